"""PCGrad: projecting conflicting gradients (Yu et al., 2020), written as a Gramian weighting."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow.aggregation._bases import GramianWeightedAggregator, GramianWeighting
from jacflow.aggregation._nonfinite import propagate_nonfinite
from jacflow.aggregation._properties import Property


def random_orders(m: int, like: Tensor) -> Tensor:
    """``[m, m - 1]``: row ``i`` is a uniformly random order of the other rows ``j != i``.

    Drawn from torch's global RNG on ``like``'s device (no draw for ``m <= 2``, where the order
    is unique).

    Example:
        >>> import torch
        >>> from jacflow.aggregation._pcgrad import random_orders
        >>> random_orders(2, torch.zeros(1))
        tensor([[1],
                [0]])
    """
    rows = torch.arange(m, device=like.device)[:, None]
    if m <= 2:
        ranks = torch.zeros(m, max(m - 1, 0), dtype=torch.long, device=like.device)
    else:
        ranks = torch.rand(m, m - 1, device=like.device).argsort(dim=1)
    return ranks + (ranks >= rows).long()  # skip i itself


def pcgrad_weights(gramian: Tensor, orders: Tensor) -> Tensor:
    r"""PCGrad weights for the visiting orders ``orders`` (``[m, k]``, row ``i``: the order for
    ``g_i``; entries equal to ``i`` are skipped).

    Row ``i`` of the coefficient matrix :math:`W` (initially :math:`I`) represents
    :math:`g_i^{pc} = \sum_k W_{ik} g_k`. For each column ``s`` and :math:`j = ` ``orders[i, s]``
    (:math:`j \ne i`), if :math:`\langle g_i^{pc}, g_j \rangle = (W G)_{ij} < 0` then
    :math:`W_{ij} \mathrel{-}= (WG)_{ij} / G_{jj}`. All ``m`` rows advance together, so the loop
    has ``m`` vectorised steps. The weights are :math:`\sum_i W_{i\cdot}` (PCGrad sums).

    Example:
        >>> import torch
        >>> from jacflow.aggregation._pcgrad import pcgrad_weights
        >>> G = torch.tensor([[18., -22.], [-22., 38.]])
        >>> pcgrad_weights(G, torch.tensor([[0, 1], [1, 0]]))
        tensor([2.2222, 1.5789])
    """
    m = gramian.shape[0]
    coefficients = torch.eye(m, dtype=gramian.dtype, device=gramian.device)
    rows = torch.arange(m, device=gramian.device)
    diagonal = gramian.diagonal()
    for s in range(orders.shape[1] if m > 1 else 0):
        j = orders[:, s]
        dots = (coefficients * gramian[j]).sum(dim=1)  # (W G)_{i, j_i}
        norms = diagonal[j]
        project = (dots < 0) & (j != rows) & (norms > 0)
        safe = torch.where(project, norms, torch.ones_like(norms))
        coefficients[rows, j] -= torch.where(project, dots / safe, torch.zeros_like(dots))
    return propagate_nonfinite(coefficients.sum(dim=0), gramian)


def two_row_pcgrad_weights(gramian: Tensor) -> Tensor:
    r"""PCGrad for ``m = 2`` in closed form: :math:`w_i = 1 - \min(0, G_{12}) / G_{ii}` (row
    :math:`i` receives the projections of the other row onto it; none onto a zero row).

    Example:
        >>> import torch
        >>> from jacflow.aggregation._pcgrad import two_row_pcgrad_weights
        >>> two_row_pcgrad_weights(torch.tensor([[18., -22.], [-22., 38.]]))
        tensor([2.2222, 1.5789])
    """
    conflict = gramian[0, 1].clamp(max=0)
    norms = gramian.diagonal()
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    weights = 1 - torch.where(norms > 0, conflict / safe, torch.zeros_like(norms))
    return propagate_nonfinite(weights, gramian)


class PCGradWeighting(GramianWeighting):
    """Gramian weighting of :class:`PCGrad` (Yu et al., *Gradient Surgery for Multi-Task
    Learning*, NeurIPS 2020); the visiting orders come from torch's global RNG.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import PCGradWeighting
        >>> PCGradWeighting()(torch.tensor([[18., -22.], [-22., 38.]]))
        tensor([2.2222, 1.5789])
    """

    without_autograd = True

    scale_invariant = True  # (its coefficients are ratios of entries of G)

    def forward(self, stat: Tensor) -> Tensor:
        with torch.no_grad():
            if stat.shape[0] == 2:
                return two_row_pcgrad_weights(stat)
            return pcgrad_weights(stat, random_orders(stat.shape[0], stat))

    def extra_repr(self) -> str:
        return ""


class PCGrad(GramianWeightedAggregator):
    r"""PCGrad (projecting conflicting gradients).

    Yu, Kumar, Gupta, Levine, Hausman & Finn, *Gradient Surgery for Multi-Task Learning*,
    NeurIPS 2020 (arXiv 2001.06782). Each gradient is projected, in a random order of the
    others, onto the normal plane of every gradient it conflicts with, and the results are
    summed:

    .. math:: g_i^{pc} \leftarrow g_i^{pc} - \frac{\min(0, \langle g_i^{pc}, g_j\rangle)}
              {\|g_j\|^2} g_j \quad (j \ne i \text{ in random order}), \qquad
              A(J) = \sum_i g_i^{pc}.

    Computed from the Gramian only, as weights on the rows. The random orders are drawn from
    torch's global RNG (``torch.manual_seed`` makes it reproducible); for a fixed draw it is
    linear under scaling. For ``m = 2`` the order does not matter.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import PCGrad
        >>> PCGrad()(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([0.5848, 3.8012, 3.8012])
    """

    properties = frozenset({Property.LINEAR_UNDER_SCALING, Property.WEIGHTED})

    def __init__(self) -> None:
        super().__init__(PCGradWeighting())
