"""The one core routine: the rows of a Jacobian as vector-Jacobian products, chunk by chunk.

Row ``r`` of the Jacobian of outputs ``y`` is the VJP of the cotangent ``e_r`` (or of row ``r`` of
user-given cotangents). Rows are differentiated ``chunk_size`` at a time with one vmapped VJP per
chunk, or one plain VJP per row when ``chunk_size == 1`` (no vmap at all: the escape hatch for
compiled graphs and ops without batching rules). The identity cotangents of a chunk are built
for that chunk only, so memory follows the chunk, never ``m x m``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from jacflow.autojac._accumulate import recording
from jacflow.autojac._graph import SPARSE_OPERANDS_READABLE


class VJP(Protocol):
    """``cotangents -> gradients`` for one row (``batched=False``) or a chunk of rows."""

    def __call__(
        self, cotangents: tuple[Tensor, ...], *, batched: bool, last: bool
    ) -> Sequence[Tensor | None]: ...


_VMAP_HINT = (
    "\n\njacflow: differentiating several rows at once with vmap failed. If the graph comes from "
    "a torch.compile'd model, an RNN on CUDA, an operation without a batching rule or an "
    "activation checkpoint whose function draws random numbers (a dropout in training mode, "
    "drawn again in the backward), pass "
    "`parallel_chunk_size=1` (or `chunk_size=1` for jacrev) to differentiate row by row "
    "without vmap. With torch.compile, also set "
    "`torch._functorch.config.donated_buffer = False` before compiling: the rows' backwards "
    "retain the graph, which torch refuses for a graph whose buffers it donates (inductor at "
    "once, aot_eager after a recompilation)."
)


def sparse_operands_hint(way_out: str = "pass `parallel_chunk_size=1`") -> str:
    """What to do where vmap failed on a sparse product that jacflow could not see (torch
    before 2.10), appended to torch's error; ``way_out`` names the caller's row-by-row
    option."""
    return (
        "\n\njacflow: the graph holds a product with a sparse operand (a graph neural network's "
        "adjacency matrix), which vmap cannot batch. jacflow finds such products and "
        "differentiates their rows one by one on torch 2.10 and later, which show a product's "
        f"operands as autograd saved them; this is torch {torch.__version__}. Upgrade torch "
        f"to 2.10 or later, or {way_out} to differentiate row by row without vmap."
    )


_DONATED_HINT = (
    "\n\njacflow: the graph holds torch.compile'd code whose backward runs once only (donated "
    "buffers), and the rows are pulled back one backward each, retaining the graph. Set "
    "`torch._functorch.config.donated_buffer = False` before compiling (with aot_eager the "
    "buffers are donated after a recompilation, e.g. at a smaller last batch)."
)

_SELECTIVE_HINT = (
    "\n\njacflow: the graph holds a region under selective activation checkpointing "
    "(torch.utils.checkpoint with context_fn=create_selective_checkpoint_contexts), whose "
    "backward torch runs once only, and the rows are pulled back in several backwards (one "
    "per row with `parallel_chunk_size=1`, one per chunk otherwise). Pass "
    "`parallel_chunk_size=None` to pull them back in one backward batched with vmap, or "
    "checkpoint without `context_fn` (a plain non-reentrant checkpoint can be pulled back "
    "several times)."
)

# (torch's refusal of a second backward through a region of selective activation checkpointing)
SELECTIVE_CHECKPOINT_ERROR = "selective activation checkpoint"


# Pieces (lower case) of the errors that differentiating rows under vmap causes: an op without
# a batching rule, an in-place op on an unbatched tensor, an autograd.Function without vmap
# support, a kernel that reads a batched tensor's storage (torch.compile'd graphs do), an op
# that cannot expand a sparse tensor to the chunk (the cotangents' batch dimension). Only
# those get the hint: others ("backward through the graph a second time") come back row by row
# too. (Retrying the chunk row by row to tell would run the hooks twice, and could find the
# graph freed by the failed call.)
_VMAP_ERRORS = (
    "vmap",
    "batching rule",
    "batched",
    "functorch",
    "doesn't have storage",
    "unsupported for sparse",
)


def vmap_related(error: RuntimeError) -> bool:
    """Whether ``error`` looks caused by vmap, so that ``parallel_chunk_size=1`` may avoid it.

    Example:
        >>> from jacflow.autojac._rows import vmap_related
        >>> vmap_related(RuntimeError("Batching rule not implemented for aten::item."))
        True
        >>> vmap_related(RuntimeError("expand is unsupported for Sparse tensors"))
        True
        >>> vmap_related(RuntimeError("Trying to backward through the graph a second time"))
        False
    """
    message = str(error).lower()
    return any(piece in message for piece in _VMAP_ERRORS)


def row_chunks(rows: int, chunk_size: int | None) -> list[tuple[int, int]]:
    size = rows if chunk_size is None else chunk_size
    size = max(size, 1)
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def basis_chunk(outputs: Sequence[Tensor], start: int, stop: int) -> tuple[Tensor, ...]:
    """Rows ``start:stop`` of the identity over the flattened outputs, split per output."""
    numels = [o.numel() for o in outputs]
    total = sum(numels)
    count = stop - start
    device = outputs[0].device
    # One [count, total] matrix per chunk; slicing per output keeps one allocation.
    flat = torch.zeros(count, total, dtype=outputs[0].dtype, device=device)
    flat[torch.arange(count, device=device), torch.arange(start, stop, device=device)] = 1
    pieces = torch.split(flat, numels, dim=1)
    return tuple(p.reshape(count, *o.shape).to(o.dtype) for p, o in zip(pieces, outputs))


def stacked_vjps(
    vjp: VJP,
    outputs: Sequence[Tensor],
    inputs: Sequence[Tensor],
    rows: int,
    chunk_size: int | None,
    cotangents: Sequence[Tensor] | None = None,
    preallocate: bool = True,
    sparse_retry: bool = False,
) -> tuple[tuple[Tensor, ...], tuple[bool, ...]]:
    """The ``rows`` x input Jacobians ``[rows, *input.shape]`` of ``outputs``, one per input,
    and per input whether a row reaches it: ``False`` where every row's VJP gave ``None``
    (autograd's answer for an input off the graph behind the outputs, whose rows are zeros),
    and for every input when there are no rows.

    Args:
        vjp: differentiates a (batch of) cotangent(s) for the outputs into input gradients.
        outputs: tensors whose shapes define the cotangents.
        inputs: tensors whose shapes define the results.
        rows: number of Jacobian rows (``sum(numel)`` for the identity).
        chunk_size: rows per VJP call (``None``: all at once; ``1``: a loop without vmap).
        cotangents: ``[rows, *output.shape]`` each, or ``None`` for the identity.
        preallocate: write chunks into one preallocated result (not differentiable; off when
            the result must carry a graph or run under function transforms).
        sparse_retry: a chunk that vmap fails to batch because of sparse tensors (a product
            with a sparse adjacency matrix) is differentiated again row by row: only for a
            ``vjp`` that may be called again (a functional pullback; autograd's runs hooks and
            may free the graph, so its callers choose rows by a walk of the graph instead). The
            pullback's backward code then runs again (a custom ``autograd.Function``'s backward
            with side effects runs once more per row).
    """
    if rows == 0:
        empty = tuple(torch.zeros((0, *i.shape), dtype=i.dtype, device=i.device) for i in inputs)
        return empty, (False,) * len(inputs)
    chunks = row_chunks(rows, chunk_size)
    sequential = chunk_size == 1
    results: list[list[Tensor]] = [[] for _ in inputs]
    reached = [False] * len(inputs)
    buffers: list[Tensor] | None = [] if preallocate and len(chunks) > 1 else None

    def cotangents_of(start: int, stop: int) -> tuple[Tensor, ...]:
        if cotangents is None:
            return basis_chunk(outputs, start, stop)
        return tuple(c[start:stop] for c in cotangents)

    for k, (start, stop) in enumerate(chunks):
        last = k == len(chunks) - 1
        chunk = cotangents_of(start, stop)
        if sequential:
            try:
                grads = _row_by_row(vjp, chunk, last)
            except RuntimeError as error:
                if SELECTIVE_CHECKPOINT_ERROR in str(error):
                    raise RuntimeError(f"{error}{_SELECTIVE_HINT}") from error
                if "donated buffer" not in str(error):
                    raise
                raise RuntimeError(f"{error}{_DONATED_HINT}") from error
        else:
            try:
                grads = list(vjp(chunk, batched=True, last=last))
            except RuntimeError as error:
                if sparse_retry and sparse_refusal(error):
                    grads = _row_by_row(vjp, chunk, last)
                elif unseen_sparse_product(error):
                    raise RuntimeError(f"{error}{sparse_operands_hint()}") from error
                elif SELECTIVE_CHECKPOINT_ERROR in str(error):
                    raise RuntimeError(f"{error}{_SELECTIVE_HINT}") from error
                elif not vmap_related(error):
                    raise
                else:
                    raise RuntimeError(f"{error}{_VMAP_HINT}") from error
        for j, (grad, inp) in enumerate(zip(grads, inputs)):
            reached[j] = reached[j] or grad is not None
            block = (
                torch.zeros((stop - start, *inp.shape), dtype=inp.dtype, device=inp.device)
                if grad is None
                else grad
            )
            if buffers is not None:
                # (in the rows' dtype, autograd's, as unchunked: a parameter's ``grad_dtype``
                # may set it apart from the parameter's)
                if k == 0:
                    buffers.append(block.new_empty((rows, *block.shape[1:])))
                buffers[j][start:stop].copy_(block)
            else:
                results[j].append(block)
    if buffers is not None:
        return tuple(buffers), tuple(reached)
    return tuple(_joined(r) for r in results), tuple(reached)


def sparse_refusal(error: RuntimeError) -> bool:
    """Whether ``error`` is vmap's failure to batch an operation on sparse tensors: a sparse
    operand it cannot expand to the chunk, or an operation missing for sparse tensors that
    batching needs (``view``).

    Example:
        >>> from jacflow.autojac._rows import sparse_refusal
        >>> error = "Could not run 'aten::view' with arguments from the 'SparseCPU' backend."
        >>> sparse_refusal(RuntimeError(error)), sparse_refusal(RuntimeError("sparse_dim < 0"))
        (True, False)
    """
    message = str(error).lower()
    return "sparse" in message and (vmap_related(error) or "could not run 'aten::" in message)


def unseen_sparse_product(error: RuntimeError) -> bool:
    """Whether ``error`` is vmap's failure on a sparse product that jacflow could not route row
    by row: one on a torch that cannot show a product's saved operands (before 2.10; see
    ``SPARSE_OPERANDS_READABLE``), so that the error gets :func:`sparse_operands_hint`."""
    return not SPARSE_OPERANDS_READABLE and sparse_refusal(error)


def _row_by_row(vjp: VJP, chunk: tuple[Tensor, ...], last: bool) -> list[Tensor | None]:
    """The chunk's rows differentiated one plain VJP each, stacked (dense; see
    :func:`_unsqueezed`), ``None`` for an input that no row reaches."""
    count = chunk[0].shape[0]
    rows = [
        _unsqueezed(vjp(tuple(c[r] for c in chunk), batched=False, last=last and r == count - 1))
        for r in range(count)
    ]
    return [
        None
        if all(g is None for g in column)
        else _joined([torch.zeros_like(_first(column)) if g is None else g for g in column])
        for column in zip(*rows, strict=True)
    ]


def _first(column: Sequence[Tensor | None]) -> Tensor:
    return next(g for g in column if g is not None)


def _unsqueezed(grads: Sequence[Tensor | None]) -> list[Tensor | None]:
    """One row's gradients as dense blocks of one row, their graph kept (see
    :func:`_joined`). A sparse gradient (``nn.Embedding(sparse=True)``) is densified: a row of
    the Jacobian has its input's shape, and the rows are stacked."""
    present = [g for g in grads if g is not None]
    with recording(present):
        return [None if g is None else _dense(g).unsqueeze(0) for g in grads]


