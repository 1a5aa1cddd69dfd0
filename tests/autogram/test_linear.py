"""The closed form of ``nn.Linear`` against the brute-force Jacobian of an unhooked copy."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from jacflow.aggregation import ConstantWeighting
from jacflow.autogram import Call, Engine, Rows, _linear
from jacflow.autogram._linear import TransposedLinearRule, UnfoldedContribution
from jacflow.autogram._rules import find_rule
from tests.autogram.test_engine import force_route, reference_jacobian


def assert_exact_backward(
    model: nn.Module, losses_of: Callable[[nn.Module], Tensor], batch_dim: int | None
) -> None:
    """The engine's Gramian of ``losses_of(model)`` is ``J J^T`` and its step with fixed
    asymmetric weights ``w`` adds ``w @ J`` to the ``.grad`` already there, with ``J`` the
    Jacobian of an unhooked copy, row by row (float64)."""
    reference = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    jacobian = reference_jacobian(
        losses_of(reference), [p for p in reference.parameters() if p.requires_grad]
    )
    previous = [torch.randn_like(p) for p in params]
    for p, g in zip(params, previous):
        p.grad = g.clone()
    weights = torch.linspace(-1.0, 2.0, jacobian.shape[0], dtype=torch.float64)
    with Engine(model, batch_dim=batch_dim) as engine:
        torch.testing.assert_close(engine.compute_gramian(losses_of(model)), jacobian @ jacobian.T)
        engine.backward(losses_of(model), ConstantWeighting(weights))
    expected = weights @ jacobian + torch.cat([g.flatten() for g in previous])
    actual = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    torch.testing.assert_close(actual, expected)


def row_losses(out: Tensor, batch_dim: int | None) -> Tensor:
    """Per sample (``batch_dim=0``): one loss per sample of ``out`` (batch first); per task:
    two losses of the whole of ``out``."""
    if batch_dim is None:
        return torch.stack([out.pow(2).sum(), out.sin().sum()])
    return out.flatten(1).pow(2).sum(1)


def assert_change_refused(
    model: nn.Module,
    losses_of: Callable[[nn.Module], Tensor],
    change: Callable[[], object],
    batch_dim: int | None,
    changed: str,
) -> None:
    """The step on ``losses_of(model)`` after ``change()`` (an attribute of a hooked module
    set between the forward and the step) raises a ``ValueError`` naming the attribute
    ``changed`` with both values, and leaves every ``.grad`` as it was."""
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    refusal = rf"changed between its forward and the step \((.+, )?{changed}: .+ -> "
    with Engine(model, batch_dim=batch_dim) as engine:
        losses = losses_of(model)
        change()
        weights = torch.ones(losses.numel(), dtype=torch.float64)
        with pytest.raises(ValueError, match=refusal):
            engine.backward(losses, ConstantWeighting(weights))
    assert all(bool((p.grad == 1).all()) for p in model.parameters())


def assert_refused_per_sample(model: nn.Module, refusal: str) -> None:
    """A per-sample step on the squared outputs of ``model`` on a batch ``[3, 4]`` raises a
    ``ValueError`` matching ``refusal`` and leaves every ``.grad`` as it was."""
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    x = torch.randn(3, 4, dtype=torch.float64)
    with Engine(model, batch_dim=0) as engine, pytest.raises(ValueError, match=refusal):
        engine.backward(model(x) ** 2, ConstantWeighting(torch.ones(3, dtype=torch.float64)))
    assert all(bool((p.grad == 1).all()) for p in model.parameters())


class _UnbatchedCall(nn.Module):
    """A head on the batch ``[B, 4]`` plus a Linear called on a buffer without the batch
    dimension: its output ``[3]`` happens to have the batch's size (B = 3)."""

    def __init__(self, context: Tensor) -> None:
        super().__init__()
        self.head, self.side = nn.Linear(4, 3), nn.Linear(context.shape[-1], 3)
        self.register_buffer("context", context)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(x).sum(1) + self.side(self.context)


@pytest.mark.parametrize("d", [1, 5])
def test_unbatched_input_per_sample_is_refused(d: int) -> None:
    """Per sample, the call without a batch dimension is refused as such, before anything is
    written (it reached the closed form, whose reshape failed with a raw torch error)."""
    model = _UnbatchedCall(torch.randn(d, dtype=torch.float64)).double()
    assert_refused_per_sample(model, rf"Linear received an unbatched input of shape \({d},\)")


