"""Aligned-MTL: aligning the principal components of the gradients (Senushkin et al., 2023)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from jacflow.aggregation._bases import GramianWeightedAggregator, GramianWeighting
from jacflow.aggregation._hyperparameters import Forwarded, Hyperparameter
from jacflow.aggregation._nonfinite import has_nonfinite, nan_weights
from jacflow.aggregation._pref_vector import (
    check_pref_rows,
    check_pref_vector,
    resolve_pref_vector,
)
from jacflow.aggregation._properties import Property

ScaleMode = Literal["min", "median", "rmse"]
_SCALE_MODES: tuple[str, ...] = ("min", "median", "rmse")


def aligned_mtl_weights(gramian: Tensor, pref: Tensor, scale_mode: str) -> Tensor:
    r"""Aligned-MTL weights :math:`w = s\, V \Lambda^{-1/2} V^\top p` on the positive spectrum.

    :math:`G = V \Lambda V^\top`; eigenvalues at or below ``m * eps * max(Λ)`` count as 0 and
    are left out of the inverse and of the scale :math:`s` (over the singular values
    :math:`\sigma = \sqrt{\lambda}` kept: their minimum, their median, or
    :math:`\sqrt{\mathrm{mean}\,\lambda}` for ``"rmse"``). A zero Gramian gives zero weights.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._aligned_mtl import aligned_mtl_weights
        >>> G = torch.tensor([[18., -22.], [-22., 38.]])
        >>> aligned_mtl_weights(G, torch.tensor([0.5, 0.5]), "min")
        tensor([0.5591, 0.4083])
    """
    m = gramian.shape[0]
    if m == 0:
        return gramian.new_zeros(0)
    if has_nonfinite(gramian):
        return nan_weights(m, gramian)
    eigenvalues, eigenvectors = torch.linalg.eigh(gramian)
    threshold = eigenvalues.max() * m * torch.finfo(gramian.dtype).eps
    kept = eigenvalues > threshold
    if not bool(kept.any()):
        return torch.zeros_like(pref)
    safe = torch.where(kept, eigenvalues, torch.ones_like(eigenvalues))
    inverse_sqrt = torch.where(kept, safe.rsqrt(), torch.zeros_like(eigenvalues))
    kept_values = eigenvalues[kept]
    if scale_mode == "min":
        scale = kept_values.min().sqrt()
    elif scale_mode == "median":
        scale = kept_values.sqrt().median()
    else:
        scale = kept_values.mean().sqrt()
    return scale * (eigenvectors @ (inverse_sqrt * (eigenvectors.T @ pref)))


def _check_scale_mode(scale_mode: object, name: str) -> ScaleMode:
    if scale_mode not in _SCALE_MODES:
        raise ValueError(f"`{name}` must be one of {_SCALE_MODES}, received {scale_mode!r}.")
    return scale_mode  # type: ignore[return-value]  # (one of the literals)


class AlignedMTLWeighting(GramianWeighting):
    """Gramian weighting of :class:`AlignedMTL` (Senushkin et al., *Independent Component
    Alignment for Multi-Task Learning*, CVPR 2023).

    Args:
        pref_vector: preference weight of each objective (default ``1/m`` each).
        scale_mode: ``"min"`` (default), ``"median"`` or ``"rmse"``.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import AlignedMTLWeighting
        >>> AlignedMTLWeighting()(torch.tensor([[18., -22.], [-22., 38.]]))
        tensor([0.5591, 0.4083])
    """

    without_autograd = True

    pref_vector = Hyperparameter(check_pref_vector)
    scale_mode = Hyperparameter(_check_scale_mode)

    def __init__(self, pref_vector: Tensor | None = None, scale_mode: ScaleMode = "min") -> None:
        super().__init__()
        self.pref_vector = pref_vector
        self.scale_mode = scale_mode

    scale_invariant = True  # (the scale s and the inverse square roots of the eigenvalues cancel)

    def check_rows(self, m: int) -> None:
        check_pref_rows(self.pref_vector, m)

    def forward(self, stat: Tensor) -> Tensor:
        with torch.no_grad():
            pref = resolve_pref_vector(self.pref_vector, stat.shape[0], stat)
            return aligned_mtl_weights(stat, pref, self.scale_mode)

    def extra_repr(self) -> str:
        return f"pref_vector={self.pref_vector!r}, scale_mode={self.scale_mode!r}"


class AlignedMTL(GramianWeightedAggregator):
    r"""Aligned-MTL.

    Senushkin, Patakin, Kuznetsov & Konushin, *Independent Component Alignment for Multi-Task
    Learning*, CVPR 2023 (arXiv 2305.19000). The rows are replaced by an orthogonal system of
    equal norms that spans the same space, :math:`\hat J = s\,G^{-1/2} J`, with
    :math:`G = JJ^\top = V\Lambda V^\top`, :math:`G^{-1/2} = V\Lambda^{-1/2}V^\top` on the
    positive spectrum and :math:`s` the smallest singular value (``"min"``), the median one
    (``"median"``) or :math:`\sqrt{\mathrm{mean}\,\lambda}` (``"rmse"``):

    .. math:: A(J) = \hat J^\top p = J^\top \big(s\, V\Lambda^{-1/2}V^\top p\big).

    Invariant to the rows' order.

    Args:
        pref_vector: preference weights :math:`p` (default ``1/m`` each).
        scale_mode: ``"min"`` (default), ``"median"`` or ``"rmse"``.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import AlignedMTL
        >>> AlignedMTL()(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([0.2133, 0.9673, 0.9673])
    """

    properties = frozenset({Property.PERMUTATION_INVARIANT, Property.WEIGHTED})

    pref_vector = Forwarded(AlignedMTLWeighting.pref_vector)
    scale_mode = Forwarded(AlignedMTLWeighting.scale_mode)

    def __init__(self, pref_vector: Tensor | None = None, scale_mode: ScaleMode = "min") -> None:
        super().__init__(AlignedMTLWeighting(pref_vector, scale_mode))

    def extra_repr(self) -> str:
        return self.gramian_weighting.extra_repr()
