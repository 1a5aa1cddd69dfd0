"""Any other module with parameters: per-row gradients through ``torch.func``.

Per-sample mode re-runs the module on each sample (``functional_call`` on a batch of one) and
pulls every row's output gradient back with ``vjp``, all under ``vmap``. Per-task mode runs the
module once on the stored inputs and ``vmap``s the ``vjp`` over the rows. The per-row gradients
are materialised (``R x P_module``), so this rule suits small modules (attention projections,
custom layers); register a closed form for big ones.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from jacflow.autogram._precision import replay_autocast
from jacflow.autogram._rules import (
    Call,
    Contribution,
    MaterializedContribution,
    Rows,
    Rule,
    add_grads,
    quiet_vmap_fallback,
)


def _selected_outputs(out: Any, positions: list[int]) -> tuple[Tensor, ...]:
    leaves, _ = tree_flatten(out)
    return tuple(leaves[i] for i in positions)


def _with_buffers(module: nn.Module, params: dict[str, Tensor]) -> dict[str, Tensor]:
    """``params`` and copies of the module's buffers, made inside the transforms: a re-run in
    training mode updates the copies (BatchNorm's running statistics), which torch.func allows,
    and leaves the module's as the forward left them."""
    return {**{name: b.clone() for name, b in module.named_buffers()}, **params}


def _per_task_grads(
    module: nn.Module, params: dict[str, Tensor], call: Call, cots: tuple[Tensor, ...]
) -> dict[str, Tensor]:
    def forward(p: dict[str, Tensor]) -> tuple[Tensor, ...]:
        out = functional_call(module, _with_buffers(module, p), call.args, call.kwargs)
        return _selected_outputs(out, call.output_positions)

    pullback = vjp(forward, params)[1]
    grads: dict[str, Tensor] = vmap(pullback)(cots)[0]
    return grads


def _per_sample_grads(
    module: nn.Module,
    params: dict[str, Tensor],
    call: Call,
    cots: tuple[Tensor, ...],
    rows: Rows,
) -> dict[str, Tensor]:
    leaves, spec = tree_flatten((call.args, call.kwargs))
    batched = [
        isinstance(leaf, Tensor) and leaf.ndim >= 1 and leaf.shape[0] == rows.num_samples
        for leaf in leaves
    ]
    row_leaves = [rows.gather(leaf) for leaf, b in zip(leaves, batched, strict=True) if b]

    def per_row(row_inputs: list[Tensor], cot: tuple[Tensor, ...]) -> dict[str, Tensor]:
        it = iter(row_inputs)
        full = [next(it).unsqueeze(0) if b else leaf for leaf, b in zip(leaves, batched)]
        args, kwargs = tree_unflatten(full, spec)

        def forward(p: dict[str, Tensor]) -> tuple[Tensor, ...]:
            out = functional_call(module, _with_buffers(module, p), tuple(args), dict(kwargs))
            return tuple(o.squeeze(0) for o in _selected_outputs(out, call.output_positions))

        pullback = vjp(forward, params)[1]
        result: dict[str, Tensor] = pullback(cot)[0]
        return result

    grads: dict[str, Tensor] = vmap(per_row)(row_leaves, cots)
    return grads


def _rng_states(device: torch.device) -> list[Tensor]:
    """The states of the generators that random operations on ``device`` draw from."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _replay_per_task(
    module: nn.Module, params: dict[str, Tensor], call: Call, cots: tuple[Tensor, ...]
) -> dict[str, Tensor]:
    """:func:`_per_task_grads`, refused when the re-run drew random numbers (dropout): it then
    drew other ones than the forward did. (Per sample, ``vmap`` raises on them itself.)"""
    device = cots[0].device
    before = _rng_states(device)
    grads = _per_task_grads(module, params, call, cots)
    if any(not torch.equal(a, b) for a, b in zip(before, _rng_states(device), strict=True)):
        raise RuntimeError("the re-run of the module drew random numbers")
    return grads


def _native_rnn(module: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """torch's fused recurrent kernels (cuDNN, MIOpen) have no batching rule, so the re-run of
    a module holding a recurrent layer uses torch's native kernels: the same function."""
    if any(isinstance(sub, nn.RNNBase) for sub in module.modules()):
        return torch.backends.cudnn.flags(enabled=False)
    return contextlib.nullcontext()


class FallbackRule(Rule):
    """Generic rule: the module and all its children's parameters, via ``torch.func``."""

    def covers_children(self) -> bool:
        return True

    def replays(self) -> bool:
        return True

    def prepare(
        self, module: nn.Module, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> Contribution:
        calls[-1].check_weights_unchanged(module)  # (the re-run reads the module as it is now)
        detached = {name: p.detach() for name, p in params.items()}
        total: dict[str, Tensor] = {}
        for call in calls:
            cots = tuple(call.grad(j) for j in range(len(call.grads)))
            try:
                with (
                    torch.enable_grad(),
                    quiet_vmap_fallback(),
                    replay_autocast(call),
                    call.forward_modes(module),
                    _native_rnn(module),
                ):
                    if rows.per_task:
                        new = _replay_per_task(module, detached, call, cots)
                    else:
                        new = _per_sample_grads(module, detached, call, cots, rows)
            except RuntimeError as error:
                if "random" not in str(error):
                    recurrent = any(isinstance(sub, nn.RNNBase) for sub in module.modules())
                    if recurrent and "storage" in str(error):  # (torch's packed kernels)
                        raise RuntimeError(
                            f"{type(module).__name__} has no closed-form Gramian rule and holds "
                            "a recurrent layer, so the engine re-runs it with torch.func, which "
                            f"failed: {error}. torch.func cannot run torch's recurrent kernels "
                            "on packed sequences. Pad the sequences, or let the closed form "
                            "cover the recurrent layer: a plain nn.RNN/LSTM/GRU, with no "
                            "parameters of its own around it."
                        ) from error
                    raise
                raise RuntimeError(
                    f"{type(module).__name__} has no closed-form Gramian rule, so the engine "
                    "re-runs it with torch.func, which cannot replay its random operations "
                    "(dropout). Set its dropout to 0, put the randomness in a separate "
                    "parameter-free module (e.g. nn.Dropout), or call .eval()."
                ) from error
            add_grads(total, new)
        return MaterializedContribution(total)
