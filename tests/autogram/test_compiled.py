"""The engine on models run through torch.compile (the Engine created on the uncompiled
modules): the compiled code's backward runs once only and not under vmap."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from torch import Tensor, nn

from jacflow.aggregation import UPGradWeighting
from jacflow.autogram import Engine
from tests.autogram.test_engine import reference_jacobian


@functools.cache
def _inductor_works() -> bool:
    """Whether inductor can compile here (it needs a C++ compiler on the CPU)."""
    try:
        torch.compile(lambda x: x * 2)(torch.ones(2))
    except Exception:  # (any failure of the toolchain)
        return False
    return True


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.norm(self.conv(x))).flatten(1))


def _losses(out: Tensor, kind: str) -> Tensor:
    if kind == "per_sample":
        return out.pow(2).sum(1)
    return out.pow(2) if kind == "columns" else out.pow(2).mean(0)


@pytest.mark.parametrize("kind", ["per_sample", "columns", "per_task"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_forwards_are_exact(backend: str, kind: str) -> None:
    """Per sample, the probe of the samples' separation (a second backward) was refused by
    inductor's donated buffers; ``[B, k]`` and per-task losses, pulled back under vmap, failed
    with errors that named neither torch.compile nor a way out. Compiled code is now not probed,
    and its rows are pulled back one at a time: exact against the brute force."""
    if backend == "inductor" and not _inductor_works():
        pytest.skip("inductor cannot compile here (no C++ compiler)")
    torch.manual_seed(0)
    model = _Net().double()
    x = torch.randn(5, 2, 6, 6, dtype=torch.float64)
    engine = Engine(model, batch_dim=None if kind == "per_task" else 0)
    compiled = torch.compile(model, backend=backend)
    params = [*model.parameters()]
    jacobian = reference_jacobian(_losses(model(x), kind), params)
    engine.clear()  # (the reference's forward)
    gramian = engine.compute_gramian(_losses(compiled(x), kind))
    torch.testing.assert_close(gramian, jacobian @ jacobian.T)
    weights = engine.backward(_losses(compiled(x), kind), UPGradWeighting())
    update = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    torch.testing.assert_close(update, weights.flatten() @ jacobian)
    torch._dynamo.reset()


def test_code_compiled_before_the_engine_is_named() -> None:
    """Dynamo does not watch module hooks: code compiled and run before the Engine existed
    never calls its hooks. The refusal named only a weight tied through a functional call; it
    names torch.compile and the way out now."""
    torch.manual_seed(0)
    model = _Net().double()
    x = torch.randn(5, 2, 6, 6, dtype=torch.float64)
    compiled = torch.compile(model.conv, backend="aot_eager")
    compiled(x)
    engine = Engine(model, batch_dim=0)
    losses = model.head(torch.relu(model.norm(compiled(x))).flatten(1)).pow(2).sum(1)
    with pytest.raises(ValueError, match=r"torch\._dynamo\.reset\(\)"):
        engine.backward(losses, UPGradWeighting())
    torch._dynamo.reset()


def test_hooked_modules_all_compiled_before_the_engine_are_named() -> None:
    """Every hooked module runs in code compiled before the Engine existed: no call is
    recorded, and the refusal names torch.compile and the way out (it told to create the
    Engine on the uncompiled module, which it was)."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    compiled = torch.compile(trunk, backend="aot_eager")
    compiled(x)
    engine = Engine(trunk, batch_dim=None)
    features = compiled(x)
    losses = torch.stack([features[:, 0].pow(2).mean(), features[:, 1].sin().mean()])
    with pytest.raises(RuntimeError, match=r"compiled and run before.*_dynamo\.reset\(\)"):
        engine.backward(losses, UPGradWeighting())
    assert all(p.grad is None for p in trunk.parameters())
    torch._dynamo.reset()


def test_a_second_step_on_one_forward_gets_no_compile_hint() -> None:
    """Without compiled code in the losses' graph, the refusal of a second step on the same
    forward says nothing of torch.compile."""
    trunk = nn.Linear(3, 2).double()
    engine = Engine(trunk, batch_dim=0)
    losses = trunk(torch.randn(4, 3, dtype=torch.float64)).pow(2).sum(1)
    engine.compute_gramian(losses)
    with pytest.raises(RuntimeError, match="No forward call") as error:
        engine.backward(losses, UPGradWeighting())
    assert "compile" not in str(error.value)


class _Gate(nn.Module):
    """A module of the generic rule: re-run, so hooked by a forward pre-hook too."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1, 1, 4, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.tanh(self.weight)


@pytest.mark.parametrize("generic", [False, True])
def test_fullgraph_is_refused_with_the_way_out(generic: bool) -> None:
    """With ``fullgraph=True``, Dynamo's error read "Tensor with grad_fn()", raised inside the
    Engine's hook, and named neither the Engine nor a way out: its reason names both now. The
    engine stays usable, the model compiled without ``fullgraph`` exact."""
    torch.manual_seed(0)
    first = _Gate() if generic else nn.Linear(4, 4)
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    engine = Engine(model, batch_dim=0)
    way_out: str | None = (
        r"(?s)jacflow\.autogram\.Engine.*fullgraph=True.*Compile without fullgraph=True"
    )
    if "reason" not in inspect.signature(torch.compiler.disable).parameters:
        way_out = None  # (torch < 2.8 gives a disabled function no reason: Dynamo's own message)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=way_out):
        torch.compile(model, backend="eager", fullgraph=True)(x)
    torch._dynamo.reset()
    jacobian = reference_jacobian(model(x).pow(2).sum(1), [*model.parameters()])
    engine.clear()  # (the reference's forward)
    gramian = engine.compute_gramian(torch.compile(model, backend="aot_eager")(x).pow(2).sum(1))
    torch.testing.assert_close(gramian, jacobian @ jacobian.T)
    torch._dynamo.reset()


class _Mixer(nn.Module):
    """Unhooked operations between the layers: compiled pieces that save intermediates."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.l1(x)
        h = self.l2((h.sin() * h.cos()).exp() + h**2)
        return self.l3(nn.functional.gelu(h) * torch.sigmoid(h))


