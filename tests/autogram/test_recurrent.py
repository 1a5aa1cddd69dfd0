"""nn.RNN, nn.LSTM and nn.GRU in closed form against the brute-force Jacobian, and what the
rule refuses."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence

from jacflow.aggregation import MeanWeighting
from jacflow.autogram import Engine
from tests.autogram._zoo import Built, Case
from tests.autogram.test_engine import check_case

B, T, D, H = 3, 5, 3, 4


class _Sequence(nn.Module):
    """An input encoder, the recurrent layer (optionally from an encoded initial state) and a
    head; the per-sample loss reads the outputs and the final states."""

    def __init__(self, kind: str, initial: bool, k: int | None, **options: Any) -> None:
        super().__init__()
        self.encode = nn.Linear(D, D)
        self.rnn = getattr(nn, kind)(D, H, **options)
        directions = 2 if self.rnn.bidirectional else 1
        size = getattr(self.rnn, "proj_size", 0) or H
        self.head = nn.Linear(directions * size, k or 1)
        self.init = nn.Linear(D, H) if initial else None
        self.k = k

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.encode(x))
        batch_first = self.rnn.batch_first
        hx: Any = None
        if self.init is not None:  # [L D, B, H], from the first step
            layers = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
            h0 = torch.tanh(self.init(x[:, 0])).expand(layers, -1, -1).contiguous()
            hx = (h0, 0.5 * h0) if isinstance(self.rnn, nn.LSTM) else h0
        out, state = self.rnn(h if batch_first else h.transpose(0, 1), hx)
        out = out if batch_first else out.transpose(0, 1)
        finals = state if isinstance(state, tuple) else (state,)
        per_step = self.head(out)  # [B, T, k or 1]
        losses = per_step.pow(2).sum(1) + sum(f.pow(2).sum((0, 2))[:, None] for f in finals)
        return losses if self.k else losses.squeeze(1)


def _case(name: str, kind: str, batch_dim: int | None = 0, **options: Any) -> Case:
    initial = options.pop("initial", False)
    k = options.pop("k", None)
    options.setdefault("batch_first", True)

    def build(dtype: torch.dtype) -> Built:
        torch.manual_seed(0)
        model = _Sequence(kind, initial, k, **options).to(dtype)
        x = torch.randn(B, T, D, dtype=dtype)
        if batch_dim is None:
            return model, (model,), lambda: model(x)[:2] * torch.tensor([1.0, -0.5])
        return model, (model,), lambda: model(x)

    return Case(name, build, batch_dim)


CASES = [
    _case("rnn_tanh", "RNN"),
    _case("rnn_relu_no_bias", "RNN", nonlinearity="relu", bias=False),
    _case("lstm", "LSTM"),
    _case("gru", "GRU"),
    _case("lstm_two_layers_bidirectional", "LSTM", num_layers=2, bidirectional=True),
    _case("gru_two_layers_bidirectional", "GRU", num_layers=2, bidirectional=True),
    _case("rnn_sequence_first", "RNN", batch_first=False, num_layers=2),
    _case("lstm_sequence_first_initial_state", "LSTM", batch_first=False, initial=True),
    _case("gru_initial_state_bidirectional", "GRU", initial=True, bidirectional=True),
    _case("lstm_rows_per_output", "LSTM", k=2, bidirectional=True),
    _case("tasks_lstm", "LSTM", None, num_layers=2, bidirectional=True),
    _case("tasks_gru_sequence_first", "GRU", None, batch_first=False, initial=True),
    _case("tasks_rnn", "RNN", None),
    _case("lstm_eval_dropout", "LSTM", num_layers=2, dropout=0.5),  # built, then .eval()
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gramian_and_update_float64(case: Case) -> None:
    if case.name == "lstm_eval_dropout":
        build = case.build

        def evaluated(dtype: torch.dtype) -> Built:
            model, modules, forward = build(dtype)
            model.eval()  # no dropout: the closed form replays it exactly
            return model, modules, forward

        case = Case(case.name, evaluated, case.batch_dim)
    check_case(case, torch.float64)


@pytest.mark.parametrize("name", ["lstm_two_layers_bidirectional", "tasks_lstm"])
def test_gramian_and_update_float32(name: str) -> None:
    check_case(next(c for c in CASES if c.name == name), torch.float32)


def test_lstm_projections() -> None:
    """No closed form: refused per sample when the engine is built, the generic rule per
    task."""
    lstm = nn.LSTM(D, H, proj_size=2, batch_first=True)
    with pytest.raises(ValueError, match="proj_size"):
        Engine(lstm, batch_dim=0)
    case = _case("tasks_lstm_projections", "LSTM", None, proj_size=2)
    check_case(case, torch.float64)


def test_refusals_leave_grads_untouched() -> None:
    """Packed sequences and dropout between layers in training mode get clear errors."""
    lstm = nn.LSTM(D, H, num_layers=2, dropout=0.5, batch_first=True)
    x = torch.randn(B, T, D)
    with Engine(lstm, batch_dim=0) as engine:
        losses = lstm(x)[0].pow(2).sum((1, 2))
        with pytest.raises(RuntimeError, match=r"dropout=0\.0"):
            engine.backward(losses, MeanWeighting())
    gru = nn.GRU(D, H, batch_first=True)
    packed = pack_padded_sequence(x, torch.tensor([5, 3, 2]), batch_first=True)
    with Engine(gru, batch_dim=None) as engine:
        losses = gru(packed)[1].pow(2).sum().reshape(1)
        with pytest.raises(ValueError, match="packed sequences"):
            engine.backward(losses, MeanWeighting())
    assert all(p.grad is None for p in [*lstm.parameters(), *gru.parameters()])
