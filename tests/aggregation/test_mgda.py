"""MGDA / MGDAWeighting: KKT optimality, a generic-solver reference, normalization modes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

from jacflow.aggregation import MGDA, LossAware, MGDAWeighting
from jacflow.aggregation._mgda import _bordered_solution
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    check_device_and_dtype,
    check_nonfinite_gramian_gives_nan,
    jacobians,
    make_jacobian,
)

J_DOC = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])


def min_norm_reference(gramian: np.ndarray) -> np.ndarray:
    """min x^T G x on the simplex by scipy's SLSQP (an independent generic solver)."""
    m = gramian.shape[0]
    result = minimize(
        lambda x: x @ gramian @ x,
        np.full(m, 1.0 / m),
        jac=lambda x: 2 * gramian @ x,
        bounds=[(0.0, 1.0)] * m,
        constraints=[{"type": "eq", "fun": lambda x: x.sum() - 1.0}],
        method="SLSQP",
        options={"ftol": 1e-15, "maxiter": 1000},
    )
    return np.asarray(result.x)


def test_claimed_properties() -> None:
    check_claimed_properties(MGDA)


def test_claimed_properties_l2() -> None:
    # The "l2" update combines unit rows: its size does not follow the scale of J, so float32
    # rounding (~1e-7) exceeds the checks' tolerances (relative to J's largest entry) for rows
    # smaller than ~1e-4, which the scale 1e-3 also draws (a rank-1 J of entries up to 6e-5,
    # whose update is 0 up to that rounding, in an explore run).
    strategy = jacobians(max_m=12, scales=(1.0, 1e3, 1e6))
    check_claimed_properties(lambda: MGDA(normalization="l2"), strategy)


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(MGDA)
    check_degenerate_inputs(lambda: MGDA(normalization="l2"))


@settings(max_examples=25)
@given(st.integers(1, 8), st.integers(1, 10), st.integers(0, 8), st.integers(0, 2**31 - 1))
def test_kkt_on_the_simplex(m: int, n: int, rank: int, seed: int) -> None:
    """lambda in the simplex, (G lambda)_i >= lambda^T G lambda for all i, = on the support."""
    J = make_jacobian(m, n, rank, 1.0, torch.float64, seed)
    G = J @ J.T
    lam = MGDAWeighting(epsilon=1e-10, max_iters=200)(G)
    assert bool((lam >= 0).all())
    assert abs(float(lam.sum()) - 1.0) < 1e-12
    g_lam = G @ lam
    value = float(lam @ g_lam)
    tol = 2e-3 * float(G.diagonal().max()) + 1e-12
    assert bool((g_lam >= value - tol).all())  # stationarity + dual feasibility
    assert float((lam * (g_lam - value)).abs().sum()) < tol  # complementary slackness


