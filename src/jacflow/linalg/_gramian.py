"""Gramians of Jacobian matrices and the PSD helpers every Gramian weighting shares."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from jacflow.linalg._products import row_gramian


def check_eps(value: object, name: str) -> float:
    """``value`` as a finite float ``>= 0``: a ``TypeError`` for a non-number (or a bool), a
    ``ValueError`` for NaN, an infinity or a negative number."""
    # (imported here: jacflow.aggregation imports jacflow.linalg)
    from jacflow.aggregation._hyperparameters import check_float

    return check_float(value, name, low=0.0)


def check_float_tensor(value: object, name: str) -> None:
    """A ``TypeError`` unless ``value`` is a Tensor of a real floating dtype (metadata only)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, received {type(value)}.")
    if not value.is_floating_point():  # (False for integer, bool and complex dtypes)
        raise TypeError(
            f"`{name}` must have a floating dtype (float32 or float64), received "
            f"{value.dtype}; convert it with `.double()`."
        )


def check_gramian(gramian: object, function: str) -> None:
    """``gramian`` must be a real floating Tensor of shape ``[..., m, m]`` (metadata only)."""
    check_float_tensor(gramian, "gramian")
    assert isinstance(gramian, Tensor)  # (for mypy: checked just above)
    if gramian.ndim < 2 or gramian.shape[-1] != gramian.shape[-2]:
        raise ValueError(
            f"`{function}` expects a square matrix [m, m] or a batch of them [..., m, m], "
            f"received shape {tuple(gramian.shape)}."
        )


def compute_gramian(matrix: Tensor) -> Tensor:
    """Return ``matrix @ matrix.T``: the Gramian of the rows of a ``[m, n]`` matrix.

    Entry ``(i, j)`` is the inner product of rows ``i`` and ``j``; the diagonal holds the
    squared norms. A negative off-diagonal entry means that two gradients conflict.

    Example:
        >>> import torch
        >>> from jacflow.linalg import compute_gramian
        >>> compute_gramian(torch.tensor([[1., 0.], [-1., 2.]]))
        tensor([[ 1., -1.],
                [-1.,  5.]])
    """
    if not torch.jit.is_scripting():  # noqa: SIM102 (TorchScript drops this branch only alone)
        if not isinstance(matrix, torch.fx.Proxy):  # (whose `ndim` is not known)
            check_float_tensor(matrix, "matrix")
            if matrix.ndim != 2:
                raise ValueError(
                    "`compute_gramian` expects a 2-D [m, n] matrix (one row per objective), "
                    f"received shape {tuple(matrix.shape)}. Flatten the trailing dimensions "
                    "(`matrix.flatten(1)`; one row: `matrix[None]`), or use `sum_gramians`."
                )
            return row_gramian(matrix)
    return matrix @ matrix.T


def sum_gramians(matrices: Iterable[Tensor]) -> Tensor:
    """Gramian of the column-wise concatenation of ``matrices`` without concatenating them.

    Each matrix has shape ``[m, *any]``; they must share ``m``. Saves the copy that
    ``torch.cat`` would make of a Jacobian split over several parameters.

    Example:
        >>> import torch
        >>> from jacflow.linalg import sum_gramians
        >>> a, b = torch.tensor([[1., 2.], [0., 1.]]), torch.tensor([[3.], [4.]])
        >>> sum_gramians([a, b])
        tensor([[14., 14.],
                [14., 17.]])
    """
    total: Tensor | None = None
    rows: int | None = None
    for i, matrix in enumerate(matrices):
        check_float_tensor(matrix, f"matrices[{i}]")
        if matrix.ndim == 0:
            raise ValueError(
                "`sum_gramians` expects tensors of shape [m, *any], received "
                f"{tuple(matrix.shape)} at {i}."
            )
        if rows is not None and matrix.shape[0] != rows:
            raise ValueError(
                f"`sum_gramians` expects matrices with the same number of rows m, received "
                f"{rows} rows first and {matrix.shape[0]} at {i}."
            )
        rows = matrix.shape[0]
        # (reshape cannot infer -1 for an empty [0, ...] matrix)
        flat = matrix.reshape(rows, -1) if rows else matrix.new_zeros(0, 0)
        term = row_gramian(flat)
        total = term if total is None else total + term
    if total is None:
        raise ValueError("`sum_gramians` needs at least one matrix, received none.")
    return total


