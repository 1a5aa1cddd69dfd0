"""MoCo: multi-objective gradient correction with a tracked Jacobian (Fernando et al., 2023)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from jacflow._stateful import SavesState, Stateful
from jacflow.aggregation._bases import Aggregator
from jacflow.aggregation._hyperparameters import Hyperparameter, floats
from jacflow.aggregation._nonfinite import has_nonfinite
from jacflow.aggregation._simplex import project_onto_simplex


def moco_step(
    tracked: Tensor, lambdas: Tensor, matrix: Tensor, beta_k: float, gamma_k: float, rho: float
) -> tuple[Tensor, Tensor, Tensor]:
    r"""One MoCo step: the new tracked Jacobian, the new weights, and the update.

    :math:`Y \leftarrow Y - \beta_k (Y - J)`,
    :math:`\lambda \leftarrow \Pi_\Delta(\lambda - \gamma_k (Y Y^\top + \rho I)\lambda)`,
    :math:`d = Y^\top \lambda`.
    """
    tracked = tracked - beta_k * (tracked - matrix)
    # Y Y^T lambda has the square of Y's scale, which overflows float32 from rows of norm 1e19
    # (a NaN lambda, kept as state, made every later update NaN): it is formed as
    # s (Y (Y^T lambda / s)) with s a power of two near Y's largest entry times one at least n
    # (Y's rows sum n terms of up to its largest entry), the last product and the step in
    # float64 (m numbers; Y itself is not widened: it may be m x 1e8).
    largest = tracked.abs().amax() if tracked.numel() else tracked.new_zeros(())
    scale = torch.where(largest > 0, torch.exp2(torch.floor(torch.log2(largest))), 1.0)
    terms = 2.0 ** math.ceil(math.log2(max(tracked.shape[-1], 1)))  # (apart: s n may overflow)
    product = (tracked @ ((tracked.T @ lambdas) / scale / terms)).to(torch.float64)
    old = lambdas.to(torch.float64)
    gradient = product * (scale.to(torch.float64) * terms) + rho * old
    lambdas = project_onto_simplex(old - gamma_k * gradient).to(lambdas.dtype)
    return tracked, lambdas, lambdas @ tracked


class MoCo(SavesState, Aggregator, Stateful):
    r"""MoCo: MGDA on a tracked (bias-corrected) Jacobian, with one projected-gradient step.

    Fernando, Shen, Liu, Chaudhury, Murugesan & Chen, *Mitigating Gradient Bias in
    Multi-objective Learning: A Provably Convergent Approach*, ICLR 2023 (arXiv 2210.12624).
    At step :math:`k = 1, 2, \dots`, with :math:`\beta_k = \beta / k^{\sigma_\beta}` and
    :math:`\gamma_k = \gamma / k^{\sigma_\gamma}`:

    .. math:: Y_k = Y_{k-1} - \beta_k (Y_{k-1} - J_k), \quad
              \lambda_k = \Pi_{\Delta_m}\!\big(\lambda_{k-1} - \gamma_k
              (Y_k Y_k^\top + \rho I)\lambda_{k-1}\big), \quad d_k = Y_k^\top \lambda_k,

    from :math:`Y_0 = 0` and :math:`\lambda_0 = \mathbf 1/m`, where :math:`\Pi_{\Delta_m}` is
    the Euclidean projection onto the simplex. This is the paper's algorithm (its optional
    projection of the rows of :math:`Y` onto a bounded set is left out); LibMTL's variant
    instead tracks rows rescaled to :math:`L_i g_i/\|g_i\|` and uses a softmax. :math:`Y Y^\top`
    needs :math:`Y J_k^\top`, so MoCo needs the Jacobian, not only its Gramian. The update mixes
    past Jacobians, so no property is claimed.

    Args:
        beta: tracking step :math:`\beta \in (0, 1]` (default 0.5).
        beta_sigma: decay exponent :math:`\sigma_\beta \ge 0` (default 0.5).
        gamma: weight step :math:`\gamma > 0` (default 0.1).
        gamma_sigma: decay exponent :math:`\sigma_\gamma \ge 0` (default 0.5).
        rho: regularisation :math:`\rho \ge 0` (default 0).

    State: :math:`Y` (``[m, n]``), :math:`\lambda` (``[m]``) and :math:`k`; :meth:`reset`
    forgets them. A Jacobian with a NaN or an infinity gives a NaN update and leaves the state
    untouched (so a step that an AMP ``GradScaler`` skips does not poison it).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import MoCo
        >>> A = MoCo()
        >>> J = torch.tensor([[2., 0.], [0., 1.]])
        >>> A(J)
        tensor([0.4812, 0.2594])
        >>> A(J)
        tensor([0.6206, 0.3665])
    """

    without_autograd = True

    saved_state = ("_tracked", "_lambdas", "_step")

    beta = Hyperparameter(floats(low=0.0, high=1.0, low_open=True))
    beta_sigma = Hyperparameter(floats(low=0.0))
    gamma = Hyperparameter(floats(low=0.0, low_open=True))
    gamma_sigma = Hyperparameter(floats(low=0.0))
    rho = Hyperparameter(floats(low=0.0))

    def __init__(
        self,
        beta: float = 0.5,
        beta_sigma: float = 0.5,
        gamma: float = 0.1,
        gamma_sigma: float = 0.5,
        rho: float = 0.0,
    ) -> None:
        super().__init__()
        self.beta = beta
        self.beta_sigma = beta_sigma
        self.gamma = gamma
        self.gamma_sigma = gamma_sigma
        self.rho = rho
        self._tracked: Tensor | None = None
        self._lambdas: Tensor | None = None
        self._step = 0

    def check_rows(self, m: int) -> None:
        if self._tracked is not None and self._tracked.shape[0] != m:
            raise ValueError(
                f"MoCo tracks a Jacobian of {self._tracked.shape[0]} rows but received one of {m} "
                "rows; call `reset()` when the shape changes."
            )

    def forward(self, matrix: Tensor) -> Tensor:
        m = matrix.shape[0]
        self.check_rows(m)
        if self._tracked is not None and self._tracked.shape != matrix.shape:
            raise ValueError(
                f"MoCo tracks a Jacobian of shape {tuple(self._tracked.shape)} but received one of "
                f"shape {tuple(matrix.shape)}; call `reset()` when the shape changes."
            )
        if m and has_nonfinite(matrix):
            # a skipped step: the state is left as it was (not set up, on a fresh instance)
            return torch.full_like(matrix[0], float("nan"))
        if self._tracked is None or self._lambdas is None:
            self._tracked = torch.zeros_like(matrix)
            self._lambdas = torch.full(
                (m,), 1.0 / max(m, 1), dtype=matrix.dtype, device=matrix.device
            )
        if m == 0:
            return matrix.new_zeros(matrix.shape[1])
        self._step += 1
        beta_k = self.beta / self._step**self.beta_sigma
        gamma_k = self.gamma / self._step**self.gamma_sigma
        with torch.no_grad():
            tracked, lambdas = self._tracked.to(matrix), self._lambdas.to(matrix)
            self._tracked, self._lambdas, update = moco_step(
                tracked, lambdas, matrix, beta_k, gamma_k, self.rho
            )
        return update

    def reset(self) -> None:
        self._tracked = None
        self._lambdas = None
        self._step = 0

    def extra_repr(self) -> str:
        return (
            f"beta={self.beta}, beta_sigma={self.beta_sigma}, gamma={self.gamma}, "
            f"gamma_sigma={self.gamma_sigma}, rho={self.rho}"
        )
