"""``jac_to_grad``: aggregate the ``.jac`` fields of tensors into their ``.grad`` fields."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from jacflow._labels import received
from jacflow.aggregation import Aggregator
from jacflow.autojac._accumulate import accumulate_grads, check_jac_field, warn_if_distributed
from jacflow.autojac._aggregate import aggregate_blocks
from jacflow.autojac._checks import (
    as_tensor_tuple,
    check_flag,
    check_non_empty,
    check_real_inputs,
    check_unique,
    rows_shape,
)


def _with_jac(items: tuple[Tensor, ...]) -> list[int]:
    """The positions of the tensors that hold a ``.jac``; a ``ValueError`` when none does."""
    present = [i for i, t in enumerate(items) if getattr(t, "jac", None) is not None]
    if not present:
        shapes = ", ".join(str(tuple(t.shape)) for t in items[:3])
        more = ", ..." if len(items) > 3 else ""
        raise ValueError(
            f"No tensor of `tensors` (shapes {shapes}{more}) has a `.jac` field. Populate them "
            "with `jacflow.backward(...)` or `jacflow.mtl_backward(...)` without an aggregator "
            "first (a tensor that the losses do not reach gets none, and is skipped)."
        )
    return present


def _checked_jac(tensor: Tensor, i: int) -> Tensor:
    """The ``.jac`` of ``tensors[i]`` (present), checked to be a dense floating-point
    ``[m, *tensor.shape]`` tensor beside it."""
    jacobian = check_jac_field(tensor.jac, tensor, f"tensors[{i}]")  # type: ignore[attr-defined]
    if not jacobian.is_floating_point():
        raise TypeError(
            f"`tensors[{i}].jac` must be a floating-point Tensor, received {jacobian.dtype}. "
            "Recompute it with `jacflow.backward(...)`, or convert it (`t.jac = t.jac.float()`)."
        )
    if jacobian.ndim != tensor.ndim + 1 or jacobian.shape[1:] != tensor.shape:
        raise ValueError(
            f"`tensors[{i}].jac` must have shape [m, *tensors[{i}].shape] = "
            f"{rows_shape(tensor.shape)}, received {tuple(jacobian.shape)}. It "
            "may be stale or belong to another tensor: delete it (`del t.jac`) and recompute it."
        )
    return jacobian


def _resolve_aggregator(A: object, aggregator: object, optimize: object) -> Aggregator:
    """The aggregator given as ``A`` or by TorchJD's name ``aggregator`` (exactly one)."""
    if A is not None and aggregator is not None:
        raise TypeError(
            "jac_to_grad got the aggregator twice, as `A` and as `aggregator`; pass it once."
        )
    given = A if aggregator is None else aggregator
    name = "`A`" if aggregator is None else "`aggregator`"
    if given is None:
        raise TypeError(
            "jac_to_grad needs an aggregator: pass it as `A` (e.g. `jac_to_grad(params, "
            "UPGrad())`) or as `aggregator=`."
        )
    if not isinstance(given, Aggregator):
        raise TypeError(
            f"{name} must be a jacflow.aggregation.Aggregator (e.g. UPGrad()), received "
            f"{received(given)}."
        )
    check_flag(optimize, "optimize_gramian_computation")
    return given


