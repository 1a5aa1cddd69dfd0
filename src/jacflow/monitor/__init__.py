"""Conflict monitoring: metrics from the Gramian, a callback for any loop, loggers and plots.

Everything is computed from the ``m x m`` Gramian ``G = J J^T`` of the step's Jacobian (and the
weights of the update when there are some), so monitoring costs no ``n``-sized work.

Example:
    >>> import torch
    >>> from jacflow.aggregation import UPGrad
    >>> from jacflow.monitor import AggregatorWatch, Monitor
    >>> aggregator = UPGrad()
    >>> watch, monitor = AggregatorWatch(aggregator), Monitor(names=["a", "b"])
    >>> update = aggregator(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
    >>> metrics = monitor.record(*watch.pop())
    >>> metrics["conflicting_pairs"], metrics["min_update_cos"] >= 0
    (1.0, True)
"""

from jacflow.monitor._loggers import CSVLogger, Logger, TensorBoardLogger
from jacflow.monitor._metrics import (
    ConflictMetrics,
    conflict_metrics,
    conflicting_pairs,
    cosine_similarities,
    gradient_norms,
    norm_ratio,
    update_cosines,
    update_norm,
)
from jacflow.monitor._monitor import Monitor
from jacflow.monitor._plots import plot_cosine_matrix, plot_cosines_over_training, plot_curves
from jacflow.monitor._watch import AggregatorWatch

__all__ = [
    "AggregatorWatch",
    "CSVLogger",
    "ConflictMetrics",
    "Logger",
    "Monitor",
    "TensorBoardLogger",
    "conflict_metrics",
    "conflicting_pairs",
    "cosine_similarities",
    "gradient_norms",
    "norm_ratio",
    "plot_cosine_matrix",
    "plot_cosines_over_training",
    "plot_curves",
    "update_cosines",
    "update_norm",
]
