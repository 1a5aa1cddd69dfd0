"""The products of ``jacflow.linalg._products``: oneDNN's kernel against torch's, 1 CPU thread.

Part 1 times the products alone: Gramians ``x @ x.T`` and weight-gradient products
``a @ b`` into an ``out=`` buffer, by torch's kernel (the BLAS: MKL in the official wheels) and
by oneDNN's (``onednn_product``, and ``product`` by slices of rows into ``out``). Part 2 times
whole steps: the per-sample and multi-task steps of ``bench_autogram.py`` with the route that
this host takes and with torch's products forced, interleaved with the plain SGD step of the same
model, and reports both ratios to SGD and their quotient (TorchJD has no such route: its figures
are in ``bench_autogram.py``).

On a host where MKL takes its AVX-512 code (an Intel processor) or without AVX-512, the rule
keeps torch's kernel and part 2's two routes are the same; part 1 still shows what oneDNN's
kernel would do there.

Usage::

    .venv/bin/python benchmarks/bench_products.py [--rounds 41] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator

import bench_autogram as autogram
import torch
from _timing import interleaved_medians, setup

from jacflow.linalg import _products

GRAMIANS = [(128, 432), (128, 2048), (128, 4608), (128, 9216), (32, 9216), (8, 262144)]
PRODUCTS = [(1024, 32, 1024), (1024, 64, 1024), (1024, 128, 1024), (1024, 256, 1024)]
STEPS_IWRM = [("mlp1024", 128), ("cnn", 128), ("cnn", 32)]
STEPS_MTL = [(1024, 256, 2), (1024, 256, 10)]


@contextlib.contextmanager
def route(onednn: bool) -> Iterator[None]:
    """Products by oneDNN's kernel (where the rule's sizes allow) or by torch's, whatever the
    host."""
    chosen = _products.host_prefers_onednn
    _products.host_prefers_onednn = lambda: onednn  # type: ignore[assignment]
    try:
        yield
    finally:
        _products.host_prefers_onednn = chosen


def forced(step: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        with route(onednn=False):
            step()

    return run


def gramian_routes(x: torch.Tensor) -> dict[str, Callable[[], object]]:
    return {"torch": lambda: x @ x.T, "onednn": lambda: _products.onednn_product(x, x.T)}


def product_routes(n: int, k: int, p: int) -> dict[str, Callable[[], object]]:
    """``[n, k] @ [k, p]`` into an ``out`` (the left factor a transposed view, as the
    engine's), by ``torch.mm`` and by ``product``'s slices."""
    a, b, out = torch.randn(k, n).T, torch.randn(k, p), torch.empty(n, p)

    def by_slices() -> None:
        with route(onednn=True):
            _products.product(a, b, out=out)

    return {"torch": lambda: torch.mm(a, b, out=out), "onednn": by_slices}


def alone(rounds: int) -> None:
    if not _products._onednn_works():
        print("oneDNN's product is not available in this torch build.")
        return
    print("Products alone (ms, median; ratio = oneDNN / torch)\n")
    print("| product | torch | oneDNN | ratio |")
    print("|---|---|---|---|")
    cases = [(f"Gramian [{r}, {c}]", gramian_routes(torch.randn(r, c))) for r, c in GRAMIANS]
    cases += [
        (f"[{n}, {k}] @ [{k}, {p}] into out", product_routes(n, k, p)) for n, k, p in PRODUCTS
    ]
    for name, routes in cases:
        medians = interleaved_medians(routes, rounds=rounds)
        ratio = medians["onednn"] / medians["torch"]
        print(f"| {name} | {medians['torch']:.3f} | {medians['onednn']:.3f} | {ratio:.2f}x |")


def steps(rounds: int) -> None:
    print(f"\nWhole steps (this host takes oneDNN: {_products.host_prefers_onednn()})\n")
    print("| step | SGD ms | host's route / SGD | torch's products / SGD | quotient |")
    print("|---|---|---|---|---|")
    cases: list[tuple[str, dict[str, autogram.Step]]] = []
    for model, batch in STEPS_IWRM:
        cases.append(
            (f"{model}, B = {batch}", autogram.iwrm_steps(model, batch, ["sgd", "jacflow"]))
        )
    for width, batch, m in STEPS_MTL:
        name = f"multi-task {width}, B = {batch}, m = {m}"
        cases.append((name, autogram.mtl_steps(width, batch, m, ["sgd", "jacflow"])))
    for name, pair in cases:
        timed: dict[str, Callable[[], object]] = {
            "sgd": pair["sgd"],
            "host": pair["jacflow"],
            "torch": forced(pair["jacflow"]),
        }
        medians = interleaved_medians(timed, rounds=rounds)
        host, plain = medians["host"] / medians["sgd"], medians["torch"] / medians["sgd"]
        print(
            f"| {name} | {medians['sgd']:.1f} | {host:.3f}x | {plain:.3f}x | {host / plain:.3f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args()
    setup()
    rounds = 7 if args.quick else args.rounds
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    alone(rounds)
    steps(rounds)


if __name__ == "__main__":
    main()
