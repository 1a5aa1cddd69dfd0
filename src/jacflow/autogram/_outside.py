"""Hooked parameters that the losses reach outside the hooked modules' recorded calls.

The engine computes each hooked parameter's share of the Jacobian from its module's recorded
calls (their inputs and output gradients). A use of that parameter anywhere else, for instance
a weight tied through a functional call (``F.linear(h, model.embed.weight)``) or an
intermediate of the module kept and used later, adds gradient that no rule sees. The losses'
graph shows such a use: walking it from the losses while stepping over each recorded call
(from its output's node straight to its inputs' nodes) reaches the parameter's gradient
accumulator. Only the nodes between the hooked modules are visited, not those inside them.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from jacflow.autogram._rules import Call


def used_outside(losses: Tensor, calls: Iterable[Call], params: dict[int, str]) -> str | None:
    """The name (a value of ``params``, keyed by ``id`` of the parameter) of a hooked parameter
    that ``losses`` reach outside the recorded ``calls``, else ``None``; also ``None`` when they
    reach none of the calls (the engine's own error then says that no call was recorded).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from jacflow.autogram._outside import used_outside
        >>> layer = nn.Linear(2, 2)
        >>> from jacflow.autogram import Engine
        >>> engine = Engine(layer, batch_dim=0)
        >>> losses = layer(torch.ones(1, 2)) @ layer.weight  # (the weight used again)
        >>> calls = [call for _, call in engine._recorder.take()]
        >>> used_outside(losses.sum(), calls, {id(layer.weight): "weight"})
        'weight'
    """
    over: dict[int, list[object]] = {}  # a recorded output's node -> its call's inputs' nodes
    for call in calls:
        inputs: list[object] = [t.grad_fn for t, _ in call.versions if t.grad_fn is not None]
        for edge in call.edges:
            over[id(edge.node)] = inputs
    stack: list[object] = [losses.grad_fn]
    seen: dict[int, object] = {}  # (holding the nodes' Python objects: their ids stay theirs)
    found: str | None = None
    recorded = False
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if id(node) in over:
            recorded = True
            stack.extend(over[id(node)])
            continue
        variable = getattr(node, "variable", None)  # (a gradient accumulator's parameter)
        if variable is not None and id(variable) in params:
            found = found or params[id(variable)]
            continue
        stack.extend(following for following, _ in node.next_functions)  # type: ignore[attr-defined]
    return found if recorded else None
