"""Walks of the losses' autograd graph, for what the recorded calls alone cannot show.

The engine computes each hooked parameter's share of the Jacobian from its module's recorded
calls (their inputs and output gradients). A use of that parameter anywhere else, for instance
a weight tied through a functional call (``F.linear(h, model.embed.weight)``) or an
intermediate of the module kept and used later, adds gradient that no rule sees. The losses'
graph shows such a use: walking it from the losses while stepping over each recorded call
(from its output's node straight to its inputs' nodes) reaches the parameter's gradient
accumulator. The nodes inside a closed form's calls are not visited; those inside a call of
a module that the generic rule re-runs are, where that module's parameters are its own.

An in-place op on a recorded output that is a view gives the view's base new nodes, through
which the gradient bypasses the recorded one; whether the losses use them (or only a stray
forward did) takes a walk too, made only when some view was changed so.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from jacflow.autogram._rules import Call
from jacflow.autojac._graph import REENTRANT_CHECKPOINT, children, sparse_operation, walk_nodes

_Target = TypeVar("_Target")


def _input_nodes(call: Call) -> list[Any]:
    return [get_gradient_edge(t).node for t, _ in call.versions if t.requires_grad]


def _output_nodes(call: Call, inputs: list[Any]) -> list[Any]:
    """The call's recorded outputs' nodes but those of an input returned as it is (the call
    covers nothing there: it is walked through)."""
    return [edge.node for edge in call.edges if not any(edge.node is i for i in inputs)]


@dataclass(eq=False)
class _Replayed:
    """A call of a module that the generic rule re-runs, as the walk sees it."""

    call: Call
    inputs: list[Any]  # its inputs' nodes
    covered: Collection[int]  # the parameters its re-run covers
    recomputes: bool  # whether its re-run computes what its module's other calls computed
    order: int  # in the record (a call ends, and is recorded, before the call around it)

    def contains(self, node: Any) -> bool:
        """Whether ``node`` was created by the call's forward (by its span of sequence numbers;
        without one, any node but its inputs')."""
        span = self.call.span
        if span is None:
            return not any(node is i for i in self.inputs)
        return span[0] <= node._sequence_nr() < span[1]

    def outer(self) -> tuple[int, int]:
        """Sorts the calls ending at one node outermost first."""
        span = self.call.span
        return (span[0], -self.order) if span is not None else (0, -self.order)


