"""The engine's Gramian and update against a brute-force Jacobian (one autograd.grad per loss)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from jacflow.aggregation import ConstantWeighting, MeanWeighting, UPGradWeighting
from jacflow.autogram import Engine, _conv, _embedding, _linear
from jacflow.autogram._conv import ConvContribution
from jacflow.autogram._linear import UnfoldedContribution
from jacflow.linalg import _products
from tests.autogram._zoo import CASES, Case


def hooked_params(modules: tuple[nn.Module, ...]) -> list[Tensor]:
    seen: dict[int, Tensor] = {}
    for module in modules:
        for p in module.parameters():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())


def reference_jacobian(losses: Tensor, params: list[Tensor]) -> Tensor:
    """``[m, n]``: one ``autograd.grad`` per loss element."""
    rows = []
    for loss in losses.flatten():
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        rows.append(
            torch.cat(
                [(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, params)]
            )
        )
    return torch.stack(rows)


def assert_float32_gramian(engine: Engine, losses: Tensor, jacobian: Tensor) -> Tensor:
    """The engine's Gramian of a float16 layer's ``losses``: in float32 and within 1e-2 of
    ``J J^T`` relative to its largest entry (float16's own rounding); returned."""
    gramian = engine.compute_gramian(losses)
    assert gramian.dtype == torch.float32
    expected = jacobian @ jacobian.T
    peak = float(expected.abs().max())
    torch.testing.assert_close(gramian.double() / peak, expected / peak, rtol=0, atol=1e-2)
    return gramian


def assert_exact_gramian(engine: Engine, losses: Tensor, params: list[Tensor]) -> None:
    """The engine's Gramian of ``losses`` equals the brute-force ``J J^T`` (with
    ``torch.testing.assert_close``'s default tolerances)."""
    jacobian = reference_jacobian(losses, params)
    torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)


def assert_exact_step(engine: Engine, forward: Callable[[], Tensor], params: list[Tensor]) -> None:
    """The engine's Gramian of ``forward()``'s losses equals the brute-force ``J J^T``, and its
    UPGrad step on a second ``forward()`` writes ``weights @ J`` into the ``.grad`` of
    ``params`` (which have none before)."""
    losses = forward()
    jacobian = reference_jacobian(losses, params)
    torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)
    weights = engine.backward(forward(), UPGradWeighting())
    actual = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    torch.testing.assert_close(actual, weights.flatten() @ jacobian)


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float64 else TOL32


TOL32 = {"rtol": 2e-3, "atol": 2e-4}


def check_case(case: Case, dtype: torch.dtype) -> None:
    model, modules, forward = case.build(dtype)
    params = hooked_params(modules)
    outside = [p for p in model.parameters() if all(p is not q for q in params)]
    tol = tolerances(dtype)
    with Engine(*modules, batch_dim=case.batch_dim) as engine:
        losses = forward()
        jacobian = reference_jacobian(losses, params)
        gramian = engine.compute_gramian(losses)
        scale = jacobian.pow(2).sum(1).max().item() + 1.0
        torch.testing.assert_close(gramian / scale, jacobian @ jacobian.T / scale, **tol)

        weights = engine.backward(forward(), UPGradWeighting())
        assert weights.shape == losses.shape
        expected = weights.flatten().to(dtype) @ jacobian
        actual = torch.cat(
            [(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in params]
        )
        gscale = expected.abs().max().item() + 1.0
        torch.testing.assert_close(actual / gscale, expected / gscale, **tol)
        assert all(p.grad is None for p in outside)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gramian_and_update_float64(case: Case, device: str) -> None:
    with torch.device(device):
        check_case(case, torch.float64)


FLOAT32 = ["mlp", "cnn", "transformer_block", "weight_tying", "tasks_mlp", "embedding_padding"]


@pytest.mark.parametrize("case", [c for c in CASES if c.name in FLOAT32], ids=FLOAT32)
def test_gramian_and_update_float32(case: Case, device: str) -> None:
    with torch.device(device):
        check_case(case, torch.float32)


def test_large_float32_products_match_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers large enough for oneDNN's products (:mod:`jacflow.linalg._products`: from 16
    million multiply-adds) agree with the float64 reference; on a host that prefers oneDNN they
    are taken."""
    taken: list[tuple[int, ...]] = []
    real = _products.onednn_product

    def spy(a: Tensor, b: Tensor) -> Tensor:
        taken.append((*a.shape, b.shape[1]))
        return real(a, b)

    monkeypatch.setattr(_products, "onednn_product", spy)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(32, 32, 3, stride=2, padding=1),  # per-sample gradients [128, 9216]
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(128, 1024),  # output gradients [128, 1024]; update [1024, 128] @ [128, 128]
        nn.Tanh(),
    )
    x = torch.randn(128, 32, 16, 16)
    exact = copy.deepcopy(model).double()
    params = list(exact.parameters())
    rows = [  # one sample at a time: the samples do not interact
        torch.cat(
            [
                g.flatten()
                for g in torch.autograd.grad(exact(x[i : i + 1].double()).pow(2).mean(), params)
            ]
        )
        for i in range(len(x))
    ]
    jacobian = torch.stack(rows)
    engine = Engine(model, batch_dim=0)
    losses = model(x).pow(2).mean(1)
    gramian = engine.compute_gramian(losses)
    scale = float(jacobian.pow(2).sum(1).max())
    torch.testing.assert_close(gramian.double() / scale, jacobian @ jacobian.T / scale, **TOL32)
    weights = engine.backward(model(x).pow(2).mean(1), MeanWeighting())
    actual = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    expected = weights.double() @ jacobian
    gscale = float(expected.abs().max())
    torch.testing.assert_close(actual / gscale, expected / gscale, **TOL32)
    if _products.host_prefers_onednn():
        assert (128, 9216, 128) in taken  # the convolution's Gramian
        assert (128, 1024, 128) in taken  # the Linear's output-gradient Gramian
        # its weight gradient, written into the gradient's buffer by slices of rows
        assert sum(n for n, k, p in taken if (k, p) == (128, 128)) == 1024
    else:
        assert not taken


def test_weights_match_weighting_of_reference_gramian() -> None:
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    engine = Engine(model, batch_dim=0)
    losses = (model(x) - 1).pow(2).sum(1)
    jacobian = reference_jacobian(losses, list(model.parameters()))
    weights = engine.backward(losses, UPGradWeighting())
    expected = UPGradWeighting()(jacobian @ jacobian.T)
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=1e-8)


def test_backward_accumulates_into_existing_grad() -> None:
    layer = nn.Linear(2, 1).double()
    layer.weight.grad = torch.ones_like(layer.weight)
    x = torch.randn(3, 2, dtype=torch.float64)
    engine = Engine(layer, batch_dim=0)
    losses = layer(x).squeeze(1)
    engine.backward(losses, MeanWeighting())
    torch.testing.assert_close(layer.weight.grad, 1 + x.mean(0, keepdim=True))
    torch.testing.assert_close(layer.bias.grad, torch.ones(1, dtype=torch.float64))


def test_other_params_get_weighted_gradient() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    engine = Engine(model[2], batch_dim=0)
    losses = model(x).pow(2).sum(1)
    first = list(model[0].parameters())
    jacobian = reference_jacobian(losses, first)
    weights = engine.backward(losses, UPGradWeighting(), other_params=first)
    expected = weights @ jacobian
    actual = torch.cat([p.grad.flatten() for p in first])  # type: ignore[union-attr]
    torch.testing.assert_close(actual, expected)


def test_other_params_read_as_a_sum_get_gradients_of_their_own() -> None:
    """autograd.grad returns one buffer for the inputs of ``a + b``: each ``.grad`` gets its
    own, so that a second step and an in-place scaling of one match torch's ``.grad``."""
    layer = nn.Linear(3, 2).double()
    a, b = (torch.randn(2, dtype=torch.float64, requires_grad=True) for _ in range(2))
    x = torch.randn(4, 3, dtype=torch.float64)
    engine = Engine(layer, batch_dim=0)
    for _ in range(2):
        weights = engine.backward((layer(x) * (a + b)).sum(1), MeanWeighting(), other_params=[a, b])
    expected = 2 * torch.autograd.grad(weights @ (layer(x) * (a + b)).sum(1), a)[0]
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(a.grad, expected)
    a.grad.mul_(0.5)
    torch.testing.assert_close(b.grad, expected)


