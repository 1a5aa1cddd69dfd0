"""nn.MultiheadAttention's closed form against the brute-force Jacobian, configuration by
configuration, and its hand-over to the generic rule."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from jacflow.aggregation import ConstantWeighting, MeanWeighting
from jacflow.autogram import Call, Engine, Rows, _attention
from tests.autogram._zoo import Built, Case
from tests.autogram.test_engine import assert_exact_step, assert_float32_gramian, check_case
from tests.autogram.test_linear import assert_change_refused, assert_exact_backward, row_losses

B, T, S, E, H = 3, 4, 5, 6, 2

Inputs = Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]


def _self(x: Tensor, memory: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return x, x, x


def _cross(x: Tensor, memory: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return x, memory, memory


def _three(x: Tensor, memory: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return x, memory, memory.flip(1)


def _narrow(x: Tensor, memory: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return x, memory[..., 1:], memory[..., 1:]


class _Attend(nn.Module):
    """Linear encoders of ``x`` (``[B, T, E]``) and ``memory`` (``[B, S, E]``), then one
    attention call; the loss per sample reads the output and, if ``use_weights``, the weights."""

    def __init__(
        self,
        inputs: Inputs,
        call: dict[str, Any],
        use_weights: bool = False,
        batch_first: bool = True,
        **options: Any,
    ) -> None:
        super().__init__()
        self.encode = nn.Linear(E, E)
        self.attn = nn.MultiheadAttention(E, H, batch_first=batch_first, **options)
        self.inputs, self.call, self.use_weights = inputs, call, use_weights

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        query, key, value = self.inputs(torch.tanh(self.encode(x)), memory)
        if not self.attn.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        out, weights = self.attn(query, key, value, **self.call)
        if not self.attn.batch_first:
            out = out.transpose(0, 1)
        loss = out.pow(2).sum(dim=(1, 2)) + out.sum(dim=(1, 2))
        if self.use_weights:
            assert weights is not None
            probe = torch.arange(weights[0].numel(), dtype=weights.dtype).reshape(weights[0].shape)
            loss = loss + (weights * probe).flatten(1).sum(1)
        return loss


def _masks(dtype: torch.dtype) -> dict[str, Tensor]:
    """Drawn on the CPU (its generator), then moved to the default device."""
    device = torch.get_default_device()
    with torch.device("cpu"):
        gen = torch.Generator().manual_seed(3)
        padding = torch.zeros(B, S, dtype=torch.bool)
        padding[0, -2:] = True
        padding[2, 0] = True
        masks = {
            "padding": padding,
            "padding_one_blind": padding | torch.tensor([True, False, False])[:, None],
            "padding_float": torch.zeros(B, S, dtype=dtype).masked_fill(padding, float("-inf")),
            "float2d": torch.randn(T, S, generator=gen, dtype=dtype),
            "bool3d": torch.rand(B * H, T, S, generator=gen) < 0.3,
            "float3d": torch.randn(B * H, T, S, generator=gen, dtype=dtype),
            "float3d_self": torch.randn(B * H, T, T, generator=gen, dtype=dtype),
            "causal": nn.Transformer.generate_square_subsequent_mask(T, dtype=dtype),
        }
    return {name: mask.to(device) for name, mask in masks.items()}


def _case(
    name: str,
    inputs: Inputs,
    call: Callable[[dict[str, Tensor]], dict[str, Any]],
    batch_dim: int | None = 0,
    use_weights: bool = False,
    batch_first: bool = True,
    **options: Any,
) -> Case:
    def build(dtype: torch.dtype) -> Built:
        torch.manual_seed(0)
        model = _Attend(inputs, call(_masks(dtype)), use_weights, batch_first, **options)
        model.to(dtype)
        x = torch.randn(B, T, E, dtype=dtype)
        memory = torch.randn(B, S if inputs is not _self else T, E, dtype=dtype)
        if batch_dim is None:
            return model, (model,), lambda: model(x, memory)[:2] * torch.tensor([1.0, -2.0])
        return model, (model,), lambda: model(x, memory)

    return Case(name, build, batch_dim)


def _kw(**kwargs: Any) -> Callable[[dict[str, Tensor]], dict[str, Any]]:
    return lambda masks: {k: masks[v] if isinstance(v, str) else v for k, v in kwargs.items()}


CASES = [
    _case("self", _self, _kw(need_weights=False)),
    _case("self_weights_unused", _self, _kw()),
    _case("self_weights_used", _self, _kw(), use_weights=True),
    _case("self_per_head_weights", _self, _kw(average_attn_weights=False), use_weights=True),
    _case("self_no_bias", _self, _kw(need_weights=False), bias=False),
    _case("cross_padding", _cross, _kw(key_padding_mask="padding", need_weights=False)),
    _case("cross_float_mask", _cross, _kw(attn_mask="float2d")),
    _case("three_inputs_bool3d", _three, _kw(attn_mask="bool3d", need_weights=False)),
    _case("causal", _self, _kw(attn_mask="causal", is_causal=True, need_weights=False)),
    _case(
        "causal_with_padding",
        _cross,
        _kw(
            attn_mask="float2d",
            is_causal=True,
            key_padding_mask="padding_float",
            need_weights=False,
        ),
    ),
    # a query that sees no key: 0 (scaled_dot_product_attention), not NaN
    _case(
        "cross_one_sample_blind",
        _cross,
        _kw(key_padding_mask="padding_one_blind", need_weights=False),
    ),
    _case(
        "tasks_one_sample_blind",
        _cross,
        _kw(key_padding_mask="padding_one_blind", need_weights=False),
        None,
    ),
    _case("tasks_self", _self, _kw(), batch_dim=None),
    _case(
        "tasks_causal_seq_first",
        _self,
        _kw(attn_mask="causal", is_causal=True, need_weights=False),
        None,
        batch_first=False,
    ),
    _case(
        "tasks_cross_seq_first", _cross, _kw(key_padding_mask="padding"), None, batch_first=False
    ),
    # per sample, sequence first ([T, B, E], nn.Transformer's default): it was refused
    _case(
        "causal_seq_first",
        _self,
        _kw(attn_mask="causal", is_causal=True, need_weights=False),
        batch_first=False,
    ),
    _case(
        "cross_seq_first_weights_used",
        _cross,
        _kw(key_padding_mask="padding", average_attn_weights=False),
        use_weights=True,
        batch_first=False,
    ),
    _case("tasks_weights_used", _self, _kw(average_attn_weights=False), None, use_weights=True),
    # outside the closed form: the generic rule, same checks
    _case("generic_bias_kv", _self, _kw(need_weights=False), add_bias_kv=True),
    _case("generic_zero_attn", _self, _kw(need_weights=False), add_zero_attn=True),
    _case("generic_kdim", _narrow, _kw(need_weights=False), kdim=E - 1, vdim=E - 1),
    # per-sample 3-D masks ([B * H, T, S]) there: the re-run of a sample was given every
    # sample's, and torch refused them ("should be (2, 3, 3)")
    _case("generic_bias_kv_3d", _three, _kw(attn_mask="bool3d"), add_bias_kv=True),
    _case(
        "generic_zero_attn_3d",
        _cross,
        _kw(attn_mask="float3d"),
        use_weights=True,
        add_zero_attn=True,
    ),
    _case("generic_kdim_3d", _narrow, _kw(attn_mask="float3d"), kdim=E - 1, vdim=E - 1),
    _case("tasks_generic_bias_kv_3d", _self, _kw(attn_mask="float3d_self"), None, add_bias_kv=True),
]
GENERIC = {"generic_bias_kv", "generic_zero_attn", "generic_kdim"}
GENERIC |= {"generic_bias_kv_3d", "generic_zero_attn_3d", "generic_kdim_3d"}
GENERIC |= {"tasks_generic_bias_kv_3d"}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gramian_and_update_float64(
    case: Case, on_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    generic_calls = []
    original = _attention._GENERIC.prepare
    monkeypatch.setattr(
        _attention._GENERIC, "prepare", lambda *a: generic_calls.append(1) or original(*a)
    )
    check_case(case, torch.float64)
    assert bool(generic_calls) == (case.name in GENERIC)


@pytest.mark.parametrize("name", ["self_weights_used", "cross_padding", "tasks_self"])
def test_gramian_and_update_float32(name: str, on_device: str) -> None:
    check_case(next(c for c in CASES if c.name == name), torch.float32)


def test_called_twice_and_rows_per_output() -> None:
    """Two calls of one module (their projections' positions joined) and ``[B, k]`` losses
    (several rows per sample)."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(E, H, batch_first=True)

        def forward(self, x: Tensor) -> Tensor:
            h = self.attn(x, x, x, need_weights=False)[0]
            h = self.attn(torch.tanh(h), x, x, need_weights=False)[0]
            return torch.stack([h.pow(2).sum((1, 2)), h.sum((1, 2))], dim=1)

    def build(dtype: torch.dtype) -> Built:
        torch.manual_seed(1)
        model = Twice().to(dtype)
        x = torch.randn(B, T, E, dtype=dtype)
        return model, (model,), lambda: model(x)

    check_case(Case("twice_Bk", build), torch.float64)


def test_frozen_projections() -> None:
    """A frozen in-projection still makes the module a unit (out_proj's parameters are used
    without calling out_proj), and a frozen out-projection is left out."""
    case = _case("self", _self, _kw(need_weights=False))
    for frozen, whole in itertools.product(("in_proj_weight", "out_proj.weight"), (False, True)):

        def build(dtype: torch.dtype, frozen: str = frozen, whole: bool = whole) -> Built:
            model, _, forward = case.build(dtype)
            model.attn.get_parameter(frozen).requires_grad_(False)
            if frozen == "in_proj_weight":
                model.attn.in_proj_bias.requires_grad_(False)
            return model, (model if whole else model.attn,), forward

        check_case(Case(f"frozen_{frozen}", build), torch.float64)


@pytest.mark.parametrize("positions", [B, T])
@pytest.mark.parametrize("generic", [False, True])
def test_sequence_first_in_per_sample_mode(positions: int, generic: bool) -> None:
    """batch_first=False batches on dimension 1, which the rule names as the output's batch
    dimension: exact in closed form, also with as many positions as samples (it was refused).
    A configuration outside the closed form (``add_bias_kv``) takes the generic rule, which
    splits dimension 0: refused with its own message, whatever the number of positions."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(E, H, add_bias_kv=generic).double()  # batch_first=False
    x = torch.randn(positions, B, E, dtype=torch.float64)

    def forward() -> Tensor:
        return attn(x, x, x)[0].pow(2).sum(dim=(0, 2))

    with Engine(attn, batch_dim=0) as engine:
        if not generic:
            assert_exact_step(engine, forward, list(attn.parameters()))
            return
        with pytest.raises(ValueError, match=r"does not cover add_bias_kv.*batch_first=True"):
            engine.backward(forward(), MeanWeighting())
    assert attn.in_proj_weight.grad is None


@pytest.mark.parametrize("layer", ["encoder", "decoder"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_transformer_layers_per_sample(layer: str, batch_first: bool) -> None:
    """``nn.TransformerEncoderLayer`` and ``DecoderLayer`` per sample, sequence first (their
    default: the attention, the Linear layers and the LayerNorms on ``[T, B, E]``; refused
    before) and batch first, with a causal mask."""
    torch.manual_seed(0)
    options: dict[str, Any] = {"dim_feedforward": 8, "dropout": 0.0, "batch_first": batch_first}
    if layer == "encoder":
        model: nn.Module = nn.TransformerEncoderLayer(E, H, **options).double()
    else:
        model = nn.TransformerDecoderLayer(E, H, **options).double()
    x = torch.randn(T, B, E, dtype=torch.float64)
    memory = torch.randn(S, B, E, dtype=torch.float64)
    if batch_first:
        x, memory = x.transpose(0, 1), memory.transpose(0, 1)
    mask = nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64)

    def forward() -> Tensor:
        if layer == "encoder":
            out = model(x, src_mask=mask, is_causal=True)
        else:
            out = model(x, memory, tgt_mask=mask, tgt_is_causal=True)
        return out.pow(2).sum(dim=(1, 2) if batch_first else (0, 2))

    with Engine(model, batch_dim=0) as engine:
        assert_exact_step(engine, forward, list(model.parameters()))


@pytest.mark.parametrize("batch_first", [True, False])
def test_unbatched_input_in_per_sample_mode_is_refused(batch_first: bool) -> None:
    """An unbatched ``[T, E]`` input has no samples to split: refused as such (it was handed
    to the generic rule, whose vmap failed with a message that blamed a missing closed form)."""
    attn = nn.MultiheadAttention(E, H, batch_first=batch_first)
    x = torch.randn(T, E)
    with Engine(attn, batch_dim=0) as engine:
        losses = attn(x, x, x)[0].pow(2).sum(dim=1)
        with pytest.raises(ValueError, match=r"unbatched input of shape \(4, 6\).*batch_dim=None"):
            engine.backward(losses, MeanWeighting())
    assert attn.in_proj_weight.grad is None


@pytest.mark.parametrize("batch_dim", [0, None])
def test_dropout_in_training_is_refused(batch_dim: int | None) -> None:
    """Its random mask cannot be replayed (per task, the generic rule silently drew another
    one); in eval mode the dropout is off and the closed form applies."""
    attn = nn.MultiheadAttention(E, H, dropout=0.5, batch_first=True)
    x = torch.randn(B, T, E)
    with Engine(attn, batch_dim=batch_dim) as engine:
        out = attn(x, x, x, need_weights=False)[0]
        losses = out.pow(2).sum(dim=(1, 2)) if batch_dim == 0 else out.pow(2).sum().reshape(1)
        with pytest.raises(ValueError, match=r"dropout=0\.0"):
            engine.compute_gramian(losses)


def test_parametrised_out_projection_gets_the_generic_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parametrisation's parameters are not the projections' weights: the generic rule
    covers them (the closed form would drop them)."""
    generic_calls = []
    original = _attention._GENERIC.prepare
    monkeypatch.setattr(
        _attention._GENERIC, "prepare", lambda *a: generic_calls.append(1) or original(*a)
    )
    case = _case("self", _self, _kw(need_weights=False))

    def build(dtype: torch.dtype) -> Built:
        model, modules, forward = case.build(dtype)
        nn.utils.parametrizations.weight_norm(model.attn.out_proj)
        return model, modules, forward

    check_case(Case("weight_norm_out_proj", build), torch.float64)
    assert generic_calls


def test_attention_mask_matches_torch() -> None:
    """The recomputed output equals the module's, for every mask form of the cases."""
    for case in CASES:
        if case.name in GENERIC or case.batch_dim is None:
            continue
        model, _, _ = case.build(torch.float64)
        calls: list[tuple[Any, ...]] = []

        def record(
            m: nn.Module, args: Any, kwargs: Any, out: Any, calls: list[Any] = calls
        ) -> None:
            calls.append((args, kwargs, out[0]))

        model.attn.register_forward_hook(record, with_kwargs=True)
        model(torch.randn(B, T, E, dtype=torch.float64), torch.randn(B, S, E, dtype=torch.float64))
        args, kwargs, out = calls[0]
        out = out if model.attn.batch_first else out.transpose(0, 1)  # (as the rule's o)
        call = Call(args, kwargs, [0], [out.shape], [None], [], [torch.zeros_like(out)])
        rows = Rows(B, B, None, per_task=False)
        args = _attention._arguments(call)
        _, _, o, _ = _attention._projection_terms(model.attn, call, args, rows)
        w, b = model.attn.out_proj.weight, model.attn.out_proj.bias
        torch.testing.assert_close(torch.nn.functional.linear(o, w, b), out.detach())


def test_shared_left_product_is_the_broadcast_product() -> None:
    """The per-task ``P^T @ d_o`` with the rows side by side equals torch's broadcasting
    product (which copies ``P`` once per row); covered end to end by the ``tasks_`` cases."""
    a = torch.randn(B, H, S, T, dtype=torch.float64)
    b = torch.randn(4, B, H, T, 3, dtype=torch.float64)
    torch.testing.assert_close(_attention._shared_left_product(a, b), a @ b, rtol=0, atol=1e-12)


def test_weights_changed_in_place_since_the_forward_are_refused() -> None:
    """The closed form reads the projection weights: changed since the forward, they are not
    the ones the forward used."""
    attn = nn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, T, E)
    with Engine(attn, batch_dim=0) as engine:
        losses = attn(x, x, x, need_weights=False)[0].pow(2).sum(dim=(1, 2))
        with torch.no_grad():
            attn.out_proj.weight.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified in place"):
            engine.backward(losses, MeanWeighting())
    assert attn.in_proj_weight.grad is None


