"""Any other module with parameters: per-row gradients through ``torch.func``.

Per-sample mode re-runs the module on each sample (``functional_call`` on a batch of one) and
pulls every row's output gradient back with ``vjp``, all under ``vmap``. Per-task mode runs the
module once on the stored inputs and ``vmap``s the ``vjp`` over the rows. The per-row gradients
are materialised (``R x P_module``), so this rule suits small modules (attention projections,
custom layers); register a closed form for big ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call, vjp, vmap
from torch.nn.utils import parametrize
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from jacflow.autogram._embedding import frequency_refusal
from jacflow.autogram._flatten import leaves
from jacflow.autogram._outside import sparse_inside
from jacflow.autogram._precision import replay_autocast
from jacflow.autogram._rules import (
    Call,
    Contribution,
    MaterializedContribution,
    Rows,
    Rule,
    add_grads,
    backward_hooks,
    quiet_vmap_fallback,
    replaying,
)
from jacflow.autojac._graph import children, walk_nodes

# a re-run's outputs may differ from the forward's by this many units of roundoff, relative
# to the largest output (a batch of one and the batch take other kernels, whose roundoff a
# cancelling output magnifies), and by at most this fraction (bfloat16 has 8 bits)
_SAME_OUTPUT_EPS = 1e4
_SAME_OUTPUT_MAX = 0.05
# the most nodes of a call's forward graph walked for its lowest precision (see _inner_eps)
_INNER_NODES = 10_000
# torch's warning when a forward hook raises while the forward itself raises
_SILENCED_HOOK = "module forward hook with ``always_call=True`` raised an exception"


def _no_closed_form(module: nn.Module) -> str:
    """How the generic rule's errors begin: the module's type has no closed form, or its rule
    handed this call over (a setting the closed form does not cover)."""
    return f"{type(module).__name__} has no closed-form Gramian rule for this call"


def _selected_outputs(out: Any, positions: list[int]) -> tuple[Tensor, ...]:
    found = leaves(out)
    return tuple(found[i] for i in positions)


def _with_buffers(call: Call, module: nn.Module, params: dict[str, Tensor]) -> dict[str, Tensor]:
    """``params`` and copies of the module's buffers as the call found them (recorded at its
    start; else as they are now), made inside the transforms: a re-run updates the copies
    (BatchNorm's running statistics in training mode), which torch.func allows, reads what the
    call read, and leaves the module's as the forward left them."""
    return {**{name: b.clone() for name, b in call.found_buffers(module).items()}, **params}


def _per_task_grads(
    module: nn.Module,
    params: dict[str, Tensor],
    call: Call,
    cots: tuple[Tensor, ...],
    upstream: frozenset[int],
) -> tuple[dict[str, Tensor], tuple[Tensor, ...]]:
    """The rows' gradients, and the re-run's outputs."""
    pulled: list[tuple[Tensor, ...]] = []  # (the row being pulled back, for the hooks)
    forward = _whole_batch_forward(module, call, lambda: pulled[-1], upstream)
    with _NoRandomDraws():
        outputs, pullback = vjp(forward, params)[:2]

    def pull(row: tuple[Tensor, ...]) -> dict[str, Tensor]:
        pulled.append(row)
        try:
            result: dict[str, Tensor] = pullback(row)[0]
            return result
        finally:
            pulled.pop()

    grads: dict[str, Tensor] = _batched_or_row_by_row(pull, (*cots, *_reached_inner_calls(call)))
    return grads, outputs


def _whole_batch_forward(
    module: nn.Module,
    call: Call,
    row: Callable[[], tuple[Tensor, ...]] = tuple,
    upstream: frozenset[int] = frozenset(),
) -> Callable[[dict[str, Tensor]], tuple[Tensor, ...]]:
    """The module's forward on the call's recorded inputs, as a function of its parameters:
    the selected outputs, then those of the reached calls made inside it (the ``upstream``
    ones given their gradient in ``row()``, see :func:`_own_gradients`)."""

    def forward(p: dict[str, Tensor]) -> tuple[Tensor, ...]:
        kept: list[Tensor] = []
        with _inner_calls(module, list(p), call, kept):
            out = functional_call(module, _with_buffers(call, module, p), call.args, call.kwargs)
        outputs = _selected_outputs(out, call.output_positions)
        _own_gradients(outputs, upstream, lambda j: row()[j])
        return (*outputs, *kept)

    return forward


def _whole_batch_vjp(
    module: nn.Module,
    params: dict[str, Tensor],
    call: Call,
    row: Callable[[], tuple[Tensor, ...]] = tuple,
    upstream: frozenset[int] = frozenset(),
) -> tuple[tuple[Tensor, ...], Callable[..., tuple[dict[str, Tensor]]]]:
    """One re-run of the module on the whole recorded batch (no vmap), under ``vjp`` so that
    the parameters are differentiated as in the forward (torch's fast paths, as the transformer
    layers' in eval mode, are taken only without grad), with the random generators left as
    they were: its outputs and its pullback (see :func:`_whole_batch_forward`)."""
    forward = _whole_batch_forward(module, call, row, upstream)
    with _generators_kept(params), _NoRandomDraws():
        outputs, pullback = vjp(forward, params)[:2]
    return outputs, pullback


def _whole_batch_outputs(
    module: nn.Module, params: dict[str, Tensor], call: Call
) -> tuple[Tensor, ...]:
    """The outputs of one re-run of the module on the whole recorded batch."""
    return _whole_batch_vjp(module, params, call)[0]


def _generators_kept(params: dict[str, Tensor]) -> contextlib.AbstractContextManager[Any]:
    """Restore the global generators of the parameters' device (those :func:`_rng_states`
    reads) at the end."""
    device = next(iter(params.values())).device
    cuda = device.type == "cuda"
    return torch.random.fork_rng([device] if cuda else [], device_type="cuda" if cuda else "cpu")


def _whole_batch_run(
    module: nn.Module,
    params: dict[str, Tensor],
    call: Call,
    cots: tuple[Tensor, ...],
    upstream: frozenset[int],
) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
    """The outputs of one re-run of the module on the whole recorded batch, and its
    parameters' gradient for the output gradients ``cots`` (one per sample, those of the
    reached inner calls after the outputs')."""
    outputs, pullback = _whole_batch_vjp(module, params, call, lambda: cots, upstream)
    grads: dict[str, Tensor] = pullback(tuple(c.to(o.dtype) for c, o in zip(cots, outputs)))[0]
    return outputs, grads


def _per_sample_sums(rows: Rows, per_row: Tensor) -> Tensor:
    """``[R, ...]`` -> ``[S, ...]``: each sample's sum of its rows."""
    if rows.index is None:
        return per_row
    return per_row.new_zeros(rows.num_samples, *per_row.shape[1:]).index_add_(
        0, rows.index, per_row
    )


class _NoRandomDraws(TorchDispatchMode):
    """Raise at a re-run's first random operation, before it draws: it would draw other
    numbers than the forward did, and advance a generator, the module's own too."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs):
            raise RuntimeError(f"the re-run of the module draws random numbers ({func})")
        return func(*args, **kwargs)


def _draws(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an operation tagged as random draws: not with a dropout probability of 0 (the
    attention kernels') or outside training (``native_dropout``'s ``train=False``)."""
    schema = func._schema.arguments
    given = {a.name: a.default_value for a in schema if a.has_default_value()}
    given.update({**dict(zip([a.name for a in schema], args, strict=False)), **kwargs})
    off = given.get("train", True) is False or given.get("training", True) is False
    return given.get("dropout_p", 1.0) != 0.0 and not off  # (training: rrelu_with_noise's)


def _batched_or_row_by_row(function: Callable[[Any], Any], rows: Any) -> Any:
    """``vmap(function)(rows)``, or, where an operation's batching rule fails (a bfloat16
    convolution's backward under autocast), ``function`` on each row of ``rows`` (a pytree of
    tensors ``[R, ...]``), stacked: slower, and exact."""
    try:
        with warnings.catch_warnings():  # (torch's note on the engine's hooks, as it fails)
            warnings.filterwarnings("ignore", message=_SILENCED_HOOK, category=UserWarning)
            return vmap(function)(rows)
    except RuntimeError as error:
        # (vmap's refusal of random operations, or a refusal of the re-run: not a rule's)
        if "random" in str(error) or isinstance(error, ReplayMismatchError):
            raise
    leaves, spec = tree_flatten(rows)
    count = leaves[0].shape[0]
    results = [function(tree_unflatten([leaf[r] for leaf in leaves], spec)) for r in range(count)]
    columns = [tree_flatten(result)[0] for result in results]
    stacked = [torch.stack(rows_of_one) for rows_of_one in zip(*columns, strict=True)]
    return tree_unflatten(stacked, tree_flatten(results[0])[1])


def _own_gradients(
    outputs: tuple[Tensor, ...], upstream: frozenset[int], grad: Callable[[int], Tensor]
) -> None:
    """Give each re-run output ``j`` in ``upstream`` (another output is computed from it) the
    gradient ``grad(j)`` in place of the one it accumulates: its captured gradient already
    counts the paths through the outputs computed from it, which the re-run would add again."""
    for j in upstream:
        outputs[j].register_hook(lambda g, j=j: grad(j).to(g.dtype).reshape(g.shape))


def _per_sample_grads(
    module: nn.Module,
    params: dict[str, Tensor],
    call: Call,
    cots: tuple[Tensor, ...],
    rows: Rows,
    upstream: frozenset[int],
    summed_later: bool = False,
) -> dict[str, Tensor]:
    """Each row's gradient, by a re-run of each sample under ``vmap``, checked against a re-run
    on the whole batch (``summed_later``: the gradients are checked by the caller, with those
    of the module's other calls, and only the outputs here)."""
    leaves, spec = tree_flatten((call.args, call.kwargs))
    batched = [
        isinstance(leaf, Tensor) and leaf.ndim >= 1 and leaf.shape[0] == rows.num_samples
        for leaf in leaves
    ]
    row_leaves = [rows.gather(leaf) for leaf, b in zip(leaves, batched, strict=True) if b]

    def per_row(
        row_inputs: list[Tensor], cot: tuple[Tensor, ...]
    ) -> tuple[dict[str, Tensor], tuple[Tensor, ...]]:
        it = iter(row_inputs)
        full = [next(it).unsqueeze(0) if b else leaf for leaf, b in zip(leaves, batched)]
        args, kwargs = tree_unflatten(full, spec)

        def forward(p: dict[str, Tensor]) -> tuple[Tensor, ...]:
            kept: list[Tensor] = []
            with _inner_calls(module, list(p), call, kept):
                out = functional_call(
                    module, _with_buffers(call, module, p), tuple(args), dict(kwargs)
                )
            selected = _selected_outputs(out, call.output_positions)
            _own_gradients(selected, upstream, lambda j: cot[j].unsqueeze(0))
            _check_one_sample_shapes(module, (*selected, *kept), cot)
            return tuple(o.squeeze(0) for o in (*selected, *kept))

        outputs, pullback = vjp(forward, params)[:2]
        result: dict[str, Tensor] = pullback(cot)[0]
        return result, outputs

    row_cots = (*cots, *_reached_inner_calls(call))
    grads, outputs = _batched_or_row_by_row(lambda rows: per_row(*rows), (row_leaves, row_cots))
    split = [tuple(leaf.shape) for leaf, b in zip(leaves, batched, strict=True) if b]
    if summed_later:
        _check_same_outputs(
            module, call, outputs, rows, split, lambda: _whole_batch_outputs(module, params, call)
        )
        return grads
    whole = functools.cache(
        lambda: _whole_batch_run(
            module, params, call, tuple(_per_sample_sums(rows, c) for c in row_cots), upstream
        )
    )
    _check_same_outputs(module, call, outputs, rows, split, lambda: whole()[0])
    _check_same_gradients(module, [call], grads, whole()[1], "a re-run on the whole batch")
    return grads


class ReplayMismatchError(RuntimeError):
    """A re-run of a module gave other outputs than its forward."""


def _check_one_sample_shapes(
    module: nn.Module, outputs: tuple[Tensor, ...], cots: tuple[Tensor, ...]
) -> None:
    """Per sample, refuse a re-run on one sample whose output is not that sample's (shape
    ``[1, *row]``, ``row`` the shape of its rows' output gradients): the forward does not
    keep the batch of its arguments' dimension 0 on its outputs' dimension 0."""
    for output, cot in zip(outputs, cots, strict=False):
        if output.squeeze(0).shape != cot.shape:
            raise ReplayMismatchError(
                f"{_no_closed_form(module)}, so the engine re-runs it sample by sample "
                f"(batch_dim set), on a batch of one, which gave an output of shape "
                f"{list(output.shape)} where {[1, *cot.shape]} was expected: its outputs do not "
                "follow the batch on dimension 0 of its tensor arguments (an argument with the "
                "batch on another dimension, as [T, B, d], or an output transposed so; no "
                "tensor argument, as a batch size passed as a number; or the batch read as a "
                "number with .item()). Use batch_dim=None, or register a closed form for it "
                "(jacflow.autogram.register_rule)."
            )


def _check_same_outputs(
    module: nn.Module,
    call: Call,
    outputs: tuple[Tensor, ...],
    rows: Rows | None,
    split: Sequence[tuple[int, ...]] = (),
    whole_batch: Callable[[], tuple[Tensor, ...]] | None = None,
) -> None:
    """Refuse a re-run whose outputs differ from the forward's (``rows``: per sample, the
    re-run's rows of samples; ``split``: the shapes of the arguments it split per sample): its
    forward read something that the re-run does not reproduce, and the gradients of the re-run
    would be those of another function. An output changed in place since the forward (an
    in-place ReLU or residual after the module) is compared with the outputs of
    ``whole_batch()`` (a re-run on the whole batch, made once, when first needed): per sample,
    that catches a forward that reads the batch size or an argument split per sample; per
    task (a second re-run), one that reads state it changes (a call counter). Outputs not
    batched as the rows are not compared."""
    # (no copy of the outputs is kept at the forward: every call would pay for the rare
    # in-place op after it, whose version change is seen here)
    whole: tuple[Tensor, ...] | None = None
    for i, ((recorded, version), again) in enumerate(zip(call.outputs, outputs, strict=False)):
        if not recorded.is_floating_point():
            continue
        if recorded._version != version:
            if whole_batch is None:
                continue
            whole = whole_batch() if whole is None else whole
            recorded = whole[i]
        if rows is not None:
            if recorded.ndim == 0 or recorded.shape[0] != rows.num_samples:
                continue
            recorded = rows.gather(recorded)
        if recorded.shape != again.shape:
            continue
        error, scale = _replay_difference(recorded, again)
        if _exceeds(error, scale, [call], again.dtype):
            per_sample = (
                " (a statistic over the batch, as a mean or variance over dimension 0, or "
                "the batch size as a number: the re-run sees one sample; or an argument "
                f"split per sample, as every tensor argument whose first size is the batch size "
                f"{rows.num_samples} is, that has no batch dimension: here the arguments of "
                f"shapes {', '.join(str(list(shape)) for shape in split)}. Make such a shared "
                "tensor a parameter or buffer of the module, or use batch_dim=None)"
                if rows is not None
                else ""
            )
            raise ReplayMismatchError(
                f"{_no_closed_form(module)}, so the engine re-runs "
                "it from its recorded inputs and parameters, which gave other outputs than its "
                f"forward ({_difference_text(error, scale)}): its forward "
                "depends on something else"
                f"{per_sample}, or on state that it changes (a "
                "call counter). Make the forward a function of its inputs and parameters, or "
                "register a closed form for it (jacflow.autogram.register_rule)."
            )


def _tolerance(call: Call, dtype: torch.dtype, inner: bool = False) -> float:
    """How far, relative to the largest entry, a re-run may differ from what it reproduces
    (``inner``: also at the lowest precision that its forward computed in)."""
    # (under autocast, the re-run's products round at the autocast dtype's precision,
    # whatever the output's dtype: a float32 parameter times a bfloat16 product)
    eps = torch.finfo(dtype).eps
    if call.autocast is not None:
        eps = max(eps, torch.finfo(call.autocast[1]).eps)
    if inner:
        eps = max(eps, _inner_eps(call))
    return min(_SAME_OUTPUT_EPS * eps, _SAME_OUTPUT_MAX)


def _exceeds(error: float, scale: float, calls: Sequence[Call], dtype: torch.dtype) -> bool:
    """Whether a re-run's ``error`` is beyond the roundoff that the ``calls`` allow."""
    if error <= max(_tolerance(c, dtype) for c in calls) * max(scale, 1e-30):
        return False
    # (a forward that computes in a lower precision than its outputs and parameters, as the
    # RMSNorm of Gemma, in float32 in a float64 model, rounds at that precision, which the
    # re-run, batched otherwise, does in another order; its graph is walked only then)
    return error > max(_tolerance(c, dtype, inner=True) for c in calls) * max(scale, 1e-30)


def _inner_eps(call: Call) -> float:
    """The roundoff of the lowest floating precision in the autograd graph of ``call``'s
    forward, between its outputs and its inputs (0 where none is seen)."""
    stops = {get_gradient_edge(t).node for t, _ in call.versions if t.requires_grad}

    def inward(node: Any) -> Iterable[Any]:
        return () if node in stops else children(node)  # (a stop: not walked past)

    walked = walk_nodes((edge.node for edge in call.edges), inward)
    inside = (node for node in walked if node not in stops)
    eps = 0.0
    for node in itertools.islice(inside, _INNER_NODES):
        for meta in getattr(node, "_input_metadata", ()):
            if meta.dtype.is_floating_point:
                eps = max(eps, torch.finfo(meta.dtype).eps)
    return eps


@contextlib.contextmanager
def without_tensor_hooks(tensors: Sequence[Tensor]) -> Iterator[None]:
    """The gradient hooks (``register_hook``) of ``tensors`` left out meanwhile: autograd runs
    a leaf's hooks on the gradient it returns for it (the engine's backward, which takes the
    gradient of the generic-rule units' parameters for the rule's check, would run them once
    more than a plain backward, and check their result)."""
    hooked = [(t, t._backward_hooks) for t in tensors if t._backward_hooks]
    for tensor, _ in hooked:
        tensor._backward_hooks = None  # (torch drops its hook that runs the dict)
    try:
        yield
    finally:
        for tensor, hooks in hooked:
            tensor._backward_hooks = hooks


def _check_same_gradients(
    module: nn.Module,
    calls: Sequence[Call],
    grads: dict[str, Tensor],
    whole: Mapping[str, Tensor | None],
    of_whole: str,
) -> None:
    """Per sample, refuse a re-run whose rows' gradients (``grads``, of the ``calls``) do not
    sum to the gradient on the whole batch (``whole``, for the summed output gradients, that
    ``of_whole`` names; ``None``: the losses do not reach the parameter, a zero gradient): the
    forward mixes the samples in a way its outputs do not show, as a batch-centred branch
    behind a gate at 0 (ReZero, adaLN-Zero) or a straight-through ``m - m.detach()`` of a batch
    statistic, and the rows would be the gradients of another function. The difference is
    measured against the largest gradient of any of the parameters (one whose gradient is 0,
    as a shift before a normalisation, differs by roundoff of the others' size)."""
    checked = {n: g.detach() for n, g in grads.items() if g.is_floating_point() and g.numel()}
    sizes = [float(g.abs().sum(0).amax().nan_to_num(0.0, 0.0, 0.0)) for g in checked.values()]
    scale = max(sizes, default=0.0)
    for name, per_row in checked.items():
        summed = per_row.sum(0)
        reference = whole[name]
        reference = summed.new_zeros(()) if reference is None else reference.detach()
        reference = reference.to(per_row.dtype).expand_as(summed)
        error, _ = _replay_difference(reference, summed)
        if _exceeds(error, scale, calls, per_row.dtype):
            raise ReplayMismatchError(
                f"{_no_closed_form(module)}, so the engine re-runs it sample by sample, whose "
                f"gradients for {name} differ from those of {of_whole} "
                f"({_difference_text(error, scale)}): its forward mixes the samples (a "
                "statistic over the batch, as a mean over dimension 0), though its outputs do "
                "not show it here (a branch behind a gate at 0, as ReZero's or adaLN-Zero's "
                "at initialisation), or saved-tensor hooks around the forward change what its "
                "backward reads (a pack hook that casts to bfloat16: the forward's backward is "
                "off by that rounding, the re-run is not). Use batch_dim=None, make the "
                "forward a function of each sample, take such hooks off the module's forward, "
                "or register a closed form for it (jacflow.autogram.register_rule)."
            )


def _non_finite_codes(t: Tensor) -> Tensor:
    """``t``'s non-finite entries as codes (NaN 1, inf 2, -inf 3; a finite entry 0)."""
    codes = t.isnan().to(torch.int8) + 2 * t.isposinf().to(torch.int8)
    return codes + 3 * t.isneginf().to(torch.int8)


def _replay_difference(recorded: Tensor, again: Tensor) -> tuple[float, float]:
    """The largest difference between a re-run's output ``again`` and the recorded one, and
    the largest recorded entry, over the entries finite in both; the difference is infinite
    where their non-finite entries (compared exactly) differ: a NaN of the re-run alone (the
    variance of one sample) would pass any tolerance, and an inf of the forward (masked
    scores) would make it infinite."""
    recorded, again = recorded.detach(), again.detach()
    if not torch.equal(_non_finite_codes(recorded), _non_finite_codes(again)):
        return float("inf"), 0.0
    if not recorded.numel():
        return 0.0, 0.0
    finite = recorded.isfinite()
    recorded, again = recorded.where(finite, 0), again.where(finite, 0)
    return float((again - recorded).abs().amax()), float(recorded.abs().amax())


def _difference_text(error: float, scale: float) -> str:
    """How a refusal states the difference that :func:`_replay_difference` measured."""
    if error == float("inf"):
        return "NaN or inf entries other than the forward's"
    return f"max difference {error:.2e}, outputs up to {scale:.2e}"


def _rng_states(device: torch.device) -> list[Tensor]:
    """The states of the generators that random operations on ``device`` draw from."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _replay_per_task(
    module: nn.Module,
    params: dict[str, Tensor],
    call: Call,
    cots: tuple[Tensor, ...],
    upstream: frozenset[int],
) -> dict[str, Tensor]:
    """:func:`_per_task_grads`, refused when the re-run draws random numbers (dropout, from
    any generator: :class:`_NoRandomDraws` raises before the draw; per sample, ``vmap``
    raises on them itself) or gives other outputs."""
    device = next(iter(params.values())).device  # (an enclosing call may have no output)
    before = _rng_states(device)
    grads, outputs = _per_task_grads(module, params, call, cots, upstream)
    if any(not torch.equal(a, b) for a, b in zip(before, _rng_states(device), strict=True)):
        raise RuntimeError("the re-run of the module drew random numbers")
    # (an output changed in place since is compared with a second re-run: a forward that
    # reads state it changes, as a call counter, gives another output at each)
    _check_same_outputs(
        module, call, outputs, None, whole_batch=lambda: _whole_batch_outputs(module, params, call)
    )
    return grads


@contextlib.contextmanager
def _without_backward_hooks(module: nn.Module) -> Iterator[None]:
    """The re-run differentiates the module's parameters with torch.func, whose transforms
    cannot run the autograd Function behind full module backward hooks
    (``register_full_backward_hook`` and its pre-hook). Those of the module itself act in the
    real backward, whose output gradients (past a pre-hook's change) the re-run is given, so
    they stay out of it; the older ``register_backward_hook`` ones run in it as they are."""
    hooks, pre_hooks = module._backward_hooks, module._backward_pre_hooks
    if module._is_full_backward_hook:
        module._backward_hooks = OrderedDict()
    module._backward_pre_hooks = OrderedDict()
    try:
        yield
    finally:
        module._backward_hooks, module._backward_pre_hooks = hooks, pre_hooks


def _ours(hook: Callable[..., Any]) -> bool:
    """Whether a hook is one of the engine's (a bound method or a partial from this package),
    which ignore a re-run's calls (see :func:`replaying`)."""
    return getattr(getattr(hook, "func", hook), "__module__", "").startswith("jacflow.autogram")


def _hook_on(
    module: nn.Module, hook: Callable[..., Any], only: bool = False
) -> Callable[..., None]:
    """``hook`` as a pre-hook of the re-run's call of ``module``: given copies of the inputs
    (the recorded ones already have its change, in place or returned), its return value
    ignored, its side effects kept (the old ``weight_norm``, ``spectral_norm`` and pruning
    compute the weight from the parameters in theirs). ``only``: a global hook, kept as it is
    on the other modules, whose calls the forward ran it on too."""

    def run(called: nn.Module, *inputs: Any) -> Any:
        if only and called is not module:
            return hook(called, *inputs)
        copies = tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, inputs)
        hook(called, *copies)
        return None

    return run


@contextlib.contextmanager
def _as_recorded(module: nn.Module) -> Iterator[None]:
    """The re-run reproduces the call as the engine recorded it: from its inputs after the
    forward pre-hooks, to its output before its forward hooks (the engine's record runs first,
    and a global forward hook that runs before it is refused). Run again, a hook's change would
    count twice: the module's forward hooks stay out of the re-run, and its pre-hooks (and the
    global ones, on this module) run on copies of the inputs with their results ignored."""
    torch_module = nn.modules.module
    hooks, pre_hooks = module._forward_hooks, module._forward_pre_hooks
    global_pre = torch_module._global_forward_pre_hooks
    module._forward_hooks = OrderedDict()
    module._forward_pre_hooks = OrderedDict(
        (k, h if _ours(h) else _hook_on(module, h)) for k, h in pre_hooks.items()
    )
    # (torch's _call_impl reads the module-level name at each call)
    torch_module._global_forward_pre_hooks = OrderedDict(
        (k, _hook_on(module, h, only=True)) for k, h in global_pre.items()
    )
    try:
        yield
    finally:
        module._forward_hooks, module._forward_pre_hooks = hooks, pre_hooks
        torch_module._global_forward_pre_hooks = global_pre


# what checkpoint() calls: torch 2.14 calls the second, which the first now wraps
_CHECKPOINT_GENERATORS = (
    "_checkpoint_without_reentrant_generator",
    "_checkpoint_without_reentrant_generator_impl",
)
_replaying = threading.local()  # (depth: the re-runs under way in this thread)
# non-reentrant checkpoints whose function drew random numbers, in any thread (a count: see
# random_checkpoints)
_RANDOM_CHECKPOINTS = [0]


@contextlib.contextmanager
def _plain_checkpoints() -> Iterator[None]:
    """A non-reentrant activation checkpoint (``use_reentrant=False``) inside the module runs
    its function plainly in the re-run: torch.func cannot run the saved tensor hooks it is
    made of, and the function's gradient is the checkpoint's. Only in this thread: torch's
    generators are wrapped once, and the wrappers run them for every other checkpoint."""
    watch_checkpoints()
    _replaying.depth = getattr(_replaying, "depth", 0) + 1
    try:
        yield
    finally:
        _replaying.depth -= 1


def watch_checkpoints() -> None:
    """Count, from now on, the non-reentrant activation checkpoints of ``torch.utils.checkpoint``
    whose function draws random numbers (dropout): their backward runs the function again, and
    under vmap, in a backward batched over rows, the draw fails ("random operations inside of
    vmap"), where one backward per row is exact (the checkpoint restores the random state for
    each). See :func:`random_checkpoints`. (Not the composable
    ``torch.distributed._composable.checkpoint``, FSDP2's, which holds the generator under a
    name of its own: torch cannot differentiate it twice, so no row-by-row backward would
    help.)"""
    for name in _CHECKPOINT_GENERATORS:
        _wrap_checkpoint_generator(name)


def random_checkpoints() -> int:
    """How many checkpoints watched by :func:`watch_checkpoints` drew random numbers so far:
    a caller compares two readings.

    Example:
        >>> import torch
        >>> from torch.utils.checkpoint import checkpoint
        >>> from jacflow.autogram._fallback import random_checkpoints, watch_checkpoints
        >>> watch_checkpoints()
        >>> x, before = torch.ones(3, requires_grad=True), random_checkpoints()
        >>> y = checkpoint(torch.nn.functional.dropout, x, use_reentrant=False)
        >>> random_checkpoints() > before
        True
        >>> before = random_checkpoints()
        >>> y = checkpoint(torch.tanh, x, use_reentrant=False)
        >>> random_checkpoints() > before
        False
    """
    return _RANDOM_CHECKPOINTS[0]


def _random_states() -> list[Tensor]:
    """The CPU's random state, and that of each CUDA device once CUDA is initialised (the
    draws of other accelerators are not seen)."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def _wrap_checkpoint_generator(name: str) -> None:
    original = getattr(torch_checkpoint, name, None)
    if original is None or getattr(original, "_jacflow_wrapper", False):
        return  # (a torch without it, or already wrapped)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Iterator[None]:
        if getattr(_replaying, "depth", 0):
            yield  # (checkpoint() runs the function here, and returns its output at the end)
            return
        before = _random_states()
        yield from original(*args, **kwargs)
        after = _random_states()
        if len(after) != len(before) or not all(map(torch.equal, before, after)):
            _RANDOM_CHECKPOINTS[0] += 1

    wrapper._jacflow_wrapper = True  # type: ignore[attr-defined]
    setattr(torch_checkpoint, name, wrapper)


def _check_backward_hooks(module: nn.Module) -> None:
    """Full module backward hooks inside the module, or registered for every module, would act
    on the gradients inside the re-run, which torch.func cannot run."""
    if backward_hooks(None)[0]:
        raise RuntimeError(
            f"{_no_closed_form(module)}, so the engine re-runs it "
            "with torch.func, which cannot run the global module backward hooks registered "
            "(torch.nn.modules.module.register_module_full_backward_hook or its pre-hook). "
            "Remove them for the step, or register them on the modules that need them."
        )
    for name, sub in module.named_modules():
        if sub is not module and backward_hooks(sub)[0]:
            raise RuntimeError(
                f"{_no_closed_form(module)}, so the engine re-runs "
                f"it with torch.func, which cannot run the module backward hook of its child "
                f"{name} ({type(sub).__name__}). Register the hook on {type(module).__name__} "
                "itself, or use a gradient hook (register_hook) on a tensor inside its forward."
            )


def _native_rnn(module: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """torch's fused recurrent kernels (cuDNN, MIOpen) have no batching rule, so the re-run of
    a module holding a recurrent layer uses torch's native kernels: the same function."""
    if any(isinstance(sub, nn.RNNBase) for sub in module.modules()):
        return torch.backends.cudnn.flags(enabled=False)
    return contextlib.nullcontext()


def _put_parameters(
    module: nn.Module, names: list[str], value: Callable[[str, Any], Any]
) -> dict[str, Any]:
    """Put ``value(name, held)`` in each of the module's parameter slots ``names`` (within it)
    and return what they held: parameters, or the tensors a transform (``functional_call``)
    put there."""
    previous = {}
    for name in names:
        owner, _, slot = name.rpartition(".")
        parameters = module.get_submodule(owner)._parameters
        previous[name] = parameters[slot]
        parameters[slot] = value(name, previous[name])
    return previous


@contextlib.contextmanager
def _inner_calls(
    module: nn.Module, names: list[str], call: Call, kept: list[Tensor]
) -> Iterator[None]:
    """While ``call`` of a module that calls itself is re-run, the calls it makes of the module
    (at any depth) use its parameters ``names`` as constants, and their outputs enter their
    callers as constants. Each of those calls is re-run on its own, for its uses of the
    parameters; the outputs of those that the losses reach are also ``kept`` (in the order
    they end) as extra outputs of this re-run, which depend on the parameters through their
    inputs only, to be pulled back with their own output gradients. So every use of the
    parameters counts once, by every path to the losses."""
    # per call under way: its recorded call (None: unknown) and how many calls it has made
    frames: list[list[Any]] = []
    swaps: list[dict[str, Any] | None] = []

    def enter(_: nn.Module, args: Any) -> None:
        if not frames:  # (the re-run call itself)
            frames.append([call, 0])
            swaps.append(None)
            return
        parent = frames[-1]
        recorded = None
        if torch.is_grad_enabled():  # (a call without grad was not recorded)
            index, parent[1] = parent[1], parent[1] + 1
            children = parent[0].children if parent[0] is not None else []
            recorded = children[index] if index < len(children) else _MISSING
        frames.append([recorded, 0])
        swaps.append(_put_parameters(module, names, lambda _, held: held.detach()))

    def leave(_: nn.Module, args: Any, output: Any) -> Any:
        recorded, made = frames.pop()
        held = swaps.pop()
        # (the re-run call itself is its recorded call: the same check)
        if recorded is _MISSING or (recorded is not None and made != len(recorded.children)):
            raise RuntimeError(
                f"{type(module).__name__} calls itself otherwise in the engine's re-run than in "
                "the forward: its calls of itself must depend on its inputs only."
            )
        if held is None:  # (the re-run call itself)
            return None
        _put_parameters(module, list(held), lambda name, _: held[name])
        if recorded is not None and recorded.grads:
            kept.extend(_selected_outputs(output, recorded.output_positions))
        return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, output)

    handles = [
        module.register_forward_pre_hook(enter),
        module.register_forward_hook(leave, always_call=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


_MISSING = Call((), {}, [], [], [], [])  # (a call of the re-run that the forward did not make)


def _reached_inner_calls(call: Call) -> tuple[Tensor, ...]:
    """The output gradients of the calls made inside ``call`` (at any depth) that the losses
    reach, in the order :func:`_inner_calls` keeps their outputs."""
    return tuple(c.grad(j) for c in _reached_inner(call) for j in range(len(c.grads)))


def _reached_inner(call: Call) -> list[Call]:
    """The calls made inside ``call`` (at any depth) that the losses reach, in the order they
    end."""
    found: list[Call] = []
    for child in call.children:
        if child is not None:
            found.extend(_reached_inner(child))
            if child.grads:
                found.append(child)
    return found


def _check_independent_outputs(module: nn.Module, call: Call) -> frozenset[int]:
    """Refuse a call whose pulled-back tensors depend on one of its outputs: an output computed
    from another (``return h, h.exp()``), or a call of the module made on its own output. The
    captured gradient of an output counts every path from it, those through the other tensors
    too, so the re-run would count them twice. An ``nn.LSTMCell`` (a subclass with its own
    ``forward``) is the exception: torch computes its ``h'`` from its ``s'`` (the CPU kernel),
    which the user cannot change, so the outputs computed from (indices into ``call.edges``)
    are returned, for the re-run to give them their captured gradients (:func:`_own_gradients`),
    which is exact. An output that is one of the call's inputs (``return h, x``) counts no
    path: the re-run's parameters do not reach it. One tensor returned twice is one output,
    whose captured gradient :func:`_once_each` gives once."""

    def reached(c: Call) -> list[Any]:  # (an output the losses do not reach counts no path)
        return [e for e, r in zip(c.edges, c.reached, strict=False) if r]

    own = reached(call)
    starts = [edge.node for edge in own] + [
        e.node for c in _reached_inner(call) for e in reached(c)
    ]
    if len(starts) < 2:
        return frozenset()
    inputs = leaves((call.args, call.kwargs))
    # (the dicts hold the nodes: a node's Python object can die and its id be reused)
    boundary = {
        id(node): node for t in inputs if isinstance(t, Tensor) and (node := t.grad_fn) is not None
    }
    outputs = {id(edge.node): j for j, edge in enumerate(own)}
    positions = {
        id(e.node): j
        for j, (e, r) in enumerate(zip(call.edges, call.reached, strict=False))
        if r and e is not None
    }
    cell = isinstance(module, nn.LSTMCell) and not call.children
    upstream: set[int] = set()
    for position, start in enumerate(starts):
        pending, seen = [start], {id(start): start}
        while pending:
            node = pending.pop()
            if id(node) in boundary:  # (an input: also an output returned as it is, above)
                continue
            if id(node) in outputs and (node is not start or position >= len(own)):
                if cell and position < len(own):
                    upstream.add(positions[id(node)])
                    continue  # (its own gradient replaces what reaches it: no need to go on)
                raise ValueError(
                    f"{_no_closed_form(module)}, and one of its "
                    "outputs is computed from another in the same call (e.g. `return h, "
                    "h.pow(2).mean()`, an auxiliary loss), or the module is called on its own "
                    "output inside it. The engine re-runs the module with every output's "
                    "gradient, which would count those paths twice. Return outputs that do not "
                    "depend on one another (compute the auxiliary term from the returned output "
                    "outside the module), do not call the module on its own output (pass a "
                    "detached copy), or register a closed form (jacflow.autogram.register_rule)."
                )
            for parent, _ in node.next_functions:
                if parent is not None and id(parent) not in seen:
                    seen[id(parent)] = parent
                    pending.append(parent)
    return frozenset(upstream)


def _once_each(call: Call, cots: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The outputs' cotangents for the re-run, zeros for an output that repeats an earlier
    one (``return h, h``): both are one tensor, whose captured gradient already sums the
    paths from each, and the re-run would count it again for the copy."""
    seen: set[tuple[int, int]] = set()
    once = []
    for edge, cot in zip(call.edges, cots, strict=False):
        key = (id(edge.node), edge.output_nr) if edge is not None else None
        once.append(torch.zeros_like(cot) if key in seen else cot)
        if key is not None:
            seen.add(key)
    return (*once, *cots[len(once) :])


def _with_enclosing_calls(calls: list[Call], rows: Rows) -> list[Call]:
    """``calls`` and the calls of the module that they run inside, which the losses may not
    reach: their uses of the parameters feed the inner calls' inputs (they get zero output
    gradients, and their reached inner calls' own)."""
    everything, seen = list(calls), {id(c) for c in calls}
    reference = next(g for c in calls for g in c.grads if g is not None)
    for call in calls:
        outer = call.parent
        while outer is not None and id(outer) not in seen:
            seen.add(id(outer))
            everything.append(outer)
            shapes = [s if rows.per_task else s[1:] for s in outer.output_shapes]
            outer.grads = [reference.new_zeros(rows.num_rows, *s) for s in shapes]
            outer = outer.parent
    return everything


def _hidden_tensors(leaf: object) -> list[Tensor]:
    """The tensors held by ``leaf``, an argument that torch's pytree left whole (a subclass of
    tuple, list or dict, or a dataclass, not registered with it), at its first level."""
    items: list[object] = []
    if isinstance(leaf, (tuple, list)):
        items = list(leaf)
    elif isinstance(leaf, dict):
        items = list(leaf.values())
    elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        items = [getattr(leaf, field.name) for field in dataclasses.fields(leaf)]
    return [item for item in items if isinstance(item, Tensor)]


def _check_samples_splittable(module: nn.Module, calls: list[Call], num_samples: int) -> None:
    """Per sample, refuse what the re-run of one sample cannot reproduce: an embedding that
    counts the batch's tokens (``scale_grad_by_freq``, set since the Engine was created), an
    ``nn.EmbeddingBag`` given its bags as one flat input with ``offsets``, which are not
    split by sample (the re-run would get every sample's tokens with one sample's offset),
    and batched tensors inside an argument that torch's pytree does not open (they would be
    passed whole to the re-run of one sample)."""
    refusal = frequency_refusal(module, type(module).__name__)
    if refusal is not None:
        raise refusal
    for call in calls:
        for leaf in tree_flatten((call.args, call.kwargs))[0]:
            hidden = _hidden_tensors(leaf)
            if any(t.ndim >= 1 and t.shape[0] == num_samples for t in hidden):
                raise ValueError(
                    f"{type(module).__name__} was given a {type(leaf).__name__} holding "
                    "tensors of the batch, which torch's pytree does not open (a subclass of "
                    "tuple, list or dict, or a dataclass): the generic rule re-runs the "
                    "module sample by sample (batch_dim set) and could not split them. Pass "
                    "the tensors as arguments (or in a plain tuple, list or dict), register "
                    "the type with torch.utils._pytree.register_pytree_node, or use "
                    "batch_dim=None. (A tensor there that is not per sample but whose first "
                    "size is the batch size counts too: make it a buffer of the module.)"
                )
    if isinstance(module, nn.EmbeddingBag) and any(call.input().ndim == 1 for call in calls):
        raise ValueError(
            "EmbeddingBag was called with one flat input and `offsets`: the generic rule "
            "re-runs it sample by sample (batch_dim set) and cannot split such bags by sample. "
            "Pass the bags as a 2-D input [B, bag_size] (padded with its padding_idx), or use "
            "batch_dim=None."
        )


def _unsupported_by_torch_func(module: nn.Module, error: RuntimeError) -> RuntimeError | None:
    """A clear refusal for a re-run that torch.func cannot run in either mode (``None`` for
    other failures): an ``autograd.Function`` without ``setup_context``, or saved tensor hooks
    inside the module."""
    if "setup_context" in str(error):
        what = "an autograd.Function without a setup_context staticmethod (its forward takes ctx)"
        advice = (
            "Split its forward into forward(*args) and setup_context(ctx, inputs, output) "
            "(per sample, also set generate_vmap_rule = True)"
        )
    elif "saved tensor hooks" in str(error):
        what = "saved tensor hooks (torch.autograd.graph.saved_tensors_hooks, save_on_cpu)"
        advice = "Take them out of its forward (around the whole forward, they may stay)"
        # (torch 2.7 and later tell whether default hooks are active)
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if top is not None and top(False) is not None:
            # (active at the step itself: the re-run, made by the step, runs under them)
            advice = (
                "They are active around the step (engine.backward or compute_gramian) itself: "
                "run the step outside the saved_tensors_hooks or save_on_cpu context (around "
                "the forward alone, they may stay)"
            )
    else:
        return None
    return RuntimeError(
        f"{_no_closed_form(module)}, so the engine re-runs it with torch.func, which cannot run "
        f"{what} inside it, whatever the batch_dim: {error}. {advice}, or register a closed "
        "form for it (jacflow.autogram.register_rule)."
    )


class FallbackRule(Rule):
    """Generic rule: the module and all its children's parameters, via ``torch.func``."""

    def covers_children(self) -> bool:
        return True

    def replays(self) -> bool:
        return True

    def prepare(
        self,
        module: nn.Module,
        params: dict[str, Tensor],
        calls: list[Call],
        rows: Rows,
        reference: Mapping[str, Tensor | None] | None = None,
    ) -> Contribution:
        """Per sample, ``reference`` (the engine's, where the losses reach ``params`` through
        these calls only) is the gradient of the rows' sum w.r.t. each of ``params``, taken in
        the engine's backward (``None``: not reached): the sum of the rows' gradients is checked
        against it, in place of a re-run of each call on the whole batch."""
        if parametrize._cache_enabled and any(map(parametrize.is_parametrized, module.modules())):
            raise RuntimeError(
                f"The Jacobian-descent step runs inside torch.nn.utils.parametrize.cached(): "
                f"the re-run of {type(module).__name__} would read the cached parametrised "
                "weights, which do not follow the parameters it differentiates. Take the step "
                "outside the cached() block (the forward may stay in it)."
            )
        _check_backward_hooks(module)
        if not rows.per_task:
            _check_samples_splittable(module, calls, rows.num_samples)
        # (copies: a re-run that renormalises a weight in place, as an embedding's max_norm
        # does, must not touch the parameter, whose version the forward's graph checks)
        detached = {name: p.detach().clone() for name, p in params.items()}
        total: dict[str, Tensor] = {}
        replayed = _with_enclosing_calls(calls, rows)
        for call in replayed:
            upstream = _check_independent_outputs(module, call)
            cots = _once_each(call, tuple(call.grad(j) for j in range(len(call.grads))))
            try:
                with (
                    torch.enable_grad(),
                    replaying(),
                    quiet_vmap_fallback(),
                    replay_autocast(call),
                    call.forward_modes(module),
                    _native_rnn(module),
                    _without_backward_hooks(module),
                    _as_recorded(module),
                    _plain_checkpoints(),
                ):
                    if rows.per_task:
                        new = _replay_per_task(module, detached, call, cots, upstream)
                    else:
                        new = _per_sample_grads(
                            module, detached, call, cots, rows, upstream, reference is not None
                        )
            except ReplayMismatchError:
                raise
            except RuntimeError as error:
                unsupported = _unsupported_by_torch_func(module, error)
                if unsupported is not None:
                    raise unsupported from error
                if "random" not in str(error):
                    recurrent = any(isinstance(sub, nn.RNNBase) for sub in module.modules())
                    if recurrent and "storage" in str(error):  # (torch's packed kernels)
                        raise RuntimeError(
                            f"{_no_closed_form(module)} and holds "
                            "a recurrent layer, so the engine re-runs it with torch.func, which "
                            f"failed: {error}. torch.func cannot run torch's recurrent kernels "
                            "on packed sequences. Pad the sequences, or let the closed form "
                            "cover the recurrent layer: a plain nn.RNN/LSTM/GRU, with no "
                            "parameters of its own around it."
                        ) from error
                    if not rows.per_task and sparse_inside(call):
                        raise ValueError(
                            f"{_no_closed_form(module)} and multiplies by a sparse tensor (a "
                            "graph's adjacency matrix?), so the engine re-runs it sample by "
                            "sample under torch.func's vmap, which failed on the sparse product: "
                            f"{error}. Per sample (batch_dim set), a product with a sparse matrix "
                            "over the samples (the nodes of a graph) mixes them. Use "
                            "batch_dim=None (per task), or jacflow.backward, which takes such "
                            "products row by row."
                        ) from error
                    if not rows.per_task:
                        raise RuntimeError(
                            f"{_no_closed_form(module)}, so the "
                            "engine re-runs it sample by sample under torch.func's vmap, which "
                            f"failed: {error}. Use batch_dim=None, or register a closed form "
                            "for it (jacflow.autogram.register_rule)."
                        ) from error
                    raise RuntimeError(
                        f"{_no_closed_form(module)}, so the engine re-runs it on the whole "
                        f"batch with torch.func, which failed: {error}. Register a closed form "
                        "for it (jacflow.autogram.register_rule)."
                    ) from error
                raise ValueError(
                    f"{_no_closed_form(module)}, so the engine "
                    "re-runs it with torch.func, which cannot replay its random operations "
                    "(dropout, noise: the re-run would draw other numbers). Move them outside "
                    "this module, whose children are re-run with it (e.g. "
                    "nn.Sequential(module, nn.Dropout(p)) in place of a dropout inside it), set "
                    "their probability to 0, or call .eval()."
                ) from error
            add_grads(total, new)
        if reference is not None and not rows.per_task:
            _check_same_gradients(module, replayed, total, reference, "the forward's backward")
        return MaterializedContribution(total)
