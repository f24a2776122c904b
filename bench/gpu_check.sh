#!/usr/bin/env bash
# The device check of an offline GPU machine, in at most 8 minutes: installs the wheel folder
# .whl/ (make gpu-wheels) into a private folder, runs the device tests (pytest -m gpu), then
# bench/gpu.py with what is left of the 8 minutes as its budget (--update-docs): crf's share
# at GRPO-sized steps with Streaming DiLoCo at the largest H that fits, then vanilla DiLoCo
# at the same steps, the small-step crf run and the GRPO step if time is left for them.
#
#   bash bench/gpu_check.sh OUT [bench/gpu.py arguments]
#
# OUT receives at most 7 files, each written as soon as it is known (a check cut at a time
# limit keeps what it measured): gpu-tests.log, gpu-bench.log, gpu.json and gpu.md (written
# again after each phase), performance.md and gpu-bench.json (docs/ with the new table and
# the result behind it: copy both back into docs/) and crf-runs.tgz (the crf runs' logs and
# round records). With bench/gpu.py arguments the tests are skipped and the benchmark runs
# with those arguments, its budget what is left of GPU_CHECK_S: GPU_CHECK_S=570 and
# --phases crf,generate,grpo,crf-small measure crf's share with vanilla DiLoCo, generation,
# the GRPO step and crf's share at small steps.
#
# Environment: PYTHON (default python3: the machine's Python with torch), GPU_CHECK_S (the
# seconds the whole check may take, default 470: 8 minutes less a margin for copying the
# results), GPU_TESTS_S (the tests' share, default 200), GPU_PHASES (the benchmark's phases
# after the tests, default crf-stream,crf,crf-small,grpo), CRF_COMMIT (the commit the table
# names, where the machine's copy of the tree has another .git). Run from the repository's root.
set -u
out=${1:?usage: bash bench/gpu_check.sh OUT [bench/gpu.py arguments]}
shift
mkdir -p "$out"
py=${PYTHON:-python3}
site=${GPU_SITE:-/tmp/crf-gpu-site}
total=${GPU_CHECK_S:-470}
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }

ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/ folder: run make gpu-wheels first"; exit 2; }
$py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" .whl/*.whl || exit 2
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
$py -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU here'" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null

tests=0
if [ $# -eq 0 ]; then
  # the cases are independent processes with tiny models: 4 at a time (xdist, from .whl)
  workers=$($py -c "import xdist" 2>/dev/null && echo "-n 4")
  # every test file with a device case (a gpu mark, or the CPU/CUDA list of tests/conftest.py)
  files=$(grep -l "pytest.mark.gpu\|DEVICES" tests/test_*.py)
  timeout "${GPU_TESTS_S:-200}" $py -m pytest -q -p no:cacheprovider -m gpu -rs \
    --timeout 150 $workers --durations 10 $files 2>&1 | tee "$out/gpu-tests.log"
  tests=${PIPESTATUS[0]}
  echo "gpu-check: tests exit $tests after $(elapsed) s"
  set -- --phases "${GPU_PHASES:-crf-stream,crf,crf-small,grpo}" --new-tokens 64 --steps 3 \
    --budget-s $((total - $(elapsed) - 25))
else
  set -- --budget-s $((total - $(elapsed) - 25)) "$@"  # a --budget-s given here comes later: it wins
fi
left=$((total - $(elapsed) - 10))
logs=$(mktemp -d)
timeout "$left" $py bench/gpu.py --out "$out" --logs "$logs" --update-docs "$@" 2>&1 \
  | tee "$out/gpu-bench.log"
bench=${PIPESTATUS[0]}
cp docs/performance.md docs/gpu-bench.json "$out"/ 2>/dev/null
(cd "$logs" && tar czf - crf-run-* 2>/dev/null) >"$out"/crf-runs.tgz
echo "gpu-check: tests exit $tests, benchmark exit $bench, $(elapsed) s in all"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
