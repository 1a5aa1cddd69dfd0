"""Scalarizers: combine a tensor of losses into one scalar, then call ``.backward()`` on it.

Loss-level methods weight the losses instead of the gradients: one ordinary backward pass, no
Jacobian. Every TorchJD 0.18 scalarizer is here with the same name, parameters and defaults
(:class:`Mean`, :class:`Sum`, :class:`Constant`, :class:`Random`, :class:`GeometricMean`,
:class:`STCH`, :class:`PBI`, :class:`COSMOS`, :class:`DWA`, :class:`FAMO`, :class:`IMTLL`,
:class:`UW`), plus :class:`LogSTCH`, :class:`Tchebycheff`, :class:`AugmentedTchebycheff`,
:class:`LBTW`, :class:`AdaLoss`, :class:`SoftAdapt`, :class:`ReLoBRaLo` and :class:`RevisedUW`.

Stateful methods subclass :class:`jacflow.Stateful` (``reset()``); those with a per-epoch or
per-step update expose it (``DWA.step()``, ``LogSTCH.step()``, ``LBTW.step()``,
``FAMO.update(new_losses)``); learnable ones (:class:`UW`, :class:`IMTLL`, :class:`RevisedUW`)
have parameters to give to the optimizer.

Example:
    >>> import torch
    >>> from jacflow.scalarization import UW
    >>> model = torch.nn.Linear(3, 2)
    >>> uw = UW(2)
    >>> optimizer = torch.optim.SGD([*model.parameters(), *uw.parameters()], lr=0.1)
    >>> losses = model(torch.ones(4, 3)).pow(2).mean(dim=0)  # one loss per output
    >>> optimizer.zero_grad()
    >>> uw(losses).backward()
    >>> optimizer.step()
    >>> uw.log_var.grad.shape
    torch.Size([2])
"""

from jacflow.scalarization._adaloss import AdaLoss
from jacflow.scalarization._base import Scalarizer
from jacflow.scalarization._constant import Constant
from jacflow.scalarization._cosmos import COSMOS
from jacflow.scalarization._dwa import DWA
from jacflow.scalarization._famo import FAMO
from jacflow.scalarization._geometric_mean import GeometricMean
from jacflow.scalarization._imtl_l import IMTLL
from jacflow.scalarization._lbtw import LBTW
from jacflow.scalarization._log_stch import LogSTCH
from jacflow.scalarization._mean import Mean
from jacflow.scalarization._pbi import PBI
from jacflow.scalarization._random import Random
from jacflow.scalarization._relobralo import ReLoBRaLo
from jacflow.scalarization._softadapt import SoftAdapt
from jacflow.scalarization._stch import STCH
from jacflow.scalarization._sum import Sum
from jacflow.scalarization._tchebycheff import AugmentedTchebycheff, Tchebycheff
from jacflow.scalarization._uw import UW, RevisedUW

__all__ = [
    "COSMOS",
    "DWA",
    "FAMO",
    "IMTLL",
    "LBTW",
    "PBI",
    "STCH",
    "UW",
    "AdaLoss",
    "AugmentedTchebycheff",
    "Constant",
    "GeometricMean",
    "LogSTCH",
    "Mean",
    "Random",
    "ReLoBRaLo",
    "RevisedUW",
    "Scalarizer",
    "SoftAdapt",
    "Sum",
    "Tchebycheff",
]
