"""The engine on a model wrapped in ``DistributedDataParallel`` (DDP): the step takes DDP's part.

DDP averages the replicas' gradients in hooks that autograd runs during ``backward``. The
engine writes ``.grad`` without that backward (its capture pulls gradients back to the layers'
outputs only), so each replica would keep its own update and the replicas would drift apart,
silently. Given a DDP wrapper, the step averages what DDP would have averaged:

* per task, the ``m x m`` Gramian is averaged over the replicas before the weighting, so that
  every replica uses the same weights, and the update is ``w^T`` times the replicas' average
  Jacobian, exactly. The weights are those of the average Gramian ``mean_r J_r J_r^T``, which
  adds the spread between the replicas to the whole batch's ``J J^T``: not those of one
  process on the whole batch, and the update may conflict with a task's gradient on the whole
  batch (the cross terms ``J_r J_s^T`` would need every replica's per-layer tensors);
* per sample, each replica weighs its own samples (the Gramian of the global batch would need
  every replica's per-sample gradients) and the updates are averaged, as DDP averages the
  gradients of the replicas' losses;
* the ``.grad`` written is the replicas' average of their accumulated ``.grad``, as after DDP's
  synchronised backward (gradients accumulated under ``no_sync()`` included); under
  ``no_sync()`` nothing is communicated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel


def wrappers_in(modules: Sequence[nn.Module]) -> list[DistributedDataParallel]:
    """The DDP wrappers among ``modules`` and their submodules, once each; refused when they do
    not share one process group (the Gramian of a per-task step is averaged over one).

    Example:
        >>> from torch import nn
        >>> from jacflow.autogram._distributed import wrappers_in
        >>> wrappers_in([nn.Sequential(nn.Linear(2, 2))])
        []
    """
    found: dict[int, DistributedDataParallel] = {}
    for root in modules:  # (anything else is refused with the engine's other checks)
        for sub in root.modules() if isinstance(root, nn.Module) else ():
            if isinstance(sub, DistributedDataParallel):
                found.setdefault(id(sub), sub)
    wrappers = list(found.values())
    if len({id(w.process_group) for w in wrappers}) > 1:
        raise ValueError(
            "The modules given to the Engine hold DistributedDataParallel wrappers on different "
            "process groups; the step averages over one. Wrap the model once."
        )
    return wrappers


def check_wrapped(modules: Sequence[nn.Module], ddp: DistributedDataParallel) -> None:
    """Refuse a ``ddp`` that does not wrap the given modules: their updates would not be
    averaged, while a per-task Gramian would be."""
    wrapped = {id(p) for p in ddp.module.parameters()}
    outside = [
        name
        for i, module in enumerate(modules)
        if isinstance(module, nn.Module)  # (anything else is refused with the other checks)
        for name, param in module.named_parameters(prefix=f"modules[{i}]")
        if id(param) not in wrapped
    ]
    if outside:
        raise ValueError(
            f"`ddp` does not wrap the modules given to the Engine ({outside[0]} is not one of "
            "its parameters): give the DistributedDataParallel that wraps the model they "
            "belong to."
        )


def synchronizing(wrappers: Sequence[DistributedDataParallel]) -> bool:
    """Whether this step averages over the replicas (not inside ``no_sync()``)."""
    return any(w.require_backward_grad_sync for w in wrappers)


def averaged_gramian(gramian: Tensor, wrappers: Sequence[DistributedDataParallel]) -> Tensor:
    """The replicas' average of their Gramians (per task: the same ``m`` losses on each,
    checked first, on every replica, by one small all-reduce)."""
    group = wrappers[0].process_group
    m = gramian.shape[0]
    sizes = torch.tensor([m, -m], dtype=torch.int64, device=gramian.device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    largest, smallest = int(sizes[0]), -int(sizes[1])
    if largest != smallest:
        raise ValueError(
            f"The replicas' per-task steps have different numbers of losses ({smallest} to "
            f"{largest}; this one {m}): their Gramians cannot be averaged. Give every replica "
            "the same tasks."
        )
    total = gramian.contiguous().clone()
    dist.all_reduce(total, group=group)
    return total / dist.get_world_size(group)


def averaged_grads(
    updates: list[tuple[Tensor, Tensor]], wrappers: Sequence[DistributedDataParallel]
) -> tuple[list[tuple[Tensor, Tensor]], list[tuple[Tensor, Tensor]]]:
    """``(written, rest)``: the new ``.grad`` of the wrapped parameters, the replicas' average
    of ``.grad + update`` (to be written as they are: every replica then holds the same
    values, bit for bit), and the other parameters' updates as they are.

    Every replica sends every trainable wrapped parameter, in the wrapper's order, with a flag
    of whether it has a gradient there (an update or a ``.grad``; zeros where not): the
    collectives then match whatever each replica's losses reached, and a parameter that none
    reached keeps no ``.grad``. One all-reduce per dtype and device, in full precision (a
    communication hook registered on the wrapper is not applied), of dense tensors: a sparse
    embedding's table is sent whole, and its ``.grad`` written sparse again. The parameters the
    wrapper ignores (``parameters_to_ignore``) are left to the caller, as DDP leaves them."""
    own: dict[int, Tensor] = {}
    rest: list[tuple[Tensor, Tensor]] = []
    wrapped = {
        id(p): p
        for w in wrappers
        for name, p in w.module.named_parameters()
        if p.requires_grad and name not in w.parameters_to_ignore  # (DDP leaves those alone)
    }
    # (decided by the module, not the update: the same layout on every replica)
    sparse = {
        id(sub.weight)
        for w in wrappers
        for sub in w.module.modules()
        if isinstance(sub, nn.Embedding) and sub.sparse
    }
    for param, grad in updates:
        if id(param) not in wrapped:
            rest.append((param, grad))
            continue
        dense = _dense(grad).reshape(param.shape)
        own[id(param)] = dense if id(param) not in own else own[id(param)] + dense
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for param in wrapped.values():
        by_kind.setdefault((param.dtype, param.device), []).append(param)
    group = wrappers[0].process_group
    size = dist.get_world_size(group)
    written: list[tuple[Tensor, Tensor]] = []
    for params in by_kind.values():
        pieces, flags = [], []
        for param in params:
            total = own.get(id(param))
            if param.grad is not None:  # (DDP averages the accumulated .grad)
                previous = _dense(param.grad)
                total = previous if total is None else total + previous
            flags.append(0.0 if total is None else 1.0)
            pieces.append(torch.zeros_like(param) if total is None else total)
        flat = torch.cat([*(t.reshape(-1) for t in pieces), pieces[0].new_tensor(flags)])
        dist.all_reduce(flat, group=group)
        flat /= size
        split = flat.split([*(t.numel() for t in pieces), len(flags)])
        for param, mean, reached in zip(params, split[:-1], split[-1].tolist(), strict=True):
            if reached == 0:
                continue
            grad = mean.view(param.shape).clone()
            if id(param) in sparse and (param.grad is None or param.grad.is_sparse):
                grad = grad.to_sparse()
            written.append((param, grad))
    return written, rest


def _dense(grad: Tensor) -> Tensor:
    return grad.to_dense() if grad.is_sparse else grad
