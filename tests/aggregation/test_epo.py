"""EPO: the LP of each mode against scipy's linprog, the fallback, and the preference ray."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog

from jacflow.aggregation import EPO, EPOWeighting
from jacflow.aggregation._epo import epo_lp, epo_weights
from tests.aggregation._properties import check_claimed_properties, check_degenerate_inputs
from tests.aggregation._with_losses import with_losses


def _reference_lp(G: np.ndarray, L: np.ndarray, r: np.ndarray, eps: float) -> tuple[float, str]:
    """The optimal value of the EPO program written from the paper, solved by HiGHS."""
    m = len(L)
    C = G / G.diagonal().max()
    rl = r * L
    l_hat = rl / rl.sum()
    mu = float(np.sum(l_hat * np.log(l_hat * m)))
    a = r * (np.log(l_hat * m) - mu)
    b = C @ a
    eq = dict(A_eq=np.ones((1, m)), b_eq=[1.0], bounds=[(0, None)] * m, method="highs")
    if mu > eps:
        rows = [j for j in range(m) if b[j] <= 0 or rl[j] == rl.max()]
        rhs = np.zeros(m) if not (b > 0).any() else np.where(rl == rl.max(), 0.0, b)
        res = linprog(-b, A_ub=-C[rows], b_ub=-rhs[rows], **eq)  # type: ignore[arg-type]
        return -res.fun, "balance"
    A_ub = np.vstack([-C, -b[None]])
    b_ub = np.append(np.zeros(m), -min(b.max(), 0.0))
    res = linprog(-C.sum(0), A_ub=A_ub, b_ub=b_ub, **eq)  # type: ignore[arg-type]
    return -res.fun, "descent"


@settings(max_examples=40)
@given(st.integers(1, 8), st.integers(0, 10**6), st.booleans())
def test_lp_value_matches_scipy(m: int, seed: int, on_ray: bool) -> None:
    rng = np.random.default_rng(seed)
    J = rng.normal(size=(m, rng.integers(1, 10)))
    r = rng.uniform(0.2, 2.0, size=m)
    L = 1.0 / r if on_ray else rng.uniform(0.1, 3.0, size=m)
    G = J @ J.T
    alpha, mode = epo_lp(torch.from_numpy(G), torch.from_numpy(L), torch.from_numpy(r), 1e-4, False)
    value, expected_mode = _reference_lp(G, L, r, 1e-4)
    assert mode == expected_mode
    assert alpha is not None
    a = alpha.numpy()
    assert (a >= -1e-9).all() and abs(a.sum() - 1) < 1e-9
    C = G / G.diagonal().max()
    rl = r * L
    l_hat = rl / rl.sum()
    b = C @ (r * (np.log(l_hat * m) - np.sum(l_hat * np.log(l_hat * m))))
    got = float(a @ b) if mode == "balance" else float(C.sum(0) @ a)
    assert abs(got - value) <= 1e-7 * (1 + abs(value))


def test_weights_are_m_alpha_and_fall_back_to_the_preference() -> None:
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]], dtype=torch.float64)
    r = torch.tensor([1.0, 2.0], dtype=torch.float64)
    alpha, _ = epo_lp(J @ J.T, torch.tensor([4.0, 1.0]), r, 1e-4, False)
    W = EPOWeighting(r)
    W.set_losses(torch.tensor([4.0, 1.0]))
    assert alpha is not None
    torch.testing.assert_close(W(J @ J.T), 2 * alpha)
    # log(0): no program, the reference's fallback (the weighting refuses such losses)
    fallback = epo_weights(J @ J.T, torch.tensor([0.0, 1.0]), r, 1e-4, False)
    torch.testing.assert_close(fallback, 2 * r / r.sum())


@pytest.mark.parametrize("losses", [[-1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [-3.0, -1.0, -2.0]])
def test_non_positive_losses_are_refused(losses: list[float]) -> None:
    """They gave the fallback r / sum(r) or meaningless weights ([0, 0, 3] for all negative)
    without a word."""
    G = torch.tensor([[1.0, 0.2, 0.0], [0.2, 1.0, 0.1], [0.0, 0.1, 1.0]])
    W = EPOWeighting(torch.tensor([1.0, 2.0, 4.0]))
    W.set_losses(torch.tensor(losses))
    with pytest.raises(ValueError, match="EPO needs positive losses"):
        W(G)
    for bad in (float("nan"), float("inf"), -float("inf")):  # a skipped step, as elsewhere
        W.set_losses(torch.tensor([bad, 1.0, 1.0]))
        assert bool(W(G).isnan().all())


def test_descends_onto_the_preference_ray() -> None:
    """Two quadratics: EPO reaches the Pareto point with r_1 L_1 = r_2 L_2 (the paper's aim)."""
    a, b = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 1.0]).double()
    r = torch.tensor([1.0, 3.0], dtype=torch.float64)
    A = EPO(r)
    x = torch.tensor([2.0, 2.0], dtype=torch.float64)

    def losses_fn(z: torch.Tensor) -> torch.Tensor:
        return torch.stack([((z - a) ** 2).sum(), ((z - b) ** 2).sum()])

    for _ in range(300):
        A.set_losses(losses_fn(x))
        x = x - 0.02 * A(torch.func.jacrev(losses_fn)(x))
    L = losses_fn(x)
    # On the ray up to the tolerance eps = 1e-4 on KL(l_hat || uniform), i.e. a few percent.
    torch.testing.assert_close(r[0] * L[0], r[1] * L[1], rtol=4e-2, atol=0)
    # Pareto optimal: x lies on the segment [a, b], where the two gradients are opposite.
    torch.testing.assert_close(x.sum(), torch.tensor(1.0, dtype=torch.float64), atol=1e-2, rtol=0)


