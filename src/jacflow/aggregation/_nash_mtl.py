"""Nash-MTL: multi-task learning as a bargaining game (Navon et al., ICML 2022)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow._stateful import SavesState, Stateful
from jacflow.aggregation._bargaining import ridge_for, solve_power_equation
from jacflow.aggregation._bases import GramianWeighting
from jacflow.aggregation._hyperparameters import Forwarded, Hyperparameter, floats, ints
from jacflow.aggregation._nonfinite import has_nonfinite, nan_weights
from jacflow.aggregation._preset import StatefulGramianPreset
from jacflow.aggregation._properties import Property


def nash_mtl_weights(gramian: Tensor, start: Tensor | None, max_iter: int) -> Tensor:
    r"""The Nash bargaining weights :math:`\alpha > 0` with :math:`G\alpha = 1/\alpha`.

    Solved in float64 on ``gramian``'s device for :math:`\hat G = G / \|G\|_F` (better
    conditioned), whose solution :math:`\hat\alpha` gives
    :math:`\alpha = \hat\alpha / \|G\|_F^{1/2}`; the official code also normalises the
    Gramian and multiplies the factor back into its constraints
    :math:`\alpha_i (G\alpha)_i \ge 1`. ``gramian`` must be finite with a positive norm;
    ``start`` (a previous solution, at any scale) warm-starts the solve.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._nash_mtl import nash_mtl_weights
        >>> nash_mtl_weights(torch.tensor([[4., 0.], [0., 1.]]), None, 20)
        tensor([0.5000, 1.0000], dtype=torch.float64)
    """
    G = gramian.detach().to(torch.float64)
    norm = G.abs().amax()  # (not the Frobenius norm, whose squares under- or overflow)
    G = (G + G.T) / (2 * norm)
    alpha = solve_power_equation(G, 1.0, start, max_iter, ridge_for(gramian.dtype))
    return alpha / norm.sqrt()


def clip_to_norm(weights: Tensor, gramian: Tensor, max_norm: float) -> Tensor:
    """``weights`` scaled so that ``||J^T w|| = sqrt(w^T G w) <= max_norm`` (0: no clipping)."""
    if max_norm == 0:
        return weights
    norm = (weights @ gramian @ weights).clamp_min(0).sqrt()
    return torch.where(norm > max_norm, weights * (max_norm / norm), weights)


class NashMTLWeighting(SavesState, GramianWeighting, Stateful):
    r"""Gramian weighting of :class:`NashMTL` (public here; private in TorchJD).

    Args:
        n_tasks: the number of objectives ``m``; a Gramian of another size raises (``m = 0``
            gives no weights).
        max_norm: the update :math:`J^\top \alpha` is scaled down to this norm when longer
            (``0`` disables the clipping).
        update_weights_every: the bargaining problem is solved on every this-many-th call; the
            calls in between reuse the last weights (clipped again for the new Gramian).
        optim_niter: cap on the Newton iterations per solve (warm-started from the last
            solution; typically 5 to 10 reach a relative residual of 1e-12).

    State:
        the last solution :math:`\alpha` (warm start and reused weights) and the call counter.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import NashMTLWeighting
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> NashMTLWeighting(n_tasks=2)(J @ J.T)
        tensor([0.4182, 0.2878])
    """

    without_autograd = True

    saved_state = ("_alpha", "_step")

    n_tasks = Hyperparameter(ints(low=1), frozen="the state is sized by it")
    max_norm = Hyperparameter(floats(low=0.0))
    update_weights_every = Hyperparameter(ints(low=1))
    optim_niter = Hyperparameter(ints(low=1))

    def __init__(
        self,
        n_tasks: int,
        max_norm: float = 1.0,
        update_weights_every: int = 1,
        optim_niter: int = 20,
    ) -> None:
        super().__init__()
        self.n_tasks = n_tasks
        self.max_norm = max_norm
        self.update_weights_every = update_weights_every
        self.optim_niter = optim_niter
        self._alpha: Tensor | None = None
        self._step = 0

    def reset(self) -> None:
        """Forget the last solution and the call counter."""
        self._alpha = None
        self._step = 0

    def check_rows(self, m: int) -> None:
        if m and m != self.n_tasks:
            raise ValueError(
                f"NashMTL was built with `n_tasks={self.n_tasks}` but received {m} objectives; "
                f"construct it with `n_tasks={m}` (and call `reset()` when the tasks change)."
            )

    def forward(self, stat: Tensor) -> Tensor:
        m = stat.shape[0]
        if m == 0:
            return stat.new_zeros(0)
        self.check_rows(m)
        with torch.no_grad():
            if has_nonfinite(stat):
                return nan_weights(m, stat)
            solve = self._step % self.update_weights_every == 0 or self._alpha is None
            self._step += 1
            if solve:
                if float(stat.abs().amax()) == 0:  # (the norm's squares may underflow)
                    return stat.new_zeros(m)
                start = None if self._alpha is None else self._alpha.to(stat.device)
                self._alpha = nash_mtl_weights(stat, start, self.optim_niter)
            assert self._alpha is not None
            alpha = self._alpha.to(device=stat.device, dtype=stat.dtype)
            return clip_to_norm(alpha, stat, self.max_norm)

    def extra_repr(self) -> str:
        return (
            f"n_tasks={self.n_tasks}, max_norm={self.max_norm}, "
            f"update_weights_every={self.update_weights_every}, optim_niter={self.optim_niter}"
        )


class NashMTL(StatefulGramianPreset):
    r"""Nash-MTL: the Nash bargaining solution between the objectives.

    Navon, Shamsian, Achituve, Maron, Kawaguchi, Chechik & Fetaya, *Multi-Task Learning as a
    Bargaining Game*, ICML 2022 (arXiv 2202.01017), Algorithm 1. The update :math:`d = J^\top
    \alpha` maximises :math:`\sum_i \log(g_i^\top d)` in a ball; its weights solve

    .. math:: G \alpha = 1 / \alpha \ (\text{elementwise}),\quad \alpha \succ 0,
              \qquad G = J J^\top,

    so that :math:`g_i^\top d = 1/\alpha_i > 0` for every objective whenever a solution exists
    (no objective conflicts), and :math:`\|d\|^2 = \sum_i \alpha_i (G\alpha)_i = m`: before
    clipping, the update has norm :math:`\sqrt m` whatever the scale of :math:`J` (so with
    ``max_norm=1`` and :math:`m \ge 2` every update has norm 1, as in the official code). The
    paper solves this by a sequence of convex problems (cvxpy); here it is solved exactly in
    torch by Newton's method on the convex problem
    :math:`\min_{\alpha \succ 0} \frac12 \alpha^\top \hat G \alpha - \sum_i \log \alpha_i`
    for :math:`\hat G = G / \|G\|_F` (better conditioned; :math:`\alpha` is its solution
    divided by :math:`\|G\|_F^{1/2}`), warm started from the previous step. Finally
    :math:`J^\top \alpha` is scaled down to ``max_norm``. This is :class:`AuxiNash` with equal
    bargaining powers. When some non-negative combination of the rows vanishes (a Pareto-stationary
    point) the problem has no solution: a tiny ridge (``1e-12`` of the trace in float64, ``10 eps``
    in lower precision) keeps the weights finite, and the update may then conflict slightly
    (by a relative amount of order 1e-7 in float64 on random such inputs). No warning is
    emitted, ever. Where a solution exists the update is invariant to the order of the rows.

    Args:
        n_tasks: the number of objectives ``m``.
        max_norm: maximal norm of the update (``0``: no clipping).
        update_weights_every: solve every this-many calls, reuse the weights in between.
        optim_niter: cap on the Newton iterations per solve.

    State:
        see :class:`NashMTLWeighting`; :meth:`reset` forgets it.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import NashMTL
        >>> NashMTL(n_tasks=2)(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([0.0542, 0.7061, 0.7061])
    """

    # Non-conflicting and permutation invariant wherever a solution exists (tested on Jacobians of
    # full row rank); not claimed because Pareto-stationary inputs have no solution.
    properties = frozenset({Property.WEIGHTED})

    n_tasks = Forwarded(NashMTLWeighting.n_tasks)
    max_norm = Forwarded(NashMTLWeighting.max_norm)
    update_weights_every = Forwarded(NashMTLWeighting.update_weights_every)
    optim_niter = Forwarded(NashMTLWeighting.optim_niter)

    def __init__(
        self,
        n_tasks: int,
        max_norm: float = 1.0,
        update_weights_every: int = 1,
        optim_niter: int = 20,
    ) -> None:
        super().__init__(NashMTLWeighting(n_tasks, max_norm, update_weights_every, optim_niter))
