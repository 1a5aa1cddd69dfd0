"""The engine on a ``DistributedDataParallel`` model: two CPU processes (gloo), against the
replicas' brute-force Jacobians gathered from both."""

from __future__ import annotations

import datetime
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from jacflow import mtl_backward
from jacflow.aggregation import GramianWeighting, UPGrad, UPGradWeighting
from jacflow.autogram import Engine, mtl_gramian_step

WORLD = 2

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is missing")


def _jacobian(losses: torch.Tensor, params: list[nn.Parameter]) -> torch.Tensor:
    rows = []
    for loss in losses.reshape(-1):
        grads = torch.autograd.grad(loss, params, retain_graph=True)
        rows.append(torch.cat([g.to_dense().reshape(-1) for g in grads]))
    return torch.stack(rows)


def _gathered(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(parts, t.contiguous())
    return torch.stack(parts)


def _model() -> tuple[nn.Module, nn.ModuleList]:
    torch.manual_seed(0)  # (the same initial weights on every replica)
    trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5)).double()
    heads = nn.ModuleList([nn.Linear(5, 1) for _ in range(3)]).double()
    return trunk, heads


def _grads(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]


def _per_sample(rank: int) -> None:
    trunk, heads = _model()
    model = nn.Sequential(trunk, heads[0])
    params = list(model.parameters())
    ddp = DistributedDataParallel(model)
    engine = Engine(ddp, batch_dim=0)
    torch.manual_seed(1 + rank)  # (each replica its own samples)
    batches = [torch.randn(5, 4, dtype=torch.float64) for _ in range(2)]
    updates = []
    for x in batches:
        losses = model(x).squeeze(1).sin()
        jacobian = _jacobian(losses, params)
        updates.append(UPGradWeighting()(jacobian @ jacobian.T) @ jacobian)
    # a step under no_sync() keeps its update local; the synchronised one averages both
    with ddp.no_sync():
        engine.backward(ddp(batches[0]).squeeze(1).sin(), UPGradWeighting())
    torch.testing.assert_close(_grads(params), updates[0])
    engine.backward(ddp(batches[1]).squeeze(1).sin(), UPGradWeighting())
    expected = _gathered(updates[0] + updates[1]).mean(0)
    torch.testing.assert_close(_grads(params), expected)
    replicas = _gathered(_grads(params))
    assert torch.equal(replicas[0], replicas[1])  # (bit for bit: the replicas stay the same)


def _weights_then_ddp_backward(rank: int) -> None:
    """The frameworks' route (docs/integrations.md): the Gramian of the wrapped model's losses,
    then DDP's own backward of ``losses @ w``, which averages the replicas' updates."""
    trunk, heads = _model()
    model = nn.Sequential(trunk, heads[0])
    params = list(model.parameters())
    ddp = DistributedDataParallel(model)
    engine = Engine(model, batch_dim=0)  # (the inner model: its replica's own Gramian)
    torch.manual_seed(1 + rank)
    x = torch.randn(5, 4, dtype=torch.float64)
    losses = ddp(x).squeeze(1).sin()
    jacobian = _jacobian(losses, params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the Gramian of its own replica: meant, no warning)
        gramian = engine.compute_gramian(losses)
    torch.testing.assert_close(gramian, jacobian @ jacobian.T)
    weights = UPGradWeighting()(gramian)
    (losses @ weights).backward()
    torch.testing.assert_close(_grads(params), _gathered(weights @ jacobian).mean(0))
    # The engine's own step without the wrapper keeps each replica's update: it warns.
    model.zero_grad()
    with pytest.warns(UserWarning, match="no DistributedDataParallel wrapper") as record:
        engine.backward(ddp(x).squeeze(1).sin(), UPGradWeighting())
    assert record[0].filename == __file__  # (at the caller's line, not jacflow's)
    torch.testing.assert_close(_grads(params), weights @ jacobian)
    engine.remove()


