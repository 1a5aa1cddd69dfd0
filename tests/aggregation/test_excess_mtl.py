"""ExcessMTL: properties, an independent re-implementation of the paper's update, warm-up, reset."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from jacflow.aggregation import ExcessMTL, ExcessMTLWeighting
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    jacobians,
)
from tests.aggregation._seeded import seeded

J_DOC = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])


def _reference(mats: list[Tensor], step: float, warmup: int) -> list[list[float]]:
    """Eqs. 6-7 and 9 of the paper in pure Python (weights start at 1/m, as in the paper)."""
    m, n = mats[0].shape
    sq_sum = [[0.0] * n for _ in range(m)]
    weights = [1.0 / m] * m
    warm = [0.0] * m
    baseline: list[float] | None = None
    outputs = []
    for t, J in enumerate(mats, start=1):
        rows = J.tolist()
        risks = []
        for i in range(m):
            risk = 0.0
            for k in range(n):
                sq_sum[i][k] += rows[i][k] ** 2
                risk += rows[i][k] ** 2 / math.sqrt(sq_sum[i][k] + 1e-7)
            risks.append(risk)
        if t <= warmup:
            warm = [warm[i] + risks[i] for i in range(m)]
            outputs.append(list(weights))
            continue
        if baseline is None:
            baseline = [w / warmup for w in warm] if warmup else risks
            if warmup:
                risks = [risks[i] / (baseline[i] + 1e-7) for i in range(m)]
        else:
            risks = [risks[i] / (baseline[i] + 1e-7) for i in range(m)]
        # w_i exp(step r_i), normalised; shifted by the largest exponent (the same ratios) so
        # that a tiny baseline cannot overflow exp
        exponents = [
            math.log(weights[i]) + step * risks[i] if weights[i] > 0 else -math.inf
            for i in range(m)
        ]
        top = max(exponents)
        unnormalized = [math.exp(e - top) for e in exponents]
        weights = [u / sum(unnormalized) for u in unnormalized]
        outputs.append(list(weights))
    return outputs


def test_claimed_properties() -> None:
    check_claimed_properties(seeded(ExcessMTL, reset=True), jacobians(max_m=16))


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(ExcessMTL)


@settings(max_examples=20)
@given(
    st.integers(1, 5),
    st.integers(1, 6),
    st.integers(0, 2**31 - 1),
    st.floats(0.1, 2.0),
    st.integers(0, 2),
)
def test_matches_reference_over_several_calls(
    m: int, n: int, seed: int, step: float, warmup: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    mats = [torch.randn(m, n, generator=gen, dtype=torch.float64) for _ in range(5)]
    weighting = ExcessMTLWeighting(robust_step_size=step, n_warmup_steps=warmup)
    for J, expected in zip(mats, _reference(mats, step, warmup)):
        torch.testing.assert_close(weighting(J), torch.tensor(expected, dtype=torch.float64))


def _official(mats: list[Tensor], step: float) -> list[list[float]]:
    """The rule of the official code (and LibMTL's ExcessMTL), written out: weights 1 each, the
    first call stores the excess risks as the baseline and keeps the weights; later calls
    multiply them by exp(step * E / E0) and rescale them to sum to m. Returned divided by m,
    with jacflow's one change: 1e-7 added to E0 (a zero baseline would divide by zero)."""
    m, n = mats[0].shape
    sq_sum = [[0.0] * n for _ in range(m)]
    weights = [1.0] * m
    baseline: list[float] | None = None
    outputs = []
    for J in mats:
        rows = J.tolist()
        risks = []
        for i in range(m):
            for k in range(n):
                sq_sum[i][k] += rows[i][k] ** 2
            risks.append(sum(rows[i][k] ** 2 / math.sqrt(sq_sum[i][k] + 1e-7) for k in range(n)))
        if baseline is None:
            baseline = risks
        else:
            # (the product and rescaling in log space: exp of a large ratio would overflow)
            logs = [
                (math.log(weights[i]) if weights[i] > 0 else -math.inf)
                + step * risks[i] / (baseline[i] + 1e-7)
                for i in range(m)
            ]
            weights = [math.exp(x - max(logs)) for x in logs]
            weights = [m * w / sum(weights) for w in weights]
        outputs.append([w / m for w in weights])
    return outputs


@settings(max_examples=20)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31 - 1), st.floats(0.1, 2.0))
def test_default_matches_the_official_first_step(m: int, n: int, seed: int, step: float) -> None:
    """The default used to take a step on the first call with the raw excess risks (weights
    [0.0005, 0.9995] at once on a random 2 x 50 Jacobian); the official code keeps them uniform
    while it records the baseline."""
    gen = torch.Generator().manual_seed(seed)
    mats = [2 * torch.randn(m, n, generator=gen, dtype=torch.float64) for _ in range(4)]
    weighting = ExcessMTLWeighting(robust_step_size=step)
    for J, expected in zip(mats, _official(mats, step)):
        torch.testing.assert_close(weighting(J), torch.tensor(expected, dtype=torch.float64))


