"""CRMOGMWeighting: the EMA recurrence, composition with both aggregator kinds, reset."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from jacflow import Stateful
from jacflow.aggregation import (
    ConstantWeighting,
    CRMOGMWeighting,
    GradVacWeighting,
    GramianWeightedAggregator,
    IMTLGWeighting,
    MeanWeighting,
    MGDAWeighting,
    UPGradWeighting,
    WeightedAggregator,
    Weighting,
)
from jacflow.linalg import QuadprogProjector
from tests.aggregation._properties import check_claimed_properties, check_degenerate_inputs


def make() -> GramianWeightedAggregator:
    return GramianWeightedAggregator(CRMOGMWeighting(MGDAWeighting()))


def test_claimed_properties() -> None:
    check_claimed_properties(make)


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(make)


@pytest.mark.parametrize("initial", [None, torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)])
def test_follows_the_ema_recurrence(initial: torch.Tensor | None) -> None:
    inner = IMTLGWeighting()
    smoothed = CRMOGMWeighting(IMTLGWeighting(), alpha=0.7, initial_weights=initial)
    previous = initial
    for _ in range(5):
        J = torch.randn(3, 4, dtype=torch.float64)
        G = J @ J.T
        current = inner(G)
        expected = current if previous is None else 0.7 * previous + 0.3 * current
        torch.testing.assert_close(smoothed(G), expected)
        previous = expected


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("inner", [MGDAWeighting, lambda: ConstantWeighting(torch.ones(3))])
def test_a_non_finite_step_is_skipped(bad: float, inner: Callable[[], Weighting]) -> None:
    """One NaN or infinite Gramian (a step that a GradScaler skips) made the average NaN for
    good; the recurrence now goes on from the last finite weights, skipping it."""
    smoothed = CRMOGMWeighting(inner(), alpha=0.7)
    reference = inner()
    gen = torch.Generator().manual_seed(0)
    previous: torch.Tensor | None = None
    for step in range(6):
        if step in (0, 3):  # the very first call too
            assert bool(smoothed(torch.full((3, 3), bad, dtype=torch.float64)).isnan().all())
        J = torch.randn(3, 4, generator=gen, dtype=torch.float64)
        current = reference(J @ J.T)
        expected = current if previous is None else 0.7 * previous + 0.3 * current
        torch.testing.assert_close(smoothed(J @ J.T), expected)
        previous = expected


def test_reset_restores_the_initial_behaviour_and_resets_the_wrapped_weighting() -> None:
    G = torch.tensor([[18.0, -22.0], [-22.0, 38.0]])
    weighting = CRMOGMWeighting(GradVacWeighting(), alpha=0.5)
    assert isinstance(weighting, Stateful)
    first = weighting(G)
    assert not torch.allclose(weighting(G), first)
    weighting.reset()
    torch.testing.assert_close(weighting(G), first)


def test_wraps_a_matrix_weighting_too() -> None:
    J = torch.randn(2, 5)
    agg = WeightedAggregator(CRMOGMWeighting(MeanWeighting(), alpha=0.5))
    torch.testing.assert_close(agg(J), J.mean(dim=0))


def test_documented_values() -> None:
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    weighting = CRMOGMWeighting(UPGradWeighting(projector=QuadprogProjector()))
    torch.testing.assert_close(
        weighting(J @ J.T), torch.tensor([1.1109, 0.7894]), atol=1e-4, rtol=0
    )


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"`alpha` must be a float in \[0.0, 1.0\]"):
        CRMOGMWeighting(MeanWeighting(), alpha=1.5)
    with pytest.raises(TypeError, match=r"`weighting` must be a jacflow\.aggregation\.Weighting"):
        CRMOGMWeighting(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`initial_weights` must be None or a vector"):
        CRMOGMWeighting(MeanWeighting(), initial_weights=torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"from `initial_weights` but the input has 3 rows"):
        CRMOGMWeighting(MeanWeighting(), initial_weights=torch.ones(2))(torch.eye(3))
    weighting = CRMOGMWeighting(ConstantWeighting(torch.ones(2)))
    weighting(torch.eye(2))
    with pytest.raises(ValueError, match=r"call `\.reset\(\)`"):
        weighting(torch.eye(3))
    with pytest.raises(ValueError, match="square Gramian"):
        CRMOGMWeighting(UPGradWeighting())(torch.ones(2, 3))


def test_repr_and_str() -> None:
    weighting = CRMOGMWeighting(MeanWeighting())
    assert repr(weighting) == "CRMOGMWeighting(MeanWeighting(), alpha=0.9, initial_weights=None)"
    assert str(weighting) == "CRMOGM(MeanWeighting)"
