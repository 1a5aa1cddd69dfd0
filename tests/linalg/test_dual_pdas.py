"""PDAS on the inverse Gramian: the primal PDAS iterates from systems of the size of the active
set, every result checked against the true Gramian."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from jacflow.linalg import _dual_pdas as dual_pdas
from jacflow.linalg import project_weights
from jacflow.linalg._dual_cone import project_weights_reference
from jacflow.linalg._dual_pdas import (
    _step,
    active_systems_pay,
    distinct_rows,
    dual_pdas_solve,
    lean_dual_pdas_solve,
    safe_inverse,
)
from jacflow.linalg._pdas import (
    _solve_free,
    kkt_residual,
    multiplier_scale,
    pad_identity,
    pdas_solve,
)
from tests.linalg.test_dual_cone import (
    assert_kkt,
    assert_lean_certificate,
    make_gramian,
    problems,
    upgrad_rows,
)
from tests.linalg.test_lawson_hanson import normalised


def per_sample_gramian(m: int, seed: int) -> Tensor:
    """The Gramian of the per-sample gradients of a small classifier's cross-entropy (from
    ``torch.func``): strongly conflicting rows, so that UPGrad's projections leave most weights
    free and only a few constraints active."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 5)).double()
    params = {k: p.detach() for k, p in model.named_parameters()}
    x, y = torch.randn(m, 10, dtype=torch.float64), torch.randint(0, 5, (m,))

    def loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    j = torch.cat([g.reshape(m, -1) for g in grads.values()], dim=1)
    return j @ j.T


def start_at_u(u: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    lam, c = 2 * torch.bmm(u, g), multiplier_scale(g)
    return lam > 0, kkt_residual(u, u, lam, c), c


@settings(max_examples=40)
@given(
    m=st.integers(2, 70),
    seed=st.integers(0, 2**31 - 1),
    fraction=st.floats(0.0, 1.0),
)
def test_a_dual_step_is_the_primal_iterate(m: int, seed: int, fraction: float) -> None:
    """For any active set, ``v = H mu`` with ``H_AA mu_A = u_A`` is the primal PDAS iterate
    (``v_A = u_A``, ``G_FF v_F = -G_FA u_A``), and ``mu = G v`` on the active set, 0 off it."""
    u, g = normalised(upgrad_rows(m), make_gramian(m, "psd", 1.0, seed))
    gen = torch.Generator().manual_seed(seed)
    active = torch.rand(1, m, m, generator=gen) < fraction
    inverse = safe_inverse(g)
    assert inverse is not None
    step = _step(u, inverse, pad_identity(inverse), active, int(active.sum(-1).amax()))
    assert step is not None
    v, mu = step
    torch.testing.assert_close(v, _solve_free(u, g, active), rtol=0, atol=1e-9)
    expected_mu = torch.where(active, torch.bmm(v, g), 0.0)
    torch.testing.assert_close(mu, expected_mu, rtol=0, atol=1e-9)


@settings(max_examples=30)
@given(m=st.integers(2, 90), seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["ps", "psd"]))
def test_solves_what_primal_pdas_solves(m: int, seed: int, kind: str) -> None:
    """The problems the dual route reports solved are solved (KKT with the true ``G``), with the
    ``v`` of primal PDAS; its reported residuals are the true ones."""
    gramian = per_sample_gramian(m, seed) if kind == "ps" else make_gramian(m, "psd", 1.0, seed)
    u, g = normalised(upgrad_rows(m), gramian)
    inverse = safe_inverse(g)
    assert inverse is not None
    start = start_at_u(u, g)
    v, residual, _ = dual_pdas_solve(u, g, inverse, start, 50, 1e-12)
    torch.testing.assert_close(
        residual, kkt_residual(v, u, 2 * torch.bmm(v, g), start[2]), rtol=0, atol=1e-15
    )
    plain, plain_residual = pdas_solve(u, g, u, 50, 1e-12)
    solved = (residual <= 1e-10) & (plain_residual <= 1e-10)
    torch.testing.assert_close(v[solved], plain[solved], rtol=0, atol=1e-9)
    for row in solved[0].nonzero().flatten().tolist():
        assert_kkt(v[0, row], u[0, row], g[0], rtol=1e-9)