def test_large_vocabulary_embedding_uses_pairwise_form() -> None:
    embedding = nn.Embedding(1000, 2).double()
    ids = torch.tensor([[3, 999, 3], [5, 6, 7]])
    engine = Engine(embedding, batch_dim=0)
    losses = embedding(ids).sin().sum((1, 2))
    assert_exact_gramian(engine, losses, [embedding.weight])


@pytest.mark.parametrize("per_sample", [1, 2])
def test_large_vocabulary_embedding_by_token_form(
    per_sample: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The by-token form (its costs set to the products alone, so that it is taken) on tokens
    in 1, 2, 3 and 5 samples (blocks of 1, 2, 4 and 8 rows with one loss per sample), one twice
    in a sample, and padding; with ``per_sample`` losses per sample."""
    for name in ("BY_TOKEN_GATHER_COST", "BY_TOKEN_SCATTER_COST", "BY_TOKEN_SIZE_COST"):
        monkeypatch.setattr(_embedding, name, 0)
    taken = []
    by_token = _embedding._gramian_by_token
    monkeypatch.setattr(
        _embedding, "_gramian_by_token", lambda *args: taken.append(1) or by_token(*args)
    )
    torch.manual_seed(0)
    embedding = nn.Embedding(10_000, 3, padding_idx=0).double()
    ids = torch.randint(20, 10_000, (6, 8))
    ids[:2, 0], ids[:3, 1], ids[:5, 2], ids[3, 3:5], ids[1:4, 5] = 7, 8, 9, 10, 0
    engine = Engine(embedding, batch_dim=0)
    losses = embedding(ids).sin().unflatten(1, (per_sample, -1)).sum((2, 3))
    assert_exact_gramian(engine, losses, [embedding.weight])
    assert taken


ROUTE_CASES = [
    c
    for c in CASES
    if c.name
    in {
        "conv1d",
        "conv1d_circular_dilation_groups",
        "conv2d_dilation_groups",
        "conv2d_depthwise",
        "conv2d_same_reflect",
        "conv3d",
        "conv3d_replicate_dilation_groups",
        "cnn",
        "linear_seq_ghost",
        "linear_seq_materialized",
        "mlp_losses_Bk",
        "tasks_mlp",
        "tasks_cnn",
        "tasks_conv_groups",
        "called_twice",
        "weight_tying",
    }
]


def force_route(monkeypatch: pytest.MonkeyPatch, route: str, keep: bool) -> None:
    """Force a Gramian route of Conv layers (ghost, grouped convolution, unfolded matmul) and
    of Linear layers (ghost or materialised), and whether materialised per-row gradients are
    kept for the update (else the update is recomputed from the recorded tensors)."""
    monkeypatch.setattr(ConvContribution, "_route", lambda self: route)
    monkeypatch.setattr(UnfoldedContribution, "_ghost_cheaper", lambda self: route == "ghost")
    monkeypatch.setattr(_conv, "worth_keeping", lambda *tensors: keep)
    monkeypatch.setattr(_linear, "worth_keeping", lambda *tensors: keep)


@pytest.mark.parametrize(
    ("route", "keep"), [("ghost", False), ("conv", True), ("conv", False), ("unfold", True)]
)
@pytest.mark.parametrize("case", ROUTE_CASES, ids=[c.name for c in ROUTE_CASES])
def test_every_route_agrees(
    case: Case, route: str, keep: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    force_route(monkeypatch, route, keep)
    check_case(case, torch.float64)


FLOAT32_ROUTES = ["cnn", "conv3d_replicate_dilation_groups", "tasks_cnn", "linear_seq_ghost"]


@pytest.mark.parametrize("route", ["ghost", "conv", "unfold"])
@pytest.mark.parametrize("case", [c for c in CASES if c.name in FLOAT32_ROUTES], ids=FLOAT32_ROUTES)
def test_every_route_agrees_float32(
    case: Case, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    force_route(monkeypatch, route, route != "ghost")
    check_case(case, torch.float32)


def test_route_choice_follows_the_operation_count() -> None:
    """First layer on RGB images: unfold; wide channels: grouped convolution; few positions
    with wide channels: ghost (the three exact routes, picked by their operation counts)."""
    torch.manual_seed(0)
    expected = [
        (nn.Conv2d(3, 16, 3, padding=1), (3, 32, 32), "unfold"),
        (nn.Conv2d(16, 32, 3, stride=2, padding=1), (16, 32, 32), "conv"),
        (nn.Conv2d(64, 64, 3), (64, 3, 3), "ghost"),
    ]
    for layer, shape, route in expected:
        engine = Engine(layer, batch_dim=0)
        losses = layer(torch.randn(8, *shape)).flatten(1).sum(1)
        contributions = engine._prepare(losses, False, ())[0]
        contribution = contributions[0][1]
        assert isinstance(contribution, ConvContribution)
        assert contribution._route() == route


@pytest.mark.parametrize(
    ("layer", "size", "route"),
    [
        (nn.Conv2d(64, 64, 3, padding=1), 3, "ghost"),
        (nn.Conv2d(64, 64, 3, padding=1), 6, "conv"),
        (nn.Conv2d(64, 64, 3, padding=1, groups=64), 1, "conv"),
    ],
)
def test_small_maps_route_counts_the_per_row_gradients_written(
    layer: nn.Conv2d, size: int, route: str
) -> None:
    """B = 32: on 3 x 3 maps the materialising routes write 32 gradients of the whole weight,
    most of their time there (the grouped convolution took 2.4x the ghost route's step); a
    depthwise layer on 1 x 1 maps keeps the grouped convolution (the ghost route loops over the
    64 groups). The Gramian is exact whichever route is taken (the forced-route tests)."""
    engine = Engine(layer, batch_dim=0)
    losses = layer(torch.randn(32, 64, size, size)).flatten(1).sum(1)
    contribution = engine._prepare(losses, False, ())[0][0][1]
    assert isinstance(contribution, ConvContribution)
    assert contribution._route() == route


def test_parameter_registered_under_two_names_counts_once() -> None:
    """A rule reads a module's own parameters directly; one registered twice is one parameter,
    as in ``named_parameters`` (counting it twice would double its Gramian)."""
    layer = nn.Linear(3, 2).double()
    layer.register_parameter("alias", layer.weight)
    x = torch.randn(4, 3, dtype=torch.float64)
    engine = Engine(layer, batch_dim=0)
    losses = layer(x).pow(2).sum(1)
    jacobian = reference_jacobian(losses, list(layer.parameters()))
    gramian = engine.compute_gramian(losses)
    torch.testing.assert_close(gramian, jacobian @ jacobian.T)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch_dim", [0, None])
def test_parametrized_weight_goes_to_the_generic_rule(bias: bool, batch_dim: int | None) -> None:
    """A parametrised weight (here weight norm) is computed from parameters of child modules:
    the Gramian and the update must cover them, not only the module's direct bias."""
    from torch.nn.utils import parametrizations

    model = nn.Sequential(
        parametrizations.weight_norm(nn.Linear(3, 4, bias=bias)), nn.Tanh(), nn.Linear(4, 1)
    ).double()
    params = list(model.parameters())
    x = torch.randn(5, 3, dtype=torch.float64)
    engine = Engine(model, batch_dim=batch_dim)
    losses = model(x).pow(2).sum(1)
    jacobian = reference_jacobian(losses, params)
    torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)
    weights = engine.backward(model(x).pow(2).sum(1), UPGradWeighting())
    actual = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    torch.testing.assert_close(actual, weights @ jacobian)


DEFAULT_DEVICE_CASES = ["mlp_losses_Bk", "cnn", "transformer_block", "tasks_mlp", "tasks_cnn"]


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.name in DEFAULT_DEVICE_CASES], ids=DEFAULT_DEVICE_CASES
)
def test_default_device_plays_no_part(case: Case) -> None:
    """The Gramian, the UPGrad weights and the ``.grad`` follow the model's device, whatever the
    default device (here ``meta``, on which nothing can be computed)."""
    results = []
    for default in ("cpu", "meta"):
        torch.manual_seed(0)
        _, modules, forward = case.build(torch.float64)
        with Engine(*modules, batch_dim=case.batch_dim) as engine, torch.device(default):
            gramian = engine.compute_gramian(forward())
            weights = engine.backward(forward(), UPGradWeighting())
        grads = [p.grad for p in hooked_params(modules)]
        results.append((gramian, weights, grads))
    (gramian, weights, grads), (gramian_m, weights_m, grads_m) = results
    assert gramian_m.device.type == weights_m.device.type == "cpu"
    torch.testing.assert_close(gramian_m, gramian, rtol=0, atol=0)
    torch.testing.assert_close(weights_m, weights, rtol=0, atol=0)
    torch.testing.assert_close(grads_m, grads, rtol=0, atol=0)


