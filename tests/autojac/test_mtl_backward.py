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


def _brute_rows(losses: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per parameter, the ``[m, *shape]`` Jacobian: one ``autograd.grad`` per loss."""
    rows = [
        torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True) for loss in losses
    ]
    return [
        torch.stack([torch.zeros_like(p) if r[k] is None else r[k] for r in rows])
        for k, p in enumerate(params)
    ]


@pytest.mark.parametrize("chunk", [None, 1, 2])
@pytest.mark.parametrize("layout", ["chain", "skip", "leaf", "split"])
def test_nested_features_count_each_path_once(layout: str, chunk: int | None) -> None:
    """Features computed from other features (a multi-scale trunk): each task's row is its
    loss's gradient, although ``autograd.grad(loss, features)`` gives an earlier feature's
    cotangent with the paths through the later ones included (each counted twice before)."""
    torch.manual_seed(3)
    a, b, c = (nn.Linear(4, 4).double() for _ in range(3))
    heads = [nn.Linear(4, 1).double(), nn.Linear(8, 1).double(), nn.Linear(12, 1).double()]
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=layout == "leaf")

    def forward() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        f1 = a(x)
        f2 = b(torch.tanh(f1))
        if layout == "chain":  # f1 -> f2 -> f3
            features = [f1, f2, c(torch.tanh(f2))]
        elif layout == "skip":  # f3 reads f1 and f2, listed out of order
            features = [c(f1 * f2), f1, f2]
        elif layout == "leaf":  # the input is a feature too, and a shared leaf
            features = [f2, x, c(f1)]
        else:  # two outputs of one node, one computed from the other
            left, right = torch.cat([f1, f2], 1).chunk(2, 1)
            features = [left, right, c(left)]
        u, v, w = features
        losses = [
            heads[0](v).pow(2).mean(),
            heads[1](torch.cat([u, w], 1)).sin().mean(),
            heads[2](torch.cat([u, v, w], 1)).cos().mean() + v.mean(),
        ]
        return losses, features

    shared = [*a.parameters(), *b.parameters(), *c.parameters()] + ([x] if layout == "leaf" else [])
    losses, _ = forward()
    expected = _brute_rows(losses, shared)
    losses, features = forward()
    mtl_backward(losses, features, parallel_chunk_size=chunk)
    for p, e in zip(shared, expected, strict=True):
        torch.testing.assert_close(p.jac, e, rtol=1e-10, atol=1e-12)  # type: ignore[attr-defined]
