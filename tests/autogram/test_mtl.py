"""``mtl_gramian_step`` against the brute-force per-task Jacobian of the shared trunk."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from jacflow import mtl_backward
from jacflow.aggregation import Constant, UPGrad, UPGradWeighting
from jacflow.autogram import Engine, mtl_gramian_step
from tests.autogram._zoo import CASES
from tests.autogram.test_engine import assert_exact_gramian, hooked_params, reference_jacobian
from tests.autojac import _zoo


def _setup(m: int, seq: bool) -> tuple[nn.Module, nn.ModuleList, torch.Tensor]:
    trunk = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.ReLU(), nn.Linear(6, 5)).double()
    heads = nn.ModuleList([nn.Linear(5, 1) for _ in range(m)]).double()
    x = torch.randn(3, 2, 4, dtype=torch.float64) if seq else torch.randn(7, 4, dtype=torch.float64)
    return trunk, heads, x


@pytest.mark.parametrize(("m", "seq"), [(1, False), (2, False), (4, True)])
def test_mtl_gramian_step(m: int, seq: bool, on_device: str) -> None:
    trunk, heads, x = _setup(m, seq)
    engine = Engine(trunk, batch_dim=None)
    features = trunk(x)
    losses = torch.stack([head(features).sin().mean() for head in heads])
    shared, specific = list(trunk.parameters()), list(heads.parameters())
    jacobian = reference_jacobian(losses, shared)
    head_grads = torch.autograd.grad(losses.sum(), specific, retain_graph=True)
    weights = mtl_gramian_step(losses, engine, UPGradWeighting(), tasks_params=specific)
    torch.testing.assert_close(weights, UPGradWeighting()(jacobian @ jacobian.T))
    actual = torch.cat([p.grad.flatten() for p in shared])  # type: ignore[union-attr]
    torch.testing.assert_close(actual, weights @ jacobian)
    for param, expected in zip(specific, head_grads, strict=True):
        torch.testing.assert_close(param.grad, expected)


def test_one_engine_through_changing_task_layouts() -> None:
    """The per-task engine keeps the cotangents of the layouts it has seen: every step, whatever
    the losses' shape or dtype (and back to an earlier one), still gets its own Gramian."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5)).double()
    engine = Engine(trunk, batch_dim=None)
    x = torch.randn(7, 4, dtype=torch.float64)
    params = list(trunk.parameters())
    for shape, dtype in [
        ((3,), torch.float64),
        ((4,), torch.float64),
        ((2, 2), torch.float64),
        ((3,), torch.float32),
        ((), torch.float64),
        ((3,), torch.float64),
    ]:
        features = trunk(x)
        n = max(1, len(torch.empty(shape).flatten()))
        scales = torch.arange(1.0, n + 1, dtype=torch.float64)
        losses = (features.sum(0)[:n] * scales + features.pow(2).mean() * scales).reshape(shape)
        losses = losses.to(dtype)
        jacobian = reference_jacobian(losses, params).double()
        gramian = engine.compute_gramian(losses)
        eps = 1e-9 if dtype == torch.float64 else 1e-4
        tol = {"rtol": eps, "atol": eps}
        torch.testing.assert_close(gramian.double(), jacobian @ jacobian.T, **tol)


def test_mtl_gramian_step_needs_per_task_engine() -> None:
    trunk, heads, x = _setup(2, False)
    engine = Engine(trunk, batch_dim=0)
    losses = torch.stack([head(trunk(x)).mean() for head in heads])
    with pytest.raises(ValueError, match=r"batch_dim=None"):
        mtl_gramian_step(losses, engine, UPGradWeighting())
    with pytest.raises(TypeError, match=r"`engine` must be"):
        mtl_gramian_step(losses, trunk, UPGradWeighting())  # type: ignore[arg-type]


