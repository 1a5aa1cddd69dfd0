"""``nn.RNN``, ``nn.LSTM`` and ``nn.GRU`` in closed form: each weight is a Linear layer over time.

At step ``t`` a cell computes ``a_t = W_ih x_t + b_ih`` and ``c_t = W_hh h_{t-1} + b_hh`` and
combines them into ``h_t`` (and the LSTM's cell state). So ``W_ih`` is a Linear layer whose
positions are the time steps, with inputs ``x_t`` and output gradients ``da_t``, and ``W_hh`` one
with inputs ``h_{t-1}`` and output gradients ``dc_t``: the Linear rule's ghost and materialised
forms, and its book-keeping update, give their Gramians and updates. The rows' ``da_t`` and
``dc_t`` come from one replay of the layer's recurrence from the recorded inputs (one backward
through it, batched over the rows when they are not the samples). Each sample's recurrence is
its own, so per-sample mode needs no re-run per sample, which ``vmap`` cannot do for torch's
fused recurrent kernels. An LSTM's projection (``proj_size``: ``h_t = W_hr (o_t * tanh(s_t))``
with the cell state ``s_t``) is one more Linear layer over time, with inputs ``o_t * tanh(s_t)``
and output gradients ``dh_t``.

Covered: every layer count, both directions, with or without biases, ``batch_first`` either
way, LSTM projections, packed sequences, a given initial state, weights tied between slots.
A packed batch is
replayed padded, each sample's state frozen past its length (the reverse direction starts at
its last step), and the packed outputs' gradients are laid out padded with zeros at the padded
steps, so those steps add nothing. Refused with a clear error: unbatched inputs in per-sample
mode, dropout between layers in a training-mode forward (its random mask cannot be replayed),
weights changed in place since the forward, and (per sample) a subclass with its own
``forward``; per task, that subclass goes to the generic rule, and an unbatched input is
replayed as a batch of one.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from jacflow.autogram._fallback import FallbackRule
from jacflow.autogram._linear import JoinedLinear, UnfoldedContribution, linear_part
from jacflow.autogram._precision import working_dtype
from jacflow.autogram._rules import (
    Call,
    Contribution,
    Rows,
    Rule,
    attribute_settings,
    find_rule,
    register_rule,
    unbatched_refusal,
)

_TYPES = (nn.RNN, nn.LSTM, nn.GRU)
# what the replay reads of the module besides its weights (an RNN's ``mode``, not its
# ``nonlinearity``, picks its kernel)
_SETTINGS = (
    "mode",
    "hidden_size",
    "num_layers",
    "bias",
    "batch_first",
    "dropout",
    "bidirectional",
    "proj_size",
)
_GENERIC = FallbackRule()


def _weight(module: nn.Module, name: str, dtype: torch.dtype) -> Tensor:
    """The parameter ``name`` of ``module``, detached, in ``dtype``."""
    weight: Tensor = getattr(module, name)
    return weight.detach().to(dtype)


def covered(module: nn.RNNBase) -> bool:
    """Whether the closed form reproduces the module's forward (the per-call conditions are
    checked when the calls are known).

    Example:
        >>> from torch import nn
        >>> from jacflow.autogram._recurrent import covered
        >>> covered(nn.LSTM(3, 4, num_layers=2, proj_size=2))
        True
        >>> class Reversed(nn.GRU):
        ...     def forward(self, x, hx=None):
        ...         return super().forward(x.flip(1), hx)
        >>> covered(Reversed(3, 4))
        False
    """
    return isinstance(module, _TYPES) and find_rule(module) is not None


def uncovered_refusal(where: str, module: nn.RNNBase) -> ValueError:
    """The error for a recurrent layer the closed form does not cover, per sample.

    Example:
        >>> from torch import nn
        >>> from jacflow.autogram._recurrent import uncovered_refusal
        >>> str(uncovered_refusal("rnn", nn.LSTM(3, 4))).split(":")[0]
        'rnn is a LSTM subclass with its own forward, permute_hidden or _update_flat_weights'
    """
    return ValueError(
        f"{where} is a {type(module).__name__} subclass with its own forward, permute_hidden or "
        "_update_flat_weights: no closed form covers it, and the per-sample engine "
        "(batch_dim set) cannot re-run it sample by sample. Use batch_dim=None, or "
        "jacflow.autojac.backward."
    )


def cell_step(
    mode: str, a: Tensor, c: Tensor, h: Tensor, state: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """One step of torch's cells from ``a = W_ih x + b_ih`` and ``c = W_hh h + b_hh``."""
    if mode == "LSTM":
        i, f, g, o = (a + c).chunk(4, -1)
        assert state is not None
        state = f.sigmoid() * state + i.sigmoid() * g.tanh()
        return o.sigmoid() * state.tanh(), state
    if mode == "GRU":
        a_r, a_z, a_n = a.chunk(3, -1)
        c_r, c_z, c_n = c.chunk(3, -1)
        r, z = (a_r + c_r).sigmoid(), (a_z + c_z).sigmoid()
        n = (a_n + r * c_n).tanh()
        return (1 - z) * n + z * h, None
    pre = a + c
    return (pre.tanh() if mode == "RNN_TANH" else pre.relu()), None


