"""Shells shared by the named Gramian methods: non-differentiable, configured by their weighting."""

from __future__ import annotations

from jacflow._stateful import Stateful
from jacflow.aggregation._bases import GramianWeightedAggregator


class NoGradGramianPreset(GramianWeightedAggregator):
    """A named method ``gramian_weighting(J J^T) @ J``, computed without autograd.

    Its ``repr`` shows the weighting's configuration under the method's name.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import CAGrad
        >>> CAGrad(c=0.5)(torch.ones(2, 3, requires_grad=True)).requires_grad
        False
    """

    without_autograd = True  # (so its call runs without autograd: Aggregator.__call__)

    def extra_repr(self) -> str:
        return self.gramian_weighting.extra_repr()


class StatefulGramianPreset(NoGradGramianPreset, Stateful):
    """A :class:`NoGradGramianPreset` whose weighting keeps state; :meth:`reset` forgets it.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import MoDo
        >>> modo = MoDo(); _ = modo(torch.eye(2)); modo.reset()
    """

    def reset(self) -> None:
        """Forget the weighting's state: the next call behaves as on a fresh instance."""
        weighting = self.gramian_weighting
        assert isinstance(weighting, Stateful)
        weighting.reset()
