# Each target bootstraps .venv on a fresh machine, then runs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-fast demo bench docs venv clean

venv: $(STAMP)

$(STAMP): setup.py
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CUDA build with a GPU; without one the CPU build from PyTorch's CPU index (TORCH_CPU_INDEX)
	# when it answers within 3 s, else the default index: tools/install_torch.py says which, and why
	$(BIN)/python tools/install_torch.py -- -q
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
	@echo "moe-rl and its python are in .venv: source .venv/bin/activate to run the commands above"

bench: $(STAMP)
	$(BIN)/python tools/bench/run_all.py

# the manual (docs/, mkdocs.yml) as a site in site/; --strict: a broken link or a page outside the nav fails
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	@echo "open site/index.html"

clean:
	rm -rf $(VENV) build site *.egg-info