def _dense(grad: Tensor) -> Tensor:
    return grad if grad.layout == torch.strided else grad.to_dense()


def _joined(blocks: list[Tensor]) -> Tensor:
    """The chunks' blocks of one input in one ``[rows, *input.shape]`` tensor. Rows with a
    graph (``create_graph=True``) keep it under ``torch.no_grad()`` too, as torch's gradients
    do: the result is the same, graph included, for every chunk size."""
    if len(blocks) == 1:
        return blocks[0]
    with recording(blocks):
        return torch.cat(blocks)


def autograd_vjp(
    outputs: Sequence[Tensor],
    inputs: Sequence[Tensor],
    retain_graph: bool,
    create_graph: bool,
) -> VJP:
    """A :class:`VJP` over the autograd graph (``torch.autograd.grad``).

    The ``.grad`` of an input that called ``retain_grad()`` is put back after every call: torch
    runs the hook of ``retain_grad()`` in every differentiation that reaches the tensor, with it
    among the inputs too, and inside vmap it stores a batched tensor. The callers write each
    input's result themselves, once. (The hooks of the tensors between ``outputs`` and
    ``inputs`` run as well; torch does not say which tensors retain grad, so those are left.)
    """
    differentiable = [i for i, o in enumerate(outputs) if o.requires_grad]
    targets = [outputs[i] for i in differentiable]
    retaining = [i for i in inputs if i.retains_grad]

    def vjp(
        cotangents: tuple[Tensor, ...], *, batched: bool, last: bool
    ) -> Sequence[Tensor | None]:
        if not targets or not inputs:
            return [None] * len(inputs)
        kept = [(i, i.grad) for i in retaining]
        try:
            return torch.autograd.grad(
                targets,
                list(inputs),
                grad_outputs=[cotangents[i] for i in differentiable],
                retain_graph=retain_graph or not last,
                create_graph=create_graph,
                allow_unused=True,
                is_grads_batched=batched,
            )
        finally:
            for tensor, grad in kept:
                tensor.grad = grad

    return vjp


def functional_vjp(pullback: Callable[..., tuple[Tensor, ...]]) -> VJP:
    """A :class:`VJP` from a ``torch.func.vjp`` pullback (composable with function transforms)."""

    def vjp(
        cotangents: tuple[Tensor, ...], *, batched: bool, last: bool
    ) -> Sequence[Tensor | None]:
        del last  # functional pullbacks can be called any number of times
        if batched:
            return torch.vmap(pullback)(cotangents)  # type: ignore[no-any-return, unused-ignore]
        return pullback(cotangents)

    return vjp
