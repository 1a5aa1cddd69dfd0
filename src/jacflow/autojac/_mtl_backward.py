"""``mtl_backward``: one step of multi-task Jacobian descent on a shared trunk with task heads."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from jacflow._labels import received
from jacflow.aggregation import Aggregator, GramianWeightedAggregator
from jacflow.aggregation._bases import weights_from_gramian
from jacflow.autojac._accumulate import (
    accumulate_grads,
    accumulate_jacs,
    check_jac_accumulable,
    warn_if_distributed,
)
from jacflow.autojac._aggregate import aggregate_blocks, computed_by_library
from jacflow.autojac._checks import (
    as_tensor_tuple,
    check_aggregator,
    check_chunk_size,
    check_flag,
    check_inputs_require_grad,
    check_non_empty,
    check_real,
    check_real_inputs,
    check_unique,
    without_repeats,
)
from jacflow.autojac._graph import (
    check_reentrant_checkpoints,
    holds_compiled,
    leaf_tensors,
    nested_features,
    passes_through,
)
from jacflow.autojac._jac import compute_jacobians

if TYPE_CHECKING:
    from jacflow.autogram import Engine

# a tensor's gradient hook, as torch keeps it in `Tensor._backward_hooks`
Hook = Callable[[Tensor], Tensor | None]


# (a detached feature made to require grad would take the trunk out of the step, silently)
_DETACHED_FEATURE = (
    "A feature is the shared trunk's output: compute it from the shared parameters with grad "
    "enabled (not under torch.no_grad(), not detached) and pass it as it is; calling "
    "`.requires_grad_()` on a detached copy would leave the trunk out of the step."
)


def _check_scalar_losses(losses: tuple[Tensor, ...]) -> None:
    for i, loss in enumerate(losses):
        if loss.numel() != 1:
            raise ValueError(
                f"`losses[{i}]` must be a scalar (one loss per task), received shape "
                f"{tuple(loss.shape)}. Reduce it first, e.g. with `.mean()`."
            )
        if not loss.requires_grad:
            raise ValueError(
                f"`losses[{i}]` does not require grad: it does not depend on any parameter."
            )


def _resolve_params(
    losses: tuple[Tensor, ...],
    features: tuple[Tensor, ...],
    tasks_params: Sequence[Iterable[Tensor]] | None,
    shared_params: Iterable[Tensor] | None,
    engine_names: dict[int, str] | None = None,
) -> tuple[list[tuple[Tensor, ...]], tuple[Tensor, ...]]:
    """The head parameters of each task and the shared ones; a parameter in both is refused
    (``engine_names``: the names of the engine's parameters, on the engine's path)."""
    if shared_params is None:
        shared = leaf_tensors(features)
    else:
        # (a parameter listed twice is taken once, as by backward, torch and TorchJD)
        shared = without_repeats(as_tensor_tuple(shared_params, "shared_params"))
        check_inputs_require_grad(shared, "shared_params")
    if tasks_params is None:
        heads = [leaf_tensors([loss], exclude=features) for loss in losses]
    else:
        try:
            task_list = list(tasks_params)
        except TypeError:
            raise TypeError(
                "`tasks_params` must be a sequence with one iterable of parameters per loss "
                f"(e.g. [head1.parameters(), head2.parameters()]), received {type(tasks_params)}."
            ) from None
        if len(task_list) != len(losses):
            raise ValueError(
                "`tasks_params` must have one iterable of parameters per loss: expected "
                f"{len(losses)}, received {len(task_list)}."
            )
        heads = [
            without_repeats(as_tensor_tuple(p, f"tasks_params[{i}]"))
            for i, p in enumerate(task_list)
        ]
        for i, params in enumerate(heads):
            check_inputs_require_grad(params, f"tasks_params[{i}]")
    shared_ids = {id(p) for p in shared}
    for i, params in enumerate(heads):
        for p in params:
            if id(p) in shared_ids:
                raise ValueError(
                    _overlap_message(
                        i,
                        p,
                        tasks_params is None,
                        shared_params is None,
                        engine_names,
                        features,
                        losses[i],
                    )
                )
    if tasks_params is not None and engine_names is None:
        # (the trunk's rows come through `features` only: a shared parameter that a loss
        # reads directly would lose that use, silently; the engine's rows hold it)
        for i, loss in enumerate(losses):
            for p in leaf_tensors([loss], exclude=features):
                if id(p) in shared_ids:
                    raise ValueError(
                        _overlap_message(i, p, True, shared_params is None, None, features, loss)
                    )
    return heads, shared


def _overlap_message(
    task: int,
    param: Tensor,
    found_in_loss: bool,
    found_behind_features: bool,
    engine_names: dict[int, str] | None,
    features: tuple[Tensor, ...] = (),
    loss: Tensor | None = None,
) -> str:
    """Why ``param`` is both a parameter of task ``task`` and a shared one, and what to do
    (``loss``: that task's, whose graph may hold compiled code)."""
    if found_in_loss and any(passes_through(f.grad_fn) for f in features):
        return (
            f"`losses[{task}]` does not read `features`: they come out of a forward of "
            "DistributedDataParallel(find_unused_parameters=True), which passes every output "
            "of the forward through one node, and a loss computed inside that forward reads the "
            "trunk's output from before that node, not the feature returned. Return only the "
            "features from the DDP forward and compute the heads and losses outside it, or "
            "build DDP with find_unused_parameters=False (the engine does not need it)."
        )
    named = None if engine_names is None else engine_names.get(id(param))
    what = f"the parameter {named}" if named else f"a parameter of shape {tuple(param.shape)}"
    if not found_in_loss:
        where = (
            "behind `features` (a shared parameter by default)"
            if found_behind_features
            else ("in `shared_params`")
        )
        return (
            f"{what[0].upper()}{what[1:]} is both in `tasks_params[{task}]` and {where}; each "
            "parameter belongs either to a task head or to the shared trunk. Pass disjoint "
            "`tasks_params` and `shared_params`."
        )
    trunk = (
        "behind `features` (a shared parameter)"
        if found_behind_features
        else ("in `shared_params`")
    )
    message = (
        f"`losses[{task}]` uses {what} outside `features` (directly, or through another "
        "output of the operation that made a feature, as with `chunk`), and it is also "
        f"{trunk}: a task's parameters get its loss's gradient and the shared ones a row per "
        "task through `features`, so that use fits neither. "
    )
    if loss is not None and holds_compiled([loss], features):
        # (a whole model compiled, or a compiled step: the trunk and the heads in one graph,
        # whose single node the losses reach the trunk through, `features` an output of it)
        return message + (
            f"The graph of `losses[{task}]` holds torch.compile'd code outside `features`: "
            "if the features and the losses come out of one compiled graph (a whole "
            "multi-task model compiled, or a compiled step that computes both), the losses reach "
            "the trunk through that graph, not through `features`. Compile the trunk and the "
            "heads separately (torch.compile(model.trunk), each head apart), or break the graph "
            "after the trunk (torch._dynamo.graph_break())."
        )
    if engine_names is None:
        return message + (
            "Use the shared parameters only through `features`, or pass what the loss reads "
            "as a feature too (`features=[f, param]`, or `features=[f1, f2]` for both outputs "
            "of a chunk): each task's use of it then counts in its row."
        )
    return message + (
        "If the loss reads an activation of the trunk, pass it as a feature too "
        "(`features=[h, f]`), which the engine takes. The engine sees its modules' parameters "
        "through their calls only: for a parameter read directly, compute such a term apart (a "
        "backward of its own, outside the aggregation), or step without the engine and add "
        "that parameter to `features` (`features=[f, param]`)."
    )


def mtl_backward(
    losses: Sequence[Tensor],
    features: Tensor | Sequence[Tensor],
    A: Aggregator | None = None,
    *,
    tasks_params: Sequence[Iterable[Tensor]] | None = None,
    shared_params: Iterable[Tensor] | None = None,
    retain_graph: bool = False,
    parallel_chunk_size: int | None = None,
    engine: Engine | None = None,
) -> None:
    """One step of multi-task Jacobian descent: heads get gradients, the trunk a Jacobian.

    Each task ``i`` has a scalar loss computed by a head from the shared ``features``. The head
    parameters of task ``i`` receive the ordinary gradient of ``losses[i]`` in ``.grad``. The
    shared parameters (the trunk, behind ``features``) receive the ``[m, *p.shape]``
    Jacobian of the ``m`` losses in ``.jac``, or its aggregation by ``A`` in ``.grad``. Each
    head is differentiated once; the trunk is differentiated once per task, through the
    features (vmapped over tasks, in chunks of ``parallel_chunk_size``).

    A parameter that no loss reaches (a head whose task is absent from this step, a shared
    parameter behind no feature that a loss reads) is left as it is: its ``.grad`` stays
    ``None`` (or keeps its value), as after ``sum(losses).backward(inputs=...)``, and a shared
    one gets no ``.jac`` (one it has is left unchanged), which :func:`jac_to_grad` then skips.
    A shared parameter that some tasks reach has zeros in the other tasks' rows, and ``A``
    gets the whole trunk Jacobian (the zero columns of unreached shared parameters included),
    also when no shared parameter is reached (as with ``engine``: a stateful ``A``
    advances at every call). (TorchJD 0.18 writes zeros to unreached shared parameters; see
    :func:`backward`.)

    Args:
        losses: one scalar loss per task.
        features: the last shared representation(s) that the heads read. One may be computed
            from another (multi-scale features, ``f2 = stage2(f1)``): each path from a loss to
            the trunk counts once (at the cost of one more pull-back per such feature).
        A: aggregator of the trunk's Jacobian; ``None`` stores ``.jac`` instead. With ``A``,
            the shared parameters must be real, as in :func:`backward`.
        tasks_params: per task, the head parameters (distinct within a task; a parameter of
            several heads gets the sum of their gradients). Default: the leaves behind each loss
            that are not behind ``features``.
        shared_params: the trunk parameters, distinct. Default: the leaves behind ``features``.
            One that no loss reaches through ``features`` keeps its ``.grad`` and ``.jac``.
        retain_graph: keep the graph for another differentiation.
        parallel_chunk_size: tasks differentiated per vmapped trunk call (``1``: no vmap).
            With ``engine``: ``None``, the tasks' rows pulled back in one backward batched with
            vmap, or ``1``, one by one without vmap (the gradient hooks of the engine's modules'
            outputs too: the way out for an operation that vmap cannot batch); the engine has
            no chunks, so other values are refused. A ``torch.compile``'d trunk cannot be
            vmapped: pass ``1``, and set ``torch._functorch.config.donated_buffer = False``
            before compiling (each task's backward retains the graph, which inductor refuses at
            once and ``aot_eager`` after a recompilation, e.g. at a smaller last batch).
            Compile the trunk and the heads apart: from one compiled graph (a whole model, or
            a compiled step computing both), the losses reach the trunk outside ``features``.
            A trunk with sparse gradients (``nn.Embedding(sparse=True)``) or products with
            sparse tensors (a graph neural network's adjacency matrix) is differentiated task
            by task, into a dense Jacobian, as in :func:`jac`; with ``engine``, its
            parameters outside the engine's modules too, and the engine pulls the tasks back
            one by one.
        engine: a per-task :class:`jacflow.autogram.Engine` (``batch_dim=None``) hooked on the
            trunk before the forward pass. With a Gramian-based ``A`` (UPGrad, MGDA, ...), the
            step then goes through the Gramian engine: no trunk Jacobian is formed and the
            trunk's weight gradients are computed once, for about ``(m + 2) / 3`` SGD steps
            instead of ``(2m + 1) / 3``. The result is the same (up to rounding: under autocast,
            to that of its low precision, about 1e-3 in bfloat16), except where a hooked trunk
            parameter has a gradient hook: that hook runs on the parameter's update, not on
            each task's row, so the Gramian, and the weights, do not see it (without the
            engine they do, even for a hook linear in its gradient). Trunk parameters that the
            engine does not hook (a projection after its modules) join the Jacobian with a row
            per task from the same backward (their gradient hooks run on each row, as without
            the engine), and given ``shared_params`` must
            hold the engine's parameters behind ``features``. A head parameter with a gradient
            hook gets its gradient from a backward of its own: the hook sees the sum of its
            tasks' gradients, not each task's part (without the engine, as in TorchJD, it runs
            on each task's: for a parameter of several tasks and a hook that is not linear, the
            two differ). Losses that read no feature (or only
            features outside the engine's modules, as a trunk parameter given as one) leave
            the engine's parameters as they are, and so does any shared parameter that no loss
            reaches, as without the engine; a loss that also reads one of the engine's
            parameters directly (a penalty on it) is refused, as without the engine. ``A`` is not
            called on a Jacobian there: its
            ``gramian_weighting`` is called on the Gramian, so forward hooks on that weighting
            run (``monitor.AggregatorWatch`` works), and hooks on ``A`` or ``A.weighting`` do
            not; a subclass of ``A`` that overrides ``forward`` or ``weights`` is refused.

    A feature that called ``retain_grad()`` gets in ``.grad`` what ``sum(losses).backward()``
    would give it: the sum of the tasks' gradients at it, added to what it held, whatever
    ``parallel_chunk_size``, and with ``engine`` too (at the cost of one more differentiation
    of the heads). Torch's hook would write it in every differentiation through the feature
    (once per task, and a batched tensor under vmap). A tensor between ``features`` and the
    shared parameters that called ``retain_grad()`` is left to that hook, as in :func:`backward`.

    A gradient hook on a feature (``features[j].register_hook``) takes part in each task's row
    once, as in ``autograd.grad(losses[i], shared_params)``: it runs in the trunk's
    pull-back, on the rows of each chunk (under vmap, one call per chunk; one per task with
    ``parallel_chunk_size=1``), and with ``engine`` on each task's row. A feature that also
    retains grad gets the hook's output on the losses' summed gradient, as after
    ``sum(losses).backward()`` (one more differentiation of the heads).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from jacflow import mtl_backward
        >>> from jacflow.aggregation import UPGrad
        >>> _ = torch.manual_seed(0)
        >>> trunk, head1, head2 = nn.Linear(3, 4), nn.Linear(4, 1), nn.Linear(4, 1)
        >>> x = torch.randn(8, 3)
        >>> features = trunk(x)
        >>> loss1, loss2 = head1(features).pow(2).mean(), head2(features).abs().mean()
        >>> mtl_backward([loss1, loss2], features, A=UPGrad())
        >>> trunk.weight.grad.shape, head1.weight.grad.shape
        (torch.Size([4, 3]), torch.Size([1, 4]))
    """
    check_flag(retain_graph, "retain_graph")
    if engine is not None:
        from jacflow.autogram import Engine
        from jacflow.autogram._engine import step_meeting

        # (under DDP, a failure of the checks on one replica is announced to the others)
        meeting = step_meeting(engine) if isinstance(engine, Engine) else contextlib.nullcontext()
        with meeting:
            loss_tuple, feature_tuple, aggregator, chunk_size = _checked(
                losses, features, A, parallel_chunk_size
            )
            _engine_step(
                loss_tuple,
                feature_tuple,
                aggregator,
                tasks_params,
                shared_params,
                engine,
                retain_graph,
                chunk_size,
            )
        return
    loss_tuple, feature_tuple, aggregator, chunk_size = _checked(
        losses, features, A, parallel_chunk_size
    )
    heads, shared = _resolve_params(loss_tuple, feature_tuple, tasks_params, shared_params)
    if shared_params is None and not shared:
        raise ValueError(
            "No parameter behind `features` requires grad: every leaf tensor that the features "
            "depend on was frozen (requires_grad=False) since the forward, so there is no "
            "trunk Jacobian to form. Unfreeze one, or step the heads alone "
            "(sum(losses).backward(), or mtl_backward(..., engine=engine), which steps them)."
        )
    check_non_empty(shared, "shared_params")
    check_reentrant_checkpoints(loss_tuple, [*(p for ps in heads for p in ps), *shared], "losses")
    if aggregator is None:
        check_jac_accumulable(shared, len(loss_tuple), "shared_params")
    else:
        check_real_inputs(shared, "shared_params")
    warn_if_distributed()

    retaining = _retaining(feature_tuple, shared)
    with _grads_put_back(retaining):
        # The features' gradient hooks (register_hook) must run once on each task's row, as in
        # `autograd.grad(losses[i], trunk)`: the heads' pass and the direct parts below take
        # the rows before them, and the trunk's pull-back from the features runs them (where
        # autograd does, a nested feature's too). Run in both, they applied twice.
        with _hooks_paused(feature_tuple):
            head_grads, feature_rows = _head_pass(loss_tuple, heads, feature_tuple)
            totals = [
                torch.stack([torch.zeros_like(f) if g is None else g for g in rows])
                for f, rows in zip(feature_tuple, feature_rows)
            ]
            cotangents = _direct_cotangents(feature_tuple, totals, chunk_size)
        # (the hooks' output at a feature that retains grad, before the pull-back frees the graph)
        hooked = any(f._backward_hooks for f in feature_tuple)
        sums = _summed_grads(loss_tuple, retaining) if retaining and hooked else None
        # (pulled back from the features that a loss reads only: no task reaches a shared
        # parameter behind none of those, which keeps its `.grad` and `.jac`, as after
        # `sum(losses).backward(inputs=shared_params)`)
        read = [j for j, rows in enumerate(feature_rows) if any(g is not None for g in rows)]
        if read:
            jacobians, trunk_reached = compute_jacobians(
                tuple(feature_tuple[j] for j in read),
                shared,
                [cotangents[j] for j in read],
                len(loss_tuple),
                retain_graph,
                False,
                chunk_size,
            )
        else:  # (zeros: `A` is called at every step, as with `engine`, so its state and hooks
            # advance the same on both routes)
            jacobians = tuple(p.new_zeros((len(loss_tuple), *p.shape)) for p in shared)
            trunk_reached = (False,) * len(shared)
    trunk: list[tuple[Tensor, Tensor | None]] = []
    if aggregator is None:
        kept = [k for k, r in enumerate(trunk_reached) if r]
        accumulate_jacs([shared[k] for k in kept], [jacobians[k] for k in kept])
    else:  # (the whole Jacobian aggregated, the unreached parameters' zeros included)
        updates, _ = aggregate_blocks(aggregator, jacobians)
        trunk = [(p, u if r else None) for p, u, r in zip(shared, updates, trunk_reached)]
    if sums is None:  # (no hook: the sum of the tasks' gradients at a retaining feature)
        sums = [
            total.sum(0) if any(g is not None for g in rows) else None
            for f, total, rows in zip(feature_tuple, totals, feature_rows)
            if any(f is r for r in retaining)
        ]
    # (the trunk's, the heads' and the retaining features' .grad in one write: a failure leaves
    # all of them as they were; a None, for one that no loss reaches, leaves it alone, and a
    # retaining feature that a loss reaches gets the sum of their gradients, once)
    written = [*trunk, *head_grads, *zip(retaining, sums)]
    accumulate_grads([p for p, _ in written], [g for _, g in written])


def _summed_grads(losses: Sequence[Tensor], tensors: list[Tensor]) -> list[Tensor | None]:
    """The gradients of the losses' sum at ``tensors`` (``None`` where none reaches one), their
    gradient hooks run, as ``sum(losses).backward()`` leaves in a ``.grad`` that they retain.

    A hooked tensor gets a differentiation of its own: with another input behind it, torch
    returns its gradient from before its hooks. The graph is kept.
    """
    found: list[Tensor | None] = [None] * len(tensors)
    groups = [[i] for i, t in enumerate(tensors) if t._backward_hooks]
    plain = [i for i, t in enumerate(tensors) if not t._backward_hooks]
    for group in [*groups, *([plain] if plain else [])]:
        grads = torch.autograd.grad(
            losses, [tensors[i] for i in group], retain_graph=True, allow_unused=True
        )
        for i, g in zip(group, grads):
            found[i] = g
    return found


def _head_pass(
    losses: tuple[Tensor, ...], heads: list[tuple[Tensor, ...]], features: tuple[Tensor, ...]
) -> tuple[list[tuple[Tensor, Tensor]], list[list[Tensor | None]]]:
    """Each head differentiated once: the gradient of each head parameter (summed over the
    tasks that reach it), and per feature, each task's gradient (``None`` where it does not
    reach the feature)."""
    head_grads: dict[int, tuple[Tensor, Tensor]] = {}
    feature_rows: list[list[Tensor | None]] = [[] for _ in features]
    for loss, params in zip(losses, heads):
        grads = torch.autograd.grad(
            loss, [*params, *features], retain_graph=True, allow_unused=True
        )
        for p, g in zip(params, grads[: len(params)]):
            if g is not None:
                previous = head_grads.get(id(p))
                head_grads[id(p)] = (p, g if previous is None else previous[1] + g)
        for rows, g in zip(feature_rows, grads[len(params) :]):
            rows.append(g)
    return list(head_grads.values()), feature_rows


def _retaining(features: tuple[Tensor, ...], shared: tuple[Tensor, ...] = ()) -> list[Tensor]:
    """The features that called ``retain_grad()`` (those not among the shared parameters, which
    get their own result): torch's hook writes their ``.grad`` in every differentiation that
    reaches them, once per task and a batched tensor under vmap, so ``mtl_backward`` puts it
    back and adds the tasks' summed gradient once."""
    inputs = {id(p) for p in shared}
    return [f for f in features if f.retains_grad and id(f) not in inputs]


@contextlib.contextmanager
def _grads_put_back(tensors: Sequence[Tensor]) -> Iterator[None]:
    """Put back the ``.grad`` that ``tensors`` hold now when the block ends, failed or not."""
    kept = [(t, t.grad) for t in tensors]
    try:
        yield
    finally:
        for tensor, grad in kept:
            tensor.grad = grad


@contextlib.contextmanager
def _hooks_paused(tensors: Sequence[Tensor]) -> Iterator[None]:
    """The gradient hooks that a user registered on ``tensors`` (``register_hook``) left out of
    the differentiations in the block, and put back, in their order, when it ends.

    Torch keeps them in the tensor's ``_backward_hooks`` dict, which its node reads at each
    backward (as the engine's ``_hooks.py`` does): emptied in place, the node runs none. The
    hook of ``retain_grad()`` is not in it (see :func:`_grads_put_back`).
    """
    paused: list[tuple[dict[int, Hook], dict[int, Hook]]] = []
    for tensor in tensors:
        hooks = tensor._backward_hooks
        if hooks:
            paused.append((hooks, dict(hooks)))
            hooks.clear()
    try:
        yield
    finally:
        for dict_, kept in paused:
            added = dict(dict_)  # (registered meanwhile: after the user's)
            dict_.clear()
            dict_.update(kept)
            dict_.update(added)


def _direct_cotangents(
    features: tuple[Tensor, ...], totals: list[Tensor], chunk_size: int | None
) -> tuple[Tensor, ...]:
    """Each task's cotangent of each feature through the heads alone, from its total one.

    ``totals[j]`` (``[m, *features[j].shape]``, from ``autograd.grad(loss, features)``) is the
    gradient of each loss w.r.t. ``features[j]``, the paths through the features computed from
    it included (``f2 = stage2(f1)``: the head's use of ``f2`` counts in ``f1``'s). Pulled back
    from all the features at once, such a path would count twice: once in ``f1``'s total and
    once from ``f2``. The direct part is the total less the pull-back to ``features[j]`` of
    the direct parts of the features computed after it, so the features are taken from the
    last created to the first (a node is created after its inputs' nodes; a leaf before any).
    Only nested features (:func:`nested_features`) cost a pull-back, of ``m`` rows in chunks
    of ``chunk_size``.
    """
    direct = list(totals)
    nested = nested_features(features)
    if not nested:
        return tuple(direct)

    def created(j: int) -> int:
        node = features[j].grad_fn
        return -1 if node is None else node._sequence_nr()

    rows = direct[0].shape[0]
    for j in sorted(nested, key=created, reverse=True):
        later = [i for i in range(len(features)) if created(i) > created(j)]
        (through,), _ = compute_jacobians(
            tuple(features[i] for i in later),
            (features[j],),
            [direct[i] for i in later],
            rows,
            True,
            False,
            chunk_size,
        )
        direct[j] = direct[j] - through.to(direct[j].dtype)
    return tuple(direct)


def _checked(
    losses: Sequence[Tensor],
    features: Tensor | Sequence[Tensor],
    A: Aggregator | None,
    parallel_chunk_size: int | None,
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...], Aggregator | None, int | None]:
    """``mtl_backward``'s arguments, checked."""
    if isinstance(losses, Tensor) and losses.numel() > 1:
        how = "`list(losses)` or `losses.unbind()`" if losses.ndim == 1 else "a list"
        raise ValueError(
            "`losses` must hold one scalar loss per task, received one tensor of shape "
            f"{tuple(losses.shape)}. Pass each task's loss as its own scalar ({how}): each task "
            "then gets its row of the trunk's Jacobian."
        )
    loss_tuple = as_tensor_tuple(losses, "losses")
    check_non_empty(loss_tuple, "losses")
    check_unique(loss_tuple, "losses")
    _check_scalar_losses(loss_tuple)
    check_real(loss_tuple, "losses")
    feature_tuple = as_tensor_tuple(features, "features")
    check_non_empty(feature_tuple, "features")
    check_unique(feature_tuple, "features")
    check_real(feature_tuple, "features")
    check_inputs_require_grad(feature_tuple, "features", _DETACHED_FEATURE)
    aggregator = check_aggregator(A)
    if aggregator is not None:  # (before any differentiation: a refusal keeps the graph)
        aggregator.check_rows(len(loss_tuple))
    chunk_size = check_chunk_size(parallel_chunk_size, "parallel_chunk_size")
    return loss_tuple, feature_tuple, aggregator, chunk_size