def used_outside(
    losses: Tensor,
    closed: Iterable[Call],
    replayed: Iterable[tuple[Call, Collection[int], bool]],
    params: dict[int, str],
) -> tuple[bool, str | None]:
    """Whether ``losses`` reach any of the recorded calls, and the name (a value of ``params``,
    keyed by ``id`` of the parameter) of a hooked parameter that they reach outside the calls
    covering it, else ``None``.

    The walk steps over each recorded call, from its output's node to its inputs' (a
    parameter given as an input included); a call that returns an input as it is covers
    nothing there and is walked through. ``closed`` are the calls of closed forms, whose rules
    cover their own parameters' uses inside them. ``replayed`` are the calls of modules that
    the generic rule re-runs, each with the ``id`` of the parameters its re-run covers and
    whether that re-run computes again what another call of its module computed (a
    parametrisation's weight, which ``parametrize.cached()`` computes once): the
    inside of each one reached is walked too, entered from its output's node, where a use of
    those parameters (or of those of the calls around it) is the call's own; the walk leaves it
    at the nodes its forward did not create (its inputs, a tensor it read otherwise). The
    inputs of a call made inside a call of the same module are inside that one (its re-run
    carries them: deep supervision).

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
        for node in _output_nodes(call, inputs):
            jumps.setdefault(id(node), []).extend(inputs)
    known: dict[int, _Replayed] = {}
    ends: dict[int, list[_Replayed]] = {}  # a replayed output's node -> the calls it ends

    def know(call: Call, covered: Collection[int], recomputes: bool) -> _Replayed:
        if id(call) not in known:
            inputs = _input_nodes(call)
            replay = known[id(call)] = _Replayed(call, inputs, covered, recomputes, len(known))
            for node in _output_nodes(call, inputs):
                ends.setdefault(id(node), []).append(replay)
        return known[id(call)]

    for call, covered, recomputes in replayed:
        know(call, covered, recomputes)

    def around(replay: _Replayed) -> list[_Replayed]:
        """The calls of the same module that ``replay`` ran inside (recorded or not)."""
        outer, call = [], replay.call
        while call.nested and call.parent is not None:
            call = call.parent
            outer.append(know(call, replay.covered, replay.recomputes))
        return outer

    Chain = tuple[_Replayed, ...]  # the replayed calls the walk is inside

    def within(chain: Chain, node: Any) -> Chain:
        """The calls of ``chain`` still around ``node``: those that created it, and those
        whose re-run computes again what another call of their module created (a weight that
        ``parametrize.cached()`` computed at the module's first call and later calls read)."""
        kept = []
        for replay in chain:
            calls = (r for r in known.values() if r.covered is replay.covered)
            if replay.contains(node) or (
                replay.recomputes and any(r.contains(node) for r in calls)
            ):
                kept.append(replay)
        return tuple(kept)

    found: str | None = None
    met = False
    stack: list[tuple[Any, Chain]] = [(losses.grad_fn, ())]
    seen: dict[tuple[int, frozenset[int]], object] = {}  # (holding the nodes: ids stay theirs)
    while stack and (found is None or not met):
        node, chain = stack.pop()
        key = (id(node), frozenset(id(replay) for replay in chain))
        if node is None or key in seen:
            continue
        seen[key] = node
        allowed = {p for replay in chain for p in replay.covered}
        entering = sorted(
            (r for r in ends.get(id(node), ()) if r not in chain), key=_Replayed.outer
        )
        if entering:  # step over the outermost call ending here, and walk its inside
            met = True
            replay = entering[0]
            base = (*chain, *(r for r in around(replay) if r not in chain))
            stack.append((node, (*base, replay)))
            allowed |= {p for r in base for p in r.covered}
            following = [(m, within(base, m)) for m in replay.inputs]
        elif id(node) in jumps:  # step over a closed form's call
            met = True
            following = [(m, within(chain, m)) for m in jumps[id(node)]]
        else:
            following = [(m, within(chain, m)) for m in children(node) if m is not None]
        for m, next_chain in following:
            variable = getattr(m, "variable", None)  # (a gradient accumulator's parameter)
            if variable is not None and id(variable) in params and id(variable) not in allowed:
                found = found or params[id(variable)]
            stack.append((m, next_chain))
    return met, found


def outside_calls(
    losses: Tensor,
    calls: Sequence[Call],
    params: Mapping[int, str] | None = None,
    inside: Collection[int] = (),
) -> tuple[object, ...]:
    """The losses' graph outside the recorded ``calls``, as a key: the type of each node in a
    walk that steps over each call (from its outputs' nodes to its inputs', as
    :func:`used_outside` does), a call as its position in ``calls``, and after the node that
    accumulates into one of the hooked ``params`` (names by ``id``), its name. Equal keys,
    with equal calls, have the same uses of the hooked parameters outside the calls and the
    same ways for one sample's loss to read another's outputs: an L2 penalty added to the
    losses, a mixing of the samples or a functional use of a weight changes it (also one on
    a hooked parameter in place of another leaf of the same shape of graph). A
    :data:`SPARSE_OPERATION` follows each node of an operation on sparse tensors (a product
    with a sparse adjacency matrix), whose backward vmap cannot batch. The calls at the
    positions ``inside`` (those the generic rule re-runs) are walked through, not over: a
    hooked parameter that such a call starts to read (another layer's weight behind a flag)
    changes the key too.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from jacflow.autogram import Engine
        >>> from jacflow.autogram._outside import outside_calls
        >>> layer = nn.Linear(2, 2)
        >>> engine = Engine(layer, batch_dim=0)
        >>> losses = layer(torch.ones(3, 2)).pow(2).sum(1)
        >>> outside_calls(losses, [call for _, call in engine._recorder.take()])
        ('SumBackward1', 'PowBackward0', 0)
    """
    ends: dict[int, int] = {}  # a call's output node -> the call's position
    for position, call in enumerate(calls):
        if position in inside:
            continue
        for edge in call.edges:
            ends.setdefault(id(edge.node), position)
    key: list[object] = []

    def following(node: Any) -> list[Any]:
        end = ends.get(id(node))
        if end is not None:
            # (the inputs' own nodes: a leaf input, a tensor or parameter, adds nothing here)
            inputs = [t.grad_fn for t, _ in calls[end].versions if t.grad_fn is not None]
            if not any(node is i for i in inputs):  # (else an input returned as it is)
                key.append(end)
                return inputs
        key.append(type(node).__name__)
        if params and id(getattr(node, "variable", None)) in params:
            key.append(params[id(node.variable)])
        if sparse_operation(node):  # (an operand's layout, which the node's name may not say)
            key.append(SPARSE_OPERATION)
        return [node for node, _ in node.next_functions]

    for _ in walk_nodes([losses.grad_fn], following):
        pass
    return tuple(key)


def sparse_inside(call: Call) -> bool:
    """Whether the graph of ``call``, from its outputs' nodes down to its inputs', holds a
    :func:`~jacflow.autojac._graph.sparse_operation` (a module of the user's own that
    multiplies by a sparse adjacency matrix), which a backward through it cannot batch.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from jacflow.autogram import Engine
        >>> from jacflow.autogram._outside import sparse_inside
        >>> class Propagate(nn.Module):
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.weight = nn.Parameter(torch.ones(2, 2))
        ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
        ...         return torch.eye(3).to_sparse() @ (x @ self.weight)
        >>> layer = Propagate()
        >>> engine = Engine(layer, batch_dim=None)
        >>> _ = layer(torch.ones(3, 2))
        >>> [sparse_inside(call) for _, call in engine._recorder.take()]
        [True]
    """
    inputs = _input_nodes(call)  # (held: their ids stay theirs)
    stops = {id(node) for node in inputs}
    nodes = walk_nodes(
        [edge.node for edge in call.edges], lambda node: () if id(node) in stops else children(node)
    )
    return any(sparse_operation(node) for node in nodes if id(node) not in stops)


# (in the key of outside_calls: the node before it is an operation on sparse tensors)
SPARSE_OPERATION = "sparse operation"


def reentrant_checkpoints(losses: Tensor) -> list[Any]:
    """The nodes of the reentrant checkpoints in the graph of ``losses``."""
    return [
        n
        for n in walk_nodes([losses.grad_fn], children)
        if type(n).__name__ == REENTRANT_CHECKPOINT
    ]


def checkpoint_above_calls(checkpoints: Sequence[Any], calls: Sequence[Call]) -> bool:
    """Whether one of the reentrant ``checkpoints`` lies between the losses and a recorded
    call's output: the engine's backward to the calls' outputs then runs its backward, which
    writes ``.grad`` of the parameters inside it.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from torch.utils.checkpoint import checkpoint
        >>> from jacflow.autogram import Engine
        >>> from jacflow.autogram._outside import checkpoint_above_calls, reentrant_checkpoints
        >>> first, second = nn.Linear(2, 2), nn.Linear(2, 2)
        >>> engine = Engine(first, batch_dim=0)
        >>> losses = checkpoint(second, first(torch.ones(3, 2)), use_reentrant=True).sum(1)
        >>> calls = [call for _, call in engine._recorder.take()]
        >>> checkpoint_above_calls(reentrant_checkpoints(losses), calls)
        True
    """
    ends = {id(edge.node) for call in calls for edge in call.edges}
    return any(id(node) in ends for node in walk_nodes(checkpoints, children))


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
    return next((targets[id(node)][0] for node in graph_nodes(losses) if id(node) in targets), None)


def graph_nodes(losses: Tensor) -> Iterator[Any]:
    """Each autograd node of the graph of ``losses`` once, depth first.

    Example:
        >>> import torch
        >>> from jacflow.autogram._outside import graph_nodes
        >>> x = torch.ones(2, requires_grad=True)
        >>> [type(node).__name__ for node in graph_nodes((x * 2).sum())]
        ['SumBackward0', 'MulBackward0', 'AccumulateGrad']
    """
    return walk_nodes([losses.grad_fn], children)


def unreached(
    starts: Iterable[Any], params: dict[int, Tensor], stops: Collection[int] = ()
) -> set[int]:
    """The ``id`` of each of ``params`` (keyed by ``id``) whose gradient accumulator is not
    reached from the autograd nodes ``starts``: autograd, run from there, would leave its
    ``.grad`` as it is. The walk ends once every accumulator is found, and does not go on past
    the nodes whose ``id`` is in ``stops`` (a call's inputs: what lies below them is not the
    call's; the caller holds those nodes, since a node's Python object that nobody holds can
    die and its ``id`` be reused).

    Example:
        >>> import torch
        >>> from jacflow.autogram._outside import unreached
        >>> a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
        >>> unreached([(a * 2).sum().grad_fn], {id(a): a, id(b): b}) == {id(b)}
        True
    """
    left = dict(params)

    def following(node: Any) -> Iterable[Any]:
        return () if id(node) in stops else children(node)

    for node in walk_nodes(starts, following):
        variable = getattr(node, "variable", None)  # (a gradient accumulator's parameter)
        if variable is not None and left.pop(id(variable), None) is not None and not left:
            break
    return set(left)
