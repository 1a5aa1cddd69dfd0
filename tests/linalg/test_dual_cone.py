"""``project_weights``: KKT certificates, agreement with quadprog and the reference, edge cases.

The optimality certificate of ``min v^T G v s.t. v >= u`` is the KKT system with multipliers
``lam = 2 G v`` (stationarity): ``v >= u``, ``lam >= 0`` and ``lam . (v - u) = 0``. It is checked
independently of the solver on hypothesis-generated Gramians.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import quadprog
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from jacflow.linalg import SolverWarning, project_weights
from jacflow.linalg import _dual_cone as dual_cone
from jacflow.linalg import _first_order as first_order
from jacflow.linalg import _pdas as pdas
from jacflow.linalg._dual_cone import _normalized, project_diagonal, project_weights_reference
from jacflow.linalg._first_order import admm_solve
from jacflow.linalg._lawson_hanson import least_combination
from tests.aggregation._properties import make_jacobian

KINDS = ("psd", "rank_deficient", "duplicated", "zero_rows", "conflicting", "more_rows")
METHODS = ("auto", "pdas", "fista", "admm")


def make_gramian(m: int, kind: str, scale: float, seed: int) -> Tensor:
    """A float64 Gramian ``J J^T`` of the given structure, scaled by ``scale``."""
    gen = torch.Generator().manual_seed(seed)
    n = max(1, m // 2) if kind == "more_rows" else 2 * m + 1  # more_rows: m > n, degenerate
    if kind == "rank_deficient":
        rank = max(1, m // 3)
        j = torch.randn(m, rank, generator=gen, dtype=torch.float64)
        j = j @ torch.randn(rank, n, generator=gen, dtype=torch.float64)
    elif kind == "conflicting":  # rows around a common direction and its opposite: many conflicts
        base = torch.randn(1, n, generator=gen, dtype=torch.float64)
        signs = torch.where(torch.rand(m, 1, generator=gen) < 0.5, -1.0, 1.0).double()
        j = signs * base + 0.3 * torch.randn(m, n, generator=gen, dtype=torch.float64)
    else:
        j = torch.randn(m, n, generator=gen, dtype=torch.float64)
    if kind == "duplicated" and m > 1:
        index = torch.randint(0, m, (m,), generator=gen)
        index[: m // 2] = torch.arange(m // 2)
        j = j[index]
    if kind == "zero_rows":
        j[torch.rand(m, generator=gen) < 0.3] = 0.0
    return scale * (j @ j.T)


def assert_kkt(v: Tensor, u: Tensor, gramian: Tensor, rtol: float = 1e-6) -> None:
    """Primal/dual feasibility and complementary slackness, relative to the problem's scales."""
    s = torch.maximum(u.abs().amax(-1, keepdim=True), v.abs().amax(-1, keepdim=True))
    s = s.clamp_min(1e-300)
    g_scale = gramian.diagonal(dim1=-2, dim2=-1).amax(-1)[..., None, None].clamp_min(1e-300)
    lam = v @ gramian  # = (G v)^T for a symmetric G
    primal = ((u - v) / s).amax()
    dual = (-lam / (g_scale * s)).amax()
    slack = ((lam * (v - u)).sum(-1, keepdim=True) / (g_scale * s * s)).abs().amax()
    assert float(primal) <= rtol, f"primal infeasibility {float(primal):.2e}"
    assert float(dual) <= rtol, f"dual infeasibility {float(dual):.2e}"
    assert float(slack) <= rtol, f"complementary slackness {float(slack):.2e}"


def upgrad_rows(m: int) -> Tensor:
    return torch.eye(m, dtype=torch.float64) / max(m, 1)


@st.composite
def problems(draw: st.DrawFn, max_m: int = 24, min_m: int = 1) -> tuple[Tensor, Tensor]:
    m = draw(st.integers(min_m, max_m))
    kind = draw(st.sampled_from(KINDS))
    scale = 10.0 ** draw(st.integers(-8, 8))
    gramian = make_gramian(m, kind, scale, draw(st.integers(0, 2**31 - 1)))
    if draw(st.booleans()):
        u = upgrad_rows(m)
    else:
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        k = draw(st.integers(1, 4))
        u = torch.randn(k, m, generator=gen, dtype=torch.float64) * 10.0 ** draw(st.integers(-3, 3))
    return u, gramian


@settings(max_examples=80)
@given(problem=problems(), method=st.sampled_from(METHODS))
def test_kkt_conditions(problem: tuple[Tensor, Tensor], method: str) -> None:
    u, gramian = problem
    v = project_weights(u, gramian, method=method)
    assert v.shape == u.shape and v.dtype == torch.float64
    assert_kkt(v, u, gramian)


@settings(max_examples=20)
@given(problem=problems(max_m=160, min_m=33))
def test_kkt_conditions_medium(problem: tuple[Tensor, Tensor]) -> None:
    """Sizes where "auto" uses ADMM (and its fallbacks), on every structure and scale."""
    u, gramian = problem
    assert_kkt(project_weights(u, gramian), u, gramian)


@pytest.mark.parametrize(
    ("m", "kind"), [(128, "psd"), (128, "conflicting"), (200, "rank_deficient"), (512, "psd")]
)
def test_kkt_conditions_large(m: int, kind: str) -> None:
    gramian = make_gramian(m, kind, 1e3, seed=m)
    v = project_weights(upgrad_rows(m), gramian)
    assert_kkt(v, upgrad_rows(m), gramian)


def test_methods_agree_large() -> None:
    gramian = make_gramian(96, "conflicting", 1.0, seed=3)
    u = upgrad_rows(96)
    pdas = project_weights(u, gramian, method="pdas")
    assert_kkt(pdas, u, gramian)
    for method in ("fista", "admm"):
        other = project_weights(u, gramian, method=method)
        assert_kkt(other, u, gramian)
        torch.testing.assert_close(other.sum(0), pdas.sum(0), rtol=1e-6, atol=1e-9)


@settings(max_examples=40)
@given(problem=problems(max_m=10), method=st.sampled_from(METHODS))
def test_agrees_with_reference(problem: tuple[Tensor, Tensor], method: str) -> None:
    """Against the one-problem-at-a-time active-set oracle; ``G v`` and ``v^T G v`` are unique
    even when ``v`` is not (singular ``G``)."""
    u, gramian = problem
    v = project_weights(u, gramian, method=method)
    ref = project_weights_reference(u, gramian)
    g_scale = float(gramian.diagonal().max())
    s = float(torch.maximum(ref.abs().max(), u.abs().max()))
    torch.testing.assert_close(v @ gramian, ref @ gramian, rtol=0, atol=1e-6 * g_scale * s)
    objective = ((v @ gramian) * v).sum(-1)
    ref_objective = ((ref @ gramian) * ref).sum(-1)
    torch.testing.assert_close(objective, ref_objective, rtol=0, atol=1e-6 * g_scale * s * s)


def quadprog_solve(u: Tensor, gramian: Tensor) -> Tensor:
    """quadprog on each row: minimize v^T G v / 2 subject to I^T v >= u."""
    m = gramian.shape[0]
    g = gramian.numpy()
    rows = [
        torch.from_numpy(
            quadprog.solve_qp(
                g, torch.zeros(m).double().numpy(), torch.eye(m).double().numpy(), row.numpy()
            )[0]
        )
        for row in u
    ]
    return torch.stack(rows)


@settings(max_examples=40)
@given(problem=problems(max_m=16), method=st.sampled_from(METHODS))
def test_agrees_with_quadprog(problem: tuple[Tensor, Tensor], method: str) -> None:
    """With ``reg_eps > 0`` the problem is strictly convex: ``v`` itself is unique."""
    u, gramian = problem
    reg = 1e-3
    v = project_weights(u, gramian, reg_eps=reg, method=method)
    trace = gramian.trace()
    normalised = gramian / trace if trace > 0 else torch.zeros_like(gramian)
    expected = quadprog_solve(u, normalised + reg * torch.eye(u.shape[-1], dtype=torch.float64))
    s = float(torch.maximum(expected.abs().max(), u.abs().max()))
    torch.testing.assert_close(v, expected, rtol=0, atol=1e-6 * s)


@pytest.mark.parametrize("method", METHODS)
def test_batch_dimensions(method: str, device: str) -> None:
    """A batch of Gramians (on an accelerator: solved there, not on the host) and several
    leading dimensions of ``u``."""
    kinds = ("psd", "conflicting", "psd", "conflicting")  # non-singular: v is unique
    gramians = torch.stack(
        [make_gramian(6, kind, 1.0, seed=i) for i, kind in enumerate(kinds)]
    ).reshape(2, 2, 6, 6)
    u = torch.randn(2, 2, 3, 6, dtype=torch.float64)
    v = project_weights(u.to(device), gramians.to(device), method=method)
    assert v.shape == u.shape and v.device.type == device
    v = v.cpu()
    for i in range(2):
        for j in range(2):
            single = project_weights_reference(u[i, j], gramians[i, j])
            torch.testing.assert_close(v[i, j], single, rtol=1e-7, atol=1e-8)
            assert_kkt(v[i, j], u[i, j], gramians[i, j])
    # Several leading dimensions of u with one Gramian.
    u = torch.randn(2, 3, 6, dtype=torch.float64)
    v = project_weights(u, gramians[0, 0])
    torch.testing.assert_close(v.reshape(6, 6), project_weights(u.reshape(6, 6), gramians[0, 0]))


