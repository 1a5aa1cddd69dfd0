"""``backward``: Jacobians accumulated into ``.jac``, or aggregated into ``.grad``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from jacflow.aggregation import Aggregator, Mean, Sum
from jacflow.aggregation._bases import compute_dtype
from jacflow.autojac._accumulate import (
    accumulate_grads,
    accumulate_jacs,
    check_jac_accumulable,
    warn_if_distributed,
)
from jacflow.autojac._aggregate import aggregate_blocks, has_forward_hooks
from jacflow.autojac._checks import (
    as_tensor_tuple,
    check_aggregator,
    check_chunk_size,
    check_flag,
    check_inputs_not_aggregator,
    check_non_empty,
    check_real,
    check_real_inputs,
    check_unique,
    checked_cotangents,
    without_repeats,
)
from jacflow.autojac._graph import check_reentrant_checkpoints
from jacflow.autojac._jac import compute_jacobians, resolve_inputs
from jacflow.autojac._rows import autograd_vjp


def store(
    inputs: Sequence[Tensor],
    jacobians: Sequence[Tensor],
    aggregator: Aggregator | None,
    reached: Sequence[bool],
    held: Sequence[Tensor] = (),
    create_graph: bool = False,
) -> None:
    """Aggregate into ``.grad`` (with an aggregator) or accumulate into ``.jac``; write last.
    No result shares memory with another or with ``held`` (the caller's tensors), nor, with
    ``create_graph``, with autograd's gradients (which another's graph may save).

    Only the inputs that a row reaches (``reached``) are written, as torch's ``backward``
    writes no ``.grad`` for an input off the graph; the aggregator still gets the whole
    Jacobian (the zero columns of the others too), so the reached inputs' updates do not
    depend on which inputs are listed, and is called also when no input is reached (a stateful
    aggregator advances at every call, as on the engine's route)."""
    if aggregator is None:
        kept = [k for k, r in enumerate(reached) if r]
        accumulate_jacs([inputs[k] for k in kept], [jacobians[k] for k in kept], held, create_graph)
        return
    updates, _ = aggregate_blocks(aggregator, jacobians)
    accumulate_grads(
        inputs, [u if r else None for u, r in zip(updates, reached)], held, create_graph
    )


def _fixed_weight_update(
    aggregator: Aggregator,
    outputs: tuple[Tensor, ...],
    inputs: tuple[Tensor, ...],
    cotangents: tuple[Tensor, ...] | None,
    rows: int,
    retain_graph: bool,
    create_graph: bool,
) -> list[Tensor | None] | None:
    """For Mean and Sum, whose weights do not depend on J: ``J^T w`` as one VJP, exactly
    (``None`` for an input that it does not reach, whose ``.grad`` is left alone).

    ``w^T (C J) = (C^T w)^T J``, so the weighted cotangent is differentiated once instead of
    forming the m rows. Returns ``None`` for every other aggregator, where forward hooks
    must see the aggregator's call on ``J``, and where an input has gradient hooks, which must
    see each row (as with any other aggregator) rather than their weighted sum, and where the
    weighted half-precision cotangents overflow their dtype (see :func:`_weighted_sum`).
    """
    if type(aggregator) not in (Mean, Sum) or rows == 0 or has_forward_hooks(aggregator):
        return None
    if any(i._backward_hooks for i in inputs):
        return None
    weight = 1.0 / rows if isinstance(aggregator, Mean) else 1.0
    if cotangents is None:
        combined = tuple(torch.full_like(o, weight) for o in outputs)
    else:
        sums = []
        for c, o in zip(cotangents, outputs):
            total = _weighted_sum(weight, c, o)
            if total is None:
                return None
            sums.append(total)
        combined = tuple(sums)
    grads = autograd_vjp(outputs, inputs, retain_graph, create_graph)(
        combined, batched=False, last=True
    )
    return list(grads)


def _weighted_sum(weight: float, cotangents: Tensor, output: Tensor) -> Tensor | None:
    """``weight`` times the sum of the rows of ``cotangents``, in ``output``'s dtype (as each row
    is differentiated), summed in its compute dtype: the m rows of a float16 cotangent may
    overflow float16 where each row and their mean fit. ``None`` where the result still does not
    fit (a ``Sum``'s): the Jacobian's rows are then formed and combined in float32."""
    rows = cotangents.to(output.dtype)
    work = compute_dtype(output.dtype)
    if work == output.dtype:
        return weight * rows.sum(0)
    total = weight * rows.sum(0, dtype=work)
    combined = total.to(output.dtype)
    if bool((combined.isinf() & total.isfinite()).any()):  # (half precision only: one sync)
        return None
    return combined


def backward(
    tensors: Tensor | Sequence[Tensor],
    inputs: Iterable[Tensor] | None = None,
    A: Aggregator | None = None,
    retain_graph: bool | None = None,
    parallel_chunk_size: int | None = None,
    *,
    jac_tensors: Tensor | Sequence[Tensor] | None = None,
    create_graph: bool = False,
) -> None:
    """Jacobian of all values of ``tensors`` w.r.t. ``inputs``, stored or aggregated.

    Without an aggregator, the Jacobian with respect to each input ``t`` (shape
    ``[m, *t.shape]``) is accumulated into ``t.jac``: in place (``t.jac += J``), unless the
    existing ``.jac`` has a graph or another dtype, is expanded, or shares memory with
    ``jac_tensors`` or another input's ``.jac`` (then it is replaced by the sum). Aggregate it
    later with :func:`jac_to_grad`. With an aggregator ``A``, the Jacobian (one row per value of
    ``tensors``) is aggregated into one vector that is accumulated into ``t.grad``, as
    ``loss.backward()`` would do with the gradient: each new ``.grad`` a tensor of its own,
    then the inputs' post-accumulate hooks run once each (so do :func:`jac_to_grad`'s and
    :func:`mtl_backward`'s).

    An input that no row reaches (not in the graph behind ``tensors``: an unused head, a
    branch skipped this step) is left as it is: its ``.grad`` stays ``None`` (or keeps its
    value), as after ``torch.autograd.backward(loss, inputs=...)``, so an optimizer skips it
    (no momentum step, no weight decay), and it gets no ``.jac`` (one it has is left
    unchanged), which :func:`jac_to_grad` then skips. An input that some rows reach is
    reached: its Jacobian has zeros in the other rows. (TorchJD 0.18 writes zeros there.)
    With ``A``, the aggregator gets the whole Jacobian, the zero columns of unreached inputs
    included, also when no input is reached.

    Args:
        tensors: the tensor or tensors to differentiate; non-empty, distinct.
        inputs: tensors to differentiate with respect to (one listed several times is taken
            once, as in :func:`torch.autograd.backward`). Default: every leaf tensor requiring
            grad behind ``tensors`` (an element of ``tensors`` that is such a leaf is its own
            input, with the identity Jacobian). A non-leaf input gets its ``.grad`` (or
            ``.jac``) written directly, without ``retain_grad()``: later differentiations
            through it leave it alone, and the next ``backward`` accumulates into it. One that
            called ``retain_grad()`` gets its result once too (the ``.grad`` that torch's hook
            writes during the differentiation is put back first).
        A: aggregator reducing the Jacobian to one update; ``None`` stores ``.jac`` instead.
            With ``A``, the inputs must be real (a ``ValueError`` otherwise: the
            aggregators combine real Jacobians); without it, a complex input's ``.jac`` is
            complex.
        retain_graph: keep the graph for another differentiation. Default: ``create_graph``.
        parallel_chunk_size: rows differentiated per vmapped call (``None``: all; ``1``: a loop
            without vmap). The results agree up to rounding, as in :func:`jac`. A
            ``torch.compile``'d graph cannot be vmapped: pass ``1``, and set
            ``torch._functorch.config.donated_buffer = False`` before compiling (each row's
            backward retains the graph, which inductor refuses at once and ``aot_eager`` after
            a recompilation, e.g. at a smaller last batch).
        jac_tensors: left-multiplies the Jacobian (chain rule, the analog of ``grad_tensors``):
            one ``[m, *tensor.shape]`` tensor per element of ``tensors``. As in
            ``grad_tensors``, ``None`` may stand for ones for a tensor of one element (``m``
            ones: the rows of the other entries, or one row when every entry is ``None``) and
            for zeros for a tensor that does not require grad.
        create_graph: keep the result differentiable, for higher-order derivatives. With
            ``A``, it must be :attr:`~jacflow.aggregation.Aggregator.differentiable` (a
            ``ValueError`` otherwise). The result has its graph under ``torch.no_grad()`` too,
            as after torch's ``backward(create_graph=True)``. Without it, ``.grad`` has no
            graph, as after torch's ``backward``, even where the aggregator holds tensors that
            require grad.

    If the call fails, every ``.grad`` and ``.jac`` is left as it was. An empty Jacobian
    (``m = 0``: ``tensors`` have no elements, e.g. the losses of an empty batch) gives each
    input that the graph behind ``tensors`` reaches ``[0, *t.shape]`` in ``.jac``, or with
    ``A`` the zero update, added to ``.grad`` (zeros where it was ``None``), as
    ``y.backward(torch.zeros(0))`` does for an empty ``y``; another input is left as it is.

    With ``A`` a ``Mean()`` or a ``Sum()`` (not a subclass) that has no forward hook, and no
    gradient hook (``register_hook``) on ``inputs``, the weighted tensors are differentiated
    once, without forming the Jacobian (unless the sum of float16 ``jac_tensors`` overflows
    float16), as ``tensors.backward(weights)`` would: in a graph with float16 steps, the
    weighted cotangent may overflow there where each row would not (``Constant(w)`` takes the
    rows one by one). In every other case each row of the Jacobian is differentiated.

    A sparse gradient (``nn.Embedding(sparse=True)``) is densified, as in :func:`jac`: ``.jac``
    and an aggregated ``.grad`` are dense, as :func:`jac_to_grad` writes from that ``.jac``
    (the aggregation mixes the rows); that of a sparse leaf (through ``torch.sparse.mm``) is
    converted to the leaf's layout, as torch's ``.grad`` must have it. The single
    differentiation above writes autograd's gradient, sparse as after ``loss.backward()``.
    For an optimizer that needs a sparse gradient (``SparseAdam``), convert it:
    ``p.grad = p.grad.to_sparse()``.

    A tensor between ``tensors`` and ``inputs`` that called ``retain_grad()`` is left to torch's
    hook, which runs in every differentiation through it: with the single differentiation above,
    it gets what ``(w @ losses).backward()`` gives it; otherwise, with
    ``parallel_chunk_size=1``, the sum of the Jacobian's rows at it; with several rows per
    vmapped call, an unusable batched tensor (the hook runs inside vmap, and torch does not say
    which tensors retain grad, so jacflow can neither avoid nor undo it; TorchJD does the same).
    Pass ``parallel_chunk_size=1`` then, or list the tensor in ``inputs`` for its own result.
    Gradient hooks on ``inputs`` run on each row of the Jacobian, whatever the aggregator. Those
    on tensors between ``tensors`` and ``inputs`` also run on each row, except with the single
    differentiation above, where they run once, on the weighted rows' sum: the same update for
    a hook linear in its gradient (a mask, a scaling), not for another (a clipping). So with
    ``A=Mean()`` and a clipping hook on such a tensor, adding a gradient hook to an input, even
    one that returns its gradient unchanged, changes the update.

    Example:
        >>> import torch
        >>> from jacflow import backward
        >>> from jacflow.aggregation import UPGrad
        >>> param = torch.tensor([1., 2.], requires_grad=True)
        >>> y1 = torch.tensor([-1., 1.]) @ param
        >>> y2 = (param ** 2).sum()
        >>> backward([y1, y2], [param], A=UPGrad())
        >>> param.grad
        tensor([0.5000, 2.5000])
    """
    outs = as_tensor_tuple(tensors, "tensors")
    check_non_empty(outs, "tensors")
    check_unique(outs, "tensors")
    check_real(outs, "tensors")
    check_flag(retain_graph, "retain_graph", none_ok=True)
    check_flag(create_graph, "create_graph")
    aggregator = check_aggregator(A)
    if create_graph and aggregator is not None and not aggregator.differentiable:
        raise ValueError(
            f"create_graph=True needs an aggregator whose update is differentiable, but "
            f"{aggregator!r} computes its weights without autograd (as most methods do): a "
            "derivative of `.grad` would hold them constant. Use UPGrad(), MGDA(), Mean(), "
            "Sum(), Constant(...) or Random(); or take the Jacobian with `jac(..., "
            "create_graph=True)` and combine its rows with weights of your choice."
        )
    chunk_size = check_chunk_size(parallel_chunk_size, "parallel_chunk_size")
    check_inputs_not_aggregator(inputs)
    ins = without_repeats(resolve_inputs(outs, inputs, "tensors", "inputs"))
    check_non_empty(ins, "inputs")
    check_reentrant_checkpoints(outs, ins, "tensors")
    if aggregator is not None:
        check_real_inputs(ins, "inputs")
    if jac_tensors is None:
        cotangents = None
        rows = sum(o.numel() for o in outs)
    else:
        cotangents, rows = checked_cotangents(jac_tensors, outs, "jac_tensors", "tensors")
    if aggregator is None:
        check_jac_accumulable(ins, rows, "inputs")
    else:
        aggregator.check_rows(rows)  # (before the graph is freed)
    retain = create_graph if retain_graph is None else retain_graph
    if aggregator is not None:
        warn_if_distributed()
        updates = _fixed_weight_update(
            aggregator, outs, ins, cotangents, rows, retain, create_graph
        )
        if updates is not None:
            accumulate_grads(ins, updates, cotangents or (), create_graph)
            return
    jacobians, reached = compute_jacobians(
        outs, ins, cotangents, rows, retain, create_graph, chunk_size
    )
    store(ins, jacobians, aggregator, reached, cotangents or (), create_graph)
