# meshwork: `make train`, `make test` and `make test-fast` each create .venv when missing, install the
# project, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_DIR ?= runs/make-train
STEPS ?= 150
ARGS ?=
PYTEST_ARGS ?=
# Two pytest workers, each a module at a time (module fixtures stay shared): compiling is mostly one thread.
WORKERS ?= 2
XDIST := $(if $(filter-out 0 1,$(WORKERS)),-n $(WORKERS) --dist loadfile)

.PHONY: train test test-fast lint dry-run clean-venv

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

## train: the default small model on the stdlib corpus over 8 simulated CPU devices; resumes if run again
train: $(VENV)/.installed
	$(PY) -m train.train --cpu-devices 8 --run-dir $(RUN_DIR) --steps $(STEPS) --resume $(ARGS)

## test: the whole test suite (8 simulated CPU devices)
test: $(VENV)/.installed
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

## test-fast: the suite without the multi-process and kill/signal tests (marked slow)
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS)

## lint: ruff's checks and formatting (as CI runs them)
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

## dry-run: the sharding, memory and collectives report of the 7B model on fsdp=8, checked against 80 GiB devices
dry-run: $(VENV)/.installed
	$(PY) -m train.train --cpu-devices 8 --model 7b --mesh fsdp=8 --batch-size 8 --seq-len 2048 --device-memory 80GiB --dry-run $(ARGS)

clean-venv:
	rm -rf $(VENV)
