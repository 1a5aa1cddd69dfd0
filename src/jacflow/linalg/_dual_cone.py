"""Projection onto the dual cone of the rows of a Jacobian, expressed in the Gramian.

For a Jacobian ``J`` with Gramian ``G = J J^T`` and a weight vector ``u``, the projection of
``J^T u`` onto the dual cone ``{x : J x >= 0}`` equals ``J^T v`` where ``v`` solves

    minimize  v^T G v   subject to  v >= u            (Quinton & Rey, 2024, Prop. 1)

This module holds the public entry point :func:`project_weights` (batched PDAS / ADMM / FISTA
solvers in ``_pdas`` and ``_first_order``) and the reference solver
:func:`project_weights_reference`: an exact primal active-set method, one problem at a time, in
float64. It is small and obviously correct; it is the oracle of the tests.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import TypedDict

import torch
from torch import Tensor

from jacflow._warnings import caller_stacklevel
from jacflow.linalg._cholesky import cholesky_ex
from jacflow.linalg._dual_pdas import (
    active_systems_pay,
    dual_pdas_solve,
    lean_dual_pdas_solve,
    safe_inverse,
)
from jacflow.linalg._first_order import admm_solve, fista_solve
from jacflow.linalg._gramian import (
    _normalize_gramian,
    _regularize_gramian,
    check_eps,
    check_float_tensor,
    has_nonfinite,
)
from jacflow.linalg._host_pdas import solve_rows
from jacflow.linalg._implicit import differentiable_projection
from jacflow.linalg._lawson_hanson import (
    DEPENDENT,
    DEPENDENT_RETRY,
    lawson_hanson_solve,
    least_combination,
)
from jacflow.linalg._pdas import (
    lean_pdas_solve,
    multiplier_scale,
    natural_residual,
    pdas_solve,
    start_residual,
)


def _solve_nonnegative_qp(q: Tensor, c: Tensor, max_iter: int) -> Tensor:
    """Minimize ``x^T q x / 2 + c^T x`` over ``x >= 0`` for a PSD ``q`` with ``c`` in its range.

    Lawson-Hanson active set: grow the free set with the most negative gradient entry, solve the
    unconstrained problem on it, and step back to feasibility when the solve leaves the orthant.
    Each outer step strictly decreases the objective, so it terminates. A candidate whose column
    is in the span of the free set (its addition does not raise the rank of ``q_FF``) is skipped
    until the free set changes: in exact arithmetic its gradient is zero, so only rounding makes
    it a candidate, and adding it would make the free system singular. The free systems are
    solved by pseudo-inverse: for ``q = 2 J J^T`` and ``c = 2 J J^T u`` they are consistent.
    """
    m = q.shape[0]
    x = torch.zeros_like(c)
    free = torch.zeros(m, dtype=torch.bool, device=q.device)
    skipped = torch.zeros(m, dtype=torch.bool, device=q.device)
    tol = 1e-12 * max(1.0, float(c.abs().max()) if m else 1.0)

    def rank(mask: Tensor) -> int:
        idx = mask.nonzero().flatten()
        block = q[idx][:, idx]
        return int(torch.linalg.matrix_rank(block, hermitian=True, rtol=1e-13)) if len(idx) else 0

    for _ in range(max_iter):
        grad = q @ x + c
        candidates = (~free) & (~skipped) & (grad < -tol)
        if not bool(candidates.any()):
            break
        masked = torch.where(candidates, grad, torch.full_like(grad, float("inf")))
        j = int(masked.argmin())
        grown = free.clone()
        grown[j] = True
        if rank(grown) == rank(free):
            skipped[j] = True
            continue
        free = grown
        skipped[:] = False
        for _ in range(max_iter):
            idx = free.nonzero().flatten()
            z = torch.zeros_like(x)
            block, inverse = q[idx][:, idx], torch.linalg.pinv(q[idx][:, idx], hermitian=True)
            z[idx] = inverse @ -c[idx]
            for _ in range(2):  # (refined: pinv's solve leaves gradients of eps * cond(q_FF))
                z[idx] -= inverse @ (block @ z[idx] + c[idx])
            if bool((z[idx] > 0).all()):
                x = z
                break
            blocking = idx[z[idx] <= 0]
            ratios = x[blocking] / (x[blocking] - z[blocking])
            alpha = float(ratios.min())
            x = x + alpha * (z - x)
            x[blocking[ratios <= alpha]] = 0.0  # exactly: rounding may leave them at +-1e-17
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
    g = _regularize_gramian(_normalize_gramian(gramian.detach().double().cpu(), norm_eps), reg_eps)
    flat_u = u.detach().double().cpu().reshape(-1, g.shape[0])
    # (solved with v = d * y, d = diag(g)^(-1/2): the unit diagonal makes the active set's
    # absolute tolerance relative to every row, whose norms may differ by orders of magnitude)
    norms = g.diagonal().clamp(min=0).sqrt()
    d = torch.where(norms > 0, 1 / norms.clamp(min=torch.finfo(g.dtype).tiny), 1.0)
    scaled = d[:, None] * g * d[None, :]
    rows = []
    for row in flat_u:
        # y = row / d + x with x >= 0:  minimize (row / d + x)^T scaled (row / d + x).
        start = row / d
        x = _solve_nonnegative_qp(2 * scaled, 2 * scaled @ start, max_iter=10 * g.shape[0] + 10)
        rows.append(d * (start + x))
    result = torch.stack(rows) if rows else flat_u.clone()
    return result.reshape(u.shape).to(device=device, dtype=dtype)


METHODS = ("auto", "pdas", "fista", "admm")
_AUTO_PDAS_MAX_M = 32  # "auto" uses PDAS up to this size, ADMM above
# ADMM starts in float32 for loose tolerances, and for large m (10-20% faster from m ~ 128).
_LOW_PRECISION_TOL = 1e-6
_LOW_PRECISION_MIN_M = 128
_FISTA_TOL = 1e-7  # FISTA stops here and hands over to the exact PDAS polish
_PDAS_MAX_ITER = 50
_DUAL_MAX_ITER = 8  # steps of "auto"'s dual PDAS (on G^-1) before PDAS / ADMM take over
# A problem given in single precision (or lower) to the default tolerance of 1e-6 takes its dual
# steps in float32 from this size (the result is checked against the float64 G, and problems
# left above the tolerance go on in float64): UPGrad's weights on per-sample Gramians at
# m = 128 took 0.76-0.94x the time; at m = 32 and 64 the conversions cost what it saves.
_SINGLE_MIN_M = 96
_SINGLE_MIN_TOL = 1e-6
# (and only on a G whose Cholesky pivots say it is well conditioned, see safe_inverse: the
# per-sample Gramians of the benchmarks have ratios of 0.28 to 0.53; at 2.8e-3, cond 1.3e4,
# float32 steps left problems for float64 ones, a wasted attempt)
_SINGLE_MIN_PIVOT = 1e-2
_FIRST_ORDER_MAX_ITER = 20_000
# PDAS's problems (rows of max-norm 1) whose weights exceed this go to the exact fallback: see
# _solve (a drift along a nearly null direction of a rounded rank-deficient Gramian).
_DRIFTED_WEIGHTS = 1e3
_POLISH_ITER = 10
# Polish only when its batched Cholesky (k * s^3 for free sets of size s) is cheap.
_POLISH_MAX_FLOP = 3e7
_DEFAULT_TOL = {torch.float64: 1e-10}  # other dtypes: 1e-6 (their Gramians are that inexact)
# Problems solved in Python floats (``_host_pdas``) when on the CPU and at most this many
# multiply-adds of Cholesky factorisations (rows x m^3): there they beat the torch solvers and
# the lean route, whose numpy loop costs less than its torch wrapping (UPGrad: even at m = 5).
_HOST_MAX_WORK = 5**4  # UPGrad: m <= 5
# Other problems on one CPU Gramian of at most this many objectives, outside autograd, first try
# ``_pdas.lean_pdas_solve`` (masked m x m systems: their cost grows as rows x m^3).
_LEAN_MAX_M = 24
# Above, UPGrad's problems of up to this many objectives whose first guess of the active sets
# is small (per-sample Gramians) first try ``_dual_pdas.lean_dual_pdas_solve``: UPGrad's
# weights 0.70-0.98x the time of the batched route at m = 25 to 32; at 40 and 48 mixed
# (0.83-1.35x by Gramian), at 64 slower (one-off A/Bs; see docs/performance.md, "Stop 49").
_LEAN_DUAL_MAX_M = 32

# Problems of at most this many objectives on an accelerator are copied to the host, solved
# there and copied back: the batched solvers' hundreds of small kernels and their
# synchronisations cost more than the copies. (UPGrad weights on an H100 against 1 and 16 CPU
# threads: the host 1.3x-10x faster up to m = 64, 0.65x-3.7x at m = 128 by Gramian kind, mostly
# slower from m = 256.)
_OFFLOAD_MAX_M = 128


def _offloads(gramian: Tensor, differentiable: bool, method: str) -> bool:
    """Whether :func:`project_weights` solves on the host a problem on an accelerator (one
    Gramian: the threshold was measured on one; a batch of them is left to the device)."""
    return (
        gramian.device.type != "cpu"
        and gramian.ndim == 2
        and gramian.shape[-1] <= _OFFLOAD_MAX_M
        and not differentiable
        and method == "auto"
    )


class _Settings(TypedDict):
    """The keyword settings of :func:`project_weights` and :func:`project_diagonal`."""

    norm_eps: float
    reg_eps: float
    method: str
    max_iter: int | None
    tol: float | None


def _solved_on_host(
    solve: Callable[[Tensor, Tensor, torch.dtype, _Settings], Tensor],
    first: Tensor,
    gramian: Tensor,
    dtype: torch.dtype,
    settings: _Settings,
) -> Tensor:
    """``solve`` on host copies of ``first`` and ``gramian``, sent back to the Gramian's device."""
    on_host = solve(first.cpu(), gramian.cpu(), dtype, settings)
    return on_host.to(gramian.device, non_blocking=True)


