"""Geometric mean of the losses (GLS)."""

from __future__ import annotations

from typing import final

import torch
from torch import Tensor

from jacflow.scalarization._base import Scalarizer, check_non_negative


def geometric_mean(losses: Tensor) -> Tensor:
    """``exp(mean(log(losses)))``; NaN/inf propagate. One loss is its own geometric mean, with
    gradient 1 also at 0 (``exp(log(0))`` would give NaN there).

    With finite losses one of which is 0, the value is 0 and the gradient 0 for every loss:
    autograd's ``0 * inf`` (the derivative of ``log`` at 0) gave NaN to the model.

    Example:
        >>> import torch
        >>> from jacflow.scalarization._geometric_mean import geometric_mean
        >>> losses = torch.tensor([0.0, 4.0], requires_grad=True)
        >>> geometric_mean(losses).backward()
        >>> losses.grad
        tensor([0., 0.])
    """
    if losses.numel() == 1:
        return losses.reshape(())
    zero = (losses == 0) & torch.isfinite(losses).all()  # (0 with inf stays NaN: 0 * inf)
    # (the zero entries replaced by 1 inside the graph: no log(0) whose backward gives NaN)
    value = torch.exp(torch.log(torch.where(zero, 1.0, losses)).mean())
    return torch.where(zero.any(), torch.zeros_like(value), value)


@final
class GeometricMean(Scalarizer):
    r"""Geometric mean of the losses: :math:`\big(\prod_{i=1}^m L_i\big)^{1/m}`.

    Paper: S. Chennupati, G. Sistu, S. Yogamani, S. A. Rawashdeh, *MultiNet++: Multi-Stream
    Feature Aggregation and Geometric Loss Strategy for Multi-Task Learning*, CVPR Workshops 2019
    (the Geometric Loss Strategy, GLS). Its gradient is
    :math:`\frac{G}{m}\sum_i \nabla L_i / L_i`: each loss is weighted by its inverse, which makes
    the method invariant to the scale of each loss (the direction of
    ``sum(log(losses))``).

    A loss of exactly 0 makes the geometric mean 0, its smallest value: the gradient is then 0
    for every loss (the derivative along the zero loss is infinite, and autograd's ``0 * inf``
    would put NaN into the model). No task trains on such a batch; to keep the others
    training, add a small constant to the losses, e.g. ``GeometricMean()(losses + 1e-8)``.

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

    reads_losses = True

    def forward(self, losses: Tensor, /) -> Tensor:
        check_non_negative(losses, "GeometricMean", "Shift the losses or use `Mean`.")
        return geometric_mean(losses)
