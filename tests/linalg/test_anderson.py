"""Anderson acceleration: exact on linear maps, its safeguard, its bookkeeping, and ADMM with it
solving what ADMM without it solves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jacflow.linalg import _first_order as first_order
from jacflow.linalg._anderson import anderson_start, anderson_step, anderson_take
from jacflow.linalg._dual_cone import _normalized, project_diagonal, project_weights_reference
from tests.conftest import DEVICES
from tests.linalg.test_dual_cone import assert_kkt, make_gramian, upgrad_rows


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 6), st.integers(0, 2**31 - 1))
def test_on_an_affine_contraction_the_fixed_point_comes_within_n_plus_one_steps(
    n: int, seed: int
) -> None:
    """On ``F(t) = t A + b`` with a full history, type-II Anderson is GMRES on ``t (I - A) = b``
    (Walker & Ni 2011): after ``n + 1`` steps the iterate is the fixed point, where the plain
    iteration is still far (spectral radius 0.95)."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    a = q @ torch.diag(torch.linspace(-0.95, 0.95, n, dtype=torch.float64)) @ q.T
    b = torch.randn(1, 3, n, generator=gen, dtype=torch.float64)
    fixed = torch.linalg.solve((torch.eye(n, dtype=torch.float64) - a).T, b[0].T).T[None]
    t = torch.zeros_like(b)
    state = anderson_start(t, memory=n)
    for _ in range(n + 2):
        t = anderson_step(state, t, t @ a + b, reg=0.0)
    torch.testing.assert_close(t, fixed, rtol=1e-7, atol=1e-9)
    plain = torch.zeros_like(b)
    for _ in range(n + 2):
        plain = plain @ a + b
    assert float((plain - fixed).abs().max()) > 1e-3 * float(fixed.abs().max())


def test_a_problem_whose_residual_blows_up_forgets_its_history_alone(on_device: str) -> None:
    """The safeguard: a residual 1e3 times the problem's best clears that problem's history
    (its step is then the plain ``F(t)``); the other problems keep theirs (on an accelerator
    too, where the step does not read on the host whether any problem blew up)."""
    a = torch.tensor([[0.5, 0.2], [0.1, 0.3]], dtype=torch.float64)
    t = torch.ones(1, 2, 2, dtype=torch.float64)
    state = anderson_start(t, memory=3)
    for _ in range(3):
        t = anderson_step(state, t, t @ a + 1.0, reg=0.0)
    assert bool((state.gram[0, 0] != 0).any()) and bool((state.gram[0, 1] != 0).any())
    mapped = t @ a + 1.0
    mapped[0, 0] += 1e6  # problem 0's map jumps far away
    step = anderson_step(state, t, mapped, reg=0.0)
    assert bool((state.gram[0, 0] == 0).all()) and bool((state.residual_diffs[0, 0] == 0).all())
    assert bool((state.gram[0, 1] != 0).any())
    torch.testing.assert_close(step[0, 0], mapped[0, 0])


