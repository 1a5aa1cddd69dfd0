"""The shared helpers of the rules."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from jacflow.autogram import Call, Contribution, Engine, Rule, _rules
from jacflow.autogram._linear import PER_ROW_SLOWDOWN, ghost_cost, materialized_cost
from jacflow.autogram._rules import Rows


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
