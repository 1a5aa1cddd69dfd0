"""UW: uncertainty weighting, and its revised regulariser."""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import torch
from torch import Tensor, nn

from jacflow._stateful import Stateful
from jacflow.scalarization._base import (
    Scalarizer,
    check_built_shape,
    check_shape,
)


@final
class UW(Scalarizer, Stateful):
    r"""Uncertainty weighting: :math:`\sum_i \big(\tfrac12 e^{-s_i} L_i + \tfrac12 s_i\big)`,
    with learnable log-variances :math:`s_i = \log \sigma_i^2`.

    The negative log-likelihood of Gaussian outputs with a learned noise per task; at its
    minimum over :math:`s`, :math:`\sigma_i^2 = L_i`, so every loss gets weight
    :math:`1 / (2 L_i)`.

    Paper: A. Kendall, Y. Gal, R. Cipolla, *Multi-Task Learning Using Uncertainty to Weigh Losses
    for Scene Geometry and Semantics*, CVPR 2018 (arXiv 1705.07115). Same names, parameters and
    defaults as TorchJD 0.18's ``UW`` (:math:`s` starts at 0; LibMTL starts at -0.5). See
    :class:`RevisedUW` for Liebel & Körner's regulariser.

    State: the parameter ``log_var``; pass ``uw.parameters()`` to the optimizer. It follows the
    losses' device and float32/float64 dtype until the first call in training mode (or a loaded
    ``state_dict``), and keeps them after that: a call on losses of another dtype computes in the
    wider one, and losses on another device raise (move it with ``.to(device)``; see
    :class:`Scalarizer`). :meth:`reset` sets it to 0 and keeps the shape ``UW`` was built for: for
    another number of losses, build a new ``UW`` and give its parameters to the optimizer.

    Args:
        shape: the shape of the losses (an ``int`` ``m`` means ``(m,)``).

    Example:
        >>> import torch
        >>> from jacflow.scalarization import UW
        >>> uw = UW(2)
        >>> model = torch.nn.Linear(3, 2)
        >>> optimizer = torch.optim.SGD([*model.parameters(), *uw.parameters()], lr=0.1)
        >>> uw(torch.tensor([1.0, 3.0]))  # (1 + 3) / 2 at s = 0
        tensor(2., grad_fn=<SumBackward0>)
    """

    def __init__(self, shape: int | Sequence[int]) -> None:
        super().__init__()
        self.log_var = nn.Parameter(torch.zeros(check_shape(shape, "UW")))

    def forward(self, losses: Tensor, /) -> Tensor:
        check_built_shape(self.log_var.shape, losses, "UW")
        self.follow([self.log_var], losses)
        return (0.5 * torch.exp(-self.log_var) * losses + 0.5 * self.log_var).sum()

    def reset(self) -> None:
        with torch.no_grad():
            self.log_var.zero_()

    def extra_repr(self) -> str:
        return f"shape={tuple(self.log_var.shape)}"


@final
class RevisedUW(Scalarizer, Stateful):
    r"""Revised uncertainty weighting, with learnable :math:`\sigma`:
    :math:`\sum_i \Big(\frac{L_i}{2\sigma_i^2} + \ln(1 + \sigma_i^2)\Big)`.

    Replaces the :math:`\ln \sigma_i^2` regulariser of :class:`UW` by
    :math:`\ln(1 + \sigma_i^2) \ge 0`, so the objective stays non-negative for non-negative
    losses and a task can no longer lower it by letting :math:`\sigma_i \to 0` through a
    negative regulariser. At the minimum over :math:`\sigma_i^2`,
    :math:`2\sigma_i^4 = L_i (1 + \sigma_i^2)`.

    Paper: L. Liebel, M. Körner, *Auxiliary Tasks in Multi-task Learning*, arXiv 1805.06334,
    2018. :math:`\sigma` itself is the parameter (as in the paper), initialised to 1.

    State: the parameter ``sigma``; pass ``ruw.parameters()`` to the optimizer. It follows the
    losses' device and float32/float64 dtype until the first call in training mode (or a loaded
    ``state_dict``), and keeps them after that: a call on losses of another dtype computes in the
    wider one, and losses on another device raise (move it with ``.to(device)``; see
    :class:`Scalarizer`). :meth:`reset` sets it to 1 and keeps the shape ``RevisedUW`` was built
    for: for another number of losses, build a new one and give its parameters to the optimizer.

    Args:
        shape: the shape of the losses (an ``int`` ``m`` means ``(m,)``).

    Example:
        >>> import torch
        >>> from jacflow.scalarization import RevisedUW
        >>> RevisedUW(2)(torch.tensor([1.0, 3.0]))  # (1 + 3) / 2 + 2 ln 2
        tensor(3.3863, grad_fn=<SumBackward0>)
    """

    def __init__(self, shape: int | Sequence[int]) -> None:
        super().__init__()
        self.sigma = nn.Parameter(torch.ones(check_shape(shape, "RevisedUW")))

    def forward(self, losses: Tensor, /) -> Tensor:
        check_built_shape(self.sigma.shape, losses, "RevisedUW")
        self.follow([self.sigma], losses)
        variance = self.sigma**2
        return (losses / (2 * variance) + torch.log1p(variance)).sum()

    def reset(self) -> None:
        with torch.no_grad():
            self.sigma.fill_(1.0)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.sigma.shape)}"