class _TiedHead(nn.Module):
    """An embedding whose table is also the output layer's weight (through a hooked Linear)."""

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4, sparse=sparse)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(torch.tanh(self.embed(idx))).pow(2).mean((1, 2))


def _weighted_backward(model: nn.Module, losses: Tensor, weights: Tensor) -> list[Tensor]:
    """The gradients that autograd accumulates for ``weights @ losses`` (hooks included)."""
    (weights.detach() @ losses).backward()
    return [p.grad.to_dense() for p in model.parameters()]


def test_parameter_gradient_hooks_run_on_the_update() -> None:
    """Gradient hooks on the parameters (a mask, a clip of a tied weight, summed over its uses
    first) and post-accumulate hooks run as after ``(w @ losses).backward()``; they were
    skipped (70% off with a mask)."""
    torch.manual_seed(0)
    idx = torch.randint(0, 7, (5, 3))
    models, calls = [], []
    for _ in range(2):
        torch.manual_seed(0)
        model = _TiedHead().double()
        model.head.weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
        model.head.weight.register_hook(lambda g: g * (torch.arange(4) % 2).double())
        model.head.weight.register_post_accumulate_grad_hook(calls.append)
        models.append(model)
    engine = Engine(models[0], batch_dim=0)
    weights = engine.backward(models[0](idx), UPGradWeighting())
    expected = _weighted_backward(models[1], models[1](idx), weights)
    for param, grad in zip(models[0].parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, grad)
    assert len(calls) == 2 and calls[0] is models[0].head.weight


