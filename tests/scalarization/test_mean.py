"""Mean against its definition, and its scale/permutation behaviour."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jacflow.scalarization import Mean

finite = st.floats(-1e3, 1e3, allow_nan=False)


def test_value_and_gradient(dtype: torch.dtype) -> None:
    losses = torch.tensor([[1.0, 2.0], [4.0, 9.0]], dtype=dtype, requires_grad=True)
    out = Mean()(losses)
    assert out.item() == (1.0 + 2.0 + 4.0 + 9.0) / 4
    out.backward()
    assert losses.grad is not None
    assert torch.equal(losses.grad, torch.full((2, 2), 0.25, dtype=dtype))


@settings(max_examples=25)
@given(st.lists(finite, min_size=1, max_size=6), st.floats(0.1, 10.0), st.randoms())
def test_scale_and_permutation(values: list[float], c: float, rnd) -> None:  # type: ignore[no-untyped-def]
    losses = torch.tensor(values, dtype=torch.float64)
    shuffled = values[:]
    rnd.shuffle(shuffled)
    assert torch.isclose(Mean()(torch.tensor(shuffled, dtype=torch.float64)), Mean()(losses))
    assert torch.isclose(Mean()(c * losses), c * Mean()(losses))
    assert math.isclose(Mean()(losses).item(), math.fsum(values) / len(values), abs_tol=1e-9)
