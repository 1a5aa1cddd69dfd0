"""``mtl_backward`` against Jacobians computed directly from the losses."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from jacflow import backward, jac, jac_to_grad, mtl_backward
from jacflow.aggregation import Aggregator, Mean, UPGrad
from tests.autojac import _zoo
from tests.autojac._held import assert_left_alone, torch_leaves_alone


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


def test_sparse_head_gradient_replaces_a_dense_grad_out_of_place() -> None:
    """A head of sparse gradient (an ``nn.Embedding(sparse=True)``) whose ``.grad`` is dense
    and cannot take the sum in place (expanded) failed with torch's "add(sparse, dense) is not
    supported"; its ``.grad`` is replaced by ``.grad + gradient``, as autograd forms it."""
    torch.manual_seed(0)
    trunk, table = nn.Linear(3, 3).double(), nn.Embedding(6, 3, sparse=True).double()
    ids = torch.tensor([1, 2, 2, 5])
    features = trunk(torch.randn(4, 3, dtype=torch.float64))
    products = features * table(ids)
    losses = [products.sum(), products.pow(2).sum()]
    (summed,) = torch.autograd.grad(losses[0] + losses[1], table.weight, retain_graph=True)
    table.weight.grad = torch.ones(1, 1, dtype=torch.float64).expand(6, 3)
    mtl_backward(losses, features, A=UPGrad())
    torch.testing.assert_close(table.weight.grad, 1 + summed.to_dense())


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
        with pytest.raises(ValueError, match=r"must hold every parameter .* Sequential.2.bias"):
            mtl_backward(
                losses, features, A=UPGrad(), engine=engine, shared_params=[trunk[0].weight]
            )
        with pytest.raises(TypeError, match="`engine` must be"):
            mtl_backward(losses, features, A=UPGrad(), engine=object())  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"received the class Engine .*Engine\(\.\.\.\)"):
            mtl_backward(losses, features, A=UPGrad(), engine=Engine)  # type: ignore[arg-type]
    # (the message named mtl_gramian_step, which the user did not call)
    with Engine(trunk, batch_dim=0) as per_sample:
        losses, features = _losses(trunk, heads, x)
        with pytest.raises(ValueError, match=r"mtl_backward with `engine=`\) needs a per-task"):
            mtl_backward(losses, features, A=UPGrad(), engine=per_sample)
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


Forward = Callable[[], tuple[list[torch.Tensor], list[torch.Tensor]]]


def _expected_grads(
    forward: Forward,
    shared: list[torch.Tensor],
    tasks_params: list[list[torch.Tensor]],
    aggregator: Aggregator,
) -> dict[int, torch.Tensor]:
    """Brute force: the trunk's ``.grad`` is ``A`` of the Jacobian from one ``autograd.grad``
    per loss; a head parameter's is the sum over the tasks listing it of their loss's
    gradient."""
    losses, _ = forward()
    rows = _brute_rows(losses, shared)
    update = aggregator(torch.cat([r.reshape(len(losses), -1) for r in rows], 1))
    expected = dict(
        zip(
            map(id, shared),
            (u.view_as(p) for u, p in zip(update.split([p.numel() for p in shared]), shared)),
        )
    )
    for loss, params in zip(losses, tasks_params, strict=True):
        for p, g in zip(params, torch.autograd.grad(loss, params, retain_graph=True), strict=True):
            expected[id(p)] = expected[id(p)] + g if id(p) in expected else g
    return expected


def _step_and_check(
    forward: Callable[[], tuple[list[torch.Tensor], list[torch.Tensor]]],
    engine: object,
    cleared: list[torch.Tensor],
    checked: list[torch.Tensor],
    expected: dict[int, torch.Tensor],
) -> None:
    """One ``mtl_backward`` step with UPGrad (and ``engine``, or none) from cleared ``.grad``,
    then the ``checked`` parameters' ``.grad`` against ``expected``."""
    for p in cleared:
        p.grad = None
    losses, features = forward()
    mtl_backward(losses, features, A=UPGrad(), engine=engine)  # type: ignore[arg-type]
    _assert_grads(checked, expected)


