#!/usr/bin/env bash
# The device check of an offline GPU machine, in at most 8 minutes: installs the wheel folder
# .whl/ (make gpu-wheels) into a private folder, runs the device tests (pytest -m gpu), then
# bench/gpu.py with what is left of the 8 minutes as its budget (--update-docs): generation,
# its profile, the GRPO step, and the small-step crf run if time is left for it.
#
#   bash bench/gpu_check.sh OUT [bench/gpu.py arguments]
#
# OUT receives at most 7 files: gpu-tests.log, gpu-bench.log, gpu.json, gpu.md,
# performance.md and gpu-bench.json (docs/ with the new table and the result behind it: copy
# both back into docs/) and crf-runs.tgz (the crf runs' logs and round records). With bench/gpu.py arguments the tests are skipped and the benchmark
# runs with those arguments and no budget, in at most 9.5 minutes: --phases crf,crf-small
# measures crf's share at GRPO-sized and at small steps, H = 50.
# Run from the repository's root; PYTHON (default python3) is the machine's Python with torch.
set -u
out=${1:?usage: bash bench/gpu_check.sh OUT [bench/gpu.py arguments]}
shift
mkdir -p "$out"
py=${PYTHON:-python3}
site=${GPU_SITE:-/tmp/crf-gpu-site}
total=${GPU_CHECK_S:-470}  # 8 minutes, less a margin for copying the results
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }

ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/ folder: run make gpu-wheels first"; exit 2; }
$py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" .whl/*.whl || exit 2
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
$py -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU here'" || exit 2

tests=0
if [ $# -eq 0 ]; then
  timeout 240 $py -m pytest -q -p no:cacheprovider -m gpu -rs --timeout 150 \
    tests/test_gpu_paths.py tests/test_gpu_generation.py tests/test_allreduce_device.py \
    2>&1 | tee "$out/gpu-tests.log"
  tests=${PIPESTATUS[0]}
  left=$((total - $(elapsed)))
  set -- --budget-s $((left - 15)) --phases generate,profile,grpo,crf-small --new-tokens 64 \
    --steps 3
else
  left=570  # a device command's limit is 10 minutes
fi
bench_out=$(mktemp -d)
timeout "$left" $py bench/gpu.py --out "$bench_out" --update-docs "$@" 2>&1 \
  | tee "$out/gpu-bench.log"
bench=${PIPESTATUS[0]}
cp "$bench_out"/gpu.json "$bench_out"/gpu.md "$out"/ 2>/dev/null
cp docs/performance.md docs/gpu-bench.json "$out"/ 2>/dev/null
(cd "$bench_out" && tar czf - crf-run-* 2>/dev/null) >"$out"/crf-runs.tgz
echo "gpu-check: tests exit $tests, benchmark exit $bench, $(elapsed) s in all"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
