"""Hooked parameters used outside the hooked modules' recorded calls are refused."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jacflow.aggregation import UPGradWeighting
from jacflow.autogram import Engine
from tests.autogram._zoo import Scale
from tests.autogram.test_engine import assert_exact_gramian, reference_jacobian


class _TiedLM(nn.Module):
    """An embedding whose weight is also the output layer's: through a functional call, through
    a module of the model, or through a module outside the engine's."""

    def __init__(self, tie: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.mid = nn.Linear(6, 6)
        self.tie = tie
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: Tensor) -> Tensor:
        h = torch.tanh(self.mid(self.embed(idx)))
        if self.tie == "functional":
            return F.linear(h, self.embed.weight)
        return self.head(h)


def _losses(model: nn.Module, batch_dim: int | None) -> Tensor:
    torch.manual_seed(1)
    idx = torch.randint(0, 10, (4, 3))
    out = model(idx).pow(2).mean(-1)
    return out.mean(1) if batch_dim == 0 else torch.stack([out.sum(), out[0, 1]])


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("tie", ["functional", "unhooked_module"])
def test_weight_tied_outside_the_hooked_calls_is_refused(tie: str, batch_dim: int | None) -> None:
    """A weight that the losses also reach through a functional call, or through a module the
    engine does not hook, is refused with the workaround before anything is written (before,
    the Gramian silently missed that use: 6% off per sample), and again when the step is
    retried."""
    torch.manual_seed(0)
    model = _TiedLM(tie).double()
    hooked = [model] if tie == "functional" else [model.embed, model.mid]
    engine = Engine(*hooked, batch_dim=batch_dim)
    name = r"_TiedLM\.embed" if tie == "functional" else r"modules\[0\]"
    for _ in range(2):  # (a retried step is refused again: it passed silently before)
        with pytest.raises(ValueError, match=name + r"\.weight is used outside the forward"):
            engine.backward(_losses(model, batch_dim), UPGradWeighting())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("batch_dim", [0, None])
def test_weight_tied_through_hooked_modules_is_exact(batch_dim: int | None) -> None:
    """The same tie through a module the engine hooks: no refusal, and exact."""
    torch.manual_seed(0)
    model = _TiedLM("module").double()
    engine = Engine(model, batch_dim=batch_dim)
    losses = _losses(model, batch_dim)
    params = list(model.parameters())
    assert_exact_gramian(engine, losses, params)


@pytest.mark.parametrize("batch_dim", [0, None])
def test_a_tie_on_a_branch_taken_later_is_refused(batch_dim: int | None) -> None:
    """The check runs again when the recorded calls change: a functional tie on a branch that
    the first steps do not take is refused when it is taken (it was only checked at the first
    step: silently 6% off per sample), and a step that was refused is checked again."""
    torch.manual_seed(0)
    model = _TiedLM("module").double()
    engine = Engine(model, batch_dim=batch_dim)
    for _ in range(2):
        engine.backward(_losses(model, batch_dim), UPGradWeighting())
    model.tie = "functional"
    grads = [p.grad.clone() for p in model.parameters()]
    for _ in range(2):
        with pytest.raises(ValueError, match=r"embed\.weight is used outside the forward calls"):
            engine.backward(_losses(model, batch_dim), UPGradWeighting())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    model.tie = "module"  # (back to a checked pattern: no walk needed, still exact)
    losses = _losses(model, batch_dim)
    assert_exact_gramian(engine, losses, list(model.parameters()))


class _KeepsIntermediate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.kept: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        product = x @ self.inner.weight.T
        self.kept = product
        return torch.tanh(product + self.inner.bias)


def test_intermediate_of_a_module_used_later_is_refused() -> None:
    """A closed-form unit's parameter reached through an intermediate kept by its parent and
    used by the losses: refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    engine = Engine(model, batch_dim=0)
    h = model[0](torch.randn(5, 3, dtype=torch.float64))
    out = model[2](model[1](h))
    losses = (out + h @ model[2].weight).pow(2).sum(1)  # (the weight again, outside its call)
    with pytest.raises(ValueError, match=r"2\.weight is used outside"):
        engine.compute_gramian(losses)


def test_no_recorded_call_keeps_its_own_error() -> None:
    """Losses that reach no recorded call get the engine's error about that, not this one."""
    model = nn.Linear(3, 2).double()
    out = model(torch.randn(4, 3, dtype=torch.float64))
    engine = Engine(model, batch_dim=0)  # (created after the forward)
    with pytest.raises(RuntimeError, match="No forward call of the hooked modules"):
        engine.compute_gramian(out.sum(1))


