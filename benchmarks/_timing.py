"""Shared timing helpers for the benchmarks: 1 thread, interleaved rounds, medians.

On the CPU the clock is process CPU time (robust to other processes on a shared machine); on an
accelerator it is wall time between two synchronisations, since the CPU clock does not see the
device's work.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import statistics
import time
from collections.abc import Callable

import torch


def setup() -> None:
    torch.set_num_threads(1)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_heap() -> None:
    """Make glibc keep freed memory for reuse, for this process (the benchmark's own choice;
    a library must not change its host's allocator).

    By default glibc serves large blocks by ``mmap`` and returns the top of the heap to the OS
    once it exceeds a threshold. A step that frees more than that at its end then faults in
    fresh pages at the next one (a minor page fault per 4 KiB, in the process's CPU time). With
    the thresholds at their maxima, freed blocks up to 32 MiB stay in the heap. The effect of
    the same setting for a user: ``MALLOC_TRIM_THRESHOLD_=1073741824
    MALLOC_MMAP_THRESHOLD_=33554432`` in the environment, or a caching allocator (jemalloc,
    tcmalloc) by ``LD_PRELOAD``.
    """
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        raise RuntimeError("--keep-heap needs glibc's mallopt (Linux with glibc).")
    if not (mallopt(_M_TRIM_THRESHOLD, 2**30) and mallopt(_M_MMAP_THRESHOLD, 2**25)):
        raise RuntimeError("glibc's mallopt refused the thresholds of --keep-heap.")


def checked_device(parser: argparse.ArgumentParser, device: str) -> str:
    """A ``--device`` option's value, ``cpu`` or an available ``cuda``; else the parser's usage
    error (a line and exit status 2, not a traceback later)."""
    if device not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, received {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    return device


def clock(device: torch.device | str = "cpu") -> Callable[[], float]:
    """A clock in seconds for work on ``device`` (see the module's docstring)."""
    device = torch.device(device)
    if device.type == "cpu":
        return time.process_time

    if device.type == "cuda":
        synchronize = torch.cuda.synchronize
    elif device.type == "mps":
        synchronize = torch.mps.synchronize
    else:
        raise ValueError(f"no clock for device {device}: use cpu, cuda or mps")

    def synchronized() -> float:
        synchronize()
        return time.perf_counter()

    return synchronized


def interleaved_medians(
    steps: dict[str, Callable[[], object]],
    rounds: int = 15,
    warmup: int = 3,
    device: torch.device | str = "cpu",
    now: Callable[[], float] | None = None,
    before: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Median time (ms, by :func:`clock`, or ``now``) of each step, methods interleaved
    round-robin; ``before`` runs before each timed step (a barrier of several processes).

    The order alternates every round so that no method always runs after the same one.
    """
    now = clock(device) if now is None else now
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            if before is not None:
                before()
            start = now()
            steps[name]()
            samples[name].append((now() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def print_ratio_row(name: str, m: int, medians: dict[str, float]) -> None:
    """One markdown row ``| name | m | jacflow ms | torchjd ms | torchjd / jacflow |``."""
    ratio = medians["torchjd"] / max(medians["jacflow"], 1e-9)
    print(
        f"| {name} | {m} | {medians['jacflow']:.2f} | {medians['torchjd']:.2f} | {ratio:.2f} |",
        flush=True,
    )
