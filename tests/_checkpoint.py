"""Whether a checkpoint (``state_dict`` through ``torch.save``) resumes a stateful method."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor, nn

M = TypeVar("M", bound=nn.Module)


def reloaded(method: M, make: Callable[[], M]) -> M:
    """A new ``make()`` loaded with ``method``'s state_dict, saved and read back by torch."""
    buffer = io.BytesIO()
    torch.save(method.state_dict(), buffer)
    buffer.seek(0)
    fresh = make()
    fresh.load_state_dict(torch.load(buffer, weights_only=False))
    return fresh


def check_resumes(
    make: Callable[[], M], call: Callable[[M, int], Tensor], saved_at: int, steps: int
) -> None:
    """``call(method, step)`` for ``step < steps``, checkpointed after ``saved_at`` steps: the
    reloaded copy gives exactly the original's outputs from then on."""
    original = make()
    for step in range(saved_at):
        call(original, step)
    copy = reloaded(original, make)
    for step in range(saved_at, steps):
        torch.testing.assert_close(call(copy, step), call(original, step), rtol=0, atol=0)
