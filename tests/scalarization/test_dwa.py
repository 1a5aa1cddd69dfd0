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
