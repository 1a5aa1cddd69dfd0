"""Recurrent cells (``nn.RNNCell``, ``nn.LSTMCell``, ``nn.GRUCell``) called in a loop: their
closed form against the brute-force Jacobian."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from jacflow.aggregation import UPGradWeighting
from jacflow.autogram import Engine
from jacflow.autogram._cells import CellRule
from jacflow.autogram._hooks import find_units
from tests.autogram.test_engine import (
    assert_exact_gramian,
    assert_exact_step,
    reference_jacobian,
)
from tests.autogram.test_linear import assert_change_refused, row_losses

D, H = 3, 4


def _cell(kind: str, bias: bool = True, nonlinearity: str = "tanh") -> nn.RNNCellBase:
    if kind == "rnn":
        return nn.RNNCell(D, H, bias=bias, nonlinearity=nonlinearity)
    return (nn.LSTMCell if kind == "lstm" else nn.GRUCell)(D, H, bias=bias)


def _unrolled(cell: nn.RNNCellBase, head: nn.Linear, x: Tensor, state: object) -> Tensor:
    """The head's outputs summed over the steps of the loop ``[B, k]`` (or ``[k]``)."""
    outs = []
    for step in x:
        state = cell(step, state)
        h = state[0] if isinstance(state, tuple) else state
        outs.append(head(h))
    return torch.stack(outs).sum(0)


def _initial(kind: str, batch: tuple[int, ...]) -> object:
    if kind == "lstm":
        return torch.randn(*batch, H, dtype=torch.float64), torch.randn(
            *batch, H, dtype=torch.float64
        )
    return torch.randn(*batch, H, dtype=torch.float64)


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["rnn_tanh", "rnn_relu", "gru", "lstm"]),
    given_state=st.booleans(),
    bias=st.booleans(),
    per_task=st.booleans(),
    k=st.integers(1, 2),
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_cells_in_a_loop_are_exact(
    kind: str, given_state: bool, bias: bool, per_task: bool, k: int, steps: int, seed: int
) -> None:
    """Gramian and update equal the brute-force ones, per sample (``[B]`` or ``[B, k]``
    losses) and per task, with a given or the default state."""
    torch.manual_seed(seed)
    name, _, nonlinearity = kind.partition("_")
    cell, head = _cell(name, bias, nonlinearity or "tanh").double(), nn.Linear(H, k).double()
    engine = Engine(cell, head, batch_dim=None if per_task else 0)
    x = torch.randn(steps, 5, D, dtype=torch.float64)
    out = _unrolled(cell, head, x, _initial(name, (5,)) if given_state else None)
    losses = (
        out.pow(2).squeeze(-1) if not per_task else torch.stack([out.sum(), out[0].pow(2).sum()])
    )
    params = [*cell.parameters(), *head.parameters()]
    jacobian = reference_jacobian(losses, params)
    torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)
    out = _unrolled(cell, head, x, _initial(name, (5,)) if given_state else None)
    losses = (
        out.pow(2).squeeze(-1) if not per_task else torch.stack([out.sum(), out[0].pow(2).sum()])
    )
    jacobian = reference_jacobian(losses, params)
    weights = engine.backward(losses, UPGradWeighting())
    got = torch.cat([p.grad.flatten() for p in params])
    torch.testing.assert_close(got, weights.flatten() @ jacobian)


def test_cells_take_the_closed_form() -> None:
    """The three cells get the closed form, not the generic rule."""
    units = find_units((nn.ModuleList([_cell("rnn"), _cell("gru"), _cell("lstm")]),))
    assert [type(unit.rule) for unit in units] == [CellRule] * 3


@pytest.mark.parametrize("kind", ["rnn", "gru", "lstm"])
@pytest.mark.parametrize("tied", [False, True])
def test_tied_weights_unbatched_inputs_and_keyword_states(kind: str, tied: bool) -> None:
    """Per task: an unbatched input and the state given by keyword, with the input and hidden
    weights (and biases) one tensor each or not."""
    torch.manual_seed(0)
    cell = (nn.RNNCell if kind == "rnn" else nn.LSTMCell if kind == "lstm" else nn.GRUCell)(H, H)
    cell, head = cell.double(), nn.Linear(H, 1).double()
    if tied:
        cell.weight_hh, cell.bias_hh = cell.weight_ih, cell.bias_ih
    engine = Engine(cell, head, batch_dim=None)
    x = torch.randn(2, H, dtype=torch.float64)
    state = _initial(kind, ())
    for step in x:
        state = cell(step, hx=state)
    out = head(state[0] if isinstance(state, tuple) else state)
    losses = torch.stack([out.sum(), out.pow(2).sum()])
    params = [*cell.parameters(), *head.parameters()]
    assert_exact_gramian(engine, losses, params)


class _Reversed(nn.GRUCell):
    def forward(self, x: Tensor, hx: Tensor | None = None) -> Tensor:
        return super().forward(x.flip(-1), hx)