@settings(max_examples=15)
@given(
    batch=st.integers(1, 5),
    k=st.integers(1, 3),
    width=st.integers(1, 6),
    seq=st.integers(0, 3),
    per_task=st.booleans(),
)
def test_random_mlps(batch: int, k: int, width: int, seq: int, per_task: bool) -> None:
    """Random shapes: the Gramian equals J J^T for per-sample ``[B, k]`` and per-task losses."""
    torch.manual_seed(batch * 100 + width)
    model = nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, k)).double()
    shape = (batch, seq, 3) if seq else (batch, 3)
    x = torch.randn(*shape, dtype=torch.float64)
    engine = Engine(model, batch_dim=None if per_task else 0)
    out = model(x)
    losses = out.pow(2).sum(1) if seq else out.pow(2)
    assert_exact_gramian(engine, losses, list(model.parameters()))


def test_vmap_fallback_warnings_stay_inside_the_engine() -> None:
    """With vmap's fallback warnings turned on, an op without a batching rule (smooth L1) in the
    batched backward warns when the user calls it, not from the engine, which accepts the loop."""
    import warnings

    warnings_on = getattr(torch._C, "_debug_only_are_vmap_fallback_warnings_enabled", None)
    if warnings_on is None:
        pytest.skip("this torch has no switch for vmap's fallback warnings")
    trunk, heads = nn.Linear(4, 4), [nn.Linear(4, 1) for _ in range(3)]
    x, target = torch.randn(5, 4), torch.zeros(5, 1)
    engine = Engine(trunk, batch_dim=None)
    before = warnings_on()
    torch._C._debug_only_display_vmap_fallback_warnings(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            features = trunk(x)
            losses = torch.stack([nn.functional.smooth_l1_loss(h(features), target) for h in heads])
            torch.autograd.grad(losses, [features], torch.eye(3), True, is_grads_batched=True)
            assert any("performance drop" in str(w.message) for w in caught)  # the op warns
            caught.clear()
            tasks = [p for h in heads for p in h.parameters()]
            mtl_gramian_step(losses, engine, UPGradWeighting(), tasks_params=tasks)
        assert not caught
    finally:
        torch._C._debug_only_display_vmap_fallback_warnings(before)


@pytest.mark.parametrize("name", ["transformer_block", "tasks_transformer_block"])
def test_fallback_loop_warnings_under_autocast_stay_inside_the_engine(name: str) -> None:
    """CPU attention under bfloat16 autocast has no batching rule, and torch warns about its
    loop even with vmap's fallback warnings off: in the generic rule's vmap (per-sample) and in
    the batched backward (per-task). No warning leaves the engine; the Gramian stays exact."""
    import warnings

    case = next(c for c in CASES if c.name == name)
    _, modules, forward = case.build(torch.float32)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with Engine(*modules, batch_dim=case.batch_dim) as engine:
        with autocast:
            losses = forward().float()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gramian = engine.compute_gramian(losses)
        assert not [str(w.message) for w in caught]
        jacobian = reference_jacobian(losses, hooked_params(modules))
        scale = jacobian.pow(2).sum(1).max().item() + 1.0
        expected = jacobian @ jacobian.T / scale
        torch.testing.assert_close(gramian / scale, expected, rtol=0, atol=1e-2)


@pytest.mark.parametrize("duplicated", [False, True])
def test_large_batch_per_task_gramian(duplicated: bool) -> None:
    """A batch of 160 through a Linear trunk with 5 tasks: the per-layer kernels are factorised
    (the Cholesky route of ``kernel_gram``), or, with every input repeated (a singular kernel),
    may not be; the Gramian and the update equal the brute-force ones either way."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(200, 16), nn.Tanh(), nn.Linear(16, 12)).double()
    heads = nn.ModuleList([nn.Linear(12, 1) for _ in range(5)]).double()
    x = torch.randn(80 if duplicated else 160, 200, dtype=torch.float64)
    x = torch.cat([x, x]) if duplicated else x
    engine = Engine(trunk, batch_dim=None)
    features = trunk(x)
    losses = torch.stack([head(features).pow(2).mean() for head in heads])
    shared = list(trunk.parameters())
    jacobian = reference_jacobian(losses, shared)
    gramian = engine.compute_gramian(losses)
    torch.testing.assert_close(gramian, jacobian @ jacobian.T, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("overlap", ["features_inside_the_trunk", "heads_hooked"])
def test_task_parameters_of_the_engine_are_refused(overlap: str) -> None:
    """A task parameter that the engine also hooks would get both the weighted update and the
    plain task gradient (silently, before): refused before anything is written."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.ReLU()).double()
    heads = nn.ModuleList([nn.Linear(7, 1).double() for _ in range(2)])
    x = torch.randn(6, 5, dtype=torch.float64)
    if overlap == "features_inside_the_trunk":
        engine = Engine(trunk, batch_dim=None)
        features = trunk[1](trunk[0](x))
        out = trunk[3](trunk[2](features))  # (trunk[2] after the features: a task parameter)
    else:
        engine = Engine(nn.ModuleList([trunk, heads]), batch_dim=None)
        features = out = trunk(x)
    losses = [heads[0](out).pow(2).mean(), heads[1](out).abs().mean()]
    with pytest.raises(ValueError, match="is also a parameter of the engine's modules"):
        mtl_backward(losses, features, A=UPGrad(), engine=engine)
    assert all(p.grad is None for p in [*trunk.parameters(), *heads.parameters()])


@pytest.mark.parametrize("join", ["stack", "cat"])
def test_task_parameter_hooks_see_the_summed_gradient(join: str) -> None:
    """Hooks on task parameters (a normalisation, a clip) run once on the gradient of the
    losses' sum, as in ``losses.sum().backward()``, on every route: the batched one (losses not
    stacked from scalars) and the task-by-task one, where a parameter shared by two heads gets
    both tasks' parts before its hook."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(5, 7), nn.Tanh()).double()
    heads = nn.ModuleList([nn.Linear(7, 1) for _ in range(3)]).double()
    scale = nn.Parameter(torch.tensor([1.5, -0.5], dtype=torch.float64))  # heads 1 and 2
    x = torch.randn(6, 5, dtype=torch.float64)

    def forward() -> torch.Tensor:
        features = trunk(x)
        scalars = [heads[0](features).pow(2).mean()]
        scalars += [(heads[k](features) * scale[k - 1]).pow(2).mean() for k in (1, 2)]
        if join == "stack":
            return torch.stack(scalars)
        return torch.cat([s.reshape(1) for s in scalars])

    specific = [*heads.parameters(), scale]
    expected = torch.autograd.grad(forward().sum(), specific)
    heads[0].weight.register_hook(lambda g: g / g.norm())
    heads[1].weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
    scale.register_hook(lambda g: g / g.norm())
    hooked = {
        0: lambda g: g / g.norm(),
        2: lambda g: g.clamp(-0.01, 0.01),
        6: lambda g: g / g.norm(),
    }
    engine = Engine(trunk, batch_dim=None)
    mtl_gramian_step(forward(), engine, UPGradWeighting(), tasks_params=specific)
    for i, (param, grad) in enumerate(zip(specific, expected, strict=True)):
        torch.testing.assert_close(param.grad, hooked.get(i, lambda g: g)(grad))


def _trunk_and_heads() -> tuple[nn.Module, nn.ModuleList, torch.Tensor]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(5, 7), nn.Tanh()).double()
    heads = nn.ModuleList([nn.Linear(7, 1) for _ in range(2)]).double()
    return trunk, heads, torch.randn(6, 5, dtype=torch.float64)


def test_task_parameters_repeated_or_frozen() -> None:
    """A parameter listed twice (a module shared by two heads, chained from both) gets the
    gradient of the losses' sum once, and a frozen one is skipped, as in ``other_params``."""
    trunk, heads, x = _trunk_and_heads()
    heads[1].bias.requires_grad_(False)
    engine = Engine(trunk, batch_dim=None)
    features = trunk(x)
    losses = torch.stack([head(features).sin().mean() for head in heads])
    expected = torch.autograd.grad(losses.sum(), [heads[0].weight], retain_graph=True)[0]
    listed = [*heads[0].parameters(), *heads[1].parameters(), heads[0].weight]
    mtl_gramian_step(losses, engine, UPGradWeighting(), tasks_params=listed)
    torch.testing.assert_close(heads[0].weight.grad, expected)
    assert heads[1].bias.grad is None


@pytest.mark.parametrize(
    ("tasks_params", "error", "match"),
    [
        ([1.0], TypeError, "`tasks_params` must hold tensors"),
        ("heads", TypeError, "`tasks_params` must hold .*pass its .parameters"),
        ("module", TypeError, "`tasks_params` must be an iterable of parameters"),
        ("per_task", TypeError, r"`tasks_params` must hold .*received a list \(one flat iterable"),
        ("generators", TypeError, r"received a generator \(one flat iterable"),
        ("computed", ValueError, "`tasks_params` must hold leaf tensors"),
    ],
)
def test_bad_task_parameters_are_refused(
    tasks_params: object, error: type[Exception], match: str
) -> None:
    trunk, heads, x = _trunk_and_heads()
    given = {
        "heads": [heads[0]],
        "module": heads[0],
        "computed": [heads[0].weight * 2],
        "per_task": [list(head.parameters()) for head in heads],  # (mtl_backward's layout)
        "generators": [head.parameters() for head in heads],
    }.get(str(tasks_params), tasks_params)
    engine = Engine(trunk, batch_dim=None)
    features = trunk(x)
    losses = torch.stack([head(features).sin().mean() for head in heads])
    with pytest.raises(error, match=match):
        mtl_gramian_step(losses, engine, UPGradWeighting(), tasks_params=given)  # type: ignore[arg-type]
    with pytest.raises(error, match=match.replace("tasks", "other")):
        Engine(trunk, batch_dim=None).backward(losses, UPGradWeighting(), other_params=given)  # type: ignore[arg-type]
    assert all(p.grad is None for p in [*trunk.parameters(), *heads.parameters()])


def test_retain_graph_keeps_the_graph() -> None:
    """``retain_graph=True`` (``mtl_backward`` with an engine, ``Engine.backward``) keeps the
    graph: a plain backward through it afterwards adds its gradient to the step's."""
    trunk, heads, x = _trunk_and_heads()
    params = [*trunk.parameters(), *heads.parameters()]
    engine = Engine(trunk, batch_dim=None)
    features = trunk(x)
    losses = [head(features).sin().mean() for head in heads]
    mtl_backward(losses, features, A=UPGrad(), engine=engine, retain_graph=True)
    first = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    plain = torch.autograd.grad(torch.stack(losses).sum(), params, retain_graph=True)
    torch.stack(losses).sum().backward()  # (the graph is still there)
    for param, step, extra in zip(params, first, plain, strict=True):
        torch.testing.assert_close(param.grad, step + extra)
    engine.remove()
    per_sample = Engine(trunk, batch_dim=0)
    out = heads[0](trunk(x)).squeeze(1)
    per_sample.backward(out, UPGradWeighting(), retain_graph=True)
    out.sum().backward()


class _Scaled(nn.Module):
    """A parameter of its own on a sequence (the generic rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.scale)


@pytest.mark.parametrize("stem", ["embedding", "bag"])
@pytest.mark.parametrize("hooked", ["linear", "generic", "whole trunk"])
@pytest.mark.parametrize("chunk_size", [None, 1])
def test_a_sparse_embedding_below_the_engine(
    stem: str, hooked: str, chunk_size: int | None
) -> None:
    """An ``nn.Embedding(sparse=True)`` (or ``EmbeddingBag``) outside the engine, below its
    modules: ``mtl_backward`` failed with torch's "Could not run 'aten::view' ... SparseCPU"
    (vmap cannot batch its backward) or "reshape is not implemented for sparse tensors". Its
    rows are pulled back one by one and densified now: the step is that without the engine,
    each ``.grad`` the previous one plus ``w @ J`` (the heads: plus their task's gradient).
    With the table in the engine too ("whole trunk"), an ``EmbeddingBag``'s re-run by the
    generic rule gave sparse rows, which failed to reshape: densified."""
    torch.manual_seed(0)
    table = (nn.Embedding if stem == "embedding" else nn.EmbeddingBag)(5, 3, sparse=True)
    middle = _Scaled() if hooked == "generic" else nn.Linear(3, 3)
    heads = [nn.Linear(3, 1) for _ in range(2)]
    model = nn.ModuleList([table, middle, *heads]).double()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 5, (4, 2))

    def forward(modules: nn.ModuleList) -> tuple[list[torch.Tensor], torch.Tensor]:
        features = modules[1](modules[0](ids))
        features = features.mean(1) if stem == "embedding" else features
        return [head(features).pow(2).mean() for head in modules[2:]], features

    weights = torch.tensor([0.3, 1.7], dtype=torch.float64)
    reference_losses, _ = forward(reference)
    trunk = [*reference[0].parameters(), *reference[1].parameters()]
    rows = [torch.autograd.grad(loss, trunk, retain_graph=True) for loss in reference_losses]
    jacobian = torch.stack([torch.cat([g.to_dense().flatten() for g in row]) for row in rows])
    head_grads = [
        torch.autograd.grad(loss, [*h.parameters()], retain_graph=True)
        for loss, h in zip(reference_losses, reference[2:], strict=True)
    ]
    params = [*model.parameters()]
    previous = [torch.randn_like(p) for p in params]
    for param, grad in zip(params, previous, strict=True):
        param.grad = grad.clone()
    engine = Engine(*([table] if hooked == "whole trunk" else []), middle, batch_dim=None)
    losses, features = forward(model)
    aggregator = Constant(weights)
    mtl_backward(losses, features, A=aggregator, engine=engine, parallel_chunk_size=chunk_size)
    assert all(p.grad.layout == torch.strided for p in params)  # type: ignore[union-attr]
    updates = [p.grad - g for p, g in zip(params, previous, strict=True)]  # type: ignore[operator]
    trunk_update = torch.cat([u.flatten() for u in updates[: len(trunk)]])
    torch.testing.assert_close(trunk_update, weights @ jacobian)
    expected = [g for grads in head_grads for g in grads]
    for update, grad in zip(updates[len(trunk) :], expected, strict=True):
        torch.testing.assert_close(update, grad)


class _Propagate(nn.Module):
    """A graph convolution of the user's own (the engine's generic rule): ``A X W`` with a
    sparse adjacency matrix ``A`` inside the module."""

    def __init__(self, adjacency: torch.Tensor, features: int, width: int) -> None:
        super().__init__()
        self.adjacency = adjacency
        self.weight = nn.Parameter(torch.randn(features, width) / features**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.adjacency, x @ self.weight)


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize("trunk_kind", ["linear", "generic"])
@pytest.mark.parametrize("route", ["compute_gramian", "backward", "mtl_backward"])
def test_a_graph_neural_network_trunk(layout: str, trunk_kind: str, route: str) -> None:
    """Per task, a trunk of graph convolutions: products with a sparse adjacency matrix between
    the hooked Linear layers, or inside modules of the generic rule. The batched backward
    failed with torch's "expand is unsupported for Sparse tensors"; the rows are pulled back
    one by one now: the Gramian is ``J J^T`` and the update UPGrad's of ``J``, as computed row
    by row with autograd. (A generic-rule module with a CSR product is refused: torch.func,
    which re-runs it, cannot differentiate CSR products.)"""
    torch.manual_seed(0)
    adjacency = _zoo.adjacency(layout)
    if trunk_kind == "linear":
        trunk: nn.Module = _zoo.GCN(adjacency).double()
    else:
        trunk = nn.Sequential(
            _Propagate(adjacency, 3, 4), nn.ReLU(), _Propagate(adjacency, 4, 4)
        ).double()
    heads = [nn.Linear(4, 1).double() for _ in range(3)]
    x = torch.randn(7, 3, dtype=torch.float64)
    shared = list(trunk.parameters())
    with Engine(trunk, batch_dim=None) as engine:
        features = trunk(x)
        losses = [head(features).pow(2).mean() for head in heads]
        jacobian = _zoo.rows_by_autograd(losses, shared)
        if trunk_kind == "generic" and layout == "csr":
            # (torch.func, which re-runs the module, fails on CSR products: a clear refusal)
            with pytest.raises(RuntimeError, match=r"(?s)re-runs it.*CSR"):
                engine.compute_gramian(torch.stack(losses))
            return
        if route == "compute_gramian":
            torch.testing.assert_close(
                engine.compute_gramian(torch.stack(losses)), jacobian @ jacobian.T
            )
            return
        if route == "backward":
            engine.backward(torch.stack(losses), UPGradWeighting())
        else:
            mtl_backward(losses, features, A=UPGrad(), engine=engine)
    update = torch.cat([p.grad.reshape(-1) for p in shared])  # type: ignore[union-attr]
    torch.testing.assert_close(update, UPGrad()(jacobian))


def test_an_unseen_sparse_product_names_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch before 2.10 cannot show jacflow a product's saved sparse operand (emulated on later
    releases): the engine's batched backward then fails inside torch, and the error names the
    release that routes it and ``mtl_backward``'s row-by-row option, which gives UPGrad's
    update of the Jacobian computed row by row with autograd. No ``.grad`` is written by the
    failed step."""
    _zoo.hide_sparse_operands(monkeypatch)
    torch.manual_seed(0)
    adjacency = _zoo.adjacency("coo")
    first, second = nn.Linear(3, 4).double(), nn.Linear(4, 4).double()
    heads = [nn.Linear(4, 1).double() for _ in range(3)]
    x = torch.randn(7, 3, dtype=torch.float64)
    shared = [*first.parameters(), *second.parameters()]
    every = [*shared, *(p for head in heads for p in head.parameters())]
    hint = r"(?s)Sparse tensors.*torch 2\.10 and later.*engine=engine, parallel_chunk_size=1"

    def step() -> tuple[Tensor, list[Tensor]]:
        features = adjacency @ second(torch.relu(adjacency @ first(x)))
        return features, [head(features).pow(2).mean() for head in heads]

    with Engine(first, second, batch_dim=None) as engine:
        features, losses = step()
        with pytest.raises(RuntimeError, match=hint):
            mtl_backward(losses, features, A=UPGrad(), engine=engine)
        assert all(p.grad is None for p in every)
        features, losses = step()
        jacobian = _zoo.rows_by_autograd(losses, shared)
        mtl_backward(losses, features, A=UPGrad(), engine=engine, parallel_chunk_size=1)
    update = torch.cat([p.grad.reshape(-1) for p in shared])  # type: ignore[union-attr]
    torch.testing.assert_close(update, UPGrad()(jacobian))


def test_a_graph_neural_network_per_node_is_refused() -> None:
    """Per sample (the nodes), the adjacency matrix mixes the samples: the engine's check
    refuses it clearly (it ran its probe row by row), and no ``.grad`` is written."""
    model = _zoo.GCN(_zoo.adjacency("coo")).double()
    with Engine(model, batch_dim=0) as engine:
        losses = model(torch.randn(7, 3, dtype=torch.float64)).pow(2).sum(1)
        with pytest.raises(ValueError, match="at other samples than their own"):
            engine.backward(losses, UPGradWeighting())
    assert all(p.grad is None for p in model.parameters())


def test_a_hook_on_losses_stacked_from_scalars_runs() -> None:
    """Losses stacked from the tasks' scalars take a route with one backward per head, which
    starts below the stack: a gradient hook on the stacked losses was skipped there (the
    Gramian without it), while the batched route and autograd run it."""
    trunk, heads, x = _trunk_and_heads()
    engine = Engine(trunk, batch_dim=None)
    features = trunk(x)
    losses = torch.stack([head(features).pow(2).mean() for head in heads])
    scale = torch.tensor([0.5, 3.0], dtype=torch.float64)
    losses.register_hook(lambda grad: grad * scale)
    jacobian = reference_jacobian(losses, list(trunk.parameters()))  # (the hook runs in it)
    torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)
