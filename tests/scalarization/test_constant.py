"""Constant against a hand-written weighted sum."""

from __future__ import annotations

import pytest
import torch

from jacflow.scalarization import Constant


def test_value_gradient_and_dtype(dtype: torch.dtype) -> None:
    weights = torch.tensor([[1.0, 0.5], [0.0, 2.0]])  # float32 weights follow the losses' dtype
    losses = torch.tensor([[2.0, 4.0], [8.0, 3.0]], dtype=dtype, requires_grad=True)
    out = Constant(weights)(losses)
    assert out.dtype == dtype
    assert out.item() == 1.0 * 2.0 + 0.5 * 4.0 + 0.0 * 8.0 + 2.0 * 3.0
    out.backward()
    assert losses.grad is not None
    assert torch.equal(losses.grad, weights.to(dtype))


def test_one_hot_is_single_task() -> None:
    losses = torch.tensor([3.0, 5.0, 7.0])
    assert Constant(torch.tensor([0.0, 1.0, 0.0]))(losses).item() == 5.0


def test_shape_mismatch_names_weights() -> None:
    with pytest.raises(
        ValueError, match=r"`weights` has shape \(2, 2\).*`losses` has shape \(4,\)"
    ):
        Constant(torch.ones(2, 2))(torch.ones(4))