def tolerances(
    dtype: torch.dtype, m: int, tol: float | None, rescaled: bool = False
) -> tuple[float, float]:
    """The residual the solvers aim for (PDAS's problems left above it go to the exact
    fallback), and the one accepted without a warning (the other methods' problems left above
    it go there).

    A given ``tol`` is both. By default they aim for ``1e-10`` (float64) or ``1e-6`` and accept
    up to ``10 m eps`` more: the residual that rounding errors of a Gramian stored in ``dtype``
    (slightly indefinite for float32) may leave even for an exact method; ``100 m eps`` on a
    problem ``rescaled`` to a unit diagonal, where every objective is measured at its own
    scale (a float32 Gramian of condition 1e9 left 1.3e-5 at ``m = 9``). On the problem as
    given, ``100 m eps`` let the solvers stop early enough for the update to conflict with an
    objective (cosines down to -9e-3, float32, m = 32).
    """
    if tol is not None:
        return float(tol), float(tol)
    target = _DEFAULT_TOL.get(dtype, 1e-6)
    return target, max(target, (100 if rescaled else 10) * m * torch.finfo(dtype).eps)


class SolverWarning(UserWarning):
    """Warned by :func:`project_weights` when a solver stops before meeting its tolerance.

    The result is then the best iterate found (lowest KKT residual), which is feasible
    (``v >= u``) but not optimal to the requested tolerance.

    Example:
        >>> import warnings
        >>> from jacflow.linalg import SolverWarning
        >>> issubclass(SolverWarning, UserWarning)
        True
    """


def check_solver_settings(
    norm_eps: float, reg_eps: float, method: str, max_iter: int | None, tol: float | None
) -> None:
    """Validate the settings of :func:`project_weights` (shared with ``TorchProjector``)."""
    # (imported here: jacflow.aggregation imports jacflow.linalg)
    from jacflow.aggregation._hyperparameters import check_float, check_int

    # (a bool is not a number here; NaN or an infinity would silently give zeros or NaN)
    for name, eps in (("norm_eps", norm_eps), ("reg_eps", reg_eps)):
        check_eps(eps, name)
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}, received {method!r}.")
    if max_iter is not None:
        check_int(max_iter, "max_iter", low=1)
    if tol is not None:
        check_float(tol, "tol", low=0.0, low_open=True)


def _check_inputs(u: Tensor, gramian: Tensor, diagonal: bool = False) -> None:
    """Types, shapes and devices of ``project_weights``'s ``u`` and ``gramian`` (``diagonal``:
    of ``project_diagonal``'s ``pref`` ``[m]`` and ``gramian`` ``[m, m]``)."""
    u_name = "pref" if diagonal else "u"
    for name, value in ((u_name, u), ("gramian", gramian)):
        check_float_tensor(value, name)
    if diagonal and (u.ndim != 1 or gramian.shape != (u.shape[0], u.shape[0])):
        raise ValueError(
            "`pref` must have shape [m] and `gramian` shape [m, m] (one Gramian), received "
            f"shapes {tuple(u.shape)} and {tuple(gramian.shape)}."
        )
    if gramian.ndim < 2 or gramian.shape[-1] != gramian.shape[-2]:
        raise ValueError(
            "`gramian` must be a square matrix [m, m] or a batch of them [..., m, m], received "
            f"shape {tuple(gramian.shape)}."
        )
    m = gramian.shape[-1]
    if u.ndim < 1 or u.shape[-1] != m:
        raise ValueError(
            f"`u` must have shape [..., m] with m = {m} (the size of `gramian`), received shape "
            f"{tuple(u.shape)}."
        )
    if gramian.ndim > 2 and (u.ndim != gramian.ndim or u.shape[:-2] != gramian.shape[:-2]):
        raise ValueError(
            "With a batch of Gramians [*batch, m, m], `u` must have shape [*batch, k, m], "
            f"received `u` of shape {tuple(u.shape)} for `gramian` of shape "
            f"{tuple(gramian.shape)}; add the k dimension with `u.unsqueeze(-2)`."
        )
    if u.device != gramian.device:
        raise ValueError(
            f"`{u_name}` is on {u.device} but `gramian` on {gramian.device}; move them to one "
            "device."
        )


def _unsolved_by(
    solver: Callable[[Tensor], tuple[Tensor, Tensor] | None],
    v: Tensor,
    residual: Tensor,
    tol: float,
) -> tuple[Tensor, Tensor]:
    """Run ``solver`` on the problem slots (``rows``, indices into ``k``) that some Gramian of
    the batch left above ``tol``; keep the better iterate of each problem (all of them when
    ``solver`` gives ``None``)."""
    if float(residual.amax()) <= tol:
        return v, residual
    rows = (residual > tol).any(0).nonzero().flatten()
    solved = solver(rows)
    if solved is None:
        return v, residual
    again, again_residual = solved
    better = (again_residual < residual[:, rows])[..., None]
    v = v.index_copy(1, rows, torch.where(better, again, v[:, rows]))
    residual = residual.index_copy(1, rows, torch.minimum(again_residual, residual[:, rows]))
    return v, residual


