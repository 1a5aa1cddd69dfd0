"""The engine's one backward: per task, losses stacked from scalars that meet the hooked modules
at one output are pulled back head by head, then batched; every layout against the brute-force
Jacobian, and the route each one takes."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from jacflow import mtl_backward
from jacflow.aggregation import ConstantWeighting, Mean, UPGradWeighting
from jacflow.autogram import Engine, _capture, mtl_gramian_step
from tests.autogram.test_engine import (
    assert_exact_gramian,
    assert_exact_step,
    reference_jacobian,
)

Losses = Callable[[Tensor, Tensor, Tensor, nn.ModuleList], Tensor]


def _heads_apart(x: Tensor, hidden: Tensor, features: Tensor, heads: nn.ModuleList) -> Tensor:
    return torch.stack([head(features).tanh().pow(2).mean() for head in heads])


def _one_head_sliced(x: Tensor, hidden: Tensor, features: Tensor, heads: nn.ModuleList) -> Tensor:
    shared = heads[-1](features).sin()  # (every task reads a column of one head)
    return torch.stack([shared[:, i % shared.shape[1]].pow(2).mean() for i in range(len(heads))])


def _skip_to_hidden(x: Tensor, hidden: Tensor, features: Tensor, heads: nn.ModuleList) -> Tensor:
    # the last task also reads the trunk's first layer: two outputs meet the heads
    losses = [head(features).pow(2).mean() for head in heads[:-1]]
    return torch.stack([*losses, heads[-1](features).mean() * hidden.sum()])


def _task_on_input(x: Tensor, hidden: Tensor, features: Tensor, heads: nn.ModuleList) -> Tensor:
    # the first task reads the input only: its row is zero
    first = heads[0].weight.sum() * x.pow(2).mean()
    return torch.stack([first, *[head(features).pow(2).mean() for head in heads]])


def _constant_task(x: Tensor, hidden: Tensor, features: Tensor, heads: nn.ModuleList) -> Tensor:
    # a loss that depends on no parameter (a metric stacked with the losses)
    return torch.stack([x.pow(2).mean(), *[head(features).exp().mean() for head in heads]])


def _tied_heads(x: Tensor, hidden: Tensor, features: Tensor, heads: nn.ModuleList) -> Tensor:
    # every head also reads the first head's weight: a task parameter shared by all tasks
    tied = heads[0].weight
    return torch.stack([(head(features) * (features @ tied.T)).mean() for head in heads])


def _cat_of_pairs(x: Tensor, hidden: Tensor, features: Tensor, heads: nn.ModuleList) -> Tensor:
    # not a stack of scalars: batched over the rows
    return torch.cat([head(features).pow(2).mean(0) for head in heads])


# the layout, and whether it goes head by head: with the last head unhooked, and hooked (its
# output is then where the heads meet the hooked modules, besides the trunk's, unless no other
# head reads the trunk)
LAYOUTS: dict[str, tuple[Losses, bool, bool]] = {
    "heads_apart": (_heads_apart, True, False),
    "one_head_sliced": (_one_head_sliced, True, True),
    "skip_to_hidden": (_skip_to_hidden, False, False),
    "task_on_input": (_task_on_input, True, False),
    "constant_task": (_constant_task, True, False),
    "tied_heads": (_tied_heads, True, False),
    "cat_of_pairs": (_cat_of_pairs, False, False),
}


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the head-by-head pullbacks."""
    calls: list[int] = []
    by_task = _capture._by_task
    monkeypatch.setattr(_capture, "_by_task", lambda *a: calls.append(1) or by_task(*a))
    return calls


def _check_layout(name: str, m: int, width: int, hooked_head: bool, seed: int) -> bool:
    """The Gramian, the trunk's update and the heads' gradients against the brute force;
    returns whether the head-by-head route was taken."""
    torch.manual_seed(seed)
    layout = LAYOUTS[name][0]
    first, rest = nn.Linear(3, width), nn.Sequential(nn.Tanh(), nn.Linear(width, 4), nn.ReLU())
    heads = nn.ModuleList([nn.Linear(4, 2) for _ in range(m)])
    first, rest, heads = first.double(), rest.double(), heads.double()
    modules = (first, rest, heads[-1]) if hooked_head else (first, rest)
    engine = Engine(*modules, batch_dim=None)
    x = torch.randn(5, 3, dtype=torch.float64)
    shared = [*first.parameters(), *rest.parameters()]
    if hooked_head:
        shared += list(heads[-1].parameters())
    tasks = [p for h in (heads[:-1] if hooked_head else heads) for p in h.parameters()]

    def forward() -> Tensor:
        hidden = first(x)
        return layout(x, hidden, rest(hidden), heads)

    losses = forward()
    jacobian = reference_jacobian(losses, shared)
    head_grads = torch.autograd.grad(
        losses.sum(), tasks, retain_graph=True, allow_unused=True, materialize_grads=True
    )
    calls: list[int] = []
    by_task = _capture._by_task
    _capture._by_task = lambda *a: calls.append(1) or by_task(*a)  # type: ignore[assignment]
    try:
        torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)
        weights = mtl_gramian_step(forward(), engine, UPGradWeighting(), tasks_params=tasks)
    finally:
        _capture._by_task = by_task  # type: ignore[assignment]
    actual = torch.cat([p.grad.flatten() for p in shared])  # type: ignore[union-attr]
    torch.testing.assert_close(actual, weights @ jacobian)
    for param, expected in zip(tasks, head_grads, strict=True):
        torch.testing.assert_close(
            torch.zeros_like(param) if param.grad is None else param.grad, expected
        )
    return bool(calls)


