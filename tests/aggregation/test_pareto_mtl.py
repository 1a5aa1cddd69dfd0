"""Pareto MTL: both phases against a literal numpy/quadprog implementation, and a training run."""

from __future__ import annotations

import numpy as np
import pytest
import quadprog
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jacflow import Stateful
from jacflow.aggregation import ParetoMTL, ParetoMTLWeighting
from tests.aggregation._properties import check_claimed_properties, check_degenerate_inputs
from tests.aggregation._with_losses import with_losses


def _min_norm_point(V: np.ndarray) -> np.ndarray:
    """min ||V^T lam||^2 over the simplex by quadprog (a small ridge makes the QP strict)."""
    k = V.shape[0]
    G = V @ V.T
    G = G + 1e-10 * (np.trace(G) / k + 1e-300) * np.eye(k)
    constraints = np.hstack([np.ones((k, 1)), np.eye(k)])
    lam = quadprog.solve_qp(G, np.zeros(k), constraints, np.r_[1.0, np.zeros(k)], meq=1)[0]
    return V.T @ lam


def _reference_direction(J: np.ndarray, L: np.ndarray, U: np.ndarray, k: int, init: bool):
    """Lin et al.'s get_d_paretomtl(_init), with normalised preferences, as a direction."""
    units = U / np.linalg.norm(U, axis=1, keepdims=True)
    rows = np.delete(units, k, axis=0) - units[k]
    active = rows[rows @ (L / np.linalg.norm(L)) > 0]
    if init and len(active):
        return _min_norm_point(active @ J), False
    return _min_norm_point(np.vstack([J, active @ J])), len(active) == 0


@settings(max_examples=30)
@given(st.integers(2, 4), st.integers(2, 5), st.integers(0, 10**6))
def test_matches_the_reference_direction_in_both_phases(m: int, K: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    U = rng.uniform(0.0, 1.0, size=(K, m)) + 0.05
    k = int(rng.integers(0, K))
    W = ParetoMTLWeighting(torch.from_numpy(U), k, n_warmup_steps=3)
    for step in range(5):
        J = rng.normal(size=(m, m + 2))
        L = rng.uniform(0.1, 2.0, size=m)
        in_warmup = not W._warmup_done and step < 3
        expected, feasible = _reference_direction(J, L, U, k, in_warmup)
        W.set_losses(torch.from_numpy(L))
        w = W(torch.from_numpy(J @ J.T)).numpy()
        d = w @ J
        if in_warmup and not feasible:  # (phase 1: the reference's weights as they are)
            np.testing.assert_allclose(d, expected, atol=1e-7 * np.linalg.norm(J))
            continue
        assert abs(np.abs(w).sum() - m) < 1e-9  # (phase 2: rescaled, as the reference)
        norm, ref_norm = np.linalg.norm(d), np.linalg.norm(expected)
        if ref_norm < 1e-6 * np.linalg.norm(J):
            assert norm < 1e-5 * np.linalg.norm(J) * m
            continue
        np.testing.assert_allclose(d / norm, expected / ref_norm, atol=1e-5)


def test_phase_one_ends_when_feasible_and_reset_restarts_it() -> None:
    U = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    A = ParetoMTL(U, index=0, n_warmup_steps=10)
    assert isinstance(A, Stateful)
    J = torch.eye(2)
    A.set_losses(torch.tensor([1.0, 2.0]))  # violated: phase 1 moves along u_1 - u_0 only
    torch.testing.assert_close(A(J), torch.tensor([-1.0, 1.0]))
    A.set_losses(torch.tensor([2.0, 1.0]))  # feasible: phase 2 (plain MGDA here)
    torch.testing.assert_close(A(J), torch.tensor([1.0, 1.0]))
    A.set_losses(torch.tensor([1.0, 2.0]))  # violated again, but phase 1 is over
    phase_two = A(J)
    assert bool((phase_two > 0).any()) and not torch.allclose(phase_two, torch.tensor([-1.0, 1.0]))
    A.reset()
    torch.testing.assert_close(A(J), torch.tensor([-1.0, 1.0]))


def test_warmup_budget_limits_phase_one() -> None:
    U = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    W = ParetoMTLWeighting(U, index=0, n_warmup_steps=0)
    W.set_losses(torch.tensor([1.0, 2.0]))
    weights = W(torch.eye(2))
    # Phase 2 directly: MGDA on {e_0, e_1, e_1 - e_0}-like rows, not the phase-1 direction.
    assert not torch.allclose(weights, torch.tensor([-1.0, 1.0]))


def test_training_run_lands_in_the_chosen_preference_region() -> None:
    a, b = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 1.0]).double()
    angles = torch.linspace(0.0, torch.pi / 2, 5, dtype=torch.float64)
    U = torch.stack([torch.cos(angles), torch.sin(angles)], dim=1)

    def losses_fn(z: torch.Tensor) -> torch.Tensor:
        return torch.stack([((z - a) ** 2).sum(), ((z - b) ** 2).sum()])

    for k in (0, 4):
        A = ParetoMTL(U, index=k, n_warmup_steps=50)
        x = torch.tensor([1.5, 1.5], dtype=torch.float64)
        for _ in range(200):
            A.set_losses(losses_fn(x))
            x = x - 0.02 * A(torch.func.jacrev(losses_fn)(x))
        L = losses_fn(x)
        L_hat = L / L.norm()
        assert int(torch.argmax(U @ L_hat)) == k  # closest preference (in angle) is u_k
        assert abs(float(x.sum()) - 1.0) < 0.05  # near the Pareto set, the segment [a, b]


