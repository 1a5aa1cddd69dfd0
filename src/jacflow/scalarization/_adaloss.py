"""AdaLoss: weights inversely proportional to the running average of each loss."""

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
    on_losses,
)


@final
class AdaLoss(SavesState, Scalarizer, Stateful):
    r"""AdaLoss: :math:`\sum_i L_i / (\bar L_i + \epsilon)`, where :math:`\bar L_i` is an
    exponential moving average of :math:`L_i` (no gradient through the weights).

    .. math::
        \bar L_i \leftarrow \beta \bar L_i + (1 - \beta) L_i \quad
        (\bar L_i = L_i \text{ at the first call}),

    updated before the weights are computed. This is gradient descent on
    :math:`\sum_i \log L_i` with each loss replaced by its running average in the denominator:
    every task's relative improvement counts the same, whatever its scale.

    Paper: H. Hu, D. Dey, M. Hebert, J. A. Bagnell, *Learning Anytime Predictions in Neural
    Networks via Adaptive Loss Balancing*, AAAI 2019 (arXiv 1708.06832).

    State: the running averages :math:`\bar L`; each call is one step. A call in evaluation mode
    (``ada.eval()``) divides by the averages as they are, without adding its losses (as
    ``BatchNorm`` uses its running statistics; by the losses themselves before any training call).
    :meth:`reset` forgets them. A NaN or infinite loss gives a non-finite value and leaves the state
    untouched (so a step that an AMP ``GradScaler`` skips does not poison it).

    The running averages are kept, and the weights and the value computed, in float32 for
    float16 or bfloat16 losses (float16 reads :math:`\epsilon = 10^{-8}` as 0, and
    :math:`1 / \bar L_i` overflows its largest value 65504 for an average below about
    :math:`1.5 \cdot 10^{-5}`), in their dtype otherwise; the value is then rounded to the
    losses' dtype. A weight above that dtype's largest value gives that largest value as the
    gradient of its loss (not ``inf``, which times a zero gradient of that loss would make the
    parameters' gradients NaN).

    Args:
        momentum: :math:`\beta \in [0, 1)`; 0 uses the current losses only.
        eps: :math:`\epsilon \ge 0`, keeps the weights finite for a zero average.

    Example:
        >>> import torch
        >>> from jacflow.scalarization import AdaLoss
        >>> ada = AdaLoss(momentum=0.5)
        >>> ada(torch.tensor([1.0, 10.0]))  # each loss over itself
        tensor(2.)
        >>> ada(torch.tensor([3.0, 10.0]))  # averages [2, 10]: 3 / 2 + 10 / 10
        tensor(2.5000)
    """

    momentum = Hyperparameter(floats(low=0.0, high=1.0, high_open=True))
    eps = Hyperparameter(floats(low=0.0))

    saved_state = ("_average",)

    reads_losses = True

    def __init__(self, momentum: float = 0.9, eps: float = 1e-8) -> None:
        super().__init__()
        self.momentum = momentum
        self.eps = eps
        self._average: Tensor | None = None

    def forward(self, losses: Tensor, /) -> Tensor:
        # (a negative average gives a negative weight: the step would ascend that loss)
        check_non_negative(losses, "AdaLoss", "Shift the losses, e.g. by a lower bound.")
        # (float32 at least: float16 reads eps = 1e-8 as 0, 1 / 1e-5 overflows it, and its
        # running average of small losses would be subnormal, i.e. rounded)
        wide = losses.to(compute_dtype(losses.dtype))
        detached = wide.detach()
        if self._average is not None:
            check_same_shape(self._average, losses, "AdaLoss")
        kept = self._average
        if kept is not None:  # (on the losses' device, in its own dtype: not rounded)
            kept = on_losses(kept, losses, kept.dtype)
        # (an evaluation call or a skipped step: state unchanged, the kept average used as it is)
        if not self.training or has_nonfinite(detached):
            average = detached if kept is None else kept
        elif kept is None:
            average = self._average = detached.clone()
        else:
            average = self._average = self.momentum * kept + (1 - self.momentum) * detached
        weights = 1.0 / (on_losses(average, wide) + self.eps)
        # (the gradient of each loss, its weight, rounded to the losses' dtype: finite)
        graded = weights.clamp(max=torch.finfo(losses.dtype).max)
        value = (graded * wide).sum() + ((weights - graded) * detached).sum()
        return value.to(losses.dtype)

    def reset(self) -> None:
        self._average = None

    def extra_repr(self) -> str:
        return f"momentum={self.momentum}, eps={self.eps}"
