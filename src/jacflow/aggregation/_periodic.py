"""Periodic: recompute a Gramian weighting every ``k`` calls and reuse its weights in between."""

from __future__ import annotations

from torch import Tensor

from jacflow._stateful import SavesState, Stateful
from jacflow.aggregation._bases import GramianWeighting, check_gramian_weighting
from jacflow.aggregation._hyperparameters import Hyperparameter, ints
from jacflow.aggregation._nonfinite import has_nonfinite, nan_weights


class Periodic(SavesState, GramianWeighting, Stateful):
    r"""Amortised weighting: call the wrapped weighting on every ``every``-th call only.

    The periodic recomputation of PSMGD (*Periodic Stochastic Multi-Gradient Descent*, AAAI
    2025) and of Nash-MTL's ``update_weights_every`` (Navon et al., ICML 2022), for any
    :class:`GramianWeighting` :math:`W`. With call counter :math:`t = 0, 1, \dots`:

    .. math:: w_t = \begin{cases} W(G_t) & t \equiv 0 \pmod k \\ w_{t-1} & \text{otherwise.}
              \end{cases}

    On a reuse step the Gramian is only checked for size and for a NaN or an infinity (one
    reduction), so a caller that forms the Gramian itself can skip that work and pass
    ``torch.zeros(m, m)``: :meth:`needs_gramian` says whether the next call recomputes, and
    :meth:`cached_weights` returns the weights that a reuse step gives. With
    :class:`GramianWeightedAggregator` the Gramian is always formed, so the saving is then only
    the weighting's own cost.

    A Gramian with a NaN or an infinity (a step that a ``GradScaler`` skips) gives non-finite
    weights and is not counted: the state is left as it was, on a recomputing call and on a
    reuse step alike (a reuse step then gives NaN weights).

    A recomputing call returns the wrapped weighting's weights as they are (with their graph
    to the Gramian when it has one, as :class:`UPGradWeighting`'s); a reuse step returns them
    detached, as constants.

    Args:
        weighting: the Gramian weighting to amortise.
        every: recompute period ``k >= 1`` (``1`` recomputes on every call).

    State: the number of calls so far and the last weights. :meth:`reset` forgets both and
    resets the wrapped weighting too when it is :class:`~jacflow.Stateful`.
    Wrapped in a :class:`GramianWeightedAggregator` ``A``, which keeps no state of its own:
    ``A.gramian_weighting.reset()``, as in TorchJD.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import Periodic, UPGradWeighting
        >>> W = Periodic(UPGradWeighting(), every=2)
        >>> G1 = torch.tensor([[18., -22.], [-22., 38.]])
        >>> W(G1)
        tensor([1.1111, 0.7895])
        >>> W.needs_gramian()
        False
        >>> W(torch.eye(2))  # reuse step: the Gramian is not read
        tensor([1.1111, 0.7895])
        >>> W.needs_gramian(), W(torch.eye(2))
        (True, tensor([0.5000, 0.5000]))
    """

    saved_state = ("_calls", "_weights")

    weighting = Hyperparameter(check_gramian_weighting)
    every = Hyperparameter(ints(low=1))

    def __init__(self, weighting: GramianWeighting, every: int) -> None:
        super().__init__()
        self.weighting = weighting
        self.every = every
        self._calls = 0
        self._weights: Tensor | None = None

    def needs_gramian(self) -> bool:
        """Whether the next call recomputes the weights (and so reads its Gramian)."""
        return self._weights is None or self._calls % self.every == 0

    def cached_weights(self) -> Tensor:
        """The weights of the last recomputation, that every reuse step returns."""
        if self._weights is None:
            raise ValueError("Periodic has no cached weights yet: call it on a Gramian first.")
        return self._weights

    @property
    def scale_invariant(self) -> bool:
        """That of the wrapped weighting."""
        return self.weighting.scale_invariant

    def check_rows(self, m: int) -> None:
        if not self.needs_gramian():  # (a reuse step returns the cached weights)
            cached = self.cached_weights()
            if cached.shape[0] != m:
                raise ValueError(
                    f"Periodic cached {cached.shape[0]} weights but received a Gramian of {m} "
                    "rows; call `reset()` when the number of objectives changes."
                )
        self.weighting.check_rows(m)

    @property
    def differentiable(self) -> bool:
        """The weighting's (the reused weights are constants: they do not depend on ``G``)."""
        return self.weighting.differentiable

    def forward(self, stat: Tensor) -> Tensor:
        if self.needs_gramian():
            weights = self.weighting(stat)
            # (the reuse steps' weights are constants: a graph to an earlier Gramian made a
            # second backward through it raise; non-finite ones, of a step a GradScaler skips,
            # are not kept: the next call recomputes)
            if has_nonfinite(weights):
                return weights
            self._weights = weights.detach()
        else:
            self.check_rows(stat.shape[0])
            if has_nonfinite(stat):  # a skipped step: not counted, the state is left as it was
                return nan_weights(stat.shape[0], self.cached_weights())
            weights = self.cached_weights()
        self._calls += 1
        return weights

    def reset(self) -> None:
        self._calls = 0
        self._weights = None
        if isinstance(self.weighting, Stateful):
            self.weighting.reset()

    def extra_repr(self) -> str:
        return f"{self.weighting!r}, every={self.every}"
