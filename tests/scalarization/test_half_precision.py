"""Half-precision losses against the float32 computation of the same formula.

float16 reads the scalarizers' small constants (ReLoBRaLo's 1e-12, AdaLoss's eps = 1e-8,
LogSTCH's 1e-20, a small STCH ``mu``) as 0, and its range ends at 65504: a zero loss or a tiny
running average then gave NaN or inf, and ReLoBRaLo kept NaN weights for the rest of training.
Each case runs the same losses (exactly representable in the half dtype) through a float32 and a
half-precision instance over several calls; the half one must give the float32 value and
gradient rounded to its dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from jacflow.scalarization import COSMOS, LBTW, STCH, AdaLoss, LogSTCH, ReLoBRaLo, Scalarizer

HALF = [torch.float16, torch.bfloat16]


def _call(scalarizer: Scalarizer, row: list[float], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The value of the losses ``row`` in ``dtype``, and their gradient."""
    losses = torch.tensor(row, dtype=dtype, requires_grad=True)
    value = scalarizer(losses)
    value.backward()
    assert losses.grad is not None
    return value.detach(), losses.grad


def _compare(
    make: Callable[[], Scalarizer],
    rows: list[list[float]],
    dtype: torch.dtype,
    between: Callable[[Scalarizer, Scalarizer, int], None] | None = None,
) -> tuple[Scalarizer, Scalarizer]:
    half, single = make(), make()
    for index, row in enumerate(rows):
        rounded = torch.tensor(row, dtype=dtype).tolist()  # (the same inputs for both)
        torch.manual_seed(index)
        value, grad = _call(half, rounded, dtype)
        torch.manual_seed(index)
        expected_value, expected_grad = _call(single, rounded, torch.float32)
        assert value.dtype == dtype and grad.dtype == dtype
        assert bool(torch.isfinite(value)), (index, value)
        assert bool(torch.isfinite(expected_value)), (index, expected_value)
        # (the float32 value, rounded to the half dtype; ReLoBRaLo sums in the half dtype)
        torch.testing.assert_close(
            value.float(), expected_value.to(dtype).float(), rtol=1.6e-2, atol=1e-5
        )
        assert bool(torch.isfinite(grad).all()), (index, grad)
        # (the float32 gradient, rounded to the half dtype once)
        torch.testing.assert_close(grad, expected_grad.to(dtype), rtol=0, atol=0)
        if between is not None:
            between(half, single, index)
    return half, single


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("alpha", "rho", "temperature"), [(0.999, 0.999, 0.1), (0.5, 0.5, 1.0)])
def test_relobralo_with_zero_losses_gives_the_float32_weights_and_keeps_them_finite(
    dtype: torch.dtype, alpha: float, rho: float, temperature: float
) -> None:
    """A loss of 0 in L(0) or L(t-1) divided 0 by 0 in float16, and the NaN weights were kept."""
    rows = [
        [0.0, 1.0, 2.0],
        [0.5, 1.0, 0.0],
        [0.25, 0.5, 1e-4],
        [0.0, 0.25, 0.5],
        [0.125, 0.0, 0.0],
        [0.0625, 0.125, 0.25],
    ]

    def same_state(half: Scalarizer, single: Scalarizer, index: int) -> None:
        assert isinstance(half, ReLoBRaLo) and isinstance(single, ReLoBRaLo)
        assert half._lambda is not None and single._lambda is not None
        assert bool(torch.isfinite(half._lambda).all()), (index, half._lambda)
        torch.testing.assert_close(half._lambda.float(), single._lambda, rtol=0, atol=0)

    _compare(lambda: ReLoBRaLo(alpha, rho, temperature), rows, dtype, same_state)


