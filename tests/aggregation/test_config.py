"""ConFIG against the paper's formula computed with the pseudo-inverse of the unit rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from jacflow.aggregation import ConFIG
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    check_device_and_dtype,
    make_jacobian,
)


def paper_config(J: Tensor, pref: Tensor) -> Tensor:
    """Liu et al.: x = pinv(U) p with unit rows U, then (sum_i g_i . x_hat) x_hat."""
    units = J / J.norm(dim=1, keepdim=True)
    x = torch.linalg.pinv(units) @ pref
    if float(x.norm()) < 1e-9:  # e.g. opposite rows: no direction, the update is 0
        return torch.zeros_like(x)
    x_hat = x / x.norm()
    return (J @ x_hat).sum() * x_hat


def test_claimed_properties() -> None:
    check_claimed_properties(ConFIG)


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(ConFIG)


@settings(max_examples=30)
@given(
    st.integers(1, 6),
    st.integers(1, 9),
    st.integers(1, 6),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)
def test_matches_the_paper_formula(m: int, n: int, rank: int, seed: int, prefer: bool) -> None:
    J = make_jacobian(m, n, min(rank, m, n), 1.0, torch.float64, seed)
    pref = torch.arange(1, m + 1, dtype=torch.float64) if prefer else torch.ones(m, dtype=J.dtype)
    agg = ConFIG(pref_vector=pref if prefer else None)
    torch.testing.assert_close(
        agg(J), paper_config(J, pref), atol=1e-7 * float(J.norm()), rtol=1e-6
    )


@settings(max_examples=30)
@given(st.integers(1, 8), st.integers(0, 4), st.integers(0, 2**31 - 1))
def test_independent_rows_never_conflict(m: int, extra: int, seed: int) -> None:
    J = make_jacobian(m, m + extra, m, 1.0, torch.float64, seed)
    products = J @ ConFIG()(J)
    assert bool((products > 0).all())
    # Equal angles: the projections on the unit rows coincide.
    projections = products / J.norm(dim=1)
    torch.testing.assert_close(projections, projections[0].expand(m))


def test_documented_values() -> None:
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    torch.testing.assert_close(
        ConFIG()(J), torch.tensor([0.1588, 2.0706, 2.0706]), atol=1e-4, rtol=0
    )


def test_errors() -> None:
    with pytest.raises(ValueError, match="`pref_vector` must be a vector"):
        ConFIG(pref_vector=torch.ones(2, 2))
    with pytest.raises(ValueError, match="one preference per objective"):
        ConFIG(pref_vector=torch.ones(3))(torch.ones(2, 2))


def test_repr_and_str() -> None:
    assert repr(ConFIG()) == "ConFIG(pref_vector=None)"
    assert str(ConFIG()) == "ConFIG"


def test_device_and_dtype(device: str, dtype: torch.dtype) -> None:
    check_device_and_dtype(lambda: ConFIG(), device, dtype)