@settings(max_examples=15)
@given(m=st.integers(2, 70), seed=st.integers(0, 2**31 - 1), scale=st.integers(-6, 6))
def test_project_weights_on_per_sample_gramians(m: int, seed: int, scale: int) -> None:
    """The automatic route (PDAS on the inverse, then the chosen method on what it leaves) is
    exact."""
    gramian = 10.0**scale * per_sample_gramian(m, seed)
    u = upgrad_rows(m)
    v = project_weights(u, gramian)
    assert_kkt(v, u, gramian, rtol=1e-9)
    torch.testing.assert_close(v, project_weights_reference(u, gramian), rtol=0, atol=1e-8)


@pytest.mark.parametrize("m", [40, 60, 64])
def test_per_sample_problems_are_solved_by_the_dual_route_alone(m: int) -> None:
    """Strongly conflicting rows (few active constraints): the route alone solves every problem
    here (PDAS can cycle on rare problems, which the caller's method then takes over)."""
    u, g = normalised(upgrad_rows(m), per_sample_gramian(m, 0))
    inverse = safe_inverse(g)
    assert inverse is not None
    start = start_at_u(u, g)
    assert active_systems_pay(start[0].sum(-1), m)
    v, residual, _ = dual_pdas_solve(u, g, inverse, start, 8, 1e-12)
    assert bool((residual <= 1e-10).all()), float(residual.amax())
    assert_kkt(v[0], u[0], g[0], rtol=1e-9)