def normalize_gramian(gramian: Tensor, eps: float) -> Tensor:
    """Divide a Gramian (or a batch of them) by its trace; a trace ``<= eps`` gives zeros.

    A NaN or infinite trace is not "small": the division happens and the non-finite values
    reach the result (NaN), so that callers see them. Uses ``torch.where`` rather than a
    Python ``if`` so that no host synchronisation happens on an accelerator.

    Example:
        >>> import torch
        >>> from jacflow.linalg import normalize_gramian
        >>> normalize_gramian(torch.tensor([[3., -1.], [-1., 1.]]), eps=0.0)
        tensor([[ 0.7500, -0.2500],
                [-0.2500,  0.2500]])
        >>> normalize_gramian(torch.tensor([[1e-9, 0.], [0., 1e-9]]), eps=1e-6)
        tensor([[0., 0.],
                [0., 0.]])
        >>> normalize_gramian(torch.tensor([[float("nan"), 0.], [0., 1.]]), eps=0.0)
        tensor([[nan, nan],
                [nan, nan]])
    """
    check_gramian(gramian, "normalize_gramian")
    return _normalize_gramian(gramian, check_eps(eps, "eps"))


def _normalize_gramian(gramian: Tensor, eps: float) -> Tensor:
    """:func:`normalize_gramian` without the checks (internal callers, on hot paths)."""
    if gramian.shape[-1] == 0:  # (no objectives: nothing to divide, and no amax of nothing)
        return torch.zeros_like(gramian)
    diagonal = gramian.diagonal(dim1=-2, dim2=-1)
    # (a trace that overflows from finite entries near the largest float: divided by the
    # largest diagonal entry first, instead of by that infinite trace, which gave zeros)
    overflowed = torch.isinf(diagonal.sum(-1)) & torch.isfinite(diagonal).all(-1)
    unit = torch.where(overflowed, diagonal.abs().amax(-1), 1.0)[..., None, None]
    scaled = gramian / unit
    trace = scaled.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]
    keep = (trace > eps / unit) | ~torch.isfinite(trace)
    safe = torch.where(keep, trace, torch.ones_like(trace))
    return torch.where(keep, scaled / safe, torch.zeros_like(gramian))


def regularize_gramian(gramian: Tensor, eps: float) -> Tensor:
    """Return ``gramian + eps * I`` (batched over leading dimensions).

    Example:
        >>> import torch
        >>> from jacflow.linalg import regularize_gramian
        >>> regularize_gramian(torch.tensor([[1., -1.], [-1., 1.]]), eps=0.5)
        tensor([[ 1.5000, -1.0000],
                [-1.0000,  1.5000]])
    """
    check_gramian(gramian, "regularize_gramian")
    return _regularize_gramian(gramian, check_eps(eps, "eps"))


def _regularize_gramian(gramian: Tensor, eps: float) -> Tensor:
    """:func:`regularize_gramian` without the checks (internal callers, on hot paths)."""
    m = gramian.shape[-1]
    eye = torch.eye(m, dtype=gramian.dtype, device=gramian.device)
    return gramian + eps * eye


def has_nonfinite(tensor: Tensor) -> bool:
    """Whether ``tensor`` holds a NaN or an infinity (one host sync).

    A finite sum proves every entry finite (a NaN or an infinity makes the sum NaN or
    infinite) at the cost of one reduction; only a non-finite sum (or an overflow) pays for the
    entrywise test, several times dearer on a large Gramian.

    Example:
        >>> import torch
        >>> from jacflow.linalg._gramian import has_nonfinite
        >>> has_nonfinite(torch.tensor([1.0, float("nan")]))
        True
        >>> has_nonfinite(torch.tensor([3e38, 3e38]))  # the sum overflows, the entries do not
        False
    """
    if math.isfinite(float(tensor.detach().sum())):
        return False
    return not bool(torch.isfinite(tensor).all())
