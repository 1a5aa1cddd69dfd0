"""Mixed precision: the engine under autocast, and modules whose tensors mix dtypes without it,
against the brute-force Jacobian."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jacflow.aggregation import (
    ConstantWeighting,
    GramianWeighting,
    IMTLGWeighting,
    MeanWeighting,
    MGDAWeighting,
    Periodic,
    RandomWeighting,
    SumWeighting,
    UPGradWeighting,
)
from jacflow.autogram import Engine, mtl_gramian_step
from jacflow.autogram import _engine as engine_module
from jacflow.autogram._precision import autocast_state
from tests.autogram._zoo import CASES, Case
from tests.autogram.test_engine import hooked_params, reference_jacobian

MIXED = ["mlp", "cnn", "transformer_block", "rmsnorm_seq", "embedding_padding", "tasks_mlp"]
MIXED += ["tasks_cnn", "generic_two_outputs"]


@pytest.mark.parametrize("inside", [False, True], ids=["after_autocast", "inside_autocast"])
@pytest.mark.parametrize("case", [c for c in CASES if c.name in MIXED], ids=MIXED)
def test_mixed_precision_autocast(case: Case, inside: bool, on_device: str) -> None:
    """A float32 model run under bfloat16 autocast: the recorded inputs and output gradients
    come in bfloat16 and float32 mixed. The Gramian and the update are float32 and equal the
    brute-force Jacobian's (its per-row weight gradients rounded to bfloat16 by autocast's
    products: hence the tolerance) whether the step runs after the autocast region (the usual
    AMP pattern) or inside it."""
    _, modules, forward = case.build(torch.float32)
    params = hooked_params(modules)
    autocast = torch.autocast(torch.device(on_device).type, dtype=torch.bfloat16)
    with Engine(*modules, batch_dim=case.batch_dim) as engine:
        with autocast:
            losses = forward().float()
        jacobian = reference_jacobian(losses, params)
        scale = jacobian.pow(2).sum(1).max().item() + 1.0
        expected_gramian = jacobian @ jacobian.T
        with autocast if inside else contextlib.nullcontext():
            gramian = engine.compute_gramian(losses)
        assert gramian.dtype == torch.float32
        tol = {"rtol": 0.0, "atol": 1e-2}
        torch.testing.assert_close(gramian / scale, expected_gramian / scale, **tol)
        with autocast:
            losses = forward().float()
        with autocast if inside else contextlib.nullcontext():
            weights = engine.backward(losses, UPGradWeighting())
    expected = weights.flatten() @ jacobian
    actual = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    assert actual.dtype == torch.float32
    gscale = expected.abs().max().item() + 1.0
    torch.testing.assert_close(actual / gscale, expected / gscale, **tol)


class LowRankAdapted(nn.Module):
    """A frozen bfloat16 weight with trainable float32 low-rank adapters on bfloat16
    activations (the QLoRA pattern): no closed form, and dtypes mixed without autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4).bfloat16(), requires_grad=False)
        self.a = nn.Parameter(torch.randn(2, 4) * 0.1)
        self.b = nn.Parameter(torch.randn(4, 2) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight) + ((x.float() @ self.a.T) @ self.b.T).to(x.dtype)


