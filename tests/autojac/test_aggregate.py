"""Aggregation inside ``backward`` / ``jac_to_grad``: forward hooks see the aggregator's call."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from jacflow import backward, jac_to_grad
from jacflow.aggregation import MGDA, Aggregator, ConFIG, Mean, Sum, UPGrad


def _problem() -> tuple[Tensor, Tensor, list[Tensor]]:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(3, generator=generator, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 2, generator=generator, dtype=torch.float64, requires_grad=True)
    outputs = [(a**2).sum(), (a * b[0, 0]).sum(), ((b @ b) * a[:2].sum()).sum()]
    return a, b, outputs


def _jacobian() -> Tensor:
    a, b, outputs = _problem()
    rows = []
    for output in outputs:
        grads = torch.autograd.grad(output, [a, b], allow_unused=True, materialize_grads=True)
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows)


def _zero_first_row(_module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor]:
    matrix = args[0].clone()
    matrix[0] = 0.0
    return (matrix,)


@pytest.mark.parametrize("make", [UPGrad, MGDA, Mean, Sum, ConFIG])
@pytest.mark.parametrize("via", ["backward", "jac_to_grad"])
def test_forward_hooks_on_the_aggregator_run_as_in_its_call(
    make: type[Aggregator], via: str
) -> None:
    """A pre-hook that changes ``J`` and a forward hook both run once, and the update is the
    aggregator's on the changed ``J`` (the shortcuts that skip the call are not taken)."""
    aggregator = make()
    calls: list[str] = []
    aggregator.register_forward_pre_hook(
        lambda m, args: (calls.append("pre"), _zero_first_row(m, args))[1]
    )
    aggregator.register_forward_hook(lambda m, args, out: calls.append("post"))
    changed = _jacobian()
    changed[0] = 0.0
    expected = make()(changed)
    a, b, outputs = _problem()
    if via == "backward":
        backward(outputs, A=aggregator)
    else:
        backward(outputs)
        jac_to_grad([a, b], aggregator)
    assert calls == ["pre", "post"]
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(torch.cat([a.grad, b.grad.flatten()]), expected)


def test_jac_to_grad_returns_the_weights_of_the_hooked_call() -> None:
    aggregator = UPGrad()
    aggregator.register_forward_pre_hook(_zero_first_row)
    changed = _jacobian()
    changed[0] = 0.0
    a, b, outputs = _problem()
    backward(outputs)
    weights = jac_to_grad([a, b], aggregator)
    assert weights is not None
    torch.testing.assert_close(weights, UPGrad().weights(changed))


def test_a_global_forward_hook_sees_the_aggregator() -> None:
    seen: list[type] = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, args, out: seen.append(type(m))
    )
    try:
        _, _, outputs = _problem()
        backward(outputs, A=UPGrad())
    finally:
        handle.remove()
    assert UPGrad in seen


class _Doubled(UPGrad):
    """A user's subclass whose forward changes the update."""

    def forward(self, matrix: Tensor) -> Tensor:
        return 2 * super().forward(matrix)


@pytest.mark.parametrize("hooked", [False, True])
def test_a_subclass_overriding_forward_is_called_on_the_jacobian(hooked: bool) -> None:
    """The Gramian shortcut skipped the subclass's forward, unless a hook (even a no-op one)
    sent the call through ``A(J)``: the result depended on the hook."""
    aggregator = _Doubled()
    if hooked:
        aggregator.register_forward_hook(lambda m, args, out: None)
    a, b, outputs = _problem()
    backward(outputs, A=aggregator)
    assert a.grad is not None and b.grad is not None
    update = torch.cat([a.grad, b.grad.flatten()])
    torch.testing.assert_close(update, 2 * UPGrad()(_jacobian()))


def test_an_engine_refuses_a_subclass_overriding_forward() -> None:
    from jacflow import mtl_backward
    from jacflow.autogram import Engine

    trunk, head = nn.Linear(2, 3), nn.Linear(3, 2)
    engine = Engine(trunk, batch_dim=None)
    features = trunk(torch.ones(4, 2))
    losses = [head(features)[:, 0].mean(), head(features)[:, 1].pow(2).mean()]
    with pytest.raises(ValueError, match="_Doubled overrides `forward` or `weights`"):
        mtl_backward(losses, features, A=_Doubled(), engine=engine)
    assert all(p.grad is None for p in [*trunk.parameters(), *head.parameters()])


class _Alternating(UPGrad):
    """A user's subclass whose ``weights`` keeps state: all on one row, alternately."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def weights(self, matrix: Tensor) -> Tensor:
        self.calls += 1
        chosen = torch.zeros(matrix.shape[0], dtype=matrix.dtype)
        chosen[(self.calls - 1) % matrix.shape[0]] = 1.0
        return chosen


def test_a_subclass_overriding_weights_is_asked_once_and_its_weights_returned() -> None:
    """``weights`` ran twice per step (the call's, then again for the returned weights): a
    stateful one stepped twice and ``jac_to_grad`` returned weights that were not applied."""
    aggregator = _Alternating()
    a, b, outputs = _problem()
    backward(outputs)
    weights = jac_to_grad([a, b], aggregator)
    assert aggregator.calls == 1 and weights is not None
    assert a.grad is not None and b.grad is not None
    update = torch.cat([a.grad, b.grad.flatten()])
    torch.testing.assert_close(weights, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(update, _jacobian()[0])


def test_a_forward_set_on_the_instance_is_used() -> None:
    aggregator = UPGrad()
    aggregator.forward = lambda matrix: torch.zeros_like(matrix[0])  # type: ignore[method-assign]
    a, b, outputs = _problem()
    backward(outputs, A=aggregator)
    assert a.grad is not None and b.grad is not None
    assert not a.grad.any() and not b.grad.any()
