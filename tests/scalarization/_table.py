"""Every scalarizer with a valid configuration for losses of shape [3], for shared tests."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from jacflow import Stateful
from jacflow.scalarization import (
    COSMOS,
    DWA,
    FAMO,
    IMTLL,
    LBTW,
    PBI,
    STCH,
    UW,
    AdaLoss,
    AugmentedTchebycheff,
    Constant,
    GeometricMean,
    LogSTCH,
    Mean,
    Random,
    ReLoBRaLo,
    RevisedUW,
    Scalarizer,
    SoftAdapt,
    Sum,
    Tchebycheff,
)

M = 3
_W = torch.tensor([0.2, 0.3, 0.5])
_Z = torch.tensor([0.1, 0.0, 0.2])

FACTORIES: dict[str, Callable[[], Scalarizer]] = {
    "Mean": Mean,
    "Sum": Sum,
    "Constant": lambda: Constant(_W),
    "Random": Random,
    "GeometricMean": GeometricMean,
    "STCH": lambda: STCH(0.3, weights=_W, reference=_Z),
    "Tchebycheff": lambda: Tchebycheff(weights=_W),
    "AugmentedTchebycheff": lambda: AugmentedTchebycheff(0.1, weights=_W),
    "PBI": lambda: PBI(5.0, weights=_W, reference=_Z),
    "COSMOS": lambda: COSMOS(2.0, weights=_W),
    "DWA": DWA,
    "FAMO": lambda: FAMO(M),
    "IMTLL": lambda: IMTLL(M),
    "UW": lambda: UW(M),
    "RevisedUW": lambda: RevisedUW(M),
    "LogSTCH": lambda: LogSTCH(0.5, warmup_epochs=0),
    "LBTW": LBTW,
    "AdaLoss": AdaLoss,
    "SoftAdapt": SoftAdapt,
    "ReLoBRaLo": ReLoBRaLo,
}

# Methods whose output is a differentiable function of the current losses (their weights come
# from earlier calls, parameters or constants); the others stop the gradient through weights
# computed from the current losses, and their tests check that gradient against the weights.
DIFFERENTIABLE = [
    "Mean",
    "Sum",
    "Constant",
    "Random",
    "GeometricMean",
    "STCH",
    "Tchebycheff",
    "AugmentedTchebycheff",
    "PBI",
    "COSMOS",
    "DWA",
    "IMTLL",
    "UW",
    "RevisedUW",
    "LogSTCH",
]
STATEFUL = [name for name, make in FACTORIES.items() if isinstance(make(), Stateful)]


def assert_same_state(state: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Two ``state_dict`` s hold the same values: tensors equal in dtype, device and value, the
    extra state's attributes (tensors, lists of tensors, numbers, ``None``) as well."""
    assert state.keys() == expected.keys()
    for key, value in state.items():
        _assert_same(value, expected[key], key)


def _assert_same(value: object, expected: object, where: str) -> None:
    if isinstance(expected, Tensor):
        assert isinstance(value, Tensor), where
        assert value.dtype == expected.dtype and value.device == expected.device, where
        assert torch.equal(value, expected), where
    elif isinstance(expected, (dict, list, tuple)):
        assert type(value) is type(expected) and len(value) == len(expected), where  # type: ignore[arg-type]
        pairs = expected.items() if isinstance(expected, dict) else enumerate(expected)
        for key, item in pairs:
            _assert_same(value[key], item, f"{where}.{key}")  # type: ignore[index]
    else:
        assert value == expected, where


def frozen(scalarizer: Scalarizer, seed: int = 0) -> Callable[[Tensor], Tensor]:
    """A pure function of the losses: each call runs on a copy of the scalarizer's state, with
    the same random seed (for gradcheck, which evaluates many times)."""

    def call(losses: Tensor) -> Tensor:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return copy.deepcopy(scalarizer)(losses)

    return call
