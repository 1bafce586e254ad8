# meshwork: `make train` and `make test` each create .venv when missing, install the project, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_DIR ?= runs/make-train
STEPS ?= 150
ARGS ?=
PYTEST_ARGS ?=

.PHONY: train test dry-run clean-venv

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

## train: the default small model on the stdlib corpus over 8 simulated CPU devices; resumes if run again
train: $(VENV)/.installed
	$(PY) -m train.train --cpu-devices 8 --run-dir $(RUN_DIR) --steps $(STEPS) --resume $(ARGS)

## test: the whole test suite (8 simulated CPU devices)
test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS)

## dry-run: the sharding, memory and collectives report of the 7B model on fsdp=8
dry-run: $(VENV)/.installed
	$(PY) -m train.train --cpu-devices 8 --model 7b --mesh fsdp=8 --batch-size 8 --seq-len 2048 --dry-run $(ARGS)

clean-venv:
	rm -rf $(VENV)
