"""FAMO: fast adaptive multitask optimization."""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import torch
from torch import Tensor

from jacflow._stateful import SavesState, Stateful
from jacflow.aggregation._nonfinite import has_nonfinite
from jacflow.scalarization._base import (
    Hyperparameter,
    Scalarizer,
    check_built_shape,
    check_optional_tensor,
    check_shape,
    floats,
)

_EPS = 1e-8
_BETAS = (0.9, 0.999)
_ADAM_EPS = 1e-8


def famo_objective(losses: Tensor, logits: Tensor, min_losses: Tensor) -> Tensor:
    """``c * sum(z * log(L - b + eps))`` with ``z = softmax(logits)`` and the constant
    ``c = 1 / sum(z / (L - b + eps))`` (both detached)."""
    z = torch.softmax(logits.flatten(), dim=0).reshape(losses.shape)
    gap = losses - min_losses + _EPS
    c = 1.0 / (z / gap.detach()).sum()
    return c * (z * torch.log(gap)).sum()


def famo_logit_gradient(logits: Tensor, delta: Tensor) -> Tensor:
    """``J_softmax(logits)^T delta = z * (delta - z . delta)``, the gradient FAMO feeds to Adam."""
    z = torch.softmax(logits.flatten(), dim=0)
    d = delta.flatten()
    return (z * (d - z @ d)).reshape(logits.shape)


