"""DB-MTL: dual balancing of log-losses and gradient magnitudes (Lin B. et al., 2023)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow._stateful import SavesState, Stateful
from jacflow.aggregation._bases import Aggregator, unit_peak_factor
from jacflow.aggregation._hyperparameters import Hyperparameter, floats
from jacflow.aggregation._loss_aware import LossAware
from jacflow.aggregation._nonfinite import has_nonfinite

_EPS = 1e-8


def dbmtl_step(
    buffer: Tensor, matrix: Tensor, losses: Tensor, beta_t: float
) -> tuple[Tensor, Tensor]:
    r"""One DB-MTL step: the new EMA buffer and the update.

    :math:`\hat G \leftarrow \beta_t \hat G + (1-\beta_t)\,\mathrm{diag}(1/(L+10^{-8}))\,J`,
    then :math:`d = \sum_i \alpha_i \hat G_i` with
    :math:`\alpha_i = \max_j \|\hat G_j\| / (\|\hat G_i\| + 10^{-8})`.
    """
    log_jacobian = matrix / (losses + _EPS)[:, None]
    buffer = beta_t * buffer + (1 - beta_t) * log_jacobian
    # The norms of the buffer scaled by a power of two c (exact), and the ratios from them:
    # squared, float32 rows of norm 2e19 overflowed to inf, and inf / inf gave a NaN update.
    c = unit_peak_factor([buffer])
    norms = (c * buffer).norm(dim=1)
    scales = norms.max() / (norms + c * _EPS)
    return buffer, scales @ buffer


class DBMTL(SavesState, Aggregator, LossAware, Stateful):
    r"""DB-MTL: an EMA of the log-loss gradients, each rescaled to the largest norm.

    Lin B., Jiang, Ye, Zhang, Ren, Kwok & Zhang, *Dual-Balancing for Multi-Task Learning*,
    arXiv 2308.12029, 2023 (published in *Neural Networks*). At step :math:`t = 1, 2, \dots`,
    with :math:`\beta_t = \beta / t^{\sigma}`:

    .. math:: \hat G_t = \beta_t \hat G_{t-1} + (1 - \beta_t)\,
              \mathrm{diag}\big(\tfrac{1}{L + 10^{-8}}\big) J_t, \qquad
              d_t = \sum_i \frac{\max_j \|\hat G_{t,j}\|}{\|\hat G_{t,i}\| + 10^{-8}}
              \hat G_{t,i},

    with :math:`\hat G_0 = 0` (the log transform is the loss-scale balancing, the rescaling to
    the largest norm the gradient-scale balancing). Task-specific parameters should receive
    :math:`\nabla \sum_i \log L_i` (outside of this aggregator). The update is not of the form
    :math:`J_t^\top w` (it mixes past Jacobians), so no property is claimed.

    Args:
        beta: EMA coefficient :math:`\beta \in [0, 1)` (default 0.9).
        beta_sigma: decay exponent :math:`\sigma \ge 0` of :math:`\beta_t` (default 0).

    State: the EMA matrix :math:`\hat G` (``[m, n]``) and the step :math:`t`; :meth:`reset`
    forgets them. A NaN or infinite Jacobian or loss gives a NaN update and leaves the state
    untouched (so a step that an AMP ``GradScaler`` skips does not poison it). Call
    :meth:`set_losses` with the ``m`` positive losses before each call; a finite loss
    :math:`\le 0` raises a ``ValueError`` before any change (its log is undefined: such a task
    would ascend, and :math:`L = -10^{-8}` divides by 0).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import DBMTL
        >>> A = DBMTL()
        >>> A.set_losses(torch.tensor([2., 0.5]))
        >>> A(torch.tensor([[4., 0.], [0., 1.]]))
        tensor([0.2000, 0.2000])
    """

    without_autograd = True

    saved_state = ("_buffer", "_step")

    beta = Hyperparameter(floats(low=0.0, high=1.0, high_open=True))
    beta_sigma = Hyperparameter(floats(low=0.0))

    def __init__(self, beta: float = 0.9, beta_sigma: float = 0.0) -> None:
        super().__init__()
        self.beta = beta
        self.beta_sigma = beta_sigma
        self._buffer: Tensor | None = None
        self._step = 0

    def check_rows(self, m: int) -> None:
        self.require_losses(m)
        if self._buffer is not None and self._buffer.shape[0] != m:
            raise ValueError(
                f"DBMTL holds an EMA of {self._buffer.shape[0]} rows but received a matrix of {m} "
                "rows; call `reset()` when the shape changes."
            )

    def forward(self, matrix: Tensor) -> Tensor:
        self.check_rows(matrix.shape[0])
        losses = self.losses_like(matrix.shape[0], matrix)
        if bool(((losses <= 0) & torch.isfinite(losses)).any()):
            raise ValueError(
                f"DBMTL needs positive losses (it divides by them: the gradients of their logs), "
                f"received {losses.tolist()}. Shift the losses by a constant to make them "
                "positive."
            )
        if self._buffer is not None and self._buffer.shape != matrix.shape:
            raise ValueError(
                f"DBMTL holds an EMA of shape {tuple(self._buffer.shape)} but received a matrix "
                f"of shape {tuple(matrix.shape)}; call `reset()` when the shape changes."
            )
        if matrix.shape[0] and (has_nonfinite(matrix) or has_nonfinite(losses)):
            # a skipped step: the state is left as it was (not set up, on a fresh instance)
            return torch.full_like(matrix[0], float("nan"))
        if self._buffer is None:
            self._buffer = torch.zeros_like(matrix)
        if matrix.shape[0] == 0:
            return matrix.new_zeros(matrix.shape[1])
        self._step += 1
        beta_t = self.beta / self._step**self.beta_sigma
        with torch.no_grad():
            buffer = self._buffer.to(matrix)
            self._buffer, update = dbmtl_step(buffer, matrix, losses, beta_t)
        return update

    def reset(self) -> None:
        self._buffer = None
        self._step = 0

    def extra_repr(self) -> str:
        return f"beta={self.beta}, beta_sigma={self.beta_sigma}"
