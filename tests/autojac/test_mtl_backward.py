"""``mtl_backward`` against Jacobians computed directly from the losses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jacflow import jac, jac_to_grad, mtl_backward
from jacflow.aggregation import Mean, UPGrad


def _model(dtype: torch.dtype) -> tuple[nn.Module, list[nn.Module], torch.Tensor]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5)).to(dtype)
    heads = [nn.Linear(5, 1).to(dtype), nn.Linear(5, 2).to(dtype), nn.Linear(5, 1).to(dtype)]
    return trunk, heads, torch.randn(7, 4, dtype=dtype)


def _losses(
    trunk: nn.Module, heads: list[nn.Module], x: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    features = trunk(x)
    outs = [h(features) for h in heads]
    return [outs[0].pow(2).mean(), outs[1].sin().mean(), (outs[2] - 1).abs().mean()], features


@pytest.mark.parametrize("chunk", [None, 1, 2])
def test_jac_and_head_grads(chunk: int | None, dtype: torch.dtype, on_device: str) -> None:
    trunk, heads, x = _model(dtype)
    losses, features = _losses(trunk, heads, x)
    shared = list(trunk.parameters())
    expected_shared = jac(losses, shared, retain_graph=True)
    expected_heads = [
        torch.autograd.grad(loss, list(h.parameters()), retain_graph=True)
        for loss, h in zip(losses, heads)
    ]
    mtl_backward(losses, features, parallel_chunk_size=chunk)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for p, e in zip(shared, expected_shared):
        torch.testing.assert_close(p.jac, e, atol=tol, rtol=tol)  # type: ignore[attr-defined]
        assert p.grad is None
    for head, grads in zip(heads, expected_heads):
        for p, g in zip(head.parameters(), grads):
            torch.testing.assert_close(p.grad, g, atol=tol, rtol=tol)
            assert not hasattr(p, "jac")


def test_with_aggregator_equals_jac_then_jac_to_grad() -> None:
    trunk, heads, x = _model(torch.float64)
    losses, features = _losses(trunk, heads, x)
    mtl_backward(losses, features)
    weights = jac_to_grad(trunk.parameters(), UPGrad())
    assert weights is not None and weights.shape == (3,)
    expected = [p.grad.clone() for p in trunk.parameters()]  # type: ignore[union-attr]
    for p in [*trunk.parameters(), *(q for h in heads for q in h.parameters())]:
        p.grad = None
    losses, features = _losses(trunk, heads, x)
    mtl_backward(losses, features, A=UPGrad())
    for p, e in zip(trunk.parameters(), expected):
        torch.testing.assert_close(p.grad, e)


def test_shared_head_params_sum_task_gradients() -> None:
    torch.manual_seed(1)
    trunk, head = nn.Linear(3, 4), nn.Linear(4, 1)
    features = trunk(torch.randn(5, 3))
    out = head(features)
    losses = [out.mean(), out.pow(2).mean()]
    expected = torch.autograd.grad(
        losses[0] + losses[1], list(head.parameters()), retain_graph=True
    )
    mtl_backward(losses, features, A=Mean())
    for p, g in zip(head.parameters(), expected):
        torch.testing.assert_close(p.grad, g)


def test_explicit_params_and_several_features() -> None:
    torch.manual_seed(2)
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    x = torch.randn(4, 3)
    f1, f2 = a(x), b(x).tanh()
    losses = [(f1 * f2).sum(), (f1 - f2).pow(2).sum()]
    expected = jac(losses, [*a.parameters(), *b.parameters()], retain_graph=True)
    mtl_backward(
        losses, [f1, f2], tasks_params=[[], []], shared_params=[*a.parameters(), *b.parameters()]
    )
    for p, e in zip([*a.parameters(), *b.parameters()], expected):
        torch.testing.assert_close(p.jac, e)  # type: ignore[attr-defined]


@pytest.mark.parametrize("aggregator", [UPGrad(), Mean()], ids=str)
def test_engine_path_equals_jacobian_path(aggregator: object, on_device: str) -> None:
    from jacflow.autogram import Engine

    trunk, heads, x = _model(torch.float64)
    params = [*trunk.parameters(), *(p for h in heads for p in h.parameters())]
    losses, features = _losses(trunk, heads, x)
    mtl_backward(losses, features, A=aggregator)  # type: ignore[arg-type]
    expected = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    for p in params:
        p.grad = None
    with Engine(trunk, batch_dim=None) as engine:
        losses, features = _losses(trunk, heads, x)
        mtl_backward(losses, features, A=aggregator, engine=engine)  # type: ignore[arg-type]
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e, atol=1e-9, rtol=1e-7)


def test_engine_path_errors_leave_grads_untouched() -> None:
    from jacflow.aggregation import ConFIG
    from jacflow.autogram import Engine

    trunk, heads, x = _model(torch.float64)
    with Engine(trunk, batch_dim=None) as engine:
        losses, features = _losses(trunk, heads, x)
        with pytest.raises(ValueError, match="Gramian-based aggregator"):
            mtl_backward(losses, features, A=ConFIG(), engine=engine)
        with pytest.raises(ValueError, match="Gramian-based aggregator"):
            mtl_backward(losses, features, engine=engine)
        with pytest.raises(ValueError, match="leave `shared_params` to None"):
            mtl_backward(
                losses, features, A=UPGrad(), engine=engine, shared_params=trunk.parameters()
            )
        with pytest.raises(TypeError, match="`engine` must be"):
            mtl_backward(losses, features, A=UPGrad(), engine=object())  # type: ignore[arg-type]
    for p in [*trunk.parameters(), *(q for h in heads for q in h.parameters())]:
        assert p.grad is None and not hasattr(p, "jac")
