"""Every scalarizer with a valid configuration for losses of shape [3], for shared tests."""

from __future__ import annotations

import copy
from collections.abc import Callable

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


def frozen(scalarizer: Scalarizer, seed: int = 0) -> Callable[[Tensor], Tensor]:
    """A pure function of the losses: each call runs on a copy of the scalarizer's state, with
    the same random seed (for gradcheck, which evaluates many times)."""

    def call(losses: Tensor) -> Tensor:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return copy.deepcopy(scalarizer)(losses)

    return call
