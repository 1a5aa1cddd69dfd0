"""Discovery of the leaf tensors behind outputs in the autograd graph."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor
from torch.autograd.graph import get_gradient_edge


def leaf_tensors(outputs: Iterable[Tensor], exclude: Iterable[Tensor] = ()) -> tuple[Tensor, ...]:
    """The leaf tensors requiring grad that ``outputs`` depend on, in discovery order.

    Walks ``grad_fn.next_functions`` breadth-first; a leaf is reached through its
    ``AccumulateGrad`` node. The walk stops at the gradient edge of any tensor of ``exclude``
    (its node and the output of it that the tensor is), so ``leaf_tensors(losses,
    exclude=features)`` yields only the parameters of the task heads; another output of a
    feature's node (``f1, f2 = out.chunk(2)`` with ``f1`` a feature) is walked through.
    Outputs that are leaves themselves are included.
    """
    stop = {
        (edge.node, edge.output_nr)
        for edge in (get_gradient_edge(t) for t in exclude if t.grad_fn is not None)
    }
    excluded_leaves = {id(t) for t in exclude if t.grad_fn is None}
    found: dict[int, Tensor] = {}
    seen: set[object] = set()
    frontier = []
    for out in outputs:
        if out.grad_fn is None:
            if out.requires_grad and id(out) not in excluded_leaves:
                found.setdefault(id(out), out)
        else:
            edge = get_gradient_edge(out)
            if (edge.node, edge.output_nr) not in stop:
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
        for child, nr in node.next_functions:
            if child is not None and (child, nr) not in stop and child not in seen:
                frontier.append(child)
    return tuple(found.values())


def nested_features(features: Sequence[Tensor]) -> list[int]:
    """The positions in ``features`` of those that another feature is computed from (a
    multi-scale trunk: ``f2 = stage2(f1)``), in the order of ``features``.

    A feature is met at its gradient edge (its node and the output of that node it is; a leaf
    at its gradient accumulator): nested where a walk of the graph behind the other features'
    nodes reaches that edge. Several outputs of one node (``f1, f2 = x.chunk(2)``) are not
    nested in one another. With fewer than two features nothing is walked.

    Example:
        >>> import torch
        >>> x = torch.ones(2, requires_grad=True)
        >>> f1 = x * 2
        >>> f2 = f1.exp()
        >>> nested_features([f1, f2]), nested_features([x, f1]), nested_features([f2, x * 3])
        ([0], [0], [])
    """
    if len(features) < 2:
        return []
    # Keyed by the nodes themselves, which keeps them alive: torch (2.11 at least) makes a new
    # Python object for a node nobody holds, so an id taken here could match another node later.
    edges: dict[tuple[object, int], list[int]] = {}
    for position, feature in enumerate(features):
        edge = get_gradient_edge(feature)
        edges.setdefault((edge.node, edge.output_nr), []).append(position)
    found: set[int] = set()
    stack = [f.grad_fn for f in features if f.grad_fn is not None]
    seen: dict[int, object] = {}  # (holding the nodes: their ids stay theirs)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        for child, output_nr in node.next_functions:
            if child is None:
                continue
            found.update(edges.get((child, output_nr), ()))
            stack.append(child)
    return sorted(found)