@pytest.mark.parametrize("returned", ["shape", "dtype", "not a tensor", "sparse"])
def test_parameter_hooks_returning_another_gradient_are_refused(returned: str) -> None:
    """What autograd refuses from a gradient hook (another shape or dtype), refused before any
    ``.grad`` is written; other parameters keep theirs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    change = {
        "shape": lambda g: g[:, :1],
        "dtype": lambda g: g.float(),
        "not a tensor": lambda g: 1.0,
        "sparse": lambda g: g.to_sparse(),
    }[returned]
    model[2].weight.register_hook(change)
    engine = Engine(model, batch_dim=0)
    losses = model(torch.randn(5, 3, dtype=torch.float64)).squeeze(1)
    with pytest.raises(ValueError, match="must return None or a tensor like its argument"):
        engine.backward(losses, UPGradWeighting())
    assert all(p.grad is None for p in model.parameters())


def test_sparse_embedding_tied_to_a_linear_accumulates() -> None:
    """A sparse embedding's update plus its tied Linear's dense one (``add(sparse, dense)``
    failed)."""
    torch.manual_seed(0)
    idx = torch.randint(0, 7, (5, 3))
    sparse, dense = _TiedHead(sparse=True).double(), _TiedHead().double()
    dense.load_state_dict(sparse.state_dict())
    weights = Engine(sparse, batch_dim=0).backward(sparse(idx), UPGradWeighting())
    expected = _weighted_backward(dense, dense(idx), weights)
    torch.testing.assert_close(sparse.embed.weight.grad.to_dense(), expected[0])


def test_other_params_skip_the_hooked_ones() -> None:
    """``other_params=model.parameters()`` (every parameter, hooked ones included, and a
    repeat) gives each one ``w @ J`` once; the hooked ones got it twice. A frozen one is
    skipped (autograd raised)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    engine = Engine(model[2], batch_dim=0)
    losses = model(torch.randn(5, 4, dtype=torch.float64)).pow(2).sum(1)
    params = list(model.parameters())
    jacobian = reference_jacobian(losses, params)
    model[0].weight.requires_grad_(False)  # (frozen ones are skipped too)
    weights = engine.backward(losses, UPGradWeighting(), other_params=[*params, params[0]])
    assert model[0].weight.grad is None
    got = torch.cat([p.grad.flatten() for p in params[1:]])
    torch.testing.assert_close(got, weights @ jacobian[:, params[0].numel() :])


def test_a_tensor_a_hook_keeps_or_returns_is_not_the_grad() -> None:
    """A hook that keeps its argument, or returns a tensor held elsewhere: `.grad` is a copy,
    so later steps do not write into them (they did: 0.4 instead of 0.3 after 3 steps)."""
    layer = nn.Linear(2, 1).double()
    constant, seen = torch.full((1, 2), 0.1, dtype=torch.float64), []
    layer.weight.register_hook(lambda g: seen.append(g))
    layer.weight.register_hook(lambda g: constant)
    engine = Engine(layer, batch_dim=0)
    for _ in range(3):
        engine.backward(layer(torch.randn(3, 2, dtype=torch.float64)).squeeze(1), MeanWeighting())
    torch.testing.assert_close(layer.weight.grad, torch.full((1, 2), 0.3, dtype=torch.float64))
    assert float(constant[0, 0]) == 0.1 and all(g is not layer.weight.grad for g in seen)


