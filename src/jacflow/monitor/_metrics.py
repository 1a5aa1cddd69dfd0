"""Conflict metrics computed from the Gramian ``G = J J^T`` alone (and optionally the weights).

Every quantity that describes how objectives conflict is a function of the ``m x m`` Gramian:
``||g_i|| = sqrt(G_ii)``, ``cos(g_i, g_j) = G_ij / sqrt(G_ii G_jj)``, and for an update
``u = J^T w``, ``||u|| = sqrt(w^T G w)`` and ``cos(u, g_i) = (G w)_i / (||u|| ||g_i||)``. So the
metrics are cheap (no ``n``-sized work) and stay valid after a Gramian all-reduce.

Conventions for degenerate inputs: a cosine whose denominator is zero (a zero gradient or a zero
update) is reported as ``0``; the norm ratio of an all-zero Gramian is ``nan`` (``0 / 0``) and
``inf`` when only the smallest norm is zero. A Gramian with a non-finite entry makes the summary
statistics of :meth:`ConflictMetrics.to_dict` (conflict count and fraction, min and mean cosine)
``nan``.

Precision: float16 and bfloat16 Gramians are computed in float32 (``w^T G w`` would overflow
half precision), integer and bool Gramians in the default floating dtype (so fractional weights
are not truncated); the results have that dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from jacflow.aggregation._bases import compute_dtype


def _check_gramian(gramian: object) -> Tensor:
    if not isinstance(gramian, Tensor):
        raise TypeError(f"`gramian` must be a torch.Tensor, received {type(gramian)}.")
    if gramian.ndim != 2 or gramian.shape[0] != gramian.shape[1]:
        raise ValueError(
            "`gramian` must be a square matrix [m, m] (the Gramian J @ J.T), received shape "
            f"{tuple(gramian.shape)}. Compute it with `jacflow.linalg.compute_gramian(J)`."
        )
    if gramian.is_complex():
        raise TypeError(
            f"`gramian` must be a real matrix, received dtype {gramian.dtype}. Pass the real "
            "Gramian J @ J.T of a real Jacobian."
        )
    if gramian.device.type == "meta":
        raise ValueError(
            "`gramian` is on the meta device, which holds no values; pass a Gramian on a real "
            "device (e.g. cpu)."
        )
    if gramian.is_floating_point():
        dtype = compute_dtype(gramian.dtype)
    else:
        dtype = torch.get_default_dtype()
    return gramian.detach().to(dtype)


def _check_weights(weights: object, m: int, like: Tensor) -> Tensor:
    if not isinstance(weights, Tensor):
        raise TypeError(f"`weights` must be a torch.Tensor or None, received {type(weights)}.")
    if weights.shape != (m,):
        raise ValueError(
            f"`weights` must have shape ({m},) to match the [{m}, {m}] Gramian, received shape "
            f"{tuple(weights.shape)}."
        )
    return weights.detach().to(device=like.device, dtype=like.dtype)


def _safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator`` with ``0`` where the denominator is zero (NaN propagates)."""
    zero = denominator == 0
    return torch.where(
        zero, torch.zeros_like(numerator), numerator / torch.where(zero, 1, denominator)
    )


def gradient_norms(gramian: Tensor) -> Tensor:
    """Norms ``||g_i|| = sqrt(G_ii)`` of the ``m`` gradients.

    Example:
        >>> import torch
        >>> from jacflow.monitor import gradient_norms
        >>> J = torch.tensor([[3., 4.], [0., 2.]])
        >>> gradient_norms(J @ J.T)
        tensor([5., 2.])
    """
    g = _check_gramian(gramian)
    return g.diagonal().clamp(min=0).sqrt()


def cosine_similarities(gramian: Tensor) -> Tensor:
    """Pairwise cosine similarities ``G_ij / sqrt(G_ii G_jj)``, clamped to ``[-1, 1]``.

    Entries involving a zero gradient are ``0`` (also on the diagonal).

    Example:
        >>> import torch
        >>> from jacflow.monitor import cosine_similarities
        >>> J = torch.tensor([[1., 0.], [-1., 1.]])
        >>> cosine_similarities(J @ J.T)
        tensor([[ 1.0000, -0.7071],
                [-0.7071,  1.0000]])
    """
    g = _check_gramian(gramian)
    norms = gradient_norms(g)
    return _safe_divide(g, torch.outer(norms, norms)).clamp(-1.0, 1.0)


