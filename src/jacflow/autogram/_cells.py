"""``nn.RNNCell``, ``nn.LSTMCell`` and ``nn.GRUCell`` in closed form: one step of a recurrence.

A call computes ``a = W_ih x + b_ih`` and ``c = W_hh h + b_hh`` and combines them into the new
state, as one time step of the recurrent layers (``_recurrent.cell_step``). So ``W_ih`` is a Linear
layer with input ``x`` and output gradient ``da``, and ``W_hh`` one with input ``h`` and output
gradient ``dc``; a cell called in a loop is a Linear layer whose positions are its calls. The
rows' ``da`` and ``dc`` come from one backward through the step replayed from the recorded
inputs (batched over the rows when they are not the samples): the step is each sample's own.

An LSTM cell returns ``(h', s')`` with ``h' = o * tanh(s')``. Where torch computes that from
``s'`` in the graph (its CPU kernel), the gradient captured at ``s'`` already holds the path
through ``h'``, so the replay reads ``s'`` there as a constant; where one fused node returns
both (CUDA), each captured gradient is its output's own.

Covered: every nonlinearity, with or without biases, a given or a default (zero) state,
weights tied between the two slots, unbatched inputs per task. Refused with a clear error:
unbatched inputs per sample. (A subclass with its own ``forward`` gets the generic rule, which
gives an LSTM cell's ``s'`` its captured gradient: ``_fallback._own_gradients``.)
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jacflow.autogram._recurrent import cell_step, slots_contribution
from jacflow.autogram._rules import (
    Call,
    Contribution,
    Rows,
    Rule,
    attribute_settings,
    register_rule,
    unbatched_refusal,
)

_TYPES = (nn.RNNCell, nn.LSTMCell, nn.GRUCell)
_SLOTS = frozenset({"weight_ih", "weight_hh", "bias_ih", "bias_hh"})


def _mode(module: nn.RNNCellBase) -> str:
    if isinstance(module, nn.LSTMCell):
        return "LSTM"
    if isinstance(module, nn.GRUCell):
        return "GRU"
    assert isinstance(module, nn.RNNCell)
    return "RNN_TANH" if module.nonlinearity == "tanh" else "RNN_RELU"


def _state(call: Call) -> Any:
    """The recorded state argument (``hx``), or ``None``."""
    return call.args[1] if len(call.args) > 1 else call.kwargs.get("hx")


def _reads_state(call: Call) -> bool:
    """Whether the LSTM cell's ``h'`` was computed from its ``s'`` in the graph (``h' = o *
    tanh(s')``, two nodes away), so that the gradient captured at ``s'`` holds that path. Read
    on the nodes recorded at the forward (an in-place op on an output gives it another)."""
    if len(call.edges) != 2:
        return False
    node, state = call.edges[0].node, call.edges[1].node
    for _ in range(2):
        following = [n for n, _ in node.next_functions if n is not None] if node else []
        if any(n is state for n in following):
            return True
        node = next((n for n in following if n.name().startswith("Tanh")), None)
    return False


def _detached(param: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``param`` detached, in the dtype of the call's (maybe upcast) tensors."""
    return None if param is None else param.detach().to(dtype)


class CellRule(Rule):
    """``nn.RNNCell``, ``nn.LSTMCell``, ``nn.GRUCell``: both weights as Linear layers whose
    positions are the calls (see the module docstring)."""

    def replays(self) -> bool:
        return True

    def parameter_names(self, module: nn.Module) -> frozenset[str]:
        return _SLOTS

    def settings(self, module: nn.Module) -> Hashable:
        # (an RNNCell's forward reads its nonlinearity at each call; the default state is
        # hidden_size wide)
        return attribute_settings(module, ("nonlinearity", "hidden_size"))

    def output_batch_dim(self, module: nn.Module, call: Call, position: int) -> int | None:
        return 0

    def validate(self, module: nn.Module, call: Call, rows: Rows) -> None:
        if not rows.per_task and call.input().dim() != 2:
            raise unbatched_refusal(module, call.input())

    def prepare(
        self, module: nn.Module, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> Contribution:
        assert isinstance(module, nn.RNNCellBase)
        return slots_contribution(
            module, params, [_terms(module, call, rows) for call in calls], rows
        )


def _terms(module: nn.RNNCellBase, call: Call, rows: Rows) -> dict[str, tuple[Tensor, Tensor]]:
    """Per weight slot: its Linear form's inputs ``[N, D]`` and their rows' output gradients
    (``[R, G H]``, or ``[R, N, G H]`` per task)."""
    mode = _mode(module)
    x = call.input()
    hx = _state(call)
    unbatched = x.dim() == 1  # (per task: replayed as a batch of one)
    if unbatched:
        x = x.unsqueeze(0)
    zeros = x.new_zeros(x.shape[0], module.hidden_size)
    if mode == "LSTM":
        h, state = (zeros, zeros) if hx is None else hx
    else:
        h, state = (zeros if hx is None else hx), None
    if unbatched and hx is not None:
        h = h.unsqueeze(0)
        state = None if state is None else state.unsqueeze(0)
    # (the state in the dtype of the input: float32 for float16 parameters, whose states come
    # as a tuple the engine's upcast does not open)
    x, h = x.detach(), h.detach().to(x.dtype)
    state = None if state is None else state.detach().to(x.dtype)
    with torch.enable_grad():  # (the engine prepares under no_grad)
        w_ih, w_hh = module.weight_ih.detach().to(x.dtype), module.weight_hh.detach().to(x.dtype)
        a = F.linear(x, w_ih, _detached(module.bias_ih, x.dtype))
        c = F.linear(h, w_hh, _detached(module.bias_hh, x.dtype))
        a, c = a.requires_grad_(), c.requires_grad_()
        if mode == "LSTM":
            i, f, g, o = (a + c).chunk(4, -1)
            assert state is not None
            new_state = f.sigmoid() * state + i.sigmoid() * g.tanh()
            # (the captured gradient of s' holds the path through h' where the graph has it)
            read = new_state.detach() if _reads_state(call) else new_state
            outputs = [o.sigmoid() * read.tanh(), new_state]
        else:
            outputs = [cell_step(mode, a, c, h, None)[0]]
        pairs = []
        for position, grad in zip(call.output_positions, call.grads, strict=True):
            if grad is None:
                continue
            if unbatched:
                grad = grad.unsqueeze(1)  # [R, H] -> [R, 1, H]
            elif not rows.per_task and rows.index is not None:  # [k N, H] -> [k, N, H]
                grad = grad.reshape(-1, rows.num_samples, *grad.shape[1:])
            pairs.append((outputs[position], grad))
        batched = rows.per_task or rows.index is not None
        da, dc = torch.autograd.grad(
            [o for o, _ in pairs],
            [a, c],
            [g for _, g in pairs],
            is_grads_batched=batched,
            allow_unused=True,
        )
    lead = (pairs[0][1].shape[0],) if batched else ()
    da = a.new_zeros(*lead, *a.shape) if da is None else da
    dc = c.new_zeros(*lead, *c.shape) if dc is None else dc
    return {"ih": (x, da), "hh": (h, dc)}


for _type in _TYPES:
    register_rule(_type, CellRule())
