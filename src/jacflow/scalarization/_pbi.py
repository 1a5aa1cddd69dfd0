"""PBI: penalty-based boundary intersection."""

from __future__ import annotations

from typing import final

import torch
from torch import Tensor

from jacflow.scalarization._base import (
    Scalarizer,
    check_float,
    check_optional_tensor,
    check_tensor,
    matching,
)
from jacflow.scalarization._stch import shifted


def pbi(values: Tensor, direction: Tensor, theta: float) -> Tensor:
    """``d1 + theta * d2`` for ``values`` (already shifted by the reference) and a direction."""
    f = values.flatten()
    unit = direction.flatten() / torch.linalg.vector_norm(direction)
    d1 = f @ unit
    # The norm's gradient at a zero vector is taken as zero (a subgradient), so d2 needs no eps.
    d2 = torch.linalg.vector_norm(f - d1 * unit)
    return d1 + theta * d2


@final
class PBI(Scalarizer):
    r"""Penalty-based boundary intersection: :math:`d_1 + \theta d_2` with

    .. math::
        d_1 = (L - z^*)^\top \hat w, \qquad d_2 = \big\lVert (L - z^*) - d_1 \hat w \big\rVert,
        \qquad \hat w = w / \lVert w \rVert,

    the distance travelled along the preference direction and the distance to it.

    Paper: Q. Zhang, H. Li, *MOEA/D: A Multiobjective Evolutionary Algorithm Based on
    Decomposition*, IEEE TEVC 2007. Same names, parameters and defaults as TorchJD 0.18's
    ``PBI``. At :math:`d_2 = 0` (always the case with one loss) the gradient of :math:`d_2` is
    taken as zero, so the value is exact there (no epsilon).

    Args:
        theta: the penalty :math:`\theta \ge 0` on :math:`d_2` (the paper uses 5).
        weights: the preference direction :math:`w`, one entry per loss; resample it (e.g. from
            a Dirichlet distribution) and reassign ``pbi.weights`` to cover the Pareto front.
        reference: the ideal point :math:`z^*`, one entry per loss; ``None`` gives zero.

    Example:
        >>> import torch
        >>> from jacflow.scalarization import PBI
        >>> PBI(theta=5.0, weights=torch.tensor([1.0, 1.0]))(torch.tensor([1.0, 3.0]))
        tensor(9.8995)
    """

    def __init__(self, theta: float, weights: Tensor, reference: Tensor | None = None) -> None:
        super().__init__()
        self.theta = check_float(theta, "theta", low=0.0)
        self.weights = check_tensor(weights, "weights", "PBI")
        self.reference = check_optional_tensor(reference, "reference", "PBI")

    def forward(self, losses: Tensor, /) -> Tensor:
        direction = matching(self.weights, "weights", losses, "PBI")
        return pbi(shifted(losses, self.reference, "PBI"), direction, self.theta)

    def extra_repr(self) -> str:
        return f"theta={self.theta}, weights={self.weights!r}, reference={self.reference!r}"
