"""Capture of the Gramian and weights that an aggregator sees, through module hooks."""

from __future__ import annotations

from typing import Any, final

import torch
from torch import Tensor, nn

from jacflow._labels import received
from jacflow.aggregation import (
    Aggregator,
    GramianWeightedAggregator,
    GramianWeighting,
    WeightedAggregator,
)


@final
class AggregatorWatch:
    """Forward hooks on an aggregator that keep the last Gramian and weights it computed.

    Use it when the aggregation happens inside a library call (``backward``,
    ``mtl_backward``, ``jac_to_grad``) and you still want to monitor it: after the call,
    :meth:`pop` returns the Gramian ``J J^T`` and the weights (``None`` for an aggregator that
    is not weighted). The hooks cost one ``m x m`` product when the aggregator receives ``J``;
    while they are on, those calls give the aggregator the whole Jacobian (a copy of its
    blocks, as for any forward hook on it) instead of its Gramian formed block by block.

    Args:
        aggregator: the aggregator to watch.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import UPGrad
        >>> from jacflow.monitor import AggregatorWatch
        >>> aggregator = UPGrad()
        >>> watch = AggregatorWatch(aggregator)
        >>> _ = aggregator(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        >>> gramian, weights = watch.pop()
        >>> gramian
        tensor([[ 18., -22.],
                [-22.,  38.]])
        >>> weights
        tensor([1.1111, 0.7895])
        >>> watch.remove()
    """

    def __init__(self, aggregator: Aggregator) -> None:
        if not isinstance(aggregator, Aggregator):
            raise TypeError(
                "`aggregator` must be a jacflow.aggregation.Aggregator, received "
                f"{received(aggregator)}."
            )
        self.aggregator = aggregator
        self._matrix: Tensor | None = None
        self._gramian: Tensor | None = None
        self._weights: Tensor | None = None
        self._handles = [aggregator.register_forward_hook(self._on_aggregate)]
        # (the Gramian weighting where there is one: the library's calls that form the Gramian
        # without J call it directly, not the aggregator's weighting of J)
        weighting: object
        if isinstance(aggregator, GramianWeightedAggregator):
            weighting = aggregator.gramian_weighting
        else:
            weighting = getattr(aggregator, "weighting", None)
        if isinstance(weighting, nn.Module):
            self._handles.append(weighting.register_forward_hook(self._on_weighting))

    def _on_aggregate(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._matrix = args[0].detach()

    def _on_weighting(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        stat = args[0].detach()
        if isinstance(module, GramianWeighting) and stat.shape[0] == stat.shape[1]:
            self._gramian = stat.clone()
        else:
            self._gramian = stat @ stat.T
        self._weights = output.detach().clone()

    def pop(self) -> tuple[Tensor | None, Tensor | None]:
        """The ``(gramian, weights)`` of the last aggregation, then forget them.

        Returns ``(None, None)`` if the aggregator was not called since the last ``pop``.
        """
        gramian, weights, matrix = self._gramian, self._weights, self._matrix
        self._gramian = self._weights = self._matrix = None
        if matrix is not None:  # (its weighting may see J rescaled, e.g. UPGrad's: same weights)
            bypassed = gramian is None
            gramian = matrix @ matrix.T
            if bypassed and isinstance(self.aggregator, WeightedAggregator):
                # The aggregator bypassed its weighting (e.g. Mean); ask it for the weights.
                with torch.no_grad():
                    weights = self.aggregator.weights(matrix)
        return gramian, weights

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
