# Two commands a new user needs: `make demo` (the main job on the embedded default) and `make test`.
# Each sets itself up: a venv in .venv, every install step pinned by constraints.txt so that no step
# can resolve a torch other than the local 2.13.0 CPU wheel.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PIN    := -c constraints.txt
STAMP  := $(VENV)/.installed
# pytest-xdist workers of `make test`; each test file is one unit of work (tests/conftest.py's scheduler).
# 3 on CI's 2 cores: the suite waits (signals, timeouts, engines starting) about as much as it computes. On
# this machine, -n 2 kept 1.35 cores busy and took 740 s; -n 3 kept 1.73 busy and took 623 s (700 s beside
# an audit's probes). The suite's own processes (ranks, engines) fill more cores on a larger machine.
TEST_WORKERS ?= 3
XDIST  := -n $(TEST_WORKERS) --no-loadscope-reorder

.PHONY: install demo test test-all bench lint clean cluster-envs gpu-check gpu-wheels

install: $(STAMP)

$(STAMP): pyproject.toml setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(PIN) torch==2.13.0
	$(PIP) install -q $(PIN) -e '.[test,sglang-cpu]'
	# sglang's own dependency list pins a CUDA torch: install the package alone (see pyproject's sglang-cpu).
	$(PIP) install -q $(PIN) --no-deps sglang==0.5.23
	touch $(STAMP)

demo: install
	$(VENV)/bin/megatron-tail demo

test: install
	$(PY) -m pytest -q -m "not slow" $(XDIST)

test-all: install
	$(PY) -m pytest -q $(XDIST)

bench: install
	$(PY) -m megatron_tail.bench.op

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# A GPU cluster: the trainer's .venv (CUDA torch, Transformer Engine) and SGLang's .venv-sglang, each with
# its own constraints file (constraints-gpu.txt, constraints-sglang.txt); slurm/rl.sbatch uses both.
cluster-envs:
	bash scripts/setup_envs.sh

# A GPU node, bare but for CUDA torch, transformers, safetensors and tensorboard (docs/operations.md,
# "Checking a GPU node"): `make gpu-wheels` where the registry is reachable (GPU_PYTHON_VERSION: the node's
# Python), copy wheels/gpu_check to the node, then `make gpu-check` there (no venv, no network).
GPU_PYTHON_VERSION ?= 3.12

gpu-wheels:
	bash scripts/gpu_check.sh --download --python-version $(GPU_PYTHON_VERSION)

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .gpu_check
