"""MGDA: the minimum-norm point of the convex hull of the gradients (Désidéri; Sener & Koltun)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from torch import Tensor

from jacflow.aggregation._bases import GramianWeightedAggregator, GramianWeighting
from jacflow.aggregation._hyperparameters import Forwarded, Hyperparameter, floats, ints
from jacflow.aggregation._loss_aware import LossAware
from jacflow.aggregation._nonfinite import has_nonfinite, nan_weights
from jacflow.aggregation._properties import Property

Normalization = Literal["none", "l2", "loss", "loss+"]
_NORMALIZATIONS: tuple[str, ...] = ("none", "l2", "loss", "loss+")


def frank_wolfe_min_norm(gramian: Tensor, epsilon: float, max_iters: int) -> Tensor:
    r"""Frank-Wolfe iterate for :math:`\min_{\lambda \in \Delta_m} \lambda^\top G \lambda`.

    Algorithm 2 of Sener & Koltun (2018): start at :math:`\lambda = 1/m`; at each step move
    towards the vertex :math:`e_t`, :math:`t = \arg\min_r (G\lambda)_r`, by the exact line
    search :math:`\gamma = \mathrm{clip}((\lambda^\top G \lambda - (G\lambda)_t) /
    (\lambda^\top G \lambda - 2 (G\lambda)_t + G_{tt}), 0, 1)`; stop after a step with
    :math:`\gamma` below ``epsilon`` (as TorchJD) or after ``max_iters`` steps.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._mgda import frank_wolfe_min_norm
        >>> frank_wolfe_min_norm(torch.tensor([[18., -22.], [-22., 38.]]), 1e-3, 100)
        tensor([0.6000, 0.4000])
    """
    m = gramian.shape[0]
    lam = torch.full((m,), 1.0 / max(m, 1), dtype=gramian.dtype, device=gramian.device)
    if m <= 1:
        return lam
    diagonal = gramian.diagonal().tolist()
    g_lam = gramian @ lam  # kept equal to G lambda by the same convex update as lambda
    a = float(lam @ g_lam)  # <v, v> with v = J^T lambda
    # Scalars live on the host: each step needs its argmin there anyway (one sync per step).
    for _ in range(max_iters):
        t = int(torch.argmin(g_lam))
        b = float(g_lam[t])  # <v, g_t>
        c = diagonal[t]  # <g_t, g_t>
        denominator = a - 2 * b + c  # |v - g_t|^2
        gamma = min(max((a - b) / denominator, 0.0), 1.0) if denominator > 0 else 0.0
        lam.mul_(1 - gamma)
        lam[t] += gamma
        g_lam.mul_(1 - gamma).add_(gramian[t], alpha=gamma)
        a = (1 - gamma) ** 2 * a + 2 * gamma * (1 - gamma) * b + gamma**2 * c
        if gamma < epsilon:
            break
    return lam


def two_row_min_norm(gramian: Tensor) -> Tensor:
    r"""Closed form for ``m = 2``: :math:`\lambda_1 = \mathrm{clip}((G_{22} - G_{12}) /
    (G_{11} + G_{22} - 2G_{12}), 0, 1)` and :math:`\lambda_2 = \mathrm{clip}((G_{11} - G_{12})
    / (G_{11} + G_{22} - 2G_{12}), 0, 1)` (1/2 each when the rows are equal). The smaller is
    computed from its own numerator and the larger is 1 minus it: their sum is 1.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._mgda import two_row_min_norm
        >>> two_row_min_norm(torch.tensor([[18., -22.], [-22., 38.]]))
        tensor([0.6000, 0.4000])
    """
    g11, g12, g22 = gramian[0, 0], gramian[0, 1], gramian[1, 1]
    denominator = g11 + g22 - 2 * g12
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    # The smaller weight from its own numerator, the larger as 1 minus it: with rows of norms
    # 1e6 apart, the long row's weight is below eps, and 1 - (1 - it) is 0 (the update was the
    # short row); both from their numerators, nearly equal rows' rounding in the denominator
    # gave weights summing to 0.5 or 1.5.
    numerators = torch.stack([g22 - g12, g11 - g12])
    ratios = (numerators / safe).clamp(0.0, 1.0)
    first_smaller = numerators[0] <= numerators[1]
    first = torch.where(first_smaller, ratios[0], 1 - ratios[1])
    weights = torch.stack([first, torch.where(first_smaller, 1 - ratios[0], ratios[1])])
    return torch.where(denominator > 0, weights, 0.5)


def _bordered_solution(kkt: Tensor, rhs: Tensor) -> Tensor:
    """``pinv(kkt) @ rhs`` for a symmetric ``kkt``: by an LU solve where no pivot of its
    factorisation is within ``sqrt(eps)`` of the largest (1.5e-8 in float64, 3.5e-4 in
    float32: a well-conditioned system, where the pseudo-inverse, which cuts below ``k eps``,
    cuts nothing and its solution is the inverse's, up to the rounding of each) and the
    residual is at rounding level, else by the pseudo-inverse (a singular or nearly singular
    Gramian: duplicated, dependent, nearly parallel or zero rows, whose systems have many
    solutions, of which pinv's is the smallest). An LU solve costs a fraction of the SVD
    behind ``pinv`` (MGDA at m = 500: 4.4 s of pseudo-inverses)."""
    k = kkt.shape[0]
    eps = torch.finfo(kkt.dtype).eps
    factors, pivots, info = torch.linalg.lu_factor_ex(kkt)
    diagonal = factors.diagonal().abs()
    if not bool(info) and bool(diagonal.min() > eps**0.5 * diagonal.max()):
        solution = torch.linalg.lu_solve(factors, pivots, rhs[:, None]).squeeze(1)
        residual = (kkt @ solution - rhs).abs().max()
        bound = 16 * k * eps * (kkt.abs().max() * solution.abs().max() + 1)
        if bool(residual <= bound):
            return solution
    return torch.linalg.pinv(kkt, hermitian=True) @ rhs


def refine_min_norm(gramian: Tensor, lam: Tensor, max_steps: int) -> Tensor:
    r"""Primal active-set method for :math:`\min_{\lambda \in \Delta_m} \lambda^\top G \lambda`.

    Starts from the feasible ``lam`` with the free set :math:`F = \{i : \lambda_i > 0\}`. Each
    step solves the equality-constrained problem on :math:`F` (the KKT system
    :math:`[G_{FF}\ \mathbf 1; \mathbf 1^\top\ 0]`, scaled to the unit-diagonal
    :math:`DGD`, :math:`D = \mathrm{diag}(1/\|g_i\|)`, and solved by pseudo-inverse so that
    singular Gramians are fine); if its solution is non-negative it is taken and the most
    violated optimality condition :math:`(G\lambda)_i \ge \lambda^\top G\lambda` outside
    :math:`F` frees its index, otherwise a ratio test moves as far as feasibility allows and
    fixes one index at 0. Stops when the KKT conditions hold, each to ``8 m eps`` of its own
    row's scale (:math:`\|g_i\|(\|d\| + \sum_j \lambda_j \|g_j\|) + \|d\|^2`, so that rows
    of norms 1e10 apart are all resolved), or after ``max_steps`` steps; every step keeps
    :math:`\lambda` feasible and does not increase the objective.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._mgda import refine_min_norm
        >>> G = torch.tensor([[1., 0., 0.], [0., 4., 0.], [0., 0., 100.]])
        >>> refine_min_norm(G, torch.full((3,), 1 / 3), 10)
        tensor([0.7937, 0.1984, 0.0079])
    """
    m = gramian.shape[0]
    scale = gramian.diagonal().max().clamp(min=torch.finfo(gramian.dtype).tiny)
    normalized = gramian / scale
    tol = 8 * m * torch.finfo(gramian.dtype).eps
    norms = normalized.diagonal().clamp(min=0).sqrt()
    # The equality-constrained steps are solved on the unit-diagonal D G D, D = diag(1/|g_i|)
    # (1 for a zero row), lam = D z: with row norms 1e10 apart, G's small entries would fall
    # below the pseudo-inverse's cut-off.
    inverse = 1.0 / torch.where(norms > 0, norms, torch.ones_like(norms))
    unit = normalized * inverse[:, None] * inverse[None, :]
    free = lam > 0
    for _ in range(max_steps):
        index = free.nonzero().squeeze(1)
        k = index.shape[0]
        kkt = torch.zeros(k + 1, k + 1, dtype=gramian.dtype, device=gramian.device)
        # [D G D, c; c^T, 0] [z; -nu] = [0; 1] with c = D 1 / max(D 1): G lam = mu 1 on F
        ones = inverse[index] / inverse[index].max()
        kkt[:k, :k] = unit[index][:, index]
        kkt[:k, k] = ones
        kkt[k, :k] = ones
        rhs = torch.zeros(k + 1, dtype=gramian.dtype, device=gramian.device)
        rhs[k] = 1
        solution = inverse[index] * _bordered_solution(kkt, rhs)[:k]
        solution = solution / solution.sum()  # (1^T D z = max(D 1) exactly; the sum is 1)
        target = torch.zeros_like(lam)
        target[index] = solution
        if bool((solution >= 0).all()):
            lam = target
            g_lam = normalized @ lam
            squared = lam @ g_lam
            # Each condition g_i.d >= |d|^2 on the scale of its own row: |g_i| (|d| + the
            # rounding of g_i.d, |g_i| sum_j lam_j |g_j|) and |d|^2. A tolerance on the scale
            # of the largest row accepted points 1e4 times too long, that conflict with rows
            # 1e10 times shorter.
            scale = norms * (squared.clamp(min=0).sqrt() + lam @ norms) + squared
            slack = torch.where(free, torch.full_like(g_lam, float("inf")), g_lam - squared)
            slack = slack / scale.clamp(min=torch.finfo(gramian.dtype).tiny)
            j = torch.argmin(slack)
            if bool(slack[j] >= -tol):
                return lam
            free[j] = True
        else:
            direction = target - lam
            shrinking = free & (direction < 0)
            safe = torch.where(shrinking, -direction, torch.ones_like(direction))
            ratios = torch.where(shrinking, lam / safe, float("inf"))
            j = torch.argmin(ratios)
            lam = (lam + ratios[j].clamp(max=1.0) * direction).clamp(min=0)
            lam[j] = 0
            free[j] = False
            lam = lam / lam.sum()
    return lam


def mgda_weights(gramian: Tensor, epsilon: float, max_iters: int) -> Tensor:
    r"""The minimiser of :math:`\lambda^\top G \lambda` on the simplex :math:`\Delta_m`.

    :func:`frank_wolfe_min_norm` (``epsilon``, ``max_iters``) gives a starting point that
    :func:`refine_min_norm` (at most ``4m + 10`` steps) turns into the exact minimiser, so the
    result satisfies the KKT conditions to rounding; ``m = 2`` uses the closed form
    :func:`two_row_min_norm`. NaN/inf in ``gramian`` give NaN weights.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._mgda import mgda_weights
        >>> mgda_weights(torch.tensor([[18., -22.], [-22., 38.]]), 1e-3, 100)
        tensor([0.6000, 0.4000])
    """
    m = gramian.shape[0]
    if m == 0:
        return gramian.new_zeros(0)
    if has_nonfinite(gramian):
        return nan_weights(m, gramian)
    if m == 1:
        return gramian.new_ones(1)
    if m == 2:
        return two_row_min_norm(gramian)
    lam = frank_wolfe_min_norm(gramian, epsilon, max_iters)
    return refine_min_norm(gramian, lam, 4 * m + 10)


def normalization_scales(
    gramian: Tensor, normalization: str, losses: Tensor | None
) -> Tensor | None:
    """The row scales :math:`c_i` of a normalization mode (``None`` for ``"none"``)."""
    if normalization == "none":
        return None
    diagonal = gramian.diagonal()
    positive = diagonal > 0  # (sqrt's infinite derivative at 0 stays out of the graph)
    norms = torch.where(positive, torch.where(positive, diagonal, 1.0).sqrt(), 0.0)
    if normalization == "l2":
        return norms
    assert losses is not None
    if bool((losses <= 0).any()):
        raise ValueError(
            f"MGDA normalization={normalization!r} divides the rows by the losses, which must "
            f"be positive; received {losses.tolist()}. Use normalization='l2' or 'none' for "
            "losses that can be zero or negative."
        )
    return losses if normalization == "loss" else losses * norms


def normalized_mgda_weights(
    gramian: Tensor, epsilon: float, max_iters: int, scales: Tensor | None
) -> Tensor:
    r"""MGDA on :math:`G' = DGD`, :math:`D = \mathrm{diag}(1/c)`, mapped back: :math:`\lambda/c`.

    Rows with :math:`c_i = 0` (zero gradients under ``l2``) keep scale 1.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._mgda import normalized_mgda_weights
        >>> G = torch.tensor([[4., 0.], [0., 1.]])
        >>> normalized_mgda_weights(G, 1e-3, 100, G.diagonal().sqrt())
        tensor([0.2500, 0.5000])
    """
    if scales is None:
        return mgda_weights(gramian, epsilon, max_iters)
    inverse = torch.where(scales != 0, 1.0 / scales, torch.ones_like(scales))
    lam = mgda_weights(gramian * inverse[:, None] * inverse[None, :], epsilon, max_iters)
    return lam * inverse


def on_support(gramian: Tensor, lam: Tensor) -> Tensor:
    r"""The minimiser of :math:`\lambda^\top G \lambda` on the face of the simplex that is the
    support of ``lam`` (the minimiser found), as a differentiable function of ``G``: the KKT
    system :math:`K x = r` (:math:`G_{SS} \lambda_S = \mu 1, 1^\top \lambda_S = 1`) solved
    as :math:`x_0 + K^+ (r - K x_0)` from the found :math:`x_0 = (\lambda_S, \mu)`, zero off
    the support. Its value is ``lam``'s; its derivative is the minimiser's where the support
    does not change. Where :math:`K` is singular (more rows than the dimension of their span
    plus one, e.g. the origin inside the hull of ``m > n + 1`` rows: the update is 0 and the
    minimisers a polytope), this is the path of minimisers through ``lam``; the least-norm
    :math:`K^+ r` alone had another minimiser's derivative, and the update's was not 0.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._mgda import on_support
        >>> on_support(torch.tensor([[18., -22.], [-22., 38.]]), torch.tensor([0.6, 0.4]))
        tensor([0.6000, 0.4000])
    """
    support = (lam > 0).nonzero().flatten()
    s = support.numel()
    block = gramian.index_select(0, support).index_select(1, support)
    ones = torch.ones(s, 1, dtype=gramian.dtype, device=gramian.device)
    corner = torch.zeros(1, 1, dtype=gramian.dtype, device=gramian.device)
    system = torch.cat([torch.cat([block, -ones], 1), torch.cat([ones.T, corner], 1)], 0)
    rhs = torch.zeros(s + 1, dtype=gramian.dtype, device=gramian.device)
    rhs[-1] = 1.0
    found = lam[support].detach()
    start = torch.cat([found, (found @ block.detach() @ found).reshape(1)])  # (mu = lam^T G lam)
    # (x_0 + K^+ (r - K x_0) is K^+ r where K is invertible, to all orders)
    solution = start + torch.linalg.pinv(system) @ (rhs - system @ start)
    return torch.zeros_like(lam).index_put((support,), solution[:s])


def _check_normalization(value: object, name: str) -> Normalization:
    if value not in _NORMALIZATIONS:
        raise ValueError(f"`{name}` must be one of {_NORMALIZATIONS}, received {value!r}.")
    return value  # type: ignore[return-value]  # (one of the literals)


class MGDAWeighting(GramianWeighting, LossAware):
    r"""Gramian weighting of :class:`MGDA` (Désidéri, C. R. Math. 2012; Sener & Koltun,
    NeurIPS 2018): the minimiser of :math:`\lambda^\top D G D \lambda` on the simplex, divided
    by the row scales :math:`c` of ``normalization``.

    Args:
        epsilon: stop the Frank-Wolfe warm start after a step of size :math:`\gamma` below
            this; must be > 0.
        max_iters: cap on the number of Frank-Wolfe steps; must be >= 1.
        normalization: ``"none"``, ``"l2"``, ``"loss"`` or ``"loss+"``; see :class:`MGDA`.
            The loss modes need :meth:`set_losses` before each call.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import MGDAWeighting
        >>> MGDAWeighting()(torch.tensor([[18., -22.], [-22., 38.]]))
        tensor([0.6000, 0.4000])
    """

    epsilon = Hyperparameter(floats(low=0.0, low_open=True))
    max_iters = Hyperparameter(ints(low=1))
    normalization = Hyperparameter(_check_normalization)

    def __init__(
        self, epsilon: float = 0.001, max_iters: int = 100, normalization: Normalization = "none"
    ) -> None:
        super().__init__()
        self.epsilon = epsilon
        self.max_iters = max_iters
        self.normalization = normalization

    @property
    def scale_invariant(self) -> bool:
        """True for ``"none"`` and ``"loss"``; ``"l2"`` and ``"loss+"`` divide by the norms."""
        return self.normalization in ("none", "loss")

    @property
    def differentiable(self) -> bool:
        """True for ``"none"`` and ``"l2"``; the loss modes' weights depend on the losses given
        to :meth:`set_losses`, which it detaches: a derivative would hold them constant."""
        return self.normalization in ("none", "l2")

    def check_rows(self, m: int) -> None:
        if self.normalization in ("loss", "loss+"):
            self.require_losses(m)

    def forward(self, stat: Tensor) -> Tensor:
        losses = None
        if self.normalization in ("loss", "loss+"):
            losses = self.losses_like(stat.shape[0], stat)
        scales = normalization_scales(stat, self.normalization, losses)  # (a graph if tracked)
        with torch.no_grad():
            plain = None if scales is None else scales.detach()
            weights = normalized_mgda_weights(stat, self.epsilon, self.max_iters, plain)
        tracked = torch.is_grad_enabled() and (
            stat.requires_grad or (losses is not None and losses.requires_grad)
        )
        if not tracked or weights.numel() == 0 or has_nonfinite(weights):
            return weights
        # (the exact weights' values, with the derivative of the minimiser on their support)
        if scales is None:
            tracked_weights = on_support(stat, weights)
        else:
            inverse = 1.0 / torch.where(scales != 0, scales, 1.0)  # (1 for a zero row)
            lam = on_support(stat * inverse[:, None] * inverse[None, :], weights / inverse.detach())
            tracked_weights = lam * inverse
        return weights + (tracked_weights - tracked_weights.detach())

    def extra_repr(self) -> str:
        return (
            f"epsilon={self.epsilon}, max_iters={self.max_iters}, "
            f"normalization={self.normalization!r}"
        )


class MGDA(GramianWeightedAggregator, LossAware):
    r"""Multiple Gradient Descent Algorithm: the minimum-norm element of the convex hull.

    Désidéri, *Multiple-gradient descent algorithm (MGDA) for multiobjective optimization*,
    C. R. Math. 2012; solved with the Frank-Wolfe method of Sener & Koltun, *Multi-Task Learning
    as Multi-Objective Optimization*, NeurIPS 2018 (arXiv 1810.04650):

    .. math:: A(J) = J^\top \lambda^*, \qquad
              \lambda^* = \arg\min_{\lambda \in \Delta_m} \lambda^\top D G D \lambda \text{ mapped
              to } w_i = \lambda^*_i / c_i,

    with :math:`G = J J^\top`, :math:`D = \mathrm{diag}(1/c)` and the row scales :math:`c` of
    the ``normalization`` mode of Sener & Koltun's code: ``"none"`` :math:`c_i = 1`, ``"l2"``
    :math:`c_i = \|g_i\|`, ``"loss"`` :math:`c_i = L_i`, ``"loss+"`` :math:`c_i = L_i \|g_i\|`
    (losses given with :meth:`set_losses`, positive). The update has a non-negative inner product
    with every row and does not depend on the rows' order. The weights :math:`w = \lambda^* / c`
    make the update the min-norm point of the scaled rows :math:`g_i / c_i`, as LibMTL does;
    Sener & Koltun's and Nash-MTL's code multiply the raw losses by :math:`\lambda^*`
    (:math:`d = J^\top \lambda^*`), another direction where the scales differ.

    The Frank-Wolfe iterations (``epsilon``, ``max_iters``, as in TorchJD) only give a starting
    point: an active-set refinement then solves the problem exactly (to rounding), so the KKT
    conditions hold and the non-conflict is not limited by the Frank-Wolfe tolerance.

    Args:
        epsilon: Frank-Wolfe stopping tolerance (> 0).
        max_iters: maximum number of Frank-Wolfe steps (>= 1).
        normalization: ``"none"`` (default), ``"l2"``, ``"loss"`` or ``"loss+"``.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import MGDA
        >>> J = torch.tensor([[-1., 1., 1.], [1., 1., 1.]])
        >>> MGDA()(J)
        tensor([0., 1., 1.])
        >>> agg = MGDA(normalization="loss")
        >>> agg.set_losses(torch.tensor([1.0, 2.0]))
        >>> agg(J)
        tensor([0.3636, 0.5455, 0.5455])
    """

    properties: ClassVar[frozenset[Property]] = frozenset(
        {Property.NON_CONFLICTING, Property.PERMUTATION_INVARIANT, Property.WEIGHTED}
    )

    epsilon = Forwarded(MGDAWeighting.epsilon)
    max_iters = Forwarded(MGDAWeighting.max_iters)
    normalization = Forwarded(MGDAWeighting.normalization)

    def __init__(
        self, epsilon: float = 0.001, max_iters: int = 100, normalization: Normalization = "none"
    ) -> None:
        super().__init__(MGDAWeighting(epsilon, max_iters, normalization))

    def set_losses(self, losses: Tensor) -> None:
        """Record the losses read by the ``"loss"`` and ``"loss+"`` modes (see ``LossAware``)."""
        weighting = self.gramian_weighting
        assert isinstance(weighting, MGDAWeighting)
        weighting.set_losses(losses)

    def extra_repr(self) -> str:
        return self.gramian_weighting.extra_repr()
