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

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import final

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from jacflow._warnings import caller_stacklevel


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
    check_dynamic(wrappers)
    if len({id(w.process_group) for w in wrappers}) > 1:
        raise ValueError(
            "The modules given to the Engine hold DistributedDataParallel wrappers on different "
            "process groups; the step averages over one. Wrap the model once."
        )
    return wrappers


def warn_without_wrapper() -> None:
    """Warn when several processes share the default process group and the engine was given
    no ``DistributedDataParallel`` wrapper: its step then writes each replica's own update
    (the replicas drift apart), as jacflow.backward, which warns the same."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    warnings.warn(
        f"torch.distributed runs {dist.get_world_size()} processes, and this Engine was given "
        "no DistributedDataParallel wrapper: its step writes each replica's own update, without "
        "DDP's averaging, and the replicas drift apart. Give it the wrapper: "
        "Engine(ddp_model, ...), or Engine(ddp_model.module.trunk, ..., ddp=ddp_model).",
        stacklevel=caller_stacklevel(),
    )


def check_dynamic(wrappers: Sequence[DistributedDataParallel]) -> None:
    """Refuse ``static_graph=True``: DDP then expects every iteration's backward to be its own,
    and after an engine step it stops averaging the plain backward passes, silently."""
    if any(w.static_graph for w in wrappers):
        raise ValueError(
            "DistributedDataParallel(static_graph=True) expects every iteration to run its own "
            "backward, which the engine's steps do not: after one, DDP stops averaging the "
            "plain backward passes. Build the wrapper without static_graph."
        )


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


@final
class Meetings:
    """The replicas' meeting points in a synchronised step. Every replica takes part in each
    meeting with whether its step has failed, so that a failure on one replica (a refusal of
    its own, an empty batch) is raised on all of them at the same point, instead of leaving the
    others waiting in the next collective (as DDP's own backward does) until the process
    group's timeout. One all-reduce of three integers per meeting.
    """

    def __init__(self, wrappers: Sequence[DistributedDataParallel]) -> None:
        self.group = wrappers[0].process_group
        nccl = dist.get_backend(self.group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        self.settled = False  # (a failure announced or seen: no more meetings in this step)

    def meet(self, tasks: int | None = None, last: bool = False) -> None:
        """Meet the other replicas; ``tasks``: this replica's number of per-task losses, which
        must be the same on all. Raises when a replica has failed or the numbers differ.
        After the ``last`` meeting, a failure is not announced (no replica waits for one)."""
        largest, smallest, failed = self._exchange(tasks, failed=False)
        self.settled = self.settled or last
        if failed:
            raise RuntimeError(
                "The step failed on another replica (its own error says why): it is abandoned "
                "on every replica, and .grad is left as it was."
            )
        if tasks is not None and largest != smallest:
            self.settled = True
            raise ValueError(
                f"The replicas' per-task steps have different numbers of losses ({smallest} to "
                f"{largest}; this one {tasks}): their Gramians cannot be averaged. Give every "
                "replica the same tasks."
            )

    def fail(self) -> None:
        """Announce this replica's failure at the next meeting (once per step)."""
        if not self.settled:
            self._exchange(None, failed=True)

    def _exchange(self, tasks: int | None, failed: bool) -> tuple[int, int, bool]:
        low = -(2**62)  # (no number of tasks: leaves the others' maximum and minimum)
        mine = [low, low] if tasks is None else [tasks, -tasks]
        message = torch.tensor([*mine, int(failed)], dtype=torch.int64, device=self.device)
        self.settled = True  # (a collective that raises is not met again)
        dist.all_reduce(message, op=dist.ReduceOp.MAX, group=self.group)
        largest, negated_smallest, anyone_failed = (int(x) for x in message.tolist())
        self.settled = bool(anyone_failed)
        return largest, -negated_smallest, bool(anyone_failed)


@contextlib.contextmanager
def meetings_of(wrappers: Sequence[DistributedDataParallel]) -> Iterator[Meetings | None]:
    """The meetings of a step (``None`` when it averages nothing: no wrapper, or inside
    ``no_sync()``); a failure inside is announced to the other replicas before it goes on."""
    check_dynamic(wrappers)  # (static_graph may be set after the engine was created)
    meetings = Meetings(wrappers) if wrappers and synchronizing(wrappers) else None
    try:
        yield meetings
    except Exception:
        if meetings is not None:
            meetings.fail()
        raise


def averaged_gramian(gramian: Tensor, wrappers: Sequence[DistributedDataParallel]) -> Tensor:
    """The replicas' average of their Gramians (per task: the same ``m`` losses on each, which
    the caller's meeting has checked)."""
    group = wrappers[0].process_group
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
                grad = grad.to_sparse(1)  # (by rows, as autograd writes an embedding's)
            written.append((param, grad))
    return written, rest


def _dense(grad: Tensor) -> Tensor:
    return grad.to_dense() if grad.is_sparse else grad
