"""``python -m jacflow.cli``: the ``jacflow`` command."""

import sys

from jacflow.cli import main

if __name__ == "__main__":
    sys.exit(main())
