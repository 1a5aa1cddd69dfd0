"""Sum: linear scalarization with unit weights."""

from __future__ import annotations

from typing import final

from torch import Tensor

from jacflow.scalarization._base import Scalarizer


@final
class Sum(Scalarizer):
    r"""The sum of the losses, :math:`\sum_i L_i`.

    Also the "unitary scalarization" of Kurin et al. (*In Defense of the Unitary Scalarization
    for Deep Multi-Task Learning*, NeurIPS 2022). Stateless, with no hyper-parameter.

    Example:
        >>> import torch
        >>> from jacflow.scalarization import Sum
        >>> Sum()(torch.tensor([1.0, 2.0, 6.0]))
        tensor(9.)
    """

    def forward(self, losses: Tensor, /) -> Tensor:
        return losses.sum()
