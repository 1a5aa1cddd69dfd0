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

import torch
from torch import Tensor

from jacflow.linalg._pdas import first_slots, gather_blocks, kkt_residual, pad_identity

# The inverse is used only when every squared Cholesky pivot of G exceeds this fraction of its
# largest diagonal entry (a necessary condition for cond(G) < 1e8).
_INVERSE_MIN_PIVOT = 1e-8
# A step gives up when its batched Cholesky (problems x s^3) would cost more: the active sets
# are then too large for the inverse to pay off against the primal methods.
_MAX_STEP_FLOP = 3e7


def safe_inverse(g: Tensor) -> Tensor | None:
    """``G^-1`` when every ``G`` is positive definite with pivots above ``_INVERSE_MIN_PIVOT``,
    else ``None``.

    Example:
        >>> import torch
        >>> from jacflow.linalg._dual_pdas import safe_inverse
        >>> g = torch.tensor([[[2.0, 1.0], [1.0, 2.0]]], dtype=torch.float64)
        >>> torch.allclose(safe_inverse(g) @ g, torch.eye(2, dtype=torch.float64))
        True
        >>> safe_inverse(torch.ones(1, 2, 2, dtype=torch.float64)) is None
        True
    """
    factor, info = torch.linalg.cholesky_ex(g)
    if bool(info.any()):
        return None
    pivots = factor.diagonal(dim1=-2, dim2=-1).square().amin(-1)
    if not bool((pivots >= _INVERSE_MIN_PIVOT * g.diagonal(dim1=-2, dim2=-1).amax(-1)).all()):
        return None
    return torch.cholesky_inverse(factor).mT  # symmetric: the transpose is the row-major copy


def active_systems_pay(counts: Tensor, m: int) -> bool:
    """Whether the active systems (``counts`` constraints per problem) are smaller than the free
    ones, and cheap: the test of the first guess, before any inverse is computed."""
    return int(counts.amax()) < m - int(counts.amin()) and _cheap(counts)


def _cheap(counts: Tensor) -> bool:
    return counts.numel() * int(counts.amax()) ** 3 <= _MAX_STEP_FLOP


def _step(
    u: Tensor, inverse: Tensor, padded: Tensor, active: Tensor, counts: Tensor
) -> tuple[Tensor, Tensor] | None:
    """``(v, mu)`` of one dual step for every problem (``counts`` active constraints each);
    ``None`` if some ``H_AA`` is not numerically positive definite."""
    b, k, m = u.shape
    flat_active, counts = active.reshape(b * k, m), counts.reshape(b * k)
    size = int(counts.amax())
    if size == 0:  # nothing binds: mu = 0
        return torch.zeros_like(u), torch.zeros_like(u)
    order, valid = first_slots(flat_active, size)
    which = None if b == 1 else torch.arange(b, device=u.device).repeat_interleave(k)
    factor, info = torch.linalg.cholesky_ex(gather_blocks(padded, which, order, counts))
    if bool(info.any()):
        return None
    rhs = u.reshape(b * k, m).gather(1, order).masked_fill_(~valid, 0.0)
    mu_active = torch.cholesky_solve(rhs[..., None], factor).squeeze(-1)
    mu = u.new_zeros(b * k, m).scatter_(1, order, mu_active.masked_fill_(~valid, 0.0))
    mu = mu.reshape(b, k, m)
    return torch.where(active, u, torch.bmm(mu, inverse)), mu


def dual_pdas_solve(
    u: Tensor,
    g: Tensor,
    inverse: Tensor,
    start: tuple[Tensor, Tensor, Tensor],
    max_iter: int,
    tol: float,
) -> tuple[Tensor, Tensor]:
    """Dual PDAS from ``v = u`` for at most ``max_iter`` steps; ``start`` is
    ``(lam, residual, c)`` at ``v = u`` (``lam = 2 u G``, the KKT residual, the multiplier
    scale), as the caller has them.

    Returns ``(v, residual)``: the better of ``u`` and the last iterate of each problem, and its
    KKT residual with the true ``G``. The steps stop early when an active system is not
    numerically positive definite or the active systems grow costly (more than
    ``_MAX_STEP_FLOP``); the problems left above ``tol`` are for another method. Whether the
    route pays at all (:func:`active_systems_pay`) is the caller's test.

    Example:
        >>> import torch
        >>> from jacflow.linalg._dual_pdas import dual_pdas_solve, safe_inverse
        >>> from jacflow.linalg._pdas import kkt_residual, multiplier_scale
        >>> g = torch.tensor([[[0.2, -0.2], [-0.2, 0.8]]], dtype=torch.float64)
        >>> u = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
        >>> lam, c = 2 * torch.bmm(u, g), multiplier_scale(g)
        >>> start = lam, kkt_residual(u, u, lam, c), c
        >>> v, _ = dual_pdas_solve(u, g, safe_inverse(g), start, 8, 1e-12)
        >>> v
        tensor([[[1.0000, 0.2500]]], dtype=torch.float64)
    """
    lam, residual, c = start
    padded = pad_identity(inverse)
    v = u
    active = lam > 0  # PDAS's first guess at v = u
    slots = torch.arange(u.shape[1], device=u.device)  # the problem slots still iterated
    pending_u = u
    for _ in range(max_iter):
        counts = active.sum(-1)
        if not _cheap(counts):  # the active sets grew large: the primal methods take over
            break
        step = _step(pending_u, inverse, padded, active, counts)
        if step is None:
            break
        pending_v, mu = step
        v = pending_v if slots.numel() == u.shape[1] else v.index_copy(1, slots, pending_v)
        following = torch.where(active, mu > 0, pending_v < pending_u)
        moving = (following != active).any(-1).any(0)  # slots whose guess changed somewhere
        if not bool(moving.any()):
            break
        if not bool(moving.all()):
            index = moving.nonzero().squeeze(1)
            slots, pending_u, following = slots[index], pending_u[:, index], following[:, index]
        active = following
    if v is u:
        return u, residual
    new_residual = kkt_residual(v, u, 2 * torch.bmm(v, g), c)
    better = new_residual < residual
    return torch.where(better[..., None], v, u), torch.where(better, new_residual, residual)
