"""nn.RNN, nn.LSTM and nn.GRU in closed form against the brute-force Jacobian, and what the
rule refuses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from jacflow.aggregation import MeanWeighting
from jacflow.autogram import Engine, _capture, _hooks, _recurrent
from tests.autogram._zoo import Built, Case
from tests.autogram.test_engine import (
    assert_exact_gramian,
    assert_float32_gramian,
    check_case,
    reference_jacobian,
)
from tests.autogram.test_linear import assert_change_refused, assert_exact_backward, row_losses

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
            # h_0 has the projected size; cuDNN takes contiguous states only
            projected = getattr(self.rnn, "proj_size", 0) or H
            hx = (
                (h0[..., :projected].contiguous(), 0.5 * h0)
                if isinstance(self.rnn, nn.LSTM)
                else h0
            )
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
    _case("lstm_projections", "LSTM", proj_size=2),
    _case(
        "lstm_projections_two_layers_bidirectional_initial",
        "LSTM",
        num_layers=2,
        bidirectional=True,
        proj_size=3,
        initial=True,
    ),
    _case("lstm_projections_rows_per_output", "LSTM", k=2, proj_size=2, batch_first=False),
    _case("tasks_lstm_projections", "LSTM", None, num_layers=2, proj_size=2, bias=False),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gramian_and_update_float64(case: Case, on_device: str) -> None:
    if case.name == "lstm_eval_dropout":
        build = case.build

        def evaluated(dtype: torch.dtype) -> Built:
            model, modules, forward = build(dtype)
            model.eval()  # no dropout: the closed form replays it exactly

            def native() -> Tensor:  # (cuDNN cannot differentiate an eval-mode forward)
                with torch.backends.cudnn.flags(enabled=False):
                    return forward()

            return model, modules, native

        case = Case(case.name, evaluated, case.batch_dim)
    check_case(case, torch.float64)


@pytest.mark.parametrize("name", ["lstm_two_layers_bidirectional", "tasks_lstm"])
def test_gramian_and_update_float32(name: str, on_device: str) -> None:
    check_case(next(c for c in CASES if c.name == name), torch.float32)


def test_refusals_leave_grads_untouched() -> None:
    """Dropout between layers in training mode and an input that is neither a tensor nor a
    packed sequence get clear errors."""
    lstm = nn.LSTM(D, H, num_layers=2, dropout=0.5, batch_first=True)
    x = torch.randn(B, T, D)
    with Engine(lstm, batch_dim=0) as engine:
        losses = lstm(x)[0].pow(2).sum((1, 2))
        with pytest.raises(ValueError, match=r"dropout=0\.0"):
            engine.backward(losses, MeanWeighting())
    assert all(p.grad is None for p in lstm.parameters())


class _Packed(nn.Module):
    """Variable-length sequences: an encoder on the padded batch, the recurrent layer on the
    packed one (from an encoded initial state if ``initial``), a head on the unpacked outputs;
    the loss per sample reads the outputs (if ``outputs``) and the final states."""

    def __init__(self, kind: str, sorted_: bool, k: int | None, **options: Any) -> None:
        super().__init__()
        self.initial, self.outputs = options.pop("initial", False), options.pop("outputs", True)
        self.encode = nn.Linear(D, D)
        self.rnn = getattr(nn, kind)(D, H, **options)
        directions = 2 if self.rnn.bidirectional else 1
        self.head = nn.Linear(directions * (getattr(self.rnn, "proj_size", 0) or H), k or 1)
        self.init = nn.Linear(D, H)
        self.sorted, self.k = sorted_, k

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        h = torch.tanh(self.encode(x))  # [B, T, D]
        if not self.rnn.batch_first:
            h = h.transpose(0, 1)
        packed = pack_padded_sequence(
            h, lengths, batch_first=self.rnn.batch_first, enforce_sorted=self.sorted
        )
        hx: Any = None
        if self.initial:
            layers = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
            h0 = torch.tanh(self.init(x[:, 0])).expand(layers, -1, -1).contiguous()
            hx = (h0, 0.5 * h0) if isinstance(self.rnn, nn.LSTM) else h0
        out, state = self.rnn(packed, hx)
        finals = state if isinstance(state, tuple) else (state,)
        losses = sum(f.pow(2).sum((0, 2))[:, None] for f in finals)
        if self.outputs:
            steps = pad_packed_sequence(out, batch_first=True)[0]  # [B, T, D H], zero padded
            losses = losses + self.head(steps).pow(2).sum(1)
        return losses if self.k else losses.squeeze(1)


def _packed_case(
    name: str, kind: str, batch_dim: int | None = 0, sorted_: bool = False, **options: Any
) -> Case:
    k = options.pop("k", None)
    options.setdefault("batch_first", True)

    def build(dtype: torch.dtype) -> Built:
        torch.manual_seed(0)
        model = _Packed(kind, sorted_, k, **options).to(dtype)
        x = torch.randn(4, T, D, dtype=dtype)
        lengths = torch.tensor([5, 5, 3, 1] if sorted_ else [2, 5, 1, 4], device="cpu")
        if batch_dim is None:
            return model, (model,), lambda: model(x, lengths)[:2] * torch.tensor([1.0, -0.5])
        return model, (model,), lambda: model(x, lengths)

    return Case(name, build, batch_dim)


PACKED = [
    _packed_case("packed_lstm", "LSTM"),
    _packed_case("packed_gru_sorted", "GRU", sorted_=True),
    _packed_case("packed_rnn_relu", "RNN", nonlinearity="relu"),
    _packed_case("packed_lstm_bidirectional_two_layers", "LSTM", num_layers=2, bidirectional=True),
    _packed_case("packed_gru_bidirectional_initial", "GRU", bidirectional=True, initial=True),
    _packed_case("packed_lstm_sequence_first", "LSTM", batch_first=False, initial=True),
    _packed_case("packed_gru_states_only", "GRU", num_layers=2, outputs=False),
    _packed_case("packed_lstm_rows_per_output", "LSTM", k=2, bidirectional=True),
    _packed_case("tasks_packed_lstm", "LSTM", None, num_layers=2, bidirectional=True),
    _packed_case("tasks_packed_gru_states_only", "GRU", None, outputs=False),
    _packed_case("packed_lstm_projections_bidirectional", "LSTM", bidirectional=True, proj_size=2),
]


@pytest.mark.parametrize("case", PACKED, ids=[c.name for c in PACKED])
def test_packed_sequences(case: Case, on_device: str) -> None:
    """Packed variable-length batches, against the brute-force Jacobian: sorted or not, both
    directions, initial states, losses that read the outputs or only the final states."""
    check_case(case, torch.float64)


def test_packed_sequences_float32() -> None:
    check_case(PACKED[3], torch.float32)


def _tied(kind: str, slot: str, to: str) -> Callable[[torch.dtype], Built]:
    def build(dtype: torch.dtype) -> Built:
        torch.manual_seed(0)
        model = _Sequence(kind, False, None, num_layers=2, bidirectional=True, batch_first=True)
        model.to(dtype)
        setattr(model.rnn, slot, getattr(model.rnn, to))  # one tensor in two slots
        x = torch.randn(B, T, D, dtype=dtype)
        return model, (model,), lambda: model(x)

    return build


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize(
    ("slot", "to"), [("weight_hh_l0_reverse", "weight_hh_l0"), ("bias_ih_l1", "bias_ih_l0")]
)
def test_slots_sharing_a_tensor(slot: str, to: str, batch_dim: int | None, on_device: str) -> None:
    """A tensor in two slots is one parameter: its per-row gradient is the sum of the slots'."""
    build = _tied("GRU", slot, to)
    if batch_dim is None:

        def build_tasks(dtype: torch.dtype) -> Built:
            model, modules, forward = build(dtype)
            return model, modules, lambda: forward()[:2] * torch.tensor([1.0, -0.5])

        check_case(Case("tied_tasks", build_tasks, None), torch.float64)
    else:
        check_case(Case("tied", build), torch.float64)


