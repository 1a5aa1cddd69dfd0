"""Writing a run folder: metrics as CSV and JSON, plots as PNG, and the printed summary."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jacflow.cli._train import RunResult


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Rows with possibly different keys, as one CSV (union of the keys, in order of appearance).

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from jacflow.cli._report import write_csv
        >>> path = Path(tempfile.mkdtemp()) / "t.csv"
        >>> write_csv(path, [{"a": 1}, {"a": 2, "b": 3}])
        >>> path.read_text().split()
        ['a,b', '1,', '2,3']
    """
    fields: dict[str, None] = {}
    for row in rows:
        fields.update(dict.fromkeys(row))
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, list(fields), restval="")
        writer.writeheader()
        writer.writerows(rows)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # (JSON has no NaN: "nan", "inf", "-inf", which float() reads back)
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_jsonable(item) for item in value]
    return value


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """``payload`` as indented JSON, with NaN and infinities written as the strings ``"nan"``,
    ``"inf"`` and ``"-inf"`` (a diverged run's values), and ``None`` as ``null`` (a value that
    does not apply).

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from jacflow.cli._report import write_json
        >>> path = Path(tempfile.mkdtemp()) / "t.json"
        >>> write_json(path, {"loss": float("nan"), "mean_min_update_cos": None})
        >>> path.read_text().split()
        ['{', '"loss":', '"nan",', '"mean_min_update_cos":', 'null', '}']
    """
    path.write_text(json.dumps(_jsonable(payload), indent=2) + "\n")


def write_run(result: RunResult, out: Path) -> list[Path]:
    """Write the metrics of ``result`` into ``out`` and return the written files."""
    steps, epochs = out / "metrics_steps.csv", out / "metrics_epochs.csv"
    write_csv(steps, result.steps)
    write_csv(epochs, result.epochs)
    payload = {
        "config": vars(result.config),
        "summary": result.summary,
        "epochs": result.epochs,
        "steps": result.steps,
    }
    write_json(out / "metrics.json", payload)
    return [steps, epochs, out / "metrics.json"]


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


PLOT_NOTICE = 'plots skipped: matplotlib is not installed (pip install "jacflow[plot]")'


def plot_run(result: RunResult, out: Path) -> list[Path]:
    """PNG plots of a multi-task run: losses, cosine heatmaps, weights (needs matplotlib)."""
    from jacflow.monitor import plot_cosines_over_training, plot_curves

    written: list[Path] = []

    def save(figure: Any, name: str) -> None:
        path = out / name
        figure.savefig(path, dpi=110)
        written.append(path)

    history = result.steps
    # smooth the per-step curves over about half an epoch
    smooth = max(1, len(history) // max(1, 2 * (len(result.epochs) - 1)))
    save(
        plot_curves(history, "loss/", title="Training loss per task", log=True, smooth=smooth),
        "losses.png",
    )
    test_rows = [{"step": row["epoch"], **row} for row in result.epochs]
    figure = plot_curves(test_rows, "test_loss/", title="Test loss per task", log=True)
    figure.axes[0].set_xlabel("epoch")
    save(figure, "test_losses.png")
    if any(key.startswith("cos/") for key in history[-1]):
        save(plot_cosines_over_training(history), "cosine_over_training.png")
    if any(key.startswith("weight/") for key in history[-1]):
        figure = plot_curves(history, "weight/", title="Weights over training", smooth=smooth)
        save(figure, "weights.png")
    if any(key.startswith("norm/") for key in history[-1]):
        figure = plot_curves(history, "norm/", title="Gradient norms", log=True, smooth=smooth)
        save(figure, "norms.png")
    return written


def _shown(value: Any) -> str:
    """``value`` as printed: floats with 4 decimals, ``nan`` and ``inf`` as they are (a diverged
    run), ``n/a`` for ``None`` (not applicable)."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else str(value)
    return str(value)


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as aligned ``key: value`` lines (floats with 4 decimals, ``nan`` and ``inf``
    for the values of a diverged run, ``n/a`` for a value that does not apply, as in
    :func:`markdown_table`).

    Example:
        >>> from jacflow.cli._report import format_summary
        >>> print(format_summary({"aggregator": "upgrad", "digit_acc": 0.91234}))
        aggregator : upgrad
        digit_acc  : 0.9123
        >>> print(format_summary({"loss": float("nan"), "mean_min_update_cos": None}))
        loss                : nan
        mean_min_update_cos : n/a
    """
    width = max(len(key) for key in summary)
    return "\n".join(f"{key.ljust(width)} : {_shown(value)}" for key, value in summary.items())


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A markdown table of ``rows`` restricted to ``columns`` (floats with 4 decimals, ``nan``
    and ``inf`` for the values of a diverged run, ``n/a`` for ``None``: e.g. the update cosines
    of an aggregator that exposes no weights).

    Example:
        >>> from jacflow.cli._report import markdown_table
        >>> print(markdown_table([{"name": "mean", "acc": 0.5}], ["name", "acc"]))
        | name | acc |
        |---|---|
        | mean | 0.5000 |
        >>> print(markdown_table([{"acc": float("nan"), "cos": None}], ["acc", "cos"]))
        | acc | cos |
        |---|---|
        | nan | n/a |
    """
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_shown(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def divergence_note(result: RunResult) -> str | None:
    """A note line when a loss of ``result`` became NaN or infinite (the run diverged: its
    values print as ``nan``), ``None`` otherwise.

    Example:
        >>> from jacflow.cli._report import divergence_note
        >>> from jacflow.cli._train import RunConfig, RunResult
        >>> result = RunResult(RunConfig(aggregator="config"), steps=[{"loss": float("nan")}])
        >>> print(divergence_note(result))
        note: the config run diverged (its losses became nan or inf); a smaller --lr may avoid it
        >>> divergence_note(RunResult(RunConfig(), steps=[{"loss": 0.5}])) is None
        True
    """
    rows = [*result.steps, *result.epochs]
    losses = [value for row in rows for key, value in row.items() if "loss" in key]
    if all(math.isfinite(value) for value in losses):
        return None
    return (
        f"note: the {result.config.aggregator} run diverged (its losses became nan or inf); a "
        "smaller --lr may avoid it"
    )
