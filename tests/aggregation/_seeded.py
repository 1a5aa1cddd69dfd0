"""Factories that make random or stateful methods reproducible call by call, for property checks.

A property such as "linear under scaling" compares several calls; for a method that draws random
numbers (Random, PCGrad, GradVac, GradDrop) or keeps state (GradVac) it is a claim about one
draw and one state. ``seeded(make)`` reseeds torch's global RNG (and optionally resets the state)
right before every call of the module that draws, so that all calls see the same draw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from jacflow import Stateful
from jacflow.aggregation import Aggregator, GramianWeightedAggregator

A = TypeVar("A", bound=Aggregator)


def seeded(make: Callable[[], A], seed: int = 0, reset: bool = False) -> Callable[[], A]:
    """``make`` whose aggregators reseed (and reset, if asked) before each weighting call."""

    def factory() -> A:
        aggregator = make()
        target: nn.Module = (
            aggregator.gramian_weighting
            if isinstance(aggregator, GramianWeightedAggregator)
            else aggregator
        )

        def hook(module: nn.Module, args: Any) -> None:
            torch.manual_seed(seed)
            if reset and isinstance(module, Stateful):
                module.reset()

        target.register_forward_pre_hook(hook)
        return aggregator

    factory.__name__ = getattr(make, "__name__", "factory")
    return factory
