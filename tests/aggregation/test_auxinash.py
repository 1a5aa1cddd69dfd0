"""AuxiNash: the bargaining fixed point, a generic-solver reference and Nash-MTL's value."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

from jacflow.aggregation import AuxiNash, AuxiNashWeighting, NashMTL
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    jacobians,
    make_jacobian,
)


def _make() -> AuxiNash:
    return AuxiNash(torch.ones(1))


def _uniform(m: int) -> AuxiNash:
    return AuxiNash(torch.ones(m))


class _AnyM(AuxiNash):
    """Preferences made for the number of rows at call time, for the shared checks."""

    def __init__(self) -> None:
        super().__init__(torch.ones(1))

    def weights(self, matrix: torch.Tensor) -> torch.Tensor:
        m = matrix.shape[0]
        prefs = torch.arange(1, m + 1, dtype=torch.float64)
        return AuxiNashWeighting(prefs)(matrix @ matrix.T)


def test_claimed_properties_and_degenerate_inputs() -> None:
    check_claimed_properties(_AnyM)
    check_degenerate_inputs(_AnyM)


@settings(max_examples=15)
@given(jacobians(max_m=12, dtypes=(torch.float64,)), st.integers(0, 1000))
def test_non_conflicting_in_float64(J: torch.Tensor, seed: int) -> None:
    prefs = torch.rand(J.shape[0], generator=torch.Generator().manual_seed(seed)) + 0.01
    d = AuxiNash(prefs)(J)
    # g_i . d = s p_i / alpha_i > 0, or d = 0 at a Pareto-stationary input.
    tol = 1e-9 * float(J.norm(dim=1).max()) * float(d.norm())
    assert bool((J @ d >= -tol).all()), J @ d


@settings(max_examples=20)
@given(
    st.integers(1, 8),
    st.integers(0, 2**31 - 1),
    st.sampled_from([1e-4, 1.0, 1e4]),
)
def test_fixed_point_of_the_bargaining_equation(m: int, seed: int, scale: float) -> None:
    J = make_jacobian(m, m + 3, m, scale, torch.float64, seed)
    prefs = torch.rand(m, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    prefs = prefs + 0.1
    alpha = AuxiNashWeighting(prefs, max_norm=None)(J @ J.T)
    powers = m * prefs / prefs.sum()
    assert bool((alpha > 0).all())
    torch.testing.assert_close(alpha * (J @ J.T @ alpha), powers, rtol=1e-6, atol=0)
    # With clipping, the direction is the same and the norm is min(max_norm, sqrt(m)).
    clipped = AuxiNash(prefs, max_norm=1.0)(J)
    torch.testing.assert_close(clipped.norm(), torch.tensor(min(1.0, m**0.5), dtype=torch.float64))
    torch.testing.assert_close(clipped * (alpha @ J).norm(), (alpha @ J) * clipped.norm())


def test_matches_a_generic_solver_of_the_nash_product() -> None:
    gen = torch.Generator().manual_seed(3)
    J = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    prefs = torch.tensor([0.5, 1.0, 2.0, 0.5], dtype=torch.float64)
    G, p = (J @ J.T).numpy(), (4 * prefs / prefs.sum()).numpy()

    def objective(a: np.ndarray) -> tuple[float, np.ndarray]:
        return 0.5 * a @ G @ a - p @ np.log(a), G @ a - p / a

    result = minimize(
        objective, np.ones(4), jac=True, bounds=[(1e-9, None)] * 4, tol=1e-14, method="L-BFGS-B"
    )
    got = AuxiNashWeighting(prefs, max_norm=None)(J @ J.T)
    torch.testing.assert_close(got, torch.from_numpy(result.x), rtol=1e-5, atol=0)


def test_uniform_powers_give_the_nash_mtl_reference_value() -> None:
    # TorchJD 0.18's NashMTL(n_tasks=2) gives [0.0542, 0.7061, 0.7061] on this matrix.
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    torch.testing.assert_close(
        _uniform(2)(J), torch.tensor([0.0542, 0.7061, 0.7061]), atol=1e-4, rtol=0
    )


@settings(max_examples=20)
@given(st.integers(1, 6), st.integers(0, 2**31 - 1), st.sampled_from([1e-3, 0.1, 1.0, 1e3]))
def test_equal_powers_are_nash_mtl(m: int, seed: int, scale: float) -> None:
    """Both solve alpha_i (G alpha)_i = 1 on the raw Gramian (the official codes). NashMTL used
    the Frobenius-normalised Gramian without scaling back: its update was sqrt(|G|_F) times
    AuxiNash's (0.146 against 1 on a Jacobian of norm 0.1)."""
    J = make_jacobian(m, m + 2, m, scale, torch.float64, seed)  # full row rank
    torch.testing.assert_close(
        AuxiNash(torch.ones(m), max_norm=None)(J), NashMTL(n_tasks=m, max_norm=0.0)(J)
    )
    torch.testing.assert_close(AuxiNash(torch.ones(m))(J), NashMTL(n_tasks=m)(J))


def test_scale_invariance_and_permutation_with_the_preferences() -> None:
    gen = torch.Generator().manual_seed(0)
    J = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    prefs = torch.tensor([3.0, 1.0, 1.0], dtype=torch.float64)
    A = AuxiNash(prefs, max_norm=None)
    c = torch.tensor([0.1, 10.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(A(c[:, None] * J), A(J))  # each row's scale cancels
    perm = torch.tensor([2, 0, 1])
    torch.testing.assert_close(AuxiNash(prefs[perm], max_norm=None)(J[perm]), A(J))


def test_zero_rows_and_pareto_stationary_inputs_get_zero_weight() -> None:
    J = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    w = AuxiNashWeighting(torch.ones(3), max_norm=None)(J @ J.T)
    assert w[1] == 0
    torch.testing.assert_close(w[[0, 2]], torch.tensor([1.0, 0.5], dtype=torch.float64))
    opposite = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    torch.testing.assert_close(_uniform(2)(opposite), torch.zeros(2))  # the disagreement point
    hull_has_zero = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])
    torch.testing.assert_close(_uniform(3)(hull_has_zero), torch.zeros(2))


def test_nan_propagates_and_errors() -> None:
    assert bool(torch.isnan(_uniform(2)(torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))).all())
    with pytest.raises(ValueError, match="one bargaining power per objective"):
        _uniform(3)(torch.eye(2))
    with pytest.raises(ValueError, match="non-negative"):
        AuxiNash(torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="1-D"):
        AuxiNash(torch.ones(2, 2))
    with pytest.raises(TypeError, match="preferences"):
        AuxiNash([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`max_norm` must be a float in \(0.0, inf\)"):
        AuxiNash(torch.ones(2), max_norm=0.0)
    with pytest.raises(ValueError, match="max_iter"):
        AuxiNash(torch.ones(2), max_iter=0)
    assert repr(_uniform(2)) == "AuxiNash(preferences=tensor([1., 1.]), max_norm=1.0, max_iter=100)"
    assert str(_uniform(2)) == "AuxiNash"


def test_weighting_and_aggregator_agree() -> None:
    J = torch.randn(4, 7, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    prefs = torch.tensor([1.0, 2.0, 0.5, 1.0])
    torch.testing.assert_close(AuxiNash(prefs)(J), AuxiNashWeighting(prefs)(J @ J.T) @ J)