def jac_to_grad(
    tensors: Iterable[Tensor],
    A: Aggregator | None = None,
    *,
    retain_jac: bool = False,
    aggregator: Aggregator | None = None,
    optimize_gramian_computation: bool = False,
) -> Tensor | None:
    """Aggregate the Jacobians stored in ``t.jac`` into ``t.grad`` for every ``t`` in ``tensors``.

    The ``.jac`` fields (``[m, *t.shape]``, same ``m`` for all) form the column blocks of one
    ``[m, n]`` Jacobian; ``A`` reduces it to one update that is accumulated into ``.grad``.
    Gramian-based aggregators never see the concatenated matrix (``G = sum_t J_t J_t^T``).
    Call it several times on groups of tensors with separate aggregators to aggregate per
    layer or per network.

    The update written has a graph only where the ``.jac`` fields have one (``jac(...,
    create_graph=True)``) and ``A`` is :attr:`~jacflow.aggregation.Aggregator.differentiable`,
    as ``.grad`` after torch's ``backward``; it has one then even under ``torch.no_grad()``,
    as after torch's ``backward(create_graph=True)``.

    A tensor without a ``.jac`` (or with ``.jac = None``) is skipped, its ``.grad`` left as it
    is: :func:`backward` and :func:`mtl_backward` write none to an input that no loss reaches
    (an unused head), whose ``.grad`` then stays ``None`` as after torch's ``backward``; it
    takes part in the aggregation as zero columns, as in ``backward(..., A=...)``, so both
    routes give the same update (also for an aggregator that reads the columns, as GradDrop's
    draw per coordinate). At least one tensor must have a ``.jac`` (a
    ``ValueError`` otherwise: most likely ``backward`` was not called, or ``jac_to_grad``
    was called twice). TorchJD 0.18 refuses any tensor without a ``.jac``.

    Every ``.jac`` is checked (a dense floating-point ``[m, *t.shape]`` tensor on ``t``'s
    device, same ``m``) before anything is written: a failed call leaves every
    ``.grad`` and ``.jac`` as it was. Empty Jacobians
    (``m = 0``) aggregate to the zero update, which is added to ``.grad`` (zeros where it was
    ``None``), with empty weights.

    Args:
        tensors: the distinct tensors whose ``.jac`` to aggregate (e.g. ``model.parameters()``).
        A: the aggregator; ``tensors`` must be real, as in :func:`backward` with ``A``.
        retain_jac: keep the ``.jac`` fields (default: delete them to free memory).
        aggregator: TorchJD's name for ``A``; give one of the two.
        optimize_gramian_computation: accepted for TorchJD's calls and without effect: jacflow
            always does what it asks (a Gramian-based ``A`` gets ``sum_t J_t J_t^T``, and the
            Jacobians are never concatenated); other aggregators get the concatenated matrix,
            where TorchJD refuses the option.

    Returns:
        The weights of the rows when ``A`` is a weighted aggregator (those its call used),
        else ``None``; also ``None`` for a subclass whose own ``forward`` does not ask for
        its ``weights``. They are in the dtype ``A`` computes in: float32 for float16 or
        bfloat16 ``.jac`` fields (as :meth:`jacflow.autogram.Engine.backward`'s; in half
        precision, large weights would overflow), else the ``.jac`` fields' (promoted) dtype.

    Example:
        >>> import torch
        >>> from jacflow import backward, jac_to_grad
        >>> from jacflow.aggregation import UPGrad
        >>> param = torch.tensor([1., 2.], requires_grad=True)
        >>> backward([torch.tensor([-1., 1.]) @ param, (param ** 2).sum()])
        >>> jac_to_grad([param], UPGrad())
        tensor([0.5000, 0.5000])
        >>> param.grad
        tensor([0.5000, 2.5000])
    """
    A = _resolve_aggregator(A, aggregator, optimize_gramian_computation)
    items = as_tensor_tuple(tensors, "tensors")
    check_non_empty(items, "tensors")
    check_unique(items, "tensors")
    check_flag(retain_jac, "retain_jac")
    check_real_inputs(items, "tensors")
    present = _with_jac(items)
    jacobians = [_checked_jac(items[i], i) for i in present]
    first = present[0]
    for i, jacobian in zip(present, jacobians):
        if jacobian.shape[0] != jacobians[0].shape[0]:
            raise ValueError(
                f"All `.jac` fields must have the same number of rows m: `tensors[{first}].jac` "
                f"has {jacobians[0].shape[0]}, `tensors[{i}].jac` has {jacobian.shape[0]}."
            )
    m = jacobians[0].shape[0]
    A.check_rows(m)
    warn_if_distributed()
    # (a tensor without `.jac` takes part as zeros, as in `backward(..., A=...)`: an aggregator
    # that reads the columns, as GradDrop's draw per coordinate, sees the same matrix)
    blocks = dict(zip(present, jacobians, strict=True))
    zeros = jacobians[0].dtype
    whole = [
        blocks[i] if i in blocks else t.new_zeros((m, *t.shape), dtype=zeros)
        for i, t in enumerate(items)
    ]
    all_updates, weights = aggregate_blocks(A, whole)
    written, updates = [items[i] for i in present], [all_updates[i] for i in present]
    # (updates with a graph, from `.jac` fields that hold one, are stored as gradients of a
    # differentiation that built a graph: each a tensor of its own, as autograd stores them)
    accumulate_grads(written, updates, create_graph=any(u.requires_grad for u in updates))
    if not retain_jac:
        for t in written:
            del t.jac  # type: ignore[attr-defined]
    return weights
