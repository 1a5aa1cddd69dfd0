"""Whether autocast is on, for the torch versions jacflow supports."""

from __future__ import annotations

import torch


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is enabled for ``device_type`` (``"cpu"``, ``"cuda"``, ...).

    Example:
        >>> import torch
        >>> from jacflow._autocast import autocast_enabled
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     autocast_enabled("cpu")
        True
        >>> autocast_enabled("cpu")
        False
    """
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4: no device argument
        cpu = device_type == "cpu"
        return torch.is_autocast_cpu_enabled() if cpu else torch.is_autocast_enabled()
