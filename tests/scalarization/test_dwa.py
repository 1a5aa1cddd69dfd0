"""DWA over a short training loop against a hand-written reference of its update rule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from jacflow.scalarization import DWA
from tests.scalarization._training import train, weighted


class DWAReference:
    def __init__(self, temperature: float) -> None:
        self.t = temperature
        self.epoch_losses: list[list[float]] = []
        self.averages: list[list[float]] = []
        self.seen_weights: list[list[float]] = []

    def __call__(self, losses: Tensor) -> Tensor:
        k = losses.numel()
        if len(self.averages) < 2:
            weights = [1.0] * k
        else:
            rates = [new / old for new, old in zip(self.averages[-1], self.averages[-2])]
            exps = [math.exp(r / self.t) for r in rates]
            weights = [k * e / sum(exps) for e in exps]
        self.seen_weights.append(weights)
        self.epoch_losses.append(losses.detach().tolist())
        return weighted(losses, weights)

    def end_epoch(self) -> None:
        n = len(self.epoch_losses)
        self.averages.append([sum(col) / n for col in zip(*self.epoch_losses)])
        self.epoch_losses = []


@pytest.mark.parametrize("temperature", [2.0, 0.5])
def test_training_loop_matches_reference(temperature: float) -> None:
    dwa, ref = DWA(temperature), DWAReference(temperature)
    values, theta = train(dwa, epochs=4, end_epoch=dwa.step)
    ref_values, ref_theta = train(ref, epochs=4, end_epoch=ref.end_epoch)
    assert values == pytest.approx(ref_values, rel=1e-12)
    torch.testing.assert_close(theta, ref_theta)
    # the last two epochs use non-uniform weights summing to K
    assert ref.seen_weights[-1] != pytest.approx([1.0, 1.0, 1.0])
    assert sum(ref.seen_weights[-1]) == pytest.approx(3.0)


def test_weights_are_uniform_for_two_epochs_and_step_without_calls_is_ignored() -> None:
    dwa = DWA()
    ones = torch.ones(3)
    dwa.step()  # nothing seen: ignored
    for epoch_losses in ([2.0, 2.0, 2.0], [1.0, 2.0, 4.0]):
        assert torch.equal(dwa.weights(ones), ones)
        dwa(torch.tensor(epoch_losses))
        dwa.step()
    w = dwa.weights(ones)
    assert w[0] < w[1] < w[2]  # the loss that went up gets the largest weight


@pytest.mark.parametrize(("first", "second"), [(1, 2), (2, 3), (3, 2)])
def test_a_loss_count_other_than_the_kept_averages_is_refused_before_any_change(
    first: int, second: int
) -> None:
    dwa = DWA()
    dwa(torch.ones(first))
    dwa.step()  # one kept average of `first` losses, no epoch sum
    with pytest.raises(ValueError, match=rf"shape \({first},\).*shape \({second},\).*reset"):
        dwa(torch.ones(second))
    with pytest.raises(ValueError, match="reset"):
        dwa.weights(torch.ones(second))
    # nothing was added: the next epoch with the right count is unaffected
    dwa(torch.full((first,), 2.0))
    dwa.step()
    assert dwa._epoch_sum is None
    assert [a.tolist() for a in dwa._averages] == [[1.0] * first, [2.0] * first]
    # one loss: K = 1 so the weight is exactly 1 whatever the rates (paper: weights sum to K)
    if first == 1:
        loss = torch.tensor([5.0], requires_grad=True)
        dwa(loss).backward()
        assert loss.grad is not None and loss.grad.tolist() == [1.0]


def test_zero_averages_give_rate_one_and_a_rise_from_zero_takes_all_the_weight() -> None:
    dwa = DWA(temperature=2.0)
    for losses in ([0.0, 2.0], [0.0, 1.0]):
        dwa(torch.tensor(losses))
        dwa.step()
    # rates [0/0 -> 1, 1/2]: 2 softmax([0.5, 0.25]) by hand
    e = [math.exp(0.5), math.exp(0.25)]
    expected = [2 * x / sum(e) for x in e]
    assert torch.allclose(dwa.weights(torch.ones(2)), torch.tensor(expected))
    dwa(torch.tensor([1.0, 1.0]))
    dwa.step()  # rates [1/0 = inf, 1]: the limit of the softmax puts K = 2 on the first loss
    assert dwa.weights(torch.ones(2)).tolist() == [2.0, 0.0]


@pytest.mark.parametrize("temperature", [1e-40, 1e-300])
def test_a_vanishing_temperature_gives_the_softmax_limit(temperature: float) -> None:
    """``rate / T`` overflows: the weights are the limit (``K`` shared by the largest rates),
    as the softmax's value is for a temperature that does not overflow (it gave NaN)."""
    dwa = DWA(temperature=temperature)
    for losses in ([2.0, 2.0, 1.0], [4.0, 4.0, 1.0]):
        dwa(torch.tensor(losses))
        dwa.step()
    assert dwa.weights(torch.ones(3)).tolist() == [1.5, 1.5, 0.0]
    near = DWA(temperature=1e-3)  # (rates [2, 2, 1]: the same weights, without overflow)
    for losses in ([2.0, 2.0, 1.0], [4.0, 4.0, 1.0]):
        near(torch.tensor(losses))
        near.step()
    assert near.weights(torch.ones(3)).tolist() == [1.5, 1.5, 0.0]


def test_half_precision_losses_are_summed_in_float32() -> None:
    """A float16 epoch sum stops growing at 2048 (and overflows at 65504): the averages, hence
    the weights, are those of float32 losses."""
    weights = []
    for dtype in (torch.float32, torch.float16):
        dwa = DWA(temperature=2.0)
        for first in (1.0, 0.8):
            for _ in range(3000):
                dwa(torch.tensor([first, 1.0], dtype=dtype))
            dwa.step()
        weights.append(dwa.weights(torch.ones(2)))
    torch.testing.assert_close(weights[1], weights[0], rtol=0, atol=1e-3)
    big = DWA()
    for _ in range(2):
        for _ in range(1000):
            big(torch.tensor([100.0, 1.0], dtype=torch.float16))
        big.step()
    torch.testing.assert_close(big.weights(torch.ones(2)), torch.ones(2))


def test_an_evaluation_call_uses_the_weights_and_adds_nothing_to_the_epoch() -> None:
    """An evaluation call went into the epoch's average, and so into the next epochs' weights."""
    dwa = DWA()
    for epoch_losses in ([4.0, 2.0], [2.0, 1.5]):
        dwa(torch.tensor(epoch_losses))
        dwa.step()
    dwa.eval()
    rates = [2.0 / 4.0, 1.5 / 2.0]
    exps = [math.exp(r / 2.0) for r in rates]
    weights = [2 * e / sum(exps) for e in exps]
    value = dwa(torch.tensor([1.0, 3.0]))
    assert value.item() == pytest.approx(weights[0] * 1.0 + weights[1] * 3.0, rel=1e-6)
    dwa.step()  # (an epoch of evaluation calls only is ignored)
    dwa.train()
    assert dwa(torch.tensor([1.0, 3.0])).item() == pytest.approx(value.item(), rel=1e-6)
