"""ConFIG against the paper's formula computed with the pseudo-inverse of the unit rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
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


def _reference(J: Tensor) -> np.ndarray:
    """ConFIG's definition in float64 numpy: x = pinv(U) 1, (sum_i g_i . x_hat) x_hat."""
    rows = J.double().numpy()
    x = np.linalg.pinv(rows / np.linalg.norm(rows, axis=1, keepdims=True)) @ np.ones(len(rows))
    x_hat = x / np.linalg.norm(x)
    return (rows @ x_hat).sum() * x_hat


@pytest.mark.parametrize("theta", [1e-2, 3e-3, 1e-3, 3e-4])
def test_nearly_parallel_rows_in_float32_match_the_float64_definition(theta: float) -> None:
    """Two rows theta rad apart and a third: the float32 unit Gramian has an eigenvalue about
    theta^2, which pinv's float32 cut-off dropped below 1e-3 rad (10% error, and a wrong sign
    at 3e-3). The float32 result must match the definition to float32 precision."""
    J = torch.tensor(
        [[1.0, 0.0, 0.0], [np.cos(theta), np.sin(theta), 0.0], [0.5, 0.2, 1.0]],
        dtype=torch.float32,
    )
    expected = _reference(J)
    out = ConFIG()(J).double().numpy()
    assert np.linalg.norm(out - expected) <= 1e-4 * np.linalg.norm(expected)
    assert np.sign(out[1]) == np.sign(expected[1])


@settings(max_examples=30)
@given(st.integers(2, 5), st.integers(0, 3), st.floats(1e-3, 1e-1), st.integers(0, 2**31 - 1))
def test_float32_matches_the_float64_definition(
    m: int, extra: int, spread: float, seed: int
) -> None:
    """Independent rows close to one direction (angles about ``spread``) in float32."""
    generator = torch.Generator().manual_seed(seed)
    n = m + extra
    base = torch.randn(n, generator=generator, dtype=torch.float64)
    J = (base + spread * base.norm() * torch.randn(m, n, generator=generator).double()).float()
    units = J.double() / J.double().norm(dim=1, keepdim=True)
    condition = torch.linalg.svdvals(units)
    assume(float(condition.min()) > 1e-2 * spread)  # (independent at float32 precision)
    expected = _reference(J)
    out = ConFIG()(J).double().numpy()
    assert np.linalg.norm(out - expected) <= 1e-3 * np.linalg.norm(expected)