def _per_task(rank: int) -> None:
    trunk, heads = _model()
    shared, specific = list(trunk.parameters()), list(heads.parameters())
    ddp = DistributedDataParallel(nn.ModuleList([trunk, heads]))
    engine = Engine(trunk, batch_dim=None, ddp=ddp)  # (the trunk only; the wrapper holds both)
    torch.manual_seed(1 + rank)
    x = torch.randn(7, 4, dtype=torch.float64)
    features = trunk(x)
    losses = torch.stack([head(features).pow(2).mean() for head in heads])
    jacobian = _jacobian(losses, shared)
    head_grads = torch.cat(
        [g.reshape(-1) for g in torch.autograd.grad(losses.sum(), specific, retain_graph=True)]
    )
    weights = mtl_gramian_step(losses, engine, UPGradWeighting(), tasks_params=specific)
    jacobians = _gathered(jacobian)
    gramian = (jacobians @ jacobians.mT).mean(0)
    torch.testing.assert_close(weights, UPGradWeighting()(gramian))
    torch.testing.assert_close(_grads(shared), weights @ jacobians.mean(0))
    torch.testing.assert_close(_grads(specific), _gathered(head_grads).mean(0))


class _Branches(nn.Module):
    def __init__(self, trunk: nn.Module, heads: nn.ModuleList) -> None:
        super().__init__()
        self.trunk, self.heads = trunk, heads

    def forward(self, x: torch.Tensor, head: int) -> torch.Tensor:
        return self.heads[head](self.trunk(x)).squeeze(1)


def _branches(rank: int) -> None:
    """Each replica's losses reach another head (a head reached on no replica keeps no
    ``.grad``): the collectives still match, and each head gets half its replica's update."""
    trunk, heads = _model()
    model = _Branches(trunk, heads)
    torch.manual_seed(1 + rank)
    x = torch.randn(5, 4, dtype=torch.float64)
    used = [*trunk.parameters(), *heads[rank].parameters()]
    jacobian = _jacobian(model(x, rank).sin(), used)
    update = UPGradWeighting()(jacobian @ jacobian.T) @ jacobian
    ran: list[int] = []
    for k, head in enumerate(heads):
        head.weight.register_post_accumulate_grad_hook(lambda p, k=k: ran.append(k))
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    engine = Engine(ddp, batch_dim=0)
    engine.backward(ddp(x, rank).sin(), UPGradWeighting())
    assert ran == [rank]  # (not the other replica's head, whose .grad is written here too)
    updates = _gathered(update)  # [replica, trunk + its head]
    trunk_size = sum(p.numel() for p in trunk.parameters())
    torch.testing.assert_close(_grads(list(trunk.parameters())), updates[:, :trunk_size].mean(0))
    for replica in range(WORLD):
        torch.testing.assert_close(
            _grads(list(heads[replica].parameters())), updates[replica, trunk_size:] / WORLD
        )
    assert all(p.grad is None for p in heads[2].parameters())
    ddp.zero_grad()
    engine.backward(ddp(x, rank).sin(), UPGradWeighting())  # (DDP's next forward: no error)
    torch.testing.assert_close(_grads(list(trunk.parameters())), updates[:, :trunk_size].mean(0))


