"""NashMTL: properties, the bargaining equation, TorchJD's value, state and reset."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import least_squares

from jacflow.aggregation import NashMTL, NashMTLWeighting
from tests.aggregation._properties import (
    check_claimed_properties,
    check_non_conflicting,
    check_permutation_invariant,
    jacobians,
    make_jacobian,
)
from tests.aggregation._seeded import seeded

J_DOC = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])


@pytest.mark.parametrize("m", [1, 3, 7])
def test_claimed_properties(m: int) -> None:
    # n_tasks fixes the number of rows, so each size gets its own strategy; the state is reset
    # before every call so that `weights(J)` and `A(J)` see the same state.
    make = seeded(lambda: NashMTL(n_tasks=m), reset=True)
    check_claimed_properties(make, jacobians(min_m=m, max_m=m))


@settings(max_examples=20)
@given(
    st.integers(1, 10),
    st.integers(0, 2**31 - 1),
    st.sampled_from([torch.float32, torch.float64]),
    st.sampled_from([1e-3, 1.0, 1e3]),
)
def test_non_conflicting_and_permutation_invariant_where_a_solution_exists(
    m: int, seed: int, dtype: torch.dtype, scale: float
) -> None:
    J = make_jacobian(m, m + 3, m, scale, dtype, seed)  # full row rank: a solution exists
    check_non_conflicting(lambda: NashMTL(n_tasks=m), J)
    check_permutation_invariant(lambda: NashMTL(n_tasks=m), J, seed)


def test_degenerate_inputs() -> None:
    """check_degenerate_inputs with n_tasks matching each input (it mixes m = 2 and m = 3)."""
    empty_rows = NashMTL(n_tasks=4)(torch.zeros(0, 5))
    assert empty_rows.shape == (5,) and bool((empty_rows == 0).all())
    assert NashMTL(n_tasks=3)(torch.zeros(3, 0)).shape == (0,)
    assert bool((NashMTL(n_tasks=3)(torch.zeros(3, 4)) == 0).all())
    nan_matrix = torch.tensor([[1.0, float("nan")], [0.5, 2.0]])
    assert not bool(torch.isfinite(NashMTL(n_tasks=2)(nan_matrix)).all())


def _normalized_gramian(J: torch.Tensor) -> torch.Tensor:
    G = J @ J.T
    return G / G.norm()


@settings(max_examples=30)
@given(st.integers(1, 10), st.integers(0, 2**31 - 1), st.sampled_from([1e-4, 1.0, 1e4]))
def test_solves_the_bargaining_equation(m: int, seed: int, scale: float) -> None:
    """G alpha = 1/alpha on the raw Gramian (the paper's equation; the official code's
    constraints alpha_i (G alpha)_i >= 1), alpha > 0, and scipy's least_squares (TorchJD's
    FairGrad solver) on the better-conditioned G / |G|_F, whose solution is
    alpha |G|_F^(1/2), agrees."""
    J = make_jacobian(m, m + 2, m, scale, torch.float64, seed)  # full row rank: a solution exists
    alpha = NashMTLWeighting(n_tasks=m, max_norm=0.0)(J @ J.T)
    assert bool((alpha > 0).all())
    torch.testing.assert_close(
        (J @ J.T) @ alpha * alpha, torch.ones(m, dtype=torch.float64), atol=1e-8, rtol=0
    )
    G = _normalized_gramian(J)
    reference = least_squares(
        lambda a: G.numpy() @ a - 1 / a,
        np.ones(m),
        bounds=(1e-12, np.inf),
        xtol=1e-15,
        ftol=1e-15,
        gtol=1e-15,
    ).x
    np.testing.assert_allclose((alpha * (J @ J.T).norm().sqrt()).numpy(), reference, rtol=1e-6)


@settings(max_examples=20)
@given(st.integers(2, 6), st.integers(0, 2**31 - 1), st.sampled_from([1e-3, 1.0, 1e3]))
def test_the_unclipped_update_has_norm_sqrt_m(m: int, seed: int, scale: float) -> None:
    """|J^T alpha|^2 = sum_i alpha_i (G alpha)_i = m at any scale, so max_norm=1 gives unit
    updates (as the official code: its update had norm sqrt(m |G|_F) here, 0.146 instead of 1
    on a Jacobian of norm 0.1)."""
    J = make_jacobian(m, m + 2, m, scale, torch.float64, seed)
    assert abs(float(NashMTL(n_tasks=m, max_norm=0.0)(J).norm()) - m**0.5) <= 1e-8 * m**0.5
    assert abs(float(NashMTL(n_tasks=m)(J).norm()) - 1.0) <= 1e-8


@pytest.mark.parametrize(
    ("dtype", "scale"),
    [
        (torch.float32, 1e-12),
        (torch.float32, 1e-15),
        (torch.float64, 1e-100),
        (torch.float64, 1e100),
    ],
)
def test_the_bargaining_equation_at_extreme_scales(dtype: torch.dtype, scale: float) -> None:
    """Finite Gramians whose Frobenius norm under- or overflows (its squares): the weights
    still solve ``alpha * (G alpha) = 1`` (G in float64), and the unclipped update has norm
    sqrt(m); they were zero."""
    J = make_jacobian(3, 50, 3, 1.0, torch.float64, seed=3)
    J = J / J.norm(dim=1, keepdim=True)
    scaled = (J * scale).to(dtype)
    alpha = NashMTL(n_tasks=3, max_norm=0.0).weights(scaled).double()
    G = scaled.double() @ scaled.double().T
    torch.testing.assert_close(
        alpha * (G @ alpha), torch.ones(3, dtype=torch.float64), rtol=0, atol=1e-5
    )
    update = NashMTL(n_tasks=3, max_norm=0.0)(scaled).double()
    assert abs(float(update.norm()) - 3**0.5) <= 1e-5


@pytest.mark.filterwarnings("ignore::UserWarning")  # (cvxpy: "not DPP")
def test_equals_torchjd_unclipped() -> None:
    """TorchJD 0.18's NashMTL (the official code's sequence of cvxpy problems) without
    clipping: the same weights to its solver's tolerance."""
    tj = pytest.importorskip("torchjd.aggregation")
    for solver in ("cvxpy", "ecos"):  # (TorchJD's extra "nash_mtl", which it imports on use)
        pytest.importorskip(solver)
    gen = torch.Generator().manual_seed(0)
    for J in (
        torch.tensor([[0.1, 0.0, 0.02], [0.0, 0.05, 0.01]], dtype=torch.float64),
        torch.randn(3, 5, generator=gen, dtype=torch.float64),
        10 * torch.randn(4, 6, generator=gen, dtype=torch.float64),
    ):
        theirs = tj.NashMTL(n_tasks=J.shape[0], max_norm=0.0)(J)
        torch.testing.assert_close(
            NashMTL(n_tasks=J.shape[0], max_norm=0.0)(J), theirs, rtol=1e-5, atol=0
        )


