"""MoDo: properties, an independent re-implementation of the update, values, reset."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jacflow.aggregation import MoDo, MoDoWeighting
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    jacobians,
)
from tests.aggregation._seeded import seeded

J_DOC = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])


def _reference_projection(y: list[float]) -> list[float]:
    """Simplex projection by the KKT conditions, enumerating the support sizes (pure Python)."""
    ordered = sorted(y, reverse=True)
    for k in range(len(y), 0, -1):
        theta = (sum(ordered[:k]) - 1) / k
        if ordered[k - 1] - theta > 0:
            return [max(v - theta, 0.0) for v in y]
    raise AssertionError("unreachable")


def test_claimed_properties() -> None:
    check_claimed_properties(seeded(MoDo, reset=True), jacobians(max_m=16))


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(MoDo)


@settings(max_examples=20)
@given(st.integers(1, 6), st.integers(0, 2**31 - 1), st.floats(0.01, 1.0), st.floats(0.0, 1.0))
def test_matches_reference_over_several_calls(m: int, seed: int, gamma: float, rho: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    mats = [
        torch.randn(m, 4, generator=gen, dtype=torch.float64)
        @ torch.randn(m, 4, generator=gen, dtype=torch.float64).T
        for _ in range(4)
    ]
    weighting = MoDoWeighting(gamma=gamma, rho=rho)
    lam = [1.0 / m] * m
    for A in mats:
        rows = A.tolist()
        step = [
            lam[i] - gamma * (sum(rows[i][j] * lam[j] for j in range(m)) + rho * lam[i])
            for i in range(m)
        ]
        lam = _reference_projection(step)
        torch.testing.assert_close(
            weighting(A), torch.tensor(lam, dtype=torch.float64), atol=1e-12, rtol=0
        )


def test_documented_values_and_reset() -> None:
    G = J_DOC @ J_DOC.T
    weighting = MoDoWeighting()
    torch.testing.assert_close(weighting(G), torch.tensor([1.0, 0.0]))
    # Second step from [1, 0]: [1, 0] - 0.1 * ([18, -22] + 0.1 * [1, 0]) projects to [0, 1].
    torch.testing.assert_close(weighting(G), torch.tensor([0.0, 1.0]))
    weighting.reset()
    torch.testing.assert_close(weighting(G), torch.tensor([1.0, 0.0]))
    aggregator = MoDo()
    torch.testing.assert_close(aggregator(J_DOC), J_DOC[0])
    torch.testing.assert_close(aggregator(J_DOC), J_DOC[1])
    aggregator.reset()
    torch.testing.assert_close(aggregator(J_DOC), J_DOC[0])


def test_devices_and_dtypes(device: str, dtype: torch.dtype) -> None:
    G = (J_DOC @ J_DOC.T).to(device=device, dtype=dtype)
    w = MoDoWeighting()(G)
    assert w.device == G.device and w.dtype == dtype


def test_errors_and_repr() -> None:
    with pytest.raises(ValueError, match="gamma"):
        MoDo(gamma=0.0)
    with pytest.raises(ValueError, match="rho"):
        MoDoWeighting(rho=-1.0)
    with pytest.raises(ValueError, match="square"):
        MoDoWeighting()(torch.ones(2, 3))
    assert repr(MoDo()) == "MoDo(gamma=0.1, rho=0.1)"
    assert str(MoDo()) == "MoDo"


def test_weights_stay_on_the_simplex_for_large_gramians() -> None:
    """Rows of norm 3e4 in float32 (Gramian 1e9: a step of 1e8) gave weights [0, 0] and a zero
    update; the simplex projection lost its sum to rounding."""
    J = torch.tensor([[3e4, 0.0], [0.0, 3e4]])
    for dtype in (torch.float32, torch.float64):
        torch.testing.assert_close(MoDo()(J.to(dtype)), torch.tensor([1.5e4, 1.5e4], dtype=dtype))