class _AnyM(ParetoMTL):
    """Three preference vectors sized at call time, for the shared checks."""

    def __init__(self) -> None:
        super().__init__(torch.ones(1, 1), index=0)

    def weights(self, matrix: torch.Tensor) -> torch.Tensor:
        m = matrix.shape[0]
        inner = ParetoMTLWeighting(torch.rand(3, m, generator=torch.Generator().manual_seed(m)), 1)
        assert self._weighting()._losses is not None
        inner.set_losses(self._weighting()._losses)
        return inner(matrix @ matrix.T)


def test_claimed_properties_and_degenerate_inputs() -> None:
    check_claimed_properties(with_losses(_AnyM))
    check_degenerate_inputs(with_losses(_AnyM))


def test_errors_nan_and_repr() -> None:
    with pytest.raises(ValueError, match=r"\[K, m\]"):
        ParetoMTL(torch.ones(3), index=0)
    with pytest.raises(ValueError, match="non-negative"):
        ParetoMTL(torch.tensor([[1.0, -1.0]]), index=0)
    with pytest.raises(ValueError, match="no zero row"):
        ParetoMTL(torch.tensor([[1.0, 1.0], [0.0, 0.0]]), index=0)
    with pytest.raises(ValueError, match=r"`index` must be in \[0, 1\]"):
        ParetoMTL(torch.eye(2), index=2)
    with pytest.raises(ValueError, match="n_warmup_steps"):
        ParetoMTL(torch.eye(2), index=0, n_warmup_steps=-1)
    with pytest.raises(TypeError, match="preferences"):
        ParetoMTL([[1.0]], index=0)  # type: ignore[arg-type]
    A = ParetoMTL(torch.eye(2), index=0)
    with pytest.raises(ValueError, match="set_losses"):
        A(torch.eye(2))
    A.set_losses(torch.ones(3))
    with pytest.raises(ValueError, match="one preference entry per objective"):
        A(torch.eye(3))
    A.set_losses(torch.tensor([1.0, float("nan")]))
    assert bool(torch.isnan(A(torch.eye(2))).all())
    assert repr(A) == "ParetoMTL(preferences=[[1.0, 0.0], [0.0, 1.0]], index=0, n_warmup_steps=100)"
    assert str(A) == "ParetoMTL"


def test_weighting_and_aggregator_agree_over_steps() -> None:
    gen = torch.Generator().manual_seed(5)
    U = torch.rand(4, 3, generator=gen) + 0.1
    A, W = ParetoMTL(U, index=1, n_warmup_steps=2), ParetoMTLWeighting(U, 1, n_warmup_steps=2)
    for _ in range(4):
        J = torch.randn(3, 6, generator=gen, dtype=torch.float64)
        L = torch.rand(3, generator=gen, dtype=torch.float64) + 0.1
        A.set_losses(L)
        W.set_losses(L)
        torch.testing.assert_close(A(J), W(J @ J.T) @ J)