class Float64Scale(nn.Module):
    """A trainable float64 scale on the float32 features of a frozen float32 Linear child."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(3, dtype=torch.float64) + 0.5)
        self.features = nn.Linear(4, 3).requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.features(x).exp().double() * self.scale


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize(
    ("make", "x", "atol"),
    [
        (LowRankAdapted, lambda: torch.randn(5, 4).bfloat16(), 1e-2),
        (Float64Scale, lambda: torch.randn(5, 4), 1e-12),
    ],
    ids=["bf16_frozen_weight_f32_adapters", "f64_scale_f32_child"],
)
def test_mixed_dtypes_without_autocast(
    make: type[nn.Module], x: object, atol: float, batch_dim: int | None
) -> None:
    """Without autocast the recorded tensors are used as they are: the generic rule re-runs the
    module in the forward's own dtypes (the Gramian exact up to the forward's rounding)."""
    assert callable(x)
    module, inputs = make(), x()
    with Engine(module, batch_dim=batch_dim) as engine:
        out = module(inputs).float().pow(2)
        losses = out.sum(1) if batch_dim == 0 else out.sum(0)
        params = hooked_params((module,))
        jacobian = reference_jacobian(losses, params).double()
        gramian = engine.compute_gramian(losses).double()
    scale = jacobian.pow(2).sum(1).max().item() + 1.0
    torch.testing.assert_close(gramian / scale, jacobian @ jacobian.T / scale, rtol=0, atol=atol)


@pytest.mark.parametrize("weighting", [MGDAWeighting(), IMTLGWeighting()], ids=str)
def test_weighting_runs_outside_autocast(weighting: object) -> None:
    """A step inside an autocast region runs the weighting outside it too: weightings whose
    products autocast would lower get the float32 Gramian and give float32 weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    with Engine(model, batch_dim=0) as engine, torch.autocast("cpu", dtype=torch.bfloat16):
        losses = F.cross_entropy(model(x), y, reduction="none")
        assert autocast_state("cpu") == ("cpu", torch.bfloat16)
        gramian = engine.compute_gramian(losses)
        losses = F.cross_entropy(model(x), y, reduction="none")
        weights = engine.backward(losses, weighting)  # type: ignore[arg-type]
    assert weights.dtype == torch.float32
    expected = weighting(gramian)  # type: ignore[operator]
    torch.testing.assert_close(weights, expected, rtol=1e-4, atol=1e-5)


class _Gain(nn.Module):
    """A module without a closed form (the generic rule): a learned gain per feature."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gain


@pytest.mark.parametrize("batch_dim", [0, None])
def test_float16_parameters_do_not_overflow_the_gramian(batch_dim: int | None) -> None:
    """A float16 model without autocast: the closed forms' products (a Linear's ``X X^T``, about
    ``|x|^2``) overflowed float16's range although every gradient and the Gramian itself are
    small, and the step wrote NaN, silently. They run in float32 now (the Gramian comes in
    float32), and the generic rule's Gramian too; against the float64 brute force."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), _Gain(8), nn.Linear(8, 3))
    with torch.no_grad():
        model[0].weight.mul_(0.01)
    reference = copy.deepcopy(model).double()
    model.half()
    x = torch.randn(6, 16) * 200  # (|x|^2 about 6e5 > 65504)

    def losses_of(net: nn.Module, inputs: Tensor) -> Tensor:
        out = net(inputs) * 1e-2
        return out.sum(1) if batch_dim == 0 else out.pow(2).mean(0)

    engine = Engine(model, batch_dim=batch_dim)
    gramian = engine.compute_gramian(losses_of(model, x.half()))
    assert gramian.dtype == torch.float32 and bool(gramian.isfinite().all())
    jacobian = reference_jacobian(
        losses_of(reference, x.half().double()), [*reference.parameters()]
    )
    expected = jacobian @ jacobian.T
    scale = float(expected.abs().max())
    torch.testing.assert_close(gramian.double() / scale, expected / scale, rtol=0, atol=2e-2)
    engine.backward(losses_of(model, x.half()), UPGradWeighting())
    assert all(bool(p.grad.isfinite().all()) for p in model.parameters())  # type: ignore[union-attr]


class _ScaledLinear(nn.Module):
    """The generic rule: a float32 gain on a Linear's output, which autocast computes in
    bfloat16; the output is float32."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(width))
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * self.gain


@pytest.mark.parametrize("batch_dim", [0, None])
def test_generic_re_run_under_autocast_is_compared_at_its_precision(batch_dim: int | None) -> None:
    """The re-run of a generic-rule module under bfloat16 autocast rounds its products
    differently from the forward (about one bfloat16 ulp); its check compared them at the
    float32 output's precision and refused the step in 5 of 5 seeds. Accepted now, with the
    Gramian of the float64 brute force to bfloat16's precision."""
    for seed in range(3):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(5, 8), _ScaledLinear(8), nn.Linear(8, 3))
        _assert_bfloat16_autocast_gramian(model, torch.randn(6, 5), batch_dim)


