"""CAGrad: Conflict-Averse Gradient descent (Liu, Liu, Jin, Stone & Liu, NeurIPS 2021)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from jacflow.aggregation._bases import GramianWeighting
from jacflow.aggregation._hyperparameters import Forwarded, Hyperparameter, floats
from jacflow.aggregation._preset import NoGradGramianPreset
from jacflow.aggregation._properties import Property
from jacflow.aggregation._simplex import min_norm_weights

_RESCALES = (0, 1, 2)


def _hull_weights(gramian: Tensor, s: float, noise: float = 0.0) -> Tensor:
    """Simplex weights ``w`` of ``x* = argmin_{x in conv(g_i)} g0.x + s ||x||``.

    For ``tau >= 0`` let ``x(tau)`` be the projection of ``-tau g0`` onto the hull, i.e. the
    min-norm point of the translated points ``g_i + tau g0`` (Wolfe's algorithm). Writing
    ``||x|| = min_l (||x||^2 / l + l) / 2`` shows that ``x* = x(tau*)`` where ``tau*`` is the
    unique sign change of ``h(tau) = ||x(tau)|| - s tau`` (positive before, negative after).
    ``tau*`` lies in ``[0, max_i ||g_i|| / s]`` and is found by safeguarded false position.
    ``noise`` is the relative rounding of the Gramian: ``||x||`` of ``x = sum_i w_i g_i`` is
    known only up to ``noise * sum_i w_i ||g_i||`` (the rows that support ``x``, not the
    largest).
    """
    m = gramian.shape[0]
    u = torch.full((m,), 1.0 / m, dtype=gramian.dtype, device=gramian.device)
    b = gramian @ u
    q = float(u @ b)
    cross = b[:, None] + b[None, :]

    norms = gramian.diagonal().clamp_min(0).sqrt()

    def evaluate(tau: float, start: Tensor | None) -> tuple[Tensor, float]:
        w = min_norm_weights(gramian + tau * cross + tau * tau * q, start)
        return w, math.sqrt(max(float(w @ gramian @ w), 0.0)) - s * tau

    radius = float(norms.max())
    lo, hi = 0.0, radius / s
    w, h_lo = evaluate(lo, None)
    w_hi, h_hi = evaluate(hi, w)
    if h_hi >= 0:  # only when every point has the same norm and x(hi) is one of them
        return w_hi
    # ||x|| read from the Gramian is exact only up to ``zero`` (its rounding): where both ||x|| and
    # s tau are below 2 zero the sign of h is noise, and tau is taken as too small.
    zero = noise * float(w @ norms)
    side = 0
    for _ in range(200):
        usable = h_lo > 2 * zero
        tau = lo + (hi - lo) * h_lo / (h_lo - h_hi) if usable else 0.5 * (lo + hi)
        if not lo < tau < hi:
            tau = 0.5 * (lo + hi)
        w, h = evaluate(tau, w)
        zero = noise * float(w @ norms)
        if abs(h) <= 1e-13 * radius or hi - lo <= 1e-13 * hi:
            break
        norm = h + s * tau
        if h <= 0 and norm <= zero and s * tau > 2 * zero:
            break  # tau >= tau* and ||x|| grows with tau, so ||x*|| <= ||x(tau)|| <= zero
        # Illinois rule: when the same end moves twice, halve the stale end's value.
        if h > 0 or s * tau <= 2 * zero:
            lo, h_lo = tau, max(h, 0.0)
            h_hi = 0.5 * h_hi if side == 1 else h_hi
            side = 1
        else:
            hi, h_hi = tau, h
            h_lo = 0.5 * h_lo if side == -1 else h_lo
            side = -1
    return w


def _nearest_psd(gramian: Tensor) -> Tensor:
    """``gramian`` with its negative eigenvalues clipped to 0 (Wolfe's algorithm needs a true Gram
    matrix; one formed in low precision is PSD only up to rounding), computed on the Gramian
    of the unit rows: the eigensolver's error is then relative to each entry's ``|g_i||g_j|``,
    not to the largest row's norm, which would swamp rows much shorter than it.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._cagrad import _nearest_psd
        >>> _nearest_psd(torch.tensor([[1.0, 1e-3], [1e-3, 1e-6 - 1e-12]], dtype=torch.float64))
        tensor([[1.0000e+00, 1.0000e-03],
                [1.0000e-03, 1.0000e-06]], dtype=torch.float64)
    """
    norms = gramian.diagonal().clamp_min(0).sqrt()
    inverse = torch.where(norms > 0, 1 / torch.where(norms > 0, norms, 1.0), 0.0)
    eigenvalues, eigenvectors = torch.linalg.eigh(gramian * inverse[:, None] * inverse[None, :])
    unit = (eigenvectors * eigenvalues.clamp_min(0)) @ eigenvectors.T
    return unit * norms[:, None] * norms[None, :]


def cagrad_weights(gramian: Tensor, c: float, norm_eps: float, rescale: int) -> Tensor:
    r"""CAGrad weights of the Gramian (any scale; solved in float64 on its device).

    With :math:`G` divided by its trace, :math:`u = 1/m`, :math:`g_0 = J^\top u` and
    :math:`s = c\|g_0\|`, solve :math:`\min_{w \in \Delta} g_w^\top g_0 + s\|g_w\|` and return
    :math:`(u + s\, w / \|g_w\|) / r` with :math:`r = 1, 1 + c^2, 1 + c` for ``rescale`` 0, 1, 2.
    Returns zeros when :math:`\|g_w\|` is below ``norm_eps`` (on the trace-normalised scale) or
    below the resolution of the Gramian's dtype, ``12 sqrt(eps)`` of
    :math:`\sum_i w_i \|g_i\|` (the rows that support :math:`g_w`: 0 is then in their
    convex hull up to rounding), and NaN weights for a non-finite Gramian.
    """
    m = gramian.shape[0]
    dtype, device = gramian.dtype, gramian.device
    if m == 0:
        return torch.zeros(0, dtype=dtype, device=device)
    G = gramian.detach().to(torch.float64)
    if not bool(torch.isfinite(G).all()):
        return torch.full((m,), math.nan, dtype=dtype, device=device)
    trace = float(G.trace())
    if trace <= 0:
        return torch.zeros(m, dtype=dtype, device=device)
    G = _nearest_psd((G + G.T) / (2 * trace))
    u = torch.full((m,), 1.0 / m, dtype=torch.float64, device=device)
    s = c * math.sqrt(max(float(u @ G @ u), 0.0))
    if s == 0:
        weights = u
    else:
        # Rounding errors of the Gramian (eps of its dtype relative to |g_i||g_j| in entry ij)
        # move x* = g_w by about sqrt(eps) sum_i w_i |g_i|: the root search cannot resolve
        # ||x*|| below a few times that, and there x* = 0 (its direction is noise).
        noise = 3 * math.sqrt(torch.finfo(dtype).eps)
        w = _hull_weights(G, s, noise)
        norm = math.sqrt(max(float(w @ G @ w), 0.0))
        resolution = noise * float(w @ G.diagonal().clamp_min(0).sqrt())
        if norm == 0 or norm < max(norm_eps, 4 * resolution):
            return torch.zeros(m, dtype=dtype, device=device)
        weights = u + (s / norm) * w
    divisor = (1.0, 1.0 + c * c, 1.0 + c)[rescale]
    return (weights / divisor).to(dtype)


def _check_rescale(rescale: object, name: str) -> int:
    if isinstance(rescale, bool) or rescale not in _RESCALES:
        raise ValueError(
            f"`{name}` must be 0 (none), 1 (divide by 1 + c^2) or 2 (divide by 1 + c), received "
            f"{rescale!r}."
        )
    return int(rescale)


class CAGradWeighting(GramianWeighting):
    r"""Gramian weighting of :class:`CAGrad`.

    Args:
        c: radius of the ball around the mean gradient, relative to its norm; ``c >= 0``.
        norm_eps: below this norm of :math:`g_w` (Gramian divided by its trace, so relative to
            the rows' scale), the point is treated as Pareto-stationary and the weights are 0;
            so is it below the Gramian's rounding, ``12 sqrt(eps)`` of :math:`\sum_i w_i
            \|g_i\|` (relative to the rows that support :math:`g_w`, not the largest row).
        rescale: 0 (default, TorchJD's behaviour): no rescaling; 1: divide by :math:`1 + c^2`
            (the official code's default); 2: divide by :math:`1 + c`.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import CAGradWeighting
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> CAGradWeighting(c=0.5)(J @ J.T)
        tensor([0.7041, 0.5000])
    """

    without_autograd = True

    c = Hyperparameter(floats(low=0.0))
    norm_eps = Hyperparameter(floats(low=0.0))
    rescale = Hyperparameter(_check_rescale)

    def __init__(self, c: float, norm_eps: float = 1e-4, rescale: int = 0) -> None:
        super().__init__()
        self.c = c
        self.norm_eps = norm_eps
        self.rescale = rescale

    scale_invariant = True  # (it solves on G divided by its trace)

    def forward(self, stat: Tensor) -> Tensor:
        with torch.no_grad():
            return cagrad_weights(stat, self.c, self.norm_eps, self.rescale)

    def extra_repr(self) -> str:
        return f"c={self.c}, norm_eps={self.norm_eps}, rescale={self.rescale}"

    def __str__(self) -> str:
        return f"CAGrad{self.c:g}"


class CAGrad(NoGradGramianPreset):
    r"""Conflict-Averse Gradient descent (CAGrad).

    Liu, Liu, Jin, Stone & Liu, *Conflict-Averse Gradient Descent for Multi-task Learning*,
    NeurIPS 2021 (arXiv 2110.14048), Algorithm 1. The update maximises the worst improvement
    among the objectives in a ball around the mean gradient :math:`g_0 = \frac1m \sum_i g_i`:

    .. math:: d = \arg\max_{\|d - g_0\| \le c\|g_0\|} \min_i g_i^\top d
              = g_0 + c\|g_0\| \frac{g_w}{\|g_w\|},\quad
              w = \arg\min_{w \in \Delta_m} g_w^\top g_0 + c\|g_0\|\,\|g_w\|,

    with :math:`g_w = J^\top w`. The dual problem is solved exactly in torch, from the Gramian
    only (a one-dimensional root search over projections onto the convex hull of the rows).
    For :math:`c \ge 1` the update conflicts with no objective. Permutation invariant.

    Args:
        c: radius of the ball, relative to :math:`\|g_0\|`; ``c >= 0`` (``c = 0`` is the mean).
        norm_eps: :math:`\|g_w\|` below which the update is 0 (relative to the rows' scale;
            TorchJD compares the same quantity, but also zeroes Jacobians whose squared norm is
            below it, which this implementation does not).
        rescale: 0 (default, as TorchJD): :math:`d`; 1: :math:`d / (1 + c^2)` (the official
            code's default); 2: :math:`d / (1 + c)`.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import CAGrad
        >>> CAGrad(c=0.5)(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([0.1835, 1.2041, 1.2041])
    """

    properties = frozenset({Property.PERMUTATION_INVARIANT, Property.WEIGHTED})

    c = Forwarded(CAGradWeighting.c)
    norm_eps = Forwarded(CAGradWeighting.norm_eps)
    rescale = Forwarded(CAGradWeighting.rescale)

    def __init__(self, c: float, norm_eps: float = 1e-4, rescale: int = 0) -> None:
        super().__init__(CAGradWeighting(c, norm_eps, rescale))

    def __str__(self) -> str:
        return str(self.gramian_weighting)
