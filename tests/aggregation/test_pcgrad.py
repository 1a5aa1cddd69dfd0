"""PCGrad / PCGradWeighting against a literal row-by-row implementation of the paper."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from jacflow.aggregation import PCGrad, PCGradWeighting
from jacflow.aggregation._pcgrad import pcgrad_weights, random_orders
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    check_nonfinite_gramian_gives_nan,
    make_jacobian,
)
from tests.aggregation._seeded import seeded


def literal_pcgrad(J: Tensor, orders: Tensor) -> Tensor:
    """Yu et al. (2020), Algorithm 1, on explicit vectors: g_i projected in the given order."""
    total = torch.zeros(J.shape[1], dtype=J.dtype)
    for i in range(J.shape[0]):
        g = J[i].clone()
        for j in orders[i].tolist():
            if j == i:
                continue
            dot = float(g @ J[j])
            if dot < 0:
                g = g - dot / float(J[j] @ J[j]) * J[j]
        total += g
    return total


def test_claimed_properties() -> None:
    check_claimed_properties(seeded(PCGrad))


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(PCGrad)


@settings(max_examples=30)
@given(st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_two_rows_match_the_literal_algorithm(n: int, seed: int) -> None:
    J = make_jacobian(2, n, 2, 1.0, torch.float64, seed)
    expected = literal_pcgrad(J, torch.tensor([[0, 1], [1, 0]]))
    torch.testing.assert_close(PCGrad()(J), expected)


@settings(max_examples=30)
@given(st.integers(1, 7), st.integers(1, 10), st.integers(0, 2**31 - 1))
def test_fixed_orders_match_the_literal_algorithm(m: int, n: int, seed: int) -> None:
    J = make_jacobian(m, n, min(m, n), 1.0, torch.float64, seed)
    gen = torch.Generator().manual_seed(seed)
    orders = torch.stack([torch.randperm(m, generator=gen) for _ in range(m)])
    expected = literal_pcgrad(J, orders)
    torch.testing.assert_close(pcgrad_weights(J @ J.T, orders) @ J, expected)


def test_orders_are_uniform_permutations_of_the_other_rows() -> None:
    m = 4
    firsts = torch.zeros(m, m)
    for _ in range(400):
        orders = random_orders(m, torch.zeros(1))
        for i in range(m):
            assert sorted(orders[i].tolist()) == [j for j in range(m) if j != i]
            firsts[i, orders[i, 0]] += 1
    off_diagonal = firsts[~torch.eye(m, dtype=torch.bool)] / 400
    assert float((off_diagonal - 1 / 3).abs().max()) < 0.1  # each other row leads 1/3 of the time


def test_random_orders_follow_the_global_seed() -> None:
    J = torch.randn(6, 4, dtype=torch.float64)
    torch.manual_seed(5)
    a = PCGrad()(J)
    torch.manual_seed(5)
    torch.testing.assert_close(PCGrad()(J), a)
    outputs = {tuple(PCGrad()(J).round(decimals=6).tolist()) for _ in range(20)}
    assert len(outputs) > 1  # the order is drawn afresh at each call


def test_documented_values() -> None:
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    torch.testing.assert_close(
        PCGrad()(J), torch.tensor([0.5848, 3.8012, 3.8012]), atol=1e-4, rtol=0
    )


def test_weighting_and_aggregator_agree() -> None:
    J = torch.randn(5, 8, dtype=torch.float64)
    torch.manual_seed(1)
    a = PCGrad()(J)
    torch.manual_seed(1)
    torch.testing.assert_close(PCGradWeighting()(J @ J.T) @ J, a)


def test_repr_and_str() -> None:
    assert repr(PCGrad()) == "PCGrad()"
    assert str(PCGrad()) == "PCGrad"


def test_device_and_dtype(device: str, dtype: torch.dtype) -> None:
    # Two rows: the visiting order, drawn from a device-specific RNG, does not matter.
    J = torch.randn(2, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    expected = PCGrad()(J)
    torch.manual_seed(0)
    out = PCGrad()(J.to(device=device, dtype=dtype))
    assert out.device.type == torch.device(device).type and out.dtype == dtype
    tol = 1e-3 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gramian_gives_nan_weights(bad: float) -> None:
    check_nonfinite_gramian_gives_nan(lambda: PCGradWeighting(), bad)
