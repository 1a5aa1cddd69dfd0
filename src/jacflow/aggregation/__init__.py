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

from jacflow.aggregation._aligned_mtl import AlignedMTL, AlignedMTLWeighting
from jacflow.aggregation._auxinash import AuxiNash, AuxiNashWeighting
from jacflow.aggregation._bases import (
    Aggregator,
    GramianWeightedAggregator,
    GramianWeighting,
    WeightedAggregator,
    Weighting,
)
from jacflow.aggregation._cagrad import CAGrad, CAGradWeighting
from jacflow.aggregation._config import ConFIG
from jacflow.aggregation._constant import Constant, ConstantWeighting
from jacflow.aggregation._crmogm import CRMOGMWeighting
from jacflow.aggregation._dbmtl import DBMTL
from jacflow.aggregation._dualproj import DualProj, DualProjWeighting
from jacflow.aggregation._epo import EPO, EPOWeighting
from jacflow.aggregation._excess_mtl import ExcessMTL, ExcessMTLWeighting
from jacflow.aggregation._fairgrad import FairGrad, FairGradWeighting
from jacflow.aggregation._graddrop import GradDrop
from jacflow.aggregation._gradnorm import GradNorm, GradNormWeighting
from jacflow.aggregation._gradvac import GradVac, GradVacWeighting
from jacflow.aggregation._imtl import IMTL
from jacflow.aggregation._imtlg import IMTLG, IMTLGWeighting
from jacflow.aggregation._krum import Krum, KrumWeighting
from jacflow.aggregation._log_loss import LogLoss
from jacflow.aggregation._loss_aware import LossAware
from jacflow.aggregation._mean import Mean, MeanWeighting
from jacflow.aggregation._mgda import MGDA, MGDAWeighting
from jacflow.aggregation._moco import MoCo
from jacflow.aggregation._modo import MoDo, MoDoWeighting
from jacflow.aggregation._nash_mtl import NashMTL, NashMTLWeighting
from jacflow.aggregation._pareto_mtl import ParetoMTL, ParetoMTLWeighting
from jacflow.aggregation._pcd import PCD, PCDWeighting
from jacflow.aggregation._pcgrad import PCGrad, PCGradWeighting
from jacflow.aggregation._periodic import Periodic
from jacflow.aggregation._properties import Property
from jacflow.aggregation._random import Random, RandomWeighting
from jacflow.aggregation._representation import representation_gramian, representation_weights
from jacflow.aggregation._sdmgrad import SDMGrad, SDMGradWeighting
from jacflow.aggregation._sum import Sum, SumWeighting
from jacflow.aggregation._trimmed_mean import TrimmedMean
from jacflow.aggregation._upgrad import UPGrad, UPGradWeighting

__all__ = [
    "DBMTL",
    "EPO",
    "IMTL",
    "IMTLG",
    "MGDA",
    "PCD",
    "Aggregator",
    "AlignedMTL",
    "AlignedMTLWeighting",
    "AuxiNash",
    "AuxiNashWeighting",
    "CAGrad",
    "CAGradWeighting",
    "CRMOGMWeighting",
    "ConFIG",
    "Constant",
    "ConstantWeighting",
    "DualProj",
    "DualProjWeighting",
    "EPOWeighting",
    "ExcessMTL",
    "ExcessMTLWeighting",
    "FairGrad",
    "FairGradWeighting",
    "GradDrop",
    "GradNorm",
    "GradNormWeighting",
    "GradVac",
    "GradVacWeighting",
    "GramianWeightedAggregator",
    "GramianWeighting",
    "IMTLGWeighting",
    "Krum",
    "KrumWeighting",
    "LogLoss",
    "LossAware",
    "MGDAWeighting",
    "Mean",
    "MeanWeighting",
    "MoCo",
    "MoDo",
    "MoDoWeighting",
    "NashMTL",
    "NashMTLWeighting",
    "PCDWeighting",
    "PCGrad",
    "PCGradWeighting",
    "ParetoMTL",
    "ParetoMTLWeighting",
    "Periodic",
    "Property",
    "Random",
    "RandomWeighting",
    "SDMGrad",
    "SDMGradWeighting",
    "Sum",
    "SumWeighting",
    "TrimmedMean",
    "UPGrad",
    "UPGradWeighting",
    "WeightedAggregator",
    "Weighting",
    "representation_gramian",
    "representation_weights",
]
