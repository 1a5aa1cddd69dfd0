"""TrimmedMean against a brute-force per-column implementation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from jacflow.aggregation import Mean, TrimmedMean
from tests.aggregation._properties import (
    check_claimed_properties,
    check_device_and_dtype,
    jacobians,
)


def brute_force(J: Tensor, trim: int) -> Tensor:
    columns = []
    for k in range(J.shape[1]):
        values = sorted(J[:, k].tolist())
        kept = values[trim : len(values) - trim]
        columns.append(sum(kept) / len(kept))
    return torch.tensor(columns, dtype=J.dtype)


def test_claimed_properties() -> None:
    check_claimed_properties(lambda: TrimmedMean(1), jacobians(min_m=3))


def test_degenerate_inputs() -> None:
    assert torch.equal(TrimmedMean(1)(torch.zeros(0, 5)), torch.zeros(5))
    assert TrimmedMean(1)(torch.zeros(3, 0)).shape == (0,)
    nan_matrix = torch.tensor([[1.0, float("nan")], [0.5, 2.0], [0.0, 1.0]])
    out = TrimmedMean(1)(nan_matrix)
    assert torch.isnan(out[1]) and float(out[0]) == 0.5  # the NaN column only


@settings(max_examples=30)
@given(st.integers(1, 9), st.integers(1, 6), st.integers(0, 4), st.integers(0, 2**31 - 1))
def test_matches_brute_force(m: int, n: int, trim: int, seed: int) -> None:
    trim = min(trim, (m - 1) // 2)
    J = torch.randn(m, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    torch.testing.assert_close(TrimmedMean(trim)(J), brute_force(J, trim))


@pytest.mark.parametrize(("trim", "m"), [(1, 5), (1, 40), (3, 33), (8, 40), (9, 40), (12, 30)])
def test_both_selection_paths_handle_ties_and_huge_outliers(trim: int, m: int) -> None:
    gen = torch.Generator().manual_seed(trim)
    J = torch.randint(-2, 3, (m, 6), generator=gen).double()  # many ties
    J[0, 0], J[1, 1] = 1e300, -1e300  # Byzantine rows must not cancel the others out
    torch.testing.assert_close(TrimmedMean(trim)(J), brute_force(J, trim))
    torch.testing.assert_close(TrimmedMean(trim)(torch.zeros(m, 3)), torch.zeros(3))


def test_no_trimming_is_the_mean() -> None:
    J = torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(TrimmedMean(0)(J), Mean()(J))


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"`trim_number` must be an int >= 0"):
        TrimmedMean(-1)
    with pytest.raises(ValueError, match=r"at least 2 \* trim_number \+ 1 = 5 rows, received 4"):
        TrimmedMean(2)(torch.ones(4, 3))


def test_repr_and_str() -> None:
    assert repr(TrimmedMean(2)) == "TrimmedMean(trim_number=2)"
    assert str(TrimmedMean(2)) == "TM2"


def test_device_and_dtype(device: str, dtype: torch.dtype) -> None:
    check_device_and_dtype(lambda: TrimmedMean(1), device, dtype)
