"""FAMO over a short training loop against a reference that uses autograd and torch.optim.Adam."""

from __future__ import annotations

import copy
import math

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


def _state(famo: FAMO) -> list[Tensor]:
    return [t.clone() for t in (famo.logits, famo._exp_avg, famo._exp_avg_sq)]


@pytest.mark.parametrize(
    ("bounds", "losses"), [(None, [-0.5, 2.0]), (torch.tensor([1.0, 0.0]), [0.5, 2.0])]
)
def test_a_loss_below_its_bound_is_refused_before_any_change(
    bounds: Tensor | None, losses: list[float]
) -> None:
    # z = [.5, .5], L = [-0.5, 2]: c = 1 / sum(z / L) = -4/3 and the loss weights c z / L are
    # [4/3, -1/3], not a convex combination: refused (the docstring's domain L >= b).
    famo = FAMO(2, min_losses=bounds)
    famo(torch.tensor([1.0, 2.0]))
    before = famo._before
    with pytest.raises(ValueError, match=r"`losses` must be at least `min_losses`"):
        famo(torch.tensor(losses))
    assert famo._before is before
    with pytest.raises(ValueError, match=r"`new_losses` must be at least `min_losses`"):
        famo.update(torch.tensor(losses))
    assert famo._before is before and famo._steps == 0
    famo.update(torch.tensor([1.0, 2.0]))  # the pending update still works
    assert famo._steps == 1


def test_update_converts_another_dtype_and_steps_like_the_same_dtype() -> None:
    mixed, same = FAMO(2), FAMO(2)
    mixed(torch.tensor([1.0, 2.0], dtype=torch.float64))
    same(torch.tensor([1.0, 2.0], dtype=torch.float64))
    mixed.update(torch.tensor([0.5, 2.0], dtype=torch.float32))
    same.update(torch.tensor([0.5, 2.0], dtype=torch.float64))
    assert mixed.logits.dtype == torch.float64
    assert torch.equal(mixed.logits, same.logits)


def test_half_precision_losses_keep_a_float32_state_and_value() -> None:
    famo = FAMO(2)
    value = famo(torch.tensor([1.0, 4.0], dtype=torch.float16))
    assert value.dtype == torch.float32 and famo.logits.dtype == torch.float32
    assert abs(float(value) - 0.8 * float(torch.log(torch.tensor(4.0)))) < 1e-6  # c = 1.6
    famo.update(torch.tensor([0.5, 4.0], dtype=torch.bfloat16))
    assert famo.logits.dtype == torch.float32 and famo._steps == 1


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -float("inf")])
def test_a_non_finite_loss_skips_the_update_and_leaves_the_state_untouched(bad: float) -> None:
    famo, clean = FAMO(2), FAMO(2)
    for f in (famo, clean):
        f(torch.tensor([1.0, 2.0]))
        f.update(torch.tensor([0.5, 2.0]))
    state = _state(famo)
    famo(torch.tensor([1.0, 2.0]))
    famo.update(torch.tensor([bad, 2.0]))  # e.g. an overflow a GradScaler skips
    assert all(torch.equal(a, b) for a, b in zip(state, _state(famo))) and famo._steps == 1
    assert not torch.isfinite(famo(torch.tensor([bad, 2.0])))  # a non-finite call: non-finite
    famo.update(torch.tensor([1.0, 2.0]))
    assert all(torch.equal(a, b) for a, b in zip(state, _state(famo))) and famo._steps == 1
    # later steps go on exactly as if the skipped ones had not happened
    for f in (famo, clean):
        f(torch.tensor([1.0, 2.0]))
        f.update(torch.tensor([0.8, 1.0]))
    assert torch.equal(famo.logits, clean.logits)


def test_half_precision_losses_after_float64_ones_keep_the_float64_state() -> None:
    famo = FAMO(2)
    famo(torch.tensor([1.0, 4.0], dtype=torch.float64))
    value = famo(torch.tensor([1.0, 4.0], dtype=torch.float16))
    assert famo.logits.dtype == torch.float64 and value.dtype == torch.float64


def test_an_evaluation_call_keeps_nothing_for_the_update() -> None:
    """An evaluation call between the training call and ``update`` replaced the losses the
    update compares with: the logits moved by the validation losses' change."""
    famo, clean = FAMO(2), FAMO(2)
    famo(torch.tensor([1.0, 2.0]))
    clean(torch.tensor([1.0, 2.0]))
    famo.eval()
    value = famo(torch.tensor([1.0, 4.0]))  # z = [.5, .5]: c = 1.6, 0.8 * log(4)
    assert value.item() == pytest.approx(0.8 * math.log(4.0), rel=1e-6)
    famo.train()
    famo.update(torch.tensor([0.5, 2.0]))
    clean.update(torch.tensor([0.5, 2.0]))
    assert torch.equal(famo.logits, clean.logits)


def test_a_state_dict_kept_in_memory_stays_a_snapshot() -> None:
    """``update`` and ``reset`` changed the buffers in place: a ``state_dict()`` kept in memory
    mixed its step count with later moments and logits (a state no run had)."""
    famo = FAMO(3)
    losses = torch.tensor([1.0, 2.0, 3.0])
    for i in range(3):
        famo(losses + i)
        famo.update(losses * 0.5 + i)
    kept, truth = famo.state_dict(), copy.deepcopy(famo.state_dict())
    famo(losses)
    famo.update(losses * 0.1)
    famo.reset()
    for key, value in truth.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(kept[key], value, rtol=0, atol=0)


def test_an_update_after_a_call_in_a_wider_dtype_steps_the_state_in_its_own() -> None:
    """Losses in float64 after float32 steps (the value computed in float64) made ``update``
    fail with a raw dtype error from the softmax's Jacobian product, and the losses of the call
    it had to compare with were lost."""
    wide, same = FAMO(2), FAMO(2)
    for famo in (wide, same):
        famo(torch.tensor([1.0, 2.0]))  # (settles the state in float32)
        famo.update(torch.tensor([0.5, 2.0]))
    value = wide(torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert value.dtype == torch.float64
    wide.update(torch.tensor([0.8, 1.0], dtype=torch.float64))
    same(torch.tensor([1.0, 2.0]))
    same.update(torch.tensor([0.8, 1.0]))
    assert wide._steps == 2
    for name in ("logits", "_exp_avg", "_exp_avg_sq"):
        assert getattr(wide, name).dtype == torch.float32
    torch.testing.assert_close(wide.logits, same.logits)