def test_take_keeps_the_histories_of_the_problems_kept() -> None:
    t = torch.randn(1, 4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    state = anderson_start(t, memory=2)
    for _ in range(3):
        t = anderson_step(state, t, 0.5 * t + 1.0, reg=1e-10)
    index = torch.tensor([3, 1])
    taken = anderson_take(state, index)
    torch.testing.assert_close(taken.gram, state.gram[:, index])
    torch.testing.assert_close(taken.step_diffs, state.step_diffs[:, index])
    assert taken.last is not None and state.last is not None
    torch.testing.assert_close(taken.last[1], state.last[1][:, index])
    assert taken.slot == state.slot


def test_memory_stays_within_its_budget() -> None:
    assert first_order.anderson_memory(512, 512) == 5
    assert first_order.anderson_memory(2048, 2048) == 2  # 2 columns fit in 2^24 elements
    assert first_order.anderson_memory(4096, 4096) == 0  # fewer than 2: none
    assert first_order.anderson_memory(128, 128) == 0  # (its overhead outweighs its gain)


@settings(max_examples=15, deadline=None)
@given(
    st.integers(33, 96),
    st.sampled_from(["gauss", "more_rows", "rank_deficient", "conflicting"]),
    st.integers(0, 2**31 - 1),
    st.booleans(),
    st.sampled_from(DEVICES),
)
def test_admm_with_acceleration_solves_what_admm_without_it_solves(
    m: int, kind: str, seed: int, low_precision: bool, device: str
) -> None:
    """Where plain ADMM reaches the tolerance, the accelerated one does too (it also solved
    degenerate problems on which plain ADMM stalls near 5e-5 and leaves them to the exact
    fallback), with the reference solver's updates (compared through ``G``: the weights of a
    singular ``G`` are not unique, ``J^T v`` is; to 1e-6 of ``|J^T u|``, what a residual of
    1e-10 allows where the projection is 0) and its KKT conditions."""
    g = _normalized(make_gramian(m, kind, 1.0, seed)[None], 0.0, 0.0, one_sync=True)
    u = upgrad_rows(m)[None] * m
    expected = project_weights_reference(u[0], g[0])
    solved = {}
    for anderson in (True, False):
        with pytest.MonkeyPatch.context() as patch:  # (from 33 objectives: faster examples)
            patch.setattr(first_order, "_ANDERSON_MIN_M", 0)
            v, residual = first_order.admm_solve(
                u.to(device),
                g.to(device),
                20_000,
                1e-10,
                low_precision=low_precision,
                anderson=anderson,
            )
        solved[anderson] = float(residual.amax()) <= 1e-10
        if solved[anderson]:
            v = v.cpu()
            gap = v[0] - expected
            assert float(torch.einsum("ki,ij,kj->k", gap, g[0], gap).amax()) <= 1e-12
            assert_kkt(v[0], u[0], g[0])
    assert solved[True] or not solved[False]


@pytest.mark.parametrize(("m", "seed"), [(96, 3), (128, 4)])
def test_acceleration_takes_fewer_products(
    m: int, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What it is for: fewer ADMM steps (counted as products with the operator) to the same
    tolerance where plain ADMM is slow (degenerate problems: 7,240 and 2,480 steps against 440
    and 300), and the same steps where it is fast (it starts only once the residual falls
    slowly: the Gramian of rows around two opposite directions takes 250 and 230 either way)."""
    g = _normalized(make_gramian(m, "more_rows", 1.0, seed=seed)[None], 0.0, 0.0, one_sync=True)
    u = upgrad_rows(m)[None] * m
    monkeypatch.setattr(first_order, "_ANDERSON_MIN_M", 0)  # (from 96: faster)
    products: list[bool] = []
    baddbmm = torch.baddbmm

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        products.append(anderson)
        return baddbmm(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "baddbmm", counted)
    for anderson in (True, False):
        first_order.admm_solve(u, g, 20_000, 1e-10, anderson=anderson)
    monkeypatch.setattr(torch, "baddbmm", baddbmm)
    counts = {flag: products.count(flag) for flag in (True, False)}
    assert 2 * counts[True] < counts[False], counts
    fast = _normalized(make_gramian(m, "conflicting", 1.0, seed=seed)[None], 0.0, 0.0, True)
    steps = []
    for anderson in (True, False):
        v, _ = first_order.admm_solve(u, fast, 20_000, 1e-10, anderson=anderson)
        steps.append(v)
    torch.testing.assert_close(steps[0], steps[1], rtol=0, atol=0)  # (the same iterates)


def test_upgrads_default_route_accelerates_slow_problems_from_192_objectives(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """``project_diagonal``'s "auto" route (ADMM above 32 objectives) starts the acceleration
    on a degenerate Gramian of 192 objectives, and its weights satisfy the KKT conditions."""
    started: list[int] = []
    start = first_order.anderson_start

    def recorded(t: torch.Tensor, memory: int) -> object:
        started.append(memory)
        return start(t, memory)

    monkeypatch.setattr(first_order, "anderson_start", recorded)
    m = 192
    gramian = make_gramian(m, "more_rows", 1.0, seed=3)
    pref = torch.full((m,), 1.0 / m, dtype=torch.float64)
    v = project_diagonal(pref.to(device), gramian.to(device)).cpu()
    assert started and started[0] == first_order._ANDERSON_MEMORY
    assert_kkt(v, torch.eye(m, dtype=torch.float64) / m, gramian)


def test_acceleration_stops_where_it_does_not_halve_the_residual(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The safeguard: on rows nearly parallel to one direction (a third of them opposite),
    plain ADMM stalls and the accelerated one with it; the acceleration runs its 5 checks (50
    steps), fails to halve the worst residual, and stops for good: the same products and the
    same residual as without it, not up to twice the time."""
    monkeypatch.setattr(first_order, "_ANDERSON_MIN_M", 0)
    m = 96
    gen = torch.Generator().manual_seed(m)
    j = torch.randn(1, 80, generator=gen, dtype=torch.float64)
    j = j + 1e-3 * torch.randn(m, 80, generator=gen, dtype=torch.float64)
    j[: m // 3] *= -0.5
    g = _normalized((j @ j.T)[None], 0.0, 0.0, one_sync=True)
    u = upgrad_rows(m)[None] * m
    products: list[bool] = []
    steps: list[int] = []
    baddbmm, step = torch.baddbmm, first_order.anderson_step

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        products.append(anderson)
        return baddbmm(*args, **kwargs)  # type: ignore[arg-type]

    def counted_step(*args: object, **kwargs: object) -> torch.Tensor:
        steps.append(1)
        return step(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "baddbmm", counted)
    monkeypatch.setattr(first_order, "anderson_step", counted_step)
    residuals = []
    for anderson in (True, False):
        _, residual = first_order.admm_solve(u, g, 20_000, 1e-10, anderson=anderson)
        residuals.append(float(residual.amax()))
    monkeypatch.setattr(torch, "baddbmm", baddbmm)
    assert len(steps) == 10 * first_order._SLOW_CHECKS
    assert products.count(True) == products.count(False)
    assert residuals[0] <= residuals[1] * 1.01
