# atomtool developer entry points. `make test` and `make demo` set themselves up from nothing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU machines take the local CPU build of torch; never let pip pull a multi-GB CUDA build.
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)

.PHONY: test demo lint venv clean gpu-test

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
ifneq ($(HAS_CUDA),1)
	$(BIN)/python -m pip install -q torch==2.13.0
endif
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[serve,dev]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check atomtool tests benchmarks scripts

test: $(STAMP) lint
	$(BIN)/python -m pytest

demo: $(STAMP)
	$(BIN)/atomtool demo

gpu-test:
	$(PY) scripts/run_gpu_tests.py

clean:
	rm -rf $(VENV) build *.egg-info
