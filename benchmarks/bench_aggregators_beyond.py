"""Call time of the aggregators TorchJD 0.18 lacks, against plain-torch floors and a peer.

For m = 2, 10, 64 rows and n = 100 000 columns (float32, one Gaussian J per m, 1 CPU thread):

* floors: ``J.sum(0)`` (a weighted sum, what every weighted method ends with) and ``J @ J.T``
  (the Gramian, what every Gramian method starts with), measured in the same run;
* jacflow: GradNorm, LogLoss(UPGrad), Periodic(UPGrad, every=10), AuxiNash, EPO, ParetoMTL,
  IMTL, MoCo, DBMTL (loss-aware ones get fixed positive losses; stateful ones keep their state
  across repeats, as in training);
* peer: TorchJD 0.18 has none of these; its ``NashMTL`` is AuxiNash with equal powers and is
  timed next to it (cvxpy/ECOS, its ``optim_niter=20``).

Median CPU time over interleaved rounds (``_timing.py``); ratios are to ``J.sum(0)``.

Usage::

    .venv/bin/python benchmarks/bench_aggregators_beyond.py [--sizes 2 10 64] [--n 100000]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _timing import interleaved_medians, setup

import jacflow.aggregation as jf


def _with_losses(
    aggregator: jf.Aggregator, losses: torch.Tensor
) -> Callable[[torch.Tensor], object]:
    def call(J: torch.Tensor) -> object:
        target = (
            aggregator if isinstance(aggregator, jf.LossAware) else aggregator.gramian_weighting
        )  # type: ignore[attr-defined]
        target.set_losses(losses)
        return aggregator(J)

    return call


def methods(m: int) -> dict[str, Callable[[torch.Tensor], object]]:
    losses = torch.linspace(0.5, 2.0, m)
    prefs = torch.rand(3, m, generator=torch.Generator().manual_seed(0)) + 0.1
    return {
        "GradNorm": _with_losses(jf.GradNorm(), losses),
        "LogLoss(UPGrad)": _with_losses(
            jf.GramianWeightedAggregator(jf.LogLoss(jf.UPGradWeighting())), losses
        ),
        "Periodic(UPGrad,10)": jf.GramianWeightedAggregator(
            jf.Periodic(jf.UPGradWeighting(), every=10)
        ),
        "AuxiNash": jf.AuxiNash(torch.ones(m)),
        "EPO": _with_losses(jf.EPO(torch.linspace(1.0, 2.0, m)), losses),
        "ParetoMTL": _with_losses(jf.ParetoMTL(prefs, index=0), losses),
        "IMTL": jf.IMTL(m),
        "MoCo": jf.MoCo(),
        "DBMTL": _with_losses(jf.DBMTL(), losses),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 10, 64])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    setup()
    warnings.filterwarnings("ignore")
    from torchjd.aggregation import NashMTL

    print("| method | " + " | ".join(f"m={m} ms (x sum)" for m in args.sizes) + " |")
    print("|---|" + "---|" * len(args.sizes))
    rows: dict[str, list[str]] = {}
    for m in args.sizes:
        J = torch.randn(m, args.n, generator=torch.Generator().manual_seed(m))
        steps: dict[str, Callable[[], object]] = {
            "floor: J.sum(0)": lambda J=J: J.sum(0),
            "floor: J @ J.T": lambda J=J: J @ J.T,
        }
        for name, call in methods(m).items():
            steps[name] = lambda call=call, J=J: call(J)
        theirs = NashMTL(n_tasks=m)
        steps["TorchJD NashMTL"] = lambda theirs=theirs, J=J: theirs(J)
        times = interleaved_medians(steps, rounds=args.rounds, warmup=1)
        base = times["floor: J.sum(0)"]
        for name, t in times.items():
            rows.setdefault(name, []).append(f"{t:.2f} ({t / base:.1f}x)")
    for name, cells in rows.items():
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
