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

Small active sets. When ``G`` is positive definite with inverse ``H``, the same iterate follows
from a system of the size of the *active* set: ``v = H mu`` with ``mu_F = 0`` and
``H_AA mu_A = u_A`` (``mu = G v`` are the multipliers up to the factor 2; this is PDAS on the
dual problem ``min mu^T H mu / 2 - u^T mu`` over ``mu >= 0``, whose iterates coincide with the
primal ones). Strongly conflicting objectives (e.g. per-sample gradients) leave most ``v_i``
free and only a few constraints active, so these systems are much smaller. The primal systems
take over when the inverse is too inaccurate to reach the tolerance.

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

import torch
from torch import Tensor

_SHIFT = 1e-13  # relative diagonal shift that makes the Cholesky factor of G_FF exist
_PATIENCE = 3  # iterations without progress of the worst residual before PDAS gives up
_MASKED_MAX_M = 48  # up to this size, full masked systems beat gathering the free blocks
# ``dual_only`` gives up when a step's batched Cholesky (problems x s^3) would cost more: the
# active sets are then too large for the inverse to pay off against ADMM.
_DUAL_ONLY_MAX_FLOP = 3e7


def multiplier_scale(g: Tensor) -> Tensor:
    """``c = 2 max_i G_ii`` per Gramian, ``[B, 1, 1]``: puts ``lam / c`` in the units of ``v``."""
    c = 2 * g.diagonal(dim1=-2, dim2=-1).amax(-1)
    return torch.where(c > 0, c, torch.ones_like(c))[:, None, None]


def kkt_residual(v: Tensor, u: Tensor, lam: Tensor, c: Tensor) -> Tensor:
    """Relative natural residual ``max_i |min(v_i - u_i, lam_i / c)| / max(1, |v|_inf)``.

    It is 0 exactly at the solution (it is the size of a projected-gradient step of length
    ``1/c``); shape ``[B, k]``.
    """
    natural = torch.minimum(v - u, lam / c).abs().amax(-1)
    scale = v.abs().amax(-1).clamp_min(1.0)
    return natural / scale


def _factor_and_solve(system: Tensor, shift: Tensor, rhs: Tensor) -> Tensor:
    """Solve ``system x = rhs`` (Cholesky, LU if not PD), then refine once against the unshifted
    matrix ``system - diag(shift)``."""
    factor, info = torch.linalg.cholesky_ex(system)
    if bool((info != 0).any()):  # not PSD (e.g. a rounded float32 Gramian): LU instead
        x = torch.linalg.solve(system, rhs)
        return x + torch.linalg.solve(system, rhs - (system @ x - shift[..., None] * x))
    x = torch.cholesky_solve(rhs, factor)
    return x + torch.cholesky_solve(rhs - (system @ x - shift[..., None] * x), factor)


def _solve_masked(u: Tensor, g: Tensor, active: Tensor) -> Tensor:
    """As :func:`_solve_free`, with full-size ``m x m`` masked systems (fewer, larger ops)."""
    m = u.shape[-1]
    free = (~active).to(u.dtype)
    v = u * (1 - free)
    rhs = v - free * torch.bmm(v, g)
    pair = free[..., :, None] * free[..., None, :]
    scale = _SHIFT * m * g.diagonal(dim1=-2, dim2=-1).amax(-1).clamp_min(1e-300)
    shift = scale[:, None, None] * free
    system = g[:, None] * pair + torch.diag_embed(1 - free + shift)
    return _factor_and_solve(system, shift, rhs[..., None]).squeeze(-1)


def gather_blocks(g: Tensor, which: Tensor, slots: Tensor, count: Tensor) -> Tensor:
    """``G[slots, slots]`` per problem (``g[which]``; ``slots`` ``[N, S]``, the first ``count``
    of them used), the identity on the unused slots: ``[N, S, S]``."""
    m = g.shape[-1]
    n, size = slots.shape
    flat = ((which[:, None] * m + slots) * m)[:, :, None] + slots[:, None, :]
    # one flat gather (index_select is about twice as fast as take here)
    block = g.reshape(-1).index_select(0, flat.reshape(-1)).reshape(n, size, size)
    used = (torch.arange(size, device=g.device) < count[:, None]).to(g.dtype)
    block.mul_(used[:, :, None]).mul_(used[:, None, :])
    block.diagonal(dim1=-2, dim2=-1).add_(1 - used)
    return block


