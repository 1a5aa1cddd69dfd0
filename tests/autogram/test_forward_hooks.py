"""A module under the generic rule with the user's forward hooks or pre-hooks: its re-run
reproduces the call as recorded (inputs after the pre-hooks, output before the forward hooks),
so a hook's change counts once."""

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jacflow.aggregation import ConstantWeighting
from jacflow.autogram import Engine


class _Generic(nn.Module):
    """No closed form: the engine re-runs it through torch.func."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(4, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(torch.tanh(x), self.weight, self.bias)


def _in_place(module: nn.Module, args: Any, out: Tensor) -> None:
    out.mul_(2.0)


def _returned(module: nn.Module, args: Any, out: Tensor) -> Tensor:
    return 1.5 * out + 0.25


def _pre(module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return (args[0] * 2.0 - 0.5,)


def _register(module: nn.Module, kind: str) -> None:
    if kind == "in-place":
        module.register_forward_hook(_in_place)
    elif kind == "returned":
        module.register_forward_hook(_returned)
    else:
        module.register_forward_pre_hook(_pre)


@pytest.mark.parametrize("kind", ["in-place", "returned", "pre"])
@pytest.mark.parametrize("batch_dim", [0, None])
def test_hooked_generic_module_is_exact(kind: str, batch_dim: int | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Generic(), nn.Linear(4, 2, dtype=torch.float64))
    _register(model[0], kind)
    x = torch.randn(5, 3, dtype=torch.float64)
    params = list(model.parameters())
    engine = Engine(model, batch_dim=batch_dim)

    def losses_of() -> Tensor:
        out = model(x).pow(2).sum(1)
        return out if batch_dim == 0 else torch.stack([out.sum(), out.pow(3).sum()])

    losses = losses_of()
    rows: list[Tensor] = [
        torch.cat([g.flatten() for g in torch.autograd.grad(loss, params, retain_graph=True)])
        for loss in losses
    ]
    jacobian = torch.stack(rows)
    gramian = engine.compute_gramian(losses)
    torch.testing.assert_close(gramian, jacobian @ jacobian.T)

    losses = losses_of()
    weights = torch.linspace(0.5, 1.5, losses.numel(), dtype=torch.float64)
    engine.backward(losses, ConstantWeighting(weights))
    grad = torch.cat([p.grad.flatten() for p in params if p.grad is not None])
    torch.testing.assert_close(grad, weights @ jacobian)
    engine.remove()


def test_hooks_are_back_after_the_rerun() -> None:
    module = _Generic()
    module.register_forward_hook(_returned)
    module.register_forward_pre_hook(_pre)
    engine = Engine(module, batch_dim=0)
    out = module(torch.randn(3, 3, dtype=torch.float64)).pow(2).sum(1)
    engine.compute_gramian(out)
    assert _returned in module._forward_hooks.values()
    assert _pre in module._forward_pre_hooks.values()
    assert torch.nn.modules.module._global_forward_pre_hooks == {}
    engine.remove()
