"""SDMGrad and MoDo: jacflow's aggregators against TorchJD 0.18's weightings on the same J.

TorchJD ships these two only as weightings of a (cross-batch) matrix, so its side is timed as
``weighting(J @ J.T) @ J``, which is what jacflow's ``SDMGrad()(J)`` / ``MoDo()(J)`` compute.
Same protocol as ``bench_aggregators.py``: float32, n = 100 000, 1 thread, interleaved medians
of CPU time; both sides keep their state across repeats.

Usage::

    .venv/bin/python benchmarks/bench_cross_batch_weightings.py [--sizes 2 10 64] [--n 100000]
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _timing import interleaved_medians, print_ratio_row, setup

import jacflow.aggregation as ours


def main() -> None:
    import torchjd.aggregation as theirs

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 10, 64])
    parser.add_argument("--n", type=int, default=100_000)
    args = parser.parse_args()
    setup()
    pairs = {
        "SDMGrad": (ours.SDMGrad, theirs.SDMGradWeighting),
        "MoDo": (ours.MoDo, theirs.MoDoWeighting),
    }
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, n = {args.n}, float32\n")
    print("| method | m | jacflow (ms) | TorchJD (ms) | TorchJD / jacflow |")
    print("|---|---|---|---|---|")
    for name, (make_mine, make_theirs) in pairs.items():
        for m in args.sizes:
            J = torch.randn(m, args.n, generator=torch.Generator().manual_seed(m))
            mine, peer = make_mine(), make_theirs()
            steps = {
                "jacflow": lambda a=mine, x=J: a(x),
                "torchjd": lambda w=peer, x=J: w(x @ x.T) @ x,
            }
            medians = interleaved_medians(steps, rounds=15, warmup=1)
            print_ratio_row(name, m, medians)


if __name__ == "__main__":
    main()
