"""GradVac: gradient vaccine (Wang et al., 2021), a stateful Gramian weighting."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow._stateful import SavesState, Stateful
from jacflow.aggregation._bases import GramianWeightedAggregator, GramianWeighting
from jacflow.aggregation._hyperparameters import Forwarded, Hyperparameter, floats
from jacflow.aggregation._nonfinite import propagate_nonfinite
from jacflow.aggregation._pcgrad import random_orders
from jacflow.aggregation._properties import Property


def gradvac_weights(
    gramian: Tensor, targets: Tensor, orders: Tensor, beta: float, eps: float
) -> tuple[Tensor, Tensor]:
    r"""GradVac weights and the updated similarity targets, for given visiting orders.

    With :math:`g_i^{gv} = \sum_k W_{ik} g_k` (initially :math:`W = I`), for each step
    ``s`` and :math:`j = ` ``orders[i, s]`` :math:`\ne i`:
    :math:`\phi = \langle g_i^{gv}, g_j\rangle / (\|g_i^{gv}\| \|g_j\| + \epsilon)`; if
    :math:`\phi < \hat\phi_{ij}`,

    .. math:: W_{ij} \mathrel{+}= \frac{\|g_i^{gv}\| (\hat\phi_{ij}\sqrt{1-\phi^2}
              - \phi\sqrt{1-\hat\phi_{ij}^2})}{\|g_j\|\sqrt{1-\hat\phi_{ij}^2} + \epsilon},

    and always :math:`\hat\phi_{ij} \leftarrow (1-\beta)\hat\phi_{ij} + \beta\phi`.
    Returns :math:`(\sum_i W_{i\cdot}, \hat\phi)`; ``targets`` is not modified.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._gradvac import gradvac_weights
        >>> G = torch.tensor([[18., -22.], [-22., 38.]])
        >>> w, t = gradvac_weights(G, torch.zeros(2, 2), torch.tensor([[0, 1], [1, 0]]), 0.5, 1e-8)
        >>> w
        tensor([2.2222, 1.5789])
    """
    m = gramian.shape[0]
    targets = targets.clone()
    coefficients = torch.eye(m, dtype=gramian.dtype, device=gramian.device)
    rows = torch.arange(m, device=gramian.device)
    norms = gramian.diagonal().clamp(min=0).sqrt()
    for s in range(orders.shape[1] if m > 1 else 0):
        j = orders[:, s]
        dots = (coefficients * gramian[j]).sum(dim=1)
        own = ((coefficients @ gramian) * coefficients).sum(dim=1).clamp(min=0).sqrt()
        phi = dots / (own * norms[j] + eps)
        target = targets[rows, j]
        other = j != rows
        sin_phi = (1 - phi.square()).clamp(min=0).sqrt()
        sin_target = (1 - target.square()).clamp(min=0).sqrt()
        step = own * (target * sin_phi - phi * sin_target) / (norms[j] * sin_target + eps)
        coefficients[rows, j] += torch.where(other & (phi < target), step, torch.zeros_like(step))
        targets[rows, j] = torch.where(other, (1 - beta) * target + beta * phi, target)
    return propagate_nonfinite(coefficients.sum(dim=0), gramian), targets


class GradVacWeighting(SavesState, GramianWeighting, Stateful):
    r"""Gramian weighting of :class:`GradVac` (Wang, Tsvetkov, Firat & Cao, *Gradient Vaccine*,
    ICLR 2021).

    Args:
        beta: EMA rate of the similarity targets, in [0, 1].
        eps: added to denominators, >= 0.

    State: the ``[m, m]`` matrix of cosine-similarity targets :math:`\hat\phi` (zeros before
    the first call). :meth:`reset` forgets it; the number of rows may only change after a reset.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import GradVacWeighting
        >>> W = GradVacWeighting()
        >>> G = torch.tensor([[18., -22.], [-22., 38.]])
        >>> W(G), W(G)
        (tensor([2.2222, 1.5789]), tensor([1.8580, 1.4064]))
        >>> W.reset(); W(G)
        tensor([2.2222, 1.5789])
    """

    without_autograd = True

    saved_state = ("_targets",)

    beta = Hyperparameter(floats(low=0.0, high=1.0))
    eps = Hyperparameter(floats(low=0.0))

    def __init__(self, beta: float = 0.5, eps: float = 1e-8) -> None:
        super().__init__()
        self.beta = beta
        self.eps = eps
        self._targets: Tensor | None = None

    def reset(self) -> None:
        self._targets = None

    def check_rows(self, m: int) -> None:
        if self._targets is not None and self._targets.shape[0] != m:
            raise ValueError(
                f"GradVac was used with {self._targets.shape[0]} objectives and now receives {m}; "
                "call `.reset()` before changing the number of objectives."
            )

    def forward(self, stat: Tensor) -> Tensor:
        m = stat.shape[0]
        self.check_rows(m)
        targets = self._targets
        if targets is None:
            targets = torch.zeros(m, m, dtype=stat.dtype, device=stat.device)
        with torch.no_grad():
            orders = random_orders(m, stat)
            weights, new_targets = gradvac_weights(
                stat, targets.to(stat), orders, self.beta, self.eps
            )
        # (a step a GradScaler skips leaves the targets; a where, not a host sync, except on
        # the first call, where a skipped step must leave no targets at all)
        skipped = ~torch.isfinite(new_targets).all()
        if self._targets is None and bool(skipped):
            return weights
        self._targets = torch.where(skipped, targets.to(stat), new_targets)
        return weights

    def extra_repr(self) -> str:
        return f"beta={self.beta}, eps={self.eps}"


class GradVac(GramianWeightedAggregator, Stateful):
    r"""GradVac (gradient vaccine).

    Wang, Tsvetkov, Firat & Cao, *Gradient Vaccine: Investigating and Improving Multi-task
    Optimization in Massively Multilingual Models*, ICLR 2021 (arXiv 2010.05874). Like
    :class:`PCGrad`, but each gradient :math:`g_i` is moved towards every other gradient
    :math:`g_j` (in random order) until their cosine similarity reaches the adaptive target
    :math:`\hat\phi_{ij}`, an exponential moving average (rate :math:`\beta`) of the observed
    similarities:

    .. math:: g_i \leftarrow g_i + \frac{\|g_i\|(\hat\phi_{ij}\sqrt{1-\phi_{ij}^2}
              - \phi_{ij}\sqrt{1-\hat\phi_{ij}^2})}{\|g_j\|\sqrt{1-\hat\phi_{ij}^2}} g_j
              \ \text{ if } \phi_{ij} < \hat\phi_{ij}, \qquad A(J) = \sum_i g_i.

    With the initial targets 0 the first call equals :class:`PCGrad`.

    Args:
        beta: EMA rate of the targets, in [0, 1] (default 0.5).
        eps: added to the denominators, >= 0 (default 1e-8).

    State: the targets :math:`\hat\phi` (see :class:`GradVacWeighting`); :meth:`reset` clears
    them.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import GradVac
        >>> A = GradVac()
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> A(J), A(J)
        (tensor([0.5848, 3.8012, 3.8012]), tensor([1.0065, 3.2644, 3.2644]))
    """

    properties = frozenset({Property.WEIGHTED})

    beta = Forwarded(GradVacWeighting.beta)
    eps = Forwarded(GradVacWeighting.eps)

    def __init__(self, beta: float = 0.5, eps: float = 1e-8) -> None:
        super().__init__(GradVacWeighting(beta, eps))

    def reset(self) -> None:
        weighting = self.gramian_weighting
        assert isinstance(weighting, GradVacWeighting)
        weighting.reset()

    def extra_repr(self) -> str:
        return self.gramian_weighting.extra_repr()
