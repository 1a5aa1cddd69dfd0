"""PCD: priority-constrained descent (a primary objective, guaranteed progress on the others)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from jacflow._stateful import SavesState, Stateful
from jacflow.aggregation._bases import GramianWeighting
from jacflow.aggregation._hyperparameters import (
    Forwarded,
    Hyperparameter,
    check_float,
    check_unit_vector,
    floats,
)
from jacflow.aggregation._nonfinite import has_nonfinite, nan_weights
from jacflow.aggregation._preset import StatefulGramianPreset
from jacflow.aggregation._properties import Property


def solve_pcd_qp(gramian: Tensor, taus: Tensor, dependence_tol: float = 1e-9) -> Tensor:
    r"""Weights ``[1, mu_2, ..., mu_m]`` of the solution of PCD's quadratic program.

    .. math:: \min_d \tfrac12\|d - g_1\|^2 \ \text{s.t.}\ g_j^\top d \ge \tau_j \|g_j\|^2
              \ (j \ge 2),\qquad d = g_1 + \sum_{j \ge 2} \mu_j g_j,

    where :math:`\mu \succeq 0` are the KKT multipliers. Solved by the dual active-set method of
    Goldfarb & Idnani (Math. Programming, 1983) for an identity Hessian, written on the Gramian:
    the iterate is always ``d = J^T [1, mu]``, so every inner product is read from ``G``. The
    most violated constraint enters; the step moves ``d`` orthogonally to the active gradients,
    and an active constraint whose multiplier reaches 0 leaves. A gradient whose component
    orthogonal to the active ones has squared norm below ``dependence_tol`` of its own counts as
    dependent (no primal step). Infeasible constraints give ``[1, 0, ..., 0]``.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._pcd import solve_pcd_qp
        >>> G = torch.tensor([[1., -1.], [-1., 1.]], dtype=torch.float64)
        >>> solve_pcd_qp(G, torch.tensor([0.], dtype=torch.float64))
        tensor([1., 1.], dtype=torch.float64)
    """
    m = gramian.shape[0]
    G = gramian
    diag = G.diagonal()
    bounds = taus * diag[1:]
    tol = 1e-9 * float(diag.max())
    w = torch.zeros(m, dtype=G.dtype, device=G.device)
    w[0] = 1
    active: list[int] = []
    for _ in range(20 * m + 20 if m > 1 else 0):
        slack = (G @ w)[1:] - bounds
        if active:
            slack[torch.tensor(active, device=G.device) - 1] = math.inf
        p = int(slack.argmin()) + 1
        violation = -float(slack[p - 1])
        if violation <= tol:
            return w
        while True:
            if active:
                idx = torch.tensor(active, device=G.device)
                # Active gradients are independent (dependent ones never enter): G_AA is PD.
                r, info = torch.linalg.solve_ex(G[idx][:, idx], G[idx, p])
                if int(info) != 0:
                    r = torch.linalg.pinv(G[idx][:, idx], hermitian=True) @ G[idx, p]
            else:
                idx = torch.zeros(0, dtype=torch.long, device=G.device)
                r = G.new_zeros(0)
            orthogonal = float(G[p, p] - G[p, idx] @ r) if active else float(G[p, p])
            violation = float(bounds[p - 1] - (G @ w)[p])
            full = violation / orthogonal if orthogonal > dependence_tol * float(G[p, p]) else None
            positive = r > 0
            partial = None
            if bool(positive.any()):
                ratios = w[idx][positive] / r[positive]
                partial = float(ratios.min())
                leaving = int(idx[positive][int(ratios.argmin())])
            if full is None and partial is None:
                w = torch.zeros_like(w)
                w[0] = 1
                return w  # the constraints are infeasible
            if partial is not None and (full is None or partial < full):
                w[idx] -= partial * r
                w[p] += partial
                w[leaving] = 0
                active.remove(leaving)
                continue
            assert full is not None
            w[idx] -= full * r
            w[p] += full
            active.append(p)
            break
    return w


def _check_tau(tau: object, name: str) -> float | Tensor:
    if isinstance(tau, Tensor):
        expected = "a float or a 1-D tensor (one value per secondary objective)"
        return check_unit_vector(tau, name, expected)
    return check_float(tau, name, low=0.0, high=1.0)


class PCDWeighting(SavesState, GramianWeighting, Stateful):
    r"""Gramian weighting of :class:`PCD`; row and column 0 belong to the primary objective.

    Args:
        tau: fraction :math:`\tau_j \in [0, 1]` of normalised progress guaranteed to each
            secondary objective: a float, or a 1-D tensor of length ``m - 1``.
        beta: decay :math:`\beta \in [0, 1)` of the moving average of the squared norms.
        eps: :math:`\epsilon \ge 0` added to that average before its inverse square root.

    State:
        the (bias-corrected) exponential moving average of the squared gradient norms
        :math:`\mathrm{diag}(G)`, float64, and the number of calls; re-initialised when the
        number of objectives changes.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import PCDWeighting
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> PCDWeighting()(J @ J.T)
        tensor([1.8481, 1.0954])
    """

    without_autograd = True

    saved_state = ("_sq_norm_ema", "_calls")

    tau = Hyperparameter(_check_tau)
    beta = Hyperparameter(floats(low=0.0, high=1.0, high_open=True))
    eps = Hyperparameter(floats(low=0.0))

    def __init__(self, tau: float | Tensor = 0.02, beta: float = 0.999, eps: float = 1e-8) -> None:
        super().__init__()
        self.tau = tau
        self.beta = beta
        self.eps = eps
        self.reset()

    def reset(self) -> None:
        """Forget the moving average of the squared norms."""
        self._sq_norm_ema: Tensor | None = None
        self._calls = 0

    def check_rows(self, m: int) -> None:
        if m > 0 and isinstance(self.tau, Tensor) and self.tau.shape[0] != m - 1:
            raise ValueError(
                f"`tau` has {self.tau.shape[0]} entries but there are {m - 1} secondary "
                "objectives; give one value per row after the first."
            )

    def _taus(self, m: int, like: Tensor) -> Tensor:
        self.check_rows(m)
        if isinstance(self.tau, Tensor):
            return self.tau.to(like)
        return torch.full((m - 1,), self.tau, dtype=like.dtype, device=like.device)

    def forward(self, stat: Tensor) -> Tensor:
        m = stat.shape[0]
        with torch.no_grad():
            if m == 0:
                return stat.new_zeros(0)
            G = stat.detach().to(torch.float64)
            taus = self._taus(m, G)
            if has_nonfinite(G):
                return nan_weights(m, stat)
            G = (G + G.T) / 2
            sq_norms = G.diagonal().clamp_min(0)
            ema = self._sq_norm_ema
            if ema is None or ema.shape[0] != m:
                ema, self._calls = torch.zeros_like(sq_norms), 0
            ema = self.beta * ema.to(sq_norms) + (1 - self.beta) * sq_norms
            self._sq_norm_ema, self._calls = ema, self._calls + 1
            denominators = (ema / (1 - self.beta**self._calls) + self.eps).sqrt()
            scales = torch.where(denominators > 0, 1 / denominators, torch.zeros_like(ema))
            if float(sq_norms[0]) == 0:
                return stat.new_zeros(m)
            normalized = G * torch.outer(scales, scales)
            precision = 10 * torch.finfo(stat.dtype).eps
            w = solve_pcd_qp(normalized, taus, dependence_tol=max(1e-9, precision))
            direction = float(w @ normalized @ w)
            magnitude = float(w.abs() @ normalized.diagonal().sqrt()) ** 2
            if direction <= precision * magnitude:
                return stat.new_zeros(m)
            weights = w * scales * math.sqrt(float(sq_norms[0]) / direction)
            return weights.to(stat.dtype)

    def extra_repr(self) -> str:
        return f"tau={self.tau}, beta={self.beta}, eps={self.eps}"


class PCD(StatefulGramianPreset):
    r"""PCD: priority-constrained descent on the first objective.

    *Not All Objectives Are Born Equal: Priority-Constrained Descent for Hierarchical
    Multi-Objective Optimization*, TMLR 2026 (arXiv 2606.29521, as cited by TorchJD 0.18; the
    authors are not named there). Row 0 of the Jacobian is the primary objective. With the
    gradients normalised by the running RMS of their norms, :math:`\tilde g_i = g_i / \sqrt{
    \hat v_i + \epsilon}` (:math:`\hat v` the bias-corrected EMA of :math:`\|g_i\|^2`), the
    direction is the closest one to the primary gradient that guarantees every secondary
    objective a fraction :math:`\tau_j` of its own first-order progress:

    .. math:: \tilde d = \arg\min_d \tfrac12\|d - \tilde g_1\|^2 \ \text{s.t.}\
              \tilde g_j^\top d \ge \tau_j \|\tilde g_j\|^2\ (j \ge 2),\qquad
              d = \frac{\|g_1\|}{\|\tilde d\|}\,\tilde d,

    solved exactly from the Gramian (Goldfarb-Idnani dual active set). If the constraints are
    infeasible, :math:`\tilde d = \tilde g_1`; if :math:`g_1 = 0` or :math:`\tilde d = 0`, the
    update is 0. Not permutation invariant (row 0 is special), not linear under scaling.

    Args:
        tau, beta, eps: see :class:`PCDWeighting`.

    State:
        see :class:`PCDWeighting`; :meth:`reset` forgets it.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import PCD
        >>> PCD()(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([-0.8200,  2.9434,  2.9434])
    """

    properties = frozenset({Property.WEIGHTED})

    tau = Forwarded(PCDWeighting.tau)
    beta = Forwarded(PCDWeighting.beta)
    eps = Forwarded(PCDWeighting.eps)

    def __init__(self, tau: float | Tensor = 0.02, beta: float = 0.999, eps: float = 1e-8) -> None:
        super().__init__(PCDWeighting(tau, beta, eps))
