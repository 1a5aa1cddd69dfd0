"""Gramian helpers against their definitions, and non-finite Gramians through the projectors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jacflow.aggregation import DualProjWeighting, UPGradWeighting
from jacflow.linalg import (
    QuadprogProjector,
    TorchProjector,
    compute_gramian,
    normalize_gramian,
    project_weights,
    regularize_gramian,
    sum_gramians,
)
from jacflow.linalg._gramian import has_nonfinite

pytest.importorskip("quadprog")


@settings(max_examples=20)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_normalize_and_regularize_match_their_definitions(m: int, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    J = torch.randn(m, n, generator=gen, dtype=torch.float64)
    G = J @ J.T
    trace = float(sum(G[i, i] for i in range(m)))
    torch.testing.assert_close(normalize_gramian(G, 0.0), G / trace)
    assert bool((normalize_gramian(G, 1.001 * trace) == 0).all())  # trace <= eps: zero
    torch.testing.assert_close(normalize_gramian(G, 0.999 * trace), G / trace)
    expected = G.clone()
    for i in range(m):
        expected[i, i] += 0.25
    torch.testing.assert_close(regularize_gramian(G, 0.25), expected)


def test_normalize_batched() -> None:
    G = torch.stack([torch.eye(2) * 2.0, torch.zeros(2, 2)])
    torch.testing.assert_close(normalize_gramian(G, 0.0), torch.stack([torch.eye(2) / 2, G[1]]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_normalize_propagates_a_nonfinite_trace(bad: float) -> None:
    G = torch.eye(3)
    G[0, 0] = bad
    assert bool(normalize_gramian(G, 1e-4).isnan().any())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("entry", [(0, 0), (0, 1)])
def test_nonfinite_gramian_gives_nan_projections(bad: float, entry: tuple[int, int]) -> None:
    """Diagonal and off-diagonal NaN/inf entries: every projector and preset gives NaN."""
    G = torch.eye(3, dtype=torch.float64)
    G[entry] = G[entry[::-1]] = bad
    u = torch.eye(3, dtype=torch.float64)
    assert bool(project_weights(u, G).isnan().all())
    for projector in (TorchProjector(), QuadprogProjector()):
        assert bool(projector(u, G).isnan().all())
        assert bool(UPGradWeighting(projector=projector)(G).isnan().all())
        assert bool(DualProjWeighting(projector=projector)(G).isnan().all())
    for m in (2, 3):  # m = 2 takes UPGrad's closed form
        assert bool(UPGradWeighting()(G[:m, :m]).isnan().all())


@settings(max_examples=60)
@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    special=st.sampled_from([None, float("nan"), float("inf"), -float("inf"), 3e38, -3e38]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_has_nonfinite_is_the_entrywise_test(
    shape: list[int], special: float | None, dtype: torch.dtype, seed: int
) -> None:
    """The sum shortcut answers as ``isfinite`` entrywise, also when finite entries overflow the
    sum (float32: 3e38 + 3e38 = inf)."""
    gen = torch.Generator().manual_seed(seed)
    tensor = torch.randn(shape, generator=gen, dtype=dtype)
    if special is not None and tensor.numel():
        flat = tensor.view(-1)
        flat[torch.randint(0, flat.numel(), (2,), generator=gen)] = special
    assert has_nonfinite(tensor) == (not bool(torch.isfinite(tensor).all()))


@pytest.mark.parametrize("shape", [(3,), (2, 3, 4), ()])
def test_compute_gramian_refuses_what_is_not_a_matrix(shape: tuple[int, ...]) -> None:
    """A 1-D input gave a scalar (its squared norm), a 3-D one torch's internal error."""
    with pytest.raises(ValueError, match=r"expects a 2-D \[m, n\] matrix"):
        compute_gramian(torch.ones(shape))


def test_sum_gramians_refuses_matrices_with_other_numbers_of_rows() -> None:
    with pytest.raises(ValueError, match="same number of rows m, received 2 rows first and 3"):
        sum_gramians([torch.ones(2, 3), torch.ones(3, 3)])
    with pytest.raises(ValueError, match=r"\[m, \*any\], received \(\) at 1"):
        sum_gramians([torch.ones(2, 3), torch.ones(())])


def test_normalize_gramian_of_entries_near_the_largest_float() -> None:
    """Finite entries whose trace overflows (about 1e307 each): the same normalisation as at
    scale 1 (it divided by the infinite trace and gave zeros); a NaN entry still gives NaN."""
    J = torch.tensor([[1.0, -2.0, 0.5], [0.3, 1.0, 2.0], [2.0, 0.0, -1.0]], dtype=torch.float64)
    G = J @ J.T
    huge = G / G.diagonal().amax() * 1e308
    assert bool(torch.isfinite(huge).all()) and not torch.isfinite(huge.diagonal().sum())
    torch.testing.assert_close(normalize_gramian(huge, 0.0), normalize_gramian(G, 0.0))
    batch = torch.stack([G, huge])
    torch.testing.assert_close(normalize_gramian(batch, 1e-3)[1], normalize_gramian(G, 0.0))
    with_nan = G.clone()
    with_nan[1, 1] = float("nan")
    assert bool(normalize_gramian(with_nan, 0.0).isnan().all())


