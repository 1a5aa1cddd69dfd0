"""SoftAdapt: softmax of the losses' rates of change."""

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
    check_bool,
    check_non_negative,
    check_same_shape,
    floats,
    on_losses,
)

_SLOPE_FLOOR = 1e-8


def softadapt_weights(
    losses: Tensor, slopes: Tensor, beta: float, normalized: bool, loss_weighted: bool
) -> Tensor:
    """SoftAdapt's weights (summing to 1) from the current losses and their slopes."""
    s = slopes.flatten()
    if normalized:
        s = s / s.abs().sum().clamp_min(_SLOPE_FLOOR)
    logits = beta * s
    # (shifted by their largest, which the softmax does not see, so that finite slopes whose
    # beta * s overflows to inf give the softmax's limit, the largest sharing 1, not inf - inf)
    top = logits.amax()
    weights = torch.softmax(torch.where(logits == top, 0.0, logits - top), dim=0)
    if loss_weighted:
        scaled = losses.flatten() * weights
        total = scaled.sum()
        # (every loss zero: the losses carry no weight information; softmax(beta s) sums to 1)
        weights = torch.where(total != 0, scaled / total, weights)
    return weights.reshape(losses.shape)


@final
class SoftAdapt(SavesState, Scalarizer, Stateful):
    r"""SoftAdapt: :math:`\sum_i \alpha_i L_i` with
    :math:`\alpha = \mathrm{softmax}(\beta s)`, where
    :math:`s_i = L_i(t) - L_i(t-1)` is the rate of change of loss :math:`i` since the last call.

    With :math:`\beta > 0` the losses that decrease slowest (or grow) get the largest weights.
    Two variants of the paper are options and combine:

    * ``normalized=True``: :math:`s \leftarrow s / \max(\lVert s \rVert_1, 10^{-8})`;
    * ``loss_weighted=True``:
      :math:`\alpha_i = L_i e^{\beta s_i} / \sum_j L_j e^{\beta s_j}`.

    The weights sum to 1 and carry no gradient; at the first call :math:`s = 0`. With
    ``loss_weighted=True`` and every loss zero, the weights are :math:`\mathrm{softmax}(\beta s)`.
    The slopes are differences, defined for losses of any sign; ``loss_weighted=True`` multiplies
    by the losses themselves, so it refuses a negative loss with a ``ValueError`` (the weight
    would be negative: the step would ascend that loss).

    Paper: A. A. Heydari, C. A. Thompson, A. Mehmood, *SoftAdapt: Techniques for Adaptive Loss
    Weighting of Neural Networks with Multi-Part Loss Functions*, arXiv 1912.12355, 2019. The
    slope is the first-order finite difference between consecutive calls.

    The weights are computed in float32 for float16 or bfloat16 losses, in their dtype otherwise.

    State: the losses of the previous call; each call is one step. A call in evaluation mode
    (``sa.eval()``) takes its slopes from the last training call's losses and keeps its own losses
    out of the state. :meth:`reset` forgets them. A NaN or infinite loss gives a non-finite value
    and is not kept (so a step that an AMP ``GradScaler`` skips does not make the next call's value
    NaN too).

    Args:
        beta: the inverse temperature :math:`\beta` (paper: 0.1; negative favours the losses
            that decrease fastest).
        normalized: divide the slopes by their L1 norm.
        loss_weighted: multiply the exponentials by the current losses.

    Example:
        >>> import torch
        >>> from jacflow.scalarization import SoftAdapt
        >>> sa = SoftAdapt(beta=1.0)
        >>> sa(torch.tensor([2.0, 2.0]))  # first call: weights 1/2
        tensor(2.)
        >>> sa(torch.tensor([1.0, 2.0]))  # slopes [-1, 0]: weights softmax([-1, 0])
        tensor(1.7311)
    """

    beta = Hyperparameter(floats())
    normalized = Hyperparameter(check_bool)
    loss_weighted = Hyperparameter(check_bool)

    saved_state = ("_previous",)

    reads_losses = True

    def __init__(self, beta: float = 0.1, normalized: bool = False, loss_weighted: bool = False):
        super().__init__()
        self.beta = beta
        self.normalized = normalized
        self.loss_weighted = loss_weighted
        self._previous: Tensor | None = None

    def forward(self, losses: Tensor, /) -> Tensor:
        if self.loss_weighted:  # (L_i e^{beta s_i} is a weight only for L_i >= 0)
            check_non_negative(
                losses, "SoftAdapt(loss_weighted=True)", "Shift the losses, e.g. by a lower bound."
            )
        detached = losses.detach()
        # (float32 at least: float16 reads the slopes' floor 1e-8 as 0, and 0 / 0 is NaN)
        work = detached.to(compute_dtype(detached.dtype))
        if self._previous is None:
            slopes = torch.zeros_like(work)
        else:
            check_same_shape(self._previous, losses, "SoftAdapt")
            slopes = work - on_losses(self._previous, work)
        # (an evaluation call, or a skipped step, keeps the previous losses)
        if self.training and not has_nonfinite(detached):
            self._previous = detached.clone()
        weights = softadapt_weights(work, slopes, self.beta, self.normalized, self.loss_weighted)
        return (weights.to(losses.dtype) * losses).sum()

    def reset(self) -> None:
        self._previous = None

    def extra_repr(self) -> str:
        return f"beta={self.beta}, normalized={self.normalized}, loss_weighted={self.loss_weighted}"
