"""The error type of the command line: printed as one message, exit code 2."""

from __future__ import annotations


class CLIError(Exception):
    """A user error (bad name, bad folder, missing extra) reported with exit code 2.

    Example:
        >>> from jacflow.cli._errors import CLIError
        >>> str(CLIError("unknown aggregator 'foo'"))
        "unknown aggregator 'foo'"
    """
