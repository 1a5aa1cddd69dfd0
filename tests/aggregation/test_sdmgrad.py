"""SDMGrad: properties, an independent re-implementation of the paper's loop, values, reset."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from jacflow.aggregation import SDMGrad, SDMGradWeighting
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    jacobians,
)
from tests.aggregation._seeded import seeded

J_DOC = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])


def _reference_projection(y: list[float]) -> list[float]:
    """Simplex projection by the KKT conditions, enumerating the support sizes (pure Python)."""
    ordered = sorted(y, reverse=True)
    for k in range(len(y), 0, -1):
        theta = (sum(ordered[:k]) - 1) / k
        if ordered[k - 1] - theta > 0:
            return [max(v - theta, 0.0) for v in y]
    raise AssertionError("unreachable")


def _reference_sequence(
    mats: list[Tensor], lr: float, momentum: float, n_iter: int, lambda_: float
) -> list[Tensor]:
    """The paper's Algorithm (official code's normalisation), written as plainly as possible."""
    m = mats[0].shape[0]
    w = [1.0 / m] * m
    pref = [1.0 / m] * m
    outputs = []
    for A in mats:
        rows = A.tolist()
        scale = (sum(max(rows[i][i], 0.0) ** 0.5 for i in range(m)) / m) ** 2
        scale = scale if scale > 0 else 1.0  # no positive diagonal entry: not normalised
        velocity = [0.0] * m
        for _ in range(n_iter):
            target = [w[j] + lambda_ * pref[j] for j in range(m)]
            grad = [sum(rows[i][j] * target[j] for j in range(m)) / scale for i in range(m)]
            velocity = [momentum * velocity[i] + grad[i] for i in range(m)]
            w = _reference_projection([w[i] - lr * velocity[i] for i in range(m)])
        outputs.append(
            torch.tensor(
                [(w[i] + lambda_ * pref[i]) / (1 + lambda_) for i in range(m)], dtype=torch.float64
            )
        )
    return outputs


def test_claimed_properties() -> None:
    check_claimed_properties(seeded(SDMGrad, reset=True), jacobians(max_m=16))


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(SDMGrad)


@settings(max_examples=15)
@given(
    st.integers(1, 6),
    st.integers(0, 2**31 - 1),
    st.floats(0.1, 20.0),
    st.floats(0.0, 0.9),
    st.floats(0.0, 1.0),
)
def test_matches_reference_over_several_calls(
    m: int, seed: int, lr: float, momentum: float, lambda_: float
) -> None:
    gen = torch.Generator().manual_seed(seed)
    # Cross-batch matrices J1 J2^T: square but not symmetric.
    mats = [
        torch.randn(m, 5, generator=gen, dtype=torch.float64)
        @ torch.randn(m, 5, generator=gen, dtype=torch.float64).T
        + 6 * torch.eye(m, dtype=torch.float64)  # mostly a positive diagonal (normalised)
        for _ in range(3)
    ]
    weighting = SDMGradWeighting(lr=lr, momentum=momentum, n_iter=7, lambda_=lambda_)
    expected = _reference_sequence(mats, lr, momentum, 7, lambda_)
    for A, reference in zip(mats, expected):
        torch.testing.assert_close(weighting(A), reference, atol=1e-9, rtol=1e-9)


def test_documented_values_and_reset() -> None:
    G = J_DOC @ J_DOC.T
    weighting = SDMGradWeighting()
    first = weighting(G)
    torch.testing.assert_close(first, torch.tensor([0.1154, 0.8846]), atol=1e-4, rtol=0)
    weighting(G)
    weighting.reset()
    torch.testing.assert_close(weighting(G), first)
    aggregator = SDMGrad()
    torch.testing.assert_close(aggregator(J_DOC), first @ J_DOC)
    aggregator(J_DOC)
    aggregator.reset()
    torch.testing.assert_close(aggregator(J_DOC), first @ J_DOC)


def test_pref_vector_and_devices(device: str, dtype: torch.dtype) -> None:
    G = (J_DOC @ J_DOC.T).to(device=device, dtype=dtype)
    pref = torch.tensor([1.0, 0.0])
    w = SDMGradWeighting(lambda_=1e6, pref_vector=pref)(G)
    assert w.device == G.device and w.dtype == dtype
    # A huge pull makes the weights the preference vector.
    torch.testing.assert_close(w.cpu().double(), pref.double(), atol=1e-5, rtol=0)


def test_errors_and_repr() -> None:
    for kwargs, name in [
        ({"lr": 0.0}, "lr"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"n_iter": 0}, "n_iter"),
        ({"lambda_": -1.0}, "lambda_"),
    ]:
        with pytest.raises(ValueError, match=name):
            SDMGrad(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pref_vector"):
        SDMGradWeighting(pref_vector=torch.ones(2, 2))
    with pytest.raises(ValueError, match="one preference per objective"):
        SDMGradWeighting(pref_vector=torch.ones(3))(torch.eye(2))
    with pytest.raises(ValueError, match="square"):
        SDMGradWeighting()(torch.ones(2, 3))
    assert repr(SDMGrad()) == (
        "SDMGrad(lr=10.0, momentum=0.5, n_iter=20, lambda_=0.3, pref_vector=None)"
    )
    assert str(SDMGrad()) == "SDMGrad"