@pytest.mark.parametrize("option", ["add_bias_kv", "add_zero_attn"])
def test_per_sample_3d_mask_on_the_generic_rule_with_rows_per_sample(option: str) -> None:
    """A 3-D ``attn_mask`` (``[B * H, T, T]``) with ``add_bias_kv`` or ``add_zero_attn``, two
    losses per sample: each re-run row gets its sample's heads' masks. The Gramian is ``J J^T``
    and ``.grad`` the previous one plus ``w @ J`` (weights of the rows, not symmetric), against
    an unhooked copy."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(E, H, batch_first=True, **{option: True}).double()
    reference = copy.deepcopy(attn)
    x = torch.randn(B, T, E, dtype=torch.float64)
    mask = torch.randn(B * H, T, T, dtype=torch.float64)

    def losses(module: nn.MultiheadAttention) -> Tensor:
        out = module(x, x, x, attn_mask=mask, need_weights=False)[0]
        return torch.stack([out.pow(2).sum((1, 2)), out[:, 0].sum(1)], dim=1)

    params = [*reference.parameters()]
    jacobian = torch.stack(
        [
            torch.cat([g.flatten() for g in torch.autograd.grad(loss, params, retain_graph=True)])
            for loss in losses(reference).flatten()
        ]
    )
    engine = Engine(attn, batch_dim=0)
    torch.testing.assert_close(engine.compute_gramian(losses(attn)), jacobian @ jacobian.T)
    previous = [torch.randn_like(p) for p in attn.parameters()]
    for param, grad in zip(attn.parameters(), previous, strict=True):
        param.grad = grad.clone()
    weights = torch.linspace(0.2, 2.9, B * 2, dtype=torch.float64)
    engine.backward(losses(attn), ConstantWeighting(weights))
    update = torch.cat(
        [(p.grad - g).flatten() for p, g in zip(attn.parameters(), previous, strict=True)]  # type: ignore[operator]
    )
    torch.testing.assert_close(update, weights @ jacobian)


@pytest.mark.parametrize("heads", [1, H])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float64])
@pytest.mark.parametrize("option", ["add_bias_kv", "add_zero_attn", "kdim"])
def test_per_sample_2d_mask_as_long_as_the_batch_on_the_generic_rule(
    option: str, dtype: torch.dtype, heads: int
) -> None:
    """A 2-D ``attn_mask`` ``[T, S]`` is shared by the samples: with ``T = B`` the generic rule
    split it by its rows as a per-sample argument, and torch refused each sample's ``[1, S]``
    (a raw error that blamed the missing closed form); each re-run now reads it whole."""
    options: dict[str, Any] = {"kdim": 3, "vdim": 3} if option == "kdim" else {option: True}
    attn = nn.MultiheadAttention(E, heads, batch_first=True, **options).double()
    x = torch.randn(B, B, E, dtype=torch.float64)  # T = B
    memory = torch.randn(B, S, 3 if option == "kdim" else E, dtype=torch.float64)
    if dtype == torch.bool:
        mask = torch.zeros(B, S, dtype=torch.bool)
        mask[0, 1:] = mask[2, 0] = True
    else:
        mask = torch.randn(B, S, dtype=torch.float64)

    def losses_of(m: nn.Module) -> Tensor:
        return row_losses(m(x, memory, memory, attn_mask=mask, need_weights=False)[0], 0)

    assert_exact_backward(attn, losses_of, 0)


@pytest.mark.parametrize("scale", [300.0, 1e-3])
@pytest.mark.parametrize("inputs", [_self, _cross], ids=["self", "cross"])
@pytest.mark.parametrize("batch_dim", [0, None])
def test_float16_projections_run_in_float32(
    batch_dim: int | None, inputs: Inputs, scale: float
) -> None:
    """A float16 attention layer without autocast: its closed form ran in float16, as the
    engine's float32 upcast of a layer's tensors skipped it (a rule that covers its children's
    parameters), so output gradients of about 300 overflowed the Gramian to ``inf`` (a float32
    Gramian of about 1e6) and small ones lost digits to float16's subnormals (15% off at 1e-3).
    Against the float64 brute force from the same float16 weights, to float16's precision."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(E, H, batch_first=True).half()
    reference = copy.deepcopy(attn).double()
    x, memory = torch.randn(B, T, E).half(), torch.randn(B, S, E).half()
    params = [*reference.parameters()]

    def losses(module: nn.MultiheadAttention, dtype: torch.dtype) -> Tensor:
        out, weights = module(*inputs(x.to(dtype), memory.to(dtype)))
        per_sample = (out.to(torch.float64).pow(2) + weights.to(torch.float64)[..., :1]).sum((1, 2))
        return scale * (per_sample if batch_dim == 0 else per_sample[:2])

    jacobian = torch.stack(
        [
            torch.cat([g.flatten() for g in torch.autograd.grad(loss, params, retain_graph=True)])
            for loss in losses(reference, torch.float64)
        ]
    )
    engine = Engine(attn, batch_dim=batch_dim)
    gramian = assert_float32_gramian(engine, losses(attn, torch.float16), jacobian)
    weights = torch.linspace(0.5, 1.5, gramian.shape[0], dtype=torch.float32)
    engine.backward(losses(attn, torch.float16), ConstantWeighting(weights))
    update = torch.cat([p.grad.double().flatten() for p in attn.parameters()])  # type: ignore[union-attr]
    target = weights.double() @ jacobian
    top = float(target.abs().max())
    torch.testing.assert_close(update / top, target / top, rtol=0, atol=1e-2)


