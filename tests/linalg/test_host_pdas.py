"""PDAS in Python floats: certified results, the hand-over to the torch solvers, and the route
``project_weights`` takes through it for small CPU problems."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from jacflow.linalg import project_weights
from jacflow.linalg._dual_cone import project_diagonal, project_weights_reference
from jacflow.linalg._host_pdas import _lawson_hanson, solve_row, solve_rows
from tests.linalg.test_dual_cone import (
    _forbid,
    assert_kkt,
    full_route,
    make_gramian,
    problems,
    upgrad_rows,
)
from tests.linalg.test_lawson_hanson import normalised


@settings(max_examples=80)
@given(problem=problems(max_m=12))
def test_certified_rows_solve_the_problem(problem: tuple[Tensor, Tensor]) -> None:
    """A row it returns meets the KKT conditions and gives the reference's ``G v`` (``v`` is not
    unique on singular Gramians, ``G v`` is); ``None`` only where some row is not certified."""
    u, g = normalised(*problem)
    solved = solve_rows(g[0].tolist(), u[0].tolist(), 1e-12)
    singly = [solve_row(g[0].tolist(), row, 1e-12) for row in u[0].tolist()]
    assert (solved is None) == any(v is None for v in singly)
    if solved is None:
        return
    v = torch.tensor(solved, dtype=torch.float64)
    assert_kkt(v, u[0], g[0], rtol=1e-9)
    ref = project_weights_reference(u[0], g[0])
    scale = max(1.0, float(ref.abs().max()), float(v.abs().max()))
    torch.testing.assert_close(v @ g[0], ref @ g[0], rtol=0, atol=1e-9 * scale)


@settings(max_examples=40)
@given(
    m=st.integers(2, 10),
    kind=st.sampled_from(["more_rows", "rank_deficient", "duplicated"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_lawson_hanson_solves_degenerate_problems(m: int, kind: str, seed: int) -> None:
    """More objectives than the rank (non-unique ``v``, a dual cone often reduced to 0), where
    PDAS may stall: the Lawson-Hanson fallback alone certifies every UPGrad row, with the
    reference's ``G v``."""
    u, g = normalised(upgrad_rows(m), make_gramian(m, kind, 1.0, seed))
    rows = g[0].tolist()
    top = max(rows[i][i] for i in range(m))
    for row, ref in zip(u[0], project_weights_reference(u[0], g[0])):
        v = _lawson_hanson(rows, row.tolist(), 1e-12, 2 * top, 1e-10 * top)
        assert v is not None
        v_t = torch.tensor(v, dtype=torch.float64)
        assert_kkt(v_t, row, g[0], rtol=1e-9)
        torch.testing.assert_close(v_t @ g[0], ref @ g[0], rtol=0, atol=1e-9)


@settings(max_examples=60)
@given(
    problem=problems(max_m=12),
    norm_eps=st.sampled_from([0.0, 1e-4]),
    reg_eps=st.sampled_from([0.0, 1e-4]),
)
def test_same_projection_as_the_torch_route(
    problem: tuple[Tensor, Tensor], norm_eps: float, reg_eps: float
) -> None:
    """``project_weights`` gives the same ``J^T v`` through the short routes (Python floats up
    to 5 objectives, the lean PDAS above) as through the batched solvers, with TorchJD's
    normalisation and regularisation too."""
    u, gramian = problem
    host = project_weights(u, gramian, norm_eps=norm_eps, reg_eps=reg_eps)
    with pytest.MonkeyPatch.context() as patch:
        full_route(patch)
        batched = project_weights(u, gramian, norm_eps=norm_eps, reg_eps=reg_eps)
    assert host.shape == batched.shape == u.shape and host.dtype == batched.dtype
    g = gramian / max(float(gramian.trace()), 1e-300)  # compare in the problem's own units
    scale = max(1.0, float(u.abs().max()), float(host.abs().max()))
    torch.testing.assert_close(host @ g, batched @ g, rtol=0, atol=1e-8 * scale)