def test_documented_value() -> None:
    # TorchJD 0.18 solves by a capped sequence of cvxpy problems, so its weights are approximate
    # in general; on this matrix it is converged to the shown digits, and the exact solution
    # agrees with it.
    torch.testing.assert_close(
        NashMTL(n_tasks=2)(J_DOC), torch.tensor([0.0542, 0.7061, 0.7061]), atol=1e-4, rtol=0
    )


def test_max_norm_clipping() -> None:
    torch.manual_seed(0)
    J = torch.randn(4, 6, dtype=torch.float64) * 10
    free = NashMTL(n_tasks=4, max_norm=0.0)(J)
    clipped = NashMTL(n_tasks=4, max_norm=0.5)(J)
    assert float(free.norm()) > 0.5
    torch.testing.assert_close(clipped, free * (0.5 / free.norm()))
    roomy = NashMTL(n_tasks=4, max_norm=1e6)(J)
    torch.testing.assert_close(roomy, free)


def test_update_weights_every_reuses_weights_and_reset() -> None:
    torch.manual_seed(0)
    grams = [(J := torch.randn(3, 5, dtype=torch.float64)) @ J.T for _ in range(4)]
    weighting = NashMTLWeighting(n_tasks=3, max_norm=0.0, update_weights_every=3)
    outputs = [weighting(G) for G in grams]
    torch.testing.assert_close(outputs[1], outputs[0])
    torch.testing.assert_close(outputs[2], outputs[0])
    fresh = NashMTLWeighting(n_tasks=3, max_norm=0.0)
    torch.testing.assert_close(outputs[3], fresh(grams[3]))  # recomputed on the 4th call
    weighting.reset()
    torch.testing.assert_close(weighting(grams[1]), NashMTLWeighting(3, max_norm=0.0)(grams[1]))
    assert not torch.allclose(outputs[0], weighting(grams[1]))


def test_aggregator_and_weighting_agree(device: str, dtype: torch.dtype) -> None:
    J = J_DOC.to(device=device, dtype=dtype)
    weights = NashMTLWeighting(n_tasks=2)(J @ J.T)
    assert weights.device == J.device and weights.dtype == dtype
    torch.testing.assert_close(NashMTL(n_tasks=2)(J), weights @ J)


def test_errors_and_repr() -> None:
    with pytest.raises(ValueError, match="n_tasks"):
        NashMTL(n_tasks=0)
    with pytest.raises(ValueError, match="max_norm"):
        NashMTL(n_tasks=2, max_norm=-1.0)
    with pytest.raises(ValueError, match="update_weights_every"):
        NashMTL(n_tasks=2, update_weights_every=0)
    with pytest.raises(ValueError, match="optim_niter"):
        NashMTLWeighting(n_tasks=2, optim_niter=0)
    with pytest.raises(TypeError, match="n_tasks"):
        NashMTL(n_tasks=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_tasks=3"):
        NashMTL(n_tasks=2)(torch.ones(3, 4))
    assert repr(NashMTL(n_tasks=2)) == (
        "NashMTL(n_tasks=2, max_norm=1.0, update_weights_every=1, optim_niter=20)"
    )
    assert str(NashMTL(n_tasks=2)) == "NashMTL"