class _TableThroughLayer(nn.Module):
    """An embedding table given as is, a parameter, as the input of a hooked Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.proj = nn.Linear(6, 6)

    def forward(self, idx: Tensor) -> Tensor:
        return self.embed(idx) @ self.proj(self.embed.weight).T


class _Skipped(nn.Module):
    """A block under the generic rule that returns its input as it is (a skipped layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((6,), 0.5))

    def forward(self, x: Tensor) -> Tensor:
        return x


class _TiedBeforeSkip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.block = _Skipped()
        self.out = nn.Linear(10, 1)

    def forward(self, idx: Tensor) -> Tensor:
        tied = F.linear(self.embed(idx), self.embed.weight)
        return self.out(self.block(tied)).squeeze(1)


@pytest.mark.parametrize("model", ["table_as_input", "before_a_skipped_block"])
def test_outside_uses_past_inputs_and_pass_through_calls_are_refused(model: str) -> None:
    """The walk goes on into a parameter given as a call's input, and through a call that
    returns its input as it is (its output's node is that input's)."""
    torch.manual_seed(0)
    module = _TableThroughLayer() if model == "table_as_input" else _TiedBeforeSkip()
    module = module.double()
    engine = Engine(module, batch_dim=None)
    out = module(torch.randint(0, 10, (4, 3)))
    with pytest.raises(ValueError, match=r"embed\.weight is used outside"):
        engine.compute_gramian(torch.stack([out.pow(2).mean(), out[0].sum()]))


def test_check_runs_again_after_a_step_that_met_no_call() -> None:
    """A first step that failed before the walk met a recorded call leaves the check for the
    next step."""
    torch.manual_seed(0)
    model = _TiedLM("functional").double()
    stale = model(torch.randint(0, 10, (4, 3)))
    engine = Engine(model, batch_dim=0)  # (created after that forward)
    with pytest.raises(RuntimeError, match="No forward call"):
        engine.compute_gramian(stale.pow(2).mean((1, 2)))
    with pytest.raises(ValueError, match=r"embed\.weight is used outside"):
        engine.compute_gramian(_losses(model, 0))


@pytest.mark.parametrize("substitute", [False, True])
def test_functional_call_with_other_tensors_is_refused(substitute: bool) -> None:
    """``torch.func.functional_call`` with the module's own parameters is exact; with other
    tensors in their place (a scaled weight) the closed form would give the gradient of those
    as the parameter's (49% off on this model): refused before anything is written."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    engine = Engine(model, batch_dim=0)
    params = {
        k: v * 0.5 if substitute and k == "2.weight" else v for k, v in model.named_parameters()
    }
    x = torch.randn(5, 4, dtype=torch.float64)
    losses = torch.func.functional_call(model, params, (x,)).squeeze(1).pow(2)
    if substitute:
        with pytest.raises(ValueError, match="read other tensors than its parameters"):
            engine.backward(losses, UPGradWeighting())
        assert all(p.grad is None for p in model.parameters())
        return
    assert_exact_gramian(engine, losses, list(model.parameters()))


def test_functional_call_with_a_freed_temporary_is_still_refused() -> None:
    """A temporary read as a parameter that the graph does not keep (a bias, which the
    product's backward does not save) dies after the forward, and a new parameter put in its
    place can take its id (here the first one made after it does): the check compared ids,
    and the step took the call as reading the module's own parameters. It is refused, and the
    recorded call does not keep the temporary alive."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 2).double()
    engine = Engine(layer, batch_dim=0)
    temporary = layer.bias * 2
    alive, temporary_id = weakref.ref(temporary), id(temporary)
    losses = torch.func.functional_call(
        layer, {"bias": temporary}, (torch.randn(4, 3, dtype=torch.float64),)
    ).sum(1)
    data = [torch.zeros(2, dtype=torch.float64) for _ in range(64)]
    del temporary
    assert alive() is None
    candidates = [nn.Parameter(d) for d in data]
    layer.bias = next((c for c in candidates if id(c) == temporary_id), candidates[0])
    with pytest.raises(ValueError, match="read other tensors than its parameters"):
        engine.backward(losses, UPGradWeighting())
    assert all(p.grad is None for p in layer.parameters())


@pytest.mark.parametrize("kind", ["attention", "lstm", "batchnorm"])
def test_outside_uses_of_replayed_closed_forms_are_refused(kind: str) -> None:
    """Attention, recurrent and BatchNorm layers have closed forms that replay the module:
    their parameters are checked too (a weight reused through a functional call, 31-38% off
    before)."""
    torch.manual_seed(0)
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    module: nn.Module
    if kind == "attention":
        module = nn.MultiheadAttention(4, 2, batch_first=True).double()
    elif kind == "lstm":
        module = nn.LSTM(4, 4, batch_first=True).double()
    else:
        module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(3)).double().eval()
    engine = Engine(module, batch_dim=None)
    if isinstance(module, nn.MultiheadAttention):
        out = F.linear(module(x, x, x)[0], module.out_proj.weight)
    elif isinstance(module, nn.LSTM):
        out = module(x)[0] @ module.weight_ih_l0[:4]
    else:
        out = module(x) * module[1].weight[:, None]
    with pytest.raises(ValueError, match="is used outside the forward calls"):
        engine.compute_gramian(torch.stack([out.sum(), out.pow(2).mean()]))


