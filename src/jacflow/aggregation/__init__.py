"""Aggregators (Jacobian ``[m, n]`` -> update ``[n]``) and weightings (Gramian -> weights ``[m]``).

Example:
    >>> import torch
    >>> from jacflow.aggregation import UPGrad, UPGradWeighting
    >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
    >>> UPGrad()(J)
    tensor([0.2924, 1.9006, 1.9006])
    >>> UPGradWeighting()(J @ J.T)
    tensor([1.1111, 0.7895])
"""

from jacflow.aggregation._bases import (
    Aggregator,
    GramianWeightedAggregator,
    GramianWeighting,
    WeightedAggregator,
    Weighting,
)
from jacflow.aggregation._gradnorm import GradNorm, GradNormWeighting
from jacflow.aggregation._log_loss import LogLoss
from jacflow.aggregation._loss_aware import LossAware
from jacflow.aggregation._mean import Mean, MeanWeighting
from jacflow.aggregation._periodic import Periodic
from jacflow.aggregation._properties import Property
from jacflow.aggregation._sum import Sum, SumWeighting
from jacflow.aggregation._upgrad import UPGrad, UPGradWeighting

__all__ = [
    "Aggregator",
    "GradNorm",
    "GradNormWeighting",
    "GramianWeightedAggregator",
    "GramianWeighting",
    "LogLoss",
    "LossAware",
    "Mean",
    "MeanWeighting",
    "Periodic",
    "Property",
    "Sum",
    "SumWeighting",
    "UPGrad",
    "UPGradWeighting",
    "WeightedAggregator",
    "Weighting",
]
