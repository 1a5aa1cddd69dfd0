"""Batched Lawson-Hanson active set for ``min v^T G v  s.t.  v >= u``: exact on degenerate G.

Writing ``v = u + x`` and ``G = R R^T`` the problem is the non-negative least-squares problem
``min_{x >= 0} |R^T (u + x)|^2`` (Lawson & Hanson, 1974, ch. 23). The method grows a passive
set ``P`` one index at a time (the most negative gradient entry ``(G v)_j``), solves the
least-squares problem restricted to ``P`` (``G_PP x_P = -(G u)_P``) and, when that leaves the
orthant, steps back to the boundary and drops the indices that reached zero. Every step lowers
the objective, so the method terminates; it is exact once it stops.

Why it is the fallback of :func:`jacflow.linalg.project_weights`. When ``G`` is singular with
more rows than its rank (``m > n``), the optimal ``v`` is not unique and the dual cone can be a
single point: first-order methods then crawl and PDAS cycles. Lawson-Hanson keeps the columns of
``P`` linearly independent (in exact arithmetic a column in the span of ``P`` has a zero
gradient once ``P``'s least-squares problem is solved), so ``G_PP`` stays non-singular and every
solve is well posed. Numerically that independence is enforced: the Cholesky factor of ``G_PP``
is extended by one row per added index, and the new pivot is the squared distance of the
candidate column from the span of ``P`` (a Schur complement); a candidate whose distance is
rounding noise is rejected until ``P`` changes.

All problems advance together. Each keeps the Cholesky factor of its passive block in insertion
order (padded with the identity, stored transposed so that triangular solves read it without a
copy), so adding an index costs triangular solves (``O(s^2)``) instead of a factorisation
(``O(s^3)``); only the steps that drop indices refactorise, and only for the problems that
take them. Problems that have stopped leave the batch. Conventions as in ``_pdas``:
float64, ``u`` ``[B, k, m]`` with rows of max-norm 1 (or 0), ``g`` ``[B, m, m]`` finite,
symmetric, trace 1 (or 0).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from jacflow.linalg._cholesky import cholesky_ex
from jacflow.linalg._pdas import gather_blocks, kkt_residual, multiplier_scale, pad_identity

DEPENDENT = 1e-11  # squared sine of the angle below which a column counts as in the span of P
# The same, for a second pass on the problems that the first left above the tolerance: on a
# Gramian whose spectrum spans 1e-10 (rows nearly parallel or opposite), a needed column can lie
# closer than DEPENDENT to the span of the others (squared sine about 1e-12); the pass that
# accepts it solved them to 1e-16 (their KKT residual decides which iterate is kept).
DEPENDENT_RETRY = 1e-14
_ADD_TOL_FACTOR = 0.1  # add a column while its residual exceeds this fraction of the tolerance
_CAPACITY_STEP = 16  # the stored factors grow by this many slots when a passive set outgrows them


def _gramian_product(g: Tensor, which: Tensor, x: Tensor) -> Tensor:
    """``G x`` for every problem (row form), ``[N, m]``."""
    return x @ g[0] if g.shape[0] == 1 else torch.bmm(x[:, None], g[which]).squeeze(1)


def _solve_passive(
    g: Tensor, gu: Tensor, which: Tensor, slots: Tensor, count: Tensor, upper: Tensor
) -> Tensor:
    """``x`` (zero outside the passive set) with ``G_PP x_P = -(G u)_P``, refined once.

    ``upper`` is the transposed Cholesky factor ``L^T`` of every passive block, ``[N, S, S]``.
    """
    used = torch.arange(slots.shape[1], device=g.device) < count[:, None]
    rhs = torch.where(used, -torch.gather(gu, 1, slots), 0.0)

    def solve(b: Tensor) -> Tensor:
        y = torch.linalg.solve_triangular(upper.mT, b[..., None], upper=False)
        return torch.linalg.solve_triangular(upper, y, upper=True).squeeze(-1)

    coefficients = solve(rhs)
    x = torch.zeros_like(gu).scatter_add(1, slots, torch.where(used, coefficients, 0.0))
    # One step of iterative refinement: the residual through the full Gramian (O(m^2)).
    residual = torch.where(used, rhs - torch.gather(_gramian_product(g, which, x), 1, slots), 0.0)
    return x.scatter_add(1, slots, torch.where(used, solve(residual), 0.0))


def lawson_hanson_solve(
    u: Tensor, g: Tensor, tol: float, max_iter: int | None = None, reject_below: float = DEPENDENT
) -> tuple[Tensor, Tensor]:
    """Solve every problem exactly by Lawson-Hanson; returns ``v`` and its KKT residual.

    ``max_iter`` caps the number of batched least-squares solves (default ``6 m + 50``); a
    problem still running then keeps its last (feasible) iterate. ``reject_below``: the squared
    sine of the angle to the span of the passive columns below which a column is rejected.

    Example:
        >>> import torch
        >>> from jacflow.linalg._lawson_hanson import lawson_hanson_solve
        >>> j = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
        >>> g = (j @ j.T / 3)[None]  # rank 2 < m = 3: rows 0 and 1 are opposite
        >>> u = torch.eye(3, dtype=torch.float64)[None]
        >>> v, residual = lawson_hanson_solve(u, g, tol=1e-12)
        >>> v[0]
        tensor([[1., 1., 0.],
                [1., 1., 0.],
                [0., 0., 1.]], dtype=torch.float64)
        >>> bool(residual.amax() <= 1e-12)
        True
    """
    b, k, m = u.shape
    n = b * k
    device, dtype = u.device, u.dtype
    uu = u.reshape(n, m)
    column_norm = g.diagonal(dim1=-2, dim2=-1)  # [b, m]
    x_out = torch.zeros_like(uu)
    # The state of the running problems (compacted when some stop).
    problem = torch.arange(n, device=device)
    which = problem // k
    gu = torch.bmm(u, g).reshape(n, m)
    c = multiplier_scale(g).reshape(b, 1).repeat_interleave(k, 0)
    u_run = uu
    inverse_norm = column_norm.clamp_min(1e-300).rsqrt()[which]  # [n, m]
    x = torch.zeros_like(uu)
    capacity = min(m, _CAPACITY_STEP)
    slots = torch.zeros(n, capacity, dtype=torch.long, device=device)
    count = torch.zeros(n, dtype=torch.long, device=device)
    upper = torch.eye(capacity, dtype=dtype, device=device).repeat(n, 1, 1)  # L^T, padded
    passive = torch.zeros_like(uu, dtype=torch.bool)
    rejected = torch.zeros_like(passive)
    stepping = torch.zeros(n, dtype=torch.bool, device=device)  # must re-solve after a step
    padded = pad_identity(g)  # for the blocks of refactorisations
    for _ in range(6 * m + 50 if max_iter is None else max_iter):
        grad = gu + _gramian_product(g, which, x)  # G (u + x): half of the multipliers
        scale = (u_run + x).abs().amax(-1, keepdim=True).clamp_min(1.0)
        candidates = ~passive & ~rejected & (grad < -_ADD_TOL_FACTOR * tol * scale * c / 2)
        # Most negative gradient per unit column norm: invariant to rescaling the objectives.
        score = grad * inverse_norm
        pick = torch.where(candidates, score, torch.inf).argmin(-1)
        adding = ~stepping & candidates.any(-1)
        finished = ~stepping & ~adding
        if bool(finished.any()):  # optimal (up to rejected, dependent columns): leave the batch
            x_out[problem[finished]] = x[finished]
            keep = ~finished
            problem, which, gu, c, x = problem[keep], which[keep], gu[keep], c[keep], x[keep]
            u_run, inverse_norm = u_run[keep], inverse_norm[keep]
            slots, count, upper = slots[keep], count[keep], upper[keep]
            passive, rejected, stepping = passive[keep], rejected[keep], stepping[keep]
            pick, adding = pick[keep], adding[keep]
            if problem.numel() == 0:
                break
        if bool((count[adding] >= capacity).any()):  # grow the stored factors
            grown = min(m, capacity + _CAPACITY_STEP)
            eye = torch.eye(grown, dtype=dtype, device=device).repeat(problem.numel(), 1, 1)
            eye[:, :capacity, :capacity] = upper
            upper = eye
            slots = torch.cat([slots, slots.new_zeros(slots.shape[0], grown - capacity)], 1)
            capacity = grown
        # Extend the factor of the adding problems by the candidate's row (a column of L^T).
        # The triangular solve runs on every problem (zero columns elsewhere): gathering the
        # adding problems' factors would copy more than it saves.
        add = adding.nonzero().flatten()
        position = count[add]
        used = (torch.arange(capacity, device=device) < count[:, None]) & adding[:, None]
        column = torch.take(g, (which[:, None] * m + slots) * m + pick[:, None])
        column = torch.where(used, column, 0.0)
        row = torch.linalg.solve_triangular(upper.mT, column[..., None], upper=False)
        row = row.squeeze(-1)[add]
        norm = torch.take(column_norm, which[add] * m + pick[add])
        pivot = norm - (row * row).sum(-1)
        independent = pivot > reject_below * norm
        row = row.scatter(
            1, position[:, None], torch.where(independent, pivot, norm).sqrt()[:, None]
        )
        saved = upper[add, :, position]
        upper[add, :, position] = row
        slots[add, position] = pick[add]
        count[add] = position + 1
        z = _solve_passive(g, gu, which, slots, count, upper)
        picked_z = z[add, pick[add]]
        # A candidate in the span of P (or whose own coefficient is not positive, which exact
        # arithmetic excludes) is rejected until P changes: restore the factor.
        dependent = ~independent | (picked_z <= 0)
        undo = add[dependent]
        upper[undo, :, position[dependent]] = saved[dependent]
        count[undo] = position[dependent]
        rejected[undo, pick[undo]] = True
        moving = stepping.clone()
        moving[add[~dependent]] = True
        used = (torch.arange(capacity, device=device) < count[:, None]).to(dtype)
        # amax, not a plain scatter: the unused slots hold stale indices that must not win
        members = torch.zeros_like(x).scatter_reduce(1, slots, used, "amax") > 0
        members &= moving[:, None]
        accept = moving & ((z > 0) | ~members).all(-1)
        step = moving & ~accept
        # Step from x towards z until the first passive coefficient reaches zero.
        blocking = members & (z <= 0) & step[:, None]
        ratio = torch.where(blocking, x / (x - z).clamp_min(1e-300), torch.ones_like(z))
        alpha = ratio.amin(-1, keepdim=True).clamp(0.0, 1.0)
        stepped = x + alpha * (z - x)
        kept = members & (stepped > 0) & ~(blocking & (ratio <= alpha))
        x = torch.where(accept[:, None], z, torch.where(step[:, None], stepped, x))
        passive = torch.where(moving[:, None], torch.where(accept[:, None], members, kept), passive)
        x = torch.where(passive, x, 0.0)
        rejected &= ~moving[:, None]
        stepping = step
        if bool(step.any()):  # refactorise (in insertion order) the blocks that lost indices
            index = step.nonzero().flatten()
            slot_range = torch.arange(capacity, device=device)
            dropped = ~torch.gather(passive[index], 1, slots[index])
            unused = slot_range >= count[index, None]
            order = torch.argsort(
                dropped.to(torch.int8) * 2 + unused.to(torch.int8), dim=-1, stable=True
            )
            kept_slots = torch.gather(slots[index], 1, order)
            kept_count = passive[index].sum(-1)
            used = slot_range < kept_count[:, None]
            factor, info = cholesky_ex(gather_blocks(padded, which[index], kept_slots, used))
            failed = info != 0  # cannot happen for a subset of an independent set; stop them
            slots[index], count[index] = kept_slots, kept_count
            upper[index] = torch.where(failed[:, None, None], upper[index], factor.mT)
            stepping[index[failed]] = False
            rejected[index[failed]] = True  # nothing more to add: the problem stops next round
    if problem.numel():
        x_out[problem] = x
    v = (uu + x_out).reshape(b, k, m)
    return v, kkt_residual(v, u, 2 * torch.bmm(v, g), multiplier_scale(g))


def least_combination(
    g: Tensor, tol: float, reject_below: float = DEPENDENT
) -> tuple[Tensor, Tensor, Tensor]:
    """``y >= 1`` minimising ``y^T G y`` for one Gramian ``g`` ``[m, m]`` (``[m]``), with the
    final passive set ``P`` (indices, ``[s]``) and the lower Cholesky factor of ``G_PP``.

    Lawson-Hanson on ``y = 1 + x``, ``x >= 0`` (Lawson & Hanson, 1974, ch. 23), as
    :func:`lawson_hanson_solve` (same candidate rule, independence test and stopping rule) but
    for one problem in the fewest tensor operations: the passive set is a Python list, its
    Cholesky factor is extended by one row per added index (a triangular solve), and the
    free system is refined once, at the end. ``y^T G y = 0`` is reached exactly when the dual
    cone ``{x : J x >= 0}`` is ``{0}`` (``J^T y = 0`` with ``y > 0``); see ``_dual_cone``.
    Conventions as :func:`lawson_hanson_solve` (float64, symmetric ``g`` of trace 1 or 0).

    Example:
        >>> import torch
        >>> from jacflow.linalg._lawson_hanson import least_combination
        >>> j = torch.tensor([[1.0, 0.0], [-1.0, 1.0], [0.0, -2.0]], dtype=torch.float64)
        >>> y, passive, factor = least_combination(j @ j.T / 7, tol=1e-12)
        >>> y, passive  # (2, 2, 1) J = 0
        (tensor([2., 2., 1.], dtype=torch.float64), tensor([1, 0]))
    """
    m = g.shape[-1]
    ones = g.new_ones(m)
    diagonal = g.diagonal().tolist()
    half_c = max(max(diagonal, default=0.0), 0.0) or 1.0  # c / 2 of multiplier_scale
    inverse_norm = g.diagonal().clamp_min(1e-300).rsqrt()
    g_ones = g.sum(0)  # G 1 (symmetric)
    x, lower = torch.zeros_like(ones), torch.zeros_like(g)  # factor of G_PP, in insertion order
    passive: list[int] = []
    closed = torch.zeros_like(ones)  # inf on the passive and rejected indices, else 0
    stepping, top, grad = False, 0.0, None  # top: max(x), for the scale of the residual
    for _ in range(6 * m + 50):
        size = len(passive)
        if not stepping:
            grad = torch.addmv(g_ones, g, x) if grad is None else grad
            # (the most negative gradient per unit column norm among the open indices: when its
            # gradient is above the threshold, so is every other's, or it is closed below)
            best, pick = torch.addcmul(closed, grad, inverse_norm).min(0)
            j, score = int(pick), float(best)
            if not score < 0:
                break
            closed[j] = math.inf
            if score * math.sqrt(diagonal[j]) >= -_ADD_TOL_FACTOR * tol * (1.0 + top) * half_c:
                continue
            index = g.new_tensor(passive, dtype=torch.long)
            column = g[j].index_select(0, index)[:, None]
            row = torch.linalg.solve_triangular(lower[:size, :size], column, upper=False)[:, 0]
            pivot = diagonal[j] - float(row @ row)
            if not pivot > reject_below * diagonal[j]:  # in the span of P: rejected until P changes
                continue
            lower[size, :size], lower[size, size] = row, math.sqrt(pivot)
            passive.append(j)
            size += 1
        index = g.new_tensor(passive, dtype=torch.long)
        z = torch.cholesky_solve(-g_ones.index_select(0, index)[:, None], lower[:size, :size])[:, 0]
        low_z, top_z, last = torch.stack([*z.aminmax(), z[-1]]).tolist()
        if not stepping and not last > 0:  # (rounding: exact arithmetic excludes it)
            passive.pop()
            continue
        if low_z > 0:
            x, top, grad = torch.zeros_like(ones).index_put_((index,), z), top_z, None
            closed = torch.zeros_like(ones).index_fill_(0, index, math.inf)
            stepping = False
            continue
        # Step from x towards z until the first passive coefficient reaches zero.
        now = x.index_select(0, index)
        blocking = z <= 0
        ratio = torch.where(blocking, now / (now - z).clamp_min(1e-300), 1.0)
        alpha = ratio.amin().clamp(0.0, 1.0)
        stepped = now + alpha * (z - now)
        kept = (stepped > 0) & ~(blocking & (ratio <= alpha))
        passive = [i for i, k in zip(passive, kept.tolist()) if k]
        index = g.new_tensor(passive, dtype=torch.long)
        x, grad = torch.zeros_like(ones).index_put_((index,), stepped[kept]), None
        top = float(x.amax())
        closed = torch.zeros_like(ones).index_fill_(0, index, math.inf)
        size = len(passive)
        factor, info = cholesky_ex(g.index_select(0, index).index_select(1, index))
        if int(info):  # (a subset of an independent set: cannot happen)
            break
        lower[:size, :size] = factor
        stepping = size > 0
    index, factor = g.new_tensor(passive, dtype=torch.long), lower[: len(passive), : len(passive)]
    return ones + _refined(g, g_ones, x, index, factor), index, factor


def _refined(g: Tensor, g_ones: Tensor, x: Tensor, passive: Tensor, factor: Tensor) -> Tensor:
    """``x`` after one step of iterative refinement of its passive system ``G_PP x_P = -(G 1)_P``
    (``factor``: of ``G_PP``): the residual through the full Gramian."""
    if not passive.numel():
        return x
    residual = -torch.addmv(g_ones, g, x).index_select(0, passive)
    step = torch.cholesky_solve(residual[:, None], factor)[:, 0]
    return x.index_add(0, passive, step).clamp_min(0.0)
