"""Discovery of the leaf tensors behind outputs in the autograd graph."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
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
    outputs, exclude = list(outputs), list(exclude)
    excluded_leaves = {id(t) for t in exclude if t.grad_fn is None}
    found: dict[int, Tensor] = {}
    for out in outputs:
        if out.grad_fn is None and out.requires_grad and id(out) not in excluded_leaves:
            found.setdefault(id(out), out)
    for node in nodes_until(outputs, exclude):
        if type(node).__name__ == _ACCUMULATOR:
            variable = node.variable
            # (one frozen since the forward keeps its node; torch's backward then skips it)
            if id(variable) not in excluded_leaves and variable.requires_grad:
                found.setdefault(id(variable), variable)
    return tuple(found.values())


# the node through which a leaf tensor receives its gradient (its ``variable``)
_ACCUMULATOR = "AccumulateGrad"


def nodes_until(outputs: Sequence[Tensor], exclude: Sequence[Tensor] = ()) -> Iterator[Any]:
    """The nodes of the graph behind ``outputs``, breadth-first, up to the gradient edges of
    ``exclude`` and the leaves' gradient accumulators: those that :func:`leaf_tensors` walks
    (a node that :func:`passes_through` once per output entered)."""
    stop = {
        (edge.node, edge.output_nr)
        for edge in (get_gradient_edge(t) for t in exclude if t.grad_fn is not None)
    }
    seen: set[object] = set()  # (nodes, and (node, output) pairs of the pass-through ones)
    frontier: deque[tuple[Any, int]] = deque()
    for out in outputs:
        if out.grad_fn is not None:
            edge = get_gradient_edge(out)
            if (edge.node, edge.output_nr) not in stop:
                frontier.append((edge.node, edge.output_nr))
    # (the loop runs once per node of graphs of thousands: lookups hoisted, no calls per node)
    pop, push, pass_through = frontier.popleft, frontier.append, _PASS_THROUGH
    while frontier:
        node, output_nr = pop()
        name = type(node).__name__
        through = name in pass_through
        key = (node, output_nr) if through else node
        if key in seen:
            continue
        seen.add(key)
        yield node
        if name == _ACCUMULATOR:
            continue
        children = node.next_functions
        if through:  # (output k is input k: only that input's graph is behind this output)
            children = children[output_nr : output_nr + 1]
        for child, nr in children:
            if child is not None and not (stop and (child, nr) in stop):
                push((child, nr))


# the autograd node of torch.compile'd code (AOTAutograd's): one node for the whole graph
COMPILED_NODE = "CompiledFunctionBackward"


def holds_compiled(outputs: Sequence[Tensor], exclude: Sequence[Tensor] = ()) -> bool:
    """Whether the graph behind ``outputs``, up to the gradient edges of ``exclude``, holds
    torch.compile'd code (see :func:`nodes_until`).

    Example:
        >>> import torch
        >>> from jacflow.autojac._graph import holds_compiled
        >>> holds_compiled([torch.ones(1, requires_grad=True) * 2])
        False
    """
    return any(type(node).__name__ == COMPILED_NODE for node in nodes_until(outputs, exclude))


# the node of a reentrant activation checkpoint (torch.utils.checkpoint, use_reentrant=True)
REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"


def checkpointed_module(node: Any) -> nn.Module | None:
    """The module that a reentrant checkpoint's node ran (given as the module, one of its
    bound methods, or a ``functools.partial`` of either), else ``None`` (another function,
    whose inside cannot be seen)."""
    function = getattr(node, "run_function", None)
    while isinstance(function, functools.partial):
        function = function.func
    owner = getattr(function, "__self__", function)
    return owner if isinstance(owner, nn.Module) else None


def _seen_tensors(function: Any) -> list[Tensor] | None:
    """The parameters and tensors that a reentrant checkpoint's ``function`` can be seen to
    use: those of a module (the function is one, or one of its bound methods) and, through
    ``functools.partial`` arguments, closure cells and defaults (``create_custom_forward(m)``,
    a lambda over a local module), of the modules and tensors it captures, nested functions
    included; ``None`` when it captures none (it reads globals, or is not Python code)."""
    captured: list[Any] = []
    pending, visited = [function], set()
    while pending:
        current = pending.pop()
        if id(current) in visited:
            continue
        visited.add(id(current))
        if isinstance(current, nn.Module):
            captured.append(current)
            continue
        if isinstance(current, functools.partial):
            pending += [current.func, *current.args, *current.keywords.values()]
            continue
        owner = getattr(current, "__self__", None)
        if owner is not None:  # (a bound method: its object)
            pending.append(owner)
        for cell in getattr(current, "__closure__", None) or ():
            try:
                pending.append(cell.cell_contents)
            except ValueError:  # (an empty cell)
                continue
        pending += list(getattr(current, "__defaults__", None) or ())
        pending += list((getattr(current, "__kwdefaults__", None) or {}).values())
        if isinstance(current, Tensor):
            captured.append(current)
    tensors = [t for c in captured for t in (c.parameters() if isinstance(c, nn.Module) else [c])]
    return tensors or None


def check_reentrant_checkpoints(
    outputs: Sequence[Tensor], inputs: Sequence[Tensor], name: str
) -> None:
    """Refuse a reentrant activation checkpoint behind ``outputs`` whose backward a
    differentiation with respect to ``inputs`` would run (torch refuses it in
    ``torch.autograd.grad``, with an error of its own) or that runs one of ``inputs`` out of
    the graph's sight (a parameter or tensor that its function captures, see
    :func:`_seen_tensors`; any leaf input where it captures none): its forward ran under
    ``no_grad``, so those inputs would get zero Jacobians, silently. One that runs neither (a
    frozen stem under the inputs' layers, a closure whose output is an input) is left alone.

    Example:
        >>> import torch
        >>> from torch.utils.checkpoint import checkpoint
        >>> from jacflow.autojac._graph import check_reentrant_checkpoints
        >>> layer, x = torch.nn.Linear(2, 2), torch.ones(3, 2, requires_grad=True)
        >>> out = checkpoint(layer, x, use_reentrant=True).sum()
        >>> check_reentrant_checkpoints([out], [*layer.parameters()], "outputs")
        Traceback (most recent call last):
        ...
        ValueError: `outputs` depend on a reentrant activation checkpoint ...
    """
    walked = _all_nodes([o.grad_fn for o in outputs])
    found = [n for n in walked.values() if type(n).__name__ == REENTRANT_CHECKPOINT]
    if not found:
        return
    wanted = {id(t) for t in inputs}
    targets = [get_gradient_edge(t).node for t in inputs if t.requires_grad]
    for node in found:
        seen = _seen_tensors(getattr(node, "run_function", None))
        # (a function whose inside cannot be seen may run any leaf input; the inputs computed
        # by the graph, its output or the features, are not in it)
        hidden = (
            any(t.grad_fn is None for t in inputs)
            if seen is None
            else any(id(t) in wanted for t in seen)
        )
        if hidden or runs_one([node], targets):
            raise ValueError(
                f"`{name}` depend on a reentrant activation checkpoint "
                "(torch.utils.checkpoint with use_reentrant=True): its backward runs only in "
                "`.backward()` without `inputs` (torch refuses it in `torch.autograd.grad`, "
                "which jacflow differentiates with), and the parameters that it runs are out "
                "of the graph's sight (their Jacobian would be zero, silently). Use "
                "checkpoint(..., use_reentrant=False), which jacflow differentiates exactly."
                + (
                    " (Its function captures no module or tensor that jacflow can see, e.g. a "
                    "lambda over a global module: any parameter among the inputs may run in it. "
                    "Checkpointing the module itself, or functools.partial(module), lets "
                    "jacflow see which do.)"
                    if seen is None
                    else ""
                )
            )


# Autograd nodes whose output ``k`` is their input ``k`` (an identity per output): DDP's
# ``_DDPSink``, which ``find_unused_parameters=True`` puts after every output of the forward.
_PASS_THROUGH = frozenset({"_DDPSinkBackward"})


def passes_through(node: Any) -> bool:
    """Whether ``node``'s output ``k`` depends on its input ``k`` only (see ``_PASS_THROUGH``):
    a walk that enters it through one output follows that input alone, as a walk through the
    forward's outputs one by one would.

    Example:
        >>> import torch
        >>> from jacflow.autojac._graph import passes_through
        >>> passes_through((torch.ones(1, requires_grad=True) * 2).grad_fn)
        False
    """
    return type(node).__name__ in _PASS_THROUGH


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
    for node in _all_nodes([f.grad_fn for f in features]).values():
        for child, output_nr in node.next_functions:
            if child is not None:
                found.update(edges.get((child, output_nr), ()))
    return sorted(found)


# The autograd nodes whose backward may return a sparse gradient (``nn.Embedding(sparse=True)``,
# ``nn.EmbeddingBag(sparse=True)``, ``gather(sparse_grad=True)``), and their saved flags.
SPARSE_GRADIENT_NODES = frozenset(
    {"EmbeddingBackward0", "EmbeddingBagBackward0", "GatherBackward0"}
)
_SPARSE_FLAGS = ("_saved_sparse", "_saved_sparse_grad")

# The operands that autograd saves for the backward of a matrix product: vmap cannot expand a
# sparse one to the rows of a chunk ("expand is unsupported for Sparse tensors"), as a graph
# neural network's product of a sparse adjacency matrix and the nodes' features needs.
_PRODUCT_OPERANDS = {
    "MmBackward0": ("_saved_self", "_saved_mat2"),
    "AddmmBackward0": ("_saved_mat1", "_saved_mat2"),
    "SparseAddmmBackward0": ("_saved_mat1", "_saved_mat2"),
    "MvBackward0": ("_saved_self", "_saved_vec"),
    "AddmvBackward0": ("_saved_mat", "_saved_vec"),
    "BmmBackward0": ("_saved_self", "_saved_mat2"),
}

# Torch 2.10 shows a saved tensor as autograd stored it (``SavedTensor.data``), without running
# saved-tensor hooks. Earlier releases cannot show a product's sparse operand so (unpacking it
# would run them: a checkpoint's recomputation at every walk), and jacflow does not see it.
SPARSE_OPERANDS_READABLE = hasattr(torch._C._autograd.SavedTensor, "data")

# Nodes of operations on sparse tensors (learned edge weights: ``sparse_coo_tensor`` of values
# that require grad, ``torch.sparse.softmax``, ``to_dense``), whose backwards vmap cannot batch
# either; the others have ``Sparse`` in their names.
_SPARSE_OPERATIONS = frozenset({"ToDenseBackward0", "ValuesBackward0", "CoalesceBackward0"})


def sparse_operation(node: Any) -> bool:
    """Whether ``node`` is the backward of an operation on a sparse tensor, or of a matrix
    product one of whose saved operands is sparse (see ``_PRODUCT_OPERANDS``). The operands are
    read as stored, never unpacked: under saved-tensor hooks (a non-reentrant checkpoint
    recomputes its forward to unpack them, ``save_on_cpu`` copies back) they are not inspected.

    Example:
        >>> import torch
        >>> from jacflow.autojac._graph import sparse_operation
        >>> adjacency = torch.eye(3).to_sparse()
        >>> features = torch.ones(3, 2, requires_grad=True)
        >>> sparse_operation((adjacency @ features).grad_fn)
        True
        >>> sparse_operation((torch.eye(3) @ features).grad_fn)
        False
    """
    name = type(node).__name__
    if "Sparse" in name or name in _SPARSE_OPERATIONS:
        return True
    for attribute in _PRODUCT_OPERANDS.get(name, ()):
        try:
            operand = getattr(node, "_raw" + attribute).data  # (what autograd stored)
        except (AttributeError, RuntimeError):  # (freed by an earlier backward, or no such)
            continue
        if isinstance(operand, Tensor) and operand.layout != torch.strided:
            return True
    return False


def sparse_on_paths(roots: Sequence[Any], targets: Sequence[Any]) -> bool:
    """Whether a backward from the nodes ``roots`` to the nodes ``targets`` runs a node that
    vmap cannot batch because of sparse tensors: a :func:`sparse_operation`, or a node whose
    saved flags say that it returns a sparse gradient (``nn.Embedding(sparse=True)``,
    ``gather(..., sparse_grad=True)``). Autograd runs the nodes with a path to a target (a
    target itself where another lies below it), not the others: a sparse product that feeds only
    parameters left out of the backward does not count.

    Example:
        >>> import torch
        >>> from torch.autograd.graph import get_gradient_edge
        >>> from jacflow.autojac._graph import sparse_on_paths
        >>> table = torch.nn.Embedding(4, 2, sparse=True)
        >>> head = torch.ones(2, requires_grad=True)
        >>> out = (table(torch.tensor([1, 3])) @ head).sum()
        >>> def node(t):
        ...     return get_gradient_edge(t).node
        >>> sparse_on_paths([out.grad_fn], [node(table.weight)])
        True
        >>> sparse_on_paths([out.grad_fn], [node(head)])
        False
    """
    candidates = sparse_candidates(roots)
    return bool(candidates) and runs_one(candidates, targets)


def sparse_candidates(roots: Sequence[Any]) -> list[Any]:
    """The nodes behind ``roots`` that vmap cannot batch because of sparse tensors (see
    :func:`sparse_on_paths`), whether autograd would run them or not."""
    return [
        node
        for node in _all_nodes(roots).values()
        if sparse_operation(node)
        or (
            type(node).__name__ in SPARSE_GRADIENT_NODES
            and any(getattr(node, flag, False) is True for flag in _SPARSE_FLAGS)
        )
    ]


def walk_nodes(starts: Iterable[Any], following: Callable[[Any], Iterable[Any]]) -> Iterator[Any]:
    """Each node reachable from the nodes ``starts`` once, depth first; ``following(node)``
    gives the nodes to visit after it (``None`` entries are skipped)."""
    stack: list[Any] = list(starts)
    seen: dict[int, object] = {}  # (holding the nodes' Python objects: their ids stay theirs)
    inline = following is children  # (the walk of every node runs per step: no call per node)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        yield node
        if inline:
            for child, _ in node.next_functions:
                if child is not None and id(child) not in seen:
                    stack.append(child)
        else:
            stack.extend(following(node))


def children(node: Any) -> Iterator[Any]:
    """The nodes that ``node``'s backward passes gradients to (``None`` where it passes none)."""
    return (child for child, _ in node.next_functions)


def _all_nodes(roots: Sequence[Any]) -> dict[int, Any]:
    """Every node behind the nodes ``roots`` (themselves included), by ``id``; the dictionary
    holds them, so that their ids stay theirs while it lives."""
    return {id(node): node for node in walk_nodes(roots, children)}


def reached_inputs(outputs: Sequence[Tensor], inputs: Sequence[Tensor]) -> tuple[bool, ...]:
    """Per input (each requiring grad), whether a backward from ``outputs`` reaches it: it is
    one of them, or its gradient edge's node lies behind them. For a Jacobian without rows
    (``m = 0``), where no VJP tells it: an input reached so gets the empty Jacobian (zeros),
    as torch's ``y.backward(torch.zeros(0))`` writes them for an empty ``y``, and another
    nothing.

    Example:
        >>> import torch
        >>> from jacflow.autojac._graph import reached_inputs
        >>> a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
        >>> reached_inputs([(a * 2)[:0]], [a, b])
        (True, False)
    """
    nodes = _all_nodes([o.grad_fn for o in outputs if o.grad_fn is not None])
    return tuple(
        any(t is o for o in outputs) or id(get_gradient_edge(t).node) in nodes for t in inputs
    )


def runs_one(nodes: Sequence[Any], targets: Sequence[Any]) -> bool:
    """Whether a backward to the nodes ``targets`` runs one of ``nodes``: autograd runs a node
    when a target is one of its children or lies below one. One walk for all of ``nodes``,
    each node's answer kept (a stem of many sparse layers is walked once, not once each)."""
    wanted = {id(target) for target in targets}
    reaches: dict[int, bool] = {}  # a node -> whether a target is it or lies below it
    held: dict[int, Any] = {}  # (holding the nodes: their ids stay theirs)
    stack: list[tuple[Any, list[Any] | None]] = [
        (child, None) for node in nodes for child, _ in node.next_functions if child is not None
    ]
    starts = [entry[0] for entry in stack]
    while stack:
        node, children = stack.pop()
        if children is None:  # (first visit: its children before it; the graph has no cycle)
            if id(node) in reaches:
                continue
            held[id(node)] = node
            reaches[id(node)] = id(node) in wanted
            if reaches[id(node)]:
                continue
            children = [child for child, _ in node.next_functions if child is not None]
            stack.append((node, children))
            stack.extend((child, None) for child in children if id(child) not in reaches)
            continue
        reaches[id(node)] = any(reaches[id(child)] for child in children)
    return any(reaches[id(start)] for start in starts)


def sparse_gradients(outputs: Sequence[Tensor], inputs: Sequence[Tensor]) -> bool:
    """Whether differentiating ``outputs`` with respect to ``inputs`` runs a backward that
    torch cannot batch with vmap because of sparse tensors: a sparse input, or a node that
    :func:`sparse_on_paths` finds (a sparse gradient, a sparse adjacency matrix) between them.

    Example:
        >>> import torch
        >>> from jacflow.autojac._graph import sparse_gradients
        >>> table = torch.nn.Embedding(4, 2, sparse=True)
        >>> out = table(torch.tensor([1, 3])).sum()
        >>> sparse_gradients([out], [table.weight]), sparse_gradients([out * 2], [out])
        (True, False)
    """
    if any(t.layout != torch.strided for t in inputs):  # (a sparse leaf: sparse gradients)
        return True
    candidates = sparse_candidates([o.grad_fn for o in outputs])
    # (the inputs' nodes only when needed: a leaf's costs a view of it)
    return bool(candidates) and runs_one(
        candidates, [get_gradient_edge(t).node for t in inputs if t.requires_grad]
    )
