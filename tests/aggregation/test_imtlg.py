"""IMTLG / IMTLGWeighting against the closed form of the IMTL paper."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import Tensor

from jacflow.aggregation import IMTLG, IMTLGWeighting
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    check_device_and_dtype,
    check_nonfinite_gramian_gives_nan,
    make_jacobian,
)


def paper_imtlg(J: Tensor) -> Tensor:
    """Liu et al. (2021), IMTL-G closed form: alpha_{2:} = g_1 U^T (D U^T)^{-1}."""
    units = J / J.norm(dim=1, keepdim=True)
    D = J[0] - J[1:]  # rows g_1 - g_i
    U = units[0] - units[1:]  # rows u_1 - u_i
    rest = J[0] @ U.T @ torch.linalg.inv(D @ U.T)
    alpha = torch.cat([(1 - rest.sum()).reshape(1), rest])
    return alpha @ J


def test_claimed_properties() -> None:
    check_claimed_properties(IMTLG)


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(IMTLG)


@settings(max_examples=30)
@given(st.integers(2, 6), st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_matches_the_paper_closed_form(m: int, extra: int, seed: int) -> None:
    J = make_jacobian(m, m + extra, m, 1.0, torch.float64, seed)
    expected = paper_imtlg(J)
    out = IMTLG()(J)
    torch.testing.assert_close(out, expected, atol=1e-6 * float(J.norm()), rtol=1e-6)
    # Equal projections on the unit gradients.
    projections = (J / J.norm(dim=1, keepdim=True)) @ out
    torch.testing.assert_close(projections, projections[0].expand(m), atol=1e-8, rtol=1e-6)


@settings(max_examples=40)
@given(st.integers(2, 6), st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_singular_gramians_match_the_paper_closed_form(m: int, extra: int, seed: int) -> None:
    """Rank m - 1: G is singular but the paper's system (D U^T) is not, so its closed form
    applies; G^+ n gave unequal projections or a blown-up update there (the sum of G^+ n is
    rounding noise when the rows are dependent)."""
    J = make_jacobian(m, m - 1 + extra, m - 1, 1.0, torch.float64, seed)
    units = J / J.norm(dim=1, keepdim=True)
    differences = J[0] - J[1:]
    system = differences @ (units[0] - units[1:]).T
    # (rows of one direction make u_1 - u_i vanish: the paper's system is then singular)
    assume(float(torch.linalg.svdvals(system).min()) > 1e-6 * float(differences.norm()))
    expected = paper_imtlg(J)
    out = IMTLG()(J)
    torch.testing.assert_close(out, expected, atol=1e-6 * float(J.norm()), rtol=1e-6)
    projections = units @ out
    torch.testing.assert_close(projections, projections[0].expand(m), atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_summing_to_zero_give_zero(dtype: torch.dtype) -> None:
    """Four rows in R^3 that sum to zero: the only combination of sum 1 with equal projections
    is the mean, whose update is zero (the pseudo-inverse form gave updates of 1e5-1e13)."""
    J = torch.randn(4, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    J[-1] = -J[:-1].sum(dim=0)
    weights = IMTLGWeighting()(J @ J.T)
    torch.testing.assert_close(weights, torch.full((4,), 0.25, dtype=torch.float64))
    out = IMTLG()(J.to(dtype))
    torch.testing.assert_close(out, torch.zeros(3, dtype=dtype), atol=1e-5, rtol=0)


def test_opposite_rows_of_unequal_norms_give_zero() -> None:
    """g_2 = -3 g_1: weights (3/4, 1/4) make the update zero (the pseudo-inverse form gave
    -5 g_1, against which g_1 conflicts)."""
    J = torch.tensor([[1.0, 2.0], [-3.0, -6.0]], dtype=torch.float64)
    torch.testing.assert_close(IMTLGWeighting()(J @ J.T), torch.tensor([0.75, 0.25]).double())
    torch.testing.assert_close(IMTLG()(J), torch.zeros(2, dtype=torch.float64))


def test_zero_rows_get_no_weight() -> None:
    """A zero row has no direction: it takes no part in the equal projections."""
    J = torch.tensor([[0.0, 0.0], [2.0, 1.0], [-1.0, 3.0]], dtype=torch.float64)
    expected = torch.cat([torch.zeros(1).double(), IMTLGWeighting()(J[1:] @ J[1:].T)])
    torch.testing.assert_close(IMTLGWeighting()(J @ J.T), expected)


def test_zero_matrix_gives_zero() -> None:
    assert torch.equal(IMTLG()(torch.zeros(3, 4)), torch.zeros(4))


def test_opposite_rows_give_zero() -> None:
    g = torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)
    torch.testing.assert_close(IMTLG()(torch.stack([g, -g])), torch.zeros(3, dtype=torch.float64))


def test_documented_values() -> None:
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    torch.testing.assert_close(IMTLG()(J), torch.tensor([0.0767, 1.0, 1.0]), atol=1e-4, rtol=0)


def test_weighting_and_aggregator_agree() -> None:
    J = torch.randn(5, 8, dtype=torch.float64)
    torch.testing.assert_close(IMTLG()(J), IMTLGWeighting()(J @ J.T) @ J)


def test_repr_and_str() -> None:
    assert repr(IMTLG()) == "IMTLG()"
    assert str(IMTLG()) == "IMTLG"


def test_device_and_dtype(device: str, dtype: torch.dtype) -> None:
    check_device_and_dtype(lambda: IMTLG(), device, dtype)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gramian_gives_nan_weights(bad: float) -> None:
    check_nonfinite_gramian_gives_nan(lambda: IMTLGWeighting(), bad)


def _closed_form(J: Tensor) -> Tensor:
    """w = G^{-1} n / 1^T G^{-1} n in float64 numpy (invertible G), the update J^T w."""
    rows = J.double().numpy()
    gramian = rows @ rows.T
    u = np.linalg.solve(gramian, np.sqrt(np.diag(gramian)))
    return torch.from_numpy(rows.T @ (u / u.sum()))


@pytest.mark.parametrize(
    ("dtype", "small"), [(torch.float32, 1e-4), (torch.float32, 1e-5), (torch.float64, 1e-8)]
)
def test_a_short_row_is_not_a_zero_row(dtype: torch.dtype, small: float) -> None:
    """J = diag(1, small, 1): G is invertible, and the update has the projection
    small / (1 + 2 small) on every unit gradient. The zero-row test was on the squared norm
    relative to the trace, so such a row (1e-4 in float32, 1e-8 in float64) got weight 0 and
    the update had projection 0 on it."""
    J = torch.diag(torch.tensor([1.0, small, 1.0], dtype=dtype))
    out = IMTLG()(J)
    expected = _closed_form(J)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=0)
    assert torch.all(out > 0)


def test_a_short_row_keeps_equal_projections_in_float32() -> None:
    """Random rows, one 1e-4 times shorter, in float32: the update conflicted with it
    (cosine -0.66 against equal cosines of 0.23 in float64)."""
    J = torch.randn(3, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    J[1] *= 1e-4
    out = IMTLG()(J.float()).double()
    cosines = (J / J.norm(dim=1, keepdim=True)) @ out / out.norm()
    torch.testing.assert_close(cosines, cosines[0].expand(3), atol=1e-4, rtol=0)
    torch.testing.assert_close(out, _closed_form(J.float()), rtol=1e-4, atol=0)


@settings(max_examples=40)
@given(
    st.integers(2, 5),
    st.integers(0, 3),
    st.floats(0.0, 6.0),
    st.sampled_from([torch.float32, torch.float64]),
    st.integers(0, 2**31 - 1),
)
def test_equal_projections_for_row_norms_spread_over_decades(
    m: int, extra: int, decades: float, dtype: torch.dtype, seed: int
) -> None:
    """Invertible G with row norms spread over up to 1e6 (1e3 in float32, whose Gramian
    keeps about 7 digits): the update has equal projections on the unit gradients, those
    of the closed form, computed in float64 from the same rows."""
    decades = decades if dtype == torch.float64 else decades / 2
    generator = torch.Generator().manual_seed(seed)
    J = torch.randn(m, m + extra, generator=generator, dtype=torch.float64)
    J = J * torch.logspace(0, -decades, m, dtype=torch.float64)[:, None]
    J = J.to(dtype)
    units = J.double() / J.double().norm(dim=1, keepdim=True)
    assume(float(torch.linalg.svdvals(units).min()) > 1e-2)  # (well-posed in both dtypes)
    expected = units @ _closed_form(J)
    projections = units @ IMTLG()(J).double()
    tolerance = 1e-9 if dtype == torch.float64 else 1e-3
    torch.testing.assert_close(projections, expected, rtol=tolerance, atol=0)
