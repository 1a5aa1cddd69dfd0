"""Aggregator names for the command line, built at run time from ``jacflow.aggregation``.

Every concrete :class:`~jacflow.aggregation.Aggregator` exported in
``jacflow.aggregation.__all__`` is available under its lower-case class name. Constructors with
required arguments get defaults from :data:`DEFAULTS` (a function of the number of objectives
``m``); classes whose required arguments have no default here (wrappers that take another
aggregator, for instance) are not offered.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from jacflow import aggregation
from jacflow.aggregation import (
    Aggregator,
    GramianWeightedAggregator,
    Mean,
    MeanWeighting,
    Sum,
    SumWeighting,
    WeightedAggregator,
)
from jacflow.cli._errors import CLIError

_Kwargs = Callable[[int], dict[str, Any]]


def _krum(m: int) -> dict[str, Any]:
    if m < 3:
        raise CLIError(f"krum needs at least 3 objectives (received {m}).")
    return {"n_byzantine": (m - 3) // 2}


def _trimmed_mean(m: int) -> dict[str, Any]:
    if m < 3:
        raise CLIError(f"trimmedmean needs at least 3 objectives (received {m}).")
    return {"trim_number": (m - 1) // 2 if m < 5 else 1}


DEFAULTS: dict[str, _Kwargs] = {
    "constant": lambda m: {"weights": torch.full((m,), 1.0 / m)},
    "nashmtl": lambda m: {"n_tasks": m},
    "cagrad": lambda m: {"c": 0.5},
    "fairgrad": lambda m: {"alpha": 1.0},
    "krum": _krum,
    "trimmedmean": _trimmed_mean,
    "epo": lambda m: {"preference": torch.ones(m)},
    "auxinash": lambda m: {"preferences": torch.ones(m)},
}
"""Arguments for constructors whose parameters have no default, by lower-case name."""

_BASES = (Aggregator, WeightedAggregator, GramianWeightedAggregator)


def _required_parameters(cls: type) -> list[str]:
    signature = inspect.signature(cls)
    return [
        name
        for name, parameter in signature.parameters.items()
        if parameter.default is inspect.Parameter.empty
        and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]


def aggregator_classes() -> dict[str, type[Aggregator]]:
    """The aggregators offered by the command line, by lower-case name.

    Example:
        >>> from jacflow.cli._registry import aggregator_classes
        >>> classes = aggregator_classes()
        >>> classes["upgrad"].__name__, "aggregator" in classes
        ('UPGrad', False)
    """
    classes: dict[str, type[Aggregator]] = {}
    for name in aggregation.__all__:
        cls = getattr(aggregation, name, None)
        if not (inspect.isclass(cls) and issubclass(cls, Aggregator)):
            continue
        if cls in _BASES or inspect.isabstract(cls):
            continue
        key = name.lower()
        if key not in DEFAULTS and _required_parameters(cls):
            continue
        classes[key] = cls
    return classes


def aggregator_key(name: str) -> str:
    """The lower-case name of the command line's aggregator called ``name``.

    Raises:
        CLIError: for an unknown name (listing the valid ones), a list of names included.

    Example:
        >>> from jacflow.cli._registry import aggregator_key
        >>> aggregator_key(" UPGrad ")
        'upgrad'
        >>> aggregator_key("upgrad,mgda")
        Traceback (most recent call last):
        ...
        jacflow.cli._errors.CLIError: unknown aggregator 'upgrad,mgda'. Valid names: ...
    """
    key = name.strip().lower()
    classes = aggregator_classes()
    if key not in classes:
        raise CLIError(f"unknown aggregator {name!r}. Valid names: {', '.join(sorted(classes))}.")
    return key


def make_aggregator(name: str, m: int) -> Aggregator:
    """Construct the aggregator called ``name`` for ``m`` objectives.

    ``mean`` and ``sum`` are built as Gramian-weighted aggregators (the same update) so that the
    monitor sees the Gramian of every step.

    Raises:
        CLIError: for an unknown name (listing the valid ones), a constructor that rejects the
            defaults, or a missing optional dependency.

    Example:
        >>> from jacflow.cli._registry import make_aggregator
        >>> type(make_aggregator("UPGrad", 3)).__name__
        'UPGrad'
        >>> make_aggregator("nope", 3)
        Traceback (most recent call last):
        ...
        jacflow.cli._errors.CLIError: unknown aggregator 'nope'. Valid names: ...
    """
    key = aggregator_key(name)
    cls = aggregator_classes()[key]
    if cls is Mean:
        return GramianWeightedAggregator(MeanWeighting())
    if cls is Sum:
        return GramianWeightedAggregator(SumWeighting())
    kwargs = DEFAULTS[key](m) if key in DEFAULTS else {}
    try:
        return cls(**kwargs)
    except ImportError as error:
        raise CLIError(f"aggregator {name!r} is unavailable: {error}") from error
    except (TypeError, ValueError) as error:
        raise CLIError(f"cannot build aggregator {name!r} for {m} objectives: {error}") from error
