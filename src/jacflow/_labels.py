"""The short labels that ``str`` gives methods, in TorchJD's format (users' logs compare them),
and how errors name a value of the wrong type."""

from __future__ import annotations

import inspect

from torch import Tensor


def vector_label(vector: Tensor) -> str:
    """The entries of ``vector`` with two decimals, their trailing zeros dropped.

    Example:
        >>> import torch
        >>> from jacflow._labels import vector_label
        >>> vector_label(torch.tensor([0.2, 1.0, 2.345]))
        '0.2, 1., 2.35'
    """
    return ", ".join(
        format(value, ".2f").rstrip("0") for value in vector.detach().flatten().tolist()
    )


def with_vector(name: str, vector: Tensor | None) -> str:
    """``name`` followed by ``([...])`` when ``vector`` is given (a preference, a leak).

    Example:
        >>> import torch
        >>> from jacflow._labels import with_vector
        >>> with_vector("UPGrad", torch.tensor([0.2, 0.8])), with_vector("UPGrad", None)
        ('UPGrad([0.2, 0.8])', 'UPGrad')
    """
    return name if vector is None else f"{name}([{vector_label(vector)}])"


def received(value: object) -> str:
    """How an error names ``value``, received where another type was expected: its type, or for
    a class given where an instance is expected (``A=UPGrad``), the class and the call that
    makes an instance (its type alone is the metaclass, ``abc.ABCMeta``).

    Example:
        >>> from jacflow._labels import received
        >>> from jacflow.aggregation import Constant, UPGrad
        >>> received(UPGrad)
        'the class UPGrad (an instance is made by calling it: UPGrad())'
        >>> received(Constant)
        'the class Constant (an instance is made by calling it: Constant(...))'
        >>> received(3)
        "<class 'int'>"
    """
    if isinstance(value, type):
        call = f"{value.__name__}({'...' if _needs_arguments(value) else ''})"
        return f"the class {value.__name__} (an instance is made by calling it: {call})"
    return str(type(value))


def _needs_arguments(cls: type) -> bool:
    """Whether constructing ``cls`` needs an argument (``Engine(...)``, not ``UPGrad()``)."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # (a signature Python cannot read: show none)
        return False
    return any(
        p.default is p.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        for p in parameters
    )
