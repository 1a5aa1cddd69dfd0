"""DualProj: one projection onto the dual cone of the rows (Lopez-Paz & Ranzato, 2017)."""

from __future__ import annotations

from torch import Tensor

from jacflow.aggregation._bases import GramianWeightedAggregator, GramianWeighting
from jacflow.aggregation._hyperparameters import Forwarded, Hyperparameter
from jacflow.aggregation._pref_vector import (
    check_pref_rows,
    check_pref_vector,
    resolve_pref_vector,
)
from jacflow.aggregation._properties import Property
from jacflow.aggregation._upgrad import check_projector, is_scale_free, projector_grad_mode
from jacflow.linalg import DualConeProjector
from jacflow.linalg._projectors import solves_on_host


def dualproj_weights(gramian: Tensor, pref: Tensor, projector: DualConeProjector) -> Tensor:
    """Weights ``v = argmin v^T G v s.t. v >= pref``: one dual-cone projection of ``J^T pref``."""
    if gramian.shape[0] == 0:
        return pref
    return projector(pref, gramian).to(gramian.dtype)


class DualProjWeighting(GramianWeighting):
    r"""Gramian weighting of :class:`DualProj`.

    Args:
        pref_vector: the preference weights :math:`u` (default ``1/m`` each).
        projector: the dual-cone projection solver (default ``TorchProjector()``: the exact
            problem, on the Gramian's device). ``QuadprogProjector()`` or
            ``TorchProjector(norm_eps=1e-4, reg_eps=1e-4)`` reproduce TorchJD's numbers.

    With a ``TorchProjector`` (or any :attr:`~jacflow.linalg.DualConeProjector.differentiable`
    projector), the weights are differentiable with respect to the Gramian and ``pref_vector``;
    with ``QuadprogProjector`` they carry no graph.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import DualProjWeighting
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> DualProjWeighting()(J @ J.T)
        tensor([0.6111, 0.5000])
    """

    pref_vector = Hyperparameter(check_pref_vector)
    projector = Hyperparameter(check_projector)
    """The dual-cone projection solver (assigning ``None`` gives the default)."""

    def __init__(
        self, pref_vector: Tensor | None = None, projector: DualConeProjector | None = None
    ) -> None:
        super().__init__()
        self.pref_vector = pref_vector
        self.projector = projector  # type: ignore[assignment]  # (None: the default)

    @property
    def scale_invariant(self) -> bool:
        """Whether the projector ignores the Gramian's scale (``norm_eps == 0``)."""
        return is_scale_free(self.projector)

    @property
    def differentiable(self) -> bool:
        """The projector's :attr:`~jacflow.linalg.DualConeProjector.differentiable`."""
        return self.projector.differentiable

    def check_rows(self, m: int) -> None:
        check_pref_rows(self.pref_vector, m)

    def forward(self, stat: Tensor) -> Tensor:
        with projector_grad_mode(self.projector):
            host = solves_on_host(self.projector, stat, self.pref_vector)
            work = stat.cpu() if host else stat
            pref = resolve_pref_vector(self.pref_vector, stat.shape[0], work)
            return dualproj_weights(work, pref, self.projector).to(stat.device, non_blocking=True)

    def extra_repr(self) -> str:
        return f"pref_vector={self.pref_vector}, projector={self.projector}"


class DualProj(GramianWeightedAggregator):
    r"""DualProj: the preference combination of the rows, projected onto their dual cone.

    The projection step of Lopez-Paz & Ranzato, *Gradient Episodic Memory for Continual
    Learning*, NeurIPS 2017 (arXiv 1706.08840), applied to the preference-weighted average
    :math:`J^\top u` of the rows:

    .. math:: A(J) = \pi_J(J^\top u) = J^\top v^*,\qquad
              v^* = \arg\min_{v \succeq u} v^\top G v,\quad G = J J^\top,

    where :math:`\pi_J` is the projection onto the dual cone :math:`\{x : J x \succeq 0\}`
    (Quinton & Rey 2024, Prop. 1). The update conflicts with no objective and does not depend on
    the order of the rows; it is not linear under scaling. With the default projector it is
    differentiable in the Jacobian (implicit differentiation of the projection's KKT system).

    Args:
        pref_vector: the preference weights :math:`u` (default ``1/m`` each).
        projector: the dual-cone projection solver; see :class:`DualProjWeighting`.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import DualProj
        >>> from jacflow.linalg import QuadprogProjector
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> DualProj()(J)
        tensor([0.5556, 1.1111, 1.1111])
        >>> DualProj(projector=QuadprogProjector())(J)  # TorchJD 0.18's numbers
        tensor([0.5563, 1.1109, 1.1109])
    """

    properties = frozenset(
        {Property.NON_CONFLICTING, Property.PERMUTATION_INVARIANT, Property.WEIGHTED}
    )

    uniform_preference_properties = frozenset({Property.PERMUTATION_INVARIANT})

    pref_vector = Forwarded(DualProjWeighting.pref_vector)
    projector = Forwarded(DualProjWeighting.projector)

    def __init__(
        self, pref_vector: Tensor | None = None, projector: DualConeProjector | None = None
    ) -> None:
        super().__init__(DualProjWeighting(pref_vector, projector))

    def extra_repr(self) -> str:
        return self.gramian_weighting.extra_repr()