# an attribute of a MultiheadAttention(6, 2, batch_first=True) set between its forward and the
# step, and whether a forward after the change is one the test differentiates
CHANGES: list[tuple[str, object, bool]] = [
    ("num_heads", 3, True),
    ("num_heads", 1, True),
    ("batch_first", False, False),
    ("dropout", 0.5, False),
    ("add_zero_attn", True, True),
]


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize(
    ("name", "value", "exact"), CHANGES, ids=[f"{n}_{v}" for n, v, _ in CHANGES]
)
def test_attributes_changed_after_the_forward_are_refused(
    name: str, value: object, exact: bool, batch_dim: int | None
) -> None:
    """The rule splits the heads, lays out the batch and takes the closed form or the generic
    rule by the module's attributes at the step: one changed since the forward is refused,
    naming it, before anything is written (a changed ``num_heads`` gave a step 13-20% off,
    silently; the others raw torch errors, or a dropout refusal for a forward that dropped
    nothing); a forward after the change is differentiated exactly."""
    attn = nn.MultiheadAttention(E, H, batch_first=True).double()
    x = torch.randn(B, T, E, dtype=torch.float64)

    def losses_of(m: nn.Module) -> Tensor:
        return row_losses(m(x, x, x)[0], batch_dim)

    assert_change_refused(attn, losses_of, lambda: setattr(attn, name, value), batch_dim, name)
    if exact:
        assert_exact_backward(attn, losses_of, batch_dim)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
def test_a_whole_sequence_first_transformer_per_sample() -> None:
    """``nn.Transformer`` as built by default (sequence first), between a shared ``nn.Embedding``
    of ``[T, B]`` ids and a Linear head, one loss per sample (refused before at its first
    attention): exact over two steps."""
    torch.manual_seed(0)
    embed, head = nn.Embedding(11, 2 * E), nn.Linear(2 * E, 11)
    transformer = nn.Transformer(
        d_model=2 * E,
        nhead=H,
        num_encoder_layers=2,
        num_decoder_layers=1,
        dim_feedforward=8,
        dropout=0.0,
    )
    model = nn.ModuleList([embed, transformer, head]).double()
    src, tgt = torch.randint(0, 11, (S, B)), torch.randint(0, 11, (T, B))
    mask = nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64)

    def forward() -> Tensor:
        out = head(transformer(embed(src), embed(tgt), tgt_mask=mask))  # [T, B, 11]
        losses = nn.functional.cross_entropy(out.permute(1, 2, 0), tgt.T, reduction="none")
        return losses.mean(1)

    with Engine(model, batch_dim=0) as engine:
        for _ in range(2):
            assert_exact_step(engine, forward, list(model.parameters()))
            model.zero_grad(set_to_none=True)
