"""DualProj: one projection onto the dual cone of the rows (Lopez-Paz & Ranzato, 2017)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow.aggregation._bases import GramianWeighting
from jacflow.aggregation._hyperparameters import check_float
from jacflow.aggregation._pref_vector import check_pref_vector, resolve_pref_vector
from jacflow.aggregation._preset import NoGradGramianPreset
from jacflow.aggregation._properties import Property
from jacflow.linalg import project_weights


def dualproj_weights(gramian: Tensor, pref: Tensor, norm_eps: float, reg_eps: float) -> Tensor:
    """Weights ``v = argmin v^T G v s.t. v >= pref``: one dual-cone projection of ``J^T pref``.

    When ``G @ pref >= 0`` the direction already conflicts with no row and ``v = pref``.
    """
    if gramian.shape[0] == 0:
        return pref
    return project_weights(pref, gramian, norm_eps=norm_eps, reg_eps=reg_eps).to(gramian.dtype)


class DualProjWeighting(GramianWeighting):
    r"""Gramian weighting of :class:`DualProj`.

    Args:
        pref_vector: the preference weights :math:`u` (default ``1/m`` each).
        norm_eps: the Gramian is divided by its trace; a trace at or below ``norm_eps`` counts
            as 0 (default 0; TorchJD uses 1e-4, see :func:`jacflow.linalg.project_weights`).
        reg_eps: ``reg_eps * I`` is added to the normalised Gramian (default 0: the exact
            problem; TorchJD uses 1e-4).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import DualProjWeighting
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> DualProjWeighting()(J @ J.T)
        tensor([0.6111, 0.5000])
    """

    def __init__(
        self, pref_vector: Tensor | None = None, norm_eps: float = 0.0, reg_eps: float = 0.0
    ) -> None:
        super().__init__()
        self.pref_vector = check_pref_vector(pref_vector)
        self.norm_eps = check_float(norm_eps, "norm_eps", low=0.0)
        self.reg_eps = check_float(reg_eps, "reg_eps", low=0.0)

    def forward(self, stat: Tensor) -> Tensor:
        with torch.no_grad():
            pref = resolve_pref_vector(self.pref_vector, stat.shape[0], stat)
            return dualproj_weights(stat, pref, self.norm_eps, self.reg_eps)

    def extra_repr(self) -> str:
        return f"pref_vector={self.pref_vector}, norm_eps={self.norm_eps}, reg_eps={self.reg_eps}"


class DualProj(NoGradGramianPreset):
    r"""DualProj: the preference combination of the rows, projected onto their dual cone.

    The projection step of Lopez-Paz & Ranzato, *Gradient Episodic Memory for Continual
    Learning*, NeurIPS 2017 (arXiv 1706.08840), applied to the preference-weighted average
    :math:`J^\top u` of the rows:

    .. math:: A(J) = \pi_J(J^\top u) = J^\top v^*,\qquad
              v^* = \arg\min_{v \succeq u} v^\top G v,\quad G = J J^\top,

    where :math:`\pi_J` is the projection onto the dual cone :math:`\{x : J x \succeq 0\}`
    (Quinton & Rey 2024, Prop. 1). The update conflicts with no objective and does not depend on
    the order of the rows; it is not linear under scaling.

    Args:
        pref_vector: the preference weights :math:`u` (default ``1/m`` each).
        norm_eps: see :class:`DualProjWeighting`.
        reg_eps: see :class:`DualProjWeighting`.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import DualProj
        >>> DualProj()(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([0.5556, 1.1111, 1.1111])
    """

    properties = frozenset(
        {Property.NON_CONFLICTING, Property.PERMUTATION_INVARIANT, Property.WEIGHTED}
    )

    def __init__(
        self, pref_vector: Tensor | None = None, norm_eps: float = 0.0, reg_eps: float = 0.0
    ) -> None:
        super().__init__(DualProjWeighting(pref_vector, norm_eps, reg_eps))
