"""Krum and Multi-Krum: Byzantine-robust selection of rows (Blanchard et al., 2017)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow.aggregation._bases import (
    GramianOfJacobianWeighting,
    GramianWeightedAggregator,
    GramianWeighting,
    WeightedAggregator,
    scale_to_unit_peak,
)
from jacflow.aggregation._hyperparameters import Forwarded, Hyperparameter, ints
from jacflow.aggregation._nonfinite import propagate_nonfinite
from jacflow.aggregation._properties import Property
from jacflow.linalg import compute_gramian


def krum_weights(gramian: Tensor, n_byzantine: int, n_selected: int) -> Tensor:
    r"""Multi-Krum weights: ``1/n_selected`` on the rows of lowest Krum score, 0 elsewhere.

    The score of row ``i`` is the sum of its squared distances
    :math:`\|g_i - g_j\|^2 = G_{ii} + G_{jj} - 2G_{ij}` to its ``m - n_byzantine - 2`` nearest
    other rows. Among rows of equal score the earlier row (lower index) is selected, so the
    weights follow the rows' order where scores tie. ``m = 0`` gives no weights.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._krum import krum_weights
        >>> J = torch.tensor([[0., 0.], [1., 0.], [0., 1.], [9., 9.]])
        >>> krum_weights(J @ J.T, 1, 1)
        tensor([1., 0., 0., 0.])
    """
    m = gramian.shape[0]
    if m == 0:
        return gramian.new_zeros(0)
    _check_rows(m, n_byzantine, n_selected)
    diagonal = gramian.diagonal()
    # (G_ij + G_ji, not 2 G_ij: a product's rounding can leave G unsymmetric, and then two
    # mutual nearest rows, whose scores tie, would be ranked by that rounding)
    distances = (diagonal[:, None] + diagonal[None, :] - (gramian + gramian.mT)).clamp(min=0)
    distances = distances + torch.diag(torch.full_like(diagonal, float("inf")))
    k = m - n_byzantine - 2
    scores = distances.topk(k, dim=1, largest=False).values.sum(dim=1)
    selected = torch.argsort(scores, stable=True)[:n_selected]
    weights = torch.zeros_like(diagonal)
    weights[selected] = 1.0 / n_selected
    return propagate_nonfinite(weights, gramian)


def _check_rows(m: int, n_byzantine: int, n_selected: int) -> None:
    if m < n_byzantine + 3:
        # (Krum scores each row by its distances to its m - n_byzantine - 2 nearest others)
        fix = "lower `n_byzantine` or aggregate more rows" if n_byzantine else "aggregate more rows"
        raise ValueError(
            f"Krum with n_byzantine={n_byzantine} needs at least n_byzantine + 3 = "
            f"{n_byzantine + 3} rows, received {m}; {fix}, or use another aggregator."
        )
    if m < n_selected:
        raise ValueError(
            f"Krum with n_selected={n_selected} needs at least that many rows, received {m}; "
            "lower `n_selected`."
        )


class KrumWeighting(GramianWeighting):
    r"""Gramian weighting of :class:`Krum` (Blanchard et al., *Machine Learning with Adversaries:
    Byzantine Tolerant Gradient Descent*, NeurIPS 2017).

    Precision: the distances :math:`G_{ii} + G_{jj} - 2G_{ij}` are differences of entries of
    ``G``; when the rows share a component :math:`c` much larger than their differences
    (per-sample or per-worker gradients), they lose the digits of :math:`\|c\|^2` that
    ``G``'s dtype rounds away (in float32, distances below about :math:`10^{-7}\|c\|^2` are
    noise). A Gramian alone cannot recover them: :class:`Krum`, which has ``J``, forms the
    Gramian of the centred rows in float64; with a Gramian of your own, centre the rows
    (:math:`J - \bar J`: the same scores) or form it in float64.

    Args:
        n_byzantine: number of rows that may be adversarial, >= 0.
        n_selected: number of rows averaged, >= 1 (1: Krum; more: Multi-Krum).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import KrumWeighting
        >>> J = torch.tensor([[0., 0.], [1., 0.], [0., 1.], [9., 9.]])
        >>> KrumWeighting(1, 2)(J @ J.T)
        tensor([0.5000, 0.5000, 0.0000, 0.0000])
    """

    n_byzantine = Hyperparameter(ints(low=0))
    n_selected = Hyperparameter(ints(low=1))

    def __init__(self, n_byzantine: int, n_selected: int = 1) -> None:
        super().__init__()
        self.n_byzantine = n_byzantine
        self.n_selected = n_selected

    scale_invariant = True  # (it selects rows by the order of their scores)

    def check_rows(self, m: int) -> None:
        if m:
            _check_rows(m, self.n_byzantine, self.n_selected)

    def forward(self, stat: Tensor) -> Tensor:
        with torch.no_grad():
            return krum_weights(stat, self.n_byzantine, self.n_selected)

    def extra_repr(self) -> str:
        return f"n_byzantine={self.n_byzantine}, n_selected={self.n_selected}"

    def __str__(self) -> str:
        return f"KrumWeighting{self.n_byzantine}-{self.n_selected}"


class _CentredGramianWeighting(GramianOfJacobianWeighting):
    r"""``gramian_weighting << gramian`` applied to the Gramian of the centred rows
    :math:`J - \bar J`, formed in float64: Krum's scores depend only on the rows' differences,
    and a common component would otherwise cancel in them (see :class:`KrumWeighting`)."""

    def forward(self, stat: Tensor) -> Tensor:
        if not isinstance(self.gramian_weighting, KrumWeighting):  # (translation invariant)
            return super().forward(stat)
        with torch.no_grad():
            rows = scale_to_unit_peak(stat).to(torch.float64)
            # (the rounding of the mean is common to all rows: the differences stay exact)
            centred = rows - rows.mean(dim=0)
            return self.gramian_weighting(compute_gramian(centred)).to(stat.dtype)


class Krum(GramianWeightedAggregator):
    r"""Krum / Multi-Krum.

    Blanchard, El Mhamdi, Guerraoui & Stainer, *Machine Learning with Adversaries: Byzantine
    Tolerant Gradient Descent*, NeurIPS 2017 (arXiv 1703.02757). With
    :math:`f` = ``n_byzantine``, the score of row :math:`i` is
    :math:`s(i) = \sum_{j \in N_i} \|g_i - g_j\|^2` over its :math:`m - f - 2` nearest other
    rows :math:`N_i`; the update is the mean of the ``n_selected`` rows of lowest score:

    .. math:: A(J) = \frac{1}{k} \sum_{i \in S} g_i, \qquad S = k \text{ rows of lowest } s,
              \ k = \texttt{n\_selected}.

    Needs :math:`m \ge f + 3` and :math:`m \ge k` rows (the paper's guarantee assumes
    :math:`m > 2f + 2`); ``m = 0`` gives the zero vector.

    Ties in the scores are broken by row index, the earlier row first (as the paper leaves
    them open). The update is therefore invariant to the rows' order only where the selected
    set is decided by the scores: with a single neighbour (:math:`m = f + 3`) the two rows of
    the closest pair always tie, and ``n_selected=1`` then returns the one given first. For
    this reason Krum does not claim :attr:`Property.PERMUTATION_INVARIANT`.

    The scores are computed from the Gramian of the centred rows :math:`J - \bar J` (the same
    distances), formed in float64: rows that share a large component (per-worker gradients)
    keep their differences, which ``J J^T`` in float32 rounds away. That Gramian is what
    :attr:`gramian_weighting` (and a hook on it) receives. :func:`jacflow.backward`,
    :func:`jacflow.jac_to_grad` and :func:`jacflow.mtl_backward` ask Krum on ``J`` for the same
    reason (the update of its call); an :class:`~jacflow.autogram.Engine`, which has only
    ``J J^T``, refuses it.

    Args:
        n_byzantine: number of possibly adversarial rows, >= 0.
        n_selected: number of rows averaged, >= 1 (default 1).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import Krum
        >>> J = torch.tensor([[0., 0.], [1., 0.], [0., 1.], [9., 9.]])
        >>> Krum(n_byzantine=1, n_selected=2)(J)
        tensor([0.5000, 0.0000])
    """

    properties = frozenset({Property.WEIGHTED})

    n_byzantine = Forwarded(KrumWeighting.n_byzantine)
    n_selected = Forwarded(KrumWeighting.n_selected)

    def __init__(self, n_byzantine: int, n_selected: int = 1) -> None:
        # (not GramianWeightedAggregator's weighting: that of the centred rows, see above)
        WeightedAggregator.__init__(
            self, _CentredGramianWeighting(KrumWeighting(n_byzantine, n_selected))
        )

    def extra_repr(self) -> str:
        return self.gramian_weighting.extra_repr()

    def __str__(self) -> str:
        weighting = self.gramian_weighting
        assert isinstance(weighting, KrumWeighting)
        return f"Krum{weighting.n_byzantine}-{weighting.n_selected}"
