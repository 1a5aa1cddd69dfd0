"""The simplex projection against the KKT conditions, in exact rational arithmetic."""

from __future__ import annotations

from fractions import Fraction

import torch
from hypothesis import given
from hypothesis import strategies as st

from jacflow.aggregation._simplex import project_onto_simplex


def _exact_projection(y: list[float]) -> list[float]:
    """max(y - theta, 0) with theta from the KKT conditions, in fractions (no rounding)."""
    exact = [Fraction(v) for v in y]
    ordered = sorted(exact, reverse=True)
    for k in range(len(y), 0, -1):
        theta = (sum(ordered[:k]) - 1) / k
        if ordered[k - 1] - theta > 0:
            return [float(max(v - theta, Fraction(0))) for v in exact]
    raise AssertionError("unreachable")


@given(
    st.lists(st.floats(-3.0, 3.0), min_size=1, max_size=6),
    st.sampled_from([0.0, 1e8, -1e8, 1e20, -1e20]),
)
def test_exact_for_entries_far_from_zero(spread: list[float], offset: float) -> None:
    """Entries of 1e8 in float32 (a step of 0.1 on a Gramian of 1e9: MoDo, MoCo) swallowed the
    1 that the weights sum to: every weight rounded to 0. The projection ignores a shift."""
    for dtype in (torch.float32, torch.float64):
        y = torch.tensor(spread, dtype=dtype) * abs(offset or 1.0) * 1e-7 + offset
        weights = project_onto_simplex(y)
        expected = torch.tensor(_exact_projection(y.tolist()), dtype=torch.float64)
        assert abs(float(weights.double().sum()) - 1.0) < 1e-5
        torch.testing.assert_close(weights.double(), expected, atol=1e-5, rtol=0)
