# Two commands do all the set-up on a fresh machine (see README.md):
#   make demo   -> the embedded default run: 4 local replicas, no credentials, no downloads
#   make test   -> lint + the whole test suite (what .ci/run calls)
# torch is installed first and pinned (2.13.0, the CPU build on this kind of machine): a bare
# `torch` requirement would let pip pull a multi-GB CUDA build.

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
TORCH  ?= torch==2.13.0
STAMP   = $(VENV)/.crf-installed

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/crf launch --backend local --replicas 4

lint: $(STAMP)
	$(BIN)/ruff check crf tests bench examples

# Two workers: most of the suite's time is replica processes waiting on deadlines and on each
# other, so two workers on two cores halve the wall time; every test must pass on a loaded
# machine anyway. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider --timeout 600 -n $(TEST_WORKERS)

bench: $(STAMP)
	$(BIN)/python bench/exchange.py

clean:
	rm -rf $(VENV) crf-runs .pytest_cache
