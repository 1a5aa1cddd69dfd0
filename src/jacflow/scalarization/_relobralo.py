"""ReLoBRaLo: relative loss balancing with random lookback."""

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

_EPS = 1e-12


def balancing(losses: Tensor, reference: Tensor, temperature: float) -> Tensor:
    """``m * softmax(L / (T * L_ref + 1e-12))``: the relative balancing weights.

    Where some ratios overflow to ``inf`` (a huge loss over a zero reference), the weights are
    the softmax's limit: ``m`` shared by them (``softmax`` itself would give NaN).
    """
    ratios = (losses / (temperature * reference + _EPS)).flatten()
    infinite = ratios == float("inf")
    limit = infinite.to(ratios.dtype) / infinite.sum().clamp(min=1)
    weights = torch.where(infinite.any(), limit, torch.softmax(ratios, dim=0))
    return losses.numel() * weights.reshape(losses.shape)


@final
class ReLoBRaLo(SavesState, Scalarizer, Stateful):
    r"""ReLoBRaLo: :math:`\sum_i \lambda_i(t) L_i`, the weights (summing to :math:`m`, no
    gradient) following

    .. math::
        \hat\lambda_i(t, t') &= \frac{m \exp\big(L_i(t) / (T L_i(t'))\big)}
            {\sum_j \exp\big(L_j(t) / (T L_j(t'))\big)}, \\
        \lambda_i(t) &= \alpha \big(\rho\, \lambda_i(t-1) + (1 - \rho)\, \hat\lambda_i(t, 0)\big)
            + (1 - \alpha)\, \hat\lambda_i(t, t-1),

    with :math:`\rho \sim \mathrm{Bernoulli}(\mathbb{E}[\rho])` drawn at each call (the random
    lookback to the initial losses :math:`L(0)`) and :math:`\lambda(0) = 1`. A
    :math:`10^{-12}` is added to the denominators :math:`T L_i(t')`. The ratios
    :math:`L_i(t) / L_i(t')` read backwards for negative losses: a negative loss raises a
    ``ValueError``.

    Paper: R. Bischof, M. Kraus, *Multi-Objective Loss Balancing for Physics-Informed Deep
    Learning*, arXiv 2110.09813, 2021. :math:`\rho` is drawn from torch's global generator
    (``torch.rand(()) < rho``), so ``torch.manual_seed`` makes runs reproducible.

    State: :math:`L(0)` (the first call's losses), :math:`L(t-1)` and :math:`\lambda(t-1)`; each
    call is one step. A call in evaluation mode (``rl.eval()``) computes its weights from that
    state with :math:`\rho` replaced by its expectation :math:`\mathbb{E}[\rho]` (no random
    draw: the training calls draw as without it) and changes nothing; before any training call
    its weights are 1. :meth:`reset` forgets them. A NaN or infinite loss gives a non-finite
    value and leaves the state untouched (so a step that an AMP ``GradScaler`` skips does not
    poison it).

    The weights are computed, and :math:`\lambda` kept, in float32 for float16 or bfloat16
    losses (float16 reads the :math:`10^{-12}` as 0, and a zero loss in :math:`L(0)` or
    :math:`L(t-1)` then gives 0/0), in their dtype otherwise. Non-finite weights are never kept:
    such a call is a skipped step (state untouched), as for a non-finite loss.

    Args:
        alpha: the exponential decay :math:`\alpha \in [0, 1]` (paper: 0.999).
        rho: the expected lookback value :math:`\mathbb{E}[\rho] \in [0, 1]` (paper: 0.999).
        temperature: :math:`T > 0` (paper: 0.1).

    Example:
        >>> import torch
        >>> from jacflow.scalarization import ReLoBRaLo
        >>> rl = ReLoBRaLo(alpha=0.5, rho=1.0, temperature=1.0)
        >>> rl(torch.tensor([1.0, 1.0]))  # first call: weights 1
        tensor(2.)
        >>> rl(torch.tensor([2.0, 1.0]))  # 0.5 * 1 + 0.5 * 2 softmax([2, 1])
        tensor(3.2311)
    """

    alpha = Hyperparameter(floats(low=0.0, high=1.0))
    rho = Hyperparameter(floats(low=0.0, high=1.0))
    temperature = Hyperparameter(floats(low=0.0, low_open=True))

    saved_state = ("_initial", "_previous", "_lambda")

    reads_losses = True

    def __init__(self, alpha: float = 0.999, rho: float = 0.999, temperature: float = 0.1):
        super().__init__()
        self.alpha = alpha
        self.rho = rho
        self.temperature = temperature
        self._initial: Tensor | None = None
        self._previous: Tensor | None = None
        self._lambda: Tensor | None = None

    def forward(self, losses: Tensor, /) -> Tensor:
        # (the ratios L(t) / L(t') read backwards for negative losses: a larger weight for the
        # loss that decreased)
        check_non_negative(losses, "ReLoBRaLo", "Shift the losses, e.g. by a lower bound.")
        detached = losses.detach()
        skipped = has_nonfinite(detached)  # (a skipped step draws no look-back either)
        # (float32 at least: float16 reads the 1e-12 as 0, and a zero reference gives 0 / 0)
        work = detached.to(compute_dtype(detached.dtype))
        first = False
        if self._initial is None or self._previous is None or self._lambda is None:
            first = True
            weights = torch.ones_like(work)
        else:
            check_same_shape(self._initial, losses, "ReLoBRaLo")
            initial, previous, last = (
                on_losses(state, work) for state in (self._initial, self._previous, self._lambda)
            )
            if skipped:
                history = last
            else:
                lookback = self._lookback(work)
                history = lookback * last + (1 - lookback) * balancing(
                    work, initial, self.temperature
                )
            recent = balancing(work, previous, self.temperature)
            weights = self.alpha * history + (1 - self.alpha) * recent
        # (else: evaluation, a skipped step, or weights that would poison every later call)
        if self.training and not skipped and not has_nonfinite(weights):
            if first:
                self._initial = detached.clone()
            self._previous = detached.clone()
            self._lambda = weights
        return (weights.to(losses.dtype) * losses).sum()

    def _lookback(self, losses: Tensor) -> Tensor | float:
        """:math:`\rho`, drawn in training mode; its expectation in evaluation mode (no draw
        from torch's generator, which the training calls' draws would then not follow)."""
        if not self.training:
            return self.rho
        return (torch.rand((), device=losses.device) < self.rho).to(losses.dtype)

    def reset(self) -> None:
        self._initial = None
        self._previous = None
        self._lambda = None

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, rho={self.rho}, temperature={self.temperature}"
