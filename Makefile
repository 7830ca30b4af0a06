# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Everything installs into ./.venv; torch is pinned (2.13.0: this project's CPU machines
# take a local CPU wheel, a GPU machine gets the ordinary CUDA build of the same version).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all test-gpu lint bench clean-data install

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,test,bench,parallel]"
	touch $(STAMP)

install: $(STAMP)

## train on the embedded synthetic scenes, then predict and score a held-out whole image
demo: $(STAMP)
	$(PY) -m seg_at_scale.cli.train $(ARGS)

## the fast test suite (slow tests: `make test-all`)
test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m "" $(ARGS)

## the CUDA paths on a GPU (tests/test_gpu.py; each skips with the reason where CUDA is absent)
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check seg_at_scale hydra_plugins tests experiments

## benchmark scripts (JSON under experiments/results/)
bench: $(STAMP)
	for b in experiments/bench_*.py; do $(PY) $$b || exit 1; done

clean-data:
	rm -rf data runs multirun outputs
