"""Constant / ConstantWeighting."""

from __future__ import annotations

import pytest
import torch

from jacflow.aggregation import Constant, ConstantWeighting, GramianWeightedAggregator
from tests.aggregation._properties import check_claimed_properties, jacobians

WEIGHTS = torch.tensor([0.3, -1.2, 2.0])


def test_claimed_properties() -> None:
    check_claimed_properties(lambda: Constant(WEIGHTS), jacobians(min_m=3, max_m=3))


def test_degenerate_inputs() -> None:
    assert torch.equal(Constant(torch.zeros(0))(torch.zeros(0, 5)), torch.zeros(5))
    assert Constant(WEIGHTS)(torch.zeros(3, 0)).shape == (0,)
    out = Constant(WEIGHTS)(torch.tensor([[1.0, float("nan")], [0.5, 2.0], [1.0, 1.0]]))
    assert not bool(torch.isfinite(out).all())


def test_values() -> None:
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    torch.testing.assert_close(Constant(torch.tensor([1.0, 2.0]))(J), torch.tensor([8.0, 3.0, 3.0]))
    J64 = torch.randn(3, 7, dtype=torch.float64)
    expected = sum(float(WEIGHTS[i]) * J64[i] for i in range(3))
    torch.testing.assert_close(Constant(WEIGHTS)(J64), expected)


def test_weighting_and_aggregator_agree() -> None:
    J = torch.randn(3, 5)
    weighting = ConstantWeighting(WEIGHTS)
    torch.testing.assert_close(weighting(J @ J.T) @ J, Constant(WEIGHTS)(J))
    torch.testing.assert_close(GramianWeightedAggregator(weighting)(J), Constant(WEIGHTS)(J))


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"`weights` must be a vector"):
        Constant(torch.ones(2, 2))
    with pytest.raises(TypeError, match=r"`weights` must be a torch\.Tensor"):
        Constant([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one weight per objective"):
        Constant(WEIGHTS)(torch.ones(2, 4))


def test_repr_and_str() -> None:
    agg = Constant(torch.tensor([1.0, 2.0]))
    assert repr(agg) == "Constant(weights=tensor([1., 2.]))"
    assert str(agg) == "Constant([1., 2.])"  # (TorchJD's label)


def test_device_and_dtype(device: str, dtype: torch.dtype) -> None:
    J = torch.randn(3, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    expected = Constant(WEIGHTS)(J)
    out = Constant(WEIGHTS)(J.to(device=device, dtype=dtype))
    assert out.device.type == torch.device(device).type and out.dtype == dtype
    tol = 1e-3 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


def test_assigning_weights_on_the_aggregator_is_refused() -> None:
    """``Constant(w).weights = tensor`` hid the method ``weights(matrix)`` of every weighted
    aggregator, accepted anything unchecked, and the next call failed with "'Tensor' object is
    not callable". It is refused and names the weighting's hyper-parameter, which takes
    effect; the aggregator is unchanged."""
    aggregator = Constant(torch.tensor([1.0, 2.0]))
    with pytest.raises(AttributeError, match=r"gramian_weighting\.weights = tensor"):
        aggregator.weights = torch.tensor([3.0, 4.0])  # type: ignore[method-assign, assignment]
    torch.testing.assert_close(aggregator(torch.eye(2)), torch.tensor([1.0, 2.0]))
    aggregator.gramian_weighting.weights = torch.tensor([3.0, 4.0])  # type: ignore[assignment]
    torch.testing.assert_close(aggregator(torch.eye(2)), torch.tensor([3.0, 4.0]))
    assert str(aggregator) == "Constant([3., 4.])"