def _sparse_and_refusals(rank: int) -> None:
    """A sparse embedding's ``.grad`` stays sparse (``SparseAdam`` needs it) and is the
    replicas' average; a parameter the wrapper ignores keeps its own update; a ``ddp`` that
    does not wrap the engine's modules, and per-task steps with other numbers of losses on the
    replicas, are refused on every replica."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Flatten(), nn.Linear(6, 1))
    model = model.double()
    params = list(model.parameters())
    torch.manual_seed(1 + rank)
    tokens = torch.randint(0, 10, (4, 2))
    jacobian = _jacobian(model(tokens).squeeze(1).sin(), params)
    update = UPGradWeighting()(jacobian @ jacobian.T) @ jacobian
    ddp = DistributedDataParallel(model)
    engine = Engine(ddp, batch_dim=0)
    engine.backward(ddp(tokens).squeeze(1).sin(), UPGradWeighting())
    table = model[0].weight.grad
    assert table is not None and table.is_sparse
    assert table.sparse_dim() == 1  # (by rows, as autograd's: it was by entries, and adding a
    # plain backward's gradient or an engine step's under no_sync() to it failed)
    grads = torch.cat([p.grad.to_dense().reshape(-1) for p in params])  # type: ignore[union-attr]
    torch.testing.assert_close(grads, _gathered(update).mean(0))
    with ddp.no_sync():
        engine.backward(ddp(tokens).squeeze(1).sin(), UPGradWeighting())
    ddp(tokens).squeeze(1).sin().sum().backward()  # (DDP's own: averages the accumulated .grad)
    plain = _jacobian(model(tokens).squeeze(1).sin().sum()[None], params)[0]
    grads = torch.cat([p.grad.to_dense().reshape(-1) for p in params])  # type: ignore[union-attr]
    expected = _gathered(update).mean(0) + _gathered(update + plain).mean(0)
    torch.testing.assert_close(grads, expected)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1)).double()
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["1.bias"])
    ddp = DistributedDataParallel(model)
    torch.manual_seed(1 + rank)
    x = torch.randn(4, 3, dtype=torch.float64)
    Engine(ddp, batch_dim=0).backward(ddp(x).squeeze(1) * (1 + rank), UPGradWeighting())
    bias, weight = _gathered(model[1].bias.grad), _gathered(model[1].weight.grad)  # type: ignore[arg-type]
    assert not torch.equal(bias[0], bias[1]) and torch.equal(weight[0], weight[1])
    trunk, heads = _model()
    with pytest.raises(ValueError, match="does not wrap"):
        Engine(trunk, batch_dim=None, ddp=ddp)
    engine = Engine(trunk, batch_dim=None, ddp=DistributedDataParallel(nn.ModuleList([trunk])))
    features = trunk(torch.randn(3, 4, dtype=torch.float64))
    losses = torch.stack([head(features).sum() for head in heads[: 2 + rank]])
    with pytest.raises(ValueError, match="different numbers of losses"):
        mtl_gramian_step(losses, engine, UPGradWeighting())
    assert all(p.grad is None for p in trunk.parameters())


class _Broken(GramianWeighting):
    def forward(self, stat: torch.Tensor) -> torch.Tensor:
        return stat.new_ones(1)  # (the wrong shape: refused by the step)


def _one_fails(rank: int) -> None:
    """A step that fails on one replica (a refusal of its own) is abandoned on every replica
    with a clear error, not left waiting in a collective; ``.grad`` is left as it was, and the
    next step is exact on both."""
    trunk, heads = _model()
    model = nn.Sequential(trunk, heads[0])
    ddp = DistributedDataParallel(model)
    engine = Engine(ddp, batch_dim=0)
    torch.manual_seed(1 + rank)
    x = torch.randn(5, 4, dtype=torch.float64)
    weighting = _Broken() if rank == 1 else UPGradWeighting()
    error, match = (ValueError, "weights") if rank == 1 else (RuntimeError, "another replica")
    with pytest.raises(error, match=match):
        engine.backward(ddp(x).squeeze(1), weighting)
    assert all(p.grad is None for p in model.parameters())
    engine.backward(ddp(x).squeeze(1), UPGradWeighting())
    replicas = _gathered(_grads(list(model.parameters())))
    assert torch.equal(replicas[0], replicas[1])
    # per task, a failure before the Gramian's meeting (no hooked call in the losses)
    shared = DistributedDataParallel(nn.ModuleList([trunk, heads]))
    engine = Engine(trunk, batch_dim=None, ddp=shared)
    features = trunk(x) if rank == 0 else torch.randn(5, 5, dtype=torch.float64)
    losses = torch.stack([head(features).sum() for head in heads])
    error, match = (RuntimeError, "another replica" if rank == 0 else "No forward call")
    with pytest.raises(error, match=match):
        mtl_gramian_step(losses, engine, UPGradWeighting())
    # mtl_backward's own checks before the step (the same loss twice on one replica)
    features = trunk(x)
    losses_list = [head(features).sum() for head in heads]
    if rank == 1:
        losses_list[2] = losses_list[0]
    error, match = (RuntimeError, "another replica") if rank == 0 else (ValueError, "distinct")
    with pytest.raises(error, match=match):
        mtl_backward(losses_list, features, A=UPGrad(), engine=engine)
    # a parameter hook that returns another shape, refused before the averaging
    hook = trunk[0].bias.register_hook(lambda g: g[:1] if rank == 1 else g)
    features = trunk(x)
    error, match = (RuntimeError, "another replica") if rank == 0 else (ValueError, "hook")
    with pytest.raises(error, match=match):
        mtl_backward([head(features).sum() for head in heads], features, A=UPGrad(), engine=engine)
    hook.remove()
    with pytest.raises(ValueError, match="static_graph"):
        Engine(DistributedDataParallel(nn.Linear(2, 1), static_graph=True), batch_dim=0)


class _Inside(nn.Module):
    """A forward that returns the trunk's features and, beside them, the task losses."""

    def __init__(self, trunk: nn.Module, heads: nn.ModuleList) -> None:
        super().__init__()
        self.trunk, self.heads = trunk, heads

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        features = self.trunk(x)
        return features, [head(features).pow(2).mean() for head in self.heads]