def conflicting_pairs(gramian: Tensor) -> int:
    """Number of pairs ``i < j`` whose gradients conflict (``G_ij < 0``).

    A ``nan`` entry is not counted (it is not negative): check that the Gramian is finite
    before reading the count (:meth:`ConflictMetrics.to_dict` reports ``nan`` then).

    Example:
        >>> import torch
        >>> from jacflow.monitor import conflicting_pairs
        >>> J = torch.tensor([[1., 0.], [-1., 1.], [0., 1.]])
        >>> conflicting_pairs(J @ J.T)
        1
    """
    g = _check_gramian(gramian)
    upper = torch.triu(torch.ones_like(g, dtype=torch.bool), diagonal=1)
    return int(((g < 0) & upper).sum())


def norm_ratio(gramian: Tensor) -> float:
    """Ratio ``max_i ||g_i|| / min_i ||g_i||`` of the largest to the smallest gradient norm:
    ``inf`` where one gradient is zero and the others not, ``nan`` where all are zero or there
    is no objective.

    Example:
        >>> import torch
        >>> from jacflow.monitor import norm_ratio
        >>> norm_ratio(torch.diag(torch.tensor([1., 4., 16.])))
        4.0
    """
    norms = gradient_norms(gramian)
    if norms.numel() == 0:
        return float("nan")
    return float(norms.max() / norms.min())


def update_norm(gramian: Tensor, weights: Tensor) -> Tensor:
    """Norm ``sqrt(w^T G w)`` of the update ``J^T w``.

    Example:
        >>> import torch
        >>> from jacflow.monitor import update_norm
        >>> J = torch.tensor([[3., 0.], [0., 4.]])
        >>> update_norm(J @ J.T, torch.tensor([1., 1.]))
        tensor(5.)
    """
    g = _check_gramian(gramian)
    w = _check_weights(weights, g.shape[0], g)
    return (w @ g @ w).clamp(min=0).sqrt()


def update_cosines(gramian: Tensor, weights: Tensor) -> Tensor:
    """Cosines ``cos(J^T w, g_i) = (G w)_i / (sqrt(w^T G w) sqrt(G_ii))`` of the update with
    each gradient; a positive entry means objective ``i`` decreases to first order.

    Example:
        >>> import torch
        >>> from jacflow.monitor import update_cosines
        >>> J = torch.tensor([[1., 0.], [0., 1.]])
        >>> update_cosines(J @ J.T, torch.tensor([1., 1.]))
        tensor([0.7071, 0.7071])
    """
    g = _check_gramian(gramian)
    w = _check_weights(weights, g.shape[0], g)
    denominator = update_norm(g, w) * gradient_norms(g)
    return _safe_divide(g @ w, denominator).clamp(-1.0, 1.0)


