"""Inputs that no loss reaches: what torch does with their ``.grad``, as the reference."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def torch_leaves_alone(
    torch_backward: Callable[[], None],
    inputs: Sequence[Tensor],
    unreached: Sequence[Tensor],
    existing: bool,
) -> tuple[list[Tensor | None], list[Tensor]]:
    """Give each of ``unreached`` a ``.grad`` of sevens (``existing``) or none, and a
    post-accumulate hook; run ``torch_backward`` and check that torch leaves those ``.grad``
    fields as they are (the very tensors) and runs no hook; then reset every ``.grad`` of
    ``inputs`` (``None``, the held ones for ``unreached``). Returns the held ``.grad`` fields and
    the hooks' record, for :func:`assert_left_alone` after jacflow's call."""
    held = [torch.full_like(t, 7.0) if existing else None for t in unreached]
    hooked: list[Tensor] = []
    for t, g in zip(unreached, held, strict=True):
        t.grad = g
        t.register_post_accumulate_grad_hook(hooked.append)
    torch_backward()
    assert_left_alone(unreached, held, hooked)
    for t in inputs:
        t.grad = None
    for t, g in zip(unreached, held, strict=True):
        t.grad = g
    return held, hooked


def assert_left_alone(
    unreached: Sequence[Tensor], held: Sequence[Tensor | None], hooked: list[Tensor]
) -> None:
    """Each ``.grad`` of ``unreached`` is what it held (``None``, or the very tensor of sevens)
    and no post-accumulate hook ran."""
    assert not hooked
    for t, g in zip(unreached, held, strict=True):
        assert t.grad is g
        if g is not None:
            assert torch.equal(g, torch.full_like(t, 7.0))
