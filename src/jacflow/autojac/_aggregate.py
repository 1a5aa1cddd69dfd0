"""Aggregation of a Jacobian split into blocks (one per input tensor), without concatenating
it where it is large."""

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
from jacflow.aggregation._bases import (
    compute_dtype,
    out_of_range,
    runs_forward_hooks,
    unit_peak_factor,
    weights_from_gramian,
)
from jacflow.linalg import sum_gramians


def _combine(weights: Tensor, blocks: Sequence[Tensor]) -> list[Tensor]:
    """``J_k^T w`` per block, formed as ``Aggregator.__call__`` forms ``J^T w``: in the
    block's compute dtype (float32 for half precision: large weights would overflow float16),
    only the update cast to the block's dtype."""
    updates = []
    for b in blocks:
        work = compute_dtype(b.dtype)
        if work == b.dtype:  # (float32/float64: no conversion of the block)
            updates.append(torch.tensordot(weights.to(work), b, dims=1))
        else:
            updates.append(torch.tensordot(weights.to(work), b.to(work), dims=1).to(b.dtype))
    return updates


def _work_dtype(blocks: Sequence[Tensor]) -> torch.dtype:
    """The dtype in which the weights of ``blocks`` are computed and returned: that of the
    aggregator's call on the concatenated matrix (float32 for half-precision blocks)."""
    return compute_dtype(functools.reduce(torch.promote_types, (b.dtype for b in blocks)))


def _gramian_weights(aggregator: GramianWeightedAggregator, blocks: Sequence[Tensor]) -> Tensor:
    """The weights of ``G = sum_k J_k J_k^T``, formed as the aggregator forms it from ``J``: in
    float32 for half-precision blocks, and from ``J`` scaled by a power of two to a largest entry
    in [1/2, 1) for a scale-invariant weighting (one block's copy at a time). Returned in that
    dtype (see :func:`_work_dtype`)."""
    work = _work_dtype(blocks)
    scaled: Iterable[Tensor] = (b.to(work) for b in blocks)
    if aggregator.gramian_weighting.scale_invariant:
        factor = unit_peak_factor(blocks, work)
        if _scales_after(blocks, factor):
            # (the same Gramian, without a scaled copy of each block: see _scales_after)
            gramian = sum_gramians(scaled) * (factor * factor)
            return aggregator.gramian_weighting(gramian).to(work)
        scaled = (b.to(work) * factor for b in blocks)
        return aggregator.gramian_weighting(sum_gramians(scaled)).to(work)
    gramian = sum_gramians(scaled)
    if out_of_range(gramian, blocks):  # (a weighting that reads the scale: formed in float64)
        gramian = sum_gramians(b.double() for b in blocks)
    return aggregator.gramian_weighting(gramian).to(work)


# The powers of two by which the blocks' Gramian may be scaled after its products rather than
# before: products of the unscaled entries neither overflow nor leave the normal range where
# the scaled ones would not, so each differs from its scaled counterpart by the exact factor.
_SCALED_AFTER = (2.0**-20, 2.0**20)


def _scales_after(blocks: Sequence[Tensor], factor: Tensor) -> bool:
    """Whether the Gramian of ``blocks`` scaled by ``factor`` (a power of two) is formed as
    ``factor^2 sum_k J_k J_k^T``, which saves a scaled copy of each block (12-23% of the
    Gramian's time on small trunks): on the CPU, where the factor is read without a device
    synchronisation, and for a factor near 1 (see ``_SCALED_AFTER``)."""
    if any(b.device.type != "cpu" for b in blocks):
        return False
    low, high = _SCALED_AFTER
    return low <= float(factor) <= high