def _exact_fallback(
    u: Tensor, g: Tensor, v: Tensor, residual: Tensor, tol: float
) -> tuple[Tensor, Tensor]:
    """Re-solve the problems whose residual exceeds ``tol`` with the exact Lawson-Hanson
    method.

    The fast methods can fail on degenerate problems (singular ``G`` with more rows than its
    rank: non-unique ``v``, a dual cone that may be a single point); Lawson-Hanson cannot.
    Problems are gathered per Gramian row of the batch so that every Gramian is factorised once.
    Those it leaves above ``tol`` take a second pass that rejects fewer columns as dependent
    (``DEPENDENT_RETRY``).
    """
    for reject_below in (DEPENDENT, DEPENDENT_RETRY):
        solver = functools.partial(_lawson_hanson_rows, u, g, tol, reject_below)
        v, residual = _unsolved_by(solver, v, residual, tol)
    return v, residual


def _lawson_hanson_rows(
    u: Tensor, g: Tensor, tol: float, reject_below: float, rows: Tensor
) -> tuple[Tensor, Tensor]:
    """Lawson-Hanson on the problem slots ``rows`` (indices into ``k``)."""
    return lawson_hanson_solve(u[:, rows], g, tol, reject_below=reject_below)


def _fista_with_polish(u: Tensor, g: Tensor, cap: int, tol: float) -> tuple[Tensor, Tensor]:
    """FISTA to a loose tolerance, then the exact PDAS polish when cheap, then FISTA again."""
    v, residual = fista_solve(u, g, u, cap, max(tol, _FISTA_TOL))
    free = int((v > u).sum(-1).amax())
    if u.shape[0] * u.shape[1] * free**3 <= _POLISH_MAX_FLOP:
        polished, polished_residual = pdas_solve(u, g, v, min(cap, _POLISH_ITER), tol)
        better = polished_residual <= residual
        v = torch.where(better[..., None], polished, v)
        residual = torch.where(better, polished_residual, residual)
    if not bool((residual <= tol).all()):  # polish too costly or unfinished: keep going
        v, residual = fista_solve(u, g, v, cap, tol)
    return v, residual


def _single_steps(dtype: torch.dtype, tol: float) -> bool:
    """Whether a problem given in ``dtype`` to the residual ``tol`` may take float32 steps (see
    ``_SINGLE_MIN_M``): single or lower precision, to a tolerance it can meet."""
    return dtype != torch.float64 and tol >= _SINGLE_MIN_TOL


def _dual_route(
    u: Tensor,
    g: Tensor,
    start: tuple[Tensor, Tensor, Tensor],
    tol: float,
    single: bool,
    factored: Callable[[], tuple[Tensor, Tensor]] | None = None,
) -> tuple[Tensor, Tensor] | None:
    """``(v, residual)`` of the dual PDAS on ``G^-1``, or ``None`` when ``G`` is not safely
    invertible. ``single``: its steps first in float32 (on a well-conditioned ``G``), checked
    against ``g``; the problems they leave above ``tol`` take float64 steps when the float32
    ones settled (not when they stopped for the cost of the active systems, which the float64
    ones would meet too). ``factored``: gives ``cholesky_ex`` of ``g``, made once by the caller
    (the float32 steps factor ``g`` in float32 and do not call it)."""
    if single:
        inverse = safe_inverse(g.float(), _SINGLE_MIN_PIVOT)
        if inverse is not None:
            guess, first_residual, c = start
            v, residual, settled = dual_pdas_solve(u, g, inverse, start, _DUAL_MAX_ITER, tol)
            if not settled:
                return v, residual

            def again(rows: Tensor) -> tuple[Tensor, Tensor] | None:
                rows_start = (guess[:, rows], first_residual[:, rows], c)
                return _dual_route(u[:, rows], g, rows_start, tol, False, factored)

            return _unsolved_by(again, v, residual, tol)
    inverse = safe_inverse(g, factored=None if factored is None else factored())
    if inverse is None:
        return None
    v, residual, _ = dual_pdas_solve(u, g, inverse, start, _DUAL_MAX_ITER, tol)
    return v, residual


def _singular(g: Tensor, tol: float, factored: tuple[Tensor, Tensor]) -> bool:
    """Whether every Gramian of ``g`` ``[B, m, m]`` may be singular: its Cholesky factorisation
    ``factored`` (``cholesky_ex``) failed, or a squared pivot is at most ``tol`` times its
    largest diagonal entry."""
    factor, info = factored
    pivots = factor.diagonal(dim1=-2, dim2=-1).square().amin(-1)
    bound = tol * g.diagonal(dim1=-2, dim2=-1).amax(-1)
    return bool(((info != 0) | ~(pivots > bound)).all())


def _zero_cone(u: Tensor, g: Tensor, tol: float, factored: tuple[Tensor, Tensor]) -> Tensor | None:
    """``v`` of every problem when each Gramian's dual cone ``{x : J x >= 0}`` is ``{0}``,
    certified by every problem's KKT residual at most ``tol`` in units of ``u``
    (:func:`natural_residual`); else ``None``.

    The cone is ``{0}`` exactly when some ``y > 0`` has ``G y = 0`` (Gordan's theorem of the
    alternative: ``J x >= 0`` has no solution but 0 iff ``J^T y = 0`` for some ``y > 0``), i.e.
    when ``min_{y >= 1} y^T G y = 0``: one Lawson-Hanson problem (:func:`least_combination`)
    then gives every problem an optimal ``v`` (:func:`null_rows`), where PDAS cycles and ADMM
    crawls (UPGrad at ``m = 128``: 0.17-0.42 s with the exact fallback, against 5 ms). Tried
    only on singular Gramians (``factored``: ``cholesky_ex`` of ``g``): the cone of the others
    is never ``{0}``.
    """
    if not _singular(g, tol, factored):
        return None
    candidates = []
    for problems, gramian in zip(u, g):  # (each must be {0}: stop at the first that is not)
        y, passive, factor = least_combination(gramian, tol)
        # (not {0}: y^T G y above the rounding of G y in units of the residual; the rows'
        # residuals decide. At m = 512, y up to 840 left 4.9e-12 on a cone {0}.)
        if float(y @ gramian @ y) > tol * float(gramian.diagonal().amax() * y.amax() ** 2):
            return None
        candidates.append(null_rows(problems, gramian, y, passive, factor))
    v = torch.stack(candidates)  # [B, 2, k, m]
    lam = 2 * (v @ g[:, None])
    # (in units of u, not relative to |v|: the weights built from y reach 10-800 where the other
    # routes' are about 1-5, and the update's error that a relative residual admits grows with
    # |v|: on a singular Gramian whose cone is thin but not {0} (width 1e-5), the screen of
    # y^T G y passed and the relative certificate accepted an update 3e-4 of |J^T u| off the
    # projection, 30 times its size; the other routes: 3e-6)
    residual = natural_residual(v, u[:, None], lam, multiplier_scale(g)[:, None])
    # (the smaller certified candidate: see null_rows)
    size = torch.where(residual <= tol, v.abs().sum(-1), torch.inf)
    v = torch.where((size[:, 1] < size[:, 0])[..., None], v[:, 1], v[:, 0])
    return v if bool((residual <= tol).any(1).all()) else None


