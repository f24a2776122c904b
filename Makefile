# Two commands do all the set-up on a fresh machine (see README.md):
#   make demo   -> the embedded default run: 4 local replicas, no credentials, no downloads;
#                  installs crf and its runtime requirements only (`pip install -e .`)
#   make test   -> lint + the whole test suite (what .ci/run calls); installs the `dev` extra
#                  too (pytest, ruff, the loopback S3/GCS servers, the cloud SDKs, trackers)
# torch is installed first and pinned (2.13.0), from PyTorch's CPU wheel index when it answers:
# on Linux a bare `torch` from PyPI is the multi-GB CUDA build. Where that index cannot be
# reached (an offline mirror, a proxy) torch comes from pip's configured index, and the install
# says so. TORCH=... picks another torch (e.g. a CUDA build on a GPU machine), TORCH_INDEX=...
# another index (empty: pip's own).

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
TORCH  ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_STAMP   = $(VENV)/.crf-torch
RUNTIME_STAMP = $(VENV)/.crf-runtime
DEV_STAMP     = $(VENV)/.crf-dev

# The pip arguments that choose torch's index: PyTorch's CPU index on Linux when it answers
# within 10 s, else none (pip's configured index). macOS and Windows wheels on PyPI
# are CPU builds already.
TORCH_INDEX_ARGS = if [ -n "$(TORCH_INDEX)" ] && [ "$$(uname -s)" = Linux ] && $(PYTHON) -c \
    "import urllib.request as u; u.urlopen('$(TORCH_INDEX)/torch/', timeout=10).close()" \
    2>/dev/null; then echo "--index-url $(TORCH_INDEX)"; fi

.PHONY: install install-dev demo test test-newest test-verl constraints lint bench gpu-wheels \
  gpu-check clean torch-index-args

$(TORCH_STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@index="$$($(TORCH_INDEX_ARGS))"; \
	case "$$index" in \
	  --index-url*) echo "installing $(TORCH): the CPU build, from $(TORCH_INDEX)";; \
	  *) echo "installing $(TORCH) from pip's configured index ($(TORCH_INDEX) did not answer;" \
	          "on Linux x86_64 PyPI's torch is the CUDA build: set TORCH_INDEX or TORCH)";; \
	esac; \
	$(BIN)/python -m pip install -q $$index "$(TORCH)"
	touch $(TORCH_STAMP)

# crf and what it needs at run time: what `make demo` runs with
$(RUNTIME_STAMP): pyproject.toml $(TORCH_STAMP)
	$(BIN)/python -m pip install -q -e .
	touch $(RUNTIME_STAMP)

# ... plus the `dev` extra: what lint, the tests and the benchmarks need (a superset)
$(DEV_STAMP): pyproject.toml $(TORCH_STAMP)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(DEV_STAMP) $(RUNTIME_STAMP)

install: $(RUNTIME_STAMP)

install-dev: $(DEV_STAMP)

demo: $(RUNTIME_STAMP)
	$(BIN)/crf launch --backend local --replicas 4

lint: $(DEV_STAMP)
	$(BIN)/ruff check crf tests bench examples
	$(BIN)/ruff format --check crf tests bench examples

# Two workers: most of the suite's time is replica processes waiting on deadlines and on each
# other, so two workers on two cores halve the wall time; every test must pass on a loaded
# machine anyway. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider --timeout 600 -n $(TEST_WORKERS)

# The suite on the newest releases crf accepts (pyproject's ranges, no constraints), in a
# venv of its own so that .venv keeps the set CI tests.
NEWEST_VENV ?= .venv-newest

test-newest:
	$(MAKE) test VENV=$(NEWEST_VENV)

# The exact set an environment was tested with (constraints/ci.txt): `pip freeze` of VENV,
# crf itself and torch's local build tag left out, for `pip install -c constraints/ci.txt`.
constraints: $(DEV_STAMP)
	$(BIN)/python -m pip freeze --exclude-editable | grep -v -i '^composer-replication' \
	  | sed 's/+cpu$$//' > constraints/ci.txt
	@wc -l < constraints/ci.txt

# verl's adapter against the real verl 0.9.1, in a second venv (verl needs transformers<5.11
# and Ray): tests/test_integrations_verl_real.py, with the stand-in tests beside it. verl's
# trainer module also imports cachetools, fastapi and uvicorn, which verl does not declare.
VERL_VENV ?= .venv-verl
VERL_STAMP = $(VERL_VENV)/.crf-verl

$(VERL_STAMP): pyproject.toml
	$(MAKE) $(VERL_VENV)/.crf-torch VENV=$(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q -e . "verl==0.9.1" cachetools fastapi uvicorn \
	  "pytest>=8" "pytest-timeout>=2.3"
	touch $(VERL_STAMP)

test-verl: $(VERL_STAMP)
	$(VERL_VENV)/bin/python -m pytest -q -p no:cacheprovider --timeout 600 \
	  tests/test_integrations_verl_real.py tests/test_integrations_verl.py

bench: $(DEV_STAMP)
	$(BIN)/python bench/exchange.py

# bench/gpu.py and the device tests on an offline GPU machine (Python 3.12, with torch,
# transformers, accelerate, safetensors): .whl/ holds, as cp312 x86-64
# wheels at this venv's versions, what such a machine lacks or has at another version (about
# 21 MB; a device call carries at most 64 MiB). bench/gpu_check.sh installs it there.
GPU_WHEELS = trl torchft-nightly transformers peft datasets dill multiprocess protobuf \
  pytest pytest-timeout pluggy iniconfig pygments \
  opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto \
  opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common \
  opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common \
  googleapis-common-protos
GPU_PLATFORMS = $(foreach n,17 24 27 28 31 34 35,--platform manylinux_2_$(n)_x86_64) \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64

gpu-wheels: $(RUNTIME_STAMP)
	rm -rf .whl
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp $(GPU_PLATFORMS) -d .whl $$($(BIN)/python -c \
	  "import importlib.metadata as m; print(' '.join(f'{n}=={m.version(n)}' for n in '$(GPU_WHEELS)'.split()))")
	@du -sh .whl

# On a GPU machine, from the repository's root, with .whl/ there: the device tests
# (pytest -m gpu) then bench/gpu.py, in at most 8 minutes; results and logs in GPU_OUT.
GPU_OUT ?= gpu-out
gpu-check:
	PYTHON=$(PYTHON) bash bench/gpu_check.sh $(GPU_OUT)

torch-index-args:
	@$(TORCH_INDEX_ARGS)

clean:
	rm -rf $(VENV) $(NEWEST_VENV) $(VERL_VENV) crf-runs .pytest_cache
