"""LogSTCH (LibMTL's STCH) over warm-up, calibration and STCH epochs against a reference."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from jacflow.scalarization import LogSTCH
from tests.scalarization._training import train


class LogSTCHReference:
    """LibMTL's rule: epochs < W log-sum; epoch W log-sum + nadir average; then m STCH(log L/z)."""

    def __init__(self, mu: float, warmup: int) -> None:
        self.mu, self.warmup, self.epoch = mu, warmup, 0
        self.calibration: list[list[float]] = []
        self.nadir: list[float] | None = None

    def __call__(self, losses: Tensor) -> Tensor:
        if self.epoch <= self.warmup:
            if self.epoch == self.warmup:
                self.calibration.append(losses.detach().tolist())
            return torch.log(losses + 1e-20).sum()
        if self.nadir is None:
            n = len(self.calibration)
            self.nadir = [sum(col) / n for col in zip(*self.calibration)]
        logs = torch.log(losses / torch.tensor(self.nadir, dtype=losses.dtype) + 1e-20)
        # m * mu * log(sum(exp(logs / mu))) written out directly (no shift: values are small)
        return losses.numel() * self.mu * torch.log(torch.exp(logs / self.mu).sum())

    def end_epoch(self) -> None:
        self.epoch += 1


@pytest.mark.parametrize(("mu", "warmup"), [(0.5, 1), (1.0, 0)])
def test_training_loop_matches_reference(mu: float, warmup: int) -> None:
    stch, ref = LogSTCH(mu, warmup_epochs=warmup), LogSTCHReference(mu, warmup)
    values, theta = train(stch, epochs=warmup + 3, end_epoch=stch.step)
    ref_values, ref_theta = train(ref, epochs=warmup + 3, end_epoch=ref.end_epoch)
    assert values == pytest.approx(ref_values, rel=1e-12)
    torch.testing.assert_close(theta, ref_theta)
    assert stch.nadir is not None
    assert stch.nadir.tolist() == pytest.approx(ref.nadir, rel=1e-12)


def test_scale_invariance_after_calibration() -> None:
    """Multiplying a loss by c everywhere leaves the STCH phase unchanged (log of L / z)."""
    scales = torch.tensor([1.0, 100.0], dtype=torch.float64)
    outputs = []
    for scale in (torch.ones(2, dtype=torch.float64), scales):
        stch = LogSTCH(0.3, warmup_epochs=0)
        stch(torch.tensor([2.0, 3.0], dtype=torch.float64) * scale)
        stch.step()
        outputs.append(stch(torch.tensor([1.0, 2.5], dtype=torch.float64) * scale).item())
    assert outputs[0] == pytest.approx(outputs[1], rel=1e-12)
    assert outputs[0] == pytest.approx(
        2 * 0.3 * math.log((0.5) ** (1 / 0.3) + (2.5 / 3) ** (1 / 0.3))
    )


def test_empty_epochs_do_not_count() -> None:
    stch = LogSTCH(1.0, warmup_epochs=1)
    stch.step()  # no call: ignored
    assert stch.epoch == 0
    stch(torch.ones(2))
    stch.step()
    stch.step()  # the calibration epoch has had no call yet: ignored
    assert stch.epoch == 1 and stch.nadir is None


def test_a_zero_nadir_entry_is_refused_at_step_and_the_calibration_goes_on() -> None:
    """A loss that averaged 0 over the calibration epoch made the nadir 0: every later value
    and gradient was NaN, with no error."""
    stch = LogSTCH(mu=1.0, warmup_epochs=0)
    stch(torch.tensor([2.0, 0.0]))
    with pytest.raises(ValueError, match=r"nadir point is \[2.0, 0.0\]: loss \[1\] averaged 0"):
        stch.step()
    assert stch.nadir is None and stch.epoch == 0  # (the calibration epoch is still open)
    stch(torch.tensor([4.0, 0.5]))  # the loss, now positive: averages [3, 0.25]
    stch.step()
    assert stch.nadir is not None
    torch.testing.assert_close(stch.nadir, torch.tensor([3.0, 0.25]))
    losses = torch.tensor([1.5, 0.5], requires_grad=True)
    value = stch(losses)
    value.backward()
    # 2 * log(exp(log(1.5 / 3)) + exp(log(0.5 / 0.25))) = 2 * log(0.5 + 2)
    assert value.item() == pytest.approx(2 * math.log(2.5), rel=1e-6)
    assert losses.grad is not None and torch.isfinite(losses.grad).all()


def test_a_checkpoint_with_a_zero_nadir_entry_is_refused() -> None:
    source, target = LogSTCH(mu=1.0, warmup_epochs=0), LogSTCH(mu=1.0, warmup_epochs=0)
    source(torch.tensor([2.0, 1.0]))
    source.step()
    state = source.state_dict()
    state["_extra_state"]["nadir"] = torch.tensor([2.0, 0.0])
    with pytest.raises(ValueError, match=r"loss \[1\] averaged 0"):
        target.load_state_dict(state)
    assert target.nadir is None


def test_evaluation_calls_count_for_nothing() -> None:
    """An evaluation call counted in the warm-up epoch and was averaged into the nadir point."""
    stch = LogSTCH(mu=1.0, warmup_epochs=1)
    stch.eval()
    assert stch(torch.tensor([1.0, 4.0])).item() == pytest.approx(math.log(4.0))
    stch.step()  # (an epoch of evaluation calls only is ignored)
    assert stch.epoch == 0
    stch.train()
    stch(torch.tensor([1.0, 1.0]))
    stch.step()  # end of the warm-up
    stch(torch.tensor([2.0, 8.0]))
    stch.eval()
    stch(torch.tensor([100.0, 100.0]))  # (not in the nadir point)
    stch.train()
    stch.step()
    assert stch.nadir is not None
    torch.testing.assert_close(stch.nadir, torch.tensor([2.0, 8.0]))
    stch.eval()
    # 2 * log(1/2 + 8/8), from the nadir point
    assert stch(torch.tensor([1.0, 8.0])).item() == pytest.approx(2 * math.log(1.5), rel=1e-6)
