"""The Gramian engine: hooks, one activation-only backward, per-layer closed forms, book-keeping."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import warnings
import weakref
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parameter import is_lazy
from torch.nn.utils.parametrize import is_parametrized
from torch.utils.hooks import RemovableHandle

from jacflow._grad_writes import added, grad_dtype, laid_out, owned, run_post_accumulate_hooks
from jacflow._labels import received
from jacflow._warnings import caller_stacklevel
from jacflow.aggregation import GramianWeighting
from jacflow.aggregation._bases import (
    check_gramian_weighting,
    peak_out_of_range,
    runs_forward_hooks,
    unit_peak_factor,
)
from jacflow.autogram._buffers import GradientBuffers, worth_reusing
from jacflow.autogram._capture import EACH, Selection, capture, pull_back
from jacflow.autogram._distributed import (
    Meetings,
    averaged_grads,
    averaged_gramian,
    check_wrapped,
    meetings_of,
    warn_without_wrapper,
    wrappers_in,
)
from jacflow.autogram._embedding import frequency_refusal
from jacflow.autogram._fallback import FallbackRule, without_tensor_hooks
from jacflow.autogram._hooks import (
    Recorder,
    Unit,
    find_units,
    running_statistics,
    same_parameters,
)
from jacflow.autogram._outside import (
    SPARSE_OPERATION,
    checkpoint_above_calls,
    first_reached,
    graph_nodes,
    outside_calls,
    reentrant_checkpoints,
    sparse_inside,
    unreached,
    used_outside,
)
from jacflow.autogram._precision import upcast, without_autocast, working_dtype
from jacflow.autogram._recurrent import covered, uncovered_refusal
from jacflow.autogram._rules import (
    Call,
    Contribution,
    Rows,
    backward_hooks,
    check_replayed_calls,
    find_rule,
    is_replaying,
    kept_methods,
    multi_grad_hook,
    no_hook,
    replaying,
    tracker_hook,
    unread_parameters,
)
from jacflow.autogram._separable import leaks, probe_cotangents, probe_sets
from jacflow.autojac._checks import check_flag, check_real_tensor
from jacflow.autojac._graph import (
    COMPILED_NODE,
    REENTRANT_CHECKPOINT,
    SPARSE_GRADIENT_NODES,
    checkpointed_module,
    sparse_gradients,
    sparse_on_paths,
)
from jacflow.autojac._rows import SELECTIVE_CHECKPOINT_ERROR
from jacflow.linalg._products import row_gramian

# A pattern of recorded calls: their units, in order, and the losses' graph outside them (see
# outside_calls); the checks that hold for one are made once per pattern.
Pattern = tuple[tuple[int, ...], tuple[object, ...]]
# the most patterns of recorded calls remembered as checked for outside uses (then forgotten)
_MAX_PATTERNS = 64
# forwards of the given modules started with calls of earlier ones pending, after which the
# engine warns that they hold their inputs (plain training steps with the engine attached)
_PENDING_FORWARDS_WARNING = 64
# ... when they hold this many bytes of inputs (a module called in a loop within one forward,
# a recurrent cell, starts a forward of a given module at every call, holding little)
_PENDING_BYTES_WARNING = 256 * 2**20

# (a compiled graph traced before the engine hooked its modules runs without the hooks)
_COMPILED_BEFORE_HINT = (
    "The losses' graph holds torch.compile'd code: code compiled and run before the Engine was "
    "created does not call the Engine's hooks (Dynamo does not watch module hooks), and "
    "Dynamo reuses compiled code across modules (code compiled for another instance of the "
    "same class, or a forward decorated with @torch.compile in the class). Create the Engine "
    "before the first compiled forward of any such module in the process, or call "
    "torch._dynamo.reset() after creating it."
)
_COMPILE_HINT = (
    "torch.compile'd modules cannot be hooked (their layers run inside one fused graph node). "
    "Create the Engine on the uncompiled module, or use jacflow.autojac.backward with "
    "parallel_chunk_size=1."
)
_REENTRANT_REFUSAL = (
    "The losses' graph holds a reentrant activation checkpoint (torch.utils.checkpoint with "
    "use_reentrant=True) around or above modules given to the Engine, inside one of them, or "
    "of a function it cannot look into: the Engine cannot see the calls inside it, and its "
    "backward writes .grad of the parameters inside it. Use checkpoint(..., "
    "use_reentrant=False), which the Engine supports."
)


def _check_modules(modules: tuple[nn.Module, ...], batch_dim: int | None) -> None:
    if not modules:
        raise ValueError("Engine needs at least one module, received none.")
    for i, module in enumerate(modules):
        if not isinstance(module, nn.Module):
            raise TypeError(f"Engine expects nn.Module arguments, modules[{i}] is {type(module)}.")
        for name, sub in module.named_modules():
            where = f"modules[{i}]" + (f".{name}" if name else "")
            if type(sub).__name__ == "OptimizedModule" or getattr(sub, "_compiled_call_impl", None):
                raise ValueError(f"{where} is compiled. {_COMPILE_HINT}")
            # (scripted or traced, with a trainable parameter: one without is no unit's)
            scripted = isinstance(sub, torch.jit.ScriptModule)
            if scripted and any(p.requires_grad for p in sub.parameters()):
                raise TypeError(
                    f"{where} is a TorchScript module (torch.jit.script or torch.jit.trace), "
                    "which runs no Python forward hooks: the engine could record none of its "
                    "calls. Give the Engine the eager module (before scripting or tracing), or "
                    "use jacflow.backward."
                )
            if any(is_lazy(t) for t in [*sub.parameters(False), *sub.buffers(False)]):
                raise ValueError(
                    f"{where} is a lazy module whose parameters are not initialised yet: its "
                    "rule is chosen, and its hooks run, before its first forward would make it a "
                    "regular module. Run one forward (e.g. on a dummy batch) before creating the "
                    "Engine."
                )
            if batch_dim is None:
                continue
            if isinstance(sub, nn.RNNBase) and not covered(sub):
                raise uncovered_refusal(where, sub)
            # (one in training mode with running statistics may be put in eval mode before
            # the forward of the losses: the step refuses a forward that used batch statistics)
            if isinstance(sub, _BatchNorm) and not running_statistics(sub):
                raise ValueError(
                    f"{where} is a {type(sub).__name__} without running statistics "
                    "(track_running_stats=False), which normalises with its batch's statistics "
                    "in every mode: it mixes the samples of a batch, so per-sample gradients "
                    "cannot be read from one backward. Replace it (e.g. by GroupNorm or "
                    "LayerNorm), build it with running statistics and call .eval() on it, or "
                    "use batch_dim=None."
                )


def _check_generic_units(units: list[Unit]) -> None:
    """Per sample, the generic rule re-runs its module sample by sample under ``vmap``, which
    torch's fused recurrent kernels do not support: refuse a recurrent layer under it (inside a
    module with parameters of its own, parametrised, or with a parameter its closed form does
    not read), and an embedding that counts the batch's tokens (``scale_grad_by_freq``)."""
    for unit in units:
        if not isinstance(unit.rule, FallbackRule):
            continue
        refusal = frequency_refusal(unit.module, unit.name)
        if refusal is not None:
            raise refusal
        for name, sub in unit.module.named_modules():
            if isinstance(sub, nn.RNNBase):
                where = f"{unit.name}.{name}" if name else unit.name
                rule = find_rule(sub)
                if unread := [] if rule is None else unread_parameters(sub, rule):
                    raise ValueError(
                        f"{where} is a {type(sub).__name__} with trainable parameters that its "
                        f"closed form does not read ({', '.join(unread)}; e.g. a weight that a "
                        "forward pre-hook computes from them, as AWD-LSTM's WeightDrop does), so "
                        "it falls to the generic rule, which cannot re-run it sample by sample "
                        "(batch_dim set). Use batch_dim=None, or jacflow.autojac.backward."
                    )
                raise ValueError(
                    f"{where} is a {type(sub).__name__} under the generic rule (inside a module "
                    f"with parameters of its own, or parametrised), which cannot re-run it "
                    "sample by sample (batch_dim set). Move those parameters into a module of "
                    "their own (e.g. a learned initial state: a module that returns it batch "
                    "first, [B, num_layers, H], which the caller transposes to the layer's "
                    "[num_layers, B, H]), or use batch_dim=None."
                )


def _check_real_parameters(unit: Unit, params: dict[str, Tensor]) -> None:
    """Refuse complex trainable parameters (``params``, the unit's): the rules form ``J J^T``
    with real products (a complex one gave a matrix that is neither ``Re(J J^H)`` nor
    Hermitian, silently). At hooking, and at each step (``model.to(torch.complex64)`` converts
    them in place)."""
    for name, param in params.items():
        if param.is_complex():
            raise TypeError(
                f"{unit.name}.{name} is a complex parameter ({param.dtype}): the Engine "
                "computes the Gramian of real parameters only. Keep it as a real parameter of "
                "twice the size (read it with torch.view_as_complex), or leave its module out "
                "of the Engine."
            )


def _check_losses(
    losses: object, batch_dim: int | None, holds_samples: Callable[[Any], bool]
) -> Tensor:
    """``losses``, checked, with the batch (dimension ``batch_dim``) moved to dimension 0 (a
    view), as the step takes them (``holds_samples``: whether autograd's node reaches the
    hooked modules' outputs, see :func:`_check_not_ordered_by_value`)."""
    if not isinstance(losses, Tensor):
        hint = ""
        listed = list(losses) if isinstance(losses, (list, tuple)) else []
        if listed and all(isinstance(t, Tensor) for t in listed):
            hint = " (pass the tensor itself)" if len(listed) == 1 else " (torch.stack(losses))"
        raise TypeError(f"`losses` must be a torch.Tensor, received {type(losses)}{hint}.")
    if losses.numel() == 0:
        if batch_dim is None:
            raise ValueError(
                f"`losses` must have one element per task, received shape {tuple(losses.shape)}."
            )
        if not -losses.ndim <= batch_dim < losses.ndim or losses.shape[batch_dim]:
            raise ValueError(  # (e.g. [0, B]: the samples are there, their losses not)
                f"`losses` must have at least one element, received shape "
                f"{tuple(losses.shape)}: with batch_dim={batch_dim}, pass each sample's losses."
            )
        # (jacflow.backward takes the zero step there; the engine's rules need a sample)
        raise ValueError(
            f"`losses` hold no sample (shape {tuple(losses.shape)}): an empty batch has no "
            "Gramian to weigh. Skip the step for this batch; engine.clear() drops its forward's "
            "recorded calls."
        )
    # (the backward of complex losses differentiates their real part: the imaginary part's
    # rows were dropped from the Gramian and the update, silently)
    check_real_tensor(losses, "losses")
    if losses.device.type == "meta":
        raise ValueError(
            "`losses` are on the meta device, which holds no values: a forward on meta tensors "
            "runs (shape inference), but the Engine's step computes from the values of its "
            "recorded calls. Step on a real device (e.g. after model.to_empty(device='cpu'))."
        )
    if not losses.requires_grad:
        raise ValueError(
            "`losses` does not require grad: compute it from the hooked modules with grad enabled."
        )
    if batch_dim is None:
        return losses
    if losses.ndim == 0:
        raise ValueError(
            f"With batch_dim={batch_dim}, `losses` must have a batch dimension (shape [B, ...]), "
            "received a scalar. Pass the per-sample losses (reduction='none'), or use "
            "batch_dim=None."
        )
    if not -losses.ndim <= batch_dim < losses.ndim:
        raise ValueError(
            f"With batch_dim={batch_dim}, `losses` must have a dimension {batch_dim}, received "
            f"shape {tuple(losses.shape)}. Pass the dimension of the losses that holds the batch "
            "(e.g. 0 for [B] or [B, k] losses, 1 for [k, B])."
        )
    batch_first = losses.movedim(batch_dim, 0) if batch_dim % losses.ndim else losses
    _check_not_ordered_by_value(batch_first, holds_samples)
    return batch_first


# autograd's nodes of the ops that order or select values along a dimension
_BY_VALUE_NODES = frozenset(
    {"SortBackward0", "SortBackward1", "TopkBackward0", "KthvalueBackward0", "MedianBackward1"}
)
# elementwise nodes (of one tensor or several), which keep each entry at its place: looked
# through from the losses
_ELEMENTWISE_NODES = frozenset(
    {
        "MulBackward0",
        "DivBackward0",
        "AddBackward0",
        "SubBackward0",
        "NegBackward0",
        "CloneBackward0",
        "ToCopyBackward0",
        "AliasBackward0",
        "ExpBackward0",
        "LogBackward0",
        "RsubBackward0",
        "RsubBackward1",
        "PowBackward0",
        "PowBackward1",
        "PowBackward2",
        "Log1PBackward0",
        "Expm1Backward0",
        "ReciprocalBackward0",
        "SoftplusBackward0",
        "SqrtBackward0",
        "AbsBackward0",
        "ReluBackward0",
        "SigmoidBackward0",
        "TanhBackward0",
        "ClampBackward0",
        "ClampBackward1",
        "ClampMinBackward0",
        "ClampMaxBackward0",
        "WhereBackward0",
        "MaximumBackward0",
        "MinimumBackward0",
    }
)
# the most nodes looked at from the losses
_MAX_LOOKED_AT = 32


def _check_not_ordered_by_value(losses: Tensor, holds_samples: Callable[[Any], bool]) -> None:
    """Per sample, refuse losses reordered along the batch: sorted, or indexed, gathered or
    selected by positions (``losses[losses.argsort()]``), where the reorderings met from the
    losses through elementwise operations do not compose to the samples' own order (a
    permutation then its inverse is exact). Each row would belong to another sample, which the
    separation probe misses whenever the probed samples map onto themselves (the Gramian's
    rows were other samples', and the weights went to the wrong losses, silently).

    Only tensors of ``B`` rows count; past an operation of several tensors (``ce * w[y]``)
    only a permutation of them does, since a learned table taken at the labels or ids (a
    class's weight, ``w[y]``) is no reordering of the samples; and only where the reordered
    tensor ``holds_samples`` (its graph reaches a hooked module's output or parameter): one
    computed from other parameters only (``w[y]`` with as many classes as samples, whose labels
    may form a permutation) cannot move a sample's share of the Gramian."""
    batch = losses.shape[0]
    # (each node with whether the walk came past an operation of several tensors, past a slice
    # of columns, and the dimension of its output that holds the batch: 0 but after a
    # transpose or permutation, such as the one that moved the batch of `Engine(batch_dim=d)`)
    frontier: list[tuple[Any, bool, bool, int]] = [(losses.grad_fn, False, False, 0)]
    looked_at = 0
    while frontier and looked_at < _MAX_LOOKED_AT:
        node, beside, columns, axis = frontier.pop()
        looked_at += not _whole_slice(node)
        before = _axis_before(node, axis)
        if before is not None:
            frontier.append((node.next_functions[0][0], beside, columns, before))
        elif axis:  # (elsewhere than dimension 0: followed through _passes_along's steps only)
            inputs = [n for n, _ in node.next_functions if n is not None]
            if _positions_along_batch(node, batch, axis) is not None:
                chain = _reordering_chain(node, batch, beside, axis=axis)
                if chain.reorders and holds_samples(node):
                    raise _reordered_losses()
                if chain.after is not None:  # (each entry back at its place: walked on)
                    frontier.append((chain.after, beside, columns, axis))
            elif _passes_along(node, axis):
                frontier.append((inputs[0], beside, columns, axis))
        elif _keeps_positions(node):
            inputs = [n for n, _ in node.next_functions if n is not None]
            sliced = columns or _slices_columns(node)
            frontier += [(n, beside or len(inputs) > 1, sliced, 0) for n in inputs]
        else:
            chain = _reordering_chain(node, batch, permutations_only=beside, columns_sliced=columns)
            # (the walk of the graph below, holds_samples: only when it matters)
            if chain.reorders and holds_samples(node):
                raise _reordered_losses()
            if chain.after is not None:
                frontier.append((chain.after, beside, chain.columns_sliced, 0))


def _reordered_losses() -> ValueError:
    return ValueError(
        "Per sample (batch_dim set), `losses` were reordered along the batch (sorted by value, "
        "or indexed, gathered or selected by positions): each loss then belongs to another "
        "sample than its place says, which the engine cannot follow. Pass the losses in the "
        "samples' order and weight or select them in the weighting (a GramianWeighting of your "
        "own), or use jacflow.backward."
    )


def _reaches_hooked(node: Any, calls: Iterable[Call], params: Container[int]) -> bool:
    """Whether autograd's ``node`` reaches the output of one of the recorded ``calls`` (or
    the base of one that is a view, which an in-place op may have given a new node) or the
    node of a hooked parameter (``params``: their ``id``), which every hooked output with
    trainable parameters reaches."""
    targets = {id(edge.node) for call in calls for edge in call.edges if edge is not None}
    targets |= {id(view.base_node) for call in calls for view in call.output_views}
    pending, seen = [node], {id(node): node}  # (held: a node's id could be reused)
    while pending:
        node = pending.pop()
        if id(node) in targets or id(getattr(node, "variable", None)) in params:
            return True
        for parent, _ in node.next_functions:
            if parent is not None and id(parent) not in seen:
                seen[id(parent)] = parent
                pending.append(parent)
    return False


