"""LogSTCH: LibMTL's smooth Tchebycheff on log-normalised losses, after a warm-up."""

from __future__ import annotations

from typing import Any, final

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
    ints,
    on_losses,
)
from jacflow.scalarization._stch import smooth_max

_LOG_EPS = 1e-20


def log_sum(losses: Tensor) -> Tensor:
    """``sum(log(losses + 1e-20))``, the warm-up objective, computed in float32 for
    half-precision losses (which read the 1e-20 as 0) and rounded to their dtype."""
    wide = losses.to(compute_dtype(losses.dtype))
    return torch.log(wide + _LOG_EPS).sum().to(losses.dtype)


def log_stch(losses: Tensor, nadir: Tensor, mu: float) -> Tensor:
    """``m * mu * logsumexp(log(losses / nadir + 1e-20) / mu)``, computed in float32 for
    half-precision losses (which read the 1e-20 as 0: log(0) = -inf, whose zero softmax weight
    times the infinite derivative of the log makes the gradient NaN) and rounded to their dtype."""
    wide = losses.to(compute_dtype(losses.dtype))
    ratios = wide / on_losses(nadir, wide)
    return (losses.numel() * smooth_max(torch.log(ratios + _LOG_EPS), mu)).to(losses.dtype)


def check_nadir(nadir: Tensor) -> None:
    """Refuse a nadir point with an entry below the smallest normal number of its dtype (0,
    in practice: a loss that was 0 throughout the calibration epoch): the losses are divided by
    it, which gives NaN (0 / 0, or x / 0 = inf turned NaN by the max-shift) at every later call.

    Example:
        >>> import torch
        >>> from jacflow.scalarization._log_stch import check_nadir
        >>> check_nadir(torch.tensor([2.0, 0.0]))
        Traceback (most recent call last):
        ...
        ValueError: LogSTCH: the nadir point is [2.0, 0.0]: loss [1] averaged 0 ...
    """
    small = (nadir < torch.finfo(nadir.dtype).tiny).flatten()
    if bool(small.any()):
        indices = small.nonzero().flatten().tolist()
        raise ValueError(
            f"LogSTCH: the nadir point is {nadir.flatten().tolist()[:8]}: loss {indices[:8]} "
            "averaged 0 (or below the smallest normal number) over the calibration epoch, and "
            "LogSTCH divides each loss by its average, which would give NaN for the rest of "
            "training. Make that loss positive (e.g. add a small constant to it) and call "
            "`step()` again at the end of the next epoch: the calibration goes on until then."
        )