class _Gated(nn.Module):
    """A module without a closed form (the generic rule) whose forward uses ``b`` only when
    asked, and reads ``c`` without grad."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.c = nn.Parameter(torch.randn(4, dtype=torch.float64))

    def forward(self, x: Tensor, use_b: bool) -> Tensor:
        with torch.no_grad():
            shift = self.c.sum()
        return x * self.a + (x * self.b if use_b else 0.0) + shift


@pytest.mark.parametrize("batch_dim", [0, None])
def test_generic_parameters_the_losses_do_not_reach_keep_their_grad(batch_dim: int | None) -> None:
    """A parameter of a generic-rule module that the losses do not reach (not used by this
    forward, or used without grad) keeps ``.grad`` as autograd leaves it: ``None``, or its
    earlier value; the reached ones get the weighted gradient. Before, they got zeros, which an
    optimiser with weight decay or momentum then applied."""
    x = torch.randn(5, 4, dtype=torch.float64)
    models = []
    for _ in range(2):  # (the engine's, and autograd's reference)
        torch.manual_seed(0)
        models.append(nn.ModuleList([_Gated(), nn.Linear(4, 2, dtype=torch.float64)]))

    def losses_of(model: nn.ModuleList, use_b: bool) -> Tensor:
        out = model[1](model[0](x, use_b))
        return out.sum(1) if batch_dim == 0 else out.pow(2).mean(0)

    engine = Engine(*models[0], batch_dim=batch_dim)
    for use_b in (False, True, False):
        weights = engine.backward(losses_of(models[0], use_b), UPGradWeighting())
        (weights.detach() * losses_of(models[1], use_b)).sum().backward()
        for got, expected in zip(models[0].parameters(), models[1].parameters(), strict=True):
            if expected.grad is None:
                assert got.grad is None
            else:
                assert got.grad is not None
                torch.testing.assert_close(got.grad, expected.grad)
    assert models[0][0].c.grad is None
    assert models[0][0].b.grad is not None  # (from the middle step, kept through the last)


def _masked(module: nn.Module) -> nn.Module:
    """``module`` whose weight a forward pre-hook computes from a parameter ``weight_orig`` and
    a fixed mask: ``torch.nn.utils.prune`` written by hand (masked or sparse training)."""
    weight = module.weight
    del module._parameters["weight"]
    module.weight_orig = nn.Parameter(weight.detach().clone())
    module.register_buffer("weight_mask", (torch.rand_like(weight) > 0.3).to(weight.dtype))

    def hook(mod: nn.Module, args: Any) -> None:
        mod.weight = mod.weight_orig * mod.weight_mask

    module.register_forward_pre_hook(hook)
    return module


# kind: (the layers, the last one masked; their input; their output's size)
_MASKED: dict[str, tuple[Callable[[], list[nn.Module]], Callable[[], Tensor], int]] = {
    "linear": (lambda: [nn.Linear(5, 3)], lambda: torch.randn(4, 5), 3),
    "conv": (lambda: [nn.Conv1d(5, 3, 2)], lambda: torch.randn(4, 5, 6), 15),
    "layer_norm": (lambda: [nn.Linear(5, 3), nn.LayerNorm(3)], lambda: torch.randn(4, 5), 3),
    "embedding": (lambda: [nn.Embedding(7, 3)], lambda: torch.randint(0, 7, (4, 6)), 18),
}


@pytest.mark.parametrize("kind", list(_MASKED))
@pytest.mark.parametrize("batch_dim", [0, None])
def test_a_parameter_the_closed_form_does_not_read_goes_to_the_generic_rule(
    kind: str, batch_dim: int | None
) -> None:
    """A covered layer with a trainable parameter outside its rule's slots (``weight_orig``,
    from which a pre-hook computes the weight) takes the generic rule: that parameter is in the
    Gramian and gets its ``.grad`` (the closed form left it out, silently)."""
    make, data, size = _MASKED[kind]
    torch.manual_seed(0)
    *before, last = make()
    model = nn.Sequential(*before, _masked(last), nn.Tanh(), nn.Flatten(), nn.Linear(size, 1))
    model = model.double()
    x = data()
    x = x if kind == "embedding" else x.double()
    params = list(model.parameters())

    def forward() -> Tensor:
        out = model(x).squeeze(1)
        return out.pow(2) if batch_dim == 0 else torch.stack([out.sum(), out.pow(2).sum()])

    with Engine(model, batch_dim=batch_dim) as engine:
        assert_exact_step(engine, forward, params)


def _grown_embedding() -> tuple[nn.Module, Tensor]:
    """An embedding whose table was replaced by a larger one (``num_embeddings`` stale), with
    ids past the old size in some samples only."""
    embedding = nn.Embedding(4, 3).double()
    embedding.weight = nn.Parameter(torch.randn(8, 3, dtype=torch.float64))
    ids = torch.tensor([[5, 1, 0], [1, 6, 2], [7, 3, 3], [2, 5, 4]])
    return nn.Sequential(embedding, nn.Tanh(), nn.Flatten()), ids


def _replaced_linear() -> tuple[nn.Module, Tensor]:
    """A Linear whose weight and bias were replaced by larger ones (``out_features`` stale)."""
    layer = nn.Linear(4, 3).double()
    layer.weight = nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    layer.bias = nn.Parameter(torch.randn(6, dtype=torch.float64))
    return nn.Sequential(layer, nn.Tanh()), torch.randn(4, 4, dtype=torch.float64)


@pytest.mark.parametrize("make", [_grown_embedding, _replaced_linear])
@pytest.mark.parametrize("batch_dim", [0, None])
def test_sizes_are_read_from_the_weight(
    make: Callable[[], tuple[nn.Module, Tensor]], batch_dim: int | None
) -> None:
    """The rules read a layer's sizes from its weight, as ``F.embedding`` and ``F.linear`` do,
    not from attributes that replacing the weight leaves stale (the embedding's Gramian mixed
    up tokens past ``num_embeddings``, and its update crashed)."""
    torch.manual_seed(0)
    model, x = make()
    params = list(model.parameters())

    def forward() -> Tensor:
        out = model(x).pow(2)
        return out.sum(1) if batch_dim == 0 else out.sum(0)[:3]

    with Engine(model, batch_dim=batch_dim) as engine:
        assert_exact_step(engine, forward, params)


def test_a_convolution_with_stale_sizes_is_refused_clearly() -> None:
    """A convolution's closed form reads its channels and kernel from its attributes: a weight
    of another shape is refused, naming both shapes (it failed inside a reshape)."""
    conv = nn.Conv1d(2, 3, 2).double()
    conv.weight = nn.Parameter(torch.randn(5, 2, 2, dtype=torch.float64))
    conv.bias = nn.Parameter(torch.randn(5, dtype=torch.float64))
    with Engine(conv, batch_dim=0) as engine:
        losses = conv(torch.randn(4, 2, 5, dtype=torch.float64)).pow(2).sum((1, 2))
        with pytest.raises(ValueError, match=r"weight has shape \(5, 2, 2\), but its attributes"):
            engine.compute_gramian(losses)


@pytest.mark.parametrize("engine_first", [True, False])
def test_sparse_embedding_grad_accumulates_with_autograds(engine_first: bool) -> None:
    """A sparse embedding's ``.grad`` has autograd's layout (sparse rows, dense columns), so a
    plain backward (an auxiliary loss, another micro-batch) and an engine step add up in either
    order (the engine's fully sparse tensor could not be added to autograd's)."""
    torch.manual_seed(0)
    embedding = nn.Embedding(7, 3, sparse=True, padding_idx=2).double()
    ids = torch.randint(0, 7, (4, 3))
    weights = torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=torch.float64)
    dense = nn.Embedding(7, 3, padding_idx=2).double()
    dense.load_state_dict(embedding.state_dict())
    jacobian = reference_jacobian(dense(ids).pow(2).sum((1, 2)), [dense.weight])
    auxiliary = torch.autograd.grad(dense(ids).pow(3).sum(), dense.weight)[0]
    with Engine(embedding, batch_dim=0) as engine:
        if not engine_first:
            embedding(ids).pow(3).sum().backward()
        engine.backward(embedding(ids).pow(2).sum((1, 2)), ConstantWeighting(weights))
        if engine_first:
            embedding(ids).pow(3).sum().backward()
    grad = embedding.weight.grad
    assert grad is not None and grad.is_sparse and grad.sparse_dim() == 1
    expected = (weights @ jacobian).reshape(7, 3) + auxiliary
    torch.testing.assert_close(grad.to_dense(), expected)


class _HeldWeights(nn.Module):
    """Weights kept in a ParameterList or ParameterDict, read by this module's forward: the
    container is never called, so it had no call of its own to record (findings29 F3)."""

    def __init__(self, container: str, head: bool) -> None:
        super().__init__()
        weights = [nn.Parameter(torch.randn(3, 3, dtype=torch.float64)) for _ in range(2)]
        self.container = container
        self.ws: nn.ParameterList | nn.ParameterDict = (
            nn.ParameterList(weights)
            if container == "list"
            else nn.ParameterDict({f"w{i}": w for i, w in enumerate(weights)})
        )
        self.head = nn.Linear(3, 2).double() if head else None

    def forward(self, x: Tensor) -> Tensor:
        weights = self.ws if isinstance(self.ws, nn.ParameterList) else self.ws.values()
        for w in weights:
            x = torch.tanh(x @ w)
        return x if self.head is None else self.head(x)


def _losses(out: Tensor, batch_dim: int | None) -> Tensor:
    per_sample = out.pow(2).sum(1)
    return per_sample if batch_dim == 0 else torch.stack([out.sum(), per_sample.pow(2).sum()])


@pytest.mark.parametrize("container", ["list", "dict"])
@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("batch_dim", [0, None])
def test_parameters_held_in_a_parameter_container_are_the_parents(
    container: str, head: bool, batch_dim: int | None
) -> None:
    torch.manual_seed(0)
    model = _HeldWeights(container, head)
    x = torch.randn(4, 3, dtype=torch.float64)
    engine = Engine(model, batch_dim=batch_dim)
    assert_exact_step(engine, lambda: _losses(model(x), batch_dim), list(model.parameters()))


@dataclasses.dataclass
class _Encoded:
    h: Tensor
    size: int


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))

    def forward(self, x: Tensor) -> _Encoded:
        return _Encoded(torch.tanh(x @ self.w), x.shape[0])


@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("batch_dim", [0, None])
def test_a_module_returning_a_dataclass_is_recorded(head: bool, batch_dim: int | None) -> None:
    """Torch's pytree takes a dataclass as a leaf: its tensors were not recorded (findings29
    F3)."""
    torch.manual_seed(0)
    encoder, linear = _Encoder(), nn.Linear(3, 2).double()
    model = nn.ModuleList([encoder, linear])
    x = torch.randn(4, 3, dtype=torch.float64)

    def forward() -> Tensor:
        h = encoder(x).h
        return _losses(linear(h) if head else h, batch_dim)

    engine = Engine(model, batch_dim=batch_dim)
    params = list(encoder.parameters()) + (list(linear.parameters()) if head else [])
    assert_exact_step(engine, forward, params)


def _non_strided(kind: str) -> Tensor:
    torch.manual_seed(0)
    dense = torch.randn(4, 5, dtype=torch.float64)
    dense[dense.abs() < 0.8] = 0
    if kind == "coo":
        return dense.to_sparse()
    if kind == "csr":
        return dense.to_sparse_csr()
    rows = [torch.randn(n, 5, dtype=torch.float64) for n in (2, 3, 1, 4)]
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


@pytest.mark.parametrize(
    ("kind", "words"), [("coo", "sparse_coo"), ("csr", "sparse_csr"), ("jagged", "nested")]
)
@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_or_nested_input_of_a_closed_form_rule_is_refused(
    kind: str, words: str, batch_dim: int | None
) -> None:
    """They crashed the step with torch's errors from inside the rules (findings29 F4)."""
    x = _non_strided(kind)
    model = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    engine = Engine(model, batch_dim=batch_dim)
    out = model(x)
    losses = (
        torch.stack([o.pow(2).sum() for o in out.unbind()]) if out.is_nested else out.pow(2).sum(1)
    )
    if batch_dim is None:
        losses = torch.stack([losses.sum(), losses.pow(2).sum()])
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(
        ValueError,
        match=rf"(?s)Sequential\.0 \(Linear\).*{words}.*dense.*jacflow\.backward\(\.\.\."
        + (r", parallel_chunk_size=1\)" if kind == "jagged" else r"\)"),
    ):
        engine.backward(losses, ConstantWeighting(torch.ones(losses.numel())))
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())


