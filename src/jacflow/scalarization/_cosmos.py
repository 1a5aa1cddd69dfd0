"""COSMOS: linear scalarization with a cosine-similarity reward."""

from __future__ import annotations

from typing import final

import torch
from torch import Tensor

from jacflow.aggregation._bases import compute_dtype
from jacflow.scalarization._base import (
    Hyperparameter,
    Scalarizer,
    floats,
    matching,
    tensors,
)


def _unit(v: Tensor) -> Tensor:
    """``v / ||v||``, and 0 for a zero ``v`` (whose direction is undefined), without a NaN
    gradient there."""
    norm = torch.linalg.vector_norm(v)
    return v / torch.where(norm > 0, norm, torch.ones_like(norm))


def cosmos(losses: Tensor, weights: Tensor, lambda_: float) -> Tensor:
    """``r.L - lambda_ * cos(r, L)``, the cosine of unit vectors (0 where one of them is zero):
    a floor on the product of norms made the gradient wrong for losses of norm below it."""
    r, f = weights.flatten(), losses.flatten()
    return r @ f - lambda_ * (_unit(r) @ _unit(f))


@final
class COSMOS(Scalarizer):
    r"""COSMOS scalarization: :math:`\sum_i r_i L_i - \lambda \cos(r, L)`, with
    :math:`\cos(r, L) = r^\top L / (\lVert r \rVert \lVert L \rVert)`.

    The cosine term pulls the vector of losses towards the preference ray :math:`r`, which
    spreads the solutions obtained for different preferences over the Pareto front.

    Paper: M. Ruchte, J. Grabocka, *Scalable Pareto Front Approximation for Deep Multi-Objective
    Learning*, ICDM 2021 (arXiv 2103.13392). The full method also feeds :math:`r` to the network
    as an input; that is the user's model, this class is the objective. Same names, parameters
    and defaults as TorchJD 0.18's ``COSMOS``.

    Args:
        lambda_: the weight :math:`\lambda \ge 0` of the cosine term (the paper uses 0.01 to 8).
        weights: the preference :math:`r`, one entry per loss; resample it from a Dirichlet
            distribution and reassign ``cosmos.weights`` at each step as in the paper.

    The value is computed in float32 for float16 or bfloat16 losses (the norm of small float16
    losses underflows), in their dtype otherwise, and rounded to the losses' dtype.

    Example:
        >>> import torch
        >>> from jacflow.scalarization import COSMOS
        >>> COSMOS(lambda_=1.0, weights=torch.tensor([0.5, 0.5]))(torch.tensor([3.0, 4.0]))
        tensor(2.5101)
    """

    lambda_ = Hyperparameter(floats(low=0.0))
    weights = Hyperparameter(tensors("COSMOS"))

    def __init__(self, lambda_: float, weights: Tensor) -> None:
        super().__init__()
        self.lambda_ = lambda_
        self.weights = weights

    def forward(self, losses: Tensor, /) -> Tensor:
        # (float32 at least: float16 squares of losses below 2e-4 underflow to 0 in the norm's
        # backward, which makes the gradient NaN)
        wide = losses.to(compute_dtype(losses.dtype))
        r = matching(self.weights, "weights", wide, "COSMOS")
        return cosmos(wide, r, self.lambda_).to(losses.dtype)

    def extra_repr(self) -> str:
        return f"lambda_={self.lambda_}, weights={self.weights!r}"
