"""GradDrop: gradient sign dropout (Chen et al., 2020)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from jacflow._labels import with_vector
from jacflow.aggregation._bases import Aggregator
from jacflow.aggregation._hyperparameters import Hyperparameter, check_unit_vector


def identity(purity: Tensor) -> Tensor:
    """The default transform of the sign purity: ``purity`` itself."""
    return purity


def graddrop(matrix: Tensor, f: Callable[[Tensor], Tensor], leak: Tensor | None) -> Tensor:
    r"""One GradDrop combination of the rows of ``matrix`` (uniform draws from torch's RNG).

    Per coordinate :math:`k`: purity :math:`P_k = \frac12(1 + \sum_i J_{ik} / \sum_i |J_{ik}|)`
    (:math:`\frac12` for an all-zero column), one draw :math:`U_k \sim \mathcal U(0, 1)`, masks
    :math:`M_{ik} = [f(P_k) > U_k][J_{ik} > 0] + [f(P_k) < U_k][J_{ik} < 0]`, and
    :math:`A(J)_k = \sum_i (\ell_i + (1 - \ell_i) M_{ik}) J_{ik}` with leak :math:`\ell`
    (0 by default).

    Example:
        >>> import torch
        >>> from jacflow.aggregation._graddrop import graddrop, identity
        >>> graddrop(torch.tensor([[1., -1.], [2., -3.]]), identity, None)
        tensor([ 3., -4.])
    """
    # Column sums of the positive and negative parts are all the masks ever select, so the
    # update needs two passes over J and no m x n mask.
    positive_part = matrix.clamp(min=0)
    negative_part = matrix.clamp(max=0)
    if leak is None:
        positive = positive_part.sum(dim=0)
        negative = negative_part.sum(dim=0)
        kept_positive, kept_negative, base = positive, negative, None
    else:
        weights = torch.stack([torch.ones_like(leak), 1 - leak]).to(matrix)
        positive, kept_positive = weights @ positive_part
        negative, kept_negative = weights @ negative_part
        base = leak.to(matrix) @ matrix
    signed = positive + negative
    total = positive - negative
    # An all-zero column has purity 1/2 (0 / tiny = 0); NaN/inf columns give NaN below.
    purity = (signed / total.clamp_(min=torch.finfo(matrix.dtype).tiny)).add_(1).mul_(0.5)
    transformed = f(purity)
    draws = torch.rand(matrix.shape[1], dtype=matrix.dtype, device=matrix.device)
    result = kept_positive * (transformed > draws)
    result.addcmul_(kept_negative, transformed < draws)
    if base is not None:
        result.add_(base)
    return result.add_(signed.mul_(0))  # 0 * (NaN or inf) = NaN: non-finite columns propagate


def _check_f(f: object, name: str) -> Callable[[Tensor], Tensor]:
    if not callable(f):
        raise TypeError(f"`{name}` must be callable (Tensor -> Tensor), received {type(f)}.")
    return f


def _check_leak(leak: object, name: str) -> Tensor | None:
    expected = "None or a vector (1-D tensor) with one value per objective"
    return None if leak is None else check_unit_vector(leak, name, expected)


class GradDrop(Aggregator):
    r"""GradDrop (gradient sign dropout).

    Chen, Ngiam, Huang, Luong, Kretzschmar, Chai & Anguelov, *Just Pick a Sign: Optimizing
    Deep Multitask Models with Gradient Sign Dropout*, NeurIPS 2020 (arXiv 2010.06808),
    Algorithm 1 lines 10-15. For every coordinate, the positive or the negative entries of
    the column are kept at random, the positive ones with probability :math:`f(P)` where
    :math:`P = \frac12(1 + \sum_i J_{ik}/\sum_i |J_{ik}|)` is the sign purity:

    .. math:: A(J)_k = \sum_i \big(\ell_i + (1-\ell_i) M_{ik}\big) J_{ik}, \quad
              M_{ik} = [f(P_k) > U_k][J_{ik} > 0] + [f(P_k) < U_k][J_{ik} < 0].

    The draws :math:`U_k \sim \mathcal U(0,1)` come from torch's global RNG. Not a weighted
    combination of the rows; no property claimed.

    Args:
        f: monotonically increasing map applied to the purity (default: identity).
        leak: per-row leak :math:`\ell \in [0, 1]^m` (1-D tensor) or ``None`` (no leak).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import GradDrop
        >>> _ = torch.manual_seed(0)
        >>> GradDrop()(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([6., 2., 2.])
    """

    f = Hyperparameter(_check_f)
    leak = Hyperparameter(_check_leak)

    def __init__(
        self, f: Callable[[Tensor], Tensor] = identity, leak: Tensor | None = None
    ) -> None:
        super().__init__()
        self.f = f
        self.leak = leak

    def check_rows(self, m: int) -> None:
        if self.leak is not None and self.leak.shape[0] != m:
            raise ValueError(
                f"`leak` has {self.leak.shape[0]} entries but the matrix has {m} rows; give one "
                "leak value per objective."
            )

    def forward(self, matrix: Tensor) -> Tensor:
        self.check_rows(matrix.shape[0])
        return graddrop(matrix, self.f, self.leak)

    def __str__(self) -> str:
        return with_vector("GradDrop", self.leak)

    def extra_repr(self) -> str:
        name = getattr(self.f, "__name__", repr(self.f))
        return f"f={name}, leak={self.leak!r}"