def _keeps_positions(node: Any) -> bool:
    """Whether autograd's ``node`` leaves each entry at its position along dimension 0: an
    elementwise operation, an unsqueeze elsewhere, a slice, selection, split or unbind along
    another dimension, or a slice or split that takes the whole dimension (``x[0:B]``,
    ``x[::1]``, ``x.chunk(1)[0]``; torch 2.6 to 2.8 also record such a slice for every index
    that begins with ``:``, as ``x[:, None]`` or ``x[:, 0]``)."""
    name = type(node).__name__
    if name == "UnsqueezeBackward0":
        return _signed(node._saved_dim) != 0
    if name in ("SelectBackward0", "UnbindBackward0"):
        return _slices_columns(node)
    if name in _SPLIT_NODES:
        if _slices_columns(node):
            return True
        pieces = (
            node._saved_split_sizes
            if name == "SplitWithSizesBackward0"
            else (node._saved_split_size,)
        )
        return len(pieces) == 1 and int(pieces[0]) >= int(node._saved_self_sym_sizes[0])
    if name == "SliceBackward0":
        return _slices_columns(node) or _whole_slice(node)
    return name in _ELEMENTWISE_NODES


def _whole_slice(node: Any) -> bool:
    """Whether autograd's ``node`` is a slice that takes all of dimension 0 (``x[0:B]``,
    ``x[-B:]``, ``x[::1]``). Torch 2.6 to 2.8 record one for every index that begins with
    ``:``, so the walks do not count it against their budget."""
    if type(node).__name__ != "SliceBackward0":
        return False
    sizes = node._saved_self_sym_sizes
    if _signed(node._saved_dim) % len(sizes) != 0:
        return False
    size = int(sizes[0])
    start = 0 if node._saved_start is None else _signed(node._saved_start)
    end = size if node._saved_end is None else _signed(node._saved_end)
    start, end = (b + size if b < 0 else b for b in (start, end))  # (x[-B:] saves -B)
    return start <= 0 and end >= size and int(node._saved_step) == 1


_SPLIT_NODES = ("SplitBackward0", "SplitWithSizesBackward0")


def _slices_columns(node: Any) -> bool:
    """Whether autograd's ``node`` is a slice, selection, split or unbind along another
    dimension than 0."""
    name = type(node).__name__
    if name == "UnbindBackward0":  # (no sizes saved: a negative dimension is not followed)
        return _signed(node._saved_dim) > 0
    if name not in ("SliceBackward0", "SelectBackward0", *_SPLIT_NODES):
        return False
    sizes = node._saved_self_sym_sizes
    return _signed(node._saved_dim) % len(sizes) != 0


def _signed(dim: int) -> int:
    """A dimension or an index saved by autograd (``-1`` is saved as ``2**64 - 1``)."""
    dim = int(dim)
    return dim - 2**64 if dim >= 2**63 else dim


def _axis_before(node: Any, axis: int) -> int | None:
    """The dimension of the input of autograd's ``node`` that its output's ``axis`` comes
    from, when ``node`` is a permutation or transpose of dimensions (``movedim``, ``.T``,
    ``transpose`` with dimensions counted from the front); else ``None``."""
    name = type(node).__name__
    if name == "PermuteBackward0":
        dims = node._saved_dims
        return _signed(dims[axis]) % len(dims)
    if name == "TBackward0":
        return 1 - axis if axis < 2 else None
    if name == "TransposeBackward0":
        pair = (_signed(node._saved_dim0), _signed(node._saved_dim1))
        if min(pair) < 0:  # (no sizes saved to count a dimension from the back)
            return None
        return pair[1] if axis == pair[0] else pair[0] if axis == pair[1] else axis
    return None


class _Chain(NamedTuple):
    """What :func:`_reordering_chain` finds: whether the chain moves entries (``reorders``);
    where it ends with each entry back at its own place, the node below it, for the walk to
    go on (``after``; else ``None``); and whether it passed a slice of columns."""

    reorders: bool
    after: Any | None = None
    columns_sliced: bool = False


def _reordering_chain(
    node: Any, batch: int, permutations_only: bool, columns_sliced: bool = False, axis: int = 0
) -> _Chain:
    """The chain of reorderings along dimension ``axis`` of tensors of ``batch`` entries there
    that starts at autograd's ``node`` (sorts, and takes of entries at given positions, one
    after the other): it ``reorders`` where it leaves the entries elsewhere than at their own
    positions (with ``permutations_only``, only where it is a permutation of the rows). A
    reordering of a matrix's rows ends the chain (its rows are not followed further), and one
    after a slice of its columns (``columns_sliced``) is not judged: only the kept columns'
    order would count, which is not followed. Between two reorderings elsewhere than along
    dimension 0, only the steps of :func:`_passes_along` are looked through."""
    order: Tensor | None = None  # (positions in the chain's input of the losses' entries)
    looked_at = 0
    while looked_at < _MAX_LOOKED_AT:
        looked_at += not _whole_slice(node)
        inputs = [n for n, _ in node.next_functions if n is not None]
        if axis == 0 and _keeps_positions(node) and len(inputs) == 1:
            columns_sliced = columns_sliced or _slices_columns(node)
            node = inputs[0]  # (between two reorderings: ``(2 * x[p])[q]``)
            continue
        if _passes_along(node, axis):
            node = inputs[0]
            continue
        positions = _positions_along_batch(node, batch, axis)
        if positions is None:
            break
        if positions.ndim != 1 and columns_sliced:
            return _Chain(False)
        # (a matrix's rows, composed with the order above, column by column)
        order = positions if order is None else positions[order]
        node = node.next_functions[0][0]
        if positions.ndim != 1:
            break
    else:  # (out of budget: nothing below is judged, the walk does not go on)
        node = None
    if order is None:
        return _Chain(False)
    if _in_place_order(order):
        return _Chain(False, node, columns_sliced)
    return _Chain(not permutations_only or _permutation(order, batch))


def _passes_along(node: Any, axis: int) -> bool:
    """Whether autograd's ``node`` leaves each entry at its position along ``axis`` (not 0):
    an elementwise operation of one tensor, or a slice along another dimension (torch 2.6 to
    2.8 record a whole one for ``x[:, p]``). The walks take only these steps there, where
    positions along the other dimensions are not followed."""
    name = type(node).__name__
    if not axis or (name not in _ELEMENTWISE_NODES and name != "SliceBackward0"):
        return False
    if name == "SliceBackward0":
        return _signed(node._saved_dim) % len(node._saved_self_sym_sizes) != axis
    return sum(n is not None for n, _ in node.next_functions) == 1


def _permutation(order: Tensor, batch: int) -> bool:
    """Whether ``order`` holds each of ``0, ..., batch - 1`` once along dimension 0."""
    if order.ndim == 0 or order.shape[0] != batch:
        return False
    own = torch.arange(batch, device=order.device).reshape(-1, *[1] * (order.ndim - 1))
    return bool((order.sort(dim=0).values == own).all())


def _positions_along_batch(node: Any, batch: int, axis: int = 0) -> Tensor | None:
    """The positions along dimension ``axis`` (put first) at which ``node``'s op takes the
    entries of its input of ``batch`` entries there (a sort's permutation, an index's, a
    gather's or an index_select's), or ``None`` when it does not reorder such an input along
    that dimension."""
    name = type(node).__name__
    if name in _BY_VALUE_NODES or name in ("GatherBackward0", "IndexSelectBackward0"):
        shape = getattr(node, "_saved_self_sym_sizes", None)
        shape = tuple(shape) if shape is not None else tuple(node._saved_self.shape)
        if not shape or _signed(node._saved_dim) % len(shape) != axis or shape[axis] != batch:
            return None
        index = node._saved_indices if name in _BY_VALUE_NODES else node._saved_index
        return index.movedim(axis, 0) if index.ndim > 1 else index
    if name == "IndexBackward0" and len(node._saved_indices) > axis:
        indices = node._saved_indices
        taken = indices[axis]
        if (
            taken is None
            or taken.dtype == torch.bool
            or any(i is not None for i in indices[:axis])  # (x[i, j]: not along one dimension)
            or node._saved_self_sym_sizes[axis] != batch
        ):
            return None
        return taken
    return None


def _in_place_order(index: Tensor) -> bool:
    """Whether ``index`` takes the entries along dimension 0 at their own positions."""
    if index.ndim == 0:
        return False
    own = torch.arange(index.shape[0], device=index.device)
    return bool((index == own.reshape(-1, *[1] * (index.ndim - 1))).all())


_TRANSFORM_HINT = (
    "The hooked modules ran under a torch.func transform (vmap, jvp, grad) in the forward, "
    "where their outputs carry no graph that the engine can record: call them outside it (a "
    "batched forward instead of vmap over samples), or use jacflow.backward."
)


def _check_not_frozen_during(unit: Unit, call: Call) -> None:
    """Refuse a step whose losses read a call of a hooked module made while some of its
    parameters were frozen (``requires_grad_(False)`` around the call) that are trainable again
    now: autograd gives them no gradient from that call, while the closed forms would give
    every call of the module its share, and the generic rule's re-run differentiates the call
    by all of them. (A call with all of them frozen, a GAN's critic under the generator's
    loss, is left out of the step; so are calls that the losses do not read, an attack's on a
    frozen model.)"""
    if any(p.requires_grad for p in call.frozen):
        raise ValueError(
            f"{unit.name or type(unit.module).__name__} ({type(unit.module).__name__}) was "
            "called with some of its parameters frozen (requires_grad=False) during this "
            "forward, which are trainable again at the step: their gradient from that call "
            "is none, which the engine cannot tell for a part of a module's parameters "
            "(its closed forms and its generic rule see the module's calls). Freeze all of "
            "the module's parameters around the call (such a call is left out of the step), "
            "keep them frozen until the step, or give the Engine only the modules that these "
            "losses train."
        )


def _check_weights(weights: object, m: int, weighting: GramianWeighting) -> Tensor:
    if not isinstance(weights, Tensor) or weights.shape != (m,):
        shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights)
        raise ValueError(f"{weighting} returned {shape}, expected weights of shape ({m},).")
    return weights


# what Engine._prepare returns: the contributions, the row layout, the row<->loss
# permutations, the gradients of the rows' sum w.r.t. the extra inputs and the captured bytes
_Prepared = tuple[
    list[tuple[dict[str, Tensor], Contribution]],
    Rows,
    tuple[Tensor, Tensor] | None,
    list[Tensor | None],
    int,
]


class TaskLayout(NamedTuple):
    """What ``mtl_backward`` knows of the tasks, for a per-task step.

    ``rows``: per task parameter (keyed by ``id``), the tasks (positions in the losses) whose
    gradient it receives, where that is not all of them (``tasks_params[i]`` gets the gradient
    of ``losses[i]``); ``trunk``: the shared parameters (hooked or not: those behind the
    features by default), whose unhooked ones join the Jacobian with a row per task from the
    step's backward, and each of which that a loss reaches gets an update (the others are
    left as they are, as by torch's backward);
    ``features``: the features, for a step whose losses read none of them; ``row_by_row``:
    the rows pulled back one by one, without vmap (``parallel_chunk_size=1``).
    """

    rows: dict[int, tuple[int, ...]]
    trunk: tuple[Tensor, ...]
    features: tuple[Tensor, ...]
    row_by_row: bool = False


_MAX_LAYOUTS = 4  # (the layouts whose checked patterns are kept)


def _layout_key(layout: list[tuple[nn.Module, type, frozenset[str]]]) -> tuple[Any, ...]:
    """A hashable key of a layout of units, its modules by weak reference: it keeps none of
    them alive, and one collected never matches a new module that takes its ``id``."""
    return tuple((weakref.ref(module), rule, names) for module, rule, names in layout)


def _layout(units: list[Unit]) -> list[tuple[nn.Module, type, frozenset[str]]]:
    """Each unit's module (held: its id stays its own), rule type and trainable parameters'
    names: another layout calls for hooking the modules again (a parameter added to a hooked
    module, frozen or unfrozen; not one replaced under its name, which a unit reads at each
    step)."""
    return [(unit.module, type(unit.rule), frozenset(unit.params())) for unit in units]


def _narrowed(
    units: list[Unit], layout: list[tuple[nn.Module, type, frozenset[str]]]
) -> list[tuple[nn.Module, type, frozenset[str]]] | None:
    """The ``layout`` of the hooked ``units`` with only their parameters trainable now (a unit
    left with none dropped), or ``None`` where a unit has a trainable parameter it had not
    when hooked (one unfrozen or added)."""
    narrowed = []
    for unit, (module, rule, names) in zip(units, layout, strict=True):
        now = frozenset(unit.params())
        if not now <= names:
            return None
        if now:
            narrowed.append((module, rule, now))
    return narrowed


def _unhook(recorder: weakref.ref[Recorder], watches: list[RemovableHandle]) -> None:
    for handle in watches:
        handle.remove()
    watches.clear()
    alive = recorder()
    if alive is not None:
        alive.remove()


class _Rehook:
    """The forward pre-hook that hooks an engine's modules again when a frozen parameter was
    made trainable. It holds the engine weakly; a deep copy or a pickle of a hooked model gets
    an inert one (an engine cannot be copied)."""

    def __init__(self, engine: Engine | None) -> None:
        self._engine = None if engine is None else weakref.ref(engine)

    def __call__(self, module: nn.Module, args: Any) -> None:
        engine = None if self._engine is None else self._engine()
        if engine is not None:
            engine._rehook_if_changed(module, args)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Rehook:
        return _Rehook(None)

    def __reduce__(self) -> tuple[type[_Rehook], tuple[None]]:
        return _Rehook, (None,)


