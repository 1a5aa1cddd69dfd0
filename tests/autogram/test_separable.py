"""Per sample, losses that read a hooked call's output at other samples than their own are
refused (the probe of ``autogram._separable``); the shapes alone could not tell."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from jacflow.aggregation import ConstantWeighting, UPGradWeighting
from jacflow.autogram import Engine, _engine
from tests.autogram.test_engine import assert_exact_gramian, hooked_params, reference_jacobian

_MESSAGE = r"read the output of .* at other samples than their own"


class _Positions(nn.Module):
    """Token and position embeddings, a projection of a fixed positional table kept as a buffer
    (``[T, d]``), and a head: the positions and the table have no batch dimension unless
    ``expand`` gives them one."""

    def __init__(self, positions: int, expand: bool) -> None:
        super().__init__()
        self.tokens = nn.Embedding(7, 4)
        self.positions = nn.Embedding(positions, 4)
        self.register_buffer("table", torch.randn(positions, 4))
        self.projection = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.expand = expand

    def forward(self, idx: Tensor) -> Tensor:
        b, t = idx.shape
        where, table = torch.arange(t), self.table
        if self.expand:
            where, table = where.expand(b, t), table.expand(b, *table.shape)
        h = self.tokens(idx) + self.positions(where) + self.projection(table)
        return self.head(torch.tanh(h)).pow(2).sum((1, 2))


@pytest.mark.parametrize("batch", [2, 5])
def test_positions_without_the_batch_dimension_are_refused(batch: int) -> None:
    """Position embeddings of ``arange(T)`` and a Linear on a ``[T, d]`` buffer with
    ``T == B``: taken as batched, their Gramian was 5-21% off, silently (refused when
    ``T != B`` by the shapes). Refused now, ``.grad`` untouched; expanded to the batch, exact."""
    torch.manual_seed(0)
    idx = torch.randint(0, 7, (batch, batch))
    model = _Positions(batch, expand=False).double()
    engine = Engine(model, batch_dim=0)
    with pytest.raises(ValueError, match=_MESSAGE):
        engine.backward(model(idx), UPGradWeighting())
    assert all(p.grad is None for p in model.parameters())
    model.expand = True
    assert_exact_gramian(engine, model(idx), hooked_params((model,)))


def _contrastive(z: Tensor) -> Tensor:
    return -torch.log_softmax(z @ z.T, dim=1).diagonal()


def _centred(h: Tensor) -> Tensor:
    return h - h.mean(0, keepdim=True)


@pytest.mark.parametrize(
    ("case", "batch"),
    [("contrastive", 5), ("contrastive", 2), ("centred", 5), ("columns", 4), ("last", 3)],
)
def test_losses_mixing_the_samples_are_refused(case: str, batch: int) -> None:
    """Losses over pairs of samples (contrastive, 66% off), a parameter-free centring over the
    batch between two hooked layers (24% off), the same with ``[B, k]`` losses, and a mixing
    that only the last sample's loss shows (each loss reads the samples before it): all
    silent before, refused now, with ``.grad`` untouched."""
    torch.manual_seed(0)
    first, second = nn.Linear(3, 4).double(), nn.Linear(4, 3).double()
    x = torch.randn(batch, 3, dtype=torch.float64)
    forwards: dict[str, Callable[[], Tensor]] = {
        "contrastive": lambda: _contrastive(second(torch.tanh(first(x)))),
        "centred": lambda: second(_centred(torch.tanh(first(x)))).pow(2).sum(1),
        "columns": lambda: second(_centred(torch.tanh(first(x)))).pow(2),
        "last": lambda: second(torch.tanh(first(x)).cumsum(0)).pow(2).sum(1),
    }
    engine = Engine(first, second, batch_dim=0)
    with pytest.raises(ValueError, match=_MESSAGE):
        engine.backward(forwards[case](), UPGradWeighting())
    assert all(p.grad is None for p in [*first.parameters(), *second.parameters()])


def test_the_probe_runs_once_per_pattern_of_calls() -> None:
    """The probe is 2 ceil(log2 B) more backwards at the first step of a pattern of calls and
    batch size (a hook on an intermediate tensor sees them), none at the next steps; its steps
    are exact."""
    models = []
    for _ in range(2):  # (the engine's, and one for the reference)
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double())
    x = torch.randn(6, 3, dtype=torch.float64)
    jacobian = reference_jacobian(models[1](x).pow(2).sum(1), [*models[1].parameters()])
    model, engine = models[0], Engine(models[0], batch_dim=0)
    seen: list[int] = []
    runs = []
    for _ in range(2):
        hidden = model[1](model[0](x))
        hidden.register_hook(lambda grad: seen.append(1))
        before = len(seen)
        gramian = engine.compute_gramian(model[2](hidden).pow(2).sum(1))
        runs.append(len(seen) - before)
        torch.testing.assert_close(gramian, jacobian @ jacobian.T)
    assert runs == [7, 1]  # (B = 6: 3 binary digits, a probe and its complement each)


def test_each_probe_frees_its_gradients_before_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's backwards run one at a time so that one probe's gradients w.r.t. the
    outputs are held at once: the previous probe's, kept by the loop's variables, were still
    alive during the next backward (the small CNN's first step at B = 128: 185 MB, 128 MB
    freed)."""
    pull_back = _engine.pull_back
    alive: list[weakref.ref[Tensor]] = []
    held_during_backward: list[int] = []

    def tracked(*args: Any, **kwargs: Any) -> tuple[Tensor | None, ...]:
        if not kwargs.get("row_by_row"):
            return pull_back(*args, **kwargs)
        held_during_backward.append(sum(ref() is not None for ref in alive))
        grads = pull_back(*args, **kwargs)
        alive[:] = [weakref.ref(g) for g in grads if g is not None]
        return grads

    monkeypatch.setattr(_engine, "pull_back", tracked)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    engine = Engine(model, batch_dim=0)
    engine.compute_gramian(model(torch.randn(8, 3, dtype=torch.float64)).pow(2).sum(1))
    assert held_during_backward == [0] * 6  # (B = 8: 3 binary digits, 2 probes each)