def aggregate_blocks(
    aggregator: Aggregator, blocks: Sequence[Tensor]
) -> tuple[list[Tensor], Tensor | None]:
    """Aggregate the Jacobian whose column blocks are ``blocks`` (each ``[m, *shape]``).

    Returns one update per block (shape ``shape``) and the weights when the aggregator is
    weighted. Gramian-based aggregators get ``G = sum_k J_k J_k^T`` and never see the
    concatenated matrix, which saves a copy of the whole Jacobian; a small one (see
    ``_FUSED_MAX_BYTES``) is concatenated, which saves calls per block. With no rows (``m = 0``),
    the aggregator gets the empty ``[0, n]`` matrix (the zero update for weighted ones).
    The weights are in the dtype of the aggregator's call on that matrix: float32 for
    half-precision blocks, as the Engine's (weights in float16 would overflow).

    The update and the weights have a graph only where the Jacobian has one and the aggregator
    is :attr:`~jacflow.aggregation.Aggregator.differentiable` (as ``.grad`` after torch's
    ``backward`` without ``create_graph``: an aggregator's trainable tensors, a
    ``pref_vector``, leave none), in any grad mode.
    """
    if not aggregator.differentiable:
        with torch.no_grad():
            return _aggregated(aggregator, blocks)
    if any(b.requires_grad for b in blocks):
        # (blocks with a graph come from create_graph=True, under which autograd records the
        # accumulation even in no_grad: so is the update, else its derivative is lost)
        with torch.enable_grad():
            return _aggregated(aggregator, blocks)
    # (autograd stays on: an aggregator of your own may take gradient steps inside)
    updates, weights = _aggregated(aggregator, blocks)
    return [u.detach() for u in updates], None if weights is None else weights.detach()


def _aggregated(
    aggregator: Aggregator, blocks: Sequence[Tensor]
) -> tuple[list[Tensor], Tensor | None]:
    """:func:`aggregate_blocks` in the caller's grad mode."""
    if has_forward_hooks(aggregator) or not computed_by_library(aggregator):
        return _through_call(aggregator, blocks)
    if _fusable(blocks):
        (update,), weights = _by_shortcut(aggregator, [_concatenated(blocks)])
        return _split(update, blocks), weights
    return _by_shortcut(aggregator, blocks)


# A Jacobian of up to this many bytes is aggregated as one block: its copy costs less than the
# products and reductions per block it saves (about 6 calls each). A small multi-task trunk's
# 12 blocks of 3 rows (290 KB): 1.13 -> 0.75 ms; at 1 MB and more the copies' fresh memory
# cost more than they saved (975 KB: 1.80 -> 3.10 ms, a host with costly page faults).
_FUSED_MAX_BYTES = 2**19


def _fusable(blocks: Sequence[Tensor]) -> bool:
    """Whether ``blocks`` are aggregated concatenated: several, small in all (see
    ``_FUSED_MAX_BYTES``), dense and of one dtype and device, so that the concatenation
    neither promotes nor moves them (each update keeps its block's dtype)."""
    size = sum(b.numel() * b.element_size() for b in blocks)
    if len(blocks) < 2 or size > _FUSED_MAX_BYTES:
        return False
    first = blocks[0]
    return all(
        b.layout == torch.strided and b.dtype == first.dtype and b.device == first.device
        for b in blocks
    )


def _split(flat: Tensor, blocks: Sequence[Tensor]) -> list[Tensor]:
    """The ``[n]`` update of the concatenated Jacobian cut into one update per block."""
    pieces = torch.split(flat, [math.prod(b.shape[1:]) for b in blocks])
    return [piece.reshape(b.shape[1:]) for piece, b in zip(pieces, blocks, strict=True)]


