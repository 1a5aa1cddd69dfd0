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
for a backward, its storage object held by the caller, or its memory shared with another
process, as after a ``torch.multiprocessing`` queue) is left alone and a fresh one is
allocated. Buffers are keyed by the parameter's ``id`` (no weak reference: a parameter with
one cannot be swapped by ``torch.utils.swap_tensors``); a stale entry is harmless, since a
buffer is only ever memory of the right shape and dtype, and the engine keeps entries only
for the parameters of its last step.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import final

import torch
from torch import Tensor

# Smaller updates keep fresh tensors: their pages did not fault in the benchmark's steps, and a
# buffer last touched a step ago is colder in cache than memory the allocator just freed (MLP
# 256, B = 128, between TorchJD's steps: 1.05-1.08x the step time with buffers, one-off).
_MIN_BYTES = 1024 * 1024
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _references(tensor: Tensor) -> tuple[int, int]:
    """Who refers to ``tensor``'s memory in this process: the tensors sharing its storage (the
    C++ count) and the references to the storage's Python object (which torch caches, so a
    caller holding it shows here). Compared with the same pair taken when nothing else did."""
    assert _use_count is not None
    storage = tensor.untyped_storage()
    return int(_use_count(storage._cdata)), sys.getrefcount(storage)


def _eligible(param: Tensor) -> bool:
    """Whether ``param`` may get a buffer: a dense CPU tensor of at least ``_MIN_BYTES``."""
    return (
        param.device.type == "cpu"
        and param.layout == torch.strided
        and param.numel() * param.element_size() >= _MIN_BYTES
    )


def worth_reusing(params: Iterable[Tensor], captured_bytes: int) -> bool:
    """Whether a step's new gradients are worth writing into kept memory: when those large
    enough to get a buffer outweigh the output gradients the step captured (``captured_bytes``).
    Then they are the step's largest allocation, and fresh ones land on fresh pages. When the
    captured gradients are larger (per-task mode with many tasks), the memory the previous
    gradients free serves them instead, and keeping it costs faults there (width-1024 trunk,
    batch 256, processes of their own, one-off: with buffers, m = 2 took 0.83-0.96x the step
    time in 7 pairs of processes and 0.94-1.02x in 2 earlier ones; m = 6 and 10 0.96-1.11x,
    with more faults at m = 10).

    Example:
        >>> import torch
        >>> from jacflow.autogram._buffers import worth_reusing
        >>> weight = torch.zeros(1024, 1024)  # 4 MiB
        >>> worth_reusing([weight], captured_bytes=2**20), worth_reusing([weight], 2**23)
        (True, False)
    """
    distinct = {id(p): p for p in params}.values()
    large = sum(p.numel() * p.element_size() for p in distinct if _eligible(p))
    return large > captured_bytes


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
        # id(param) -> (its buffer, the buffer's references when nothing else held it)
        self._held: dict[int, tuple[Tensor, tuple[int, int]]] = {}

    def take(self, param: Tensor) -> Tensor | None:
        """A buffer for ``param``'s new ``.grad``, or ``None`` when ``param`` already has a
        gradient (it is accumulated into), is small, is not a dense CPU tensor, or this torch
        cannot count a storage's references."""
        if param.grad is not None or _use_count is None or not _eligible(param):
            return None
        held = self._held.get(id(param))
        if held is not None:
            buffer, alone = held
            if (
                buffer.shape == param.shape
                and buffer.dtype == param.dtype
                and not buffer.is_shared()
                and _references(buffer) == alone
            ):
                return buffer
        buffer = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        self._held[id(param)] = (buffer, _references(buffer))
        return buffer

    def keep_only(self, params: Iterable[Tensor]) -> None:
        """Drop the buffers of parameters not in ``params`` (those of the last step)."""
        wanted = {id(param) for param in params}
        for key in [key for key in self._held if key not in wanted]:
            del self._held[key]

    @staticmethod
    def as_grad(buffer: Tensor, param: Tensor) -> Tensor:
        """The ``.grad`` handed out: a view, so that ``take`` sees when it is dropped."""
        return buffer.view(param.shape)
