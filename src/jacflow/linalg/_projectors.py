"""Dual-cone projectors: interchangeable solvers of ``min v^T G v  s.t.  v >= u``.

UPGrad takes a projector so that the solver (and its normalisation / regularisation) is a
choice of the user: :class:`TorchProjector` (default, exact, batched, on the Gramian's device) or
:class:`QuadprogProjector` (quadprog on the CPU, TorchJD's numbers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, final

import torch
from torch import Tensor

from jacflow.linalg._dual_cone import (
    _offloads,
    check_solver_settings,
    project_diagonal,
    project_weights,
)
from jacflow.linalg._gramian import _normalize_gramian, _regularize_gramian, check_float_tensor


class DualConeProjector(ABC):
    """Maps weights ``u`` ``[..., m]`` and a Gramian ``G`` ``[m, m]`` to ``v`` (``u``'s shape).

    ``v`` solves ``minimize v^T G v subject to v >= u`` row by row, so that ``J^T v`` is the
    projection of ``J^T u`` onto the dual cone ``{x : J x >= 0}``.

    Example:
        >>> import torch
        >>> from jacflow.linalg import DualConeProjector, TorchProjector
        >>> isinstance(TorchProjector(), DualConeProjector)
        True
    """

    differentiable: ClassVar[bool] = False
    """Whether autograd's graph of ``v`` gives its true derivative with respect to ``u`` and
    ``G``: :class:`UPGrad` and :class:`DualProj` with this projector then return updates with
    a graph (``create_graph=True``). Off by default, so that a solver whose graph would hold
    something constant (an iteration, a detached step) gives no silently wrong derivative; a
    projector of your own written in differentiable torch code sets it to True.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import UPGrad
        >>> from jacflow.linalg import DualConeProjector, project_weights
        >>> class Mine(DualConeProjector):
        ...     differentiable = True
        ...     def __call__(self, u, gramian):
        ...         return project_weights(u, gramian)
        >>> UPGrad(projector=Mine()).differentiable
        True
    """

    @abstractmethod
    def __call__(self, u: Tensor, gramian: Tensor) -> Tensor:
        """Project every row of ``u``."""

    def project_diagonal(self, pref: Tensor, gramian: Tensor) -> Tensor:
        """Project the rows of ``torch.diag(pref)`` (UPGrad's problems), ``[m, m]``.

        The default forms the matrix and calls the projector; a projector may solve these
        problems faster.

        Example:
            >>> import torch
            >>> from jacflow.linalg import QuadprogProjector
            >>> G = torch.tensor([[18., -22.], [-22., 38.]])
            >>> QuadprogProjector().project_diagonal(torch.ones(2), G)
            tensor([[1.0000, 0.5789],
                    [1.2218, 1.0000]])
        """
        return self(torch.diag(pref), gramian)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._repr_args()})"

    def _repr_args(self) -> str:
        """The constructor arguments, as they appear in ``repr`` (none by default: a projector
        written to TorchJD's contract, one abstract ``__call__``, needs nothing more)."""
        return ""


@final
class TorchProjector(DualConeProjector):
    """The default projector: :func:`jacflow.linalg.project_weights` with fixed settings.

    Args:
        norm_eps: see :func:`~jacflow.linalg.project_weights` (default 0).
        reg_eps: see :func:`~jacflow.linalg.project_weights` (default 0: the exact problem).
        method: ``"auto"``, ``"pdas"``, ``"admm"`` or ``"fista"``.
        max_iter: iteration cap (``None``: the solver's default).
        tol: KKT residual tolerance (``None``: the solver's default for the dtype).

    Example:
        >>> import torch
        >>> from jacflow.linalg import TorchProjector
        >>> G = torch.tensor([[1., -1.], [-1., 4.]])
        >>> TorchProjector()(torch.tensor([1., 0.]), G)
        tensor([1.0000, 0.2500])
    """

    differentiable = True  # (implicit differentiation of the projections' KKT systems)

    def __init__(
        self,
        norm_eps: float = 0.0,
        reg_eps: float = 0.0,
        method: str = "auto",
        max_iter: int | None = None,
        tol: float | None = None,
    ) -> None:
        check_solver_settings(norm_eps, reg_eps, method, max_iter, tol)
        self.norm_eps = float(norm_eps)
        self.reg_eps = float(reg_eps)
        self.method = method
        self.max_iter = max_iter
        self.tol = tol

    def __call__(self, u: Tensor, gramian: Tensor) -> Tensor:
        return project_weights(u, gramian, **self._settings())

    def project_diagonal(self, pref: Tensor, gramian: Tensor) -> Tensor:
        """Project the rows of ``torch.diag(pref)`` without forming or scanning them.

        Example:
            >>> import torch
            >>> from jacflow.linalg import TorchProjector
            >>> G = torch.tensor([[1., -1.], [-1., 4.]])
            >>> TorchProjector().project_diagonal(torch.tensor([1., 1.]), G)
            tensor([[1.0000, 0.2500],
                    [1.0000, 1.0000]])
        """
        return project_diagonal(pref, gramian, **self._settings())

    def _settings(self) -> dict[str, Any]:
        return {
            "norm_eps": self.norm_eps,
            "reg_eps": self.reg_eps,
            "method": self.method,
            "max_iter": self.max_iter,
            "tol": self.tol,
        }

    def _repr_args(self) -> str:
        return (
            f"norm_eps={self.norm_eps}, reg_eps={self.reg_eps}, method={self.method!r}, "
            f"max_iter={self.max_iter}, tol={self.tol}"
        )


def _quadprog() -> Any:
    """The ``quadprog`` module, imported where used: a projector that held it could not be
    copied or pickled (nor a model or aggregator holding the projector, in a checkpoint)."""
    try:
        import quadprog
    except ImportError as error:
        raise ImportError(
            "`QuadprogProjector` needs the quadprog package: `pip install quadprog` (or use "
            "the default `TorchProjector`)."
        ) from error
    return quadprog


@final
class QuadprogProjector(DualConeProjector):
    """Projector solving one quadprog QP per row on the CPU in float64 (TorchJD's numbers).

    ``G`` is divided by its trace (a trace ``<= norm_eps`` gives ``G = 0``) and ``reg_eps * I``
    is added, as in TorchJD 0.18; quadprog (Goldfarb-Idnani) then needs that regularised ``G``
    to be positive definite. A NaN or infinite entry in ``G`` gives NaN weights. Requires the
    ``quadprog`` package.

    Args:
        norm_eps: trace threshold of the normalisation (TorchJD: 1e-4).
        reg_eps: diagonal regularisation of the normalised Gramian (TorchJD: 1e-4); must be
            positive for singular Gramians.

    Raises:
        ImportError: at construction, if ``quadprog`` is not installed.

    Example:
        >>> import torch
        >>> from jacflow.linalg import QuadprogProjector
        >>> G = torch.tensor([[18., -22.], [-22., 38.]])
        >>> QuadprogProjector()(torch.eye(2), G)  # the exact solution has 1.2222
        tensor([[1.0000, 0.5789],
                [1.2218, 1.0000]])
    """

    def __init__(self, norm_eps: float = 1e-4, reg_eps: float = 1e-4) -> None:
        check_solver_settings(norm_eps, reg_eps, "auto", None, None)
        self.norm_eps = float(norm_eps)
        self.reg_eps = float(reg_eps)
        _quadprog()  # (refused at construction where it is missing)

    def __call__(self, u: Tensor, gramian: Tensor) -> Tensor:
        check_float_tensor(u, "u")
        check_float_tensor(gramian, "gramian")
        m = gramian.shape[-1] if gramian.ndim else 0
        if gramian.ndim != 2 or gramian.shape[0] != m or u.shape[-1:] != (m,):
            raise ValueError(
                "`QuadprogProjector` expects `u` [..., m] and `gramian` [m, m], received shapes "
                f"{tuple(u.shape)} and {tuple(gramian.shape)}."
            )
        dtype = torch.promote_types(u.dtype, gramian.dtype)
        if m == 0:  # (nothing to project, as project_weights)
            return u.detach().to(device=gramian.device, dtype=dtype, copy=True)
        g = _normalize_gramian(gramian.detach().cpu().double(), self.norm_eps)
        g = _regularize_gramian(g, self.reg_eps)
        rows_t = u.detach().cpu().double().reshape(-1, m)
        finite_rows = torch.isfinite(rows_t).all(-1).tolist()
        rows = rows_t.numpy()
        if not bool(torch.isfinite(g).all()):  # quadprog would call it "not positive definite"
            return torch.full(u.shape, float("nan"), dtype=dtype, device=gramian.device)
        g_np = ((g + g.T) / 2).numpy()
        identity = torch.eye(m, dtype=torch.float64, device="cpu").numpy()
        zeros = torch.zeros(m, dtype=torch.float64, device="cpu").numpy()
        solve_qp = _quadprog().solve_qp
        solutions = []
        for row, finite in zip(rows, finite_rows, strict=True):
            if not finite:  # (as the batched solver: NaN weights for a NaN or infinite row)
                solutions.append(torch.full((m,), float("nan"), dtype=torch.float64))
                continue
            try:
                solution = solve_qp(g_np, zeros, identity, row)[0]
            except ValueError as error:
                raise ValueError(
                    f"quadprog could not solve the projection ({error}); the regularised "
                    f"Gramian must be positive definite: use `reg_eps > 0` (now {self.reg_eps})."
                ) from error
            solutions.append(torch.from_numpy(solution))
        v = (torch.stack(solutions) if solutions else torch.from_numpy(rows)).reshape(u.shape)
        return v.to(device=gramian.device, dtype=dtype)

    def _repr_args(self) -> str:
        return f"norm_eps={self.norm_eps}, reg_eps={self.reg_eps}"


def solves_on_host(projector: DualConeProjector, gramian: Tensor, *others: Tensor | None) -> bool:
    """Whether a weighting should compute its weights from host copies of ``gramian`` (and of
    ``others``, its other inputs): where ``projector`` would copy its problems to the host
    anyway (a default-method :class:`TorchProjector`, see :func:`project_weights`'s Solvers).
    The weighting's own steps around the projection (checks, rescaling, sums) then run there
    too, instead of as small kernels and synchronisations on the accelerator.

    Example:
        >>> import torch
        >>> from jacflow.linalg import QuadprogProjector, TorchProjector
        >>> from jacflow.linalg._projectors import solves_on_host
        >>> G = torch.eye(3)  # (on the CPU: nothing to copy)
        >>> solves_on_host(TorchProjector(), G), solves_on_host(QuadprogProjector(), G)
        (False, False)
    """
    if not isinstance(projector, TorchProjector):
        return False
    tracked = any(t is not None and t.requires_grad for t in (gramian, *others))
    return _offloads(gramian, torch.is_grad_enabled() and tracked, projector.method)
