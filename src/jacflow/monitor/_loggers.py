"""Destinations for the metrics of :class:`jacflow.monitor.Monitor`."""

from __future__ import annotations

import csv
import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, final

from jacflow.monitor._optional import require


class Logger(ABC):
    """Receives one ``{name: float}`` dictionary per recorded step.

    Example:
        >>> from jacflow.monitor import Logger, Monitor
        >>> class Printer(Logger):
        ...     def log(self, metrics, step):
        ...         print(step, metrics["conflicting_pairs"])
        >>> import torch
        >>> _ = Monitor([Printer()]).record(torch.tensor([[1., -1.], [-1., 2.]]))
        0 1.0
    """

    @abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None:
        """Write the metrics of step ``step``."""

    def close(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Flush and release resources (no-op by default)."""


@final
class CSVLogger(Logger):
    """Writes one row per step to a CSV file, with a ``step`` column first.

    Columns are the keys seen so far; when a later step brings a new key, the file is rewritten
    with the extended header (earlier rows get empty cells).

    Args:
        path: the CSV file to create (its folder is created if needed).

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from jacflow.monitor import CSVLogger, Monitor
        >>> path = Path(tempfile.mkdtemp()) / "metrics.csv"
        >>> with Monitor([CSVLogger(path)]) as monitor:
        ...     _ = monitor.record(torch.eye(2), step=7)
        >>> path.read_text().splitlines()[0].split(",")[:3]
        ['step', 'conflicting_pairs', 'conflict_fraction']
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fields: list[str] = ["step"]
        self._rows: list[dict[str, Any]] = []
        self.path.write_text("step\n")

    def log(self, metrics: dict[str, float], step: int) -> None:
        row: dict[str, Any] = {"step": step, **metrics}
        new_fields = [key for key in row if key not in self._fields]
        self._rows.append(row)
        if new_fields:
            self._fields.extend(new_fields)
            self._rewrite()
        else:
            with self.path.open("a", newline="") as file:
                csv.DictWriter(file, self._fields, restval="").writerow(row)

    def _rewrite(self) -> None:
        with self.path.open("w", newline="") as file:
            writer = csv.DictWriter(file, self._fields, restval="")
            writer.writeheader()
            writer.writerows(self._rows)


@final
class TensorBoardLogger(Logger):
    """Writes scalars to TensorBoard event files (needs the ``tensorboard`` extra).

    Args:
        log_dir: the folder of the event files.

    Raises:
        ImportError: if ``tensorboard`` is not installed, with the install line.

    Example:
        >>> from jacflow.monitor import TensorBoardLogger
        >>> TensorBoardLogger("runs/example")  # doctest: +SKIP
    """

    def __init__(self, log_dir: str | Path) -> None:
        require("tensorboard", "tensorboard", "TensorBoardLogger")
        tb = require("torch.utils.tensorboard", "tensorboard", "TensorBoardLogger")
        self.log_dir = Path(log_dir)
        self._writer = tb.SummaryWriter(log_dir=str(self.log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            if not math.isnan(value):
                self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
