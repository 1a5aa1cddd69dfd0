"""Pareto MTL: one Pareto-optimal solution per preference region (Lin X. et al., 2019)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow._stateful import SavesState, Stateful
from jacflow.aggregation._bases import GramianWeightedAggregator, GramianWeighting
from jacflow.aggregation._hyperparameters import Forwarded, Hyperparameter, check_real_values, ints
from jacflow.aggregation._loss_aware import LossAware
from jacflow.aggregation._mgda import mgda_weights
from jacflow.aggregation._nonfinite import has_nonfinite, nan_weights
from jacflow.aggregation._properties import Property

_MGDA_EPSILON = 1e-3
_MGDA_ITERS = 100


def active_constraints(preferences: Tensor, index: int, losses: Tensor) -> Tensor:
    r"""Rows :math:`\hat u_j - \hat u_k` (``[|I|, m]``) of the violated constraints.

    Constraint :math:`j \neq k` is violated when :math:`(\hat u_j - \hat u_k)^\top \hat L > 0`,
    with :math:`\hat u = u / \|u\|` and :math:`\hat L = L / \|L\|`: the losses are closer (in
    angle) to the preference :math:`u_j` than to :math:`u_k`.
    """
    units = preferences / preferences.norm(dim=1, keepdim=True)
    rows = torch.cat([units[:index], units[index + 1 :]]) - units[index]
    values = rows @ (losses / losses.norm())
    return rows[values > 0]


def pareto_mtl_weights(
    gramian: Tensor, losses: Tensor, preferences: Tensor, index: int, warmup: bool
) -> tuple[Tensor, bool]:
    r"""Pareto MTL weights and whether feasible.

    * warm-up (phase 1), some constraint violated: :math:`w = A_I^\top \beta` with
      :math:`\beta` the MGDA weights of the Gramian :math:`A_I G A_I^\top`, as they are;
    * otherwise (phase 2): :math:`w = \lambda + A_I^\top \beta` with :math:`(\lambda, \beta)`
      the MGDA weights of :math:`[I; A_I]\, G\, [I; A_I]^\top`, rescaled to
      :math:`\sum_i |w_i| = m`.

    (The reference training code rescales the phase-2 weights only.)
    """
    m = gramian.shape[0]
    G = gramian.to(torch.float64)
    A = active_constraints(preferences.to(G), index, losses.to(G))
    feasible = A.shape[0] == 0
    if warmup and not feasible:
        beta = mgda_weights(A @ G @ A.T, _MGDA_EPSILON, _MGDA_ITERS)
        return (A.T @ beta).to(gramian.dtype), feasible
    stacked = torch.cat([torch.eye(m, dtype=G.dtype, device=G.device), A])
    solution = mgda_weights(stacked @ G @ stacked.T, _MGDA_EPSILON, _MGDA_ITERS)
    weights = stacked.T @ solution
    total = weights.abs().sum()
    weights = torch.where(total > 0, m * weights / torch.where(total > 0, total, 1.0), weights)
    return weights.to(gramian.dtype), feasible


def _check_preferences(preferences: object, name: str) -> Tensor:
    if not isinstance(preferences, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, received {type(preferences)}.")
    if preferences.ndim != 2 or preferences.shape[0] == 0:
        raise ValueError(
            f"`{name}` must be a matrix [K, m] with one preference vector per row (K >= 1), "
            f"received shape {tuple(preferences.shape)}."
        )
    check_real_values(preferences, name)
    if bool((preferences < 0).any()) or (
        preferences.shape[1] > 0 and bool((preferences.sum(1) == 0).any())
    ):
        raise ValueError(
            f"`{name}` must be finite and non-negative with no zero row, received {preferences}."
        )
    return preferences.detach().clone()


def _preferences_fit(weighting: ParetoMTLWeighting, preferences: Tensor) -> None:
    index = getattr(weighting, "index", None)  # (None while the constructor runs)
    if index is not None and index >= preferences.shape[0]:
        raise ValueError(
            f"`preferences` must have a row `index` = {index}, received {preferences.shape[0]} "
            "rows; assign `index` first."
        )


def _index_fits(weighting: ParetoMTLWeighting, index: int) -> None:
    rows = weighting.preferences.shape[0]
    if index >= rows:
        raise ValueError(
            f"`index` must be in [0, {rows - 1}] (a row of `preferences`), received {index}."
        )


class ParetoMTLWeighting(SavesState, GramianWeighting, LossAware, Stateful):
    r"""Gramian weighting of :class:`ParetoMTL`.

    Args:
        preferences: ``[K, m]`` non-negative preference vectors :math:`u_1, \dots, u_K`.
        index: which sub-problem :math:`k` (row of ``preferences``) this run solves.
        n_warmup_steps: maximal number of phase-1 calls (``>= 0``).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import ParetoMTLWeighting
        >>> W = ParetoMTLWeighting(torch.tensor([[1., 0.], [0., 1.]]), index=0)
        >>> W.set_losses(torch.tensor([1., 2.]))  # closer to u_1 than to u_0: phase 1
        >>> W(torch.tensor([[1., 0.], [0., 1.]]))
        tensor([-1.,  1.])
        >>> W.set_losses(torch.tensor([2., 1.]))  # feasible: phase 2 from now on
        >>> W(torch.tensor([[1., 0.], [0., 1.]]))
        tensor([1., 1.])
    """

    without_autograd = True

    saved_state = ("_steps", "_warmup_done")

    preferences = Hyperparameter(_check_preferences, fits=_preferences_fit)
    index = Hyperparameter(ints(low=0), fits=_index_fits)
    n_warmup_steps = Hyperparameter(ints(low=0))

    def __init__(self, preferences: Tensor, index: int, n_warmup_steps: int = 100) -> None:
        super().__init__()
        self.preferences = preferences
        self.index = index
        self.n_warmup_steps = n_warmup_steps
        self._steps = 0
        self._warmup_done = False

    scale_invariant = True  # (the MGDA weights of A G A^T, normalised)

    def check_rows(self, m: int) -> None:
        if self.preferences.shape[1] != m:
            raise ValueError(
                f"ParetoMTL has preference vectors of {self.preferences.shape[1]} entries but the "
                f"Gramian has {m} rows; give one preference entry per objective."
            )
        self.require_losses(m)

    def forward(self, stat: Tensor) -> Tensor:
        m = stat.shape[0]
        self.check_rows(m)
        losses = self.losses_like(m, stat)
        if m == 0:
            return stat.new_zeros(0)
        if has_nonfinite(stat) or has_nonfinite(losses):
            return nan_weights(m, stat)
        warmup = not self._warmup_done and self._steps < self.n_warmup_steps
        self._steps += 1
        with torch.no_grad():
            weights, feasible = pareto_mtl_weights(
                stat, losses, self.preferences, self.index, warmup
            )
        if feasible or not warmup:
            self._warmup_done = True
        return weights

    def reset(self) -> None:
        self._steps = 0
        self._warmup_done = False

    def extra_repr(self) -> str:
        return (
            f"preferences={self.preferences.tolist()}, index={self.index}, "
            f"n_warmup_steps={self.n_warmup_steps}"
        )


class ParetoMTL(GramianWeightedAggregator, LossAware, Stateful):
    r"""Pareto MTL: MGDA restricted to the preference region of one preference vector.

    Lin X., Zhen, Li, Zhang & Kwong, *Pareto Multi-Task Learning*, NeurIPS 2019 (arXiv
    1912.12854). The loss space is split by :math:`K` preference vectors; sub-problem
    :math:`k` seeks a Pareto-optimal point whose losses :math:`L` are closer to :math:`u_k`
    than to every other :math:`u_j`: with :math:`\hat u = u/\|u\|` and
    :math:`\hat L = L/\|L\|`, the constraints are :math:`(\hat u_j - \hat u_k)^\top \hat L \le
    0`. Let :math:`A_I` hold the rows :math:`\hat u_j - \hat u_k` of the violated ones.

    * Phase 1 (at most ``n_warmup_steps`` calls, until no constraint is violated): descend on
      the violated constraints, :math:`w = A_I^\top \beta`, :math:`\beta =
      \mathrm{MGDA}(A_I G A_I^\top)`.
    * Phase 2: MGDA on the objectives and the violated constraints,
      :math:`w = \lambda + A_I^\top \beta`, :math:`(\lambda, \beta) =
      \mathrm{MGDA}([I; A_I] G [I; A_I]^\top)`.

    As in the reference training code the phase-2 weights are rescaled to
    :math:`\sum_i |w_i| = m` (individual weights may be negative) and the phase-1 weights are
    used as they are; the update is :math:`d = J^\top w`.

    Args:
        preferences: ``[K, m]`` non-negative preference vectors, no zero row.
        index: the sub-problem :math:`k \in [0, K)`.
        n_warmup_steps: maximal number of phase-1 calls (default 100; the paper uses the first
            2 of 100 epochs, LibMOON 20% of the epochs).

    State: the number of calls and whether phase 1 is over; :meth:`reset` restarts phase 1.
    Call :meth:`set_losses` with the ``m`` losses before each call.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import ParetoMTL
        >>> A = ParetoMTL(torch.tensor([[1., 0.], [1., 1.], [0., 1.]]), index=0)
        >>> A.set_losses(torch.tensor([1., 1.]))
        >>> A(torch.tensor([[1., 0.], [0., 2.]]))
        tensor([-0.2929,  1.4142])
    """

    properties = frozenset({Property.WEIGHTED})

    preferences = Forwarded(ParetoMTLWeighting.preferences)
    index = Forwarded(ParetoMTLWeighting.index)
    n_warmup_steps = Forwarded(ParetoMTLWeighting.n_warmup_steps)

    def __init__(self, preferences: Tensor, index: int, n_warmup_steps: int = 100) -> None:
        super().__init__(ParetoMTLWeighting(preferences, index, n_warmup_steps))

    def _weighting(self) -> ParetoMTLWeighting:
        weighting = self.gramian_weighting
        assert isinstance(weighting, ParetoMTLWeighting)
        return weighting

    def set_losses(self, losses: Tensor) -> None:
        self._weighting().set_losses(losses)

    def reset(self) -> None:
        self._weighting().reset()

    def forward(self, matrix: Tensor) -> Tensor:
        with torch.no_grad():
            return super().forward(matrix)

    def extra_repr(self) -> str:
        return self.gramian_weighting.extra_repr()
