"""FAMO over a short training loop against a reference that uses autograd and torch.optim.Adam."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from jacflow.scalarization import FAMO
from tests.scalarization._training import train

EPS = 1e-8


class FAMOReference:
    def __init__(self, m: int, min_losses: Tensor, lr: float, weight_decay: float) -> None:
        self.w = nn.Parameter(torch.zeros(m, dtype=torch.float64))
        self.opt = torch.optim.Adam([self.w], lr=lr, weight_decay=weight_decay)
        self.b = min_losses
        self.before: Tensor | None = None

    def __call__(self, losses: Tensor) -> Tensor:
        z = torch.softmax(self.w, dim=0).detach()
        gap = losses - self.b + EPS
        c = 1.0 / (z / gap.detach()).sum()
        self.before = losses.detach()
        return (c * z * torch.log(gap)).sum()

    def update(self, new_losses: Tensor) -> None:
        assert self.before is not None
        delta = torch.log(self.before - self.b + EPS) - torch.log(new_losses - self.b + EPS)
        self.opt.zero_grad()
        with torch.enable_grad():
            torch.softmax(self.w, dim=0).backward(delta)
        self.opt.step()


@pytest.mark.parametrize(("lr", "weight_decay"), [(0.025, 1e-3), (0.3, 0.0)])
def test_training_loop_matches_reference(lr: float, weight_decay: float) -> None:
    b = torch.tensor([0.01, 0.0, 0.02], dtype=torch.float64)
    famo = FAMO(3, min_losses=b, lr=lr, weight_decay=weight_decay)
    ref = FAMOReference(3, b, lr, weight_decay)
    values, theta = train(famo, epochs=3, after_step=famo.update)
    ref_values, ref_theta = train(ref, epochs=3, after_step=ref.update)
    assert values == pytest.approx(ref_values, rel=1e-10)
    torch.testing.assert_close(theta, ref_theta)
    torch.testing.assert_close(famo.logits, ref.w.detach())
    assert not torch.equal(famo.logits, torch.zeros(3, dtype=torch.float64))


def test_gradient_is_the_normalised_convex_combination() -> None:
    famo = FAMO(3)
    with torch.no_grad():
        famo.logits.copy_(torch.tensor([0.2, -0.1, 0.4]))
    losses = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(famo(losses), losses)
    z = torch.softmax(torch.tensor([0.2, -0.1, 0.4], dtype=torch.float64), dim=0)
    coefficients = z / (losses.detach() + EPS)
    torch.testing.assert_close(grad, coefficients / coefficients.sum())
    assert grad.sum().item() == pytest.approx(1.0)


def test_update_requires_a_call_first() -> None:
    famo = FAMO(2)
    with pytest.raises(ValueError, match="must follow a call"):
        famo.update(torch.ones(2))
    famo(torch.ones(2))
    famo.update(torch.full((2,), 0.5))
    with pytest.raises(ValueError, match="must follow a call"):
        famo.update(torch.ones(2))  # one update per call
    with pytest.raises(ValueError, match="`new_losses`"):
        famo(torch.ones(2))
        famo.update(torch.ones(3))


def test_logits_are_buffers_not_parameters() -> None:
    famo = FAMO(2)
    assert list(famo.parameters()) == []
    assert {name for name, _ in famo.named_buffers()} >= {"logits", "min_losses"}
