"""CAGrad: claimed properties, TorchJD's value, and optimality certified by strong duality."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from jacflow.aggregation import CAGrad, CAGradWeighting, Mean
from jacflow.aggregation._cagrad import _hull_weights
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    check_non_conflicting,
    jacobians,
    make_jacobian,
)

J_DOC = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])


def test_claimed_properties() -> None:
    check_claimed_properties(lambda: CAGrad(c=0.5), jacobians(max_m=12))


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(lambda: CAGrad(c=0.5))


@settings(max_examples=20)
@given(jacobians(max_m=12), st.sampled_from([1.0, 2.0, 10.0]))
def test_non_conflicting_when_c_at_least_one(matrix: Tensor, c: float) -> None:
    check_non_conflicting(lambda: CAGrad(c=c), matrix)


def test_documented_value() -> None:
    torch.testing.assert_close(
        CAGrad(c=0.5)(J_DOC), torch.tensor([0.1835, 1.2041, 1.2041]), atol=1e-4, rtol=0
    )


@settings(max_examples=40)
@given(
    st.integers(1, 10),
    st.integers(1, 12),
    st.integers(0, 2**31 - 1),
    st.floats(0.05, 3.0),
    st.sampled_from([1e-3, 1.0, 1e3]),
)
def test_strong_duality_certifies_optimality(
    m: int, n: int, seed: int, c: float, scale: float
) -> None:
    """The primal max_{||d-g0|| <= c||g0||} min_i g_i.d equals the dual value at our weights.

    By weak duality, min_i g_i.d <= g_w.g0 + c||g0|| ||g_w|| for every feasible d and every w in
    the simplex; equality at our (d, w) proves that both are optimal, with no solver involved.
    """
    gen = torch.Generator().manual_seed(seed)
    J = make_jacobian(m, n, min(m, n), scale, torch.float64, seed)
    J = J + scale * torch.randn(n, generator=gen, dtype=torch.float64)  # a non-zero mean
    G = J @ J.T
    g0 = J.mean(dim=0)
    radius = c * float(g0.norm())
    w = _hull_weights(G / G.trace(), c * math.sqrt(float(g0 @ g0) / float(G.trace())))
    g_w = w @ J
    d = CAGrad(c=c, norm_eps=0.0)(J)
    if float(d.norm()) == 0.0:
        # Only when x* = 0 up to float64 resolution (Pareto-stationary point inside the ball).
        assert float(g_w.norm()) <= 3e-7 * math.sqrt(float(G.diagonal().max()))
        return
    tol = 1e-7 * float(J.norm()) ** 2
    assert float((d - g0).norm()) <= radius * (1 + 1e-9) + 1e-12 * scale  # primal feasible
    assert bool((w >= 0).all()) and abs(float(w.sum()) - 1) < 1e-12  # dual feasible
    primal = float((J @ d).min())
    dual = float(g_w @ g0) + radius * float(g_w.norm())
    assert abs(primal - dual) <= tol, (primal, dual)


def test_matches_scipy_on_a_generic_problem() -> None:
    """An independent generic solver (SLSQP on the primal) finds the same update."""
    np = pytest.importorskip("numpy")
    scipy_optimize = pytest.importorskip("scipy.optimize")
    torch.manual_seed(3)
    J = torch.randn(4, 6, dtype=torch.float64) + torch.randn(6, dtype=torch.float64)
    c = 0.7
    A, g0 = J.numpy(), J.mean(dim=0).numpy()
    r = c * np.linalg.norm(g0)
    constraints = [
        {"type": "ineq", "fun": lambda z: A @ z[:-1] - z[-1]},
        {"type": "ineq", "fun": lambda z: r**2 - np.sum((z[:-1] - g0) ** 2)},
    ]
    z0 = np.concatenate([g0, [float((A @ g0).min())]])
    result = scipy_optimize.minimize(
        lambda z: -z[-1],
        z0,
        constraints=constraints,
        method="SLSQP",
        options={"ftol": 1e-14, "maxiter": 1000},
    )
    assert result.success
    torch.testing.assert_close(CAGrad(c=c)(J), torch.from_numpy(result.x[:-1]), atol=1e-6, rtol=0)


def test_c_zero_is_the_mean_and_rescale_divides() -> None:
    torch.manual_seed(0)
    J = torch.randn(5, 7, dtype=torch.float64)
    torch.testing.assert_close(CAGrad(c=0.0)(J), Mean()(J))
    c = 0.8
    base = CAGrad(c=c)(J)
    torch.testing.assert_close(CAGrad(c=c, rescale=1)(J), base / (1 + c**2))
    torch.testing.assert_close(CAGrad(c=c, rescale=2)(J), base / (1 + c))


def test_scale_invariant_weights_and_dtypes(device: str, dtype: torch.dtype) -> None:
    G = (J_DOC @ J_DOC.T).to(device=device, dtype=dtype)
    w = CAGradWeighting(c=0.5)(G)
    assert w.device == G.device and w.dtype == dtype
    torch.testing.assert_close(CAGradWeighting(c=0.5)(G * 1e-8), w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        w @ J_DOC.to(device=device, dtype=dtype),
        CAGrad(c=0.5)(J_DOC.to(device=device, dtype=dtype)),
    )


def test_errors_and_repr() -> None:
    with pytest.raises(ValueError, match="`c` must be a float in"):
        CAGrad(c=-0.1)
    with pytest.raises(TypeError, match="`c`"):
        CAGrad(c="big")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="norm_eps"):
        CAGradWeighting(c=0.5, norm_eps=-1.0)
    with pytest.raises(ValueError, match="rescale"):
        CAGrad(c=0.5, rescale=3)
    with pytest.raises(ValueError, match="square Gramian"):
        CAGradWeighting(c=0.5)(torch.ones(2, 3))
    assert repr(CAGrad(c=0.5)) == "CAGrad(c=0.5, norm_eps=0.0001, rescale=0)"
    assert str(CAGrad(c=0.5)) == "CAGrad0.5"
    assert str(CAGrad(c=1)) == "CAGrad1"


def _two_row_reference(J: Tensor, c: float) -> Tensor:
    """CAGrad's update for two rows in float64 from the rows themselves: the dual over the
    segment ``g(t) = (1 - t) g_1 + t g_2`` is convex in ``t``, minimised by bounded Brent."""
    scipy_optimize = pytest.importorskip("scipy.optimize")
    rows = J.double()
    g0 = rows.mean(dim=0)
    s = c * float(g0.norm())

    def point(t: float) -> Tensor:
        return (1 - t) * rows[0] + t * rows[1]

    def dual(t: float) -> float:
        return float(point(t) @ g0) + s * float(point(t).norm())

    found = scipy_optimize.minimize_scalar(
        dual, bounds=(0.0, 1.0), method="bounded", options={"xatol": 1e-14}
    )
    t = min([0.0, 1.0, float(found.x)], key=dual)
    return g0 + s * point(t) / point(t).norm()


@pytest.mark.parametrize(
    ("dtype", "small", "c", "norm_eps"),
    [
        (torch.float32, 1e-3, 0.5, 1e-4),
        (torch.float32, 1e-3, 0.5, 0.0),
        (torch.float32, 1e-3, 2.0, 0.0),
        (torch.float32, 3e-3, 2.0, 0.0),
        (torch.float64, 1e-7, 0.5, 0.0),
        (torch.float64, 1e-7, 2.0, 0.0),
    ],
)
def test_rows_of_very_different_norms_are_not_taken_as_stationary(
    dtype: torch.dtype, small: float, c: float, norm_eps: float
) -> None:
    """Orthogonal rows (0 is not in their hull) 1e3 apart in float32, 1e7 in float64: the
    update was 0, from a rounding floor relative to the largest row (and an eigensolver error
    of that size) where the point x* is supported by the short row only."""
    J = torch.tensor([[1.0, 0.0], [0.0, small]], dtype=dtype)
    expected = _two_row_reference(J, c).to(dtype)
    torch.testing.assert_close(CAGrad(c, norm_eps)(J), expected, rtol=1e-4, atol=0)


@settings(max_examples=60, deadline=None)
@given(
    st.floats(-4.0, 0.0),
    st.floats(0.0, 2.5),
    st.floats(0.1, 2.5),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_two_rows_match_the_dual_on_their_segment(
    log_ratio: float, angle: float, c: float, dtype: torch.dtype
) -> None:
    """Two rows at an angle below 2.5 rad (0 outside their hull) with norms up to 1e4 apart: the
    update is that of the dual minimised in float64 on the rows (to 1e-4 relative: the
    Gramian's rounding, amplified near stationarity; the update was 0 in float32)."""
    J = torch.tensor(
        [[1.0, 0.0], [10**log_ratio * math.cos(angle), 10**log_ratio * math.sin(angle)]],
        dtype=dtype,
    )
    expected = _two_row_reference(J, c)
    out = CAGrad(c, norm_eps=0.0)(J).double()
    tol = 1e-4 * float(expected.norm())
    assert float((out - expected).norm()) <= tol, (out, expected)