class Engine:
    """Gramian of the Jacobian of many losses w.r.t. the parameters of some modules, without
    the Jacobian; and the whole Jacobian-descent step with one activation-only backward.

    Create the engine *before* the forward pass: it hooks every module that has a closed-form
    rule (Linear, Conv1d/2d/3d, Embedding, LayerNorm, RMSNorm, GroupNorm, BatchNorm1d/2d/3d,
    MultiheadAttention, RNN, LSTM, GRU and their cells), or, for other modules, each one with
    direct trainable parameters (a generic ``torch.func`` rule covering it and its children).
    Each grad-enabled
    forward call is recorded; the calls that the losses do not reach (stray or evaluation
    forwards) are ignored and dropped at the next step. A parameter is seen through the hooked
    modules' calls only: at the first step, and again when the recorded calls or the losses'
    graph around them change, one that the losses also reach elsewhere (a weight tied through
    a functional call or to an unhooked layer, a penalty on it added to the losses) is refused
    with a clear error, so hook every module that uses it (for a module under the generic
    rule, the uses inside its calls are its own). Frozen parameters
    (``requires_grad=False``) are left out, also those frozen between a forward and its step;
    a module unfrozen later (a backbone after a warm-up) is hooked at the next forward of the
    given modules with no call pending. As with autograd, a module frozen around its calls,
    or for the whole forward and made trainable before the step (a GAN's critic under the
    generator's loss), gets nothing from them: such calls are left out. A module with only
    some of its parameters frozen around a call, or made trainable after the forward while
    others of its parameters were trainable in it, is refused.

    Per sample, the first step of each pattern of recorded calls (the hooked modules called, and
    the losses' graph around their calls) and batch size checks that every loss reads the hooked
    calls' outputs at its own sample only, by ``2 ceil(log2 B)`` more backwards, from the losses
    of the samples with a 1 at each binary digit of their index and from the others' (gradient
    hooks on that path run in them too), which split every pair of samples: a loss over pairs of
    samples, a module outside the engine that mixes them, or a module called on a tensor without
    the batch dimension whose first size equals the batch size (position embeddings of
    ``torch.arange(T)`` with ``T == B``) is refused with a clear error, where the shapes alone
    cannot tell. (A read decided by the data, as a normalisation by the batch's largest output,
    losses sorted by value (``losses.sort()``, ``topk``) or sequences pooled at their lengths,
    is seen only where the probed step shows it: a later step of the same pattern and batch size
    is not probed, and such a mixing gives other samples' rows, silently. A ``retain_grad()``
    tensor on that path accumulates
    those backwards' gradients too. A model whose calls or losses' graph change at every step,
    as with LayerDrop, is checked at every step.) A reentrant activation checkpoint
    (``use_reentrant=True``) that runs hooked modules (or a function that is not a module's) or
    lies above the hooked calls, whose calls the engine cannot see, is refused; the
    non-reentrant one is supported. Torch.compile'd code, whose backward may run only once, is
    not checked.

    The output gradients of several rows per sample (``[B, k]`` losses) or of per-task losses
    are pulled back in one backward batched with ``vmap``. Per task on the CPU, losses stacked
    from scalars (``torch.stack``) whose heads reach the hooked modules through one output (the
    shared trunk's) are first pulled back to that output head by head, one backward per task
    along its own head: batched, each head would carry every task's row. Gradient hooks that
    a user registers on a hooked module's output (``out.register_hook``) are honoured. Torch's
    fused recurrent kernels
    (cuDNN) have no batching rule: when a recurrent layer inside the given modules ran one, that
    backward is taken row by row (``k`` or ``m`` backward passes); one outside them, between the
    losses and the hooked modules, is refused with a clear error (give the Engine a module that
    contains it, or run it under ``torch.backends.cudnn.flags(enabled=False)``).

    Under mixed precision (``torch.autocast``), the recorded inputs and output gradients of a
    layer with a closed form are taken in its parameters' dtype, other modules are re-run under
    the autocast of their forward, and the step (weighting included) runs outside autocast: the
    Gramian and the update come in the parameters' dtype, whether the step runs inside the
    autocast region or after it (PyTorch's advice for ``backward``). Without autocast, the
    recorded tensors are used as they are, but for float16 parameters: their products would
    overflow float16's range, so they run in float32, and the Gramian comes in float32 (the
    update in float16). A forward on the meta device (shape inference, deferred
    initialisation) runs as without the engine; a step on its losses, which hold no values, is
    refused with a ``ValueError`` (step after ``model.to_empty(device=...)``).

    Per-row gradients of extreme but finite scale (about 1e19 or 1e-20 and beyond in float32)
    overflow or underflow the Gramian's products. The step of a weighting that
    :attr:`~jacflow.aggregation.GramianWeighting.reads_gramian` (not ``MeanWeighting``,
    ``SumWeighting``, ``ConstantWeighting``, ``RandomWeighting``: their weights and the update
    do not need it) reads the Gramian's largest entry
    (one host read) and, when it is not finite or lost its digits (below ``tiny / eps``,
    about 1e-31 in float32, zero included), forms the Gramian again in float64 from the
    per-row gradients, one parameter at a time (slow, and it materialises them: only then).
    A :attr:`~jacflow.aggregation.GramianWeighting.scale_invariant` weighting gets it scaled
    by a power of two to a largest entry in [1/2, 1), in the usual dtype (the weights at
    scale 1); another gets it in float64, as from ``jacflow.backward``. The weights are
    returned in the Gramian's usual dtype at every step, also by a weighting that keeps those
    of a float64 Gramian (``Periodic``'s reuse steps). The ``.grad`` written is the true
    ``w @ J``. Not under DDP per task, whose replicas average their Gramians as formed; nor in
    :meth:`compute_gramian`, which returns the Gramian as formed.

    Args:
        modules: the modules whose parameters define the Jacobian. Parameters of other modules
            get no gradient from :meth:`backward` unless passed as ``other_params``.
        batch_dim: ``0``: ``losses[i, ...]`` depend only on sample ``i`` of every hooked
            module's batch (dimension 0 of its inputs and outputs; an output that the losses do
            not read may lack it, as a 0-d auxiliary term returned with a module's output, and
            under the generic rule only a 0-d one); one backward then gives every sample's
            output gradients. Another dimension ``d`` (negative ones count from the back) says
            that the losses hold the batch there (``[k, B]`` losses: ``1``); the modules' batch
            stays their dimension 0. The Gramian's rows and the weights follow
            ``losses.flatten()`` whatever ``d``, as TorchJD's do. An empty batch is refused
            (skip its step), where ``jacflow.backward`` takes the zero step. ``None``: no such
            structure (e.g. one loss per task on a shared trunk); one batched backward over the
            ``m`` losses.
        ddp: the ``DistributedDataParallel`` wrapping the model, when the modules given are
            inside it (e.g. its trunk; a wrapper among the modules given is found). DDP averages
            the replicas' gradients in hooks of ``backward``, which the engine's step does not
            run: the step then averages instead. Per task, the replicas' ``m x m`` Gramians are
            averaged before the weighting (every replica gets the same weights, those of the
            average Gramian, not of the whole batch's, and the update is ``w^T`` times their
            average Jacobian); per sample, each replica weighs its own
            samples and the updates are averaged, as DDP averages the replicas' gradients. The
            ``.grad`` written is the replicas' average of their accumulated ``.grad``, as after
            DDP's synchronised backward; inside ``ddp.no_sync()`` nothing is communicated.
            Without it, each replica keeps its own update.

    Raises:
        ValueError: a module mixes the samples (a BatchNorm without running statistics; one
            in training mode in the forward of the losses, at the step), or the losses read
            a hooked output at other samples than their own, while ``batch_dim=0``; a module is
            compiled; per sample, an embedding with ``scale_grad_by_freq`` under the generic
            rule; a reentrant checkpoint.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from jacflow.autogram import Engine
        >>> from jacflow.aggregation import UPGradWeighting
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> x, y = torch.randn(5, 3), torch.randn(5, 1)
        >>> with Engine(model, batch_dim=0) as engine:
        ...     losses = ((model(x) - y) ** 2).squeeze(1)
        ...     weights = engine.backward(losses, UPGradWeighting())
        >>> weights.shape, model[0].weight.grad.shape
        (torch.Size([5]), torch.Size([4, 3]))

        Losses laid out ``[k, B]`` (one row per objective) hold the batch on dimension 1; the
        Gramian and the weights follow ``losses.flatten()``:

        >>> layer = nn.Linear(3, 2)
        >>> with Engine(layer, batch_dim=1) as engine:
        ...     losses = layer(x).pow(2).T  # [2, 5]
        ...     gramian = engine.compute_gramian(losses)
        ...     weights = engine.backward(layer(x).pow(2).T, UPGradWeighting())
        >>> gramian.shape, weights.shape
        (torch.Size([10, 10]), torch.Size([2, 5]))
    """

    def __init__(
        self,
        *modules: nn.Module,
        batch_dim: int | None,
        ddp: DistributedDataParallel | None = None,
    ) -> None:
        if batch_dim is not None and (
            isinstance(batch_dim, bool) or not isinstance(batch_dim, int)
        ):
            raise TypeError(
                f"`batch_dim` must be an int or None, received {received(batch_dim)}. Pass the "
                "dimension of the losses that holds the batch (per sample, usually 0) or None "
                "(per task)."
            )
        self.batch_dim = batch_dim
        self._modules = modules
        self._recorder = Recorder()
        self._removed = False
        # reused .grad memory, for the steps whose new gradients outweigh what they captured
        # (see _buffers.worth_reusing)
        self._buffers: GradientBuffers | None = GradientBuffers()
        self._per_task_rows: dict[tuple[torch.Size, torch.dtype, torch.device], tuple[Rows, Tensor]]
        self._per_task_rows = {}
        self._units: list[Unit] = []
        # the modules watched (BatchNorm per sample, recurrent layers), held (their ids stay
        # theirs): the units found now and those watched differing from these is a change
        # that calls for hooking the modules again
        self._watched: list[nn.Module] = []
        self._layout: list[tuple[nn.Module, type, frozenset[str]]] = []
        self._snapshot_at: tuple[Any, ...] = ()
        # the patterns of recorded calls whose steps passed the check of outside uses: the
        # losses' graph is walked again only for a new pattern
        self._outside_checked: set[Pattern] = set()
        # (and, per sample, those whose losses read each output at its own sample only)
        # (keyed with the batch size and where each output's batch lies, see _prepare_calls)
        self._separable_checked: set[tuple[Pattern, int, tuple[Any, ...]]] = set()
        self._hook_error: Exception | None = None  # (of hooking them again at a forward)
        # (the sets above of the other layouts of units hooked before, see _hook_modules)
        self._checked_by_layout: dict[tuple[Any, ...], tuple[set[Any], set[Any]]] = {}
        # (a step's forward ran with the modules changed since, its calls still exact (see
        # _calls_still_exact): hooked again after the step)
        self._hook_after_step = False
        self._pending_forwards = 0  # (see _note_pending_forward)
        self._warned_pending = False
        # (DistributedDataParallel wrappers: the step takes their averaging over the replicas)
        given = [] if ddp is None else [_checked_ddp(ddp, modules)]
        self._replicas = wrappers_in([*modules, *given])
        self._meeting_open = False  # (a step's meetings, shared by a caller's checks)
        self._step_names: dict[int, str] | None = None  # (_hooked_names, within a step)
        self._meetings: Meetings | None = None
        self._hook_modules()
        # (a forward of a given module first hooks them again if they changed: a frozen
        # parameter made trainable, e.g. a backbone after a warm-up, or a module added)
        rehook = _Rehook(self)
        self._watches = [m.register_forward_pre_hook(rehook) for m in modules]
        self._snapshot_at = self._snapshot()  # (with these hooks)
        # (an engine dropped without remove() unhooks the modules when it is collected; the
        # recorder held weakly: its hooks keep it while the modules live)
        weakref.finalize(self, _unhook, weakref.ref(self._recorder), self._watches)

    def _hook_modules(self) -> None:
        """Find the units among the modules' parameters trainable now and hook them."""
        modules, batch_dim = self._modules, self.batch_dim
        _check_modules(modules, batch_dim)
        units = find_units(modules)
        for unit in units:
            _check_real_parameters(unit, unit.params())
        if batch_dim is not None:
            _check_generic_units(units)
        self._recorder.remove()
        self._units = units
        self._step_names = None
        # (the patterns checked hold for a layout of units: kept for one hooked again later, as
        # the model's after a frozen attack's or a functional_call teacher's forward)
        if len(self._checked_by_layout) >= _MAX_LAYOUTS:
            self._checked_by_layout.clear()
        self._checked_by_layout[_layout_key(self._layout)] = (
            self._outside_checked,
            self._separable_checked,
        )
        self._layout = _layout(units)
        self._outside_checked, self._separable_checked = self._checked_by_layout.pop(
            _layout_key(self._layout), (set(), set())
        )
        self._hook_error = None
        for index, unit in enumerate(self._units):
            self._recorder.hook(index, unit)
            if unit.rule.covers_children():
                self._recorder.watch_children(unit)
        self._watched = self._to_watch()
        if batch_dim is not None:
            for i, module in enumerate(modules):
                for name, sub in module.named_modules():
                    if isinstance(sub, _BatchNorm):
                        self._recorder.watch_coupling(f"modules[{i}].{name}", sub)
        for sub in self._watched:
            if isinstance(sub, nn.RNNBase):
                self._recorder.watch_fused_rnn(sub)
            elif isinstance(sub, nn.GroupNorm):
                self._recorder.watch_group_norm(sub)
        self._snapshot_at = self._snapshot()  # (with the hooks just registered)

    def _to_watch(self) -> list[nn.Module]:
        """The BatchNorm layers (per sample), and the recurrent and GroupNorm layers of the
        modules, once."""
        per_sample = self.batch_dim is not None
        found: dict[int, nn.Module] = {}
        for root in self._modules:
            for sub in root.modules():
                if isinstance(sub, (nn.RNNBase, nn.GroupNorm)) or (
                    per_sample and isinstance(sub, _BatchNorm)
                ):
                    found.setdefault(id(sub), sub)
        return list(found.values())

    def _changed(self) -> bool:
        """Whether the modules changed since they were hooked: another layout of units now (a
        frozen module made trainable, a module added, moved or replaced, a weight norm or
        pruning applied, a parameter added), or other layers to watch. (Not the parameters'
        identities, which functional_call swaps for the length of a call; a unit reads its
        parameters at each step.)"""
        snapshot = self._snapshot()
        if snapshot == self._snapshot_at:  # (the usual case, without finding the units)
            return False
        try:
            units = find_units(self._modules)
        except ValueError:  # (hooking them again raises it, at the step)
            return True
        # (modules compare by identity, as in the snapshot)
        changed = _layout(units) != self._layout or self._to_watch() != self._watched
        if not changed:
            self._snapshot_at = snapshot
        return changed

    def _snapshot(self) -> tuple[Any, ...]:
        """Per module (held, compared by identity): its type, the methods the rules rely on
        (``forward``, ``_conv_forward``) as its type has them and whether its instance has one
        of its own, its children by name, its parameters by name with their flags, and its
        forward pre-hooks (pruning, old weight norms). Equal, no unit changed."""
        return tuple(
            (
                sub,
                type(sub),
                kept_methods(sub),
                tuple(sub._modules.items()),
                tuple(
                    (n, id(p), p.requires_grad) for n, p in sub._parameters.items() if p is not None
                ),
                tuple(sub._forward_pre_hooks),
            )
            for root in self._modules
            for sub in root.modules()
        )

    def _calls_still_exact(self, losses: Tensor) -> bool:
        """Whether the modules changed since they were hooked only in ways that leave the calls
        recorded exact for ``losses``: parameters frozen (the units found now are the hooked
        ones less those, and those left with none), and modules not hooked then made trainable
        whose parameters ``losses`` do not reach (frozen for the forward, as a GAN's critic for
        the generator's, and unfrozen before the step: autograd gives them no gradient); the
        layers watched the same. A unit reads its trainable parameters at the step."""
        try:
            units = find_units(self._modules)
        except ValueError:
            return False
        # (a unit hooked with no trainable parameter, a parametrized module frozen then, counts
        # as not hooked: its generic rule keeps only the parameters that its calls reach)
        if any(not names and rule is not FallbackRule for _, rule, names in self._layout):
            return False
        with_params = [(u, entry) for u, entry in zip(self._units, self._layout) if entry[2]]
        hooked = {id(module) for _, (module, _, _) in with_params}
        kept = [unit for unit in units if id(unit.module) in hooked and unit.params()]
        narrowed = _narrowed([u for u, _ in with_params], [entry for _, entry in with_params])
        if _layout(kept) != narrowed:
            return False
        if self._to_watch() != self._watched:
            return False
        added = [p for u in units if id(u.module) not in hooked for p in u.params().values()]
        nodes = (get_gradient_edge(p).node for p in added)
        targets: dict[int, tuple[str, object]] = {id(node): ("", node) for node in nodes}
        return not targets or first_reached(losses, targets) is None

    def _rehook_if_changed(self, module: nn.Module, args: Any) -> None:
        # (not with calls pending, whose units would change: the step refuses them instead;
        # nor for a forward that records nothing. At every grad-enabled forward with none
        # pending, not once between steps: one made in a passing state (the model frozen for
        # an attack on its inputs, a teacher's pass through functional_call with detached
        # tensors) hooks the modules for it, and the next forward hooks them back)
        if self._recorder.calls and torch.is_grad_enabled() and not is_replaying():
            self._note_pending_forward()
        if self._recorder.calls or self._recorder.idle or is_replaying():
            return
        if not torch.is_grad_enabled():
            return
        if not self._changed():
            return
        if self._hooked_again():
            self._recorder.run_pre_hooks(module, args)

    def _hooked_again(self) -> bool:
        """Hook the modules again; whether that succeeded (a refusal is kept for the next
        step, which raises it: not in the forward)."""
        try:
            self._hook_modules()
        except (ValueError, TypeError) as error:
            self._hook_error = error
            return False
        return True

    def _check_unchanged(self, losses: Tensor) -> None:
        """Refuse a step whose forward ran with the modules changed since they were hooked
        (its calls were not all recorded), after hooking them again for the next forward. One
        whose changes leave the calls exact (parameters frozen, or modules made trainable that
        the losses do not reach) is not refused: the step hooks them again at its end (its
        calls taken, none is pending then)."""
        if not self._changed():
            return
        if self._calls_still_exact(losses):
            self._hook_after_step = True
            return
        error = self._hook_error
        try:
            self._hook_modules()  # (the calls were taken: none is pending)
        except (ValueError, TypeError) as refusal:
            error = refusal
        if error is not None:
            raise error
        raise ValueError(
            "The Engine's modules changed since it hooked them, after this forward began (a "
            "frozen parameter made trainable, a module added or replaced, or a module's own "
            "parameters frozen under a rule that covered its children, while calls of a "
            "forward were pending), so not all of its calls were recorded. The Engine has "
            "hooked them again: run the forward again. (It hooks them again at the start of a "
            "forward of a module given to it when no call is pending.) A whole module frozen "
            "for the forward and made trainable before the step is taken (left out, as "
            "autograd leaves it) where the losses do not reach it; where this happens at every "
            "step, change the freezing so that the forward's and the step's agree: unfreeze "
            "before the forward what it uses trainable, freeze a module as a whole, or keep "
            "it frozen until the step."
        )

    # ----------------------------------------------------------------------------- lifecycle
    def __deepcopy__(self, memo: dict[int, object]) -> Engine:
        raise TypeError(
            "An Engine cannot be copied: it hooks the modules it was created on. Create a new "
            "Engine on the copied model (a deep copy of a hooked model carries no engine)."
        )

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("An Engine cannot be pickled: create a new one after loading the model.")

    def remove(self) -> None:
        """Remove every hook, drop the recorded calls and the kept gradient memory. Calling it
        twice is harmless."""
        _unhook(weakref.ref(self._recorder), self._watches)
        self._removed = True
        self._buffers = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    def clear(self) -> None:
        """Drop the calls recorded so far (e.g. after grad-enabled forwards you won't use)."""
        self._recorder.take()
        self._pending_forwards = 0

    def _note_pending_forward(self) -> None:
        """Count a forward started while earlier ones' calls wait for a step, and warn once
        when many have piled up holding much memory: their recorded inputs stay alive until a
        step takes them (looked at every ``_PENDING_FORWARDS_WARNING`` forwards)."""
        self._pending_forwards += 1
        if self._warned_pending or self._pending_forwards % _PENDING_FORWARDS_WARNING:
            return
        storages = {
            id(t): t.untyped_storage().nbytes()
            for _, call in self._recorder.calls
            for t in call.args
            if isinstance(t, Tensor)
        }
        held = sum(storages.values())
        if held < _PENDING_BYTES_WARNING:
            return
        self._warned_pending = True
        warnings.warn(
            f"The Engine has recorded the calls of {self._pending_forwards} forwards of its "
            f"modules since its last step, holding {held / 2**20:.0f} MiB of "
            "inputs until a step takes them. Plain training steps with the Engine attached (a "
            "warm-up before Jacobian descent) keep them: call engine.clear() after such steps, "
            "or create the Engine when Jacobian descent starts (engine.remove() when it ends).",
            stacklevel=caller_stacklevel(),
        )

    # ----------------------------------------------------------------------------- public API
    def compute_gramian(self, losses: Tensor, *, retain_graph: bool = True) -> Tensor:
        """The ``[m, m]`` Gramian ``J J^T`` of the Jacobian of ``losses.flatten()`` w.r.t. the
        hooked parameters.

        Args:
            losses: any shape, ``m = losses.numel()``; per sample, its dimension
                ``batch_dim`` is the batch.
            retain_graph: keep the graph (default ``True``) so that ``losses.backward(weights)``
                can follow, as in TorchJD.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from jacflow.autogram import Engine
            >>> layer = nn.Linear(2, 1, bias=False)
            >>> with torch.no_grad():
            ...     _ = layer.weight.copy_(torch.tensor([[1.0, 1.0]]))
            >>> engine = Engine(layer, batch_dim=0)
            >>> x = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
            >>> engine.compute_gramian(layer(x).squeeze(1))
            tensor([[1., 0.],
                    [0., 4.]])
        """
        # (checked before the step takes the recorded calls: autograd's error on another value
        # is a raw one, and the failed step would have used up the forward)
        check_flag(retain_graph, "retain_graph", none_ok=True)
        given, losses = self._checked_losses(losses)
        # (autograd.grad needs no grad mode: no graph of the grads)
        with torch.no_grad(), without_autocast(losses.device.type):
            contributions, rows, order = self._prepare(losses, retain_graph, ())[:3]
            order = _in_given_order(order, given, self.batch_dim)
            return _to_loss_order(_assemble(contributions, rows, losses), order)

    def backward(
        self,
        losses: Tensor,
        weighting: GramianWeighting,
        *,
        other_params: Iterable[Tensor] = (),
        retain_graph: bool = False,
    ) -> Tensor:
        """One Jacobian-descent step: ``G``, ``w = weighting(G)``, and ``.grad += w @ J``.

        The weighted gradient of each hooked layer comes from its stored inputs and output
        gradients (book-keeping), so there is no second backward. Parameters outside the hooked
        modules are left untouched unless listed in ``other_params``, which then receive
        ``sum_i w_i grad(losses_i)`` through one ordinary autograd call (the hooked modules'
        parameters and the frozen ones there are skipped: ``other_params=model.parameters()``
        is right).
        Gradient hooks on the parameters (``p.register_hook``) run on their update, and their
        post-accumulate hooks after it is written, as after ``(weights @ losses).backward()``.
        Gradient hooks on a hooked module's output (``out.register_hook``) run on the gradient
        of the losses' sum (per sample) or on each task's row (per task), from which the
        Gramian and the update are then formed, not on ``weights @ losses``' gradient: for a
        hook linear in its gradient (a mask, a scaling) the update is the same; for one that is
        not (a clipping) it is the weighted sum of the hooked rows.
        ``retain_graph=True`` keeps the graph of ``losses`` for another differentiation.

        When a step's large new gradients outweigh the output gradients it captured (per-sample
        mode, or few tasks in per-task mode), a new ``.grad`` of 1 MiB or more (a CPU Linear
        weight) is a view of memory the engine keeps and reuses at later steps once nothing
        refers to it any more (``zero_grad()`` dropped it): that memory stays allocated between
        steps, as with ``zero_grad(set_to_none=False)``, until :meth:`remove`.

        Args:
            losses: any shape, ``m = losses.numel()``; per sample, its dimension
                ``batch_dim`` is the batch.
            weighting: the Gramian weighting that gives the weights (e.g.
                ``UPGradWeighting()``).
            other_params: parameters outside the hooked modules to step too (see above).
            retain_graph: keep the graph of ``losses`` for another differentiation.

        Returns:
            The weights, with the shape of ``losses`` (in the order of ``losses.flatten()``).

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from jacflow.autogram import Engine
            >>> from jacflow.aggregation import MeanWeighting
            >>> layer = nn.Linear(2, 1)
            >>> engine = Engine(layer, batch_dim=0)
            >>> losses = layer(torch.eye(2)).squeeze(1)
            >>> engine.backward(losses, MeanWeighting())
            tensor([0.5000, 0.5000])
            >>> layer.weight.grad, layer.bias.grad
            (tensor([[0.5000, 0.5000]]), tensor([1.]))
        """
        return self._step(losses, weighting, other_params, (), retain_graph)

    # ----------------------------------------------------------------------------- internals
    def _step(
        self,
        losses: Tensor,
        weighting: GramianWeighting,
        other_params: Iterable[Tensor],
        tasks_params: Iterable[Tensor],
        retain_graph: bool,
        layout: TaskLayout | None = None,
    ) -> Tensor:
        """Gramian, weights, weighted grads; ``tasks_params`` get the plain gradient of
        ``losses.sum()`` (per-task mode only; see :func:`capture`), or, with ``layout``, of the
        losses of their tasks, and its unhooked trunk parameters join the Jacobian. Under DDP,
        a failure on this replica is announced to the others at the step's next meeting."""
        if not self._replicas:
            warn_without_wrapper()
        with self._meeting() as meetings:
            check_gramian_weighting(weighting)
            check_flag(retain_graph, "retain_graph", none_ok=True)  # (see compute_gramian)
            given, losses = self._checked_losses(losses)
            # (before the step takes the recorded calls: a refused number of losses leaves the
            # forward for a retry, as jacflow.backward leaves the graph)
            weighting.check_rows(losses.numel())
            others, tasks = self._checked_params(other_params, tasks_params)
            unhooked, selections = self._task_inputs(tasks, layout)
            with without_autocast(losses.device.type):  # (the weighting's products too)
                # (autograd.grad needs no grad mode: no graph of the grads)
                with torch.no_grad():
                    prepared = self._prepare(
                        losses,
                        retain_graph or bool(others),
                        [*tasks, *unhooked],
                        selections,
                        None if layout is None else layout.features,
                        layout is not None and layout.row_by_row,
                    )
                    contributions, rows, order, extra_grads, captured_bytes = prepared
                    order = _in_given_order(order, given, self.batch_dim)
                    task_grads, trunk_rows = extra_grads[: len(tasks)], extra_grads[len(tasks) :]
                    gramian = _to_loss_order(_assemble(contributions, rows, losses), order)
                    gramian = _with_rows(gramian, trunk_rows)
                    dtype = gramian.dtype
                    if meetings is not None and rows.per_task:  # (the same weights everywhere)
                        meetings.meet(gramian.shape[0])
                        gramian = averaged_gramian(gramian, self._replicas)
                    # (overflowed: per-row gradients of about 1e19 in float32; or underflowed:
                    # below about 1e-20; one host read of the peak, the common path's only cost,
                    # for weights that read the Gramian: the update is formed by book-keeping)
                    elif _reads_gramian(weighting) and peak_out_of_range(gramian):
                        # (rare: formed again, exactly)
                        exact = _gramian_in_float64(contributions, rows, order, trunk_rows, gramian)
                        gramian = _usable(exact, weighting, dtype) if _in_range(exact) else gramian
                weights = _check_weights(weighting(gramian), gramian.shape[0], weighting)
                # (a weighting that read the float64 Gramian, or reused the weights of a step
                # that did: Periodic's)
                weights = _in_usual_dtype(weights, dtype)
                with torch.no_grad():
                    row_weights = weights if order is None else weights[order[1]]
                    params = (p for named, _ in contributions for p in named.values())
                    worth = worth_reusing(params, captured_bytes)
                    buffers = self._buffers if worth else None
                    updates = _weighted_grads(contributions, row_weights, buffers)
                    # (the unhooked trunk's hooks ran on each row, as in the Jacobian's rows)
                    trunk_updates = _row_updates(unhooked, trunk_rows, row_weights)
            # (autograd runs the hooks of the tasks' and the other parameters on their gradients)
            plain = [(p, g) for p, g in zip(tasks, task_grads, strict=True) if g is not None]
            plain += trunk_updates
            if others:
                extra = torch.autograd.grad(
                    given,
                    others,
                    grad_outputs=weights.reshape(given.shape).to(given.dtype),
                    retain_graph=retain_graph,
                    allow_unused=True,
                )
                plain += [(p, g) for p, g in zip(others, extra, strict=True) if g is not None]
            # (autograd.grad returns one buffer for the inputs of an `a + b`: one each)
            own = owned([g for _, g in plain], held=(weights,))
            plain = [(p, g) for (p, _), g in zip(plain, own, strict=True)]
            # (the hooked parameters' hooks last: after everything that may fail)
            with torch.no_grad():
                updates = _through_param_hooks(updates) + plain
                reached = {id(param) for param, _ in updates}  # (their post-accumulate hooks run)
                _check_update_sizes(updates)
                written: list[tuple[Tensor, Tensor]] = []
                if meetings is not None:
                    meetings.meet(last=True)
                    written, updates = averaged_grads(updates, self._replicas)
            _accumulate(updates, written, reached)
            return weights.reshape(given.shape)

    @contextlib.contextmanager
    def _meeting(self) -> Iterator[Meetings | None]:
        """The replicas' meetings of one step (see :class:`Meetings`), opened once: a caller's
        checks before the step (``mtl_backward``'s) take part in them, so that a failure
        there is announced at the step's meetings too."""
        if self._meeting_open:
            yield self._meetings
            return
        with meetings_of(self._replicas) as meetings:
            self._meeting_open, self._meetings = True, meetings
            try:
                yield meetings
            finally:
                self._meeting_open, self._meetings = False, None
                self._step_names = None

    def _checked_params(
        self, other_params: Iterable[Tensor], tasks_params: Iterable[Tensor]
    ) -> tuple[list[Tensor], list[Tensor]]:
        """``other_params`` without the hooked parameters (the engine's update reaches them
        once); ``tasks_params``, refused where one is a hooked parameter; both without the
        frozen parameters and repeats."""
        others = _parameter_list(other_params, "other_params")
        tasks = _parameter_list(tasks_params, "tasks_params")
        if not (others or tasks):
            return others, tasks
        hooked = self._hooked_names()
        for param in tasks:
            if id(param) in hooked:
                raise ValueError(
                    f"The task parameter {hooked[id(param)]} is also a parameter of the "
                    "engine's modules, whose update is the weighted one: it would get both. "
                    "Hook only the shared modules (the trunk), and pass the trunk's output as "
                    "the features."
                )
        return [p for p in others if id(p) not in hooked], tasks

    def _task_inputs(
        self, tasks: list[Tensor], layout: TaskLayout | None
    ) -> tuple[list[Tensor], list[Selection] | None]:
        """The layout's trunk parameters that the engine does not hook, and which rows each
        extra input of the backward (``tasks``, then those) receives (``None``: the rows' sum
        for every task parameter, and no such trunk parameter)."""
        if layout is None:
            return [], None
        hooked = self._hooked_names()
        unhooked = [p for p in layout.trunk if id(p) not in hooked]
        if not (unhooked or layout.rows):
            return [], None
        return unhooked, [layout.rows.get(id(p)) for p in tasks] + [EACH] * len(unhooked)

    def _prepare(
        self,
        losses: Tensor,
        retain_graph: bool,
        extra_inputs: Sequence[Tensor],
        selections: Sequence[Selection] | None = None,
        features: Sequence[Tensor] | None = None,
        row_by_row: bool = False,
    ) -> _Prepared:
        """Capture the output gradients, then build every unit's contribution (the part after
        the capture runs in the caller's ``no_grad``); ``row_by_row``: pull the rows back one
        by one, without vmap, whatever the graph holds.

        Returns the contributions, the row layout, the row<->loss permutations (``None`` when
        they are the identity), the gradients of the rows' sum (or those ``selections`` ask
        for) w.r.t. ``extra_inputs`` and the bytes of all captured gradients. With
        ``features``, losses that read none of those computed by the hooked modules reach no
        hooked call and make a step without contributions instead of an error (one that reads
        a hooked parameter directly is refused).
        """
        coupled, outside = self._recorder.coupled, self._recorder.outside
        returned = self._recorder.returned
        # (ops whose backward vmap cannot batch: the rows are pulled back one by one; also a
        # checkpoint's random draws, which its backward makes again, and anomaly mode, whose
        # check of each backward's output for NaN vmap cannot batch)
        recorder = self._recorder
        row_by_row = (
            row_by_row
            or recorder.fused_rnn
            or recorder.strided_norm
            or recorder.random_checkpoint
            or torch.is_anomaly_enabled()
        )
        calls = self._recorder.take()
        self._pending_forwards = 0
        try:
            return self._prepare_calls(
                calls,
                coupled,
                outside,
                returned,
                row_by_row,
                losses,
                retain_graph,
                extra_inputs,
                selections,
                features,
            )
        finally:  # (the tree of a module's calls of itself is a reference cycle)
            for _, call in calls:
                call.parent, call.children = None, []
            if self._hook_after_step:  # (so that the changes are seen by the next forward)
                self._hook_after_step = False
                self._hooked_again()

    def _prepare_calls(
        self,
        calls: list[tuple[int, Call]],
        coupled: list[tuple[str, Any]],
        outside: tuple[str, str] | None,
        returned: dict[int, int],
        row_by_row: bool,
        losses: Tensor,
        retain_graph: bool,
        extra_inputs: Sequence[Tensor],
        selections: Sequence[Selection] | None,
        features: Sequence[Tensor] | None,
    ) -> _Prepared:
        """:meth:`_prepare` on the ``calls`` taken from the recorder (and its other notes:
        see :class:`Recorder`)."""
        self._check_unchanged(losses)
        if outside is not None:
            child, parent = outside
            raise ValueError(
                f"{child} ran outside the forward of {parent}, whose rule covers its parameters "
                f"through {parent}'s own calls only: this call's share of their gradient would "
                f"be missed. Call it only inside {parent}'s forward, or freeze its parameters "
                "(requires_grad_(False)). (Any grad-enabled call since the last step counts, "
                "one that the losses do not read included: run it under torch.no_grad().)"
            )
        # (a stray forward's call that the losses do not read mixes none of their samples)
        targets = {id(node): (name, node) for name, node in coupled}
        mixing = first_reached(losses, targets) if targets else None
        if mixing is not None:
            raise ValueError(
                f"{mixing} normalised with its batch's statistics during the forward of "
                "`losses` (training mode, or track_running_stats=False): it mixes the samples, "
                "so the per-sample engine (batch_dim set) cannot be used. Call .eval() on one "
                "with running statistics, replace it (e.g. by GroupNorm), or use "
                "batch_dim=None."
            )
        # (before the backward: autograd may fail on such a view)
        with_units = [(self._units[index], call) for index, call in calls]
        _check_strided_inputs(with_units, self.batch_dim)
        _check_hooks_under_view_ops(losses, with_units)
        _check_output_views(losses, with_units)
        # (the checks below hold for a pattern of calls and the graph around them)
        reruns = {k for k, (index, _) in enumerate(calls) if self._reruns(index)}
        outside_key = outside_calls(losses, [c for _, c in calls], self._hooked_names(), reruns)
        pattern = (tuple(i for i, _ in calls), outside_key)
        if REENTRANT_CHECKPOINT in pattern[1]:
            self._check_reentrant_checkpoints(losses, calls)
        if pattern not in self._outside_checked:
            self._check_no_outside_use(losses, calls, pattern, returned)
        rows, cotangents, order = self._rows(losses)
        edges = [edge for _, call in calls for edge in call.edges]
        # (a module re-run with torch.func replays the hooks its forward registered: its own
        # outputs' hooks are refused below rather than run here)
        hooks = [
            [] if self._reruns(index) else h for index, call in calls for h in call.user_hooks()
        ]
        above = [a for _, call in calls for a in call.hooks_above()]
        # (compiled code's backward runs once, and not under vmap: no probe, rows one by one)
        compiled = _holds_compiled(pattern[1], edges)
        # (vmap cannot batch a sparse backward, that of an nn.Embedding(sparse=True) below or
        # of a product with a sparse adjacency matrix, between the modules or inside a module
        # of the generic rule, whose graph the walk of outside_calls steps over; where there
        # is one, a walk tells whether the capture's backward runs it)
        sparse = SPARSE_OPERATION in pattern[1] or any(
            self._reruns(index) and sparse_inside(call) for index, call in calls
        )
        row_by_row = (
            row_by_row
            or (sparse and _runs_sparse(losses, calls, extra_inputs))
            or _sparse_rows(pattern[1], losses, extra_inputs, selections)
        )
        # (per sample, a new pattern's losses are probed after the checks below: the graph stays)
        probing = not rows.per_task and rows.num_samples > 1 and not compiled
        # (a pattern is probed again for another batch size: other pairs of samples; and where
        # a call's outputs start merging the batch with positions (see _merged_positions): at
        # one position, positions first ([T B], torch.stack over T) reads as batch first; or
        # hold it elsewhere than on dimension 0 (see _sequence_first): with T = B, sequence
        # first reads as batch first)
        batch = max(rows.num_samples, 1)
        layouts = tuple(
            tuple(
                (len(s) > 1 and _merges_batch(s[0], batch), _batch_elsewhere(s, batch))
                for s in c.output_shapes
            )
            for _, c in calls
        )
        probed = (pattern, int(losses.shape[0]) if losses.dim() else 1, layouts)
        probing = probing and probed not in self._separable_checked
        # (per sample, one row per sample, the backward also takes the gradient of the
        # generic-rule units' own parameters: the reference of the rule's check of their rows,
        # see FallbackRule.prepare; their gradient hooks, which the engine runs on the update,
        # left out meanwhile. Batched over several rows, it would take each row's, under vmap,
        # where a backward without a batching rule could fail: the rule re-runs the module.)
        one_row = not rows.per_task and rows.index is None
        checked = _own_generic_params(self._units, calls) if one_row else {}
        inputs = [*extra_inputs, *(p for params in checked.values() for p in params.values())]
        if selections is not None:
            selections = [*selections, *[None] * (len(inputs) - len(extra_inputs))]
        with (
            replaying(),  # (a checkpointed forward recomputed by it is not a forward call)
            _compiled_backward_hint(),
            _selective_checkpoint_hint(),
            _reentrant_checkpoint_hint(),
            without_tensor_hooks(inputs[len(extra_inputs) :]),
        ):
            grads, extra_grads = capture(
                losses,
                edges,
                hooks,
                above,
                inputs,
                cotangents,
                rows.per_task,
                retain_graph or probing,
                row_by_row or compiled,
                selections,
            )
        references = _by_unit(checked, extra_grads[len(extra_inputs) :])
        extra_grads = extra_grads[: len(extra_inputs)]
        captured_bytes = sum(g.numel() * g.element_size() for g in grads if g is not None)
        reached: dict[int, list[Call]] = {}
        frozen_calls = False  # (whether calls made with their parameters frozen were left out)
        recorded: dict[int, list[Call]] = {}  # (the replayed units' calls, reached or not)
        batch_dims: list[tuple[Unit, Call, list[int | None]]] = []  # (of the reached calls)
        flattened: set[tuple[Any, int]] = set()  # (see _flattened_rows)
        found: list[set[int]] = []

        def buffer_ids() -> set[int]:
            """The modules' buffers, which _sequence_first never reads so: found once a step,
            and only where a call may be sequence first (no call on the usual path)."""
            if not found:
                found.append({id(b) for m in self._modules for b in m.buffers()})
            return found[0]

        cursor = 0
        for (index, call), layout in zip(calls, layouts, strict=True):
            if call.modes is not None:
                recorded.setdefault(index, []).append(call)
            call_grads = _at_outputs(call, grads[cursor : cursor + len(call.edges)])
            cursor += len(call.edges)
            unit = self._units[index]
            if all(g is None for g in call_grads):
                continue
            if call.preceded:
                raise ValueError(
                    f"A forward hook ran before the Engine's on {unit.name} (one registered with "
                    "prepend=True after the Engine was created, or a global forward hook): the "
                    "Engine cannot tell whether it replaced the module's output, and if it did, "
                    "the Gramian would be read at that hook's output and be wrong. Register it "
                    "without prepend=True (after the Engine's), or on a module the Engine does "
                    "not hook, or remove the global hook while the Engine is attached."
                )
            if call.all_frozen:  # (autograd gives its parameters nothing from this call)
                frozen_calls = True
                continue
            if self._reruns(index):
                _check_no_output_hooks(unit, call, call_grads)
            else:
                _check_no_legacy_backward_hooks(unit)
                _check_settings(unit, call, index, calls)
            unit.rule.validate(unit.module, call, rows)
            dims = [unit.rule.output_batch_dim(unit.module, call, j) for j in call.output_positions]
            call.merged = _merged_positions(unit, call, rows, dims, not compiled, flattened)
            call.batch_at = 0
            if call.merged > 1:  # (laid out by _batch_first_call; the probe checks the order)
                dims = [None] * len(dims)
            elif dims == [0] and layout[0][1] is not None and not compiled:  # (one output)
                at = _sequence_first(unit, call, rows, layout[0][1], buffer_ids)
                if at is not None:  # (laid out by _batch_first_call; the probe checks it)
                    dims, call.batch_at = [at], at
            _check_batch(unit, call, rows, dims, losses.shape, call_grads)
            _check_versions(call)
            _check_same_parameters(unit, call)
            if call.frozen:  # (rare: see the function)
                _check_not_frozen_during(unit, call)
            call.reached = [g is not None for g in call_grads]
            call.grads = _rows_shaped(call_grads, call, rows, dims)
            reached.setdefault(index, []).append(call)
            batch_dims.append((unit, call, dims))
        # (a probe that met non-finite gradients gave no verdict: the next step probes again)
        if (
            probing
            and batch_dims
            and _check_separable(losses, batch_dims, rows.num_samples, retain_graph)
        ):
            if len(self._separable_checked) >= _MAX_PATTERNS:
                self._separable_checked.clear()
            self._separable_checked.add(probed)
        if not reached and is_replaying():
            raise RuntimeError(
                "An Engine step ran inside the forward of a module that another engine re-runs "
                "(its generic rule, with torch.func): the calls of that re-run are not recorded. "
                "Take the step outside the module's forward."
            )
        if not reached and (not self._units or frozen_calls):  # (every parameter frozen: 0)
            return [], rows, order, extra_grads, captured_bytes
        if (
            not reached
            and features is not None
            and not self._reaches_hooked_features(losses, features)
        ):
            # (a hooked parameter that the losses read without a recorded call: a penalty on
            # it, or a feature that is one; its share would be missed)
            read = _hooked_param_reached(losses, self._hooked_names())
            if read is not None:
                raise ValueError(
                    f"The parameter {read} of the engine's modules is read by the losses "
                    "outside the modules' calls (directly, as a penalty on it or as a feature), "
                    "and they read none of the features computed by the modules: the Gramian "
                    "would miss that use. Use it through its module only, or step without "
                    "the engine."
                )
            # (the losses read only features outside the hooked modules, or none: the hooked
            # parameters' Jacobians are zero, the others' rows came from the capture)
            return [], rows, order, extra_grads, captured_bytes
        names = self._hooked_names() if not reached and returned else {}
        for key, index in returned.items():  # (the cause, where a unit returned one)
            if key in names:
                raise _returned_as_is(self._units[index], names[key], self.batch_dim)
        if not reached:
            # (the losses may read a hooked parameter through a functional call instead)
            read = _hooked_param_reached(losses, self._hooked_names())
            raise RuntimeError(
                "No forward call of the hooked modules is in the graph of `losses`. Create the "
                "Engine before the forward, run the forward with grad enabled, and make the "
                "losses depend on the hooked modules' outputs. Each step takes the calls "
                "recorded since the previous one: a second step on the same forward "
                "(compute_gramian then backward, a retry after a failed step, or a step for "
                "each of two forwards run before either) finds none; run the forward before "
                "each step. So does a step after another one on the same forward whose losses "
                "did not read these calls (a GAN's critic step on fake.detach() took the "
                "generator's call, which the generator's step then reads): take the steps in "
                "the other order, or use one engine per network."
                + (f" {_COMPILED_BEFORE_HINT}" if compiled else "")
                + (f" {_PARAMETER_FEATURE_HINT}" if features is not None else "")
                + (f" {_functional_use_hint(read)}" if read is not None else "")
                + (f" {_TRANSFORM_HINT}" if self._recorder.took_under_transform else "")
            )
        for index, unit_calls in recorded.items():
            if index in reached:  # from its first reached call on (calls nested in another
                # call end before it: the chain runs over the outermost ones)
                calls_reached = {id(c) for c in reached[index]}
                first = next(i for i, c in enumerate(unit_calls) if id(c) in calls_reached)
                chain = [c for c in unit_calls[first:] if not c.nested]
                if chain:
                    check_replayed_calls(self._units[index].module, chain)
        contributions = []
        for index, unit_calls in reached.items():
            unit = self._units[index]
            params = unit.params()
            _check_real_parameters(unit, params)
            if self._reruns(index):
                params = _reached_params(params, unit_calls)
            if not params:
                continue
            if not unit.rule.covers_children():  # (the generic rule replays the autocast)
                dtype = next(iter(params.values())).dtype
                work = working_dtype(dtype)
                for call in unit_calls:
                    if call.autocast is not None or work != dtype:
                        upcast(call, work)
            rule = unit.rule
            unit_calls = [_batch_first_call(call, rows) for call in unit_calls]
            if isinstance(rule, FallbackRule) and index in references:
                reference = {name: references[index][name] for name in params}
                contribution = rule.prepare(unit.module, params, unit_calls, rows, reference)
            else:
                contribution = rule.prepare(unit.module, params, unit_calls, rows)
            contributions.append((params, contribution))
        return contributions, rows, order, extra_grads, captured_bytes

    def _check_reentrant_checkpoints(self, losses: Tensor, calls: list[tuple[int, Call]]) -> None:
        """Refuse a reentrant activation checkpoint in the losses' graph where it matters: the
        calls inside it are not recorded (its forward runs without grad), and its backward
        writes ``.grad`` of the parameters inside it. It is harmless below every recorded call
        (the engine's backward stops before it) when it runs a module holding none of the
        hooked parameters (a frozen backbone, or one trained apart from the Engine); a
        function that is not a module's cannot be looked into, and is refused."""
        checkpoints = reentrant_checkpoints(losses)
        hooked = self._hooked_names()
        inside = any(
            module is None or any(id(p) in hooked for p in module.parameters())
            for module in map(checkpointed_module, checkpoints)
        )
        if inside or checkpoint_above_calls(checkpoints, [call for _, call in calls]):
            raise ValueError(_REENTRANT_REFUSAL)

    def _check_no_outside_use(
        self,
        losses: Tensor,
        calls: list[tuple[int, Call]],
        pattern: Pattern,
        returned: dict[int, int],
    ) -> None:
        """Refuse a hooked parameter that the losses reach outside the recorded calls (a
        weight tied through a functional call): its share there would be missing. Run once per
        ``pattern`` of recorded calls (the units called, in order, and the graph around them):
        such a use is the model's or the losses' structure (a branch taken at some steps only,
        a penalty added later), and the walk costs 1-3% of a step of a small model (per
        sample, the width-256 MLP at B = 128; per task, width 256 with 10 heads). ``returned``:
        the parameters that a unit's call returned as they are (by ``id``: the unit's index),
        whose use outside the calls has that cause."""
        # (a module under the generic rule is re-run, its calls of itself and of its children
        # included: the uses of its parameters inside its calls are its own)
        params = self._hooked_names()
        covered = {
            index: {id(p) for p in unit.params().values()}
            for index, unit in enumerate(self._units)
            if self._reruns(index) and unit.params()
        }
        closed = (call for index, call in calls if not self._reruns(index))
        recomputed = {  # (a parametrisation's weight, cached or not, is computed again)
            index: any(map(is_parametrized, self._units[index].module.modules()))
            for index in covered
        }
        replayed = (
            (call, covered[index], recomputed[index]) for index, call in calls if index in covered
        )
        met, outside = used_outside(losses, closed, replayed, params) if params else (True, None)
        # (checked once the walk met a recorded call: else the step fails for that)
        if met and outside is None:
            if len(self._outside_checked) >= _MAX_PATTERNS:  # (a model whose calls vary a lot)
                self._outside_checked.clear()
            self._outside_checked.add(pattern)
        if met and outside is not None:
            by = next((i for key, i in returned.items() if params.get(key) == outside), None)
            if by is not None:
                raise _returned_as_is(self._units[by], outside, self.batch_dim)
            raise ValueError(
                f"The parameter {outside} is used outside the forward calls of the hooked modules "
                "(e.g. a weight tied through a functional call, F.linear(h, "
                "embedding.weight), or an intermediate of the module kept and used later): "
                "the Gramian would miss that use. Use it through a module (e.g. an nn.Linear "
                "whose weight is the tied parameter), give the engine that module too, or "
                "freeze the parameter. If the losses also hold an earlier forward whose calls a "
                "step already took (a graph kept by retain_graph=True, or a second forward run "
                "before the step), run the forward again for each step instead. If the losses "
                "hold a derivative through the hooked modules (a gradient penalty: "
                "autograd.grad(..., create_graph=True) in the loss), the engine cannot take "
                "them: use jacflow.backward or jacflow.mtl_backward for such losses."
                + (f" {_COMPILED_BEFORE_HINT}" if _holds_compiled(pattern[1], ()) else "")
            )

    def _reaches_hooked_features(self, losses: Tensor, features: Sequence[Tensor]) -> bool:
        """Whether ``losses`` read one of the ``features`` computed from a hooked parameter:
        those that they cannot read without a recorded call of the hooked modules."""
        params = self._hooked_names()
        computed = [
            f for f in features if f.grad_fn is not None and _reaches_hooked(f.grad_fn, (), params)
        ]
        return _reaches(losses, computed)

    def _hooked_names(self) -> dict[int, str]:
        """The trainable hooked parameters' names, keyed by ``id`` (a tie: its first name);
        found once per step (``mtl_backward``'s checks and the step's ask for them)."""
        if self._step_names is not None and self._meeting_open:
            return self._step_names
        names: dict[int, str] = {}
        for unit in self._units:
            for key, param in unit.params().items():
                names.setdefault(id(param), f"{unit.name}.{key}")
        self._step_names = names if self._meeting_open else None
        return names

    def _reruns(self, index: int) -> bool:
        """Whether the unit's rule re-runs its module's own forward (the generic rule)."""
        return isinstance(self._units[index].rule, FallbackRule)

    def _checked_losses(self, losses: object) -> tuple[Tensor, Tensor]:
        """``losses`` checked, as given and with their batch first (see :func:`_check_losses`)."""
        if self._removed:
            raise RuntimeError("This Engine was removed; create a new one before the forward.")
        batch_first = _check_losses(losses, self.batch_dim, self._holds_samples)
        return cast(Tensor, losses), batch_first

    def _holds_samples(self, node: Any) -> bool:
        """Whether autograd's ``node`` reaches a hooked module's output or parameter."""
        calls = (call for _, call in self._recorder.calls)
        return _reaches_hooked(node, calls, self._hooked_names())

    def _rows(self, losses: Tensor) -> tuple[Rows, Tensor, tuple[Tensor, Tensor] | None]:
        """Row layout, backward cotangents and the row<->loss permutations."""
        m = losses.numel()
        device = losses.device
        if self.batch_dim is None:
            # the same few task counts come back every step: build their cotangents once
            # (autograd only reads them; built again where a hook or an autograd.Function at
            # the losses changed them in place)
            key = (losses.shape, losses.dtype, device)
            cached = self._per_task_rows.get(key)
            if cached is None or cached[1]._version:
                eye = torch.eye(m, dtype=losses.dtype, device=device).reshape(m, *losses.shape)
                if m == 1:
                    eye = eye[0]
                if len(self._per_task_rows) >= 8:  # (shapes that keep changing: stay small)
                    self._per_task_rows.clear()
                cached = self._per_task_rows[key] = (Rows(m, 1, None, per_task=True), eye)
            return cached[0], cached[1], None
        b = losses.shape[0]
        k = m // b
        if k == 1:
            return Rows(b, b, None, per_task=False), torch.ones_like(losses), None
        columns = torch.eye(k, dtype=losses.dtype, device=device)  # [k, k]
        cot = columns.unsqueeze(1).expand(k, b, k).reshape(k, *losses.shape)
        index = torch.arange(b, device=device).repeat(k)  # row r = c * B + i -> sample i
        r = torch.arange(m, device=device)
        loss_of_row = (r % b) * k + r // b
        row_of_loss = torch.empty_like(loss_of_row)
        row_of_loss[loss_of_row] = r
        return Rows(m, b, index, per_task=False), cot, (row_of_loss, loss_of_row)


