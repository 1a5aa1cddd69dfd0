"""Run the shared property checks on methods that read the losses (:class:`LossAware`).

The shared checks call an aggregator on Jacobians of any number of rows ``m``; a loss-aware
method needs ``m`` losses first. :func:`with_losses` wraps a factory so that every call first
feeds ``losses_for(m)`` (fixed positive values) to the method, and keeps its property claims.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor

from jacflow import Stateful
from jacflow.aggregation import (
    Aggregator,
    GramianWeightedAggregator,
    LossAware,
    WeightedAggregator,
)


def loss_target(aggregator: Aggregator) -> LossAware:
    """The object that takes the losses: the aggregator, or the weighting it wraps (the Gramian
    weighting of a Gramian-based aggregator)."""
    if isinstance(aggregator, LossAware):
        return aggregator
    assert isinstance(aggregator, WeightedAggregator)
    weighting = (
        aggregator.gramian_weighting
        if isinstance(aggregator, GramianWeightedAggregator)
        else aggregator.weighting
    )
    assert isinstance(weighting, LossAware)
    return weighting


def losses_for(m: int) -> Tensor:
    """``m`` distinct positive losses, the same for every call with the same ``m``."""
    return torch.linspace(0.5, 2.0, m) if m > 1 else torch.ones(m)


class _FeedLosses(Aggregator):
    def __init__(self, inner: Aggregator) -> None:
        super().__init__()
        self.inner = inner

    @property
    def differentiable(self) -> bool:
        return self.inner.differentiable

    def forward(self, matrix: Tensor) -> Tensor:
        loss_target(self.inner).set_losses(losses_for(matrix.shape[0]))
        return self.inner(matrix)


class _FeedLossesWeighted(WeightedAggregator):
    def __init__(self, inner: WeightedAggregator) -> None:
        super().__init__(inner.weighting)
        self.inner = inner

    def weights(self, matrix: Tensor) -> Tensor:
        # A stateful method advances its state on every call: read the weights of a copy so
        # that the next call (the aggregation checked against these weights) sees the same state.
        inner = copy.deepcopy(self.inner) if isinstance(self.inner, Stateful) else self.inner
        loss_target(inner).set_losses(losses_for(matrix.shape[0]))
        return inner.weights(matrix)

    def forward(self, matrix: Tensor) -> Tensor:
        loss_target(self.inner).set_losses(losses_for(matrix.shape[0]))
        return self.inner(matrix)


def with_losses(make: Callable[[], Aggregator]) -> Callable[[], Aggregator]:
    """A factory of ``make()`` wrapped to receive ``losses_for(m)`` before each call."""
    cls = type(make())
    base = _FeedLossesWeighted if issubclass(cls, WeightedAggregator) else _FeedLosses
    wrapper = type(f"{cls.__name__}WithLosses", (base,), {"properties": cls.properties})

    def factory() -> Aggregator:
        return wrapper(make())  # type: ignore[no-any-return]

    return factory
