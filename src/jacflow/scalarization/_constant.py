"""Constant: linear scalarization with fixed, user-given weights."""

from __future__ import annotations

from typing import final

from torch import Tensor

from jacflow._labels import vector_label
from jacflow.scalarization._base import Scalarizer, check_tensor, matching


def weighted_sum(losses: Tensor, weights: Tensor) -> Tensor:
    """``sum(weights * losses)`` for two tensors of the same shape."""
    return (weights * losses).sum()


@final
class Constant(Scalarizer):
    r"""Linear scalarization with fixed weights: :math:`\sum_i w_i L_i`.

    A one-hot ``weights`` gives single-task learning (STL) on one of the losses.

    Args:
        weights: one weight per loss; must have the shape of the losses passed at call time.
            It is moved to the losses' device and dtype on each call.

    Example:
        >>> import torch
        >>> from jacflow.scalarization import Constant
        >>> Constant(torch.tensor([1.0, 0.5]))(torch.tensor([2.0, 4.0]))
        tensor(4.)
    """

    def __init__(self, weights: Tensor) -> None:
        super().__init__()
        self.weights = check_tensor(weights, "weights", "Constant")

    def forward(self, losses: Tensor, /) -> Tensor:
        return weighted_sum(losses, matching(self.weights, "weights", losses, "Constant"))

    def __str__(self) -> str:
        return f"Constant([{vector_label(self.weights)}])"

    def extra_repr(self) -> str:
        return f"weights={self.weights!r}"