def test_module_around_a_recurrent_layer(on_device: str) -> None:
    """A module with parameters of its own (a learned initial state) around a GRU goes to the
    generic rule: refused per sample when the engine is built, exact per task."""

    class LearnedStart(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.h0 = nn.Parameter(torch.zeros(1, 1, H, dtype=torch.float64))
            self.gru = nn.GRU(D, H, batch_first=True).double()

        def forward(self, x: Tensor) -> Tensor:
            out, _ = self.gru(x, self.h0.expand(1, x.shape[0], H).contiguous())
            return out.pow(2).sum((1, 2))

    torch.manual_seed(0)
    model = LearnedStart()
    refusal = r"LearnedStart.gru is a GRU under the generic rule.*batch first, \[B, num_layers"
    with pytest.raises(ValueError, match=refusal):
        Engine(model, batch_dim=0)
    x = torch.randn(B, T, D, dtype=torch.float64)
    case = Case("learned_start_tasks", lambda dt: (model, (model,), lambda: model(x)[:2]), None)
    check_case(case, torch.float64)


class _InitialState(nn.Module):
    """A learned initial state of two layers in a module of its own, returned in the layout
    the recurrent layer takes (``[L, B, H]``) or batch first (``[B, L, H]``)."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.h0 = nn.Parameter(torch.linspace(-1.0, 1.0, 2 * H, dtype=torch.float64).view(2, H))

    def forward(self, x: Tensor) -> Tensor:
        state = self.h0.expand(x.shape[0], 2, H)
        return state if self.batch_first else state.transpose(0, 1)


class _WithInitialState(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.init = _InitialState(batch_first)
        self.gru = nn.GRU(D, H, num_layers=2, batch_first=True).double()

    def forward(self, x: Tensor) -> Tensor:
        h0 = self.init(x)
        h0 = h0.transpose(0, 1) if self.init.batch_first else h0
        return self.gru(x, h0.contiguous())[0].pow(2).sum((1, 2))


@pytest.mark.parametrize("batch_first", [False, True])
def test_a_learned_initial_state_in_a_module_of_its_own(batch_first: bool) -> None:
    """The advice of the refusal above followed: a module returning the state in the layer's
    layout ``[L, B, H]`` was refused with advice to expand it to the batch (it is). The
    refusal now says that the generic rule reads the batch on dimension 0 of a module's
    outputs, and to return it batch first and transpose it after the call, which is exact."""
    torch.manual_seed(0)
    model = _WithInitialState(batch_first)
    engine = Engine(model, batch_dim=0)
    x = torch.randn(B, T, D, dtype=torch.float64)
    if batch_first:
        assert_exact_gramian(engine, model(x), list(model.parameters()))
        return
    refusal = (
        r"_WithInitialState.init \(_InitialState\) must have its batch size 3 .* received shape "
        r"\(2, 3, 4\)\..* If the batch is on dimension 1 of that output, the generic rule reads "
        r"it on dimension 0 .*: return it batch first and transpose it after the call"
    )
    with pytest.raises(ValueError, match=refusal):
        engine.compute_gramian(model(x))


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_unbatched_input_per_task(
    kind: str, on_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One sequence without a batch dimension (per task), with an initial state from a hooked
    encoder and a batched call of the same layer: the closed form, as a batch of one."""
    torch.manual_seed(0)
    encode, rnn = nn.Linear(D, H).double(), getattr(nn, kind)(D, H, num_layers=2).double()
    x, batch = torch.randn(T, D, dtype=torch.float64), torch.randn(T, B, D, dtype=torch.float64)

    def forward() -> Tensor:
        h0 = torch.tanh(encode(x[:2]))  # [L, H]
        out, state = rnn(x, (h0, 0.5 * h0) if kind == "LSTM" else h0)
        finals = state if isinstance(state, tuple) else (state,)
        batched = rnn(batch)[0].pow(2).sum()
        return torch.stack([out[-2:].sum(), sum(f.pow(2).sum() for f in finals) + batched])

    monkeypatch.setattr(_recurrent._GENERIC, "prepare", None)  # (not called)
    check_case(Case("unbatched", lambda dt: (rnn, (encode, rnn), forward), None), torch.float64)


class _Doubled(nn.LSTM):
    """A subclass with a forward of its own: the generic rule per task."""

    def forward(self, input: Any, hx: Any = None) -> Any:
        out, state = super().forward(input, hx)
        return out, tuple(2 * s for s in state)


class _LearnedScale(nn.Module):
    """Parameters of its own around an LSTM fed a packed batch: the generic rule per task."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(H, dtype=torch.float64))
        self.lstm = nn.LSTM(D, H, batch_first=True).double()

    def forward(self, packed: Any) -> Tensor:
        return self.lstm(packed)[1][0] * self.scale


@pytest.mark.parametrize("make", [lambda: _Doubled(D, H, batch_first=True).double(), _LearnedScale])
def test_packed_sequences_under_the_generic_rule_are_refused_clearly(
    make: Callable[[], nn.Module],
) -> None:
    """torch.func cannot re-run torch's recurrent kernels on a packed batch: per task, the
    generic rule names the packed sequences and the ways out, and writes nothing."""
    module = make()
    x = torch.randn(B, T, D, dtype=torch.float64)
    packed = pack_padded_sequence(x, torch.tensor([2, 5, 3]), True, False)
    with Engine(module, batch_dim=None) as engine:
        out = module(packed)
        h_n = out[1][0] if isinstance(out, tuple) else out
        losses = torch.stack([h_n.sum(), h_n.pow(2).sum()])
        with pytest.raises(RuntimeError, match=r"packed sequences\. Pad the sequences"):
            engine.backward(losses, MeanWeighting())
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs cuDNN")
def test_fused_kernel_behind_a_forward_of_its_own() -> None:
    """Per task, a subclass whose forward transforms cuDNN's outputs (the kernel hidden from
    its outputs' graph) is still pulled back row by row: judged by its input."""

    class Tanh(nn.GRU):
        def forward(self, input: Any, hx: Any = None) -> Any:
            out, h = super().forward(input, hx)
            return torch.tanh(out * 2 + 1).pow(2).sin(), h

    def build(dtype: torch.dtype) -> Built:
        torch.manual_seed(0)
        encode, rnn = nn.Linear(D, D).to(dtype), Tanh(D, H, batch_first=True).to(dtype)
        x = torch.randn(B, T, D, dtype=dtype)
        return rnn, (encode, rnn), lambda: rnn(encode(x))[0].sum((0, 1))[:2]

    with torch.device("cuda"):
        check_case(Case("hidden_fused", build, None), torch.float64)


def test_modes_and_weights_as_the_forward_saw_them() -> None:
    """Dropout is judged by the forward's mode, not the step's; weights changed in place since
    the forward are refused (the replay would read other weights)."""
    torch.manual_seed(0)
    lstm = nn.LSTM(D, H, num_layers=2, dropout=0.5, batch_first=True).double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    with Engine(lstm, batch_dim=0) as engine:
        losses = lstm(x)[0].pow(2).sum((1, 2))  # training mode: dropout applied
        lstm.eval()
        with pytest.raises(ValueError, match="dropout"):
            engine.compute_gramian(losses)
        losses = lstm(x)[0].pow(2).sum((1, 2))  # eval mode: no dropout
        lstm.train()
        assert_exact_gramian(engine, losses, list(lstm.parameters()))
        lstm.eval()
        losses = lstm(x)[0].pow(2).sum((1, 2))
        with torch.no_grad():
            lstm.weight_hh_l0.mul_(1.5)
        with pytest.raises(RuntimeError, match="modified in place"):
            engine.backward(losses, MeanWeighting())
    assert all(p.grad is None for p in lstm.parameters())


def _bfloat16_lstm_runs(packed: bool) -> bool:
    """Whether torch runs an LSTM under bfloat16 autocast on this CPU (on a padded batch,
    oneDNN has no such primitive on some hosts: AVX2 without AVX-512, seen on an AMD EPYC)."""
    lstm, x = nn.LSTM(2, 2), torch.randn(2, 1, 2)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lstm(pack_padded_sequence(x, torch.tensor([2]), False) if packed else x)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("packed", [False, True])
def test_lstm_initial_state_under_autocast(packed: bool) -> None:
    """The initial states inside the (h0, c0) tuple, and a packed sequence's data, come in
    bfloat16 under autocast: the replay takes them in the weights' dtype."""
    if not _bfloat16_lstm_runs(packed):
        pytest.skip("torch's own LSTM forward under bfloat16 autocast fails on this CPU")
    torch.manual_seed(0)
    init, lstm = nn.Linear(D, H), nn.LSTM(D, H, batch_first=True)
    x = torch.randn(B, T, D)
    with Engine(init, lstm, batch_dim=0) as engine:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h0 = torch.tanh(init(x[:, 0]))[None]
            if packed:
                lengths = torch.tensor([2, 5, 3])
                data = pack_padded_sequence(init(x)[..., :D], lengths, True, False)
                out = pad_packed_sequence(lstm(data, (h0, h0))[0], batch_first=True)[0]
            else:
                out = lstm(x, (h0, h0))[0]
            losses = out.float().pow(2).sum((1, 2))
        gramian = engine.compute_gramian(losses)
        jacobian = reference_jacobian(losses, [*init.parameters(), *lstm.parameters()])
    reference = jacobian @ jacobian.T
    assert gramian.dtype == torch.float32
    assert ((gramian - reference).abs().max() / reference.abs().max()) < 0.05


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
@pytest.mark.parametrize("batch_dim", [0, None])
def test_float16_packed_sequences_run_in_float32(kind: str, batch_dim: int | None) -> None:
    """A float16 recurrent layer on a packed sequence, without autocast: the replay took the
    padded data in float16 (the weights' dtype), while every other float16 layer runs in
    float32, so the Gramian came in float16 and overflowed to ``inf`` from output gradients of
    about 300 (a float32 Gramian of about 1e7). Against the float64 brute force from the same
    float16 weights and inputs, to float16's precision."""
    torch.manual_seed(0)
    rnn = getattr(nn, kind)(D, H, batch_first=True).half()
    reference = getattr(nn, kind)(D, H, batch_first=True).double()
    reference.load_state_dict(rnn.state_dict())
    x, lengths = torch.randn(B, T, D).half(), torch.tensor([2, 5, 3])

    def losses(module: nn.RNNBase, dtype: torch.dtype) -> Tensor:
        data = pack_padded_sequence(x.to(dtype), lengths, True, False)
        out = pad_packed_sequence(module(data)[0], batch_first=True)[0]
        per_sample = 300 * out.to(torch.float64).pow(2).sum((1, 2))
        return per_sample if batch_dim == 0 else per_sample[:2]

    jacobian = reference_jacobian(losses(reference, torch.float64), [*reference.parameters()])
    assert_float32_gramian(Engine(rnn, batch_dim=batch_dim), losses(rnn, torch.float16), jacobian)


BATCHED = [c for c in CASES if c.batch_dim is None or c.name == "lstm_rows_per_output"]


@pytest.mark.parametrize("case", BATCHED, ids=[c.name for c in BATCHED])
def test_rows_pulled_back_one_by_one(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch's fused recurrent kernels (cuDNN) have no batching rule: when a recurrent layer ran
    one, the rows' gradients are pulled back one backward per row, with the same result. The
    flag is forced here, where no layer runs the fused kernel."""
    monkeypatch.setattr(_hooks, "_from_fused_rnn", lambda node: True)
    rows_pulled = []
    one_by_one = _capture._row_by_row
    monkeypatch.setattr(_capture, "_row_by_row", lambda *a: rows_pulled.append(1) or one_by_one(*a))
    check_case(case, torch.float64)
    assert rows_pulled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs cuDNN")
def test_fused_layer_outside_the_engine_is_named() -> None:
    """A recurrent layer on cuDNN between the losses and the hooked modules, outside them, cannot
    be pulled back in one batched backward: a clear error, and no ``.grad``."""
    with torch.device("cuda"):
        encode, lstm = nn.Linear(D, D), nn.LSTM(D, H, batch_first=True)
        x = torch.randn(B, T, D)
        with Engine(encode, batch_dim=None) as engine:
            out = lstm(torch.tanh(encode(x)))[0]
            losses = torch.stack([out.pow(2).sum(), out.sum()])
            with pytest.raises(RuntimeError, match=r"cudnn\.flags\(enabled=False\)"):
                engine.backward(losses, MeanWeighting())
    assert all(p.grad is None for p in encode.parameters())


class _ScaledInitialState(nn.GRU):
    """Overrides ``permute_hidden``, which ``nn.GRU.forward`` applies to the initial state."""

    def permute_hidden(self, hx: Tensor, permutation: Tensor | None) -> Tensor:
        return 2 * super().permute_hidden(hx, permutation)


def test_a_method_the_forward_delegates_to_overridden_is_not_replayed() -> None:
    """The closed form replays torch's recurrence from the initial state as given: a subclass
    with its own ``permute_hidden`` takes the generic rule per task (exact), and is refused per
    sample, as one with its own ``forward``."""
    torch.manual_seed(0)
    encode, rnn = nn.Linear(D, D).double(), _ScaledInitialState(D, H, batch_first=True).double()
    x, h0 = torch.randn(B, T, D, dtype=torch.float64), torch.randn(1, B, H, dtype=torch.float64)

    def forward() -> Tensor:
        out = rnn(encode(x), h0)[0]
        return torch.stack([out.sum(), out.pow(2).sum()])

    check_case(
        Case("permute_hidden", lambda dt: (rnn, (encode, rnn), forward), None), torch.float64
    )
    with pytest.raises(ValueError, match="its own forward, permute_hidden"):
        Engine(rnn, batch_dim=0)


def _weight_drop(lstm: nn.LSTM) -> nn.LSTM:
    """AWD-LSTM's WeightDrop, with a fixed mask: ``weight_hh_l0`` recomputed at each call, by a
    forward pre-hook, from a parameter ``weight_hh_l0_raw``."""
    raw = lstm._parameters.pop("weight_hh_l0")
    assert raw is not None
    lstm.register_parameter("weight_hh_l0_raw", nn.Parameter(raw.detach().clone()))
    lstm.register_buffer("mask", (torch.rand_like(raw) > 0.5).to(raw.dtype) / 0.5)

    def hook(module: nn.Module, args: Any) -> None:
        module.weight_hh_l0 = module.weight_hh_l0_raw * module.mask

    lstm.register_forward_pre_hook(hook)
    hook(lstm, ())
    return lstm


def test_a_parameter_the_closed_form_does_not_read_is_not_left_out() -> None:
    """WeightDrop's raw weight is no slot of the closed form: per task the generic rule covers
    it (exact), per sample the layer is refused with its name (it was left out silently)."""
    torch.manual_seed(0)
    encode, rnn = nn.Linear(D, D).double(), _weight_drop(nn.LSTM(D, H, batch_first=True).double())
    x = torch.randn(B, T, D, dtype=torch.float64)

    def forward() -> Tensor:
        out = rnn(encode(x))[0]
        return torch.stack([out.sum(), out.pow(2).sum()])

    check_case(Case("weight_drop", lambda dt: (rnn, (encode, rnn), forward), None), torch.float64)
    with pytest.raises(ValueError, match=r"does not read \(weight_hh_l0_raw;"):
        Engine(rnn, batch_dim=0)


# a recurrent layer, an attribute set between its forward and the step, and whether a forward
# after the change is one the layer can run
CHANGES: list[tuple[Callable[[], nn.RNNBase], str, object, bool]] = [
    (lambda: nn.RNN(D, H, batch_first=True), "mode", "RNN_RELU", True),
    (lambda: nn.GRU(D, H, batch_first=True), "hidden_size", 2, False),
    (lambda: nn.GRU(D, H, batch_first=True, num_layers=2), "num_layers", 1, False),
    (lambda: nn.GRU(D, H, batch_first=True), "bias", False, False),
    (lambda: nn.GRU(D, H, batch_first=True), "batch_first", False, True),
    (lambda: nn.LSTM(D, H, batch_first=True, num_layers=2), "dropout", 0.5, False),
    (lambda: nn.LSTM(D, H, batch_first=True, bidirectional=True), "bidirectional", False, False),
    (lambda: nn.LSTM(D, H, batch_first=True, proj_size=2), "proj_size", 0, False),
]


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize(("make", "name", "value", "exact"), CHANGES, ids=[c[1] for c in CHANGES])
def test_attributes_changed_after_the_forward_are_refused(
    make: Callable[[], nn.RNNBase], name: str, value: object, exact: bool, batch_dim: int | None
) -> None:
    """The replay reads the layer's kernel, sizes, layers, biases, layout, dropout, directions
    and projection at the step: one changed since the forward is refused, naming it, before
    anything is written (a changed ``mode`` or ``bias`` gave a step 51-261% off, silently; the
    others raw torch errors, or a dropout refusal for a forward that dropped nothing); a
    forward after the change is differentiated exactly."""
    layer = make().double()
    x = torch.randn(B, T, D, dtype=torch.float64)

    def losses_of(m: nn.Module) -> Tensor:
        out = m(x)[0]
        return row_losses(out if m.batch_first else out.transpose(0, 1), batch_dim)

    assert_change_refused(layer, losses_of, lambda: setattr(layer, name, value), batch_dim, name)
    if exact and not (batch_dim == 0 and name == "batch_first"):
        assert_exact_backward(layer, losses_of, batch_dim)


def test_the_replay_reads_the_steps_of_the_input_projection_by_one_unbind() -> None:
    """The replay read ``a = W_ih x + b_ih`` at each step as ``a[:, t]``, whose backward wrote
    a zero ``[N, T, G H]`` per step (``T^2`` in all): 4.2 s of a 4.4 s per-task step of an
    LSTM on 256 steps, against 14 ms for the SGD step. One ``unbind`` stacks the steps'
    gradients once: no step is selected from a tensor of all the steps."""
    layer = nn.LSTM(D, H, num_layers=2, bidirectional=True, batch_first=True)
    with torch.enable_grad():
        replay = _recurrent._Replay(layer, torch.randn(B, T, D), None)
    nodes, seen = [o.grad_fn for o in replay.outputs], set()
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.extend(next_node for next_node, _ in node.next_functions)
    assert "SelectBackward0" not in {node.name() for node in seen}
