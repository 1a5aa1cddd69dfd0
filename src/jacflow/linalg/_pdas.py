"""Batched primal-dual active-set (PDAS) solver of ``min v^T G v  s.t.  v >= u``.

Hintermüller, Ito & Kunisch (2002), *The primal-dual active set strategy as a semismooth Newton
method*. With multipliers ``lam = 2 G v`` the optimality (KKT) conditions are

    v >= u,   lam >= 0,   lam * (v - u) = 0,

equivalently ``min(v - u, lam / c) = 0`` for any ``c > 0``. Given a guess ``A`` of the active set
(``v_A = u_A``), the free part solves ``G_FF v_F = -G_FA u_A`` and the next guess is
``{i : lam_i + c (u_i - v_i) > 0}``. Once the guess is right one solve gives the exact answer.

All problems are solved at once by a batched Cholesky: for ``m <= 48`` as full ``m x m``
systems with the identity on the active rows (fewer, larger operations); above, each free
system is gathered into a padded ``s x s`` block (``s`` = the largest free set) and scattered
back.

Small active sets are solved faster on the inverse Gramian: see ``_dual_pdas``.

Singular Gramians. For ``G = J J^T`` the free system is always consistent
(``G_FA u_A = J_F (J_A^T u_A)`` lies in the range of ``G_FF = J_F J_F^T``), so it is solved
exactly up to rounding: the Cholesky factor is taken of ``G_FF + delta I`` with a tiny
``delta`` (only to make the factorisation exist) followed by a step of iterative refinement
against the unshifted ``G_FF``. The problem itself is never changed: convergence is decided by
the KKT residual evaluated with the exact ``G``.

Internal conventions (see :func:`jacflow.linalg.project_weights`): float64 tensors, ``u`` of
shape ``[B, k, m]`` scaled so that each row has max-norm 1 (or 0), ``g`` of shape ``[B, m, m]``
finite, symmetric, with trace 1 (or 0).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from jacflow.linalg._cholesky import cholesky_ex

_SHIFT = 1e-13  # relative diagonal shift that makes the Cholesky factor of G_FF exist
_PATIENCE = 3  # iterations without progress of the worst residual before PDAS gives up
_MASKED_MAX_M = 48  # up to this size, full masked systems beat gathering the free blocks


def multiplier_scale(g: Tensor) -> Tensor:
    """``c = 2 max_i G_ii`` per Gramian, ``[B, 1, 1]``: puts ``lam / c`` in the units of ``v``."""
    c = 2 * g.diagonal(dim1=-2, dim2=-1).amax(-1)
    return torch.where(c > 0, c, 1.0).reshape(-1, 1, 1)


def start_residual(lam: Tensor, c: Tensor) -> Tensor:
    """:func:`kkt_residual` at ``v = u`` for rows ``u`` of max-norm 1 or 0, with fewer
    operations: the natural residual is then ``max_i max(0, -lam_i) / c`` and the scale 1.

    Example:
        >>> import torch
        >>> from jacflow.linalg._pdas import kkt_residual, start_residual
        >>> u, lam = torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[0.5, -0.25]]])
        >>> c = torch.ones(1, 1, 1)
        >>> start_residual(lam, c), kkt_residual(u, u, lam, c)
        (tensor([[0.2500]]), tensor([[0.2500]]))
    """
    return lam.neg().clamp_min(0).amax(-1) / c[..., 0]


def natural_residual(v: Tensor, u: Tensor, lam: Tensor, c: Tensor) -> Tensor:
    """Natural residual ``max_i |min(v_i - u_i, lam_i / c)|``, in units of the rows ``u``.

    It is 0 exactly at the solution (it is the size of a projected-gradient step of length
    ``1/c``); shape ``[B, k]``.

    Example:
        >>> import torch
        >>> from jacflow.linalg._pdas import natural_residual
        >>> u, v = torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[1.0, 3.0]]])
        >>> natural_residual(v, u, torch.tensor([[[0.5, 0.25]]]), torch.ones(1, 1, 1))
        tensor([[0.2500]])
    """
    return torch.minimum(v - u, lam / c).abs().amax(-1)


def kkt_residual(v: Tensor, u: Tensor, lam: Tensor, c: Tensor) -> Tensor:
    """Relative natural residual ``max_i |min(v_i - u_i, lam_i / c)| / max(1, |v|_inf)``
    (:func:`natural_residual` relative to ``v``'s size); shape ``[B, k]``."""
    return natural_residual(v, u, lam, c) / v.abs().amax(-1).clamp_min(1.0)


def with_exact_bounds(low: Tensor, low_u: Tensor, u: Tensor) -> Tensor:
    """``low``, an iterate computed in a lower precision than ``u`` against ``low_u`` (``u``
    rounded to that precision), in ``u``'s dtype with ``u``'s own values where it holds
    ``low_u``: the constraints it holds active. The implicit backward tells active constraints
    by ``v_i = u_i`` exactly; ``u_i``'s rounding, up to one step above ``u_i``, reads as free.

    Example:
        >>> import torch
        >>> from jacflow.linalg._pdas import with_exact_bounds
        >>> u = torch.tensor([0.1, 0.0], dtype=torch.float64)
        >>> low = torch.tensor([0.1, 0.5], dtype=torch.float32)  # (0.1 held, rounded)
        >>> bool(with_exact_bounds(low, u.float(), u)[0] == u[0]), float(low[0]) == 0.1
        (True, False)
    """
    return torch.where(low == low_u, u, low.to(u.dtype))


def _factor_and_solve(system: Tensor, shift: Tensor, rhs: Tensor) -> Tensor:
    """Solve ``system x = rhs`` (Cholesky, LU if not PD), then refine once against the unshifted
    matrix ``system - diag(shift)``."""
    factor, info = cholesky_ex(system)
    if bool((info != 0).any()):  # not PSD (e.g. a rounded float32 Gramian): LU instead
        x = torch.linalg.solve(system, rhs)
        return x + torch.linalg.solve(system, rhs - (system @ x - shift[..., None] * x))
    x = torch.cholesky_solve(rhs, factor)
    return x + torch.cholesky_solve(rhs - (system @ x - shift[..., None] * x), factor)


def _shift_scale(g: Tensor, size: int) -> Tensor:
    """The diagonal shift of free blocks of size ``size``, per Gramian, ``[B, 1, 1]``."""
    top = g.diagonal(dim1=-2, dim2=-1).amax(-1).clamp_min(1e-300)
    return (_SHIFT * size * top).reshape(-1, 1, 1)


def _solve_masked(u: Tensor, g: Tensor, active: Tensor, scale: Tensor | None = None) -> Tensor:
    """As :func:`_solve_free`, with full-size ``m x m`` masked systems (fewer, larger ops);
    ``scale``: :func:`_shift_scale` of ``g`` when the caller keeps it across iterations."""
    scale = _shift_scale(g, u.shape[-1]) if scale is None else scale
    free = (~active).to(u.dtype)
    v = torch.where(active, u, 0.0)
    rhs = v - free * torch.bmm(v, g)
    shift = scale * free
    system = g[:, None] * (free[..., :, None] * free[..., None, :])
    system.diagonal(dim1=-2, dim2=-1).add_(1 - free + shift)  # the identity on active rows
    return _factor_and_solve(system, shift, rhs[..., None]).squeeze(-1)


def pad_identity(g: Tensor, extra: int | None = None) -> Tensor:
    """``[[G, 0], [0, I]]`` per matrix, ``[B, m + extra, m + extra]`` (``extra`` defaults to
    ``m``): :func:`gather_blocks` reads the unused slots of its blocks (at most ``extra``) from
    the identity part (no masking of the gathered blocks)."""
    b, m, _ = g.shape
    side = m + (m if extra is None else extra)
    padded = g.new_zeros(b, side, side)
    padded[:, :m, :m] = g
    padded[:, m:, m:].diagonal(dim1=-2, dim2=-1).fill_(1.0)
    return padded


def gather_blocks(padded: Tensor, which: Tensor | None, slots: Tensor, used: Tensor) -> Tensor:
    """``G[slots, slots]`` per problem, the identity on the unused slots: ``[N, S, S]``.

    ``padded`` is :func:`pad_identity` of the Gramians with ``extra >= S``, ``which`` the
    Gramian of each problem (``None``: the first), ``slots`` ``[N, S]`` and ``used`` (bool,
    ``[N, S]``) the slots in use, which come first in each row.
    """
    side = padded.shape[-1]
    n, size = slots.shape
    positions = torch.arange(side - size, side, device=slots.device)
    index = torch.where(used, slots, positions)  # unused slots: the identity part
    if padded.numel() < 2**31:  # 32-bit indices: the index arithmetic is about twice as fast
        index = index.to(torch.int32)
        which = None if which is None else which.to(torch.int32)
    rows = index * side if which is None else (which[:, None] * side + index) * side
    flat = rows[:, :, None] + index[:, None, :]
    # one flat gather (index_select is about twice as fast as take or advanced indexing here)
    return padded.reshape(-1).index_select(0, flat.reshape(-1)).reshape(n, size, size)


def first_slots(mask: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """Indices ``[N, size]`` listing each row's true entries of ``mask`` first, and which of
    them are true."""
    # (on the bytes of the mask: no float copy)
    order = torch.topk(mask.view(torch.uint8), size, dim=-1, sorted=True).indices
    return order, torch.gather(mask, 1, order)


def _solve_free(
    u: Tensor,
    g: Tensor,
    active: Tensor,
    padded: Tensor | None = None,
    scale: Tensor | None = None,
) -> Tensor:
    """``v`` with ``v_A = u_A`` and ``G_FF v_F = -G_FA u_A`` for every problem's active set
    (``padded``: :func:`pad_identity` of ``g``, ``scale``: :func:`_shift_scale` of ``g`` for
    the masked systems, when the caller keeps them across iterations)."""
    b, k, m = u.shape
    if m <= _MASKED_MAX_M:
        return _solve_masked(u, g, active, scale)
    v = torch.where(active, u, torch.zeros_like(u))
    free = ~active
    s = int(free.sum(-1).amax()) if free.numel() else 0
    if s == 0:
        return v
    p = b * k
    rhs_full = -torch.bmm(v, g).reshape(p, m)  # row form of -G (u restricted to A)
    flat_free = free.reshape(p, m)
    flat_v = v.reshape(p, m)
    order, valid = first_slots(flat_free, s)
    batch = torch.arange(b, device=u.device).repeat_interleave(k)
    padded = pad_identity(g) if padded is None else padded
    system = gather_blocks(padded, batch, order, valid)  # free entries first
    shift = _shift_scale(g, s).reshape(-1, 1)[batch] * valid.to(system.dtype)
    system.diagonal(dim1=-2, dim2=-1).add_(shift)
    rhs = torch.where(valid, torch.gather(rhs_full, 1, order), torch.zeros_like(shift))[..., None]
    x = _factor_and_solve(system, shift, rhs)
    values = torch.where(valid, x.squeeze(-1), torch.gather(flat_v, 1, order))
    return flat_v.scatter(1, order, values).reshape(b, k, m)


_LEAN_MAX_ITER = 12  # solves of lean_pdas_solve before it hands the problems over


def lean_pdas_solve(u: Tensor, g: Tensor, tol: float) -> Tensor | None:
    """PDAS on one Gramian in the fewest dispatched operations, for small problems on the CPU.

    ``u`` is ``[k, m]``, its rows of max-norm 1 (or 0), and ``g`` ``[m, m]``, symmetric, both
    float64 on the CPU; unlike the other solvers', ``g`` need not have trace 1 (PDAS, its
    stopping rule and the residual below do not change when ``G`` is scaled). With a few
    objectives a batched solve costs its dispatched operations, not its arithmetic, so this loop
    runs in numpy on the tensors' memory (an operation there costs 1-2 us against torch's 5-10
    us on this project's hosts: the loop 2-4x faster at m = 6 to 12, 1.1-1.4x at 16 to 24;
    see docs/performance.md, "Stop 48"). It takes about a
    dozen operations per step (masked ``m x m`` systems, no diagonal shift, no refinement, no
    bookkeeping of best iterates), stops when no active set changes, and checks the KKT
    residual (:func:`kkt_residual`) once, at the end. Ties (``lam_i = 0`` at ``v_i = u_i``, e.g.
    an objective with a zero gradient) count as active, which keeps a zero row of ``G`` out of
    the free systems.

    Returns ``v``, exactly feasible, when every problem's residual is at most ``tol``, else
    ``None`` (a free block that is not numerically positive definite, a cycle,
    ``_LEAN_MAX_ITER`` steps, a NaN): the caller then runs the general solvers, which handle
    those cases.

    Example:
        >>> import torch
        >>> from jacflow.linalg._pdas import lean_pdas_solve
        >>> g = torch.tensor([[0.2, -0.2], [-0.2, 0.8]], dtype=torch.float64)
        >>> lean_pdas_solve(torch.eye(2, dtype=torch.float64), g, 1e-12)
        tensor([[1.0000, 0.2500],
                [1.0000, 1.0000]], dtype=torch.float64)
        >>> lean_pdas_solve(torch.eye(2, dtype=torch.float64), -g, 1e-12) is None  # not PSD
        True
    """
    rows, gram = u.detach().numpy(), g.detach().numpy()
    top = lean_scale(gram)
    identity = np.eye(gram.shape[-1])
    active = rows @ gram >= 0  # PDAS's first guess at v = u, ties active
    with np.errstate(all="ignore"):  # (a NaN fails the final check)
        for _ in range(_LEAN_MAX_ITER):
            free = ~active
            # G_FF on the free rows and columns, the identity elsewhere: v_A = u_A and
            # G_FF v_F = -G_FA u_A in one system per problem
            system = np.where(free[:, :, None] & free[:, None, :], gram, identity)
            fixed = np.where(active, rows, 0.0)
            try:
                np.linalg.cholesky(system)  # (only the test: positive definite free blocks)
                v = np.linalg.solve(system, np.where(active, rows, -(fixed @ gram))[..., None])
            except np.linalg.LinAlgError:
                return None
            v = v[..., 0]
            half_lam = v @ gram
            following = half_lam + top * (rows - v) >= 0
            if not (following != active).any():
                break
            active = following
        else:
            return None
        return lean_certified(v, rows, half_lam, top, tol)


def lean_scale(gram: np.ndarray) -> float:
    """``c / 2`` of :func:`multiplier_scale` for one Gramian in numpy (the lean solvers work
    with half the multipliers, ``lam / 2 = G v``)."""
    top = float(gram.diagonal().max())
    return top if top > 0 else 1.0


def lean_certified(
    v: np.ndarray, rows: np.ndarray, half_lam: np.ndarray, top: float, tol: float
) -> Tensor | None:
    """The lean solvers' end: ``max(v, rows)`` as a tensor when every problem's KKT residual
    (:func:`kkt_residual` in numpy: its torch operations would cost what the loops save, with
    ``half_lam = v G`` and ``top`` from :func:`lean_scale`) is at most ``tol``, else ``None``
    (also for a NaN)."""
    with np.errstate(all="ignore"):
        residual = np.abs(np.minimum(v - rows, half_lam / top)).max(-1)
        if not (residual <= tol * np.maximum(np.abs(v).max(-1), 1.0)).all():
            return None
    return torch.from_numpy(np.maximum(v, rows))


def pdas_solve(
    u: Tensor,
    g: Tensor,
    v0: Tensor,
    max_iter: int,
    tol: float,
    start: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Run PDAS from ``v0`` until every KKT residual is ``<= tol`` or ``max_iter`` solves.

    Returns the best iterate of each problem (lowest residual) and its residual ``[B, k]``.
    Problems already solved keep their active set (above ``m = 48`` the problem slots solved
    for every Gramian leave the batch), so no converged problem can cycle; the
    iterations also stop when the worst residual has not decreased for three of them (a cycle).
    ``start`` is ``(2 v0 G, residual at v0)`` when the caller has them.

    Example:
        >>> import torch
        >>> from jacflow.linalg._pdas import pdas_solve
        >>> g = torch.tensor([[[0.2, -0.2], [-0.2, 0.8]]], dtype=torch.float64)
        >>> u = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
        >>> v, residual = pdas_solve(u, g, u, max_iter=10, tol=1e-12)
        >>> v
        tensor([[[1.0000, 0.2500]]], dtype=torch.float64)
    """
    c = multiplier_scale(g)
    if start is None:
        lam = 2 * torch.bmm(v0, g)
        start = lam, kkt_residual(v0, u, lam, c)
    lam, out_res = start
    out_v = v0
    best_v, best_res = out_v, out_res
    active = lam + c * (u - v0) > 0
    rows = torch.arange(u.shape[1], device=u.device)  # the problem slots still iterated
    compact = u.shape[-1] > _MASKED_MAX_M
    # g is fixed: pad it (compact systems) or scale its shift (masked ones) once, not per step
    padded = pad_identity(g) if compact else None
    scale = None if compact else _shift_scale(g, u.shape[-1])
    worst, since_gain = float("inf"), 0
    for _ in range(max_iter):
        current = float(best_res.amax())  # (solved slots leaving the batch do not change it)
        if current <= tol:
            break
        done = best_res <= tol
        # Slots solved for every Gramian leave the batch; not for m <= 48, where each problem
        # is one masked system and dropping it gains less than the bookkeeping costs.
        keep = ~done.all(0) if compact else None
        if keep is not None and not bool(keep.all()):
            out_v = out_v.index_copy(1, rows, best_v)
            out_res = out_res.index_copy(1, rows, best_res)
            index = keep.nonzero().flatten()
            rows, u, active, done = rows[index], u[:, index], active[:, index], done[:, index]
            best_v, best_res = best_v[:, index], best_res[:, index]
        # PDAS cycles on some degenerate problems: stop once the worst problem stops gaining.
        since_gain = since_gain + 1 if current >= worst else 0
        worst = min(worst, current)
        if since_gain >= _PATIENCE:
            break
        v = _solve_free(u, g, active, padded, scale)
        lam = 2 * torch.bmm(v, g)
        res = kkt_residual(v, u, lam, c)
        better = res < best_res
        best_v = torch.where(better[..., None], v, best_v)
        best_res = torch.where(better, res, best_res)
        active = torch.where(done[..., None], active, lam + c * (u - v) > 0)
    if rows.numel() == out_v.shape[1]:  # nothing left the batch
        return best_v, best_res
    return out_v.index_copy(1, rows, best_v), out_res.index_copy(1, rows, best_res)
