"""Writing results into ``.grad`` and ``.jac``: always the last step of a public call."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def check_jac_accumulable(tensors: Sequence[Tensor], rows: int, name: str) -> None:
    """Fail before computing anything if an existing ``.jac`` cannot take ``rows`` new rows."""
    for i, tensor in enumerate(tensors):
        existing = getattr(tensor, "jac", None)
        shape = (rows, *tensor.shape)
        if existing is not None and tuple(existing.shape) != shape:
            raise ValueError(
                f"Cannot accumulate a Jacobian of shape {shape} into the `.jac` of `{name}[{i}]`, "
                f"which already holds shape {tuple(existing.shape)} (a different "
                "number of rows). Delete the old `.jac` first (`del t.jac`) or call "
                "`jac_to_grad` before the next `backward`."
            )


def accumulate_jacs(tensors: Sequence[Tensor], jacobians: Sequence[Tensor]) -> None:
    for tensor, jac in zip(tensors, jacobians):
        existing = getattr(tensor, "jac", None)
        tensor.jac = jac if existing is None else existing + jac  # type: ignore[attr-defined]


def _readable_grad(tensor: Tensor) -> Tensor | None:
    if not tensor.is_leaf and not tensor.retains_grad:
        tensor.retain_grad()  # like torch.autograd.backward(inputs=...) on a non-leaf
    return tensor.grad


def accumulate_grads(tensors: Sequence[Tensor], updates: Sequence[Tensor]) -> None:
    for tensor, update in zip(tensors, updates):
        update = update.to(tensor.dtype)
        existing = _readable_grad(tensor)
        if existing is None:
            tensor.grad = update
        elif update.requires_grad or existing.requires_grad:
            tensor.grad = existing + update
        else:
            with torch.no_grad():
                existing.add_(update)
