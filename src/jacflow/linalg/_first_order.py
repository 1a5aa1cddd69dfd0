"""Batched first-order solvers (FISTA, ADMM) for ``min v^T G v  s.t.  v >= u``.

Beck & Teboulle (2009) with the gradient restart of O'Donoghue & Candès (2015). One iteration of
all problems is one batched product ``V G`` plus element-wise operations; the projection onto
``{v >= u}`` is ``max(., u)``. The step is ``1 / (2 lambda_max(G))``, with ``lambda_max`` from a
symmetric eigenvalue solve (exact, unlike a power iteration, so the step is always safe).

Convergence is checked every ``check_every`` iterations with the KKT residual of
:mod:`jacflow.linalg._pdas`; rows whose every problem has converged are then dropped from the
batch, so the cost follows the slowest problems only. Both methods also stop when the worst
residual stagnates (less than a 2x gain in 50 checks). Conventions as in ``_pdas``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow.linalg._pdas import kkt_residual, multiplier_scale, pdas_solve, with_exact_bounds

_STALL_CHECKS = 50
_FLOAT32_FLOOR = 1e-6  # the float32 phase of ADMM hands over to float64 below this residual
# ADMM's polish: PDAS from its iterate once every residual is below _POLISH_FROM (from 1e-2 it
# failed on a per-sample Gramian, from 1e-3 it solved every problem) and ADMM has spent as
# many multiply-adds as _POLISH_AFTER PDAS steps (k m^2 per ADMM step, k s^3 per PDAS step on
# free sets of size s), so that problems ADMM solves quickly are not polished.
_POLISH_FROM = 1e-3
_POLISH_AFTER = 10
_POLISH_MIN_STEPS = 100  # (problems solved within them are not looked at: its checks cost too)


def _stalled(history: list[float], worst: Tensor, window: int = _STALL_CHECKS) -> bool:
    """Record the worst residual; true when it gained less than 2x over the last ``window``
    checks (e.g. a rounded, indefinite ``G``)."""
    history.append(float(worst))
    return len(history) > window and history[-1] > 0.5 * history[-1 - window]


def fista_solve(
    u: Tensor, g: Tensor, v0: Tensor, max_iter: int, tol: float, check_every: int = 10
) -> tuple[Tensor, Tensor]:
    """FISTA from ``v0`` until every KKT residual is ``<= tol`` or ``max_iter`` iterations.

    Returns the last iterate of each problem and its KKT residual ``[B, k]``.

    Example:
        >>> import torch
        >>> from jacflow.linalg._first_order import fista_solve
        >>> g = torch.tensor([[[0.2, -0.2], [-0.2, 0.8]]], dtype=torch.float64)
        >>> u = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
        >>> v, residual = fista_solve(u, g, u, max_iter=500, tol=1e-12)
        >>> v
        tensor([[[1.0000, 0.2500]]], dtype=torch.float64)
    """
    c = multiplier_scale(g)
    top = torch.linalg.eigvalsh(g)[..., -1]
    step = (0.5 / torch.where(top > 0, top, torch.ones_like(top)))[:, None, None]
    out_v = torch.maximum(v0, u)
    out_res = kkt_residual(out_v, u, 2 * torch.bmm(out_v, g), c)
    rows = torch.arange(u.shape[1], device=u.device)
    history: list[float] = []
    uu, v = u, out_v
    y = v
    t = torch.ones_like(v[..., :1])
    for it in range(max_iter):
        v_new = torch.maximum(y - step * 2 * torch.bmm(y, g), uu)
        restart = ((y - v_new) * (v_new - v)).sum(-1, keepdim=True) > 0
        t_new = (1 + torch.sqrt(1 + 4 * t * t)) / 2
        beta = torch.where(restart, torch.zeros_like(t), (t - 1) / t_new)
        t = torch.where(restart, torch.ones_like(t), t_new)
        y = v_new + beta * (v_new - v)
        v = v_new
        if (it + 1) % check_every == 0 or it + 1 == max_iter:
            res = kkt_residual(v, uu, 2 * torch.bmm(v, g), c)
            out_v = out_v.index_copy(1, rows, v)
            out_res = out_res.index_copy(1, rows, res)
            keep = (res > tol).any(0)
            if not bool(keep.any()) or _stalled(history, res.amax()):
                break
            if not bool(keep.all()):
                index = keep.nonzero().flatten()
                rows, uu, v, y, t = (
                    rows[index],
                    uu[:, index],
                    v[:, index],
                    y[:, index],
                    t[:, index],
                )
    return out_v, out_res


def _admm_operator(g: Tensor, dtype: torch.dtype) -> Tensor:
    """``Q diag(rho / (2 lambda + rho)) Q^T`` in ``dtype``, with ``rho`` the geometric mean of the
    extreme eigenvalues of ``G`` (the smallest clipped to ``1e-6`` times the largest)."""
    eigenvalues, q = torch.linalg.eigh(g.to(dtype))
    eigenvalues = eigenvalues.clamp_min(0.0)
    top = eigenvalues[..., -1:].clamp_min(torch.finfo(dtype).tiny)
    bottom = torch.where(eigenvalues > 1e-6 * top, eigenvalues, top).amin(-1, keepdim=True)
    rho = top.sqrt() * bottom.sqrt()  # [B, 1] (top * bottom underflows for a zero G: 0 / 0)
    return (q * (rho / (2 * eigenvalues + rho))[:, None, :]) @ q.mT


def admm_solve(
    u: Tensor,
    g: Tensor,
    max_iter: int,
    tol: float,
    check_every: int = 10,
    relax: float = 1.6,
    low_precision: bool = False,
    polish_iter: int = 0,
) -> tuple[Tensor, Tensor]:
    """Over-relaxed ADMM with one eigendecomposition of ``G`` shared by all problems.

    Splits ``v = z`` with ``z >= u`` (Boyd et al. 2011, section 5.2 and 3.4.3). The ``v``-update
    ``(2 G + rho I)^{-1} rho (z - w)`` is one product with the fixed matrix
    ``Q diag(rho / (2 lambda + rho)) Q^T``; ``rho`` is the geometric mean of the extreme
    eigenvalues of ``G`` (the smallest clipped to ``1e-6`` times the largest), a classical
    choice for quadratic programs. Returns the (feasible) ``z`` iterate of each problem and its
    KKT residual ``[B, k]``; converged rows are dropped from the batch as in :func:`fista_solve`.

    With ``low_precision`` the iterations (the eigendecomposition and the products, nearly all
    the cost) start in float32, about twice as fast; the residuals are still measured in float64
    against the true ``G``. Once the worst residual is below ``1e-6`` (or stalls) and ``tol`` is
    not met yet, the iterations go on in float64 from where they are.

    With ``polish_iter``, from the 100th step, the exact PDAS
    (:func:`jacflow.linalg._pdas.pdas_solve`, that many steps) is tried from the iterates of
    the problems that are close (every residual below ``1e-3``) once ADMM has spent as much as
    ten PDAS steps on them would cost: the problems it solves leave the batch (the others go
    on, their ADMM state intact; after a failed try the next one waits until the spending
    doubles). On ill-conditioned Gramians ADMM's last digits take thousands of steps: UPGrad on
    a per-sample Gramian of condition 1e5 at m = 512 took 2,900 (12.8 s), with the polish 2.2 s.

    Example:
        >>> import torch
        >>> from jacflow.linalg._first_order import admm_solve
        >>> g = torch.tensor([[[0.2, -0.2], [-0.2, 0.8]]], dtype=torch.float64)
        >>> u = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
        >>> v, residual = admm_solve(u, g, max_iter=500, tol=1e-12)
        >>> v
        tensor([[[1.0000, 0.2500]]], dtype=torch.float64)
    """
    c = multiplier_scale(g)
    dtype = torch.float32 if low_precision else g.dtype
    step = relax * _admm_operator(g, dtype)  # the relaxation folded into the operator
    out_v = u.clone()
    out_res = kkt_residual(u, u, 2 * torch.bmm(u, g), c)
    rows = torch.arange(u.shape[1], device=u.device)
    history: list[float] = []
    uu = u
    bound = u.to(dtype)
    z = bound
    w = torch.zeros_like(z)  # the scaled dual variable, updated in place
    m = u.shape[-1]
    spent, budget = 0, 0  # ADMM's multiply-adds, and those a polish waits for
    for it in range(max_iter):
        spent += z.shape[1] * m * m
        # over-relaxed v-update (1 - relax) z + relax (z - w) S, as one fused product
        relaxed = torch.baddbmm(z, z - w, step, beta=1 - relax)
        w = w.add_(relaxed)
        z = torch.maximum(w, bound)
        w = w.sub_(z)
        if (it + 1) % check_every == 0 or it + 1 == max_iter:
            held = with_exact_bounds(z, bound, uu) if dtype != g.dtype else z
            exact = torch.maximum(held, uu)  # feasible also where float32 rounded u
            res = kkt_residual(exact, uu, 2 * torch.bmm(exact, g), c)
            if polish_iter and it + 1 >= _POLISH_MIN_STEPS:
                close = ((res <= _POLISH_FROM) & (res > tol)).all(0).nonzero().flatten()
                if len(close) and not budget:  # (set once, from the first close problems)
                    free = int((exact[:, close] > uu[:, close]).sum(-1).amax())
                    budget = _POLISH_AFTER * z.shape[1] * free**3
                if len(close) and spent >= budget:
                    polished, polished_res = pdas_solve(
                        uu[:, close], g, exact[:, close], polish_iter, tol
                    )
                    better = polished_res < res[:, close]
                    exact = exact.index_copy(
                        1, close, torch.where(better[..., None], polished, exact[:, close])
                    )
                    res = res.index_copy(1, close, torch.minimum(polished_res, res[:, close]))
                    if bool((polished_res > tol).any()):  # (a failed try: wait longer)
                        budget = 2 * spent
            worst = res.amax()
            out_v = out_v.index_copy(1, rows, exact)
            out_res = out_res.index_copy(1, rows, res)
            keep = (res > tol).any(0)
            if not bool(keep.any()):
                break
            low = dtype != g.dtype
            stalled = _stalled(history, worst, 10 if low else _STALL_CHECKS)  # records it once
            if low and (worst <= _FLOAT32_FLOOR or stalled):
                dtype = g.dtype  # float32 is done (or not enough for these problems): float64
                step = relax * _admm_operator(g, dtype)
                z, w, bound = exact, w.to(dtype), uu
                history.clear()
            elif stalled:
                break
            if not bool(keep.all()):
                index = keep.nonzero().flatten()
                rows, uu, bound = rows[index], uu[:, index], bound[:, index]
                z, w = z[:, index], w[:, index]
    return out_v, out_res
