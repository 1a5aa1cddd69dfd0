"""The shared helpers of the rules."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jacflow.autogram._rules import gram


@settings(max_examples=30)
@given(
    rows=st.integers(1, 70),
    columns=st.integers(1, 9),
    leaf=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_blocked_gram_equals_full_product(rows: int, columns: int, leaf: int, seed: int) -> None:
    """Every level of the 2 x 2 blocking (odd and even row counts) against ``f @ f.T``."""
    generator = torch.Generator().manual_seed(seed)
    flat = torch.randn(rows, columns, generator=generator, dtype=torch.float64)
    result = gram(flat, leaf=leaf, min_columns=1)
    torch.testing.assert_close(result, flat @ flat.T, rtol=1e-12, atol=1e-12)


def test_default_thresholds_block_wide_matrices_exactly() -> None:
    flat = torch.randn(130, 1100, dtype=torch.float64)
    torch.testing.assert_close(gram(flat), flat @ flat.T, rtol=1e-12, atol=1e-10)
    narrow = torch.randn(130, 10, dtype=torch.float64)
    assert torch.equal(gram(narrow), narrow @ narrow.T)
