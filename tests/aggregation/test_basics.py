"""Mean, Sum and UPGrad: claimed properties, degenerate inputs, and the documented values."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from jacflow.aggregation import (
    Aggregator,
    GramianWeightedAggregator,
    Mean,
    MeanWeighting,
    Sum,
    UPGrad,
    UPGradWeighting,
    WeightedAggregator,
)
from jacflow.linalg import QuadprogProjector, TorchProjector
from jacflow.linalg._dual_cone import project_weights_reference
from tests.aggregation._properties import check_claimed_properties, check_degenerate_inputs

FACTORIES: list[Callable[[], Aggregator]] = [Mean, Sum, UPGrad]


@pytest.mark.parametrize("make", FACTORIES, ids=lambda f: f.__name__)
def test_claimed_properties(make: Callable[[], Aggregator]) -> None:
    check_claimed_properties(make)


@pytest.mark.parametrize("make", FACTORIES, ids=lambda f: f.__name__)
def test_degenerate_inputs(make: Callable[[], Aggregator]) -> None:
    check_degenerate_inputs(make)


def test_documented_values() -> None:
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    torch.testing.assert_close(
        UPGrad()(J), torch.tensor([0.2924, 1.9006, 1.9006]), atol=1e-4, rtol=0
    )
    torch.testing.assert_close(
        UPGradWeighting()(J @ J.T), torch.tensor([1.1111, 0.7895]), atol=1e-4, rtol=0
    )
    torch.testing.assert_close(Mean()(J), torch.tensor([1.0, 1.0, 1.0]))
    # TorchJD 0.18 normalises and regularises by 1e-4; the same settings give its numbers.
    torchjd_like = UPGrad(projector=QuadprogProjector())(J)
    torch.testing.assert_close(
        torchjd_like, torch.tensor([0.2929, 1.9004, 1.9004]), atol=1e-4, rtol=0
    )
    torch.testing.assert_close(Sum()(J), torch.tensor([2.0, 2.0, 2.0]))


def test_upgrad_matches_its_definition() -> None:
    """UPGrad = mean of the projections of each row onto the dual cone, checked by KKT."""
    torch.manual_seed(1)
    J = torch.randn(5, 7, dtype=torch.float64)
    G = J @ J.T
    V = project_weights_reference(
        torch.eye(5, dtype=torch.float64) / 5, G, norm_eps=0.0, reg_eps=0.0
    )
    for i in range(5):
        v = V[i]
        u = torch.eye(5, dtype=torch.float64)[i] / 5
        assert bool((v >= u - 1e-12).all())  # primal feasibility
        multipliers = 2 * G @ v  # stationarity: 2 G v = lambda, lambda >= 0
        assert bool((multipliers >= -1e-9).all())
        assert abs(float(multipliers @ (v - u))) < 1e-9  # complementary slackness
    expected = V.sum(0) @ J
    got = UPGrad()(J)
    torch.testing.assert_close(got, expected)


def test_aggregator_rejects_non_matrix() -> None:
    with pytest.raises(ValueError, match="2-D matrix"):
        UPGrad()(torch.ones(3))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        UPGrad()([[1.0]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="square Gramian"):
        UPGradWeighting()(torch.ones(2, 3))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_aggregators_and_weightings_reject_non_real_float_dtypes(dtype: torch.dtype) -> None:
    """Checked at the base classes' boundary: integer matrices gave raw torch errors or were
    aggregated in integer arithmetic, complex ones lost their imaginary part silently."""
    import jacflow.aggregation as aggregation

    matrix = torch.ones(2, 2, dtype=dtype)
    for aggregator in (aggregation.Mean(), aggregation.MGDA(), aggregation.PCD(), UPGrad()):
        with pytest.raises(TypeError, match=rf"`matrix`.*floating-point.*{dtype}"):
            aggregator(matrix)
    with pytest.raises(TypeError, match=rf"`gramian`.*floating-point.*{dtype}"):
        UPGradWeighting()(matrix)


def test_bad_hyperparameters() -> None:
    with pytest.raises(ValueError, match="norm_eps"):
        UPGrad(projector=TorchProjector(norm_eps=-1.0))
    with pytest.raises(TypeError, match="projector"):
        UPGrad(projector=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pref_vector"):
        UPGrad(pref_vector=torch.ones(2, 2))
    with pytest.raises(ValueError, match="one preference per objective"):
        UPGrad(pref_vector=torch.ones(3))(torch.ones(2, 2))
    with pytest.raises(TypeError, match="GramianWeighting"):
        GramianWeightedAggregator(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Weighting"):
        WeightedAggregator(object())  # type: ignore[arg-type]


def test_weighting_and_aggregator_agree() -> None:
    J = torch.randn(6, 9, dtype=torch.float64)
    torch.testing.assert_close(UPGrad()(J), UPGradWeighting()(J @ J.T) @ J)
    torch.testing.assert_close(GramianWeightedAggregator(MeanWeighting())(J), Mean()(J))


@given(
    st.floats(-1.0, 1.0),
    st.floats(0.0, 3.0),
    st.floats(-1.0, 2.0),
    st.floats(-1.0, 2.0),
    st.sampled_from([1e-6, 1.0, 1e6]),
    st.booleans(),
)
def test_two_objective_closed_form_matches_the_solver(
    cos: float, ratio: float, p1: float, p2: float, scale: float, zero_row: bool
) -> None:
    """The m = 2 closed form against the general solver on every kind of 2 x 2 Gramian.

    Per row ``u = p_i^+ e_i``: the closed form must be feasible (``v >= u``) and its objective
    ``v^T G v`` at most the solver's. For the projection onto a convex set this bounds the
    distance of the updates, ``|J^T (v - v*)|^2 <= v^T G v - v*^T G v*``, and it stays valid
    where the solver itself is inaccurate (``|g_2| = 1e-20 |g_1|``: the optimum has
    ``v_2 = 1e20``, beyond the solver's KKT tolerance).
    """
    from jacflow.aggregation._upgrad import two_objective_weights, two_objective_weights_on_host
    from jacflow.linalg import project_weights

    g11 = 0.0 if zero_row else 1.0
    g12 = cos * ratio * (g11**0.5)
    G = scale * torch.tensor([[g11, g12], [g12, ratio**2]], dtype=torch.float64)
    pref = torch.tensor([p1, p2], dtype=torch.float64)
    rows = torch.diag(pref.clamp(min=0))
    tol = 1e-12 * (float(G.trace()) + 1e-300) * (1 + float(pref.abs().max())) ** 2
    for u in rows:
        solver = project_weights(u, G)
        got = two_objective_weights(G, u)  # a row's own preference: only that row projects
        assert bool((got >= u).all())
        assert float(got @ G @ got) <= float(solver @ G @ solver) + tol
    torch.testing.assert_close(
        two_objective_weights(G, pref),
        two_objective_weights(G, rows[0]) + two_objective_weights(G, rows[1]),
        rtol=1e-12,
        atol=0.0,
    )
    # the CPU path in Python floats runs the same operations in the same order
    torch.testing.assert_close(
        two_objective_weights_on_host(G, pref), two_objective_weights(G, pref), rtol=0, atol=0
    )


@given(st.floats(-1.0, 1.0), st.floats(0.0, 3.0), st.sampled_from([torch.float32, torch.float64]))
def test_two_objective_default_preference_without_a_tensor(
    cos: float, ratio: float, dtype: torch.dtype
) -> None:
    """UPGradWeighting's default on the CPU (``pref=None``, no preference tensor) gives, in
    the Gramian's dtype, the bits of the preference ``(1/2, 1/2)`` given as a tensor; in
    float64 also those of the tensor form (float32 rounds the tensor form's steps)."""
    from jacflow.aggregation._upgrad import two_objective_weights, two_objective_weights_on_host

    G = torch.tensor([[1.0, cos * ratio], [cos * ratio, ratio**2]], dtype=dtype)
    half = torch.full((2,), 0.5, dtype=dtype)
    got = two_objective_weights_on_host(G, None)
    assert got.dtype == dtype
    torch.testing.assert_close(got, two_objective_weights_on_host(G, half), rtol=0, atol=0)
    torch.testing.assert_close(UPGradWeighting()(G), UPGradWeighting(half)(G), rtol=0, atol=0)
    if dtype == torch.float64:
        torch.testing.assert_close(got, two_objective_weights(G, half), rtol=0, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_two_objective_closed_form_propagates_nonfinite(bad: float) -> None:
    from jacflow.aggregation import UPGradWeighting
    from jacflow.aggregation._upgrad import two_objective_weights, two_objective_weights_on_host

    G = torch.tensor([[bad, -1.0], [-1.0, 2.0]])
    pref = torch.tensor([0.5, 0.5])
    assert bool(two_objective_weights_on_host(G, pref).isnan().all())
    assert bool(UPGradWeighting()(G).isnan().all())
    if bad != bad:  # NaN: the tensor form keeps it too (an infinity may give a finite ratio)
        assert bool(two_objective_weights(G, pref).isnan().any())


@pytest.mark.parametrize("m", [2, 3, 30])
def test_upgrad_weights_without_conflict_keep_their_graph(m: int) -> None:
    """A Gramian with no negative entry needs no projection (the weights are the preference);
    under autograd the weights still depend on ``G``, with zero gradient (the short cut
    returned the preference without a graph to ``G``, and ``backward()`` raised)."""
    gen = torch.Generator().manual_seed(m)
    j = torch.rand(m, 6, generator=gen, dtype=torch.float64)
    gramian = (j @ j.T).requires_grad_(True)
    weights = UPGradWeighting()(gramian)
    torch.testing.assert_close(weights, torch.full((m,), 1 / m, dtype=torch.float64))
    (weights * torch.arange(m)).sum().backward()
    assert gramian.grad is not None
    assert bool((gramian.grad == 0).all())


@pytest.mark.parametrize("m", [2, 3, 5])
def test_upgrad_short_cut_agrees_with_the_projections(m: int) -> None:
    """With no negative entry in ``G`` the weights skip the solver; a negative preference
    entry then gave ``pref`` itself. The short cut, the solver (``G`` tracked by autograd, or
    one entry a hair below 0) and the definition agree. (A NaN or infinite preference is
    refused at construction.)"""
    gen = torch.Generator().manual_seed(m)
    j = torch.rand(m, 6, generator=gen, dtype=torch.float64)
    j[0, :3], j[1, 3:] = 0.0, 0.0  # (G_01 = 0: the nudge below keeps the problem)
    gramian = j @ j.T
    pref = torch.linspace(0.5, -0.3, m, dtype=torch.float64)
    nudged = gramian.clone()
    nudged[0, 1] = nudged[1, 0] = -1e-300
    got = [
        UPGradWeighting(pref)(gramian),
        UPGradWeighting(pref)(gramian.clone().requires_grad_(True)).detach(),
        UPGradWeighting(pref)(nudged),
    ]
    expected = project_weights_reference(torch.diag(pref), gramian).sum(0)
    torch.testing.assert_close(expected, pref.clamp_min(0))
    for weights in got:
        torch.testing.assert_close(weights, expected)


def test_two_objective_gradient_at_a_zero_row_is_finite() -> None:
    """A zero row (a constant task) left every gradient NaN (the closed form's discarded
    quotient by 0), J = 0 too. Along the other row the update is smooth: central differences.
    (Along the zero row it has a kink: only finiteness is asserted there.)"""
    J = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]], dtype=torch.float64)
    tracked = J.clone().requires_grad_()
    (grad,) = torch.autograd.grad(UPGrad()(tracked).sum(), tracked)
    assert bool(torch.isfinite(grad).all())
    h = 1e-6
    for column in range(3):
        step = torch.zeros_like(J)
        step[1, column] = h
        expected = (UPGrad()(J + step).sum() - UPGrad()(J - step).sum()) / (2 * h)
        torch.testing.assert_close(grad[1, column], expected, rtol=1e-5, atol=1e-7)
    zero = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    (at_zero,) = torch.autograd.grad(UPGrad()(zero).sum(), zero)
    assert bool(torch.isfinite(at_zero).all())
