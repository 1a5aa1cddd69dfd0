"""Writing results into ``.grad`` and ``.jac``: always the last step of a public call."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from jacflow._grad_writes import (
    added,
    grad_dtype,
    non_overlapping,
    owned,
    run_post_accumulate_hooks,
    sole_owners,
)
from jacflow._warnings import caller_stacklevel

_NON_LEAF_GRAD_WARNING = (
    "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"
)


def check_jac_field(jacobian: object, tensor: Tensor, where: str) -> Tensor:
    """The ``.jac`` of ``tensor`` (named ``where``), checked to be a dense Tensor on its device:
    adding to it or aggregating it then cannot fail half-way, after other writes."""
    if not isinstance(jacobian, Tensor):
        raise TypeError(
            f"`{where}.jac` must be a Tensor, received {type(jacobian)}. Delete it "
            "(`del t.jac`) and recompute it."
        )
    if jacobian.layout != torch.strided:
        raise ValueError(
            f"`{where}.jac` must be a dense (strided) Tensor, received one of layout "
            f"{jacobian.layout}. Convert it with `t.jac = t.jac.to_dense()`."
        )
    if jacobian.device != tensor.device:
        raise ValueError(
            f"`{where}.jac` is on {jacobian.device}, but `{where}` is on {tensor.device}. Move "
            "it with `t.jac = t.jac.to(t.device)`."
        )
    return jacobian


def check_jac_accumulable(tensors: Sequence[Tensor], rows: int, name: str) -> None:
    """Fail before computing anything if an existing ``.jac`` cannot take ``rows`` new rows."""
    for i, tensor in enumerate(tensors):
        existing = getattr(tensor, "jac", None)
        if existing is None:
            continue
        existing = check_jac_field(existing, tensor, f"{name}[{i}]")
        shape = (rows, *tensor.shape)
        if tuple(existing.shape) != shape:
            raise ValueError(
                f"Cannot accumulate a Jacobian of shape {shape} into the `.jac` of `{name}[{i}]`, "
                f"which already holds shape {tuple(existing.shape)} (a different "
                "number of rows). Delete the old `.jac` first (`del t.jac`) or call "
                "`jac_to_grad` before the next `backward`."
            )


def accumulate_jacs(
    tensors: Sequence[Tensor],
    jacobians: Sequence[Tensor],
    held: Sequence[Tensor] = (),
    create_graph: bool = False,
) -> None:
    """Add ``jacobians[i]`` to ``tensors[i].jac`` (or set it), each a dense tensor of its own
    (see :func:`owned`; ``held``: the caller's tensors, which no ``.jac`` may share;
    ``create_graph``: the Jacobians of a differentiation that built a graph, all copied).

    An existing ``.jac`` is added to in place (``+=``, as TorchJD does: references to it see
    the sum) where :func:`_adds_in_place` allows it and it shares no memory with ``held`` or
    with an earlier input's ``.jac``; else it is replaced by the sum. All the out-of-place sums
    are formed before the first write, so that a failure leaves every ``.jac`` as it was.
    """
    existing = [getattr(t, "jac", None) for t in tensors]
    with recording(jacobians):
        jacs = owned(
            jacobians, [*held, *(e for e in existing if e is not None)], None, create_graph
        )
        in_place = _jacs_added_in_place(existing, jacs, held)
        new = [
            j if e is None or add else added(e, j) for e, j, add in zip(existing, jacs, in_place)
        ]
    with torch.no_grad():
        for e, j, add in zip(existing, jacs, in_place):
            if add:
                e.add_(j)  # type: ignore[union-attr]
    for tensor, jac, add in zip(tensors, new, in_place):
        if not add:
            tensor.jac = jac  # type: ignore[attr-defined]


def _jacs_added_in_place(
    existing: Sequence[Tensor | None], jacs: Sequence[Tensor], held: Sequence[Tensor]
) -> list[bool]:
    """Per input, whether its existing ``.jac`` takes the new rows in place: allowed by
    :func:`_adds_in_place`, and sharing no memory with ``held`` (the caller's tensors, left
    unchanged) or with an earlier input's ``.jac`` (whose sum is then formed from it first)."""
    alone = iter(sole_owners([e for e in existing if e is not None], held))
    flags = []
    for e, jac in zip(existing, jacs):
        if e is None:
            flags.append(False)
            continue
        flags.append(next(alone) and _adds_in_place(e, jac))
    return flags


def recording(results: Sequence[Tensor]) -> contextlib.AbstractContextManager[object]:
    """Grad mode on where a result has a graph (``create_graph=True``): autograd records the
    accumulation then even under ``no_grad``, and so must the sums, copies and conversions
    of the results (else ``.grad`` silently loses its graph), and the stacking of the rows.

    Example:
        >>> import torch
        >>> from jacflow.autojac._accumulate import recording
        >>> row = torch.ones(2, requires_grad=True) * 2
        >>> with torch.no_grad(), recording([row]):
        ...     row.unsqueeze(0).requires_grad
        True
    """
    if any(r.requires_grad for r in results):
        return torch.enable_grad()
    return contextlib.nullcontext()


