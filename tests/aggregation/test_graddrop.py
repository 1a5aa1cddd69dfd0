"""GradDrop against a literal coordinate-by-coordinate implementation of the paper."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from jacflow.aggregation import GradDrop, Sum
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    make_jacobian,
)


def literal_graddrop(J: Tensor, draws: Tensor, leak: list[float] | None) -> Tensor:
    """Chen et al. (2020), Algorithm 1 lines 10-15, one coordinate and one row at a time."""
    m, n = J.shape
    out = torch.zeros(n, dtype=J.dtype)
    for k in range(n):
        column = J[:, k].tolist()
        total = sum(abs(x) for x in column)
        purity = 0.5 * (1 + sum(column) / total) if total > 0 else 0.5
        for i in range(m):
            keep = (purity > draws[k] and column[i] > 0) or (purity < draws[k] and column[i] < 0)
            ell = 0.0 if leak is None else leak[i]
            out[k] += (ell + (1 - ell) * float(keep)) * column[i]
    return out


def test_claimed_properties() -> None:
    check_claimed_properties(GradDrop)


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(GradDrop)


@settings(max_examples=30)
@given(st.integers(1, 6), st.integers(1, 8), st.integers(0, 2**31 - 1), st.booleans())
def test_matches_the_literal_algorithm(m: int, n: int, seed: int, with_leak: bool) -> None:
    J = make_jacobian(m, n, min(m, n), 1.0, torch.float64, seed)
    leak = [0.1 * (i % 4) for i in range(m)] if with_leak else None
    torch.manual_seed(seed)
    draws = torch.rand(n, dtype=torch.float64)
    torch.manual_seed(seed)
    out = GradDrop(leak=None if leak is None else torch.tensor(leak))(J)
    torch.testing.assert_close(out, literal_graddrop(J, draws, leak))


def test_agreeing_signs_are_summed() -> None:
    J = torch.rand(5, 7) + 0.1
    torch.testing.assert_close(GradDrop()(J), J.sum(dim=0))
    torch.testing.assert_close(GradDrop()(-J), -J.sum(dim=0))


def test_full_leak_is_the_sum() -> None:
    J = torch.randn(4, 9, dtype=torch.float64)
    torch.testing.assert_close(GradDrop(leak=torch.ones(4))(J), Sum()(J))


def test_f_reshapes_the_keep_probability() -> None:
    J = torch.tensor([[-4.0, 1.0], [6.0, -1.0]])
    keep_positive = GradDrop(f=lambda p: torch.ones_like(p))(J)
    keep_negative = GradDrop(f=lambda p: torch.zeros_like(p))(J)
    torch.testing.assert_close(keep_positive, torch.tensor([6.0, 1.0]))
    torch.testing.assert_close(keep_negative, torch.tensor([-4.0, -1.0]))


def test_documented_value() -> None:
    torch.manual_seed(0)
    out = GradDrop()(torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]]))
    torch.testing.assert_close(out, torch.tensor([6.0, 2.0, 2.0]))


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"`leak` must be None or a vector"):
        GradDrop(leak=torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"`leak` values must lie in \[0, 1\]"):
        GradDrop(leak=torch.tensor([0.5, 1.5]))
    with pytest.raises(TypeError, match="`f` must be callable"):
        GradDrop(f=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one leak value per objective"):
        GradDrop(leak=torch.tensor([0.5, 0.5]))(torch.ones(3, 2))


def test_repr_and_str() -> None:
    assert repr(GradDrop()) == "GradDrop(f=identity, leak=None)"
    assert str(GradDrop()) == "GradDrop"
