"""Walks of the losses' autograd graph, for what the recorded calls alone cannot show.

The engine computes each hooked parameter's share of the Jacobian from its module's recorded
calls (their inputs and output gradients). A use of that parameter anywhere else, for instance
a weight tied through a functional call (``F.linear(h, model.embed.weight)``) or an
intermediate of the module kept and used later, adds gradient that no rule sees. The losses'
graph shows such a use: walking it from the losses while stepping over each recorded call
(from its output's node straight to its inputs' nodes) reaches the parameter's gradient
accumulator. Only the nodes between the hooked modules are visited, not those inside them.

An in-place op on a recorded output that is a view gives the view's base new nodes, through
which the gradient bypasses the recorded one; whether the losses use them (or only a stray
forward did) takes a walk too, made only when some view was changed so.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any, TypeVar

from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from jacflow.autogram._rules import Call

_Target = TypeVar("_Target")


def _walk(starts: Iterable[Any], following: Callable[[Any], Iterable[Any]]) -> Iterator[Any]:
    """Each node reachable from the nodes ``starts`` once, depth first; ``following(node)``
    gives the nodes to visit after it."""
    stack: list[Any] = list(starts)
    seen: dict[int, object] = {}  # (holding the nodes' Python objects: their ids stay theirs)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        yield node
        stack.extend(following(node))


def _inputs(node: Any) -> Iterator[Any]:
    return (following for following, _ in node.next_functions)


def _input_nodes(call: Call) -> list[Any]:
    return [get_gradient_edge(t).node for t, _ in call.versions if t.requires_grad]


def used_outside(
    losses: Tensor,
    closed: Iterable[Call],
    replayed: Iterable[tuple[Call, Collection[int]]],
    params: dict[int, str],
) -> tuple[bool, str | None]:
    """Whether ``losses`` reach any of the recorded calls, and the name (a value of ``params``,
    keyed by ``id`` of the parameter) of a hooked parameter that they reach outside the calls
    covering it, else ``None``.

    The walk steps over each recorded call, from its output's node to its inputs' (a
    parameter given as an input included); a call that returns an input as it is covers
    nothing there and is walked through. ``closed`` are the calls of closed forms, whose rules
    cover their own parameters' uses inside them. ``replayed`` are the calls of modules that
    the generic rule re-runs, each with the ``id`` of the parameters its re-run covers: the
    inside of each one reached is walked too (from its output's node back to its inputs', what
    it reads otherwise included), where a use of those parameters is the call's own. So is the
    inside of a call that a call of the same module made inside it reaches (deep
    supervision): the re-run of the outer call carries it.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from jacflow.autogram import Engine
        >>> from jacflow.autogram._outside import used_outside
        >>> layer = nn.Linear(2, 2)
        >>> engine = Engine(layer, batch_dim=0)
        >>> losses = layer(torch.ones(1, 2)) @ layer.weight  # (the weight used again)
        >>> calls = [call for _, call in engine._recorder.take()]
        >>> used_outside(losses.sum(), calls, [], {id(layer.weight): "weight"})
        (True, 'weight')
    """
    jumps: dict[int, list[Any]] = {}  # a closed form's output node -> its call's inputs' nodes
    for call in closed:
        inputs = _input_nodes(call)
        for edge in call.edges:
            if not any(node is edge.node for node in inputs):
                jumps.setdefault(id(edge.node), []).extend(inputs)
    ends: dict[int, list[Call]] = {}  # a replayed output's node -> the calls it ends
    inputs_of: dict[int, list[Any]] = {}  # (by id of a replayed call)
    stops: dict[int, set[int]] = {}  # its inputs' nodes, where its inside ends
    outputs: dict[int, set[int]] = {}  # its outputs' nodes
    covers: dict[int, Collection[int]] = {}  # the parameters its re-run covers
    for call, covered in replayed:
        inputs = inputs_of[id(call)] = _input_nodes(call)
        stops[id(call)] = {id(node) for node in inputs}
        covers[id(call)] = covered
        outputs[id(call)] = set()
        for edge in call.edges:
            if id(edge.node) not in stops[id(call)]:
                ends.setdefault(id(edge.node), []).append(call)
                outputs[id(call)].add(id(edge.node))

    def around(call: Call, context: Call | None) -> Call | None:
        """The context of a replayed call's inputs: the outer call of the same module for a
        call made inside it, else the context the walk met the call in."""
        outer = call.parent if call.nested else None
        return outer if outer is not None and id(outer) in covers else context

    found: str | None = None
    met = False
    entered: set[int] = set()  # the replayed calls whose inside was entered from their output
    stack: list[tuple[Any, Call | None]] = [(losses.grad_fn, None)]
    seen: dict[tuple[int, int], object] = {}  # (holding the nodes: their ids stay theirs)
    while stack and (found is None or not met):
        node, context = stack.pop()
        key = (id(node), id(context))
        if node is None or key in seen:
            continue
        seen[key] = node
        following: list[tuple[Any, Call | None]] = []
        own = context is not None and id(node) in outputs[id(context)]
        if not own and (id(node) in jumps or id(node) in ends):
            met = True
            following += [(m, context) for m in jumps.get(id(node), ())]
            for call in ends.get(id(node), ()):
                if id(call) not in entered:
                    entered.add(id(call))
                    stack.append((node, call))
                following += [(m, around(call, context)) for m in inputs_of[id(call)]]
        else:
            for m in _inputs(node):
                if context is not None and id(m) in stops[id(context)]:
                    if id(context) in entered:
                        continue  # (the step over the call goes on from there)
                    # (entered from a call made inside it: on to the context around it)
                    following.append((m, around(context, None)))
                else:
                    following.append((m, context))
        for m, outer in following:
            variable = getattr(m, "variable", None)  # (a gradient accumulator's)
            allowed = () if outer is None else covers[id(outer)]
            if variable is not None and id(variable) in params and id(variable) not in allowed:
                found = found or params[id(variable)]
            stack.append((m, outer))
    return met, found


def first_reached(losses: Tensor, targets: dict[int, tuple[_Target, object]]) -> _Target | None:
    """The first value of ``targets`` (keyed by ``id`` of a node, each with that node) whose
    node is in the graph of ``losses``, else ``None``.

    Example:
        >>> import torch
        >>> from jacflow.autogram._outside import first_reached
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = x * 2
        >>> targets = {id(y.grad_fn): ("y", y.grad_fn)}
        >>> first_reached((y + 1).sum(), targets), first_reached(x.sum(), targets)
        ('y', None)
    """
    nodes = _walk([losses.grad_fn], _inputs)
    return next((targets[id(node)][0] for node in nodes if id(node) in targets), None)