def null_rows(u: Tensor, g: Tensor, y: Tensor, passive: Tensor, factor: Tensor) -> Tensor:
    """Two candidates ``[2, k, m]`` for optimal ``v >= u`` with ``G v = 0``, for the rows ``u``
    ``[k, m]``, given ``y >= 1`` with ``G y = 0``, and an independent set ``P`` of columns
    (``factor``: the Cholesky factor of ``G_PP``), both from :func:`least_combination`.

    The first, ``t y`` with ``t = max(0, max_j u_j / y_j)``, is optimal. The second,
    ``z + t' y`` with ``z = u - beta`` on ``P``, ``G_PP beta = (G u)_P``, is optimal when the
    rows of ``J`` on ``P`` span its row space (then ``J^T z = 0``); ``t' >= 0`` is the least that
    makes it ``>= u`` (the ratio test of a simplex step), and it is then shrunk towards 0 while
    ``>= u``. The weights are not unique; the second is 3-9x smaller on the benchmark's
    rank-deficient Gramians, and large weights along the null space of a rounded ``G`` make the
    update ``J^T v`` uncertain by about ``sqrt(eps) |v|``.

    Example:
        >>> import torch
        >>> from jacflow.linalg._dual_cone import null_rows
        >>> from jacflow.linalg._lawson_hanson import least_combination
        >>> j = torch.tensor([[1.0, 0.0], [-1.0, 1.0], [0.0, -2.0]], dtype=torch.float64)
        >>> g = j @ j.T / 7
        >>> v = null_rows(torch.eye(3, dtype=torch.float64), g, *least_combination(g, 1e-12))[1]
        >>> v
        tensor([[1.0000, 1.0000, 0.5000],
                [1.0000, 1.0000, 0.5000],
                [2.0000, 2.0000, 1.0000]], dtype=torch.float64)
        >>> bool((v @ j).abs().max() < 1e-15)  # every update J^T v is 0
        True
    """
    scaled = (u / y).amax(-1, keepdim=True).clamp_min(0) * y
    if not passive.numel():  # (G 1 = 0)
        return torch.stack([scaled, scaled])
    beta = torch.cholesky_solve((u @ g).index_select(1, passive).T, factor).T  # [k, s]
    shift = (beta / y.index_select(0, passive)).amax(-1, keepdim=True).clamp_min(0)
    z = (u + shift * y).index_add(1, passive, -beta)
    ratio = torch.where(z > 0, u / z, 0.0).amax(-1, keepdim=True).clamp(0.0, 1.0)
    shrunk = torch.where((ratio * z >= u).all(-1, keepdim=True), ratio * z, z)
    return torch.stack([scaled, shrunk])


