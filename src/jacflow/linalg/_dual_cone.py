"""Projection onto the dual cone of the rows of a Jacobian, expressed in the Gramian.

For a Jacobian ``J`` with Gramian ``G = J J^T`` and a weight vector ``u``, the projection of
``J^T u`` onto the dual cone ``{x : J x >= 0}`` equals ``J^T v`` where ``v`` solves

    minimize  v^T G v   subject to  v >= u            (Quinton & Rey, 2024, Prop. 1)

This module holds the reference solver: an exact primal active-set method, one problem at a
time, in float64. It is small and obviously correct; it is the oracle of the tests.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow.linalg._gramian import normalize_gramian, regularize_gramian


def _solve_nonnegative_qp(q: Tensor, c: Tensor, max_iter: int) -> Tensor:
    """Minimize ``x^T q x / 2 + c^T x`` over ``x >= 0`` for a PSD ``q`` with ``c`` in its range.

    Lawson-Hanson style active set: grow the free set with the most negative gradient entry,
    solve the unconstrained problem on it, and step back to feasibility when the solve leaves
    the orthant. Each outer step strictly decreases the objective, so it terminates. The free
    sub-systems are solved by pseudo-inverse: for ``q = 2 J J^T`` and ``c = 2 J J^T u`` they
    are always consistent, so no regularisation is needed.
    """
    m = q.shape[0]
    x = torch.zeros_like(c)
    free = torch.zeros(m, dtype=torch.bool)
    tol = 1e-12 * max(1.0, float(c.abs().max()) if m else 1.0)
    for _ in range(max_iter):
        grad = q @ x + c
        candidates = (~free) & (grad < -tol)
        if not bool(candidates.any()):
            break
        masked = torch.where(candidates, grad, torch.full_like(grad, float("inf")))
        free[int(masked.argmin())] = True
        for _ in range(max_iter):
            idx = free.nonzero().flatten()
            z = torch.zeros_like(x)
            z[idx] = torch.linalg.pinv(q[idx][:, idx], hermitian=True) @ -c[idx]
            if bool((z[idx] > 0).all()):
                x = z
                break
            blocking = idx[z[idx] <= 0]
            ratios = x[blocking] / (x[blocking] - z[blocking])
            alpha = float(ratios.min())
            x = x + alpha * (z - x)
            free &= x > 0
            x = torch.where(free, x, torch.zeros_like(x))
    return x


def project_weights_reference(
    u: Tensor, gramian: Tensor, *, norm_eps: float = 0.0, reg_eps: float = 0.0
) -> Tensor:
    """Exact weights ``v`` of the dual-cone projection for every row of ``u``.

    ``u`` has shape ``[..., m]`` and ``gramian`` shape ``[m, m]``; the result has ``u``'s shape.
    The Gramian is normalised by its trace (``norm_eps``) and regularised by ``reg_eps * I``
    before solving, as documented in :func:`jacflow.linalg.project_weights`.

    Example:
        >>> import torch
        >>> from jacflow.linalg._dual_cone import project_weights_reference
        >>> G = torch.tensor([[1., -1.], [-1., 4.]], dtype=torch.float64)
        >>> project_weights_reference(torch.tensor([1., 0.], dtype=torch.float64), G, reg_eps=0.0)
        tensor([1.0000, 0.2500], dtype=torch.float64)
    """
    device, dtype = gramian.device, gramian.dtype
    g = regularize_gramian(normalize_gramian(gramian.detach().double().cpu(), norm_eps), reg_eps)
    flat_u = u.detach().double().cpu().reshape(-1, g.shape[0])
    rows = []
    for row in flat_u:
        # v = row + x with x >= 0:  minimize (row + x)^T g (row + x).
        x = _solve_nonnegative_qp(2 * g, 2 * g @ row, max_iter=10 * g.shape[0] + 10)
        rows.append(row + x)
    result = torch.stack(rows) if rows else flat_u.clone()
    return result.reshape(u.shape).to(device=device, dtype=dtype)


def project_weights(
    u: Tensor, gramian: Tensor, *, norm_eps: float = 0.0, reg_eps: float = 0.0
) -> Tensor:
    """Weights of the projection of ``J^T u`` onto the dual cone of the rows of ``J``.

    For every row ``u`` of ``u`` (shape ``[..., m]``) returns ``v`` (same shape) solving
    ``minimize v^T G v subject to v >= u`` with ``G = gramian`` (``[m, m]``), so that
    ``J^T v`` is the projection of ``J^T u`` onto ``{x : J x >= 0}``.

    Args:
        u: the weights to project, ``[..., m]``.
        gramian: the Gramian ``J J^T``, ``[m, m]``.
        norm_eps: ``G`` is divided by its trace; a trace ``<= norm_eps`` counts as zero.
        reg_eps: ``reg_eps * I`` is added to the normalised ``G`` (0: the exact problem).

    Example:
        >>> import torch
        >>> from jacflow.linalg import project_weights
        >>> G = torch.tensor([[1., -1.], [-1., 4.]], dtype=torch.float64)
        >>> project_weights(torch.tensor([1., 0.], dtype=torch.float64), G)
        tensor([1.0000, 0.2500], dtype=torch.float64)
    """
    return project_weights_reference(u, gramian, norm_eps=norm_eps, reg_eps=reg_eps)