@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts(name: str) -> None:
    """Each layout is exact, and goes head by head exactly when its heads meet the trunk at
    one output."""
    assert _check_layout(name, m=3, width=6, hooked_head=False, seed=0) == LAYOUTS[name][1]


@pytest.mark.parametrize("name", LAYOUTS)
def test_hooked_head(name: str) -> None:
    """A hooked module inside a head: the heads reach the hooked modules at several outputs
    (batched), or all through that head (head by head); exact either way."""
    assert _check_layout(name, m=3, width=6, hooked_head=True, seed=1) == LAYOUTS[name][2]


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(LAYOUTS)),
    m=st.integers(2, 5),
    width=st.integers(1, 7),
    hooked_head=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_layouts(name: str, m: int, width: int, hooked_head: bool, seed: int) -> None:
    taken = _check_layout(name, m, width, hooked_head, seed)
    assert taken == LAYOUTS[name][2 if hooked_head else 1]


def test_long_heads_are_pulled_back_batched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Heads longer than the walk's budget (per task) are not walked to their end: batched."""
    calls = _spy(monkeypatch)
    torch.manual_seed(0)
    trunk = nn.Linear(3, 4).double()
    engine = Engine(trunk, batch_dim=None)
    features = trunk(torch.randn(5, 3, dtype=torch.float64))
    long = features
    for _ in range(_capture._WALK_PER_TASK * 2):
        long = long * 1.01  # (one autograd node per step, shared by both tasks)
    losses = torch.stack([long.pow(2).mean(), long.sin().mean()])
    assert_exact_gramian(engine, losses, list(trunk.parameters()))
    assert not calls


def test_per_sample_rows_are_pulled_back_batched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per sample, the losses' rows are not tasks: no head-by-head route."""
    calls = _spy(monkeypatch)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    engine = Engine(model, batch_dim=0)
    out = model(torch.randn(2, 3, dtype=torch.float64))
    losses = torch.stack([out[0].sum(), out[1].pow(2).sum()])  # (stacked, one per sample)
    assert_exact_gramian(engine, losses, list(model.parameters()))
    assert not calls


@pytest.mark.parametrize("layers", [1, 2])
def test_graph_freed_as_asked(layers: int) -> None:
    """With ``retain_graph=False`` the graph is freed, heads included, as on the batched route:
    a later backward through it is refused by autograd."""
    trunk = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    heads = nn.ModuleList([nn.Linear(4, 1) for _ in range(3)])
    engine = Engine(trunk, batch_dim=None)
    features = trunk(torch.randn(5, 4))
    losses = torch.stack([head(features).mean() for head in heads])
    engine.compute_gramian(losses, retain_graph=False)
    with pytest.raises(RuntimeError, match="second time"):
        losses.sum().backward()
    assert all(p.grad is None for p in heads.parameters())


