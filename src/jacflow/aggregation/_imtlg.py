"""IMTL-G: impartial multi-task learning, gradient part (Liu et al., 2021)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow.aggregation._bases import GramianWeightedAggregator, GramianWeighting
from jacflow.aggregation._nonfinite import has_nonfinite, nan_weights
from jacflow.aggregation._properties import Property


def imtlg_weights(gramian: Tensor) -> Tensor:
    r"""IMTL-G weights: the :math:`w` with :math:`\mathbf 1^\top w = 1` whose combination
    :math:`J^\top w` has the same projection on every unit gradient :math:`g_i / \|g_i\|`.

    In the Gramian, with :math:`n_i = \|g_i\| = \sqrt{G_{ii}}`, the projections are
    :math:`(G w)_i / n_i`, so :math:`w` solves the ``m`` linear equations
    :math:`\mathbf 1^\top w = 1` and :math:`(G_1 / n_1 - G_i / n_i)\, w = 0` for
    :math:`i \ge 2` (the paper's system, in which it solves for :math:`w_2, \dots, w_m`).
    When :math:`G` is invertible this is :math:`w = G^{-1} n / (\mathbf 1^\top G^{-1} n)`; the
    system also holds where :math:`G` is singular, where :math:`G^+ n` need not give equal
    projections (opposite rows of unequal norms), or its sum is rounding noise (rows that sum to
    zero). Zero rows take no part (their direction is undefined) and get weight 0. When the
    system has several solutions the least-norm one is taken; when it has none (a zero matrix,
    or no combination of sum 1 with equal projections), the weights are 0.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._imtlg import imtlg_weights
        >>> imtlg_weights(torch.tensor([[18., -22.], [-22., 38.]]))
        tensor([0.5923, 0.4077])
        >>> imtlg_weights(torch.tensor([[5., -15.], [-15., 45.]]))  # g_2 = -3 g_1: J^T w = 0
        tensor([0.7500, 0.2500])
    """
    m = gramian.shape[0]
    if m == 0:
        return gramian.new_zeros(0)
    if has_nonfinite(gramian):
        return nan_weights(m, gramian)
    dtype = gramian.dtype
    eps = torch.finfo(dtype).eps  # (the input's precision: what counts as rounding)
    # Solved in float64 (m is small): a float32 row 1e-4 times shorter than the largest has a
    # squared norm 1e-8 of it, whose digits float32 arithmetic would lose.
    gramian = gramian.to(torch.float64)
    trace = gramian.diagonal().sum()
    scale = torch.where(trace > 0, trace, torch.ones_like(trace))
    normalized = gramian / scale  # scale-free
    norms = normalized.diagonal().clamp(min=0).sqrt()
    # Zero rows (up to rounding) are those of norm below the input's rounding relative to the
    # largest; a test on the squared norm would also drop real rows 1e-4 (float32) or 1e-8
    # (float64) times shorter, and the update could then conflict with them.
    active = norms > m * eps
    # rows G_i / n_i (projections of the combination on the unit gradients); zero rows: none
    projections = torch.where(active[:, None], normalized / norms.clamp(min=eps)[:, None], 0.0)
    projections = projections * active[None, :]  # (a zero row takes no weight)
    first = int(torch.argmax(active.to(torch.int8)))  # (the first active row, if any)
    system = torch.cat(
        [active[None, :].to(torch.float64), (projections[first] - projections) * active[:, None]]
    )
    system = torch.cat([system[:1], system[1:][torch.arange(m, device=gramian.device) != first]])
    target = torch.zeros(m, dtype=torch.float64, device=gramian.device)
    target[0] = 1.0
    # (the cut-off of the input's precision: a singular G stays singular under its rounding)
    weights = torch.linalg.pinv(system, rtol=m * eps) @ target
    residual = (system @ weights - target).abs().max()
    solved = bool(active.any()) and bool(
        residual <= eps**0.5 * max(1.0, float(weights.abs().sum()))
    )
    weights = weights * active if solved else torch.zeros_like(weights)
    return weights.to(dtype)


class IMTLGWeighting(GramianWeighting):
    r"""Gramian weighting of :class:`IMTLG` (Liu et al., *Towards Impartial Multi-task
    Learning*, ICLR 2021): the weights of sum 1 whose combination has equal projections on
    the unit gradients, :math:`w = G^{-1} n / (\mathbf 1^\top G^{-1} n)` with
    :math:`n_i = \sqrt{G_{ii}}` when :math:`G` is invertible (see :func:`imtlg_weights` for a
    singular :math:`G`).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import IMTLGWeighting
        >>> IMTLGWeighting()(torch.tensor([[18., -22.], [-22., 38.]]))
        tensor([0.5923, 0.4077])
    """

    without_autograd = True

    scale_invariant = True  # (the weights solve a system homogeneous in G)

    def forward(self, stat: Tensor) -> Tensor:
        with torch.no_grad():
            return imtlg_weights(stat)

    def extra_repr(self) -> str:
        return ""


class IMTLG(GramianWeightedAggregator):
    r"""IMTL-G: the combination with equal projections on every unit gradient.

    Liu, Li, Kuang, Xue, Chen, Yang, Liao & Zhang, *Towards Impartial Multi-task Learning*,
    ICLR 2021 (OpenReview IMPnRXEWpvr): :math:`A(J) = J^\top w` with the weights of sum 1
    for which :math:`\langle A(J), g_i/\|g_i\|\rangle` is equal for all ``i``. For an
    invertible Gramian, in the form of Quinton & Rey (2024),

    .. math:: w = \frac{G^{-1} n}{\mathbf 1^\top G^{-1} n}, \qquad n_i = \|g_i\| = \sqrt{G_{ii}};

    for a singular one the paper's linear system is solved (:func:`imtlg_weights`), so that
    opposite rows, of any norms, and rows that sum to zero give the zero vector, as the paper's
    closed form does (TorchJD's ``G^+ n`` does not). Invariant to the rows' order; not
    conflict-free in general. A zero Jacobian, or one with no such combination, gives the zero
    vector.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import IMTLG
        >>> IMTLG()(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([0.0767, 1.0000, 1.0000])
    """

    properties = frozenset({Property.PERMUTATION_INVARIANT, Property.WEIGHTED})

    def __init__(self) -> None:
        super().__init__(IMTLGWeighting())
