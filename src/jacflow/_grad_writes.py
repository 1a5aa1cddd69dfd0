"""Writing ``.grad`` and ``.jac`` as autograd's accumulation does: results of their own
(copies of those that would share memory with another result or with the caller's tensors, or
whose elements share memory among themselves), a ``.grad`` in its parameter's layout, and the
post-accumulate hooks of the tensors whose ``.grad`` was written."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

_HAS_GRAD_DTYPE = hasattr(Tensor, "grad_dtype")  # (torch >= 2.10)


def _extent(t: Tensor) -> tuple[tuple[torch.device, int], int, int] | None:
    """``t``'s storage and the bytes ``[low, high)`` its elements span in it (``None`` where
    nothing can be shared: sparse or empty tensors; torch's strides are never negative)."""
    count = t.numel()
    if count == 0 or t.layout != torch.strided:
        return None
    if t.is_contiguous():  # (the usual case, from a flag that torch keeps)
        span = count
    else:
        span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    low = t.data_ptr()
    return (t.device, t.untyped_storage().data_ptr()), low, low + span * t.element_size()


def _steps(t: Tensor) -> list[tuple[int, int]]:
    """``(stride, size)`` of each dimension of ``t`` that has several elements, by stride."""
    return sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1)


def non_overlapping(t: Tensor) -> bool:
    """Whether no two elements of the strided tensor ``t`` share memory, by a sufficient test
    (torch's): along the dimensions by increasing stride, each steps over all the elements of
    the smaller ones. An expanded tensor (a zero stride) fails it; in-place ops refuse those.

    Example:
        >>> import torch
        >>> from jacflow._grad_writes import non_overlapping
        >>> non_overlapping(torch.ones(4, 4)[:, ::2]), non_overlapping(torch.ones(1).expand(3))
        (True, False)
    """
    reach = 1
    for stride, size in _steps(t):
        if stride < reach:
            return False
        reach += (size - 1) * stride
    return True


def dense(t: Tensor) -> bool:
    """Whether the elements of the strided tensor ``t`` fill their memory span once each:
    contiguous in some order of the dimensions (channels_last is; a slice with gaps is not)."""
    filled = 1
    for stride, size in _steps(t):
        if stride != filled:
            return False
        filled *= size
    return True


def _fits(result: Tensor, like: Tensor | None) -> bool:
    """Whether ``result`` (strided) can be stored as it is: see :func:`laid_out`."""
    if result.is_contiguous() and (like is None or like.is_contiguous()):
        return True  # (the usual case, from flags that torch keeps: no Python loop)
    if like is None:
        return dense(result)
    if not dense(like):
        return result.is_contiguous()
    return all(
        size == 1 or a == b for size, a, b in zip(result.shape, result.stride(), like.stride())
    )


def laid_out(result: Tensor, like: Tensor | None = None) -> Tensor:
    """``result``, or a copy of it where its layout is not the one to store.

    A ``.grad`` (``like``: its tensor) takes the strides of its tensor where that one is dense
    (channels_last included), else the contiguous ones, as autograd's accumulation lays out
    ``.grad``; a ``.jac`` (``like=None``) is dense. ``torch.autograd.grad`` can return an
    expanded tensor (a zero stride: the gradient of a ``sum`` passed on unchanged), on which
    ``p.grad.mul_`` and ``clip_grad_norm_`` fail. A result already laid out is not copied.

    Example:
        >>> import torch
        >>> from jacflow._grad_writes import laid_out
        >>> param = torch.zeros(2, 3, 4, 4).to(memory_format=torch.channels_last)
        >>> laid_out(torch.ones(()).expand(2, 3, 4, 4), param).stride() == param.stride()
        True
        >>> laid_out(torch.ones(1).expand(3)).stride()
        (1,)
    """
    if result.layout != torch.strided or _fits(result, like):
        return result
    if like is not None and dense(like):
        return torch.empty_like(like, dtype=result.dtype, device=result.device).copy_(result)
    return result.clone(memory_format=torch.contiguous_format)