@pytest.mark.parametrize("dtype", HALF)
def test_relobralo_keeps_no_non_finite_weights(dtype: torch.dtype) -> None:
    """Ratios that overflow (a huge loss over a zero reference) give the softmax's limit, not
    NaN weights that every later call would inherit."""
    rl = ReLoBRaLo(alpha=0.5, rho=1.0, temperature=1.0)
    rl(torch.tensor([0.0, 1.0], dtype=torch.float64))
    value = rl(torch.tensor([1e300, 1.0], dtype=torch.float64))
    assert rl._lambda is not None and bool(torch.isfinite(rl._lambda).all())
    assert bool(torch.isfinite(value))
    # (then half-precision calls go on from that finite state)
    for row in ([0.5, 1.0], [0.0, 0.25]):
        value = rl(torch.tensor(row, dtype=dtype))
        assert bool(torch.isfinite(value)) and bool(torch.isfinite(rl._lambda).all())


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("eps", [1e-8, 0.0])
def test_adaloss_with_zero_and_tiny_averages_gives_the_float32_value(
    dtype: torch.dtype, eps: float
) -> None:
    """float16 read eps = 1e-8 as 0 (0 / 0 for a zero average), and 1 / average overflowed its
    65504 for an average below about 1.5e-5. A weight beyond the dtype's range is the largest
    finite gradient there."""
    rows = [[1e-5, 2.0, 0.5], [2e-5, 1.0, 0.25], [1e-4, 0.5, 0.125], [1e-5, 0.25, 0.0625]]
    if eps > 0:  # (a zero average needs eps: 1 / 0 in float32 too)
        rows = [[0.0, *row[1:]] if i < 2 else row for i, row in enumerate(rows)]
    half, single = AdaLoss(momentum=0.9, eps=eps), AdaLoss(momentum=0.9, eps=eps)
    for row in rows:
        rounded = torch.tensor(row, dtype=dtype).tolist()
        value, grad = _call(half, rounded, dtype)
        expected_value, expected_grad = _call(single, rounded, torch.float32)
        assert bool(torch.isfinite(value)) and bool(torch.isfinite(grad).all()), (value, grad)
        torch.testing.assert_close(value, expected_value.to(dtype), rtol=0, atol=0)
        largest = torch.finfo(dtype).max
        torch.testing.assert_close(grad, expected_grad.clamp(max=largest).to(dtype), rtol=0, atol=0)
        assert half._average is not None and single._average is not None
        torch.testing.assert_close(half._average, single._average, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mu", [1.0, 0.1])
def test_log_stch_with_zero_losses_gives_the_float32_value_and_gradient(
    dtype: torch.dtype, mu: float
) -> None:
    """After calibration, float16 took log(0 + 1e-20) = -inf: a zero softmax weight times the
    infinite derivative of the log made the gradient NaN."""
    warmup = [[2.0, 0.5, 1.0], [1.0, 0.25, 0.5]]
    calibration = [[2.0, 0.5, 1.0], [1.0, 1.0, 0.5]]
    after = [[1.0, 0.0, 0.5], [0.0, 0.0, 0.25], [0.5, 1e-4, 0.0], [0.25, 0.125, 1e-3]]
    rows = warmup + calibration + after

    def epochs(half: Scalarizer, single: Scalarizer, index: int) -> None:
        if index in (len(warmup) - 1, len(warmup) + len(calibration) - 1):
            assert isinstance(half, LogSTCH) and isinstance(single, LogSTCH)
            half.step()
            single.step()

    half, _ = _compare(lambda: LogSTCH(mu=mu, warmup_epochs=1), rows, dtype, epochs)
    assert isinstance(half, LogSTCH) and half.nadir is not None


@pytest.mark.parametrize("dtype", HALF)
def test_log_stch_warmup_value_of_a_zero_loss_is_finite(dtype: torch.dtype) -> None:
    """float16 read log(0 + 1e-20) as -inf; float32's value log(1e-20) is about -46. (The
    gradient 1e20 is beyond float16's range: the float32 one rounded, as documented.)"""
    value = LogSTCH(mu=1.0)(torch.tensor([0.0, 1.0], dtype=dtype))
    assert value.dtype == dtype
    expected = LogSTCH(mu=1.0)(torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(value, expected.to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mu", [1e-9, 1e-2])
def test_stch_with_a_small_mu_gives_the_float32_gradient(dtype: torch.dtype, mu: float) -> None:
    """float16 read mu = 1e-9 as 0: the gradient of mu * logsumexp(...) was 0 for every loss."""
    rows = [[0.0, 1e-5], [1e-3, 0.0], [0.5, 0.25]]
    _compare(lambda: STCH(mu=mu), rows, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_cosmos_with_small_losses_gives_the_float32_gradient(dtype: torch.dtype) -> None:
    """The squares of float16 losses below about 2e-4 underflow in the norm's backward: the
    gradient was NaN."""
    rows = [[0.0, 1e-5], [1e-4, 2e-4], [0.5, 0.25]]
    _compare(lambda: COSMOS(1.0, torch.tensor([1.0, 2.0])), rows, dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("alpha", [0.5, 0.1])
def test_lbtw_with_a_large_loss_ratio_gives_the_float32_value_and_gradient(
    dtype: torch.dtype, alpha: float
) -> None:
    """The ratio 100 / 1e-3 overflowed float16 (inf weight, inf value) although the weight
    (1e5) ** alpha and the value fit; bfloat16 rounded the ratio to 3 significant digits."""
    rows = [[1e-3, 1.0], [100.0, 0.5], [30.0, 0.25]]
    _compare(lambda: LBTW(alpha), rows, dtype)
