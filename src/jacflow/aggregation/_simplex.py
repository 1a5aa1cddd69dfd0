"""Torch solvers on the probability simplex, shared by the methods that need them.

* :func:`project_onto_simplex`: Euclidean projection, sort-based and vectorised (no Python loop).
* :func:`min_norm_weights`: the minimum-norm point of the convex hull of points given only by
  their Gram matrix (Wolfe's algorithm, 1976), with warm starts.
"""

from __future__ import annotations

import torch
from torch import Tensor


def project_onto_simplex(y: Tensor) -> Tensor:
    """Euclidean projection of every row of ``y`` (``[..., m]``) onto ``{w >= 0, sum(w) = 1}``.

    The sort-based algorithm of Held, Wolfe & Crowder (1974): the projection is
    ``max(y - theta, 0)`` with ``theta`` chosen so that the result sums to one. A NaN entry makes
    the whole row NaN.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._simplex import project_onto_simplex
        >>> project_onto_simplex(torch.tensor([0.695, -0.305]))
        tensor([1., 0.])
        >>> project_onto_simplex(torch.tensor([0.5, 0.5, 0.2]))
        tensor([0.4333, 0.4333, 0.1333])
    """
    m = y.shape[-1]
    if m == 0:
        return y.clone()
    # The projection ignores a common shift: the largest entry moved to 0 keeps the 1 that the
    # weights sum to. Entries of 1e8 (a float32 step of 0.1 on a Gramian of 1e9) swallowed it,
    # and y - theta rounded to 0 everywhere: weights of sum 0, a zero update.
    y = y - y.amax(dim=-1, keepdim=True)
    ordered = torch.sort(y, dim=-1, descending=True).values
    shifted_sums = ordered.cumsum(dim=-1) - 1
    ranks = torch.arange(1, m + 1, device=y.device, dtype=y.dtype)
    count = (ordered - shifted_sums / ranks > 0).sum(dim=-1, keepdim=True).clamp_min(1)
    theta = shifted_sums.gather(-1, count - 1) / count.to(y.dtype)
    return (y - theta).clamp_min(0)


def _affine_minimizer(gram: Tensor, support: Tensor) -> Tensor:
    """Weights ``a`` (summing to one) of the min-norm point of the affine hull of ``support``."""
    k = support.shape[0]
    bordered = torch.zeros(k + 1, k + 1, dtype=gram.dtype, device=gram.device)
    bordered[:k, :k] = gram[support][:, support]
    bordered[:k, k] = 1
    bordered[k, :k] = 1
    rhs = torch.zeros(k + 1, dtype=gram.dtype, device=gram.device)
    rhs[k] = 1
    solution, info = torch.linalg.solve_ex(bordered, rhs)
    if int(info) != 0 or not bool(torch.isfinite(solution).all()):
        solution = torch.linalg.pinv(bordered, hermitian=True) @ rhs
    return solution[:k]


def min_norm_weights(
    gram: Tensor, start: Tensor | None = None, max_iter: int | None = None
) -> Tensor:
    """Weights ``w`` in the simplex minimising ``w^T K w`` for the Gram matrix ``K`` of points.

    Wolfe's algorithm ("Finding the nearest point in a polytope", Math. Programming 1976): a
    corral ``S`` of affinely independent points is grown with the point of least inner product
    with the current iterate and shrunk whenever the affine minimiser leaves the simplex. It is
    exact up to rounding and finite; ``max_iter`` caps the number of major cycles.

    Args:
        gram: ``[m, m]`` PSD Gram matrix of the points (float64 recommended), ``m >= 1``.
        start: optional feasible warm start (its support must be affinely independent, as
            returned by a previous call on translated points).
        max_iter: cap on the number of points added to the corral (default ``5 m + 20``; in
            exact arithmetic about ``m`` suffice).

    Example:
        >>> import torch
        >>> from jacflow.aggregation._simplex import min_norm_weights
        >>> P = torch.tensor([[1., 0.], [0., 1.]], dtype=torch.float64)
        >>> min_norm_weights(P @ P.T)
        tensor([0.5000, 0.5000], dtype=torch.float64)
    """
    m = gram.shape[0]
    diag = gram.diagonal()
    tol = 1e-12 * float(diag.abs().max())
    if start is None:
        w = torch.zeros(m, dtype=gram.dtype, device=gram.device)
        w[int(diag.argmin())] = 1
    else:
        w = start.clone()
    support = (w > 0).nonzero().flatten()
    need_minor = start is not None
    for _ in range(5 * m + 20 if max_iter is None else max_iter):
        if not need_minor:
            products = gram @ w
            j = int(products.argmin())
            if float(w @ products - products[j]) <= tol or bool((support == j).any()):
                break
            support = torch.cat([support, support.new_tensor([j])])
        need_minor = False
        for _ in range(m + 1):  # minor cycles: each removes at least one point
            a = _affine_minimizer(gram, support)
            if bool((a > 0).all()):
                w = torch.zeros_like(w).index_put_((support,), a)
                break
            current = w[support]
            blocking = a <= 0
            ratios = current[blocking] / (current[blocking] - a[blocking])
            theta = ratios.min().clamp(0, 1)
            current = current + theta * (a - current)
            keep = current > 0
            keep[blocking.nonzero().flatten()[int(ratios.argmin())]] = False
            support, current = support[keep], current[keep]
            w = torch.zeros_like(w).index_put_((support,), current / current.sum())
    return w
