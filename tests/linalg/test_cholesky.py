"""``cholesky_ex``: the factor and ``info`` of ``torch.linalg.cholesky_ex``, padded sizes
included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jacflow.linalg._cholesky import cholesky_ex


@settings(max_examples=30, deadline=None)
@given(
    n=st.sampled_from([1, 5, 127, 128, 129, 256]),
    batch=st.sampled_from([(), (1,), (3,)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_factor_is_torchs(n: int, batch: tuple[int, ...], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    j = torch.randn(*batch, n, n + 3, generator=gen, dtype=torch.float64)
    a = j @ j.mT
    factor, info = cholesky_ex(a)
    expected, expected_info = torch.linalg.cholesky_ex(a)
    assert factor.shape == expected.shape
    torch.testing.assert_close(factor, expected)
    assert torch.equal(info, expected_info)


@pytest.mark.parametrize("n", [128, 129, 256])
def test_info_of_a_matrix_that_is_not_positive_definite(n: int, device: str) -> None:
    """The padding keeps LAPACK's ``info``: the order of the first bad leading minor."""
    a = torch.eye(n, dtype=torch.float64, device=device).repeat(2, 1, 1)
    a[0, 100, 100] = -1.0  # minor 101 is not positive definite
    factor, info = cholesky_ex(a)
    expected_factor, expected_info = torch.linalg.cholesky_ex(a)
    assert info.tolist() == expected_info.tolist() == [101, 0]
    torch.testing.assert_close(factor[1], expected_factor[1])


def test_float32_and_empty() -> None:
    j = torch.randn(128, 200)
    factor, info = cholesky_ex(j @ j.T)
    torch.testing.assert_close(factor @ factor.T, j @ j.T, rtol=1e-4, atol=1e-3)
    assert int(info) == 0
    empty_factor, empty_info = cholesky_ex(torch.zeros(0, 0))
    assert empty_factor.shape == (0, 0) and int(empty_info) == 0
