"""Tchebycheff scalarization and its augmented form."""

from __future__ import annotations

from typing import final

import torch
from torch import Tensor

from jacflow.scalarization._base import (
    Hyperparameter,
    Scalarizer,
    floats,
    optional_tensors,
)
from jacflow.scalarization._stch import preference, shifted


def tchebycheff(losses: Tensor, weights: Tensor, reference: Tensor | None, owner: str) -> Tensor:
    """``max_i weights_i * (losses_i - reference_i)``; ties share the gradient equally."""
    return torch.amax(weights * shifted(losses, reference, owner))


@final
class Tchebycheff(Scalarizer):
    r"""Weighted Tchebycheff scalarization: :math:`\max_i \lambda_i (L_i - z_i^*)`.

    Every Pareto-optimal point minimises it for some preference :math:`\lambda` (also on
    non-convex fronts, unlike a weighted sum). It is not differentiable where two terms tie;
    there the gradient is shared equally between the tied losses. :class:`STCH` is its smooth
    approximation. The reference :math:`z^*` should lie below the losses (an ideal point), as
    in the STCH paper's definition; no absolute value is taken.

    Paper: Q. Zhang, H. Li, *MOEA/D: A Multiobjective Evolutionary Algorithm Based on
    Decomposition*, IEEE TEVC 2007 (the Tchebycheff approach of MOEA/D).

    Args:
        weights: the preference :math:`\lambda`, one entry per loss; ``None`` gives ``1/m`` each
            (the default of :class:`STCH`, so that ``STCH(mu)`` tends to ``Tchebycheff()``).
        reference: the ideal point :math:`z^*`, one entry per loss; ``None`` gives zero.

    Example:
        >>> import torch
        >>> from jacflow.scalarization import Tchebycheff
        >>> Tchebycheff(weights=torch.tensor([0.8, 0.2]))(torch.tensor([1.0, 3.0]))
        tensor(0.8000)
    """

    weights = Hyperparameter(optional_tensors("Tchebycheff"))
    reference = Hyperparameter(optional_tensors("Tchebycheff"))

    def __init__(self, weights: Tensor | None = None, reference: Tensor | None = None) -> None:
        super().__init__()
        self.weights = weights
        self.reference = reference

    def forward(self, losses: Tensor, /) -> Tensor:
        lambda_ = preference(self.weights, losses, "Tchebycheff")
        return tchebycheff(losses, lambda_, self.reference, "Tchebycheff")

    def extra_repr(self) -> str:
        return f"weights={self.weights!r}, reference={self.reference!r}"


@final
class AugmentedTchebycheff(Scalarizer):
    r"""Augmented Tchebycheff scalarization:

    .. math::
        \max_i \lambda_i (L_i - z_i^*) + \rho \sum_i (L_i - z_i^*).

    The small linear term (:math:`\rho > 0`) makes every minimiser Pareto optimal (the plain
    Tchebycheff scalarization may return weakly Pareto-optimal points) and gives every loss a
    gradient.

    Paper: R. E. Steuer, E.-U. Choo, *An Interactive Weighted Tchebycheff Procedure for Multiple
    Objective Programming*, Mathematical Programming 26, 1983.

    Args:
        rho: the augmentation coefficient :math:`\rho \ge 0` (typically small, e.g. ``1e-3``;
            ``0`` gives :class:`Tchebycheff` on finite losses; a ``-inf`` loss gives NaN here,
            through ``0 * -inf``, where the maximum alone stays finite).
        weights: the preference :math:`\lambda`, one entry per loss; ``None`` gives ``1/m``.
        reference: the ideal point :math:`z^*`, one entry per loss; ``None`` gives zero.

    Example:
        >>> import torch
        >>> from jacflow.scalarization import AugmentedTchebycheff
        >>> AugmentedTchebycheff(rho=0.1)(torch.tensor([1.0, 3.0]))
        tensor(1.9000)
    """

    rho = Hyperparameter(floats(low=0.0))
    weights = Hyperparameter(optional_tensors("AugmentedTchebycheff"))
    reference = Hyperparameter(optional_tensors("AugmentedTchebycheff"))

    def __init__(
        self, rho: float, weights: Tensor | None = None, reference: Tensor | None = None
    ) -> None:
        super().__init__()
        self.rho = rho
        self.weights = weights
        self.reference = reference

    def forward(self, losses: Tensor, /) -> Tensor:
        owner = "AugmentedTchebycheff"
        lambda_ = preference(self.weights, losses, owner)
        worst = tchebycheff(losses, lambda_, self.reference, owner)
        return worst + self.rho * shifted(losses, self.reference, owner).sum()

    def extra_repr(self) -> str:
        return f"rho={self.rho}, weights={self.weights!r}, reference={self.reference!r}"
