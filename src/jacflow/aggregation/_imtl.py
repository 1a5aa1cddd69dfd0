"""IMTL (hybrid): IMTL-G on the Jacobian of the IMTL-L-scaled losses (Liu et al., 2021)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow._stateful import Stateful
from jacflow.aggregation._bases import GramianWeightedAggregator
from jacflow.aggregation._hyperparameters import Hyperparameter, ints
from jacflow.aggregation._imtlg import IMTLG, IMTLGWeighting
from jacflow.scalarization._imtl_l import IMTLL


class IMTL(GramianWeightedAggregator, Stateful):
    r"""IMTL: impartial multi-task learning, the hybrid of its loss and gradient parts.

    Liu, Li, Kuang, Xue, Chen, Yang, Liao & Zhang, *Towards Impartial Multi-task Learning*,
    ICLR 2021 (OpenReview IMPnRXEWpvr). A composition of the two halves:

    * IMTL-L (:class:`jacflow.scalarization.IMTLL`) scales each loss with a learnable
      :math:`s_i`: :math:`\tilde L_i = e^{s_i} L_i - s_i` (:meth:`scale_losses`);
    * IMTL-G (:class:`IMTLG`) aggregates the Jacobian :math:`\tilde J` of the scaled losses
      w.r.t. the shared parameters: :math:`d = \tilde J^\top w`,
      :math:`w = \tilde G^+ n / \mathbf 1^\top \tilde G^+ n`, :math:`n_i = \sqrt{\tilde G_{ii}}`.

    The task-specific parameters and the scales :math:`s` are trained on
    :math:`\sum_i \tilde L_i` (so :math:`\partial / \partial s_i = e^{s_i} L_i - 1`, which
    drives every scaled loss to 1): give ``imtl.parameters()`` to the optimizer and
    back-propagate ``scaled.sum()`` for them. Calling the aggregator is exactly :class:`IMTLG`.

    Args:
        n_tasks: number of losses ``m >= 1`` (the size of :math:`s`).

    State: the scales :math:`s` (parameter ``imtl_l.log_scale``, initially 0);
    :meth:`reset` sets them back to 0.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import IMTL
        >>> imtl = IMTL(2)
        >>> theta = torch.tensor([1., 2.], requires_grad=True)
        >>> losses = torch.stack([theta.pow(2).sum(), 10 * (theta - 1).pow(2).sum()])
        >>> scaled = imtl.scale_losses(losses)  # IMTL-L
        >>> J = torch.stack([torch.autograd.grad(x, theta, retain_graph=True)[0] for x in scaled])
        >>> imtl(J)  # IMTL-G on the Jacobian of the scaled losses
        tensor([1.6345, 6.9239])
        >>> scaled.sum().backward()  # the scales (and the task heads) learn from the sum
        >>> imtl.imtl_l.log_scale.grad  # e^s L - 1
        tensor([4., 9.])
    """

    without_autograd = True

    properties = IMTLG.properties

    n_tasks = Hyperparameter(ints(low=1), frozen="the size of the trainable scales `imtl_l`")

    def __init__(self, n_tasks: int) -> None:
        super().__init__(IMTLGWeighting())
        self.n_tasks = n_tasks
        self.imtl_l = IMTLL(self.n_tasks)

    def scale_losses(self, losses: Tensor) -> Tensor:
        """The IMTL-L scaled losses :math:`e^{s_i} L_i - s_i`, one per task (differentiable)."""
        if not isinstance(losses, Tensor):
            raise TypeError(f"`losses` must be a torch.Tensor, received {type(losses)}.")
        scales: Tensor = self.imtl_l.log_scale
        if losses.shape != scales.shape:
            raise ValueError(
                f"IMTL was built for {tuple(scales.shape)} losses but received shape "
                f"{tuple(losses.shape)}; pass the vector of the n_tasks losses."
            )
        scales = scales.to(device=losses.device)
        return torch.exp(scales) * losses - scales

    def check_rows(self, m: int) -> None:
        if m and m != self.n_tasks:
            raise ValueError(
                f"IMTL was built with `n_tasks={self.n_tasks}` (the size of its scales `imtl_l`) "
                f"but received {m} objectives; construct it with `n_tasks={m}`."
            )

    def weights(self, matrix: Tensor) -> Tensor:
        self.check_rows(matrix.shape[0])
        return super().weights(matrix)

    def reset(self) -> None:
        self.imtl_l.reset()

    def extra_repr(self) -> str:
        return f"n_tasks={self.n_tasks}"
