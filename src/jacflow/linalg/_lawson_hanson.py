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
solve is well posed. Numerically that independence is enforced: the candidate is placed last in
the Cholesky factorisation of ``G_PP``, whose last pivot is then the squared distance of the
candidate column from the span of ``P`` (a Schur complement); a candidate whose distance is
rounding noise is rejected until ``P`` changes.

All problems advance together, one least-squares solve per iteration: the passive blocks are
gathered into padded ``s x s`` systems (``s`` the largest passive set) and factorised by one
batched Cholesky; problems that have stopped leave the batch. Conventions as in ``_pdas``:
float64, ``u`` ``[B, k, m]`` with rows of max-norm 1 (or 0), ``g`` ``[B, m, m]`` finite,
symmetric, trace 1 (or 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow.linalg._pdas import kkt_residual, multiplier_scale

_SHIFT = 1e-14  # relative diagonal shift: lets the Cholesky factor of a PSD block exist
_DEPENDENT = 1e-11  # squared sine of the angle below which a column counts as in the span of P
_ADD_TOL_FACTOR = 0.1  # add a column while its residual exceeds this fraction of the tolerance


def _passive_solve(
    g: Tensor, which: Tensor, gu: Tensor, members: Tensor, last: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Least-squares step on every problem's passive set.

    Args:
        g: the Gramians, ``[B, m, m]``.
        which: the Gramian of each problem (an index into ``g``), ``[N]``.
        gu: ``G u`` per problem, ``[N, m]``.
        members: the passive set of each problem, ``[N, m]`` bool.
        last: the index placed last in the factorisation (the candidate), or ``-1``, ``[N]``.

    Returns:
        ``x`` (zero outside ``members``) solving ``G_PP x_P = -(G u)_P``, ``[N, m]``; the
        squared relative distance of column ``last`` from the span of the others, ``[N]`` (1
        where ``last`` is ``-1``); and whether the factorisation succeeded, ``[N]``.
    """
    n, m = gu.shape
    rows = torch.arange(n, device=gu.device)
    is_last = torch.zeros_like(members)
    has_last = last >= 0
    is_last[rows[has_last], last[has_last]] = True
    key = members.to(torch.int8) * 2 - is_last.to(torch.int8)  # 2: member, 1: last, 0: other
    s = max(int(members.sum(-1).amax()), 1)
    order = torch.argsort(key, dim=-1, descending=True, stable=True)[:, :s]
    valid = torch.gather(members, 1, order)
    # One flat gather of the s x s blocks (a 3-index advanced index is several times slower).
    flat = (which[:, None] * m + order) * m
    system = torch.take(g, flat[:, :, None] + order[:, None, :])
    weight = valid.to(system.dtype)
    system.mul_(weight[:, :, None]).mul_(weight[:, None, :])  # in place: the largest tensors
    diag = system.diagonal(dim1=-2, dim2=-1)
    shift = _SHIFT * s * diag.amax(-1, keepdim=True).clamp_min(1e-300) * valid
    diag.add_((~valid).to(system.dtype) + shift)
    factor, info = torch.linalg.cholesky_ex(system)
    ok = info == 0
    if not bool(ok.all()):
        eye = torch.eye(s, dtype=system.dtype, device=system.device)
        factor = torch.where(ok[:, None, None], factor, eye)
    rhs = torch.where(valid, -torch.gather(gu, 1, order), torch.zeros_like(shift))[..., None]
    x = torch.cholesky_solve(rhs, factor)
    # One step of iterative refinement against the unshifted block.
    x = x + torch.cholesky_solve(rhs - torch.bmm(system, x) + shift[..., None] * x, factor)
    position = (valid.sum(-1) - 1).clamp_min(0)  # the candidate sits at the last valid slot
    pivot = factor[rows, position, position] ** 2
    column = torch.gather(diag - shift, 1, position[:, None]).squeeze(1).clamp_min(1e-300)
    distance = torch.where(has_last, pivot / column, torch.ones_like(pivot))
    values = torch.where(valid, x.squeeze(-1), torch.zeros_like(shift))
    out = torch.zeros_like(gu).scatter(1, order, values)
    return out, distance, ok


def lawson_hanson_solve(
    u: Tensor, g: Tensor, tol: float, max_iter: int | None = None
) -> tuple[Tensor, Tensor]:
    """Solve every problem exactly by Lawson-Hanson; returns ``v`` and its KKT residual.

    ``max_iter`` caps the number of batched least-squares solves (default ``6 m + 50``); a
    problem still running then keeps its last (feasible) iterate.

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
    batch = torch.arange(b, device=u.device).repeat_interleave(k)
    uu = u.reshape(n, m)
    gu = torch.bmm(u, g).reshape(n, m)
    c = multiplier_scale(g)[batch, 0]  # [n, 1]
    column_norm = g.diagonal(dim1=-2, dim2=-1)[batch]
    x = torch.zeros_like(uu)
    passive = torch.zeros_like(uu, dtype=torch.bool)
    rejected = torch.zeros_like(passive)
    stepping = torch.zeros(n, dtype=torch.bool, device=u.device)  # must re-solve after a step
    work = torch.arange(n, device=u.device)  # the problems still running
    for _ in range(6 * m + 50 if max_iter is None else max_iter):
        if work.numel() == 0:
            break
        grad = gu + torch.bmm(x.reshape(b, k, m), g).reshape(n, m)  # G (u + x): half of lam
        w_x, w_p, w_grad = x[work], passive[work], grad[work]
        scale = (uu[work] + w_x).abs().amax(-1, keepdim=True).clamp_min(1.0)
        threshold = -_ADD_TOL_FACTOR * tol * scale * c[work] / 2
        candidates = ~w_p & ~rejected[work] & (w_grad < threshold)
        # Most negative gradient per unit column norm: invariant to rescaling the objectives.
        score = w_grad / column_norm[work].clamp_min(1e-300).sqrt()
        pick = torch.where(candidates, score, torch.full_like(score, float("inf"))).argmin(-1)
        adding = ~stepping[work] & candidates.any(-1)
        finished = ~stepping[work] & ~adding
        members = w_p.clone()
        members[adding, pick[adding]] = True
        last = torch.where(adding, pick, torch.full_like(pick, -1))
        z, distance, ok = _passive_solve(g, batch[work], gu[work], members, last)
        picked_z = torch.gather(z, 1, pick[:, None]).squeeze(1)
        # A candidate in the span of P (or whose own coefficient is not positive, which exact
        # arithmetic excludes) is rejected until P changes; P and x stay as they were.
        dependent = adding & (~ok | (distance <= _DEPENDENT) | (picked_z <= 0))
        w_rej = rejected[work]
        w_rej[dependent, pick[dependent]] = True
        moving = ~finished & ~dependent & ok
        finished = finished | (stepping[work] & ~ok)  # a failed solve on a subset of P: stop
        members = torch.where(moving[:, None], members, w_p)
        feasible = (z > 0) | ~members
        accept = moving & feasible.all(-1)
        step = moving & ~accept
        # Step from x towards z until the first passive coefficient reaches zero.
        blocking = members & (z <= 0) & step[:, None]
        ratio = torch.where(blocking, w_x / (w_x - z).clamp_min(1e-300), torch.ones_like(z))
        alpha = ratio.amin(-1, keepdim=True).clamp(0.0, 1.0)
        stepped = w_x + alpha * (z - w_x)
        stepped_members = members & (stepped > 0) & ~(blocking & (ratio <= alpha))
        new_x = torch.where(accept[:, None], z, torch.where(step[:, None], stepped, w_x))
        new_p = torch.where(
            accept[:, None], members, torch.where(step[:, None], stepped_members, w_p)
        )
        new_x = torch.where(new_p, new_x, torch.zeros_like(new_x))
        w_rej = torch.where((accept | step)[:, None], torch.zeros_like(w_rej), w_rej)
        x[work], passive[work], rejected[work] = new_x, new_p, w_rej
        stepping[work] = step
        work = work[~finished]
    v = (uu + x).reshape(b, k, m)
    return v, kkt_residual(v, u, 2 * torch.bmm(v, g), multiplier_scale(g))
