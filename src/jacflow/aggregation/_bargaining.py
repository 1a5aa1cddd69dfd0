"""The positive solution of ``G w = w^(-p)``: the weights of Nash-MTL (p = 1) and FairGrad.

Both methods ask for ``w > 0`` with ``(G w)_i = w_i^(-p)``, i.e. ``g_i . d = w_i^(-p)`` for
``d = J^T w``. It is the stationarity condition of the strictly convex problem

    minimize  f(w) = 1/2 w^T G w + sum_i phi(w_i)   over w > 0,
    phi(w) = -log(w) (p = 1),   phi(w) = -w^(1-p) / (1-p) (p != 1),

which this module solves with Newton's method and a backtracking line search that keeps
``w > 0`` (a damped Newton method on a self-concordant function when p = 1). ``G`` gets
``ridge * trace(G) / m`` added to its diagonal so that a solution always exists, even when some
non-negative combination of the rows vanishes (then no ``d`` improves every objective, and the
corresponding weights become large but finite). Callers pass a ridge above the relative rounding
error of the Gramian's original dtype, so that rounding cannot make ``G`` indefinite.
"""

from __future__ import annotations

import torch
from torch import Tensor

_RESIDUAL_TOL = 1e-12


def ridge_for(dtype: torch.dtype) -> float:
    """A relative ridge safely above the rounding error of a Gramian computed in ``dtype``."""
    return max(1e-12, 10 * torch.finfo(dtype).eps)


def _barrier(w: Tensor, p: float) -> Tensor:
    if p == 1.0:
        return -torch.log(w).sum()
    return -(w ** (1.0 - p)).sum() / (1.0 - p)


def _objective(G: Tensor, w: Tensor, p: float) -> Tensor:
    return 0.5 * w @ G @ w + _barrier(w, p)


def solve_power_equation(
    G: Tensor, p: float, start: Tensor | None, max_iter: int, ridge: float = 1e-12
) -> Tensor:
    """Positive ``w`` with ``G w = w^(-p)`` (elementwise), for a finite PSD float64 ``G``.

    Args:
        G: ``[m, m]`` finite, symmetric PSD, float64, with a positive trace.
        p: the exponent, ``p > 0``.
        start: positive warm start (default: ones); it is first rescaled optimally.
        max_iter: cap on the number of Newton steps.
        ridge: relative regularisation of ``G`` (see the module docstring).

    Returns:
        The last iterate; it meets ``max_i |(G w)_i w_i^p - 1| <= 1e-12`` unless the cap was hit.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._bargaining import solve_power_equation
        >>> G = torch.tensor([[4., 0.], [0., 1.]], dtype=torch.float64)
        >>> solve_power_equation(G, 1.0, None, 20)
        tensor([0.5000, 1.0000], dtype=torch.float64)
    """
    m = G.shape[0]
    # Clip the negative eigenvalues that rounding leaves in a low-precision Gramian, then add
    # the ridge: f is then strictly convex and bounded below.
    eigenvalues, eigenvectors = torch.linalg.eigh(G)
    G = (eigenvectors * eigenvalues.clamp_min(0)) @ eigenvectors.T
    G = G + (ridge * float(G.diagonal().sum()) / m) * torch.eye(m, dtype=G.dtype, device=G.device)
    w = torch.ones(m, dtype=G.dtype, device=G.device) if start is None else start.clone()
    # The best multiple of w: t^(1+p) = sum(w^(1-p)) / (w^T G w).
    curvature = float(w @ G @ w)
    if curvature > 0:
        w = w * (float((w ** (1.0 - p)).sum()) / curvature) ** (1.0 / (1.0 + p))
    value = _objective(G, w, p)
    for _ in range(max_iter):
        power = w ** (-p)
        gradient = G @ w - power
        if float(((G @ w) / power - 1).abs().max()) <= _RESIDUAL_TOL:
            break
        hessian = G + torch.diag(p * power / w)
        step = -torch.linalg.solve(hessian, gradient)
        slope = float(gradient @ step)
        if slope >= 0:  # numerically converged: no descent direction left
            break
        shrinking = step < 0
        t = 1.0
        if bool(shrinking.any()):
            t = min(1.0, 0.99 * float((-w[shrinking] / step[shrinking]).min()))
        for _ in range(60):
            candidate = w + t * step
            candidate_value = _objective(G, candidate, p)
            # Near the solution (Newton decrement -slope tiny) the decrease is below the rounding
            # of f: take the full step, where Newton converges quadratically.
            if -slope <= 1e-8 and t == 1.0:
                break
            if float(candidate_value) <= float(value) + 0.25 * t * slope:
                break
            t *= 0.5
        else:
            break
        if t < 1.0 and -t * slope <= 1e-15 * (abs(float(value)) + 1.0):
            break  # the decrease is below the rounding of f: no further progress possible
        w, value = candidate, candidate_value
    return w