def test_selective_checkpointing_per_sample_is_refused_with_the_way_out() -> None:
    """Selective activation checkpointing lets a region be pulled back once only, and the first
    per-sample step probes the losses with more backwards through it (here to the first
    layer's output): torch's raw refusal came back from the probe, without the way out. Named
    now, ``.grad`` untouched; per task (one batched backward) the step is exact."""
    from tests.autojac.test_jac import _selectively_checkpointed, _Tanh

    torch.manual_seed(0)
    first, block, head = nn.Linear(3, 4).double(), _Tanh().requires_grad_(False), nn.Linear(4, 2)
    head = head.double()
    x = torch.randn(6, 3, dtype=torch.float64)
    params = [*first.parameters(), *head.parameters()]
    with Engine(first, head, batch_dim=0) as engine:
        losses = head(_selectively_checkpointed(block, first(x))).pow(2).sum(1)
        with pytest.raises(RuntimeError, match=r"selective activation.*without `context_fn`"):
            engine.backward(losses, UPGradWeighting())
    assert all(p.grad is None for p in params)
    with Engine(first, head, batch_dim=None) as engine:
        losses = head(_selectively_checkpointed(block, first(x))).pow(2).sum(0)
        gramian = engine.compute_gramian(losses)
    rows = []
    for loss in head(block(first(x))).pow(2).sum(0):
        grads = torch.autograd.grad(loss, params, retain_graph=True)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    jacobian = torch.stack(rows)
    torch.testing.assert_close(gramian, jacobian @ jacobian.T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("call", ["compute_gramian", "backward", "mtl_gramian_step"])
@pytest.mark.parametrize("flag", ["yes", 1, torch.tensor(True)])
def test_a_non_bool_retain_graph_is_refused_before_the_step(call: str, flag: object) -> None:
    """``retain_graph`` other than a bool (or ``None``) got autograd's raw error from inside the
    step, after the step had taken the forward's recorded calls. Named now, ``.grad``
    untouched, and the same losses then step exactly."""
    from jacflow.autogram import mtl_gramian_step

    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    params = list(trunk.parameters())
    with Engine(trunk, batch_dim=None) as engine:
        losses = trunk(torch.randn(5, 3, dtype=torch.float64)).pow(2).mean(0)
        jacobian = reference_jacobian(losses, params)
        with pytest.raises(TypeError, match=r"`retain_graph` must be a bool or None"):
            if call == "compute_gramian":
                engine.compute_gramian(losses, retain_graph=flag)  # type: ignore[arg-type]
            elif call == "backward":
                engine.backward(losses, MeanWeighting(), retain_graph=flag)  # type: ignore[arg-type]
            else:
                mtl_gramian_step(losses, engine, MeanWeighting(), retain_graph=flag)  # type: ignore[arg-type]
        assert all(p.grad is None for p in params)
        weights = engine.backward(losses, MeanWeighting())
    update = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
    torch.testing.assert_close(update, weights @ jacobian, rtol=1e-10, atol=1e-12)


def _flattened_model(norm: str) -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(0)
    norms = {"layer": nn.LayerNorm(6), "rms": nn.RMSNorm(6), "group": nn.GroupNorm(2, 6)}
    return nn.Linear(3, 6).double(), norms[norm].double(), nn.Linear(6, 7).double()


def _flattened_losses(
    layers: tuple[nn.Module, nn.Module, nn.Module], x: Tensor, order: str = "batch", k: int = 1
) -> Tensor:
    """A per-position layer, then a norm and a head called on the tokens flattened (``[B T,
    d]``, as language models' heads and OPT's layers are called; ``order="positions"``:
    ``[T B, d]``), one loss per sample (``k`` per sample)."""
    first, norm, head = layers
    hidden = torch.tanh(first(x))
    batch, positions, width = hidden.shape
    if order == "batch":
        out = head(norm(hidden.reshape(-1, width))).view(batch, positions, -1)
    else:
        flat = hidden.transpose(0, 1).reshape(-1, width)
        out = head(norm(flat)).view(positions, batch, -1).transpose(0, 1)
    squares = out.pow(2)
    return squares.mean((1, 2)) if k == 1 else squares.mean(1)[:, :k]


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("batch", [1, 4])
def test_modules_of_rows_on_flattened_tokens_are_exact(norm: str, batch: int) -> None:
    """Per sample, a Linear and a LayerNorm or RMSNorm called on the batch flattened with the
    positions (``[B T, d]``) are read as called on ``[B, T, d]``: the Gramian and ``.grad``
    equal autograd's row by row."""
    layers = _flattened_model(norm)
    x = torch.randn(batch, 5, 3, dtype=torch.float64)
    params = [p for layer in layers for p in layer.parameters()]
    reference = reference_jacobian(_flattened_losses(layers, x), params)
    weights = torch.rand(batch, dtype=torch.float64)
    with Engine(*layers, batch_dim=0) as engine:
        gramian = engine.compute_gramian(_flattened_losses(layers, x))
        torch.testing.assert_close(gramian, reference @ reference.T, rtol=1e-10, atol=1e-13)
        engine.backward(_flattened_losses(layers, x), ConstantWeighting(weights))
    grads = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    torch.testing.assert_close(grads, weights @ reference, rtol=1e-10, atol=1e-13)


def test_a_module_of_rows_given_flattened_tokens_by_keyword_is_exact() -> None:
    """Per sample, a Linear and a LayerNorm given the tokens flattened batch first by keyword
    (``layer(input=h)``, which the rules read as their input) are read as called on
    ``[B, T, d]``, as when given positionally: exact, not refused."""
    torch.manual_seed(0)
    first, norm, head = nn.Linear(3, 4).double(), nn.LayerNorm(4).double(), nn.Linear(4, 2).double()
    x = torch.randn(3, 5, 3, dtype=torch.float64)
    params = [p for layer in (first, norm, head) for p in layer.parameters()]

    def losses() -> Tensor:
        flat = torch.tanh(first(x)).reshape(-1, 4)
        return head(input=norm(input=flat)).view(3, 5, 2).pow(2).mean((1, 2))

    reference = reference_jacobian(losses(), params)
    weights = torch.rand(3, dtype=torch.float64)
    with Engine(first, norm, head, batch_dim=0) as engine:
        gramian = engine.compute_gramian(losses())
        torch.testing.assert_close(gramian, reference @ reference.T, rtol=1e-10, atol=1e-13)
        engine.backward(losses(), ConstantWeighting(weights))
    grads = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    torch.testing.assert_close(grads, weights @ reference, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize(
    ("norm", "order", "k", "message"),
    [
        ("layer", "positions", 1, "flatten it batch first"),  # (the samples interleaved)
        ("layer", "batch", 2, r"merges the batch with other dimensions \(20 = 4 x 5"),
        ("group", "batch", 1, r"merges the batch with other dimensions \(20 = 4 x 5"),
    ],
)
def test_flattened_tokens_that_are_not_read_so_are_refused(
    norm: str, order: str, k: int, message: str
) -> None:
    """Refused, with ``.grad`` untouched: tokens flattened positions first (the probe sees the
    samples interleaved), several losses per sample (rows of the flattened output are not one
    sample's), and a GroupNorm (its channels are dimension 1: it does not map rows alone)."""
    layers = _flattened_model(norm)
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    with Engine(*layers, batch_dim=0) as engine, pytest.raises(ValueError, match=message):
        engine.backward(_flattened_losses(layers, x, order, k), UPGradWeighting())
    assert all(p.grad is None for layer in layers for p in layer.parameters())


@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.RMSNorm])
def test_a_norm_over_the_flattened_batch_is_refused(norm: type[nn.Module]) -> None:
    """A LayerNorm or RMSNorm whose normalized shape covers dimension 0 of tokens flattened
    batch first (``[B T, d]`` normalised as a whole) does not map rows one by one: refused with
    the batch-mismatch error, ``.grad`` untouched, not a raw error of the norm read on
    ``[B, T, d]``."""
    torch.manual_seed(0)
    layer = norm((6, 3)).double()
    data = torch.randn(3, 2, 3, dtype=torch.float64, requires_grad=True)
    with Engine(layer, batch_dim=0) as engine, pytest.raises(ValueError, match="batch size 3"):
        flat = torch.tanh(data).reshape(6, 3)  # (computed, as the data itself is not)
        engine.backward(layer(flat).view(3, 2, 3).pow(3).sum((1, 2)), UPGradWeighting())
    assert all(p.grad is None for p in layer.parameters())