class _Gated(nn.Module):
    """A generic module whose forward calls a hooked Linear that is not its child on its own
    parameter (an input of that call) and uses a weight tied to that Linear's."""

    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.randn(4, 4))
        self.tied = shared.weight
        self.shared = [shared]  # (a plain list: not a child)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x @ self.tied.T) * self.shared[0](self.gate).sum(0)


@pytest.mark.parametrize("batch_dim", [0, None])
def test_generic_parameter_used_outside_its_calls_is_refused(batch_dim: int | None) -> None:
    """A parameter of a module under the generic rule that the losses also reach outside its
    calls (a learned scale reused in the loss) is refused; it was not checked (silently
    wrong)."""
    torch.manual_seed(0)
    scale, head = Scale(4).double(), nn.Linear(4, 3).double()
    engine = Engine(scale, head, batch_dim=batch_dim)
    x = torch.randn(5, 4, dtype=torch.float64)
    out = head(scale(x)).tanh().pow(2).sum(1) + (x * scale.s).sum(1)
    losses = out if batch_dim == 0 else torch.stack([out.sum(), out[0]])
    with pytest.raises(ValueError, match=r"modules\[0\]\.s is used outside the forward calls"):
        engine.backward(losses, UPGradWeighting())
    assert all(p.grad is None for p in [*scale.parameters(), *head.parameters()])


def test_generic_uses_inside_its_calls_are_exact() -> None:
    """Uses inside a generic module's calls are its own: its parameter given to a hooked Linear
    called inside them, and a weight tied to that Linear's, are not refused, and exact."""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4).double()
    gated, scale = _Gated(shared).double(), Scale(4).double()
    engine = Engine(shared, gated, scale, batch_dim=None)
    x = torch.randn(5, 4, dtype=torch.float64)
    out = shared(scale(gated(x))).pow(2).sum(1)
    losses = torch.stack([out.sum(), out[0]])
    params = [*shared.parameters(), gated.gate, *scale.parameters()]
    assert_exact_gramian(engine, losses, params)


class _ScaleKeeps(Scale):
    """A generic module that keeps an intermediate of its parameter, and reads a context
    tensor that is not an argument (set before the call)."""

    context: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        self.kept = x * self.s
        return self.kept.tanh() if self.context is None else self.kept * self.context


def test_generic_intermediate_used_later_is_refused() -> None:
    """An intermediate of a generic module's parameter, kept and used by the losses outside its
    call, is a use that its re-run does not see: refused."""
    torch.manual_seed(0)
    scale, head = _ScaleKeeps(4).double(), nn.Linear(4, 1).double()
    engine = Engine(scale, head, batch_dim=0)
    out = head(scale(torch.randn(5, 4, dtype=torch.float64))).squeeze(1)
    with pytest.raises(ValueError, match=r"modules\[0\]\.s is used outside"):
        engine.compute_gramian(out + scale.kept.sum(1))


