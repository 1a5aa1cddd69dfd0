"""STCH: smooth Tchebycheff scalarization."""

from __future__ import annotations

from typing import final

import torch
from torch import Tensor

from jacflow.aggregation._bases import compute_dtype
from jacflow.scalarization._base import (
    Hyperparameter,
    Scalarizer,
    floats,
    matching,
    optional_tensors,
)


def preference(weights: Tensor | None, losses: Tensor, owner: str) -> Tensor:
    """The given preference on the losses' device and dtype, or ``1/m`` for each loss."""
    if weights is None:
        return torch.full_like(losses, 1.0 / losses.numel())
    return matching(weights, "weights", losses, owner)


def shifted(losses: Tensor, reference: Tensor | None, owner: str) -> Tensor:
    """``losses - reference`` (``losses`` itself when there is no reference point)."""
    if reference is None:
        return losses
    return losses - matching(reference, "reference", losses, owner)


def smooth_max(values: Tensor, mu: float) -> Tensor:
    r"""``mu * log(sum(exp(values / mu)))``, computed without overflow for small ``mu``.

    The largest value is taken out before dividing by ``mu`` (Appendix B.1 of the STCH paper) and
    added back, so the result and its gradient (``softmax(values / mu)``) are unchanged.
    """
    flat = values.flatten()
    top = flat.max().detach()
    return mu * torch.logsumexp((flat - top) / mu, dim=0) + top


@final
class STCH(Scalarizer):
    r"""Smooth Tchebycheff scalarization.

    .. math::
        \mu \log \sum_{i=1}^m \exp\Big(\frac{\lambda_i (L_i - z_i^*)}{\mu}\Big),

    a smooth upper bound of the Tchebycheff scalarization
    :math:`\max_i \lambda_i (L_i - z_i^*)` (see :class:`Tchebycheff`), above it by at most
    :math:`\mu \log m`, that tends to it as :math:`\mu \to 0`. Its gradient weights each loss by
    ``softmax(lambda * (L - z) / mu)``, so the worst-off objectives dominate.

    Paper: X. Lin, X. Zhang, Z. Yang, F. Liu, Z. Wang, Q. Zhang, *Smooth Tchebycheff
    Scalarization for Multi-Objective Optimization*, ICML 2024 (arXiv 2402.19078). Same names,
    parameters and defaults as TorchJD 0.18's ``STCH``. For the variant of LibMTL (log of the
    losses over a nadir point measured after a warm-up), see :class:`LogSTCH`.

    Args:
        mu: the smoothing parameter :math:`\mu > 0`; smaller is closer to the maximum (the paper
            evaluates 0.01, 0.1, 0.5 and 1).
        weights: the preference :math:`\lambda`, one entry per loss; ``None`` gives ``1/m``
            each.
        reference: the ideal point :math:`z^*`, one entry per loss; ``None`` gives zero.

    The value is computed in float32 for float16 or bfloat16 losses (float16 reads a small
    :math:`\mu` as 0), in their dtype otherwise, and rounded to the losses' dtype.

    Example:
        >>> import torch
        >>> from jacflow.scalarization import STCH
        >>> STCH(mu=0.5)(torch.tensor([1.0, 3.0]))
        tensor(1.5635)
    """

    mu = Hyperparameter(floats(low=0.0, low_open=True))
    weights = Hyperparameter(optional_tensors("STCH"))
    reference = Hyperparameter(optional_tensors("STCH"))

    def __init__(
        self, mu: float, weights: Tensor | None = None, reference: Tensor | None = None
    ) -> None:
        super().__init__()
        self.mu = mu
        self.weights = weights
        self.reference = reference

    def forward(self, losses: Tensor, /) -> Tensor:
        # (float32 at least: float16 reads a mu below 6e-8 as 0, whose gradient is then 0)
        wide = losses.to(compute_dtype(losses.dtype))
        lambda_ = preference(self.weights, wide, "STCH")
        value = smooth_max(lambda_ * shifted(wide, self.reference, "STCH"), self.mu)
        return value.to(losses.dtype)

    def extra_repr(self) -> str:
        return f"mu={self.mu}, weights={self.weights!r}, reference={self.reference!r}"