def _rows_shaped(
    call_grads: list[Tensor | None], call: Call, rows: Rows, batch_dims: list[int | None]
) -> list[Tensor | None]:
    """Gradients of every row w.r.t. each output, ``[R, *sample_shape]`` (per sample: the
    output's batch dimension ``batch_dims[j]`` taken out); zeros for outputs that the losses do
    not reach (the call has at least one reached output)."""
    reference = next(g for g in call_grads if g is not None)
    shaped: list[Tensor | None] = []
    for grad, shape, dim in zip(call_grads, call.output_shapes, batch_dims, strict=True):
        if rows.per_task:
            sample_shape = shape
        elif dim is None:  # (no batch dimension: the rule's to lay out)
            shaped.append(grad)
            continue
        else:
            sample_shape = shape[:dim] + shape[dim + 1 :]
        if grad is None:
            shaped.append(reference.new_zeros(rows.num_rows, *sample_shape))
            continue
        if dim and not rows.per_task:  # the batch to the front ([k, ...]: after the k)
            extra = grad.ndim - len(shape)
            grad = grad.movedim(extra + dim, extra)
        target = (rows.num_rows, *sample_shape)
        # (usually already so: a reshape is a dispatch, the comparison is not)
        shaped.append(grad if grad.shape == target else grad.reshape(target))
    return shaped