@pytest.mark.parametrize("foreign", [False, True])
def test_generic_call_reading_a_context_is_walked_inside(foreign: bool) -> None:
    """A generic call's inside is walked back to its inputs and past the tensors it reads
    otherwise: a context computed by a hooked Linear is exact; a hooked Linear's weight used
    inside the call (no rule covers that use) is refused."""
    torch.manual_seed(0)
    scale, proj = _ScaleKeeps(4).double(), nn.Linear(4, 4).double()
    engine = Engine(scale, proj, batch_dim=None)  # (the re-run per sample would see no batch)
    x = torch.randn(5, 4, dtype=torch.float64)
    scale.context = proj(x).tanh()
    if foreign:
        scale.context = scale.context * proj.weight[0]
    out = scale(x).pow(2).sum(1)
    losses = torch.stack([out.sum(), out[0], out[1:].mean()])
    if foreign:
        with pytest.raises(ValueError, match=r"modules\[1\]\.weight is used outside"):
            engine.compute_gramian(losses)
        return
    assert_exact_gramian(engine, losses, [*scale.parameters(), *proj.parameters()])


class _Gate(Scale):
    """Ends its forward with a call of a module that is not its child (its output as is)."""

    def forward(self, x: Tensor, proj: nn.Module) -> Tensor:  # type: ignore[override]
        return proj(torch.tanh(x) * self.s)


class _Reads(Scale):
    """Reads the parameter of the module that calls it (by attribute)."""

    def __init__(self, owner: nn.Module) -> None:
        super().__init__(4)
        self.owner = [owner]  # (a plain list: not a child)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.s * self.owner[0].s


class _Calls(Scale):
    def forward(self, x: Tensor, inner: nn.Module) -> Tensor:  # type: ignore[override]
        return torch.tanh(inner(x * self.s))


class _Deep(Scale):
    """Calls itself on its input as it is; keeps every call's output."""

    def __init__(self, features: int) -> None:
        super().__init__(features)
        self.outs: list[Tensor] = []

    def forward(self, x: Tensor, depth: int = 1) -> Tensor:
        out = torch.tanh(x * self.s) if depth == 0 else torch.tanh(self(x, depth - 1) * self.s) + x
        self.outs.append(out)
        return out


class _Precomputed(Scale):
    """Reads a weight computed from its parameter outside its calls (once per sequence)."""

    w: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        assert self.w is not None
        return torch.tanh(x * self.w)


@pytest.mark.parametrize(
    "case", ["ends_with_a_call", "reads_its_caller", "recursion_on_its_input", "precomputed"]
)
@pytest.mark.parametrize("batch_dim", [0, None])
def test_the_insides_of_generic_calls(case: str, batch_dim: int | None) -> None:
    """The walk steps over a call that a generic call ends with (it was refused: exact); a use
    of the caller's parameter inside a generic call that it calls is the caller's (refused:
    exact); it leaves a generic call's inside at the nodes made before the call: a recursion
    on its own input with the parameter used before it (silently 6% off), a weight computed
    from the parameter before the call (silently 6-100% off) are refused."""
    torch.manual_seed(0)
    x = torch.randn(4, 4, dtype=torch.float64)
    head = nn.Linear(4, 1).double()
    forward: Callable[[], Tensor]
    if case == "ends_with_a_call":
        gate, proj = _Gate(4).double(), nn.Linear(4, 4).double()
        hooked: list[nn.Module] = [gate, proj, head]
        forward = lambda: head(gate(x, proj))  # noqa: E731
    elif case == "reads_its_caller":
        outer = _Calls(4).double()
        inner = _Reads(outer).double()
        hooked = [outer, inner, head]
        forward = lambda: head(outer(x, inner))  # noqa: E731
    elif case == "recursion_on_its_input":
        deep = _Deep(4).double()
        hooked = [deep, head]
        # (the parameter used before the outer call; the losses read the inner call's output)
        forward = lambda: head(deep.outs[0] if deep(x * deep.s) is not None else x)  # noqa: E731
    else:
        pre = _Precomputed(4).double()
        hooked = [pre, head]

        def forward() -> Tensor:
            pre.w = pre.s * 2
            return head(pre(x))

    engine = Engine(*hooked, batch_dim=batch_dim)
    per_sample = forward().pow(2).sum(1)
    losses = per_sample if batch_dim == 0 else torch.stack([per_sample.sum(), per_sample[0]])
    if case in ("recursion_on_its_input", "precomputed"):
        with pytest.raises(ValueError, match=r"\.s is used outside the forward calls"):
            engine.compute_gramian(losses)
        return
    params = [p for module in hooked for p in module.parameters()]
    assert_exact_gramian(engine, losses, list({id(p): p for p in params}.values()))


