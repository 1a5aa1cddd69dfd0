"""The short labels that ``str`` gives methods, in TorchJD's format (users' logs compare them)."""

from __future__ import annotations

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
