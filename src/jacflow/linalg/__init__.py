"""Linear algebra of Jacobian descent: Gramians and the dual-cone projection.

Example:
    >>> import torch
    >>> from jacflow.linalg import compute_gramian
    >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
    >>> compute_gramian(J)
    tensor([[ 18., -22.],
            [-22.,  38.]])
"""

from jacflow.linalg._dual_cone import SolverWarning, project_weights
from jacflow.linalg._gramian import (
    compute_gramian,
    normalize_gramian,
    regularize_gramian,
    sum_gramians,
)
from jacflow.linalg._projectors import DualConeProjector, QuadprogProjector, TorchProjector

__all__ = [
    "DualConeProjector",
    "QuadprogProjector",
    "SolverWarning",
    "TorchProjector",
    "compute_gramian",
    "normalize_gramian",
    "project_weights",
    "regularize_gramian",
    "sum_gramians",
]
