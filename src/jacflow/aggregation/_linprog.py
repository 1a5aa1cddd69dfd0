"""A small dense linear-programming solver in torch: the two-phase simplex method.

Used by methods whose sub-problem is a linear program over a handful of variables (EPO). It
runs on the input's device in float64 with Bland's anti-cycling rule, so it terminates; an
iteration cap bounds the work anyway.
"""

from __future__ import annotations

import torch
from torch import Tensor

_TOL = 1e-10


def _pivot(tableau: Tensor, row: int, col: int) -> None:
    tableau[row] /= tableau[row, col].clone()
    factors = tableau[:, col].clone()
    factors[row] = 0
    tableau -= factors[:, None] * tableau[row][None, :]


def _run_simplex(tableau: Tensor, basis: list[int], allowed: int, max_iter: int) -> str:
    """Minimise the objective held in the last row; entering columns are among ``:allowed``."""
    for _ in range(max_iter):
        costs = tableau[-1, :allowed]
        entering = (costs < -_TOL).nonzero()
        if entering.numel() == 0:
            return "optimal"
        col = int(entering[0])  # Bland: the smallest improving index
        column = tableau[:-1, col]
        positive = column > _TOL
        if not bool(positive.any()):
            return "unbounded"
        ratios = torch.where(positive, tableau[:-1, -1] / column, torch.inf)
        best = float(ratios.min())
        ties = (ratios <= best + _TOL * (1 + abs(best))).nonzero().flatten().tolist()
        row = min(ties, key=lambda i: basis[i])  # Bland: the smallest leaving index
        _pivot(tableau, row, col)
        basis[row] = col
    return "iteration cap"


def linprog_max(
    c: Tensor,
    A_ub: Tensor,
    b_ub: Tensor,
    A_eq: Tensor,
    b_eq: Tensor,
    max_iter: int = 1000,
) -> Tensor | None:
    """``argmax c^T x`` s.t. ``A_ub x <= b_ub``, ``A_eq x = b_eq``, ``x >= 0``; ``None`` if none.

    Returns ``None`` when the program is infeasible or unbounded, or the cap is hit. All inputs
    must be finite; the computation is in float64 on ``c``'s device.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._linprog import linprog_max
        >>> c = torch.tensor([1., 2.])
        >>> linprog_max(c, torch.tensor([[1., 1.]]), torch.tensor([1.]),
        ...             torch.zeros(0, 2), torch.zeros(0))
        tensor([0., 1.], dtype=torch.float64)
    """
    f64, device = torch.float64, c.device
    n, n_ub, n_eq = c.shape[0], A_ub.shape[0], A_eq.shape[0]
    rows = n_ub + n_eq
    # Columns: x (n), slacks (n_ub), artificials (rows), right-hand side.
    tableau = torch.zeros(rows + 1, n + n_ub + rows + 1, dtype=f64, device=device)
    tableau[:n_ub, :n] = A_ub.to(dtype=f64, device=device)
    tableau[:n_ub, n : n + n_ub] = torch.eye(n_ub, dtype=f64, device=device)
    tableau[n_ub:rows, :n] = A_eq.to(dtype=f64, device=device)
    tableau[:n_ub, -1] = b_ub.to(dtype=f64, device=device)
    tableau[n_ub:rows, -1] = b_eq.to(dtype=f64, device=device)
    flip = tableau[:rows, -1] < 0
    tableau[:rows][flip] *= -1
    tableau[:rows, n + n_ub : n + n_ub + rows] = torch.eye(rows, dtype=f64, device=device)
    basis = list(range(n + n_ub, n + n_ub + rows))
    # Phase 1: minimise the sum of the artificials.
    tableau[-1, : n + n_ub] = -tableau[:rows, : n + n_ub].sum(0)
    tableau[-1, -1] = -tableau[:rows, -1].sum()
    status = _run_simplex(tableau, basis, n + n_ub, max_iter)
    scale = 1.0 + float(tableau[:rows, -1].abs().max()) if rows else 1.0
    if status != "optimal" or float(-tableau[-1, -1]) > 1e-9 * scale:
        return None
    for row, var in enumerate(basis):  # drive the artificials (at level 0) out of the basis
        if var >= n + n_ub:
            candidates = (tableau[row, : n + n_ub].abs() > _TOL).nonzero()
            if candidates.numel():
                col = int(candidates[0])
                _pivot(tableau, row, col)
                basis[row] = col
    # Phase 2: minimise -c^T x.
    costs = torch.zeros(n + n_ub + rows + 1, dtype=f64, device=device)
    costs[:n] = -c.to(dtype=f64, device=device)
    for row, var in enumerate(basis):
        costs -= costs[var].clone() * tableau[row]
    tableau[-1] = costs
    if _run_simplex(tableau, basis, n + n_ub, max_iter) != "optimal":
        return None
    x = torch.zeros(n, dtype=f64, device=device)
    for row, var in enumerate(basis):
        if var < n:
            x[var] = tableau[row, -1]
    return x
