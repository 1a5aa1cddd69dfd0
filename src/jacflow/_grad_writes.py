"""Writing ``.grad`` and ``.jac`` as autograd's accumulation does: results of their own
(copies of those that would share memory with another result or with the caller's tensors),
and the post-accumulate hooks of the tensors whose ``.grad`` was written."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor


def _extent(t: Tensor) -> tuple[tuple[torch.device, int], int, int] | None:
    """``t``'s storage and the bytes ``[low, high)`` its elements span in it (``None`` where
    nothing can be shared: sparse or empty tensors; torch's strides are never negative)."""
    if t.layout != torch.strided or t.numel() == 0:
        return None
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    low = t.data_ptr()
    return (t.device, t.untyped_storage().data_ptr()), low, low + span * t.element_size()


def owned(results: Sequence[Tensor], held: Sequence[Tensor] = ()) -> list[Tensor]:
    """``results``, with a copy of each one whose elements overlap those of an earlier one or
    of a tensor of ``held`` (the caller's).

    A ``.grad`` or ``.jac`` must be a tensor of its own, as autograd's accumulation makes it (it
    copies a gradient that something else holds): ``torch.autograd.grad`` returns one buffer
    for several inputs when an operation passes its gradient through (``a + b``), and a
    Jacobian can be a view of the caller's ``jac_tensors``. Shared, a later in-place
    accumulation or ``p.grad.mul_`` (gradient clipping) would change another tensor's too.
    Disjoint views of one buffer (the engine's reused gradient memory) are not copied.

    Example:
        >>> import torch
        >>> from jacflow._grad_writes import owned
        >>> g, buffer = torch.ones(2), torch.zeros(4)
        >>> a, b = owned([g, g])
        >>> a is g, b is g, torch.equal(a, b)
        (True, False, True)
        >>> first, second = buffer[:2], buffer[2:]
        >>> [r is t for r, t in zip(owned([first, second]), (first, second))]
        [True, True]
    """
    taken: dict[tuple[torch.device, int], list[tuple[int, int]]] = {}

    def overlaps(extent: tuple[tuple[torch.device, int], int, int]) -> bool:
        storage, low, high = extent
        spans = taken.setdefault(storage, [])
        i = bisect.bisect_left(spans, (low, low))
        before = i > 0 and spans[i - 1][1] > low
        after = i < len(spans) and spans[i][0] < high
        if not (before or after):
            spans.insert(i, (low, high))
        return before or after

    for t in held:  # (merged where they overlap: the spans stay disjoint and sorted)
        extent = _extent(t)
        if extent is None:
            continue
        storage, low, high = extent
        spans = taken.setdefault(storage, [])
        joined = [(a, b) for a, b in spans if b > low and a < high]
        for span in joined:
            spans.remove(span)
        merged = (min([low, *(a for a, _ in joined)]), max([high, *(b for _, b in joined)]))
        bisect.insort(spans, merged)
    result: list[Tensor] = []
    for t in results:
        extent = _extent(t)
        result.append(t.clone() if extent is not None and overlaps(extent) else t)
    return result


def run_post_accumulate_hooks(tensors: Iterable[Tensor]) -> None:
    """Run the post-accumulate hooks (``register_post_accumulate_grad_hook``) of each tensor
    once, in the order given, after all their ``.grad`` are written: as autograd runs them
    after accumulating into ``.grad`` (optimizer steps in backward, gradient logging).

    Example:
        >>> import torch
        >>> from jacflow._grad_writes import run_post_accumulate_hooks
        >>> p = torch.zeros(2, requires_grad=True)
        >>> _ = p.register_post_accumulate_grad_hook(lambda t: print("hook", t.grad))
        >>> p.grad = torch.ones(2)
        >>> run_post_accumulate_hooks([p, p])
        hook tensor([1., 1.])
    """
    done: set[int] = set()
    for tensor in tensors:
        if id(tensor) in done:
            continue
        done.add(id(tensor))
        for hook in list((getattr(tensor, "_post_accumulate_grad_hooks", None) or {}).values()):
            hook(tensor)
