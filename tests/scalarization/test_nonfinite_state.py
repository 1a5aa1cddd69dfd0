"""A step with a NaN or infinite loss leaves a stateful scalarizer's state untouched."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from jacflow.scalarization import DWA, LBTW, AdaLoss, LogSTCH, ReLoBRaLo, SoftAdapt
from jacflow.scalarization._base import Scalarizer

GOOD = [[1.0, 2.0], [3.0, 1.0], [2.0, 4.0]]


def _run(make: Callable[[], Scalarizer], bad: Tensor | None) -> list[float]:
    """Values of the GOOD calls, with one call on ``bad`` after the first; for DWA and LogSTCH
    (whose first epoch, without warm-up, fixes the nadir point) an epoch each."""
    torch.manual_seed(0)
    s = make()
    values = []
    for i, losses in enumerate(GOOD):
        values.append(float(s(torch.tensor(losses))))
        if i == 0 and bad is not None:
            assert not math.isfinite(float(s(bad)))
        if isinstance(s, (DWA, LogSTCH)):
            s.step()
    values.append(float(s(torch.tensor([1.0, 1.0]))))
    return values


@pytest.mark.parametrize(
    "make",
    [
        lambda: AdaLoss(momentum=0.5),
        lambda: ReLoBRaLo(alpha=0.5, rho=1.0, temperature=1.0),
        lambda: ReLoBRaLo(alpha=0.5, rho=0.0, temperature=1.0),
        lambda: ReLoBRaLo(alpha=0.5, rho=0.5, temperature=1.0),  # (no look-back drawn)
        DWA,
        LBTW,
        SoftAdapt,
        lambda: LogSTCH(mu=0.5, warmup_epochs=0),
    ],
)
@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -float("inf")])
def test_a_non_finite_call_is_non_finite_and_later_calls_are_as_without_it(
    make: Callable[[], Scalarizer], bad: float
) -> None:
    clean = _run(make, None)
    assert all(math.isfinite(v) for v in clean)
    assert _run(make, torch.tensor([bad, 2.0])) == clean


@pytest.mark.parametrize("make", [AdaLoss, ReLoBRaLo, DWA, LBTW, SoftAdapt])
def test_a_non_finite_first_call_keeps_no_state(make: Callable[[], Scalarizer]) -> None:
    s = make()
    assert not math.isfinite(float(s(torch.tensor([float("inf"), 1.0]))))
    if isinstance(s, DWA):
        s.step()
        assert s._averages == []
    # the next call is a first call: weights 1 (AdaLoss: each loss over itself; SoftAdapt:
    # weights 1/2)
    expected = {AdaLoss: 2.0, SoftAdapt: 1.5}.get(type(s), 3.0)
    assert float(s(torch.tensor([1.0, 2.0]))) == pytest.approx(expected, rel=1e-6)


def test_a_calibration_epoch_without_a_finite_call_is_repeated() -> None:
    """LogSTCH: the nadir point comes from the first calibration epoch with finite losses."""
    stch = LogSTCH(mu=1.0, warmup_epochs=0)
    assert not math.isfinite(float(stch(torch.tensor([float("nan"), 1.0]))))
    stch.step()
    assert stch.nadir is None and stch.epoch == 0
    stch(torch.tensor([2.0, 8.0]))
    stch.step()
    assert stch.nadir is not None
    torch.testing.assert_close(stch.nadir, torch.tensor([2.0, 8.0]))


def test_a_calibration_epoch_sums_half_precision_losses_in_float32() -> None:
    """LogSTCH's nadir point from float16 losses (whose float16 sum overflows at 65504)."""
    stch = LogSTCH(mu=1.0, warmup_epochs=0)
    for _ in range(1000):
        stch(torch.tensor([100.0, 1.0], dtype=torch.float16))
    stch.step()
    assert stch.nadir is not None
    torch.testing.assert_close(stch.nadir, torch.tensor([100.0, 1.0]))
