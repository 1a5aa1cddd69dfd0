"""``jac``: the Jacobians of outputs with respect to inputs, returned as a tuple."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from jacflow.autojac._checks import (
    as_tensor_tuple,
    check_chunk_size,
    check_flag,
    check_inputs_require_grad,
    check_non_empty,
    check_real,
    check_unique,
    checked_cotangents,
)
from jacflow.autojac._graph import (
    check_reentrant_checkpoints,
    leaf_tensors,
    reached_inputs,
    sparse_gradients,
)
from jacflow.autojac._rows import autograd_vjp, stacked_vjps


def resolve_inputs(
    outputs: tuple[Tensor, ...], inputs: Iterable[Tensor] | None, out_name: str, in_name: str
) -> tuple[Tensor, ...]:
    """Explicit inputs validated, or every leaf requiring grad behind ``outputs``."""
    if inputs is None:
        for i, out in enumerate(outputs):
            if not out.requires_grad:
                raise ValueError(
                    f"`{out_name}[{i}]` does not require grad and has no grad_fn, so the leaves "
                    f"it depends on cannot be found. Pass `{in_name}` explicitly, or make sure "
                    f"`{out_name}[{i}]` is computed from tensors that require grad."
                )
        leaves = leaf_tensors(outputs)  # (a leaf output requiring grad is its own input)
        if not leaves:  # (as torch.autograd.grad refuses empty inputs)
            raise ValueError(
                f"`{out_name}` reach no leaf tensor that requires grad: every one behind them "
                "was frozen (requires_grad=False) since the forward, so there is nothing to "
                f"differentiate. Unfreeze the parameters to differentiate, pass `{in_name}` "
                "(non-leaf tensors too), or skip the call."
            )
        return leaves
    resolved = as_tensor_tuple(inputs, in_name)
    check_inputs_require_grad(resolved, in_name)
    if outputs and not any(out.requires_grad for out in outputs):
        # (a Jacobian of zeros, silently: most likely computed under torch.no_grad())
        raise ValueError(
            f"No tensor of `{out_name}` requires grad: they do not depend on `{in_name}` (were "
            f"they computed under `torch.no_grad()`?). Compute them with grad enabled."
        )
    return resolved


def compute_jacobians(
    outputs: tuple[Tensor, ...],
    inputs: tuple[Tensor, ...],
    jac_outputs: Sequence[Tensor] | None,
    rows: int,
    retain_graph: bool,
    create_graph: bool,
    chunk_size: int | None,
) -> tuple[tuple[Tensor, ...], tuple[bool, ...]]:
    """The validated core call shared by ``jac``, ``backward`` and ``mtl_backward``: the
    Jacobians, and per input whether a row reaches it (with no rows: whether the graph behind
    ``outputs`` does, see :func:`reached_inputs`). ``backward`` and ``mtl_backward`` write only
    the reached inputs' ``.grad`` and ``.jac``, as torch's ``backward(inputs=...)`` leaves an
    unreached input's ``.grad`` alone; ``jac`` returns zeros for the others.

    A graph whose backward returns sparse gradients (``nn.Embedding(sparse=True)``) or runs
    through sparse tensors (a product with a graph's sparse adjacency matrix) is differentiated
    row by row whatever ``chunk_size``: torch cannot batch those backwards with vmap. The rows
    are densified, so the Jacobians are dense. So is any graph under
    ``torch.autograd.detect_anomaly()``, whose check of each backward's output for NaN vmap
    cannot batch.
    """
    if chunk_size != 1 and (torch.is_anomaly_enabled() or sparse_gradients(outputs, inputs)):
        chunk_size = 1
    cotangents = (
        None if jac_outputs is None else tuple(j.to(o.dtype) for j, o in zip(jac_outputs, outputs))
    )
    vjp = autograd_vjp(outputs, inputs, retain_graph, create_graph)
    jacobians, reached = stacked_vjps(
        vjp, outputs, inputs, rows, chunk_size, cotangents, preallocate=not create_graph
    )
    if rows == 0:
        reached = reached_inputs(outputs, inputs)
    return jacobians, reached


def jac(
    outputs: Tensor | Sequence[Tensor],
    inputs: Iterable[Tensor] | None = None,
    jac_outputs: Tensor | Sequence[Tensor] | None = None,
    retain_graph: bool | None = None,
    parallel_chunk_size: int | None = None,
    *,
    create_graph: bool = False,
) -> tuple[Tensor, ...]:
    """Jacobians of ``outputs`` with respect to ``inputs``, one per input.

    The Jacobian has one row per element of ``outputs`` (flattened and concatenated in order),
    so the result for input ``t`` has shape ``[m, *t.shape]``. With ``jac_outputs``, the
    Jacobian is left-multiplied by them (the chain rule, like ``grad_outputs`` of
    :func:`torch.autograd.grad`).

    Args:
        outputs: the tensor or tensors to differentiate; must be non-empty and distinct.
        inputs: tensors to differentiate with respect to (leaves or not); each must require
            grad. Default: every leaf tensor requiring grad that ``outputs`` depend on (an
            output that is such a leaf is its own input).
            Inputs that ``outputs`` do not depend on get zero Jacobians; an input listed
            several times gets its Jacobian at each place, as in :func:`torch.autograd.grad`.
        jac_outputs: one tensor per output, of shape ``[m, *output.shape]`` with the same
            ``m`` for all; default: the identity (``m = total numel of outputs``). ``None``
            may stand for ones for an output of one element (``m`` ones; one row when every
            entry is ``None``) and for zeros for one that does not require grad, as in
            torch's ``grad_outputs``.
        retain_graph: keep the graph for another differentiation. Default: ``create_graph``.
        parallel_chunk_size: rows differentiated per vmapped call; ``None`` = all at once,
            ``1`` = one plain call per row without vmap. Memory scales with the chunk. The
            results agree up to rounding, not bit for bit: batched and per-row kernels may sum
            in another order (differences of about 1e-7 of the largest entries in float32, as
            in TorchJD). A ``torch.compile``'d graph cannot be vmapped: pass ``1``, and set
            ``torch._functorch.config.donated_buffer = False`` before compiling (each row's
            backward retains the graph, which inductor refuses at once and ``aot_eager`` after
            a recompilation, e.g. at a smaller last batch). A graph with sparse gradients
            (``nn.Embedding(sparse=True)``, ``gather(..., sparse_grad=True)``) or products
            with sparse tensors (a graph neural network's sparse adjacency matrix, COO or CSR,
            learned edge weights) is differentiated row by row whatever the chunk size (torch
            cannot vmap their backward), and its rows are densified: the Jacobian is dense.
        create_graph: build the graph of the result, for higher-order derivatives.

    With ``inputs=None``, outputs whose leaves were all frozen (``requires_grad=False``) since
    the forward are refused (``ValueError``), as by :func:`backward`: nothing would be
    differentiated.

    No ``.grad`` is written: an input that called ``retain_grad()`` keeps its ``.grad`` (torch's
    hook writes it during the differentiation; it is put back). A tensor between ``outputs`` and
    ``inputs`` that called ``retain_grad()`` is left to that hook, as in :func:`backward`: the sum
    of the rows with ``parallel_chunk_size=1``, an unusable batched tensor with vmapped rows.

    A non-reentrant activation checkpoint (``torch.utils.checkpoint(..., use_reentrant=False)``)
    is differentiated exactly, its forward recomputed once per chunk of rows. A reentrant one
    (``use_reentrant=True``) whose backward the rows would run, or that runs one of ``inputs``
    (a parameter of its module, or any function that is not a module's), is refused with a
    ``ValueError``: torch runs its backward only in ``.backward()`` without ``inputs``, and the
    parameters inside it are out of the graph's sight (so in :func:`backward` and
    :func:`mtl_backward` too).

    Each row is the gradient of all of ``outputs`` with a cotangent that is zero off its own
    entries, as in :func:`torch.func.jacrev`: where the derivative of one output is infinite,
    that zero times infinity makes NaN the other rows that reach the same operation, for every
    chunk size. The Jacobian is then non-finite either way (so is ``backward``'s aggregation,
    which an AMP ``GradScaler`` skips); differentiate the outputs in separate calls to keep the
    other rows.

    Returns:
        A tuple with one ``[m, *input.shape]`` tensor per input.

    Example:
        >>> import torch
        >>> from jacflow import jac
        >>> param = torch.tensor([1., 2.], requires_grad=True)
        >>> y1 = torch.tensor([-1., 1.]) @ param
        >>> y2 = (param ** 2).sum()
        >>> jac([y1, y2], [param])
        (tensor([[-1.,  1.],
                [ 2.,  4.]]),)
    """
    outs = as_tensor_tuple(outputs, "outputs")
    check_non_empty(outs, "outputs")
    check_unique(outs, "outputs")
    check_real(outs, "outputs")
    check_flag(retain_graph, "retain_graph", none_ok=True)
    check_flag(create_graph, "create_graph")
    chunk_size = check_chunk_size(parallel_chunk_size, "parallel_chunk_size")
    ins = resolve_inputs(outs, inputs, "outputs", "inputs")
    check_reentrant_checkpoints(outs, ins, "outputs")
    if jac_outputs is None:
        cotangents = None
        rows = sum(o.numel() for o in outs)
    else:
        cotangents, rows = checked_cotangents(jac_outputs, outs, "jac_outputs", "outputs")
    retain = create_graph if retain_graph is None else retain_graph
    return compute_jacobians(outs, ins, cotangents, rows, retain, create_graph, chunk_size)[0]
