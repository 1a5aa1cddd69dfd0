"""UPGrad: Unconflicting Projection of Gradients (Quinton & Rey, 2024)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow.aggregation._bases import GramianWeightedAggregator, GramianWeighting
from jacflow.aggregation._pref_vector import check_pref_vector, resolve_pref_vector
from jacflow.aggregation._properties import Property
from jacflow.linalg._dual_cone import project_weights


def _check_eps(value: float, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative float, received {value!r}.")
    return float(value)


def upgrad_weights(gramian: Tensor, pref: Tensor, norm_eps: float, reg_eps: float) -> Tensor:
    """UPGrad weights: ``sum_i v_i`` where ``v_i`` solves ``min v^T G v s.t. v >= pref_i e_i``.

    Short-circuits when no off-diagonal entry of ``G`` is negative: then no row conflicts
    with another, every projection is the identity, and the weights are ``pref``.
    """
    m = gramian.shape[0]
    if m == 0:
        return pref
    off_diagonal = gramian - torch.diag(gramian.diagonal())
    if not bool((off_diagonal < 0).any()):
        return pref
    u = torch.diag(pref)
    return project_weights(u, gramian, norm_eps=norm_eps, reg_eps=reg_eps).sum(dim=0)


class UPGradWeighting(GramianWeighting):
    r"""Gramian weighting of :class:`UPGrad`.

    Args:
        pref_vector: preference weight of each objective (default ``1/m`` each).
        norm_eps: the Gramian is divided by its trace; a trace at or below ``norm_eps`` counts
            as 0. The default 0 keeps UPGrad scale-free (TorchJD's 1e-4 makes Jacobians with
            entries below about 1e-2 fall back to the mean, which conflicts).
        reg_eps: ``reg_eps * I`` is added to the normalised Gramian before solving. The default
            0 solves the exact problem (the solver handles singular Gramians); TorchJD's 1e-4
            reproduces its results but lets the update conflict by up to about 1% of its norm
            near stationary points.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import UPGradWeighting
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> UPGradWeighting()(J @ J.T)
        tensor([1.1111, 0.7895])
    """

    def __init__(
        self, pref_vector: Tensor | None = None, norm_eps: float = 0.0, reg_eps: float = 0.0
    ) -> None:
        super().__init__()
        self.pref_vector = check_pref_vector(pref_vector)
        self.norm_eps = _check_eps(norm_eps, "norm_eps")
        self.reg_eps = _check_eps(reg_eps, "reg_eps")

    def forward(self, stat: Tensor) -> Tensor:
        with torch.no_grad():
            pref = resolve_pref_vector(self.pref_vector, stat.shape[0], stat)
            return upgrad_weights(stat, pref, self.norm_eps, self.reg_eps)

    def extra_repr(self) -> str:
        return f"pref_vector={self.pref_vector}, norm_eps={self.norm_eps}, reg_eps={self.reg_eps}"


class UPGrad(GramianWeightedAggregator):
    r"""Unconflicting Projection of Gradients (UPGrad).

    Quinton & Rey, *Jacobian Descent for Multi-Objective Optimization*, 2024 (arXiv
    2406.16232). Each row :math:`g_i` of the Jacobian is projected onto the dual cone
    :math:`\{x : Jx \succeq 0\}` of the rows, and the projections are averaged with the
    preference weights :math:`p`:

    .. math:: A(J) = \sum_i p_i \, \pi_J(g_i), \quad
              \pi_J(J^\top u) = J^\top v^*, \quad v^* = \arg\min_{v \succeq u} v^\top G v.

    The update conflicts with no objective (:math:`J A(J) \succeq 0`), is linear under
    scaling of the rows and invariant to their order.

    Args:
        pref_vector: preference weight of each objective (default ``1/m`` each).
        norm_eps: see :class:`UPGradWeighting`.
        reg_eps: see :class:`UPGradWeighting`.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import UPGrad
        >>> UPGrad()(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([0.2924, 1.9006, 1.9006])
    """

    properties = frozenset(
        {
            Property.NON_CONFLICTING,
            Property.LINEAR_UNDER_SCALING,
            Property.PERMUTATION_INVARIANT,
            Property.WEIGHTED,
        }
    )

    def __init__(
        self, pref_vector: Tensor | None = None, norm_eps: float = 0.0, reg_eps: float = 0.0
    ) -> None:
        super().__init__(UPGradWeighting(pref_vector, norm_eps, reg_eps))

    def forward(self, matrix: Tensor) -> Tensor:
        with torch.no_grad():
            return super().forward(matrix)

    def extra_repr(self) -> str:
        return self.gramian_weighting.extra_repr()
