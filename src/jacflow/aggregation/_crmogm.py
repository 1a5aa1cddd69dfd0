"""CR-MOGM: exponential moving average of the weights of any weighting (Zhou et al., 2022)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow._stateful import SavesState, Stateful
from jacflow.aggregation._bases import GramianWeighting, Weighting, check_weighting
from jacflow.aggregation._hyperparameters import Hyperparameter, check_real_values, floats
from jacflow.aggregation._nonfinite import has_nonfinite, propagate_nonfinite


def _check_initial_weights(value: object, name: str) -> Tensor | None:
    if value is not None and (not isinstance(value, Tensor) or value.ndim != 1):
        raise ValueError(
            f"`{name}` must be None or a vector (1-D tensor) with one weight per objective, "
            f"received {value!r}."
        )
    return None if value is None else check_real_values(value, name)


class CRMOGMWeighting(SavesState, GramianWeighting, Stateful):
    r"""Correlation-reduced weights: an exponential moving average of a weighting's output.

    Zhou, Zhang, Jiang, Yang, Ji & Yang, *On the Convergence of Stochastic Multi-Objective
    Gradient Manipulation and Beyond*, NeurIPS 2022. For the wrapped weighting :math:`W`:

    .. math:: \lambda_t = \alpha\, \lambda_{t-1} + (1 - \alpha)\, W(\text{stat}_t),

    with :math:`\lambda_0` = ``initial_weights``, or :math:`\lambda_0 = W(\text{stat}_1)` (so
    the first output is :math:`W`'s own) when it is ``None``. Accepts whatever the wrapped
    weighting accepts: wrap a Gramian weighting to use it with
    :class:`~jacflow.aggregation.GramianWeightedAggregator`.

    Args:
        weighting: the weighting whose weights are smoothed.
        alpha: weight of the past, in [0, 1] (default 0.9).
        initial_weights: :math:`\lambda_0` (1-D tensor), or ``None``.

    State: the last weights :math:`\lambda_{t-1}`. :meth:`reset` forgets them and resets the
    wrapped weighting when it is :class:`~jacflow.Stateful`. (Wrapped in a
    :class:`~jacflow.aggregation.GramianWeightedAggregator` ``A``, which keeps no state of its
    own: ``A.gramian_weighting.reset()``, as in TorchJD.) The number of objectives may only
    change after a reset. A NaN or infinite input gives NaN weights, and non-finite weights
    from the wrapped weighting give non-finite weights; both leave :math:`\lambda_{t-1}`
    untouched (so a step that an AMP ``GradScaler`` skips does not poison the average).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import CRMOGMWeighting, ConstantWeighting
        >>> W = CRMOGMWeighting(ConstantWeighting(torch.tensor([1., 0.])), alpha=0.5,
        ...                     initial_weights=torch.tensor([0., 1.]))
        >>> W(torch.eye(2)), W(torch.eye(2))
        (tensor([0.5000, 0.5000]), tensor([0.7500, 0.2500]))
        >>> W.reset(); W(torch.eye(2))
        tensor([0.5000, 0.5000])
    """

    without_autograd = True

    saved_state = ("_previous",)

    weighting = Hyperparameter(check_weighting)
    alpha = Hyperparameter(floats(low=0.0, high=1.0))
    initial_weights = Hyperparameter(_check_initial_weights)
    r""":math:`\lambda_0`; an assignment takes effect on the first call after a :meth:`reset`
    (or on the first call at all)."""

    def __init__(
        self, weighting: Weighting, alpha: float = 0.9, initial_weights: Tensor | None = None
    ) -> None:
        super().__init__()
        self.weighting = weighting
        self.alpha = alpha
        self.initial_weights = initial_weights
        self._previous: Tensor | None = None

    def _check_input(self, stat: Tensor) -> None:
        self.weighting._check_input(stat)

    def reset(self) -> None:
        self._previous = None
        if isinstance(self.weighting, Stateful):
            self.weighting.reset()

    @property
    def scale_invariant(self) -> bool:
        """That of the wrapped weighting (an average of scale-invariant weights is)."""
        return isinstance(self.weighting, GramianWeighting) and self.weighting.scale_invariant

    def check_rows(self, m: int) -> None:
        previous = self._previous if self._previous is not None else self.initial_weights
        if previous is not None and previous.shape[0] != m:
            source = "`initial_weights`" if self._previous is None else "the previous call"
            raise ValueError(
                f"CRMOGMWeighting has {previous.shape[0]} weights from {source} but the input "
                f"has {m} rows; give one weight per objective, or call `.reset()` before "
                "changing the number of objectives."
            )
        self.weighting.check_rows(m)

    def forward(self, stat: Tensor) -> Tensor:
        m = stat.shape[0]
        self.check_rows(m)
        previous = self._previous if self._previous is not None else self.initial_weights
        current = self.weighting(stat)
        with torch.no_grad():
            if previous is None:
                smoothed = current.detach().clone()
            else:
                previous = previous.to(current)
                smoothed = self.alpha * previous + (1 - self.alpha) * current.detach()
            if has_nonfinite(stat) or has_nonfinite(smoothed):  # a skipped step: keep the state
                return propagate_nonfinite(smoothed, stat)
        self._previous = smoothed
        return smoothed

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, initial_weights={self.initial_weights!r}"

    def __repr__(self) -> str:
        return f"CRMOGMWeighting({self.weighting!r}, {self.extra_repr()})"

    def __str__(self) -> str:
        return f"CRMOGM({self.weighting})"
