"""``nn.MultiheadAttention`` in closed form: two Linear layers with the attention between them.

With ``q, k, v`` the projected inputs split into heads, ``P = softmax(q k^T / sqrt(d_h) + M)``
(``M`` the additive mask) and ``o = P v`` (heads merged), the module returns ``o W_o^T + b_o``
(and ``P``, averaged over the heads or not, when asked for the weights). From every row's
gradient ``g`` of the output (and ``g_P`` of the weights), per head:

    d_o = g W_o      dv = P^T d_o      dP = d_o v^T + g_P      dS = P * (dP - rowsum(dP * P))
    dq = dS k / sqrt(d_h)      dk = dS^T q / sqrt(d_h)

so the in-projection is a Linear layer with input ``x`` and output gradients ``[dq, dk, dv]``
and the out-projection one with input ``o`` and output gradients ``g``; the Linear rule's ghost
and materialised forms, and its book-keeping update, serve both. Cross-attention joins the
query and key/value inputs along the positions, each with its block of the gradients (zeros in
the others' blocks), which sums to the same weight gradient. The generic rule instead re-ran
the whole module per sample under ``vmap`` and materialised its per-sample gradients.

Covered: packed projection weights (``kdim == vdim == embed_dim``), self- and
cross-attention, key-padding and attention masks (boolean or additive), ``is_causal``, the
returned attention weights, batched inputs. Anything else (``bias_k``/``bias_v``,
``add_zero_attn``, separate projection weights, a parametrised ``out_proj``, autocast, unbatched
inputs per task, a subclass with its own ``forward``) goes to the generic rule (per sample, with
a 3-D ``attn_mask`` split by sample: :func:`_with_sample_masks`; per sample with
``batch_first=False`` it is refused, naming what the closed form does not cover, since the
generic rule splits dimension 0). Dropout in
training mode is refused (its random mask cannot be replayed), and so are unbatched inputs per
sample (``batch_dim=0``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jacflow.autogram._fallback import FallbackRule
from jacflow.autogram._linear import JoinedLinear, linear_part
from jacflow.autogram._precision import working_dtype
from jacflow.autogram._rules import (
    Call,
    Contribution,
    Rows,
    Rule,
    attribute_settings,
    register_rule,
    unbatched_refusal,
)

# what the closed form (and the generic rule, for the configurations it takes) reads of the
# module besides its parameters
_SETTINGS = (
    "embed_dim",
    "kdim",
    "vdim",
    "num_heads",
    "batch_first",
    "dropout",
    "_qkv_same_embed_dim",
    "add_zero_attn",
)
_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)
_GENERIC = FallbackRule()


def _arguments(call: Call) -> dict[str, Any]:
    """The call's arguments by name, defaults included."""
    bound = _SIGNATURE.bind(None, *call.args, **call.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _with_sample_masks(call: Call, heads: int, num_samples: int) -> Call:
    """``call`` with its ``attn_mask`` as ``[B, heads, T, S]``, which the generic rule splits
    by sample as it splits every argument whose first size is the batch size; one sample's is
    flattened back by :func:`_flattened_mask`. A 3-D mask (``[B * heads, T, S]``, each
    sample's heads in a block) given whole, the re-run of one sample read every sample's masks
    and torch refused them; a 2-D one (``[T, S]``, shared by the samples) with ``T = B`` was
    split by its rows."""
    bound = _SIGNATURE.bind(None, *call.args, **call.kwargs)
    mask = bound.arguments.get("attn_mask")
    if not isinstance(mask, Tensor):
        return call
    if mask.dim() == 2 and mask.shape[0] == num_samples:
        bound.arguments["attn_mask"] = mask.expand(num_samples, heads, *mask.shape)
    elif mask.dim() == 3 and heads > 1 and mask.shape[0] == num_samples * heads:
        bound.arguments["attn_mask"] = mask.unflatten(0, (num_samples, heads))
    else:
        return call
    return dataclasses.replace(call, args=bound.args[1:], kwargs=bound.kwargs)


def _flattened_mask(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A forward pre-hook for the generic rule's re-run: a 4-D ``attn_mask`` (from
    :func:`_with_sample_masks`) as the ``[N * heads, T, S]`` one that torch takes."""
    bound = _SIGNATURE.bind(None, *args, **kwargs)
    mask = bound.arguments.get("attn_mask")
    if not isinstance(mask, Tensor) or mask.dim() != 4:
        return None
    bound.arguments["attn_mask"] = mask.flatten(0, 1)
    return bound.args[1:], bound.kwargs


_PROJECTIONS = frozenset({"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"})


def _uncovered(
    module: nn.MultiheadAttention,
    params: dict[str, Tensor],
    calls: list[Call],
    arguments: list[dict[str, Any]],
) -> str | None:
    """What in the module or a call (with its ``arguments``) the closed form does not
    reproduce exactly; ``None`` where it does them all."""
    if type(module).forward is not nn.MultiheadAttention.forward:
        return "a forward of its own"
    if not module._qkv_same_embed_dim:
        return "kdim or vdim other than embed_dim"
    if module.bias_k is not None or module.add_zero_attn:
        return "add_bias_kv" if module.bias_k is not None else "add_zero_attn"
    if not params.keys() <= _PROJECTIONS:  # e.g. a parametrised out_proj's parameters
        return "parameters other than its projections' (a parametrised out_proj)"
    for call, args in zip(calls, arguments, strict=True):
        if call.autocast is not None:
            return "a call under autocast"
        if not set(call.output_positions) <= {0, 1} or any(
            args[name].dim() != 3 for name in ("query", "key", "value")
        ):
            return "a call on unbatched inputs"
    return None


def _heads(t: Tensor, heads: int) -> Tensor:
    """``[..., T, E]`` -> ``[..., H, T, E / H]``."""
    return t.unflatten(-1, (heads, -1)).transpose(-3, -2)


def _merged(t: Tensor) -> Tensor:
    """``[..., H, T, d]`` -> ``[..., T, H d]``."""
    return t.transpose(-3, -2).flatten(-2)


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean mask (``True``: not attended) as ``-inf``/``0``; a float mask as it is."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            mask, float("-inf")
        )
    return mask.to(dtype)


def attention_mask(args: dict[str, Any], scores: Tensor) -> Tensor | None:
    """The additive mask the forward applied to ``scores`` (``[N, H, T, S]``), broadcastable
    to them.

    As ``F.multi_head_attention_forward``: ``is_causal`` without key padding mask or weights
    means the causal mask (whatever ``attn_mask`` holds), else ``attn_mask`` plus the key
    padding mask.

    Example:
        >>> import torch
        >>> from jacflow.autogram._attention import attention_mask
        >>> scores = torch.zeros(1, 1, 2, 2)  # [N, H, T, S]
        >>> args = {"key_padding_mask": torch.tensor([[False, True]]), "attn_mask": None,
        ...         "is_causal": False, "need_weights": True}
        >>> attention_mask(args, scores)
        tensor([[[[0., -inf]]]])
        >>> args.update(key_padding_mask=None, is_causal=True, need_weights=False)
        >>> attention_mask(args, scores)
        tensor([[0., -inf],
                [0., 0.]])
    """
    n, heads, t, s = scores.shape
    padding = _additive(args["key_padding_mask"], scores.dtype)
    if args["is_causal"] and padding is None and not args["need_weights"]:
        allowed = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril()
        return _additive(~allowed, scores.dtype)
    mask = _additive(args["attn_mask"], scores.dtype)
    if mask is not None and mask.dim() == 3:  # [N H, T, S]
        mask = mask.view(n, heads, t, s)
    if padding is not None:  # [N, S]
        padding = padding[:, None, None, :]
        mask = padding if mask is None else mask + padding
    return mask


def _batch_first(t: Tensor, module: nn.MultiheadAttention) -> Tensor:
    return t if module.batch_first else t.transpose(0, 1)


def _shared_left_product(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for ``a`` (``[N, H, S, T]``) shared by every row of ``b`` (``[R, N, H, T, d]``),
    as ``[R, N, H, S, d]``: the rows side by side in one product per head, where the
    broadcasting ``matmul`` copies ``a`` once per row (per task, ``a = P^T``: ``R`` copies of
    the attention weights, the replay's largest tensors)."""
    r, d = b.shape[0], b.shape[-1]
    side_by_side = b.permute(1, 2, 3, 0, 4).flatten(-2)  # [N, H, T, R d]
    return (a @ side_by_side).unflatten(-1, (r, d)).permute(3, 0, 1, 2, 4)


def _projection_terms(
    module: nn.MultiheadAttention, call: Call, args: dict[str, Any], rows: Rows
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x, d_in, o, g)`` of one call (``args``: its arguments by name), batch first: the
    in-projection's input and its rows' output gradients ``[dq, dk, dv]`` (positions of the
    query, then of the other inputs), the out-projection's input ``o`` and its rows' output
    gradients ``g``, in the :func:`working_dtype` of the parameters (float32 for float16
    ones: the engine's upcast of a layer's tensors does not reach this rule, which covers
    ``out_proj``'s parameters as a child's, and the Gramian's products overflowed float16 from
    output gradients of about 300)."""
    heads = module.num_heads
    assert module.in_proj_weight is not None
    dtype = working_dtype(module.in_proj_weight.dtype)

    def work(t: Tensor) -> Tensor:
        return t.to(dtype)

    self_attention = args["query"] is args["key"] and args["key"] is args["value"]
    query, key, value = (work(_batch_first(args[n], module)) for n in ("query", "key", "value"))
    w_in = work(module.in_proj_weight.detach())
    b_in = None if module.in_proj_bias is None else work(module.in_proj_bias.detach())
    if self_attention:  # one product for the three projections
        projected = F.linear(query, w_in, b_in).chunk(3, -1)
    else:
        b_chunks = (None, None, None) if b_in is None else b_in.chunk(3)
        inputs = (query, key, value)
        projected = tuple(
            F.linear(x, w, b) for x, w, b in zip(inputs, w_in.chunk(3), b_chunks, strict=True)
        )
    q, k, v = (_heads(t, heads) for t in projected)
    scale = 1 / math.sqrt(q.shape[-1])
    scores = (q @ k.mT) * scale
    mask = attention_mask(args, scores)
    if mask is not None:
        scores = scores + mask
    p = scores.softmax(-1)  # [N, H, T, S]
    if mask is not None and not args["need_weights"]:
        # the forward's scaled_dot_product_attention gives a query that sees no key 0, not NaN
        p = p.masked_fill(scores.amax(-1, keepdim=True) == float("-inf"), 0.0)
    o = _merged(p @ v)

    grads = dict(zip(call.output_positions, call.grads, strict=True))
    g = grads[0]
    if g is None:
        raise RuntimeError("internal: the output of a reached attention call has no gradient")
    g = work(g)
    if rows.per_task and not module.batch_first:  # [R, T, N, E] -> [R, N, T, E]
        g = g.transpose(1, 2)
    # rows' view of the per-sample tensors: per sample, gathered; per task, broadcast
    gather: Callable[[Tensor], Tensor] = (lambda t: t) if rows.per_task else rows.gather
    p_rows, q_rows, k_rows, v_rows = (gather(t) for t in (p, q, k, v))
    d_o = _heads(g @ work(module.out_proj.weight.detach()), heads)
    dv = _shared_left_product(p.mT, d_o) if rows.per_task else p_rows.mT @ d_o
    dp = d_o @ v_rows.mT
    g_weights = grads.get(1)
    if g_weights is not None:  # the returned weights: P, or its mean over the heads
        g_weights = work(g_weights)
        dp = dp + (g_weights.unsqueeze(-3) / heads if args["average_attn_weights"] else g_weights)
    # dS = P * (dP - rowsum(dP * P)) as dP * P - P * rowsum(dP * P), in place in dP (our own
    # [R, H, T, S] tensor, the largest of the step): three passes over it instead of four, and
    # no temporaries of its size
    ds = dp.mul_(p_rows)
    ds.addcmul_(p_rows, ds.sum(-1, keepdim=True), value=-1)
    dq = _merged(ds @ k_rows) * scale
    dk = _merged(ds.mT @ q_rows) * scale
    dv = _merged(dv)

    if self_attention:
        return query, torch.cat([dq, dk, dv], -1), o, g
    zeros_q, zeros_kv = torch.zeros_like(dq), torch.zeros_like(dk)
    q_part = torch.cat([dq, zeros_q, zeros_q], -1)
    if args["key"] is args["value"]:
        x = torch.cat([query, key], -2)
        d_in = torch.cat([q_part, torch.cat([zeros_kv, dk, dv], -1)], -2)
    else:
        x = torch.cat([query, key, value], -2)
        k_part = torch.cat([zeros_kv, dk, zeros_kv], -1)
        v_part = torch.cat([zeros_kv, zeros_kv, dv], -1)
        d_in = torch.cat([q_part, k_part, v_part], -2)
    return x, d_in, o, g


class AttentionRule(Rule):
    """``nn.MultiheadAttention``: the projections' parameters in closed form (see the module
    docstring); configurations outside it use the generic rule."""

    def replays(self) -> bool:
        return True

    def covers_children(self) -> bool:
        return True  # out_proj's parameters: the module uses them without calling out_proj

    def settings(self, module: nn.Module) -> Hashable:
        return attribute_settings(module, _SETTINGS)

    def validate(self, module: nn.Module, call: Call, rows: Rows) -> None:
        assert isinstance(module, nn.MultiheadAttention)
        if rows.per_task:
            return
        query = _arguments(call)["query"]
        if isinstance(query, Tensor) and query.dim() != 3:
            raise unbatched_refusal(module, query)

    def output_batch_dim(self, module: nn.Module, call: Call, position: int) -> int | None:
        assert isinstance(module, nn.MultiheadAttention)
        # (the output [T, N, E] sequence first; the weights [N, (H,) T, S] batch first)
        return 1 if position == 0 and not module.batch_first else 0

    def prepare(
        self, module: nn.Module, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> Contribution:
        assert isinstance(module, nn.MultiheadAttention)
        if module.dropout > 0 and any(call.trained(module) for call in calls):
            raise ValueError(
                f"nn.MultiheadAttention(dropout={module.dropout}) drops attention weights at "
                "random in training mode, which the engine cannot replay to compute the "
                "Gramian. Build it with dropout=0.0 (dropout elsewhere in the model is fine), "
                "or call .eval() on it."
            )
        arguments = [_arguments(call) for call in calls]
        uncovered = _uncovered(module, params, calls, arguments)
        if uncovered is not None:
            if rows.per_task:
                return _GENERIC.prepare(module, params, calls, rows)
            if not module.batch_first:  # (the generic rule splits the inputs' dimension 0)
                raise ValueError(
                    "nn.MultiheadAttention(batch_first=False) takes the batch on dimension 1, "
                    "which the per-sample engine (batch_dim set) reads in closed form only, "
                    f"and the closed form does not cover {uncovered}: the generic rule, "
                    "which it takes then, reads the batch on dimension 0. Build it with "
                    "batch_first=True, or use batch_dim=None."
                )
            split = [_with_sample_masks(call, module.num_heads, rows.num_samples) for call in calls]
            handle = module.register_forward_pre_hook(
                _flattened_mask, with_kwargs=True, prepend=True
            )
            try:
                return _GENERIC.prepare(module, params, split, rows)
            finally:
                handle.remove()
        terms = [
            _projection_terms(module, call, args, rows)
            for call, args in zip(calls, arguments, strict=True)
        ]
        x, d_in, o, g = (list(t) for t in zip(*terms, strict=True))
        assert module.in_proj_weight is not None
        parts = [
            linear_part(
                x, d_in, rows, module.in_proj_weight, ("in_proj_weight", "in_proj_bias"), params
            ),
            linear_part(
                o, g, rows, module.out_proj.weight, ("out_proj.weight", "out_proj.bias"), params
            ),
        ]
        return JoinedLinear([part for part in parts if part[0]])


register_rule(nn.MultiheadAttention, AttentionRule())
