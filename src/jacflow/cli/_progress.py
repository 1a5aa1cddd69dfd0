"""A progress display: tqdm when installed, otherwise one printed line per epoch."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, final


def _format(values: dict[str, float]) -> str:
    return " ".join(f"{key}={value:.4f}" for key, value in values.items())


@final
class Progress:
    """Shows training progress with live per-task losses.

    Args:
        total: number of steps.
        label: prefix of the display.
        enabled: ``False`` shows nothing.

    Example:
        >>> from jacflow.cli._progress import Progress
        >>> with Progress(2, "demo", enabled=False) as progress:
        ...     progress.update({"loss": 1.0})
        ...     progress.epoch_done(1, {"loss": 0.5})
    """

    def __init__(self, total: int, label: str, *, enabled: bool = True) -> None:
        self.label = label
        self.enabled = enabled
        self._bar: Any = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                print(f"{label}: tqdm not installed, printing one line per epoch", flush=True)
            else:
                self._bar = tqdm(total=total, desc=label, file=sys.stderr, dynamic_ncols=True)

    def update(self, losses: dict[str, float]) -> None:
        """One step done; show its losses."""
        if self._bar is not None:
            self._bar.set_postfix_str(_format(losses), refresh=False)
            self._bar.update(1)

    def epoch_done(self, epoch: int, values: dict[str, float]) -> None:
        """An epoch done; without tqdm, print its summary line."""
        if self.enabled and self._bar is None:
            print(f"{self.label} epoch {epoch}: {_format(values)}", flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.close()