def _first_slots(mask: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """Indices ``[N, size]`` listing each row's true entries of ``mask`` first, and which of
    them are true."""
    order = torch.topk(mask.to(torch.float32), size, dim=-1, sorted=True).indices
    return order, torch.gather(mask, 1, order)


def _solve_free(u: Tensor, g: Tensor, active: Tensor) -> Tensor:
    """``v`` with ``v_A = u_A`` and ``G_FF v_F = -G_FA u_A`` for every problem's active set."""
    b, k, m = u.shape
    if m <= _MASKED_MAX_M:
        return _solve_masked(u, g, active)
    v = torch.where(active, u, torch.zeros_like(u))
    free = ~active
    s = int(free.sum(-1).amax()) if free.numel() else 0
    if s == 0:
        return v
    p = b * k
    rhs_full = -torch.bmm(v, g).reshape(p, m)  # row form of -G (u restricted to A)
    flat_free = free.reshape(p, m)
    flat_v = v.reshape(p, m)
    order, valid = _first_slots(flat_free, s)
    batch = torch.arange(b, device=u.device).repeat_interleave(k)
    system = gather_blocks(g, batch, order, valid.sum(-1))  # the free entries come first
    shift = _SHIFT * s * g.diagonal(dim1=-2, dim2=-1).amax(-1).clamp_min(1e-300)[batch]
    shift = shift[:, None] * valid.to(system.dtype)
    system.diagonal(dim1=-2, dim2=-1).add_(shift)
    rhs = torch.where(valid, torch.gather(rhs_full, 1, order), torch.zeros_like(shift))[..., None]
    x = _factor_and_solve(system, shift, rhs)
    values = torch.where(valid, x.squeeze(-1), torch.gather(flat_v, 1, order))
    return flat_v.scatter(1, order, values).reshape(b, k, m)


def _solve_active(u: Tensor, inverse: Tensor, active: Tensor) -> Tensor | None:
    """The iterate of :func:`_solve_free` from ``H_AA mu_A = u_A`` and ``v = H mu``
    (``inverse`` = ``H`` = ``G^-1``); ``None`` if some ``H_AA`` is not numerically positive
    definite."""
    b, k, m = u.shape
    p = b * k
    flat_active = active.reshape(p, m)
    s = int(flat_active.sum(-1).amax()) if flat_active.numel() else 0
    if s == 0:
        return torch.zeros_like(u)  # mu = 0: nothing binds
    order, valid = _first_slots(flat_active, s)
    batch = torch.arange(b, device=u.device).repeat_interleave(k)
    system = gather_blocks(inverse, batch, order, valid.sum(-1))
    factor, info = torch.linalg.cholesky_ex(system)
    if bool((info != 0).any()):
        return None
    rhs = torch.where(valid, torch.gather(u.reshape(p, m), 1, order), 0.0)
    mu_active = torch.cholesky_solve(rhs[..., None], factor).squeeze(-1)
    mu = u.new_zeros(p, m).scatter(1, order, torch.where(valid, mu_active, 0.0)).reshape(b, k, m)
    return torch.where(active, u, torch.bmm(mu, inverse))


def active_systems_pay(active: Tensor, dual_only: bool) -> bool:
    """Whether the active systems are smaller than the free ones (and, for ``dual_only``, cheap
    enough)."""
    counts = active.sum(-1)
    size, smallest = int(counts.amax()), int(counts.amin())
    cheap = not dual_only or counts.numel() * size**3 <= _DUAL_ONLY_MAX_FLOP
    return size < active.shape[-1] - smallest and cheap


def pdas_solve(
    u: Tensor,
    g: Tensor,
    v0: Tensor,
    max_iter: int,
    tol: float,
    inverse: Tensor | None = None,
    dual_only: bool = False,
) -> tuple[Tensor, Tensor]:
    """Run PDAS from ``v0`` until every KKT residual is ``<= tol`` or ``max_iter`` solves.

    Returns the best iterate of each problem (lowest residual) and its residual ``[B, k]``.
    Problems already solved keep their active set (above ``m = 48`` the problem slots solved
    for every Gramian leave the batch), so no converged problem can cycle; the
    iterations also stop when the worst residual has not decreased for three of them (a cycle).
    With ``inverse`` (``G^-1``), each step solves the smaller of the free and the active
    systems; once a step leaves some problem's active set unchanged without meeting ``tol``
    (the inverse is too inaccurate), only the free systems are used. ``dual_only`` stops
    instead wherever a step would need a free system, or active systems costing more than
    ``_DUAL_ONLY_MAX_FLOP``.

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
    lam = 2 * torch.bmm(v0, g)
    out_v, out_res = v0, kkt_residual(v0, u, lam, c)
    best_v, best_res = out_v, out_res
    active = lam + c * (u - v0) > 0
    rows = torch.arange(u.shape[1], device=u.device)  # the problem slots still iterated
    compact = u.shape[-1] > _MASKED_MAX_M
    worst, since_gain = float("inf"), 0
    for _ in range(max_iter):
        done = best_res <= tol
        if bool(done.all()):
            break
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
        current = float(best_res.amax())
        since_gain = since_gain + 1 if current >= worst else 0
        worst = min(worst, current)
        if since_gain >= _PATIENCE:
            break
        v = None
        if inverse is not None and active_systems_pay(active, dual_only):
            v = _solve_active(u, inverse, active)
        dual = v is not None
        if v is None:
            if dual_only:
                break
            v = _solve_free(u, g, active)
        lam = 2 * torch.bmm(v, g)
        res = kkt_residual(v, u, lam, c)
        better = res < best_res
        best_v = torch.where(better[..., None], v, best_v)
        best_res = torch.where(better, res, best_res)
        following = torch.where(done[..., None], active, lam + c * (u - v) > 0)
        if dual and bool(((following == active).all(-1) & (best_res > tol)).any()):
            inverse = None  # a fixed point of the inaccurate dual step: free systems from now
        active = following
    if rows.numel() == out_v.shape[1]:  # nothing left the batch
        return best_v, best_res
    return out_v.index_copy(1, rows, best_v), out_res.index_copy(1, rows, best_res)
