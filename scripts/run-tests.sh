#!/usr/bin/env bash
# The test command: lint, format check, type check, then the test suite (doctests, docs build
# and every documented example included). Extra arguments are passed to pytest.
JACFLOW_EXTRAS=test,cli,docs,integrations source "$(dirname "$0")/_venv.sh"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/mypy
.venv/bin/pytest -q "$@"