@pytest.mark.parametrize("hook", ["scaled", "reversed"])
def test_gradient_hook_on_the_meeting_output(hook: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's gradient hook on the output where the heads meet the trunk (a gradient reversal)
    would run in both backward passes of the head-by-head route: that output is pulled back
    batched, and the hook runs once."""
    calls = _spy(monkeypatch)
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    heads = nn.ModuleList([nn.Linear(4, 1) for _ in range(3)]).double()
    engine = Engine(trunk, batch_dim=None)
    x = torch.randn(6, 3, dtype=torch.float64)
    scale = 3.0 if hook == "scaled" else -1.0

    def forward() -> Tensor:
        features = trunk(x)
        features.register_hook(lambda grad: grad * scale)
        return torch.stack([head(features.tanh()).pow(2).mean() for head in heads])

    losses = forward()
    shared = list(trunk.parameters())
    jacobian = reference_jacobian(losses, shared)
    torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)
    weights = mtl_gramian_step(forward(), engine, UPGradWeighting())
    actual = torch.cat([p.grad.flatten() for p in shared])  # type: ignore[union-attr]
    torch.testing.assert_close(actual, weights @ jacobian)
    assert not calls


def _from_grad_output(module: nn.Module, grads_in: Any, grads_out: Any) -> tuple[Tensor]:
    """A full backward hook whose ``grad_input`` depends on ``grad_output`` (not linearly)."""
    return (grads_in[0] * (1.0 + grads_out[0].pow(2).sum()),)


def _halved(module: nn.Module, grads_out: Any) -> tuple[Tensor]:
    return (grads_out[0] * 0.5,)


@pytest.mark.parametrize("kind", ["hook", "pre_hook"])
@pytest.mark.parametrize("where", ["unit", "container", "global", "head"])
def test_full_backward_hooks_across_the_meeting_output(
    kind: str, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full module backward hook (or pre-hook) of a module whose output lies on the heads'
    side and whose input on the trunk's (the module of the meeting output, a container around
    it, every module): torch keeps the ``grad_output`` of the last backward through the output,
    so head by head the hook saw the last task's only, and a ``grad_input`` computed from it
    went down every task's row (a review's finding). Such losses are pulled back batched, each
    row with its own ``grad_output``: exact; a hook inside a head is exact too."""
    calls = _spy(monkeypatch)
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(3, 5), nn.Sequential(nn.Tanh(), nn.Linear(5, 4))).double()
    heads = nn.ModuleList([nn.Linear(4, 1) for _ in range(3)]).double()
    register = {
        "unit": lambda: trunk[1][1],
        "container": lambda: trunk[1],
        "head": lambda: heads[0],
    }
    hooks: list[Any] = []
    if where == "global":
        module = torch.nn.modules.module
        # (torch keeps the kind of the global hooks after they are removed: restored after)
        monkeypatch.setattr(module, "_global_is_full_backward_hook", None)
        hooks.append(
            module.register_module_full_backward_hook(_from_grad_output)
            if kind == "hook"
            else module.register_module_full_backward_pre_hook(_halved)
        )
    else:
        target = register[where]()
        hooks.append(
            target.register_full_backward_hook(_from_grad_output)
            if kind == "hook"
            else target.register_full_backward_pre_hook(_halved)
        )
    # (inputs that require grad: every hooked module has a grad_input to return)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    try:
        engine = Engine(trunk, batch_dim=None)

        def forward() -> Tensor:
            features = trunk(x)
            return torch.stack([head(features).pow(2).mean() for head in heads])

        losses = forward()
        jacobian = reference_jacobian(losses, list(trunk.parameters()))
        torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)
        _check_step(forward, engine, list(trunk.parameters()), list(heads.parameters()))
    finally:
        for handle in hooks:
            handle.remove()
    if where != "head":
        assert not calls


def test_full_backward_hook_on_the_meeting_module_through_mtl_backward() -> None:
    """``mtl_backward`` with the engine stacks the losses (head by head before): with a full
    backward hook on the module of the features, it writes what it writes without the engine,
    the plain trunk update of the mean of the tasks' rows."""
    x = torch.randn(6, 3, dtype=torch.float64)
    grads = {}
    for use_engine in (False, True):
        torch.manual_seed(0)
        trunk = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double()
        heads = nn.ModuleList([nn.Linear(4, 1) for _ in range(3)]).double()
        trunk[2].register_full_backward_hook(_from_grad_output)
        engine = Engine(trunk, batch_dim=None) if use_engine else None
        features = trunk(x)
        losses = [head(features).pow(2).mean() for head in heads]
        jacobian = reference_jacobian(torch.stack(losses), list(trunk.parameters()))
        mtl_backward(losses, features, A=Mean(), engine=engine)
        actual = torch.cat([p.grad.flatten() for p in trunk.parameters()])  # type: ignore[union-attr]
        torch.testing.assert_close(actual, jacobian.mean(0))
        grads[use_engine] = actual
    torch.testing.assert_close(grads[True], grads[False])


def _check_step(
    forward: Callable[[], Tensor], engine: Engine, shared: list[Tensor], tasks: list[Tensor]
) -> None:
    """``mtl_gramian_step`` on a fresh forward: the shared parameters get ``weights @ J``, the
    task parameters the gradient of the losses' sum."""
    losses = forward()
    jacobian = reference_jacobian(losses, shared)
    expected = torch.autograd.grad(losses.sum(), tasks)
    weights = mtl_gramian_step(forward(), engine, UPGradWeighting(), tasks_params=tasks)
    actual = torch.cat([p.grad.flatten() for p in shared])  # type: ignore[union-attr]
    torch.testing.assert_close(actual, weights @ jacobian)
    for param, grad in zip(tasks, expected, strict=True):
        torch.testing.assert_close(param.grad, grad)


def test_task_param_also_past_the_meeting_output() -> None:
    """A task parameter also used below the hooked trunk (tied with its unhooked input layer):
    the first task's backward goes past the meeting output, so the heads' graph is kept for the
    batched backward from there; exact."""
    torch.manual_seed(0)
    tied = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    trunk = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    head = nn.Linear(4, 1).double()
    engine = Engine(trunk, batch_dim=None)
    x = torch.randn(5, 4, dtype=torch.float64)

    def forward() -> Tensor:
        features = trunk((x @ tied.T).tanh())
        return torch.stack([(features @ tied.T).pow(2).mean(), head(features).pow(2).mean()])

    _check_step(forward, engine, list(trunk.parameters()), [tied, *head.parameters()])


