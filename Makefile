# Two commands do everything on a fresh machine (README.md):
#   make parity   -- the main job: python -m parity.check
#   make test     -- the CPU test suite's fast tier (kernels through the Pallas and Triton interpreters)
#   make test-slow -- its slow tier (larger interpreted cases); CI (.ci/run) runs both
# The first use creates .venv with the tested, pinned set of requirements/cpu.lock (pip
# constraints: every package at the exact version CPU CI was tested with). torch is installed
# first, alone: the lock pins the 2.13.0 CPU build, so no multi-GB CUDA build is downloaded.
# Where no local wheel or index serves torch's CPU build, add PyTorch's CPU index:
#   make PIP_TORCH_ARGS='--extra-index-url https://download.pytorch.org/whl/cpu'
# On the GPU machine (packages preinstalled, no network; nothing is installed there):
#   make test-gpu -- compiled kernels at realistic shapes (pytest -m gpu)
#   make bench    -- the benchmarks (benchmarks/*.py; JSON results in benchmarks/results)
# (scripts/run_gpu_checks.sh runs the GPU tests, parity and the benchmarks, in parallel where they fit.)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCK := requirements/cpu.lock
PIP_TORCH_ARGS ?=
BENCH_OUT ?= benchmarks/results

.PHONY: parity test test-slow test-gpu bench clean

$(STAMP): pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c $(LOCK) $(PIP_TORCH_ARGS) torch
	$(BIN)/pip install -q -c $(LOCK) -e '.[torch,parity,test]'
	touch $(STAMP)

parity: $(STAMP)
	$(BIN)/python -m parity.check $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -m "not gpu and not slow" $(ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -n 2 -m "slow and not gpu" $(ARGS)

# GPU machine: the system Python with its preinstalled packages, no .venv
test-gpu:
	PYTHONPATH=. $(PY) -m pytest -m gpu tests $(ARGS)

bench:
	PYTHONPATH=. $(PY) benchmarks/softmax.py --out $(BENCH_OUT)
	PYTHONPATH=. $(PY) benchmarks/rope.py --out $(BENCH_OUT)
	PYTHONPATH=. $(PY) benchmarks/stick_breaking.py --out $(BENCH_OUT)

clean:
	rm -rf $(VENV)
