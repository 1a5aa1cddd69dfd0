"""PBI: penalty-based boundary intersection."""

from __future__ import annotations

from typing import final

import torch
from torch import Tensor

from jacflow.scalarization._base import (
    Hyperparameter,
    Scalarizer,
    check_tensor,
    floats,
    matching,
    optional_tensors,
)
from jacflow.scalarization._stch import shifted


def pbi(values: Tensor, direction: Tensor, theta: float) -> Tensor:
    """``d1 + theta * d2`` for ``values`` (already shifted by the reference) and a direction."""
    f = values.flatten()
    # (scaled to a largest entry of 1 first: the norm of a tiny direction underflows to 0)
    scaled = direction.flatten() / direction.abs().amax()
    unit = scaled / torch.linalg.vector_norm(scaled)
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
            It must be finite and not all zero (checked at construction and on assignment).
        reference: the ideal point :math:`z^*`, one entry per loss; ``None`` gives zero.

    Example:
        >>> import torch
        >>> from jacflow.scalarization import PBI
        >>> PBI(theta=5.0, weights=torch.tensor([1.0, 1.0]))(torch.tensor([1.0, 3.0]))
        tensor(9.8995)
        >>> PBI(theta=5.0, weights=torch.zeros(2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: PBI: `weights` (the preference direction) must be finite and not all zero ...
    """

    theta = Hyperparameter(floats(low=0.0))
    reference = Hyperparameter(optional_tensors("PBI"))

    def __init__(self, theta: float, weights: Tensor, reference: Tensor | None = None) -> None:
        super().__init__()
        self.theta = theta
        self.weights = weights
        self.reference = reference

    @property
    def weights(self) -> Tensor:
        """The preference direction :math:`w` (checked on assignment: finite and not zero)."""
        return self._weights

    @weights.setter
    def weights(self, value: Tensor) -> None:
        direction = check_tensor(value, "weights", "PBI")
        if not bool((direction != 0).any()):  # (finite: checked by `check_tensor`)
            raise ValueError(
                "PBI: `weights` (the preference direction) must be finite and not all zero "
                f"(its norm divides it), received {direction.detach().flatten().tolist()[:8]}. "
                "Give a non-zero direction, e.g. `torch.ones(m)` or a Dirichlet sample."
            )
        self._weights = direction

    def forward(self, losses: Tensor, /) -> Tensor:
        direction = matching(self.weights, "weights", losses, "PBI")
        return pbi(shifted(losses, self.reference, "PBI"), direction, self.theta)

    def extra_repr(self) -> str:
        return f"theta={self.theta}, weights={self.weights!r}, reference={self.reference!r}"
