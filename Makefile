# longspec: `make demo` runs the tiny three-stage pipeline, `make test` runs the test suite.
# Both create .venv from nothing (CPU PyTorch; the GPU extra is opt-in: make gpu).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
export DS_ACCELERATOR ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)

.PHONY: demo test test-fast venv gpu bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[train,dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/longspec demo

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

gpu: $(STAMP)
	$(PY) -m pip install -q -e ".[gpu]"

bench: $(STAMP)
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) longspec-demo .pytest_cache
