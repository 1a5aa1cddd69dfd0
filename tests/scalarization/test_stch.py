"""STCH against the paper's formula, its bounds around the Tchebycheff value, and stability."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jacflow.scalarization import STCH, Tchebycheff


def reference(losses: list[float], mu: float, weights: list[float], ref: list[float]) -> float:
    terms = [w * (f - z) / mu for f, w, z in zip(losses, weights, ref)]
    top = max(terms)
    return mu * (top + math.log(math.fsum(math.exp(t - top) for t in terms)))


def test_value_with_weights_and_reference(dtype: torch.dtype) -> None:
    f, w, z = [1.0, 3.0, 2.0], [0.5, 0.2, 0.3], [0.5, 1.0, 0.0]
    out = STCH(0.4, torch.tensor(w), torch.tensor(z))(torch.tensor(f, dtype=dtype))
    assert out.dtype == dtype
    assert math.isclose(out.item(), reference(f, 0.4, w, z), rel_tol=1e-6)


def test_default_preference_is_uniform() -> None:
    f = [1.0, 3.0]
    expected = reference(f, 0.5, [0.5, 0.5], [0, 0])
    assert math.isclose(STCH(0.5)(torch.tensor(f)).item(), expected, rel_tol=1e-6)


def test_gradient_is_softmax_of_scaled_terms() -> None:
    f = torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([0.5, 0.2, 0.3], dtype=torch.float64)
    STCH(0.25, w)(f).backward()
    expected = w * torch.softmax(w * f.detach() / 0.25, dim=0)
    torch.testing.assert_close(f.grad, expected)


def test_no_overflow_for_large_losses_and_small_mu() -> None:
    losses = torch.tensor([1e4, 2e4], dtype=torch.float32)
    out = STCH(1e-3)(losses)
    assert math.isclose(out.item(), 1e4, rel_tol=1e-6)  # = max(w * f) = 0.5 * 2e4


def test_shape_mismatch_names_reference() -> None:
    with pytest.raises(ValueError, match="`reference`"):
        STCH(1.0, reference=torch.zeros(2))(torch.ones(3))


@settings(max_examples=30)
@given(
    st.lists(st.floats(-100, 100), min_size=1, max_size=6),
    st.floats(1e-3, 10.0),
    st.randoms(),
)
def test_between_tchebycheff_and_tchebycheff_plus_mu_log_m(values, mu, rnd) -> None:  # type: ignore[no-untyped-def]
    losses = torch.tensor(values, dtype=torch.float64)
    tch = Tchebycheff()(losses).item()
    stch = STCH(mu)(losses).item()
    assert tch - 1e-9 <= stch <= tch + mu * math.log(len(values)) + 1e-9
    # permuting the losses does not change the (uniformly weighted) value
    shuffled = values[:]
    rnd.shuffle(shuffled)
    assert math.isclose(
        STCH(mu)(torch.tensor(shuffled, dtype=torch.float64)).item(),
        stch,
        rel_tol=1e-12,
        abs_tol=1e-9,
    )