class _Part(NamedTuple):
    """One layer and direction of a replay: the inputs of ``W_ih`` (``x``) and ``W_hh``
    (``previous``, the ``h_{t-1}``), ``a = W_ih x + b_ih`` for all steps, every step's ``c_t``,
    and with projections the inputs (``unprojected``) and outputs (``hps``) of ``W_hr`` per
    step, in the recurrence's order (a Linear form pairs them step by step: the order of the
    steps plays no part)."""

    suffix: str
    x: Tensor
    previous: Tensor
    a: Tensor
    cs: list[Tensor]
    unprojected: list[Tensor]
    hps: list[Tensor]


class _Replay:
    """The recurrence of one call, replayed batch first from its recorded inputs, with the
    tensors each weight's Linear form needs: per layer and direction, the inputs ``x_t``, the
    previous states ``h_{t-1}``, ``a = W_ih x + b_ih`` for all steps and every step's ``c_t``."""

    def __init__(
        self, module: nn.RNNBase, x: Tensor, hx: Any, lengths: Tensor | None = None
    ) -> None:
        self.mode = module.mode
        directions = 2 if module.bidirectional else 1
        n, steps, size = x.shape[0], x.shape[1], module.hidden_size
        lstm = module.mode == "LSTM"
        projected = getattr(module, "proj_size", 0)  # (an LSTM's h_t = W_hr (o * tanh(c_t)))
        shape = (module.num_layers * directions, n, size)
        c0: Tensor | None = None
        if hx is None:
            h0 = x.new_zeros((*shape[:2], projected or size))
            c0 = x.new_zeros(shape) if lstm else None
        elif lstm:  # [L D, N, H], as the module takes them (in the weights' dtype: the
            # upcast of a call made under autocast does not reach into the tuple)
            h0, c0 = hx[0].detach().to(x.dtype), hx[1].detach().to(x.dtype)
        else:
            h0 = hx.detach().to(x.dtype)
        self.parts: list[_Part] = []
        layer_input, last_h, last_c = x.detach(), [], []
        # (a packed batch: each sample's steps; past them its state stays as it is)
        active = None
        if lengths is not None:
            steps_of = torch.arange(steps, device=x.device)
            active = (steps_of[:, None] < lengths.to(x.device)[None, :])[..., None]  # [T, N, 1]
        for layer in range(module.num_layers):
            outputs = []
            for direction in range(directions):
                suffix = f"_l{layer}" + ("_reverse" if direction else "")

                # (in the dtype of the call's tensors: float32 for float16 parameters)
                w_ih, w_hh = (_weight(module, f"weight_{k}{suffix}", x.dtype) for k in ("ih", "hh"))
                b_ih, b_hh = (
                    _weight(module, f"bias_{k}{suffix}", x.dtype) if module.bias else None
                    for k in ("ih", "hh")
                )
                w_hr = _weight(module, f"weight_hr{suffix}", x.dtype) if projected else None
                a = F.linear(layer_input, w_ih, b_ih)  # every step at once
                if not a.requires_grad:  # (first layer: a leaf, whose gradient is da)
                    a.requires_grad_()
                # (one node that stacks the steps' gradients in the backward: a[:, t] at each
                # step made a zero [N, T, G H] per step there, T^2 in all: 4.2 s of a 4.4 s step
                # of an LSTM on 256 steps per task)
                a_steps = a.unbind(1)
                index = layer * directions + direction
                h, state = h0[index], (None if c0 is None else c0[index])
                hs: list[Tensor] = [h] * steps
                previous: list[Tensor] = [h] * steps
                cs: list[Tensor] = [h] * steps
                unprojected: list[Tensor] = []  # o * tanh(c_t), W_hr's inputs
                hps: list[Tensor] = []  # W_hr's outputs
                for t in range(steps - 1, -1, -1) if direction else range(steps):
                    previous[t] = h
                    cs[t] = F.linear(h, w_hh, b_hh)
                    if not cs[t].requires_grad:  # (first step: from the constant h_0)
                        cs[t].requires_grad_()
                    new_h, new_state = cell_step(module.mode, a_steps[t], cs[t], h, state)
                    if w_hr is not None:
                        unprojected.append(new_h)
                        new_h = F.linear(new_h, w_hr)
                        hps.append(new_h)
                    if active is None:
                        h, state = new_h, new_state
                    else:
                        h = torch.where(active[t], new_h, h)
                        if state is not None and new_state is not None:
                            state = torch.where(active[t], new_state, state)
                    hs[t] = h
                outputs.append(torch.stack(hs, 1))
                last_h.append(h)
                if state is not None:
                    last_c.append(state)
                self.parts.append(
                    _Part(suffix, layer_input, torch.stack(previous, 1), a, cs, unprojected, hps)
                )
            layer_input = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        # the module's outputs, batch first: [N, T, D H], [N, L D, H] (and the cell states)
        self.outputs = [layer_input, torch.stack(last_h, 1)]
        if lstm:
            self.outputs.append(torch.stack(last_c, 1))

    def row_grads(
        self, cotangents: list[Tensor | None], batched: bool
    ) -> list[tuple[Tensor, Tensor, Tensor | None]]:
        """``(da, dc, dh)`` per layer and direction, ``[*, N, T, G H]`` (``dh``: of the
        projections' outputs ``[*, N, T, P]``, or ``None``), from the rows' gradients of the
        outputs (``batched``: with a leading row dimension). Outside the GRU a cell reads
        ``a + c`` only, so ``dc = da``: only the GRU's ``c_t`` are differentiated."""
        pairs = [(o, c) for o, c in zip(self.outputs, cotangents, strict=True) if c is not None]
        own_c = self.mode == "GRU"
        groups = [(part.a, part.cs if own_c else [], part.hps) for part in self.parts]
        grads = torch.autograd.grad(
            [o for o, _ in pairs],
            [t for a, cs, hps in groups for t in (a, *cs, *hps)],
            [c for _, c in pairs],
            is_grads_batched=batched,
            allow_unused=True,
        )
        reference = next(c for c in cotangents if c is not None)
        lead = reference.shape[:1] if batched else ()
        out, cursor = [], 0
        for a, cs, hps in groups:
            targets = (a, *cs, *hps)
            group = [
                g if g is not None else t.new_zeros(*lead, *t.shape)
                for g, t in zip(grads[cursor : cursor + len(targets)], targets, strict=True)
            ]
            cursor += len(targets)
            da, dcs, dhs = group[0], group[1 : 1 + len(cs)], group[1 + len(cs) :]
            out.append(
                (
                    da,
                    torch.stack(dcs, -2) if own_c else da,
                    torch.stack(dhs, -2) if dhs else None,
                )
            )
        return out


