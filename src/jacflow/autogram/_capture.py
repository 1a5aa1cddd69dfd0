"""The engine's one backward: every row's gradient w.r.t. the hooked calls' outputs.

The rows' cotangents are pulled back in one backward batched with ``vmap`` (or row by row where
a fused recurrent kernel has no batching rule). Per task, losses stacked from ``m`` scalars
often reach the hooked modules through one output (the shared trunk's features) along ``m``
separate heads. Batched over the tasks, every head would carry all ``m`` rows, ``m - 1`` of
them zeros, and their sum into the features would cost ``m`` times the features' gradient for
each head. So on the CPU such losses are pulled back to that output task by task, each along
its own head, and from there in one batched backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from jacflow.autogram._rules import quiet_vmap_fallback

# nodes walked per task, looking for the output that the tasks' heads meet at; a longer walk
# means heads (or a trunk left out of the engine) too large for the task-by-task route to pay
_WALK_PER_TASK = 64
# devices where heads are pulled back task by task: on an accelerator the m backward passes'
# kernel launches cost more than the batched backward's extra work
_BY_TASK_DEVICES = ("cpu",)

_NO_BATCHING_RULE = (
    "The engine pulls the rows' gradients back in one backward batched with vmap, and an "
    "operation between the losses and the hooked modules has no batching rule (see the error "
    "above), e.g. a recurrent layer on cuDNN outside the modules given to the Engine. Give the "
    "Engine a module that contains it (its backward is then taken row by row), or run it under "
    "torch.backends.cudnn.flags(enabled=False)."
)


def capture(
    losses: Tensor,
    edges: Sequence[GradientEdge],
    extra_inputs: Sequence[Tensor],
    cotangents: Tensor,
    per_task: bool,
    retain_graph: bool,
    row_by_row: bool,
) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """Every row's gradient w.r.t. each of ``edges`` (``[R, *shape]``, ``None`` where no row
    reaches it), and the gradient of the rows' sum w.r.t. each of ``extra_inputs``.

    ``cotangents`` holds one cotangent of ``losses`` per row (``[R, *losses.shape]``), or is the
    cotangent of the single row (``losses.shape``); ``per_task``: the rows are the losses
    themselves (an identity), which the task-by-task route needs.
    """
    batched = cotangents.ndim > losses.ndim
    heads = _task_heads(losses, edges) if batched and per_task else None
    if heads is not None:
        branches, meeting = heads
        meeting_rows, extra = _by_task(losses, branches, meeting, extra_inputs)
        if meeting_rows is None:  # (no task's gradient reaches it)
            return [None] * len(edges), extra
        grads = pull_back([meeting], edges, meeting_rows, True, retain_graph, row_by_row)
        return list(grads), extra
    grads = pull_back(
        [losses], [*edges, *extra_inputs], cotangents, batched, retain_graph, row_by_row
    )
    extra_rows = grads[len(edges) :]
    extra = [g if g is None or not batched else g.sum(0) for g in extra_rows]
    return list(grads[: len(edges)]), extra


def pull_back(
    outputs: Sequence[Tensor | GradientEdge],
    inputs: Sequence[Tensor | GradientEdge],
    cotangents: Tensor,
    batched: bool,
    retain_graph: bool,
    row_by_row: bool = False,
) -> tuple[Tensor | None, ...]:
    """Gradients w.r.t. ``inputs`` of the single output in ``outputs`` along ``cotangents``:
    ``batched``, one backward under vmap for all its rows, or, with ``row_by_row`` (the graph
    holds an op that vmap cannot batch), one backward per row, stacked."""
    if not inputs:
        return ()
    if batched and row_by_row:
        return _row_by_row(outputs, inputs, cotangents, retain_graph)
    try:
        # (batched: under vmap, whose loop over ops without a batching rule is only slower)
        with quiet_vmap_fallback() if batched else contextlib.nullcontext():
            return torch.autograd.grad(
                outputs,  # type: ignore[arg-type]
                inputs,  # type: ignore[arg-type]
                grad_outputs=cotangents,
                retain_graph=retain_graph,
                allow_unused=True,
                is_grads_batched=batched,
                materialize_grads=False,
            )
    except RuntimeError as error:
        if not (batched and "Batching rule not implemented" in str(error)):
            raise
        raise RuntimeError(_NO_BATCHING_RULE) from error


def _row_by_row(
    outputs: Sequence[Tensor | GradientEdge],
    inputs: Sequence[Tensor | GradientEdge],
    cotangents: Tensor,
    retain_graph: bool,
) -> tuple[Tensor | None, ...]:
    per_row = [
        torch.autograd.grad(
            outputs,  # type: ignore[arg-type]
            inputs,  # type: ignore[arg-type]
            grad_outputs=cotangent,
            retain_graph=retain_graph or r < len(cotangents) - 1,
            allow_unused=True,
            materialize_grads=False,
        )
        for r, cotangent in enumerate(cotangents)
    ]
    return tuple(_stacked(list(grads)) for grads in zip(*per_row, strict=True))


def _stacked(grads: list[Tensor | None]) -> Tensor | None:
    """The rows' gradients stacked, zeros for the rows that do not reach the input."""
    some = next((g for g in grads if g is not None), None)
    if some is None:
        return None
    return torch.stack([torch.zeros_like(some) if g is None else g for g in grads])


