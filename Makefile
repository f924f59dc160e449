# eaglex: the two commands a fresh clone needs are `make engine` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
MODEL   ?= tiny
BACKEND ?= onnxruntime
PYTEST_ARGS ?=

.PHONY: setup test test-all engine bench lint clean help

help:            ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first: the pinned CPU build installs from local disk in seconds; anything else pulls GBs
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install eaglex with its pinned dependencies

test: $(STAMP)   ## run the test suite CI runs (slow extras skipped)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-all: $(STAMP)  ## run every test, slow ones included
	$(BIN)/python -m pytest -q -m "" $(PYTEST_ARGS)

clean:           ## remove build outputs (keeps .venv)
	rm -rf build .pytest_cache
