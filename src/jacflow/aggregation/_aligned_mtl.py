"""Aligned-MTL: aligning the principal components of the gradients (Senushkin et al., 2023)."""

from __future__ import annotations

from typing import Any, Literal

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


def _kept_spectrum(gramian: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``G = V diag(λ) V^T`` (``λ`` ascending), the mask of the eigenvalues kept (above
    ``m * eps * max(λ)``) and that threshold."""
    eigenvalues, eigenvectors = torch.linalg.eigh(gramian)
    threshold = eigenvalues.max() * gramian.shape[0] * torch.finfo(gramian.dtype).eps
    return eigenvalues, eigenvectors, eigenvalues > threshold, threshold


def _inverse_sqrt(eigenvalues: Tensor, kept: Tensor) -> Tensor:
    """``λ^{-1/2}`` on the kept spectrum, 0 elsewhere."""
    safe = torch.where(kept, eigenvalues, torch.ones_like(eigenvalues))
    return torch.where(kept, safe.rsqrt(), torch.zeros_like(eigenvalues))


def _scale(kept_values: Tensor, scale_mode: str) -> Tensor:
    """The singular-value scale ``s`` of the kept eigenvalues (ascending)."""
    if scale_mode == "min":
        return kept_values.min().sqrt()
    if scale_mode == "median":
        return kept_values.sqrt().median()
    return kept_values.mean().sqrt()


def _divided_differences(eigenvalues: Tensor, kept: Tensor) -> Tensor:
    r"""The Daleckii-Krein matrix of :math:`f(\lambda) = \lambda^{-1/2}` on the kept spectrum
    and 0 on the rest: :math:`\Gamma_{ij} = (f(\lambda_i) - f(\lambda_j)) / (\lambda_i -
    \lambda_j)`, and :math:`f'(\lambda_i)` where :math:`\lambda_i = \lambda_j`, so that
    :math:`dF = V (\Gamma \circ V^\top dG\, V) V^\top` for :math:`F = V f(\Lambda) V^\top`.

    Between two kept eigenvalues it is :math:`-1 / (\sqrt{\lambda_i}\sqrt{\lambda_j}
    (\sqrt{\lambda_i} + \sqrt{\lambda_j}))`: no cancellation, and :math:`f'(\lambda_i)` when
    they are equal, so repeated or close eigenvalues need no tolerance. Between a kept and a
    dropped eigenvalue (strictly apart: one is above the threshold, the other not) it is the
    quotient itself; between two dropped ones, 0 (:math:`f` is 0 there).

    Example:
        >>> import torch
        >>> from jacflow.aggregation._aligned_mtl import _divided_differences
        >>> _divided_differences(torch.tensor([0.0, 4.0, 4.0]), torch.tensor([False, True, True]))
        tensor([[ 0.0000,  0.1250,  0.1250],
                [ 0.1250, -0.0625, -0.0625],
                [ 0.1250, -0.0625, -0.0625]])
    """
    root = torch.where(kept, eigenvalues, torch.ones_like(eigenvalues)).sqrt()
    both = kept[:, None] & kept[None, :]
    between_kept = -1.0 / (root[:, None] * root[None, :] * (root[:, None] + root[None, :]))
    f = torch.where(kept, 1.0 / root, torch.zeros_like(root))
    gap = eigenvalues[:, None] - eigenvalues[None, :]
    mixed = kept[:, None] ^ kept[None, :]
    quotient = (f[:, None] - f[None, :]) / torch.where(mixed, gap, torch.ones_like(gap))
    return torch.where(both, between_kept, torch.where(mixed, quotient, torch.zeros_like(gap)))


def _scale_gradient(
    eigenvalues: Tensor, kept: Tensor, threshold: Tensor, scale: Tensor, scale_mode: str
) -> Tensor:
    r""":math:`\partial s / \partial \lambda_i` for each eigenvalue (0 for the dropped ones).

    ``"rmse"``: :math:`s = \sqrt{\mathrm{mean}_K \lambda}`, so :math:`1 / (2 s |K|)` on the
    kept set :math:`K`. ``"min"`` and ``"median"``: :math:`s = \sqrt{\lambda_k}` for the
    smallest kept eigenvalue or the lower median one, so :math:`1 / (2 s)` on :math:`\lambda_k`
    when it is simple. When it is repeated (within ``sqrt(eps)`` relative, or the threshold:
    ``eigh``'s accuracy), :math:`s` is not differentiable (its directional derivative is
    the extreme eigenvalue of the perturbation restricted to the eigenspace); the
    :math:`1 / (2 s)` is shared evenly by the tied eigenvalues, the derivative of their mean.
    That is the derivative along every perturbation that keeps the tie (a rescaling of
    ``G``, ...) and, for a pair, the central difference along any perturbation. It depends on
    the eigenspace only, not on the basis that ``eigh`` picks in it.
    """
    if scale_mode == "rmse":
        return kept.to(scale.dtype) / (2 * scale * kept.sum())
    first = int(kept.numel() - kept.sum())  # (λ ascending: the kept ones come last)
    offset = 0 if scale_mode == "min" else (int(kept.sum()) - 1) // 2  # (torch's lower median)
    target = eigenvalues[first + offset]
    tolerance = torch.finfo(eigenvalues.dtype).eps ** 0.5 * target + threshold
    tied = (kept & ((eigenvalues - target).abs() <= tolerance)).to(scale.dtype)
    return tied / (2 * scale * tied.sum())


class _FirstOrderOnly(torch.autograd.Function):
    """The identity on the gradients ``grad_gramian`` and ``grad_pref`` (computed without a
    graph), attached to the tensors they depend on, ``sources``: differentiating them raises,
    where it would silently miss the terms through ``sources``."""

    @staticmethod
    def forward(
        ctx: Any, grad_gramian: Tensor, grad_pref: Tensor, *sources: Tensor
    ) -> tuple[Tensor, Tensor]:
        return grad_gramian.clone(), grad_pref.clone()

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, ...]:
        raise RuntimeError(
            "AlignedMTL's weights are differentiable once: their gradient has no derivative "
            "(it was computed with create_graph=True and then differentiated)."
        )


class _AlignedMTLWeights(torch.autograd.Function):
    """:func:`aligned_mtl_weights` on a finite Gramian of at least one row, with the
    derivative described there (first order only)."""

    @staticmethod
    def forward(ctx: Any, gramian: Tensor, pref: Tensor, scale_mode: str) -> Tensor:
        eigenvalues, eigenvectors, kept, threshold = _kept_spectrum(gramian)
        ctx.scale_mode = scale_mode
        ctx.kept_any = bool(kept.any())
        if not ctx.kept_any:
            ctx.save_for_backward(gramian, pref)
            return torch.zeros_like(pref)
        inverse_sqrt = _inverse_sqrt(eigenvalues, kept)
        scale = _scale(eigenvalues[kept], scale_mode)
        ctx.save_for_backward(gramian, pref, eigenvalues, eigenvectors, kept, threshold, scale)
        return scale * (eigenvectors @ (inverse_sqrt * (eigenvectors.T @ pref)))

    @staticmethod
    def backward(ctx: Any, grad_weights: Tensor) -> tuple[Tensor, Tensor, None]:
        gramian, pref, *spectrum = ctx.saved_tensors
        with torch.no_grad():
            if ctx.kept_any:
                grads = _gradients(grad_weights, pref, ctx.scale_mode, *spectrum)
            else:  # (nothing kept: zero weights, whatever G near it)
                grads = torch.zeros_like(gramian), torch.zeros_like(pref)
        if torch.is_grad_enabled():  # (create_graph=True)
            grads = _FirstOrderOnly.apply(*grads, gramian, pref, grad_weights)
        return grads[0], grads[1], None


def _gradients(
    grad_weights: Tensor,
    pref: Tensor,
    scale_mode: str,
    eigenvalues: Tensor,
    eigenvectors: Tensor,
    kept: Tensor,
    threshold: Tensor,
    scale: Tensor,
) -> tuple[Tensor, Tensor]:
    r"""The cotangents of ``G`` and ``p`` for :math:`w = s F p`, :math:`F = V f(\Lambda)
    V^\top`: :math:`\bar p = s F \bar w`, :math:`\bar s = \bar w^\top F p` and
    :math:`\bar F = s\, \mathrm{sym}(\bar w p^\top)`, brought to ``G`` by
    :func:`_divided_differences` and :func:`_scale_gradient` (all in the eigenbasis)."""
    V, inverse_sqrt = eigenvectors, _inverse_sqrt(eigenvalues, kept)
    p_hat, g_hat = V.T @ pref, V.T @ grad_weights
    grad_pref = scale * (V @ (inverse_sqrt * g_hat))
    grad_scale = g_hat @ (inverse_sqrt * p_hat)
    grad_f = scale * (g_hat[:, None] * p_hat[None, :] + p_hat[:, None] * g_hat[None, :]) / 2
    in_basis = _divided_differences(eigenvalues, kept) * grad_f + torch.diag(
        grad_scale * _scale_gradient(eigenvalues, kept, threshold, scale, scale_mode)
    )
    return V @ in_basis @ V.T, grad_pref


def aligned_mtl_weights(gramian: Tensor, pref: Tensor, scale_mode: str) -> Tensor:
    r"""Aligned-MTL weights :math:`w = s\, V \Lambda^{-1/2} V^\top p` on the positive spectrum.

    :math:`G = V \Lambda V^\top`; eigenvalues at or below ``m * eps * max(Λ)`` count as 0 and
    are left out of the inverse and of the scale :math:`s` (over the singular values
    :math:`\sigma = \sqrt{\lambda}` kept: their minimum, their median, or
    :math:`\sqrt{\mathrm{mean}\,\lambda}` for ``"rmse"``). A zero Gramian gives zero weights.

    Gradients, with respect to ``gramian`` and ``pref``, hold the set of kept eigenvalues
    fixed: the matrix function :math:`G^{-1/2}` by the Daleckii-Krein formula
    (:func:`_divided_differences`; finite and exact where eigenvalues repeat, e.g. orthogonal
    rows of equal norms, where autograd through ``eigh`` gives NaN), and the scale by
    :func:`_scale_gradient` (a repeated smallest or median eigenvalue makes the
    ``"min"``/``"median"`` scale non-differentiable: the tied eigenvalues share its derivative
    evenly). The dropped eigenvalues have a zero derivative: a perturbation that moves only
    them changes nothing, while one that lifts them above the threshold makes the weights jump
    (they are not continuous there; a rank-deficient ``G = J J^T`` keeps its rank under every
    perturbation of a ``J`` with fewer columns than rows). The gradient with respect to
    ``gramian`` is symmetric (``eigh`` reads one triangle, and a Gramian's perturbations are
    symmetric). First derivatives only: differentiating the gradient again (after
    ``create_graph=True``) raises a ``RuntimeError``.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._aligned_mtl import aligned_mtl_weights
        >>> G = torch.tensor([[18., -22.], [-22., 38.]])
        >>> aligned_mtl_weights(G, torch.tensor([0.5, 0.5]), "min")
        tensor([0.5591, 0.4083])
        >>> G = torch.eye(2, requires_grad=True)  # orthogonal rows of equal norms
        >>> aligned_mtl_weights(G, torch.tensor([0.5, 0.5]), "min")[0].backward()
        >>> G.grad  # (finite: autograd through eigh gives NaN here)
        tensor([[-0.1250, -0.1250],
                [-0.1250,  0.1250]])
    """
    m = gramian.shape[0]
    if m == 0:
        return gramian.new_zeros(0)
    if has_nonfinite(gramian):
        return nan_weights(m, gramian)
    weights: Tensor = _AlignedMTLWeights.apply(gramian, pref, scale_mode)
    return weights


def _check_scale_mode(scale_mode: object, name: str) -> ScaleMode:
    if scale_mode not in _SCALE_MODES:
        raise ValueError(f"`{name}` must be one of {_SCALE_MODES}, received {scale_mode!r}.")
    return scale_mode  # type: ignore[return-value]  # (one of the literals)


class AlignedMTLWeighting(GramianWeighting):
    """Gramian weighting of :class:`AlignedMTL` (Senushkin et al., *Independent Component
    Alignment for Multi-Task Learning*, CVPR 2023).

    The weights are differentiable with respect to the Gramian and the preference (first
    derivatives; see :func:`aligned_mtl_weights`).

    Args:
        pref_vector: preference weight of each objective (default ``1/m`` each).
        scale_mode: ``"min"`` (default), ``"median"`` or ``"rmse"``.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import AlignedMTLWeighting
        >>> AlignedMTLWeighting()(torch.tensor([[18., -22.], [-22., 38.]]))
        tensor([0.5591, 0.4083])
    """

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

    Invariant to the rows' order. Differentiable (first derivatives) with respect to ``J``
    through :math:`G` (``backward(..., create_graph=True)`` accepts it): the derivative of
    the matrix function :math:`G^{-1/2}` on the kept spectrum, finite where eigenvalues
    repeat; see :class:`AlignedMTLWeighting`.

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

    uniform_preference_properties = frozenset({Property.PERMUTATION_INVARIANT})

    pref_vector = Forwarded(AlignedMTLWeighting.pref_vector)
    scale_mode = Forwarded(AlignedMTLWeighting.scale_mode)

    def __init__(self, pref_vector: Tensor | None = None, scale_mode: ScaleMode = "min") -> None:
        super().__init__(AlignedMTLWeighting(pref_vector, scale_mode))

    def extra_repr(self) -> str:
        return self.gramian_weighting.extra_repr()
