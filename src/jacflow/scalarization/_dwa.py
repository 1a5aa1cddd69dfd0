"""DWA: dynamic weight average."""

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


def dwa_weights(older: Tensor, newer: Tensor, temperature: float) -> Tensor:
    """``K * softmax((newer / older) / T)`` over all entries, reshaped like ``newer``.

    ``0 / 0`` is taken as the rate 1 (no change); when some rates are infinite (a positive
    average after a zero one) the weights are the softmax's limit: ``K`` shared equally by them.
    The rates are shifted by their largest before the division (the softmax does not change),
    so that a temperature small enough for ``rate / T`` to overflow (or to read as 0 in the
    rates' dtype) gives the limit too: ``K`` shared by the largest rates, not NaN.
    """
    rates = loss_ratio(newer, older).flatten()
    infinite = rates == float("inf")
    limit = infinite.to(rates.dtype) / infinite.sum().clamp(min=1)
    shifted = rates - rates.amax()
    # (0 where a temperature below the dtype's range reads as 0: the largest rates, not 0 / 0)
    soft = torch.softmax(torch.where(shifted == 0, 0.0, shifted / temperature), dim=0)
    return newer.numel() * torch.where(infinite.any(), limit, soft).reshape(newer.shape)


@final
class DWA(SavesState, Scalarizer, Stateful):
    r"""Dynamic weight average: weights each loss by how slowly it decreased over the last epochs.

    At epoch :math:`t`, the scalarized loss of a batch with losses :math:`\ell_k` is

    .. math::
        \sum_k \lambda_k(t)\, \ell_k, \qquad
        \lambda_k(t) = \frac{K \exp(w_k(t-1) / T)}{\sum_i \exp(w_i(t-1) / T)}, \qquad
        w_k(t-1) = \frac{L_k(t-1)}{L_k(t-2)},

    where :math:`L_k(t)` is the average of :math:`\ell_k` over the batches of epoch :math:`t`
    and :math:`K` the number of losses (the weights sum to :math:`K`). During the first two
    epochs the weights are all 1. The weights carry no gradient. An average of 0 after an
    average of 0 has the rate 1 (0/0 taken as no change); if a positive average follows a zero
    one, its rate is infinite and the weights are the softmax's limit (``K`` shared by the
    losses with an infinite rate, 0 for the others). The rates are ratios of averages, which
    read backwards for negative ones: a negative loss raises a ``ValueError``.

    Paper: S. Liu, E. Johns, A. J. Davison, *End-to-End Multi-Task Learning with Attention*,
    CVPR 2019 (arXiv 1803.10704). Same names, parameters and defaults as TorchJD 0.18's ``DWA``.

    State: the running sum and count of this epoch's losses, and the averages of the last two
    epochs. Each call adds its (detached) losses to the epoch's sum; call :meth:`step` once at
    the end of each epoch. A call in evaluation mode (``dwa.eval()``) gives the value with the
    current weights and adds nothing to the epoch (as :meth:`weights`). :meth:`reset` forgets
    everything. A NaN or infinite loss gives a non-finite value and is left out of the epoch's
    average (so a step that an AMP ``GradScaler`` skips does not poison the next two epochs'
    weights).

    Args:
        temperature: :math:`T > 0`; larger is more uniform (the paper uses 2).

    Example:
        >>> import torch
        >>> from jacflow.scalarization import DWA
        >>> dwa = DWA()
        >>> for epoch_losses in ([4.0, 2.0], [2.0, 1.5]):
        ...     _ = dwa(torch.tensor(epoch_losses))
        ...     dwa.step()
        >>> dwa(torch.tensor([1.0, 1.0]))  # weights 2 softmax([0.5, 0.75] / 2)
        tensor(2.)
        >>> dwa.weights(torch.tensor([1.0, 1.0]))
        tensor([0.9376, 1.0624])
    """

    temperature = Hyperparameter(floats(low=0.0, low_open=True))

    saved_state = ("_epoch_sum", "_epoch_batches", "_averages")

    reads_losses = True

    def __init__(self, temperature: float = 2.0) -> None:
        super().__init__()
        self.temperature = temperature
        self._epoch_sum: Tensor | None = None
        self._epoch_batches = 0
        self._averages: list[Tensor] = []

    def _check(self, losses: Tensor) -> None:
        """Check ``losses`` against every kept tensor (this epoch's sum and both averages)."""
        kept = [] if self._epoch_sum is None else [self._epoch_sum]
        for state in [*kept, *self._averages]:
            check_same_shape(state, losses, "DWA")

    def weights(self, losses: Tensor) -> Tensor:
        """The weights the next call gives to losses of this shape (no state change)."""
        self._check(losses)
        if len(self._averages) < 2:
            return torch.ones_like(losses)
        older, newer = (on_losses(average, losses, average.dtype) for average in self._averages)
        return dwa_weights(older, newer, self.temperature).to(losses.dtype)

    def forward(self, losses: Tensor, /) -> Tensor:
        # (the rate of a negative average reads backwards: -1 -> -2 would be a rate of 2)
        check_non_negative(losses, "DWA", "Shift the losses, e.g. by a lower bound.")
        value = (self.weights(losses) * losses).sum()
        detached = losses.detach()
        # (an evaluation call or a skipped step: state unchanged; the latter's value non-finite)
        if not self.training or has_nonfinite(detached):
            return value
        # (summed in float32 at least: a float16 sum stops growing at 2048 and overflows)
        work = detached.to(compute_dtype(detached.dtype))
        if self._epoch_sum is None:
            self._epoch_sum = work.clone()
        else:
            self._epoch_sum = on_losses(self._epoch_sum, work) + work
        self._epoch_batches += 1
        return value

    def step(self) -> None:
        """End the epoch: its average loss becomes the newest of the two kept averages.

        An epoch without any call is ignored.
        """
        if self._epoch_sum is None:
            return
        average = self._epoch_sum / self._epoch_batches
        self._averages = [*self._averages, average][-2:]
        self._epoch_sum = None
        self._epoch_batches = 0

    def reset(self) -> None:
        self._epoch_sum = None
        self._epoch_batches = 0
        self._averages = []

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"
