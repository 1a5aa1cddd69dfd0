# Sourced by the set-up scripts: create or reuse .venv and install jacflow with the given extras.
# torch==2.13.0 is installed first, explicitly, so that pip takes the CPU build from the local
# wheel cache (where pip's configuration offers one) instead of the newest torch, a multi-GB
# CUDA build on Linux, to satisfy `torch>=2.6`; elsewhere pip takes the package index's build
# of 2.13.0. A torch already in .venv is kept (the README says how to put the CPU build there).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${PIP[@]}" "torch==2.13.0"
fi
"${PIP[@]}" -e ".[${JACFLOW_EXTRAS:-}]"
