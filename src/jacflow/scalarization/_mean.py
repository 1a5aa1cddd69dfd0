"""Mean: the equal-weight average of the losses."""

from __future__ import annotations

from typing import final

from torch import Tensor

from jacflow.scalarization._base import Scalarizer


@final
class Mean(Scalarizer):
    r"""The average of the losses, :math:`\frac{1}{m}\sum_i L_i` (equal weighting, EW).

    The baseline of every multi-task paper; stateless, with no hyper-parameter.

    Example:
        >>> import torch
        >>> from jacflow.scalarization import Mean
        >>> Mean()(torch.tensor([[1.0, 2.0], [3.0, 6.0]]))
        tensor(3.)
    """

    def forward(self, losses: Tensor, /) -> Tensor:
        return losses.mean()