def test_task_params_past_the_meeting_output() -> None:
    """``tasks_params`` behind the hooked modules (an unhooked first layer) get the plain
    gradient of the losses' sum through the trunk, on the head-by-head route too."""
    torch.manual_seed(0)
    first, trunk = nn.Linear(3, 4).double(), nn.Linear(4, 4).double()
    heads = nn.ModuleList([nn.Linear(4, 1) for _ in range(3)]).double()
    engine = Engine(trunk, batch_dim=None)
    x = torch.randn(5, 3, dtype=torch.float64)

    def forward() -> Tensor:
        features = trunk(first(x).tanh())
        return torch.stack([head(features).pow(2).mean() for head in heads])

    _check_step(
        forward, engine, list(trunk.parameters()), [*first.parameters(), *heads.parameters()]
    )


class _NoGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> None:
        return None


def test_heads_that_pass_no_gradient() -> None:
    """Heads whose backward returns no gradient reach the trunk in the graph but not in the
    gradients: the engine names the missing forward calls; the task parameters are untouched."""
    trunk, heads = nn.Linear(3, 4), nn.ModuleList([nn.Linear(4, 1) for _ in range(2)])
    engine = Engine(trunk, batch_dim=None)
    features = _NoGradient.apply(trunk(torch.randn(5, 3)))
    losses = torch.stack([head(features).mean() for head in heads])
    with pytest.raises(RuntimeError, match="No forward call of the hooked modules"):
        mtl_gramian_step(losses, engine, UPGradWeighting(), tasks_params=heads.parameters())
    assert all(p.grad is None for p in [*trunk.parameters(), *heads.parameters()])