class _PooledAt(nn.Module):
    """A sequence-first ``[T, B, d]`` Linear with ``T == B`` (its rows are positions, which the
    Engine takes for samples), each sequence pooled at the position ``(b + shift) % B``."""

    def __init__(self, shift: int) -> None:
        super().__init__()
        self.layer, self.head = nn.Linear(3, 4), nn.Linear(4, 1)
        self.shift = shift

    def forward(self, x: Tensor) -> Tensor:
        hidden = torch.tanh(self.layer(x))
        batch = x.shape[1]
        where = [(b + self.shift) % batch for b in range(batch)]
        return self.head(hidden[where, range(batch)]).squeeze(1).pow(2)


@pytest.mark.parametrize("batch", [4, 5, 6, 8])
def test_a_read_of_any_other_sample_is_refused(batch: int) -> None:
    """Each loss reads one other sample's row: two complementary halves missed the reads within
    a half (a Gramian 100% off, silently); the binary digits' probes split every pair. Reading
    its own row (shift 0) is exact, and a new batch size is probed again (a pattern probed at
    one size passed a mixing at another)."""
    x = torch.randn(batch, batch, 3, dtype=torch.float64)
    torch.manual_seed(0)
    model = _PooledAt(0).double()
    engine = Engine(model, batch_dim=0)
    small = torch.randn(2, 2, 3, dtype=torch.float64)
    engine.compute_gramian(model(small))  # (the pattern, probed at B = 2)
    for shift in range(1, batch):
        model.shift = shift
        with pytest.raises(ValueError, match=_MESSAGE):
            engine.compute_gramian(model(x))
    model.shift = 0
    reference = copy.deepcopy(model)
    jacobian = reference_jacobian(reference(x), [*reference.parameters()])
    torch.testing.assert_close(engine.compute_gramian(model(x)), jacobian @ jacobian.T)