def _assert_bfloat16_autocast_gramian(model: nn.Module, x: Tensor, batch_dim: int | None) -> None:
    """The engine's Gramian of a forward under bfloat16 autocast equals the float64 brute
    force to bfloat16's precision (losses: squares summed per sample, or averaged per output
    channel per task)."""
    reference = copy.deepcopy(model).double()
    dims = tuple(range(1, x.ndim))

    def losses_of(out: Tensor) -> Tensor:
        if batch_dim == 0:
            return out.pow(2).sum(dims)
        return out.pow(2).mean((0, *dims[1:]))

    with Engine(model, batch_dim=batch_dim) as engine:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = losses_of(model(x).float())
        gramian = engine.compute_gramian(losses)
    jacobian = reference_jacobian(losses_of(reference(x.double())), [*reference.parameters()])
    expected = jacobian @ jacobian.T
    scale = float(expected.abs().max())
    torch.testing.assert_close(gramian.double() / scale, expected / scale, rtol=0, atol=5e-2)


class _ConvNextBlock(nn.Module):
    """The generic rule: a depthwise convolution, a LayerNorm over channels last, and a learned
    layer scale, as in ConvNeXt."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(width, width, 3, padding=1, groups=width)
        self.norm = nn.LayerNorm(width)
        self.gamma = nn.Parameter(0.1 * torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(self.depthwise(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return h * self.gamma[:, None, None]


@pytest.mark.parametrize("batch_dim", [0, None])
def test_generic_rule_where_vmap_fails_under_autocast(batch_dim: int | None) -> None:
    """Under bfloat16 autocast, torch.func's batched pullback of this block fails inside
    torch ("expected scalar type BFloat16 but found Float"; per task with no context). The
    generic rule then pulls back row by row; against the float64 brute force."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 2, stride=2), _ConvNextBlock())
    _assert_bfloat16_autocast_gramian(model, torch.randn(6, 3, 8, 8), batch_dim)