def sole_owners(tensors: Sequence[Tensor], held: Sequence[Tensor] = ()) -> list[bool]:
    """Per tensor, whether none of its elements share memory with those of an earlier tensor
    or of a tensor of ``held`` (sparse and empty tensors share nothing).

    Example:
        >>> import torch
        >>> from jacflow._grad_writes import sole_owners
        >>> buffer = torch.zeros(4)
        >>> sole_owners([buffer[:2], buffer[2:], buffer[1:3]])
        [True, True, False]
    """
    taken: dict[tuple[torch.device, int], list[tuple[int, int]]] = {}

    def take(extent: tuple[tuple[torch.device, int], int, int], shared_too: bool) -> bool:
        """Whether ``extent`` overlaps a span taken; taken (merged with those it overlaps: the
        spans stay disjoint and sorted) if not, or anyway with ``shared_too``."""
        storage, low, high = extent
        spans = taken.setdefault(storage, [])
        i = bisect.bisect_left(spans, (low, low))
        if i > 0 and spans[i - 1][1] > low:  # (the one span that starts before it and may reach it)
            i -= 1
        j = i
        while j < len(spans) and spans[j][0] < high:
            j += 1
        if i == j or shared_too:
            spans[i:j] = [
                (min(low, spans[i][0]), max(high, spans[j - 1][1])) if i < j else (low, high)
            ]
        return i != j

    for t in held:
        extent = _extent(t)
        if extent is not None:
            take(extent, shared_too=True)
    return [(extent := _extent(t)) is None or not take(extent, False) for t in tensors]


def owned(
    results: Sequence[Tensor],
    held: Sequence[Tensor] = (),
    like: Sequence[Tensor] | None = None,
    copied: bool = False,
) -> list[Tensor]:
    """``results`` as ``.grad`` (``like``: the tensor of each) or ``.jac`` (``like=None``) fields:
    each :func:`laid_out`, and copied where its elements overlap those of an earlier result or
    of a tensor of ``held`` (the caller's).

    A ``.grad`` or ``.jac`` must be a tensor of its own, as autograd's accumulation makes it (it
    copies a gradient that something else holds): ``torch.autograd.grad`` returns one buffer
    for several inputs when an operation passes its gradient through (``a + b``), and a
    Jacobian can be a view of the caller's ``jac_tensors``. Shared, a later in-place
    accumulation or ``p.grad.mul_`` (gradient clipping) would change another tensor's too.
    Disjoint views of one buffer (the engine's reused gradient memory) are not copied.

    ``copied``: copy every result, as autograd's accumulation does under ``create_graph=True``
    (the gradients of a differentiation that built a graph): the graph of one gradient may save
    another (a gradient that an addition passes on, the cotangent itself), and an in-place write
    into the ``.grad`` or ``.jac`` holding it (the next call's accumulation, a clipping) would
    break that graph.

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
    laid = [laid_out(r, None if like is None else like[k]) for k, r in enumerate(results)]
    return [
        r if sole and not copied else r.clone() for r, sole in zip(laid, sole_owners(laid, held))
    ]


def added(total: Tensor, grad: Tensor) -> Tensor:
    """``total + grad`` out of place, either of them sparse (COO, or another sparse layout):
    torch adds a sparse tensor to a dense one, not a dense one to a sparse one, so the dense
    one comes first (the same sum, as autograd's accumulation forms it).

    Example:
        >>> import torch
        >>> from jacflow._grad_writes import added
        >>> sparse = torch.eye(2).to_sparse()
        >>> added(sparse, torch.ones(2, 2)), added(torch.ones(2, 2), sparse).layout
        (tensor([[2., 1.],
                [1., 2.]]), torch.strided)
    """
    if total.layout != torch.strided and grad.layout == torch.strided:
        return grad + total
    return total + grad


def grad_dtype(tensor: Tensor) -> torch.dtype:
    """The dtype of the gradient that torch's ``backward`` writes into ``tensor.grad``: a leaf's
    ``grad_dtype`` where one is set (torch >= 2.10, e.g. float32 gradients of a bfloat16
    parameter; its ``.grad`` setter refuses any other), else ``tensor``'s dtype (also for
    ``grad_dtype=None``, which accepts any: autograd's gradient keeps the tensor's dtype).

    Example:
        >>> import torch
        >>> from jacflow._grad_writes import grad_dtype
        >>> grad_dtype(torch.zeros(2, dtype=torch.bfloat16, requires_grad=True))
        torch.bfloat16
    """
    if not (_HAS_GRAD_DTYPE and tensor.is_leaf):  # (torch refuses to read a non-leaf's)
        return tensor.dtype
    return getattr(tensor, "grad_dtype", None) or tensor.dtype


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
