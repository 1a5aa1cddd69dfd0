"""Mean: the average of the rows, i.e. gradient descent on the average objective."""

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


def mean_weights(m: int, like: Tensor) -> Tensor:
    """``[1/m] * m`` on ``like``'s device and dtype (empty when ``m = 0``)."""
    return torch.full((m,), 1.0 / max(m, 1), dtype=like.dtype, device=like.device)


class MeanWeighting(GramianWeighting):
    """Weights ``1/m`` for each of the ``m`` rows; reads only the number of rows.

    Accepts a Gramian or (through :class:`Weighting` semantics) any square statistic.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import MeanWeighting
        >>> MeanWeighting()(torch.eye(2))
        tensor([0.5000, 0.5000])
    """

    def _check_input(self, stat: Tensor) -> None:
        Weighting._check_input(self, stat)

    _forward_reads_size_only = True  # (the weights do not read G: scale-invariant)

    def forward(self, stat: Tensor) -> Tensor:
        return mean_weights(stat.shape[0], stat)


class Mean(GramianWeightedAggregator):
    """Average of the rows of the Jacobian: ``J^T 1 / m``.

    Equivalent to ordinary gradient descent on the mean of the objectives. Linear under
    scaling, permutation invariant, not conflict-free.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import Mean
        >>> Mean()(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([1., 1., 1.])
    """

    properties = frozenset(
        {Property.LINEAR_UNDER_SCALING, Property.PERMUTATION_INVARIANT, Property.WEIGHTED}
    )

    def __init__(self) -> None:
        super().__init__(MeanWeighting())

    def weights(self, matrix: Tensor) -> Tensor:
        # The weights depend only on m: no Gramian. The inherited forward is then one
        # matrix-vector product, faster than a reduction over rows.
        return weights_without_gramian(self, matrix, lambda J: mean_weights(J.shape[0], J))
