"""The engine's one backward: every row's gradient w.r.t. the hooked calls' outputs.

The rows' cotangents are pulled back in one backward batched with ``vmap`` (or row by row where
a fused recurrent kernel has no batching rule). Per task, losses stacked from ``m`` scalars
often reach the hooked modules through one output (the shared trunk's features) along ``m``
separate heads. Batched over the tasks, every head would carry all ``m`` rows, ``m - 1`` of
them zeros, and their sum into the features would cost ``m`` times the features' gradient for
each head. So on the CPU such losses are pulled back to that output task by task, each along
its own head, and from there in one batched backward (unless a module's full backward hooks
lie on the heads' side: see ``_MODULE_HOOK_NODE``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge

from jacflow.autogram._rules import multi_grad_hook, quiet_vmap_fallback
from jacflow.autojac._rows import sparse_operands_hint, unseen_sparse_product

# nodes walked per task, looking for the output that the tasks' heads meet at; a longer walk
# means heads (or a trunk left out of the engine) too large for the task-by-task route to pay
_WALK_PER_TASK = 64
# devices where heads are pulled back task by task: on an accelerator the m backward passes'
# kernel launches cost more than the batched backward's extra work
_BY_TASK_DEVICES = ("cpu",)
# the node that torch puts at the inputs and outputs of a module with full backward hooks or
# pre-hooks (``register_full_backward_hook``, per module or global): its hook keeps the
# ``grad_output`` of the last backward through the module's output, and a module that lies
# across the meeting output would fire, in the batched backward, with the last task's only
_MODULE_HOOK_NODE = "BackwardHookFunctionBackward"

Hook = Callable[[Tensor], Tensor | None]

# which rows' gradients an extra input receives: their sum (``None``: all the rows; a tuple: the
# rows listed, a task's parameters in ``mtl_backward``), or ``EACH`` row's, stacked
EACH: Literal["each"] = "each"
Selection = tuple[int, ...] | Literal["each"] | None

_NO_BATCHING_RULE = (
    "The engine pulls the rows' gradients back in one backward batched with vmap, and an "
    "operation between the losses and the hooked modules has no batching rule (see the error "
    "above): e.g. a recurrent layer on cuDNN outside the modules given to the Engine (give the "
    "Engine a module that contains it, whose backward is then taken row by row, or run it under "
    "torch.backends.cudnn.flags(enabled=False)), or a gradient hook (register_hook) that reads "
    "values out of its gradient (.item(), .tolist(), data-dependent control flow), which vmap "
    "cannot batch: compute such statistics outside the hook; or a GroupNorm on a "
    "channels_last tensor outside the modules given to the Engine, or called as F.group_norm "
    "(its backward queries the memory format, which vmap cannot do): make its input "
    "contiguous (x.contiguous()), or give the Engine a module that contains it as an "
    "nn.GroupNorm, whose backward is then taken row by row; or an activation checkpoint whose "
    "function draws random numbers (a dropout in training mode, drawn again in the backward): "
    "with torch.utils.checkpoint(..., use_reentrant=False) the engine sees it and pulls the "
    "rows back one by one, and torch cannot differentiate the composable checkpoint "
    "(torch.distributed._composable.checkpoint) more than once: use torch.utils.checkpoint, "
    "or keep its random operations out of the checkpointed region. In a per-task step, "
    "mtl_backward(..., engine=engine, parallel_chunk_size=1) pulls the rows back one by one, "
    "without vmap, whatever the operation (Engine.backward and mtl_gramian_step have no such "
    "option: step through mtl_backward, or without the engine)."
)


def capture(
    losses: Tensor,
    edges: Sequence[GradientEdge],
    hooks: Sequence[Sequence[Hook]],
    hooks_above: Sequence[bool],
    extra_inputs: Sequence[Tensor],
    cotangents: Tensor,
    per_task: bool,
    retain_graph: bool,
    row_by_row: bool,
    selections: Sequence[Selection] | None = None,
) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """Every row's gradient w.r.t. each of ``edges`` (``[R, *shape]``, ``None`` where no row
    reaches it), and the gradient of the rows' sum w.r.t. each of ``extra_inputs``.

    ``cotangents`` holds one cotangent of ``losses`` per row (``[R, *losses.shape]``), or is the
    cotangent of the single row (``losses.shape``); ``per_task``: the rows are the losses
    themselves (an identity), which the task-by-task route needs; ``hooks``: the gradient hooks
    a user registered on each edge's tensor; ``hooks_above``: whether an edge read below its
    output (at the output's base) has such hooks on the output, which the backward runs.
    ``selections`` (one per extra input, default all ``None``) narrows an extra input's sum to
    some rows, or asks for ``EACH`` row's gradient (``[R, *shape]``, from the same backward;
    autograd runs the input's gradient hooks on each row).
    """
    batched = cotangents.ndim > losses.ndim
    chosen = list(selections) if selections is not None else [None] * len(extra_inputs)
    # A gradient hook on an extra input (a task head's `register_hook`, e.g. a normalisation)
    # takes the gradient of the rows' sum, as in a plain backward; the batched routes below
    # would run it on each row (under vmap, zeros for a row that does not reach the input) or
    # each task. Such inputs get one plain backward of their own, which stops at them.
    hooked = [
        bool(batched and tensor._backward_hooks) and rows != EACH
        for tensor, rows in zip(extra_inputs, chosen, strict=True)
    ]
    plain = _summed_grads(losses, extra_inputs, hooked, cotangents, chosen)
    extra_inputs = [tensor for tensor, has in zip(extra_inputs, hooked, strict=True) if not has]
    chosen = [rows for rows, has in zip(chosen, hooked, strict=True) if not has]
    hooked_edges = [bool(h) or above for h, above in zip(hooks, hooks_above, strict=True)]
    heads = _task_heads(losses, edges, hooked_edges) if batched and per_task else None
    if heads is not None:
        # (an input asked for each row that no head reaches but through the meeting output is
        # pulled back from there with the hooked outputs, in the batched backward)
        behind = [
            rows == EACH and get_gradient_edge(tensor).node not in heads.nodes
            for tensor, rows in zip(extra_inputs, chosen, strict=True)
        ]
        along = [(t, r) for t, r, b in zip(extra_inputs, chosen, behind, strict=True) if not b]
        meeting_rows, extra = _by_task(
            losses, heads, [t for t, _ in along], [r for _, r in along], retain_graph
        )
        below = [t for t, b in zip(extra_inputs, behind, strict=True) if b]
        if meeting_rows is None:  # (no task's gradient reaches it)
            return [None] * len(edges), _merged(
                hooked, plain, _merged(behind, [None] * len(below), extra)
            )
        with _hooks_run(edges, hooks, True, row_by_row) as grads:
            pulled = pull_back(
                [heads.meeting], [*edges, *below], meeting_rows, True, retain_graph, row_by_row
            )
            grads += pulled[: len(edges)]
        extra = _merged(behind, list(pulled[len(edges) :]), extra)
        return grads, _merged(hooked, plain, extra)
    with _hooks_run(edges, hooks, batched, row_by_row) as grads:
        pulled = pull_back(
            [losses], [*edges, *extra_inputs], cotangents, batched, retain_graph, row_by_row
        )
        grads += pulled[: len(edges)]
    extra = [
        _selected(g, rows, batched) for g, rows in zip(pulled[len(edges) :], chosen, strict=True)
    ]
    return grads, _merged(hooked, plain, extra)


def _selected(grad: Tensor | None, rows: Selection, batched: bool) -> Tensor | None:
    """An extra input's gradient from its rows' gradients (``[R, *shape]`` when ``batched``,
    else the single row's): their sum, that of the rows selected, or each row's."""
    if grad is None:
        return None
    if not batched:
        return grad.unsqueeze(0) if rows == EACH else grad
    if rows is None:
        return grad.sum(0)
    if rows == EACH:
        return grad
    return grad[rows[0]] if len(rows) == 1 else grad[list(rows)].sum(0)


def _summed_grads(
    losses: Tensor,
    inputs: Sequence[Tensor],
    which: list[bool],
    cotangents: Tensor,
    selections: Sequence[Selection],
) -> list[Tensor | None]:
    """The gradients of the rows' sum (or of the sum of the rows selected) w.r.t. the
    ``inputs`` marked in ``which`` (only in the batched routes: ``cotangents`` holds one row per
    loss row): one backward per selection."""
    groups: dict[Selection, list[int]] = {}
    for i, (take, rows) in enumerate(zip(which, selections, strict=True)):
        if take:
            groups.setdefault(rows, []).append(i)
    grads: dict[int, Tensor | None] = {}
    for rows, members in groups.items():
        summed = cotangents.sum(0) if rows is None else cotangents[list(rows)].sum(0)
        found = torch.autograd.grad(
            [losses],
            [inputs[i] for i in members],
            grad_outputs=[summed],
            retain_graph=True,
            allow_unused=True,
        )
        grads.update(zip(members, found, strict=True))
    return [grads[i] for i in sorted(grads)]


def _merged(
    which: list[bool], chosen: list[Tensor | None], rest: list[Tensor | None]
) -> list[Tensor | None]:
    """``chosen`` where ``which`` is true and ``rest`` elsewhere, in order."""
    chosen_iter, rest_iter = iter(chosen), iter(rest)
    return [next(chosen_iter) if take else next(rest_iter) for take in which]


@contextlib.contextmanager
def _hooks_run(
    edges: Sequence[GradientEdge],
    hooks: Sequence[Sequence[Hook]],
    batched: bool,
    row_by_row: bool = False,
) -> Iterator[list[Tensor | None]]:
    """Around a backward that fills the yielded list with the edges' gradients: where an edge's
    node ran in it, autograd captured that edge's gradient before the user's hooks on its tensor
    (which the gradient flowing on did pass through), so they are run on the captured one here
    (per row when ``batched``: under vmap, or one call per row with ``row_by_row``, as the
    backward was taken); an edge where the backward stopped was captured after them.
    Multi-grad hooks (see ``multi_grad_hook``) ran in the backward and are not run again."""
    hooks = [[h for h in user_hooks if not multi_grad_hook(h)] for user_hooks in hooks]
    ran: set[int] = set()
    watches = [
        edges[i].node.register_prehook(lambda grads, i=i: ran.add(i))
        for i, user_hooks in enumerate(hooks)
        if user_hooks
    ]
    grads: list[Tensor | None] = []
    try:
        yield grads
    finally:
        for watch in watches:
            watch.remove()
    for i in ran:
        grad = grads[i]
        if grad is not None:
            run = _run(hooks[i])
            if not batched:
                grads[i] = run(grad)
            elif row_by_row:  # (a hook that vmap cannot batch: .item(), numpy)
                grads[i] = torch.stack([run(row) for row in grad])
            else:
                grads[i] = torch.vmap(run)(grad)


def _run(hooks: Sequence[Hook]) -> Callable[[Tensor], Tensor]:
    def run(grad: Tensor) -> Tensor:
        for hook in hooks:
            changed = hook(grad)
            grad = grad if changed is None else changed
        return grad

    return run


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
        if batched and unseen_sparse_product(error):
            way_out = (
                "in a per-task step pass `mtl_backward(..., engine=engine, parallel_chunk_size=1)`"
            )
            raise RuntimeError(f"{error}{sparse_operands_hint(way_out)}") from error
        vmap_limit = ("Batching rule not implemented", "inside of vmap")
        if not (batched and any(text in str(error) for text in vmap_limit)):
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
    """The rows' gradients stacked, zeros for the rows that do not reach the input, dense (a
    sparse one, of an ``nn.Embedding(sparse=True)``, as autojac's Jacobian rows)."""
    dense = [g if g is None or g.layout == torch.strided else g.to_dense() for g in grads]
    some = next((g for g in dense if g is not None), None)
    if some is None:
        return None
    return torch.stack([torch.zeros_like(some) if g is None else g for g in dense])


class _Heads(NamedTuple):
    """The tasks' branches (``None`` for a loss that depends on no parameter) and the one
    recorded output through which they reach the hooked modules."""

    branches: list[GradientEdge | None]
    meeting: GradientEdge
    nodes: set[Any]  # the nodes on the heads' side of the meeting output (the walk's own set)


def _task_heads(
    losses: Tensor, edges: Sequence[GradientEdge], hooked: Sequence[bool]
) -> _Heads | None:
    """For ``m`` losses stacked from scalars (on the devices of ``_BY_TASK_DEVICES``), the
    heads that meet the hooked modules at one recorded output without gradient hooks of a
    user's (taken by both backward passes, they would run twice); ``None`` otherwise (several
    outputs, a walk too long to pay, or a module's full backward hooks on the heads' side,
    see ``_MODULE_HOOK_NODE``: left to the batched backward, which gives each row its own
    ``grad_output``, also for those of a module inside a head, which are rare)."""
    root = losses.grad_fn
    if losses.ndim != 1 or losses.device.type not in _BY_TASK_DEVICES:
        return None
    if losses._backward_hooks:  # (the heads' backwards start below the stack: they skip it)
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
        if type(node).__name__ == _MODULE_HOOK_NODE:
            return None
        seen.add(node)
        if len(seen) > _WALK_PER_TASK * len(branches):
            return None
        todo.extend(following for following in node.next_functions if following[0] is not None)
    if not meeting:
        return None
    ((node, output_nr),) = meeting
    if any(h and (e.node, e.output_nr) == (node, output_nr) for e, h in zip(edges, hooked)):
        return None
    heads = [None if b[0] is None else GradientEdge(b[0], b[1]) for b in branches]
    return _Heads(heads, GradientEdge(node, output_nr), seen)


def _by_task(
    losses: Tensor,
    heads: _Heads,
    extra_inputs: Sequence[Tensor],
    selections: Sequence[Selection],
    retain_graph: bool,
) -> tuple[Tensor | None, list[Tensor | None]]:
    """Each task's gradient w.r.t. the meeting output, stacked (``None`` if none reaches it),
    and the gradients of the tasks' sum (or of the tasks selected, or each task's, stacked)
    w.r.t. ``extra_inputs``: one backward per task, along its own branch. The last one frees
    the heads' graph unless ``retain_graph``, or unless the first went on past the meeting
    output (an extra input lies there, where the batched backward from that output still has
    to go)."""
    one = torch.ones((), dtype=losses.dtype, device=losses.device)
    taken = [i for i, branch in enumerate(heads.branches) if branch is not None]
    went_past: list[bool] = []
    watch = heads.meeting.node.register_prehook(lambda grads: went_past.append(True))
    meeting_grads: list[Tensor | None] = [None] * len(heads.branches)
    extra: list[Tensor | None] = [None] * len(extra_inputs)
    each: dict[int, list[Tensor | None]] = {
        j: [None] * len(heads.branches) for j, rows in enumerate(selections) if rows == EACH
    }
    try:
        for i in taken:
            grads = torch.autograd.grad(
                [heads.branches[i]],  # type: ignore[arg-type]
                [heads.meeting, *extra_inputs],  # type: ignore[arg-type]
                grad_outputs=[one],
                retain_graph=retain_graph or i != taken[-1] or i == taken[0] or bool(went_past),
                allow_unused=True,
                materialize_grads=False,
            )
            meeting_grads[i] = grads[0]
            for j, grad in enumerate(grads[1:]):
                rows = selections[j]
                if j in each:
                    each[j][i] = grad
                elif grad is not None and (rows is None or i in rows):
                    previous = extra[j]
                    extra[j] = grad if previous is None else previous + grad
    finally:
        watch.remove()
    for j, per_task in each.items():
        extra[j] = _stacked(per_task)
    return _stacked(meeting_grads), extra
