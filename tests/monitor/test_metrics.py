"""Conflict metrics from the Gramian against direct computations on an explicit Jacobian."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.nn.functional import cosine_similarity

from jacflow.monitor import (
    conflict_metrics,
    conflicting_pairs,
    cosine_similarities,
    gradient_norms,
    norm_ratio,
    update_cosines,
    update_norm,
)


@st.composite
def jacobians_and_weights(draw: st.DrawFn) -> tuple[Tensor, Tensor]:
    m = draw(st.integers(1, 8))
    n = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    gen = torch.Generator().manual_seed(seed)
    J = scale * torch.randn(m, n, generator=gen, dtype=torch.float64)
    if draw(st.booleans()) and m > 1:
        J[draw(st.integers(0, m - 1))] = 0.0  # an exactly zero gradient
    w = torch.rand(m, generator=gen, dtype=torch.float64) + 0.1
    return J, w


def _direct_cosine(a: Tensor, b: Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return 0.0 if na == 0 or nb == 0 else float(a @ b) / (na * nb)


@settings(max_examples=60)
@given(jacobians_and_weights())
def test_metrics_match_direct_computation_from_jacobian(case: tuple[Tensor, Tensor]) -> None:
    J, w = case
    m = J.shape[0]
    G = J @ J.T
    update = J.T @ w
    torch.testing.assert_close(gradient_norms(G), J.norm(dim=1), rtol=1e-9, atol=0.0)
    for i in range(m):
        for j in range(m):
            expected = _direct_cosine(J[i], J[j])
            assert float(cosine_similarities(G)[i, j]) == pytest.approx(expected, abs=1e-9)
    direct_conflicts = sum(float(J[i] @ J[j]) < 0 for i in range(m) for j in range(i + 1, m))
    assert conflicting_pairs(G) == direct_conflicts
    torch.testing.assert_close(update_norm(G, w), update.norm(), rtol=1e-9, atol=1e-300)
    expected_update_cos = [_direct_cosine(update, J[i]) for i in range(m)]
    assert update_cosines(G, w).tolist() == pytest.approx(expected_update_cos, abs=1e-9)
    norms = J.norm(dim=1)
    expected_ratio = float(norms.max() / norms.min()) if float(norms.min()) > 0 else math.inf
    assert norm_ratio(G) == pytest.approx(expected_ratio, rel=1e-9)


def test_cosines_agree_with_torch_cosine_similarity() -> None:
    J = torch.randn(5, 7, dtype=torch.float64)
    expected = cosine_similarity(J[:, None, :], J[None, :, :], dim=-1)
    torch.testing.assert_close(cosine_similarities(J @ J.T), expected)


def test_to_dict_flattens_with_names_and_summaries() -> None:
    J = torch.tensor([[1.0, 0.0], [-1.0, 1.0], [0.0, 2.0]], dtype=torch.float64)
    w = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    flat = conflict_metrics(J @ J.T, w).to_dict(["a", "b", "c"])
    s = 1 / math.sqrt(2)
    assert flat["cos/a-b"] == pytest.approx(-s)
    assert flat["cos/a-c"] == pytest.approx(0.0)
    assert flat["cos/b-c"] == pytest.approx(s)
    assert flat["conflicting_pairs"] == 1.0
    assert flat["conflict_fraction"] == pytest.approx(1 / 3)
    assert flat["min_cosine"] == pytest.approx(-s)
    assert flat["mean_cosine"] == pytest.approx(0.0)
    assert flat["norm_ratio"] == pytest.approx(2.0)
    assert flat["norm/b"] == pytest.approx(math.sqrt(2))
    assert flat["weight/c"] == 0.0
    # update = (0, 1): cosines with (1,0), (-1,1), (0,2) are 0, 1/sqrt(2), 1
    assert [flat["update_cos/a"], flat["update_cos/b"], flat["update_cos/c"]] == pytest.approx(
        [0.0, s, 1.0]
    )
    assert flat["min_update_cos"] == pytest.approx(0.0)
    assert flat["update_norm"] == pytest.approx(1.0)
    short = conflict_metrics(J @ J.T).to_dict(per_objective=False, pairwise=False)
    assert set(short) == {
        "conflicting_pairs",
        "conflict_fraction",
        "min_cosine",
        "mean_cosine",
        "norm_ratio",
    }


def test_degenerate_gramians() -> None:
    zero = torch.zeros(2, 2)
    assert math.isnan(norm_ratio(zero))
    assert cosine_similarities(zero).tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert update_cosines(zero, torch.ones(2)).tolist() == [0.0, 0.0]
    nan = torch.tensor([[float("nan"), 0.0], [0.0, 1.0]])
    assert math.isnan(float(cosine_similarities(nan)[0, 0]))
    single = conflict_metrics(torch.tensor([[4.0]]), torch.tensor([1.0])).to_dict()
    assert single["conflict_fraction"] == 0.0 and single["norm/0"] == 2.0


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"square matrix \[m, m\]"):
        gradient_norms(torch.ones(2, 3))
    with pytest.raises(TypeError, match=r"`gramian` must be a torch\.Tensor"):
        conflict_metrics([[1.0]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`weights` must have shape \(2,\)"):
        update_norm(torch.eye(2), torch.ones(3))
    with pytest.raises(ValueError, match="`names` must have 2 entries"):
        conflict_metrics(torch.eye(2)).to_dict(["a"])
