"""GradNorm: learnable task weights that balance the weighted gradient norms (Chen et al., 2018)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow._stateful import SavesState, Stateful
from jacflow.aggregation._bases import GramianWeightedAggregator, GramianWeighting
from jacflow.aggregation._hyperparameters import Forwarded, Hyperparameter, floats
from jacflow.aggregation._loss_aware import LossAware
from jacflow.aggregation._nonfinite import has_nonfinite, nan_weights
from jacflow.aggregation._properties import Property
from jacflow.scalarization._base import loss_ratio

_MIN_WEIGHT = 1e-8


def relative_rates(losses: Tensor, initial_losses: Tensor) -> Tensor:
    r"""The relative inverse training rates :math:`r_i = \tilde L_i / \mathrm{mean}(\tilde L)`,
    :math:`\tilde L_i = L_i / L_i(0)`, for non-negative losses, never NaN.

    ``0 / 0`` is taken as 1 (no change). A positive loss whose :math:`L_i(0)` is 0 has an
    infinite ratio; the rates are then their limit: ``m`` shared equally by the infinite ratios,
    0 for the others. When every ratio is 0 the rates are all 1 (equal ratios).

    Example:
        >>> import torch
        >>> from jacflow.aggregation._gradnorm import relative_rates
        >>> relative_rates(torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0.0, 2.0, 2.0]))
        tensor([1.2000, 0.6000, 1.2000])
        >>> relative_rates(torch.tensor([0.5, 1.0, 2.0]), torch.tensor([0.0, 2.0, 2.0]))
        tensor([3., 0., 0.])
    """
    m = losses.shape[0]
    if m == 0:
        return losses.clone()
    ratios = loss_ratio(losses, initial_losses)
    infinite = torch.isinf(ratios)
    top = ratios.amax()
    scaled = ratios / top  # (the mean of the ratios themselves could overflow)
    rates = torch.where(top == 0, torch.ones_like(ratios), scaled / scaled.mean())
    limit = infinite.to(ratios.dtype) * (m / infinite.sum().clamp_min(1))
    return torch.where(infinite.any(), limit, rates)


def gradnorm_step(
    weights: Tensor,
    gramian: Tensor,
    losses: Tensor,
    initial_losses: Tensor,
    alpha: float,
    lr: float,
) -> Tensor:
    r"""One GradNorm update of the task weights; returns the renormalised new weights.

    With :math:`n_i = \sqrt{G_{ii}}`, weighted norms :math:`w_i n_i`, their mean :math:`\bar n`,
    loss ratios :math:`\tilde L_i = L_i / L_i(0)` and :math:`r_i = \tilde L_i / \mathrm{mean}
    (\tilde L)` (see :func:`relative_rates` for zero losses), the targets
    :math:`T_i = \bar n\, r_i^\alpha` are constants and the gradient of
    :math:`\sum_i |w_i n_i - T_i|` is :math:`\mathrm{sign}(w_i n_i - T_i)\, n_i`. After the step
    the weights are floored at 1e-8 and rescaled to sum to ``m``.
    """
    m = weights.shape[0]
    norms = gramian.diagonal().clamp_min(0).sqrt()
    weighted = weights * norms
    targets = weighted.mean() * relative_rates(losses, initial_losses) ** alpha
    gap = weighted - targets
    new = weights - lr * (torch.sign(gap) + 0 * gap) * norms  # 0 * gap keeps NaN (sign(NaN) = 0)
    new = new.clamp_min(_MIN_WEIGHT)
    return m * new / new.sum()


class GradNormWeighting(SavesState, GramianWeighting, LossAware, Stateful):
    r"""Gramian weighting of :class:`GradNorm`; reads only the diagonal of the Gramian.

    Args:
        alpha: restoring-force strength :math:`\alpha \ge 0` (1.5 in the paper's NYUv2 setup).
        lr: step size :math:`> 0` of the plain gradient step on the weights.

    State: the weights (initially 1) and the losses of the first call :math:`L(0)`; reset by
    :meth:`reset`. Call :meth:`set_losses` with the ``m`` non-negative losses before every
    call.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import GradNormWeighting
        >>> W = GradNormWeighting(alpha=1.5, lr=0.1)
        >>> G = torch.tensor([[4., 0.], [0., 1.]])
        >>> W.set_losses(torch.tensor([1., 1.])); W(G)
        tensor([1., 1.])
        >>> W.set_losses(torch.tensor([0.5, 1.])); W(G)
        tensor([0.8421, 1.1579])
    """

    without_autograd = True

    saved_state = ("_weights", "_initial_losses")

    alpha = Hyperparameter(floats(low=0.0))
    lr = Hyperparameter(floats(low=0.0, low_open=True))

    def __init__(self, alpha: float = 1.5, lr: float = 0.025) -> None:
        super().__init__()
        self.alpha = alpha
        self.lr = lr
        self._weights: Tensor | None = None
        self._initial_losses: Tensor | None = None

    def check_rows(self, m: int) -> None:
        self.require_losses(m)
        if self._weights is not None and self._weights.shape[0] != m:
            raise ValueError(
                f"GradNormWeighting holds {self._weights.shape[0]} weights but received a "
                f"Gramian of {m} rows; call `reset()` when the number of objectives changes."
            )

    def forward(self, stat: Tensor) -> Tensor:
        m = stat.shape[0]
        losses = self.losses_like(m, stat)
        if bool(((losses < 0) & torch.isfinite(losses)).any()):
            raise ValueError(
                f"GradNorm needs non-negative losses (it reads their ratios L_i / L_i(0)), "
                f"received {losses.tolist()}. Shift the losses by a constant to make them "
                "non-negative."
            )
        if has_nonfinite(stat) or has_nonfinite(losses):
            return nan_weights(m, stat)  # a skipped step: the state is left as it was
        with torch.no_grad():
            if self._weights is None or self._initial_losses is None:
                self._weights = torch.ones(m, dtype=stat.dtype, device=stat.device)
                self._initial_losses = losses
            else:
                self.check_rows(m)
            current = self._weights.to(dtype=stat.dtype, device=stat.device)
            initial = self._initial_losses.to(dtype=stat.dtype, device=stat.device)
            self._weights = gradnorm_step(current, stat, losses, initial, self.alpha, self.lr)
            return current

    def reset(self) -> None:
        self._weights = None
        self._initial_losses = None

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, lr={self.lr}"


class GradNorm(GramianWeightedAggregator, LossAware, Stateful):
    r"""GradNorm: adaptive loss weights that equalise the training rates of the tasks.

    Chen, Badrinarayanan, Lee & Rabinovich, *GradNorm: Gradient Normalization for Adaptive Loss
    Balancing in Deep Multitask Networks*, ICML 2018 (arXiv 1711.02257). The update at step
    :math:`t` is :math:`d_t = J_t^\top w_t`; then the weights take one gradient step on
    :math:`\sum_i |w_i \|g_i\| - \overline{w\|g\|}\, r_i^\alpha|` with the targets held
    constant, where :math:`r_i` is the loss ratio :math:`L_i(t)/L_i(0)` divided by its mean:

    .. math:: w_{t+1} \propto \max\!\big(w_t - \eta\, \mathrm{sign}(w_t \odot n - T) \odot n,
              10^{-8}\big), \quad \textstyle\sum_i w_{t+1,i} = m, \quad n_i = \sqrt{G_{ii}}.

    The paper takes the norms on the last shared layer; here they are those of the rows given
    (pass that layer's Jacobian, or use :func:`representation_weights`). Weights start at 1, so
    the first step is :class:`Sum`. The weights are updated by this plain step rather than by
    the model's optimizer, and are floored at 1e-8 to stay positive.

    Args:
        alpha: restoring-force strength :math:`\alpha \ge 0` (default 1.5).
        lr: step size :math:`\eta > 0` on the weights (default 0.025).

    The losses must be non-negative (a negative one raises a ``ValueError`` before any
    change). A loss at 0 is allowed: :math:`0/0` is taken as 1 (no change), and a positive loss
    whose :math:`L_i(0)` is 0 has an infinite ratio, for which :math:`r` is the limit (``m``
    shared by the infinite ratios, 0 for the others); all ratios 0 give :math:`r = 1`. So
    finite inputs never make the state NaN.

    State: the weights and the first losses :math:`L(0)`; :meth:`reset` forgets them. A NaN or
    infinite Gramian or loss gives NaN weights and leaves the state untouched (so a step that
    an AMP ``GradScaler`` skips does not poison it). Call :meth:`set_losses` with the ``m``
    losses before each call.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import GradNorm
        >>> A = GradNorm(alpha=1.5, lr=0.1)
        >>> J = torch.tensor([[2., 0.], [0., 1.]])
        >>> A.set_losses(torch.tensor([1., 1.])); A(J)
        tensor([2., 1.])
        >>> A.set_losses(torch.tensor([0.5, 1.])); A(J)
        tensor([1.6842, 1.1579])
    """

    properties = frozenset({Property.WEIGHTED})

    alpha = Forwarded(GradNormWeighting.alpha)
    lr = Forwarded(GradNormWeighting.lr)

    def __init__(self, alpha: float = 1.5, lr: float = 0.025) -> None:
        super().__init__(GradNormWeighting(alpha, lr))

    def set_losses(self, losses: Tensor) -> None:
        self._weighting().set_losses(losses)

    def reset(self) -> None:
        self._weighting().reset()

    def _weighting(self) -> GradNormWeighting:
        weighting = self.gramian_weighting
        assert isinstance(weighting, GradNormWeighting)
        return weighting

    def forward(self, matrix: Tensor) -> Tensor:
        with torch.no_grad():
            return super().forward(matrix)

    def extra_repr(self) -> str:
        return self.gramian_weighting.extra_repr()
