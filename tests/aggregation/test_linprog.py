"""The dense two-phase simplex solver against scipy.optimize.linprog (HiGHS)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from jacflow.aggregation._linprog import linprog_max


@settings(max_examples=60)
@given(
    st.integers(1, 6), st.integers(0, 6), st.integers(0, 2), st.booleans(), st.integers(0, 10**6)
)
def test_agrees_with_scipy(n: int, n_ub: int, n_eq: int, simplex: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    c = rng.normal(size=n)
    A, b = rng.normal(size=(n_ub, n)), rng.normal(size=n_ub)
    Ae, be = rng.normal(size=(n_eq, n)), rng.normal(size=n_eq)
    if simplex:  # a bounded feasible region (when the other constraints allow it)
        Ae, be = np.vstack([Ae, np.ones((1, n))]), np.append(be, 1.0)
    reference = linprog(
        -c,
        A_ub=A if n_ub else None,
        b_ub=b if n_ub else None,
        A_eq=Ae if len(be) else None,
        b_eq=be if len(be) else None,
        bounds=[(0, None)] * n,
        method="highs",
    )
    x = linprog_max(*(torch.from_numpy(v) for v in (c, A, b, Ae, be)))
    if reference.status != 0:
        assert x is None  # infeasible or unbounded
        return
    assert x is not None
    xs = x.numpy()
    assert abs(c @ xs - c @ reference.x) <= 1e-7 * (1 + abs(c @ reference.x))
    assert (xs >= -1e-9).all()
    assert (A @ xs <= b + 1e-7).all()
    np.testing.assert_allclose(Ae @ xs, be, atol=1e-7)


def test_degenerate_cycling_example_terminates() -> None:
    # Beale's classic example, on which the simplex method cycles without an anti-cycling rule.
    c = torch.tensor([0.75, -150.0, 1 / 50, -6.0], dtype=torch.float64)
    A = torch.tensor(
        [[0.25, -60.0, -1 / 25, 9.0], [0.5, -90.0, -1 / 50, 3.0], [0.0, 0.0, 1.0, 0.0]],
        dtype=torch.float64,
    )
    b = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    x = linprog_max(c, A, b, torch.zeros(0, 4), torch.zeros(0))
    assert x is not None
    assert abs(float(c @ x) - 0.05) < 1e-12
