"""The shared helpers of the rules."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from jacflow.aggregation import ConstantWeighting, UPGradWeighting
from jacflow.autogram import Call, Contribution, Engine, Rule, _rules
from jacflow.autogram._linear import PER_ROW_SLOWDOWN, ghost_cost, materialized_cost
from jacflow.autogram._rules import Rows
from tests.autogram.test_engine import reference_jacobian


def test_route_of_sequence_linear_layers() -> None:
    """Per sample, materialised per-row gradients are small products at about a quarter of the
    ghost form's speed per multiply-add (PER_ROW_SLOWDOWN): a feed-forward layer on 16
    positions takes the ghost form at B = 32 and the materialised one at B = 64 (as measured);
    per task the per-row gradients are one large product, counted at full speed."""

    def ghost_cheaper(rows: Rows, t: int, d: int, p: int) -> bool:
        return ghost_cost(rows, t, 1, d, p) <= materialized_cost(rows, t, 1, d, p)

    assert ghost_cheaper(Rows(32, 32, None, per_task=False), 16, 128, 512)
    assert not ghost_cheaper(Rows(64, 64, None, per_task=False), 16, 128, 512)
    tasks = Rows(2, 1, None, per_task=True)
    assert materialized_cost(tasks, 64, 1, 8, 4) == 2 * 64 * 8 * 4 + 2 * 2 * 8 * 4
    samples = Rows(2, 2, None, per_task=False)
    assert materialized_cost(samples, 64, 1, 8, 4) == (PER_ROW_SLOWDOWN * 64 + 2) * 2 * 8 * 4


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


class _ChecksWithoutReplaying(Rule):
    """Reads the module's weights (checks them) but does not say so with ``replays()``."""

    def prepare(
        self, module: nn.Module, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> Contribution:
        calls[-1].check_weights_unchanged(module)
        raise AssertionError("unreachable")


def test_weight_check_needs_a_replaying_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine records the weights only for rules whose ``replays()`` is True: a rule that
    checks them without it gets an error saying so, not a check that always passes."""
    monkeypatch.setitem(_rules._RULES, _Scale, _ChecksWithoutReplaying())
    module = _Scale()
    with Engine(module, batch_dim=0) as engine:
        losses = module(torch.randn(3, 2, dtype=torch.float64)).sum(1)
        with pytest.raises(RuntimeError, match=r"replays\(\)"):
            engine.compute_gramian(losses)


class _SquaredWeightConv2d(nn.Conv2d):
    """Overrides only ``_conv_forward``, which ``nn.Conv2d.forward`` calls (as weight
    standardisation, FFT or fake-quantised convolutions do)."""

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return super()._conv_forward(input, weight**2, bias)


def _squared_conv_on_instance() -> nn.Conv2d:
    conv = nn.Conv2d(2, 3, 3)
    plain = conv._conv_forward
    conv._conv_forward = lambda x, w, b: plain(x, w**2, b)  # type: ignore[method-assign]
    return conv


@pytest.mark.parametrize("make", [lambda: _SquaredWeightConv2d(2, 3, 3), _squared_conv_on_instance])
@pytest.mark.parametrize("batch_dim", [0, None])
def test_a_method_the_forward_delegates_to_overridden_gets_the_generic_rule(
    make: Any, batch_dim: int | None
) -> None:
    """A convolution whose ``_conv_forward`` is not ``nn.Conv2d``'s computes something else
    than the closed form assumes: the generic rule gives its exact Gramian and update."""
    torch.manual_seed(0)
    model = nn.Sequential(make(), nn.Tanh(), nn.Flatten(), nn.Linear(27, 2)).double()
    params = list(model.parameters())
    x = torch.randn(4, 2, 5, 5, dtype=torch.float64)

    def forward() -> Tensor:
        out = model(x)
        return out.pow(2).sum(1) if batch_dim == 0 else out.pow(2).sum(0)

    weights = torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=torch.float64)
    with Engine(model, batch_dim=batch_dim) as engine:
        losses = forward()
        jacobian = reference_jacobian(losses, params)
        torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)
        engine.backward(forward(), ConstantWeighting(weights[: losses.shape[0]]))
    actual = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    torch.testing.assert_close(actual, weights[: losses.shape[0]] @ jacobian)


class _Pair(tuple):  # type: ignore[type-arg]  # (a tuple subclass: torch's pytree keeps it whole)
    pass


class _PairReader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))

    def forward(self, pair: Any) -> Tensor:
        a, b = pair
        return (a * self.w).tanh().sum(-1) + (b * self.w**2).sum(-1)


def test_generic_rule_refuses_batched_tensors_it_cannot_split() -> None:
    """Per sample, tensors of the batch inside an argument that torch's pytree does not open
    (a tuple subclass) cannot be split: refused with the reason (the re-run failed inside
    vmap with a bare shape mismatch); in a plain tuple, and per task, the Gramian is exact."""
    a = torch.randn(4, 3, dtype=torch.float64)
    b = torch.randn(4, 3, dtype=torch.float64)
    module = _PairReader()
    refusal = pytest.raises(ValueError, match=r"given a _Pair holding tensors of the batch")
    with Engine(module, batch_dim=0) as engine, refusal:
        engine.compute_gramian(module(_Pair((a, b))))
    for batch_dim, pair in ((0, (a, b)), (None, _Pair((a, b)))):
        with Engine(module, batch_dim=batch_dim) as engine:
            losses = module(pair)
            losses = losses if batch_dim == 0 else losses[:2]
            jacobian = reference_jacobian(losses, [module.w])
            torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)


class _BatchStatistic(nn.Module):
    """A Linear on the batch's mean (``[d]``, not per sample) added to every sample's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        return (h + self.b(h.mean(0))).pow(2).sum(1)


class _PerSampleLoop(nn.Module):
    """A Linear called on one sample at a time (``[d]`` inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return torch.stack([self.a(row).pow(2).sum() for row in x])


@pytest.mark.parametrize("model_type", [_BatchStatistic, _PerSampleLoop])
def test_unbatched_refusal_names_both_causes(model_type: type[nn.Module]) -> None:
    """The refusal of an unbatched Linear input advised only ``x.unsqueeze(0)``, which fits
    neither a batch statistic (``x.mean(0)``) nor a loop over the samples. It names both causes
    with the advice for each now, before anything is written."""
    torch.manual_seed(0)
    model = model_type().double()
    engine = Engine(model, batch_dim=0)
    with pytest.raises(ValueError, match=r"unbatched input") as refusal:
        engine.backward(model(torch.randn(4, 5, dtype=torch.float64)), UPGradWeighting())
    message = str(refusal.value)
    for advice in ("x.unsqueeze(0)", "call it once on the batch", "x.mean(0)", "batch_dim=None"):
        assert advice in message
    assert all(p.grad is None for p in model.parameters())