class _Returns(Scale):
    """Calls itself and returns nothing: the inner call's output is kept."""

    def __init__(self, features: int) -> None:
        super().__init__(features)
        self.outs: list[Tensor] = []

    def forward(self, x: Tensor, depth: int = 1) -> Tensor | None:
        h = torch.tanh(x * self.s)
        if depth == 0:
            return h
        self.outs.append(self(h, depth - 1))
        return None


@pytest.mark.parametrize("batch_dim", [0, None])
def test_recursion_whose_outer_call_returns_nothing(batch_dim: int | None) -> None:
    """A module that calls itself and returns nothing (its inner output kept): the outer call,
    unrecorded, still carries the inner call's input (it was refused; per task the engine then
    failed on it)."""
    torch.manual_seed(0)
    module = _Returns(4).double()
    engine = Engine(module, batch_dim=batch_dim)
    module(torch.randn(4, 4, dtype=torch.float64))
    per_sample = module.outs[-1].pow(2).sum(1)
    losses = per_sample if batch_dim == 0 else torch.stack([per_sample.sum(), per_sample[0]])
    assert_exact_gramian(engine, losses, [module.s])


class _Lazy(Scale):
    """Computes a weight from its parameter at its first call and keeps it for the later ones
    (by hand: not a parametrisation, which each re-run computes again)."""

    w: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.w is None:
            self.w = self.s.exp()
        return torch.tanh(x * self.w)


def test_a_weight_kept_from_an_earlier_call_is_refused() -> None:
    """The later calls' re-runs would read it as a constant (the Gramian was 0, silently)."""
    module = _Lazy(4).double()
    engine = Engine(module, batch_dim=0)
    losses = module(module(torch.randn(5, 4, dtype=torch.float64))).pow(2).sum(1)
    with pytest.raises(ValueError, match=r"\.s is used outside the forward calls"):
        engine.compute_gramian(losses)


def test_a_penalty_added_at_a_later_step_is_refused() -> None:
    """An L2 penalty on a hooked weight added to the losses from the second step on, with the
    same calls: the check of outside uses ran at the first step only, and the penalty's share
    was missing from the Gramian and the update (46% off). It is checked again when the
    losses' graph around the calls changes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    engine = Engine(model, batch_dim=0)
    x = torch.randn(6, 5, dtype=torch.float64)
    engine.backward(model(x).pow(2).sum(1), UPGradWeighting())
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="is used outside the forward calls"):
        engine.backward(model(x).pow(2).sum(1) + model[2].weight.pow(2).sum(), UPGradWeighting())
    for p, grad in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(p.grad, grad)


@pytest.mark.parametrize("batch_dim", [0, None])
def test_a_penalty_moved_onto_a_hooked_weight_is_refused(batch_dim: int | None) -> None:
    """A penalty on another parameter of the hooked weight's shape at the first step, on the
    hooked weight at the second: the graph around the calls had the same node types, so the
    check of outside uses was skipped and the penalty's share was missing from the update,
    silently. The hooked parameter that a node accumulates into is part of the graph's key."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    other = nn.Parameter(torch.randn(3, 8, dtype=torch.float64))
    x = torch.randn(6, 5, dtype=torch.float64)

    def losses(penalised: Tensor) -> Tensor:
        out = model(x).pow(2)
        out = out.sum(1) if batch_dim == 0 else out.sum(0)
        return out + penalised.pow(2).sum()

    engine = Engine(model, batch_dim=batch_dim)
    first = losses(other)
    params = list(model.parameters())
    rows = [torch.autograd.grad(loss, params, retain_graph=True) for loss in first]
    jacobian = torch.stack([torch.cat([g.reshape(-1) for g in row]) for row in rows])
    weights = engine.backward(first, UPGradWeighting())
    before = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    update = torch.cat([g.reshape(-1) for g in before])
    torch.testing.assert_close(update, weights @ jacobian, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"2\.weight is used outside the forward calls"):
        engine.backward(losses(model[2].weight), UPGradWeighting())
    for p, grad in zip(params, before, strict=True):
        torch.testing.assert_close(p.grad, grad)