class _CellLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(4, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Tensor:
        state = None
        for step in range(x.shape[1]):
            state = self.cell(x[:, step], state)
        assert state is not None
        return self.head(state[0])


class _Recurrent(nn.Module):
    def __init__(self, layer: nn.RNNBase) -> None:
        super().__init__()
        self.layer = layer
        self.head = nn.Linear(layer.hidden_size, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(x)[0][:, -1])


@pytest.mark.parametrize("kind", ["gru", "lstm", "cells"])
@pytest.mark.parametrize("batch_dim", [0, None])
def test_float16_recurrent_layers(kind: str, batch_dim: int | None) -> None:
    """The recurrent closed forms replay the layer with its weights: in float16 they met the
    float32 inputs of the other closed forms and failed ("mat1 and mat2 must have the same
    dtype"); they replay in float32 now. Against the float64 brute force."""
    torch.manual_seed(0)
    layers = {
        "gru": lambda: _Recurrent(nn.GRU(4, 5, batch_first=True)),
        "lstm": lambda: _Recurrent(nn.LSTM(4, 5, num_layers=2, batch_first=True)),
        "cells": _CellLoop,
    }
    model = layers[kind]()
    reference = copy.deepcopy(model).double()
    model.half()
    x = torch.randn(3, 6, 4)

    def losses_of(out: Tensor) -> Tensor:
        return out.pow(2).sum(1) if batch_dim == 0 else out.pow(2).mean(0)

    engine = Engine(model, batch_dim=batch_dim)
    gramian = engine.compute_gramian(losses_of(model(x.half()).float()))
    jacobian = reference_jacobian(
        losses_of(reference(x.half().double())), [*reference.parameters()]
    )
    expected = jacobian @ jacobian.T
    scale = float(expected.abs().max())
    torch.testing.assert_close(gramian.double() / scale, expected / scale, rtol=0, atol=2e-2)


def test_float16_model_under_bfloat16_autocast() -> None:
    """A float16 model under bfloat16 autocast: its bfloat16 tensors, which do not promote to
    float16, were left as recorded and met the float16 weights in the update (a raw dtype
    error). They go to the float32 of float16's closed forms now; the Gramian and the update
    against the float64 brute force."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    reference = copy.deepcopy(model).double()
    model.half()
    x = torch.randn(6, 5)
    engine = Engine(model, batch_dim=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = model(x.half()).pow(2).sum(1)  # (bfloat16 losses)
    weights = engine.backward(losses, UPGradWeighting())
    params = [*reference.parameters()]
    jacobian = reference_jacobian(reference(x.half().double()).pow(2).sum(1), params)
    update = torch.cat([p.grad.double().flatten() for p in model.parameters()])  # type: ignore[union-attr]
    expected = weights.double() @ jacobian
    scale = float(expected.abs().max())
    torch.testing.assert_close(update / scale, expected / scale, rtol=0, atol=5e-2)


def test_float16_batchnorm_in_eval_mode() -> None:
    """A float16 BatchNorm in eval mode: its float16 running statistics met the float32 inputs
    of float16's closed forms ("mixed dtype"); against the float64 brute force."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(16, 2))
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    model.eval()
    reference = copy.deepcopy(model).double()
    model.half()
    x = torch.randn(5, 2, 4, 4)
    engine = Engine(model, batch_dim=0)
    gramian = engine.compute_gramian(model(x.half()).float().pow(2).sum(1))
    params = [*reference.parameters()]
    jacobian = reference_jacobian(reference(x.half().double()).pow(2).sum(1), params)
    expected = jacobian @ jacobian.T
    scale = float(expected.abs().max())
    torch.testing.assert_close(gramian.double() / scale, expected / scale, rtol=0, atol=2e-2)


class _ScaleReading(GramianWeighting):
    """A weighting that reads the Gramian's scale (not scale-invariant): ``G_ii / (1 + G_ii)``,
    computed in the Gramian's dtype; it records the Gramian it got."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Tensor] = []

    def forward(self, stat: Tensor) -> Tensor:
        self.seen.append(stat)
        diagonal = stat.diagonal()
        return diagonal / (1 + diagonal)


def _scaled_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    return nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 8), _Gain(8)
    )


def _scaled_losses(kind: str, model: nn.Module, scale: float) -> Tensor:
    torch.manual_seed(1)
    dtype = next(model.parameters()).dtype
    x = torch.randn(6, 5) if kind == "mlp" else torch.randn(6, 2, 6, 6)
    targets = torch.randn(6, 3 if kind == "mlp" else 8)
    out = model(x.to(dtype))
    return (out - targets.to(dtype)).pow(2).mean(1) * scale


_SCALES = [1e-30, 1e-20, 1e19, 1e25]


@pytest.mark.parametrize("scale", _SCALES)
@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_gradients_of_extreme_scale(kind: str, batch_dim: int | None, scale: float) -> None:
    """Per-row gradients of extreme but finite scale in a float32 model: the float32 Gramian
    overflowed (about 1e19: NaN weights and ``.grad``) or underflowed (below about 1e-20: wrong
    weights, uniform at 1e-30). The weights and the ``.grad`` written are now those of the
    float64 reference (UPGrad of the float64 Gramian, weighting the float64 Jacobian) and, UPGrad
    being scale-invariant, the weights are those at scale 1."""
    reference = _scaled_model(kind).double()
    losses = _scaled_losses(kind, reference, scale)
    jacobian = reference_jacobian(losses, [*reference.parameters()])
    expected_weights = UPGradWeighting()(jacobian @ jacobian.T)
    expected_grad = expected_weights @ jacobian

    def step(at: float) -> tuple[Tensor, Tensor]:
        model = _scaled_model(kind)
        with Engine(model, batch_dim=batch_dim) as engine:
            weights = engine.backward(_scaled_losses(kind, model, at), UPGradWeighting())
        grads = [p.grad.flatten() for p in model.parameters()]  # type: ignore[union-attr]
        return weights, torch.cat(grads)

    weights, grad = step(scale)
    assert weights.dtype == torch.float32 and bool(weights.isfinite().all())
    assert bool(grad.isfinite().all())
    torch.testing.assert_close(weights.double(), expected_weights, rtol=1e-5, atol=1e-6)
    error = (grad.double() - expected_grad).norm() / expected_grad.norm()
    assert error < 1e-5
    torch.testing.assert_close(weights, step(1.0)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", _SCALES)
def test_scale_reading_weighting_gets_the_float64_gramian(scale: float) -> None:
    """A weighting that reads the Gramian's scale gets, where the float32 Gramian overflowed or
    underflowed, the Gramian formed in float64 (as ``jacflow.backward`` gives it), and its
    weights come back in float32."""
    reference = _scaled_model("mlp").double()
    losses = _scaled_losses("mlp", reference, scale)
    jacobian = reference_jacobian(losses, [*reference.parameters()])
    expected = jacobian @ jacobian.T
    model = _scaled_model("mlp")
    weighting = _ScaleReading()
    with Engine(model, batch_dim=0) as engine:
        weights = engine.backward(_scaled_losses("mlp", model, scale), weighting)
    (gramian,) = weighting.seen
    assert gramian.dtype == torch.float64 and weights.dtype == torch.float32
    torch.testing.assert_close(gramian, expected, rtol=1e-5, atol=0)
    # (in float32, as they come: 1e-60 is 0 there)
    torch.testing.assert_close(weights, weighting(expected).float(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("batch_dim", [0, None])
def test_periodic_reuse_steps_after_a_float64_gramian(batch_dim: int | None) -> None:
    """A ``Periodic`` weighting that reads the scale keeps the float64 weights of a step whose
    Gramian was formed in float64 (an overflow): its reuse steps returned them in float64, where
    the docs say the Gramian's usual dtype. Every step's weights are float32 now, the reuse
    steps' those of the first step, and each ``.grad`` is the float64 reference's ``w @ J``."""
    reference = _scaled_model("mlp").double()
    scales = [1e25, 1.0, 1.0, 1.0]  # (recomputed at steps 0 and 3)
    jacobians = [
        reference_jacobian(_scaled_losses("mlp", reference, s), [*reference.parameters()])
        for s in scales
    ]
    inner = _ScaleReading()
    model, weighting = _scaled_model("mlp"), Periodic(inner, every=3)
    steps = []
    with Engine(model, batch_dim=batch_dim) as engine:
        for scale, jacobian in zip(scales, jacobians, strict=True):
            model.zero_grad()
            weights = engine.backward(_scaled_losses("mlp", model, scale), weighting)
            grad = torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]
            expected = weights.double() @ jacobian
            assert (grad.double() - expected).norm() <= 1e-5 * expected.norm()
            steps.append(weights)
    assert [g.dtype for g in inner.seen] == [torch.float64, torch.float32]  # (the rescue)
    assert all(weights.dtype == torch.float32 for weights in steps)
    assert torch.equal(steps[1], steps[0]) and torch.equal(steps[2], steps[0])
    for step in (0, 3):
        expected = _ScaleReading()(jacobians[step] @ jacobians[step].T).float()
        torch.testing.assert_close(steps[step], expected, rtol=1e-5, atol=0)


_HOST_READS = ("__float__", "__bool__", "__int__", "item", "tolist")


@contextlib.contextmanager
def _counting_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts the tensors' host reads and the Engine's range tests of its Gramian."""
    counts = {"reads": 0, "range_tests": 0}

    def counted(key: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return original(*args, **kwargs)

        return wrapper

    with monkeypatch.context() as patch:
        for name in _HOST_READS:
            patch.setattr(Tensor, name, counted("reads", getattr(Tensor, name)))
        test = counted("range_tests", engine_module.peak_out_of_range)
        patch.setattr(engine_module, "peak_out_of_range", test)
        yield counts


_ROWS_ONLY: dict[str, Callable[[], GramianWeighting]] = {
    "mean": MeanWeighting,
    "sum": SumWeighting,
    "constant": lambda: ConstantWeighting(torch.linspace(0.3, 1.7, 6)),
    "random": RandomWeighting,
}


@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e25])
@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("name", sorted(_ROWS_ONLY))
def test_no_range_test_for_weightings_that_do_not_read_the_gramian(
    name: str, batch_dim: int | None, scale: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weighting whose weights read only the number of rows (Mean, Sum, Constant, Random)
    had the Gramian's peak read at every step (a host read, which stalls a GPU's queue), to
    rescue weights that do not depend on it: a step after the first makes no host read now,
    and the update is still the float64 reference's ``w @ J`` at extreme scales."""
    reference = _scaled_model("mlp").double()
    losses = _scaled_losses("mlp", reference, scale)
    jacobian = reference_jacobian(losses, [*reference.parameters()])
    model, weighting = _scaled_model("mlp"), _ROWS_ONLY[name]()
    with Engine(model, batch_dim=batch_dim) as engine:
        engine.backward(_scaled_losses("mlp", model, scale), weighting)  # (a first step)
        model.zero_grad()
        losses = _scaled_losses("mlp", model, scale)
        torch.manual_seed(2)
        with _counting_host_reads(monkeypatch) as counts:
            weights = engine.backward(losses, weighting)
    assert counts == {"reads": 0, "range_tests": 0}
    torch.manual_seed(2)
    assert torch.equal(weights, _ROWS_ONLY[name]()(torch.zeros(6, 6)))
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]
    expected = weights.double() @ jacobian
    assert (grad.double() - expected).norm() <= 1e-5 * expected.norm()