def _engine_step(
    losses: tuple[Tensor, ...],
    features: tuple[Tensor, ...],
    aggregator: Aggregator | None,
    tasks_params: Sequence[Iterable[Tensor]] | None,
    shared_params: Iterable[Tensor] | None,
    engine: Engine,
    retain_graph: bool,
    chunk_size: int | None = None,
) -> None:
    """``mtl_backward`` through the per-task Gramian engine (validated first, written last)."""
    from jacflow.autogram import Engine
    from jacflow.autogram._engine import TaskLayout
    from jacflow.autogram._mtl import per_task_step

    if not isinstance(engine, Engine):
        raise TypeError(
            f"`engine` must be a jacflow.autogram.Engine or None, received {received(engine)}."
        )
    if not isinstance(aggregator, GramianWeightedAggregator):
        raise ValueError(
            "`engine` needs a Gramian-based aggregator `A` (e.g. UPGrad(), MGDA(), Mean()): the "
            f"engine computes the Gramian, not the Jacobian; received A={aggregator!r}. Drop "
            "`engine` to store `.jac` or to use a Jacobian-based aggregator."
        )
    if not weights_from_gramian(aggregator):
        raise ValueError(
            f"`engine` calls the Gramian weighting of `A` on the Gramian, and A={aggregator!r} "
            "weights the rows from more than their Gramian (Krum: the centred rows in float64), "
            "which that would skip. Drop `engine`, or pass "
            "GramianWeightedAggregator(A.gramian_weighting) to weight the plain Gramian."
        )
    if not computed_by_library(aggregator):
        raise ValueError(
            "`engine` calls the Gramian weighting of `A` on the Gramian, and "
            f"{type(aggregator).__name__} overrides `forward` or `weights`, which that would "
            "skip. Put the change in a "
            "GramianWeighting of your own (GramianWeightedAggregator(MyWeighting())), or drop "
            "`engine`."
        )
    if chunk_size not in (None, 1):
        # (the engine's backward is one pull-back of all the rows: it has no chunks to size)
        raise ValueError(
            "`parallel_chunk_size` must be None or 1 with `engine`, received "
            f"{chunk_size}: the engine pulls the tasks' rows back in one backward batched with "
            "vmap (None) or one by one without vmap (1), not in chunks. Drop `engine` to "
            "differentiate the trunk in chunks of rows."
        )
    heads, shared = _resolve_params(
        losses, features, tasks_params, shared_params, engine._hooked_names()
    )
    check_real_inputs(shared, "shared_params")
    if shared_params is not None:
        _check_engine_params_shared(shared, features, engine)
    # (a task parameter gets the gradient of its tasks' losses only; with both defaults, the
    # other losses do not reach it, and that of all the losses is the same)
    explicit = tasks_params is not None or shared_params is not None
    if explicit:  # (a task parameter that its tasks' losses do not reach is left as it is)
        # (the default shared parameters are the leaves behind the features: not walked again)
        behind = shared if shared_params is None else leaf_tensors(features)
        heads = _reached_heads(losses, features, heads, behind)
    layout = TaskLayout(_task_rows(heads) if explicit else {}, shared, features, chunk_size == 1)
    stacked = torch.stack([loss.reshape(()) for loss in losses])
    retaining = _retaining(features, shared)
    with _grads_put_back(retaining):
        # (the sum of the losses' gradients at these, before the step frees the graph: one
        # more differentiation of the heads, as the engine's step does not form it)
        sums = _summed_grads(losses, retaining) if retaining else []
        per_task_step(  # (which takes a parameter of several heads once)
            stacked,
            engine,
            aggregator.gramian_weighting,
            [p for params in heads for p in params],
            retain_graph,
            layout,
        )
    accumulate_grads(retaining, sums)


