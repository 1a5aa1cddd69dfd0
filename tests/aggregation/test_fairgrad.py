"""FairGrad: properties, the fixed point G w = w^(-1/alpha), TorchJD's value and scipy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import least_squares

from jacflow.aggregation import FairGrad, FairGradWeighting, Mean
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    check_non_conflicting,
    check_permutation_invariant,
    jacobians,
    make_jacobian,
)

J_DOC = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])


@pytest.mark.parametrize("alpha", [0.5, 1.0, 3.0])
def test_claimed_properties(alpha: float) -> None:
    check_claimed_properties(lambda: FairGrad(alpha=alpha), jacobians(max_m=16))


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(lambda: FairGrad(alpha=1.0))


@settings(max_examples=30)
@given(
    st.integers(1, 10),
    st.integers(0, 2**31 - 1),
    st.sampled_from([0.25, 1.0, 2.0, 10.0]),
    st.sampled_from([1e-3, 1.0, 1e3]),
)
def test_fixed_point_and_scipy(m: int, seed: int, alpha: float, scale: float) -> None:
    J = make_jacobian(m, m + 2, m, scale, torch.float64, seed)  # full row rank: a solution exists
    G = J @ J.T
    w = FairGradWeighting(alpha=alpha)(G)
    assert bool((w > 0).all())
    torch.testing.assert_close(
        G @ w * w ** (1 / alpha), torch.ones(m, dtype=torch.float64), atol=1e-8, rtol=0
    )
    fit = least_squares(
        lambda x: (G.numpy() @ x) * x ** (1 / alpha) - 1,
        w.numpy() * 1.5,
        bounds=(0, np.inf),
        xtol=1e-15,
        ftol=1e-15,
        gtol=1e-15,
    )
    # The positive solution is unique, so a converged scipy fit must agree. scipy can stop
    # far from it (m=9, seed=14, alpha=10, scale=1e3: its residual is 1e-2, ours 3e-11);
    # the residual certificate above holds in every case.
    if float(np.abs(fit.fun).max()) <= 1e-9:
        np.testing.assert_allclose(w.numpy(), fit.x, rtol=1e-6)


@settings(max_examples=20)
@given(
    st.integers(1, 10),
    st.integers(0, 2**31 - 1),
    st.sampled_from([0.5, 1.0, 4.0]),
    st.sampled_from([torch.float32, torch.float64]),
)
def test_non_conflicting_and_permutation_invariant_where_a_solution_exists(
    m: int, seed: int, alpha: float, dtype: torch.dtype
) -> None:
    J = make_jacobian(m, m + 3, m, 1.0, dtype, seed)  # full row rank: a solution exists
    check_non_conflicting(lambda: FairGrad(alpha=alpha), J)
    check_permutation_invariant(lambda: FairGrad(alpha=alpha), J, seed)


def test_documented_value_and_alpha_zero() -> None:
    torch.testing.assert_close(
        FairGrad(alpha=1.0)(J_DOC), torch.tensor([0.0766, 0.9985, 0.9985]), atol=1e-4, rtol=0
    )
    torch.manual_seed(0)
    J = torch.randn(4, 5)
    torch.testing.assert_close(FairGrad(alpha=0.0)(J), Mean()(J))


def test_aggregator_and_weighting_agree(device: str, dtype: torch.dtype) -> None:
    J = J_DOC.to(device=device, dtype=dtype)
    weights = FairGradWeighting(alpha=2.0)(J @ J.T)
    assert weights.device == J.device and weights.dtype == dtype
    torch.testing.assert_close(FairGrad(alpha=2.0)(J), weights @ J)


def test_max_iters_caps_the_solver() -> None:
    torch.manual_seed(0)
    J = torch.randn(6, 8, dtype=torch.float64)
    G = J @ J.T
    capped = FairGradWeighting(alpha=1.0, max_iters=1)(G)
    converged = FairGradWeighting(alpha=1.0)(G)
    assert not torch.allclose(capped, converged)


def test_errors_and_repr() -> None:
    with pytest.raises(ValueError, match="`alpha` must be a float in"):
        FairGrad(alpha=-1.0)
    with pytest.raises(ValueError, match="max_iters"):
        FairGrad(alpha=1.0, max_iters=0)
    with pytest.raises(ValueError, match="square Gramian"):
        FairGradWeighting(alpha=1.0)(torch.ones(2, 3))
    assert repr(FairGrad(alpha=1.0)) == "FairGrad(alpha=1.0, max_iters=None)"
    assert str(FairGrad(alpha=1.0)) == "1.0-FairGrad"  # (TorchJD's label)


def test_label_shows_alpha_as_given() -> None:
    """``2-FairGrad`` for ``alpha=2`` (TorchJD's label; it was ``2.0-FairGrad``), ``0.5`` and
    ``2.0`` as they are, also after an assignment; the weights do not depend on the type."""
    assert str(FairGrad(alpha=2)) == "2-FairGrad"
    assert str(FairGradWeighting(alpha=2)) == "2-FairGrad"
    assert repr(FairGrad(alpha=2)) == "FairGrad(alpha=2, max_iters=None)"
    assert str(FairGrad(alpha=2.0)) == "2.0-FairGrad"
    assert str(FairGrad(alpha=0.5)) == "0.5-FairGrad"
    aggregator = FairGrad(alpha=0.5)
    aggregator.alpha = 3
    assert str(aggregator) == "3-FairGrad"
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    assert torch.equal(FairGrad(alpha=2)(J), FairGrad(alpha=2.0)(J))
    assert torch.equal(FairGrad(alpha=0)(J), FairGrad(alpha=0.0)(J))
    with pytest.raises(TypeError, match="`alpha` must be a float"):
        FairGrad(alpha=True)
