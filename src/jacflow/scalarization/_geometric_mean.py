"""Geometric mean of the losses (GLS)."""

from __future__ import annotations

from typing import final

import torch
from torch import Tensor

from jacflow.scalarization._base import Scalarizer, check_non_negative


def geometric_mean(losses: Tensor) -> Tensor:
    """``exp(mean(log(losses)))``; zero if a loss is zero, NaN/inf propagate. One loss is its
    own geometric mean, with gradient 1 also at 0 (``exp(log(0))`` would give NaN there)."""
    if losses.numel() == 1:
        return losses.reshape(())
    return torch.exp(torch.log(losses).mean())


@final
class GeometricMean(Scalarizer):
    r"""Geometric mean of the losses: :math:`\big(\prod_{i=1}^m L_i\big)^{1/m}`.

    Paper: S. Chennupati, G. Sistu, S. Yogamani, S. A. Rawashdeh, *MultiNet++: Multi-Stream
    Feature Aggregation and Geometric Loss Strategy for Multi-Task Learning*, CVPR Workshops 2019
    (the Geometric Loss Strategy, GLS). Its gradient is
    :math:`\frac{G}{m}\sum_i \nabla L_i / L_i`: each loss is weighted by its inverse, which makes
    the method invariant to the scale of each loss (the direction of
    ``sum(log(losses))``).

    Raises:
        ValueError: when a loss is negative (the geometric mean is defined for non-negative
            values only). A NaN or infinite loss (``-inf`` included) gives a non-finite
            value.

    Example:
        >>> import torch
        >>> from jacflow.scalarization import GeometricMean
        >>> GeometricMean()(torch.tensor([1.0, 4.0, 16.0]))
        tensor(4.)
    """

    def forward(self, losses: Tensor, /) -> Tensor:
        check_non_negative(losses, "GeometricMean", "Shift the losses or use `Mean`.")
        return geometric_mean(losses)
