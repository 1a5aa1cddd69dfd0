"""The batched Lawson-Hanson fallback: exact on every structure, degenerate ones included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from jacflow.linalg import _dual_cone as dual_cone
from jacflow.linalg import project_weights
from jacflow.linalg._dual_cone import project_weights_reference
from jacflow.linalg._gramian import normalize_gramian
from jacflow.linalg._lawson_hanson import (
    lawson_hanson_solve,
    lean_lawson_hanson_solve,
    least_combination,
)
from tests.linalg.test_dual_cone import assert_kkt, make_gramian, problems, upgrad_rows


def normalised(u: Tensor, gramian: Tensor) -> tuple[Tensor, Tensor]:
    """The solver's internal convention: rows of max-norm 1, a Gramian of trace 1."""
    scale = u.abs().amax(-1, keepdim=True)
    u = u / torch.where(scale > 0, scale, torch.ones_like(scale))
    return u.reshape(1, -1, u.shape[-1]), normalize_gramian(gramian, 0.0)[None]


@settings(max_examples=60)
@given(problem=problems(max_m=40))
def test_kkt_and_reference(problem: tuple[Tensor, Tensor]) -> None:
    u, gramian = normalised(*problem)
    v, residual = lawson_hanson_solve(u, gramian, tol=1e-12)
    assert bool((residual <= 1e-10).all()), float(residual.amax())
    assert_kkt(v[0], u[0], gramian[0], rtol=1e-9)
    # G v is unique even when v is not: compare with the sequential reference
    ref = project_weights_reference(u[0], gramian[0])
    s = max(float(ref.abs().max()), float(v.abs().max()), float(u.abs().max()))
    g_scale = float(gramian.diagonal(dim1=-2, dim2=-1).max())
    torch.testing.assert_close(v[0] @ gramian[0], ref @ gramian[0], rtol=0, atol=1e-8 * g_scale * s)


@settings(max_examples=20)
@given(m=st.integers(2, 60), seed=st.integers(0, 2**31 - 1))
def test_more_rows_than_rank(m: int, seed: int) -> None:
    """Rank m / 2: the dual cone is often the single point 0 and ``v`` is far from unique."""
    gramian = make_gramian(m, "more_rows", 1.0, seed)
    u, g = normalised(upgrad_rows(m), gramian)
    v, residual = lawson_hanson_solve(u, g, tol=1e-12)
    assert bool((residual <= 1e-10).all()), float(residual.amax())
    assert_kkt(v[0], u[0], gramian, rtol=1e-9)


def test_batch_of_gramians_matches_one_by_one() -> None:
    gramians = torch.stack([make_gramian(12, kind, 1.0, 5) for kind in ("psd", "more_rows")])
    g = normalize_gramian(gramians[0], 0.0), normalize_gramian(gramians[1], 0.0)
    u = torch.eye(12, dtype=torch.float64)
    both, _ = lawson_hanson_solve(torch.stack([u, u]), torch.stack(g), tol=1e-12)
    for i in range(2):
        alone, _ = lawson_hanson_solve(u[None], g[i][None], tol=1e-12)
        torch.testing.assert_close(both[i] @ g[i], alone[0] @ g[i], rtol=0, atol=1e-12)


def test_iteration_cap_returns_a_feasible_iterate() -> None:
    u, g = normalised(upgrad_rows(30), make_gramian(30, "conflicting", 1.0, 8))
    v, residual = lawson_hanson_solve(u, g, tol=1e-12, max_iter=2)
    assert bool((v >= u).all())
    assert float(residual.amax()) > 1e-12  # two solves cannot finish these problems
    v, residual = lawson_hanson_solve(u, g, tol=1e-12)
    assert float(residual.amax()) <= 1e-12