def _task_heads(
    losses: Tensor, edges: Sequence[GradientEdge]
) -> tuple[list[GradientEdge | None], GradientEdge] | None:
    """For ``m`` losses stacked from scalars (on the CPU), each loss's branch and the one
    recorded output through which all of them reach the hooked modules; ``None`` when there is
    no such output (several, or a walk too long to pay)."""
    root = losses.grad_fn
    if losses.ndim != 1 or losses.device.type not in _BY_TASK_DEVICES:
        return None
    if type(root).__name__ != "StackBackward0":
        return None
    branches: list[Any] = list(root.next_functions)  # type: ignore[union-attr]
    if len(branches) != losses.numel() or len(branches) < 2:
        return None
    recorded = {(edge.node, edge.output_nr) for edge in edges}
    meeting: set[tuple[Any, int]] = set()
    seen: set[Any] = set()
    todo = [branch for branch in branches if branch[0] is not None]
    while todo:
        node, output_nr = todo.pop()
        if (node, output_nr) in recorded:
            meeting.add((node, output_nr))
            if len(meeting) > 1:
                return None
            continue
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > _WALK_PER_TASK * len(branches):
            return None
        todo.extend(following for following in node.next_functions if following[0] is not None)
    if not meeting:
        return None
    ((node, output_nr),) = meeting
    heads = [None if b[0] is None else GradientEdge(b[0], b[1]) for b in branches]
    return heads, GradientEdge(node, output_nr)


def _by_task(
    losses: Tensor,
    branches: list[GradientEdge | None],
    meeting: GradientEdge,
    extra_inputs: Sequence[Tensor],
) -> tuple[Tensor | None, list[Tensor | None]]:
    """Each task's gradient w.r.t. the ``meeting`` output, stacked (``None`` if none reaches
    it), and the gradients of the tasks' sum w.r.t. ``extra_inputs``: one backward per task,
    along its own branch. The heads' graph is kept: ``extra_inputs`` may lie past the meeting
    output, where the batched backward from there still has to go."""
    one = torch.ones((), dtype=losses.dtype, device=losses.device)
    meeting_grads: list[Tensor | None] = []
    extra: list[Tensor | None] = [None] * len(extra_inputs)
    for branch in branches:
        if branch is None:  # (a loss that depends on no parameter)
            meeting_grads.append(None)
            continue
        grads = torch.autograd.grad(
            [branch],
            [meeting, *extra_inputs],  # type: ignore[arg-type]
            grad_outputs=[one],
            retain_graph=True,
            allow_unused=True,
            materialize_grads=False,
        )
        meeting_grads.append(grads[0])
        for j, grad in enumerate(grads[1:]):
            if grad is not None:
                previous = extra[j]
                extra[j] = grad if previous is None else previous + grad
    return _stacked(meeting_grads), extra
