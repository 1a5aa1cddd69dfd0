"""PCD: KKT optimality of its quadratic program, TorchJD's values, the moving average, reset."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog, minimize

from jacflow.aggregation import PCD, PCDWeighting
from jacflow.aggregation._pcd import solve_pcd_qp
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    jacobians,
    make_jacobian,
)
from tests.aggregation._seeded import seeded

J_DOC = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])


def test_claimed_properties() -> None:
    check_claimed_properties(seeded(PCD, reset=True), jacobians(max_m=16))


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(PCD)


@settings(max_examples=40)
@given(
    st.integers(1, 8),
    st.integers(1, 10),
    st.integers(0, 2**31 - 1),
    st.floats(0.0, 1.0),
)
def test_qp_solution_satisfies_kkt(m: int, n: int, seed: int, tau: float) -> None:
    """d = g1 + sum mu_j g_j with mu >= 0, feasible, complementary: the QP's unique optimum."""
    J = make_jacobian(m, n, min(m, n), 1.0, torch.float64, seed)
    G = J @ J.T
    taus = torch.full((m - 1,), tau, dtype=torch.float64)
    w = solve_pcd_qp(G, taus)
    d = w @ J
    bounds = taus * G.diagonal()[1:]
    slack = J[1:] @ d - bounds
    tol = 1e-8 * float(G.diagonal().max())
    assert float(w[0]) == 1.0 and bool((w[1:] >= 0).all())  # stationarity form, dual feasible
    if bool((slack >= -tol).all()):
        assert float((w[1:] * slack).abs().sum()) <= (m - 1) * tol  # complementary slackness
    else:
        # Declared infeasible: check with scipy's LP solver. For tau > 0 the substitution
        # d = tau * x turns g_j . d >= tau |g_j|^2 into (g_j / |g_j|) . x >= |g_j|, whose
        # feasibility does not depend on tau (tau = 1e-9 made the bounds ~1e-10, below any
        # absolute tolerance: the former least-squares check failed there).
        assert torch.equal(w, torch.eye(m, dtype=torch.float64)[0])
        assert tau > 0  # d = 0 is feasible for tau = 0
        norms = J[1:].norm(dim=1)
        rows = norms > 1e-12
        A = (J[1:][rows] / norms[rows, None]).numpy()
        lp = linprog(np.zeros(n), A_ub=-A, b_ub=-norms[rows].numpy(), bounds=(None, None))
        assert lp.status == 2, f"declared infeasible but scipy finds x = {lp.x}"


@pytest.mark.parametrize("seed", range(4))
def test_qp_matches_scipy(seed: int) -> None:
    torch.manual_seed(seed)
    J = torch.randn(4, 6, dtype=torch.float64)
    G = J @ J.T
    taus = torch.full((3,), 0.3, dtype=torch.float64)
    d = solve_pcd_qp(G, taus) @ J
    A, g1, b = J[1:].numpy(), J[0].numpy(), (taus * G.diagonal()[1:]).numpy()
    result = minimize(
        lambda x: 0.5 * np.sum((x - g1) ** 2),
        g1,
        jac=lambda x: x - g1,
        constraints=[{"type": "ineq", "fun": lambda x: A @ x - b, "jac": lambda x: A}],
        method="SLSQP",
        options={"ftol": 1e-14, "maxiter": 500},
    )
    torch.testing.assert_close(d, torch.from_numpy(result.x), atol=1e-6, rtol=0)


def test_documented_values_and_reset() -> None:
    aggregator = PCD()
    first = aggregator(J_DOC)
    torch.testing.assert_close(first, torch.tensor([-0.8200, 2.9434, 2.9434]), atol=1e-4, rtol=0)
    torch.testing.assert_close(
        PCDWeighting()(J_DOC @ J_DOC.T), torch.tensor([1.8481, 1.0954]), atol=1e-4, rtol=0
    )
    aggregator(J_DOC * torch.tensor([[10.0], [0.1]]))
    assert not torch.allclose(aggregator(J_DOC), first)  # the moving average remembers
    aggregator.reset()
    torch.testing.assert_close(aggregator(J_DOC), first)


def test_update_has_the_primary_norm_and_tau_vector(device: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    J = torch.randn(4, 5).to(device=device, dtype=dtype)
    d = PCD(tau=torch.tensor([0.1, 0.5, 0.9]))(J)
    assert d.device == J.device and d.dtype == dtype
    torch.testing.assert_close(d.norm(), J[0].norm(), rtol=1e-4, atol=0)


def test_infeasible_constraints_fall_back_to_the_primary_gradient() -> None:
    # Two opposite secondary gradients cannot both make progress: the update is g1.
    J = torch.tensor([[1.0, 2.0, 0.0], [0.0, 1.0, 1.0], [0.0, -1.0, -1.0]], dtype=torch.float64)
    torch.testing.assert_close(PCD(tau=0.5)(J), J[0])
    # With tau = 0 the same constraints are feasible (d orthogonal to them).
    d = PCD(tau=0.0)(J)
    torch.testing.assert_close(J[1:] @ d, torch.zeros(2, dtype=torch.float64), atol=1e-12, rtol=0)


def test_errors_and_repr() -> None:
    with pytest.raises(ValueError, match="tau"):
        PCD(tau=1.5)
    with pytest.raises(ValueError, match="tau"):
        PCD(tau=torch.ones(2, 2))
    with pytest.raises(ValueError, match="tau"):
        PCD(tau=torch.tensor([0.5, 2.0]))
    with pytest.raises(ValueError, match="secondary objectives"):
        PCD(tau=torch.tensor([0.5, 0.5]))(J_DOC)
    with pytest.raises(ValueError, match="beta"):
        PCD(beta=1.0)
    with pytest.raises(ValueError, match="eps"):
        PCDWeighting(eps=-1.0)
    assert repr(PCD()) == "PCD(tau=0.02, beta=0.999, eps=1e-08)"
    assert str(PCD()) == "PCD"