def _solve(
    u: Tensor,
    g: Tensor,
    method: str,
    max_iter: int | None,
    tol: float,
    accept: float,
    lam: Tensor | None = None,
    single: bool = False,
) -> Tensor:
    """Solve the normalised problems (float64, ``u`` ``[B, k, m]``, ``g`` ``[B, m, m]``) to the
    residual ``tol``; warn about those left above ``accept``. ``lam``: ``2 u G`` when the caller
    has it. ``single``: the problem came in single precision (:func:`_single_steps`)."""
    c = multiplier_scale(g)
    lam = 2 * torch.bmm(u, g) if lam is None else lam
    residual = start_residual(lam, c)
    if float(residual.amax()) <= tol:  # nothing conflicts: v = u solves every problem
        return u
    m = u.shape[-1]
    dual = None  # (v, residual) of the dual route
    if method == "auto":
        # (G's Cholesky factorisation, made once where first read: by the dual route's float64
        # steps and by the test of a dual cone {0}; 1-2% of the time where the dual route does
        # not run. Not where the dual route's float32 steps solve: 1.08-1.12x UPGrad's time on
        # float32 per-sample Gramians at m = 128 when it was made up front)
        made: list[tuple[Tensor, Tensor]] = []  # (not functools.cache: 3% at m = 32)

        def factored() -> tuple[Tensor, Tensor]:
            if not made:
                made.append(cholesky_ex(g))
            return made[0]

        method = "pdas" if m <= _AUTO_PDAS_MAX_M else "admm"
        # PDAS's first guess of the active sets (lam > 0 at v = u): small ones (e.g.
        # per-sample conflicts) are solved fastest on G^-1; the chosen method takes the rest.
        guess = lam > 0
        if active_systems_pay(guess.sum(-1), m):
            single = single and m >= _SINGLE_MIN_M
            dual = _dual_route(u, g, (guess, residual, c), tol, single, factored)
        if dual is None and max_iter is None:  # (a dual route ran: G is invertible)
            zero = _zero_cone(u, g, tol, factored())
            if zero is not None:
                # (the problems solved at v = u keep it, as they do on the other routes: a
                # Gramian 0 in a batch with cones {0} got max(u) 1, not the v = u stated)
                return torch.where((residual <= tol)[..., None], u, torch.maximum(zero, u))
    cap = max_iter or (_PDAS_MAX_ITER if method == "pdas" else _FIRST_ORDER_MAX_ITER)
    low_precision = tol >= _LOW_PRECISION_TOL or m >= _LOW_PRECISION_MIN_M

    def chosen(u: Tensor, start: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        if method == "pdas":
            return pdas_solve(u, g, u, cap, tol, start)
        if method == "admm":
            return admm_solve(u, g, cap, tol, low_precision=low_precision, polish_iter=_POLISH_ITER)
        return _fista_with_polish(u, g, cap, tol)

    if dual is None:
        v, residual = chosen(u, (lam, residual))
    else:
        v, residual = _unsolved_by(lambda rows: chosen(u[:, rows]), *dual, tol)
    if max_iter is None and method == "pdas":
        # (PDAS on a rank-deficient, rounded Gramian can drift along a nearly null direction:
        # weights of 3e4 for rows of max-norm 1, whose residual, relative to |v|, passes while
        # the update conflicts with an objective; Lawson-Hanson's are exact and moderate)
        residual = torch.where(v.abs().amax(-1) > _DRIFTED_WEIGHTS, torch.inf, residual)
    worst = float(residual.amax())
    # PDAS's problems (m <= 32, where Lawson-Hanson is cheap) above ``tol``, not only above
    # ``accept``: a float32 problem rescaled to a unit diagonal (accept 100 m eps) that PDAS
    # left at 3e-4 on a Gramian of condition 1e7 had weights 2-48% off, which Lawson-Hanson
    # solves exactly; the better iterate is kept. (ADMM's, from m = 33, keep ``accept``: on
    # rank-deficient float32 Gramians, which ADMM leaves near 6e-5, Lawson-Hanson took 2-4x the
    # time at m = 128 and 256, and stopped above ``tol`` too.)
    fallback_above = tol if method == "pdas" else accept
    if max_iter is None and not worst <= fallback_above:  # a cap: this method only
        v, residual = _exact_fallback(u, g, v, residual, tol)
        worst = float(residual.amax())
    if not worst <= accept:
        warnings.warn(
            f"`project_weights` (method={method!r}) stopped with a KKT residual of {worst:.2e} "
            f"> tol = {accept:.1e}; returning the best iterate. Raise `max_iter` (or `tol`).",
            SolverWarning,
            stacklevel=caller_stacklevel(),
        )
    return torch.maximum(v, u)  # exactly feasible; moves a converged v by at most ~tol


def _row_scales(rows: Tensor) -> Tensor:
    """The max-norm of each row (``[..., 1]``), 1 for a zero row: the solvers' scaling of ``u``."""
    scale = rows.abs().amax(-1, keepdim=True)
    return torch.where(scale > 0, scale, 1.0)


def _solve_finite(
    flat_u: Tensor,
    g: Tensor,
    method: str,
    max_iter: int | None,
    tol: float,
    accept: float,
    single: bool = False,
) -> Tensor:
    """Scale the rows of ``u``, solve, and give NaN rows where ``u`` or ``g`` is not finite."""
    bad = None
    if has_nonfinite(g) or has_nonfinite(flat_u):
        bad_g = ~torch.isfinite(g).all(-1).all(-1)
        bad = ~torch.isfinite(flat_u).all(-1) | bad_g[:, None]
        g = torch.where(bad_g[:, None, None], torch.zeros_like(g), g)
        flat_u = torch.where(bad[..., None], torch.zeros_like(flat_u), flat_u)
    scale = _row_scales(flat_u)
    v = _solve(flat_u / scale, g, method, max_iter, tol, accept, None, single) * scale
    return v if bad is None else torch.where(bad[..., None], torch.full_like(v, float("nan")), v)


def _normalized(g: Tensor, norm_eps: float, reg_eps: float, one_sync: bool) -> Tensor:
    """The symmetric part of ``g`` ``[B, m, m]`` (``v^T G v`` only sees it) divided by its
    trace, plus ``reg_eps I`` renormalised to trace 1 (same solution), as
    :func:`project_weights` documents. ``one_sync``: for one Gramian outside autograd, the trace
    is read on the host and the guards of ``normalize_gramian`` become a Python test (same
    result, 3 operations instead of 13)."""
    if one_sync and reg_eps == 0:
        trace = float(g.diagonal(dim1=-2, dim2=-1).sum())
        if math.isinf(trace) and not has_nonfinite(g):  # (finite entries near the largest
            return _normalized(g, norm_eps, reg_eps, one_sync=False)  # float: see below)
        if trace > norm_eps or not math.isfinite(trace):
            lift = _lift(trace, g.dtype)
            if lift != 1.0:  # (a subnormal trace, whose reciprocal overflows)
                g, trace = g * lift, trace * lift
            return (g + g.mT) * (0.5 / trace)
        return torch.zeros_like(g)
    g = _normalize_gramian(g, norm_eps)  # (then symmetrised: g + g^T overflowed near the max)
    g = g / 2 + g.mT / 2
    if reg_eps > 0:
        g = _normalize_gramian(_regularize_gramian(g, reg_eps), 0.0)
    return g


def _lift(trace: float, dtype: torch.dtype) -> float:
    """1, or an exact power of two by which a Gramian of ``trace`` in ``dtype`` is multiplied
    before dividing it by its trace, where the trace is so small (subnormal) that its
    reciprocal overflows; the quotient is the same."""
    info = torch.finfo(dtype)
    if trace > 0 and 1 / trace > info.max:
        return 2.0 ** (math.frexp(info.max)[1] // 2)
    return 1.0


def _normalized_on_host(gramian: Tensor, norm_eps: float, reg_eps: float) -> list[list[float]]:
    """The Gramian as :func:`project_weights` normalises it, in Python floats."""
    rows = gramian.tolist()
    m = len(rows)
    # (a trace that overflows from finite entries: divided by the largest diagonal entry
    # first, as normalize_gramian; the symmetric part's sums overflowed there too)
    diagonal = [rows[i][i] for i in range(m)]
    overflowed = math.isinf(sum(diagonal)) and all(math.isfinite(x) for x in diagonal)
    unit = max(abs(x) for x in diagonal) if overflowed else 1.0
    g = [[(rows[i][j] / unit + rows[j][i] / unit) / 2 for j in range(m)] for i in range(m)]
    trace = sum(g[i][i] for i in range(m))
    kept = trace > norm_eps / unit or not math.isfinite(trace)
    lift = _lift(trace, torch.float64)  # (a subnormal trace, whose reciprocal overflows)
    if lift != 1.0:
        g, trace = [[x * lift for x in row] for row in g], trace * lift
    scale = 1 / trace if kept else 0.0
    g = [[x * scale for x in row] for row in g]
    if reg_eps > 0:
        renormalize = 1 / (sum(g[i][i] for i in range(m)) + m * reg_eps)
        g = [
            [(x + reg_eps * (i == j)) * renormalize for j, x in enumerate(row)]
            for i, row in enumerate(g)
        ]
    return g


def _solved_rows_on_host(
    gramian: Tensor,
    rows: list[list[float] | None],
    scales: list[float],
    norm_eps: float,
    reg_eps: float,
    tol: float,
    dtype: torch.dtype,
) -> Tensor | None:
    """``v`` ``[k, m]`` of the rows of max-norm 1 (or 0) that were divided by ``scales``,
    solved in Python floats (``_host_pdas``); a ``None`` row (not finite) and every row of a
    non-finite Gramian give NaN. ``None`` when some problem needs the torch solvers."""
    g = _normalized_on_host(gramian, norm_eps, reg_eps)
    m = len(g)
    if not all(math.isfinite(x) for row in g for x in row):
        return torch.full((len(rows), m), math.nan, dtype=dtype, device=gramian.device)
    solved = solve_rows(g, [row for row in rows if row is not None], tol)
    if solved is None:
        return None
    pending = iter(solved)
    out = [
        [math.nan] * m if row is None else [x * s for x in next(pending)]
        for row, s in zip(rows, scales)
    ]
    return torch.tensor(out, dtype=torch.float64, device=gramian.device).to(dtype)


def _project_on_host(
    u: Tensor, gramian: Tensor, norm_eps: float, reg_eps: float, tol: float, dtype: torch.dtype
) -> Tensor | None:
    """:func:`project_weights` in Python floats for small CPU problems, or ``None``."""
    flat = u.reshape(-1, gramian.shape[-1]).tolist()
    finite = [all(math.isfinite(x) for x in row) for row in flat]  # (max() skips some NaNs)
    scales = [max(map(abs, row)) if ok else 1.0 for row, ok in zip(flat, finite)]
    scales = [s if s > 0 else 1.0 for s in scales]  # a zero row stays zero
    rows = [[x / s for x in row] if ok else None for row, s, ok in zip(flat, scales, finite)]
    v = _solved_rows_on_host(gramian, rows, scales, norm_eps, reg_eps, tol, dtype)
    return None if v is None else v.reshape(u.shape)


def _diagonal_on_host(
    pref: Tensor, gramian: Tensor, norm_eps: float, reg_eps: float, tol: float, dtype: torch.dtype
) -> Tensor | None:
    """:func:`project_diagonal` in Python floats: UPGrad's rows ``sign(pref_i) e_i`` are built
    on the host, not scanned; ``None`` when some problem needs the torch solvers."""
    weights = pref.tolist()
    m = len(weights)
    rows: list[list[float] | None] = [
        [float((x > 0) - (x < 0)) if i == j else 0.0 for j in range(m)]
        if math.isfinite(x)
        else None
        for i, x in enumerate(weights)
    ]
    scales = [abs(x) if math.isfinite(x) else 1.0 for x in weights]
    return _solved_rows_on_host(gramian, rows, scales, norm_eps, reg_eps, tol, dtype)


def _lean_route(
    rows: Tensor, scale: Tensor, gramian: Tensor, norm_eps: float, reg_eps: float, tol: float
) -> Tensor | None:
    """``lean_pdas_solve`` (up to ``_LEAN_MAX_M`` objectives, else ``lean_dual_pdas_solve``) on
    the float64 ``rows`` ``[k, m]`` of max-norm 1 (or 0), which are the problem's rows divided
    by ``scale`` ``[k, 1]``, and the Gramian normalised as :func:`project_weights` states the
    problem: the unscaled ``v``, or ``None``. Also ``None`` (one host sync) when an entry of the
    Gramian or a scale is not finite, or their sum overflows: the batched route then gives the
    NaN rows, by its explicit test rather than by NaNs spreading through the products."""
    g = gramian.to(torch.float64)
    if not math.isfinite(float(g.sum() + scale.sum())):
        return None
    solve = lean_pdas_solve if g.shape[-1] <= _LEAN_MAX_M else lean_dual_pdas_solve
    v = solve(rows, _normalized(g[None], norm_eps, reg_eps, one_sync=True)[0], tol)
    return None if v is None else v * scale


def _dual_pays(sign: Tensor, gramian: Tensor) -> bool:
    """:func:`active_systems_pay` for the first guess of the problems ``sign_i e_i`` (UPGrad's),
    whose multipliers at ``v = u`` are the rows of ``G`` times ``sign_i``: the test, on the
    Gramian as given, before the lean dual route converts anything (where it fails, e.g. on
    Gramians of two camps of objectives, that conversion cost 5-10% of UPGrad's time)."""
    return active_systems_pay(((sign[:, None] * gramian) > 0).sum(-1), gramian.shape[-1])


def _short_routes_apply(
    gramian: Tensor, differentiable: bool, method: str, max_iter: int | None
) -> bool:
    """Whether ``"auto"`` first tries the short routes (the Python floats, the lean PDAS, the
    lean dual PDAS): one CPU Gramian, outside autograd, no explicit iteration cap."""
    return (
        gramian.device.type == "cpu"
        and gramian.ndim == 2
        and not differentiable
        and method == "auto"
        and max_iter is None
    )


def project_weights(
    u: Tensor,
    gramian: Tensor,
    *,
    norm_eps: float = 0.0,
    reg_eps: float = 0.0,
    method: str = "auto",
    max_iter: int | None = None,
    tol: float | None = None,
) -> Tensor:
    """Weights of the projection of ``J^T u`` onto the dual cone of the rows of ``J``.

    For every row ``u`` of ``u`` returns ``v`` solving ``minimize v^T G v subject to v >= u``
    with ``G = gramian``, so that ``J^T v`` is the projection of ``J^T u`` onto
    ``{x : J x >= 0}``. All problems are solved at once, in torch, on ``gramian``'s device
    (small ones on an accelerator on the host; see Solvers), and returned on that device.

    Problem statement. ``G`` is first divided by its trace (a trace ``<= norm_eps`` gives
    ``G = 0``, hence ``v = u``) and ``reg_eps * I`` is added. With the defaults
    ``norm_eps = reg_eps = 0`` the problem solved is exactly the one above, rescaled to a unit
    diagonal when its diagonal spreads over more than 16 (gradients' norms over more than 4):
    with ``d = sqrt(diag(G))``, ``w = d v`` solves ``min w^T G' w s.t. w >= d u`` for
    ``G' = G / (d d^T)`` (neither this nor dividing by the trace changes the solution), so that
    the tolerance below weighs every objective by its own gradient's norm. TorchJD uses
    ``norm_eps = reg_eps = 1e-4``, without the rescaling.

    Solvers. ``"pdas"``: exact primal-dual active set (a few batched Cholesky solves; exact also
    for singular ``G``). ``"admm"``: ADMM with one eigendecomposition of ``G`` shared by all
    problems (one batched product per iteration). ``"fista"``: accelerated projected gradient
    with restart (one batched ``V @ G`` per iteration), polished by PDAS when that is cheap.
    ``"auto"``: PDAS for ``m <= 32``, ADMM above; before them, when PDAS's first guess of the
    active sets is small (strongly conflicting objectives, e.g. per-sample gradients) and ``G``
    is safely positive definite, PDAS on the dual problem solves on ``G^-1`` systems of the size
    of the active set (``jacflow.linalg._dual_pdas``; every result checked against ``G``), and
    the chosen method takes the problems it leaves. Without an explicit ``max_iter``, the problems
    the chosen method leaves unsolved (above the tolerance for PDAS, above the level accepted
    without a warning for the others; degenerate ones: singular ``G`` with more rows than its
    rank; ill-conditioned ones) are re-solved by an exact batched Lawson-Hanson active set
    (``jacflow.linalg._lawson_hanson``), which keeps its passive columns linearly independent.
    Where ``G`` is singular and the dual cone is ``{0}`` (rows with a positive combination equal
    to 0, e.g. more objectives than the rank), ``"auto"`` (without ``max_iter``) solves every
    problem from one Lawson-Hanson problem, ``min y^T G y`` over ``y >= 1``, whose optimum 0
    certifies it (``_dual_cone._zero_cone``; every result checked by its KKT residual, not
    relative to ``|v|``); PDAS
    cycles and ADMM crawls there. Problems with ``G u >= 0`` need no projection (``v = u``);
    when this holds for every problem (e.g. no negative entry in ``G`` and ``u >= 0``) nothing
    is solved. Small problems on one CPU Gramian outside autograd are first tried on shorter
    routes, with the same certificate;
    a problem they cannot certify (e.g. a matrix that is not PSD, a singular free block) sends
    them all to the route above. The tiniest (rows x m^3 at most 625, e.g. UPGrad with up to 5
    objectives) run ``"auto"``'s PDAS one problem at a time in Python floats
    (``jacflow.linalg._host_pdas``, exact Lawson-Hanson where PDAS stalls); the others of up to
    24 objectives a PDAS of about a dozen numpy operations per step
    (``jacflow.linalg._pdas.lean_pdas_solve``): there the batched solvers' fixed cost of some
    200 torch operations, not their arithmetic, is the time. :func:`project_diagonal`'s
    problems (UPGrad's) of 25 to 32 objectives whose first guess of the active sets is small
    (per-sample Gramians) first try the dual route's steps in numpy
    (``jacflow.linalg._dual_pdas.lean_dual_pdas_solve``). Like the batched route's
    ``"auto"``, both are taken only without an explicit ``max_iter``. Outside autograd,
    ``"auto"`` problems on one Gramian of at most 128 objectives on an accelerator are copied
    to the host and solved there (the batched solvers' many small kernels and
    synchronisations cost more than the copies); the result comes back to the Gramian's
    device.

    Accuracy. Problems are stated and checked in float64 whatever the input dtype (float32
    loses the active set on ill-conditioned Gramians); the result has the promoted dtype of
    ``u`` and ``gramian``. Two routes iterate in float32 where that is safe, every result they
    give checked in float64 against ``G``: the dual route's steps for a float32 (or lower)
    input to the default tolerance from 96 objectives, on a well-conditioned ``G`` (squared
    Cholesky pivots above 1e-2 of its largest diagonal entry; ``v_i = u_i`` exactly on the
    constraints they hold active; the problems they leave above the tolerance take float64
    steps, unless the float32 ones stopped for the cost of the active systems), and ADMM's
    first iterations (for a tolerance of 1e-6 or looser, or from 128 objectives; they go on in
    float64 where that is not met). A problem counts as solved when its KKT residual
    ``max_i |min(v_i - u_i, lam_i / c)| / max(1, |v|_inf)`` (with ``u`` scaled to max-norm 1,
    ``lam = 2 G v`` and ``c = 2 max_i G_ii``, ``G`` of trace 1, rescaled as above) is at most
    ``tol``. The residual is in units of ``u`` (of ``J^T u``): where the dual cone is thin
    (objectives nearly opposed, ``|J^T v| < 1e-7 |J^T u|``), a solution within ``tol`` may be
    percents off ``J^T v`` in relative terms (a cosine of about -1e-4 with an objective, on an
    update that small); a smaller ``tol`` with ``method="pdas"`` resolves it as far as float64
    allows. If some problem does not meet ``tol`` within ``max_iter``, a
    :class:`SolverWarning` is issued and the best iterate is returned. NaN or infinite
    entries in ``G`` (or in a row of ``u``) give NaN rows. Under autograd, a non-finite row of
    ``u`` gets no gradient and passes none to the other inputs; the rows of a non-finite ``G``
    pass none to the other Gramians of a batch (where the loss uses them, that ``G`` and their
    rows of ``u`` get NaN).

    Gradients. When ``u`` or ``gramian`` requires grad, ``v`` is differentiable by implicit
    differentiation of the KKT system at the solution (active set held fixed, pseudo-inverse
    on singular free blocks; see ``jacflow.linalg._implicit``), also twice
    (``create_graph=True``). The backward pass costs ``k`` masked ``m x m`` pseudo-inverses.

    Args:
        u: the weights to project, ``[..., m]``; with a batch of Gramians ``[*batch, k, m]``.
        gramian: the Gramian ``J J^T`` (symmetric PSD), ``[m, m]`` or ``[*batch, m, m]``.
        norm_eps: ``G`` is divided by its trace; a trace ``<= norm_eps`` counts as zero.
        reg_eps: ``reg_eps * I`` is added to the normalised ``G`` (0: the exact problem).
        method: ``"auto"``, ``"pdas"``, ``"admm"`` or ``"fista"``.
        max_iter: iteration cap of the chosen method (default: 50 PDAS or 20 000 ADMM / FISTA
            iterations); an explicit cap also disables the exact fallback.
        tol: KKT residual at which a problem counts as solved. By default the solvers aim for
            1e-10 (float64 inputs) or 1e-6 (float32) and accept, without a warning, up to
            ``max(1e-6, 10 m eps)`` for float32 inputs, whose rounded Gramians may be slightly
            indefinite (``100 m eps`` on a problem rescaled to a unit diagonal).

    Returns:
        ``v`` with the shape of ``u``.

    Example:
        >>> import torch
        >>> from jacflow.linalg import project_weights
        >>> G = torch.tensor([[1., -1.], [-1., 4.]], dtype=torch.float64)
        >>> project_weights(torch.tensor([1., 0.], dtype=torch.float64), G)
        tensor([1.0000, 0.2500], dtype=torch.float64)
        >>> project_weights(torch.eye(2, dtype=torch.float64), G)  # UPGrad's problems
        tensor([[1.0000, 0.2500],
                [1.0000, 1.0000]], dtype=torch.float64)
    """
    _check_inputs(u, gramian)
    check_solver_settings(norm_eps, reg_eps, method, max_iter, tol)
    m = gramian.shape[-1]
    dtype = torch.promote_types(u.dtype, gramian.dtype)
    if m == 0 or u.numel() == 0:
        return u.detach().to(dtype).clone()
    settings = _Settings(
        norm_eps=norm_eps, reg_eps=reg_eps, method=method, max_iter=max_iter, tol=tol
    )
    bad = _nonfinite_rows_under_autograd(u, gramian)
    if bad is not None:
        return torch.where(
            bad, math.nan, project_weights(torch.where(bad, 0.0, u), gramian, **settings)
        )
    d = _rescaling(gramian, norm_eps, reg_eps)
    if d is not None:
        d_rows = d if gramian.ndim == 2 else d.unsqueeze(-2)  # (u's rows: [*batch, k, m])
        first = u * d_rows
        scaled = _project_weights(first, _scaled(gramian, d), dtype, settings, rescaled=True)
        return _unscaled(scaled, first, d_rows, u.to(dtype))
    return _project_weights(u, gramian, dtype, settings)


# The diagonal's spread (largest over smallest entry) up to which the problem is solved as it
# is: the solvers' tolerance then weighs no objective more than 16 times less than another (a
# 4-fold spread of gradient norms), and the rescaling's dozen operations (6% of UPGrad's
# weights on a per-sample Gramian at m = 128, whose spreads are often 1.2-2.5) are saved.
_BALANCED_SPREAD = 16.0


def _rescaling(gramian: Tensor, norm_eps: float, reg_eps: float) -> Tensor | None:
    """:func:`_unit_diagonal_scale` of the exact problem (``norm_eps = reg_eps = 0``) whose
    diagonal spreads over more than ``_BALANCED_SPREAD`` (or holds a zero, a negative or a
    non-finite entry), to solve it rescaled to a unit diagonal; else ``None``."""
    if norm_eps != 0 or reg_eps != 0:
        return None
    low, high = torch.aminmax(gramian.detach().diagonal(dim1=-2, dim2=-1))
    low_value, high_value = float(low), float(high)
    if low_value > 0 and high_value <= _BALANCED_SPREAD * low_value:
        return None
    # (in float64, as the problems are stated: the rescaled problem formed in half precision
    # was the given one rounded, 120% off in bfloat16 on a review's case)
    return _unit_diagonal_scale(gramian.to(torch.float64))


def _unit_diagonal_scale(gramian: Tensor) -> Tensor:
    """``d = sqrt(diag(G))`` (``[..., m]``): with ``G' = G / (d d^T)``, of unit diagonal, ``v``
    solves ``min v^T G v s.t. v >= u`` exactly when ``d v`` solves ``min w^T G' w s.t.
    w >= d u``. The solvers' residuals then weigh every objective by its own gradient's norm,
    not by the largest: on ``G`` itself, a conflict with an objective whose gradient is ``1e3``
    times smaller than another's (float32) or ``1e4`` to ``1e7`` times (float64) was below their
    tolerance, and the update conflicted with it.

    Where the diagonal is zero or negative (a zero gradient, or rounding), ``d`` is the
    smallest positive one of its Gramian (1 if none is): a fixed 1 made the result depend on
    ``G``'s scale, as a zero gradient's ``u_i`` then dominated the rows' max-norm, the unit
    of the residual (a Gramian of scale ``1e-11`` with zero rows, float32: conflicts of 4% of
    an objective's gradient left, without a warning). Where it is not finite, ``d`` is 1."""
    diagonal = gramian.diagonal(dim1=-2, dim2=-1)
    usable = (diagonal > 0) & (diagonal < math.inf)  # (an infinite d gave u NaN gradients)
    smallest = torch.where(usable, diagonal, math.inf).amin(-1, keepdim=True)
    fallback = torch.where(smallest < math.inf, smallest, 1.0).expand_as(diagonal)
    unusable = torch.where(diagonal <= 0, fallback, torch.ones_like(diagonal))
    return torch.where(usable, diagonal, unusable).sqrt()


def _nonfinite_rows_under_autograd(rows: Tensor, gramian: Tensor) -> Tensor | None:
    """Under autograd, which rows of ``rows`` (``[..., m]``) hold a NaN or infinite entry
    (``[..., 1]``), or ``None`` when none does (or no graph is built). They are solved as zero
    rows and set to NaN after, so that no NaN enters the graph: ``0 * NaN`` in the backward of
    the rescaling made the finite rows' gradients NaN (first order, then second order)."""
    if not (torch.is_grad_enabled() and (rows.requires_grad or gramian.requires_grad)):
        return None
    bad = ~torch.isfinite(rows).all(-1, keepdim=True)
    return bad if bool(bad.any()) else None


def _scaled(gramian: Tensor, d: Tensor) -> Tensor:
    return gramian / (d.unsqueeze(-1) * d.unsqueeze(-2))


def _unscaled_diagonal(scaled: Tensor, first: Tensor, d: Tensor, pref: Tensor) -> Tensor:
    """:func:`_unscaled` for the rows of ``diag(pref)``, whose other constraints are ``v_j >= 0``:
    ``0 / d`` is exact, and only the diagonal needs the exact ``u``."""
    v = scaled / d
    diagonal = torch.where(scaled.diagonal() == first, pref, v.diagonal())
    diagonal = _with_gradient_of(torch.maximum(diagonal, pref), v.diagonal())
    v.diagonal().copy_(diagonal)
    return v


def _unscaled(scaled: Tensor, first: Tensor, d: Tensor, u: Tensor) -> Tensor:
    """``v = scaled / d``, with ``v_i = u_i`` exactly where the scaled problem's constraint is
    active (``scaled_i = first_i``: ``(u d) / d`` may round off ``u``), and feasible elsewhere
    (``max(v, u)`` in value, a rounding error, with ``v``'s gradient). The gradient is that of
    ``scaled / d`` also where ``v_i = u_i`` (see :func:`_with_gradient_of`)."""
    v = scaled / d.to(scaled.dtype)
    exact = torch.where(scaled == first.to(scaled.dtype), u, v)
    return _feasible(_with_gradient_of(exact, v), u)


def _with_gradient_of(value: Tensor, v: Tensor) -> Tensor:
    """``value`` (``v`` up to rounding), with ``v``'s gradient where ``v`` has one: an active
    constraint's ``v_i = u_i`` taken from ``u`` would give ``u``'s gradient, where the implicit
    one of a weakly active constraint (see ``jacflow.linalg._implicit``) is that of ``v``."""
    if v.requires_grad:
        return v + (value - v).detach()
    return value


def _feasible(v: Tensor, u: Tensor) -> Tensor:
    """``max(v, u)`` in value, with ``v``'s gradient: the rows' scaling ``(u / s) * s`` may
    round an active ``v_i`` one ulp below ``u_i``."""
    u = u.to(v.dtype)
    if v.requires_grad:
        return v + (u - v).clamp_min(0).detach()
    return torch.maximum(v, u)


def _project_weights(
    u: Tensor, gramian: Tensor, dtype: torch.dtype, settings: _Settings, rescaled: bool = False
) -> Tensor:
    """:func:`project_weights` after its checks, on the problem as given (``dtype``: the
    result's; ``rescaled``: to a unit diagonal, see :func:`tolerances`)."""
    norm_eps, reg_eps, method = settings["norm_eps"], settings["reg_eps"], settings["method"]
    max_iter, tol = settings["max_iter"], settings["tol"]
    m = gramian.shape[-1]
    if m == 0 or u.numel() == 0:
        return u.detach().to(dtype).clone()
    differentiable = torch.is_grad_enabled() and (gramian.requires_grad or u.requires_grad)
    if _offloads(gramian, differentiable, method):
        there = functools.partial(_project_weights, rescaled=rescaled)
        return _solved_on_host(there, u, gramian, dtype, settings)
    target, accept = tolerances(dtype, m, tol, rescaled)
    if _short_routes_apply(gramian, differentiable, method, max_iter):
        if u.numel() // m * m**3 <= _HOST_MAX_WORK:
            v = _project_on_host(u, gramian, norm_eps, reg_eps, target, dtype)
            if v is not None:
                return _feasible(v, u)
        elif m <= _LEAN_MAX_M:
            flat = u.to(torch.float64).reshape(-1, m)
            scale = _row_scales(flat)
            v = _lean_route(flat / scale, scale, gramian, norm_eps, reg_eps, target)
            if v is not None:
                return _feasible(v.reshape(u.shape).to(dtype), u)

    single = _single_steps(dtype, target)

    def solve(flat_u: Tensor, g: Tensor) -> Tensor:
        return _solve_finite(flat_u, g, method, max_iter, target, accept, single)

    def projected() -> Tensor:  # in float64
        g = gramian.to(torch.float64).reshape(-1, m, m)
        flat_u = u.to(torch.float64).reshape(g.shape[0], -1, m)
        g = _normalized(g, norm_eps, reg_eps, one_sync=g.shape[0] == 1 and not differentiable)
        v = differentiable_projection(flat_u, g, solve) if differentiable else solve(flat_u, g)
        return v.reshape(u.shape)

    v = projected().to(dtype) if differentiable else _without_graph(projected, dtype)
    return _feasible(v, u)


def _without_graph(solve: Callable[[], Tensor], dtype: torch.dtype) -> Tensor:
    """``solve()`` in inference mode, which spares every operation autograd's bookkeeping
    (0.89-0.94x the time of UPGrad's solve on per-sample Gramians at m = 64 and 128, float32,
    1 thread; a one-off A/B), returned in ``dtype`` as an ordinary tensor (one copy, made
    outside inference mode): an inference tensor cannot be saved for a later backward or
    modified in place outside inference mode."""
    with torch.inference_mode():
        v = solve()
    return v.to(dtype, copy=True)


def project_diagonal(
    pref: Tensor,
    gramian: Tensor,
    *,
    norm_eps: float = 0.0,
    reg_eps: float = 0.0,
    method: str = "auto",
    max_iter: int | None = None,
    tol: float | None = None,
) -> Tensor:
    """``project_weights(torch.diag(pref), gramian, ...)``: UPGrad's ``m`` problems, whose rows
    ``pref_i e_i`` need no scan (their scaled rows are ``sign(pref_i) e_i`` and their first
    multipliers rows of ``G``).

    Example:
        >>> import torch
        >>> from jacflow.linalg._dual_cone import project_diagonal
        >>> G = torch.tensor([[1., -1.], [-1., 4.]], dtype=torch.float64)
        >>> project_diagonal(torch.tensor([2., 1.], dtype=torch.float64), G)
        tensor([[2.0000, 0.5000],
                [1.0000, 1.0000]], dtype=torch.float64)
    """
    _check_inputs(pref, gramian, diagonal=True)
    check_solver_settings(norm_eps, reg_eps, method, max_iter, tol)
    settings = _Settings(
        norm_eps=norm_eps, reg_eps=reg_eps, method=method, max_iter=max_iter, tol=tol
    )
    dtype = torch.promote_types(pref.dtype, gramian.dtype)
    bad = _nonfinite_rows_under_autograd(pref[:, None], gramian)
    if bad is not None:
        safe = torch.where(bad[:, 0], 0.0, pref)
        return torch.where(bad, math.nan, project_diagonal(safe, gramian, **settings))
    d = _rescaling(gramian, norm_eps, reg_eps) if gramian.shape[-1] > 0 else None
    if d is not None:
        first = pref * d
        scaled = _project_diagonal(first, _scaled(gramian, d), dtype, settings, rescaled=True)
        return _unscaled_diagonal(scaled, first.to(dtype), d.to(dtype), pref.to(dtype))
    return _project_diagonal(pref, gramian, dtype, settings)


def _project_diagonal(
    pref: Tensor, gramian: Tensor, dtype: torch.dtype, settings: _Settings, rescaled: bool = False
) -> Tensor:
    """:func:`project_diagonal` after its checks, on the problem as given (``rescaled``: see
    :func:`_project_weights`)."""
    norm_eps, reg_eps, method = settings["norm_eps"], settings["reg_eps"], settings["method"]
    max_iter, tol = settings["max_iter"], settings["tol"]
    m = gramian.shape[-1]
    differentiable = torch.is_grad_enabled() and (pref.requires_grad or gramian.requires_grad)
    if _offloads(gramian, differentiable, method):
        there = functools.partial(_project_diagonal, rescaled=rescaled)
        return _solved_on_host(there, pref, gramian, dtype, settings)
    short = _short_routes_apply(gramian, differentiable, method, max_iter)
    host = gramian.device.type == "cpu" and m**4 <= _HOST_MAX_WORK
    if m == 0 or differentiable or (host and not short):
        return _project_weights(torch.diag(pref), gramian, dtype, settings, rescaled)
    target, accept = tolerances(dtype, m, tol, rescaled)
    if host:
        on_host = _diagonal_on_host(pref, gramian, norm_eps, reg_eps, target, dtype)
        if on_host is None:
            return _project_weights(torch.diag(pref), gramian, dtype, settings, rescaled)
        return on_host
    weights = pref.to(torch.float64)
    sign, scale = torch.sign(weights), weights.abs()[:, None]
    if short and (m <= _LEAN_MAX_M or (m <= _LEAN_DUAL_MAX_M and _dual_pays(sign, gramian))):
        v = _lean_route(torch.diag(sign), scale, gramian, norm_eps, reg_eps, target)
        if v is not None:
            return v.to(dtype)
    if has_nonfinite(gramian) or has_nonfinite(pref):
        return _project_weights(torch.diag(pref), gramian, dtype, settings, rescaled)

    def projected() -> Tensor:  # in float64
        g = _normalized(gramian.to(torch.float64)[None], norm_eps, reg_eps, one_sync=True)
        lam = (2 * sign)[:, None] * g[0]
        single = _single_steps(dtype, target)
        v = _solve(torch.diag(sign)[None], g, method, max_iter, target, accept, lam[None], single)
        return v[0] * scale

    return _without_graph(projected, dtype)
