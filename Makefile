# Quick start: `make demo` and `make test` each work on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev
DOCSTAMP := $(VENV)/.installed-docs

.PHONY: demo test lint format bench docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

$(DOCSTAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[dev,docs]"
	touch $@

demo: $(STAMP)
	$(BIN)/python -m nnx_mpmd train $(DEMO_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -n auto $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff format --check nnx_mpmd tests examples benchmarks
	$(BIN)/ruff check nnx_mpmd tests examples benchmarks

format: $(STAMP)
	$(BIN)/ruff format nnx_mpmd tests examples benchmarks
	$(BIN)/ruff check --fix nnx_mpmd tests examples benchmarks

bench: $(STAMP)
	$(BIN)/python -m nnx_mpmd bench $(BENCH_ARGS)

docs: $(DOCSTAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) site build *.egg-info .pytest_cache runs
