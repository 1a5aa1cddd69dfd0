"""Memory for the engine's ``.grad`` tensors, kept from one step to the next.

A JD step allocates its parameters' gradients last, after the captured output gradients and the
Gramian's temporaries; a plain backward allocates them during the backward. On a CPU whose
allocator gives freed memory back to the OS (glibc does once more than its trim threshold is
free at the top of its heap), the JD step's new gradients then land on fresh pages every step:
one page fault per 4 KiB (about 3 000 a step for a width-1024 trunk of three layers). The
engine instead writes each large update into a buffer of its own and hands out a view of it as
``.grad``, and reuses the buffer at the next step once nothing else refers to its memory: the
view was dropped (``zero_grad()`` sets ``.grad`` to ``None``) and no other tensor shares the
storage. A buffer still in use (a ``.grad`` kept by the caller, a view of it, a tensor saved
for a backward) is left alone and a fresh one is allocated.
"""

from __future__ import annotations

import weakref
from typing import final

import torch
from torch import Tensor

# Smaller updates keep fresh tensors: their pages did not fault in the benchmark's steps, and a
# buffer last touched a step ago is colder in cache than memory the allocator just freed (MLP
# 256, B = 128, between TorchJD's steps: 1.05-1.08x the step time with buffers, one-off).
_MIN_BYTES = 1024 * 1024
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _storage_references(tensor: Tensor) -> int:
    """How many tensors share ``tensor``'s storage (plus the transient storage object)."""
    assert _use_count is not None
    return int(_use_count(tensor.untyped_storage()._cdata))


@final
class GradientBuffers:
    """One reusable buffer per large CPU parameter whose ``.grad`` the engine creates.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from jacflow.autogram._buffers import GradientBuffers
        >>> layer, buffers = nn.Linear(512, 512), GradientBuffers()
        >>> first = buffers.take(layer.weight)
        >>> layer.weight.grad = buffers.as_grad(first, layer.weight)
        >>> layer.weight.grad = None  # what zero_grad() does
        >>> buffers.take(layer.weight) is first  # its memory is reused
        True
        >>> layer.weight.grad = buffers.as_grad(first, layer.weight)
        >>> kept = layer.weight.grad  # the caller keeps last step's gradient
        >>> layer.weight.grad = None
        >>> buffers.take(layer.weight) is first  # so a fresh buffer is used
        False
    """

    def __init__(self) -> None:
        # id(param) -> (the parameter, weakly; its buffer; the buffer's storage references
        # when nothing else shares it). The entry goes with the parameter. (Not a
        # WeakKeyDictionary: it compares colliding keys with ``==``, elementwise on tensors.)
        self._held: dict[int, tuple[weakref.ref[Tensor], Tensor, int]] = {}

    def take(self, param: Tensor) -> Tensor | None:
        """A buffer for ``param``'s new ``.grad``, or ``None`` when ``param`` already has a
        gradient (it is accumulated into), is small, is not a dense CPU tensor, or this torch
        cannot count a storage's references."""
        if (
            param.grad is not None
            or _use_count is None
            or param.device.type != "cpu"
            or param.layout != torch.strided
            or param.numel() * param.element_size() < _MIN_BYTES
        ):
            return None
        key = id(param)
        held = self._held.get(key)
        if held is not None and held[0]() is param:
            _, buffer, alone = held
            if (
                buffer.shape == param.shape
                and buffer.dtype == param.dtype
                and _storage_references(buffer) == alone
            ):
                return buffer
        buffer = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        owner = weakref.ref(param, lambda _: self._held.pop(key, None))
        self._held[key] = (owner, buffer, _storage_references(buffer))
        return buffer

    @staticmethod
    def as_grad(buffer: Tensor, param: Tensor) -> Tensor:
        """The ``.grad`` handed out: a view, so that ``take`` sees when it is dropped."""
        return buffer.view(param.shape)
