"""Random loss weighting (RLW)."""

from __future__ import annotations

from typing import final

import torch
from torch import Tensor

from jacflow.scalarization._base import Scalarizer


def random_weights(like: Tensor) -> Tensor:
    """Fresh weights ``softmax(randn)`` of ``like``'s shape, device and dtype (they sum to 1)."""
    logits = torch.randn(like.numel(), device=like.device, dtype=like.dtype)
    return torch.softmax(logits, dim=0).reshape(like.shape)


@final
class Random(Scalarizer):
    r"""Random loss weighting: :math:`\sum_i w_i L_i` with :math:`w = \mathrm{softmax}(z)`,
    :math:`z \sim \mathcal{N}(0, I)` drawn anew at each call.

    Paper: B. Lin, F. Ye, Y. Zhang, I. W. Tsang, *Reasonable Effectiveness of Random Weighting:
    A Litmus Test for Multi-Task Learning*, TMLR 2022 (Algorithm 2). The weights are positive,
    sum to one and carry no gradient; they are drawn from torch's global generator.

    Example:
        >>> import torch
        >>> from jacflow.scalarization import Random
        >>> _ = torch.manual_seed(0)
        >>> Random()(torch.tensor([1.0, 2.0, 3.0]))
        tensor(1.1758)
    """

    def forward(self, losses: Tensor, /) -> Tensor:
        return (random_weights(losses) * losses).sum()
