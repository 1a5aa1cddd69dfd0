"""MoCo: several steps against a literal implementation of the paper's update."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jacflow import Stateful
from jacflow.aggregation import MoCo
from tests.aggregation._properties import check_claimed_properties, check_degenerate_inputs


def _simplex_projection(y: np.ndarray) -> np.ndarray:
    """Projection onto the simplex as the QP min ||x - y||^2, solved by bisection on theta."""
    low, high = float(y.min()) - 1.0, float(y.max())
    for _ in range(200):
        theta = (low + high) / 2
        if np.maximum(y - theta, 0).sum() > 1:
            low = theta
        else:
            high = theta
    return np.maximum(y - (low + high) / 2, 0)


def _reference(
    jacobians: list[np.ndarray], beta: float, sb: float, gamma: float, sg: float, rho: float
) -> list[np.ndarray]:
    m, n = jacobians[0].shape
    Y = np.zeros((m, n))
    lam = np.full(m, 1.0 / m)
    out = []
    for k, J in enumerate(jacobians, start=1):
        Y = Y - beta / k**sb * (Y - J)
        lam = _simplex_projection(lam - gamma / k**sg * ((Y @ Y.T + rho * np.eye(m)) @ lam))
        out.append(Y.T @ lam)
    return out


@pytest.mark.parametrize("params", [(0.5, 0.5, 0.1, 0.5, 0.0), (0.9, 0.0, 0.5, 0.2, 0.3)])
def test_matches_the_paper_update(params: tuple[float, float, float, float, float]) -> None:
    torch.manual_seed(0)
    jacobians = [torch.randn(4, 6, dtype=torch.float64) for _ in range(6)]
    expected = _reference([J.numpy() for J in jacobians], *params)
    A = MoCo(*params)
    for J, e in zip(jacobians, expected):
        torch.testing.assert_close(A(J), torch.from_numpy(e))


def test_reset_restores_first_step_behaviour() -> None:
    A = MoCo()
    assert isinstance(A, Stateful)
    J = torch.tensor([[2.0, 0.0], [-1.0, 1.0]])
    first = A(J)
    assert not torch.equal(A(J), first)
    A.reset()
    torch.testing.assert_close(A(J), first)
    with pytest.raises(ValueError, match="reset"):
        A(torch.ones(3, 2))


def test_claimed_properties_and_degenerate_inputs() -> None:
    check_claimed_properties(MoCo)
    check_degenerate_inputs(MoCo)


def test_construction_errors_and_repr() -> None:
    with pytest.raises(ValueError, match=r"`beta` must be a float in \(0.0, 1.0\]"):
        MoCo(beta=0.0)
    with pytest.raises(ValueError, match="gamma"):
        MoCo(gamma=-1.0)
    with pytest.raises(ValueError, match="rho"):
        MoCo(rho=-1.0)
    with pytest.raises(ValueError, match="gamma_sigma"):
        MoCo(gamma_sigma=float("nan"))
    assert repr(MoCo()) == "MoCo(beta=0.5, beta_sigma=0.5, gamma=0.1, gamma_sigma=0.5, rho=0.0)"
    assert str(MoCo()) == "MoCo"


def test_nan_gives_nan_and_leaves_the_state_untouched() -> None:
    J = torch.tensor([[2.0, 0.0], [-1.0, 1.0]])
    reference, A = MoCo(), MoCo()
    for _ in range(2):
        expected = reference(J)
        assert bool(torch.isnan(A(torch.tensor([[float("nan"), 0.0], [0.0, 1.0]]))).all())
        torch.testing.assert_close(A(J), expected)


def test_a_skipped_first_call_does_not_fix_the_shape() -> None:
    """A NaN Jacobian on a fresh instance set the tracked Jacobian up (zeros of its shape), and
    a valid Jacobian of another shape was then refused; now it gives a fresh instance's update."""
    A = MoCo()
    assert bool(A(torch.tensor([[float("nan"), 1.0, 2.0], [0.0, 1.0, 1.0]])).isnan().all())
    J = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert torch.equal(A(J), MoCo()(J))


def test_a_large_finite_jacobian_leaves_a_finite_state() -> None:
    """Y Y^T lambda overflowed float32 (rows of norm 1e20): a NaN lambda, kept as state, made
    every later update NaN. The weights' step is taken in float64."""
    A = MoCo()
    torch.testing.assert_close(A(torch.tensor([[1e20]])), torch.tensor([5e19]))
    assert bool(torch.isfinite(A(torch.ones(1, 1))).all())
    J = torch.tensor([[1e25, 0.0], [0.0, 1.0]])
    torch.testing.assert_close(MoCo()(J), MoCo()(J.double()).float())


def test_many_large_columns_leave_a_finite_state() -> None:
    """Y (Y^T lambda) sums n products of Y's scale: with entries of 1e37 over 1000 columns it
    overflowed float32 after the first fix (which scaled by Y's largest entry only), and the
    NaN weights stayed as state. The weights equal those of the float64 Jacobian."""
    J = torch.full((2, 1000), 1e37) * torch.tensor([[1.0], [0.5]])
    A, reference = MoCo(), MoCo()
    for _ in range(2):
        update = A(J)
        expected = reference(J.double())
        assert bool(torch.isfinite(update).all())
        torch.testing.assert_close(update.double(), expected, rtol=1e-5, atol=0.0)
