"""ReLoBRaLo over a short training loop against a hand-written reference of the paper's rule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from jacflow.scalarization import ReLoBRaLo
from tests.scalarization._training import train, weighted


def _balance(current: list[float], reference: list[float], t: float) -> list[float]:
    ratios = [c / (t * r + 1e-12) for c, r in zip(current, reference)]
    top = max(ratios)
    exps = [math.exp(x - top) for x in ratios]
    return [len(current) * e / sum(exps) for e in exps]


class ReLoBRaLoReference:
    def __init__(self, alpha: float, rho: float, temperature: float) -> None:
        self.alpha, self.rho, self.t = alpha, rho, temperature
        self.initial: list[float] | None = None
        self.previous: list[float] = []
        self.lam: list[float] = []
        self.lookbacks: list[bool] = []

    def __call__(self, losses: Tensor) -> Tensor:
        current = losses.detach().tolist()
        if self.initial is None:
            self.initial, lam = current, [1.0] * len(current)
        else:
            keep = bool(torch.rand(()) < self.rho)  # the Bernoulli(rho) lookback draw
            self.lookbacks.append(keep)
            to_start = _balance(current, self.initial, self.t)
            recent = _balance(current, self.previous, self.t)
            history = self.lam if keep else to_start
            lam = [self.alpha * h + (1 - self.alpha) * r for h, r in zip(history, recent)]
        self.previous, self.lam = current, lam
        return weighted(losses, lam)


@pytest.mark.parametrize(
    ("alpha", "rho", "temperature"),
    [(0.999, 0.999, 0.1), (0.5, 0.5, 1.0), (0.9, 0.0, 0.5), (0.0, 1.0, 0.1)],
)
def test_training_loop_matches_reference(alpha: float, rho: float, temperature: float) -> None:
    rl, ref = ReLoBRaLo(alpha, rho, temperature), ReLoBRaLoReference(alpha, rho, temperature)
    torch.manual_seed(5)
    values, theta = train(rl, epochs=3)
    torch.manual_seed(5)
    ref_values, ref_theta = train(ref, epochs=3)
    assert values == pytest.approx(ref_values, rel=1e-12)
    torch.testing.assert_close(theta, ref_theta)
    if rho == 0.5:
        assert len(set(ref.lookbacks)) == 2  # both branches of the lookback were exercised


def test_weights_sum_to_m_and_carry_no_gradient() -> None:
    rl = ReLoBRaLo(alpha=0.7, rho=0.3, temperature=0.5)
    rl(torch.tensor([1.0, 2.0, 3.0]))
    losses = torch.tensor([0.5, 2.5, 2.0], requires_grad=True)
    (grad,) = torch.autograd.grad(rl(losses), losses)
    assert grad.sum().item() == pytest.approx(3.0, rel=1e-6)
    assert grad[1] > grad[2] > grad[0]  # the loss that rose most relative to before gets most


def test_an_evaluation_call_uses_the_expected_lookback_and_draws_nothing() -> None:
    """An evaluation call drew a look-back from torch's generator and replaced the state."""
    rl = ReLoBRaLo(alpha=0.5, rho=0.25, temperature=1.0)
    rl(torch.tensor([1.0, 1.0]))
    rl.eval()
    generator = torch.random.get_rng_state()
    losses = [2.0, 1.0]
    exps = [math.exp(v) for v in losses]  # L / (T L_ref) with both references [1, 1]
    balanced = [2 * e / sum(exps) for e in exps]
    history = [0.25 * 1.0 + 0.75 * b for b in balanced]  # E[rho] lambda + (1 - E[rho]) bal
    weights = [0.5 * h + 0.5 * b for h, b in zip(history, balanced)]
    value = rl(torch.tensor(losses))
    assert value.item() == pytest.approx(sum(w * v for w, v in zip(weights, losses)), rel=1e-6)
    assert torch.equal(torch.random.get_rng_state(), generator)
