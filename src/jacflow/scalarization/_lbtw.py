"""LBTW: loss-balanced task weighting."""

from __future__ import annotations

from typing import final

import torch
from torch import Tensor

from jacflow._stateful import SavesState, Stateful
from jacflow.aggregation._bases import compute_dtype
from jacflow.aggregation._nonfinite import has_nonfinite
from jacflow.scalarization._base import (
    Hyperparameter,
    Scalarizer,
    check_non_negative,
    check_same_shape,
    floats,
    loss_ratio,
    on_losses,
)


def lbtw_weights(losses: Tensor, initial: Tensor, alpha: float) -> Tensor:
    """``(losses / initial) ** alpha``, with ``0 / 0`` taken as 1."""
    return loss_ratio(losses, initial) ** alpha


@final
class LBTW(SavesState, Scalarizer, Stateful):
    r"""Loss-balanced task weighting: :math:`\sum_i w_i L_i` with
    :math:`w_i = \big(L_i / L_i^{(0)}\big)^{\alpha}` (no gradient through :math:`w`).

    A task whose loss has already dropped a lot relative to its initial value
    :math:`L_i^{(0)}` gets a small weight, which limits negative transfer to the others.

    Paper: S. Liu, Y. Liang, A. Gitter, *Loss-Balanced Task Weighting to Reduce Negative
    Transfer in Multi-Task Learning*, AAAI 2019 (student abstract). In the paper
    :math:`L^{(0)}` is the loss of the first batch of each epoch: call :meth:`step` at the end
    of each epoch for that behaviour; without it :math:`L^{(0)}` is the first batch of training.

    State: :math:`L^{(0)}`, taken from the first call in training mode after construction,
    :meth:`step` or :meth:`reset`. A call in evaluation mode (``lbtw.eval()``) weights its losses
    against that reference (weights 1 while there is none) and never becomes it. The first call's
    weights are 1 by definition (:math:`L = L^{(0)}`), even for a zero loss; later, a loss that is 0
    with :math:`L_i^{(0)} = 0` has weight 1 (0/0 taken as 1: no change), and a positive one an
    infinite weight when :math:`\alpha > 0` (infinite relative growth: call :meth:`step` to take a
    new reference). A NaN or infinite loss gives a non-finite value and is not taken as
    :math:`L^{(0)}` (so a step that an AMP ``GradScaler`` skips does not poison the state).

    The weights are computed, and :math:`L^{(0)}` kept, in float32 for float16 or bfloat16
    losses (a float16 ratio above 65504 is infinite), in their dtype otherwise; the value is
    then rounded to the losses' dtype.

    Args:
        alpha: the exponent :math:`\alpha \ge 0` (the paper uses 0.1 and 0.5; 0 is the sum).

    Example:
        >>> import torch
        >>> from jacflow.scalarization import LBTW
        >>> lbtw = LBTW(alpha=0.5)
        >>> lbtw(torch.tensor([4.0, 2.0]))  # first call: weights 1
        tensor(6.)
        >>> lbtw(torch.tensor([1.0, 2.0]))  # weights sqrt(1/4), sqrt(2/2)
        tensor(2.5000)
    """

    alpha = Hyperparameter(floats(low=0.0))

    saved_state = ("_initial",)

    reads_losses = True

    def __init__(self, alpha: float = 0.5) -> None:
        super().__init__()
        self.alpha = alpha
        self._initial: Tensor | None = None

    def forward(self, losses: Tensor, /) -> Tensor:
        # (a negative ratio's power is NaN)
        check_non_negative(losses, "LBTW", "Shift the losses, e.g. by a lower bound.")
        # (float32 at least: a float16 ratio L / L(0) above 65504 is inf, e.g. 100 / 1e-3, whose
        # power is then an infinite weight, and a bfloat16 ratio keeps 3 significant digits)
        wide = losses.to(compute_dtype(losses.dtype))
        detached = wide.detach()
        if self._initial is None:
            # (else: an evaluation call or a skipped step, no reference taken)
            if self.training and not has_nonfinite(detached):
                self._initial = detached.clone()
            weights = torch.ones_like(detached)  # L = L(0): weights 1 by definition
        else:
            check_same_shape(self._initial, losses, "LBTW")
            weights = lbtw_weights(detached, on_losses(self._initial, wide), self.alpha)
        return (weights * wide).sum().to(losses.dtype)

    def step(self) -> None:
        """End the epoch: the next call's losses become the new :math:`L^{(0)}`."""
        self._initial = None

    def reset(self) -> None:
        self._initial = None

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}"
