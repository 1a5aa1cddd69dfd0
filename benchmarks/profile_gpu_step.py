"""Where a per-sample JD step's time goes on a GPU: launches, copies and synchronisations.

On a GPU the benchmark models are launch-bound: a step costs about its number of dispatched
operations times the per-operation overhead, not its arithmetic. For each (model, B) this
prints, per step of ``sgd`` and ``jacflow`` (``bench_autogram.py``'s steps): the wall time
(median, synchronised), the counts of kernel launches, host-device copies and synchronisations
(``torch.profiler``), and the GPU's busy time; then the UPGrad weighting alone on the step's
Gramian on the GPU (copied to the host and solved there below 129 objectives), on a host copy,
and the copy; and the cost of one small operation on each device.

Run: ``python benchmarks/profile_gpu_step.py [--table]`` (``--table``: the profiler's table
of jacflow's step, by self CPU time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_autogram import iwrm_gramian, iwrm_steps

from jacflow.aggregation import UPGradWeighting

torch.set_num_threads(1)
CASES = [("mlp256", 32), ("mlp256", 128), ("cnn", 32), ("cnn", 128)]
WEIGHTING = UPGradWeighting()
CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaStreamSynchronize")


def wall_ms(fn: Callable[[], object], repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--table", action="store_true", help="the profiler's table of jacflow's step"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():  # (`jacflow bench` runs every script: not a failure)
        print("profile_gpu_step.py profiles a step on a CUDA GPU, and none is available: skipped.")
        return
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    x = torch.randn(16, device="cuda")
    y = x.cpu()
    each = {"cuda": x, "cpu": y}
    for name, t in each.items():
        us = wall_ms(lambda t=t: [t.add(1) for _ in range(200)]) * 5
        print(f"one add on {name}: {us:.1f} us")
    for model, batch in CASES:
        steps = iwrm_steps(model, batch, ["sgd", "jacflow"], "cuda")
        for method, step in steps.items():
            ms = wall_ms(step, 30)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    step()
                torch.cuda.synchronize()
            events = prof.key_averages()
            counts = {e.key: e.count // 10 for e in events if e.key in CALLS}
            busy = sum(getattr(e, "self_device_time_total", 0) for e in events) / 10 / 1e3
            print(f"{model} B={batch} {method}: {ms:.2f} ms, GPU busy {busy:.2f} ms, {counts}")
            if method == "jacflow" and args.table and (model, batch) == CASES[0]:
                print(events.table(sort_by="self_cpu_time_total", row_limit=30))
        gramian = iwrm_gramian(model, batch, "cuda")
        host = gramian.cpu()
        on_gpu = wall_ms(lambda g=gramian: WEIGHTING(g))
        on_host = wall_ms(lambda g=host: WEIGHTING(g))
        copy = wall_ms(lambda g=gramian: g.cpu())
        print(
            f"  weighting m={batch}: GPU Gramian {on_gpu:.2f} ms, host Gramian {on_host:.2f} ms, "
            f"copy to host {copy:.3f} ms"
        )


if __name__ == "__main__":
    main()