def test_tokens_flattened_positions_first_after_a_step_at_one_position_are_refused() -> None:
    """A head called on tokens flattened positions first (``torch.stack`` over the positions,
    the same graph at any length): at one position the first step is exact (the batch is not
    merged), and a later step of the same batch size at three positions, whose rows interleave
    the samples, is probed and refused, with ``.grad`` untouched, not read batch first."""
    torch.manual_seed(0)
    head = nn.Linear(3, 2).double()

    def losses(positions: int) -> Tensor:
        data = torch.randn(4, positions, 3, dtype=torch.float64, requires_grad=True)
        hidden = torch.tanh(data)  # (computed: the data itself, flattened, is not read merged)
        flat = torch.stack(hidden.unbind(1)).view(-1, 3)  # ([T B, 3]: positions first)
        return head(flat).view(positions, 4, 2).transpose(0, 1).pow(2).mean((1, 2))

    with Engine(head, batch_dim=0) as engine:
        engine.compute_gramian(losses(1))
        with pytest.raises(ValueError, match="flatten it batch first"):
            engine.backward(losses(3), UPGradWeighting())
    assert head.weight.grad is None and head.bias.grad is None


def test_the_data_itself_flattened_is_refused_with_the_condition_in_the_hint() -> None:
    """A head called on the data itself flattened (no module, no autograd op before it) is not
    read merged: the refusal's hint says that the input must be computed by autograd, rather
    than only that a Linear with one loss per sample is read so (which the user has)."""
    head = nn.Linear(3, 2).double()
    x = torch.randn(3, 4, 3, dtype=torch.float64)
    with (
        Engine(head, batch_dim=0) as engine,
        pytest.raises(ValueError, match="where autograd computed its input, not the data itself"),
    ):
        engine.backward(head(x.reshape(-1, 3)).view(3, 4, 2).pow(2).mean((1, 2)), UPGradWeighting())
    assert head.weight.grad is None and head.bias.grad is None


