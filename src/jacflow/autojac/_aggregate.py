"""Aggregation of a Jacobian split into blocks (one per input tensor) without concatenating it."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from jacflow.aggregation import (
    Aggregator,
    GramianWeightedAggregator,
    Mean,
    Sum,
    WeightedAggregator,
)
from jacflow.aggregation._bases import compute_dtype, unit_peak_factor
from jacflow.linalg import sum_gramians


def _combine(weights: Tensor, blocks: Sequence[Tensor]) -> list[Tensor]:
    return [torch.tensordot(weights.to(b.dtype), b, dims=1) for b in blocks]


def _gramian_weights(aggregator: GramianWeightedAggregator, blocks: Sequence[Tensor]) -> Tensor:
    """The weights of ``G = sum_k J_k J_k^T``, formed as the aggregator forms it from ``J``: in
    float32 for half-precision blocks, and from ``J`` scaled by a power of two to a largest entry
    in [1/2, 1) for a scale-invariant weighting (one block's copy at a time)."""
    dtype = functools.reduce(torch.promote_types, (b.dtype for b in blocks))
    work = compute_dtype(dtype)
    scaled: Iterable[Tensor] = (b.to(work) for b in blocks)
    if aggregator.gramian_weighting.scale_invariant:
        factor = unit_peak_factor(blocks, work)
        scaled = (b.to(work) * factor for b in blocks)
    return aggregator.gramian_weighting(sum_gramians(scaled)).to(dtype)


def aggregate_blocks(
    aggregator: Aggregator, blocks: Sequence[Tensor]
) -> tuple[list[Tensor], Tensor | None]:
    """Aggregate the Jacobian whose column blocks are ``blocks`` (each ``[m, *shape]``).

    Returns one update per block (shape ``shape``) and the weights when the aggregator is
    weighted. Gramian-based aggregators get ``G = sum_k J_k J_k^T`` and never see the
    concatenated matrix, which saves a copy of the whole Jacobian. With no rows (``m = 0``),
    the aggregator gets the empty ``[0, n]`` matrix (the zero update for weighted ones).
    """
    m = blocks[0].shape[0]
    if has_forward_hooks(aggregator) or not computed_by_library(aggregator):
        return _through_call(aggregator, blocks)
    if isinstance(aggregator, (Mean, Sum)):
        # Their weights only depend on m: skip the Gramian entirely.
        weights = aggregator.weights(blocks[0].new_empty((m, 0)))
        return _combine(weights, blocks), weights
    if isinstance(aggregator, GramianWeightedAggregator) and m > 0:
        return _combine(weights := _gramian_weights(aggregator, blocks), blocks), weights
    # (explicit widths: ``reshape(0, -1)`` is ambiguous when there are no rows)
    matrix = torch.cat([b.reshape(m, math.prod(b.shape[1:])) for b in blocks], dim=1)
    if isinstance(aggregator, WeightedAggregator):
        weights = aggregator.weights(matrix)
        return _combine(weights, blocks), weights
    flat = aggregator(matrix)
    sizes = [math.prod(b.shape[1:]) for b in blocks]
    return [piece.reshape(b.shape[1:]) for piece, b in zip(torch.split(flat, sizes), blocks)], None


def computed_by_library(aggregator: Aggregator) -> bool:
    """Whether the aggregator's ``forward`` and ``weights`` are jacflow's own, so that the
    shortcuts (the Gramian formed block by block, Mean's and Sum's weights) compute what its
    call would; a user's subclass that overrides them is called on ``J``."""
    cls = type(aggregator)
    return all(
        str(getattr(getattr(cls, name, None), "__module__", "")).startswith("jacflow.")
        for name in ("forward", "weights")
        if hasattr(cls, name)
    )


def has_forward_hooks(aggregator: Aggregator) -> bool:
    """Whether a forward hook or pre-hook is registered on the aggregator, on one of its
    submodules (its weighting) or globally: the shortcuts above skip those modules' calls."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(
        module._forward_hooks or module._forward_pre_hooks for module in aggregator.modules()
    )


def _through_call(
    aggregator: Aggregator, blocks: Sequence[Tensor]
) -> tuple[list[Tensor], Tensor | None]:
    """Aggregate by calling ``aggregator`` on the concatenated Jacobian, so that its modules'
    forward hooks run (and may change its input or output) and a subclass's own ``forward``
    or ``weights`` is used, as in ``aggregator(J)``; the weights are those its weighting
    returned in that call."""
    m = blocks[0].shape[0]
    matrix = torch.cat([b.reshape(m, math.prod(b.shape[1:])) for b in blocks], dim=1)
    returned: list[Tensor] = []
    weighting = getattr(aggregator, "weighting", None)
    watch = (
        weighting.register_forward_hook(lambda _m, _a, out: returned.append(out))
        if isinstance(aggregator, WeightedAggregator) and isinstance(weighting, nn.Module)
        else None
    )
    try:
        flat = aggregator(matrix)
    finally:
        if watch is not None:
            watch.remove()
    weights: Tensor | None = None
    if isinstance(aggregator, WeightedAggregator):
        weights = returned[-1] if returned else aggregator.weights(matrix)
    sizes = [math.prod(b.shape[1:]) for b in blocks]
    pieces = torch.split(flat, sizes)
    return [piece.reshape(b.shape[1:]) for piece, b in zip(pieces, blocks, strict=True)], weights