@pytest.mark.parametrize("m", [20, 100])  # PDAS; ADMM iterating in float32
def test_float32(m: int) -> None:
    gramian = make_gramian(m, "conflicting", 1.0, seed=1)
    u = upgrad_rows(m)
    v32 = project_weights(u.float(), gramian.float())
    assert v32.dtype == torch.float32
    v64 = project_weights(u, gramian)
    torch.testing.assert_close(v32.double().sum(0), v64.sum(0), rtol=1e-4, atol=1e-4)
    assert_kkt(v32.double(), u, gramian.float().double(), rtol=1e-5)


DEVICE_CASES = [(2, "psd"), (40, "rank_deficient"), (40, "more_rows"), (128, "conflicting")]
DEVICE_CASES += [(256, "psd")]


# float32 only on the full-rank kinds: a singular Gramian rounded to float32 is no longer PSD
@pytest.mark.parametrize(
    ("m", "kind", "dtype"),
    [(m, kind, torch.float64) for m, kind in DEVICE_CASES]
    + [(m, kind, torch.float32) for m, kind in DEVICE_CASES if kind in ("psd", "conflicting")],
)
def test_device_and_dtype(m: int, kind: str, device: str, dtype: torch.dtype) -> None:
    """On any device the solution keeps the input's device and dtype, is KKT-certified and gives
    the CPU float64 solution's ``G v``. On an accelerator, up to 128 objectives are solved on the
    host (the CPU's bits, for this Gramian and for UPGrad's problems), above it on the device.
    The default device plays no part (here ``meta``, on which nothing can be computed)."""
    gramian, u = make_gramian(m, kind, 1.0, seed=m), upgrad_rows(m)
    pref = torch.ones(m, dtype=dtype) / m
    with torch.device("meta"):
        v = project_weights(u.to(device, dtype), gramian.to(device, dtype))
        diagonal = project_diagonal(pref.to(device), gramian.to(device, dtype))
    assert v.device.type == torch.device(device).type and v.dtype == dtype
    rounded = gramian.to(dtype).double()
    assert_kkt(v.cpu().double(), u, rounded, rtol=1e-6 if dtype == torch.float64 else 1e-4)
    expected = project_weights(u, rounded)
    g = rounded / rounded.trace()
    atol = 1e-9 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(v.cpu().double() @ g, expected @ g, rtol=0, atol=atol)
    assert diagonal.device == v.device and diagonal.dtype == dtype
    torch.testing.assert_close(diagonal.cpu().double() @ g, expected @ g, rtol=0, atol=atol)
    if device != "cpu" and m <= 128:  # solved on the host: the CPU's bits
        assert torch.equal(v.cpu(), project_weights(u.to(dtype), gramian.to(dtype)))
        assert torch.equal(diagonal.cpu(), project_diagonal(pref, gramian.to(dtype)))


def full_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``project_weights`` skip its short routes for small CPU problems (Python floats, the
    lean PDAS) whatever the size: the batched solvers, as on an accelerator or under autograd."""
    monkeypatch.setattr(dual_cone, "_HOST_MAX_WORK", -1)
    monkeypatch.setattr(dual_cone, "_LEAN_MAX_M", -1)
    monkeypatch.setattr(dual_cone, "_LEAN_DUAL_MAX_M", -1)


def _forbid(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make the named functions of ``_dual_cone`` fail the test if called."""
    for name in names:

        def fail(*args: object, name: str = name) -> None:
            raise AssertionError(f"{name} ran")

        monkeypatch.setattr(dual_cone, name, fail)


