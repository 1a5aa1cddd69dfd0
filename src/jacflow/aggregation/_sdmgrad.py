"""SDMGrad: direction-oriented multi-objective gradient (Xiao, Ban & Ji, NeurIPS 2023)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow._stateful import SavesState, Stateful
from jacflow.aggregation._bases import GramianWeighting
from jacflow.aggregation._hyperparameters import Forwarded, Hyperparameter, floats, ints
from jacflow.aggregation._nonfinite import has_nonfinite, nan_weights
from jacflow.aggregation._pref_vector import (
    check_pref_rows,
    check_pref_vector,
    resolve_pref_vector,
)
from jacflow.aggregation._preset import StatefulGramianPreset
from jacflow.aggregation._properties import Property
from jacflow.aggregation._simplex import project_onto_simplex


def sdmgrad_inner_loop(
    matrix: Tensor, w: Tensor, pref: Tensor, lr: float, momentum: float, n_iter: int, lambda_: float
) -> Tensor:
    r"""``n_iter`` steps of projected SGD with momentum on :math:`w \in \Delta`.

    The objective is :math:`\frac12 (w + \lambda p)^\top A (w + \lambda p)` with :math:`A` the
    input divided by the squared mean of :math:`\sqrt{A_{ii}}`; its gradient is
    :math:`A (w + \lambda p)` (symmetric case), as in TorchJD. The official code steps along
    the gradient of the objective without the half, twice this one: its ``lr`` is half of the
    same step's ``lr`` here.
    """
    scale = matrix.diagonal().clamp_min(0).sqrt().mean() ** 2
    a = matrix / torch.where(scale > 0, scale, torch.ones_like(scale))
    velocity: Tensor | None = None
    for _ in range(n_iter):
        grad = a @ (w + lambda_ * pref)
        velocity = grad if velocity is None else momentum * velocity + grad
        w = project_onto_simplex(w - lr * velocity)
    return w


class SDMGradWeighting(SavesState, GramianWeighting, Stateful):
    r"""Weighting of SDMGrad, for a cross-batch matrix :math:`A = J_1 J_2^\top` or a Gramian.

    The paper's stochastic algorithm reads :math:`A = J_1 J_2^\top` built from two independent
    mini-batches (an unbiased estimate of :math:`J J^\top`; not symmetric in general), and the
    returned weights multiply the losses of a third batch. Any square ``[m, m]`` input is
    accepted; with the Gramian :math:`J J^\top` of one batch it is the deterministic method
    (see :class:`SDMGrad`).

    Args:
        lr: step size of the inner projected SGD, ``> 0``.
        momentum: momentum of the inner SGD, in ``[0, 1)``.
        n_iter: number of inner steps per call, ``>= 1``.
        lambda_: pull towards the preference direction, ``>= 0``.
        pref_vector: the preference weights :math:`\tilde w` (default ``1/m`` each).

    State:
        the simplex weights :math:`w` of the inner problem (initially ``1/m``; re-initialised
        when the number of objectives changes), continued from call to call.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import SDMGradWeighting
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> SDMGradWeighting()(J @ J.T)
        tensor([0.1154, 0.8846])
    """

    without_autograd = True

    saved_state = ("_w",)

    lr = Hyperparameter(floats(low=0.0, low_open=True))
    momentum = Hyperparameter(floats(low=0.0, high=1.0, high_open=True))
    n_iter = Hyperparameter(ints(low=1))
    lambda_ = Hyperparameter(floats(low=0.0))
    pref_vector = Hyperparameter(check_pref_vector)

    def __init__(
        self,
        lr: float = 10.0,
        momentum: float = 0.5,
        n_iter: int = 20,
        lambda_: float = 0.3,
        pref_vector: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.lr = lr
        self.momentum = momentum
        self.n_iter = n_iter
        self.lambda_ = lambda_
        self.pref_vector = pref_vector
        self._w: Tensor | None = None

    def reset(self) -> None:
        """Forget the inner weights: the next call starts from ``1/m`` again."""
        self._w = None

    scale_invariant = True  # (its steps read G divided by the squared mean norm)

    def check_rows(self, m: int) -> None:
        check_pref_rows(self.pref_vector, m)

    def forward(self, stat: Tensor) -> Tensor:
        m = stat.shape[0]
        with torch.no_grad():
            pref = resolve_pref_vector(self.pref_vector, m, stat)
            if m == 0:
                return pref
            if has_nonfinite(stat):
                return nan_weights(m, stat)
            w = self._w
            if w is None or w.shape[0] != m:
                w = torch.full((m,), 1.0 / m, dtype=stat.dtype, device=stat.device)
            w = w.to(device=stat.device, dtype=stat.dtype)
            w = sdmgrad_inner_loop(stat, w, pref, self.lr, self.momentum, self.n_iter, self.lambda_)
            self._w = w
            return (w + self.lambda_ * pref) / (1.0 + self.lambda_)

    def extra_repr(self) -> str:
        return (
            f"lr={self.lr}, momentum={self.momentum}, n_iter={self.n_iter}, "
            f"lambda_={self.lambda_}, pref_vector={self.pref_vector}"
        )


class SDMGrad(StatefulGramianPreset):
    r"""SDMGrad on one Jacobian: :class:`SDMGradWeighting` applied to :math:`J J^\top`.

    Xiao, Ban & Ji, *Direction-oriented Multi-objective Learning: Simple and Provable Stochastic
    Algorithms*, NeurIPS 2023 (arXiv 2305.18409). The weights approximately solve

    .. math:: \min_{w \in \Delta_m} \tfrac12 \|J^\top (w + \lambda \tilde w)\|^2,\qquad
              d = J^\top \frac{w + \lambda \tilde w}{1 + \lambda},

    by ``n_iter`` steps of projected SGD with momentum, warm started from the previous call:
    the direction of the min-norm (MGDA) point pulled towards the preference direction
    :math:`J^\top \tilde w`. The paper's stochastic version feeds the weighting with
    :math:`J_1 J_2^\top` from two independent mini-batches (use :class:`SDMGradWeighting`
    directly for that); this aggregator uses the Gramian of the one Jacobian it receives.
    The input is divided by the squared mean row norm first, which makes the weights
    independent of the Jacobian's scale (the official code adds 1e-4 under each row norm's
    square root, which halves its steps for rows of norm about 0.01; TorchJD adds 1e-8 to the
    divisor, which changes the result for Jacobians of norm below about 1e-4). The inner step
    is ``lr`` times the gradient of the halved objective above, as in TorchJD, with TorchJD's
    default ``lr=10``; the official code's step is the gradient of the objective without the
    half, so its ``lr=10`` is ``lr=20`` here.

    Args:
        lr, momentum, n_iter, lambda_, pref_vector: see :class:`SDMGradWeighting`.

    State:
        the inner weights; :meth:`reset` forgets them.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import SDMGrad
        >>> SDMGrad()(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([4.8462, 1.0000, 1.0000])
    """

    # Permutation invariant in exact arithmetic only: with the default lr the inner iteration is
    # not contracting, and rounding differences from reordered sums can change its outcome.
    properties = frozenset({Property.WEIGHTED})

    lr = Forwarded(SDMGradWeighting.lr)
    momentum = Forwarded(SDMGradWeighting.momentum)
    n_iter = Forwarded(SDMGradWeighting.n_iter)
    lambda_ = Forwarded(SDMGradWeighting.lambda_)
    pref_vector = Forwarded(SDMGradWeighting.pref_vector)

    def __init__(
        self,
        lr: float = 10.0,
        momentum: float = 0.5,
        n_iter: int = 20,
        lambda_: float = 0.3,
        pref_vector: Tensor | None = None,
    ) -> None:
        super().__init__(SDMGradWeighting(lr, momentum, n_iter, lambda_, pref_vector))
