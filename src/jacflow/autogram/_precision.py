"""Mixed precision: what autocast did in the forward, and how the engine's closed forms see it.

Under ``torch.autocast`` a layer's inputs and outputs (hence its output gradients) can come in a
lower precision than its parameters, and not all in one. Each recorded call notes the autocast
state of its forward; the closed forms of such a call take its tensors in the parameters' dtype
(an exact upcast), the generic rule re-runs the module under the same autocast, and every
step's own products run outside any enclosing autocast region. Calls recorded without autocast
are used as recorded, whatever their dtypes, but for float16 parameters, whose closed forms
run in float32 (the Gramian's products overflow float16's range).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from jacflow.autogram._rules import Call

AutocastState = tuple[str, torch.dtype]


def autocast_state(device_type: str) -> AutocastState | None:
    """``(device type, dtype)`` of the autocast enabled for ``device_type``, else ``None`` (also
    for a device type that has no autocast, e.g. ``meta``).

    Example:
        >>> import torch
        >>> from jacflow.autogram._precision import autocast_state
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     autocast_state("cpu")
        ('cpu', torch.bfloat16)
        >>> autocast_state("cpu") is None, autocast_state("meta") is None
        (True, True)
    """
    if not torch.amp.is_autocast_available(device_type):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return device_type, torch.get_autocast_dtype(device_type)


def without_autocast(device_type: str) -> contextlib.AbstractContextManager[object]:
    """Run the engine's products in the dtypes of their tensors, not in the lower precision of
    an enclosing autocast region."""
    if autocast_state(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def replay_autocast(call: Call) -> contextlib.AbstractContextManager[object]:
    """The autocast of ``call``'s forward, for a rule that re-runs the module."""
    if call.autocast is None:
        return contextlib.nullcontext()
    device_type, dtype = call.autocast
    return torch.autocast(device_type, dtype=dtype)


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the closed forms' products for parameters of ``dtype``: float32 for
    float16, whose range the products of a Gramian overflow (``|x|^2 > 65504`` for a Linear's
    input, however small the per-sample gradients), ``dtype`` otherwise.

    Example:
        >>> import torch
        >>> from jacflow.autogram._precision import working_dtype
        >>> working_dtype(torch.float16), working_dtype(torch.bfloat16)
        (torch.float32, torch.bfloat16)
    """
    return torch.float32 if dtype == torch.float16 else dtype


def upcast(call: Call, dtype: torch.dtype) -> None:
    """Take the floating inputs and output gradients of a call in ``dtype`` (only upwards: an
    exact conversion), in place: the parameters' dtype for a call made under autocast, the
    :func:`working_dtype` of float16 parameters."""

    def lower(value: object) -> bool:
        return (
            isinstance(value, Tensor)
            and value.dtype != dtype
            and value.is_floating_point()
            and torch.promote_types(value.dtype, dtype) == dtype
        )

    def up(value: Any) -> Any:
        return value.to(dtype) if lower(value) else value

    call.args = tuple(up(a) for a in call.args)
    call.kwargs = {name: up(value) for name, value in call.kwargs.items()}
    call.grads = [up(g) for g in call.grads]