class _InverseNormMean(MeanWeighting):
    """A subclass of Mean whose own ``forward`` reads the Gramian: weights ``1 / |g_i|``."""

    def forward(self, stat: Tensor) -> Tensor:
        inverse = stat.diagonal().rsqrt()
        return inverse / inverse.sum()


@pytest.mark.parametrize("hooked", [False, True])
def test_range_test_for_weightings_that_read_the_gramian(
    hooked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weighting that reads the Gramian (UPGrad; Mean with a forward pre-hook, which may
    read it) still has it tested, and rescued from an overflow: the weights of scale 1."""
    weighting: GramianWeighting = MeanWeighting() if hooked else UPGradWeighting()
    seen: list[Tensor] = []
    if hooked:
        weighting.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    model = _scaled_model("mlp")
    with Engine(model, batch_dim=0) as engine, _counting_host_reads(monkeypatch) as counts:
        weights = engine.backward(_scaled_losses("mlp", model, 1e25), weighting)
    assert counts["range_tests"] == 1
    if hooked:  # (the Gramian rescued: finite, scaled to a peak in [1/2, 1))
        assert 0.5 <= float(seen[0].abs().amax()) < 1
    else:
        reference = _scaled_model("mlp").double()
        losses = _scaled_losses("mlp", reference, 1.0)
        jacobian = reference_jacobian(losses, [*reference.parameters()])
        expected = UPGradWeighting()(jacobian @ jacobian.T)
        torch.testing.assert_close(weights.double(), expected, rtol=1e-5, atol=1e-6)


def test_a_subclass_with_its_own_forward_reads_the_gramian(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A subclass of Mean whose ``forward`` reads the Gramian does not inherit Mean's claims
    (it inherited them: no range test, and an overflowed Gramian gave NaN weights and NaN
    ``.grad`` at gradients of 1e20): its Gramian is tested and rescued, and the weights are
    those of the float64 reference."""
    weighting = _InverseNormMean()
    assert weighting.reads_gramian and not weighting.scale_invariant
    reference = _scaled_model("mlp").double()
    losses = _scaled_losses("mlp", reference, 1e20)
    jacobian = reference_jacobian(losses, [*reference.parameters()])
    model = _scaled_model("mlp")
    with Engine(model, batch_dim=0) as engine, _counting_host_reads(monkeypatch) as counts:
        weights = engine.backward(_scaled_losses("mlp", model, 1e20), weighting)
    assert counts["range_tests"] == 1
    expected = _InverseNormMean()(jacobian @ jacobian.T)
    torch.testing.assert_close(weights.double(), expected, rtol=1e-5, atol=0.0)
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]
    assert bool(torch.isfinite(grad).all())


