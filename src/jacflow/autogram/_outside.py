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

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from jacflow.autogram._rules import Call

_Target = TypeVar("_Target")


def _walk(losses: Tensor, following: Callable[[Any], Iterable[Any]]) -> Iterator[Any]:
    """Each node of the graph of ``losses`` once, depth first; ``following(node)`` gives the
    nodes to visit after it."""
    stack: list[Any] = [losses.grad_fn]
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


def used_outside(
    losses: Tensor, calls: Iterable[Call], params: dict[int, str]
) -> tuple[bool, str | None]:
    """Whether ``losses`` reach any of the recorded ``calls``, and the name (a value of
    ``params``, keyed by ``id`` of the parameter) of a hooked parameter that they reach outside
    those calls, else ``None``.

    The walk steps over each call, from its output's node to its inputs' (a parameter given as
    an input included). A call that returns one of its inputs as it is (its output's node is an
    input's) covers nothing there and is walked through.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from jacflow.autogram import Engine
        >>> from jacflow.autogram._outside import used_outside
        >>> layer = nn.Linear(2, 2)
        >>> engine = Engine(layer, batch_dim=0)
        >>> losses = layer(torch.ones(1, 2)) @ layer.weight  # (the weight used again)
        >>> calls = [call for _, call in engine._recorder.take()]
        >>> used_outside(losses.sum(), calls, {id(layer.weight): "weight"})
        (True, 'weight')
    """
    over: dict[int, list[object]] = {}  # a recorded output's node -> its call's inputs' nodes
    for call in calls:
        inputs = [get_gradient_edge(t).node for t, _ in call.versions if t.requires_grad]
        for edge in call.edges:
            if not any(node is edge.node for node in inputs):
                over.setdefault(id(edge.node), []).extend(inputs)
    found: str | None = None
    met = False
    for node in _walk(losses, lambda node: over[id(node)] if id(node) in over else _inputs(node)):
        met = met or id(node) in over
        variable = getattr(node, "variable", None)  # (a gradient accumulator's parameter)
        if variable is not None and id(variable) in params:
            found = found or params[id(variable)]
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
    hits = (targets[id(node)][0] for node in _walk(losses, _inputs) if id(node) in targets)
    return next(hits, None)
