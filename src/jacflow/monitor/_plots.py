"""Matplotlib figures of conflict metrics (needs the ``plot`` extra).

The functions build ``matplotlib.figure.Figure`` objects directly (no pyplot state, no display
needed) and return them; save with ``figure.savefig(path)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from jacflow.monitor._metrics import cosine_similarities
from jacflow.monitor._optional import require


def _figure(size: tuple[float, float]) -> Any:
    figure_module = require("matplotlib.figure", "plot", "Plotting")
    return figure_module.Figure(figsize=size, layout="constrained")


def plot_cosine_matrix(gramian: Tensor, names: Sequence[str] | None = None) -> Any:
    """Heatmap of the pairwise cosine similarities of the gradients, annotated with values.

    Args:
        gramian: the ``[m, m]`` Gramian ``J J^T``.
        names: one label per objective.

    Example:
        >>> import torch
        >>> from jacflow.monitor import plot_cosine_matrix
        >>> J = torch.tensor([[1., 0.], [-1., 1.]])
        >>> figure = plot_cosine_matrix(J @ J.T, ["a", "b"])
        >>> figure.axes[0].get_title()
        'Gradient cosine similarity'
    """
    cosines = cosine_similarities(gramian).cpu()  # float32 for half-precision Gramians
    if cosines.dtype not in (torch.float32, torch.float64):  # numpy has no bfloat16
        cosines = cosines.float()
    m = cosines.shape[0]
    labels = [str(i) for i in range(m)] if names is None else [str(name) for name in names]
    if len(labels) != m:
        raise ValueError(
            f"`names` must have {m} entries (one per objective of the [{m}, {m}] Gramian), "
            f"received {len(labels)}: {labels!r}."
        )
    figure = _figure((1.2 + 0.6 * m, 1.0 + 0.6 * m))
    ax = figure.add_subplot()
    image = ax.imshow(cosines.numpy(), cmap="RdBu", vmin=-1.0, vmax=1.0)
    ax.set_xticks(range(m), labels, rotation=45, ha="right")
    ax.set_yticks(range(m), labels)
    if m <= 12:
        for i in range(m):
            for j in range(m):
                ax.text(j, i, f"{float(cosines[i, j]):.2f}", ha="center", va="center", fontsize=8)
    figure.colorbar(image, ax=ax)
    ax.set_title("Gradient cosine similarity")
    return figure


def _steps(history: Sequence[dict[str, float]]) -> list[float]:
    return [row.get("step", float(index)) for index, row in enumerate(history)]


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(values))
    ]


def plot_curves(
    history: Sequence[dict[str, float]],
    prefix: str,
    *,
    title: str | None = None,
    log: bool = False,
    smooth: int = 1,
) -> Any:
    """Line plot over steps of every metric whose key starts with ``prefix``.

    Args:
        history: rows such as :attr:`Monitor.history` (a ``step`` key is used as x when present).
        prefix: e.g. ``"loss/"``, ``"weight/"``, ``"norm/"`` or ``"cos/"``.
        title: the title (default: the prefix).
        log: logarithmic y axis.
        smooth: plot the trailing mean over this many points (1: the raw values).

    Example:
        >>> from jacflow.monitor import plot_curves
        >>> history = [{"step": 0., "loss/a": 1.0}, {"step": 1., "loss/a": 0.5}]
        >>> figure = plot_curves(history, "loss/")
        >>> [line.get_label() for line in figure.axes[0].get_lines()]
        ['a']
        >>> line = plot_curves(history, "loss/", smooth=2).axes[0].get_lines()[0]
        >>> [float(y) for y in line.get_ydata()]
        [1.0, 0.75]
    """
    if not isinstance(smooth, int) or isinstance(smooth, bool) or smooth < 1:
        raise ValueError(f"`smooth` must be a positive int, received {smooth!r}.")
    keys = sorted({key for row in history for key in row if key.startswith(prefix)})
    if not keys:
        raise ValueError(
            f"No metric starts with {prefix!r} in `history`; available keys: "
            f"{sorted({key for row in history for key in row})}."
        )
    figure = _figure((6.0, 3.5))
    ax = figure.add_subplot()
    steps = _steps(history)
    for key in keys:
        points = [(s, row[key]) for s, row in zip(steps, history) if key in row]
        values = _moving_average([p[1] for p in points], smooth)
        ax.plot([p[0] for p in points], values, label=key[len(prefix) :])
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_title(title if title is not None else prefix.rstrip("/"))
    ax.legend(fontsize=8)
    return figure


def plot_cosines_over_training(history: Sequence[dict[str, float]], max_columns: int = 200) -> Any:
    """Heatmap of every pairwise cosine (rows) against the training step (columns).

    Steps are averaged into at most ``max_columns`` bins so that long runs stay readable.

    Args:
        history: rows with ``cos/<i>-<j>`` keys, such as :attr:`Monitor.history`.
        max_columns: the largest number of columns.

    Example:
        >>> from jacflow.monitor import plot_cosines_over_training
        >>> history = [{"step": float(s), "cos/a-b": -0.5, "cos/a-c": 0.1} for s in range(4)]
        >>> figure = plot_cosines_over_training(history)
        >>> [label.get_text() for label in figure.axes[0].get_yticklabels()]
        ['a-b', 'a-c']
    """
    keys = sorted({key for row in history for key in row if key.startswith("cos/")})
    if not keys or not history:
        raise ValueError("`history` holds no `cos/<i>-<j>` entries to plot.")
    if not isinstance(max_columns, int) or isinstance(max_columns, bool):
        raise TypeError(
            f"`max_columns` must be an int (the largest number of columns), received "
            f"{max_columns!r} of type {type(max_columns).__name__}."
        )
    if max_columns < 1:
        raise ValueError(f"`max_columns` must be at least 1, received {max_columns}.")
    n = len(history)
    bins = min(n, max_columns)
    grid = [[0.0] * bins for _ in keys]
    counts = [[0] * bins for _ in keys]
    for index, row in enumerate(history):
        column = index * bins // n
        for r, key in enumerate(keys):
            if key in row:
                grid[r][column] += row[key]
                counts[r][column] += 1
    values = [
        [g / c if c else float("nan") for g, c in zip(gr, cr)] for gr, cr in zip(grid, counts)
    ]
    steps = _steps(history)
    figure = _figure((7.0, 1.2 + 0.35 * len(keys)))
    ax = figure.add_subplot()
    image = ax.imshow(
        values,
        cmap="RdBu",
        vmin=-1.0,
        vmax=1.0,
        aspect="auto",
        interpolation="nearest",
        extent=(steps[0], steps[-1] + 1, len(keys) - 0.5, -0.5),
    )
    ax.set_yticks(range(len(keys)), [key[len("cos/") :] for key in keys])
    ax.set_xlabel("step")
    ax.set_title("Pairwise gradient cosine over training")
    figure.colorbar(image, ax=ax)
    return figure
