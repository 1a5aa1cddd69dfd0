"""Conflict metrics from the Gramian against direct computations on an explicit Jacobian."""

from __future__ import annotations

import math
from typing import Any

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


def test_half_precision_gramians_are_computed_in_float32() -> None:
    # J has 2 rows of 100 entries 20: every Gramian entry is 40000 (exact in float16), but
    # w^T G w = 160000 overflows float16. By hand: u = J^T w = 40 * ones(100), ||u|| = 400 and
    # u is parallel to both gradients (cosines 1).
    gramian = torch.full((2, 2), 40000.0, dtype=torch.float16)
    weights = torch.tensor([1.0, 1.0])
    metrics = conflict_metrics(gramian, weights)
    assert metrics.update_norm is not None and metrics.update_cosines is not None
    assert metrics.update_norm.dtype == torch.float32
    assert float(metrics.update_norm) == pytest.approx(400.0)
    assert metrics.update_cosines.tolist() == pytest.approx([1.0, 1.0])
    assert metrics.to_dict()["min_update_cos"] == pytest.approx(1.0)
    assert float(update_norm(gramian, weights)) == pytest.approx(400.0)
    assert float(update_norm(gramian.to(torch.bfloat16), weights)) == pytest.approx(400.0, 1e-2)
    assert update_cosines(gramian.to(torch.bfloat16), weights).dtype == torch.float32


def test_integer_gramians_do_not_truncate_the_weights() -> None:
    # J = [[2, 0], [-1, 1]], w = [0.5, 0.5]: u = J^T w = [0.5, 0.5] by hand, ||u|| = sqrt(0.5);
    # cos(u, g_0) = 1 / (sqrt(0.5) * 2) = sqrt(0.5), cos(u, g_1) = 0.
    jacobian = torch.tensor([[2, 0], [-1, 1]])
    gramian = jacobian @ jacobian.T
    weights = torch.tensor([0.5, 0.5])
    assert float(update_norm(gramian, weights)) == pytest.approx(math.sqrt(0.5))
    metrics = conflict_metrics(gramian, weights)
    assert metrics.update_cosines is not None
    assert metrics.update_cosines.tolist() == pytest.approx([math.sqrt(0.5), 0.0], abs=1e-7)
    assert metrics.update_cosines.is_floating_point()
    assert conflicting_pairs(gramian) == 1
    with pytest.raises(TypeError, match="must be a real matrix"):
        gradient_norms(torch.eye(2, dtype=torch.complex64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gramian_gives_nan_conflict_statistics(bad: float) -> None:
    gramian = torch.tensor([[1.0, -0.5, bad], [-0.5, 1.0, 0.2], [bad, 0.2, 1.0]])
    metrics = conflict_metrics(gramian, torch.ones(3))
    assert not metrics.finite
    flat = metrics.to_dict()
    for key in ("conflicting_pairs", "conflict_fraction", "min_cosine", "mean_cosine"):
        assert math.isnan(flat[key]), key
    # the integer count only counts the negative numbers (here G_01)
    assert metrics.n_conflicting_pairs == 1
    all_nan = conflict_metrics(torch.full((3, 3), float("nan"))).to_dict()
    assert math.isnan(all_nan["conflict_fraction"]) and math.isnan(all_nan["min_cosine"])
    assert conflict_metrics(torch.eye(3)).finite


def test_min_cosine_propagates_nan_whatever_its_position() -> None:
    # one NaN pair cosine after a finite one: Python's min() would ignore it
    cosines = torch.tensor([[1.0, 0.5, 0.5], [0.5, 1.0, float("nan")], [0.5, float("nan"), 1.0]])
    metrics = conflict_metrics(torch.eye(3))
    patched = type(metrics)(metrics.norms, cosines, 0, 1.0)
    assert math.isnan(patched.to_dict()["min_cosine"])


@pytest.mark.parametrize("metric", [conflicting_pairs, norm_ratio, conflict_metrics])
def test_a_meta_gramian_is_refused(metric: Any) -> None:
    """A meta Gramian raised torch's ``Tensor.item() cannot be called on meta tensors``."""
    with pytest.raises(ValueError, match=r"`gramian` is on the meta device"):
        metric(torch.ones(3, 3, device="meta"))
    metric(torch.eye(3))
