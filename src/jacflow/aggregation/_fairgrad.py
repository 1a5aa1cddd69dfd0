"""FairGrad: fair resource allocation between objectives (Ban & Ji, ICML 2024)."""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from jacflow.aggregation._bargaining import ridge_for, solve_power_equation
from jacflow.aggregation._bases import GramianWeighting
from jacflow.aggregation._hyperparameters import (
    Forwarded,
    Hyperparameter,
    check_float,
    ints,
    or_none,
)
from jacflow.aggregation._mean import mean_weights
from jacflow.aggregation._nonfinite import has_nonfinite, nan_weights
from jacflow.aggregation._preset import NoGradGramianPreset
from jacflow.aggregation._properties import Property

_DEFAULT_MAX_ITERS = 100


def fairgrad_weights(gramian: Tensor, alpha: float, max_iters: int) -> Tensor:
    r"""Weights :math:`w \succ 0` with :math:`G w = w^{-1/\alpha}`; ``1/m`` each when ``alpha = 0``.

    Solved in float64 on ``gramian``'s device. A non-finite Gramian gives NaN weights and a zero
    Gramian zero weights (the update is zero whatever the weights).
    """
    m = gramian.shape[0]
    if m == 0 or alpha == 0:
        return mean_weights(m, gramian)
    if has_nonfinite(gramian):
        return nan_weights(m, gramian)
    G = gramian.detach().to(torch.float64)
    if float(G.diagonal().sum()) <= 0:
        return gramian.new_zeros(m)
    G = (G + G.T) / 2
    ridge = ridge_for(gramian.dtype)
    return solve_power_equation(G, 1.0 / alpha, None, max_iters, ridge).to(gramian.dtype)


def _check_alpha(value: object, name: str) -> float:
    """``value`` if it is a float ``>= 0``, kept as given (an int stays an int, as in the label
    ``2-FairGrad``: TorchJD's); the maths read it as a number either way.

    Example:
        >>> from jacflow.aggregation._fairgrad import _check_alpha
        >>> _check_alpha(2, "alpha"), _check_alpha(0.5, "alpha")
        (2, 0.5)
    """
    check_float(value, name, low=0.0)
    return cast(float, value)  # (an int or a float: check_float refuses the rest)


class FairGradWeighting(GramianWeighting):
    r"""Gramian weighting of :class:`FairGrad`.

    Args:
        alpha: the fairness exponent :math:`\alpha \ge 0` (0 gives the mean, 1 proportional
            fairness, large values approach max-min fairness).
        max_iters: cap on the Newton iterations (default ``None``: 100; TorchJD passes it to
            scipy's ``least_squares`` as ``max_nfev``).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import FairGradWeighting
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> FairGradWeighting(alpha=1.0)(J @ J.T)
        tensor([0.5915, 0.4071])
    """

    without_autograd = True

    alpha = Hyperparameter(_check_alpha)
    max_iters = Hyperparameter(or_none(ints(low=1)))

    def __init__(self, alpha: float, max_iters: int | None = None) -> None:
        super().__init__()
        self.alpha = alpha
        self.max_iters = max_iters

    def forward(self, stat: Tensor) -> Tensor:
        with torch.no_grad():
            cap = _DEFAULT_MAX_ITERS if self.max_iters is None else self.max_iters
            return fairgrad_weights(stat, self.alpha, cap)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, max_iters={self.max_iters}"

    def __str__(self) -> str:
        return f"{self.alpha}-FairGrad"  # (alpha as given: TorchJD's label)


class FairGrad(NoGradGramianPreset):
    r"""FairGrad: the update of :math:`\alpha`-fair utility maximisation between objectives.

    Ban & Ji, *Fair Resource Allocation in Multi-Task Learning*, ICML 2024 (arXiv 2402.15638).
    The update :math:`d = J^\top w` maximises :math:`\sum_i u_\alpha(g_i^\top d)` in a ball, with
    the :math:`\alpha`-fair utility :math:`u_\alpha(x) = x^{1-\alpha}/(1-\alpha)`
    (:math:`\log x` for :math:`\alpha = 1`); its weights solve

    .. math:: G w = w^{-1/\alpha} \ (\text{elementwise}),\quad w \succ 0,\qquad G = J J^\top,

    so :math:`g_i^\top d = w_i^{-1/\alpha} > 0` for all objectives whenever a solution exists.
    The fixed point is solved exactly in torch by Newton's method on the strictly convex problem
    :math:`\min_{w \succ 0} \frac12 w^\top G w - \sum_i \frac{w_i^{1-1/\alpha}}{1-1/\alpha}`
    (:math:`\sum_i \log w_i` for :math:`\alpha = 1`). ``alpha = 0`` gives the mean. At a
    Pareto-stationary point (no solution), a tiny ridge keeps the weights finite. Where a solution
    exists the update is non-conflicting and invariant to the order of the rows.
    :math:`\alpha = 1` is Nash-MTL without normalisation or clipping.

    Args:
        alpha: the fairness exponent, ``alpha >= 0``.
        max_iters: cap on the Newton iterations (``None``: 100).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import FairGrad
        >>> FairGrad(alpha=1.0)(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([0.0766, 0.9985, 0.9985])
    """

    # Non-conflicting and permutation invariant wherever a solution exists (tested on Jacobians of
    # full row rank); not claimed because Pareto-stationary inputs have no solution.
    properties = frozenset({Property.WEIGHTED})

    alpha = Forwarded(FairGradWeighting.alpha)
    max_iters = Forwarded(FairGradWeighting.max_iters)

    def __init__(self, alpha: float, max_iters: int | None = None) -> None:
        super().__init__(FairGradWeighting(alpha, max_iters))

    def __str__(self) -> str:
        return str(self.gramian_weighting)