def _find_unused(rank: int) -> None:
    """DDP(find_unused_parameters=True) passes every output of its forward through one node:
    losses computed inside that forward do not read the features it returns, which is
    refused with that reason (the message spoke of a shared parameter used outside the
    features); with the heads outside the forward the step is the one of find_unused=False."""
    torch.manual_seed(1 + rank)
    x = torch.randn(7, 4, dtype=torch.float64)
    trunk, heads = _model()
    ddp = DistributedDataParallel(_Inside(trunk, heads), find_unused_parameters=True)
    features, losses = ddp(x)
    with pytest.raises(ValueError, match="find_unused_parameters=True"):
        mtl_backward(losses, features, A=UPGrad())
    assert all(p.grad is None for p in trunk.parameters())
    updates = []
    for find_unused in (False, True):
        trunk, heads = _model()
        ddp = DistributedDataParallel(trunk, find_unused_parameters=find_unused)
        features = ddp(x)
        mtl_backward([head(features).pow(2).mean() for head in heads], features, A=UPGrad())
        updates.append(_grads([*trunk.parameters(), *heads.parameters()]))
    torch.testing.assert_close(updates[1], updates[0])


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),  # (a hang fails the test, not the whole run)
    )
    try:
        _per_sample(rank)
        _weights_then_ddp_backward(rank)
        _per_task(rank)
        _branches(rank)
        _sparse_and_refusals(rank)
        _one_fails(rank)
        _find_unused(rank)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Every check passed on both replicas. Torch's teardown of a gloo group whose DDP reducers
    # are still alive sometimes aborts the process ("terminate called without an active
    # exception", about one run in ten): leave without it.
    os._exit(0)


def _free_port() -> int:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    except OSError as error:  # (a machine without a loopback network)
        pytest.skip(f"no local socket for the two processes: {error}")


def test_ddp_replicas_get_the_averaged_update() -> None:
    """Per sample, each replica's UPGrad update of its own samples, averaged (with what was
    accumulated under ``no_sync()``, where nothing is averaged); per task, the weights of the
    replicas' average Gramian on every replica and ``w^T`` times their average Jacobian; the
    task parameters the replicas' average gradient of the losses' sum."""
    mp.spawn(_worker, args=(_free_port(),), nprocs=WORLD, join=True)


def test_ddp_must_be_the_wrapper() -> None:
    model = nn.Linear(2, 1)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        Engine(model, batch_dim=0, ddp=model)  # type: ignore[arg-type]
    assert not model._forward_hooks and not model._forward_pre_hooks  # (nothing hooked)
