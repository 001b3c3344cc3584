# make run   : set up, then run the whole pipeline (dvc repro) on the embedded default data
# make test  : set up, then run the default test suite
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed

export PATH := $(BIN):$(PATH)
export DVC_NO_ANALYTICS := 1
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PYTHONUNBUFFERED := 1

.PHONY: setup run test test-slow promote lint tensorboard clean

$(STAMP): requirements.txt constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt -c constraints.txt
	@touch $(STAMP)

# A fresh clone (or an unpacked tarball) gets the git and DVC state that `dvc repro` needs.
setup: $(STAMP)
	@test -d .git || git init --quiet
	@test -d .dvc || $(BIN)/dvc init --quiet
	@$(BIN)/dvc config core.analytics false

run: setup
	$(BIN)/dvc repro
	@$(BIN)/python -m tasks.summary

test: setup
	$(BIN)/python -m pytest

test-slow: setup
	$(BIN)/python -m pytest -m slow

# Make this run's metrics the baseline that check_regression compares against.
promote: setup
	$(BIN)/python -m tasks.promote

lint: setup
	$(BIN)/ruff check tasks flows tests
	$(BIN)/ruff format --check tasks flows tests

tensorboard: setup
	$(BIN)/tensorboard --logdir runs --host 127.0.0.1

clean:
	rm -rf runs .pytest_cache