@final
class LogSTCH(SavesState, Scalarizer, Stateful):
    r"""Smooth Tchebycheff on log-losses normalised by a nadir point, after a warm-up (LibMTL).

    A separate class rather than options of :class:`STCH` because it is stateful (epochs, a
    measured nadir point) while :class:`STCH` is a pure function. With :math:`e` the epoch
    index (starting at 0, advanced by :meth:`step`) and :math:`W` = ``warmup_epochs``:

    * epochs :math:`e < W`: :math:`\sum_i \log(L_i + 10^{-20})` (the geometric loss strategy);
    * epoch :math:`e = W` (calibration): the same objective, and the nadir point
      :math:`z_i` is the average of :math:`L_i` over this epoch's calls;
    * epochs :math:`e > W`:
      :math:`m \mu \log \sum_i \exp\big(\log(L_i / z_i + 10^{-20}) / \mu\big)`.

    This is LibMTL's ``STCH`` weighting with ``STCH_warmup_epoch = W`` (its value is shifted by
    the constant largest term, which changes no gradient; here the exact value is returned).
    The log makes the method invariant to the scale of each loss.

    Paper: X. Lin, X. Zhang, Z. Yang, F. Liu, Z. Wang, Q. Zhang, *Smooth Tchebycheff
    Scalarization for Multi-Objective Optimization*, ICML 2024 (arXiv 2402.19078), in the form
    of its multi-task experiments (official code, ported to LibMTL).

    State: the epoch index, the sum and count of the losses of the calibration epoch, and the
    nadir point. Call :meth:`step` at the end of every epoch; :meth:`reset` starts over. A call
    in evaluation mode (``stch.eval()``) gives the objective of the current epoch and counts for
    nothing: it is not averaged into the nadir point, and an epoch of such calls only is
    ignored by :meth:`step`. A
    NaN or infinite loss in the calibration epoch gives a non-finite value and is left out of
    the nadir point (so a step that an AMP ``GradScaler`` skips does not poison it for the rest
    of training); a calibration epoch without a finite call is repeated. A nadir entry of 0 (a
    loss that was 0 throughout the calibration epoch) would make every later value NaN:
    :meth:`step` then raises a ``ValueError`` and leaves the calibration epoch open, and
    ``load_state_dict`` refuses such a nadir point.

    The objective is computed in float32 for float16 or bfloat16 losses (float16 reads the
    :math:`10^{-20}` as 0), in their dtype otherwise, and rounded to the losses' dtype; so is
    its gradient, which is ``inf`` in float16 where float32's exceeds 65504 (the warm-up's
    :math:`1 / (L_i + 10^{-20})` for a loss below about :math:`1.5 \cdot 10^{-5}`).

    Args:
        mu: the smoothing parameter :math:`\mu > 0`.
        warmup_epochs: the number :math:`W \ge 0` of log-sum epochs before the calibration
            epoch (LibMTL uses 4).

    Example:
        >>> import torch
        >>> from jacflow.scalarization import LogSTCH
        >>> stch = LogSTCH(mu=1.0, warmup_epochs=0)
        >>> stch(torch.tensor([2.0, 8.0]))  # calibration epoch: log 2 + log 8
        tensor(2.7726)
        >>> stch.step()
        >>> stch(torch.tensor([1.0, 8.0]))  # 2 * log(1/2 + 8/8)
        tensor(0.8109)
    """

    mu = Hyperparameter(floats(low=0.0, low_open=True))
    warmup_epochs = Hyperparameter(ints(low=0))

    saved_state = ("epoch", "_sum", "_count", "nadir")

    reads_losses = True

    def __init__(self, mu: float, warmup_epochs: int = 4) -> None:
        super().__init__()
        self.mu = mu
        self.warmup_epochs = warmup_epochs
        self.epoch = 0
        self._sum: Tensor | None = None
        self._count = 0
        self.nadir: Tensor | None = None

    def forward(self, losses: Tensor, /) -> Tensor:
        # (the log of a negative loss is NaN)
        check_non_negative(losses, "LogSTCH", "Shift the losses, e.g. by a lower bound.")
        if self.epoch < self.warmup_epochs:
            if self.training:  # (an epoch of evaluation calls only is ignored by step())
                self._count += 1
            return log_sum(losses)
        if self.nadir is None:
            detached = losses.detach()
            # (an evaluation call or a skipped step: not in the nadir point)
            if not self.training or has_nonfinite(detached):
                return log_sum(losses)
            # (summed in float32 at least: a float16 sum stops growing at 2048 and overflows)
            work = detached.to(compute_dtype(detached.dtype))
            if self._sum is None:
                self._sum = work.clone()
            else:
                check_same_shape(self._sum, losses, "LogSTCH")
                self._sum = on_losses(self._sum, work) + work
            self._count += 1
            return log_sum(losses)
        check_same_shape(self.nadir, losses, "LogSTCH")
        return log_stch(losses, self.nadir, self.mu)

    def step(self) -> None:
        """End the epoch (an epoch without any call is ignored); the calibration epoch's end
        fixes the nadir point."""
        if self._count == 0 and self.nadir is None:
            return
        if self._sum is not None and self.nadir is None:
            nadir = self._sum / self._count
            check_nadir(nadir)  # (before any change: the calibration epoch goes on)
            self.nadir = nadir
            self._sum = None
        self._count = 0
        self.epoch += 1

    def _check_saved(self, state: Any) -> None:
        super()._check_saved(state)
        if isinstance(state["nadir"], Tensor):  # (a checkpoint is checked as step() checks)
            check_nadir(state["nadir"])

    def reset(self) -> None:
        self.epoch = 0
        self._sum = None
        self._count = 0
        self.nadir = None

    def extra_repr(self) -> str:
        return f"mu={self.mu}, warmup_epochs={self.warmup_epochs}"
