"""A checkpoint (``state_dict`` through ``torch.save``) resumes a stateful scalarizer exactly."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from jacflow.scalarization import (
    DWA,
    FAMO,
    IMTLL,
    LBTW,
    UW,
    AdaLoss,
    LogSTCH,
    ReLoBRaLo,
    RevisedUW,
    SoftAdapt,
)
from jacflow.scalarization._base import Scalarizer
from tests._checkpoint import check_resumes

_LOSSES = torch.rand(10, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.1


def _call(method: Scalarizer, step: int) -> Tensor:
    """One step of the method's protocol: its value, then what it does after the model's step
    (FAMO's update) and at the end of an epoch of two calls (DWA's and LogSTCH's step)."""
    losses = _LOSSES[step]
    value = method(losses)
    if isinstance(method, FAMO):
        method.update(losses * 0.9)
    if isinstance(method, (DWA, LogSTCH)) and step % 2 == 1:
        method.step()
    return value


@pytest.mark.parametrize(
    "make",
    [
        lambda: AdaLoss(momentum=0.5),
        DWA,
        lambda: FAMO(3),
        LBTW,
        lambda: LogSTCH(mu=0.5, warmup_epochs=1),
        lambda: ReLoBRaLo(alpha=0.5, rho=1.0),
        SoftAdapt,
    ],
)
@pytest.mark.parametrize("saved_at", [0, 3, 4])
def test_a_reloaded_checkpoint_continues_as_the_original(
    make: Callable[[], Scalarizer], saved_at: int
) -> None:
    """Their plain attributes (FAMO's Adam step count, DWA's epoch averages, LBTW's initial
    losses, ...) were not in ``state_dict``: a reloaded FAMO took 1.74x too large a step, the
    others restarted their warm-up."""
    check_resumes(lambda: make().double(), _call, saved_at, len(_LOSSES))


def test_a_foreign_state_is_refused() -> None:
    state = DWA().state_dict()
    with pytest.raises(ValueError, match=r"must hold \['_initial'\], received \['_averages'"):
        LBTW().load_state_dict(state)


def test_a_refused_load_leaves_the_saved_attributes_as_they_were() -> None:
    """A size mismatch is raised after the whole load: FAMO(4) refusing FAMO(3)'s state kept
    its step count and call state from that state, and its next step moved less."""
    source = FAMO(3)
    for step in range(4):
        source(_LOSSES[step]).item()
        source.update(_LOSSES[step] * 0.9)
    source(_LOSSES[4])
    target, fresh = FAMO(4), FAMO(4)
    with pytest.raises(RuntimeError, match="size mismatch"):
        target.load_state_dict(source.state_dict())
    losses = torch.tensor([1.0, 2.0, 3.0, 4.0])
    for famo in (target, fresh):
        famo(losses)
        famo.update(losses * 0.9)
    torch.testing.assert_close(target.logits, fresh.logits)


@pytest.mark.parametrize("between_call_and_update", [False, True])
def test_famo_resumes_a_float64_run_exactly(between_call_and_update: bool) -> None:
    """Its buffers follow the losses' dtype: a fresh FAMO's float32 buffers rounded a float64
    state (the runs then drifted apart), and ``update`` after a load between the call and the
    update mixed float32 and float64."""
    torch.manual_seed(0)
    losses = [torch.rand(2, dtype=torch.float64) + 0.1 for _ in range(10)]
    first = FAMO(2, lr=0.5)
    for i in range(4):
        first(losses[i])
        first.update(losses[i + 1])
    if between_call_and_update:
        first(losses[4])
    second = FAMO(2, lr=0.5)
    second.load_state_dict(first.state_dict())
    start = 4
    if between_call_and_update:
        first.update(losses[5])
        second.update(losses[5])
        start = 5
    for i in range(start, 9):
        assert torch.equal(first(losses[i]), second(losses[i]))
        first.update(losses[i + 1])
        second.update(losses[i + 1])
    assert torch.equal(first.logits, second.logits)


@pytest.mark.parametrize("make", [lambda: UW(2), lambda: RevisedUW(2), lambda: IMTLL(2)])
def test_learned_weights_of_a_float64_run_load_exactly(make: Callable[[], Scalarizer]) -> None:
    """Their parameters follow the losses' dtype: a fresh module's float32 ones rounded a
    float64 state (the same load as FAMO's buffers, in the base class)."""
    losses = torch.tensor([0.3, 1.7], dtype=torch.float64)
    first = make()
    optimizer = torch.optim.SGD(first.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        first(losses).backward()
        optimizer.step()
    second = make()
    second.load_state_dict(first.state_dict())
    for mine, theirs in zip(first.parameters(), second.parameters(), strict=True):
        assert theirs.dtype == torch.float64
        assert torch.equal(mine, theirs)
    assert torch.equal(first(losses), second(losses))
