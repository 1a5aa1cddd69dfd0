"""Import of optional dependencies with an error that says how to install them."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise an ``ImportError`` naming the extra that provides it.

    Example:
        >>> from jacflow.monitor._optional import require
        >>> require("json", "none", "the example").__name__
        'json'
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{purpose} needs the optional dependency `{module.split('.')[0]}`, which is not "
            f'installed. Install it with: pip install "jacflow[{extra}]"'
        ) from error
