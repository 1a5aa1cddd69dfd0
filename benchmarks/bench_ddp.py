"""The Gramian engine under DistributedDataParallel against a plain DDP step, one run.

Two CPU processes (gloo on 127.0.0.1), 1 torch thread each; each replica has its own batch.
Wall time per step (the collectives are part of it), rank 0's median over interleaved rounds,
each step started after a barrier; ratios to the plain DDP SGD step of the same run.

* per sample (an MLP, ``B`` samples per replica, cross-entropy): ``sgd`` = the mean loss's
  ``backward()`` through DDP + ``SGD.step``; ``jacflow`` = ``Engine(ddp, batch_dim=0)
  .backward(losses, UPGradWeighting())`` (each replica weighs its samples, the updates are
  averaged); ``jacflow, mean`` = the same with ``MeanWeighting`` (the engine and the averaging
  without the UPGrad QP);
* per task (a trunk of 3 Linear+ReLU, ``m`` heads, MSE): ``sgd`` = ``losses.sum().backward()``
  through DDP; ``jacflow`` = ``Engine(trunk, batch_dim=None, ddp=ddp)`` + ``mtl_gramian_step``
  (the replicas' Gramians averaged, then the update).

TorchJD 0.18 is not timed: its steps on a DDP model do not synchronise the replicas at all
(``docs/performance.md``), so they are not the same work.

Run: ``.venv/bin/python benchmarks/bench_ddp.py [--rounds 31]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _timing import interleaved_medians

from jacflow.aggregation import MeanWeighting, UPGradWeighting
from jacflow.autogram import Engine, mtl_gramian_step

WORLD = 2
Step = Callable[[], object]


def _mlp(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def _per_sample_step(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor, method: str) -> Step:
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    if method == "sgd":

        def step() -> None:
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()

        return step
    engine = Engine(ddp, batch_dim=0)
    weighting = UPGradWeighting() if method == "jacflow" else MeanWeighting()

    def engine_step() -> None:
        opt.zero_grad()
        engine.backward(F.cross_entropy(ddp(x), y, reduction="none"), weighting)
        opt.step()

    return engine_step


def per_sample_steps(rank: int, width: int, batch: int) -> dict[str, Step]:
    """Fresh model per method (the same initial weights), each replica its own batch."""
    steps: dict[str, Step] = {}
    for method in ("sgd", "jacflow", "jacflow, mean"):
        torch.manual_seed(0)
        model = _mlp(width)
        torch.manual_seed(1 + rank)
        x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
        steps[method] = _per_sample_step(DistributedDataParallel(model), x, y, method)
    return steps


class _Tasks(nn.Module):
    def __init__(self, width: int, m: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(3):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.trunk = nn.Sequential(*layers)
        self.heads = nn.ModuleList([nn.Linear(width, 1) for _ in range(m)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.trunk(x)
        return torch.cat([head(features) for head in self.heads], dim=1)


def _per_task_step(model: _Tasks, x: torch.Tensor, y: torch.Tensor, method: str) -> Step:
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if method == "sgd":

        def step() -> None:
            opt.zero_grad()
            (ddp(x) - y).pow(2).mean(dim=0).sum().backward()
            opt.step()

        return step
    engine = Engine(model.trunk, batch_dim=None, ddp=ddp)
    heads, weighting = list(model.heads.parameters()), UPGradWeighting()

    def engine_step() -> None:
        opt.zero_grad()
        losses = (ddp(x) - y).pow(2).mean(dim=0)
        mtl_gramian_step(losses, engine, weighting, tasks_params=heads)
        opt.step()

    return engine_step


def per_task_steps(rank: int, width: int, batch: int, m: int) -> dict[str, Step]:
    steps: dict[str, Step] = {}
    for method in ("sgd", "jacflow"):
        torch.manual_seed(0)
        model = _Tasks(width, m)
        torch.manual_seed(1 + rank)
        x, y = torch.randn(batch, width), torch.randn(batch, m)
        steps[method] = _per_task_step(model, x, y, method)
    return steps


def _timed(steps: dict[str, Step], rounds: int) -> dict[str, float]:
    """Median wall time (ms), interleaved, each step started after a barrier."""
    return interleaved_medians(steps, rounds, now=time.perf_counter, before=dist.barrier)


def _worker(rank: int, port: int, rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    rows = []
    for width, batch in [(256, 32), (256, 64), (1024, 64)]:
        times = _timed(per_sample_steps(rank, width, batch), rounds)
        rows.append(("per sample", f"MLP {width}, B = {batch} per replica", times))
    for m in (2, 6, 10):
        times = _timed(per_task_steps(rank, 256, 64, m), rounds)
        rows.append(("per task", f"width 256, B = 64 per replica, m = {m}", times))
    if rank == 0:
        print(f"torch {torch.__version__}, {WORLD} processes (gloo), 1 thread each, wall time")
        print()
        print("| mode | configuration | DDP SGD ms | jacflow | jacflow, mean |")
        print("|---|---|---|---|---|")
        for mode, config, times in rows:
            sgd = times["sgd"]
            mean = f"{times['jacflow, mean'] / sgd:.2f}x" if "jacflow, mean" in times else "-"
            print(f"| {mode} | {config} | {sgd:.1f} | {times['jacflow'] / sgd:.2f}x | {mean} |")
    dist.barrier()
    # (torch's teardown of a gloo group with DDP alive sometimes aborts the process)
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=31)
    args = parser.parse_args()
    mp.spawn(_worker, args=(_free_port(), args.rounds), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