def _by_shortcut(
    aggregator: Aggregator, blocks: Sequence[Tensor]
) -> tuple[list[Tensor], Tensor | None]:
    """:func:`aggregate_blocks` for an aggregator of the library's own, without hooks: its
    weights from the Gramian or the blocks, where it has some, and the blocks combined."""
    m = blocks[0].shape[0]
    if isinstance(aggregator, (Mean, Sum)):
        # Their weights only depend on m: skip the Gramian entirely.
        weights = aggregator.weights(blocks[0].new_empty((m, 0), dtype=_work_dtype(blocks)))
        return _combine(weights, blocks), weights
    if weights_from_gramian(aggregator) and m > 0:
        # (not Krum's, whose weighting reads J itself: asked on J below, as in its call)
        return _combine(weights := _gramian_weights(aggregator, blocks), blocks), weights
    if isinstance(aggregator, WeightedAggregator):
        # (in the compute dtype, as the aggregator's call weights it: not cast back to half)
        weights = aggregator.weights(_concatenated(blocks).to(_work_dtype(blocks)))
        return _combine(weights, blocks), weights
    return _through_call(aggregator, blocks)


def _concatenated(blocks: Sequence[Tensor]) -> Tensor:
    """The ``[m, n]`` Jacobian whose column blocks are ``blocks``."""
    m = blocks[0].shape[0]  # (explicit widths: ``reshape(0, -1)`` is ambiguous without rows)
    return torch.cat([b.reshape(m, math.prod(b.shape[1:])) for b in blocks], dim=1)


def computed_by_library(aggregator: Aggregator) -> bool:
    """Whether the aggregator's ``forward`` and ``weights`` are jacflow's own, so that the
    shortcuts (the Gramian formed block by block, Mean's and Sum's weights) compute what its
    call would; a user's subclass that overrides them is called on ``J``."""
    cls = type(aggregator)
    return all(
        name not in vars(aggregator)  # (a method set on the instance)
        and str(getattr(getattr(cls, name, None), "__module__", "")).startswith("jacflow.")
        for name in ("forward", "weights")
        if hasattr(cls, name)
    )


def has_forward_hooks(aggregator: Aggregator) -> bool:
    """Whether a forward hook or pre-hook is registered on the aggregator, on one of its
    submodules (its weighting) or globally: the shortcuts above skip those modules' calls."""
    return runs_forward_hooks(*aggregator.modules())


def _through_call(
    aggregator: Aggregator, blocks: Sequence[Tensor]
) -> tuple[list[Tensor], Tensor | None]:
    """Aggregate by calling ``aggregator`` on the concatenated Jacobian, so that its modules'
    forward hooks run (and may change its input or output) and a subclass's own ``forward``
    or ``weights`` is used, as in ``aggregator(J)``; the weights are those its ``weights``
    returned in that call (recorded, not asked again: a stateful one would step twice), or,
    when its ``forward`` did not ask for them, those of the library's own ``weights``."""
    matrix = _concatenated(blocks)
    if not isinstance(aggregator, WeightedAggregator):
        flat, weights = aggregator(matrix), None
    else:
        flat, recorded = _recording_weights(aggregator, matrix)
        weights = recorded[-1] if recorded else None
        if weights is None and computed_by_library(aggregator):  # (Mean's and Sum's)
            weights = aggregator.weights(matrix.to(compute_dtype(matrix.dtype)))
    if not isinstance(flat, Tensor) or tuple(flat.shape) != (matrix.shape[1],):
        received = tuple(flat.shape) if isinstance(flat, Tensor) else type(flat).__name__
        raise ValueError(
            f"`A` ({aggregator!r}) returned an update of shape {received}, expected "
            f"({matrix.shape[1]},): one entry per column of the Jacobian."
        )
    return _split(flat, blocks), weights


def _recording_weights(
    aggregator: WeightedAggregator, matrix: Tensor
) -> tuple[Tensor, list[Tensor]]:
    """``aggregator(matrix)``, and what its ``weights`` returned during that call."""
    recorded: list[Tensor] = []
    weights = aggregator.weights
    own = vars(aggregator).get("weights")

    def recording(stat: Tensor) -> Tensor:
        result = weights(stat)
        recorded.append(result)
        return result

    vars(aggregator)["weights"] = recording  # (shadows the method for this call only)
    try:
        return aggregator(matrix), recorded
    finally:
        if own is None:
            del vars(aggregator)["weights"]
        else:
            vars(aggregator)["weights"] = own
