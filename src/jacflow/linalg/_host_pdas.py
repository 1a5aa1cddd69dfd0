"""Exact solvers in Python floats, for the small problems of a few objectives on the CPU.

With a handful of objectives (multi-task learning: m = 3 to 5) the batched torch solvers of
``_pdas`` spend their time dispatching some two hundred tensor operations, not computing, and
even ``_pdas.lean_pdas_solve`` (a numpy loop, with its torch wrapping) costs more than solving
in Python floats (with more objectives, or more rows, that lean route is faster). This module
solves one problem at a time on Python floats:

* the primal-dual active-set iteration of ``_pdas``: a step is one Cholesky factorisation of
  the free block (at most ``m^3 / 6`` multiply-adds) and one product with ``G``. Singular
  Gramians (duplicated objectives, zero gradients) make singular free blocks: their dependent
  columns are skipped (the free systems are consistent);
* where PDAS stalls (degenerate problems: more objectives than the rank of ``G``), the
  Lawson-Hanson active set of ``_lawson_hanson``, which keeps its passive columns linearly
  independent and terminates.

Every result is certified by ``_pdas``'s KKT residual. A problem neither method certifies (an
indefinite matrix, the iteration caps) makes :func:`solve_rows` return ``None``, and the caller
runs the torch solvers. Conventions as in ``_pdas``: ``g`` symmetric with trace 1 (or 0), each
``u`` of max-norm 1 (or 0), float64 arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import repeat
from operator import add, mul, sub, truediv

Matrix = Sequence[Sequence[float]]

_MAX_ITER = 50
# A squared Cholesky pivot within this fraction of G's largest diagonal entry from 0 marks a
# dependent column; one below minus that fraction, an indefinite block (for the torch solvers).
_MIN_PIVOT = 1e-10


def _cholesky(block: list[list[float]], floor: float) -> list[list[float]] | None:
    """Lower Cholesky factor of the PSD ``block``, skipping dependent columns; ``None`` if the
    block is not PSD (a pivot below ``-floor``).

    A pivot in ``[-floor, floor]`` marks a column (numerically) in the span of the previous
    ones (duplicated objectives, a zero gradient): its factor column stays zero, and
    :func:`_cholesky_solve` sets its unknown to 0. The free systems are consistent (their
    right-hand side lies in the range of ``G_FF``), so the other unknowns still solve them.
    """
    n = len(block)
    factor = [[0.0] * n for _ in range(n)]
    for j in range(n):
        row_j = factor[j]
        pivot = block[j][j] - sum(map(mul, row_j[:j], row_j[:j]))
        if pivot < -floor:
            return None
        if pivot <= floor:
            continue  # a dependent column: row j keeps a zero diagonal
        root = math.sqrt(pivot)
        row_j[j] = root
        for i in range(j + 1, n):
            row_i = factor[i]
            row_i[j] = (block[i][j] - sum(map(mul, row_i[:j], row_j[:j]))) / root
    return factor


def _cholesky_solve(factor: list[list[float]], rhs: list[float]) -> list[float]:
    """Solve ``L L^T x = rhs`` by forward and back substitution, with ``x_j = 0`` where the
    diagonal of ``L`` is zero (the dependent columns of :func:`_cholesky`)."""
    n = len(rhs)
    y = [0.0] * n
    for i in range(n):
        row = factor[i]
        if row[i] != 0.0:
            y[i] = (rhs[i] - sum(map(mul, row[:i], y[:i]))) / row[i]
    x = [0.0] * n
    for i in reversed(range(n)):
        if factor[i][i] != 0.0:
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
        >>> [round(x, 12) for x in solve_row(g, [0.0, 0.0, 1.0], 1e-12)]
        [0.8, 0.0, 1.0]
        >>> solve_row([[0.5, -1.0], [-1.0, 0.5]], [1.0, 0.0], 1e-12) is None  # not PSD: for torch
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


def _lawson_hanson(
    g: Matrix, u: Sequence[float], tol: float, c: float, floor: float
) -> list[float] | None:
    """Lawson-Hanson on ``x = v - u >= 0``: grow the passive set by the most negative
    multiplier whose column is independent of it, solve on it, step back to feasibility."""
    m = len(u)
    gu = [sum(map(mul, row, u)) for row in g]
    x = [0.0] * m
    passive: list[int] = []
    skipped: set[int] = set()

    def solve_on(indices: list[int]) -> list[float] | None:
        factor = _cholesky([[g[i][j] for j in indices] for i in indices], floor)
        if factor is None or factor[-1][-1] == 0.0:  # not PSD, or the last column dependent
            return None
        return _cholesky_solve(factor, [-gu[i] for i in indices])

    for _ in range(_MAX_ITER):
        v = list(map(add, u, x))
        lam = _multipliers(g, v)
        if _residual(v, u, lam, c) <= tol:
            return list(map(max, v, u))
        out = set(passive) | skipped
        candidates = [j for j in range(m) if j not in out and lam[j] < 0]
        if not candidates:
            return None
        grown = [*passive, min(candidates, key=lam.__getitem__)]
        z = solve_on(grown)
        if z is None:  # in the span of the passive columns: only rounding made it a candidate
            skipped.add(grown[-1])
            continue
        passive, skipped = grown, set()
        for _ in range(_MAX_ITER):
            if all(zi > 0 for zi in z):
                x = [0.0] * m
                for i, zi in zip(passive, z):
                    x[i] = zi
                break
            ratios = {i: x[i] / (x[i] - zi) for i, zi in zip(passive, z) if zi <= 0}
            alpha = min(ratios.values())
            for i, zi in zip(passive, z):
                x[i] += alpha * (zi - x[i])
            for i, ratio in ratios.items():
                if ratio <= alpha:
                    x[i] = 0.0  # exactly: rounding may leave it at +-1e-17
            passive = [i for i in passive if x[i] > 0]
            x = [xi if i in passive else 0.0 for i, xi in enumerate(x)]
            if not passive:
                break
            z = solve_on(passive)
            if z is None:
                return None
    return None


def solve_rows(g: Matrix, rows: Sequence[Sequence[float]], tol: float) -> list[list[float]] | None:
    """:func:`solve_row` for each row of ``rows``; ``None`` as soon as one is not certified."""
    top = max((g[i][i] for i in range(len(g))), default=0.0)
    c = 2 * top if top > 0 else 1.0  # as _pdas.multiplier_scale
    floor = _MIN_PIVOT * top
    solved = []
    for u in rows:
        v = _pdas(g, u, tol, c, floor)
        if v is None:  # a degenerate problem (PDAS stalls): the exact active set
            v = _lawson_hanson(g, u, tol, c, floor)
        if v is None:
            return None
        solved.append(v)
    return solved
