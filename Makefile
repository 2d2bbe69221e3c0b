# Each target bootstraps .venv on a fresh machine, then runs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch on machines without CUDA; the default (CUDA) build otherwise.
TORCH_PIN := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0")

.PHONY: test test-fast demo bench venv clean

venv: $(STAMP)

$(STAMP): setup.py
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[dev]"
	# sglang's request types and argument parser, for tests/contract/; --no-deps because its
	# requirements pin a CUDA torch (setup.py's [dev] holds what it imports on CPU)
	$(BIN)/pip install -q --no-deps sglang==0.5.23
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

demo: $(STAMP)
	$(BIN)/moe-rl train --config launch/configs/tiny_cpu.yaml

bench: $(STAMP)
	$(BIN)/python tools/bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
