"""ConFIG: conflict-free updates through the pseudo-inverse of the unit gradients (Liu et al.)."""

from __future__ import annotations

import torch
from torch import Tensor

from jacflow.aggregation._bases import Aggregator, scale_to_unit_peak
from jacflow.aggregation._hyperparameters import Hyperparameter
from jacflow.aggregation._nonfinite import has_nonfinite
from jacflow.aggregation._pref_vector import check_pref_rows, check_pref_vector
from jacflow.aggregation._properties import Property
from jacflow.linalg import compute_gramian


def config_weights(gramian: Tensor, pref: Tensor, eps: float | None = None) -> Tensor:
    r"""Weights :math:`w` with :math:`J^\top w` = ConFIG's update, from the Gramian only.

    With :math:`D = \mathrm{diag}(1/\|g_i\|)` (0 for zero rows), the unit rows are :math:`DJ`
    and their Gramian :math:`\hat G = DGD`. The least-norm solution of :math:`(DJ)x = p` is
    :math:`x = J^\top D y`, :math:`y = \hat G^+ p`; with :math:`\|x\|^2 = y^\top \hat G y` and
    :math:`\sum_i \langle g_i, x\rangle = \mathbf 1^\top G D y`, the update
    :math:`(\sum_i \langle g_i, \hat x\rangle)\hat x`, :math:`\hat x = x/\|x\|`, is
    :math:`J^\top w` for :math:`w = \frac{\mathbf 1^\top G D y}{y^\top \hat G y} D y`.

    ``eps`` is the relative precision of :math:`\hat G`'s eigenvalues, which sets the
    pseudo-inverse's cut-off (default: the machine epsilon of ``gramian``'s dtype). A Gramian
    formed in float64 from float32 rows is exact to float64 rounding, but the rows themselves
    are known to float32's: :class:`ConFIG` passes ``max(eps64, eps32**2)`` (the Gramian
    squares the rows' singular values).

    Example:
        >>> import torch
        >>> from jacflow.aggregation._config import config_weights
        >>> config_weights(torch.tensor([[18., -22.], [-22., 38.]]), torch.ones(2))
        tensor([1.2265, 0.8441])
    """
    m = gramian.shape[0]
    if m == 0:
        return gramian.new_zeros(0)
    if has_nonfinite(gramian):
        return torch.full((m,), float("nan"), dtype=gramian.dtype, device=gramian.device)
    norms = gramian.diagonal().clamp(min=0).sqrt()
    inverse = torch.where(norms > 0, 1.0 / torch.where(norms > 0, norms, 1.0), 0.0)
    unit_gramian = gramian * inverse[:, None] * inverse[None, :]
    eps = torch.finfo(gramian.dtype).eps if eps is None else eps
    y = torch.linalg.pinv(unit_gramian, rtol=m * eps, hermitian=True) @ pref
    dy = inverse * y
    squared_norm = y @ unit_gramian @ y
    magnitude = (gramian @ dy).sum()
    # ||x||^2 >= |p_R|^2 / m when p has a part p_R in the range of U; below rounding level,
    # p is orthogonal to it (e.g. opposite rows) and there is no direction: the update is 0.
    floor = 100 * m * eps * (pref @ pref)
    defined = squared_norm > floor
    safe = torch.where(defined, squared_norm, torch.ones_like(squared_norm))
    return torch.where(defined, magnitude / safe, 0.0) * dy


class ConFIG(Aggregator):
    r"""ConFIG (conflict-free inverse gradients).

    Liu, Chu & Thuerey, *ConFIG: Towards Conflict-free Training of Physics Informed Neural
    Networks*, ICLR 2025 (arXiv 2408.11104). With the unit rows :math:`U = [g_i/\|g_i\|]_i`
    and preference :math:`p` (ones by default):

    .. math:: x = U^+ p, \qquad \hat x = x / \|x\|, \qquad
              A(J) = \Big(\sum_i \langle g_i, \hat x\rangle\Big) \hat x.

    When the rows are linearly independent, :math:`\langle g_i, \hat x\rangle \propto p_i
    \|g_i\| > 0` for every row. When :math:`x` vanishes (e.g. two opposite rows) there is no
    direction and the update is 0. Linear under scaling, and invariant to the rows'
    order with a uniform ``pref_vector``. Computed
    from the Gramian :math:`JJ^\top` (an ``m x m`` pseudo-inverse) and one product with
    :math:`J^\top`, never a pseudo-inverse of the ``[m, n]`` matrix; the Gramian is formed and
    solved in float64 (it squares the rows' condition number: in float32, rows 1e-3 rad apart
    would be taken for one), and a float32 ``J`` gives the float64 result to float32 precision.

    Args:
        pref_vector: the right-hand side :math:`p` (default: ones).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import ConFIG
        >>> ConFIG()(torch.tensor([[-4., 1., 1.], [6., 1., 1.]]))
        tensor([0.1588, 2.0706, 2.0706])
    """

    without_autograd = True

    properties = frozenset({Property.LINEAR_UNDER_SCALING, Property.PERMUTATION_INVARIANT})

    uniform_preference_properties = frozenset({Property.PERMUTATION_INVARIANT})

    pref_vector = Hyperparameter(check_pref_vector)

    def __init__(self, pref_vector: Tensor | None = None) -> None:
        super().__init__()
        self.pref_vector = pref_vector

    def check_rows(self, m: int) -> None:
        check_pref_rows(self.pref_vector, m)

    def forward(self, matrix: Tensor) -> Tensor:
        m = matrix.shape[0]
        self.check_rows(m)
        if self.pref_vector is None:
            pref = torch.ones(m, dtype=torch.float64, device=matrix.device)
        else:
            pref = self.pref_vector.to(device=matrix.device, dtype=torch.float64)
        with torch.no_grad():
            # (the weights ignore a global scale of J: no overflow or underflow of the Gramian)
            scaled = scale_to_unit_peak(matrix)
            # In float64: the unit Gramian squares the rows' condition number, so in float32 two
            # rows 1e-3 rad apart have an eigenvalue 1e-7, below float32's pinv cut-off.
            eps = max(torch.finfo(torch.float64).eps, torch.finfo(matrix.dtype).eps ** 2)
            weights = config_weights(compute_gramian(scaled.to(torch.float64)), pref, eps)
        return weights.to(matrix.dtype) @ matrix

    def extra_repr(self) -> str:
        return f"pref_vector={self.pref_vector!r}"
