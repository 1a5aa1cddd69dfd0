"""``jacflow compare`` (and ``train --mode iwrm``): several aggregators, one seed, one table."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jacflow.cli._model import TASKS
from jacflow.cli._report import (
    PLOT_NOTICE,
    divergence_note,
    markdown_table,
    matplotlib_available,
    write_csv,
    write_json,
    write_run,
)
from jacflow.cli._train import RunConfig, RunResult, check_out_dir, train_iwrm, train_mtl
from jacflow.monitor import Logger

MTL_COLUMNS = [
    "aggregator",
    "digit_acc",
    "parity_acc",
    "recon_mse",
    "test_loss/digit",
    "test_loss/parity",
    "mean_conflict_fraction",
    "mean_min_update_cos",
    "seconds",
]
IWRM_COLUMNS = [
    "aggregator",
    "train_loss",
    "train_acc",
    "test_loss",
    "test_acc",
    "mean_conflict_fraction",
    "mean_min_update_cos",
    "seconds",
]


def _plot(results: Sequence[RunResult], mode: str, path: Path) -> None:
    from matplotlib.figure import Figure

    keys = [f"test_loss/{name}" for name in TASKS] if mode == "mtl" else ["train_loss", "test_loss"]
    figure = Figure(figsize=(4.0 * len(keys), 3.5), layout="constrained")
    axes = figure.subplots(1, len(keys), squeeze=False)[0]
    for ax, key in zip(axes, keys):
        for result in results:
            epochs = [row["epoch"] for row in result.epochs]
            ax.plot(epochs, [row[key] for row in result.epochs], label=result.config.aggregator)
        ax.set_title(key)
        ax.set_xlabel("epoch")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    figure.savefig(path, dpi=110)


def compare(
    configs: Sequence[Any],
    mode: str,
    out: Path,
    *,
    progress: bool = True,
    plots: bool = True,
    tensorboard: bool = False,
) -> int:
    """Train one run per config into ``out/<aggregator>/`` and write the comparison table;
    with ``tensorboard``, each run also logs to ``out/<aggregator>/tensorboard``.

    ``comparison.json`` names the runs' folders from the start (``"complete": false`` until
    the table is written), so that ``--overwrite`` finds those of an interrupted comparison.
    """
    runs = [{"aggregator": config.aggregator} for config in configs]
    for config in configs:  # (before any training: a run folder that is a file is refused now)
        check_out_dir(out / config.aggregator)
    write_json(out / "comparison.json", {"mode": mode, "complete": False, "runs": runs})
    results: list[RunResult] = []
    for config in configs:
        assert isinstance(config, RunConfig)
        loggers: list[Logger] = []
        if tensorboard:
            from jacflow.monitor import TensorBoardLogger

            loggers.append(TensorBoardLogger(out / config.aggregator / "tensorboard"))
        train = train_mtl if mode == "mtl" else train_iwrm
        result = train(config, loggers=loggers, progress=progress, label=config.aggregator)
        run_dir = out / config.aggregator
        run_dir.mkdir(parents=True, exist_ok=True)
        write_run(result, run_dir)
        results.append(result)
    columns = MTL_COLUMNS if mode == "mtl" else IWRM_COLUMNS
    rows = [result.summary for result in results]
    write_csv(out / "comparison.csv", [{c: row.get(c, "") for c in columns} for row in rows])
    table = markdown_table(rows, columns)
    first = configs[0]
    header = (
        f"# {mode} comparison: seed {first.seed}, {first.epochs} epochs, "
        f"batch {first.batch_size}, lr {first.lr}\n\n"
    )
    (out / "comparison.md").write_text(header + table + "\n")
    write_json(out / "comparison.json", {"mode": mode, "complete": True, "runs": rows})
    if plots and matplotlib_available():
        _plot(results, mode, out / "comparison.png")
    elif plots:
        print(PLOT_NOTICE)
    print(f"\nRun folder: {out}\n")
    print(header + table)
    for result in results:
        note = divergence_note(result)
        if note:
            print(note)
    return 0
