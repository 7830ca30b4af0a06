# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Everything installs into ./.venv; torch is pinned (2.14.1 with torchvision 0.29.1: the
# ordinary build, which runs on CPU here and on a GPU machine alike).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow test-all test-gpu gpu-wheels gpu-check test-slurm slurm-up slurm-down lint bench bench-smoke clean-data install

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e ".[dev,test,bench,parallel]"
	touch $(STAMP)

install: $(STAMP)

## train on the embedded synthetic scenes, then predict and score a held-out whole image
demo: $(STAMP)
	$(PY) -m seg_at_scale.cli.train $(ARGS)

## the fast test suite, in parallel (slow tests, and every command started fresh: `make test-all`);
## the modules compiled first, once: under PYTHONDONTWRITEBYTECODE each of the suite's fresh
## processes would compile the package again (0.3 s each); a failure here stops nothing.
## One worker per core and one more: the Slurm modules share a worker that mostly waits on
## its cluster (tests/conftest.py), and the others keep every core busy meanwhile.
## Under the malloc the commands preload (tcmalloc where installed; SEG_AT_SCALE_MALLOC chooses
## as for them: seg_at_scale/cli/malloc.py): the tests' forwards reuse freed memory instead of
## mapping it afresh (the smp exactness tests: 11 % less CPU here)
WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN) + 1 )))
UNDER_MALLOC := $(PY) -c 'import sys; from seg_at_scale.cli.malloc import run_under; run_under(sys.argv[1:])'
test: $(STAMP)
	-$(PY) -m compileall -q -j 0 seg_at_scale tests experiments >/dev/null
	$(UNDER_MALLOC) $(PY) -m pytest -q -n $(WORKERS) --dist loadscope --no-loadscope-reorder $(ARGS)

## the slow tests alone, in parallel as `make test` (CI runs both): long trainings, the wheel,
## the notebooks, and the start-up mechanisms each proven in fresh interpreters (malloc,
## huge pages, the collector, the suite's warm processes); no fault test is among them
test-slow: $(STAMP)
	-$(PY) -m compileall -q -j 0 seg_at_scale tests experiments >/dev/null
	$(UNDER_MALLOC) $(PY) -m pytest -q -m slow -n $(WORKERS) --dist loadscope --no-loadscope-reorder $(ARGS)

test-all: $(STAMP)
	SEG_TEST_COLD=1 $(UNDER_MALLOC) $(PY) -m pytest -q -m "" $(ARGS)

## the CUDA paths on a GPU (tests/test_gpu.py; each skips with the reason where CUDA is absent)
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu $(ARGS)

## the wheels a lent GPU machine lacks, fetched here into .whl/ and .whl-codecs/
## (tools/gpu_lent.sh installs them there, offline, then runs `make gpu-check NO_VENV=1`
## with the machine's own python)
gpu-wheels: $(STAMP)
	$(PY) tools/gpu_wheels.py

## on a lent GPU, within 8 minutes and installing nothing: make test-gpu, then the prediction,
## encoders and training sections of bench_gpu.py, into one JSON (OUT=<folder> to choose where);
## then, in at most 70 s more, torch.compile against eager on the device (bench_compile.py)
gpu-check: $(if $(NO_VENV),,$(STAMP))
	timeout 450 $(PY) experiments/bench_gpu.py --tests --tests-timeout 200 \
	    --sections prediction,encoders,train_step --out $${OUT:-experiments/results}/bench_gpu.json
	-timeout 70 $(PY) experiments/bench_compile.py --device cuda --repeats 3 \
	    --out $${OUT:-experiments/results}/bench_compile_gpu.json

## the Slurm tests alone (tests/slurm: a two-node cluster on this host; root and Debian's
## slurmctld slurmd slurm-client munge, which .ci/run installs; they skip without them)
test-slurm: $(STAMP)
	$(UNDER_MALLOC) $(PY) -m pytest -q -m slurm tests/slurm $(ARGS)

## a two-node test cluster for a person to try (export SLURM_CONF=$(CURDIR)/.slurm/slurm.conf)
slurm-up: $(STAMP)
	$(PY) tools/slurm_cluster.py up .slurm

slurm-down: $(STAMP)
	$(PY) tools/slurm_cluster.py down .slurm

lint: $(STAMP)
	$(PY) -m ruff check seg_at_scale hydra_plugins tests experiments
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

## every benchmark at full size, one after another (JSON under experiments/results/; hours;
## `experiments/bench.py list` names them, `experiments/bench.py <name>` runs one)
bench: $(STAMP)
	for b in $$($(PY) experiments/bench.py list | cut -d' ' -f1); do \
	    $(PY) experiments/bench.py $$b || exit 1; done

## each benchmark's quick smoke run (seconds each; tests/test_benchmarks.py, -m bench)
bench-smoke: $(STAMP)
	$(PY) -m pytest -q -m bench tests/test_benchmarks.py -n auto

clean-data:
	rm -rf data runs multirun outputs
