"""PDAS in Python floats, for the small problems of a few objectives on the CPU.

With a handful of objectives (multi-task learning: m = 3 to 12) the batched torch solvers of
``_pdas`` spend their time dispatching some two hundred tensor operations (about 1.5 ms), not
computing. This module runs the same primal-dual active-set iteration (see ``_pdas``) one
problem at a time on Python floats: a step is one Cholesky factorisation of the free block (at
most ``m^3 / 6`` multiply-adds) and one product with ``G``.

Every result is certified by ``_pdas``'s KKT residual. A problem the iteration cannot certify (a
free block that is not numerically positive definite, as on singular Gramians; a cycle; the
iteration cap) makes :func:`solve_rows` return ``None``, and the caller runs the torch solvers,
which handle every case. Conventions as in ``_pdas``: ``g`` symmetric with trace 1 (or 0), each
``u`` of max-norm 1 (or 0), float64 arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import repeat
from operator import mul, sub, truediv

Matrix = Sequence[Sequence[float]]

_MAX_ITER = 50
# A free block is handed to the torch solvers when a squared Cholesky pivot falls below this
# fraction of G's largest diagonal entry (a nearly singular block: they refine such solves).
_MIN_PIVOT = 1e-10


def _cholesky(block: list[list[float]], floor: float) -> list[list[float]] | None:
    """Lower Cholesky factor of ``block``, or ``None`` if a pivot is ``<= floor``."""
    n = len(block)
    factor = [[0.0] * n for _ in range(n)]
    for j in range(n):
        row_j = factor[j]
        pivot = block[j][j] - sum(map(mul, row_j[:j], row_j[:j]))
        if not pivot > floor:
            return None
        root = math.sqrt(pivot)
        row_j[j] = root
        for i in range(j + 1, n):
            row_i = factor[i]
            row_i[j] = (block[i][j] - sum(map(mul, row_i[:j], row_j[:j]))) / root
    return factor


def _cholesky_solve(factor: list[list[float]], rhs: list[float]) -> list[float]:
    """Solve ``L L^T x = rhs`` by forward and back substitution."""
    n = len(rhs)
    y = [0.0] * n
    for i in range(n):
        row = factor[i]
        y[i] = (rhs[i] - sum(map(mul, row[:i], y[:i]))) / row[i]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (y[i] - sum(factor[k][i] * x[k] for k in range(i + 1, n))) / factor[i][i]
    return x


def _multipliers(g: Matrix, v: list[float]) -> list[float]:
    """``lam = 2 G v``."""
    return [2 * sum(map(mul, row, v)) for row in g]


def _residual(v: list[float], u: Sequence[float], lam: list[float], c: float) -> float:
    """``_pdas.kkt_residual`` of one problem."""
    natural = max(map(abs, map(min, map(sub, v, u), map(truediv, lam, repeat(c)))))
    return natural / max(1.0, max(map(abs, v)))


def solve_row(g: Matrix, u: Sequence[float], tol: float) -> list[float] | None:
    """``v`` minimising ``v^T G v`` over ``v >= u`` to the KKT residual ``tol``, or ``None``.

    Example:
        >>> from jacflow.linalg._host_pdas import solve_row
        >>> [round(x, 12) for x in solve_row([[0.2, -0.2], [-0.2, 0.8]], [1.0, 0.0], 1e-12)]
        [1.0, 0.25]
        >>> g = [[0.25, 0.25, -0.2], [0.25, 0.25, -0.2], [-0.2, -0.2, 0.5]]  # duplicated rows
        >>> solve_row(g, [0.0, 0.0, 1.0], 1e-12) is None  # a singular free block: for torch
        True
    """
    solved = solve_rows(g, [u], tol)
    return None if solved is None else solved[0]


def _pdas(g: Matrix, u: Sequence[float], tol: float, c: float, floor: float) -> list[float] | None:
    """PDAS from ``v = u`` with the multiplier scale ``c`` and the pivot floor ``floor``."""
    m = len(u)
    v = list(u)
    lam = _multipliers(g, v)
    seen: set[tuple[bool, ...]] = set()
    for _ in range(_MAX_ITER):
        if _residual(v, u, lam, c) <= tol:
            return list(map(max, v, u))  # exactly feasible, as in _dual_cone
        active = tuple(li + c * (ui - vi) > 0 for vi, ui, li in zip(v, u, lam))
        if active in seen:  # a cycle: PDAS would not converge from here
            return None
        seen.add(active)
        free = [i for i in range(m) if not active[i]]
        v = [ui if a else 0.0 for ui, a in zip(u, active)]
        if free:
            factor = _cholesky([[g[i][j] for j in free] for i in free], floor)
            if factor is None:
                return None
            rhs = [-sum(map(mul, g[i], v)) for i in free]
            for i, x in zip(free, _cholesky_solve(factor, rhs)):
                v[i] = x
        lam = _multipliers(g, v)
    return None


def solve_rows(g: Matrix, rows: Sequence[Sequence[float]], tol: float) -> list[list[float]] | None:
    """:func:`solve_row` for each row of ``rows``; ``None`` as soon as one is not certified."""
    top = max((g[i][i] for i in range(len(g))), default=0.0)
    c = 2 * top if top > 0 else 1.0  # as _pdas.multiplier_scale
    solved = []
    for u in rows:
        v = _pdas(g, u, tol, c, _MIN_PIVOT * top)
        if v is None:
            return None
        solved.append(v)
    return solved
