"""A Cholesky factorisation that steps around the slow sizes of the CPU's LAPACK."""

from __future__ import annotations

import torch
from torch import Tensor

# MKL's factorisation of a matrix whose size is a multiple of this is markedly slower than of
# its neighbours (one thread, float64: 133 us at 128 against 61 us at 127 and 45 us at 129; 3.2
# ms at 512 against 1.5 ms at 513).
_SLOW_MULTIPLE = 128


def cholesky_ex(a: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.cholesky_ex(a)``: the lower factor ``L`` of every matrix of ``a`` and
    LAPACK's ``info`` (0, or the order of the first leading minor that is not positive
    definite).

    On the CPU, matrices of a size that is a multiple of 128 are factorised as
    ``[[A, 0], [0, 1]]``, whose factor is ``[[L, 0], [0, 1]]`` and whose ``info`` is that of
    ``A``: 0.35-0.9x the time at sizes 128 to 768 (float32 and float64, one thread; a one-off
    measurement). ``L`` is then a view of the larger factor.

    Example:
        >>> import torch
        >>> from jacflow.linalg._cholesky import cholesky_ex
        >>> j = torch.randn(128, 300, dtype=torch.float64)
        >>> factor, info = cholesky_ex(j @ j.T)
        >>> torch.allclose(factor @ factor.T, j @ j.T), int(info)
        (True, 0)
    """
    n = a.shape[-1]
    if a.device.type != "cpu" or n == 0 or n % _SLOW_MULTIPLE:
        return torch.linalg.cholesky_ex(a)
    padded = a.new_zeros(*a.shape[:-2], n + 1, n + 1)
    padded[..., :n, :n] = a
    padded[..., n, n] = 1.0
    factor, info = torch.linalg.cholesky_ex(padded)
    return factor[..., :n, :n], info