@dataclass(frozen=True)
class ConflictMetrics:
    """The conflict metrics of one step; build it with :func:`conflict_metrics`.

    Attributes:
        norms: ``[m]`` gradient norms.
        cosines: ``[m, m]`` pairwise cosine similarities.
        n_conflicting_pairs: number of pairs ``i < j`` with ``G_ij < 0`` (``nan`` entries are
            not counted; see ``finite``).
        norm_ratio: largest over smallest gradient norm.
        weights: the ``[m]`` weights of the update, or ``None``.
        update_norm: ``||J^T w||`` (``None`` without weights).
        update_cosines: ``[m]`` cosines between the update and each gradient (``None`` without
            weights).
        finite: whether every entry of the Gramian is finite; when not, the summary statistics
            of :meth:`to_dict` (``conflicting_pairs``, ``conflict_fraction``, ``min_cosine``,
            ``mean_cosine``) are ``nan``.

    Example:
        >>> import torch
        >>> from jacflow.monitor import conflict_metrics
        >>> J = torch.tensor([[1., 0.], [-1., 1.]])
        >>> metrics = conflict_metrics(J @ J.T, torch.tensor([0.5, 0.5]))
        >>> metrics.to_dict(["a", "b"])["cos/a-b"]
        -0.7071...
    """

    norms: Tensor
    cosines: Tensor
    n_conflicting_pairs: int
    norm_ratio: float
    weights: Tensor | None = None
    update_norm: Tensor | None = None
    update_cosines: Tensor | None = None
    finite: bool = True

    @property
    def m(self) -> int:
        """Number of objectives."""
        return int(self.norms.shape[0])

    def to_dict(
        self, names: list[str] | None = None, *, per_objective: bool = True, pairwise: bool = True
    ) -> dict[str, float]:
        """Flatten into ``{name: float}`` for loggers.

        Summary keys (always): ``conflicting_pairs``, ``conflict_fraction``, ``min_cosine``,
        ``mean_cosine``, ``norm_ratio`` and, with weights, ``update_norm`` and
        ``min_update_cos``. With ``per_objective``: ``norm/<i>`` (and ``weight/<i>``,
        ``update_cos/<i>`` with weights). With ``pairwise``: ``cos/<i>-<j>`` for ``i < j``.

        Args:
            names: one name per objective (default ``"0"``, ``"1"``, ...).
            per_objective: include the per-objective entries.
            pairwise: include one entry per pair of objectives.
        """
        m = self.m
        names = [str(i) for i in range(m)] if names is None else list(names)
        if len(names) != m:
            raise ValueError(f"`names` must have {m} entries (one per objective), got {names!r}.")
        pairs = torch.triu_indices(m, m, offset=1)
        pair_tensor = self.cosines[pairs[0], pairs[1]]
        n_pairs = pair_tensor.numel()
        out: dict[str, float] = {
            "conflicting_pairs": float(self.n_conflicting_pairs),
            "conflict_fraction": self.n_conflicting_pairs / n_pairs if n_pairs else 0.0,
            "min_cosine": float(pair_tensor.min()) if n_pairs else 1.0,
            "mean_cosine": float(pair_tensor.mean()) if n_pairs else 1.0,
            "norm_ratio": self.norm_ratio,
        }
        if not self.finite:
            for key in ("conflicting_pairs", "conflict_fraction", "min_cosine", "mean_cosine"):
                out[key] = math.nan
        if self.update_norm is not None and self.update_cosines is not None:
            out["update_norm"] = float(self.update_norm)
            out["min_update_cos"] = float(self.update_cosines.min()) if m else 1.0
        if per_objective:
            for name, value in zip(names, self.norms.tolist()):
                out[f"norm/{name}"] = value
            if self.weights is not None and self.update_cosines is not None:
                for name, value in zip(names, self.weights.tolist()):
                    out[f"weight/{name}"] = value
                for name, value in zip(names, self.update_cosines.tolist()):
                    out[f"update_cos/{name}"] = value
        if pairwise:
            for i, j, value in zip(pairs[0].tolist(), pairs[1].tolist(), pair_tensor.tolist()):
                out[f"cos/{names[i]}-{names[j]}"] = value
        return out


def conflict_metrics(gramian: Tensor, weights: Tensor | None = None) -> ConflictMetrics:
    """All conflict metrics of one step from the Gramian ``J J^T`` and optional weights ``w``.

    Args:
        gramian: the ``[m, m]`` Gramian of the Jacobian (one gradient per row of ``J``).
        weights: the ``[m]`` weights of the update ``J^T w`` (e.g. returned by a weighting),
            or ``None`` to skip the update metrics.

    Example:
        >>> import torch
        >>> from jacflow.monitor import conflict_metrics
        >>> J = torch.tensor([[1., 0.], [-1., 1.], [0., 2.]])
        >>> metrics = conflict_metrics(J @ J.T, torch.tensor([1., 1., 0.]))
        >>> metrics.n_conflicting_pairs, metrics.norm_ratio
        (1, 2.0)
        >>> metrics.update_cosines
        tensor([0.0000, 0.7071, 1.0000])
    """
    g = _check_gramian(gramian)
    finite = bool(torch.isfinite(g).all())
    if weights is None:
        return ConflictMetrics(
            norms=gradient_norms(g),
            cosines=cosine_similarities(g),
            n_conflicting_pairs=conflicting_pairs(g),
            norm_ratio=norm_ratio(g),
            finite=finite,
        )
    w = _check_weights(weights, g.shape[0], g)
    return ConflictMetrics(
        norms=gradient_norms(g),
        cosines=cosine_similarities(g),
        n_conflicting_pairs=conflicting_pairs(g),
        norm_ratio=norm_ratio(g),
        weights=w,
        update_norm=update_norm(g, w),
        update_cosines=update_cosines(g, w),
        finite=finite,
    )