@pytest.mark.parametrize("m", [6, 12, 24])
def test_lean_route_serves_small_problems(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """From 6 to 24 objectives on the CPU, UPGrad's and random rows reach neither the Python
    floats nor the batched solvers, and get what the batched solvers give."""
    gramian = make_gramian(m, "conflicting", 1.0, seed=m)
    pref = torch.rand(m, dtype=torch.float64) - 0.2  # a negative preference projects to 0
    rows = torch.randn(3, m, dtype=torch.float64)
    with pytest.MonkeyPatch.context() as patch:
        full_route(patch)
        expected = project_weights(rows, gramian), project_diagonal(pref, gramian)
    _forbid(monkeypatch, "_solve", "solve_rows")
    v, diagonal = project_weights(rows, gramian), project_diagonal(pref, gramian)
    assert_kkt(v, rows, gramian, rtol=1e-9)
    g = gramian / gramian.trace()
    torch.testing.assert_close(v @ g, expected[0] @ g, rtol=0, atol=1e-12)
    torch.testing.assert_close(diagonal @ g, expected[1] @ g, rtol=0, atol=1e-12)


def _spy_lean(
    monkeypatch: pytest.MonkeyPatch, name: str = "lean_pdas_solve"
) -> list[Tensor | None]:
    """Record what each call of the named lean solver of ``_dual_cone`` returns."""
    results: list[Tensor | None] = []
    solve = getattr(dual_cone, name)

    def spy(u: Tensor, g: Tensor, tol: float) -> Tensor | None:
        results.append(solve(u, g, tol))
        return results[-1]

    monkeypatch.setattr(dual_cone, name, spy)
    return results


def assert_lean_certificate(
    solve: Callable[[Tensor, Tensor, float], Tensor | None], problem: tuple[Tensor, Tensor]
) -> None:
    """A lean solver, on ``problem`` stated as it takes it (rows of max-norm 1, trace 1),
    returns either nothing or the exact projection: the reference active set's update."""
    u, gramian = problem
    rows = u / u.abs().amax(-1, keepdim=True).clamp_min(1e-300)  # (its rows of max-norm 1)
    g = gramian / gramian.trace().clamp_min(1e-300)
    v = solve(rows, g, 1e-10)
    if v is None:
        return
    assert v.dtype == torch.float64 and v.shape == rows.shape and bool((v >= rows).all())
    assert_kkt(v, rows, g, rtol=1e-9)
    ref = project_weights_reference(rows, g)
    torch.testing.assert_close(v @ g, ref @ g, rtol=0, atol=1e-9)


@settings(max_examples=60)
@given(problem=problems(max_m=24))
def test_lean_pdas_certifies_what_it_returns(problem: tuple[Tensor, Tensor]) -> None:
    """The lean PDAS (numpy) returns either nothing or the exact projection: every problem
    kind, duplicated objectives and rank-deficient Gramians included (which it may hand over),
    against the reference active set's update."""
    assert_lean_certificate(pdas.lean_pdas_solve, problem)


@pytest.mark.parametrize("m", [8, 25])
def test_lean_route_hands_over_or_is_not_taken(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the lean PDAS gives no certificate (here: a singular free block) the batched
    solvers answer; above 24 objectives it is not tried."""
    j = torch.randn(m, 2 * m, dtype=torch.float64, generator=torch.Generator().manual_seed(m))
    j[1] = j[2] = -j[0]  # duplicated objectives, both conflicting with the first
    gramian, u = j @ j.T, upgrad_rows(m)
    results = _spy_lean(monkeypatch)
    v = project_weights(u, gramian)
    assert results == [] if m > 24 else len(results) == 1 and results[0] is None
    assert_kkt(v, u, gramian, rtol=1e-9)
    ref = project_weights_reference(u, gramian)
    torch.testing.assert_close(v @ gramian, ref @ gramian, rtol=0, atol=1e-9)


@pytest.mark.parametrize("m", [4, 12])  # the Python floats, the lean PDAS
def test_short_routes_need_auto_without_a_cap(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit method or iteration cap goes to the batched solvers, as documented."""
    gramian = make_gramian(m, "conflicting", 1.0, seed=m)
    pref = torch.rand(m, dtype=torch.float64) + 0.1
    _forbid(monkeypatch, "lean_pdas_solve", "solve_rows")
    for kwargs in ({"method": "pdas"}, {"max_iter": 50}):
        v = project_weights(torch.diag(pref), gramian, **kwargs)  # type: ignore[arg-type]
        diagonal = project_diagonal(pref, gramian, **kwargs)  # type: ignore[arg-type]
        assert_kkt(v, torch.diag(pref), gramian, rtol=1e-9)
        torch.testing.assert_close(diagonal @ gramian, v @ gramian, rtol=0, atol=1e-12)


def test_lean_route_solves_the_symmetric_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """``v^T G v`` only sees the symmetric part of ``G``: an asymmetric input gets, certified
    by the lean PDAS itself, the projection of its symmetric part."""
    m = 10
    gramian = make_gramian(m, "conflicting", 1.0, seed=5)
    skew = torch.randn(m, m, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    results = _spy_lean(monkeypatch)
    v = project_weights(upgrad_rows(m), gramian + 0.3 * (skew - skew.T))
    assert len(results) == 1 and results[0] is not None
    ref = project_weights_reference(upgrad_rows(m), gramian)
    torch.testing.assert_close(v @ gramian, ref @ gramian, rtol=0, atol=1e-12)


def test_lean_route_keeps_the_trace_rule() -> None:
    """A matrix whose trace is not positive counts as ``G = 0`` (``v = u``), as on the other
    routes, not as the indefinite problem it states."""
    g = torch.eye(6, dtype=torch.float64)
    g[5, 5], g[0, 1], g[1, 0] = -10.0, -0.5, -0.5
    u = torch.eye(6, dtype=torch.float64)[[0, 0, 1]]
    torch.testing.assert_close(project_weights(u, g), u, rtol=0, atol=0)
    pref = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(project_diagonal(pref, g), torch.diag(pref), rtol=0, atol=0)


@pytest.mark.parametrize("m", [25, 28, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lean_dual_route_serves_upgrads_per_sample_problems(
    m: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From 25 to 32 objectives, UPGrad's problems on a per-sample Gramian (few active
    constraints) are solved by the lean dual PDAS alone, to what the batched route gives."""
    gramian = per_sample_gramian(m, seed=m).to(dtype)
    pref = torch.rand(m, dtype=dtype, generator=torch.Generator().manual_seed(m)) + 0.5
    with pytest.MonkeyPatch.context() as patch:
        full_route(patch)
        expected = project_diagonal(pref, gramian)
    results = _spy_lean(monkeypatch, "lean_dual_pdas_solve")
    _forbid(monkeypatch, "_solve", "solve_rows", "lean_pdas_solve")
    v = project_diagonal(pref, gramian)
    assert len(results) == 1 and results[0] is not None
    assert v.dtype == dtype
    g = gramian.double() / gramian.double().trace()
    assert_kkt(
        v.double(), torch.diag(pref).double(), g, rtol=1e-9 if dtype == torch.float64 else 1e-6
    )
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close((v.double() @ g), expected.double() @ g, rtol=0, atol=tol)


@pytest.mark.parametrize("kind", ["conflicting", "singular", "large"])
def test_lean_dual_route_hands_over_or_is_not_taken(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Gramian whose first guess has large active sets (two camps of rows) never reaches the lean
    dual PDAS; a singular one reaches it and gets no certificate; above 32 objectives it is
    not tried. The batched route answers, exactly, in every case."""
    m = 33 if kind == "large" else 32
    if kind == "conflicting":
        gramian = make_gramian(m, "conflicting", 1.0, seed=3)
    else:
        gramian = per_sample_gramian(m, seed=4)
        if kind == "singular":  # a duplicated sample: G is singular, the first guess small
            gramian[1], gramian[:, 1] = gramian[0], gramian[:, 0]
    results = _spy_lean(monkeypatch, "lean_dual_pdas_solve")
    u = upgrad_rows(m)
    v = project_diagonal(torch.full((m,), 1.0 / m, dtype=torch.float64), gramian)
    assert results == ([None] if kind == "singular" else [])
    assert_kkt(v, u, gramian, rtol=1e-9)
    ref = project_weights_reference(u, gramian)
    torch.testing.assert_close(v @ gramian, ref @ gramian, rtol=0, atol=1e-9)


def route_next_call_to_host(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Simulate on the CPU an accelerator's host route: the next call's own check says yes,
    the checks of the calls it makes say no. Returns the answers, in order."""
    taken: list[bool] = []

    def once(g: Tensor, differentiable: bool, method: str) -> bool:
        taken.append(not taken)
        return taken[-1] and not differentiable and method == "auto"

    monkeypatch.setattr(dual_cone, "_offloads", once)
    return taken


@pytest.mark.filterwarnings("ignore::jacflow.linalg.SolverWarning")  # (max_iter=3, both routes)
@pytest.mark.parametrize("m", [1, 2, 5, 40])
def test_host_route_of_an_accelerator(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The route that solves an accelerator's problem on the host (simulated on the CPU: the
    first call takes it, its inner call does not) passes every setting on and returns what the
    direct call returns."""
    gramian = make_gramian(m, "conflicting", 1.0, seed=m)
    pref = torch.rand(m, dtype=torch.float64) + 0.1
    for kwargs in ({}, {"norm_eps": 1e-4, "reg_eps": 1e-4}, {"max_iter": 3}, {"tol": 1e-4}):
        for solve, first in ((project_weights, torch.diag(pref)), (project_diagonal, pref)):
            taken = route_next_call_to_host(monkeypatch)
            routed = solve(first, gramian, **kwargs)  # type: ignore[operator]
            monkeypatch.undo()
            assert taken[0] and len(taken) >= 2  # the outer call took the route, once
            assert torch.equal(routed, solve(first, gramian, **kwargs))  # type: ignore[operator]


def per_sample_gramian(m: int, seed: int) -> Tensor:
    """A float64 Gramian like a classifier's per-sample one: 10 classes whose mean gradients
    conflict with one another (a centred simplex), each sample's its class's plus noise, so that
    a sample's gradient conflicts with most others (UPGrad's active sets are small)."""
    gen = torch.Generator().manual_seed(seed)
    centres = 3 * (torch.eye(10, dtype=torch.float64) - 0.1)  # (pairwise products -0.9)
    labels = torch.randint(0, 10, (m,), generator=gen)
    noise = 0.1 * torch.randn(m, 300, generator=gen, dtype=torch.float64)  # (full rank)
    j = torch.cat([centres[labels], noise], 1)
    return j @ j.T


def _step_dtypes(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """Record the dtype of every dual PDAS run's steps (that of the inverse it is given)."""
    seen: list[torch.dtype] = []
    solve = dual_cone.dual_pdas_solve

    def recorded(
        u: Tensor, g: Tensor, inverse: Tensor, *args: object
    ) -> tuple[Tensor, Tensor, bool]:
        seen.append(inverse.dtype)
        return solve(u, g, inverse, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(dual_cone, "dual_pdas_solve", recorded)
    return seen


@pytest.mark.parametrize("m", [96, 128])
@pytest.mark.parametrize("diagonal", [False, True])
def test_single_precision_problems_take_float32_steps(
    m: int, diagonal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 problem from 96 objectives takes its dual steps in float32, and the result
    still meets the default tolerance against the float32 Gramian, computed exactly (float64):
    the same KKT certificate as the float64 route's result, at a float32 Gramian's precision."""
    seen = _step_dtypes(monkeypatch)
    gramian = per_sample_gramian(m, seed=m).float()
    exact = gramian.double()
    u = upgrad_rows(m)
    if diagonal:
        v = project_diagonal(torch.full((m,), 1.0 / m), gramian)
    else:
        v = project_weights(u.float(), gramian)
    assert seen == [torch.float32] and v.dtype == torch.float32
    assert_kkt(v.double(), u, exact, rtol=1e-5)
    expected = project_weights(u, exact)
    g = exact / exact.trace()
    torch.testing.assert_close(v.double() @ g, expected @ g, rtol=0, atol=1e-6)


def test_double_precision_and_small_problems_keep_float64_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """float64 problems, float32 ones below 96 objectives and float32 ones to a tolerance below
    1e-6 take float64 steps."""
    seen = _step_dtypes(monkeypatch)
    gramian = per_sample_gramian(128, seed=3)
    project_weights(upgrad_rows(128), gramian)
    project_weights(upgrad_rows(64).float(), per_sample_gramian(64, seed=3).float())
    project_weights(upgrad_rows(128).float(), gramian.float(), tol=1e-8)
    assert seen == [torch.float64] * 3


def test_float32_steps_left_above_the_tolerance_are_finished_in_float64(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """float32 steps cannot reach 1e-9: the problems are solved again with float64 steps, and
    the result meets the tolerance."""
    monkeypatch.setattr(dual_cone, "_SINGLE_MIN_TOL", 1e-12)
    seen = _step_dtypes(monkeypatch)
    m = 128
    gramian = per_sample_gramian(m, seed=5).float()
    v = project_weights(upgrad_rows(m).float(), gramian, tol=1e-9)
    assert seen == [torch.float32, torch.float64]
    exact = gramian.double()
    expected = project_weights(upgrad_rows(m), exact, tol=1e-9)
    g = exact / exact.trace()
    torch.testing.assert_close(v.double() @ g, expected @ g, rtol=0, atol=1e-7)


def _solved_with_grads(u: Tensor, gramian: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``v = project_weights(u, gramian)`` and the gradients of ``<v, w>`` w.r.t. ``u`` and
    ``gramian``, all in float64."""
    u, gramian = u.clone().requires_grad_(True), gramian.clone().requires_grad_(True)
    v = project_weights(u, gramian)
    (v.double() * w).sum().backward()
    assert u.grad is not None and gramian.grad is not None
    return v.detach().double(), u.grad.double(), gramian.grad.double()


def _check_exact_and_float64_gradients(
    u: Tensor,
    gramian: Tensor,
    w: Tensor,
    solved: tuple[Tensor, Tensor, Tensor],
    min_active: int,
    atol: float,
) -> None:
    """``solved`` (of the float32 ``u`` and ``gramian``) has ``v_i = u_i`` exactly on the more
    than ``min_active`` constraints active in the float64 solve of the same values, and its
    gradients equal the float64 route's to ``atol`` times their largest entry."""
    v, grad_u, grad_g = solved
    v_ref, grad_u_ref, grad_g_ref = _solved_with_grads(u.double(), gramian.double(), w)
    active = v_ref - u.double() <= 1e-9 * v_ref.abs().amax(-1, keepdim=True)
    assert int(active.sum()) > min_active and bool((v[active] == u.double()[active]).all())
    torch.testing.assert_close(
        grad_u, grad_u_ref, rtol=0, atol=atol * float(grad_u_ref.abs().max())
    )
    torch.testing.assert_close(
        grad_g, grad_g_ref, rtol=0, atol=atol * float(grad_g_ref.abs().max())
    )


def test_float32_steps_keep_the_active_constraints_exact() -> None:
    """Rows that are not float32 numbers once scaled (general ``u``, DualProj with a
    preference): where the float32 steps hold a constraint active, ``v_i = u_i`` exactly, so the
    implicit backward tells it active, and the gradients are those of the float64 route on the
    same inputs (before, ``v_i`` rounded up by up to 3e-8 relative: gradients 55% off)."""
    m = 128
    gramian = per_sample_gramian(m, seed=5).float()
    gen = torch.Generator().manual_seed(0)
    u = torch.rand(2, m, generator=gen) * torch.eye(m)[:2].mul(5).add(0.05)
    w = torch.randn(2, m, generator=gen, dtype=torch.float64)

    v, grad_u, grad_g = _solved_with_grads(u, gramian, w)
    _check_exact_and_float64_gradients(u, gramian, w, (v, grad_u, grad_g), 2, 1e-5)


def test_float32_admm_keeps_the_active_constraints_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """ADMM's float32 iterations on general rows (the dual route does not pay for them): where
    the iterate holds a constraint active, ``v_i = u_i`` exactly and the gradients are the
    float64 route's (before, ``v_i`` was u's float32 rounding, up to one float32 step above
    ``u_i``: the implicit backward took 17 of 401 active constraints as free, gradients 75%
    off; found by a review)."""
    calls: list[bool] = []
    original = dual_cone.admm_solve

    def recorded(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        calls.append(bool(kwargs.get("low_precision")))
        return original(*args, **kwargs)

    monkeypatch.setattr(dual_cone, "admm_solve", recorded)
    gen = torch.Generator().manual_seed(1)
    m = 100
    centres = 3.0 * (torch.eye(10, dtype=torch.float64) - 0.1)
    labels = torch.randint(0, 10, (m,), generator=gen)
    noise = 0.1 * torch.randn(m, 300, generator=gen, dtype=torch.float64)
    j = torch.cat([centres[labels], noise], 1)
    gramian = (j @ j.T).float()
    u = torch.randn(8, m, generator=gen, dtype=torch.float64).float()
    u = (u.abs() * torch.rand(8, m, generator=gen, dtype=torch.float64).float()) / 3.0
    w = torch.randn(8, m, generator=gen, dtype=torch.float64)

    solved = _solved_with_grads(u, gramian, w)
    assert calls == [True]  # (float32 iterations, then the float64 route's own run below)
    _check_exact_and_float64_gradients(u, gramian, w, solved, 100, 1e-4)


@pytest.mark.parametrize("seed", [3, 4, 7])
def test_ill_conditioned_rescaled_float32_problems_are_solved_to_the_tolerance(seed: int) -> None:
    """A float32 Gramian of condition 1e7 whose diagonal spreads over 8 orders of magnitude
    (solved rescaled, where the warning waits for ``100 m eps``): PDAS stopped at a residual
    of about 3e-4, above the 1e-6 aimed for, and the result was returned as it was, 3-13% off
    with gradients off too (a review's finding). Problems left above the tolerance now go to
    the exact fallback, as with an explicit ``tol``."""
    gen = torch.Generator().manual_seed(seed)
    m, n = 22, 38
    q = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))[0]
    p = torch.linalg.qr(torch.randn(n, m, generator=gen, dtype=torch.float64))[0]
    singular = torch.logspace(0, -3.6, m, dtype=torch.float64)
    norms = torch.logspace(0, 0.9, m, dtype=torch.float64)
    j = norms[:, None] * (q * singular) @ p.T
    gramian = (j @ j.T).float()
    expected = project_diagonal(torch.ones(m, dtype=torch.float64), gramian.double())
    v = project_diagonal(torch.ones(m), gramian)
    scale = float(expected.abs().max())
    torch.testing.assert_close(v.double(), expected, rtol=0, atol=1e-6 * scale)
    u = torch.eye(m)
    w = torch.randn(m, m, generator=gen, dtype=torch.float64)
    solved = _solved_with_grads(u, gramian, w)
    torch.testing.assert_close(solved[0], expected, rtol=0, atol=1e-6 * scale)
    _check_exact_and_float64_gradients(u, gramian, w, solved, 5, 1e-4)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_half_precision_rescaled_problem_is_formed_in_float64(
    dtype: torch.dtype, atol: float
) -> None:
    """A Gramian whose diagonal spreads over more than 16 is solved rescaled to a unit
    diagonal; the rescaled problem was formed in the input's half precision, so the problem
    solved was the given one rounded (weights 120% off in bfloat16, 13% in float16: a review's
    case). It is formed in float64 now: the error is the output's rounding."""
    gen = torch.Generator().manual_seed(3)
    m = 25
    a = torch.randn(m, 5, generator=gen, dtype=torch.float64)
    g = a @ a.T + torch.diag(torch.rand(m, generator=gen, dtype=torch.float64) * 0.1 + 0.01)
    d = g.diagonal().sqrt()
    spread = 10 ** (torch.rand(m, generator=gen, dtype=torch.float64) * 2 - 1)
    g = g / (d[:, None] * d[None]) * spread[:, None] * spread[None]
    given = g.to(dtype).double()  # (the problem as given, exactly)
    u = torch.eye(m, dtype=torch.float64)[:6] * 2.0
    pref = torch.full((m,), 2.0, dtype=torch.float64)
    cases = [
        (project_weights(u.to(dtype), g.to(dtype)), project_weights(u, given)),
        (project_diagonal(pref.to(dtype), g.to(dtype)), project_diagonal(pref, given)),
    ]
    for v, expected in cases:
        assert v.dtype == dtype
        scale = float(expected.abs().max())
        torch.testing.assert_close(v.double(), expected, rtol=0, atol=atol * scale)


def test_float32_steps_stopped_by_their_cost_are_not_repeated_in_float64(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the float32 steps stop because the active systems grow costly, float64 steps would
    too: the problems go straight to the chosen method (before, a float64 pass was tried first:
    1.1x the time at m = 192)."""
    seen = _step_dtypes(monkeypatch)
    m = 192
    gramian = per_sample_gramian(m, seed=m).float()
    v = project_weights(upgrad_rows(m).float(), gramian)
    assert seen == [torch.float32]
    assert_kkt(v.double(), upgrad_rows(m), gramian.double(), rtol=1e-5)


def test_ill_conditioned_single_precision_problems_keep_float64_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A float32 Gramian whose squared Cholesky pivots fall below 1e-2 of its largest diagonal
    entry (two samples' gradients nearly equal: 2.8e-3, cond 1.3e4, where float32 steps leave
    problems above the tolerance) is not trusted to float32 steps."""
    seen = _step_dtypes(monkeypatch)
    m = 100
    gen = torch.Generator().manual_seed(0)
    centres = 3 * (torch.eye(10, dtype=torch.float64) - 0.1)
    labels = torch.randint(0, 10, (m,), generator=gen)
    noise = 0.1 * torch.randn(m, 300, generator=gen, dtype=torch.float64)
    j = torch.cat([centres[labels], noise], 1)
    j[1] = j[0] + 1e-2 * torch.randn(310, generator=gen, dtype=torch.float64)
    gramian = (j @ j.T).float()
    v = project_weights(upgrad_rows(m).float(), gramian)
    assert seen == [torch.float64]
    assert_kkt(v.double(), upgrad_rows(m), gramian.double(), rtol=1e-5)


def test_low_precision_admm_switches_to_float64_for_tight_tolerances() -> None:
    """float32 iterations cannot reach 1e-11: ADMM must hand over to float64 and finish there."""
    gramian = make_gramian(60, "conflicting", 1.0, seed=4)
    g = (gramian / gramian.trace())[None]
    u = torch.eye(60, dtype=torch.float64)[None]
    v, residual = admm_solve(u, g, 20_000, 1e-11, low_precision=True)
    assert float(residual.amax()) <= 1e-11
    assert v.dtype == torch.float64
    assert_kkt(v[0], u[0], g[0], rtol=1e-9)
    loose, loose_residual = admm_solve(u, g, 20_000, 1e-5, low_precision=True)
    assert float(loose_residual.amax()) <= 1e-5
    torch.testing.assert_close(loose[0].sum(0), v[0].sum(0), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_give_nan(bad: float) -> None:
    gramians = torch.stack([make_gramian(5, "conflicting", 1.0, seed=s) for s in range(2)])
    u = upgrad_rows(5).expand(2, 5, 5).clone()
    gramians[0, 1, 2] = bad
    v = project_weights(u, gramians)
    assert bool(v[0].isnan().all())
    torch.testing.assert_close(v[1], project_weights(u[1], gramians[1]))
    u[1, 3, 0] = bad
    v = project_weights(u, gramians)
    assert bool(v[1, 3].isnan().all())
    assert bool(v[1, [0, 1, 2, 4]].isfinite().all())


def test_admm_problems_below_the_warning_level_skip_the_exact_fallback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ADMM's problems (from 33 objectives) go to the exact fallback above the warning level
    only: on a rank-deficient float32 Gramian, which ADMM leaves near 6e-5 (below the level,
    above the 1e-6 aimed for), Lawson-Hanson took 2.2x the time at m = 128 and stopped above
    1e-6 too (a review's finding on the first version of the fallback above the tolerance)."""
    calls: list[int] = []
    original = dual_cone._exact_fallback

    def recorded(*args: Any) -> tuple[Tensor, Tensor]:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(dual_cone, "_exact_fallback", recorded)
    gen = torch.Generator().manual_seed(0)
    m, n, rank = 128, 2000, 40
    j = torch.randn(m, rank, generator=gen) @ torch.randn(rank, n, generator=gen)
    j = j * torch.logspace(0, 1.5, m)[:, None] + 0.5 * torch.randn(1, n, generator=gen)
    gramian = j @ j.T
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v = project_diagonal(torch.full((m,), 1 / m), gramian)
    assert calls == []
    with warnings.catch_warnings():  # (float64 too stops near 2e-5 on this Gramian)
        warnings.simplefilter("ignore", SolverWarning)
        expected = project_diagonal(torch.full((m,), 1 / m, dtype=torch.float64), gramian.double())
    scale = float(expected.sum(0).abs().max())
    torch.testing.assert_close(v.sum(0).double(), expected.sum(0), rtol=0, atol=5e-2 * scale)


@pytest.mark.parametrize("m", [3, 12, 40, 100])  # (host, lean, batched PDAS, ADMM routes)
@pytest.mark.parametrize("grad", [False, True])
def test_general_rows_are_exactly_feasible(m: int, grad: bool) -> None:
    """``v >= u`` exactly for rows that are not powers of two: the rows are scaled to max-norm
    1 and back, and ``(u / s) * s`` rounded active ``v_i`` one ulp below ``u_i`` (a review's
    finding, every route)."""
    gen = torch.Generator().manual_seed(m)
    j = torch.randn(m, m + 3, generator=gen, dtype=torch.float64)
    j[1::2] = -j[::2][: m // 2] + 0.3 * torch.randn(m // 2, m + 3, generator=gen, dtype=j.dtype)
    gramian = j @ j.T
    u = torch.rand(16, m, generator=gen, dtype=torch.float64) * 3.7
    v = project_weights(u.clone().requires_grad_(grad), gramian).detach()
    assert bool((v >= u).all())
    assert_kkt(v, u, gramian)


@pytest.mark.parametrize("method", ["auto", "admm"])
def test_zero_gramian_in_a_batch_solved_by_admm(method: str) -> None:
    """A zero Gramian (or one the trace rule zeroes) beside others that ADMM solves: its step
    size was ``sqrt(tiny * tiny) = 0`` and its iterates 0 / 0, so ADMM warned of a NaN residual
    (v = u was still returned, by the feasibility clamp)."""
    m = 40
    gramians = torch.stack(
        [torch.zeros(m, m, dtype=torch.float64), make_gramian(m, "conflicting", 1.0, 2)]
    )
    u = upgrad_rows(m).expand(2, m, m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v = project_weights(u, gramians, method=method)
    torch.testing.assert_close(v[0], u[0], rtol=0, atol=0)
    torch.testing.assert_close(v[1], project_weights(u[1], gramians[1], method=method))


@pytest.mark.parametrize("method", METHODS)
def test_warns_when_stopped_early(method: str) -> None:
    gramian = make_gramian(30, "conflicting", 1.0, seed=2)
    u = upgrad_rows(30)
    with pytest.warns(SolverWarning, match="KKT residual"):
        v = project_weights(u, gramian, method=method, max_iter=1)
    assert bool((v >= u).all())  # the best iterate is still feasible
    with pytest.warns(SolverWarning):  # an unreachable tolerance
        project_weights(u, gramian, method=method, max_iter=5, tol=1e-300)


def test_solver_warning_points_at_the_callers_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whichever route stops early (direct, UPGrad's diagonal problems, an aggregator's module
    call, the host route of an accelerator), the warning names the user's file, not jacflow's
    or torch's."""
    from jacflow.aggregation import UPGrad
    from jacflow.linalg import TorchProjector

    gramian = make_gramian(30, "conflicting", 1.0, seed=2)
    jacobian = torch.linalg.cholesky(gramian + 1e-9 * torch.eye(30, dtype=torch.float64))
    pref = torch.ones(30, dtype=torch.float64)
    calls = [
        lambda: project_weights(upgrad_rows(30), gramian, max_iter=1),
        lambda: project_diagonal(pref, gramian, method="pdas", max_iter=1),
        lambda: UPGrad(projector=TorchProjector(method="pdas", max_iter=1))(jacobian),
    ]
    for call in calls:
        with pytest.warns(SolverWarning) as caught:
            call()
        assert [w.filename for w in caught] == [__file__] * len(caught)
    taken = route_next_call_to_host(monkeypatch)
    with pytest.warns(SolverWarning) as caught:
        project_weights(upgrad_rows(30), gramian, max_iter=1)
    assert taken[0] and [w.filename for w in caught] == [__file__] * len(caught)


def test_edge_sizes() -> None:
    empty = project_weights(torch.zeros(0), torch.zeros(0, 0))
    assert empty.shape == (0,)
    assert project_weights(torch.zeros(0, 3), torch.eye(3)).shape == (0, 3)
    u = torch.tensor([[2.0], [-3.0]], dtype=torch.float64)
    torch.testing.assert_close(
        project_weights(u, torch.tensor([[4.0]]).double()), torch.tensor([[2.0], [0.0]]).double()
    )
    torch.testing.assert_close(project_weights(u, torch.zeros(1, 1).double()), u)
    # A zero Gramian: every v >= u is optimal, and u itself is returned.
    u = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(project_weights(u, torch.zeros(4, 4).double()), u)


def test_two_opposite_rows_closed_form() -> None:
    """J = [g, -a g]: projecting e_1 must cancel the update, v = (1, 1/a)."""
    g = torch.tensor([[1.0, 2.0, -1.0]], dtype=torch.float64)
    j = torch.cat([g, -3.0 * g])
    v = project_weights(torch.tensor([1.0, 0.0], dtype=torch.float64), j @ j.T)
    torch.testing.assert_close(v, torch.tensor([1.0, 1.0 / 3.0], dtype=torch.float64))


def test_no_conflict_returns_u() -> None:
    j = torch.rand(5, 7, dtype=torch.float64)  # non-negative entries: G >= 0 entrywise
    u = torch.rand(4, 5, dtype=torch.float64)
    assert torch.equal(project_weights(u, j @ j.T), u)


@pytest.mark.parametrize("diagonal", [False, True])
def test_results_are_ordinary_tensors(diagonal: bool) -> None:
    """The batched route solves in inference mode; what it returns must still go into a graph
    and take in-place updates, which an inference tensor refuses outside inference mode."""
    gramian = make_gramian(24, "conflicting", 1.0, seed=6)  # 24^4 > 10^4: the batched route
    pref = torch.full((24,), 1 / 24, dtype=torch.float64)
    v = project_diagonal(pref, gramian) if diagonal else project_weights(torch.diag(pref), gramian)
    assert not v.is_inference()
    scale = torch.ones((), dtype=torch.float64, requires_grad=True)
    (scale * v).sum().backward()  # saves v for the gradient of scale
    torch.testing.assert_close(scale.grad, v.sum())
    v.add_(1.0)


def test_invariances() -> None:
    gramian = make_gramian(12, "conflicting", 1.0, seed=4)
    u = torch.randn(3, 12, dtype=torch.float64)
    v = project_weights(u, gramian)
    torch.testing.assert_close(project_weights(u, 1e6 * gramian), v)
    torch.testing.assert_close(project_weights(7.0 * u, gramian), 7.0 * v)
    perm = torch.randperm(12)
    torch.testing.assert_close(project_weights(u[:, perm], gramian[perm][:, perm]), v[:, perm])


def test_norm_and_reg_eps() -> None:
    gramian = make_gramian(4, "conflicting", 1e-6, seed=5)
    u = upgrad_rows(4)
    # A trace at or below norm_eps counts as zero: nothing is projected.
    torch.testing.assert_close(project_weights(u, gramian, norm_eps=1.0), u)
    regularised = project_weights(u, gramian, reg_eps=0.1)
    normalised = gramian / gramian.trace() + 0.1 * torch.eye(4, dtype=torch.float64)
    torch.testing.assert_close(regularised, project_weights_reference(u, normalised))


def test_invalid_inputs() -> None:
    g = torch.eye(3)
    with pytest.raises(ValueError, match=r"`gramian` must be a square"):
        project_weights(torch.ones(3), torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"`u` must have shape \[..., m\] with m = 3"):
        project_weights(torch.ones(2), g)
    with pytest.raises(ValueError, match=r"\[\*batch, k, m\]"):
        project_weights(torch.ones(2, 3), torch.eye(3).expand(2, 3, 3))
    with pytest.raises(TypeError, match="floating dtype"):
        project_weights(torch.ones(3, dtype=torch.int64), g)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        project_weights([1.0, 0.0, 0.0], g)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`method` must be one of"):
        project_weights(torch.ones(3), g, method="newton")
    with pytest.raises(ValueError, match="`max_iter`"):
        project_weights(torch.ones(3), g, max_iter=0)
    with pytest.raises(ValueError, match="`tol`"):
        project_weights(torch.ones(3), g, tol=-1.0)
    with pytest.raises(ValueError, match="`reg_eps`"):
        project_weights(torch.ones(3), g, reg_eps=-1.0)


def test_degenerate_problem_falls_back_to_an_exact_solution() -> None:
    """Rank 4 < n = 10 < m = 13: the dual cone is almost a subspace and ``v`` is huge and not
    unique. PDAS cycles and FISTA stalls on this one; the exact fallback must still solve it."""
    j = make_jacobian(13, 10, 4, 1e-7, torch.float64, seed=27)
    gramian = j @ j.T
    u = upgrad_rows(13)
    v = project_weights(u, gramian)
    assert_kkt(v, u, gramian)
    ref = project_weights_reference(u, gramian)
    s = float(ref.abs().max())
    g_scale = float(gramian.diagonal().max())
    torch.testing.assert_close(v @ gramian, ref @ gramian, rtol=0, atol=1e-6 * g_scale * s)


@pytest.mark.parametrize(("m", "seed"), [(156, 612965234), (141, 1), (100, 2)])
def test_degenerate_more_rows_than_rank(m: int, seed: int) -> None:
    """Rank m / 2: ADMM and FISTA stall and PDAS cycles here (the m = 156 case ended at a KKT
    residual of 1e-4 before the Lawson-Hanson fallback); the result must be exact."""
    gramian = make_gramian(m, "more_rows", 1.0, seed)
    u = upgrad_rows(m)
    assert_kkt(project_weights(u, gramian), u, gramian)


@settings(max_examples=40)
@given(
    m=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([0.0, 1e-12, 1.0, 1e6]),
    norm_eps=st.sampled_from([0.0, 1e-4]),
    bad=st.sampled_from([None, float("nan"), float("inf")]),
)
def test_one_sync_normalisation_is_the_batched_one(
    m: int, seed: int, scale: float, norm_eps: float, bad: float | None
) -> None:
    """The host-read trace of one Gramian gives the guarded tensor normalisation: the same
    matrix (to rounding), zeros below ``norm_eps``, non-finite entries where G has some."""
    gen = torch.Generator().manual_seed(seed)
    j = torch.randn(m, m + 1, generator=gen, dtype=torch.float64)
    g = (scale * (j @ j.T) + 1e-3 * torch.randn(m, m, generator=gen, dtype=torch.float64))[None]
    if bad is not None:
        g[0, 0, m - 1] = bad
    fast = _normalized(g, norm_eps, 0.0, one_sync=True)
    guarded = _normalized(g, norm_eps, 0.0, one_sync=False)
    assert torch.equal(torch.isfinite(fast), torch.isfinite(guarded))
    finite = torch.isfinite(guarded)
    torch.testing.assert_close(fast[finite], guarded[finite], rtol=1e-14, atol=0)


def _projection_onto_dual_cone(j: Tensor, g: Tensor) -> Tensor:
    """The primal QP on ``J`` itself, independent of the Gramian: ``argmin |x - g|^2`` subject
    to ``J x >= 0`` (quadprog, float64)."""
    n = j.shape[1]
    x = quadprog.solve_qp(
        torch.eye(n, dtype=torch.float64).numpy(),
        g.double().numpy(),
        j.double().T.contiguous().numpy(),
        torch.zeros(j.shape[0], dtype=torch.float64).numpy(),
    )[0]
    return torch.from_numpy(x)


# (row norms 0.03 to 73 in float32, and 2.5e-4 to 1.7e3 in float64: two reviewed cases)
_SPREAD_ROWS = {
    torch.float32: [
        [0.015923108905553818, -0.03018845058977604, 0.005432105623185635],
        [-0.04856562614440918, 0.05658954381942749, 0.11892170459032059],
        [0.2697981297969818, -1.23176109790802, -1.2911725044250488],
        [0.6047760248184204, -7.1842732429504395, -10.918421745300293],
        [49.25053405761719, 52.090736389160156, 11.286518096923828],
    ],
    torch.float64: [
        [-0.00013420613650887866, -0.0002142356623581206, 4.005388807538127e-06],
        [0.05570190322900979, 0.3431284471081381, -0.195091586233169],
        [972.2052549085097, 404.10742060064365, -1343.823291068561],
    ],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_objectives_of_very_different_norms_are_not_conflicted(dtype: torch.dtype) -> None:
    """The problem is solved at unit diagonal (an exact rescaling), so that the solvers'
    tolerance weighs every objective by its own gradient's norm. On ``G`` itself, a conflict
    with a gradient 1e3 (float32) or 1e7 (float64) times smaller than another's was below it:
    UPGrad's update there conflicted with an objective (cosine -0.92 and -0.46)."""
    j = torch.tensor(_SPREAD_ROWS[dtype], dtype=dtype)
    m = j.shape[0]
    gramian = j @ j.T
    upgrad = project_diagonal(torch.full((m,), 1 / m, dtype=dtype), gramian).sum(0) @ j
    expected = sum(_projection_onto_dual_cone(j, row / m) for row in j)
    scale = float(j.double().norm(dim=1).max())  # (float32: the Gramian's rounding, about
    tol = 1e-6 if dtype == torch.float32 else 1e-12  # eps times its largest entries)
    torch.testing.assert_close(upgrad.double(), expected, rtol=0, atol=tol * scale)
    norms = j.double().norm(dim=1)
    assert bool(((j.double() @ upgrad.double()) >= -tol * scale * norms).all())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), spread=st.floats(1.0, 9.0), m=st.integers(2, 12))
def test_row_norms_spread_over_orders_of_magnitude(seed: int, spread: float, m: int) -> None:
    """float64 Jacobians whose row norms span up to 1e9: every UPGrad projection agrees with
    the primal QP on ``J``, each to the precision of its own row."""
    gen = torch.Generator().manual_seed(seed)
    j = torch.randn(m, m + 3, generator=gen, dtype=torch.float64)
    j = j * 10 ** (spread * torch.rand(m, 1, generator=gen, dtype=torch.float64))
    v = project_weights(torch.eye(m, dtype=torch.float64), j @ j.T)
    for i in range(m):
        expected = _projection_onto_dual_cone(j, j[i])
        torch.testing.assert_close(v[i] @ j, expected, rtol=0, atol=1e-8 * float(j[i].norm()))


def test_float32_gramians_below_the_rescaling_spread_do_not_conflict() -> None:
    """Nearly opposed pairs of gradients, float32, the diagonal spread just below the
    rescaling threshold (solved as given): a looser warning threshold there (``100 m eps``,
    meant for the rescaled problems) let the solvers stop with DualProj's update conflicting
    with an objective (cosine -9e-3, 28% from the primal QP), silently."""
    gen = torch.Generator().manual_seed(61)
    m, n = 32, 40
    j = torch.randn(m, n, generator=gen, dtype=torch.float64)
    for i in range(0, m - 1, 2):
        j[i + 1] = -j[i] + 0.05 * torch.randn(n, generator=gen, dtype=torch.float64)
    j = j / j.norm(dim=1, keepdim=True)
    spread = torch.logspace(0, float(torch.log10(torch.tensor(15.99))), m, dtype=torch.float64)
    j = j * spread.sqrt()[torch.randperm(m, generator=gen)][:, None]
    gramian = j.float() @ j.float().T
    v = project_weights(torch.full((1, m), 1 / m), gramian)[0]
    update = v.double() @ j
    expected = _projection_onto_dual_cone(j, j.mean(0))
    assert float((update - expected).norm() / expected.norm()) < 1e-3
    cosines = (j @ update) / (j.norm(dim=1) * update.norm())
    assert float(cosines.min()) > -1e-4


@pytest.mark.parametrize("m", [6, 20])
def test_reference_solver_is_optimal_on_rows_of_very_different_norms(m: int) -> None:
    """The oracle of these tests: its active set's absolute tolerance ignored the conflicts
    with rows of tiny norm (an update at an angle of 120 degrees to one of them), until it
    solved the problem scaled to a unit diagonal."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.logspace(-4, 4, m, dtype=torch.float64)[:, None]
    J = torch.randn(m, m + 3, generator=gen, dtype=torch.float64) * scales
    gramian, u = J @ J.T, torch.eye(m, dtype=torch.float64)
    v = project_weights_reference(u, gramian)
    updates = v @ J
    cosines = (updates @ J.T) / (updates.norm(dim=1, keepdim=True) * J.norm(dim=1))
    assert float(cosines.min()) >= -1e-9
    objective = torch.einsum("ki,ij,kj->k", v, gramian, v)
    fast = project_weights(u, gramian)
    assert bool((objective <= torch.einsum("ki,ij,kj->k", fast, gramian, fast) * (1 + 1e-9)).all())


@pytest.mark.parametrize("kind", ["more_rows", "rank_deficient"])
def test_admm_polish_solves_the_problems_exactly(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ADMM's PDAS polish (taken by "auto" above m = 32) runs on problems ADMM is slow on, and
    its answers (the updates) are those of the reference solver. (Without Anderson's
    acceleration, which solves these problems before the polish's turn comes.)"""
    m = 64
    gramian = make_gramian(m, kind, 1.0, seed=1)
    calls: list[int] = []
    polish = first_order.pdas_solve

    def counted(u: Tensor, *args: object) -> tuple[Tensor, Tensor]:
        calls.append(u.shape[1])
        return polish(u, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(first_order, "pdas_solve", counted)
    g = _normalized(gramian[None], 0.0, 0.0, one_sync=True)
    u = upgrad_rows(m)[None] * m
    v, residual = first_order.admm_solve(u, g, 20_000, 1e-10, polish_iter=10, anderson=False)
    assert calls, "the polish never ran"
    assert float(residual.amax()) <= 1e-10
    # (the weights of a singular G are not unique, the update J^T v is: compare through G)
    gap = v[0] - project_weights_reference(u[0], g[0])
    assert float(torch.einsum("ki,ij,kj->k", gap, g[0], gap).amax()) <= 1e-14
    assert_kkt(v[0], u[0], g[0])


@pytest.mark.parametrize("m", [3, 24, 32, 40])
def test_gramians_near_the_largest_float_are_projected_as_at_scale_one(m: int) -> None:
    """Every route (host floats, lean, batched, ADMM): finite entries whose trace overflows
    gave v = u (the Gramian divided by an infinite trace) or NaN; the projection ignores a
    global scale of G."""
    J = make_jacobian(m, m + 3, m, 1.0, torch.float64, seed=m)
    G = J @ J.T
    huge = G / G.diagonal().amax() * 1e308
    assert bool(torch.isfinite(huge).all()) and not torch.isfinite(huge.diagonal().sum())
    u = torch.eye(m, dtype=torch.float64)
    torch.testing.assert_close(project_weights(u, huge), project_weights(u, G), rtol=0, atol=1e-9)
    pref = torch.full((m,), 1.0 / m, dtype=torch.float64)
    torch.testing.assert_close(
        project_diagonal(pref, huge), project_diagonal(pref, G), rtol=0, atol=1e-9
    )


@pytest.mark.parametrize(("dtype", "scale"), [(torch.float32, 1e-12), (torch.float64, 1e-22)])
@pytest.mark.parametrize("method", METHODS)
def test_zero_rows_of_a_small_gramian_do_not_set_the_residuals_unit(
    dtype: torch.dtype, scale: float, method: str
) -> None:
    """A zero gradient's diagonal entry was rescaled by 1 (the others by their gradients'
    norms), so its ``u_i`` set the unit of the residual: on a Gramian of small scale the
    conflict of the two other objectives was below the tolerance and ``v = u`` came back
    (an update at an angle of 117 degrees to the third gradient), silently. The projection
    ignores a global scale of ``G``."""
    J = torch.tensor([[0.0, 0.0], [1.0, 0.0], [-0.5, 1.0]], dtype=torch.float64)
    gramian = (scale * (J @ J.T)).to(dtype)
    u = torch.tensor([1.0, 1.0, 0.0], dtype=dtype)
    expected = torch.tensor([1.0, 1.0, 0.4], dtype=dtype)
    torch.testing.assert_close(project_weights(u, gramian, method=method), expected)
    torch.testing.assert_close(project_weights(u, gramian / scale, method=method), expected)


def test_reference_solver_is_optimal_on_nearly_parallel_rows() -> None:
    """The oracle of these tests solved its free systems by pseudo-inverse alone, whose
    gradients were left at ``eps * cond`` (1e-8 on rows within 1e-4 of one direction or its
    opposite): it stopped on the wrong active set, J^T v 59% off the projection."""
    gen = torch.Generator().manual_seed(36)
    m, n = 6, 8
    base = torch.randn(n, generator=gen, dtype=torch.float64)
    J = base + 1e-4 * torch.randn(m, n, generator=gen, dtype=torch.float64)
    J[torch.rand(m, generator=gen) < 0.3] *= -1
    gramian, u = J @ J.T, torch.eye(m, dtype=torch.float64)
    v = project_weights_reference(u, gramian)
    fast = project_weights(u, gramian)
    gap = v - fast
    objective = torch.einsum("ki,ij,kj->k", fast, gramian, fast)
    assert bool((torch.einsum("ki,ij,kj->k", gap, gramian, gap) <= 1e-12 * objective).all())
    assert_kkt(v, u, gramian)


@pytest.mark.parametrize("route", ["pdas", "auto under autograd"])
def test_pdas_drifting_on_a_rounded_rank_deficient_gramian_goes_to_the_exact_fallback(
    route: str,
) -> None:
    """On this rank-2 float32 Gramian (rows 0 and 1 opposite, their norms 5x apart), PDAS
    drifted along a nearly null direction: weights of 3e4, an update of 0.5% of ``|J^T u|``
    conflicting with an objective (cosine -0.99), no warning, its residual relative to
    ``|v|`` passing; under autograd "auto" takes PDAS, and DualProj's gradients reached 1.2e5.
    Problems with such weights go to the exact Lawson-Hanson fallback (review 57)."""
    J = torch.tensor([[2.0, 1.0], [-10.0, -5.0], [0.0, 1.0], [-0.1, -0.1]])
    u = torch.full((4,), 0.25)
    reference = project_weights_reference(u.double(), (J @ J.T).double())
    if route == "pdas":
        v = project_weights(u, J @ J.T, method="pdas")
    else:
        leaf = J.clone().requires_grad_()
        v = project_weights(u, leaf @ leaf.T)
        (v @ leaf).sum().backward()
        assert leaf.grad is not None and float(leaf.grad.abs().max()) < 1.0
        v = v.detach()
    assert float(v.abs().max()) < 10
    scale = float((u @ J).norm())
    assert float((v.double() @ J.double()).norm()) <= 1e-5 * scale
    assert float((reference @ J.double()).norm()) <= 1e-5 * scale


def zero_cone_jacobian(m: int, n: int, kind: str, seed: int) -> Tensor:
    """A Jacobian ``[m, n]`` (``m >= n + 1``) whose rows have a positive combination equal to
    0, so that the dual cone ``{x : J x >= 0}`` is ``{0}`` (Gordan), with rows ``duplicated``,
    ``opposite`` (a row and its negative), or ``near`` (a perturbation of ``1e-7`` that leaves
    ``G`` nonsingular, eigenvalues down to about ``1e-14`` of the largest)."""
    gen = torch.Generator().manual_seed(seed)
    j = torch.randn(m - 1, n, generator=gen, dtype=torch.float64)
    if kind == "duplicated":
        j[: (m - 1) // 2] = j[(m - 1) // 2 : 2 * ((m - 1) // 2)]
    if kind == "opposite":
        j[: (m - 1) // 2] = -j[(m - 1) // 2 : 2 * ((m - 1) // 2)]
    weights = torch.rand(1, m - 1, generator=gen, dtype=torch.float64) + 0.1
    j = torch.cat([j, -weights @ j])
    if kind == "near":
        j = torch.cat([j, 1e-7 * torch.randn(m, m, generator=gen, dtype=torch.float64)], 1)
    return j


def _update_reference(u: Tensor, gramian: Tensor) -> Tensor:
    """``R^T v`` (``G = R R^T``), the update in an orthonormal basis, of the exact projection:
    scipy's NNLS on ``min_{x >= 0} |R^T (u + x)|``, row by row."""
    np = pytest.importorskip("numpy")
    nnls = pytest.importorskip("scipy.optimize").nnls
    eigenvalues, q = np.linalg.eigh(gramian.numpy())
    r = q * np.sqrt(np.clip(eigenvalues, 0.0, None))
    rows = []
    for row in u.numpy():
        x, _ = nnls(r.T, -r.T @ row, maxiter=50 * len(row))
        rows.append(r.T @ (row + x))
    return torch.tensor(np.array(rows))


ZERO_CONE_KINDS = ("plain", "duplicated", "opposite", "near")


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(3, 40),
    kind=st.sampled_from(ZERO_CONE_KINDS),
    general=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_trivial_dual_cone(m: int, kind: str, general: bool, seed: int) -> None:
    """Degenerate Gramians whose dual cone is ``{0}``: the KKT conditions, and the update
    ``J^T v`` of scipy's NNLS (unique, unlike ``v``), for UPGrad's rows or general ones."""
    gen = torch.Generator().manual_seed(seed)
    j = zero_cone_jacobian(m, int(torch.randint(1, m, (1,), generator=gen)), kind, seed)
    gramian = j @ j.T
    u = upgrad_rows(m) if not general else torch.randn(3, m, generator=gen, dtype=torch.float64)
    v = project_weights(u, gramian)
    assert_kkt(v, u, gramian, rtol=1e-8)
    expected = _update_reference(u, gramian)  # (in another basis: compare the norms)
    size = float(j.norm()) * float(torch.maximum(v.abs().amax(), u.abs().amax()))
    # (scipy's NNLS stops about 1e-8 off; "near": eigenvalues of 1e-14 of the largest, the
    # update of their directions (1e-7) is at the precision that a float64 Gramian determines)
    atol = (1e-6 if kind == "near" else 1e-7) * size
    torch.testing.assert_close((v @ j).norm(dim=-1), expected.norm(dim=-1), rtol=0, atol=atol)
    if kind != "near":  # (its cone is not exactly {0})
        assert float((v @ j).norm(dim=-1).amax()) <= 1e-8 * size


def _spy_zero_cone(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    taken: list[bool] = []
    original = dual_cone._zero_cone

    def spy(*args: Any) -> Tensor | None:
        result = original(*args)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(dual_cone, "_zero_cone", spy)
    return taken


@pytest.mark.parametrize("m", [8, 30, 64])
@pytest.mark.parametrize("kind", ZERO_CONE_KINDS[:3])
def test_trivial_dual_cone_is_solved_by_one_problem(
    m: int, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UPGrad's problems on a Gramian of dual cone ``{0}``: one Lawson-Hanson problem solves them
    all (PDAS cycled there and ADMM crawled, 0.2-0.4 s at m = 128), with moderate weights (at
    most 50 times the rows' max-norm on these Gramians, along the null space)."""
    taken = _spy_zero_cone(monkeypatch)
    j = zero_cone_jacobian(m, m // 2, kind, seed=m)
    u = torch.diag(torch.linspace(1.0, 2.0, m, dtype=torch.float64))
    v = project_diagonal(u.diagonal(), j @ j.T)
    assert taken == [True]
    assert_kkt(v, u, j @ j.T, rtol=1e-9)
    assert float(v.abs().amax()) <= 50 * 2.0


def test_trivial_dual_cone_candidates_are_optimal() -> None:
    """Both candidates of ``null_rows`` are ``>= u`` with ``G v = 0``, for general rows; the
    second is the smaller here."""
    j = zero_cone_jacobian(24, 10, "plain", seed=5)
    g = _normalized((j @ j.T)[None], 0.0, 0.0, one_sync=True)[0]
    u = torch.randn(6, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y, passive, factor = least_combination(g, tol=1e-12)
    candidates = dual_cone.null_rows(u, g, y, passive, factor)
    for v in candidates:
        assert float((u - v).amax()) <= 1e-15 * float(v.abs().amax())  # (>= u up to rounding)
        size = float(v.abs().amax()) * float(g.diagonal().amax())
        assert float((v @ g).abs().amax()) <= 1e-12 * size
    assert float(candidates[1].abs().sum()) < float(candidates[0].abs().sum())


@pytest.mark.parametrize("other", ["zero cone", "psd", "more_rows"])
def test_trivial_dual_cone_in_a_batch(other: str) -> None:
    """A batch of Gramians ``[2, m, m]``, the first of dual cone ``{0}``: the shortcut serves the
    batch only when every Gramian's cone is ``{0}``; the KKT conditions either way."""
    m = 20
    first = zero_cone_jacobian(m, 7, "plain", seed=2)
    if other == "zero cone":
        second = (
            zero_cone_jacobian(m, 9, "duplicated", seed=3)
            @ zero_cone_jacobian(m, 9, "duplicated", seed=3).T
        )
    else:
        second = make_gramian(m, other, 1.0, seed=4)
    gramians = torch.stack([first @ first.T, second])
    u = torch.eye(m, dtype=torch.float64).expand(2, m, m)
    v = project_weights(u, gramians)
    for i in range(2):
        assert_kkt(v[i], u[i], gramians[i], rtol=1e-9)


def test_trivial_dual_cone_in_float32_and_under_autograd() -> None:
    """A float32 Gramian (rounded: no longer exactly singular) and a differentiable call."""
    j = zero_cone_jacobian(40, 12, "plain", seed=6)
    gramian = j @ j.T
    u = upgrad_rows(40)
    v = project_weights(u.float(), gramian.float())
    assert_kkt(v.double(), u, gramian, rtol=1e-4)
    leaf = gramian.clone().requires_grad_()
    v = project_weights(u, leaf)
    assert_kkt(v.detach(), u, gramian, rtol=1e-8)
    (grad,) = torch.autograd.grad(v.sum(), leaf)
    assert bool(torch.isfinite(grad).all())


def _thin_cone_jacobian(m: int, n: int, width: float, seed: int) -> Tensor:
    """A Jacobian ``[m, n]`` (``m > n``: ``G`` singular) whose dual cone is thin but not ``{0}``:
    every row's first entry is ``width`` times a positive number, so ``e_1`` is in the cone."""
    gen = torch.Generator().manual_seed(seed)
    first = width * (torch.rand(m, 1, generator=gen, dtype=torch.float64) + 0.1)
    return torch.cat([first, torch.randn(m, n - 1, generator=gen, dtype=torch.float64)], 1)


def _update_from_jacobian(u: Tensor, j: Tensor) -> Tensor:
    """The projection ``J^T v`` of the exact problem, from scipy's NNLS on ``J`` itself (not on
    a factor of the rounded ``G``, whose noise directions weigh ``sqrt(eps) |v|``)."""
    np = pytest.importorskip("numpy")
    nnls = pytest.importorskip("scipy.optimize").nnls
    jn = j.numpy()
    rows = [jn.T @ (row + nnls(jn.T, -jn.T @ row, maxiter=200 * len(row))[0]) for row in u.numpy()]
    return torch.tensor(np.array(rows))


@pytest.mark.parametrize(("m", "width", "seed"), [(64, 1e-5, 3), (64, 3e-6, 0), (64, 3e-6, 7)])
def test_thin_dual_cone_is_not_taken_for_zero(m: int, width: float, seed: int) -> None:
    """A singular Gramian whose cone is thin, not ``{0}``: ``y^T G y`` passes the screen of the
    test of a cone ``{0}``, and its weights (10-30) had a KKT residual below ``tol`` relative to
    ``|v|`` while the update was 5e-5 to 1e-4 of ``|J^T u|`` off the projection (the shortcut's
    certificate is now in units of ``u``)."""
    j = _thin_cone_jacobian(m, m // 3, width, seed)
    u = torch.eye(m, dtype=torch.float64)
    v = project_weights(u, j @ j.T)
    error = (v @ j - _update_from_jacobian(u, j)).norm(dim=-1) / (u @ j).norm(dim=-1)
    assert float(error.amax()) <= 2e-5


def test_trivial_dual_cone_keeps_the_problems_solved_at_u() -> None:
    """A batch of a Gramian of dual cone ``{0}`` and a Gramian 0: the shortcut serves the batch,
    and the problems of ``G = 0`` keep ``v = u`` (as stated, and as alone), not ``max(u) 1``."""
    m = 20
    j = zero_cone_jacobian(m, 7, "plain", seed=0)
    gramians = torch.stack([j @ j.T, torch.zeros(m, m, dtype=torch.float64)])
    u = torch.eye(m, dtype=torch.float64).expand(2, m, m) / m
    v = project_weights(u, gramians)
    assert bool((v[1] == u[1]).all())
    assert_kkt(v[0], u[0], gramians[0], rtol=1e-9)