def test_unbatched_input_per_task_is_exact() -> None:
    """Per task the batch is one sample: the same call is differentiated exactly."""
    model = _UnbatchedCall(torch.randn(5, dtype=torch.float64)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    assert_exact_backward(model, lambda m: torch.stack([m(x).pow(2).sum(), m(x).sum()]), None)


class _EmptyFeatures(nn.Module):
    """``nn.Linear(4, 0)`` (an empty output) feeding ``nn.Linear(0, 3)`` (no input features:
    its output is its bias, a learned constant), which scales a head on the input."""

    def __init__(self) -> None:
        super().__init__()
        self.head, self.squeeze, self.const = nn.Linear(4, 3), nn.Linear(4, 0), nn.Linear(0, 3)
        nn.init.normal_(self.const.bias)  # (its default is 0: no fan-in)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(x) * self.const(self.squeeze(x))


def _losses_of(x: Tensor, batch_dim: int | None, k: int) -> Callable[[nn.Module], Tensor]:
    """Non-linear losses of a model's outputs on ``x``: ``[B]`` or ``[B, k]`` per sample, ``k``
    full-batch losses per task."""

    def losses(model: nn.Module) -> Tensor:
        out = model(x).flatten(1)
        terms = [out.pow(2).sum(1), (out.sin() * out).sum(1)][:k]
        if batch_dim is None:
            return torch.stack([t.sum() for t in terms])
        return terms[0] if k == 1 else torch.stack(terms, dim=1)

    return losses


@pytest.mark.parametrize(
    ("route", "keep"),
    [(None, False), ("ghost", False), ("materialized", True), ("materialized", False)],
)
@pytest.mark.parametrize("positions", [(), (2,)], ids=["flat", "sequence"])
@pytest.mark.parametrize(("batch_dim", "k"), [(0, 1), (0, 2), (None, 2)])
def test_linear_without_input_or_output_features_is_exact(
    route: str | None,
    keep: bool,
    positions: tuple[int, ...],
    batch_dim: int | None,
    k: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``in_features = 0`` or ``out_features = 0`` (as plain autograd allows): the empty
    weight adds 0 to the Gramian and its bias counts as usual, on every route (``route=None``:
    the engine's choice; the positions of an empty input were inferred by a reshape, which
    failed)."""
    if route is not None:
        force_route(monkeypatch, route, keep)
    model = _EmptyFeatures().double()
    x = torch.randn(3, *positions, 4, dtype=torch.float64)
    assert_exact_backward(model, _losses_of(x, batch_dim, k), batch_dim)


@pytest.mark.parametrize(
    ("batch", "positions", "d", "p", "k", "ghost"),
    [
        (64, 8, 256, 16, 4, False),  # (measured, 1 thread: ghost 3.2-4.7x the materialised)
        (128, 8, 256, 16, 4, False),  # (8.7-9.8x)
        (64, 8, 64, 64, 4, False),  # (5.6-6.1x)
        (64, 4, 256, 64, 2, True),  # (0.57-0.60x)
        (32, 16, 128, 512, 1, True),  # (a transformer's feed-forward layer, [B] losses: 0.46-0.89x)
    ],
)
def test_route_of_sequence_linear_with_several_losses_per_sample(
    batch: int, positions: int, d: int, p: int, k: int, ghost: bool
) -> None:
    """Per sample on sequences, the ghost route gathers the kernel to the rows (``[B, k]``
    losses), multiplies it with the backprops' ``[R T, R T]`` Gram matrix and sums over the
    positions: memory-bound passes, charged per entry (without them the ghost route was taken
    at 5-10x the cost of the materialised one)."""
    layer = nn.Linear(d, p)
    with Engine(layer, batch_dim=0) as engine:
        out = layer(torch.randn(batch, positions, d)).flatten(1)
        losses = out.pow(2).sum(1) if k == 1 else out[:, :k] ** 2
        contribution = engine._prepare(losses, False, ())[0][0][1]
    assert isinstance(contribution, UnfoldedContribution)
    assert contribution._ghost_cheaper() == ghost


def _hf_conv1d() -> type[nn.Module]:
    """Hugging Face's ``Conv1D`` (GPT-2's layers: a Linear of weight ``[in, out]``)."""
    pytest.importorskip("transformers", reason='pip install "jacflow[integrations]"')
    from transformers.pytorch_utils import Conv1D

    return Conv1D  # type: ignore[no-any-return]


@pytest.mark.parametrize("route", ["ghost", "materialised", "kept"])
@pytest.mark.parametrize("batch_dim", [0, None])
def test_hugging_face_conv1d_has_a_closed_form(
    route: str, batch_dim: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Conv1D`` (weight ``[in, out]``) takes the transposed Linear rule, found by its name
    without importing transformers: its Gramian and ``.grad`` (a weight called twice, on
    sequences and on vectors; a per-sample and a per-task step) equal autograd's row by row,
    on every route of the Gramian and of the update."""
    conv1d = _hf_conv1d()
    assert isinstance(find_rule(conv1d(5, 3)), TransposedLinearRule)
    monkeypatch.setattr(UnfoldedContribution, "_ghost_cheaper", lambda self: route == "ghost")
    monkeypatch.setattr(_linear, "worth_keeping", lambda *tensors: route == "kept")
    torch.manual_seed(0)
    first, second = conv1d(5, 3).double(), conv1d(2, 5).double()
    x, v = torch.randn(4, 6, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)

    def losses_of() -> Tensor:
        hidden = torch.tanh(first(x)).mean(1) + torch.tanh(first(v))  # (first: called twice)
        out = second(hidden)
        return out.pow(2).sum(1) if batch_dim == 0 else out.pow(2).sum(0)

    params = [*first.parameters(), *second.parameters()]
    reference = reference_jacobian(losses_of(), params)
    weights = torch.rand(reference.shape[0], dtype=torch.float64)
    with Engine(first, second, batch_dim=batch_dim) as engine:
        gramian = engine.compute_gramian(losses_of())
        torch.testing.assert_close(gramian, reference @ reference.T, rtol=1e-10, atol=1e-12)
        engine.backward(losses_of(), ConstantWeighting(weights))
    grads = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    torch.testing.assert_close(grads, weights @ reference, rtol=1e-10, atol=1e-12)


def test_a_conv1d_whose_weight_is_not_in_by_out_is_refused() -> None:
    """The closed form reads the weight as ``[in, out]``: a module of that name computing
    otherwise (another version's ``forward``) is refused by name, not given a wrong Gramian."""
    rule = TransposedLinearRule()
    layer = nn.Linear(3, 5)  # (weight [5, 3]: [out, in])
    call = Call((torch.ones(4, 3),), {}, [0], [torch.Size([4, 5])], [None], [])
    with pytest.raises(ValueError, match=r"weight as \[in, out\] = \(5, 3\)"):
        rule.validate(layer, call, Rows(4, 4, None, per_task=False))
    rule.validate(nn.Linear(5, 3), call, Rows(4, 4, None, per_task=False))  # ([3, 5]: accepted)


@pytest.mark.parametrize(
    ("batch_dim", "k", "shape"), [(0, 1, (32, 16, 64)), (0, 2, (32, 16, 64)), (None, 3, (2, 64))]
)
def test_per_row_gradients_larger_than_the_inputs_are_formed_by_blocks(
    batch_dim: int | None, k: int, shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The materialised route forms per-row gradients larger than the layer's inputs and
    backprops by blocks of output features, each at most their size (here with no floor:
    several blocks of the 96 features), and sums the blocks' Gramians: exact."""
    monkeypatch.setattr(_linear, "PER_ROW_BLOCK_FLOOR", 1)
    monkeypatch.setattr(UnfoldedContribution, "_ghost_cheaper", lambda self: False)
    blocks: list[int] = []
    per_row = _linear.per_row_weight_grads

    def counted(u: Tensor, bp: Tensor, rows: Rows) -> Tensor:
        blocks.append(bp.shape[-1])
        return per_row(u, bp, rows)

    monkeypatch.setattr(_linear, "per_row_weight_grads", counted)
    torch.manual_seed(0)
    layer = nn.Linear(64, 96).double()
    x = torch.randn(*shape, dtype=torch.float64)
    assert_exact_backward(layer, _losses_of(x, batch_dim, k), batch_dim)
    assert len(blocks) >= 6 and max(blocks) < 96  # (two steps: the Gramian's and backward's)


class _SequenceFirst(nn.Module):
    """Linear layers and a LayerNorm on ``[T, B, ...]`` inputs, as ``nn.Transformer``'s layers
    by default; ``losses`` per sample: ``[B]``, or ``[B, 2]`` with ``two``."""

    def __init__(self, norm_over_batch: bool = False, two: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)
        self.norm = nn.LayerNorm((B_SEQ, 5) if norm_over_batch else 5)
        self.two = two

    def forward(self, x: Tensor) -> Tensor:
        out = self.b(torch.tanh(self.norm(self.a(x))))  # [T, B, (h,) 3]
        per_sample = out.movedim(1, 0).flatten(1)
        if self.two:
            return torch.stack([per_sample.pow(2).sum(1), per_sample.sin().sum(1)], 1)
        return per_sample.pow(2).sum(1)


B_SEQ = 3


@pytest.mark.parametrize("shape", [(5, B_SEQ, 4), (2, B_SEQ, 2, 4), (6, B_SEQ, 4)])
@pytest.mark.parametrize("two", [False, True])
def test_sequence_first_calls_per_sample(shape: tuple[int, ...], two: bool) -> None:
    """Per sample, Linear and LayerNorm calls on sequence-first inputs (the batch on
    dimension 1, ``T != B``; with heads; ``T = 2 B``, which might be read as a merged batch)
    read the batch where it is (they were refused: "must have its batch size on dimension
    0"), for ``[B]`` and ``[B, k]`` losses."""
    torch.manual_seed(0)
    model = _SequenceFirst(two=two).double()
    x = torch.randn(*shape, dtype=torch.float64)
    assert_exact_backward(model, lambda m: m(x), 0)


def test_sequence_first_with_as_many_positions_as_samples() -> None:
    """With ``T = B`` the shapes cannot tell: dimension 0 is read, and the probe refuses the
    mixing that this reads; after steps with ``T != B``, the first step with ``T = B`` is
    probed again (another layout of the batch), not taken with the wrong reading."""
    torch.manual_seed(0)
    model = _SequenceFirst().double()
    with Engine(model, batch_dim=0) as engine:
        for _ in range(2):
            engine.compute_gramian(model(torch.randn(5, B_SEQ, 4, dtype=torch.float64)))
        params = list(model.parameters())
        for p in params:
            p.grad = None
        losses = model(torch.randn(B_SEQ, B_SEQ, 4, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"at other samples.*sequence first \(\[T, B, d\]\)"):
            engine.backward(losses, ConstantWeighting(torch.ones(B_SEQ, dtype=torch.float64)))
        assert all(p.grad is None for p in params)


def test_a_norm_over_the_batch_of_a_sequence_first_input_is_refused() -> None:
    """A LayerNorm over ``(B, d)`` of a ``[T, B, d]`` input normalises across the samples:
    not read as sequence first, refused by the batch check."""
    torch.manual_seed(0)
    model = _SequenceFirst(norm_over_batch=True).double()
    x = torch.randn(5, B_SEQ, 4, dtype=torch.float64)
    refusal = "must have its batch size 3 on dimension 0"
    with Engine(model, batch_dim=0) as engine, pytest.raises(ValueError, match=refusal):
        engine.compute_gramian(model(x))


def test_a_table_with_a_dimension_of_the_batch_size_is_not_read_as_sequence_first() -> None:
    """A parameter table ``[k, C, d]`` with ``C = B`` by chance, projected by a hooked Linear
    and read by each loss at its label: the probe of a first step whose labels are
    ``arange(B)`` would pass, and later steps with other labels be wrong. Such a table is not
    read as sequence first: refused by the batch check."""
    torch.manual_seed(0)
    enc, proj = nn.Linear(3, 3).double(), nn.Linear(3, 3).double()
    table = nn.Parameter(torch.randn(2, B_SEQ, 3, dtype=torch.float64))
    x = torch.randn(B_SEQ, 3, dtype=torch.float64)
    with Engine(enc, proj, batch_dim=0) as engine:
        picked = proj(table)[:, torch.arange(B_SEQ)].sum(0)
        with pytest.raises(ValueError, match="must have its batch size 3 on dimension 0"):
            engine.compute_gramian((enc(x) * picked).sum(1))


def test_position_ids_of_one_row_as_long_as_the_batch() -> None:
    """Position ids ``[1, T]`` with ``T = B``: their embedding's dimension 1 has the batch's
    size and is read as sequence first; the probe refuses it, and the message names that
    reading and the way out."""
    torch.manual_seed(0)
    tokens, positions = nn.Embedding(5, 4).double(), nn.Embedding(B_SEQ, 4).double()
    ids = torch.randint(0, 5, (B_SEQ, B_SEQ))
    with Engine(tokens, positions, batch_dim=0) as engine:
        h = tokens(ids) + positions(torch.arange(B_SEQ)[None])
        refusal = r"Read as sequence first, with the batch on dimension 1.*expand"
        with pytest.raises(ValueError, match=refusal):
            engine.compute_gramian(h.pow(2).sum(dim=(1, 2)))