@pytest.mark.parametrize("sequence_first", [True, False])
def test_a_position_that_the_data_zero_does_not_hide_a_sequence_first_linear(
    sequence_first: bool,
) -> None:
    """A Linear on a sequence-first ``[T, B, d]`` tensor with ``T == B`` takes positions for
    samples. With one position all zero before a ReLU, its gradient vanishes at that (unprobed)
    row, and the probe of half the losses passed it: the Gramian was off by 4.8 and the update
    by 3.1, silently. The other losses' probe sees them read the probed rows: refused, ``.grad``
    untouched. Batch-first, the same zero position is exact."""
    torch.manual_seed(0)
    layer = nn.Linear(2, 2, bias=False).double()
    x = torch.randn(3, 3, 2, dtype=torch.float64)
    x[:, 1] = 0.0

    def losses(module: nn.Module) -> Tensor:
        if not sequence_first:
            return torch.relu(module(x)).pow(2).sum((1, 2))
        return torch.relu(module(x.transpose(0, 1))).transpose(0, 1).pow(2).sum((1, 2))

    reference = copy.deepcopy(layer)
    jacobian = reference_jacobian(losses(reference), [reference.weight])
    engine = Engine(layer, batch_dim=0)
    previous = torch.randn_like(layer.weight)
    layer.weight.grad = previous.clone()
    weights = torch.tensor([0.2, 1.0, 3.0], dtype=torch.float64)
    if sequence_first:
        with pytest.raises(ValueError, match=_MESSAGE):
            engine.compute_gramian(losses(layer))
        with pytest.raises(ValueError, match=_MESSAGE):
            engine.backward(losses(layer), ConstantWeighting(weights))
        assert torch.equal(layer.weight.grad, previous)
        return
    torch.testing.assert_close(engine.compute_gramian(losses(layer)), jacobian @ jacobian.T)
    engine.backward(losses(layer), ConstantWeighting(weights))
    torch.testing.assert_close(layer.weight.grad.flatten(), previous.flatten() + weights @ jacobian)


def test_non_finite_gradients_are_not_judged() -> None:
    """A NaN in the weights reaches every loss: the step propagates it (its weights are NaN),
    and the probe does not call it a mixing."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    engine = Engine(model, batch_dim=0)
    weights = engine.backward(
        model(torch.randn(4, 3, dtype=torch.float64)).sum(1), UPGradWeighting()
    )
    assert bool(weights.isnan().all())


def test_a_mixing_from_a_later_step_or_with_hooks_is_refused() -> None:
    """The probe runs again when the losses' graph around the calls changes with the same calls
    (a centring over the batch from the second step on: it was checked at the first step only),
    and runs where module backward hooks are registered (a monitoring hook: it was left out)."""
    torch.manual_seed(0)
    first, second = nn.Linear(3, 4).double(), nn.Linear(4, 3).double()
    second.register_full_backward_hook(lambda module, grads_in, grads_out: None)
    x = torch.randn(6, 3, dtype=torch.float64)
    engine = Engine(first, second, batch_dim=0)
    for mixed in (False, True):
        hidden = torch.tanh(first(x))
        losses = second(_centred(hidden) if mixed else hidden).pow(2).sum(1)
        if mixed:
            with pytest.raises(ValueError, match=_MESSAGE):
                engine.backward(losses, UPGradWeighting())
        else:
            engine.backward(losses, UPGradWeighting())


@pytest.mark.parametrize(("case", "batch"), [("centred", 2), ("centred", 4), ("pair", 3)])
def test_a_mixing_after_a_packed_recurrent_layer_is_refused(case: str, batch: int) -> None:
    """A packed sequence's data has no batch dimension: the probe skipped the outputs of a
    recurrent layer called on one, and a centring over the batch or a loss reading every
    sample after it gave a Gramian 18-73% off, silently. Its rows are read by their samples
    now: refused, ``.grad`` untouched; the same step without the mixing is exact."""
    torch.manual_seed(0)
    gru = nn.GRU(4, 3, batch_first=True).double()
    x = torch.randn(batch, 3, 4, dtype=torch.float64)
    lengths = torch.tensor([3, 1, 2, 3][:batch])

    def losses(mixed: bool) -> Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, True, enforce_sorted=False)
        out = nn.utils.rnn.pad_packed_sequence(gru(packed)[0], batch_first=True)[0].mean(1)
        base = out.sin() + out.pow(2)
        if not mixed:
            return base
        return _centred(base) if case == "centred" else base * out[:, :1].sum(0)

    engine = Engine(gru, batch_dim=0)
    with pytest.raises(ValueError, match=_MESSAGE):
        engine.backward(losses(True), UPGradWeighting())
    assert all(p.grad is None for p in gru.parameters())
    assert_exact_gramian(engine, losses(False), hooked_params((gru,)))
