"""EPO: Exact Pareto Optimal search for a preference ray (Mahapatra & Rajan, 2020)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow.aggregation._bases import GramianWeightedAggregator, GramianWeighting
from jacflow.aggregation._hyperparameters import (
    Forwarded,
    Hyperparameter,
    check_bool,
    check_real_values,
    floats,
)
from jacflow.aggregation._linprog import linprog_max
from jacflow.aggregation._loss_aware import LossAware
from jacflow.aggregation._nonfinite import has_nonfinite, nan_weights
from jacflow.aggregation._properties import Property


def epo_lp(
    gramian: Tensor, losses: Tensor, preference: Tensor, eps: float, relax: bool
) -> tuple[Tensor | None, str]:
    r"""The EPO linear program; returns (``alpha`` in the simplex or ``None``, the mode).

    With :math:`C = G`, :math:`\hat l = r \odot L / \sum r \odot L`,
    :math:`\mu = \sum_i \hat l_i \log(m \hat l_i)` (terms with :math:`\hat l_i \le` machine
    epsilon dropped), :math:`a = r \odot (\log(m \hat l) - \mu)` and :math:`b = C a`:

    * balance mode (:math:`\mu > \varepsilon`): maximise :math:`\alpha^\top b` subject to
      :math:`C\alpha \ge` rhs, where rhs is :math:`-\infty` on :math:`\{b_j > 0\}`, 0 on
      :math:`\arg\max r \odot L` and :math:`b_j` elsewhere (all 0 when no :math:`b_j > 0`);
    * descent mode: maximise :math:`\mathbf 1^\top C\alpha` subject to :math:`C\alpha \ge 0`
      and (unless ``relax``) :math:`\alpha^\top b \ge \min(\max_j b_j, 0)`;

    always over the simplex :math:`\alpha \ge 0, \mathbf 1^\top \alpha = 1`.
    """
    m = gramian.shape[0]
    C = gramian.to(torch.float64)
    C = C / C.diagonal().max().clamp_min(torch.finfo(torch.float64).tiny)  # the LP is scale-free
    rl = preference.to(C) * losses.to(C)
    l_hat = rl / rl.sum()
    kept = l_hat[l_hat > torch.finfo(torch.float64).eps]
    mu = float((kept * torch.log(kept * m)).sum())
    a = preference.to(C) * (torch.log(l_hat * m) - mu)
    b = C @ a
    if not bool(torch.isfinite(b).all()):
        return None, "failed"
    ones = torch.ones(1, m, dtype=C.dtype, device=C.device)
    if mu > eps:
        rhs = b.clone()
        positive = b > 0
        if bool(positive.any()):
            rhs[positive] = -torch.inf
            rhs[rl == rl.max()] = 0
        else:
            rhs = torch.zeros_like(b)
        finite = torch.isfinite(rhs)
        alpha = linprog_max(b, -C[finite], -rhs[finite], ones, ones[0, :1])
        return alpha, "balance"
    A_ub, b_ub = -C, torch.zeros(m, dtype=C.dtype, device=C.device)
    if not relax:
        bound = min(float(b.max()), 0.0)
        A_ub = torch.cat([A_ub, -b[None, :]])
        b_ub = torch.cat([b_ub, b_ub.new_tensor([-bound])])
    return linprog_max(C.sum(0), A_ub, b_ub, ones, ones[0, :1]), "descent"


def epo_weights(
    gramian: Tensor, losses: Tensor, preference: Tensor, eps: float, relax: bool
) -> Tensor:
    """EPO weights ``m * alpha``, with ``alpha = r / sum(r)`` when the LP has no solution."""
    m = gramian.shape[0]
    if m == 0:
        return gramian.new_zeros(0)
    if has_nonfinite(gramian) or has_nonfinite(losses):
        return nan_weights(m, gramian)
    alpha, _ = epo_lp(gramian, losses, preference, eps, relax)
    if alpha is None:
        alpha = preference.to(torch.float64) / preference.sum()
    return (m * alpha).to(device=gramian.device, dtype=gramian.dtype)


def _check_preference(preference: object, name: str) -> Tensor:
    if not isinstance(preference, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, received {type(preference)}.")
    if preference.ndim != 1:
        raise ValueError(
            f"`{name}` must be a vector (1-D tensor) with one positive entry per objective, "
            f"received shape {tuple(preference.shape)}."
        )
    check_real_values(preference, name)
    if bool((preference <= 0).any()):
        raise ValueError(f"`{name}` must be finite and positive, received {preference}.")
    return preference.detach().clone()


class EPOWeighting(GramianWeighting, LossAware):
    r"""Gramian weighting of :class:`EPO`.

    Args:
        preference: the preference vector :math:`r > 0` (one entry per objective).
        eps: non-uniformity threshold :math:`\varepsilon \ge 0` below which EPO descends
            instead of balancing (default 1e-4).
        relax: drop the constraint :math:`\alpha^\top b \ge \min(\max_j b_j, 0)` of the
            descent mode (default ``False``).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import EPOWeighting
        >>> W = EPOWeighting(torch.tensor([1., 1.]))
        >>> W.set_losses(torch.tensor([2., 1.]))
        >>> W(torch.tensor([[1., 0.], [0., 1.]]))
        tensor([2., 0.])
    """

    without_autograd = True

    preference = Hyperparameter(_check_preference)
    eps = Hyperparameter(floats(low=0.0))
    relax = Hyperparameter(check_bool)

    def __init__(self, preference: Tensor, eps: float = 1e-4, relax: bool = False) -> None:
        super().__init__()
        self.preference = preference
        self.eps = eps
        self.relax = relax

    scale_invariant = True  # (its LP reads G divided by its largest diagonal entry)

    def check_rows(self, m: int) -> None:
        if self.preference.shape[0] != m:
            raise ValueError(
                f"EPO has {self.preference.shape[0]} preference entries but the Gramian has {m} "
                "rows; give one preference per objective."
            )
        self.require_losses(m)

    def forward(self, stat: Tensor) -> Tensor:
        m = stat.shape[0]
        self.check_rows(m)
        losses = self.losses_like(m, stat)
        if bool(((losses <= 0) & torch.isfinite(losses)).any()):
            raise ValueError(
                f"EPO needs positive losses (it reads the logs of r_i L_i / sum_j r_j L_j), "
                f"received {losses.tolist()}. Shift the losses by a constant to make them "
                "positive."
            )
        with torch.no_grad():
            return epo_weights(stat, losses, self.preference, self.eps, self.relax)

    def extra_repr(self) -> str:
        return f"preference={self.preference}, eps={self.eps}, relax={self.relax}"


class EPO(GramianWeightedAggregator, LossAware):
    r"""EPO: descent that first balances the losses onto a preference ray, then improves them.

    Mahapatra & Rajan, *Multi-Task Learning with User Preferences: Gradient Descent with
    Controlled Ascent in Pareto Optimization*, ICML 2020 (journal version: *Exact Pareto Optimal
    Search for Multi-Task Learning and Multi-Criteria Decision-Making*, arXiv 2108.00597). The
    target is the Pareto-optimal point where :math:`r_1 L_1 = \dots = r_m L_m`. Each step solves
    a linear program over :math:`\alpha \in \Delta_m` on :math:`C = G` (see
    :func:`~jacflow.aggregation._epo.epo_lp`): while the normalised losses
    :math:`\hat l = r\odot L / \sum r \odot L` are not uniform
    (:math:`\mathrm{KL}(\hat l\,\|\,\mathbf 1/m) > \varepsilon`) it maximises the decrease of the
    non-uniformity, otherwise it maximises the total descent without leaving the ray. The
    update is

    .. math:: d = J^\top (m\,\alpha),

    as in the reference training code; when the program has no solution,
    :math:`\alpha = r / \sum r`. The LP is solved by a dense two-phase simplex method in torch
    (float64, Bland's rule). Stateless.

    Args:
        preference: the preference vector :math:`r > 0`.
        eps: non-uniformity threshold (default 1e-4).
        relax: use the relaxed descent program (default ``False``).

    Call :meth:`set_losses` with the ``m`` positive losses before each call: a finite loss
    :math:`\le 0` raises a ``ValueError`` (the logs are undefined), a NaN or infinite one gives
    NaN weights.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import EPO
        >>> A = EPO(torch.tensor([1., 2.]))
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> A.set_losses(torch.tensor([4., 1.]))  # r * L = (4, 2): balance, on loss 1 only
        >>> A(J)
        tensor([-8.,  2.,  2.])
        >>> A.set_losses(torch.tensor([2., 1.]))  # r * L = (2, 2): on the ray, descend
        >>> A(J)
        tensor([1.0000, 2.0000, 2.0000])
    """

    properties = frozenset({Property.WEIGHTED})

    preference = Forwarded(EPOWeighting.preference)
    eps = Forwarded(EPOWeighting.eps)
    relax = Forwarded(EPOWeighting.relax)

    def __init__(self, preference: Tensor, eps: float = 1e-4, relax: bool = False) -> None:
        super().__init__(EPOWeighting(preference, eps, relax))

    def set_losses(self, losses: Tensor) -> None:
        weighting = self.gramian_weighting
        assert isinstance(weighting, EPOWeighting)
        weighting.set_losses(losses)

    def forward(self, matrix: Tensor) -> Tensor:
        with torch.no_grad():
            return super().forward(matrix)

    def extra_repr(self) -> str:
        return self.gramian_weighting.extra_repr()
