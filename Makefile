# Two commands do everything on a fresh machine (README.md):
#   make parity   -- the main job: python -m parity.check
#   make test     -- the CPU test suite (kernels through the Pallas and Triton interpreters)
# The first use creates .venv. torch is pinned to the 2.13.0 CPU build first, so that the
# project's range (torch>=2.11,<2.14) is already satisfied and no CUDA build is downloaded.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: parity test test-gpu bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[torch,parity,test]'
	touch $(STAMP)

parity: $(STAMP)
	$(BIN)/python -m parity.check $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -m "not gpu" $(ARGS)

clean:
	rm -rf $(VENV)
