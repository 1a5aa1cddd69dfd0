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

from jacflow.linalg._anderson import (
    AndersonState,
    anderson_start,
    anderson_step,
    anderson_take,
)
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
# Anderson acceleration of ADMM: its history's columns, within a budget of elements (the two
# histories hold 2 h columns of every problem's m entries: 4x the iterates at h = 2).
_ANDERSON_MEMORY = 5
# (below, a step's product costs less than the acceleration's dozen more operations: UPGrad on
# the benchmark's degenerate Gramian at m = 128 took 35 ms with it against 25 ms without)
_ANDERSON_MIN_M = 192
_ANDERSON_MAX_ELEMENTS = 2**24
_REG = {torch.float32: 1e-5, torch.float64: 1e-10}  # its least squares' Tikhonov term
_SLOW_CHECKS, _SLOW_GAIN = 5, 10.0  # it starts where the residual fell < 10x in 5 checks
_SLOW_FLOAT32_ABOVE = 1e-4
# Every _SLOW_CHECKS checks, the acceleration must have divided the worst residual by this, or
# it stops for good (nearly parallel rows: plain ADMM and the accelerated one both stall, the
# latter at up to twice the cost per step).
_ACCELERATED_GAIN = 2.0


def anderson_memory(problems: int, m: int) -> int:
    """Columns of ADMM's Anderson history for ``problems`` of size ``m``: at most
    ``_ANDERSON_MEMORY``, within ``_ANDERSON_MAX_ELEMENTS``; 0 (none) below 2, and below
    ``_ANDERSON_MIN_M`` objectives.

    Example:
        >>> from jacflow.linalg._first_order import anderson_memory
        >>> anderson_memory(512, 512), anderson_memory(4096, 4096), anderson_memory(128, 128)
        (5, 0, 0)
    """
    if m < _ANDERSON_MIN_M:
        return 0
    memory = min(_ANDERSON_MEMORY, _ANDERSON_MAX_ELEMENTS // max(1, 2 * problems * m))
    return memory if memory >= 2 else 0


def _slow(history: list[float]) -> bool:
    """Whether the worst residual fell less than ``_SLOW_GAIN`` times over the last
    ``_SLOW_CHECKS`` checks: then Anderson's acceleration pays for its work per step (0.65 to
    1.1 times a plain step's on this project's CPU host, from m = 512 down to 192), not on the
    problems plain ADMM solves quickly."""
    return len(history) > _SLOW_CHECKS and history[-1] > history[-1 - _SLOW_CHECKS] / _SLOW_GAIN


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
    anderson: bool = True,
) -> tuple[Tensor, Tensor]:
    """Over-relaxed ADMM with one eigendecomposition of ``G`` shared by all problems.

    Splits ``v = z`` with ``z >= u`` (Boyd et al. 2011, section 5.2 and 3.4.3). The ``v``-update
    ``(2 G + rho I)^{-1} rho (z - w)`` is one product with the fixed matrix
    ``Q diag(rho / (2 lambda + rho)) Q^T``; ``rho`` is the geometric mean of the extreme
    eigenvalues of ``G`` (the smallest clipped to ``1e-6`` times the largest), a classical
    choice for quadratic programs. Returns the best (feasible) ``z`` iterate of each problem and
    its KKT residual ``[B, k]``; converged rows are dropped from the batch as in
    :func:`fista_solve`.

    With ``anderson`` (and from ``_ANDERSON_MIN_M`` objectives), once the worst residual falls
    less than 10x in 5 checks, the iteration ``t <- F(t)`` on ``t = z + w`` is accelerated by
    :mod:`jacflow.linalg._anderson` (5 columns of history; its steps cost up to twice plain
    ones). It stops for good where it fails to halve the worst residual in 5 checks (both
    stall on nearly parallel rows). UPGrad's weights on the benchmark's per-sample Gramian of
    real images at m = 512 took 700 ADMM steps without it, 150 with it; on problems that ADMM
    solves quickly it never starts. The stall test reads plain ADMM's residuals as they are
    and, once the acceleration has run, each problem's best.

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
    t = bound  # the iterate: z = max(t, u) and the scaled dual variable w = t - z
    m = u.shape[-1]
    memory = anderson_memory(u.shape[0] * u.shape[1], m) if anderson else 0
    accelerated: AndersonState | None = None  # (started once plain ADMM proves slow)
    anchor, since = 0.0, 0  # (its safeguard: see _ACCELERATED_GAIN)
    spent, budget = 0, 0  # ADMM's multiply-adds, and those a polish waits for
    for it in range(max_iter):
        spent += t.shape[1] * m * m
        z = torch.maximum(t, bound)
        w = t - z
        # over-relaxed v-update (1 - relax) z + relax (z - w) S, as one fused product, then
        # the dual step: F(t) = w + that
        mapped = torch.baddbmm(z, z - w, step, beta=1 - relax).add_(w)
        t = mapped if accelerated is None else anderson_step(accelerated, t, mapped, _REG[dtype])
        if (it + 1) % check_every == 0 or it + 1 == max_iter:
            z = torch.maximum(t, bound)
            held = with_exact_bounds(z, bound, uu) if dtype != g.dtype else z
            exact = torch.maximum(held, uu)  # feasible also where float32 rounded u
            res = kkt_residual(exact, uu, 2 * torch.bmm(exact, g), c)
            if polish_iter and it + 1 >= _POLISH_MIN_STEPS:
                close = ((res <= _POLISH_FROM) & (res > tol)).all(0).nonzero().flatten()
                if len(close) and not budget:  # (set once, from the first close problems)
                    free = int((exact[:, close] > uu[:, close]).sum(-1).amax())
                    budget = _POLISH_AFTER * t.shape[1] * free**3
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
            # each problem's best iterate (the accelerated residuals do not fall monotonically)
            best = out_res[:, rows]
            improved = res < best
            raw_worst = res.amax()
            res = torch.where(improved, res, best)
            out_v = out_v.index_copy(
                1, rows, torch.where(improved[..., None], exact, out_v[:, rows])
            )
            out_res = out_res.index_copy(1, rows, res)
            worst = res.amax()
            keep = (res > tol).any(0)
            if not bool(keep.any()):
                break
            low = dtype != g.dtype
            # (plain ADMM's stall test reads its residuals as they are, as before; once the
            # acceleration has started (anchor set), through each problem's best, as the
            # accelerated residuals do not fall monotonically)
            watched = worst if anchor else raw_worst
            stalled = _stalled(history, watched, 10 if low else _STALL_CHECKS)  # records it once
            if low and (worst <= _FLOAT32_FLOOR or stalled):
                dtype = g.dtype  # float32 is done (or not enough for these problems): float64
                step = relax * _admm_operator(g, dtype)
                t, bound = exact + (t - z).to(dtype), uu  # (the same dual variable w)
                if accelerated is not None:
                    accelerated, anchor, since = anderson_start(t, memory), float(worst), 0
                history.clear()
            elif stalled:
                break
            if accelerated is not None:
                since += 1
                if since == _SLOW_CHECKS:
                    # (the safeguard: see _ACCELERATED_GAIN)
                    if float(worst) > anchor / _ACCELERATED_GAIN:
                        accelerated, memory = None, 0
                    anchor, since = float(worst), 0
            elif memory and _slow(history):
                # (not near float32's floor, where its rounding, not ADMM, slows the residual,
                # nor where every problem is about to be polished)
                near_floor = low and float(worst) <= _SLOW_FLOAT32_ABOVE
                polish_due = bool(budget) and 2 * spent >= budget and float(worst) <= _POLISH_FROM
                if not (near_floor or polish_due):
                    accelerated, anchor, since = anderson_start(t, memory), float(worst), 0
            if not bool(keep.all()):
                index = keep.nonzero().flatten()
                rows, uu, bound, t = rows[index], uu[:, index], bound[:, index], t[:, index]
                if accelerated is not None:
                    accelerated = anderson_take(accelerated, index)
    return out_v, out_res