def test_donated_buffers_refusal_names_compute_gramians_retained_graph() -> None:
    """With aot_eager, code recompiled after a first step donates its buffers: per sample with
    ``[B]`` losses, ``compute_gramian``, which retains the graph by default, is refused. The
    hint said nothing of that default (nor of aot_eager); it names it and ``retain_graph=False``
    now, which works, exact."""
    torch.manual_seed(0)
    model = _Mixer().double()
    x = torch.randn(5, 6, dtype=torch.float64)
    engine = Engine(model, batch_dim=0)
    compiled = torch.compile(model, backend="aot_eager")
    engine.backward(compiled(x).pow(2).sum(1), UPGradWeighting())
    hint = r"(?s)aot_eager's after a recompilation.*compute_gramian's default.*retain_graph=False"
    with pytest.raises(RuntimeError, match=hint):
        engine.compute_gramian(compiled(x).pow(2).sum(1))
    jacobian = reference_jacobian(model(x).pow(2).sum(1), [*model.parameters()])
    engine.clear()  # (the reference's forward)
    gramian = engine.compute_gramian(compiled(x).pow(2).sum(1), retain_graph=False)
    torch.testing.assert_close(gramian, jacobian @ jacobian.T)
    torch._dynamo.reset()


def test_code_compiled_for_another_instance_is_named() -> None:
    """Dynamo reuses code compiled for another instance of the same class: the Engine, created
    before this instance's first compiled forward, records nothing. The hint said to create
    the Engine before the first compiled forward, which it was; it names that case now, and
    ``torch._dynamo.reset()``, which makes the step exact."""
    torch.manual_seed(0)
    first, model = (nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)) for _ in range(2))
    first, model = first.double(), model.double()
    x = torch.randn(5, 4, dtype=torch.float64)
    torch._dynamo.reset()
    try:
        torch.compile(first, backend="aot_eager")(x).sum().backward()
        engine = Engine(model, batch_dim=0)
        compiled = torch.compile(model, backend="aot_eager")
        hint = r"(?s)compiled and run before.*another instance of the same class.*_dynamo\.reset"
        with pytest.raises(RuntimeError, match=hint):
            engine.compute_gramian(compiled(x).pow(2).sum(1))
        torch._dynamo.reset()
        jacobian = reference_jacobian(model(x).pow(2).sum(1), [*model.parameters()])
        engine.clear()  # (the reference's forward)
        gramian = engine.compute_gramian(compiled(x).pow(2).sum(1))
        torch.testing.assert_close(gramian, jacobian @ jacobian.T)
    finally:
        torch._dynamo.reset()


def test_flattened_tokens_read_through_compiled_code_are_refused_by_name() -> None:
    """A Linear on tokens flattened batch first is read as called on ``[B, T, d]`` only where
    the engine can probe the order: through compiled code, it is refused with ``.grad``
    untouched, and the message says why the flattening batch first was not enough."""
    torch.manual_seed(0)
    head = nn.Linear(3, 2).double()
    squash = torch.compile(lambda out: torch.tanh(out).pow(2), backend="aot_eager")
    hidden = torch.randn(4, 5, 3, dtype=torch.float64)
    with Engine(head, batch_dim=0) as engine:
        losses = squash(head(hidden.reshape(-1, 3))).view(4, -1).mean(1)
        with pytest.raises(ValueError, match="compile'd code lies between it and the losses"):
            engine.backward(losses, UPGradWeighting())
    assert head.weight.grad is None and head.bias.grad is None
    torch._dynamo.reset()


def test_sequence_first_calls_read_through_compiled_code_are_refused_by_name() -> None:
    """A Linear on a sequence-first input (``[T, B, d]``) is read with the batch on dimension 1
    only where the engine can probe the order (with ``T = B`` by chance, a tensor that is
    not sequence first would read so too): through compiled code, it is refused with ``.grad``
    untouched, and the message says why."""
    torch.manual_seed(0)
    head = nn.Linear(3, 2).double()
    squash = torch.compile(lambda out: torch.tanh(out).pow(2), backend="aot_eager")
    hidden = torch.randn(5, 4, 3, dtype=torch.float64)
    with Engine(head, batch_dim=0) as engine:
        losses = squash(head(hidden)).sum(dim=(0, 2))
        with pytest.raises(ValueError, match=r"sequence first.*compile'd code lies between"):
            engine.backward(losses, UPGradWeighting())
    assert head.weight.grad is None and head.bias.grad is None
    torch._dynamo.reset()