@pytest.mark.parametrize("forced", [False, True])
def test_devices(on_device: str, forced: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Heads are pulled back task by task on the CPU only (on an accelerator, kernel launches
    outweigh the saved work); forced onto another device, that route is exact there too."""
    if forced:
        monkeypatch.setattr(_capture, "_BY_TASK_DEVICES", ("cpu", on_device))
    taken = _check_layout("heads_apart", m=3, width=6, hooked_head=False, seed=2)
    assert taken == (forced or on_device == "cpu")


@pytest.mark.parametrize("layout", ["per_sample", "per_sample_rows", "per_task"])
@pytest.mark.parametrize("where", [0, 2])
@pytest.mark.parametrize("scale", [3.0, -1.0])
def test_gradient_hooks_on_hooked_outputs(layout: str, where: int, scale: float) -> None:
    """A user's gradient hook on a hooked layer's output (a scaling, a gradient reversal): where
    the backward goes on through that layer, autograd captures the gradient before the hook,
    and the engine runs the hook on it; on the deepest layer it captured it after. Exact, with
    the update's sign, in every layout."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    model = model.double()
    engine = Engine(model, batch_dim=None if layout == "per_task" else 0)
    x = torch.randn(5, 3, dtype=torch.float64)

    def forward() -> Tensor:
        out = model[0](x) if where == 0 else model[:2](x)
        if where == 2:
            out = model[2](out)
        out.register_hook(lambda grad: grad * scale)
        out = model[where + 1 :](out)
        if layout == "per_sample":
            return out.pow(2).sum(1)
        if layout == "per_sample_rows":
            return out.pow(2)
        return torch.stack([out.sum(), out.pow(2).mean(), out[0, 1]])

    assert_exact_step(engine, forward, list(model.parameters()))


class _Scaled(nn.Module):
    """Parameters of its own (the generic rule), optionally hooking its own output."""

    def __init__(self, hook_inside: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))
        self.hook_inside = hook_inside

    def forward(self, x: Tensor) -> Tensor:
        out = x * self.scale
        if self.hook_inside:
            out.register_hook(lambda grad: -grad)
        return out


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("inside", [False, True])
def test_gradient_hook_on_a_re_run_module_is_refused(batch_dim: int | None, inside: bool) -> None:
    """The generic rule re-runs its module's forward with torch.func, which registers again the
    hooks the forward registered: a hook on that module's own output is refused, before anything
    is written; one on a tensor computed from it is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _Scaled(inside), nn.Tanh(), nn.Linear(4, 2)).double()
    engine = Engine(model, batch_dim=batch_dim)
    x = torch.randn(5, 3, dtype=torch.float64)

    def losses(view: bool) -> Tensor:
        model[1].hook_inside = inside and not view
        out = model[1](model[0](x))
        if view:
            out = out.view_as(out)
        if not inside or view:
            out.register_hook(lambda grad: -grad)
        out = model[2:](out)
        return out.pow(2).sum(1) if batch_dim == 0 else torch.stack([out.sum(), out[0, 1]])

    with pytest.raises(ValueError, match="carries a gradient hook"):
        engine.backward(losses(view=False), UPGradWeighting())
    assert all(p.grad is None for p in model.parameters())
    reference = losses(view=True)
    assert_exact_gramian(engine, reference, list(model.parameters()))


class _ViewOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return (x @ self.weight).view(*x.shape[:-1], 2, 2)


_PATTERNS = ["in_place", "used_before_and_after", "again_after", "freed"]


def _in_place_forward(
    first: nn.Module, module: nn.Module, pattern: str, batch_dim: int | None
) -> Tensor:
    """Losses of ``module`` (after ``first``) whose output gets an in-place op: before the
    losses, also with a use before it, again after the losses, or inside a forward that frees
    the output before the step."""
    h = first(torch.randn(3, 5, 4, dtype=torch.float64))
    attention = isinstance(module, nn.MultiheadAttention)
    out = module(h, h, h, need_weights=False)[0] if attention else module(h)
    before = out * 2 if pattern == "used_before_and_after" else 0.0
    out.add_(1.0)
    total = (out + before).pow(2)
    losses = total.sum(tuple(range(1, out.ndim))) if batch_dim == 0 else total.flatten()[:4]
    if pattern == "again_after":
        out.mul_(0.5)
    return losses


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("pattern", _PATTERNS)
def test_in_place_op_on_a_view_output_is_refused(pattern: str, batch_dim: int | None) -> None:
    """An in-place op on a hooked module's output that is a view takes the recorded node out of
    the graph: refused with the workaround, also when the losses use the view before the op
    too, when another op follows the losses, and when the view is freed before the step (an
    in-place residual inside a forward, which was silently wrong: the engine now holds the
    views until the step)."""
    torch.manual_seed(0)
    first, module = nn.Linear(4, 4).double(), _ViewOut()
    engine = Engine(first, module, batch_dim=batch_dim)
    with pytest.raises(RuntimeError, match=r"is a view .* modified in place"):
        engine.backward(_in_place_forward(first, module, pattern, batch_dim), UPGradWeighting())
    assert all(p.grad is None for p in [*first.parameters(), *module.parameters()])


class _ScaleThenLinear(nn.Module):
    """A parameter of its own (the generic rule), then a child Linear on a sequence: its output
    is the Linear's product reshaped, a view made inside its forward."""

    def __init__(self, clone: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(3))
        self.linear = nn.Linear(3, 3)
        self.clone = clone

    def forward(self, x: Tensor) -> Tensor:
        out = self.linear(x * self.scale)
        return out.clone() if self.clone else out


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("clone", [False, True])
def test_in_place_op_after_a_generic_module_ending_in_a_linear(
    batch_dim: int | None, clone: bool
) -> None:
    """A generic-rule module whose forward ends in a Linear on a sequence returns a view made
    inside it; an in-place ReLU after it was refused with a message that sent the user looking
    for a transpose or reshape of their own. The message names that Linear now (``.grad``
    untouched), and the documented way out (``.clone()`` at the forward's end) is exact:
    ``.grad`` is the previous one plus ``w @ J`` of an unhooked copy."""
    torch.manual_seed(0)
    model = nn.Sequential(_ScaleThenLinear(clone), nn.ReLU(inplace=True), nn.Linear(3, 2))
    model = model.double()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 3, 3, dtype=torch.float64)

    def losses(net: nn.Module) -> Tensor:
        out = net(x).flatten(1)
        return out.pow(2).sum(1) if batch_dim == 0 else torch.stack([out.sum(), out[0, 1]])

    params = [*model.parameters()]
    previous = [torch.randn_like(p) for p in params]
    for param, grad in zip(params, previous, strict=True):
        param.grad = grad.clone()
    engine = Engine(model[0], model[2], batch_dim=batch_dim)
    weights = torch.linspace(0.3, 1.9, 4 if batch_dim == 0 else 2, dtype=torch.float64)
    if not clone:
        with pytest.raises(RuntimeError, match=r"an nn.Linear on a sequence .* modified in place"):
            engine.backward(losses(model), ConstantWeighting(weights))
        assert all(torch.equal(p.grad, g) for p, g in zip(params, previous, strict=True))
        return
    jacobian = reference_jacobian(losses(reference), [*reference.parameters()])
    engine.backward(losses(model), ConstantWeighting(weights))
    update = torch.cat([(p.grad - g).flatten() for p, g in zip(params, previous, strict=True)])
    torch.testing.assert_close(update, weights @ jacobian)


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("pattern", [*_PATTERNS, "relu_inplace"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_in_place_ops_on_attention_outputs(
    batch_first: bool, pattern: str, batch_dim: int | None
) -> None:
    """MultiheadAttention's output is a view of its output projection's (transposed when
    batch-first): the engine reads the gradient at the projection, so in-place ops on the
    output (``ReLU(inplace=True)`` after it, in-place residuals) leave the step exact. They
    were refused, where plain autograd works."""
    torch.manual_seed(0)
    first = nn.Linear(4, 4).double()
    attention = nn.MultiheadAttention(4, 2, batch_first=batch_first).double()
    engine = Engine(first, attention, batch_dim=None if not batch_first else batch_dim)
    dim = batch_dim if batch_first else None  # (batch-second: per task only)
    params = [*first.parameters(), *attention.parameters()]

    def forward() -> Tensor:
        torch.manual_seed(1)
        if pattern != "relu_inplace":
            return _in_place_forward(first, attention, pattern, dim)
        h = first(torch.randn(3, 5, 4, dtype=torch.float64))
        out = nn.ReLU(inplace=True)(attention(h, h, h, need_weights=False)[0])
        return out.pow(2).sum((1, 2)) if dim == 0 else torch.stack([out.sum(), out[0, 0, 1]])

    assert_exact_step(engine, forward, params)


@pytest.mark.parametrize("batch_dim", [0, None])
def test_attention_output_transposed_in_place_then_changed(batch_dim: int | None) -> None:
    """An in-place view op on attention's output (``transpose_``) before an in-place op on its
    values: the gradient read at the output projection is laid out as the output was at the
    forward (the first version took the layout at the step: a Gramian off by half its size
    per task, a false refusal per sample; a review's finding)."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(4, 2, batch_first=True).double()
    engine = Engine(attention, batch_dim=batch_dim)
    x = torch.randn(4, 4, 4, dtype=torch.float64)  # (B == T: the transpose keeps the shape)
    out = attention(x, x, x, need_weights=False)[0]
    out.transpose_(0, 1)
    out.mul_(torch.linspace(0.5, 2.0, 4, dtype=torch.float64).view(4, 1, 1))
    per_sample = (out.pow(2) * torch.linspace(1, 2, 4, dtype=torch.float64)).sum((0, 2))
    losses = per_sample if batch_dim == 0 else torch.stack([per_sample.sum(), out[0, 1, 2]])
    assert_exact_gramian(engine, losses, list(attention.parameters()))


@pytest.mark.parametrize("change", ["no_grad", "detach"])
@pytest.mark.parametrize("kind", ["attention", "view"])
def test_view_output_changed_outside_autograd_before_the_losses(kind: str, change: str) -> None:
    """An output that is a view, changed in place under no_grad (or through ``.detach()``)
    before the losses are computed from it: the view gets a new node on its base's, which
    bypasses the recorded one. Attention's output is read at its projection (exact); another
    view is refused with the workaround. Both raised that no forward call was in the graph."""
    torch.manual_seed(0)
    first = nn.Linear(4, 4).double()
    module = (
        nn.MultiheadAttention(4, 2, batch_first=True).double()
        if kind == "attention"
        else _ViewOut()
    )
    engine = Engine(first, module, batch_dim=0)
    h = first(torch.randn(3, 5, 4, dtype=torch.float64))
    out = module(h, h, h, need_weights=False)[0] if kind == "attention" else module(h)
    if change == "no_grad":
        with torch.no_grad():
            out.mul_(2.0)
    else:
        out.detach().mul_(2.0)
    losses = (out * 3.0).pow(2).sum(tuple(range(1, out.ndim)))
    params = [*first.parameters(), *module.parameters()]
    if kind == "attention":
        assert_exact_gramian(engine, losses, params)
        return
    with pytest.raises(RuntimeError, match=r"is a view .* under no_grad"):
        engine.backward(losses, UPGradWeighting())
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize(
    "hooked", ["no", "yes", "freed", "round_trip", "stray_forward", "multi_grad"]
)
@pytest.mark.parametrize("kind", ["linear", "attention"])
def test_hook_after_an_in_place_view_op_on_an_output(kind: str, hooked: str) -> None:
    """An in-place view op (``transpose_``) keeps an output's hooks dict, which the engine
    opened, on the output's old node: a hook registered after the op got the gradient in the
    old layout (a size error; silently wrong values with square shapes). Such a hook is
    refused with the workaround, ``.grad`` untouched, also when the output is freed before
    the step or transposed back (a review found both missed by a first version, which
    compared the output's strides); without one, or on a stray forward's output that the
    losses do not use, or a multi-grad hook (an observer, e.g. FlopCounterMode's), the step is
    exact."""
    torch.manual_seed(0)
    module: nn.Module
    if kind == "linear":
        module, x = nn.Linear(4, 6).double(), torch.randn(3, 4, dtype=torch.float64)
    else:
        module = nn.MultiheadAttention(4, 2, batch_first=True).double()
        x = torch.randn(3, 5, 4, dtype=torch.float64)
    engine = Engine(module, batch_dim=None)

    def forward() -> Tensor:
        return module(x) if kind == "linear" else module(x, x, x, need_weights=False)[0]

    stray = forward()  # (kept alive: a metric)
    out = forward()
    hooked_out = stray if hooked == "stray_forward" else out
    hooked_out.transpose_(0, 1)
    if hooked == "multi_grad":
        torch.autograd.graph.register_multi_grad_hook([hooked_out], lambda grads: None)
    elif hooked != "no":
        mask = torch.rand(hooked_out.shape, dtype=torch.float64)
        hooked_out.register_hook(lambda grad: grad * mask)
    if hooked == "round_trip":
        out.transpose_(0, 1)
    losses = torch.stack([out.sum(), (out * 2.0).sum()])
    if hooked == "freed":
        del out, hooked_out  # (nothing in the losses' graph saves the output)
    params = list(module.parameters())
    if hooked in ("no", "stray_forward", "multi_grad"):
        assert_exact_gramian(engine, losses, params)
        return
    with pytest.raises(ValueError, match="in-place view operation"):
        engine.backward(losses, UPGradWeighting())
    assert all(p.grad is None for p in params)


def test_hooked_outputs_pickle_without_warnings() -> None:
    """The engine's own hook on each recorded output is marked unserializable: saving such an
    output does not warn about it."""
    import io
    import warnings

    layer = nn.Linear(3, 2)
    engine = Engine(layer, batch_dim=0)
    out = layer(torch.randn(4, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.save(out, io.BytesIO())
    engine.remove()


def test_hook_reading_values_under_the_batched_backward_is_named() -> None:
    """A gradient hook that reads values out of its gradient cannot run under vmap: the error
    names such a hook."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    engine = Engine(model, batch_dim=None)
    hidden = model[0](torch.randn(5, 3))
    hidden.register_hook(lambda grad: grad * grad.sum().item())
    out = model[1:](hidden)
    with pytest.raises(RuntimeError, match=r"gradient hook \(register_hook\) that reads values"):
        engine.compute_gramian(torch.stack([out.sum(), out.pow(2).mean()]))


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("which", ["generic", "linear"])
def test_module_backward_hooks(batch_dim: int | None, which: str) -> None:
    """Module backward hooks (a pre-hook that scales the output gradient, an observing hook) act
    in the real backward; the generic rule's torch.func re-run, which cannot run them, is given
    the output gradients past them. Exact, the hooks running once per backward (per sample, the
    first step's probe of the samples' separation is 2 ceil(log2 B) more backwards)."""
    torch.manual_seed(0)
    middle = _Scaled(hook_inside=False) if which == "generic" else nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(3, 4), middle, nn.Tanh(), nn.Linear(4, 2)).double()
    fired: list[str] = []
    middle.register_full_backward_pre_hook(lambda m, grads: (grads[0] * -2.0,))
    middle.register_full_backward_hook(lambda m, grads_in, grads_out: fired.append("hook"))
    engine = Engine(model, batch_dim=batch_dim)
    x = torch.randn(5, 3, dtype=torch.float64)

    def forward() -> Tensor:
        out = model(x)
        return out.pow(2).sum(1) if batch_dim == 0 else torch.stack([out.sum(), out[0, 1]])

    losses = forward()
    params = list(model.parameters())
    jacobian = reference_jacobian(losses, params)
    fired.clear()
    torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)
    weights = engine.backward(forward(), UPGradWeighting())
    actual = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    torch.testing.assert_close(actual, weights @ jacobian)
    assert fired == ["hook"] * (2 + 6 if batch_dim == 0 else 2)  # (B = 5: 3 binary digits)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # (torch deprecates these hooks)
@pytest.mark.parametrize("batch_dim", [0, None])
def test_legacy_module_backward_hook_on_a_re_run_module(batch_dim: int | None) -> None:
    """The older ``register_backward_hook``, which changes the gradients inside the module,
    runs in the generic rule's re-run as in the real backward: exact."""
    torch.manual_seed(0)
    middle = _Scaled(hook_inside=False)
    model = nn.Sequential(nn.Linear(3, 4), middle, nn.Tanh(), nn.Linear(4, 2)).double()
    middle.register_backward_hook(
        lambda m, grads_in, grads_out: tuple(None if g is None else g * 0.5 for g in grads_in)
    )
    engine = Engine(model, batch_dim=batch_dim)
    out = model(torch.randn(5, 3, dtype=torch.float64))
    losses = out.pow(2).sum(1) if batch_dim == 0 else torch.stack([out.sum(), out[0, 1]])
    assert_exact_gramian(engine, losses, list(model.parameters()))


class _Wrapper(nn.Module):
    """Parameters of its own (the generic rule) around a Linear child."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))
        self.inner = nn.Linear(4, 4).double()

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x) * self.scale


@pytest.mark.filterwarnings("ignore::UserWarning")  # (torch's note on hooks without inputs)
@pytest.mark.parametrize("where", ["child", "global"])
def test_module_backward_hooks_inside_a_re_run_module_are_refused(where: str) -> None:
    """A full module backward hook on a child of a generic-rule module (or one registered for
    every module) would change gradients inside the torch.func re-run, which cannot run it:
    refused with the workaround, before anything is written."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _Wrapper(), nn.Tanh(), nn.Linear(4, 2)).double()
    if where == "child":
        handle = model[1].inner.register_full_backward_pre_hook(lambda m, g: (g[0] * -3.0,))
    else:  # (an observer: every module's pre-hook)
        handle = torch.nn.modules.module.register_module_full_backward_pre_hook(lambda m, g: None)
    try:
        engine = Engine(model, batch_dim=None)
        out = model(torch.randn(5, 3, dtype=torch.float64))
        with pytest.raises(RuntimeError, match=r"cannot run the .*backward hook"):
            engine.backward(torch.stack([out.sum(), out[0, 1]]), UPGradWeighting())
    finally:
        handle.remove()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "case", ["no_grad_change", "detached_metric", "stray_forward", "stray_forward_freed"]
)
def test_view_outputs_changed_in_place_outside_the_losses(case: str) -> None:
    """A view output changed in place outside autograd (under no_grad, or through a detached
    copy sharing its version counter) keeps its base's node; a stray forward's view changed in
    place under autograd gets new nodes that the losses do not reach: the step is exact."""
    torch.manual_seed(0)
    first = nn.Linear(4, 4).double()
    attention = nn.MultiheadAttention(4, 2, batch_first=True).double()
    engine = Engine(first, attention, batch_dim=0)

    def forward(x: Tensor) -> Tensor:
        h = first(x)
        return attention(h, h, h, need_weights=False)[0]

    x = torch.randn(3, 5, 4, dtype=torch.float64)
    stray = forward(torch.randn(2, 5, 4, dtype=torch.float64))  # (kept alive: a metric)
    if case == "stray_forward":
        stray.relu_()
    if case == "stray_forward_freed":
        forward(torch.randn(2, 5, 4, dtype=torch.float64)).relu_()
    out = forward(x)
    losses = out.sum((1, 2)).pow(2)  # (nothing saves out: a metric may change it in place)
    if case == "detached_metric":
        out.detach().clamp_(min=0)
    if case == "no_grad_change":
        with torch.no_grad():
            out.relu_()
    params = [*first.parameters(), *attention.parameters()]
    assert_exact_gramian(engine, losses, params)


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("op", ["relu_inplace", "residual_in_place", "dropout_inplace", "hooked"])
def test_in_place_ops_on_a_sequence_linear_output(batch_dim: int | None, op: str) -> None:
    """A Linear on ``[B, T, d]`` returns its product reshaped (a view): the engine reads the
    gradient at the product, so in-place ops on the output (``ReLU(inplace=True)``, an in-place
    residual, in-place dropout, also after a gradient hook) leave the step exact."""
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4).double(), nn.Linear(4, 2).double()
    engine = Engine(first, second, batch_dim=batch_dim)
    x = torch.randn(3, 5, 4, dtype=torch.float64)

    def forward() -> Tensor:
        torch.manual_seed(1)  # (the same dropout mask in both forwards)
        h = first(x)
        if op == "relu_inplace":
            h = nn.ReLU(inplace=True)(h)
        elif op == "residual_in_place":
            h += x
        elif op == "dropout_inplace":
            h = nn.functional.dropout(h, 0.3, training=True, inplace=True)
        else:
            h.register_hook(lambda grad: -2.0 * grad)
            h.relu_()
        out = second(h)
        return out.pow(2).sum((1, 2)) if batch_dim == 0 else torch.stack([out.sum(), out[0, 0, 1]])

    assert_exact_step(engine, forward, [*first.parameters(), *second.parameters()])


@pytest.mark.parametrize("size", [5, 1], ids=["strided", "contiguous_1x1"])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("batch_dim", [0, None])
def test_group_norm_on_channels_last_is_pulled_back_row_by_row(
    affine: bool, batch_dim: int | None, size: int
) -> None:
    """A GroupNorm's backward on a channels_last tensor cannot run under vmap ("NYI: querying
    is_contiguous inside of vmap"): with rows to pull back ([B, k] losses, or tasks), the
    engine takes them one by one, whether the GroupNorm is hooked or has no parameters. On
    1 x 1 maps the channels_last tensor is also contiguous (its strides still read as
    channels_last to the backward): it was missed, and the step failed."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(4, 4, 3, padding=1), nn.GroupNorm(2, 4, affine=affine), nn.Conv2d(4, 2, 1)
    ).double()
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(3, 4, size, size, dtype=torch.float64).to(memory_format=torch.channels_last)
    params = list(model.parameters())

    def forward() -> Tensor:
        out = model(x).pow(2)
        return out.sum((2, 3)) if batch_dim == 0 else out.sum((0, 2, 3))

    with Engine(model, batch_dim=batch_dim) as engine:
        assert_exact_step(engine, forward, params)