def test_zero_warmup_is_torchjd_default() -> None:
    tj = pytest.importorskip("torchjd.aggregation")
    gen = torch.Generator().manual_seed(0)
    mats = [2 * torch.randn(2, 50, generator=gen, dtype=torch.float64) for _ in range(4)]
    ours, theirs = ExcessMTLWeighting(n_warmup_steps=0), tj.ExcessMTLWeighting()
    for J in mats:
        torch.testing.assert_close(ours(J), theirs(J))


def test_documented_value_and_reset() -> None:
    aggregator = ExcessMTL()
    first = aggregator(J_DOC)
    torch.testing.assert_close(first, torch.tensor([1.0, 1.0, 1.0]))
    second = aggregator(J_DOC * torch.tensor([[2.0], [1.0]]))
    torch.testing.assert_close(second, torch.tensor([-4.4555, 1.7468, 1.7468]), atol=1e-4, rtol=0)
    aggregator(J_DOC * 2)
    aggregator.reset()
    torch.testing.assert_close(aggregator(J_DOC), first)


def test_warmup_keeps_uniform_weights_and_shape_change_restarts() -> None:
    weighting = ExcessMTLWeighting(n_warmup_steps=2)
    for _ in range(2):
        torch.testing.assert_close(weighting(J_DOC), torch.tensor([0.5, 0.5]))
    # Row 0's excess risk grows relative to its warm-up baseline: its weight goes up.
    after = weighting(J_DOC * torch.tensor([[3.0], [1.0]]))
    assert float(after[0]) > 0.5 > float(after[1])
    # A Jacobian of another shape starts a new history (and its warm-up).
    torch.testing.assert_close(weighting(torch.ones(3, 2)), torch.full((3,), 1 / 3))


def test_nan_does_not_corrupt_the_state(device: str, dtype: torch.dtype) -> None:
    J = J_DOC.to(device=device, dtype=dtype)
    weighting = ExcessMTLWeighting()
    nan = torch.full_like(J, float("nan"))
    assert bool(weighting(nan).isnan().all())
    fresh = ExcessMTLWeighting()
    for K in (J, J * torch.tensor([[2.0], [1.0]], device=device, dtype=dtype)):
        w = weighting(K)
        assert w.device == J.device and w.dtype == dtype
        torch.testing.assert_close(w, fresh(K))


def test_errors_and_repr() -> None:
    with pytest.raises(ValueError, match="robust_step_size"):
        ExcessMTL(robust_step_size=0.0)
    with pytest.raises(ValueError, match="n_warmup_steps"):
        ExcessMTLWeighting(n_warmup_steps=-1)
    with pytest.raises(TypeError, match="n_warmup_steps"):
        ExcessMTL(n_warmup_steps=1.5)  # type: ignore[arg-type]
    assert repr(ExcessMTL()) == "ExcessMTL(robust_step_size=1.0, n_warmup_steps=1)"
    assert str(ExcessMTL()) == "ExcessMTL"


def test_a_state_dict_kept_in_memory_is_a_snapshot() -> None:
    """Its running sum of squares was the live tensor, which later calls updated in place,
    while its call counter stayed: resuming from it gave another step than the original's."""
    generator = torch.Generator().manual_seed(0)
    jacobians = [torch.randn(2, 3, generator=generator) for _ in range(5)]
    original = ExcessMTL()
    for J in jacobians[:3]:
        original(J)
    checkpoint = original.state_dict()
    expected = original(jacobians[3])
    original(jacobians[4])
    resumed = ExcessMTL()
    resumed.load_state_dict(checkpoint)
    torch.testing.assert_close(resumed(jacobians[3]), expected, rtol=0, atol=0)


@pytest.mark.parametrize("n_warmup_steps", [0, 1])
def test_float32_entries_whose_squares_overflow(n_warmup_steps: int) -> None:
    """Finite float32 entries of about 1e20 square past float32's range (about 3e38): the
    weights were NaN. The squares and their running sum are then formed in float64 (the sum
    is kept so while it does not fit float32), giving the float64 input's weights and update,
    in float32, at that call and the later ones, of any scale."""
    generator = torch.Generator().manual_seed(0)
    narrow = ExcessMTL(n_warmup_steps=n_warmup_steps)
    wide = ExcessMTL(n_warmup_steps=n_warmup_steps)
    for scale in (1e20, 3e20, 1e19, 1.0):
        J = scale * torch.randn(3, 4, generator=generator)
        out, expected = narrow(J), wide(J.double())
        assert out.dtype == torch.float32 and bool(torch.isfinite(out).all())
        torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=0.0)
        weights = narrow.weighting._weights
        assert weights is not None and wide.weighting._weights is not None
        torch.testing.assert_close(weights.double(), wide.weighting._weights, rtol=1e-6, atol=0.0)


def test_a_skipped_call_of_another_shape_keeps_the_state() -> None:
    """A NaN Jacobian of a new shape re-initialised the state (and forgot the old one) before
    the check that skips the call; now the next call continues as if it had not happened."""
    J = torch.tensor([[1.0, 2.0], [3.0, -1.0]], dtype=torch.float64)
    A, reference = ExcessMTL(), ExcessMTL()
    for scale in (1.0, 2.0):
        A(scale * J), reference(scale * J)
    assert bool(A(torch.full((3, 2), math.nan, dtype=torch.float64)).isnan().all())
    assert torch.equal(A(3 * J), reference(3 * J))
