"""A tiny 3-task least-squares problem and a training loop to run a scalarizer and a hand-written
reference of its update rule side by side."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

_GEN = torch.Generator().manual_seed(1234)
_X = torch.randn(3, 4, 3, generator=_GEN, dtype=torch.float64)  # 3 batches of 4 inputs
_Y = torch.randn(3, 4, 3, generator=_GEN, dtype=torch.float64)  # one target column per task


def task_losses(theta: Tensor, batch: int) -> Tensor:
    """Three positive losses ``mean((X theta - y_i)^2) + 0.05`` sharing ``theta`` in R^3."""
    prediction = _X[batch] @ theta
    return ((prediction[:, None] - _Y[batch]) ** 2).mean(dim=0) + 0.05


class Method(Protocol):
    def __call__(self, losses: Tensor, /) -> Tensor: ...


def train(
    method: Method,
    *,
    epochs: int = 3,
    batches: int = 2,
    lr: float = 0.05,
    after_step: Callable[[Tensor], None] | None = None,
    end_epoch: Callable[[], None] | None = None,
) -> tuple[list[float], Tensor]:
    """SGD on ``theta`` with the scalarized loss; returns the values of every step and the final
    ``theta``. ``after_step`` receives the losses recomputed on the same batch after the step."""
    theta = torch.tensor([0.5, -0.3, 0.8], dtype=torch.float64, requires_grad=True)
    values = []
    for _ in range(epochs):
        for batch in range(batches):
            value = method(task_losses(theta, batch))
            values.append(value.item())
            (grad,) = torch.autograd.grad(value, theta)
            with torch.no_grad():
                theta -= lr * grad
            if after_step is not None:
                with torch.no_grad():
                    after_step(task_losses(theta, batch))
        if end_epoch is not None:
            end_epoch()
    return values, theta.detach()


def weighted(losses: Tensor, weights: list[float]) -> Tensor:
    """``sum(w_i * L_i)`` with constant Python weights (the references' way to scalarize)."""
    return sum((w * loss for w, loss in zip(weights, losses)), torch.zeros((), dtype=losses.dtype))