@pytest.mark.parametrize("seed", [132, 198, 272, 340])
def test_columns_close_to_the_span_are_taken_where_needed(seed: int) -> None:
    """Rows nearly parallel or opposite, with a spectrum spanning 1e-10 (as an H200 gave for a
    random model's per-sample Gramian): the first pass rejected a needed column as dependent and
    UPGrad warned at a residual of 1.3e-10 to 2.2e-10; the second pass, rejecting fewer, solves
    them (the KKT conditions, and no SolverWarning, which the suite raises)."""
    gen = torch.Generator().manual_seed(seed)
    m, n = 12, 8
    signs = torch.where(torch.rand(m, generator=gen) < 0.4, -1.0, 1.0).double()
    spread = torch.randn(m, n - 1, generator=gen, dtype=torch.float64)
    spread = torch.cat([signs[:, None], spread], 1)
    left, _ = torch.linalg.qr(spread)
    right, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    singular = torch.tensor(
        [1.0, 3e-2, 2.3e-2, 2.8e-3, 3e-4, 1e-4, 6e-5, 7.5e-6], dtype=torch.float64
    )
    j = left * singular @ right.T
    v = project_weights(torch.eye(m, dtype=torch.float64), j @ j.T)
    assert_kkt(v, torch.eye(m, dtype=torch.float64), j @ j.T, rtol=1e-9)


