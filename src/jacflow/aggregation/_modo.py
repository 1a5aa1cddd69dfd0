"""MoDo: multi-objective gradient with double sampling (Chen, Fernando, Ying & Chen, JMLR 2024)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow._stateful import SavesState, Stateful
from jacflow.aggregation._bases import GramianWeighting
from jacflow.aggregation._hyperparameters import Forwarded, Hyperparameter, floats
from jacflow.aggregation._nonfinite import has_nonfinite, nan_weights
from jacflow.aggregation._preset import StatefulGramianPreset
from jacflow.aggregation._properties import Property
from jacflow.aggregation._simplex import project_onto_simplex


def modo_step(matrix: Tensor, lambd: Tensor, gamma: float, rho: float) -> Tensor:
    r"""One projected step :math:`\Pi_\Delta(\lambda - \gamma (A \lambda + \rho \lambda))`."""
    return project_onto_simplex(lambd - gamma * (matrix @ lambd + rho * lambd))


class MoDoWeighting(SavesState, GramianWeighting, Stateful):
    r"""Weighting of MoDo, for a cross-batch matrix :math:`A = J_1 J_2^\top` or a Gramian.

    The paper's algorithm reads :math:`A = J_1 J_2^\top` from two independent mini-batches (an
    unbiased estimate of :math:`J J^\top`; a single-batch Gramian biases the step); any square
    ``[m, m]`` input is accepted.

    Args:
        gamma: step size of the weight update, ``> 0``.
        rho: :math:`\ell_2` regularisation of the weights, ``>= 0``.

    State:
        the weights :math:`\lambda` (initially ``1/m``; re-initialised when the number of
        objectives changes).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import MoDoWeighting
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> MoDoWeighting()(J @ J.T)
        tensor([1., 0.])
    """

    without_autograd = True

    saved_state = ("_lambda",)

    gamma = Hyperparameter(floats(low=0.0, low_open=True))
    rho = Hyperparameter(floats(low=0.0))

    def __init__(self, gamma: float = 0.1, rho: float = 0.1) -> None:
        super().__init__()
        self.gamma = gamma
        self.rho = rho
        self._lambda: Tensor | None = None

    def reset(self) -> None:
        """Forget the weights: the next call starts from ``1/m`` again."""
        self._lambda = None

    def forward(self, stat: Tensor) -> Tensor:
        m = stat.shape[0]
        with torch.no_grad():
            if m == 0:
                return stat.new_zeros(0)
            if has_nonfinite(stat):
                return nan_weights(m, stat)
            lambd = self._lambda
            if lambd is None or lambd.shape[0] != m:
                lambd = torch.full((m,), 1.0 / m, dtype=stat.dtype, device=stat.device)
            lambd = modo_step(
                stat, lambd.to(device=stat.device, dtype=stat.dtype), self.gamma, self.rho
            )
            self._lambda = lambd
            return lambd

    def extra_repr(self) -> str:
        return f"gamma={self.gamma}, rho={self.rho}"


class MoDo(StatefulGramianPreset):
    r"""MoDo on one Jacobian: :class:`MoDoWeighting` applied to :math:`J J^\top`.

    Chen, Fernando, Ying & Chen, *Three-Way Trade-Off in Multi-Objective Learning:
    Optimization, Generalization and Conflict-Avoidance*, NeurIPS 2023 / JMLR 2024 (arXiv
    2305.20057). Each call takes one projected gradient step on the MGDA objective
    :math:`\frac12\|J^\top\lambda\|^2 + \frac\rho2\|\lambda\|^2` over the simplex and returns the
    update :math:`J^\top \lambda`:

    .. math:: \lambda_{t+1} = \Pi_{\Delta_m}\big(\lambda_t - \gamma (A_t \lambda_t +
              \rho \lambda_t)\big),\qquad d_t = J_t^\top \lambda_{t+1}.

    The paper estimates :math:`A_t = J_1 J_2^\top` from two independent batches (use
    :class:`MoDoWeighting` directly for that); this aggregator uses the Gramian of the one
    Jacobian it receives. The step is not normalised, so ``gamma`` is relative to the squared
    scale of the gradients.

    Args:
        gamma, rho: see :class:`MoDoWeighting`.

    State:
        the weights :math:`\lambda`; :meth:`reset` forgets them.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import MoDo
        >>> MoDo()(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([-4.,  1.,  1.])
    """

    properties = frozenset({Property.PERMUTATION_INVARIANT, Property.WEIGHTED})

    gamma = Forwarded(MoDoWeighting.gamma)
    rho = Forwarded(MoDoWeighting.rho)

    def __init__(self, gamma: float = 0.1, rho: float = 0.1) -> None:
        super().__init__(MoDoWeighting(gamma, rho))
