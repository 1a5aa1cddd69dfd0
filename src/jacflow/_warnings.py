"""Where jacflow's warnings point: at the user's code, past jacflow's and torch's frames."""

from __future__ import annotations

import sys


def caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning of the function calling this one at the first
    frame outside jacflow and torch: the user's call, whatever route led there (the host or
    the device, an aggregator's module call, a module's forward hook).

    Example:
        >>> from jacflow._warnings import caller_stacklevel
        >>> caller_stacklevel() >= 1
        True
    """
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module.partition(".")[0] not in ("jacflow", "torch"):
            break
        frame, level = frame.f_back, level + 1
    return level