def _input(call: Call) -> Any:
    """The recorded input: a tensor or a packed sequence (anything else is refused in
    ``validate``)."""
    return call.args[0] if call.args else call.kwargs.get("input")


def _unbatched(call: Call) -> bool:
    x = _input(call)
    return isinstance(x, Tensor) and x.dim() != 3


def _replay_index(call: Call, position: int) -> int:
    """The replay's output (0: the outputs, 1: ``h_n``, 2: ``c_n``) of the module's output leaf
    ``position``: a packed output is four leaves (data, batch sizes and the two orders)."""
    return (
        position if position == 0 or not isinstance(_input(call), PackedSequence) else position - 3
    )


def _padded(grad: Tensor, packed: PackedSequence, lead: int) -> Tensor:
    """The gradient ``[*lead, total, F]`` of a packed output's data, laid out as the padded
    batch ``[*lead, N, T, F]`` (batch first, in the samples' order; zeros at padded steps)."""
    data = grad.movedim(0, 1) if lead else grad
    fields = PackedSequence(
        data, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices
    )
    padded = pad_packed_sequence(fields, batch_first=True)[0]
    return padded.movedim(2, 0) if lead else padded


def _grouped(
    keys: list[str], module: nn.RNNBase | nn.RNNCellBase, params: dict[str, Tensor]
) -> list[tuple[list[str], tuple[str, str]]]:
    """The slots (``ih_l0``, ``hh_l0_reverse``, ...) whose Linear parts are joined, with the
    names of the weight and bias they give gradients to.

    Untied, each slot is one part (its weight and its bias). A tensor filling several slots
    (``weight_hh_l0_reverse = weight_hh_l0``) is one parameter whose per-row gradient is the
    sum of those slots': its slots are joined along the time positions, the weights and the
    biases grouped apart (``params`` names each tensor once).
    """
    name_of = {id(t): name for name, t in params.items()}
    weights = [getattr(module, f"weight_{k}") for k in keys]
    biases = [getattr(module, f"bias_{k}", None) if module.bias else None for k in keys]
    tied = len({id(w) for w in weights}) < len(keys) or (
        module.bias and len({id(b) for b in biases}) < len(keys)
    )
    if not tied:
        return [([k], (f"weight_{k}", f"bias_{k}")) for k in keys]
    groups: dict[tuple[str, str], list[str]] = {}
    for key, weight, bias in zip(keys, weights, biases, strict=True):
        groups.setdefault((name_of.get(id(weight), ""), ""), []).append(key)
        if bias is not None:
            groups.setdefault(("", name_of.get(id(bias), "")), []).append(key)
    return [(slots, names) for names, slots in groups.items() if any(names)]