def _check_strided_inputs(calls: list[tuple[Unit, Call]], batch_dim: int | None) -> None:
    """Refuse a nested (jagged) tensor given to a hooked module, and a sparse one given to a
    module with a closed-form rule: the rules reshape, index and stack the recorded tensors,
    which torch does not implement for them. (The generic rule re-runs the module on the
    sparse input as it was given, which is exact.)"""
    for unit, call in calls:
        for leaf, _ in call.versions:  # (the call's tensor inputs, flattened at the forward)
            nested = leaf.is_nested
            if not nested and (leaf.layout == torch.strided or isinstance(unit.rule, FallbackRule)):
                continue
            kind = "a nested (jagged) tensor" if nested else f"a sparse tensor ({leaf.layout})"
            dense = "pad the batch into a dense tensor" if nested else "pass x.to_dense()"
            # (jacflow.backward takes a sparse input's rows one by one by itself)
            chunks = ", parallel_chunk_size=1" if nested else ""
            raise ValueError(
                f"{unit.name} ({type(unit.module).__name__}) was given {kind} as input, which "
                f"the Engine (batch_dim={batch_dim}) cannot take apart by sample or task. "
                f"Give it a dense strided tensor ({dense}), or use jacflow.backward(...{chunks}), "
                "which differentiates the losses row by row."
            )


def _check_output_views(losses: Tensor, calls: list[tuple[Unit, Call]]) -> None:
    """An output that is a view, changed in place under autograd since the forward (``relu_``,
    ``+=``), gives its base new nodes, through which the gradient bypasses the recorded one:
    refused when the losses reach one of them. A change outside autograd (under ``no_grad``,
    through ``.detach()``) keeps the base's node but gives the view a new one on it, which
    bypasses the recorded node too where the losses were computed from the view after it. The
    engine holds the recorded views until the step, so that a change made after the caller
    freed the view is seen too; a stray forward's view changed so is left alone (the walk of
    the losses' graph that tells is made only then). An output that can be read at its base
    instead (a Linear's on sequences, an attention's: see ``OutputView``) is read there, below
    the new nodes."""
    new_nodes: dict[int, tuple[Unit, object]] = {}  # (one walk for all the changed views)
    for unit, call in calls:
        for output in call.output_views:
            base = output.view._base
            if base is None:
                continue
            # (a change outside autograd gives the view alone a new node, on its base's)
            changed_base = base.grad_fn is not output.base_node
            if not changed_base and output.view.grad_fn is output.node:
                continue
            if output.at_base is not None:  # (read below the new nodes)
                call.read_at_base(output.position, *output.at_base, output.view)
            elif changed_base:
                for node in _new_base_nodes(base.grad_fn, output.base_node):
                    new_nodes[id(node)] = (unit, node)
            elif _bypasses(node := output.view.grad_fn, output.node, base.grad_fn):
                new_nodes[id(node)] = (unit, node)
    if new_nodes:
        changed = first_reached(losses, new_nodes)
        if changed is not None:
            raise RuntimeError(
                f"An output of {changed.name} ({type(changed.module).__name__}) is a view (a "
                "transposed or reshaped tensor, or one made inside its forward: an nn.Linear "
                "on a sequence [..., T, d] returns its product reshaped, so a forward that ends "
                "in one returns a view) and was modified in place after the forward (relu_, "
                "+=, indexing assignment; or under no_grad or through .detach() before the "
                "losses used it): that takes the module's call out of the graph, so its "
                "gradients cannot be read. Use an out-of-place operation on it (torch.relu(x), "
                "x = x + y), or .clone() it first (at the end of the module's forward too)."
            )