def test_tokens_unpadded_by_a_mask_are_not_read_merged() -> None:
    """Tokens unpadded by the attention mask (``h[mask]``, ``[sum(lengths), d]``, as for
    variable-length attention) and padded back after a head: a sample's rows are as many as
    its length, which changes with the data. A first step of equal lengths would pass the
    probe read batch first, and a later one of other lengths with the same number of tokens
    be wrong: refused at every step, ``.grad`` untouched, as before flattened tokens were
    read."""
    torch.manual_seed(0)
    first, head = nn.Linear(3, 4).double(), nn.Linear(4, 2).double()

    def losses(lengths: list[int], positions: int) -> Tensor:
        x = torch.randn(len(lengths), positions, 3, dtype=torch.float64)
        mask = torch.arange(positions) < torch.tensor(lengths)[:, None]
        out = head(torch.tanh(first(x))[mask])  # ([sum(lengths), 2])
        padded = torch.zeros(len(lengths), positions, 2, dtype=torch.float64)
        return padded.masked_scatter(mask[..., None], out).pow(2).sum((1, 2))

    with Engine(first, head, batch_dim=0) as engine:
        for lengths, positions in [([2, 2], 2), ([1, 3], 3)]:
            with pytest.raises(ValueError, match="not from rows selected by a mask"):
                engine.compute_gramian(losses(lengths, positions))
    assert all(p.grad is None for p in [*first.parameters(), *head.parameters()])


def test_a_computed_table_of_a_multiple_of_the_batch_rows_picked_by_labels_is_refused() -> None:
    """A Linear on a table of ``2 B`` rows computed from a parameter (``tanh(table)``, not a
    leaf) whose rows the losses pick by labels: no flatten of the batch lies behind its rows,
    so it is not read merged, at a first step whose labels fall in each sample's own block
    and at a later one whose labels do not (which the probe of the first would miss)."""
    torch.manual_seed(0)
    table = nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    layer = nn.Linear(4, 2).double()
    x = torch.randn(3, 2, dtype=torch.float64)
    with Engine(layer, batch_dim=0) as engine:
        for labels in ([0, 3, 4], [5, 0, 1]):
            losses = (layer(torch.tanh(table))[torch.tensor(labels)] * x).sum(1).pow(2)
            with pytest.raises(ValueError, match="batch size 3"):
                engine.compute_gramian(losses)


@pytest.mark.parametrize("kind", ["parameter", "buffer"])
def test_a_table_of_a_multiple_of_the_batch_rows_picked_by_labels_is_refused(kind: str) -> None:
    """A Linear on a table of ``2 B`` rows (a parameter or a plain tensor) whose rows the losses
    pick by labels is not read as the batch merged with 2 positions: a first step whose labels
    fall in each sample's own block would pass the probe, and a later one be wrong. Refused,
    ``.grad`` untouched, as before flattened tokens were read."""
    torch.manual_seed(0)
    batch, width = 3, 4
    table = torch.randn(2 * batch, width, dtype=torch.float64)
    if kind == "parameter":
        table = nn.Parameter(table)
    layer = nn.Linear(width, 2).double()
    labels = torch.tensor([0, 3, 4])  # (sample i's label in rows 2i, 2i + 1)
    x = torch.randn(batch, 2, dtype=torch.float64)
    with Engine(layer, batch_dim=0) as engine, pytest.raises(ValueError, match="batch size 3"):
        losses = (layer(table)[labels] * x).sum(1).pow(2)
        engine.backward(losses, UPGradWeighting())
    assert layer.weight.grad is None and layer.bias.grad is None


@pytest.mark.parametrize("reorder", ["index", "roll", "index_copy", "sum_of_paths"])
def test_flattened_tokens_reordered_by_the_data_are_not_read_merged(reorder: str) -> None:
    """Tokens flattened batch first, then reordered along the rows by the data (an index, a
    roll, an index_copy, or one path of several) before a head, and put back after it: a
    first step whose reordering keeps each sample's rows would pass the probe, and a later one
    of the same pattern that moves rows across samples be wrong. Refused at every step,
    ``.grad`` untouched, as when rows are selected by a mask."""
    torch.manual_seed(0)
    first, head = nn.Linear(3, 4).double(), nn.Linear(4, 2).double()

    def losses(shift: int) -> Tensor:
        flat = torch.tanh(first(torch.randn(3, 2, 3, dtype=torch.float64))).reshape(-1, 4)
        order = torch.arange(6).roll(shift)
        back = order.argsort()
        if reorder == "index":
            out = head(flat[order])[back]
        elif reorder == "roll":
            out = head(flat.roll(shift, 0)).roll(-shift, 0)
        elif reorder == "index_copy":
            out = head(torch.zeros_like(flat).index_copy(0, order, flat))[order]
        else:
            out = head(flat + flat[order])
        return out.view(3, 2, 2).pow(2).mean((1, 2))

    with Engine(first, head, batch_dim=0) as engine:
        for shift in (0, 1):
            with pytest.raises(ValueError, match="batch size 3"):
                engine.backward(losses(shift), UPGradWeighting())
    assert all(p.grad is None for p in [*first.parameters(), *head.parameters()])


def _reused_conv(conv: nn.Module, x: Tensor) -> Tensor:
    conv.dilation = (1,)  # (a convolution reused at two dilations in one forward)
    first = conv(x).pow(2).sum((1, 2))
    conv.dilation = (2,)
    return first + conv(x).pow(2).sum((1, 2))


def _reused_norm(norm: nn.Module, x: Tensor) -> Tensor:
    norm.eps = 1e-5
    first = norm(x).sin().sum((1, 2))
    norm.eps = 1e-1
    return first + norm(x).sin().sum((1, 2))


@pytest.mark.parametrize(
    ("module", "losses_of", "change"),
    [
        (nn.Conv1d(2, 3, 3, padding=2), _reused_conv, r"dilation: \(1,\) -> \(2,\)"),
        (nn.LayerNorm(4), _reused_norm, r"eps: 1e-05 -> 0\.1"),
    ],
    ids=["conv_dilation", "layer_norm_eps"],
)
def test_a_module_called_with_two_settings_in_one_forward_is_named(
    module: nn.Module, losses_of: Callable[[nn.Module, Tensor], Tensor], change: str
) -> None:
    """A module called twice in one forward with an attribute that its closed form reads
    changed between the calls cannot be differentiated by its rule (which reads the module's
    attributes once, at the step): refused, as before, but saying so; the error told to change
    the attributes before the forward, which the user did. Nothing is written."""
    module = module.double()
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    refusal = rf"called with different attributes.*\({change}, "
    with Engine(module, batch_dim=0) as engine, pytest.raises(ValueError, match=refusal):
        engine.backward(losses_of(module, x), UPGradWeighting())
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in module.parameters())
