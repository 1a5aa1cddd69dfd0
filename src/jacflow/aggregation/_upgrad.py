"""UPGrad: Unconflicting Projection of Gradients (Quinton & Rey, 2024)."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor

from jacflow.aggregation._bases import GramianWeightedAggregator, GramianWeighting
from jacflow.aggregation._hyperparameters import Forwarded, Hyperparameter
from jacflow.aggregation._mean import mean_weights
from jacflow.aggregation._nonfinite import has_nonfinite, propagate_nonfinite
from jacflow.aggregation._pref_vector import (
    check_pref_rows,
    check_pref_vector,
    resolve_pref_vector,
)
from jacflow.aggregation._properties import Property
from jacflow.linalg._projectors import (
    DualConeProjector,
    QuadprogProjector,
    TorchProjector,
    solves_on_host,
)


def _ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator`` with ``x / 0 = 0`` (a zero row); NaN still propagates. The
    discarded quotient divides by 1, not 0: its infinite derivative, times the zero that
    ``where`` gives it, would make every gradient NaN."""
    zero = denominator == 0
    return torch.where(zero, 0.0, numerator / torch.where(zero, 1.0, denominator))


def two_objective_weights(gramian: Tensor, pref: Tensor) -> Tensor:
    """Exact UPGrad weights for ``m = 2`` in closed form (no solver, no host synchronisation).

    Row 1 (``u = p_1 e_1``, ``p_1 >= 0``) projects to ``v = (p_1, max(0, -G_12 p_1 / G_22))``:
    for fixed ``v_1`` the best ``v_2`` is ``-G_12 v_1 / G_22`` clipped at 0, and the remaining
    objective grows with ``v_1``. Symmetrically for row 2. A row with ``p_i <= 0`` projects to
    0 (``v = 0`` is feasible and has objective 0).
    """
    p = pref.clamp(min=0)
    # row i gains max(0, -G_12 p_j / G_jj) on objective j (one vector op for both rows)
    gains = _ratio(-gramian[0, 1] * p, gramian.diagonal().flip(0)).clamp(min=0)
    return (p + gains.flip(0)).to(pref.dtype)


def two_objective_weights_on_host(gramian: Tensor, pref: Tensor | None) -> Tensor:
    """:func:`two_objective_weights` in Python floats, for a Gramian outside autograd.

    The same formulas, with two host reads instead of about ten tensor operations (whose
    dispatch, or on an accelerator whose kernel launches, dominate a 2 x 2 problem); a NaN or
    infinite entry of either gives NaN weights. ``pref=None`` is the default preference
    ``(1/2, 1/2)``, in the Gramian's dtype. The weights are on the Gramian's device.
    """
    dtype = gramian.dtype if pref is None else pref.dtype
    (g11, g12), (_, g22) = gramian.tolist()
    if not all(math.isfinite(g) for g in (g11, g12, g22)):
        return torch.full((2,), math.nan, dtype=dtype, device=gramian.device)
    preference = [0.5, 0.5] if pref is None else pref.tolist()
    if not all(math.isfinite(p) for p in preference):  # (max(0, NaN) would read 0)
        return torch.full((2,), math.nan, dtype=dtype, device=gramian.device)
    p1, p2 = (max(0.0, p) for p in preference)
    gain1 = max(0.0, -g12 * p2 / g11) if g11 != 0 else 0.0
    gain2 = max(0.0, -g12 * p1 / g22) if g22 != 0 else 0.0
    return torch.tensor([p1 + gain1, p2 + gain2], dtype=dtype, device=gramian.device)


def _is_exact(projector: DualConeProjector) -> bool:
    return (
        isinstance(projector, TorchProjector) and projector.norm_eps == 0 and projector.reg_eps == 0
    )


def is_scale_free(projector: DualConeProjector) -> bool:
    """Whether ``projector``'s weights ignore a global scale of the Gramian: the exact problem
    is, and so are the trace-normalised solvers unless ``norm_eps > 0`` (an absolute cut-off)."""
    return isinstance(projector, (TorchProjector, QuadprogProjector)) and projector.norm_eps == 0


def check_projector(projector: object, name: str = "projector") -> DualConeProjector:
    """``projector``, or the default ``TorchProjector()`` for ``None``; else a ``TypeError``."""
    if projector is None:
        return TorchProjector()
    if not isinstance(projector, DualConeProjector):
        raise TypeError(
            f"`{name}` must be a jacflow.linalg.DualConeProjector (e.g. TorchProjector() or "
            f"QuadprogProjector()) or None, received {type(projector)}."
        )
    return projector


def projector_grad_mode(projector: DualConeProjector) -> contextlib.AbstractContextManager[None]:
    """Autograd as the projector allows: off for one that is not
    :attr:`~jacflow.linalg.DualConeProjector.differentiable` (its weights then carry no graph
    that could hold its solve constant)."""
    return contextlib.nullcontext() if projector.differentiable else torch.no_grad()