@pytest.mark.parametrize("scale", [1e-30, 1e25])
def test_mtl_gramian_step_of_extreme_scale(scale: float) -> None:
    """``mtl_gramian_step`` shares the step: per-task losses of extreme scale give the weights
    of scale 1 (UPGrad) and a finite update."""

    def run(at: float) -> tuple[Tensor, list[Tensor]]:
        torch.manual_seed(0)
        trunk, heads = nn.Linear(5, 8), nn.ModuleList(nn.Linear(8, 1) for _ in range(3))
        x, targets = torch.randn(10, 5), torch.randn(3, 10, 1)
        with Engine(trunk, batch_dim=None) as engine:
            features = trunk(x).tanh()
            losses = torch.stack(
                [(h(features) - t).pow(2).mean() * at for h, t in zip(heads, targets)]
            )
            weights = mtl_gramian_step(
                losses, engine, UPGradWeighting(), tasks_params=heads.parameters()
            )
        params = [*trunk.parameters(), *heads.parameters()]
        return weights, [p.grad / at for p in params]  # type: ignore[operator]

    weights, grads = run(scale)
    expected_weights, expected_grads = run(1.0)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-4, atol=1e-5)
    for grad, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(
    not hasattr(torch.Tensor, "grad_dtype"), reason="Tensor.grad_dtype needs torch >= 2.10"
)
@pytest.mark.parametrize("hooked", [False, True])
@pytest.mark.parametrize("existing", [False, True])
def test_grad_is_written_in_the_parameters_grad_dtype(hooked: bool, existing: bool) -> None:
    """float32 gradients of a bfloat16 parameter (its ``grad_dtype``), as torch's ``backward``
    of the weighted losses writes them (its gradient hooks see them so too): the step failed,
    after writing the other parameters' ``.grad``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).bfloat16()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 3).bfloat16()
    for m in (model, reference):
        m[0].bias.grad_dtype = torch.float32  # type: ignore[attr-defined]
        m[2].weight.grad_dtype = torch.float32  # type: ignore[attr-defined]
        if hooked:
            m[0].bias.register_hook(lambda g: g * 2)
        if existing:
            for p in m.parameters():
                p.grad = torch.ones_like(p, dtype=p.grad_dtype)  # type: ignore[attr-defined]
    engine = Engine(model, batch_dim=0)
    weights = engine.backward(model(x).squeeze(1), UPGradWeighting())
    (weights.to(torch.bfloat16) @ reference(x).squeeze(1)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None and q.grad is not None
        assert p.grad.dtype == q.grad.dtype, name
        torch.testing.assert_close(p.grad.float(), q.grad.float(), atol=0.02, rtol=0.02)
    assert model[0].bias.grad.dtype == torch.float32


@pytest.mark.parametrize("batch_dim", [0, None])
def test_meta_forward_runs_and_its_step_is_refused(batch_dim: int | None) -> None:
    """A grad-enabled forward of a hooked model moved to the meta device (shape inference,
    deferred initialisation) runs as without the Engine: it failed inside the forward hook
    (``unknown device type for autocast``). A step on its losses is refused, naming the meta
    device, and after ``to_empty`` and loading values the engine's step is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 4, dtype=torch.float64)
    with Engine(model, batch_dim=batch_dim) as engine:
        model.to("meta")
        out = model(torch.empty(5, 4, dtype=torch.float64, device="meta"))
        assert out.shape == (5, 3) and out.device.type == "meta"
        losses = out.sum(1) if batch_dim == 0 else out.sum(0)
        with pytest.raises(ValueError, match=r"`losses` are on the meta device.*to_empty"):
            engine.compute_gramian(losses)
        with pytest.raises(ValueError, match=r"`losses` are on the meta device"):
            engine.backward(losses, UPGradWeighting())
        model.to_empty(device="cpu")
        model.load_state_dict(reference.state_dict())
        out = model(x)
        weights = engine.backward(out.sum(1) if batch_dim == 0 else out.sum(0), UPGradWeighting())
    ref_out = reference(x)
    params = [*reference.parameters()]
    jacobian = reference_jacobian(ref_out.sum(1) if batch_dim == 0 else ref_out.sum(0), params)
    torch.testing.assert_close(weights, UPGradWeighting()(jacobian @ jacobian.T))
    actual = torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]
    torch.testing.assert_close(actual, weights @ jacobian)
