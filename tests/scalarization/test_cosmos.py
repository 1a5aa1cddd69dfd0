"""COSMOS against a NumPy computation of r.L - lambda cos(r, L)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from jacflow.scalarization import COSMOS, Constant


def test_value(dtype: torch.dtype) -> None:
    f, r = np.array([1.0, 3.0, 2.0]), np.array([0.5, 0.2, 0.3])
    expected = f @ r - 2.0 * (f @ r) / (np.linalg.norm(f) * np.linalg.norm(r))
    out = COSMOS(2.0, torch.tensor(r))(torch.tensor(f, dtype=dtype))
    assert out.dtype == dtype
    assert math.isclose(out.item(), float(expected), rel_tol=1e-6)


def test_lambda_zero_is_linear_scalarization() -> None:
    losses, r = torch.tensor([1.0, 3.0]), torch.tensor([0.25, 0.75])
    assert COSMOS(0.0, r)(losses).item() == Constant(r)(losses).item()


def test_aligned_losses_get_the_full_reward() -> None:
    r = torch.tensor([1.0, 2.0])
    assert math.isclose(COSMOS(3.0, r)(2 * r).item(), (2 * r @ r).item() - 3.0, rel_tol=1e-6)


def test_zero_losses_give_a_finite_value_and_gradient() -> None:
    f = torch.zeros(2, requires_grad=True)
    out = COSMOS(1.0, torch.tensor([0.5, 0.5]))(f)
    out.backward()
    assert f.grad is not None
    assert out.item() == 0.0
    assert torch.isfinite(f.grad).all()


@pytest.mark.parametrize("scale", [1e-6, 1e-9, 1e-12])
def test_gradient_of_small_losses_is_the_papers(scale: float) -> None:
    """d/dL [r.L - lambda r.L / (|r| |L|)], by hand: a floor of 1e-8 on the product of norms
    made it wrong (and of the wrong sign) below it."""
    r = torch.tensor([0.5, 0.5], dtype=torch.float64)
    losses = (torch.tensor([0.6, 0.4], dtype=torch.float64) * scale).requires_grad_()
    COSMOS(1.0, r)(losses).backward()
    L = losses.detach()
    nr, nl = r.norm(), L.norm()
    expected = r - (r / (nr * nl) - (r @ L) * L / (nr * nl**3))
    torch.testing.assert_close(losses.grad, expected)


def test_zero_losses_give_a_finite_gradient() -> None:
    losses = torch.zeros(2, requires_grad=True)
    value = COSMOS(1.0, torch.tensor([0.5, 0.5]))(losses)
    value.backward()
    assert float(value.detach()) == 0.0
    assert losses.grad is not None and torch.isfinite(losses.grad).all()
