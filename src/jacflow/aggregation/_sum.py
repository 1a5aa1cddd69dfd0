"""Sum: the sum of the rows, i.e. gradient descent on the summed objectives."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow.aggregation._bases import (
    GramianWeightedAggregator,
    GramianWeighting,
    Weighting,
    weights_without_gramian,
)
from jacflow.aggregation._properties import Property


def _ones(matrix: Tensor) -> Tensor:
    """A weight of 1 for each row of ``matrix``, on its device and dtype."""
    return torch.ones(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)


class SumWeighting(GramianWeighting):
    """Weight ``1`` for each row; reads only the number of rows.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import SumWeighting
        >>> SumWeighting()(torch.eye(3))
        tensor([1., 1., 1.])
    """

    def _check_input(self, stat: Tensor) -> None:
        Weighting._check_input(self, stat)

    _forward_reads_size_only = True  # (the weights do not read G: scale-invariant)

    def forward(self, stat: Tensor) -> Tensor:
        return _ones(stat)


class Sum(GramianWeightedAggregator):
    """Sum of the rows of the Jacobian: ``J^T 1``.

    What ``loss.sum().backward()`` computes. Linear under scaling, permutation invariant.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import Sum
        >>> Sum()(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([2., 2., 2.])
    """

    properties = frozenset(
        {Property.LINEAR_UNDER_SCALING, Property.PERMUTATION_INVARIANT, Property.WEIGHTED}
    )

    def __init__(self) -> None:
        super().__init__(SumWeighting())

    def weights(self, matrix: Tensor) -> Tensor:
        # The weights depend only on m: no Gramian. The inherited forward is then one
        # matrix-vector product, faster than a reduction over rows.
        return weights_without_gramian(self, matrix, _ones)