def test_a_subclass_with_its_own_forward_gets_the_generic_rule() -> None:
    """Its forward is not the cell's: the generic rule re-runs it (exact)."""
    torch.manual_seed(0)
    cell = _Reversed(D, H).double()
    assert [type(unit.rule) for unit in find_units((cell,))] != [CellRule]
    engine = Engine(cell, batch_dim=None)
    out = cell(torch.randn(5, D, dtype=torch.float64))
    losses = torch.stack([out.sum(), out.pow(2).mean()])
    assert_exact_gramian(engine, losses, list(cell.parameters()))


class _OwnLSTMCell(nn.LSTMCell):
    """An LSTM cell with its own forward: torch computes its ``h'`` from its ``c'`` (CPU),
    so one output is computed from the other; ``zoneout`` keeps a share of the previous
    ``h`` (eval-mode zoneout), so the returned ``h`` is computed from ``c'`` too."""

    def __init__(self, zoneout: bool) -> None:
        super().__init__(D, H)
        self.zoneout = zoneout

    def forward(self, x: Tensor, hx: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        h, c = super().forward(x, hx)
        if self.zoneout and hx is not None:
            h = 0.3 * hx[0] + 0.7 * h
        return h, c


@pytest.mark.parametrize("zoneout", [False, True])
@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("reads", ["h", "h_and_c"])
def test_an_lstm_cell_subclass_with_its_own_forward(
    zoneout: bool, batch_dim: int | None, reads: str
) -> None:
    """The generic rule gives the captured gradient of ``c'`` (which holds the path through
    ``h'``) to the re-run's ``c'`` in place of the one it accumulates: exact, in a loop and
    with the losses reading ``h`` only or both (it was refused as an auxiliary loss)."""
    torch.manual_seed(0)
    cell = _OwnLSTMCell(zoneout).double()
    assert [type(unit.rule) for unit in find_units((cell,))] != [CellRule]
    x = torch.randn(4, 3, D, dtype=torch.float64)

    def forward() -> Tensor:
        state = None
        for step in x:
            state = cell(step, state)
        assert state is not None
        per = state[0].pow(2).sum(1) + (state[1].sin().sum(1) if reads == "h_and_c" else 0)
        return per if batch_dim == 0 else torch.stack([per.sum(), per[1]])

    with Engine(cell, batch_dim=batch_dim) as engine:
        assert_exact_step(engine, forward, list(cell.parameters()))


class _AuxiliaryGRUCell(nn.GRUCell):
    def forward(self, x: Tensor, hx: Tensor | None = None) -> tuple[Tensor, Tensor]:
        h = super().forward(x, hx)
        return h, h.exp()


def test_other_cells_outputs_computed_from_one_another_stay_refused() -> None:
    """Only the LSTM cell's own structure is given the captured gradients: another module's
    output computed from another stays refused."""
    cell = _AuxiliaryGRUCell(D, H).double()
    with Engine(cell, batch_dim=None) as engine:
        h, e = cell(torch.randn(3, D, dtype=torch.float64))
        with pytest.raises(ValueError, match="count those paths twice"):
            engine.compute_gramian(torch.stack([h.sum(), e.sum()]))


def test_unbatched_input_per_sample_is_refused() -> None:
    cell = _cell("gru").double()
    engine = Engine(cell, batch_dim=0)
    with pytest.raises(ValueError, match="unbatched input of shape"):
        engine.compute_gramian(cell(torch.randn(D, dtype=torch.float64)).pow(2))


@pytest.mark.parametrize("change", ["state_added", "output_rectified"])
def test_lstm_outputs_changed_in_place(change: str) -> None:
    """An in-place op on the LSTM cell's h or c gives them new nodes: which captured gradient
    holds the path through h is read on the nodes recorded at the forward (2-12% off)."""
    torch.manual_seed(0)
    cell, head = _cell("lstm").double(), nn.Linear(H, 1).double()
    engine = Engine(cell, head, batch_dim=0)
    x = torch.randn(3, 5, D, dtype=torch.float64)
    state = None
    for step in x:
        h, c = cell(step, state)
        if change == "state_added":
            c += 0.5 * step.sum(1, keepdim=True)
        else:
            torch.relu_(h)
        state = (h, c)
    losses = head(state[0]).squeeze(1).pow(2) + state[1].sum(1)
    assert_exact_gramian(engine, losses, [*cell.parameters(), *head.parameters()])


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize(
    ("kind", "name", "value"), [("rnn", "nonlinearity", "relu"), ("gru", "hidden_size", 2)]
)
def test_attributes_changed_after_the_forward_are_refused(
    kind: str, name: str, value: object, batch_dim: int | None
) -> None:
    """The replay of a step reads an RNN cell's nonlinearity and the width of the default
    state at the step: one changed since the forward is refused, naming it, before anything
    is written (a changed nonlinearity gave a step 109-185% off, silently; a changed width a
    raw torch error)."""
    cell = _cell(kind).double()
    x = torch.randn(3, 5, D, dtype=torch.float64)

    def losses_of(m: nn.Module) -> Tensor:
        h = None
        for step in x.unbind(1):
            h = m(step, h)
        assert h is not None
        return row_losses(h, batch_dim)

    assert_change_refused(cell, losses_of, lambda: setattr(cell, name, value), batch_dim, name)