def upgrad_weights(
    gramian: Tensor, pref_vector: Tensor | None, projector: DualConeProjector
) -> Tensor:
    """UPGrad weights: ``sum_i v_i`` where ``v_i`` solves ``min v^T G v s.t. v >= pref_i e_i``.

    ``pref_vector=None`` is the default ``1/m`` each. Short-circuits when no off-diagonal entry
    of ``G`` is negative (and ``G`` is not tracked by autograd): then no row conflicts with
    another, every projection of ``p_i e_i`` is itself (``p_i >= 0``) or 0, and the weights
    are ``max(pref, 0)``. A NaN or infinite entry in ``G`` or ``pref`` gives NaN weights.
    """
    m = gramian.shape[0]
    pref = None if pref_vector is None else resolve_pref_vector(pref_vector, m, gramian)
    if m == 2 and _is_exact(projector):
        # (outside autograd, Python floats; then the default preference needs no tensor either)
        if not gramian.requires_grad and (pref is None or not pref.requires_grad):
            return two_objective_weights_on_host(gramian, pref)
        given = pref
        pref = mean_weights(2, gramian) if given is None else given
        weights = propagate_nonfinite(two_objective_weights(gramian, pref), gramian)
        # (an infinite preference gave an infinite weight, not NaN)
        return weights if given is None else propagate_nonfinite(weights, given)
    if pref is None:
        pref = mean_weights(m, gramian)
    if m == 0:
        return pref
    # (a negative diagonal entry, impossible for a Gramian, only means no short cut; the
    # minimum is NaN or -inf where some entry is, and the projector gives the NaN weights)
    # (not under autograd with a G that requires grad and a differentiable projector: the
    # weights then keep their graph to G, of zero gradient, as without the short cut)
    tracked = torch.is_grad_enabled() and gramian.requires_grad
    tracked = tracked and projector.differentiable
    if not tracked and float(gramian.detach().amin()) >= 0 and not has_nonfinite(gramian):
        if pref_vector is None:  # (1/m each)
            return pref
        if not has_nonfinite(pref):  # (a NaN preference gives NaN weights, from the projector)
            return pref.clamp_min(0)  # (a row p_i e_i with p_i < 0 projects to 0)
    return projector.project_diagonal(pref, gramian).sum(dim=0)


class UPGradWeighting(GramianWeighting):
    r"""Gramian weighting of :class:`UPGrad`.

    Args:
        pref_vector: preference weight of each objective (default ``1/m`` each).
        projector: the dual-cone projection solver (default ``TorchProjector()``: the exact
            problem, batched, on the Gramian's device, handling singular Gramians). TorchJD's
            normalisation and regularisation (``norm_eps = reg_eps = 1e-4``), e.g.
            ``QuadprogProjector()`` or ``TorchProjector(norm_eps=1e-4, reg_eps=1e-4)``,
            reproduce its results but let the update conflict by up to about 1% of its norm
            near stationary points, and make Jacobians with entries below about 1e-2 fall back
            to the mean.

    With a ``TorchProjector``, the weights are differentiable with respect to the Gramian and
    ``pref_vector`` (implicit differentiation of the projections, also twice).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import UPGradWeighting
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> UPGradWeighting()(J @ J.T)
        tensor([1.1111, 0.7895])
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
        """The projector's :attr:`~jacflow.linalg.DualConeProjector.differentiable`: True with
        a ``TorchProjector`` (implicit differentiation), False with ``QuadprogProjector``."""
        return self.projector.differentiable

    def check_rows(self, m: int) -> None:
        check_pref_rows(self.pref_vector, m)

    def forward(self, stat: Tensor) -> Tensor:
        with projector_grad_mode(self.projector):
            host = solves_on_host(self.projector, stat, self.pref_vector)
            weights = upgrad_weights(stat.cpu() if host else stat, self.pref_vector, self.projector)
            return weights.to(stat.device, non_blocking=True)

    def extra_repr(self) -> str:
        return f"pref_vector={self.pref_vector}, projector={self.projector}"


class UPGrad(GramianWeightedAggregator):
    r"""Unconflicting Projection of Gradients (UPGrad).

    Quinton & Rey, *Jacobian Descent for Multi-Objective Optimization*, 2024 (arXiv
    2406.16232). Each row :math:`g_i` of the Jacobian is projected onto the dual cone
    :math:`\{x : Jx \succeq 0\}` of the rows, and the projections are averaged with the
    preference weights :math:`p`:

    .. math:: A(J) = \sum_i p_i \, \pi_J(g_i), \quad
              \pi_J(J^\top u) = J^\top v^*, \quad v^* = \arg\min_{v \succeq u} v^\top G v.

    The update conflicts with no objective (:math:`J A(J) \succeq 0`), is linear under
    scaling of the rows and invariant to their order. With the default projector it is
    differentiable in the Jacobian (implicit differentiation of the projections' KKT systems),
    so it can be used under ``create_graph=True``.

    Args:
        pref_vector: preference weight of each objective (default ``1/m`` each).
        projector: the dual-cone projection solver; see :class:`UPGradWeighting`.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import UPGrad
        >>> from jacflow.linalg import QuadprogProjector
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> UPGrad()(J)
        tensor([0.2924, 1.9006, 1.9006])
        >>> UPGrad(projector=QuadprogProjector())(J)  # TorchJD 0.18's numbers
        tensor([0.2929, 1.9004, 1.9004])
    """

    properties = frozenset(
        {
            Property.NON_CONFLICTING,
            Property.LINEAR_UNDER_SCALING,
            Property.PERMUTATION_INVARIANT,
            Property.WEIGHTED,
        }
    )

    uniform_preference_properties = frozenset({Property.PERMUTATION_INVARIANT})

    pref_vector = Forwarded(UPGradWeighting.pref_vector)
    projector = Forwarded(UPGradWeighting.projector)

    def __init__(
        self, pref_vector: Tensor | None = None, projector: DualConeProjector | None = None
    ) -> None:
        super().__init__(UPGradWeighting(pref_vector, projector))

    def extra_repr(self) -> str:
        return self.gramian_weighting.extra_repr()
