"""Per-aggregator call time: every jacflow aggregator that has a same-named TorchJD 0.18 one.

The methods are discovered at run time from ``jacflow.aggregation.__all__``: every concrete
:class:`~jacflow.aggregation.Aggregator` subclass (the generic ``WeightedAggregator`` and
``GramianWeightedAggregator`` shells excepted) whose name also exists in
``torchjd.aggregation``. Both are built with each library's defaults plus the required
arguments in ``REQUIRED`` (the same values on both sides); a method that needs arguments not
listed there is reported as skipped.

For m = 2, 10, 64 rows and n = 100 000 columns (float32, one Gaussian J per m, 1 CPU thread),
each pair is called once as a probe (a side slower than ``--max-seconds`` is not repeated and
is reported as skipped), then timed with interleaved rounds (median CPU time, see
``_timing.py``). Stateful methods keep their state across the repeats, as in training.

Usage::

    .venv/bin/python benchmarks/bench_aggregators.py [--sizes 2 10 64] [--n 100000] [--only MGDA]
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _timing import interleaved_medians, print_ratio_row, setup

import jacflow.aggregation as ours

GENERIC = {"Aggregator", "WeightedAggregator", "GramianWeightedAggregator"}

# Required constructor arguments, identical for both libraries (None: not defined for this m).
REQUIRED: dict[str, Callable[[int], dict[str, Any] | None]] = {
    "Constant": lambda m: {"weights": torch.ones(m)},
    "Krum": lambda m: {"n_byzantine": 1, "n_selected": 2} if m >= 4 else None,
    "TrimmedMean": lambda m: {"trim_number": 1 if m >= 3 else 0},
    "CAGrad": lambda m: {"c": 0.5},
    "FairGrad": lambda m: {"alpha": 1.0},
    "NashMTL": lambda m: {"n_tasks": m},
}


def discover() -> list[str]:
    """Names of the aggregators that both libraries export."""
    import torchjd.aggregation as theirs

    names = []
    for name in ours.__all__:
        cls = getattr(ours, name)
        if (
            inspect.isclass(cls)
            and issubclass(cls, ours.Aggregator)
            and not inspect.isabstract(cls)
            and name not in GENERIC
            and inspect.isclass(getattr(theirs, name, None))
        ):
            names.append(name)
    return sorted(names)


def needs_arguments(cls: type) -> bool:
    parameters = inspect.signature(cls).parameters.values()
    return any(p.default is inspect.Parameter.empty for p in parameters)


def build(name: str, m: int) -> tuple[Any, Any] | str:
    """(jacflow aggregator, TorchJD aggregator), or the reason why the pair is skipped."""
    import torchjd.aggregation as theirs

    mine, peer = getattr(ours, name), getattr(theirs, name)
    if name in REQUIRED:
        kwargs = REQUIRED[name](m)
        if kwargs is None:
            return "not defined for this m"
    elif needs_arguments(mine) or needs_arguments(peer):
        return "needs arguments not listed in REQUIRED"
    else:
        kwargs = {}
    return mine(**kwargs), peer(**kwargs)


def probe(step: Callable[[], object]) -> float:
    start = time.process_time()
    step()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 10, 64])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--max-seconds", type=float, default=20.0)
    parser.add_argument("--only", nargs="*", default=None, help="restrict to these methods")
    args = parser.parse_args()
    setup()
    warnings.simplefilter("ignore")  # NashMTL (TorchJD) warns on every call through cvxpy

    found = discover()
    unknown = sorted(set(args.only or ()) - set(found))
    if unknown:
        parser.error(
            f"--only: {', '.join(unknown)} not among the methods of both libraries: "
            + ", ".join(found)
        )
    names = [name for name in found if args.only is None or name in args.only]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, n = {args.n}, float32")
    print(f"methods found in both libraries: {', '.join(names)}\n")
    print("| method | m | jacflow (ms) | TorchJD (ms) | TorchJD / jacflow |")
    print("|---|---|---|---|---|")
    for name in names:
        for m in args.sizes:
            J: Tensor = torch.randn(m, args.n, generator=torch.Generator().manual_seed(m))
            pair = build(name, m)
            if isinstance(pair, str):
                print(f"| {name} | {m} | skipped: {pair} | | |")
                continue
            mine, peer = pair
            steps = {"jacflow": lambda a=mine, x=J: a(x), "torchjd": lambda a=peer, x=J: a(x)}
            first = {label: probe(step) for label, step in steps.items()}
            slow = [label for label, seconds in first.items() if seconds > args.max_seconds]
            if slow:
                cells = {
                    label: (f"> {args.max_seconds:.0f} s (skipped)" if label in slow else "")
                    for label in steps
                }
                print(f"| {name} | {m} | {cells['jacflow']} | {cells['torchjd']} | |")
                continue
            longest = max(first.values())
            rounds = 3 if longest > 2.0 else 7 if longest > 0.2 else 15
            medians = interleaved_medians(steps, rounds=rounds, warmup=1)
            print_ratio_row(name, m, medians)


if __name__ == "__main__":
    main()
