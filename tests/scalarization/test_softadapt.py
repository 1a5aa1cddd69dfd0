"""SoftAdapt's four variants over a short training loop against a hand-written reference."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from jacflow.scalarization import SoftAdapt
from tests.scalarization._training import train, weighted


class SoftAdaptReference:
    def __init__(self, beta: float, normalized: bool, loss_weighted: bool) -> None:
        self.beta, self.normalized, self.loss_weighted = beta, normalized, loss_weighted
        self.previous: list[float] | None = None

    def __call__(self, losses: Tensor) -> Tensor:
        current = losses.detach().tolist()
        slopes = (
            [0.0] * len(current)
            if self.previous is None
            else [c - p for c, p in zip(current, self.previous)]
        )
        self.previous = current
        if self.normalized:
            total = max(sum(abs(s) for s in slopes), 1e-8)
            slopes = [s / total for s in slopes]
        top = max(self.beta * s for s in slopes)
        exps = [math.exp(self.beta * s - top) for s in slopes]
        if self.loss_weighted:
            exps = [c * e for c, e in zip(current, exps)]
        return weighted(losses, [e / sum(exps) for e in exps])


@pytest.mark.parametrize("normalized", [False, True])
@pytest.mark.parametrize("loss_weighted", [False, True])
@pytest.mark.parametrize("beta", [0.1, 5.0, -2.0])
def test_training_loop_matches_reference(
    beta: float, normalized: bool, loss_weighted: bool
) -> None:
    sa = SoftAdapt(beta, normalized=normalized, loss_weighted=loss_weighted)
    ref = SoftAdaptReference(beta, normalized, loss_weighted)
    values, theta = train(sa, epochs=3)
    ref_values, ref_theta = train(ref, epochs=3)
    assert values == pytest.approx(ref_values, rel=1e-12)
    torch.testing.assert_close(theta, ref_theta)


def test_gradient_is_the_weights_and_favours_the_slowest_loss() -> None:
    sa = SoftAdapt(beta=1.0)
    sa(torch.tensor([2.0, 2.0, 2.0]))
    losses = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    (grad,) = torch.autograd.grad(sa(losses), losses)
    torch.testing.assert_close(grad, torch.softmax(torch.tensor([-1.0, 0.0, 1.0]), dim=0))
    assert grad.sum().item() == pytest.approx(1.0)


def test_loss_weighted_with_every_loss_zero_falls_back_to_the_softmax() -> None:
    """``L_i e^{b s_i} / sum_j L_j e^{b s_j}`` is 0/0 when every loss is zero (it gave NaN):
    the weights are then ``softmax(b s)``, which sum to 1."""
    sa = SoftAdapt(beta=1.0, loss_weighted=True)
    sa(torch.tensor([1.0, 2.0]))
    losses = torch.zeros(2, requires_grad=True)
    (grad,) = torch.autograd.grad(sa(losses), losses)
    torch.testing.assert_close(grad, torch.softmax(torch.tensor([-1.0, -2.0]), dim=0))


@pytest.mark.parametrize("normalized", [False, True])
def test_negative_losses_are_kept_without_loss_weighting(normalized: bool) -> None:
    """The slopes are differences: defined for losses of any sign (only ``loss_weighted``
    multiplies by the losses and refuses a negative one)."""
    sa = SoftAdapt(beta=1.0, normalized=normalized)
    sa(torch.tensor([-1.0, 2.0]))
    losses = torch.tensor([-3.0, 2.5], requires_grad=True)
    sa(losses).backward()
    slopes = [-2.0, 0.5]
    if normalized:
        slopes = [s / 2.5 for s in slopes]
    exps = [math.exp(s) for s in slopes]
    expected = [e / sum(exps) for e in exps]
    assert losses.grad is not None
    assert losses.grad.tolist() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("normalized", [False, True])
def test_half_precision_losses_give_the_float32_weights(
    dtype: torch.dtype, normalized: bool
) -> None:
    """float16 read the slopes' floor 1e-8 as 0: with zero slopes (the first call, or the same
    losses again) ``normalized=True`` divided 0 by 0 and returned NaN."""
    rows = [[0.5, 1.0, 2.0], [0.5, 1.0, 2.0], [0.25, 1.0, 3.0]]
    half, reference = (
        SoftAdapt(beta=1.0, normalized=normalized),
        SoftAdaptReference(1.0, normalized, False),
    )
    for row in rows:
        losses = torch.tensor(row, dtype=dtype, requires_grad=True)
        value = half(losses)
        value.backward()
        exact = torch.tensor(row, dtype=torch.float64, requires_grad=True)
        reference(exact).backward()
        assert value.dtype == dtype
        assert losses.grad is not None and exact.grad is not None
        torch.testing.assert_close(losses.grad.double(), exact.grad, rtol=1e-2, atol=1e-3)


def test_an_evaluation_call_takes_its_slopes_from_the_last_training_call() -> None:
    """An evaluation call became the previous losses of the next training call's slopes."""
    sa = SoftAdapt(beta=1.0)
    sa(torch.tensor([2.0, 2.0]))
    sa.eval()
    expected = (math.exp(-1.0) * 1.0 + 1.0 * 2.0) / (math.exp(-1.0) + 1.0)  # slopes [-1, 0]
    assert sa(torch.tensor([1.0, 2.0])).item() == pytest.approx(expected, rel=1e-6)
    assert sa(torch.tensor([5.0, 5.0])).item() == pytest.approx(5.0, rel=1e-6)  # slopes [3, 3]
    sa.train()
    assert sa(torch.tensor([1.0, 2.0])).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("beta", [100.0, -100.0])
def test_slopes_whose_product_with_beta_overflows_give_the_softmax_limit(beta: float) -> None:
    """``beta * s`` above float32's range (finite losses and slopes) made the softmax inf - inf:
    the value was NaN, a step that an AMP ``GradScaler`` skips, from finite losses."""
    rows = [[0.0, 1.0, 2.0], [1e37, 1.0, 2.0]]
    single, double = SoftAdapt(beta=beta), SoftAdapt(beta=beta)
    for row in rows:
        value = single(torch.tensor(row))
        expected = double(torch.tensor(row, dtype=torch.float64))  # (beta * s fits float64)
    assert bool(torch.isfinite(value))
    torch.testing.assert_close(value, expected.float())
