"""PBI against a NumPy computation of d1 + theta d2."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jacflow.scalarization import PBI


def reference(f: list[float], w: list[float], z: list[float], theta: float) -> float:
    v = np.array(f) - np.array(z)
    u = np.array(w) / np.linalg.norm(w)
    d1 = float(v @ u)
    d2 = float(np.linalg.norm(v - d1 * u))
    return d1 + theta * d2


def test_value(dtype: torch.dtype) -> None:
    f, w, z = [1.0, 3.0, 2.0], [0.5, 0.2, 0.3], [0.5, 1.0, 0.0]
    out = PBI(5.0, torch.tensor(w), torch.tensor(z))(torch.tensor(f, dtype=dtype))
    assert math.isclose(out.item(), reference(f, w, z, 5.0), rel_tol=1e-6)
    assert math.isclose(
        PBI(0.0, torch.tensor(w))(torch.tensor(f)).item(),
        reference(f, w, [0, 0, 0], 0.0),
        rel_tol=1e-6,
    )


def test_on_the_preference_ray_value_is_exact_and_gradient_finite() -> None:
    f = torch.tensor([2.0, 2.0], dtype=torch.float64, requires_grad=True)
    out = PBI(5.0, torch.tensor([1.0, 1.0]))(f)
    assert math.isclose(out.item(), math.sqrt(8.0), rel_tol=1e-14)  # d2 = 0, no epsilon
    out.backward()
    torch.testing.assert_close(f.grad, torch.full((2,), 1 / math.sqrt(2), dtype=torch.float64))


@settings(max_examples=30)
@given(
    st.lists(st.tuples(st.floats(0, 10), st.floats(0.1, 1)), min_size=1, max_size=5), st.randoms()
)
def test_joint_permutation_invariance(pairs, rnd) -> None:  # type: ignore[no-untyped-def]
    shuffled = pairs[:]
    rnd.shuffle(shuffled)
    values = []
    for ps in (pairs, shuffled):
        f = torch.tensor([p[0] for p in ps], dtype=torch.float64)
        w = torch.tensor([p[1] for p in ps], dtype=torch.float64)
        values.append(PBI(2.0, w)(f).item())
    assert math.isclose(values[0], values[1], rel_tol=1e-9, abs_tol=1e-9)


@pytest.mark.parametrize("bad", [[0.0, 0.0], [float("nan"), 1.0], [float("inf"), 1.0]])
def test_a_zero_or_non_finite_direction_is_refused_at_construction_and_on_assignment(
    bad: list[float],
) -> None:
    with pytest.raises(ValueError, match=r"`weights`.*(not all zero|must be finite)"):
        PBI(theta=5.0, weights=torch.tensor(bad))
    pbi = PBI(theta=5.0, weights=torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match=r"`weights`.*(not all zero|must be finite)"):
        pbi.weights = torch.tensor(bad)
    # the direction kept is the previous one: d1 = 4 / sqrt(2), d2 = sqrt(2) (hand computation)
    assert math.isclose(
        float(pbi(torch.tensor([1.0, 3.0]))), 4 / math.sqrt(2) + 5 * math.sqrt(2), rel_tol=1e-6
    )


def test_a_tiny_direction_gives_the_value_of_the_same_direction() -> None:
    """Its norm underflows in float32 (1e-30 squared): the direction is scaled first."""
    losses = torch.tensor([1.0, 3.0])
    expected = PBI(5.0, torch.tensor([1.0, 1.0]))(losses)
    torch.testing.assert_close(PBI(5.0, torch.tensor([1e-30, 1e-30]))(losses), expected)
    torch.testing.assert_close(
        PBI(5.0, torch.tensor([1e-45, 0.0]))(losses), PBI(5.0, torch.tensor([1.0, 0.0]))(losses)
    )
