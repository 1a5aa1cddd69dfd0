"""AdaLoss over a short training loop against a hand-written EMA reference; gradient = weights."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from jacflow.scalarization import AdaLoss
from tests.scalarization._training import train, weighted


class AdaLossReference:
    def __init__(self, momentum: float, eps: float) -> None:
        self.momentum, self.eps = momentum, eps
        self.average: list[float] | None = None

    def __call__(self, losses: Tensor) -> Tensor:
        current = losses.detach().tolist()
        if self.average is None:
            self.average = current
        else:
            b = self.momentum
            self.average = [b * a + (1 - b) * c for a, c in zip(self.average, current)]
        return weighted(losses, [1 / (a + self.eps) for a in self.average])


@pytest.mark.parametrize(("momentum", "eps"), [(0.9, 1e-8), (0.0, 0.0), (0.5, 0.1)])
def test_training_loop_matches_reference(momentum: float, eps: float) -> None:
    ada, ref = AdaLoss(momentum, eps), AdaLossReference(momentum, eps)
    values, theta = train(ada, epochs=3)
    ref_values, ref_theta = train(ref, epochs=3)
    assert values == pytest.approx(ref_values, rel=1e-12)
    torch.testing.assert_close(theta, ref_theta)


def test_gradient_is_the_inverse_average(dtype: torch.dtype) -> None:
    ada = AdaLoss(momentum=0.5, eps=0.0)
    ada(torch.tensor([1.0, 8.0], dtype=dtype))
    losses = torch.tensor([3.0, 8.0], dtype=dtype, requires_grad=True)
    (grad,) = torch.autograd.grad(ada(losses), losses)
    torch.testing.assert_close(grad, torch.tensor([0.5, 0.125], dtype=dtype))


def test_scale_invariance_of_the_first_step() -> None:
    losses = torch.tensor([0.01, 1.0, 100.0])
    assert AdaLoss()(losses).item() == pytest.approx(3.0, rel=1e-6)


def test_an_evaluation_call_divides_by_the_averages_as_they_are() -> None:
    """An evaluation call was averaged into the running averages (as BatchNorm's statistics
    must not be)."""
    ada = AdaLoss(momentum=0.5)
    ada.eval()
    assert ada(torch.tensor([4.0, 10.0])).item() == pytest.approx(2.0)  # none yet: L / L
    ada.train()
    ada(torch.tensor([1.0, 10.0]))
    ada.eval()
    assert ada(torch.tensor([3.0, 10.0])).item() == pytest.approx(3.0 / 1.0 + 10.0 / 10.0)
    ada.train()
    assert ada(torch.tensor([3.0, 10.0])).item() == pytest.approx(3.0 / 2.0 + 10.0 / 10.0)