def slots_contribution(
    module: nn.RNNBase | nn.RNNCellBase,
    params: dict[str, Tensor],
    terms: list[dict[str, tuple[Tensor, Tensor]]],
    rows: Rows,
) -> JoinedLinear:
    """The Linear forms of a recurrent module's weight slots, from each call's ``terms`` (per
    slot: its inputs and their rows' output gradients), joined along the calls' positions."""
    inputs: dict[str, list[Tensor]] = {}
    grads: dict[str, list[Tensor]] = {}
    for call_terms in terms:
        for slot, (u, d) in call_terms.items():
            inputs.setdefault(slot, []).append(u)
            grads.setdefault(slot, []).append(d)
    parts: list[tuple[set[str], UnfoldedContribution]] = []
    for slots, names in _grouped(list(inputs), module, params):
        weight = getattr(module, f"weight_{slots[0]}")
        # (a bias alone reads no input: one column keeps the positions of slots whose inputs
        # differ in width)
        us = [u if names[0] else u[..., :1] for key in slots for u in inputs[key]]
        ds = [d for key in slots for d in grads[key]]
        part = linear_part(us, ds, rows, weight, names, params)
        if part[0]:
            parts.append(part)
    return JoinedLinear(parts)


class RecurrentRule(Rule):
    """``nn.RNN``, ``nn.LSTM``, ``nn.GRU``: every weight as a Linear layer over the time steps
    (see the module docstring)."""

    def delegates(self) -> tuple[str, ...]:
        # the order of the initial states, and the weights the fused kernel reads
        return ("permute_hidden", "_update_flat_weights")

    def parameter_names(self, module: nn.Module) -> frozenset[str]:
        assert isinstance(module, nn.RNNBase)
        return frozenset(module._flat_weights_names)

    def replays(self) -> bool:
        return True

    def settings(self, module: nn.Module) -> Hashable:
        return attribute_settings(module, _SETTINGS)

    def output_batch_dim(self, module: nn.Module, call: Call, position: int) -> int | None:
        assert isinstance(module, nn.RNNBase)
        if position == 0:  # the outputs: packed (no batch dimension), [N, T, ...] or [T, N, ...]
            packed = isinstance(_input(call), PackedSequence)
            return None if packed else (0 if module.batch_first else 1)
        return 1  # h_n, c_n: [L D, N, H]

    def output_samples(self, module: nn.Module, call: Call, position: int) -> Tensor | None:
        packed = _input(call)
        if position != 0 or not isinstance(packed, PackedSequence):
            return None
        # (the packed data's rows: at each step, the first batch_sizes[t] sorted samples)
        order = packed.sorted_indices
        if order is None:
            order = torch.arange(int(packed.batch_sizes[0]), device=packed.data.device)
        return torch.cat([order[: int(size)] for size in packed.batch_sizes])

    def validate(self, module: nn.Module, call: Call, rows: Rows) -> None:
        x = _input(call)
        if not isinstance(x, (Tensor, PackedSequence)):
            raise ValueError(
                f"{type(module).__name__} received a {type(x).__name__}: the engine needs a "
                "tensor or a PackedSequence."
            )
        if not rows.per_task and isinstance(x, Tensor) and x.dim() != 3:
            raise unbatched_refusal(module, x)

    def prepare(
        self, module: nn.Module, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> Contribution:
        assert isinstance(module, nn.RNNBase)
        if not covered(module):
            if rows.per_task:
                return _GENERIC.prepare(module, params, calls, rows)
            raise uncovered_refusal(type(module).__name__, module)  # (Engine refuses it first)
        dropped = module.dropout > 0 and module.num_layers > 1
        if dropped and any(call.trained(module) for call in calls):
            raise ValueError(
                f"{type(module).__name__}(dropout={module.dropout}) drops values between its "
                "layers at random in training mode, which the engine cannot replay to compute "
                "the Gramian. Build it with dropout=0.0, or call .eval() on it."
            )
        return slots_contribution(
            module, params, [self._terms(module, call, rows) for call in calls], rows
        )

    def _terms(
        self, module: nn.RNNBase, call: Call, rows: Rows
    ) -> dict[str, tuple[Tensor, Tensor]]:
        """Per weight slot (``ih_l{k}[_reverse]``, ``hh_...``, ``hr_...``): its Linear form's
        inputs (batch first) and their rows' output gradients."""
        x = _input(call)
        hx = call.args[1] if len(call.args) > 1 else call.kwargs.get("hx")
        packed = x if isinstance(x, PackedSequence) else None
        lengths: Tensor | None = None
        unbatched = _unbatched(call)  # (per task: one sequence, replayed as a batch of one)
        if packed is not None:  # replayed padded, batch first (in the weights' working dtype:
            # the engine's upcast, of a call made under autocast or of float16 weights, does not
            # reach into the packed sequence; float16 replayed, the Gramian overflowed)
            x, lengths = pad_packed_sequence(packed, batch_first=True)
            x = x.to(working_dtype(module.all_weights[0][0].dtype))
        elif unbatched:  # [T, D] -> [1, T, D]; the states [L D, H] -> [L D, 1, H]
            x = x.unsqueeze(0)
            if hx is not None:
                hx = tuple(h.unsqueeze(1) for h in hx) if isinstance(hx, tuple) else hx.unsqueeze(1)
        elif not module.batch_first:
            x = x.transpose(0, 1)
        with torch.enable_grad():  # (the engine prepares under no_grad)
            replay = _Replay(module, x, hx, lengths)
        cotangents: list[Tensor | None] = [None] * len(replay.outputs)
        for position, grad in zip(call.output_positions, call.grads, strict=True):
            cotangents[_replay_index(call, position)] = grad
        batched = rows.per_task or rows.index is not None
        first_batched = module.batch_first or packed is not None
        if packed is not None and cotangents[0] is not None:  # -> [*, N, T, F]
            cotangents[0] = _padded(cotangents[0], packed, 1 if batched else 0)
        if unbatched:  # [R, T, F] -> [R, 1, T, F]; [R, L D, H] -> [R, 1, L D, H]
            cotangents = [None if c is None else c.unsqueeze(1) for c in cotangents]
        elif rows.per_task:  # [R, *output shape] -> [R, N, ...]
            cotangents = [
                c if c is None or (j == 0 and first_batched) else c.transpose(1, 2)
                for j, c in enumerate(cotangents)
            ]
        elif batched:  # [k N, ...] -> [k, N, ...] (row c N + i: sample i)
            cotangents = [
                c
                if c is None or (j == 0 and packed is not None)
                else c.reshape(-1, rows.num_samples, *c.shape[1:])
                for j, c in enumerate(cotangents)
            ]
        with torch.enable_grad():
            row_grads = replay.row_grads(cotangents, batched)
        terms = {}
        for part, (da, dc, dh) in zip(replay.parts, row_grads, strict=True):
            terms["ih" + part.suffix] = (part.x.detach(), da)
            terms["hh" + part.suffix] = (part.previous.detach(), dc)
            if dh is not None:
                terms["hr" + part.suffix] = (torch.stack(part.unprojected, 1).detach(), dh)
        return terms


for _type in _TYPES:
    register_rule(_type, RecurrentRule())