def _current_grad(tensor: Tensor) -> Tensor | None:
    """``tensor.grad``, read without ``retain_grad()`` and without torch's non-leaf warning.

    A non-leaf input gets its ``.grad`` written directly, never through ``retain_grad()``: the
    hook that ``retain_grad()`` installs would fire in every later differentiation through the
    tensor, vmapped ones included, and store a batched tensor in ``.grad``.
    """
    if tensor.is_leaf or tensor.retains_grad:
        return tensor.grad
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NON_LEAF_GRAD_WARNING, category=UserWarning)
        return tensor.grad


def _adds_in_place(existing: Tensor, update: Tensor) -> bool:
    """Whether ``existing += update`` is safe and wanted, as autograd decides it.

    In place (``.grad`` or ``.jac`` keeps its identity) when no graph is involved and
    ``existing`` is a dense tensor that can be written: not an inference tensor, no element
    shared by several positions (an expanded tensor), and the update's dtype and device (the
    sum then has those of the out-of-place one).
    """
    return (
        not update.requires_grad
        and not existing.requires_grad
        and existing.layout == torch.strided
        and not existing.is_inference()
        and existing.dtype == update.dtype
        and existing.device == update.device
        and non_overlapping(existing)
    )


def accumulate_grads(
    tensors: Sequence[Tensor],
    updates: Sequence[Tensor | None],
    held: Sequence[Tensor] = (),
    create_graph: bool = False,
) -> None:
    """Add ``updates[i]`` to ``tensors[i].grad`` (or set it when it is ``None``), each new
    ``.grad`` a tensor of its own in its tensor's layout (see :func:`owned`; ``held``: the
    caller's tensors; ``create_graph``: gradients of a differentiation that built a graph, all
    copied). A ``None`` update leaves its tensor alone (an input that no row reaches, whose
    ``.grad`` torch's ``backward`` would not write either).

    Every update is converted to the dtype of torch's gradient (:func:`grad_dtype`: a
    parameter's ``grad_dtype`` where set) and every existing ``.grad`` read and every
    out-of-place sum (``existing + update``, where the ``.grad`` cannot be written in place)
    formed before the first write, so that no write fails after another has been made. Then
    the tensors' post-accumulate hooks run, once each, as after ``loss.backward()``.
    """
    pairs = [(t, u) for t, u in zip(tensors, updates, strict=True) if u is not None]
    tensors, kept = [t for t, _ in pairs], [u for _, u in pairs]
    with recording(kept):
        converted = [_in_layout(_in_dtype(u, grad_dtype(t)), t) for t, u in pairs]
        current = [_current_grad(tensor) for tensor in tensors]
        # (only what is stored as it is must be a tensor of its own, laid out as its tensor)
        fresh = [k for k, existing in enumerate(current) if existing is None]
        stored = owned(
            [converted[k] for k in fresh], held, [tensors[k] for k in fresh], create_graph
        )
        for k, update in zip(fresh, stored):
            converted[k] = update
        in_place = [e is not None and _adds_in_place(e, u) for e, u in zip(current, converted)]
        new = [
            u if e is None or add else added(e, u)
            for e, u, add in zip(current, converted, in_place)
        ]
    for tensor, existing, update, add in zip(tensors, current, new, in_place):
        if add:
            with torch.no_grad():
                existing.add_(update)  # type: ignore[union-attr]
        else:
            tensor.grad = update
    run_post_accumulate_hooks(tensors)


def _in_dtype(update: Tensor, dtype: torch.dtype) -> Tensor:
    """``update.to(dtype)``, without the call where it has that dtype (it runs per tensor)."""
    return update if update.dtype == dtype else update.to(dtype)


def _in_layout(update: Tensor, tensor: Tensor) -> Tensor:
    """``update`` in the layout of ``tensor``: a sparse leaf (through ``torch.sparse.mm``) gets a
    sparse ``.grad`` of its layout, as from autograd, and the ``.grad`` setter refuses a dense
    one (an aggregated update is dense: the aggregation mixes the densified rows)."""
    if tensor.layout == torch.strided or update.layout != torch.strided:
        return update
    if tensor.layout == torch.sparse_coo:
        return update.to_sparse(tensor.sparse_dim())
    blocksize = None
    if tensor.layout in (torch.sparse_bsr, torch.sparse_bsc):
        values = tensor.values().shape  # ([*batch], nnz, *block, *dense)
        end = len(values) - tensor.dense_dim()
        blocksize = tuple(values[end - 2 : end])
    return update.to_sparse(layout=tensor.layout, blocksize=blocksize, dense_dim=tensor.dense_dim())


def warn_if_distributed() -> None:
    """Warn (once per call site) when several processes share a process group: the public
    calls that write ``.grad`` call it once, as those writes bypass DistributedDataParallel's
    averaging hooks (as TorchJD's do)."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return
    if distributed.get_world_size() < 2:
        return
    warnings.warn(
        f"torch.distributed runs {distributed.get_world_size()} processes, and jacflow's "
        "backward, jac_to_grad and mtl_backward write .grad directly, without "
        "DistributedDataParallel's averaging: each replica keeps its own update and the "
        "replicas drift apart. Use the Gramian engine, which averages over the replicas "
        "(jacflow.autogram.Engine(ddp_model, ...), or mtl_backward(..., engine=Engine(trunk, "
        "batch_dim=None, ddp=ddp_model))), or average .grad yourself (all_reduce, then divide "
        "by the world size) before the optimizer's step.",
        stacklevel=caller_stacklevel(),
    )
