"""``jac_to_grad``: aggregate the ``.jac`` fields of tensors into their ``.grad`` fields."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from jacflow.aggregation import Aggregator
from jacflow.autojac._accumulate import accumulate_grads
from jacflow.autojac._aggregate import aggregate_blocks
from jacflow.autojac._checks import as_tensor_tuple, check_non_empty


def jac_to_grad(
    tensors: Iterable[Tensor], A: Aggregator, *, retain_jac: bool = False
) -> Tensor | None:
    """Aggregate the Jacobians stored in ``t.jac`` into ``t.grad`` for every ``t`` in ``tensors``.

    The ``.jac`` fields (``[m, *t.shape]``, same ``m`` for all) form the column blocks of one
    ``[m, n]`` Jacobian; ``A`` reduces it to one update that is accumulated into ``.grad``.
    Gramian-based aggregators never see the concatenated matrix (``G = sum_t J_t J_t^T``).
    Call it several times on groups of tensors with separate aggregators to aggregate per
    layer or per network.

    Args:
        tensors: the tensors whose ``.jac`` to aggregate (e.g. ``model.parameters()``).
        A: the aggregator.
        retain_jac: keep the ``.jac`` fields (default: delete them to free memory).

    Returns:
        The weights of the rows when ``A`` is a weighted aggregator, else ``None``.

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
    if not isinstance(A, Aggregator):
        raise TypeError(
            f"`A` must be a jacflow.aggregation.Aggregator (e.g. UPGrad()), received {type(A)}."
        )
    items = as_tensor_tuple(tensors, "tensors")
    check_non_empty(items, "tensors")
    jacobians: list[Tensor] = []
    for i, t in enumerate(items):
        jacobian = getattr(t, "jac", None)
        if jacobian is None:
            raise ValueError(
                f"`tensors[{i}]` (shape {tuple(t.shape)}) has no `.jac` field. Populate it "
                "with `jacflow.backward(...)` or `jacflow.mtl_backward(...)` without an "
                "aggregator first, and pass only tensors that the losses depend on."
            )
        if jacobians and jacobian.shape[0] != jacobians[0].shape[0]:
            raise ValueError(
                "All `.jac` fields must have the same number of rows m: `tensors[0].jac` has "
                f"{jacobians[0].shape[0]}, `tensors[{i}].jac` has {jacobian.shape[0]}."
            )
        jacobians.append(jacobian)
    updates, weights = aggregate_blocks(A, jacobians)
    accumulate_grads(items, updates)
    if not retain_jac:
        for t in items:
            del t.jac  # type: ignore[attr-defined]
    return weights
