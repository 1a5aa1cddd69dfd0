"""The batched Lawson-Hanson fallback: exact on every structure, degenerate ones included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from jacflow.linalg import project_weights
from jacflow.linalg._dual_cone import project_weights_reference
from jacflow.linalg._gramian import normalize_gramian
from jacflow.linalg._lawson_hanson import lawson_hanson_solve, least_combination
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


def nnls_least_combination(g: Tensor) -> float:
    """``min_{y >= 1} y^T G y`` by scipy's NNLS on ``min_{x >= 0} |R^T (1 + x)|`` with
    ``G = R R^T`` from an eigendecomposition: an independent reference. (Zero columns, which
    do not change the value, are left out: scipy 1.x's NNLS gave one a coefficient of 1.7e15
    and a residual norm that its own solution does not have.)"""
    np = pytest.importorskip("numpy")
    nnls = pytest.importorskip("scipy.optimize").nnls
    kept = g.diagonal() > 0
    if not bool(kept.any()):  # (G = 0; scipy's NNLS aborts the process on an empty matrix)
        return 0.0
    eigenvalues, q = np.linalg.eigh(g[kept][:, kept].numpy())
    r = q * np.sqrt(np.clip(eigenvalues, 0.0, None))
    ones = np.ones(r.shape[0])
    x, _ = nnls(r.T, -r.T @ ones, maxiter=50 * g.shape[0])
    return float(np.sum((r.T @ (ones + x)) ** 2))


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
