"""LBTW over a short training loop against a hand-written reference; gradient = weights."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from jacflow.scalarization import LBTW
from tests.scalarization._training import train, weighted


class LBTWReference:
    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.initial: list[float] | None = None

    def __call__(self, losses: Tensor) -> Tensor:
        current = losses.detach().tolist()
        if self.initial is None:
            self.initial = current
        weights = [(c / i) ** self.alpha for c, i in zip(current, self.initial)]
        return weighted(losses, weights)

    def end_epoch(self) -> None:
        self.initial = None


@pytest.mark.parametrize("alpha", [0.5, 0.1, 1.0])
@pytest.mark.parametrize("per_epoch", [True, False])
def test_training_loop_matches_reference(alpha: float, per_epoch: bool) -> None:
    lbtw, ref = LBTW(alpha), LBTWReference(alpha)
    values, theta = train(lbtw, epochs=3, batches=3, end_epoch=lbtw.step if per_epoch else None)
    ref_values, ref_theta = train(
        ref, epochs=3, batches=3, end_epoch=ref.end_epoch if per_epoch else None
    )
    assert values == pytest.approx(ref_values, rel=1e-12)
    torch.testing.assert_close(theta, ref_theta)


def test_gradient_is_the_weights(dtype: torch.dtype) -> None:
    lbtw = LBTW(0.5)
    lbtw(torch.tensor([4.0, 1.0], dtype=dtype))
    losses = torch.tensor([1.0, 4.0], dtype=dtype, requires_grad=True)
    (grad,) = torch.autograd.grad(lbtw(losses), losses)
    torch.testing.assert_close(grad, torch.tensor([0.5, 2.0], dtype=dtype))


def test_a_zero_loss_has_weight_one_on_the_first_call_and_while_it_stays_zero() -> None:
    lbtw = LBTW(alpha=0.5)
    assert float(lbtw(torch.tensor([0.0, 2.0]))) == 2.0  # first call: weights 1 by definition
    assert float(lbtw(torch.tensor([0.0, 0.5]))) == 0.25  # weights [0/0 -> 1, sqrt(1/4)]
    assert float(lbtw(torch.tensor([1.0, 2.0]))) == float("inf")  # (1 / 0) ** 0.5


def test_an_evaluation_call_never_becomes_the_reference() -> None:
    """After step(), a validation call became L(0) for the whole epoch."""
    lbtw = LBTW(alpha=0.5)
    lbtw.eval()
    assert lbtw(torch.tensor([9.0, 1.0])).item() == pytest.approx(10.0)  # no reference: 1
    lbtw.train()
    assert lbtw(torch.tensor([4.0, 2.0])).item() == pytest.approx(6.0)  # the reference
    lbtw.eval()
    # weights sqrt(1/4), sqrt(8/2): against the training reference
    assert lbtw(torch.tensor([1.0, 8.0])).item() == pytest.approx(0.5 + 2.0 * 8.0)
    lbtw.train()
    assert lbtw(torch.tensor([1.0, 2.0])).item() == pytest.approx(0.5 + 2.0)