def test_normalize_gramian_without_objectives() -> None:
    """m = 0: an empty result, as before the guard against overflowing traces (whose amax of
    an empty diagonal raised an IndexError)."""
    for shape in ((0, 0), (3, 0, 0)):
        empty = torch.zeros(shape, dtype=torch.float64)
        assert normalize_gramian(empty, 0.0).shape == shape


_G = torch.tensor([[3.0, 1.0], [1.0, 4.0]])
_NOT_A_NUMBER = ["x", None, True, [0.1]]
_BAD_EPS = [float("nan"), float("inf"), -1.0]


@pytest.mark.parametrize("function", [normalize_gramian, regularize_gramian])
@pytest.mark.parametrize("eps", _NOT_A_NUMBER)
def test_eps_of_the_wrong_type_is_a_type_error(function: Any, eps: object) -> None:
    with pytest.raises(TypeError, match=r"`eps` must be a float in \[0.0, inf\), received"):
        function(_G, eps)


@pytest.mark.parametrize("function", [normalize_gramian, regularize_gramian])
@pytest.mark.parametrize("eps", _BAD_EPS)
def test_non_finite_or_negative_eps_is_a_value_error(function: Any, eps: float) -> None:
    with pytest.raises(ValueError, match=r"`eps` must be a float in \[0.0, inf\)"):
        function(_G, eps)


@pytest.mark.parametrize("function", [normalize_gramian, regularize_gramian])
@pytest.mark.parametrize(
    ("gramian", "error", "words"),
    [
        ([[1.0, 0.0], [0.0, 1.0]], TypeError, r"`gramian` must be a torch\.Tensor"),
        (np.eye(2), TypeError, r"`gramian` must be a torch\.Tensor"),
        (torch.eye(2, dtype=torch.int64), TypeError, "floating dtype.*int64"),
        (torch.eye(2, dtype=torch.complex64), TypeError, "floating dtype.*complex64"),
        (torch.ones(2), ValueError, r"square matrix.*received shape \(2,\)"),
        (torch.tensor(1.0), ValueError, r"square matrix.*received shape \(\)"),
        (torch.ones(2, 3), ValueError, r"square matrix.*received shape \(2, 3\)"),
        (torch.ones(4, 2, 3), ValueError, r"square matrix.*received shape \(4, 2, 3\)"),
    ],
)
def test_gramian_helpers_refuse_what_is_not_a_real_square_matrix(
    function: Any, gramian: object, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        function(gramian, 0.0)


def test_gramian_helpers_keep_valid_inputs() -> None:
    torch.testing.assert_close(normalize_gramian(_G, 0), _G / 7)
    torch.testing.assert_close(regularize_gramian(_G, 1), _G + torch.eye(2))
    batch = _G.expand(3, 2, 2).double()
    torch.testing.assert_close(normalize_gramian(batch, np.float64(0.0)), batch / 7)
    assert normalize_gramian(torch.zeros(0, 0), 0.0).shape == (0, 0)
    assert regularize_gramian(torch.zeros(0, 0), 1.0).shape == (0, 0)


@pytest.mark.parametrize(
    ("matrix", "error", "words"),
    [
        ([[1.0, 0.0]], TypeError, r"`matrix` must be a torch\.Tensor.*list"),
        (np.ones((2, 3)), TypeError, r"`matrix` must be a torch\.Tensor.*ndarray"),
        (torch.ones(2, 3, dtype=torch.int64), TypeError, "floating dtype.*int64"),
        (torch.ones(2, 3, dtype=torch.complex64), TypeError, "floating dtype.*complex64"),
        (torch.ones(3), ValueError, "2-D"),
    ],
)
def test_compute_gramian_refuses_bad_matrices(
    matrix: object, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        compute_gramian(matrix)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("matrices", "error", "words"),
    [
        ([[1.0, 0.0]], TypeError, r"`matrices\[0\]` must be a torch\.Tensor"),
        ([torch.ones(2, 2), np.ones((2, 2))], TypeError, r"`matrices\[1\]`.*ndarray"),
        ([torch.ones(2, 2, dtype=torch.bool)], TypeError, "floating dtype.*bool"),
        ([torch.ones(2, 2, dtype=torch.complex64)], TypeError, "floating dtype.*complex64"),
    ],
)
def test_sum_gramians_refuses_bad_matrices(
    matrices: list[Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        sum_gramians(matrices)


@pytest.mark.parametrize("shape", [(0, 0), (0,), (0, 3, 2)])
def test_sum_gramians_of_empty_matrices_is_an_empty_gramian(shape: tuple[int, ...]) -> None:
    assert torch.equal(sum_gramians([torch.empty(shape)]), torch.empty(0, 0))
    assert torch.equal(sum_gramians([torch.empty(shape), torch.empty(0, 5)]), torch.empty(0, 0))
    torch.testing.assert_close(sum_gramians([torch.ones(2, 0), torch.ones(2, 1)]), torch.ones(2, 2))
