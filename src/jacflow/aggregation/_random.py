"""Random: random loss weighting (Lin et al., 2022)."""

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


def random_weights(m: int, like: Tensor) -> Tensor:
    """``softmax(z)`` for ``z ~ N(0, I_m)`` drawn from torch's global RNG of ``like``'s device."""
    z = torch.randn(m, device=like.device, dtype=like.dtype)
    return torch.softmax(z, dim=0)


class RandomWeighting(GramianWeighting):
    """Fresh random weights on the simplex at every call; reads only the number of rows.

    Random loss weighting of Lin, Ye, Zhang & Tsang, *Reasonable Effectiveness of Random
    Weighting*, TMLR 2022.

    Args: none. The weights are ``softmax`` of a standard normal vector drawn from torch's
    global random number generator (seed it with ``torch.manual_seed``).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import RandomWeighting
        >>> _ = torch.manual_seed(0)
        >>> RandomWeighting()(torch.eye(3))
        tensor([0.8446, 0.1349, 0.0205])
    """

    def _check_input(self, stat: Tensor) -> None:
        Weighting._check_input(self, stat)

    _forward_reads_size_only = True  # (the weights do not read G: scale-invariant)

    def forward(self, stat: Tensor) -> Tensor:
        return random_weights(stat.shape[0], stat)


class Random(GramianWeightedAggregator):
    r"""Random weighting (RLW / RGW).

    Lin, Ye, Zhang & Tsang, *Reasonable Effectiveness of Random Weighting: A Litmus Test for
    Multi-Task Learning*, TMLR 2022 (arXiv 2111.10603). At every call

    .. math:: A(J) = J^\top \operatorname{softmax}(z), \qquad z \sim \mathcal N(0, I_m).

    For a fixed draw of :math:`z` it is linear under scaling; it is not permutation invariant
    (the draw is attached to row positions). Seed with ``torch.manual_seed``.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import Random
        >>> _ = torch.manual_seed(0)
        >>> Random()(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([-2.6229,  1.0000,  1.0000])
    """

    properties = frozenset({Property.LINEAR_UNDER_SCALING, Property.WEIGHTED})

    def __init__(self) -> None:
        super().__init__(RandomWeighting())

    def weights(self, matrix: Tensor) -> Tensor:
        return weights_without_gramian(self, matrix)  # (only m is read: skip the Gramian)