# autograd's nodes of in-place view ops (transpose_, swapdims_, t_, unsqueeze_, squeeze_,
# as_strided_; the out-of-place ops' nodes end in 0, or 0-2 for squeeze)
_IN_PLACE_VIEW_NODES = frozenset(
    {
        "TransposeBackward1",
        "TBackward1",
        "UnsqueezeBackward1",
        "SqueezeBackward3",
        "SqueezeBackward4",
        "SqueezeBackward5",
        "AsStridedBackward1",
    }
)


def _check_hooks_under_view_ops(losses: Tensor, calls: list[tuple[Unit, Call]]) -> None:
    """Refuse a user's gradient hook on an output on which the losses' graph holds an in-place
    view op (``transpose_``, ``unsqueeze_``): the op keeps the output's hooks dict (which the
    engine opened) on the output's old node, so torch runs every hook there on the gradient in
    the old layout, also one registered after the op for the new layout (a size error, or
    with square shapes silently wrong values); plain autograd, with no hook before the op,
    gives that one the new layout. Which hooks came after the op is unknown. Multi-grad hooks
    only observe and are let through. The losses' graph is walked only when a hooked output
    has such hooks."""
    hooked: dict[tuple[int, int], Unit] = {}
    for unit, call in calls:
        for edge, hooks in zip(call.edges, call.output_hooks or [], strict=False):
            # (usually the engine's own hook alone: one length test)
            if len(hooks) > 1 and any(
                h is not no_hook and not multi_grad_hook(h) for h in hooks.values()
            ):
                hooked[(id(edge.node), edge.output_nr)] = unit
    if not hooked:
        return
    for node in graph_nodes(losses):
        following = node.next_functions
        if type(node).__name__ in _IN_PLACE_VIEW_NODES and following and following[0][0]:
            owner = hooked.get((id(following[0][0]), following[0][1]))
            if owner is not None:
                raise ValueError(
                    f"An output of {owner.name} ({type(owner.module).__name__}) carries a "
                    "gradient hook (register_hook) and an in-place view operation (transpose_, "
                    "unsqueeze_, ...) was applied to it after the forward: torch then runs the "
                    "hook on the gradient in the output's old layout, and the engine cannot "
                    "tell a hook registered before the operation from one registered after it. "
                    "Use the out-of-place operation (out = out.transpose(0, 1)), or register "
                    "the hook on a tensor computed from the output (out = out.view_as(out) "
                    "first)."
                )


# the most nodes followed from a view's node towards its base's
_MAX_VIEW_NODES = 64


def _bypasses(node: Any, recorded: Any, base_node: Any) -> bool:
    """Whether a view's current ``node`` leads to its base's node without the ``recorded`` one
    (a change outside autograd regenerated it; an in-place view op, ``transpose_``, stacks its
    node on the recorded one instead)."""
    for _ in range(_MAX_VIEW_NODES):
        if node is None or node is recorded:
            return False
        if node is base_node:
            return True
        node = node.next_functions[0][0] if node.next_functions else None
    return False


def _new_base_nodes(node: Any, recorded: Any) -> list[object]:
    """The nodes that in-place ops on a view gave its base since the forward, newest first:
    each one's first input is the base's node before it."""
    nodes: list[object] = []
    while node is not None and node is not recorded and all(node is not n for n in nodes):
        nodes.append(node)
        node = node.next_functions[0][0] if node.next_functions else None
    return nodes


def _returned_as_is(unit: Unit, param: str, batch_dim: int | None) -> ValueError:
    """The refusal of a unit that returns its parameter ``param`` (its full name) as it is."""
    own = param.removeprefix(f"{unit.name}.")
    way = (
        f"return it expanded to the batch of an input x that the module is given (e.g. "
        f"self.{own}.expand(x.shape[0], ...)), which the engine follows exactly"
        if batch_dim is not None
        else f"return it through an operation (e.g. self.{own}.expand(...) or self.{own} * 1)"
    )
    return ValueError(
        f"{unit.name} ({type(unit.module).__name__}) returns its parameter {own} as it is: no "
        "operation made that output, so the engine records no call of the module, and the "
        f"losses use {param} outside the hooked modules' calls (the Gramian would miss that "
        f"use). In its forward, {way}; or freeze the parameter."
    )


def _check_no_legacy_backward_hooks(unit: Unit) -> None:
    """PyTorch's older module backward hooks (``register_backward_hook``) change the gradients
    of the module's last node, its parameters' included, which a closed form does not see."""
    module = unit.module
    if backward_hooks(module)[1] or backward_hooks(None)[1]:
        raise ValueError(
            f"{unit.name} ({type(module).__name__}) has a module backward hook of the older "
            "kind (register_backward_hook, on it or on every module), which changes gradients "
            "that its closed form computes from the captured ones. Use "
            "register_full_backward_hook (deprecated by PyTorch for the older one), whose "
            "changes act on the module's inputs."
        )


def _check_no_output_hooks(unit: Unit, call: Call, grads: list[Tensor | None]) -> None:
    """The generic rule re-runs the module's forward under torch.func, which registers the
    hooks its forward registers again: a user's gradient hook on the module's own output
    would be run twice (or, registered later, not at all)."""
    for hooks, grad in zip(call.user_hooks(), grads, strict=True):
        # (torch's module trackers observe: the re-run's own calls are counted again)
        if any(not tracker_hook(h) for h in hooks) and grad is not None:
            raise ValueError(
                f"An output of {unit.name} ({type(unit.module).__name__}, which the engine "
                "re-runs with torch.func: no closed form covers it) carries a gradient hook "
                "(register_hook). The re-run cannot tell whether its forward registered it. "
                "Register the hook on a tensor computed from that output (e.g. "
                "out = out.view_as(out) first), or on one inside the module."
            )


def _check_settings(unit: Unit, call: Call, index: int, calls: Sequence[tuple[int, Call]]) -> None:
    """Refuse a call whose module's attributes that the closed form reads (``Rule.settings``:
    a convolution's stride, padding, ...) were changed since its forward: the rule would
    read the new ones, with the recorded tensors of the old (a shape error, or for a changed
    padding mode a wrong result, silently). ``calls``: the step's ``(unit index, call)``, of
    which another of the unit's (``index``) may have been made with the current attributes:
    the module was called with several settings in one forward (a convolution reused at two
    dilations), which no change before the forward allows."""
    now = unit.rule.settings(unit.module)
    if now == call.settings:
        return
    if any(i == index and other.settings == now for i, other in calls):
        raise ValueError(
            f"{unit.name} was called with different attributes that its closed form reads in "
            f"the losses' forward ({_changes(call.settings, now)}, changed between two calls): "
            "its rule reads the module's attributes once, at the step, so its calls must share "
            "them. Use one module per setting, or take one step (one forward) per setting."
        )
    raise ValueError(
        f"{unit.name}'s attributes that its closed form reads changed between its forward "
        f"and the step ({_changes(call.settings, now)}): the step would read the new ones "
        "with the tensors that the old ones made. Change them before the forward, or run "
        "the forward again after changing them."
    )


def _changes(before: object, after: object) -> str:
    """``before -> after``; for settings given as ``(name, value)`` pairs (as a convolution's),
    the changed ones only."""
    old, new = _named_pairs(before), _named_pairs(after)
    if old is None or new is None or [n for n, _ in old] != [n for n, _ in new]:
        return f"{before!r} -> {after!r}"
    return ", ".join(f"{n}: {v!r} -> {w!r}" for (n, v), (_, w) in zip(old, new) if v != w)


def _named_pairs(settings: object) -> list[tuple[str, object]] | None:
    if not isinstance(settings, tuple):
        return None
    pairs = [p for p in settings if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)]
    return pairs if len(pairs) == len(settings) else None


def _check_same_parameters(unit: Unit, call: Call) -> None:
    """A closed form writes the gradients of the module's parameters from what the forward
    read as them: refused when those were other tensors (``torch.func.functional_call``)."""
    if call.params_read is not None and not same_parameters(call.params_read, unit.module):
        raise ValueError(
            f"The forward call of {unit.name} ({type(unit.module).__name__}) read other tensors "
            "than its parameters as its weights (e.g. through torch.func.functional_call), or "
            "its parameters were replaced since: the engine computes the Jacobian with respect "
            "to the module's parameters from that call. Call the module itself, with its own "
            "parameters, or use jacflow.autojac for functional calls."
        )


def _check_versions(call: Call) -> None:
    for tensor, version in call.versions:
        if tensor._version != version:
            raise RuntimeError(
                "An input of a hooked module was modified in place after the forward; the "
                "Gramian needs it unchanged. Avoid in-place operations on it."
            )


def _sparse_rows(
    outside: tuple[object, ...],
    losses: Tensor,
    extra_inputs: Sequence[Tensor],
    selections: Sequence[Selection] | None,
) -> bool:
    """Whether an extra input whose rows are asked for one by one (``EACH``: an unhooked trunk
    parameter of ``mtl_backward``) gets a sparse gradient (``nn.Embedding(sparse=True)``),
    which the backward batched with vmap cannot form: the key ``outside`` (from
    :func:`outside_calls`) names such a node, and a walk of the losses' graph finds its sparse
    flag set."""
    if selections is None or SPARSE_GRADIENT_NODES.isdisjoint(outside):
        return False
    each = [t for t, rows in zip(extra_inputs, selections, strict=True) if rows == EACH]
    return bool(each) and sparse_gradients([losses], each)


def _runs_sparse(
    losses: Tensor, calls: Sequence[tuple[int, Call]], extra_inputs: Sequence[Tensor]
) -> bool:
    """Whether the backward from ``losses`` to the recorded calls' outputs and the
    ``extra_inputs`` runs an operation on sparse tensors (see ``sparse_on_paths``)."""
    targets = [edge.node for _, call in calls for edge in call.edges]
    targets += [get_gradient_edge(t).node for t in extra_inputs if t.requires_grad]
    return sparse_on_paths([losses.grad_fn], targets)


def _holds_compiled(outside: tuple[object, ...], edges: Sequence[Any]) -> bool:
    """Whether the losses' graph holds torch.compile'd code, around the recorded calls
    (``outside``, from :func:`outside_calls`) or as their outputs' nodes."""
    return COMPILED_NODE in outside or any(type(e.node).__name__ == COMPILED_NODE for e in edges)


@contextlib.contextmanager
def _compiled_backward_hint() -> Iterator[None]:
    """Name the way out of torch's refusal of a second backward through compiled code."""
    try:
        yield
    except RuntimeError as error:
        if "donated buffer" not in str(error):
            raise
        raise RuntimeError(
            "The losses' graph holds torch.compile'd code whose backward may run once only "
            "(donated buffers: inductor's at once, aot_eager's after a recompilation, e.g. at a "
            "smaller last batch), and this step pulls the losses back more than once (several "
            "rows per sample or several tasks: one backward per row) or keeps their graph "
            "(retain_graph=True, compute_gramian's default). Set "
            "torch._functorch.config.donated_buffer = False before compiling (or then call "
            "torch._dynamo.reset()), pass retain_graph=False to compute_gramian if the losses "
            "are not pulled back again, or compile without the modules given to the Engine."
        ) from error


@contextlib.contextmanager
def _reentrant_checkpoint_hint() -> Iterator[None]:
    """The engine's refusal of a reentrant activation checkpoint that its graph walk cannot
    see (inside a module under the generic rule), in place of torch's, which names a call of
    ``.grad()`` that the user did not make."""
    try:
        yield
    except RuntimeError as error:
        if "use_reentrant=True, torch.utils.checkpoint is incompatible" not in str(error):
            raise
        raise ValueError(_REENTRANT_REFUSAL) from error


@contextlib.contextmanager
def _selective_checkpoint_hint() -> Iterator[None]:
    """Name the way out of torch's refusal of a second backward through a region of selective
    activation checkpointing."""
    try:
        yield
    except RuntimeError as error:
        if SELECTIVE_CHECKPOINT_ERROR not in str(error):
            raise
        raise RuntimeError(
            "The losses' graph holds a region under selective activation checkpointing "
            "(torch.utils.checkpoint with context_fn=create_selective_checkpoint_contexts), "
            "whose backward torch runs once only, and this step pulls the losses back more "
            "than once: per sample, the first step of each pattern of calls and batch size "
            "checks the losses with 2 ceil(log2 B) more backwards; several rows per sample or "
            "several tasks pulled back one by one, and a graph kept (retain_graph=True, "
            "compute_gramian's default) and pulled back again, take one backward each. "
            "Checkpoint without `context_fn` (a plain checkpoint(..., use_reentrant=False) is "
            "exact), or, per task, pull the rows back in one backward batched with vmap."
        ) from error


