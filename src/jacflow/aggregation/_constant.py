"""Constant: fixed weights given by the user (static weighting)."""

from __future__ import annotations

from torch import Tensor

from jacflow._labels import vector_label
from jacflow.aggregation._bases import (
    GramianWeightedAggregator,
    GramianWeighting,
    Weighting,
    weights_without_gramian,
)
from jacflow.aggregation._hyperparameters import Hyperparameter, check_real_values
from jacflow.aggregation._properties import Property


def _check_weights(weights: object, name: str) -> Tensor:
    if not isinstance(weights, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, received {type(weights)}.")
    if weights.ndim != 1:
        raise ValueError(
            f"`{name}` must be a vector (1-D tensor) with one weight per objective, received "
            f"shape {tuple(weights.shape)}."
        )
    return check_real_values(weights, name)


def constant_weights(weights: Tensor, m: int, like: Tensor) -> Tensor:
    """``weights`` on ``like``'s device and dtype, checked to have ``m`` entries."""
    _check_count(weights, m)
    return weights.to(device=like.device, dtype=like.dtype)


def _check_count(weights: Tensor, m: int) -> None:
    if weights.shape[0] != m:
        raise ValueError(
            f"Constant has {weights.shape[0]} `weights` but the input has {m} rows; give one "
            "weight per objective."
        )


class ConstantWeighting(GramianWeighting):
    """The fixed ``weights``, whatever the input; reads only its number of rows.

    Accepts a Gramian or any matrix with one row per objective.

    Args:
        weights: one weight per objective (1-D tensor).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import ConstantWeighting
        >>> ConstantWeighting(torch.tensor([1., 2.]))(torch.eye(2))
        tensor([1., 2.])
    """

    weights = Hyperparameter(_check_weights)

    def __init__(self, weights: Tensor) -> None:
        super().__init__()
        self.weights = weights

    def _check_input(self, stat: Tensor) -> None:
        Weighting._check_input(self, stat)

    _forward_reads_size_only = True  # (the weights do not read G: scale-invariant)

    def check_rows(self, m: int) -> None:
        _check_count(self.weights, m)

    def forward(self, stat: Tensor) -> Tensor:
        return constant_weights(self.weights, stat.shape[0], stat)

    def extra_repr(self) -> str:
        return f"weights={self.weights!r}"

    def __str__(self) -> str:
        return f"ConstantWeighting({self.weights.tolist()})"


class Constant(GramianWeightedAggregator):
    r"""Linear combination of the rows with fixed weights: :math:`A(J) = J^\top w`.

    The static weighting of multi-task learning; a one-hot ``weights`` gives single-task
    learning. Linear under scaling; not permutation invariant (the weights follow the rows'
    order). The number of rows must equal the number of weights.

    Args:
        weights: one weight per objective (1-D tensor).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import Constant
        >>> Constant(torch.tensor([1., 2.]))(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([8., 3., 3.])
    """

    properties = frozenset({Property.LINEAR_UNDER_SCALING, Property.WEIGHTED})

    def __init__(self, weights: Tensor) -> None:
        super().__init__(ConstantWeighting(weights))

    def weights(self, matrix: Tensor) -> Tensor:
        return weights_without_gramian(self, matrix)  # (only m is read: skip the Gramian)

    def extra_repr(self) -> str:
        return self.gramian_weighting.extra_repr()

    def __str__(self) -> str:
        weighting = self.gramian_weighting
        assert isinstance(weighting, ConstantWeighting)
        return f"Constant([{vector_label(weighting.weights)}])"