def nnls_updates(g: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """``R^T v`` for every row of ``u`` ``[k, m]``, ``v`` minimising ``v^T G v`` over ``v >= u``,
    by scipy's NNLS on ``min_{x >= 0} |R^T (u + x)|`` with ``G = R R^T`` from an
    eigendecomposition (an independent reference: ``R^T v`` is unique where ``v`` is not), and
    ``R`` (``[m, n]``) to map other weights. (Zero columns, which change no update, are left
    out: scipy 1.x's NNLS gave one a coefficient of 1.7e15 and a residual norm that its own
    solution does not have.)"""
    np = pytest.importorskip("numpy")
    nnls = pytest.importorskip("scipy.optimize").nnls
    kept = (g.diagonal() > 0).numpy()
    if not kept.any():  # (G = 0; scipy's NNLS aborts the process on an empty matrix)
        return torch.zeros(u.shape[0], 1, dtype=torch.float64), torch.zeros(g.shape[0], 1).double()
    eigenvalues, q = np.linalg.eigh(g.numpy()[kept][:, kept])
    # (G's rounding, eigenvalues of 1e-17 on a rank-deficient G, weighs its null directions by
    # 3e-9 in R; read as 0, they made scipy's NNLS stop 0.014 from the optimum)
    r = np.zeros((g.shape[0], kept.sum()))
    r[kept] = q * np.sqrt(np.clip(eigenvalues, 0.0, None))
    updates = []
    for row in u.numpy():
        x, _ = nnls(r[kept].T, -r.T @ row, maxiter=50 * g.shape[0])
        updates.append(r.T @ row + r[kept].T @ x)
    return torch.from_numpy(np.stack(updates)), torch.from_numpy(r)


def nnls_least_combination(g: Tensor) -> float:
    """``min_{y >= 1} y^T G y`` by :func:`nnls_updates`."""
    update, _ = nnls_updates(g, torch.ones(1, g.shape[0], dtype=torch.float64))
    return float(update.square().sum())


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 40),
    kind=st.sampled_from(["more_rows", "rank_deficient", "duplicated", "zero_rows", "psd"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_least_combination_is_optimal(m: int, kind: str, seed: int) -> None:
    """``y >= 1``, its KKT conditions (``G y >= 0``, ``0`` off the bound), the factor of its
    passive block, and the optimal value of scipy's NNLS."""
    _, g = normalised(upgrad_rows(m), make_gramian(m, kind, 1.0, seed))
    g = g[0]
    y, passive, factor = least_combination(g, tol=1e-12)
    assert bool((y >= 1).all())
    top = float(g.diagonal().amax())
    scale = float(y.abs().amax()) * top
    gy = g @ y
    assert float(gy.amin()) >= -1e-9 * scale  # no descent direction within y >= 1
    assert float((gy * (y - 1)).abs().amax()) <= 1e-9 * scale * float(y.amax())
    assert bool((y[passive] > 1).all()) and passive.unique().numel() == passive.numel()
    block = g[passive][:, passive]
    torch.testing.assert_close(factor @ factor.T, block, rtol=0, atol=1e-12 * top)
    value = float(y @ gy)
    assert abs(value - nnls_least_combination(g)) <= 1e-9 * (1 + value) * float(y.amax())


def test_least_combination_reaches_zero_on_a_trivial_dual_cone() -> None:
    """Rows with a positive combination equal to 0: ``y^T G y = 0`` to rounding."""
    gen = torch.Generator().manual_seed(3)
    j = torch.randn(9, 4, generator=gen, dtype=torch.float64)
    j = torch.cat([j, -(torch.rand(1, 9, generator=gen, dtype=torch.float64) + 0.5) @ j])
    g = normalize_gramian(j @ j.T, 0.0)
    y, passive, _ = least_combination(g, tol=1e-12)
    assert float(y @ g @ y) <= 1e-13 * float(y.amax()) ** 2
    assert passive.numel() == 4  # a basis of J's row space


def assert_updates_match_nnls(v: Tensor, u: Tensor, g: Tensor, rtol: float = 1e-7) -> None:
    """``R^T v`` (the update ``J^T v`` up to a rotation) of every row against scipy's NNLS, to
    ``rtol`` of the update's scale (``max(|u|, |v|) sqrt(max G_ii)``; ``R``'s null directions,
    of size ``sqrt(eps)``, move it by about 1e-8 of it)."""
    expected, r = nnls_updates(g, u)
    scale = max(float(u.abs().max()), float(v.abs().max())) * float(g.diagonal().max()) ** 0.5
    torch.testing.assert_close(v @ r, expected, rtol=0, atol=rtol * scale)


def opposite_rows(m: int, seed: int) -> Tensor:
    """Rows in opposite pairs and a few zero ones: ``G`` singular, its dual cone not ``{0}``
    only through the unpaired rows."""
    gen = torch.Generator().manual_seed(seed)
    j = torch.randn(m, max(1, m // 2), generator=gen, dtype=torch.float64)
    pairs = m // 3
    j[pairs : 2 * pairs] = -j[:pairs]
    j[torch.rand(m, generator=gen) < 0.15] = 0.0
    return j @ j.T


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 32),
    kind=st.sampled_from(["more_rows", "rank_deficient", "duplicated", "zero_rows", "opposite"]),
    seed=st.integers(0, 2**31 - 1),
    upgrad=st.booleans(),
)
def test_lean_solver_matches_nnls_on_degenerate_gramians(
    m: int, kind: str, seed: int, upgrad: bool
) -> None:
    """The lean solver's residual, KKT conditions and updates against scipy's NNLS."""
    gramian = opposite_rows(m, seed) if kind == "opposite" else make_gramian(m, kind, 1.0, seed)
    gen = torch.Generator().manual_seed(seed)
    rows = upgrad_rows(m) if upgrad else torch.randn(3, m, generator=gen, dtype=torch.float64)
    u, g = normalised(rows, gramian)
    v, residual = lean_lawson_hanson_solve(u, g, tol=1e-12)
    assert bool((residual <= 1e-10).all()), float(residual.amax())
    assert bool((v >= u).all())
    assert_kkt(v[0], u[0], g[0], rtol=1e-9)
    assert_updates_match_nnls(v[0], u[0], g[0])


@pytest.mark.parametrize("seed", [132, 198, 272, 340])
def test_lean_solver_on_nearly_dependent_columns(seed: int) -> None:
    """Rows nearly parallel or opposite (a spectrum spanning 1e-10, as in
    ``test_columns_close_to_the_span_are_taken_where_needed``): every row it certifies is
    optimal (its update is NNLS's), whichever it leaves to the compacted solver."""
    gen = torch.Generator().manual_seed(seed)
    m, n = 12, 8
    signs = torch.where(torch.rand(m, generator=gen) < 0.4, -1.0, 1.0).double()
    spread = torch.cat([signs[:, None], torch.randn(m, n - 1, generator=gen).double()], 1)
    left, _ = torch.linalg.qr(spread)
    right, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    singular = torch.tensor([1.0, 3e-2, 2.3e-2, 2.8e-3, 3e-4, 1e-4, 6e-5, 7.5e-6]).double()
    j = left * singular @ right.T
    u, g = normalised(upgrad_rows(m), j @ j.T)
    v, residual = lean_lawson_hanson_solve(u, g, tol=1e-12)
    certified = residual[0] <= 1e-12
    assert bool((v >= u).all()) and bool(certified.any())
    assert_updates_match_nnls(v[0][certified], u[0][certified], g[0])


def test_lean_solver_batch_matches_one_by_one() -> None:
    """``[B, m, m]`` Gramians: each problem as when solved alone."""
    gramians = [make_gramian(16, "more_rows", 1.0, 5), opposite_rows(16, 2)]
    g = torch.stack([normalize_gramian(gramian, 0.0) for gramian in gramians])
    u = torch.eye(16, dtype=torch.float64).expand(2, 16, 16)
    both, residual = lean_lawson_hanson_solve(u, g, tol=1e-12)
    assert float(residual.amax()) <= 1e-12
    for i in range(2):
        alone, _ = lean_lawson_hanson_solve(u[i][None], g[i][None], tol=1e-12)
        torch.testing.assert_close(both[i] @ g[i], alone[0] @ g[i], rtol=0, atol=1e-12)


def _spy_fallback(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the name of each Lawson-Hanson solver that the exact fallback runs."""
    calls: list[str] = []
    for name in ("lean_lawson_hanson_solve", "lawson_hanson_solve"):
        solve = getattr(dual_cone, name)

        def spy(*args: object, name: str = name, solve: object = solve, **kwargs: object) -> object:
            calls.append(name)
            return solve(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(dual_cone, name, spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("m", [8, 32])
def test_fallback_takes_the_lean_solver_first(
    m: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UPGrad's rows on the benchmark's lowrank Gramian (seed 1: PDAS cycles, the dual cone is
    not ``{0}``), in float64 and float32: the lean solver answers them all, exactly."""
    j = torch.randn(m, m // 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    gramian, u = j @ j.T, torch.eye(m, dtype=torch.float64)
    calls = _spy_fallback(monkeypatch)
    v = project_weights(u.to(dtype), gramian.to(dtype)).double()
    assert calls == ["lean_lawson_hanson_solve"]
    g = gramian.to(dtype).double()
    rtol = 1e-9 if dtype == torch.float64 else 1e-5  # (float32: its default tolerance, 1e-6)
    assert_kkt(v, u, g, rtol=rtol)
    assert_updates_match_nnls(v, u, normalize_gramian(g, 0.0), rtol=max(10 * rtol, 1e-7))


@pytest.mark.parametrize("kind", ["duplicated", "more_rows", "opposite"])
def test_lean_solver_rejects_dependent_columns(kind: str) -> None:
    """With ``tol = 0`` every gradient below 0 is a candidate, the columns in the span of the
    passive ones (whose gradients are rounding) included: accepting them would make the passive
    systems singular (residuals up to 0.3 here); rejected, the problems are solved."""
    for seed in range(8):
        m = 12
        gramian = opposite_rows(m, seed) if kind == "opposite" else make_gramian(m, kind, 1.0, seed)
        u, g = normalised(upgrad_rows(m), gramian)
        v, residual = lean_lawson_hanson_solve(u, g, tol=0.0)
        assert float(residual.amax()) <= 1e-12, (seed, float(residual.amax()))
        assert_kkt(v[0], u[0], g[0], rtol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fallback_on_a_batch_of_degenerate_gramians(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``[B, m, m]`` lowrank Gramians (seeds where PDAS cycles): the lean solver runs on the
    batch and every problem of every Gramian meets its KKT conditions."""
    m = 8
    # (J and G in float64: G = J J^T computed in float32 is indefinite at 1e-8, which no
    # solver certifies to float64's tolerance)
    gens = [torch.Generator().manual_seed(s) for s in (1, 3, 4)]
    js = [torch.randn(m, m // 2, generator=gen, dtype=torch.float64) for gen in gens]
    gramian = torch.stack([j @ j.T for j in js])
    u = torch.eye(m, dtype=torch.float64).expand(3, m, m)
    calls = _spy_fallback(monkeypatch)
    v = project_weights(u.to(dtype), gramian.to(dtype)).double()
    assert calls[0] == "lean_lawson_hanson_solve"
    for i in range(3):
        rtol = 1e-9 if dtype == torch.float64 else 1e-5
        assert_kkt(v[i], u[i], gramian[i].to(dtype).double(), rtol=rtol)