def _any_m() -> EPO:
    return _AnyM()


class _AnyM(EPO):
    """A preference sized at call time, for the shared checks on any number of rows."""

    def __init__(self) -> None:
        super().__init__(torch.ones(1))

    def weights(self, matrix: torch.Tensor) -> torch.Tensor:
        m = matrix.shape[0]
        inner = EPOWeighting(torch.linspace(1.0, 2.0, m) if m > 1 else torch.ones(m))
        assert self.gramian_weighting._losses is not None
        inner.set_losses(self.gramian_weighting._losses)
        return inner(matrix @ matrix.T)


def test_claimed_properties_and_degenerate_inputs() -> None:
    check_claimed_properties(with_losses(_any_m))
    check_degenerate_inputs(with_losses(_any_m))


def test_errors_and_repr() -> None:
    with pytest.raises(ValueError, match="positive"):
        EPO(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="1-D"):
        EPO(torch.ones(2, 1))
    with pytest.raises(TypeError, match="preference"):
        EPO([1.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eps"):
        EPO(torch.ones(2), eps=-1.0)
    with pytest.raises(TypeError, match="relax"):
        EPO(torch.ones(2), relax=1)  # type: ignore[arg-type]
    A = EPO(torch.ones(2))
    with pytest.raises(ValueError, match="set_losses"):
        A(torch.eye(2))
    with pytest.raises(ValueError, match="one preference per objective"):
        A(torch.eye(3))
    A.set_losses(torch.tensor([1.0, float("nan")]))
    assert bool(torch.isnan(A(torch.eye(2))).all())
    assert repr(A) == "EPO(preference=tensor([1., 1.]), eps=0.0001, relax=False)"
    assert str(A) == "EPO"


def test_weighting_and_aggregator_agree() -> None:
    J = torch.randn(4, 7, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    r, L = torch.tensor([1.0, 2.0, 0.5, 1.0]), torch.tensor([1.0, 0.3, 2.0, 1.0])
    A, W = EPO(r), EPOWeighting(r)
    A.set_losses(L)
    W.set_losses(L)
    torch.testing.assert_close(A(J), W(J @ J.T) @ J)
