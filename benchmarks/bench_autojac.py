"""autojac speed and memory: jacflow vs plain PyTorch vs TorchJD 0.18, in one run.

Speed: one step = zero grads + forward + backward, on a 3-layer MLP of width 1024 with m
losses; ``sum(losses).backward()`` (SGD) vs ``jacflow.backward(losses, A=Mean())`` vs TorchJD's
``backward(losses)`` + ``jac_to_grad(params, Mean())``. Then an overhead-bound step (a stack of
small transformer layers, one loss per sample), where jacflow's work in Python per call (the
walks of the graph, the writes of ``.grad``) shows: ``losses.mean().backward()`` vs
``jacflow.backward(losses, A=Mean())`` and ``A=UPGrad()`` vs TorchJD's ``backward(losses)`` +
``jac_to_grad(params, UPGrad())``; and an overhead-bound multi-task step (a small trunk,
``mtl_backward`` with UPGrad, against TorchJD's ``mtl_backward`` + ``jac_to_grad``).
Memory: peak RSS increase of ``jacflow.jac`` with m = 100 rows for ``parallel_chunk_size``
None vs 10, each in a fresh process.

Run: ``.venv/bin/python benchmarks/bench_autojac.py`` (TorchJD from the ``bench`` extra);
``--deep`` for the overhead-bound tables alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _timing import interleaved_medians, setup

import jacflow
from jacflow.aggregation import Mean, UPGrad

WIDTH, BATCH = 1024, 64


def _torchjd() -> tuple[ModuleType, ModuleType] | None:
    """TorchJD's ``autojac`` and ``aggregation`` modules (the ``bench`` extra), or ``None``
    where it is not installed: its columns then read nan."""
    try:
        import torchjd.aggregation as tagg
        import torchjd.autojac as tjd
    except ImportError:
        return None
    return tjd, tagg


def _torchjd_backward(
    model: nn.Module, losses: Callable[[], Any], params: list[torch.Tensor], aggregator: str
) -> Callable[[], None] | None:
    """TorchJD's step: its ``backward(losses)`` + ``jac_to_grad(params, <aggregator>())``."""
    peer = _torchjd()
    if peer is None:
        return None
    tjd, tagg = peer
    aggregate = getattr(tagg, aggregator)()

    def step() -> None:
        model.zero_grad()
        tjd.backward(losses(), inputs=params)
        tjd.jac_to_grad(params, aggregate)

    return step


def _mlp(m: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, m)
    )


def speed(m: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = _mlp(m)
    params = list(model.parameters())
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, m)

    def losses() -> list[torch.Tensor]:
        out = model(x)
        return [((out[:, i] - y[:, i]) ** 2).mean() for i in range(m)]

    def sgd() -> None:
        model.zero_grad()
        torch.stack(losses()).sum().backward()

    def ours() -> None:
        model.zero_grad()
        jacflow.backward(losses(), params, A=Mean())

    def ours_jacobian() -> None:
        # The full Jacobian path: every row is differentiated, then aggregated.
        model.zero_grad()
        jacflow.backward(losses(), params)
        jacflow.jac_to_grad(params, Mean())

    steps = {"sgd": sgd, "jacflow": ours, "jacflow_jacobian": ours_jacobian}
    theirs = _torchjd_backward(model, losses, params, "Mean")
    if theirs is not None:
        steps["torchjd"] = theirs
    return interleaved_medians(steps)


DEEP_LAYERS, DEEP_WIDTH, DEEP_BATCH, DEEP_TOKENS = 4, 64, 8, 16


def speed_deep() -> dict[str, float]:
    """The overhead-bound step (see the module's docstring): a few hundred autograd nodes, a few
    ms of compute."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(DEEP_WIDTH, 4, 2 * DEEP_WIDTH, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, DEEP_LAYERS, enable_nested_tensor=False)
    params = list(model.parameters())
    x = torch.randn(DEEP_BATCH, DEEP_TOKENS, DEEP_WIDTH)

    def losses() -> torch.Tensor:
        return model(x).pow(2).mean((1, 2))

    def sgd() -> None:
        model.zero_grad()
        losses().mean().backward()

    def ours_mean() -> None:
        model.zero_grad()
        jacflow.backward(losses(), A=Mean())

    def ours_upgrad() -> None:
        model.zero_grad()
        jacflow.backward(losses(), A=UPGrad())

    steps = {"sgd": sgd, "jacflow_mean": ours_mean, "jacflow_upgrad": ours_upgrad}
    theirs = _torchjd_backward(model, losses, params, "UPGrad")
    if theirs is not None:
        steps["torchjd_upgrad"] = theirs
    return interleaved_medians(steps, rounds=31)


SMALL_LAYERS, SMALL_WIDTH, SMALL_BATCH = 6, 64, 32


def speed_small_mtl(m: int) -> dict[str, float]:
    """An overhead-bound multi-task step: ``m`` one-output heads on a small trunk of Linear +
    ReLU layers, ``mtl_backward`` with UPGrad, no engine."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(SMALL_LAYERS):
        layers += [nn.Linear(SMALL_WIDTH, SMALL_WIDTH), nn.ReLU()]
    trunk = nn.Sequential(*layers)
    heads = nn.ModuleList([nn.Linear(SMALL_WIDTH, 1) for _ in range(m)])
    shared, every = list(trunk.parameters()), [*trunk.parameters(), *heads.parameters()]
    x, y = torch.randn(SMALL_BATCH, SMALL_WIDTH), torch.randn(m, SMALL_BATCH)

    def forward() -> tuple[torch.Tensor, list[torch.Tensor]]:
        features = trunk(x)
        return features, [((h(features).squeeze(1) - t) ** 2).mean() for h, t in zip(heads, y)]

    def zero() -> None:
        for p in every:
            p.grad = None

    def sgd() -> None:
        zero()
        torch.stack(forward()[1]).sum().backward()

    upgrad = UPGrad()

    def ours() -> None:
        zero()
        features, losses = forward()
        jacflow.mtl_backward(losses, features, A=upgrad)

    steps = {"sgd": sgd, "jacflow": ours}
    peer = _torchjd()
    if peer is not None:
        tjd, tagg = peer
        their_upgrad = tagg.UPGrad()

        def theirs() -> None:
            zero()
            features, losses = forward()
            tjd.mtl_backward(losses, features)
            tjd.jac_to_grad(shared, their_upgrad)

        steps["torchjd"] = theirs
    return interleaved_medians(steps, rounds=101)


