#!/usr/bin/env bash
# The test suite on another torch release, e.g. the declared lower bound (pyproject.toml):
#   bash scripts/test-torch.sh 2.6.0 [pytest arguments]
# It makes a virtual environment of its own, .venv-torch-VERSION, installs that torch from the
# package index (on Linux a CUDA build: several GB the first time), jacflow and its test extras,
# then runs pytest over tests and src. Lint and type checks stay with scripts/run-tests.sh.
set -euo pipefail
VERSION="${1:?usage: bash scripts/test-torch.sh TORCH_VERSION [pytest arguments]}"
shift
cd "$(dirname "$0")/.."
VENV=".venv-torch-$VERSION"
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" "torch==$VERSION"
"${PIP[@]}" -e ".[test,cli]"
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__)"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
