"""Writing into ``.grad``: under several processes, a warning that nothing is averaged."""

from __future__ import annotations

import warnings

import pytest
import torch

from jacflow import backward, mtl_backward
from jacflow.aggregation import UPGrad


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("call", ["backward", "mtl_backward"])
def test_writes_under_several_processes_warn_that_nothing_is_averaged(
    world_size: int, call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under DDP these calls bypass its averaging hooks (the replicas' ``.grad`` differed by
    2.26 after one step, silently): warned, naming the way out; one process: no warning."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world_size)
    trunk = torch.nn.Linear(2, 3)
    features = trunk(torch.ones(4, 2))
    losses = [features.pow(2).mean(), features.sin().mean()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if call == "backward":
            backward(losses, A=UPGrad())
        else:
            mtl_backward(losses, features, A=UPGrad())
    messages = [str(w.message) for w in caught if "drift apart" in str(w.message)]
    assert len(messages) == (1 if world_size == 2 else 0)
    assert all("jacflow.autogram.Engine(ddp_model" in m for m in messages)
    assert trunk.weight.grad is not None
