"""GeometricMean against the product formula, its scale behaviour and its errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jacflow.scalarization import GeometricMean

positive = st.floats(1e-3, 1e3)


@settings(max_examples=30)
@given(st.lists(positive, min_size=1, max_size=6), st.floats(1e-2, 1e2))
def test_product_formula_and_homogeneity(values: list[float], c: float) -> None:
    losses = torch.tensor(values, dtype=torch.float64)
    expected = math.prod(values) ** (1 / len(values))
    assert math.isclose(GeometricMean()(losses).item(), expected, rel_tol=1e-10)
    assert math.isclose(GeometricMean()(c * losses).item(), c * expected, rel_tol=1e-10)


def test_gradient_weights_each_loss_by_its_inverse(dtype: torch.dtype) -> None:
    losses = torch.tensor([1.0, 4.0, 16.0], dtype=dtype, requires_grad=True)
    out = GeometricMean()(losses)
    out.backward()
    expected = 4.0 / 3 / torch.tensor([1.0, 4.0, 16.0], dtype=dtype)  # G / (m L_i)
    torch.testing.assert_close(losses.grad, expected)


def test_zero_loss_gives_zero_and_negative_raises() -> None:
    assert GeometricMean()(torch.tensor([0.0, 3.0])).item() == 0.0
    with pytest.raises(ValueError, match="non-negative"):
        GeometricMean()(torch.tensor([1.0, -2.0]))


def test_one_loss_is_its_own_geometric_mean_with_gradient_one_at_zero() -> None:
    """``exp(log(0))`` has gradient ``0 * inf = NaN``; one loss's geometric mean is itself."""
    for value in (0.0, 2.5):
        loss = torch.tensor([value], requires_grad=True)
        mean = GeometricMean()(loss)
        (grad,) = torch.autograd.grad(mean, loss)
        assert mean.item() == value and grad.tolist() == [1.0]


def test_a_zero_loss_gives_a_zero_gradient_and_no_nan_reaches_the_model() -> None:
    """``exp(mean(log L))`` with a loss at 0: autograd's ``0 * inf`` put NaN into the model's
    gradient (a task fitted exactly poisoned the next optimizer step)."""
    model = torch.nn.Linear(2, 3, dtype=torch.float64)
    with torch.no_grad():
        model.weight[0] = 0.0
        model.bias[0] = 0.0
    losses = model(torch.tensor([1.0, -2.0], dtype=torch.float64)) ** 2  # the first one is 0
    losses = losses + torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)
    value = GeometricMean()(losses)
    value.backward()
    assert value.item() == 0.0
    for param in model.parameters():
        assert param.grad is not None
        assert torch.equal(param.grad, torch.zeros_like(param))


def test_a_zero_loss_with_an_infinite_one_stays_nan() -> None:
    """0 * inf has no value: a NaN, as any other non-finite input propagates."""
    assert torch.isnan(GeometricMean()(torch.tensor([0.0, float("inf"), 1.0])))