@final
class FAMO(SavesState, Scalarizer, Stateful):
    r"""FAMO: decreases all losses at about the same rate, using only the loss values.

    The scalarized loss is

    .. math::
        c \sum_i z_i \log(L_i - b_i + \epsilon), \qquad z = \mathrm{softmax}(w), \qquad
        c = \Big(\sum_i \frac{z_i}{L_i - b_i + \epsilon}\Big)^{-1},

    with :math:`c` and :math:`z` treated as constants, so the gradient is the convex
    combination :math:`\sum_i \frac{c z_i}{L_i - b_i + \epsilon} \nabla L_i` and
    :math:`\epsilon = 10^{-8}`. After the model's step, :meth:`update` receives the losses
    recomputed on the same batch and moves the logits :math:`w` by one Adam step
    (:math:`\beta = (0.9, 0.999)`, L2 weight decay) on the gradient
    :math:`J_{\mathrm{softmax}}(w)^\top \delta`, where
    :math:`\delta_i = \log(L_i^{\text{before}} - b_i + \epsilon) - \log(L_i^{\text{after}} - b_i
    + \epsilon)`: losses that improved a lot lose weight.

    Paper: B. Liu, Y. Feng, P. Stone, Q. Liu, *FAMO: Fast Adaptive Multitask Optimization*,
    NeurIPS 2023 (arXiv 2306.03792). Same names, parameters and defaults as TorchJD 0.18's
    ``FAMO``.

    State: the logits :math:`w` (a buffer, not a parameter: FAMO steps them itself, do not give
    them to your optimizer), Adam's moments and step count, and the losses of the last call.
    They follow the losses' device at every call, and their dtype (float32 or float64) until the
    first call in training mode or a loaded ``state_dict`` (see :class:`Scalarizer`); after
    that, and for float16 or bfloat16 losses, they keep theirs (half precision would round
    Adam's small steps away), and the value is computed in the wider of the two dtypes.
    :meth:`update` converts its losses to the device and dtype of the call's (the wider one), and
    steps the logits and Adam's moments in their own dtype. A
    call in evaluation mode (``famo.eval()``) computes the value and keeps nothing for
    :meth:`update`, which then uses the last training call's losses. A NaN or infinite loss
    gives a non-finite value, and an :meth:`update` with a NaN or an infinity in either call's
    losses leaves the state untouched (so a step that an AMP ``GradScaler`` skips does not
    poison it). :meth:`reset` restores zeros.

    Args:
        shape: the shape of the losses (an ``int`` ``m`` means ``(m,)``).
        min_losses: lower bounds :math:`b` of the losses (default zeros; then the losses must be
            non-negative). A loss below its bound raises a ``ValueError`` before any change.
        lr: Adam's learning rate for the logits, :math:`\ge 0` (paper: 0.025).
        weight_decay: L2 weight decay of the logits, :math:`\ge 0` (paper: 1e-3).

    Example:
        >>> import torch
        >>> from jacflow.scalarization import FAMO
        >>> famo = FAMO(2)
        >>> famo(torch.tensor([1.0, 4.0]))  # z = [.5, .5]: c = 1.6, 0.8 * log(4)
        tensor(1.1090)
        >>> famo.update(torch.tensor([0.5, 4.0]))  # loss 0 improved: its weight goes down
        >>> torch.softmax(famo.logits, dim=0)
        tensor([0.4875, 0.5125])
    """

    lr = Hyperparameter(floats(low=0.0))
    weight_decay = Hyperparameter(floats(low=0.0))

    saved_state = ("_steps", "_before")

    logits: Tensor
    min_losses: Tensor
    _exp_avg: Tensor
    _exp_avg_sq: Tensor

    reads_losses = True

    def __init__(
        self,
        shape: int | Sequence[int],
        min_losses: Tensor | None = None,
        lr: float = 0.025,
        weight_decay: float = 1e-3,
    ) -> None:
        super().__init__()
        size = check_shape(shape, "FAMO")
        self.lr = lr
        self.weight_decay = weight_decay
        bounds = check_optional_tensor(min_losses, "min_losses", "FAMO")
        if bounds is None:
            bounds = torch.zeros(size)
        elif bounds.shape != size:
            raise ValueError(
                f"FAMO: `min_losses` must have the shape of the losses {tuple(size)}, received "
                f"{tuple(bounds.shape)}."
            )
        self.register_buffer("logits", torch.zeros(size))
        self.register_buffer("min_losses", bounds.clone())
        self.register_buffer("_exp_avg", torch.zeros(size))
        self.register_buffer("_exp_avg_sq", torch.zeros(size))
        self._steps = 0
        self._before: Tensor | None = None

    def _check(self, losses: Tensor, name: str) -> None:
        """Check the shape and that no loss lies below its bound (NaN and inf pass)."""
        check_built_shape(self.logits.shape, losses, "FAMO", name)
        bounds = self.min_losses.to(device=losses.device, dtype=losses.dtype)
        detached = losses.detach()
        # (a NaN or infinite loss is a skipped step, not a bad bound: -inf included)
        if bool(((detached < bounds) & torch.isfinite(detached)).any()):
            raise ValueError(
                f"FAMO: `{name}` must be at least `min_losses` (default 0: the losses must be "
                "non-negative; log(L - b) is taken), received "
                f"{losses.detach().flatten().tolist()[:8]} with `min_losses` "
                f"{self.min_losses.flatten().tolist()[:8]}. Pass lower bounds of the losses as "
                "`min_losses` (e.g. the most negative value a loss can take)."
            )

    def forward(self, losses: Tensor, /) -> Tensor:
        self._check(losses, "losses")
        self.follow([self.logits, self.min_losses, self._exp_avg, self._exp_avg_sq], losses)
        if self.training:  # (an evaluation call is not the step that update() follows)
            work = torch.promote_types(self.logits.dtype, losses.dtype)
            self._before = losses.detach().to(work, copy=True)
        return famo_objective(losses, self.logits, self.min_losses)

    @torch.no_grad()
    def update(self, new_losses: Tensor, /) -> None:
        """One Adam step on the logits from the change of the losses across the model's step.

        Args:
            new_losses: the same batch's losses, evaluated again once the optimizer has stepped.

        ``new_losses`` are converted to the device and dtype of the call's losses (the wider of
        theirs and the state's), so that they may come from another precision (e.g. autocast). If
        they or the call's losses hold a NaN or an infinity, the step is skipped: the logits, Adam's
        moments and step count are left untouched.

        Raises:
            ValueError: if the scalarizer was not called on this step's losses first, or if
                ``new_losses`` has another shape or lies below ``min_losses``.
        """
        if self._before is None:
            raise ValueError(
                "FAMO.update(new_losses) must follow a call `famo(losses)` on the same batch, in "
                "training mode; call the scalarizer, step the model, then update with the new "
                "losses."
            )
        if not isinstance(new_losses, Tensor):
            raise TypeError(f"FAMO: `new_losses` must be a torch.Tensor, got {type(new_losses)}.")
        self._check(new_losses, "new_losses")
        after = new_losses.detach().to(device=self._before.device, dtype=self._before.dtype)
        before, self._before = self._before, None
        if has_nonfinite(before) or has_nonfinite(after):  # skipped step: state unchanged
            return
        delta = torch.log(before - self.min_losses + _EPS) - torch.log(
            after - self.min_losses + _EPS
        )
        # (in the logits' dtype: losses of a wider dtype than the settled state compute the
        # change in theirs, but the state keeps its own, which the next calls read)
        delta = delta.to(self.logits.dtype)
        grad = famo_logit_gradient(self.logits, delta) + self.weight_decay * self.logits
        beta1, beta2 = _BETAS
        self._steps += 1
        # (out of place: a state_dict kept in memory holds the buffers, and stays a snapshot)
        self._exp_avg = torch.add(self._exp_avg * beta1, grad, alpha=1 - beta1)
        self._exp_avg_sq = torch.addcmul(self._exp_avg_sq * beta2, grad, grad, value=1 - beta2)
        step_size = self.lr / (1 - beta1**self._steps)
        denom = (self._exp_avg_sq / (1 - beta2**self._steps)).sqrt_().add_(_ADAM_EPS)
        self.logits = torch.addcdiv(self.logits, self._exp_avg, denom, value=-step_size)

    def reset(self) -> None:
        for name in ("logits", "_exp_avg", "_exp_avg_sq"):
            setattr(self, name, torch.zeros_like(getattr(self, name)))
        self._steps = 0
        self._before = None

    def extra_repr(self) -> str:
        shape = tuple(self.logits.shape)
        return f"shape={shape}, lr={self.lr}, weight_decay={self.weight_decay}"