@settings(max_examples=20)
@given(st.integers(2, 6), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_objective_matches_a_generic_solver(m: int, n: int, seed: int) -> None:
    J = make_jacobian(m, n, min(m, n), 1.0, torch.float64, seed)
    G = J @ J.T
    ours = MGDAWeighting(epsilon=1e-9, max_iters=200)(G)
    reference = torch.from_numpy(min_norm_reference(G.numpy()))
    scale = float(G.diagonal().max())
    assert float(ours @ G @ ours) <= float(reference @ G @ reference) + 1e-4 * scale
    # The min-norm point itself is unique.
    torch.testing.assert_close(ours @ J, reference @ J, atol=1e-2 * scale**0.5, rtol=0)


@settings(max_examples=30)
@given(st.integers(1, 12), st.integers(0, 12), st.integers(0, 2**31 - 1), st.booleans())
def test_bordered_solution_is_the_pseudo_inverses(k: int, rank: int, seed: int, dup: bool) -> None:
    """The KKT systems of the refinement, of float64 Gramians of any rank (duplicated rows
    too): the LU route, where taken, gives pinv's solution; elsewhere pinv's is returned. (In
    float32 the two agree to the rounding of the system, which its conditioning scales.)"""
    rows = make_jacobian(k, 12, min(rank, k), 1.0, torch.float64, seed)
    if dup and k > 1:
        rows[1] = rows[0]
    norms = rows.norm(dim=1).clamp(min=1e-300)
    unit = (rows / norms[:, None]) @ (rows / norms[:, None]).T
    kkt = torch.zeros(k + 1, k + 1, dtype=torch.float64)
    kkt[:k, :k], kkt[:k, k], kkt[k, :k] = unit, 1.0, 1.0
    rhs = torch.zeros(k + 1, dtype=torch.float64)
    rhs[k] = 1.0
    expected = torch.linalg.pinv(kkt, hermitian=True) @ rhs
    torch.testing.assert_close(_bordered_solution(kkt, rhs), expected, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize(("m", "rank"), [(120, 120), (120, 60), (60, 200)])
def test_kkt_with_many_objectives(m: int, rank: int) -> None:
    """Large supports, where the refinement's systems are solved by LU (full rank) or by the
    pseudo-inverse (rank m/2): lambda satisfies the KKT conditions on the simplex."""
    J = make_jacobian(m, max(rank, m), min(rank, m), 1.0, torch.float64, 3)
    G = J @ J.T
    lam = MGDA().weights(J)
    g_lam = G @ lam
    value = float(lam @ g_lam)
    tol = 1e-9 * float(G.diagonal().max())
    assert bool((lam >= 0).all()) and abs(float(lam.sum()) - 1.0) < 1e-12
    assert bool((g_lam >= value - tol).all())
    assert float((lam * (g_lam - value)).abs().max()) < tol


def test_documented_values() -> None:
    torch.testing.assert_close(MGDA()(J_DOC), torch.tensor([0.0, 1.0, 1.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(MGDAWeighting()(J_DOC @ J_DOC.T), torch.tensor([0.6, 0.4]))


@pytest.mark.parametrize("mode", ["l2", "loss", "loss+"])
def test_normalization_modes_match_their_definition(mode: str) -> None:
    """G' = D G D solved by SLSQP, then w = lambda / c."""
    J = make_jacobian(4, 6, 4, 1.0, torch.float64, 11) * torch.tensor([[1.0], [5.0], [0.2], [3]])
    G = J @ J.T
    losses = torch.tensor([0.5, 2.0, 1.0, 4.0], dtype=torch.float64)
    norms = G.diagonal().sqrt()
    c = {"l2": norms, "loss": losses, "loss+": losses * norms}[mode]
    lam = torch.from_numpy(min_norm_reference((G / c[:, None] / c[None, :]).numpy()))
    expected = lam / c
    weighting = MGDAWeighting(epsilon=1e-10, max_iters=200, normalization=mode)  # type: ignore[arg-type]
    weighting.set_losses(losses)
    torch.testing.assert_close(weighting(G), expected, atol=2e-3, rtol=0)
    agg = MGDA(epsilon=1e-10, max_iters=200, normalization=mode)  # type: ignore[arg-type]
    assert isinstance(agg, LossAware)
    agg.set_losses(losses)
    torch.testing.assert_close(agg(J), weighting(G) @ J)


def test_l2_mode_is_invariant_to_row_scales() -> None:
    J = torch.randn(5, 8, dtype=torch.float64)
    scaled = torch.tensor([[1e-3], [1.0], [10.0], [2.0], [1e3]], dtype=torch.float64) * J
    torch.testing.assert_close(MGDA(normalization="l2")(J), MGDA(normalization="l2")(scaled))


def test_loss_modes_need_losses() -> None:
    with pytest.raises(ValueError, match="set_losses"):
        MGDA(normalization="loss")(J_DOC)
    agg = MGDA(normalization="loss+")
    agg.set_losses(torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="one loss per row"):
        agg(J_DOC)
    agg.set_losses(torch.tensor([1.0, -2.0]))
    with pytest.raises(ValueError, match="must be positive"):
        agg(J_DOC)


def test_nan_never_hangs_and_propagates() -> None:
    G = torch.tensor([[1.0, float("nan")], [float("nan"), 2.0]])
    assert bool(MGDAWeighting(max_iters=10**9)(G).isnan().all())


def test_weighting_and_aggregator_agree() -> None:
    J = torch.randn(6, 9, dtype=torch.float64)
    torch.testing.assert_close(MGDA()(J), MGDAWeighting()(J @ J.T) @ J)


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match=r"`epsilon` must be a float in \(0.0, inf\)"):
        MGDA(epsilon=0.0)
    with pytest.raises(ValueError, match=r"`max_iters` must be an int >= 1"):
        MGDA(max_iters=0)
    with pytest.raises(ValueError, match=r"`normalization` must be one of"):
        MGDA(normalization="l1")  # type: ignore[arg-type]


def test_repr_and_str() -> None:
    assert repr(MGDA()) == "MGDA(epsilon=0.001, max_iters=100, normalization='none')"
    assert str(MGDA()) == "MGDA"


def test_device_and_dtype(device: str, dtype: torch.dtype) -> None:
    check_device_and_dtype(lambda: MGDA(), device, dtype)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gramian_gives_nan_weights(bad: float) -> None:
    check_nonfinite_gramian_gives_nan(lambda: MGDAWeighting(), bad)


@pytest.mark.parametrize("normalization", ["none", "l2"])
def test_weights_are_differentiable(normalization: str) -> None:
    """The exact weights, with the derivative of the minimiser on their support: autograd's
    directional derivative equals central differences (an interior and a boundary minimiser),
    and a zero row under "l2" gives finite gradients (no 0 * inf from its scale)."""
    cases = [
        torch.tensor([[2.0, 0.3, -0.5], [-1.0, 1.5, 0.2], [0.1, -0.8, 1.2]], dtype=torch.float64),
        torch.tensor([[1.0, 0.0, 0.2], [3.0, 0.5, 0.1], [0.2, 2.0, 0.0]], dtype=torch.float64),
    ]
    weighting = MGDAWeighting(normalization=normalization)
    for J in cases:
        direction = torch.linspace(-1.0, 1.0, J.numel(), dtype=torch.float64).reshape(J.shape)
        tracked = J.clone().requires_grad_()
        weights = weighting(tracked @ tracked.T)
        torch.testing.assert_close(weights.detach(), weighting(J @ J.T))
        cotangent = torch.tensor([0.3, -1.0, 0.7], dtype=torch.float64)
        (grad,) = torch.autograd.grad(weights @ cotangent, tracked)
        h = 1e-6
        plus, minus = J + h * direction, J - h * direction
        expected = (weighting(plus @ plus.T) - weighting(minus @ minus.T)) @ cotangent / (2 * h)
        torch.testing.assert_close((grad * direction).sum(), expected, rtol=1e-5, atol=1e-7)
    zero_row = cases[0].clone()
    zero_row[2] = 0.0
    tracked = zero_row.clone().requires_grad_()
    (grad,) = torch.autograd.grad(weighting(tracked @ tracked.T).sum(), tracked)
    assert bool(torch.isfinite(grad).all())


@pytest.mark.parametrize("normalization", ["none", "l2"])
def test_update_is_differentiable_with_the_origin_inside_the_hull(normalization: str) -> None:
    """Five rows in the plane around the origin: the update is 0 on a neighbourhood of J (its
    derivatives are 0) while the minimisers form a polytope. The least-norm solution of the
    KKT system gave the derivative of another minimiser than the weights: a non-zero
    derivative of the update. Checked with torch's gradcheck and gradgradcheck."""
    angles = torch.tensor([0.3, 1.4, 2.6, 3.9, 5.1], dtype=torch.float64)
    radii = torch.tensor([1.0, 0.7, 1.3, 0.9, 1.1], dtype=torch.float64)
    J = torch.stack([radii * angles.cos(), radii * angles.sin()], dim=1)
    aggregator = MGDA(normalization=normalization)  # type: ignore[arg-type]
    assert aggregator(J).abs().max() < 1e-12
    tracked = J.clone().requires_grad_()
    (derivative,) = torch.autograd.grad(aggregator(tracked).sum(), tracked)
    torch.testing.assert_close(derivative, torch.zeros_like(J), rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(aggregator, (tracked,), eps=1e-6, atol=1e-6)
    assert torch.autograd.gradgradcheck(aggregator, (tracked,), eps=1e-6, atol=1e-5)


def test_loss_modes_are_not_differentiable() -> None:
    """Their weights depend on the losses, which ``set_losses`` detaches: a derivative would
    hold them constant (0.615 where the truth is -0.237 on a one-loss example), so the update
    has no graph and ``create_graph=True`` refuses them."""
    import jacflow

    assert MGDA().differentiable and MGDA(normalization="l2").differentiable
    for normalization in ("loss", "loss+"):
        aggregator = MGDA(normalization=normalization)  # type: ignore[arg-type]
        assert not aggregator.differentiable
        x = torch.tensor([1.5, -0.5], dtype=torch.float64, requires_grad=True)
        losses = [1 + (x**2).sum(), x.sin().sum() + 2]
        aggregator.set_losses(torch.stack(losses).detach())
        with pytest.raises(ValueError, match="create_graph=True needs an aggregator"):
            jacflow.backward(losses, [x], A=aggregator, create_graph=True)


def min_norm_point_of_rows(J: np.ndarray) -> np.ndarray:
    """The min-norm point of the rows' convex hull by brute force over supports, each
    affine hull's min-norm point by least squares on the rows themselves (never G): a convex
    combination of the rows, so its norm bounds the minimum from above."""
    best = None
    for k in range(1, J.shape[0] + 1):
        for support in itertools.combinations(range(J.shape[0]), k):
            P = J[list(support)]
            t = np.linalg.lstsq((P[1:] - P[0]).T, -P[0], rcond=None)[0] if k > 1 else []
            lam = np.concatenate([[1 - np.sum(t)], t])
            if (lam < -1e-12).any():
                continue
            d = lam @ P
            if best is None or np.linalg.norm(d) < np.linalg.norm(best):
                best = d
    assert best is not None
    return best


def test_exact_and_non_conflicting_for_row_norms_spread_over_decades() -> None:
    """Random rows with norms in logspace(-s, s), s up to 6 (1e12 apart). The refinement's
    stopping test was relative to the largest row only: at s = 5 it stopped at points 40-3000
    times longer than the minimum, with cosines down to -0.8 with the shortest row. Points
    zero to the Gramian's rounding (Pareto stationary) are exempt."""
    rng = np.random.default_rng(0)
    worst_cosine, worst_ratio = 1.0, 1.0
    for _ in range(300):
        m, n, s = int(rng.integers(3, 6)), int(rng.integers(2, 8)), int(rng.integers(1, 7))
        J = rng.standard_normal((m, n)) * np.logspace(-s, s, m)[:, None]
        d = MGDA()(torch.tensor(J)).numpy()
        norms = np.linalg.norm(J, axis=1)
        if np.linalg.norm(d) <= 1e-14 * norms.max():
            continue
        cosines = (J @ d) / (norms * np.linalg.norm(d))
        worst_cosine = min(worst_cosine, float(cosines.min()))
        if s <= 5:  # (at 1e12 the minimum's norm, 1e-12 of the largest row's, is noise)
            ratio = np.linalg.norm(d) / np.linalg.norm(min_norm_point_of_rows(J))
            worst_ratio = max(worst_ratio, float(ratio))
    assert worst_cosine >= -1e-9
    assert worst_ratio <= 1 + 1e-3


@given(st.integers(0, 2**31 - 1), st.integers(4, 13))
def test_two_rows_of_norms_far_apart_in_any_order(seed: int, decades: int) -> None:
    """m = 2, float32 rows 1e4 to 1e13 apart: the long row's weight, below eps, was computed as
    1 - (1 - it) = 0 in one order of the rows (the update was the short row alone, up to
    50% off), and exactly in the other; each weight now has its own closed form."""
    gen = torch.Generator().manual_seed(seed)
    J = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    J[1] *= 10.0**decades
    expected = MGDA()(J)
    for perm in ([0, 1], [1, 0]):
        got = MGDA()(J[perm].float()).double()
        scale = float(expected.norm()) + 1e-6 * float(J[0].norm())
        assert float((got - expected).norm()) <= 1e-3 * scale


@given(st.integers(0, 2**31 - 1), st.integers(5, 9))
def test_two_nearly_equal_rows_give_their_common_gradient(seed: int, decades: int) -> None:
    """m = 2, float32 rows equal to 1e-5..1e-9 relative: their weights sum to 1 and the update
    is their common gradient. With each weight from its own numerator, the rounding of the
    denominator gave weights summing to 0.5 or 1.5 (15% of random draws)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(50, generator=gen, dtype=torch.float64)
    J = torch.stack([a, a + 10.0**-decades * torch.randn(50, generator=gen, dtype=torch.float64)])
    weights = MGDAWeighting()(J.float() @ J.float().T)
    assert abs(float(weights.sum()) - 1) <= 1e-6
    torch.testing.assert_close(MGDA()(J.float()).double(), J[0], rtol=1e-4, atol=1e-4)
