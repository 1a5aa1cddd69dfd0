"""Tchebycheff and augmented Tchebycheff against their definitions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jacflow.scalarization import STCH, AugmentedTchebycheff, Tchebycheff


def test_value_with_weights_and_reference(dtype: torch.dtype) -> None:
    f, w, z = [1.0, 3.0, 2.0], [0.5, 0.2, 0.3], [0.5, 1.0, 0.0]
    losses = torch.tensor(f, dtype=dtype)
    out = Tchebycheff(torch.tensor(w), torch.tensor(z))(losses)
    expected = max(wi * (fi - zi) for fi, wi, zi in zip(f, w, z))
    assert math.isclose(out.item(), expected, rel_tol=1e-6)
    aug = AugmentedTchebycheff(0.01, torch.tensor(w), torch.tensor(z))(losses)
    assert math.isclose(
        aug.item(), expected + 0.01 * sum(fi - zi for fi, zi in zip(f, z)), rel_tol=1e-6
    )


def test_gradient_goes_to_the_worst_term_and_ties_share_it() -> None:
    f = torch.tensor([1.0, 3.0, 2.0], requires_grad=True)
    Tchebycheff()(f).backward()
    assert f.grad is not None
    assert f.grad.tolist() == pytest.approx([0.0, 1 / 3, 0.0], rel=1e-6)
    g = torch.tensor([3.0, 3.0, 2.0], requires_grad=True)
    AugmentedTchebycheff(0.5)(g).backward()
    assert g.grad is not None
    assert torch.allclose(g.grad, torch.tensor([1 / 6 + 0.5, 1 / 6 + 0.5, 0.5]))


def test_stch_tends_to_tchebycheff() -> None:
    losses = torch.tensor([0.3, 0.9, 0.5], dtype=torch.float64)
    w = torch.tensor([0.6, 0.1, 0.3], dtype=torch.float64)
    gaps = [
        abs(STCH(mu, w)(losses).item() - Tchebycheff(w)(losses).item()) for mu in (1, 0.1, 0.01)
    ]
    assert gaps[0] > gaps[1] > gaps[2]
    assert gaps[2] <= 0.01 * math.log(3)


def test_rho_zero_is_tchebycheff() -> None:
    losses = torch.tensor([0.3, 0.9, 0.5])
    assert AugmentedTchebycheff(0.0)(losses).item() == Tchebycheff()(losses).item()


@settings(max_examples=30)
@given(st.lists(st.floats(-100, 100), min_size=1, max_size=6), st.floats(1e-2, 1e2))
def test_positive_homogeneity(values: list[float], c: float) -> None:
    losses = torch.tensor(values, dtype=torch.float64)
    for make in (Tchebycheff, lambda: AugmentedTchebycheff(0.1)):
        assert math.isclose(
            make()(c * losses).item(), c * make()(losses).item(), rel_tol=1e-9, abs_tol=1e-9
        )
