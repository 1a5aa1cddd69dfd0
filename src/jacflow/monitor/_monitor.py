"""The callback object that turns each step's Gramian into logged conflict metrics."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import final

from torch import Tensor

from jacflow._labels import received
from jacflow.monitor._loggers import Logger
from jacflow.monitor._metrics import ConflictMetrics, conflict_metrics


@final
class Monitor:
    """Records conflict metrics from any training loop and forwards them to loggers.

    Call :meth:`record` once per step with the Gramian ``J J^T`` of the step's Jacobian (and the
    weights of the update when the aggregator is weighted). The flat metrics of each recorded step
    are kept in :attr:`history` and passed to every logger.

    Args:
        loggers: destinations such as :class:`CSVLogger` or :class:`TensorBoardLogger`.
        names: one name per objective, used in the metric keys (default ``"0"``, ``"1"``, ...).
        every: record only the steps whose number is a multiple of ``every``.
        per_objective: log the per-objective norms, weights and update cosines.
        pairwise: log one cosine per pair of objectives (turn off when ``m`` is large).

    Example:
        >>> import torch
        >>> from jacflow.monitor import Monitor
        >>> monitor = Monitor(names=["a", "b"])
        >>> J = torch.tensor([[1., 0.], [-1., 1.]])
        >>> metrics = monitor.record(J @ J.T, torch.tensor([0.5, 0.5]), losses=[0.3, 0.2])
        >>> metrics["conflicting_pairs"], metrics["loss/b"], round(metrics["cos/a-b"], 4)
        (1.0, 0.2, -0.7071)
        >>> len(monitor.history)
        1
    """

    def __init__(
        self,
        loggers: Sequence[Logger] = (),
        *,
        names: Sequence[str] | None = None,
        every: int = 1,
        per_objective: bool = True,
        pairwise: bool = True,
    ) -> None:
        for index, logger in enumerate(loggers):
            if not isinstance(logger, Logger):
                raise TypeError(
                    f"`loggers[{index}]` must be a jacflow.monitor.Logger, received "
                    f"{received(logger)}."
                )
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"`every` must be a positive int, received {every!r}.")
        self.loggers = list(loggers)
        self.names = None if names is None else [str(name) for name in names]
        self.every = every
        self.per_objective = per_objective
        self.pairwise = pairwise
        self.history: list[dict[str, float]] = []
        """One flat dictionary per recorded step, with its ``step`` key."""
        self.last: ConflictMetrics | None = None
        """The structured metrics of the last recorded step (cosine matrix included)."""
        self._next_step = 0

    def record(
        self,
        gramian: Tensor,
        weights: Tensor | None = None,
        step: int | None = None,
        losses: Tensor | Sequence[float | Tensor] | None = None,
    ) -> dict[str, float] | None:
        """Compute the metrics of one step, log them and return them.

        Args:
            gramian: the ``[m, m]`` Gramian of the step's Jacobian.
            weights: the ``[m]`` weights of the update, or ``None``.
            step: the step number (default: one more than the previous call's).
            losses: the ``m`` loss values (a tensor, or floats or scalar tensors), logged as
                ``loss/<name>``.

        Returns:
            The flat metrics, or ``None`` when ``step`` is skipped by ``every``.
        """
        step = self._next_step if step is None else int(step)
        if step % self.every:
            self._next_step = step + 1
            return None
        metrics = conflict_metrics(gramian, weights)
        names = self.names if self.names is not None else [str(i) for i in range(metrics.m)]
        flat = metrics.to_dict(names, per_objective=self.per_objective, pairwise=self.pairwise)
        if losses is not None:
            values = (
                losses.detach().reshape(-1).tolist()
                if isinstance(losses, Tensor)
                else [float(v.detach()) if isinstance(v, Tensor) else float(v) for v in losses]
            )
            if len(values) != metrics.m:
                raise ValueError(
                    f"`losses` must hold {metrics.m} values (one per objective), received "
                    f"{len(values)}."
                )
            for name, value in zip(names, values):
                flat[f"loss/{name}"] = float(value)
        # (the state moves only once the step is accepted: a refused one changes nothing)
        self._next_step, self.last = step + 1, metrics
        for logger in self.loggers:
            logger.log(flat, step)
        self.history.append({"step": float(step), **flat})
        return flat

    def close(self) -> None:
        """Close every logger."""
        for logger in self.loggers:
            logger.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
