"""AlignedMTL / AlignedMTLWeighting against the SVD form of the paper."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from jacflow.aggregation import AlignedMTL, AlignedMTLWeighting
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    check_device_and_dtype,
    check_nonfinite_gramian_gives_nan,
    make_jacobian,
)


def svd_aligned(J: Tensor, pref: Tensor, mode: str) -> Tensor:
    """Senushkin et al.: J = U S V^T, aligned rows s U V^T, update (s U V^T)^T p."""
    left, singular, right = torch.linalg.svd(J, full_matrices=False)
    keep = singular > singular.max() * 1e-10
    left, singular, right = left[:, keep], singular[keep], right[keep]
    scale = {
        "min": singular.min(),
        "median": singular.median(),
        "rmse": singular.square().mean().sqrt(),
    }[mode]
    return scale * (left @ right).T @ pref


def test_claimed_properties() -> None:
    check_claimed_properties(AlignedMTL)


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(AlignedMTL)


@settings(max_examples=30)
@given(
    st.integers(1, 6),
    st.integers(1, 9),
    st.integers(1, 6),
    st.sampled_from(["min", "median", "rmse"]),
    st.integers(0, 2**31 - 1),
)
def test_matches_the_svd_form(m: int, n: int, rank: int, mode: str, seed: int) -> None:
    J = make_jacobian(m, n, min(rank, m, n), 1.0, torch.float64, seed)
    pref = torch.rand(m, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    out = AlignedMTL(pref_vector=pref, scale_mode=mode)(J)  # type: ignore[arg-type]
    torch.testing.assert_close(out, svd_aligned(J, pref, mode), atol=1e-7, rtol=1e-6)


def test_documented_values() -> None:
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    torch.testing.assert_close(
        AlignedMTL()(J), torch.tensor([0.2133, 0.9673, 0.9673]), atol=1e-4, rtol=0
    )
    torch.testing.assert_close(
        AlignedMTL(scale_mode="rmse")(J), torch.tensor([0.5764, 2.6142, 2.6142]), atol=1e-4, rtol=0
    )


def test_zero_matrix_gives_zero() -> None:
    assert torch.equal(AlignedMTL()(torch.zeros(3, 4)), torch.zeros(4))


def test_weighting_and_aggregator_agree() -> None:
    J = torch.randn(5, 8, dtype=torch.float64)
    torch.testing.assert_close(
        AlignedMTL(scale_mode="median")(J), AlignedMTLWeighting(scale_mode="median")(J @ J.T) @ J
    )


def test_errors() -> None:
    with pytest.raises(
        ValueError, match=r"`scale_mode` must be one of \('min', 'median', 'rmse'\)"
    ):
        AlignedMTL(scale_mode="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`pref_vector` must be a vector"):
        AlignedMTLWeighting(pref_vector=torch.ones(1, 2))


def test_repr_and_str() -> None:
    assert repr(AlignedMTL()) == "AlignedMTL(pref_vector=None, scale_mode='min')"
    assert str(AlignedMTL()) == "AlignedMTL"


def test_device_and_dtype(device: str, dtype: torch.dtype) -> None:
    check_device_and_dtype(lambda: AlignedMTL(), device, dtype)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gramian_gives_nan_weights(bad: float) -> None:
    check_nonfinite_gramian_gives_nan(lambda: AlignedMTLWeighting(), bad)