def _peak_child(chunk: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 100)
    )
    x = torch.randn(2048, 256)
    out = model(x).mean(0)
    result_mb = 0.0
    if chunk != "baseline":
        size = None if chunk == "None" else int(chunk)
        jacobians = jacflow.jac(out, list(model.parameters()), parallel_chunk_size=size)
        result_mb = sum(j.numel() * j.element_size() for j in jacobians) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mb": peak / 1024, "result_mb": result_mb}))


def memory(chunk: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--peak", chunk], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def deep_table() -> None:
    print(
        f"\n## Overhead-bound step: {DEEP_LAYERS} transformer layers of width {DEEP_WIDTH}, "
        f"batch {DEEP_BATCH} x {DEEP_TOKENS} tokens, one loss per sample, 1 thread\n"
    )
    print(
        "| SGD ms | jacflow Mean / SGD | jacflow UPGrad / SGD | TorchJD UPGrad / SGD "
        "| jacflow UPGrad / TorchJD |"
    )
    print("|---|---|---|---|---|")
    t = speed_deep()
    tj = t.get("torchjd_upgrad", float("nan"))
    print(
        f"| {t['sgd']:.2f} | {t['jacflow_mean'] / t['sgd']:.2f} "
        f"| {t['jacflow_upgrad'] / t['sgd']:.2f} | {tj / t['sgd']:.2f} "
        f"| {t['jacflow_upgrad'] / tj:.2f} |"
    )
    print(
        f"\n## Overhead-bound multi-task step: {SMALL_LAYERS} Linear + ReLU layers of width "
        f"{SMALL_WIDTH}, batch {SMALL_BATCH}, m one-output heads, UPGrad, 1 thread\n"
    )
    print(
        "jacflow: `mtl_backward(losses, features, A=UPGrad())` (no engine); TorchJD: its "
        "`mtl_backward(losses, features)` + `jac_to_grad(trunk, UPGrad())`.\n"
    )
    print("| m | SGD ms | jacflow / SGD | TorchJD / SGD | jacflow / TorchJD |")
    print("|---|---|---|---|---|")
    for m in (3, 10):
        t = speed_small_mtl(m)
        tj = t.get("torchjd", float("nan"))
        print(
            f"| {m} | {t['sgd']:.2f} | {t['jacflow'] / t['sgd']:.2f} | {tj / t['sgd']:.2f} "
            f"| {t['jacflow'] / tj:.2f} |"
        )


def main() -> None:
    setup()
    print("## backward(losses, A=Mean()) step time, MLP width 1024, batch 64, 1 thread\n")
    print(
        "jacflow: `backward(losses, A=Mean())` (one weighted VJP, exact since Mean's weights do "
        "not depend on J); jacflow (Jacobian): `backward(losses)` + `jac_to_grad(params, Mean())`;"
        " TorchJD: its `backward(losses)` + `jac_to_grad(params, Mean())`.\n"
    )
    print(
        "| m | SGD ms | jacflow / SGD | jacflow (Jacobian) / SGD | TorchJD / SGD "
        "| jacflow (Jacobian) / TorchJD |"
    )
    print("|---|---|---|---|---|---|")
    for m in (2, 10):
        t = speed(m)
        tj = t.get("torchjd", float("nan"))
        print(
            f"| {m} | {t['sgd']:.1f} | {t['jacflow'] / t['sgd']:.2f} "
            f"| {t['jacflow_jacobian'] / t['sgd']:.2f} | {tj / t['sgd']:.2f} "
            f"| {t['jacflow_jacobian'] / tj:.2f} |"
        )
    deep_table()
    print("\n## Peak memory of jac(), m = 100 rows, batch 2048, width-256 MLP\n")
    print(
        "Peak RSS of a fresh process that calls jac(), minus the peak of the same process "
        "without the call.\n"
    )
    print("| parallel_chunk_size | peak increase MB | size of the returned Jacobian MB |")
    print("|---|---|---|")
    baseline = memory("baseline")["peak_mb"]
    for chunk in ("None", "10", "1"):
        r = memory(chunk)
        print(f"| {chunk} | {r['peak_mb'] - baseline:.0f} | {r['result_mb']:.0f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deep", action="store_true", help="the overhead-bound tables alone")
    parser.add_argument("--peak", help=argparse.SUPPRESS)  # (a child of the memory table)
    args = parser.parse_args()
    if args.peak is not None:
        setup()
        _peak_child(args.peak)
    elif args.deep:
        setup()
        deep_table()
    else:
        main()
