#!/usr/bin/env bash
# The main job: train a multi-task network on the bundled digits data with Jacobian descent.
# Extra arguments are passed to `jacflow train` (see `jacflow train --help`).
JACFLOW_EXTRAS=cli source "$(dirname "$0")/_venv.sh"
exec .venv/bin/jacflow train "$@"
