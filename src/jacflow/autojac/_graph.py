"""Discovery of the leaf tensors behind outputs in the autograd graph."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor


def leaf_tensors(outputs: Iterable[Tensor], exclude: Iterable[Tensor] = ()) -> tuple[Tensor, ...]:
    """The leaf tensors requiring grad that ``outputs`` depend on, in discovery order.

    Walks ``grad_fn.next_functions`` breadth-first; a leaf is reached through its
    ``AccumulateGrad`` node. The walk stops at the ``grad_fn`` of any tensor of ``exclude``, so
    ``leaf_tensors(losses, exclude=features)`` yields only the parameters of the task heads.
    Outputs that are leaves themselves are included.
    """
    stop = {t.grad_fn for t in exclude if t.grad_fn is not None}
    excluded_leaves = {id(t) for t in exclude if t.grad_fn is None}
    found: dict[int, Tensor] = {}
    seen: set[object] = set()
    frontier = []
    for out in outputs:
        if out.grad_fn is None:
            if out.requires_grad and id(out) not in excluded_leaves:
                found.setdefault(id(out), out)
        elif out.grad_fn not in stop:
            frontier.append(out.grad_fn)
    while frontier:
        node = frontier.pop(0)
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            if id(variable) not in excluded_leaves:
                found.setdefault(id(variable), variable)
            continue
        for child, _ in node.next_functions:
            if child is not None and child not in stop and child not in seen:
                frontier.append(child)
    return tuple(found.values())
