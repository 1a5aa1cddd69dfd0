"""PDAS on the dual problem, for small active sets (strongly conflicting objectives).

For a positive definite ``G`` with inverse ``H``, the multipliers ``mu = G v`` of
``min v^T G v  s.t.  v >= u`` (``lam = 2 mu`` in ``_pdas``'s notation) solve the dual problem
``min mu^T H mu / 2 - u^T mu`` over ``mu >= 0``, and ``v = H mu``. Given a guess ``A`` of the
active set (the support of ``mu``), one step solves ``H_AA mu_A = u_A`` and takes ``v = H mu``;
the next guess keeps the ``i`` in ``A`` with ``mu_i > 0`` and adds the ``i`` outside it with
``v_i < u_i``. This is PDAS's rule ``lam_i + c (u_i - v_i) > 0`` evaluated with ``lam = 2 mu``
(exact for this iterate: ``lam_F = 0`` and ``v_A = u_A``), so the iterates are those of
``_pdas``'s primal PDAS, from systems of the size of the active set instead of the free set.

Strongly conflicting objectives (e.g. per-sample gradients) leave most weights free and few
constraints active (UPGrad on per-sample Gramians at ``m = 128``: about 15), and PDAS's first
guess (``lam > 0`` at ``v = u``) is then nearly always right: one or two small solves, and no
product with ``G`` until the single check of every result against the true ``G`` (its KKT
residual), which also catches an inaccurate inverse. Problems left above the tolerance are
returned as they are, for another method to take. Conventions as in ``_pdas``.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import torch
from torch import Tensor

from jacflow.linalg._cholesky import cholesky_ex
from jacflow.linalg._pdas import (
    first_slots,
    gather_blocks,
    kkt_residual,
    lean_certified,
    lean_scale,
    pad_identity,
    with_exact_bounds,
)

# The inverse is used only when every squared Cholesky pivot of G exceeds this fraction of its
# largest diagonal entry (a necessary condition for cond(G) < 1e8).
_INVERSE_MIN_PIVOT = 1e-8
# A step gives up when its batched Cholesky (problems x s^3) would cost more: the active sets
# are then too large for the inverse to pay off against the primal methods.
_MAX_STEP_FLOP = 3e7
# The first step factorises each distinct active set once when at least _MIN_SHARED problems
# are solved and at most _MAX_DISTINCT of their sets are distinct; below either, the
# bookkeeping costs more than the LAPACK calls it saves (measured: no gain at 64 problems).
_MAX_DISTINCT = 0.75
_MIN_SHARED = 100
# On the CPU, whose batched LAPACK calls factorise one padded matrix after another, problems
# are split into groups of similar active-set sizes, each padded to its own largest, when that
# saves more than _GROUP_COST (in multiply-adds of a factorisation, s^3 each) per extra group,
# and only from _GROUP_MIN_SIZE active constraints. (UPGrad on a transformer's per-sample
# Gramian at m = 128: active sets of 20 to 56, 0.67x the weighting's time; below 32, no gain.)
_GROUP_COST = 1.5e6
_GROUP_MIN_SIZE = 32


def safe_inverse(
    g: Tensor, min_pivot: float = _INVERSE_MIN_PIVOT, factored: tuple[Tensor, Tensor] | None = None
) -> Tensor | None:
    """``G^-1`` when every ``G`` is positive definite with squared Cholesky pivots above
    ``min_pivot`` times its largest diagonal entry, else ``None`` (``factored``: ``cholesky_ex``
    of ``g`` when the caller has it).

    Example:
        >>> import torch
        >>> from jacflow.linalg._dual_pdas import safe_inverse
        >>> g = torch.tensor([[[2.0, 1.0], [1.0, 2.0]]], dtype=torch.float64)
        >>> torch.allclose(safe_inverse(g) @ g, torch.eye(2, dtype=torch.float64))
        True
        >>> safe_inverse(torch.ones(1, 2, 2, dtype=torch.float64)) is None
        True
    """
    factor, info = cholesky_ex(g) if factored is None else factored
    pivots = factor.diagonal(dim1=-2, dim2=-1).square().amin(-1)
    bound = min_pivot * g.diagonal(dim1=-2, dim2=-1).amax(-1)
    if not bool(((info == 0) & (pivots >= bound)).all()):  # one host sync for both tests
        return None
    return torch.cholesky_inverse(factor).mT  # symmetric: the transpose is the row-major copy


def active_systems_pay(counts: Tensor, m: int) -> bool:
    """Whether the active systems (``counts`` constraints per problem) are smaller than the free
    ones, and cheap: the test of the first guess, before any inverse is computed."""
    low, high = (int(x) for x in torch.aminmax(counts))
    return high < m - low and _cheap(counts.numel(), high)


def _cheap(problems: int, size: int) -> bool:
    """Whether a step's batched Cholesky (``problems`` blocks of size ``size``) is cheap."""
    return problems * size**3 <= _MAX_STEP_FLOP


