# Quick start: `make demo` and `make test` each work on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev
DOCSTAMP := $(VENV)/.installed-docs

.PHONY: venv demo test test-fast lint typecheck format bench bench-peers docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# pip byte-compiles what it installs one file at a time; compileall does it on every
# core (a failure to compile a file is not an install failure, for pip either).
COMPILE := $(BIN)/python -m compileall -q -j 0 $(VENV)/lib || true

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --no-compile -e ".[dev]"
	$(COMPILE)
	touch $@

$(DOCSTAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --no-compile -e ".[dev,docs]"
	$(COMPILE)
	touch $@

# The virtual environment with the dev extras, as `make test` and `make lint` need it.
venv: $(STAMP)

# Compiled programs are cached in ~/.cache/nnx_mpmd/jax, so a second `make demo`
# reaches its first step sooner; DEMO_ARGS=--no-compile-cache turns that off.
demo: $(STAMP)
	$(BIN)/python -m nnx_mpmd train $(DEMO_ARGS)

# worksteal: a worker that runs out of tests takes queued ones from the other, so no
# worker idles at the end while the other still has tests queued behind a long one.
test: $(STAMP)
	$(BIN)/python -m pytest -n auto --dist worksteal $(PYTEST_ARGS)

# Unit tests of the schedules, the compiler's pieces, errors and layering: seconds,
# not minutes (no end-to-end training).
FAST_TESTS := tests/schedules/test_schedules.py tests/schedules/test_schedules_generators.py \
	tests/project/test_errors.py tests/project/test_layers.py tests/compiler/test_split_backward.py \
	tests/jit/test_bad_batch.py tests/jit/test_validation.py tests/project/test_lint.py \
	tests/placement/test_mesh.py tests/compiler/test_instructions_ir.py \
	tests/compiler/test_outer_passes.py tests/compiler/test_region_passes.py \
	tests/runtime/test_interpreter.py tests/jit/test_stages_api.py \
	tests/compiler/test_step_passes.py tests/schedules/test_schedules_contention.py
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n auto --dist worksteal $(FAST_TESTS) $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff format --check nnx_mpmd tests examples benchmarks .ci
	$(BIN)/ruff check nnx_mpmd tests examples benchmarks .ci
	$(MAKE) typecheck

# pyright (standard mode, settings in pyproject.toml) over the package, then
# --verifytypes: every symbol of the public API must have a known type
# (.ci/public_api_types.py says which do not). PYTHONPATH: pyright cannot follow the
# editable install's import hook.
typecheck: $(STAMP)
	$(BIN)/pyright --pythonpath $(BIN)/python
	PYTHONPATH=$(CURDIR) $(BIN)/pyright --pythonpath $(BIN)/python --verifytypes nnx_mpmd \
		--ignoreexternal --outputjson | $(BIN)/python .ci/public_api_types.py

format: $(STAMP)
	$(BIN)/ruff format nnx_mpmd tests examples benchmarks .ci
	$(BIN)/ruff check --fix nnx_mpmd tests examples benchmarks .ci

bench: $(STAMP)
	$(BIN)/python -m nnx_mpmd bench $(BENCH_ARGS)

# nnx_mpmd beside JaxPP (when .peers/jaxpp-venv exists; `bash ../shared/peers/setup_jaxpp.sh
# .peers/jaxpp-venv` builds it) and a hand-written jax.jit + device_put floor, alternated in
# fresh processes; PEERS_ARGS="--rows overhead,gpt --rounds 3" narrows or widens it.
bench-peers: $(STAMP)
	$(BIN)/python benchmarks/peers_bench.py $(PEERS_ARGS)

docs: $(DOCSTAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) site build *.egg-info .pytest_cache runs
