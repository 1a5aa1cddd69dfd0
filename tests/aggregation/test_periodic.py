"""Periodic: recomputation schedule, reuse without reading the Gramian, reset and errors."""

from __future__ import annotations

import pytest
import torch

from jacflow.aggregation import (
    GramianWeightedAggregator,
    GramianWeighting,
    MeanWeighting,
    Periodic,
    UPGradWeighting,
)
from tests.aggregation._properties import check_claimed_properties, check_degenerate_inputs


class _CountingWeighting(GramianWeighting):
    """Weights = diag(G), counting how often it is called (an observable reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, stat: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return stat.diagonal().clone()


def test_recomputes_every_k_calls_and_reuses_in_between() -> None:
    inner = _CountingWeighting()
    W = Periodic(inner, every=3)
    grams = [torch.eye(2) * (t + 1) for t in range(7)]
    outs = []
    flags = []
    for G in grams:
        flags.append(W.needs_gramian())
        outs.append(W(G))
    # Reference schedule: the weights of call t are diag(G_{3 * floor(t / 3)}).
    for t, out in enumerate(outs):
        torch.testing.assert_close(out, grams[3 * (t // 3)].diagonal())
    assert flags == [True, False, False, True, False, False, True]
    assert inner.calls == 3


def test_reuse_step_ignores_the_gramian_values() -> None:
    W = Periodic(UPGradWeighting(), every=2)
    G = torch.tensor([[18.0, -22.0], [-22.0, 38.0]])
    first = W(G)
    torch.testing.assert_close(W(torch.zeros(2, 2)), first)
    torch.testing.assert_close(W.cached_weights(), first)


def test_every_one_equals_the_wrapped_weighting() -> None:
    torch.manual_seed(0)
    W = Periodic(UPGradWeighting(), every=1)
    for _ in range(3):
        J = torch.randn(4, 6, dtype=torch.float64)
        torch.testing.assert_close(W(J @ J.T), UPGradWeighting()(J @ J.T))


def test_reset_restores_first_call_behaviour() -> None:
    W = Periodic(_CountingWeighting(), every=5)
    W(torch.eye(2))
    W.reset()
    assert W.needs_gramian()
    torch.testing.assert_close(W(2 * torch.eye(2)), torch.tensor([2.0, 2.0]))
    with pytest.raises(ValueError, match="no cached weights"):
        Periodic(MeanWeighting(), every=2).cached_weights()


def test_changed_number_of_objectives_on_reuse_step_is_an_error() -> None:
    W = Periodic(MeanWeighting(), every=2)
    W(torch.eye(2))
    with pytest.raises(ValueError, match="reset"):
        W(torch.eye(3))


def test_construction_errors() -> None:
    with pytest.raises(ValueError, match="every"):
        Periodic(MeanWeighting(), every=0)
    with pytest.raises(TypeError, match="every"):
        Periodic(MeanWeighting(), every=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="GramianWeighting"):
        Periodic(object(), every=2)  # type: ignore[arg-type]
    assert repr(Periodic(MeanWeighting(), every=2)) == "Periodic(MeanWeighting(), every=2)"
    assert str(Periodic(MeanWeighting(), every=2)) == "Periodic"


def test_as_aggregator_properties_and_degenerate_inputs() -> None:
    def make() -> GramianWeightedAggregator:
        return GramianWeightedAggregator(Periodic(MeanWeighting(), every=2))

    check_claimed_properties(make)
    check_degenerate_inputs(make)


def test_reuse_steps_return_constants_under_autograd() -> None:
    """With a differentiable weighting (UPGrad's), the recomputing call's weights keep their
    graph to its Gramian; the reuse steps' are constants. They returned the weights with that
    graph, so a loss of a later step through them raised on its backward (a review's finding)."""
    j = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0], [1.0, -3.0, 0.5]], dtype=torch.float64)
    weighting = Periodic(UPGradWeighting(), every=2)
    first = (j @ j.T).requires_grad_(True)
    weights = weighting(first)
    (weights * torch.arange(3)).sum().backward()
    assert first.grad is not None and bool(first.grad.abs().sum() > 0)
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    reused = weighting((j @ j.T).requires_grad_(True))
    assert not reused.requires_grad
    torch.testing.assert_close(reused, weights.detach())
    (reused * x).sum().backward()  # (raised: backward through the first step's graph again)
    torch.testing.assert_close(x.grad, weights.detach())


def test_nonfinite_weights_are_not_reused() -> None:
    """A recomputing step on a NaN Gramian (a step a GradScaler skips) gives NaN weights, is
    not counted, and the next call recomputes: it kept the NaN weights for the next every - 1
    finite steps, all of which the scaler then skipped too."""
    inner = _CountingWeighting()
    W = Periodic(inner, every=3)
    assert bool(W(torch.full((2, 2), float("nan"))).isnan().all())
    assert W.needs_gramian()
    torch.testing.assert_close(W(torch.eye(2) * 2), torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(W(torch.eye(2) * 5), torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(W(torch.eye(2) * 7), torch.tensor([2.0, 2.0]))
    assert W.needs_gramian()


def test_skipped_reuse_step_is_not_counted() -> None:
    """A reuse step on a non-finite Gramian (a step a GradScaler skips) gives NaN weights and
    leaves the state as it was: the schedule is that of a run without that step. It was counted,
    which moved every later recomputation one step earlier (a review's finding)."""
    grams = [torch.eye(2) * (t + 1) for t in range(7)]
    bad = torch.eye(2)
    bad[0, 1] = float("inf")
    inner = _CountingWeighting()
    W = Periodic(inner, every=3)
    outs = []
    flags = []
    for t, G in enumerate(grams):
        if t in (1, 5):  # skipped steps, on reuse steps
            assert bool(W(bad).isnan().all())
            assert bool(W(torch.full((2, 2), float("nan"))).isnan().all())
        flags.append(W.needs_gramian())
        outs.append(W(G))
    for t, out in enumerate(outs):  # as in a run without the skipped steps
        torch.testing.assert_close(out, grams[3 * (t // 3)].diagonal())
    assert flags == [True, False, False, True, False, False, True]
    assert inner.calls == 3
    torch.testing.assert_close(W.cached_weights(), grams[6].diagonal())


def test_skipped_reuse_step_in_the_aggregator_keeps_the_schedule() -> None:
    """The review's reproducer: in a GramianWeightedAggregator, a Jacobian with an infinity on
    a reuse step gives a non-finite update and changes none of the later updates."""
    torch.manual_seed(0)
    j1, j2, j3 = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)
    bad = j2.clone()
    bad[0, 0] = float("inf")

    def run(with_skipped_step: bool) -> list[torch.Tensor]:
        A = GramianWeightedAggregator(Periodic(UPGradWeighting(), every=3))
        updates = [A(j1)]
        if with_skipped_step:
            assert not bool(torch.isfinite(A(bad)).all())
        updates += [A(j2), A(j3), A(j1)]
        return updates

    for expected, actual in zip(run(False), run(True), strict=True):
        torch.testing.assert_close(actual, expected)
