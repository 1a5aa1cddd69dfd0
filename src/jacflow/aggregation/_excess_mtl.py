"""ExcessMTL: robust multi-task learning with excess risks (He et al., ICML 2024)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow._stateful import SavesState, Stateful
from jacflow.aggregation._bases import WeightedAggregator, Weighting
from jacflow.aggregation._hyperparameters import Forwarded, Hyperparameter, floats, ints
from jacflow.aggregation._nonfinite import has_nonfinite, nan_weights
from jacflow.aggregation._properties import Property

_EPS = 1e-7


def _squares_and_sum(matrix: Tensor, sq_sum: Tensor) -> tuple[Tensor, Tensor] | None:
    """The squares of ``matrix`` and their running sum with ``sq_sum``, in ``matrix``'s dtype,
    or in float64 where they overflow it (finite float32 entries above about 1e19, or a sum
    that outgrew float32: the sum is then kept in float64, as it does not fit); ``None`` when
    ``matrix`` holds a NaN or an infinity (or its float64 squares overflow). One host
    synchronisation, three where float32 overflows.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._excess_mtl import _squares_and_sum
        >>> squares, total = _squares_and_sum(torch.tensor([[3e19, 1.0]]), torch.zeros(1, 2))
        >>> squares.dtype, bool(torch.isfinite(total).all())  # (9e38: past float32's range)
        (torch.float64, True)
    """
    squares = matrix.square()
    total = sq_sum.to(squares) + squares
    if not has_nonfinite(total):
        return squares, total
    if matrix.dtype == torch.float64 or has_nonfinite(matrix):
        return None
    return _squares_and_sum(matrix.double(), sq_sum)


class ExcessMTLWeighting(SavesState, Weighting, Stateful):
    r"""Weighting of :class:`ExcessMTL`; reads the Jacobian itself (its state is ``[m, n]``).

    Args:
        robust_step_size: step size :math:`\eta` of the exponentiated-gradient update, ``> 0``.
        n_warmup_steps: calls during which the weights stay ``1/m`` while the excess risks are
            averaged into the baseline, ``>= 0``. With 1 (default, as the official code and
            LibMTL) the first call records the baseline and keeps uniform weights. With 0
            (TorchJD 0.18's default) the first call's excess risks are the baseline and also
            drive that call's step unscaled: raw excess risks grow with the gradients' scale,
            so the weights can saturate at once.

    State:
        the running sum :math:`S` of squared Jacobians (``[m, n]``), the weights (initially
        ``1/m``), the baseline excess risks, the warm-up sum and the call counter. All are
        re-initialised when the Jacobian's shape changes.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import ExcessMTLWeighting
        >>> W = ExcessMTLWeighting()
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> W(J)  # the first call records the baseline
        tensor([0.5000, 0.5000])
        >>> W(J * torch.tensor([[2.], [1.]]))  # row 0's excess risk grew more: more weight
        tensor([0.7468, 0.2532])
    """

    without_autograd = True

    saved_state = ("_sq_sum", "_weights", "_baseline", "_warmup_sum", "_calls")

    robust_step_size = Hyperparameter(floats(low=0.0, low_open=True))
    n_warmup_steps = Hyperparameter(ints(low=0))

    def __init__(self, robust_step_size: float = 1.0, n_warmup_steps: int = 1) -> None:
        super().__init__()
        self.robust_step_size = robust_step_size
        self.n_warmup_steps = n_warmup_steps
        self.reset()

    def reset(self) -> None:
        """Forget every statistic: the next call starts from uniform weights and warm-up."""
        self._sq_sum: Tensor | None = None
        self._weights: Tensor | None = None
        self._baseline: Tensor | None = None
        self._warmup_sum: Tensor | None = None
        self._calls = 0

    def forward(self, stat: Tensor) -> Tensor:
        m, n = stat.shape
        with torch.no_grad():
            if m == 0:
                return stat.new_zeros(0)
            fresh = self._sq_sum is None or self._sq_sum.shape != stat.shape
            sq_sum = stat.new_zeros(m, n) if self._sq_sum is None or fresh else self._sq_sum
            summed = _squares_and_sum(stat.detach(), sq_sum)
            if summed is None:  # a NaN/inf in J: report it, keep the state (even on a new shape)
                return nan_weights(m, stat)
            if fresh:
                self.reset()
                self._weights = stat.new_full((m,), 1.0 / m)
                self._warmup_sum = stat.new_zeros(m)
            assert self._weights is not None and self._warmup_sum is not None
            squares, self._sq_sum = summed  # (not in place: a state_dict holds it)
            # Excess risk of task i ~ g_i^T H_i^{-1} g_i with the AdaGrad diagonal H_i (Eqs 6-7).
            excess = squares.div_((self._sq_sum + _EPS).sqrt_()).sum(dim=1)
            # (the state follows excess: stat's dtype, or float64 where the squares overflow it)
            self._calls += 1
            if self._calls <= self.n_warmup_steps:
                self._warmup_sum = self._warmup_sum.to(excess) + excess
                return self._weights.to(stat)
            if self._baseline is None:
                if self.n_warmup_steps > 0:
                    self._baseline = self._warmup_sum.to(excess) / self.n_warmup_steps
                    excess = excess / (self._baseline + _EPS)
                else:
                    self._baseline = excess
            else:
                excess = excess / (self._baseline.to(excess) + _EPS)
            # Exponentiated gradient (Eq. 9), in log space so that huge risks saturate.
            logits = self._weights.to(excess).log() + self.robust_step_size * excess
            self._weights = torch.softmax(logits, dim=0)
            return self._weights.to(stat)

    def extra_repr(self) -> str:
        return f"robust_step_size={self.robust_step_size}, n_warmup_steps={self.n_warmup_steps}"


class ExcessMTL(WeightedAggregator, Stateful):
    r"""ExcessMTL: weights driven up for the objectives with the largest excess risk.

    He et al. (Yifei He and co-authors), *Robust Multi-Task Learning with Excess Risks*,
    ICML 2024 (arXiv 2402.02009). The excess risk of objective :math:`i` is estimated by the
    second-order Taylor term :math:`E_i = g_i^\top H_i^{-1} g_i` with the AdaGrad diagonal
    :math:`H_i = \mathrm{diag}(\sqrt{\sum_{s \le t} g_{i,s}^2})` (Eqs. 6-7), divided by its
    baseline :math:`E_i^0` (Sec. 3.2), and the weights move by exponentiated gradient (Eq. 9):

    .. math:: w_{t+1} = \mathrm{softmax}\big(\log w_t + \eta\, E / E^0\big),\qquad
              d = J^\top w_{t+1}.

    The weights stay on the simplex (initially ``1/m``, as in the paper). By default the first
    call only records :math:`E^0` (uniform weights, as the official code). Permutation
    invariant. The state holds an ``[m, n]`` matrix, as large as the Jacobian.

    Args:
        robust_step_size: :math:`\eta`, ``> 0``.
        n_warmup_steps: see :class:`ExcessMTLWeighting`.

    State:
        see :class:`ExcessMTLWeighting`; :meth:`reset` forgets it.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import ExcessMTL
        >>> A = ExcessMTL()
        >>> J = torch.tensor([[-4., 1., 1.], [6., 1., 1.]])
        >>> A(J)  # the first call records the baseline: the mean of the rows
        tensor([1., 1., 1.])
        >>> A(J * torch.tensor([[2.], [1.]]))
        tensor([-4.4555,  1.7468,  1.7468])
    """

    properties = frozenset({Property.PERMUTATION_INVARIANT, Property.WEIGHTED})

    robust_step_size = Forwarded(ExcessMTLWeighting.robust_step_size, via="weighting")
    n_warmup_steps = Forwarded(ExcessMTLWeighting.n_warmup_steps, via="weighting")

    def __init__(self, robust_step_size: float = 1.0, n_warmup_steps: int = 1) -> None:
        super().__init__(ExcessMTLWeighting(robust_step_size, n_warmup_steps))

    def reset(self) -> None:
        """Forget every statistic."""
        assert isinstance(self.weighting, ExcessMTLWeighting)
        self.weighting.reset()

    def forward(self, matrix: Tensor) -> Tensor:
        with torch.no_grad():
            return super().forward(matrix)

    def extra_repr(self) -> str:
        return self.weighting.extra_repr()
