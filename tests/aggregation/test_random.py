"""Random / RandomWeighting."""

from __future__ import annotations

import torch

from jacflow.aggregation import Random, RandomWeighting
from tests.aggregation._properties import check_claimed_properties, check_degenerate_inputs
from tests.aggregation._seeded import seeded


def test_claimed_properties() -> None:
    # Linearity under scaling is a claim about one draw: every call reuses seed 0.
    check_claimed_properties(seeded(Random))


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(Random)


def test_matches_softmax_of_a_normal_draw() -> None:
    J = torch.randn(4, 6, dtype=torch.float64)
    torch.manual_seed(3)
    expected = torch.softmax(torch.randn(4, dtype=torch.float64), dim=0) @ J
    torch.manual_seed(3)
    torch.testing.assert_close(Random()(J), expected)


def test_weights_lie_on_the_simplex_and_vary() -> None:
    weighting = RandomWeighting()
    draws = torch.stack([weighting(torch.eye(5)) for _ in range(200)])
    assert bool((draws > 0).all())
    torch.testing.assert_close(draws.sum(dim=1), torch.ones(200))
    assert float(draws.std(dim=0).min()) > 0.05  # fresh weights at every call
    assert float((draws.mean(dim=0) - 0.2).abs().max()) < 0.05  # exchangeable entries


def test_weighting_and_aggregator_agree() -> None:
    J = torch.randn(3, 5)
    torch.manual_seed(7)
    a = Random()(J)
    torch.manual_seed(7)
    torch.testing.assert_close(RandomWeighting()(J @ J.T) @ J, a)


def test_repr_and_str() -> None:
    assert repr(Random()) == "Random()"
    assert str(Random()) == "Random"
