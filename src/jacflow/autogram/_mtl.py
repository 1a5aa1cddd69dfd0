"""Multi-task Jacobian descent through the per-task engine."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from jacflow._labels import received
from jacflow.aggregation import GramianWeighting
from jacflow.autogram._engine import Engine, TaskLayout


def mtl_gramian_step(
    losses: Tensor,
    engine: Engine,
    weighting: GramianWeighting,
    *,
    tasks_params: Iterable[Tensor] = (),
    retain_graph: bool = False,
) -> Tensor:
    """One multi-task JD step on a shared trunk, at about ``(m + 2) / 3`` SGD steps.

    ``engine`` must have been created with ``batch_dim=None`` on the shared trunk's modules
    before the forward pass. One backward, batched over the ``m`` task losses, gives every
    task's gradient w.r.t. every trunk layer's output (no weight gradients); per-layer closed
    forms give the ``m x m`` Gramian; the trunk receives ``sum_k w_k grad(loss_k)`` from the
    stored layer inputs (book-keeping); ``tasks_params`` (the task heads) receive the plain
    gradient of ``losses.sum()`` from the same backward (those with gradient hooks from a
    backward of their own, so that the hooks see that sum, as in ``losses.sum().backward()``).

    Args:
        losses: the ``m`` task losses (any shape, ``m = losses.numel()``).
        engine: a per-task :class:`Engine` hooked on the shared modules.
        weighting: the Gramian weighting (e.g. ``UPGradWeighting()``).
        tasks_params: task-specific parameters (frozen ones and repeats are skipped).
        retain_graph: keep the graph of ``losses`` for another differentiation.

    Returns:
        The weights of the tasks, with the shape of ``losses``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from jacflow.autogram import Engine, mtl_gramian_step
        >>> from jacflow.aggregation import UPGradWeighting
        >>> _ = torch.manual_seed(0)
        >>> trunk, heads = nn.Linear(3, 4), nn.ModuleList([nn.Linear(4, 1) for _ in range(2)])
        >>> engine = Engine(trunk, batch_dim=None)
        >>> features = trunk(torch.randn(6, 3))
        >>> losses = torch.stack([head(features).pow(2).mean() for head in heads])
        >>> w = mtl_gramian_step(losses, engine, UPGradWeighting(), tasks_params=heads.parameters())
        >>> w.shape, trunk.weight.grad.shape, heads[0].weight.grad.shape
        (torch.Size([2]), torch.Size([4, 3]), torch.Size([1, 4]))
    """
    return per_task_step(losses, engine, weighting, tasks_params, retain_graph)


def per_task_step(
    losses: Tensor,
    engine: Engine,
    weighting: GramianWeighting,
    tasks_params: Iterable[Tensor],
    retain_graph: bool,
    layout: TaskLayout | None = None,
) -> Tensor:
    """:func:`mtl_gramian_step`, with what ``mtl_backward`` knows of the tasks (see
    :class:`TaskLayout`)."""
    if not isinstance(engine, Engine):
        raise TypeError(f"`engine` must be a jacflow.autogram.Engine, received {received(engine)}.")
    if engine.batch_dim is not None:
        raise ValueError(
            "A per-task step (mtl_gramian_step, or mtl_backward with `engine=`) needs a per-task "
            f"engine: create it with batch_dim=None, received an engine with "
            f"batch_dim={engine.batch_dim}."
        )
    return engine._step(losses, weighting, (), tasks_params, retain_graph, layout)