def test_inaccurate_inverse_is_caught_by_the_true_residual() -> None:
    """A perturbed inverse gives wrong iterates; they are reported with their true residual
    (above the tolerance), never as solved."""
    m = 60
    u, g = normalised(upgrad_rows(m), per_sample_gramian(m, 2))
    inverse = safe_inverse(g)
    assert inverse is not None
    noise = torch.randn(m, m, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rough = inverse + 1e-5 * inverse.abs().max() * (noise + noise.T)
    start = start_at_u(u, g)
    v, residual, _ = dual_pdas_solve(u, g, rough, start, 50, 1e-12)
    true = kkt_residual(v, u, 2 * torch.bmm(v, g), start[2])
    torch.testing.assert_close(residual, true, rtol=0, atol=1e-15)
    assert bool((residual > 1e-10).any())  # the noise is far above the tolerance
    exact, _, _ = dual_pdas_solve(u, g, inverse, start, 50, 1e-12)
    solved = residual <= 1e-10
    torch.testing.assert_close(v[solved], exact[solved], rtol=0, atol=1e-9)


def test_large_active_sets_are_left_to_other_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    """The route is taken only when the first guess's active systems are smaller than the free
    ones; its steps stop (nothing solved) once they cost more than the bound."""
    m = 12
    assert active_systems_pay(torch.tensor([[4, 6, 7]]), m)  # 7 < 12 - 4
    assert not active_systems_pay(torch.tensor([[4, 6, 7, 8]]), m)  # 8 >= 12 - 4
    assert not active_systems_pay(torch.full((1, 200), 60), 300)  # 200 * 60^3 > 3e7
    u, g = normalised(upgrad_rows(m), per_sample_gramian(m, 0))
    start = start_at_u(u, g)
    inverse = safe_inverse(g)
    assert inverse is not None
    monkeypatch.setattr(dual_pdas, "_MAX_STEP_FLOP", 0)
    v, left, _ = dual_pdas_solve(u, g, inverse, start, 8, 1e-12)
    residual = start[1]
    assert v is u and left is residual


def test_a_non_positive_definite_system_stops_the_steps() -> None:
    u = upgrad_rows(4)[None]
    indefinite = torch.diag(torch.tensor([1.0, -1.0, 1.0, 1.0], dtype=torch.float64))[None]
    active = torch.ones(1, 4, 4, dtype=torch.bool)
    assert _step(u, indefinite, pad_identity(indefinite), active, 4) is None


def test_inverse_only_for_safely_positive_definite_gramians() -> None:
    singular = normalised(upgrad_rows(8), make_gramian(8, "more_rows", 1.0, 0))[1]
    assert safe_inverse(singular) is None
    regular = normalised(upgrad_rows(8), make_gramian(8, "psd", 1.0, 0))[1]
    inverse = safe_inverse(regular)
    assert inverse is not None
    torch.testing.assert_close(inverse @ regular, torch.eye(8, dtype=torch.float64)[None])


@settings(max_examples=40)
@given(
    m=st.integers(1, 40),
    patterns=st.integers(1, 8),
    problems=st.integers(1, 80),
    batch=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_distinct_rows_group_equal_rows(
    m: int, patterns: int, problems: int, batch: int, seed: int
) -> None:
    """Rows drawn from a few patterns: each row's representative is an equal row of the same
    Gramian, one per distinct (row, Gramian); ``None`` only when more than 3/4 are distinct.
    The default device plays no part (``meta``: nothing can be computed there)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.rand(patterns, m, generator=gen) < 0.5
    mask = pool[torch.randint(0, patterns, (problems,), generator=gen)]
    which = torch.randint(0, batch, (problems,), generator=gen) if batch > 1 else None
    labelled = mask if which is None else torch.cat([mask, which[:, None] == torch.arange(3)], 1)
    distinct = torch.unique(labelled, dim=0).shape[0]
    dual_pdas._hash_weights.cache_clear()  # (made once per size and device)
    with torch.device("meta"):
        shared = distinct_rows(mask, which)
    if shared is None:
        assert distinct > 0.75 * problems
        return
    first, owner = shared
    assert first.numel() == distinct  # no collision of keys in these draws
    torch.testing.assert_close(mask[first][owner], mask, rtol=0, atol=0)
    if which is not None:
        torch.testing.assert_close(which[first][owner], which, rtol=0, atol=0)


@settings(max_examples=25)
@given(
    m=st.integers(2, 50),
    patterns=st.integers(1, 4),
    batch=st.integers(1, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_shared_factorisations_give_the_same_step(
    m: int, patterns: int, batch: int, seed: int
) -> None:
    """Problems with repeated active sets (shared factorisations) get the iterate each would get
    alone."""
    gen = torch.Generator().manual_seed(seed)
    gs, inverses = [], []
    for b in range(batch):
        u, g = normalised(upgrad_rows(m), make_gramian(m, "psd", 1.0, seed + b))
        inverse = safe_inverse(g)
        assert inverse is not None
        gs.append(g)
        inverses.append(inverse)
    u = u.expand(batch, m, m)
    inverse = torch.cat(inverses)
    pool = torch.rand(patterns, m, generator=gen) < 0.4
    active = pool[torch.randint(0, patterns, (batch, m), generator=gen)]
    size = int(active.sum(-1).amax())
    padded = pad_identity(inverse)
    which = torch.arange(batch).repeat_interleave(m) if batch > 1 else None
    if m >= 6:  # at most 4 sets per Gramian: at most 3/4 of the problems are distinct
        assert distinct_rows(active.reshape(-1, m), which) is not None
    alone = _step(u, inverse, padded, active, size)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dual_pdas, "_MIN_SHARED", 0)  # share even among few problems
        shared = _step(u, inverse, padded, active, size, share=True)
    assert alone is not None and shared is not None
    torch.testing.assert_close(shared, alone, rtol=0, atol=1e-12)


def _grouped_and_padded(m: int, seed: int, kind: str, cost: float) -> int:
    """Dual PDAS with the active systems in groups of similar size (forced from any size at
    the cost ``cost`` per extra group) against one padded batch: the same iterates, and
    KKT-certified solutions. Returns how many steps were split into groups."""
    gramian = per_sample_gramian(m, seed) if kind == "ps" else make_gramian(m, "psd", 1.0, seed)
    u, g = normalised(upgrad_rows(m), gramian)
    inverse = safe_inverse(g)
    assert inverse is not None
    start = start_at_u(u, g)
    split = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dual_pdas, "_GROUP_MIN_SIZE", 10**9)
        padded, padded_residual, _ = dual_pdas_solve(u, g, inverse, start, 50, 1e-12)
        original = dual_pdas.size_groups
        patch.setattr(dual_pdas, "_GROUP_MIN_SIZE", 1)
        patch.setattr(dual_pdas, "_GROUP_COST", cost)
        patch.setattr(dual_pdas, "size_groups", lambda *a: split.append(original(*a)) or split[-1])
        v, residual, _ = dual_pdas_solve(u, g, inverse, start, 50, 1e-12)
    torch.testing.assert_close(v, padded, rtol=0, atol=1e-12)
    torch.testing.assert_close(residual, padded_residual, rtol=0, atol=1e-14)
    for row in (residual[0] <= 1e-10).nonzero().flatten().tolist():
        assert_kkt(v[0, row], u[0, row], g[0], rtol=1e-9)
    return sum(groups is not None for groups in split)


@settings(max_examples=30)
@given(
    m=st.integers(2, 90),
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(["ps", "psd"]),
    cost=st.sampled_from([0.0, 1e3, 1e5]),
)
def test_steps_by_size_groups_are_the_padded_steps(
    m: int, seed: int, kind: str, cost: float
) -> None:
    _grouped_and_padded(m, seed, kind, cost)


@pytest.mark.parametrize("m", [40, 64])
def test_steps_split_into_size_groups(m: int) -> None:
    assert _grouped_and_padded(m, 0, "ps", 0.0) > 0


def test_size_groups_cover_every_problem_once() -> None:
    counts = torch.tensor([3, 40, 41, 7, 39, 2, 60, 5] * 16)
    groups = dual_pdas.size_groups(counts, 60)
    assert groups is not None
    rows = torch.cat([r for r, _ in groups])
    assert sorted(rows.tolist()) == list(range(counts.numel()))
    for r, size in groups:
        assert int(counts[r].max()) == size


@settings(max_examples=60)
@given(problem=problems(max_m=60, min_m=2))
@example(problem=(upgrad_rows(40), per_sample_gramian(40, 1)))
def test_lean_dual_certifies_what_it_returns(problem: tuple[Tensor, Tensor]) -> None:
    """The lean dual PDAS (numpy) returns either nothing or the exact projection: every problem
    kind and scale (singular Gramians and large active sets are handed over), against the
    reference active set's update."""
    assert_lean_certificate(lean_dual_pdas_solve, problem)


@pytest.mark.parametrize("m", [25, 40, 64])
def test_lean_dual_takes_the_batched_steps(m: int) -> None:
    """On per-sample Gramians it solves every problem, with the iterates of the torch steps
    (:func:`dual_pdas_solve` in float64) up to rounding."""
    for seed in range(3):
        u, g = normalised(upgrad_rows(m), per_sample_gramian(m, seed))
        rows = u[0] * m  # (max-norm 1)
        v = lean_dual_pdas_solve(rows, g[0], 1e-12)
        assert v is not None, f"seed {seed}"
        inverse = safe_inverse(g)
        assert inverse is not None
        steps, residual, _ = dual_pdas_solve(
            rows[None], g, inverse, start_at_u(rows[None], g), 8, 1e-12
        )
        assert bool((residual <= 1e-12).all())
        torch.testing.assert_close(v, torch.maximum(steps[0], rows), rtol=0, atol=1e-12)


def test_lean_dual_hands_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """No certificate, hence ``None``: large active sets at the first guess, a singular
    Gramian (a duplicated sample), steps that would cost too much, or a last iterate that
    misses the tolerance (an indefinite Gramian: see the docstring's example)."""
    m = 40
    u, g = normalised(upgrad_rows(m), per_sample_gramian(m, 0))
    rows, g = u[0] * m, g[0]
    assert lean_dual_pdas_solve(rows, g, 1e-12) is not None
    camps = normalised(upgrad_rows(m), make_gramian(m, "conflicting", 1.0, 0))[1][0]
    assert lean_dual_pdas_solve(rows, camps, 1e-12) is None
    singular = g.clone()
    singular[1], singular[:, 1] = singular[0], singular[:, 0]
    assert lean_dual_pdas_solve(rows, singular, 1e-12) is None
    with monkeypatch.context() as patch:
        patch.setattr(dual_pdas, "_MAX_STEP_FLOP", 0)
        assert lean_dual_pdas_solve(rows, g, 1e-12) is None
    with monkeypatch.context() as patch:
        patch.setattr(dual_pdas, "_LEAN_MAX_ITER", 1)  # (the first guess is not the answer here)
        assert lean_dual_pdas_solve(rows, g, 1e-12) is None
    empty = lean_dual_pdas_solve(rows[:0], g, 1e-12)
    assert empty is not None and empty.shape == (0, m)


@pytest.mark.parametrize("seed", [0, 2, 3, 6])
def test_lean_dual_certifies_its_last_iterate(seed: int) -> None:
    """Gramians with exact zeros (sparse ternary Jacobians): rounding on the ties keeps
    flipping an active set of answers that are already right, up to the last step; that
    iterate is certified and returned (it was handed over, costing the batched route's time
    again), and it is the exact projection. A Gramian that requires grad is read as it is."""
    gen = torch.Generator().manual_seed(seed)
    m, n = 25 + seed % 8, 33 + seed
    j = torch.randint(-1, 2, (m, n), generator=gen).double()
    j = j * (torch.rand(m, n, generator=gen) < 0.15)
    j[j.abs().sum(1) == 0, 0] = 1.0
    g = j @ j.T / (j @ j.T).trace()
    rows = torch.eye(m, dtype=torch.float64)
    v = lean_dual_pdas_solve(rows, g.requires_grad_(), 1e-10)
    assert v is not None
    g = g.detach()
    assert_kkt(v, rows, g, rtol=1e-9)
    ref = project_weights_reference(rows, g)
    torch.testing.assert_close(v @ g, ref @ g, rtol=0, atol=1e-9)
