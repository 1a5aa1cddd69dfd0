"""Aggregation of a Jacobian split into blocks (one per input tensor) without concatenating it."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

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
