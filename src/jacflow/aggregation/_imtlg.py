"""IMTL-G: impartial multi-task learning, gradient part (Liu et al., 2021)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow.aggregation._bases import GramianWeightedAggregator, GramianWeighting
from jacflow.aggregation._nonfinite import has_nonfinite, nan_weights
from jacflow.aggregation._properties import Property


def imtlg_weights(gramian: Tensor) -> Tensor:
    r"""IMTL-G weights :math:`w = G^+ n / (\mathbf 1^\top G^+ n)` with :math:`n_i = \|g_i\|`.

    Then :math:`\langle J^\top w, g_i / \|g_i\| \rangle` is the same for every row (when
    :math:`n` is in the range of :math:`G`) and :math:`\sum_i w_i = 1`. When
    :math:`\mathbf 1^\top G^+ n` vanishes (e.g. a zero matrix, or opposite rows), no such
    combination exists and the weights are 0.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._imtlg import imtlg_weights
        >>> imtlg_weights(torch.tensor([[18., -22.], [-22., 38.]]))
        tensor([0.5923, 0.4077])
    """
    m = gramian.shape[0]
    if m == 0:
        return gramian.new_zeros(0)
    if has_nonfinite(gramian):
        return nan_weights(m, gramian)
    trace = gramian.diagonal().sum()
    scale = torch.where(trace > 0, trace, torch.ones_like(trace))
    normalized = gramian / scale  # scale-free, avoids over/underflow in float32
    norms = normalized.diagonal().clamp(min=0).sqrt()
    raw = torch.linalg.pinv(normalized, hermitian=True) @ norms
    total = raw.sum()
    tiny = torch.finfo(gramian.dtype).eps * m * raw.abs().sum()
    safe = torch.where(total.abs() > tiny, total, torch.ones_like(total))
    return torch.where(total.abs() > tiny, raw / safe, torch.zeros_like(raw))


class IMTLGWeighting(GramianWeighting):
    r"""Gramian weighting of :class:`IMTLG` (Liu et al., *Towards Impartial Multi-task
    Learning*, ICLR 2021): :math:`w = G^+ n / (\mathbf 1^\top G^+ n)`,
    :math:`n_i = \sqrt{G_{ii}}`.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import IMTLGWeighting
        >>> IMTLGWeighting()(torch.tensor([[18., -22.], [-22., 38.]]))
        tensor([0.5923, 0.4077])
    """

    scale_invariant = True  # (the weights solve a system homogeneous in G)

    def forward(self, stat: Tensor) -> Tensor:
        with torch.no_grad():
            return imtlg_weights(stat)

    def extra_repr(self) -> str:
        return ""


class IMTLG(GramianWeightedAggregator):
    r"""IMTL-G: the combination with equal projections on every unit gradient.

    Liu, Li, Kuang, Xue, Chen, Yang, Liao & Zhang, *Towards Impartial Multi-task Learning*,
    ICLR 2021 (OpenReview IMPnRXEWpvr); in the Gramian form of Quinton & Rey (2024):

    .. math:: A(J) = J^\top w, \qquad w = \frac{G^+ n}{\mathbf 1^\top G^+ n}, \qquad
              n_i = \|g_i\| = \sqrt{G_{ii}},

    so that :math:`\langle A(J), g_i/\|g_i\|\rangle` is equal for all ``i`` and the weights sum
    to 1. Invariant to the rows' order; not conflict-free in general. A zero (or degenerate)
    Jacobian gives the zero vector.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import IMTLG
        >>> IMTLG()(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([0.0767, 1.0000, 1.0000])
    """

    properties = frozenset({Property.PERMUTATION_INVARIANT, Property.WEIGHTED})

    def __init__(self) -> None:
        super().__init__(IMTLGWeighting())