@functools.lru_cache(maxsize=8)
def _hash_weights(m: int, device: torch.device) -> Tensor:
    generator = torch.Generator().manual_seed(m)
    return torch.randint(1, 2**32, (m,), generator=generator, dtype=torch.int64, device="cpu").to(
        device
    )


def distinct_rows(mask: Tensor, which: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """``(first, owner)``: one representative row of each distinct key of the rows of ``mask``
    ``[N, m]``, and the representative of each row; ``None`` when too few keys repeat for
    sharing to pay.

    A row's key is the sum of fixed random 32-bit integers over its true entries (exact, so
    equal rows have equal keys), offset per Gramian ``which``. Distinct rows almost never share
    a key, and rows are not compared: a problem given another's active set gets a wrong iterate,
    which the check of every result against ``G`` rejects like any other.

    Example:
        >>> import torch
        >>> from jacflow.linalg._dual_pdas import distinct_rows
        >>> mask = torch.tensor([[1, 0], [1, 0], [1, 0], [0, 1]], dtype=torch.bool)
        >>> first, owner = distinct_rows(mask, None)
        >>> bool((mask[first][owner] == mask).all()), first.numel()
        (True, 2)
    """
    n, m = mask.shape
    keys = (mask * _hash_weights(m, mask.device)).sum(-1)  # below m 2^32
    if which is not None:
        if int(which.amax()) >= 2**62 // (m << 32):  # the offsets would overflow
            return None
        keys = keys + which * (m << 32)
    distinct, owner = torch.unique(keys, return_inverse=True)
    if distinct.numel() > _MAX_DISTINCT * n:
        return None
    rows = torch.arange(n, device=owner.device)
    return owner.new_empty(distinct.numel()).scatter_(0, owner, rows), owner


def size_groups(counts: Tensor, size: int) -> list[tuple[Tensor, int]] | None:
    """Problems (rows of ``counts``, their active-set sizes) in up to 4 groups of similar size,
    each with the size its systems are padded to, when the groups' factorisations cost less
    than one batch padded to ``size`` (``_GROUP_COST`` per extra group); else ``None``.

    Example:
        >>> import torch
        >>> from jacflow.linalg._dual_pdas import size_groups
        >>> counts = torch.tensor([60, 5, 6, 58] * 32)
        >>> [(rows.numel(), s) for rows, s in size_groups(counts, 60)]
        [(64, 6), (64, 60)]
        >>> size_groups(torch.tensor([60, 59] * 64), 60) is None
        True
    """
    n = counts.numel()
    ordered, permutation = torch.sort(counts)
    sizes = ordered.tolist()
    best_cost: float = n * size**3
    best: list[tuple[Tensor, int]] | None = None
    for parts in (2, 3, 4):
        bounds = [round(n * q / parts) for q in range(parts + 1)]
        groups = [
            (permutation[low:high], max(int(sizes[high - 1]), 1))
            for low, high in itertools.pairwise(bounds)
            if high > low
        ]
        cost = sum(rows.numel() * s**3 for rows, s in groups) + (len(groups) - 1) * _GROUP_COST
        if cost < best_cost:
            best_cost, best = cost, groups
    return best


def _solve_groups(
    u: Tensor, padded: Tensor, order: Tensor, valid: Tensor, groups: list[tuple[Tensor, int]]
) -> Tensor | None:
    """``mu`` ``[N, m]`` of one dual step of the problems (rows of ``u`` ``[N, m]``, one
    Gramian) group by group (:func:`size_groups`); ``None`` if some ``H_AA`` is not
    numerically positive definite."""
    mu = torch.zeros_like(u)
    for rows, size in groups:
        slots, used = order.index_select(0, rows)[:, :size], valid.index_select(0, rows)[:, :size]
        factor, info = cholesky_ex(gather_blocks(padded, None, slots, used))
        if bool(info.any()):
            return None
        rhs = u.index_select(0, rows).gather(1, slots).masked_fill_(~used, 0.0)
        mu_active = torch.cholesky_solve(rhs[..., None], factor).squeeze(-1)
        mu.index_copy_(
            0, rows, mu.new_zeros(rows.numel(), u.shape[-1]).scatter_(1, slots, mu_active)
        )
    return mu


def _step(
    u: Tensor,
    inverse: Tensor,
    padded: Tensor,
    active: Tensor,
    size: int,
    share: bool = False,
) -> tuple[Tensor, Tensor] | None:
    """``(v, mu)`` of one dual step for every problem (at most ``size`` active constraints
    each); ``None`` if some ``H_AA`` is not numerically positive definite. ``padded`` is
    ``pad_identity(inverse, extra)`` with ``extra >= size``."""
    b, k, m = u.shape
    if size == 0:  # nothing binds: mu = 0
        return torch.zeros_like(u), torch.zeros_like(u)
    flat_active = active.reshape(b * k, m)
    which = None if b == 1 else torch.arange(b, device=u.device).repeat_interleave(k)
    # Problems with the same active set (and Gramian) share one factorisation: per-sample
    # conflicts cluster (e.g. by class), so that the first guesses often repeat.
    shared = distinct_rows(flat_active, which) if share and b * k >= _MIN_SHARED else None
    sets, set_which = flat_active, which
    if shared is not None:
        sets = flat_active.index_select(0, shared[0])
        set_which = None if which is None else which.index_select(0, shared[0])
    order, valid = first_slots(sets, size)
    groups = None
    if shared is None and which is None and u.device.type == "cpu" and size >= _GROUP_MIN_SIZE:
        groups = size_groups(valid.sum(-1), size)
    if groups is not None:
        grouped = _solve_groups(u.reshape(k, m), padded, order, valid, groups)
        if grouped is None:
            return None
        mu = grouped.reshape(b, k, m)
    else:
        factor, info = cholesky_ex(gather_blocks(padded, set_which, order, valid))
        if bool(info.any()):
            return None
        if shared is not None:
            owner = shared[1]
            order, valid = order.index_select(0, owner), valid.index_select(0, owner)
            # in LAPACK's column-major layout, which cholesky_solve then uses without a copy
            factor = factor.mT.index_select(0, owner).mT
        rhs = u.reshape(b * k, m).gather(1, order).masked_fill_(~valid, 0.0)
        # The blocks are [[H_AA, 0], [0, I]] and the unused right-hand sides 0: so are their
        # mu, exactly, and the scatter writes zeros there.
        mu_active = torch.cholesky_solve(rhs[..., None], factor).squeeze(-1)
        mu = u.new_zeros(b * k, m).scatter_(1, order, mu_active).reshape(b, k, m)
    return torch.where(active, u, torch.bmm(mu, inverse)), mu


def dual_pdas_solve(
    u: Tensor,
    g: Tensor,
    inverse: Tensor,
    start: tuple[Tensor, Tensor, Tensor],
    max_iter: int,
    tol: float,
) -> tuple[Tensor, Tensor, bool]:
    """Dual PDAS from ``v = u`` for at most ``max_iter`` steps; ``start`` is
    ``(active, residual, c)`` at ``v = u`` (PDAS's first guess ``lam > 0`` with
    ``lam = 2 u G``, the KKT residual, the multiplier scale), as the caller has them.

    The steps run in the dtype of ``inverse``, which may be lower than that of ``u`` and ``g``
    (float32 steps for a float64 problem: :func:`~jacflow.linalg._dual_cone._solve`); the
    result is checked in the problem's own dtype, with ``v_i = u_i`` exactly where the steps
    held the constraint active (the implicit backward tells active constraints by it).

    The steps stop early when an active system is not numerically positive definite or the
    active systems grow costly (more than ``_MAX_STEP_FLOP``); the problems left above ``tol``
    are for another method. Whether the route pays at all (:func:`active_systems_pay`) is the
    caller's test.

    Returns ``(v, residual, settled)``: the better of ``u`` and the last iterate of each
    problem, its KKT residual with the true ``G``, and whether the steps stopped because no
    active set changed or an active system was not numerically positive definite (rather than
    for the cost of the systems or ``max_iter``): only then may steps in a higher precision
    finish what these left.

    Example:
        >>> import torch
        >>> from jacflow.linalg._dual_pdas import dual_pdas_solve, safe_inverse
        >>> from jacflow.linalg._pdas import kkt_residual, multiplier_scale
        >>> g = torch.tensor([[[0.2, -0.2], [-0.2, 0.8]]], dtype=torch.float64)
        >>> u = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
        >>> lam, c = 2 * torch.bmm(u, g), multiplier_scale(g)
        >>> start = lam > 0, kkt_residual(u, u, lam, c), c
        >>> v, _, settled = dual_pdas_solve(u, g, safe_inverse(g), start, 8, 1e-12)
        >>> v, settled
        (tensor([[[1.0000, 0.2500]]], dtype=torch.float64), True)
    """
    active, residual, c = start
    padded: Tensor | None = None  # padded on demand, with room for active sets to grow
    steps_u = u.to(inverse.dtype)  # (the steps' dtype; u itself when it is theirs)
    # (u's values survive the steps' dtype, e.g. UPGrad's rows of 0 and 1: nothing to restore)
    restore = steps_u is not u and not torch.equal(steps_u.to(u.dtype), u)
    v = steps_u
    slots = None  # the problem slots still iterated (None: all)
    pending_u = steps_u
    settled = False
    for iteration in range(max_iter):
        size = int(active.sum(-1).amax())
        if not _cheap(active.shape[0] * active.shape[1], size):
            break  # the active sets grew large: the primal methods take over
        if padded is None or padded.shape[-1] < u.shape[-1] + size:
            padded = pad_identity(inverse, min(u.shape[-1], 2 * size))
        step = _step(pending_u, inverse, padded, active, size, share=iteration == 0)
        if step is None:
            settled = True
            break
        pending_v, mu = step
        v = pending_v if slots is None else v.index_copy(1, slots, pending_v)
        # (mu is 0 off the active set and v = u on it: the rule needs no select)
        following = (mu > 0) | (pending_v < pending_u)
        # the slots whose guess changed somewhere (bool reductions are slow on the CPU)
        moving = (following ^ active).view(torch.uint8).amax(-1).amax(0).nonzero().squeeze(1)
        count = moving.numel()
        if count == 0:
            settled = True
            break
        if count < active.shape[1]:
            slots = moving if slots is None else slots[moving]
            pending_u, following = pending_u[:, moving], following[:, moving]
        active = following
    if v is steps_u:
        return u, residual, settled
    v = with_exact_bounds(v, steps_u, u) if restore else v.to(u.dtype)
    new_residual = kkt_residual(v, u, 2 * torch.bmm(v, g), c)
    better = new_residual < residual
    v = torch.where(better[..., None], v, u)
    return v, torch.where(better, new_residual, residual), settled


_LEAN_MAX_ITER = 8  # steps of lean_dual_pdas_solve before it hands the problems over


def lean_dual_pdas_solve(u: Tensor, g: Tensor, tol: float) -> Tensor | None:
    """The dual PDAS on one Gramian in numpy, for the CPU's problems of a few dozen objectives.

    ``u`` is ``[k, m]``, its rows of max-norm 1 (or 0), and ``g`` ``[m, m]``, symmetric, both
    float64 on the CPU (the scale of ``g`` does not matter). The iterates are those of
    :func:`dual_pdas_solve` in float64, from the same first guess: each step solves every
    problem's ``H_AA mu_A = u_A`` (``H = G^-1``), gathered into blocks padded to the largest
    active set, and the next steps only the problems whose active set changed. There the
    torch steps' fixed cost of some hundred dispatched operations, not their arithmetic, is
    much of the time, and a numpy operation costs a fraction of a torch one (UPGrad's weights
    on per-sample Gramians 0.70-0.98x the time at m = 25 to 32; see docs/performance.md,
    "Stop 49"). The ``m x m`` products and the inverse stay in torch, under its thread
    settings.

    Returns ``v``, exactly feasible, when every problem's KKT residual with ``g`` is at most
    ``tol`` (:func:`~jacflow.linalg._pdas.lean_certified`), else ``None``: the active systems
    do not pay (:func:`active_systems_pay`) or grow costly, ``G`` is not safely invertible
    (:func:`safe_inverse`'s test), a solve fails, or a result misses ``tol`` (also the last
    iterate when the active sets still change after ``_LEAN_MAX_ITER`` steps). The caller then
    runs the batched solvers, which take those cases.

    Example:
        >>> import torch
        >>> from jacflow.linalg._dual_pdas import lean_dual_pdas_solve
        >>> g = torch.tensor([[1.0, -0.5, 0.0], [-0.5, 1.0, 0.0], [0.0, 0.0, 1.0]])
        >>> u = torch.eye(3, dtype=torch.float64)
        >>> lean_dual_pdas_solve(u, g.double(), 1e-12)
        tensor([[1.0000, 0.5000, 0.0000],
                [0.5000, 1.0000, 0.0000],
                [0.0000, 0.0000, 1.0000]], dtype=torch.float64)
        >>> lean_dual_pdas_solve(u, -g.double(), 1e-12) is None  # not positive definite
        True
    """
    u, g = u.detach(), g.detach()
    rows, k, m = u.numpy(), u.shape[0], u.shape[1]
    if not k:
        return u.clone()
    # (numpy's BLAS would run the m x m products on threads of its own from m = 64 or so)
    guess = u @ g > 0  # PDAS's first guess at v = u (lam > 0), as dual_pdas_solve's
    if not active_systems_pay(guess.sum(-1), m):
        return None
    active = guess.numpy()
    counts = active.sum(-1)
    inverse = safe_inverse(g)
    if inverse is None:
        return None
    with np.errstate(all="ignore"):  # (a NaN fails the final check)
        lookup, v = inverse.numpy(), rows.copy()
        moving, pending = np.arange(k), rows  # the problems still iterated, and their rows
        for _ in range(_LEAN_MAX_ITER):
            size, n = int(counts.max()), len(moving)
            if not _cheap(n, size):
                return None
            mu = np.zeros_like(pending)
            if size:
                # each problem's active indices first, padded with free ones whose blocks are
                # the identity and right-hand sides 0: their mu is 0, exactly
                order = np.argsort(~active, axis=1, kind="stable")[:, :size]
                problems = np.arange(n)[:, None]
                valid = active[problems, order]
                pair = valid[:, :, None] & valid[:, None, :]
                blocks = np.where(pair, lookup[order[:, :, None], order[:, None, :]], np.eye(size))
                rhs = np.where(valid, pending[problems, order], 0.0)
                try:  # (no test of the blocks' definiteness: the residual below decides)
                    mu[problems, order] = np.linalg.solve(blocks, rhs[..., None])[..., 0]
                except np.linalg.LinAlgError:
                    return None
            step = np.where(active, pending, (torch.from_numpy(mu) @ inverse).numpy())
            v[moving] = step
            following = (mu > 0) | (step < pending)
            # (a problem whose active set stays has its answer: the next step would repeat it)
            changed = (following != active).any(-1)
            if not changed.any():
                break
            moving, pending, active = moving[changed], pending[changed], following[changed]
            counts = active.sum(-1)
        # (also after the last step: on exact ties, rounding may flip an active set of an
        # answer that is already right)
        half_lam = (torch.from_numpy(v) @ g).numpy()
        return lean_certified(v, rows, half_lam, lean_scale(g.numpy()), tol)
