"""AuxiNash: Nash bargaining with fixed bargaining powers (Shamsian, Navon et al., 2023)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow.aggregation._bases import GramianWeightedAggregator, GramianWeighting
from jacflow.aggregation._hyperparameters import (
    Forwarded,
    Hyperparameter,
    check_real_values,
    floats,
    ints,
    or_none,
)
from jacflow.aggregation._nonfinite import has_nonfinite, nan_weights
from jacflow.aggregation._properties import Property

_MIN_POWER = 1e-4
_RIDGE = 1e-12  # relative to the mean diagonal: a solution exists even when Pareto-stationary
_TOL = 1e-12


def _negative_nash_product(gramian: Tensor, alpha: Tensor, powers: Tensor) -> Tensor:
    return 0.5 * alpha @ gramian @ alpha - powers @ torch.log(alpha)


def bargaining_solution(gramian: Tensor, powers: Tensor, max_iter: int) -> Tensor:
    r"""Positive :math:`\alpha` with :math:`\alpha_i (G\alpha)_i = p_i` for a PD float64 ``G``.

    It minimises the strictly convex :math:`\tfrac12 \alpha^\top G \alpha - \sum_i p_i \log
    \alpha_i`; damped Newton steps that stay in :math:`\alpha > 0` (fraction to the boundary,
    Armijo backtracking), from the solution of the diagonal problem, stop when
    :math:`\max_i |\alpha_i (G\alpha)_i / p_i - 1| \le 10^{-12}` or after ``max_iter`` steps.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._auxinash import bargaining_solution
        >>> G = torch.tensor([[4., 0.], [0., 1.]], dtype=torch.float64)
        >>> bargaining_solution(G, torch.tensor([1., 4.], dtype=torch.float64), 50)
        tensor([0.5000, 2.0000], dtype=torch.float64)
    """
    alpha = (powers / gramian.diagonal()).sqrt()
    value = _negative_nash_product(gramian, alpha, powers)
    for _ in range(max_iter):
        products = gramian @ alpha
        if float((alpha * products / powers - 1).abs().max()) <= _TOL:
            break
        gradient = products - powers / alpha
        hessian = gramian + torch.diag(powers / alpha**2)
        step = -torch.linalg.solve(hessian, gradient)
        slope = float(gradient @ step)
        if not slope < 0:
            break
        to_boundary = torch.where(step < 0, alpha / -step, torch.full_like(alpha, torch.inf))
        t = min(1.0, 0.99 * float(to_boundary.min()))
        while t > 1e-20:
            trial = alpha + t * step
            trial_value = _negative_nash_product(gramian, trial, powers)
            if float(trial_value) <= float(value) + 0.25 * t * slope:
                alpha, value = trial, trial_value
                break
            t *= 0.5
        else:
            break
    return alpha


def auxinash_weights(
    gramian: Tensor, preferences: Tensor, max_norm: float | None, max_iter: int
) -> Tensor:
    r"""AuxiNash weights: the bargaining solution for powers ``preferences``, norm-clipped.

    The powers are clipped at 1e-4 and rescaled to sum to ``m``. Rows with a zero gradient get
    weight 0 (no bargaining point exists for them). When some positive combination of the rows
    vanishes (a Pareto-stationary point), no update improves every objective and the weights
    are 0 (the disagreement point of the game). The solution has
    :math:`\|J^\top\alpha\|^2 = \sum_i p_i = m`; it is scaled down to ``max_norm`` when larger.
    """
    m = gramian.shape[0]
    if m == 0:
        return gramian.new_zeros(0)
    if has_nonfinite(gramian):
        return nan_weights(m, gramian)
    G = gramian.to(torch.float64)
    diag = G.diagonal()
    active = diag > 1e-12 * float(diag.abs().max())
    weights = torch.zeros(m, dtype=torch.float64, device=G.device)
    if not bool(active.any()):
        return weights.to(gramian.dtype)
    powers = preferences.to(G).clamp_min(_MIN_POWER)
    powers = m * powers / powers.sum()
    sub = G[active][:, active]
    scale = float(sub.diagonal().mean())
    sub = sub / scale
    ridged = sub + _RIDGE * torch.eye(sub.shape[0], dtype=sub.dtype, device=sub.device)
    alpha = bargaining_solution(ridged, powers[active], max_iter)
    # Without the ridge, alpha_i (G alpha)_i = p_i has no solution when a positive combination
    # of the rows vanishes (Pareto stationarity); the ridge then carries at least half of some
    # p_i and that objective would be hurt. No agreement improves on disagreement: return 0.
    fit = alpha * (sub @ alpha) / powers[active]
    if not float(fit.min()) >= 0.5:
        return weights.to(gramian.dtype)
    weights[active] = alpha / scale**0.5
    if max_norm is not None:
        norm = float((weights @ G @ weights).clamp_min(0).sqrt())
        if norm > max_norm:
            weights = weights * (max_norm / norm)
    return weights.to(gramian.dtype)


def _check_preferences(preferences: object, name: str) -> Tensor:
    if not isinstance(preferences, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, received {type(preferences)}.")
    if preferences.ndim != 1:
        raise ValueError(
            f"`{name}` must be a vector (1-D tensor) with one bargaining power per "
            f"objective, received shape {tuple(preferences.shape)}."
        )
    check_real_values(preferences, name)
    if bool((preferences < 0).any()):
        raise ValueError(f"`{name}` must be finite and non-negative, received {preferences}.")
    return preferences.detach().clone()


class AuxiNashWeighting(GramianWeighting):
    r"""Gramian weighting of :class:`AuxiNash`.

    Args:
        preferences: bargaining powers :math:`p \ge 0`, one per objective (clipped at 1e-4 and
            rescaled to sum to ``m``; all ones gives Nash-MTL).
        max_norm: the update norm is clipped to this value (``None``: no clipping).
        max_iter: cap on the Newton steps (``>= 1``).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import AuxiNashWeighting
        >>> W = AuxiNashWeighting(torch.tensor([1., 4.]), max_norm=None)
        >>> W(torch.tensor([[4., 0.], [0., 1.]]))
        tensor([0.3162, 1.2649])
    """

    without_autograd = True

    preferences = Hyperparameter(_check_preferences)
    max_norm = Hyperparameter(or_none(floats(low=0.0, low_open=True)))
    max_iter = Hyperparameter(ints(low=1))

    def __init__(
        self, preferences: Tensor, max_norm: float | None = 1.0, max_iter: int = 100
    ) -> None:
        super().__init__()
        self.preferences = preferences
        self.max_norm = max_norm
        self.max_iter = max_iter

    def check_rows(self, m: int) -> None:
        if self.preferences.shape[0] != m:
            raise ValueError(
                f"AuxiNash has {self.preferences.shape[0]} preferences but the Gramian has {m} "
                "rows; give one bargaining power per objective."
            )

    def forward(self, stat: Tensor) -> Tensor:
        self.check_rows(stat.shape[0])
        with torch.no_grad():
            return auxinash_weights(stat, self.preferences, self.max_norm, self.max_iter)

    def extra_repr(self) -> str:
        return f"preferences={self.preferences}, max_norm={self.max_norm}, max_iter={self.max_iter}"


class AuxiNash(GramianWeightedAggregator):
    r"""AuxiNash: asymmetric Nash bargaining between a main task and auxiliary tasks.

    Shamsian, Navon, Glazer, Kawaguchi, Chechik & Fetaya, *Auxiliary Learning as an Asymmetric
    Bargaining Game*, ICML 2023 (arXiv 2301.13501). With fixed bargaining powers :math:`p`
    (Nash-MTL of Navon et al., ICML 2022, is :math:`p = \mathbf 1`), the update
    :math:`d = J^\top\alpha` maximises :math:`\sum_i p_i \log(g_i^\top d)` over the ball; its
    weights solve

    .. math:: \alpha_i \,(G\alpha)_i = p_i, \qquad \alpha > 0,

    found here exactly by Newton's method in torch (the paper's sequential convex
    approximation approximates the same point), and :math:`d` is scaled down to norm
    ``max_norm`` when longer. Every objective improves: :math:`g_i^\top d = p_i/\alpha_i > 0`.
    At a Pareto-stationary point (a positive combination of the rows vanishes) no such
    :math:`\alpha` exists and the update is 0, the disagreement point; zero rows get weight 0.
    The update is scale-free (unit-norm-like whatever the scale of ``J``), so near such points
    the rounding of a float32 Gramian can break :math:`g_i^\top d > 0` by more than the
    suite's tolerance: non-conflict is tested in float64 but not claimed as a property.
    Learning :math:`p` (the bilevel part of the paper) is left to the caller. Stateless.

    Args:
        preferences: bargaining powers :math:`p \ge 0`, one per objective.
        max_norm: clip the update to this norm (default 1.0, as Nash-MTL; ``None``: no clip).
        max_iter: cap on the Newton steps (default 100).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import AuxiNash
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> AuxiNash(torch.ones(2))(J)
        tensor([0.0542, 0.7061, 0.7061])
    """

    properties = frozenset({Property.WEIGHTED})

    preferences = Forwarded(AuxiNashWeighting.preferences)
    max_norm = Forwarded(AuxiNashWeighting.max_norm)
    max_iter = Forwarded(AuxiNashWeighting.max_iter)

    def __init__(
        self, preferences: Tensor, max_norm: float | None = 1.0, max_iter: int = 100
    ) -> None:
        super().__init__(AuxiNashWeighting(preferences, max_norm, max_iter))

    def forward(self, matrix: Tensor) -> Tensor:
        with torch.no_grad():
            return super().forward(matrix)

    def extra_repr(self) -> str:
        return self.gramian_weighting.extra_repr()