def _assert_grads(params: list[torch.Tensor], expected: dict[int, torch.Tensor]) -> None:
    for p in params:
        torch.testing.assert_close(p.grad, expected[id(p)], rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("aggregator", [UPGrad(), Mean()], ids=str)
@pytest.mark.parametrize("route", ["by_task", "batched"])
def test_engine_task_params_get_their_tasks_gradient(route: str, aggregator: Aggregator) -> None:
    """With an engine, ``tasks_params[i]`` gets the gradient of ``losses[i]`` (of the tasks
    listing it), not of the losses' sum, where another task's loss reads it too (a cross-task
    penalty); a gradient hook on it sees that gradient. Both routes of the engine's backward:
    the heads pulled back task by task to the one output they meet at, and the batched one
    (heads reading two hooked outputs)."""
    from jacflow.autogram import Engine

    torch.manual_seed(4)
    trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    heads = [nn.Linear(6, 1).double() for _ in range(3)]
    penalty = nn.Parameter(torch.tensor([0.5, -1.0], dtype=torch.float64))  # tasks 0 and 2
    x = torch.randn(7, 4, dtype=torch.float64)

    def forward() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        f = trunk(x)
        g = trunk[1](trunk[0](x)) if route == "batched" else f  # (a second hooked output)
        return [
            heads[0](f).pow(2).mean() + penalty[0] * heads[1].weight.sum(),
            heads[1](g).sin().mean() + penalty.pow(2).sum() + heads[0].bias.sum(),
            heads[2](f).cos().mean() * penalty[1],
        ], [f] if route == "by_task" else [g, f]

    tasks_params = [
        [*heads[0].parameters(), penalty],
        [*heads[1].parameters()],
        [*heads[2].parameters(), penalty],
    ]
    shared = list(trunk.parameters())
    expected = _expected_grads(forward, shared, tasks_params, aggregator)
    heads[0].weight.register_hook(lambda g: 2 * g)  # (a hook: a plain backward of its own)
    expected[id(heads[0].weight)] = 2 * expected[id(heads[0].weight)]
    with Engine(trunk, batch_dim=None) as engine:
        losses, features = forward()
        mtl_backward(losses, features, A=aggregator, tasks_params=tasks_params, engine=engine)
    _assert_grads([*shared, *(p for params in tasks_params for p in params)], expected)


@pytest.mark.parametrize("shared", ["default", "all", "without_pre"])
@pytest.mark.parametrize("route", ["by_task", "batched"])
def test_engine_unhooked_trunk_joins_the_jacobian(route: str, shared: str) -> None:
    """Trunk parameters behind ``features`` that the engine does not hook (a projection
    after the hooked encoder, a layer before it) get their part of the weighted update, with
    their columns in the Gramian, as without the engine (they got nothing, silently). Given
    ``shared_params`` are the trunk, as without the engine: one left out gets nothing and is
    not in the Gramian."""
    from jacflow.autogram import Engine

    torch.manual_seed(5)
    pre, proj = nn.Linear(4, 4).double(), nn.Linear(6, 6).double()
    encoder = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    heads = [nn.Linear(6, 1).double() for _ in range(3)]
    x = torch.randn(7, 4, dtype=torch.float64)

    def forward() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        h = encoder[1](encoder[0](pre(x)))
        f = proj(encoder[2](h).tanh())
        g = h if route == "batched" else f  # (the heads read two hooked outputs)
        losses = [heads[0](f).pow(2).mean(), heads[1](g).sin().mean(), heads[2](f).cos().mean()]
        return losses, [f] if route == "by_task" else [h, f]

    trunk = [*pre.parameters(), *encoder.parameters(), *proj.parameters()]
    given = {"default": None, "all": trunk, "without_pre": trunk[2:]}[shared]
    tasks_params = [list(h.parameters()) for h in heads]
    expected = _expected_grads(forward, trunk if given is None else given, tasks_params, UPGrad())
    # (a gradient hook on an unhooked trunk parameter runs on each row, as without the engine)
    clamp = proj.bias.register_hook(lambda g: g.clamp(-0.01, 0.01))
    losses, features = forward()
    mtl_backward(losses, features, A=UPGrad(), shared_params=given)
    without_engine = [p.grad.clone() for p in trunk if p.grad is not None]
    for p in [*trunk, *(q for h in heads for q in h.parameters())]:
        p.grad = None
    with Engine(encoder, batch_dim=None) as engine:
        losses, features = forward()
        mtl_backward(losses, features, A=UPGrad(), engine=engine, shared_params=given)
    _assert_grads([p for h in heads for p in h.parameters()], expected)
    with_engine = [p.grad for p in trunk if p.grad is not None]
    assert len(with_engine) == len(trunk if given is None else given)
    for actual, reference in zip(with_engine, without_engine, strict=True):
        torch.testing.assert_close(actual, reference, rtol=1e-7, atol=1e-10)
    clamp.remove()
    if shared != "default":  # (the brute force, without the hook: checked by the default case)
        return
    for p in trunk:
        p.grad = None
    with Engine(encoder, batch_dim=None) as engine:
        losses, features = forward()
        mtl_backward(losses, features, A=UPGrad(), engine=engine)
    _assert_grads(trunk, expected)


def test_engine_losses_that_read_no_feature() -> None:
    """Losses none of which reads ``features``: the heads' gradients, with the engine as
    without it (it was refused). No loss reaches the trunk: its ``.grad`` stays ``None``, as
    after ``sum(losses).backward()``, with the engine or without it (both wrote zeros)."""
    from jacflow.autogram import Engine

    trunk, heads, x = _model(torch.float64)

    def forward() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        features = trunk(x)
        return [h.weight.pow(2).sum() for h in heads], [features]

    shared, tasks_params = list(trunk.parameters()), [list(h.parameters())[:1] for h in heads]
    expected = _expected_grads(forward, shared, tasks_params, UPGrad())
    assert all(expected[id(p)].abs().max() == 0 for p in shared)
    everything = [*shared, *(q for h in heads for q in h.parameters())]
    heads_checked = [p for params in tasks_params for p in params]
    _step_and_check(forward, None, everything, heads_checked, expected)
    assert all(p.grad is None and not hasattr(p, "jac") for p in shared)
    assert all(h.bias.grad is None for h in heads)
    _step_and_check(forward, Engine(trunk, batch_dim=None), everything, heads_checked, expected)
    assert all(p.grad is None for p in shared)
    assert all(h.bias.grad is None for h in heads)
    # (losses that read the features, computed before the engine existed: still refused)
    for p in [*shared, *(q for h in heads for q in h.parameters())]:
        p.grad = None
    losses, features = _losses(trunk, heads, x)
    with pytest.raises(RuntimeError, match="No forward call of the hooked modules"):
        mtl_backward(losses, features, A=UPGrad(), engine=Engine(trunk, batch_dim=None))
    assert all(p.grad is None for p in [*shared, *(q for h in heads for q in h.parameters())])


def test_engine_losses_that_read_only_a_parameter_feature() -> None:
    """Losses that read, of the features, only a trunk parameter that the engine does not
    hook (given as a feature): that parameter's rows, as without the engine (it was refused:
    no hooked call in the losses' graph). No loss reaches the engine's parameters: their
    ``.grad`` stays ``None``, with the engine or without it (both wrote zeros)."""
    from jacflow.autogram import Engine

    torch.manual_seed(3)
    trunk, heads = nn.Linear(3, 4).double(), [nn.Linear(4, 1).double() for _ in range(2)]
    scale, x = nn.Parameter(torch.randn(4, dtype=torch.float64)), torch.randn(5, 3).double()

    def forward() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        features = [trunk(x), scale]
        return [heads[0].bias.pow(2).sum(), (heads[1].weight * scale).sum().pow(2)], features

    shared, tasks_params = [*trunk.parameters(), scale], [[heads[0].bias], [heads[1].weight]]
    expected = _expected_grads(forward, shared, tasks_params, UPGrad())
    assert all(expected[id(p)].abs().max() == 0 for p in trunk.parameters())
    assert expected[id(scale)].abs().max() > 0
    everything = [*shared, *(q for h in heads for q in h.parameters())]
    checked = [*shared, *(p for params in tasks_params for p in params)]
    _step_and_check(forward, None, everything, [scale, *checked[len(shared) :]], expected)
    assert all(p.grad is None for p in trunk.parameters())
    engine = Engine(trunk, batch_dim=None)
    _step_and_check(forward, engine, everything, [scale, *checked[len(shared) :]], expected)
    assert all(p.grad is None for p in trunk.parameters())


@pytest.mark.parametrize("tasks", ["default", "given"])
def test_engine_refuses_a_penalty_of_losses_that_read_no_feature(tasks: str) -> None:
    """A loss that reads no feature but a hooked trunk parameter directly (a penalty on it):
    refused with the engine, as without it (its gradient was dropped, silently), and no
    ``.grad`` written."""
    from jacflow.autogram import Engine

    torch.manual_seed(4)
    trunk, head = nn.Linear(3, 4).double(), nn.Linear(4, 1).double()
    features = trunk(torch.randn(5, 3).double())
    loss = head.bias.pow(2).sum() + trunk.weight.pow(2).sum()
    tasks_params = None if tasks == "default" else [head.parameters()]
    with pytest.raises(ValueError, match="outside `features`"):
        mtl_backward([loss], features, A=Mean(), tasks_params=tasks_params, retain_graph=True)
    engine = Engine(trunk, batch_dim=None)
    features = trunk(torch.randn(5, 3).double())
    loss = head.bias.pow(2).sum() + trunk.weight.pow(2).sum()
    with pytest.raises(ValueError, match=r"Linear\.weight"):
        mtl_backward([loss], features, A=Mean(), tasks_params=tasks_params, engine=engine)
    assert all(p.grad is None for p in [*trunk.parameters(), *head.parameters()])


def test_engine_names_a_feature_sliced_from_a_hooked_parameter() -> None:
    """Losses that read only a slice of a hooked parameter given as a feature: refused with a
    message that names that cause (it said only to create the engine before the forward)."""
    from jacflow.autogram import Engine

    torch.manual_seed(5)
    trunk, head = nn.Linear(3, 4).double(), nn.Linear(2, 1).double()
    engine = Engine(trunk, batch_dim=None)
    features = [trunk(torch.randn(5, 3).double()), trunk.weight[0, :2]]
    loss = head(features[1]).pow(2).sum()
    with pytest.raises(RuntimeError, match="computed from a parameter of the hooked modules"):
        mtl_backward([loss], features, A=Mean(), engine=engine)
    assert all(p.grad is None for p in [*trunk.parameters(), *head.parameters()])


def test_shared_parameter_used_directly_as_a_feature() -> None:
    """The way out that the refusal of a loss reading a trunk parameter directly gives: that
    parameter as one more feature, whose use by each task then counts in its row (exact)."""
    torch.manual_seed(6)
    trunk, heads = nn.Linear(3, 4).double(), [nn.Linear(4, 1).double() for _ in range(2)]
    x = torch.randn(5, 3, dtype=torch.float64)

    def forward() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        f = trunk(x)
        penalty = 0.1 * trunk.bias.pow(2).sum()
        return [heads[0](f).pow(2).mean() + penalty, heads[1](f).sin().mean()], [f, trunk.bias]

    losses, _ = forward()
    expected = _brute_rows(losses, list(trunk.parameters()))
    losses, features = forward()
    mtl_backward(losses, features)
    for p, e in zip(trunk.parameters(), expected, strict=True):
        torch.testing.assert_close(p.jac, e, rtol=1e-10, atol=1e-12)  # type: ignore[attr-defined]
    for head, loss in zip(heads, forward()[0], strict=True):
        for p, g in zip(head.parameters(), torch.autograd.grad(loss, list(head.parameters()))):
            torch.testing.assert_close(p.grad, g)


def _retaining_forward(
    trunk: nn.Module, heads: list[nn.Module], x: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Nested features (``f2`` read from ``f1``) that called ``retain_grad()``, each holding a
    ``.grad`` already, and three losses that read them."""
    f1 = trunk(x)
    f2 = torch.tanh(f1) * 2
    for f in (f1, f2):
        f.retain_grad()
        f.grad = torch.full_like(f, 0.25)
    outs = [h(f) for h, f in zip(heads, (f1, f2, f2))]
    return [outs[0].pow(2).mean(), outs[1].sin().mean(), (outs[2] - 1).abs().mean()], [f1, f2]


@pytest.mark.parametrize("chunk", [None, 1, 2, "engine"])
def test_features_that_retain_grad_get_the_sum_of_the_losses_gradient(
    chunk: int | str | None,
) -> None:
    """As after ``sum(losses).backward()``, added to what they held; they got a leaked batched
    tensor (vmapped rows) or twice the true value (``parallel_chunk_size=1``)."""
    from jacflow.autogram import Engine

    trunk, heads, x = _model(torch.float64)
    losses, features = _retaining_forward(trunk, heads, x)
    sum(losses).backward()  # type: ignore[union-attr]
    expected = [f.grad for f in features]
    expected_trunk = jac(_retaining_forward(trunk, heads, x)[0], list(trunk.parameters()))
    for p in [*trunk.parameters(), *(q for h in heads for q in h.parameters())]:
        p.grad = None
    engine = Engine(trunk, batch_dim=None) if chunk == "engine" else None
    losses, features = _retaining_forward(trunk, heads, x)
    if engine is None:
        mtl_backward(losses, features, A=Mean(), parallel_chunk_size=chunk)  # type: ignore[arg-type]
    else:
        mtl_backward(losses, features, A=Mean(), engine=engine)
    for f, e in zip(features, expected, strict=True):
        torch.testing.assert_close(f.grad, e)
    for p, rows in zip(trunk.parameters(), expected_trunk, strict=True):
        torch.testing.assert_close(p.grad, rows.mean(0))


class _Failing(Aggregator):
    def forward(self, matrix: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this aggregator fails")


def test_a_failed_call_leaves_the_features_grad() -> None:
    """The heads' pass ran torch's hook on the features before the aggregator failed."""
    trunk, heads, x = _model(torch.float64)
    losses, features = _retaining_forward(trunk, heads, x)
    with pytest.raises(RuntimeError, match="fails"):
        mtl_backward(losses, features, A=_Failing())
    assert all(torch.equal(f.grad, torch.full_like(f, 0.25)) for f in features)  # type: ignore[arg-type]


class _Hooked:
    """A trunk whose features carry a gradient hook that is not linear (a clipping, then a
    scaling), counted in ``calls``; with ``nested``, a second feature computed from the first,
    hooked too."""

    def __init__(self, nested: bool) -> None:
        torch.manual_seed(7)
        self.nested = nested
        self.trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5)).double()
        self.stage2 = nn.Linear(5, 5).double()
        self.heads = [nn.Linear(5, 1).double() for _ in range(3)]
        self.x = torch.randn(7, 4, dtype=torch.float64)
        self.calls = 0
        self.shared = [*self.trunk.parameters(), *(self.stage2.parameters() if nested else ())]
        self.tasks_params = [list(h.parameters()) for h in self.heads]

    def hook(self, g: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return 2 * g.clamp(-0.02, 0.02)

    def forward(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        f1 = self.trunk(self.x)
        f2 = self.stage2(f1.tanh()) if self.nested else f1
        for f in [f1, f2] if self.nested else [f1]:
            f.register_hook(self.hook)
        losses = [
            self.heads[0](f1).pow(2).mean(),
            self.heads[1](f2).sin().mean(),
            (self.heads[2](f2) - 1).abs().mean() + self.heads[2](f1).mean(),
        ]
        return losses, [f1, f2] if self.nested else [f1]


@pytest.mark.parametrize("chunk", [None, 1, 2])
@pytest.mark.parametrize("nested", [False, True])
def test_feature_hooks_run_once_per_task_row(nested: bool, chunk: int | None) -> None:
    """A gradient hook on a feature takes part in each task's row once, as in
    ``autograd.grad(losses[i], trunk)``, where autograd runs it (a nested feature's on the
    path to the feature below it too): the heads' pass returned the hooked gradient, and the
    trunk's pull-back from the features ran the hook again on it (twice in all)."""
    model = _Hooked(nested)
    expected = _brute_rows(model.forward()[0], model.shared)
    model.calls = 0
    losses, features = model.forward()
    mtl_backward(losses, features, parallel_chunk_size=chunk)
    for p, e in zip(model.shared, expected, strict=True):
        torch.testing.assert_close(p.jac, e, rtol=1e-10, atol=1e-12)  # type: ignore[attr-defined]
    # (once per feature and chunk of rows: under vmap, a call takes each row of its chunk)
    chunks = {None: 1, 1: 3, 2: 2}[chunk]
    assert model.calls == chunks * len(features)


@pytest.mark.parametrize("aggregator", [UPGrad(), Mean()], ids=str)
def test_feature_hooks_same_with_and_without_engine(aggregator: Aggregator) -> None:
    """The engine runs a feature's hook once per task's row, as autograd does: the path
    without it agrees now (a scaling hook counted twice there, once with the engine)."""
    from jacflow.autogram import Engine

    model = _Hooked(False)
    params = [*model.shared, *(p for ps in model.tasks_params for p in ps)]
    expected = _expected_grads(model.forward, model.shared, model.tasks_params, aggregator)
    losses, features = model.forward()
    mtl_backward(losses, features, A=aggregator)
    _assert_grads(params, expected)
    for p in params:
        p.grad = None
    with Engine(model.trunk, batch_dim=None) as engine:
        losses, features = model.forward()
        mtl_backward(losses, features, A=aggregator, engine=engine)
    _assert_grads(params, expected)


@pytest.mark.parametrize("chunk", [None, 1, "engine"])
@pytest.mark.parametrize("nested", [False, True])
def test_hooked_features_that_retain_grad(nested: bool, chunk: int | str | None) -> None:
    """A hooked feature that called ``retain_grad()`` gets in ``.grad`` what
    ``sum(losses).backward()`` leaves there: the hooks' output on the losses' summed gradient
    (nested features included), with the engine as without it."""
    from jacflow.autogram import Engine

    model = _Hooked(nested)
    losses, features = model.forward()
    for f in features:
        f.retain_grad()
    sum(losses).backward()  # type: ignore[union-attr]
    expected = [f.grad for f in features]
    for p in [*model.shared, *(q for ps in model.tasks_params for q in ps)]:
        p.grad = None
    engine = Engine(model.trunk, batch_dim=None) if chunk == "engine" else None
    losses, features = model.forward()
    for f in features:
        f.retain_grad()
    if engine is None:
        mtl_backward(losses, features, A=Mean(), parallel_chunk_size=chunk)  # type: ignore[arg-type]
    else:
        mtl_backward(losses, features, A=Mean(), engine=engine)
    for f, e in zip(features, expected, strict=True):
        torch.testing.assert_close(f.grad, e, rtol=1e-10, atol=1e-12)


class _NumpyTanh(torch.autograd.Function):
    """A tanh computed in numpy: vmap cannot batch its backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        y = torch.from_numpy(np.tanh(x.detach().numpy()))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return torch.from_numpy(g.numpy() * (1 - y.numpy() ** 2))


@pytest.mark.parametrize("unbatchable", ["op", "hook"])
@pytest.mark.parametrize("route", ["by_task", "batched"])
def test_engine_with_chunk_size_one_pulls_back_row_by_row(route: str, unbatchable: str) -> None:
    """``parallel_chunk_size=1`` with ``engine``: the rows pulled back one by one, without
    vmap, so an op between the hooked modules that vmap cannot batch (numpy), or a gradient
    hook on a hooked output that reads a number (``.item()``), works, with the rows' update
    (it was ignored: the engine's batched backward failed). Without it the engine's error
    names that way out."""
    from jacflow.autogram import Engine

    torch.manual_seed(8)
    lower, upper = nn.Linear(3, 5).double(), nn.Linear(5, 4).double()
    heads = [nn.Linear(4, 1).double() for _ in range(3)]
    x = torch.randn(6, 3, dtype=torch.float64)

    def scale(g: torch.Tensor) -> torch.Tensor:
        return g * (2.0 if g.abs().max().item() > 0.01 else 0.5)

    def forward() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        h = lower(x)
        f = upper(_NumpyTanh.apply(h) if unbatchable == "op" else h.tanh())
        if unbatchable == "hook":  # (on an output with a hooked call below: the engine
            f.register_hook(scale)  # runs it again on the gradient it captured there)
        g = h[:, :4] if route == "batched" else f  # (the heads read two hooked outputs)
        losses = [heads[0](f).pow(2).mean(), heads[1](g).sin().mean(), heads[2](f).cos().mean()]
        return losses, [f] if route == "by_task" else [h, f]

    shared = [*lower.parameters(), *upper.parameters()]
    tasks_params = [list(h.parameters()) for h in heads]
    params = [*shared, *(p for ps in tasks_params for p in ps)]
    expected = _expected_grads(forward, shared, tasks_params, UPGrad())
    with Engine(lower, upper, batch_dim=None) as engine:
        losses, features = forward()
        with pytest.raises(RuntimeError, match=r"mtl_backward\(\.\.\., engine=engine, parallel_"):
            mtl_backward(losses, features, A=UPGrad(), engine=engine)
        assert all(p.grad is None for p in params)
        losses, features = forward()  # (a failed step took the forward's calls)
        mtl_backward(losses, features, A=UPGrad(), engine=engine, parallel_chunk_size=1)
    _assert_grads(params, expected)


def test_engine_refuses_chunk_sizes_it_cannot_honour() -> None:
    """The engine pulls the rows back all at once or one by one: another chunk size is
    refused before anything is computed (it was ignored, silently)."""
    from jacflow.autogram import Engine

    trunk, heads, x = _model(torch.float64)
    with Engine(trunk, batch_dim=None) as engine:
        losses, features = _losses(trunk, heads, x)
        with pytest.raises(ValueError, match="`parallel_chunk_size` must be None or 1 with"):
            mtl_backward(losses, features, A=UPGrad(), engine=engine, parallel_chunk_size=2)
        assert all(p.grad is None for p in [*trunk.parameters(), *heads[0].parameters()])
        mtl_backward(losses, features, A=UPGrad(), engine=engine, parallel_chunk_size=1)
    losses, features = _losses(trunk, heads, x)
    expected = [p.grad.clone() for p in trunk.parameters()]  # type: ignore[union-attr]
    for p in [*trunk.parameters(), *(q for h in heads for q in h.parameters())]:
        p.grad = None
    mtl_backward(losses, features, A=UPGrad())
    for p, e in zip(trunk.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=1e-7, atol=1e-10)


@pytest.mark.skipif(
    not hasattr(torch.Tensor, "grad_dtype"), reason="Tensor.grad_dtype needs torch >= 2.10"
)
@pytest.mark.parametrize("A", [UPGrad(), Mean(), None], ids=str)
def test_trunk_and_heads_are_written_in_their_grad_dtype(A: Aggregator | None) -> None:
    """As torch's ``backward`` writes them: the call failed, after writing the trunk's
    ``.grad`` (and the heads' before the one with a ``grad_dtype``)."""
    trunk, heads, x = _model(torch.bfloat16)
    with_dtype = [trunk[2].bias, heads[1].bias, heads[2].weight]
    for p in with_dtype:
        p.grad_dtype = torch.float32  # type: ignore[attr-defined]
    losses, features = _losses(trunk, heads, x)
    shared = list(trunk.parameters())
    rows = [torch.autograd.grad(loss, shared, retain_graph=True) for loss in losses]
    matrix = torch.stack([torch.cat([g.float().flatten() for g in row]) for row in rows])
    expected_heads = [
        torch.autograd.grad(loss, list(h.parameters()), retain_graph=True)
        for loss, h in zip(losses, heads)
    ]
    mtl_backward(losses, features, A=A)
    for h, expected in zip(heads, expected_heads):
        for p, g in zip(h.parameters(), expected):
            assert p.grad is not None
            wanted = torch.float32 if any(p is q for q in with_dtype) else torch.bfloat16
            assert p.grad.dtype == wanted
            torch.testing.assert_close(p.grad.float(), g.float(), atol=0.02, rtol=0.02)
    if A is None:
        return
    update = A(matrix).split([p.numel() for p in shared])
    for p, u in zip(shared, update):
        assert p.grad is not None
        wanted = torch.float32 if any(p is q for q in with_dtype) else torch.bfloat16
        assert p.grad.dtype == wanted
        torch.testing.assert_close(p.grad.float(), u.view(p.shape), atol=0.02, rtol=0.02)


def test_compiled_trunk_with_donated_buffers_names_the_way_out() -> None:
    """A trunk compiled with aot_eager donates its backward's buffers once a smaller last batch
    recompiles it; the rows' backwards (``parallel_chunk_size=1``) then failed with torch's
    raw error: it now names the setting to change."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh()).double()
    heads = [nn.Linear(8, 1).double() for _ in range(3)]
    torch._dynamo.reset()
    compiled = torch.compile(trunk, backend="aot_eager")

    def step(batch: int) -> None:
        f = compiled(torch.randn(batch, 6, dtype=torch.float64))
        mtl_backward([h(f).pow(2).mean() for h in heads], f, A=UPGrad(), parallel_chunk_size=1)

    try:
        with pytest.raises(RuntimeError, match=r"donated_buffer = False` before compiling"):
            for batch in (16, 16, 5):
                step(batch)
    finally:
        torch._dynamo.reset()


class _MultiTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(6, 8), nn.GELU())
        self.heads = nn.ModuleList([nn.Linear(8, 1) for _ in range(2)])

    def forward(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        f = self.trunk(x)
        return f, [h(f).squeeze(1) for h in self.heads]


def test_features_and_losses_of_one_compiled_graph_name_compile() -> None:
    """The whole multi-task model compiled: the losses reach the trunk through the graph's one
    node, not through ``features``. The refusal named a parameter used outside ``features``
    and advice that led to another refusal; it names torch.compile and the way out now, which
    works (the trunk and the heads compiled apart: as eager). An eager refusal says nothing of
    torch.compile."""
    torch.manual_seed(0)
    model = _MultiTask().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    f, outs = model(x)
    with pytest.raises(ValueError, match="outside `features`") as error:
        mtl_backward([outs[0].mean() + model.trunk[0].bias.sum(), outs[1].mean()], f)
    assert "compile" not in str(error.value)
    f, outs = model(x)
    mtl_backward([o.pow(2).mean() for o in outs], f, A=UPGrad())
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    try:
        with torch._functorch.config.patch(donated_buffer=False):
            f, outs = torch.compile(model, backend="aot_eager")(x)
            way_out = r"(?s)torch\.compile'd code.*Compile the trunk and the heads separately"
            with pytest.raises(ValueError, match=way_out):
                mtl_backward([o.pow(2).mean() for o in outs], f, A=UPGrad(), parallel_chunk_size=1)
            assert all(p.grad is None for p in model.parameters())
            trunk = torch.compile(model.trunk, backend="aot_eager")
            heads = [torch.compile(h, backend="aot_eager") for h in model.heads]
            f = trunk(x)
            losses = [h(f).squeeze(1).pow(2).mean() for h in heads]
            mtl_backward(losses, f, A=UPGrad(), parallel_chunk_size=1)
    finally:
        torch._dynamo.reset()
    assert len(expected) == len([*model.parameters()])
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_graph_neural_network_trunk(layout: str) -> None:
    """Three tasks on the nodes' features of a graph convolutional trunk (products with a
    sparse adjacency matrix, which vmap cannot batch): the trunk gets UPGrad of the tasks'
    Jacobian, the heads their own gradients, as computed row by row with autograd."""
    torch.manual_seed(0)
    trunk = _zoo.GCN(_zoo.adjacency(layout)).double()
    heads = [nn.Linear(4, 1).double() for _ in range(3)]
    x = torch.randn(7, 3, dtype=torch.float64)
    features = trunk(x)
    losses = [head(features).pow(2).mean() for head in heads]
    shared = list(trunk.parameters())
    expected = UPGrad()(_zoo.rows_by_autograd(losses, shared))
    expected_heads = [
        torch.autograd.grad(loss, list(h.parameters()), retain_graph=True)
        for loss, h in zip(losses, heads)
    ]
    mtl_backward(losses, features=features, A=UPGrad())
    torch.testing.assert_close(torch.cat([p.grad.reshape(-1) for p in shared]), expected)
    for head, grads in zip(heads, expected_heads):
        for p, g in zip(head.parameters(), grads):
            torch.testing.assert_close(p.grad, g)


def _trunk_partly_unreached() -> tuple[
    Callable[[], tuple[list[Tensor], list[Tensor]]], list[Tensor], list[Tensor], list[nn.Module]
]:
    """A forward with two features of which the losses read only the first: ``used`` behind
    it, ``behind_unread`` behind the second only, and ``t1`` behind neither (listed as
    shared anyway). Returns the forward, the reached shared parameters, the unreached ones and
    the heads."""
    torch.manual_seed(6)
    t0, t_b, t1 = nn.Linear(3, 4).double(), nn.Linear(3, 4).double(), nn.Linear(3, 4).double()
    heads = [nn.Linear(4, 1).double(), nn.Linear(4, 2).double()]
    x = torch.randn(5, 3, dtype=torch.float64)

    def forward() -> tuple[list[Tensor], list[Tensor]]:
        f, unread = torch.tanh(t0(x)), t_b(x)
        return [heads[0](f).pow(2).mean(), heads[1](f).sin().mean()], [f, unread]

    return forward, list(t0.parameters()), [*t_b.parameters(), *t1.parameters()], heads


@pytest.mark.parametrize("aggregator", [UPGrad(), Mean()], ids=str)
@pytest.mark.parametrize("chunk", [None, 1])
@pytest.mark.parametrize("existing", [False, True])
def test_an_unreached_shared_param_keeps_its_grad_as_torch_does(
    aggregator: Aggregator, chunk: int | None, existing: bool
) -> None:
    """A shared parameter that no loss reaches (behind a feature that no loss reads, or behind
    no feature) got a zero ``.grad``; it keeps its ``.grad``, as after
    ``sum(losses).backward(inputs=shared_params)``. The reached ones get ``A`` of the
    Jacobian, as before. Its post-accumulate hooks do not run, as with torch."""
    forward, reached, unreached, heads = _trunk_partly_unreached()
    shared = [*reached, *unreached]
    held, hooked = torch_leaves_alone(
        lambda: torch.autograd.backward(sum(forward()[0]), inputs=shared),
        shared,
        unreached,
        existing,
    )
    losses, features = forward()
    rows = _brute_rows(losses, shared)
    update = aggregator(torch.cat([r.flatten(1) for r in rows], 1))
    expected = [u.view_as(p) for u, p in zip(update.split([p.numel() for p in shared]), shared)]
    mtl_backward(losses, features, A=aggregator, shared_params=shared, parallel_chunk_size=chunk)
    assert_left_alone(unreached, held, hooked)
    for p, e in zip(reached, expected):
        torch.testing.assert_close(p.grad, e)
    for head, loss in zip(heads, losses):
        # (the heads as before: each its task's gradient)
        for p, g in zip(head.parameters(), torch.autograd.grad(loss, list(head.parameters()))):
            torch.testing.assert_close(p.grad, g)


def test_an_unreached_shared_param_gets_no_jac() -> None:
    """Without ``A``, an unreached shared parameter got a zero ``.jac``; it gets none (one it
    has is left unchanged), and ``jac_to_grad`` then skips it, its ``.grad`` left alone."""
    forward, reached, unreached, _ = _trunk_partly_unreached()
    kept = torch.ones(2, *unreached[-1].shape, dtype=torch.float64)
    unreached[-1].jac = kept  # type: ignore[attr-defined]
    losses, features = forward()
    rows = _brute_rows(losses, reached)
    mtl_backward(losses, features, shared_params=[*reached, *unreached])
    assert all(not hasattr(p, "jac") for p in unreached[:-1])
    assert unreached[-1].jac is kept and torch.equal(kept, torch.ones_like(kept))  # type: ignore[attr-defined]
    for p, r in zip(reached, rows):
        torch.testing.assert_close(p.jac, r)  # type: ignore[attr-defined]
    del unreached[-1].jac  # type: ignore[attr-defined]
    jac_to_grad([*reached, *unreached], UPGrad())
    assert all(p.grad is None for p in unreached)
    update = UPGrad()(torch.cat([r.flatten(1) for r in rows], 1))
    for p, u in zip(reached, update.split([p.numel() for p in reached])):
        torch.testing.assert_close(p.grad, u.view_as(p))


@pytest.mark.parametrize("with_engine", [False, True])
def test_the_aggregator_is_called_when_no_loss_reaches_the_trunk(with_engine: bool) -> None:
    """Losses that read no feature: ``A``'s weighting runs once per call on both routes (a
    stateful one advances at every step, a monitor sees every step), and the trunk's ``.grad``
    stays ``None``. Without the engine it was not called, with it it was."""
    from jacflow.aggregation import GramianWeightedAggregator, UPGradWeighting
    from jacflow.autogram import Engine

    torch.manual_seed(0)
    trunk, heads = nn.Linear(3, 4), [nn.Linear(3, 1), nn.Linear(3, 1)]
    engine = Engine(trunk, batch_dim=None) if with_engine else None
    weighting, calls = UPGradWeighting(), []
    weighting.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(5, 3)
    features = trunk(x)
    losses = [h(x).pow(2).mean() for h in heads]
    mtl_backward(
        losses,
        features,
        A=GramianWeightedAggregator(weighting),
        tasks_params=[list(h.parameters()) for h in heads],
        shared_params=list(trunk.parameters()),
        engine=engine,
    )
    assert len(calls) == 1
    assert all(p.grad is None for p in trunk.parameters())
    for head in heads:
        expected = torch.autograd.grad(head(x).pow(2).mean(), list(head.parameters()))
        for p, g in zip(head.parameters(), expected, strict=True):
            torch.testing.assert_close(p.grad, g)


@pytest.mark.parametrize("with_engine", [False, True])
@pytest.mark.parametrize("frozen", ["engine_layer", "head"])
def test_a_parameter_frozen_after_the_forward_is_left_out(frozen: str, with_engine: bool) -> None:
    """A parameter frozen between the forward and the step (a freeze schedule) is left out of
    the step, as ``torch.autograd.backward`` leaves it, with or without the engine: the others
    get the brute-force update of the losses' Jacobian without it. It raised torch's error on
    ``autograd.grad`` of a tensor that does not require grad."""
    from jacflow.autogram import Engine

    torch.manual_seed(6)
    trunk = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    heads = [nn.Linear(6, 1).double() for _ in range(2)]
    x = torch.randn(8, 5, dtype=torch.float64)
    cold = trunk[0].weight if frozen == "engine_layer" else heads[0].weight

    def forward() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        f = trunk(x)
        return [h(f).pow(2).mean() for h in heads], [f]

    shared = [p for p in trunk.parameters() if p is not cold]
    tasks = [[p for p in h.parameters() if p is not cold] for h in heads]
    expected = _expected_grads(forward, shared, tasks, UPGrad())
    with Engine(trunk, batch_dim=None) if with_engine else contextlib.nullcontext() as engine:
        losses, features = forward()
        cold.requires_grad_(False)
        mtl_backward(losses, features, A=UPGrad(), engine=engine)
    assert cold.grad is None
    _assert_grads([*shared, *(p for params in tasks for p in params)], expected)


def test_a_frozen_leaf_is_not_an_input_of_jac() -> None:
    """``jac(outputs)`` (every leaf that requires grad) leaves out a leaf frozen since the
    forward, as ``torch.autograd.backward`` does; the others' Jacobians are the brute force's."""
    torch.manual_seed(7)
    layer = nn.Linear(3, 2).double()
    out = layer(torch.randn(4, 3, dtype=torch.float64)).pow(2).sum(0)
    layer.weight.requires_grad_(False)
    expected = _brute_rows(list(out), [layer.bias])[0]
    (jacobian,) = jac(out)
    torch.testing.assert_close(jacobian, expected)


@pytest.mark.parametrize("hooked", [False, True])
@pytest.mark.parametrize("route", ["by_task", "batched"])
def test_engine_task_param_that_its_tasks_do_not_reach_is_left_alone(
    route: str, hooked: bool
) -> None:
    """A parameter listed in ``tasks_params`` for a task whose loss does not reach it (read by
    another task only) keeps its ``.grad`` with the engine as without it, as torch leaves an
    input that the losses do not reach; no hook of its runs. The engine's backward, batched over
    the tasks, gave it a zero ``.grad``. The other parameters get the brute-force step."""
    from jacflow.autogram import Engine

    torch.manual_seed(8)
    trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    heads = [nn.Linear(6, 1).double() for _ in range(2)]
    side = nn.Linear(6, 1).double()  # read by task 0, listed under task 1
    x = torch.randn(7, 4, dtype=torch.float64)

    def forward() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        f = trunk(x)
        g = trunk[1](trunk[0](x)) if route == "batched" else f  # (a second hooked output)
        losses = [(heads[0](f) + side(f)).pow(2).mean(), heads[1](g).sin().mean()]
        return losses, [f] if route == "by_task" else [g, f]

    tasks_params = [list(heads[0].parameters()), [*heads[1].parameters(), *side.parameters()]]
    shared = list(trunk.parameters())
    expected = _expected_grads(forward, shared, [tasks_params[0], tasks_params[1][:2]], UPGrad())
    calls: list[Tensor] = []
    if hooked:
        side.weight.register_hook(calls.append)
    with Engine(trunk, batch_dim=None) as engine:
        losses, features = forward()
        mtl_backward(losses, features, A=UPGrad(), tasks_params=tasks_params, engine=engine)
    assert side.weight.grad is None and side.bias.grad is None and not calls
    _assert_grads([*shared, *tasks_params[0], *tasks_params[1][:2]], expected)


@pytest.mark.parametrize("with_engine", [False, True])
def test_a_task_parameter_behind_the_features_gets_its_tasks_gradient(with_engine: bool) -> None:
    """A parameter between the engine's modules and the features (a projection), listed as a
    task's, gets that task's loss's gradient, with or without the engine (the check of which
    tasks reach a parameter walks the heads only, and kept it out)."""
    from jacflow.autogram import Engine

    torch.manual_seed(9)
    trunk, proj = nn.Linear(4, 5).double(), nn.Linear(5, 5).double()
    heads = [nn.Linear(5, 1).double() for _ in range(2)]
    x = torch.randn(6, 4, dtype=torch.float64)
    with Engine(trunk, batch_dim=None) if with_engine else contextlib.nullcontext() as engine:
        features = proj(trunk(x))
        losses = [heads[0](features).pow(2).mean(), heads[1](features).sin().mean()]
        expected = torch.autograd.grad(losses[0], list(proj.parameters()), retain_graph=True)
        tasks_params = [[*heads[0].parameters(), *proj.parameters()], list(heads[1].parameters())]
        mtl_backward(
            losses,
            [features],
            A=UPGrad(),
            tasks_params=tasks_params,
            shared_params=list(trunk.parameters()),
            engine=engine,
        )
    for p, e in zip(proj.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e)


def test_a_trunk_frozen_since_the_forward_is_named() -> None:
    """Every trunk parameter frozen since the forward, no engine: a refusal that gives that
    cause (it named `shared_params`, which the caller did not pass), and no ``.grad``
    written; ``backward`` with every leaf frozen likewise (it named `inputs`), and ``jac``
    (it returned no Jacobian)."""
    torch.manual_seed(10)
    trunk, head = nn.Linear(4, 5).double(), nn.Linear(5, 1).double()
    features = trunk(torch.randn(6, 4, dtype=torch.float64))
    losses = [head(features).pow(2).mean(), head(features).sin().mean()]
    trunk.requires_grad_(False)
    with pytest.raises(ValueError, match=r"No parameter behind `features` requires grad"):
        mtl_backward(losses, [features], A=UPGrad())
    assert all(p.grad is None for p in [*trunk.parameters(), *head.parameters()])
    head.requires_grad_(False)
    with pytest.raises(ValueError, match=r"`tensors` reach no leaf tensor that requires grad"):
        backward(losses, A=UPGrad())
    # (``jac`` likewise: it returned no Jacobian, as if there were nothing to differentiate)
    with pytest.raises(ValueError, match=r"`outputs` reach no leaf tensor that requires grad"):
        jac(losses)
