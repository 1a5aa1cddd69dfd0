"""LogLoss: the weighting applied to the log-loss Jacobian, checked against explicit J_log."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from jacflow.aggregation import GramianWeightedAggregator, GramianWeighting, LogLoss, MeanWeighting
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    jacobians,
)
from tests.aggregation._with_losses import losses_for, with_losses


class _CouplingWeighting(GramianWeighting):
    """A non-linear test weighting that reads the whole Gramian: softmax(-G 1 / tr G)."""

    def forward(self, stat: torch.Tensor) -> torch.Tensor:
        return torch.softmax(-stat.sum(1) / (stat.trace() + 1e-30), dim=0)


def _make() -> GramianWeightedAggregator:
    return GramianWeightedAggregator(LogLoss(_CouplingWeighting()))


def test_claimed_properties_and_degenerate_inputs() -> None:
    check_claimed_properties(with_losses(_make))
    check_degenerate_inputs(with_losses(_make))


@settings(max_examples=15)
@given(jacobians(max_m=8, dtypes=(torch.float64,)))
def test_equals_weighting_on_explicit_log_jacobian(J: torch.Tensor) -> None:
    losses = losses_for(J.shape[0]).double()
    A = _make()
    assert isinstance(A.gramian_weighting, LogLoss)
    A.gramian_weighting.set_losses(losses)
    J_log = J / losses[:, None]
    expected = GramianWeightedAggregator(_CouplingWeighting())(J_log)
    torch.testing.assert_close(A(J), expected)


def test_mean_of_log_losses_matches_autograd() -> None:
    torch.manual_seed(0)
    theta = torch.randn(3, dtype=torch.float64)
    A_mat = torch.randn(4, 3, dtype=torch.float64)

    def losses_fn(x: torch.Tensor) -> torch.Tensor:
        return (A_mat @ x) ** 2 + 1.0

    J = torch.func.jacrev(losses_fn)(theta)
    W = LogLoss(MeanWeighting())
    W.set_losses(losses_fn(theta))
    expected = torch.func.grad(lambda x: torch.log(losses_fn(x)).mean())(theta)
    torch.testing.assert_close(GramianWeightedAggregator(W)(J), expected)


def test_bad_losses_and_construction() -> None:
    W = LogLoss(MeanWeighting())
    with pytest.raises(ValueError, match="set_losses"):
        W(torch.eye(2))
    W.set_losses(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="positive losses"):
        W(torch.eye(2))
    W.set_losses(torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="one loss per row"):
        W(torch.eye(2))
    W.set_losses(torch.tensor([1.0, float("nan")]))
    assert bool(torch.isnan(W(torch.eye(2))).any())
    with pytest.raises(TypeError, match="GramianWeighting"):
        LogLoss(object())  # type: ignore[arg-type]
    assert repr(W) == "LogLoss(MeanWeighting())"