@settings(max_examples=30)
@given(m=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
def test_torch_route_still_solves_small_problems(m: int, seed: int) -> None:
    """The torch solvers keep serving small problems (on accelerators, under autograd): their
    KKT certificate with the Python-float route switched off."""
    gramian = make_gramian(m, "conflicting", 1.0, seed)
    with pytest.MonkeyPatch.context() as patch:
        full_route(patch)
        v = project_weights(upgrad_rows(m), gramian)
    assert_kkt(v, upgrad_rows(m), gramian)


def test_small_problems_take_the_python_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """A well-posed CPU problem of up to 5 objectives never reaches the torch solvers, through
    ``project_weights`` or ``project_diagonal`` (which builds UPGrad's rows on the host)."""
    _forbid(monkeypatch, "_solve", "lean_pdas_solve")
    gramian = make_gramian(5, "conflicting", 1.0, 0)
    v = project_weights(upgrad_rows(5), gramian)
    assert_kkt(v, upgrad_rows(5), gramian)
    pref = torch.tensor([0.3, -0.2, 0.0, 0.5, 1.0], dtype=torch.float64)
    diagonal = project_diagonal(pref, gramian)
    g = gramian / gramian.trace()
    ref = project_weights_reference(torch.diag(pref), gramian)
    torch.testing.assert_close(diagonal @ g, ref @ g, rtol=0, atol=1e-12)
    with pytest.raises(AssertionError, match="_solve ran"):  # what the route avoids
        project_weights(upgrad_rows(5), gramian, method="pdas")


def test_singular_free_blocks_are_solved() -> None:
    """Duplicated objectives and a zero gradient make the free blocks singular: the dependent
    columns are skipped and the result is the exact projection."""
    j = torch.tensor([[1.0, 0.2, 0.0], [1.0, 0.2, 0.0], [-0.8, 0.5, 0.1], [0.0, 0.0, 0.0]])
    gramian = (j @ j.T).double()
    g = (gramian / gramian.trace()).tolist()
    u = upgrad_rows(4)
    solved = solve_rows(g, (u * 4).tolist(), 1e-12)
    assert solved is not None  # no hand-over
    v = project_weights(u, gramian)
    assert_kkt(v, u, gramian)
    ref = project_weights_reference(u, gramian)
    torch.testing.assert_close(v @ gramian, ref @ gramian, rtol=0, atol=1e-12)


def test_indefinite_block_hands_over() -> None:
    """A matrix that is not PSD (no Gramian; e.g. a badly rounded one) gets no certificate from
    Python floats: ``project_weights`` answers as the torch route does."""
    g = [[0.5, -1.0], [-1.0, 0.5]]
    assert solve_row(g, [1.0, 0.0], 1e-12) is None
    gramian = torch.tensor(g, dtype=torch.float64)
    u = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    with pytest.warns(UserWarning):  # the torch route does not meet its tolerance either
        v = project_weights(u, gramian)
    with pytest.MonkeyPatch.context() as patch, pytest.warns(UserWarning):
        full_route(patch)
        batched = project_weights(u, gramian)
    torch.testing.assert_close(v, batched, rtol=0, atol=0)


@pytest.mark.parametrize("m", [4, 8])  # the Python floats, the lean PDAS
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_entries(bad: float, m: int) -> None:
    """A non-finite Gramian entry gives NaN rows; a non-finite entry of ``u`` gives a NaN row
    and leaves the other rows solved, as on the torch route."""
    gramian = make_gramian(m, "conflicting", 1.0, 3)
    u = upgrad_rows(m)
    broken = gramian.clone()
    broken[1, 2] = bad
    assert bool(project_weights(u, broken).isnan().all())
    bad_u = u.clone()
    bad_u[2, 0] = bad
    v = project_weights(bad_u, gramian)
    others = [i for i in range(m) if i != 2]
    assert bool(v[2].isnan().all()) and not bool(v[others].isnan().any())
    torch.testing.assert_close(v[others], project_weights(u[others], gramian))


def test_dtypes_and_batch_shape() -> None:
    """The result has ``u``'s shape and the promoted dtype, as on the torch route."""
    gramian = make_gramian(5, "conflicting", 1.0, 4).float()
    u = torch.rand(2, 3, 5)
    v = project_weights(u, gramian)
    assert v.shape == u.shape and v.dtype == torch.float32
    with pytest.MonkeyPatch.context() as patch:
        full_route(patch)
        batched = project_weights(u, gramian)
    torch.testing.assert_close(v, batched, rtol=1e-5, atol=1e-6)
    assert project_weights(u.double(), gramian).dtype == torch.float64