def _check_engine_params_shared(
    shared: tuple[Tensor, ...], features: tuple[Tensor, ...], engine: Engine
) -> None:
    """Refuse ``shared_params`` given without a parameter of the engine's modules that lies
    behind ``features``: the engine's Gramian and update cover it."""
    names = engine._hooked_names()
    given = {id(p) for p in shared}
    for p in leaf_tensors(features):
        if id(p) in names and id(p) not in given:
            raise ValueError(
                "`shared_params` must hold every parameter of the engine's modules behind "
                f"`features`: the engine's Gramian and update cover them, and {names[id(p)]} "
                "is not in it. Leave `shared_params` to its default (the leaves behind "
                "`features`), or add the engine's modules' parameters to it."
            )


def _reached_heads(
    losses: tuple[Tensor, ...],
    features: tuple[Tensor, ...],
    heads: list[tuple[Tensor, ...]],
    behind: tuple[Tensor, ...],
) -> list[tuple[Tensor, ...]]:
    """Each task's parameters that its loss may reach: in its head (a walk that stops at
    ``features``), or ``behind`` the features (their leaves: a projection between the
    engine's modules and the features listed as a task's). The engine's backward, batched
    over the tasks, gives the others a zero gradient where torch, and the route without the
    engine, leave their ``.grad`` as it is."""
    ids = {id(p) for p in behind}
    reached = [ids | {id(p) for p in leaf_tensors([loss], exclude=features)} for loss in losses]
    return [tuple(p for p in ps if id(p) in r) for ps, r in zip(heads, reached, strict=True)]


def _task_rows(heads: list[tuple[Tensor, ...]]) -> dict[int, tuple[int, ...]]:
    """Per head parameter (by ``id``), the tasks that list it, where not all of them do."""
    owners: dict[int, dict[int, None]] = {}
    for task, params in enumerate(heads):
        for p in params:
            owners.setdefault(id(p), {})[task] = None
    return {key: tuple(tasks) for key, tasks in owners.items() if len(tasks) < len(heads)}
