"""``jacflow bench``: the benchmark scripts of the repository, or a quick built-in subset."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

from jacflow import autojac
from jacflow.aggregation import UPGrad, UPGradWeighting
from jacflow.cli._data import load_digits
from jacflow.cli._model import DigitsMTL
from jacflow.cli._report import markdown_table

BUILTIN_OBJECTIVES = (2, 8, 32)
"""The numbers of objectives for which the built-in subset times the UPGrad weights."""
BUILTIN_SUBSET = (
    "one multi-task step with UPGrad against sum(losses).backward() (and against TorchJD when "
    f"it is installed), and the UPGrad weights for {', '.join(map(str, BUILTIN_OBJECTIVES[:-1]))} "
    f"and {BUILTIN_OBJECTIVES[-1]} objectives"
)
"""What :func:`builtin_bench` times, in words."""


def find_benchmarks(start: Path | None = None) -> Path | None:
    """The ``benchmarks/`` folder of the jacflow repository above ``start`` (default: cwd), or
    next to the installed sources; ``None`` when there is none (an installed package)."""
    candidates = [start or Path.cwd(), Path(__file__).resolve().parents[3]]
    for base in candidates:
        for folder in [base, *base.parents]:
            bench = folder / "benchmarks"
            if bench.is_dir() and _is_jacflow_project(folder / "pyproject.toml"):
                return bench
    return None


def _is_jacflow_project(pyproject: Path) -> bool:
    """Whether ``pyproject``'s ``[project]`` table names ``jacflow`` (another project's
    benchmarks are not ours to run)."""
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return False
    try:
        import tomllib  # (Python 3.11+)
    except ImportError:  # (3.10: the [project] table's own lines)
        table = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, flags=re.M | re.S)
        found = table and re.search(r'^name\s*=\s*["\']jacflow["\']', table.group(1), re.M)
        return bool(found)
    try:
        project = tomllib.loads(text).get("project", {})
    except tomllib.TOMLDecodeError:
        return False
    return isinstance(project, dict) and project.get("name") == "jacflow"


def benchmark_scripts(folder: Path, pattern: str | None = None) -> list[Path]:
    """The runnable scripts of ``folder`` (``*.py`` not starting with ``_``), filtered by name."""
    scripts = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    return [p for p in scripts if pattern is None or pattern in p.stem]


def run_scripts(scripts: list[Path], timeout: float) -> int:
    """Run each script with one thread and stream its output; return the number of failures."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    failures = 0
    for script in scripts:
        print(f"\n## {script.name}\n", flush=True)
        try:
            completed = subprocess.run(
                [sys.executable, str(script)], env=env, cwd=script.parent.parent, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            print(f"{script.name}: timed out after {timeout:.0f} s", flush=True)
            failures += 1
            continue
        if completed.returncode:
            print(f"{script.name}: exit code {completed.returncode}", flush=True)
            failures += 1
    return failures


def _median_interleaved(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def builtin_bench(repeats: int = 50) -> str:
    """Time a multi-task step and UPGrad weights; return markdown ratio tables."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    images, labels = load_digits()
    x, y = images[:64], labels[:64]
    model = DigitsMTL()
    heads = [list(m.parameters()) for m in (model.digit, model.parity, model.recon)]
    shared = list(model.trunk.parameters())
    upgrad = UPGrad()

    def losses() -> tuple[torch.Tensor, list[torch.Tensor]]:
        features = model.trunk(x)
        digit, parity, recon = model.heads_forward(features)
        return features, [
            F.cross_entropy(digit, y),
            F.binary_cross_entropy_with_logits(parity, (y % 2).float()),
            F.mse_loss(recon, x),
        ]

    def plain() -> None:
        model.zero_grad()
        torch.stack(losses()[1]).sum().backward()

    def jacflow_step() -> None:
        model.zero_grad()
        features, values = losses()
        autojac.mtl_backward(values, features, A=upgrad, tasks_params=heads, shared_params=shared)

    fns: dict[str, Callable[[], None]] = {"sum().backward()": plain, "jacflow UPGrad": jacflow_step}
    try:
        import torchjd.aggregation as tjd_aggregation
        import torchjd.autojac as tjd_autojac
    except ImportError:
        pass
    else:
        tjd_upgrad = tjd_aggregation.UPGrad()

        def torchjd_step() -> None:
            model.zero_grad()
            features, values = losses()
            tjd_autojac.mtl_backward(values, features=features)
            tjd_autojac.jac_to_grad(shared, tjd_upgrad)

        fns["TorchJD 0.18 UPGrad"] = torchjd_step
    step_times = _median_interleaved(fns, repeats)
    base = step_times["sum().backward()"]
    rows = [
        {"method": name, "ms/step": 1e3 * t, "ratio vs sum().backward()": t / base}
        for name, t in step_times.items()
    ]
    table = "### Multi-task step (3 tasks, batch 64, 1 thread)\n\n"
    table += markdown_table(rows, ["method", "ms/step", "ratio vs sum().backward()"])
    weighting = UPGradWeighting()
    weight_rows = []
    for m in BUILTIN_OBJECTIVES:
        J = torch.randn(m, 200, dtype=torch.float64)
        J[1] = 0.5 * J[1] - J[0]  # at least one conflicting pair: no short-cut in the solver
        gramian = J @ J.T

        def weights(gramian: torch.Tensor = gramian) -> None:
            weighting(gramian)

        t = _median_interleaved({"w": weights}, max(3, repeats // 4))["w"]
        weight_rows.append({"m": m, "ms": 1e3 * t})
    table += "\n\n### UPGrad weights from an m x m Gramian (float64, conflicting rows)\n\n"
    table += markdown_table(weight_rows, ["m", "ms"])
    return table