def _at_outputs(call: Call, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
    """The gradients of ``call``'s edges in its outputs' shapes and layouts (an edge at an
    output's base has the base's), with any leading dimensions of rows kept."""
    at_outputs = list(grads)
    for i, view in call.base_views.items():
        grad = at_outputs[i]
        if grad is not None:
            at_outputs[i] = view.of(grad)
    return at_outputs


def _check_separable(
    losses: Tensor,
    calls: list[tuple[Unit, Call, list[int | None]]],
    num_samples: int,
    retain_graph: bool,
) -> bool:
    """Refuse a per-sample step in which the losses read a reached call's output at other
    samples than their own (see ``_separable``); else whether every probe gave a verdict
    (see :func:`leaks`). From probing backwards, one row by one (as
    the step's own, not under vmap), of the losses of the samples of each of
    :func:`probe_sets`. Each probe's gradients are checked and dropped before the next
    backward: held together, they took 2 ceil(log2 B) copies of the step's output gradients
    (the small CNN at B = 64: 190 MB at its first step against the step's 20). They free the
    graph unless ``retain_graph``."""
    probes = probe_sets(num_samples)
    if not probes:  # (one sample: nothing to mix)
        return True
    edges = [edge for _, call, _ in calls for edge in call.edges]
    conclusive = True
    cotangents = probe_cotangents(losses, probes)
    samples = [_row_samples(unit, call, dims, num_samples) for unit, call, dims in calls]
    for index, probe in enumerate(probes):
        keep = retain_graph or index < len(probes) - 1
        # (in a function: its gradients are freed when it returns, before the next backward;
        # held by this loop's variables, two probes' were alive at once)
        leak, sure = _probe_leak(
            losses, calls, edges, cotangents[index : index + 1], probe, keep, samples
        )
        if leak is not None:
            unit, call, position = leak
            raise _separation_error(unit, call, position, num_samples, losses)
        conclusive = conclusive and sure
    return conclusive


def _probe_leak(
    losses: Tensor,
    calls: list[tuple[Unit, Call, list[int | None]]],
    edges: list[Any],
    cotangent: Tensor,
    probe: list[int],
    keep: bool,
    samples: list[list[Tensor | None]],
) -> tuple[tuple[Unit, Call, int] | None, bool]:
    """The first ``(unit, call, output position)`` whose output the losses of ``probe``'s
    samples read at another sample (from one probing backward along ``cotangent``), or
    ``None``; and whether every output gave a verdict (see :func:`leaks`)."""
    with replaying(), _selective_checkpoint_hint():
        grads = pull_back([losses], edges, cotangent, True, keep, row_by_row=True)
    cursor, sure = 0, True
    for (unit, call, dims), call_samples in zip(calls, samples, strict=True):
        call_grads = _at_outputs(call, grads[cursor : cursor + len(call.edges)])
        cursor += len(call.edges)
        outputs = zip(call_grads, dims, call.output_positions, call_samples, strict=True)
        for rows, dim, position, known in outputs:
            if rows is None or (dim is None and known is None):
                continue
            verdict = leaks(rows[0], 0 if dim is None else dim, probe, known)
            if verdict:
                return (unit, call, position), sure
            sure = sure and verdict is not None
    return None, sure


def _row_samples(
    unit: Unit, call: Call, dims: list[int | None], num_samples: int
) -> list[Tensor | None]:
    """For each output of the call whose rows are not the batch (``dims``: ``None``), the
    sample of each row: the batch merged with positions (sample-major rows), or a packed
    sequence's data (its rule knows them, else ``None``); ``None`` for the others."""
    if call.merged > 1:
        merged = torch.arange(num_samples).repeat_interleave(call.merged)
        return [merged] * len(dims)
    return [
        unit.rule.output_samples(unit.module, call, position) if dim is None else None
        for dim, position in zip(dims, call.output_positions, strict=True)
    ]


def _separation_error(
    unit: Unit, call: Call, position: int, num_samples: int, losses: Tensor
) -> ValueError:
    if call.merged > 1:
        return _batch_mismatch(
            unit,
            num_samples,
            call.output_shapes[call.output_positions.index(position)],
            0,
            losses.shape,
            f"Read as the batch merged with {call.merged} positions, batch first "
            "([B, k, ...] flattened), its rows are read by the losses at other "
            "samples than their own: if it was flattened in another order ([k, B, "
            "...]), flatten it batch first. ",
        )
    shape = call.output_shapes[call.output_positions.index(position)]
    if call.batch_at:  # (see _sequence_first)
        cause = (
            f"Read as sequence first, with the batch on dimension {call.batch_at} (the only "
            "leading dimension of the batch's size), its rows are read by the losses at "
            "other samples than their own. Either that dimension is not the batch (position "
            "embeddings of ids shaped [1, T] with T == B): expand the input to the batch "
            "first (e.g. positions.expand(B, T))"
        )
    else:
        cause = (
            "Either its input has no batch dimension and a first size equal to the batch "
            "size (position embeddings of torch.arange(T) with T == B, a table kept as a "
            "buffer or a parameter): expand it to the batch first (e.g. "
            "positions.expand(B, T))"
        )
        if len(shape) > 2 and num_samples in shape[1:-1] and unit.rule.maps_rows(unit.module):
            cause += (
                "; or it is sequence first ([T, B, d]) with as many positions as samples, "
                "which its shape cannot tell from batch first (read so where T != B): "
                "transpose it to batch first ([B, T, d]) or pad the positions"
            )
    return ValueError(
        f"Per sample (batch_dim set), the losses read the output of {unit.name} "
        f"({type(unit.module).__name__}) at other samples than their own, so its "
        f"per-sample gradients are not those of one backward's rows. {cause}; or "
        "something after it mixes the samples (a loss over pairs of samples, a "
        "BatchNorm in training mode outside the Engine's modules, h - h.mean(0)). "
        "Use batch_dim=None for such models."
    )


def _merges_batch(size: int, batch: int) -> bool:
    """Whether a first size ``size`` may be the ``batch`` merged with positions (``k B``,
    ``k > 1``): the calls :func:`_merged_positions` may read so, and the probe's key flags."""
    return size > batch and size % batch == 0


def _merged_positions(
    unit: Unit,
    call: Call,
    rows: Rows,
    batch_dims: list[int | None],
    checked: bool,
    flattened: set[tuple[Any, int]],
) -> int:
    """``k`` where, per sample with one loss per sample, a module that maps rows one by one
    (:meth:`Rule.maps_rows`) was called on the batch merged with ``k > 1`` positions on
    dimension 0 (its input, computed by autograd, and every output ``[B k, ...]``, from
    ``x.view(-1, d)``), else 1.
    Such a call is read as one on ``[B, k, ...]``, batch first: the probe of the pattern's
    first step (``checked``: not for compiled code, which is not probed) refuses another order
    (:func:`_check_separable`)."""
    batch = rows.num_samples
    if rows.per_task or rows.index is not None or rows.num_rows != batch or not checked:
        return 1
    if any(d != 0 for d in batch_dims) or not unit.rule.maps_rows(unit.module):
        return 1
    firsts = {shape[0] if len(shape) > 1 else 0 for shape in call.output_shapes}
    if len(firsts) != 1:
        return 1
    size = firsts.pop()
    # (the input as the rules read it, Call.input: passed by keyword too, layer(input=h))
    x = call.first_argument()
    if not _merges_batch(size, batch) or not isinstance(x, Tensor):
        return 1
    # (not a leaf: a table kept as a parameter or a buffer, whose rows the losses may pick by
    # labels, which the probe of one step cannot rule out; nor the data itself, flattened)
    if x.grad_fn is None or x.dim() < 2 or x.shape[0] != size:
        return 1
    # (rows of tokens selected by a mask or index, unpadded as for variable-length attention,
    # are a sample's in numbers that change with the data: a first step of equal lengths
    # passes the probe and later steps would be wrong; only a flatten is read so. One
    # sample's rows are all its own)
    if batch > 1 and not _flattened_rows(x, size, flattened):
        return 1
    # (a norm over every dimension, dimension 0 included, normalises across the rows)
    normalized = getattr(unit.module, "normalized_shape", None)
    if isinstance(unit.module, (nn.LayerNorm, nn.RMSNorm)) and len(normalized or ()) >= x.dim():
        return 1
    return size // batch


# (autograd nodes of a view or reshape: a flatten of [B, k, ...] into [B k, ...])
_FLATTEN_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
# (autograd nodes that select rows of another tensor by a mask or an index)
_ROW_SELECT_NODES = frozenset(
    {
        "IndexBackward0",
        "IndexSelectBackward0",
        "MaskedSelectBackward0",
        "GatherBackward0",
        "TakeBackward0",
        "PackPaddedSequenceBackward0",
    }
)
# (autograd nodes that may move rows along dimension 0 by an index, a mask, a shift or a
# stride, as many in as out: a reordering decided by the data, which the probe of one step
# cannot rule out; followed only where they act on another dimension, see _moves_rows)
_ROW_MOVE_NODES = frozenset(
    {
        *_ROW_SELECT_NODES,
        "SortBackward0",
        "RollBackward0",
        "FlipBackward0",
        "ScatterBackward0",
        "ScatterAddBackward0",
        "ScatterReduceBackward0",
        "IndexCopyBackward0",
        "IndexAddBackward0",
        "IndexPutBackward0",
        "IndexFillBackward0",
        "MaskedScatterBackward0",
        "AsStridedBackward0",
        "CopySlices",
        "CummaxBackward0",
        "CumminBackward0",
    }
)
_MAX_ROWS_WALK = 4096


def _moves_rows(node: Any, name: str, dims: int) -> bool:
    """Whether autograd's ``node`` (a ``name`` of :data:`_ROW_MOVE_NODES`, on inputs of
    ``dims`` dimensions) may move entries along dimension 0 (other than by its dimension
    saved: ``h[:, i]``, ``h.flip(-1)``, ``h.sort(-1)`` keep each row's)."""
    if name in ("IndexBackward0", "IndexPutBackward0"):
        indices = getattr(node, "_saved_indices", None)
        return not indices or indices[0] is not None
    saved = getattr(node, "_saved_dims", None)
    if saved is None:
        saved = getattr(node, "_saved_dim", None)
        saved = None if saved is None else (saved,)
    if not saved or dims == 0:  # (none saved, or a roll over the flattened entries)
        return True
    return any(_signed(dim) % dims == 0 for dim in saved)


def _flattened_rows(x: Tensor, size: int, flattened: set[tuple[Any, int]]) -> bool:
    """Whether the ``size`` rows of ``x`` come, through operations that keep them (each
    operation's input of as many rows followed back; a view that splits them, as a Linear's
    on ``[B k, S, d]`` does, followed on the finer rows), from a view or reshape of a tensor
    of fewer rows that divide ``size`` (``h.view(-1, d)`` of ``[B, T, d]``, or another order,
    which the probe checks), met before any selection of rows of a tensor of another number
    of rows (``h[mask]``: tokens unpadded, a sample's in numbers that change with the data).
    ``flattened``: the step's inputs found so, where a walk from a later call's stops (calls
    chained on the flattened tokens: each walk short)."""
    todo: list[tuple[Any, int]] = [(x.grad_fn, size)]
    seen: set[tuple[Any, int]] = set()
    found = False  # (every path walked: a selection or a reordering on any refuses)
    while todo:
        node, rows = todo.pop()
        if node is None or (node, rows) in seen:
            continue
        if (node, rows) in flattened:
            found = True
            continue
        seen.add((node, rows))
        if len(seen) > _MAX_ROWS_WALK:
            return False
        name = type(node).__name__
        for following, index in node.next_functions:
            if following is None:
                continue
            try:
                shape = following._input_metadata[index].shape
            except (AttributeError, IndexError, RuntimeError):
                continue
            if len(shape) == 0:
                continue
            if name in _ROW_MOVE_NODES and _moves_rows(node, name, len(shape)):
                return False
            if shape[0] == rows:
                todo.append((following, rows))
            elif name in _FLATTEN_NODES and shape[0] < size and size % shape[0] == 0:
                found = True  # (a flatten, not followed further)
            elif name in _FLATTEN_NODES and shape[0] > rows and shape[0] % rows == 0:
                todo.append((following, shape[0]))
            elif name in _FLATTEN_NODES and rows > size and shape[0] == size:
                todo.append((following, size))
    if found:
        flattened.add((x.grad_fn, size))
    return found


def _batch_first_call(call: Call, rows: Rows) -> Call:
    """``call`` as its rule reads it, batch first: a merged call (:func:`_merged_positions`) as
    one on ``[B, k, ...]``, its input and its rows' output gradients (``[B k, ...]``, one row
    per sample) with the batch taken apart from the positions; a sequence-first call
    (:func:`_sequence_first`) with its input's batch moved first (its gradients are, by
    :func:`_rows_shaped`); any other call as it is."""
    if call.merged > 1:
        batch, k = rows.num_samples, call.merged
        x = call.input()
        x = x.reshape(batch, k, *x.shape[1:])
        grads = [None if g is None else g.reshape(batch, k, *g.shape[1:]) for g in call.grads]
        return _with_input(call, x, grads=grads, merged=1)
    if call.batch_at:
        return _with_input(call, call.input().movedim(call.batch_at, 0), batch_at=0)
    return call


def _with_input(call: Call, x: Tensor, **changes: Any) -> Call:
    """``call`` with ``x`` as its input (and ``changes`` to its other fields)."""
    if call.args:
        args, kwargs = (x, *call.args[1:]), call.kwargs
    else:  # (passed by keyword: Call.input reads the first)
        args, kwargs = call.args, {**call.kwargs, next(iter(call.kwargs)): x}
    return dataclasses.replace(call, args=args, kwargs=kwargs, **changes)


def _sequence_first(
    unit: Unit, call: Call, rows: Rows, at: int, buffer_ids: Callable[[], set[int]]
) -> int | None:
    """Per sample, ``at`` where the batch lies on dimension ``at > 0`` (the only leading
    dimension of its size, see :func:`_batch_elsewhere`) of the one output of a call of a
    module that maps rows one by one (:meth:`Rule.maps_rows`: a Linear, a LayerNorm over the
    last dimensions, an Embedding) on a sequence-first input (``[T, B, d]``, as
    ``nn.Transformer``'s layers by default), and on its input alike, which is not a table
    kept as a parameter or a buffer (whose rows the losses may pick by labels, which the probe
    of one step cannot rule out) and not normalised over that dimension. ``None`` otherwise
    (then dimension 0 is read: a batch elsewhere with ``T = B`` is refused by the probe).
    Only where the probe runs (not for compiled code), which alone tells a sequence-first call
    from one whose dimension ``at`` has the batch's size by chance (position embeddings of
    ``[1, T]`` ids with ``T = B``)."""
    if rows.per_task or not unit.rule.maps_rows(unit.module):
        return None
    x = call.first_argument()
    (shape,) = call.output_shapes
    # (an Embedding's ids have one dimension less than its output)
    if not isinstance(x, Tensor) or x.dim() <= at or x.shape[: at + 1] != shape[: at + 1]:
        return None
    normalized = getattr(unit.module, "normalized_shape", None)
    if normalized is not None and len(normalized) >= x.dim() - at:
        return None
    if isinstance(x, nn.Parameter) or id(x) in buffer_ids():  # (``buffer_ids``: the modules')
        return None
    return at


def _batch_elsewhere(shape: torch.Size, batch: int) -> int | None:
    """The only leading dimension ``d > 0`` of ``shape`` (not its last) of size ``batch``,
    where dimension 0 is not of that size; else ``None``: the calls :func:`_sequence_first`
    may read so, and the probe's key holds."""
    if len(shape) < 3 or shape[0] == batch:
        return None
    found = [d for d in range(1, len(shape) - 1) if shape[d] == batch]
    return found[0] if len(found) == 1 else None


def _check_batch(
    unit: Unit,
    call: Call,
    rows: Rows,
    batch_dims: list[int | None],
    losses_shape: torch.Size,
    grads: Sequence[Tensor | None],
) -> None:
    """Refuse an output of ``call`` without the losses' batch on its batch dimension, but one
    that the losses do not read (``grads``: ``None``), as an auxiliary statistic of the batch
    returned with the output: it adds nothing to the rows' gradients, and a rule is handed
    zeros for it. The generic rule re-runs the module sample by sample, whose outputs must
    then follow the batch too, but for a 0-d one (a loss term), whose re-run is not compared
    with the forward's."""
    if rows.per_task:
        return
    batch = rows.num_samples
    generic = isinstance(unit.rule, FallbackRule)
    for shape, dim, grad in zip(call.output_shapes, batch_dims, grads, strict=True):
        if dim is None or (len(shape) > dim and shape[dim] == batch):
            continue
        if grad is None and not (generic and shape):
            continue
        if grad is None:
            raise ValueError(
                f"Per sample (batch_dim set), the outputs of {unit.name} "
                f"({type(unit.module).__name__}) must have the batch size {batch} on dimension "
                f"{dim}, received shape "
                f"{tuple(shape)} for an output that the losses do not read. The module has no "
                "closed form: the engine re-runs it sample by sample, and every output of the "
                "re-run must follow the batch (but a 0-d one). Return that output detached "
                "(out.detach(): it is then not recorded) or compute it outside the module, or "
                "use batch_dim=None."
            )
        raise _batch_mismatch(unit, batch, shape, dim, losses_shape)


def _batch_mismatch(
    unit: Unit, batch: int, shape: torch.Size, dim: int, losses_shape: torch.Size, read: str = ""
) -> ValueError:
    """The refusal of an output of ``unit`` whose dimension ``dim`` is not the losses' batch
    (``read``: how the engine read it, where it tried)."""
    # (the common causes that the shapes point at, as conditions: they may coincide)
    hints = ""
    size = shape[dim] if len(shape) > dim else 0
    if _merges_batch(size, batch):
        hints += (
            f"If its input merges the batch with other dimensions ({size} = {batch} x "
            f"{size // batch}: a layer called on flattened tokens, x.view(-1, d), as a "
            "language model's head often is), call it on the unflattened input "
            "([B, T, d]), which is exact. (A Linear, a Conv1D, a LayerNorm or an RMSNorm on "
            "tokens flattened batch first is read so by itself, with one loss per sample, "
            "where autograd computed its input, not the data itself, a parameter or a "
            "buffer, from a flatten, not from rows selected by a mask or an index (tokens "
            "unpadded), and no torch.compile'd code lies between it and the losses, whose "
            "backward the engine cannot probe for the order.) "
        )
    if size == 1:
        hints += (
            "Its output has size 1 there: if that is broadcast over the batch later "
            "(position embeddings of positions shaped [1, T], as Hugging Face models such as "
            "BERT and GPT-2 build when no position_ids are given), pass the positions "
            "expanded to the batch (position_ids=torch.arange(T).expand(B, T)), which is "
            "exact; if it is one row of the batch selected by a mask or an index, see the "
            "subsets below. "
        )
    # (the generic rule reads the batch on dimension 0 of any module's outputs)
    elsewhere = [k for k, n in enumerate(shape) if n == batch and k != dim]
    if elsewhere and isinstance(unit.rule, FallbackRule):
        hints += (
            f"If the batch is on dimension {elsewhere[0]} of that output, the generic rule "
            f"reads it on dimension {dim} of the module's outputs: return it batch first and "
            "transpose it after the call (e.g. a recurrent layer's learned initial state "
            "returned as [B, num_layers, H] and transposed by the caller). "
        )
    elif elsewhere and dim == 0 and unit.rule.maps_rows(unit.module):
        hints += (
            f"If the batch is on dimension {elsewhere[0]} of that output (sequence first, "
            "[T, B, d]), the engine reads it there by itself where that is the only leading "
            "dimension of the batch's size, dimension 0 is not, the input is not a parameter "
            "or a buffer, and no torch.compile'd code "
            "lies between it and the losses, whose backward the engine cannot probe for the "
            "order; else transpose it to batch first ([B, T, d]), which is exact. "
        )
    return ValueError(
        f"Per sample, dimension batch_dim of `losses` is the batch (shape "
        f"{tuple(losses_shape)} with it first): the outputs of {unit.name} "
        f"({type(unit.module).__name__}) must have its batch size {batch} on dimension {dim}, "
        f"received shape {tuple(shape)}. {read}If `losses` are laid out otherwise ([k, B] "
        "with batch_dim=0: pass batch_dim=1), or are not per sample (sliced, as losses[:3]; "
        "reduced over the batch, as out.mean(0)), pass the per-sample losses and select or "
        f"weight them in the weighting (a GramianWeighting of your own). {hints}Expand a "
        "tensor without the batch dimension to the batch before the call (e.g. "
        "positions.expand(B, T)), or use "
        "batch_dim=None for modules that do not batch there. If the module was called on "
        "several batches whose losses are concatenated, call it once on the concatenated "
        "inputs (or use batch_dim=None). If it was called on a subset of the batch's rows "
        "(routing to experts or clusters, x[mask], AdaptiveLogSoftmaxWithLoss), the "
        "per-sample engine cannot tell the rows' samples: use batch_dim=None."
    )


def _assemble(
    contributions: list[tuple[dict[str, Tensor], Contribution]], rows: Rows, losses: Tensor
) -> Tensor:
    """Sum the contributions; parameters shared between units are combined exactly."""
    owners: dict[int, list[tuple[Contribution, str]]] = {}
    for params, contribution in contributions:
        for name, param in params.items():
            owners.setdefault(id(param), []).append((contribution, name))
    shared = {key for key, users in owners.items() if len(users) > 1}
    total: Tensor | None = None
    for params, contribution in contributions:
        names = {n for n, p in params.items() if id(p) not in shared}
        term = contribution.gramian(names)
        if term is not None:
            total = term if total is None else total + term
    for key in shared:
        summed = sum(c.per_row_grads(n).reshape(rows.num_rows, -1) for c, n in owners[key])
        assert isinstance(summed, Tensor)
        term = row_gramian(summed)
        total = term if total is None else total + term
    if total is None:  # every hooked parameter is frozen
        return losses.new_zeros(rows.num_rows, rows.num_rows)
    return total


def _in_range(exact: Tensor) -> bool:
    """Whether the float64 Gramian is finite and not zero: otherwise the gradients themselves
    are non-finite or zero, and the Gramian as formed gives the same weights."""
    peak = float(exact.abs().amax())
    return 0 < peak < math.inf


_CHUNK = 1 << 22  # elements of a per-row gradient converted to float64 at once


def _gramian_in_float64(
    contributions: list[tuple[dict[str, Tensor], Contribution]],
    rows: Rows,
    order: tuple[Tensor, Tensor] | None,
    trunk_rows: Sequence[Tensor | None],
    like: Tensor,
) -> Tensor:
    """The Gramian in float64 (on ``like``'s device), in the losses' order, from each
    parameter's per-row gradients (finite where the lower-precision products overflowed, and
    with their digits where those underflowed), one parameter and a few columns at a time.
    Slow: materialises the per-row gradients; only for a Gramian out of range."""
    owners: dict[int, list[tuple[Contribution, str]]] = {}
    for params, contribution in contributions:
        for name, param in params.items():
            owners.setdefault(id(param), []).append((contribution, name))
    num_rows = rows.num_rows
    total: Tensor | None = None
    for users in owners.values():
        grads = [c.per_row_grads(n).reshape(num_rows, -1) for c, n in users]
        step = max(1, _CHUNK // max(1, num_rows))
        for start in range(0, grads[0].shape[1], step):
            block = sum(g[:, start : start + step].double() for g in grads)
            assert isinstance(block, Tensor)
            term = row_gramian(block)
            total = term if total is None else total + term
    if total is None:  # (every hooked parameter frozen)
        total = like.new_zeros(num_rows, num_rows, dtype=torch.float64)
    total = _to_loss_order(total, order)
    present = [r.reshape(r.shape[0], -1).double() for r in trunk_rows if r is not None]
    return total + row_gramian(torch.cat(present, dim=1)) if present else total


def _in_usual_dtype(weights: Tensor, dtype: torch.dtype) -> Tensor:
    """``weights`` in the Gramian's usual ``dtype``, whatever the weighting returned."""
    return weights if weights.dtype == dtype else weights.to(dtype)


def _reads_gramian(weighting: GramianWeighting) -> bool:
    """Whether ``weighting``'s call reads the Gramian's values: its
    :attr:`~jacflow.aggregation.GramianWeighting.reads_gramian`, or a forward hook or pre-hook
    that runs with it (it may read them)."""
    return weighting.reads_gramian or runs_forward_hooks(weighting)


def _usable(exact: Tensor, weighting: GramianWeighting, dtype: torch.dtype) -> Tensor:
    """What ``weighting`` gets of the exact Gramian: a scale-invariant one gets it scaled by a
    power of two to a largest entry in [1/2, 1), in ``dtype`` (the weights at scale 1); one
    that reads the scale gets it in float64, as ``jacflow.backward`` gives it."""
    if weighting.scale_invariant:
        return (exact * unit_peak_factor([exact])).to(dtype)
    return exact


def step_meeting(engine: Engine) -> contextlib.AbstractContextManager[Meetings | None]:
    """The meetings of ``engine``'s next step, opened by a caller whose own checks come first
    (``mtl_backward``): under DDP, a failure there is then announced to the other replicas."""
    return engine._meeting()


def _checked_ddp(ddp: object, modules: Sequence[nn.Module]) -> DistributedDataParallel:
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(
            "`ddp` must be the torch.nn.parallel.DistributedDataParallel wrapping the model, "
            f"or None; received {type(ddp).__name__}."
        )
    check_wrapped(modules, ddp)
    return ddp


def _parameter_list(params: Iterable[Tensor], name: str) -> list[Tensor]:
    """The trainable tensors of ``params``, each once; a clear error for anything but leaf
    tensors."""
    if isinstance(params, (Tensor, nn.Module)):
        raise TypeError(
            f"`{name}` must be an iterable of parameters (e.g. `head.parameters()`), received "
            f"a {type(params).__name__}."
        )
    unique: dict[int, Tensor] = {}
    for param in params:
        if not isinstance(param, Tensor):
            hint = (
                " (pass its .parameters())"
                if isinstance(param, nn.Module)
                else " (one flat iterable: chain the lists, [p for ps in lists for p in ps])"
                if isinstance(param, (list, tuple)) or inspect.isgenerator(param)
                else ""
            )
            raise TypeError(
                f"`{name}` must hold tensors (parameters), received a {type(param).__name__}{hint}."
            )
        if not param.is_leaf:
            raise ValueError(
                f"`{name}` must hold leaf tensors (parameters), whose .grad the step writes; "
                f"received a tensor computed by {type(param.grad_fn).__name__}. Pass the "
                "parameters it is computed from."
            )
        if param.requires_grad:
            unique.setdefault(id(param), param)
    return list(unique.values())


def _reaches(losses: Tensor, tensors: Sequence[Tensor]) -> bool:
    """Whether ``losses`` depend on any of ``tensors`` (a walk of their graph)."""
    nodes = (get_gradient_edge(t).node for t in tensors)
    return first_reached(losses, {id(node): (True, node) for node in nodes}) is not None


# (mtl_backward's features: one computed from a hooked parameter outside the modules' calls)
_PARAMETER_FEATURE_HINT = (
    "If a feature is computed from a parameter of the hooked modules outside their calls "
    "(a slice of a weight, `features=[h, layer.weight[0]]`), the losses read that parameter "
    "where the engine cannot see it: pass the modules' outputs as features, or step without "
    "the engine."
)


def _functional_use_hint(name: str) -> str:
    """The hint of a step whose losses read the hooked parameter ``name`` but no hooked call:
    a use that the engine cannot see, unless the forward was taken by an earlier step."""
    return (
        f"The losses read the hooked parameter {name}. Unless an earlier step took this "
        "forward's calls (see above), they read it outside its module's forward (a "
        "functional call on it in another module's forward, as F.conv2d(x, conv.weight) or "
        "F.linear(x, layer.weight)), a use that is not recorded: call the module itself "
        "(conv(x)), or give the Engine a module with parameters of its own that makes the "
        "call (its generic rule covers the uses inside its forward)."
    )


def _hooked_param_reached(losses: Tensor, params: dict[int, str]) -> str | None:
    """The name of a hooked parameter (``params``: by ``id``) that ``losses`` depend on, if
    any (a walk of their graph)."""
    if losses.grad_fn is None:
        return None
    for node in graph_nodes(losses):
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in params:
            return params[id(variable)]
    return None


def _with_rows(gramian: Tensor, rows: Sequence[Tensor | None]) -> Tensor:
    """``gramian`` plus that of the Jacobian whose columns are ``rows`` (``[m, *shape]`` each,
    ``None`` where no loss reaches the parameter)."""
    present = [r.reshape(r.shape[0], -1).to(gramian.dtype) for r in rows if r is not None]
    if not present:
        return gramian
    return gramian + row_gramian(torch.cat(present, dim=1))


def _row_updates(
    params: Sequence[Tensor], rows: Sequence[Tensor | None], weights: Tensor
) -> list[tuple[Tensor, Tensor]]:
    """``w @ J`` for each parameter given with its rows; none for one that no loss reaches
    (its ``.grad`` is left as it is, as by torch's backward)."""
    return [
        (param, torch.tensordot(weights.to(grads.dtype), grads, dims=1))
        for param, grads in zip(params, rows, strict=True)
        if grads is not None
    ]


def _in_given_order(
    order: tuple[Tensor, Tensor] | None, losses: Tensor, batch_dim: int | None
) -> tuple[Tensor, Tensor] | None:
    """The row<->loss permutations ``order`` of the losses with their batch moved first (see
    :func:`_check_losses`) made those of ``losses`` as given, whose flattened order the Gramian
    and the weights follow, as TorchJD's do."""
    if batch_dim is None or batch_dim % losses.ndim == 0:
        return order
    index = torch.arange(losses.numel(), device=losses.device)
    given_of_moved = index.reshape(losses.shape).movedim(batch_dim, 0).reshape(-1)
    moved_of_given = torch.empty_like(given_of_moved)
    moved_of_given[given_of_moved] = index
    if order is None:
        return moved_of_given, given_of_moved
    row_of_loss, loss_of_row = order
    return row_of_loss[moved_of_given], given_of_moved[loss_of_row]


def _to_loss_order(gramian: Tensor, order: tuple[Tensor, Tensor] | None) -> Tensor:
    if order is None:
        return gramian
    row_of_loss = order[0]
    return gramian[row_of_loss][:, row_of_loss]


def _own_generic_params(
    units: Sequence[Unit], calls: Sequence[tuple[int, Call]]
) -> dict[int, dict[str, Tensor]]:
    """The trainable parameters of the generic-rule units called (by unit index), where none
    is another unit's too (a tie): the losses reach them through the unit's calls only (a use
    outside the hooked calls is refused), so the gradient of the rows' sum w.r.t. them is the
    sum of the rows' gradients that the rule re-runs the module for. Not those of a unit whose
    weights changed since one of its calls: the rule refuses that, where the backward through
    the module would fail on its saved weights."""
    called: dict[int, list[Call]] = {}
    for index, call in calls:
        called.setdefault(index, []).append(call)
    generic = [
        i
        for i, unit_calls in called.items()
        if isinstance(units[i].rule, FallbackRule) and _weights_as_called(units[i], unit_calls)
    ]
    if not generic:
        return {}
    seen: dict[int, int] = {}
    for unit in units:
        for param in unit.params().values():
            seen[id(param)] = seen.get(id(param), 0) + 1
    found = {i: units[i].params() for i in generic}
    return {
        i: params
        for i, params in found.items()
        if params and all(seen[id(p)] == 1 for p in params.values())
    }


def _weights_as_called(unit: Unit, calls: Sequence[Call]) -> bool:
    """Whether the module's parameters are those, at the versions, that each of its ``calls``
    (of a replaying rule, which records them) left."""
    now = list(unit.module.parameters())
    return all(
        len(now) == len(call.weight_versions)
        and all(p is q and p._version == v for p, (q, v) in zip(now, call.weight_versions))
        for call in calls
    )


def _by_unit(
    params: dict[int, dict[str, Tensor]], grads: Sequence[Tensor | None]
) -> dict[int, dict[str, Tensor | None]]:
    """``grads`` (one per parameter of ``params``, in order) as ``params`` is laid out."""
    found = iter(grads)
    return {index: {name: next(found) for name in named} for index, named in params.items()}


def _reached_params(params: dict[str, Tensor], calls: list[Call]) -> dict[str, Tensor]:
    """``params`` (a generic-rule unit's) but those that the losses do not reach: one its
    forward did not use (a branch not taken), or used without grad. Autograd leaves their
    ``.grad`` as it is, where the re-run would give zeros. The losses reach a parameter only
    through its calls' outputs (another use is refused), so the walk starts from their reached
    outputs; which parameters a forward uses may change with its inputs, so it runs at every
    step. (The closed forms' calls use all their parameters.)"""
    starts = [
        edge.node
        for call in calls
        for edge, hit in zip(call.edges, call.reached, strict=True)
        if hit
    ]
    # (not past the outermost calls' inputs: the earlier network is not the module's; the
    # inputs of a call nested in another are inside that one)
    stops = {  # (holding the nodes: a node's Python object can die and its id be reused)
        id(node): node
        for call in calls
        if not call.nested
        for t, _ in call.versions
        if (node := t.grad_fn) is not None
    }
    unused = unreached(starts, {id(p): p for p in params.values()}, stops)
    return {name: p for name, p in params.items() if id(p) not in unused} if unused else params


def _weighted_grads(
    contributions: list[tuple[dict[str, Tensor], Contribution]],
    weights: Tensor,
    buffers: GradientBuffers | None,
) -> list[tuple[Tensor, Tensor]]:
    """The updates, the large ones written into the engine's reusable buffers where the
    contribution can. A tied parameter's buffer goes to its first contribution only, so that
    it stays the reusable one (the others are fresh tensors added to it; a second ``take``
    would also see the buffer in use and allocate another)."""
    updates = []
    served: dict[int, Tensor] = {}  # id(param) -> its buffer, taken for one contribution

    for params, contribution in contributions:

        def buffer_for(
            name: str, dtype: torch.dtype, params: dict[str, Tensor] = params
        ) -> Tensor | None:
            param = params[name]
            if buffers is None or id(param) in served or param.dtype != dtype:
                return None
            buffer = buffers.take(param)
            if buffer is not None:
                served[id(param)] = buffer
            return buffer

        for name, grad in contribution.weighted_grads_into(weights, buffer_for).items():
            param = params[name]
            if grad is served.get(id(param)):
                grad = GradientBuffers.as_grad(grad, param)
            updates.append((param, grad))
    if buffers is not None:
        buffers.keep_only(p for params, _ in contributions for p in params.values())
    return updates


def _as_update(param: Tensor, grad: Tensor) -> Tensor:
    """``grad`` in the dtype of ``param``'s gradient (:func:`grad_dtype`: its ``grad_dtype``
    where set, as torch's backward writes it and its ``.grad`` setter requires) and in its
    shape (each conversion only when needed: it costs a dispatch per parameter)."""
    dtype = grad_dtype(param)
    if grad.dtype != dtype:
        grad = grad.to(dtype)
    if not grad.is_sparse and grad.shape != param.shape:
        grad = grad.reshape(param.shape)
    return grad


def _sparse_sums(
    updates: list[tuple[Tensor, Tensor]], written: list[tuple[Tensor, Tensor]]
) -> dict[int, Tensor]:
    """The new ``.grad`` of each parameter of ``updates`` with a sparse side (a piece, or the
    ``.grad`` it is added to, ``written``'s where it replaces it): the sum of its ``.grad``
    and its pieces in order, out of place."""
    current = {id(param): param.grad for param, _ in updates}
    current.update((id(param), grad) for param, grad in written)
    sparse = {id(p) for p, g in updates if g.is_sparse or _is_sparse(current[id(p)])}
    sums: dict[int, Tensor] = {}
    for param, grad in updates:
        if id(param) in sparse:
            total = sums.get(id(param), current[id(param)])
            sums[id(param)] = laid_out(grad, param) if total is None else added(total, grad)
    return sums


def _is_sparse(grad: Tensor | None) -> bool:
    return grad is not None and grad.is_sparse


def _through_param_hooks(updates: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
    """Each parameter with gradient hooks (``p.register_hook``, e.g. a pruning mask) gets one
    update, the sum of its pieces (a tie's), passed through its hooks in order: as autograd
    passes the gradient of ``weights @ losses`` through them."""
    if not any(param._backward_hooks for param, _ in updates):
        return updates
    pieces: dict[int, tuple[Tensor, Tensor]] = {}
    plain: list[tuple[Tensor, Tensor]] = []
    for param, grad in updates:
        if not param._backward_hooks:
            plain.append((param, grad))
            continue
        grad = _as_update(param, grad)
        if id(param) in pieces:
            grad = added(pieces[id(param)][1], grad)
        pieces[id(param)] = (param, grad)
    for param, grad in pieces.values():
        for hook in list((param._backward_hooks or {}).values()):
            result = hook(grad)
            if result is not None:
                _check_hook_result(hook, grad, result)
                grad = result
        # (a hook may keep the tensor it saw or return one held elsewhere: as autograd does
        # for a gradient referred to elsewhere, .grad gets a copy)
        plain.append((param, grad.clone()))
    return plain


def _check_update_sizes(updates: list[tuple[Tensor, Tensor]]) -> None:
    """Refuse, before anything is written, a gradient that does not fit its parameter (what a
    gradient hook of a task or other parameter returned: autograd checks it on the tensor it
    ran on, not against the parameter)."""
    for param, grad in updates:
        if grad.shape != param.shape and (grad.is_sparse or grad.numel() != param.numel()):
            raise ValueError(
                f"A gradient of shape {tuple(grad.shape)} was computed for a parameter of shape "
                f"{tuple(param.shape)}: a gradient hook (register_hook) must return None or a "
                "tensor like its argument."
            )


def _check_hook_result(hook: Any, grad: Tensor, result: Any) -> None:
    """Refuse what autograd refuses from a gradient hook: another type, shape or dtype."""
    same = isinstance(result, Tensor) and (
        result.shape,
        result.dtype,
        result.device,
        result.is_sparse,
    ) == (grad.shape, grad.dtype, grad.device, grad.is_sparse)
    if not same:
        received = _described(result) if isinstance(result, Tensor) else type(result).__name__
        raise ValueError(
            f"The gradient hook {getattr(hook, '__name__', hook)!r} of a parameter returned "
            f"{received} for a gradient of {_described(grad)}: a hook must return None or a "
            "tensor like its argument (shape, dtype, device, layout), as in autograd."
        )


def _described(t: Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}{' (sparse)' if t.is_sparse else ''}"


def _accumulate(
    updates: list[tuple[Tensor, Tensor]], written: list[tuple[Tensor, Tensor]], reached: set[int]
) -> None:
    """Write last: ``.grad`` is untouched if anything before failed. ``updates`` are added to
    ``.grad``, ``written`` (the replicas' averages under DDP) replace it. Then the
    post-accumulate hooks (``register_post_accumulate_grad_hook``) of the parameters this
    step ``reached`` run, once each (under DDP, not those of a parameter that only another
    replica's losses reached: autograd would not have accumulated into it here)."""
    with torch.no_grad():
        # (every conversion before the first write: the `.grad` setter then refuses none)
        written = [(param, _as_update(param, grad)) for param, grad in written]
        updates = [(param, _as_update(param, grad)) for param, grad in updates]
        # (and the new .grad of every parameter with a sparse side, out of place: a sum that
        # fails writes nothing)
        sparse_sums = _sparse_sums(updates, written)
        for param, grad in written:
            param.grad = grad
        for param, grad in updates:
            if id(param) in sparse_sums:
                param.grad = sparse_sums[id(param)]
            elif param.grad is None:
                # Every update is a fresh tensor of ours, a view of the engine's buffer which
                # nothing else refers to, or a gradient of autograd's that `owned` copied
                # where it was shared: a copy only to take the parameter's layout.
                param.grad = laid_out(grad, param)
            else:
                param.grad.add_(grad)
        pairs = [*written, *updates]
        run_post_accumulate_hooks(param for param, _ in pairs if id(param) in reached)
