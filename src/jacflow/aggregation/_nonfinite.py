"""Propagation of NaN/inf inputs to the weights of methods whose solvers would hide them."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow.linalg._gramian import has_nonfinite

__all__ = ["has_nonfinite", "nan_weights", "propagate_nonfinite"]


def nan_weights(m: int, like: Tensor) -> Tensor:
    """``m`` NaN weights on ``like``'s device and dtype: the answer to a non-finite input.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._nonfinite import nan_weights
        >>> nan_weights(2, torch.zeros(1))
        tensor([nan, nan])
    """
    return torch.full((m,), float("nan"), dtype=like.dtype, device=like.device)


def propagate_nonfinite(weights: Tensor, stat: Tensor) -> Tensor:
    """``weights``, or all NaN when ``stat`` holds a NaN or an infinity (no host sync).

    Iterative solvers turn a NaN input into finite weights (every comparison with NaN is
    false); this puts the NaN back so that it reaches the update.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._nonfinite import propagate_nonfinite
        >>> propagate_nonfinite(torch.tensor([0.5, 0.5]), torch.tensor([[1.0, float("inf")]]))
        tensor([nan, nan])
    """
    finite = torch.isfinite(stat).all()
    return torch.where(finite, weights, torch.full_like(weights, float("nan")))
