"""LogLoss: apply a Gramian weighting to the Jacobian of the log-losses."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow.aggregation._bases import GramianWeighting, check_gramian_weighting
from jacflow.aggregation._hyperparameters import Hyperparameter
from jacflow.aggregation._loss_aware import LossAware


def log_loss_weights(gramian: Tensor, losses: Tensor, weighting: GramianWeighting) -> Tensor:
    r"""Weights on the rows of ``J`` that apply ``weighting`` to ``J_log = diag(1/L) J``.

    ``J_log`` is the Jacobian of :math:`\log L`; its Gramian is :math:`D G D` with
    :math:`D = \mathrm{diag}(1/L)`, and :math:`J_{\log}^\top w_{\log} = J^\top (D w_{\log})`.
    """
    scale = 1.0 / losses
    log_weights = weighting(scale[:, None] * gramian * scale[None, :])
    return scale * log_weights


class LogLoss(GramianWeighting, LossAware):
    r"""Wrapper applying a Gramian weighting to the gradients of the log-losses.

    Gradient methods on :math:`\log L_i` instead of :math:`L_i` ("LOG_MGDA", "LOG_CAGrad",
    ... in the FAMO and FairGrad repositories; the gradient half of DB-MTL: Lin B. et al.,
    *Dual-Balancing for Multi-Task Learning*, arXiv 2308.12029, 2023). The rows of the log-loss
    Jacobian are :math:`g_i / L_i`, so with :math:`D = \mathrm{diag}(1/L)` and the wrapped
    weighting :math:`W`:

    .. math:: w_{\log} = W(D G D), \qquad d = J_{\log}^\top w_{\log} = J^\top (D\, w_{\log}),

    and the weights returned on the rows of the original Jacobian are :math:`D w_{\log}`.

    Losses: call :meth:`set_losses` with the ``m`` positive loss values before each call; a
    loss :math:`\le 0` raises a ``ValueError`` (its log is undefined), a NaN loss propagates.
    The wrapper keeps no state of its own; reset a stateful wrapped weighting directly.

    Args:
        weighting: the Gramian weighting applied to the log-loss Gramian.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import GramianWeightedAggregator, LogLoss, UPGradWeighting
        >>> W = LogLoss(UPGradWeighting())
        >>> W.set_losses(torch.tensor([2., 0.5]))
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> W(J @ J.T)
        tensor([1.4722, 1.1447])
        >>> GramianWeightedAggregator(W)(J)
        tensor([0.9795, 2.6170, 2.6170])
    """

    without_autograd = True

    weighting = Hyperparameter(check_gramian_weighting)

    def __init__(self, weighting: GramianWeighting) -> None:
        super().__init__()
        self.weighting = weighting

    @property
    def scale_invariant(self) -> bool:
        """That of the wrapped weighting (the losses' scaling does not depend on G)."""
        return self.weighting.scale_invariant

    def check_rows(self, m: int) -> None:
        self.weighting.check_rows(m)
        self.require_losses(m)

    def forward(self, stat: Tensor) -> Tensor:
        losses = self.losses_like(stat.shape[0], stat)
        if bool((losses <= 0).any()):
            raise ValueError(
                f"LogLoss needs positive losses (their log is taken), received {losses}. Shift "
                "the losses by a constant to make them positive."
            )
        with torch.no_grad():
            return log_loss_weights(stat, losses, self.weighting)

    def extra_repr(self) -> str:
        return repr(self.weighting)
