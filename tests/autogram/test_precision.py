"""Mixed precision: the engine under autocast, and modules whose tensors mix dtypes without it,
against the brute-force Jacobian."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jacflow.aggregation import IMTLGWeighting, MGDAWeighting, UPGradWeighting
from jacflow.autogram import Engine
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