@pytest.mark.parametrize("hooked", ["model", "block"])
def test_reentrant_checkpoints_are_refused(hooked: str) -> None:
    """A reentrant activation checkpoint hides its calls from the engine and writes ``.grad``
    of the parameters inside it in its backward: the checkpointed layers got no update (or an
    unrelated error). Refused with a clear error; the non-reentrant checkpoint is exact."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(5, 8), nn.Tanh())
    head = nn.Linear(8, 3)
    model = nn.ModuleDict({"block": block, "head": head}).double()
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    engine = Engine(model if hooked == "model" else block, batch_dim=0)

    def losses(reentrant: bool) -> Tensor:
        return head(checkpoint(block, x, use_reentrant=reentrant)).pow(2).sum(1)

    with pytest.raises(ValueError, match="use_reentrant=False"):
        engine.backward(losses(True), UPGradWeighting())
    assert all(p.grad is None for p in model.parameters())
    params = [*model.parameters()] if hooked == "model" else [*block.parameters()]
    assert_exact_gramian(engine, losses(False), params)


class _CheckpointsInside(nn.Module):
    """A module of the generic rule (a parameter of its own) that checkpoints its function."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.lin, self.scale = nn.Linear(5, 5), nn.Parameter(torch.ones(5))
        self.reentrant = reentrant

    def forward(self, x: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        def function(t: Tensor) -> Tensor:
            return torch.tanh(self.lin(t)) * self.scale

        return checkpoint(function, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("batch_dim", [0, None])
def test_a_reentrant_checkpoint_inside_a_generic_module_is_refused_by_the_engine(
    batch_dim: int | None,
) -> None:
    """The graph walk does not look inside a generic-rule call, so torch's own error came out
    of the engine's backward, naming a call of ``.grad()`` the user did not make. The engine's
    refusal now, with nothing written; the same module with a non-reentrant checkpoint is
    exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), _CheckpointsInside(True), nn.Linear(5, 1)).double()
    x = torch.randn(4, 5, dtype=torch.float64)
    engine = Engine(model, batch_dim=batch_dim)

    def losses() -> Tensor:
        out = model(x)
        return out.pow(2).sum(1) if batch_dim == 0 else torch.stack([out.sum(), out.pow(2).sum()])

    with pytest.raises(ValueError, match=r"inside one of them.*use_reentrant=False"):
        engine.backward(losses(), UPGradWeighting())
    assert all(p.grad is None for p in model.parameters())
    model[1].reentrant = False
    assert_exact_gramian(engine, losses(), list(model.parameters()))


class _CheckpointsItsChild(nn.Module):
    """A module of the generic rule whose forward checkpoints its child (non-reentrant)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.lin, x, use_reentrant=False).tanh() * self.scale


def test_a_checkpoint_recomputed_in_a_users_backward_is_not_an_outside_call() -> None:
    """A backward of the user's before the step (a reference gradient) recomputes the
    checkpointed child, outside its unit's forward: that is no forward call, and the step is
    exact (it was refused as a call of the child outside the unit)."""
    torch.manual_seed(0)
    unit, head = _CheckpointsItsChild().double(), nn.Linear(3, 1).double()
    params = [*unit.parameters(), *head.parameters()]
    engine = Engine(unit, head, batch_dim=0)
    losses = head(unit(torch.randn(4, 3, dtype=torch.float64))).pow(2).squeeze(1)
    jacobian = reference_jacobian(losses, params)
    weights = engine.backward(losses, UPGradWeighting())
    update = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    torch.testing.assert_close(update, weights @ jacobian)


def test_a_reentrant_checkpoint_below_every_hooked_call_is_accepted() -> None:
    """A reentrant checkpoint of a backbone that the Engine does not hook, below its hooked
    head: the engine's backward stops before it, and every hooked module was called outside
    it. Exact (it was refused with the checkpoints around hooked calls)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(5, 8), nn.Tanh()).double()
    head = nn.Linear(8, 3).double()
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    engine = Engine(head, batch_dim=0)
    losses = head(checkpoint(backbone, x, use_reentrant=True)).pow(2).sum(1)
    assert_exact_gramian(engine, losses, [*head.parameters()])
    assert all(p.grad is None for p in backbone.parameters())


def test_a_hooked_layer_also_called_inside_a_reentrant_checkpoint_is_refused() -> None:
    """A shared layer called twice, once inside a reentrant checkpoint below the other call:
    the checkpointed call is not recorded, and the step was accepted without it (Gramian 14%
    off, update 25%). The checkpoint runs a module holding hooked modules: refused."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = nn.Linear(4, 4).double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    engine = Engine(layer, batch_dim=0)
    losses = layer(torch.tanh(checkpoint(layer, x, use_reentrant=True))).pow(2).sum(1)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        engine.backward(losses, UPGradWeighting())
    assert all(p.grad is None for p in layer.parameters())


def test_an_unused_expert_beside_a_checkpointed_frozen_stem_is_exact() -> None:
    """A hooked layer not called at this step (an expert not selected) beside a reentrant
    checkpoint of a frozen stem below the hooked calls: refused before (any hooked layer
    without a call), exact now."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    stem = nn.Sequential(nn.Linear(5, 8), nn.Tanh()).double().requires_grad_(False)
    experts = nn.ModuleList([nn.Linear(8, 3), nn.Linear(8, 3)]).double()
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    engine = Engine(experts, batch_dim=0)
    losses = experts[0](checkpoint(stem, x, use_reentrant=True)).pow(2).sum(1)
    assert_exact_gramian(engine, losses, [*experts[0].parameters()])


@pytest.mark.parametrize("batch_dim", [0, None])
def test_a_gradient_penalty_in_the_losses_is_refused_with_the_reason(batch_dim: int | None) -> None:
    """Losses holding a derivative through a hooked module (a gradient penalty) reach its
    parameters through the double backward, which the Gramian would miss: refused, and the
    message names that case and the way out (autojac), not only tied weights."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1)).double()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    with Engine(model, batch_dim=batch_dim) as engine:
        out = model(x).squeeze(1)
        (penalty,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        losses = out + penalty.square().sum(1)
        with pytest.raises(ValueError, match=r"gradient penalty.*jacflow\.backward"):
            engine.compute_gramian(losses if batch_dim == 0 else losses[:2])


class _Token(nn.Module):
    """A learned token, returned as it is, or expanded to the batch of ``x`` when given."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)[None])

    def forward(self, x: Tensor | None = None) -> Tensor:
        return self.token if x is None else self.token.expand(x.shape[0], -1)


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("alone", [False, True])
def test_a_module_returning_its_parameter_as_it_is_is_told_how(
    alone: bool, batch_dim: int | None
) -> None:
    """A module whose forward returns its parameter as it is records no call (the output has
    no node): the refusal told to use the parameter through a module and give the engine that
    module, which the user did. It now names the module and the way out: per sample, return it
    expanded to the batch, which is exact."""
    torch.manual_seed(0)
    token, head = _Token(), nn.Linear(4, 1).double()
    modules = (token,) if alone else (token, head)
    engine = Engine(*modules, batch_dim=batch_dim)
    x = torch.randn(5, 4, dtype=torch.float64)

    def forward(expanded: bool = False) -> Tensor:
        out = head(torch.tanh(x + token(x if expanded else None))).squeeze(1) ** 2
        return out if batch_dim == 0 else torch.stack([out.sum(), out[0]])

    way = "expanded to the batch" if batch_dim == 0 else r"through an operation"
    match = rf"(Token|modules\[0\]) \(_Token\) returns its parameter token as it is.*{way}"
    with pytest.raises(ValueError, match=match):
        engine.backward(forward(), UPGradWeighting())
    assert all(p.grad is None for m in modules for p in m.parameters())
    if batch_dim == 0:
        assert_exact_gramian(
            engine, forward(expanded=True), [p for m in modules for p in m.parameters()]
        )
