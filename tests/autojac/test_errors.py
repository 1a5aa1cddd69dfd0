"""Bad input: a clear error that names the argument, and nothing lost in ``.grad``/``.jac``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from jacflow import backward, jac, jac_to_grad, mtl_backward
from jacflow.aggregation import (
    Aggregator,
    ConFIG,
    Constant,
    Krum,
    Mean,
    NashMTL,
    TrimmedMean,
    UPGrad,
)


class _Exploding(Aggregator):
    def forward(self, matrix: Tensor) -> Tensor:
        raise RuntimeError("aggregator failed midway")


def _setup() -> tuple[Tensor, Tensor, list[Tensor]]:
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    v = torch.tensor([0.5], requires_grad=True)
    w.grad = torch.tensor([7.0, 7.0])
    w.jac = torch.ones(2, 2)  # type: ignore[attr-defined]
    outputs = [(w * v).sum(), (w**2).sum()]
    return w, v, outputs


def _snapshot(*tensors: Tensor) -> list[tuple[Tensor | None, Tensor | None]]:
    out = []
    for t in tensors:
        grad = None if t.grad is None else t.grad.clone()
        jac_field = getattr(t, "jac", None)
        out.append((grad, None if jac_field is None else jac_field.clone()))
    return out


CASES: list[tuple[str, type[Exception], str, Callable[[Tensor, Tensor, list[Tensor]], object]]] = [
    ("empty tensors", ValueError, "`tensors` cannot be empty", lambda w, v, o: backward([])),
    ("empty outputs", ValueError, "`outputs` cannot be empty", lambda w, v, o: jac([], [w])),
    ("no grad_fn", ValueError, "has no grad_fn", lambda w, v, o: backward([w.detach() * 2])),
    (
        "input without grad",
        ValueError,
        r"`inputs\[0\]`.*does not require grad",
        lambda w, v, o: backward(o, [torch.ones(2)]),
    ),
    (
        "duplicated tensors",
        ValueError,
        "distinct tensors",
        lambda w, v, o: backward([o[0], o[0]], [w], A=Mean()),
    ),
    (
        "jac_tensors length",
        ValueError,
        "one tensor per element of `tensors`",
        lambda w, v, o: backward(o, [w], jac_tensors=[torch.ones(1)], A=Mean()),
    ),
    (
        "jac_tensors trailing shape",
        ValueError,
        r"`jac_tensors\[0\]` must have shape",
        lambda w, v, o: backward(o, [w], jac_tensors=[torch.ones(1, 2), torch.ones(1)], A=Mean()),
    ),
    (
        "jac_tensors of a scalar",
        ValueError,
        r"`jac_tensors\[0\]` must have shape \[m, \*tensors\[0\]\.shape\] = \[m\], received \(\)\.",
        lambda w, v, o: backward(o, [w], jac_tensors=[torch.ones(()), torch.ones(1)], A=Mean()),
    ),
    (
        "jac_tensors rows",
        ValueError,
        "same number of rows",
        lambda w, v, o: backward(o, [w], jac_tensors=[torch.ones(1), torch.ones(2)], A=Mean()),
    ),
    (
        "chunk 0",
        ValueError,
        "parallel_chunk_size",
        lambda w, v, o: backward(o, [w], parallel_chunk_size=0),
    ),
    (
        "chunk -1",
        ValueError,
        "parallel_chunk_size",
        lambda w, v, o: jac(o, [w], parallel_chunk_size=-1),
    ),
    (
        "chunk float",
        TypeError,
        "parallel_chunk_size",
        lambda w, v, o: backward(o, [w], parallel_chunk_size=2.0),  # type: ignore[arg-type]
    ),
    ("A not aggregator", TypeError, "`A` must be", lambda w, v, o: backward(o, [w], A="upgrad")),  # type: ignore[arg-type]
    ("A raises", RuntimeError, "midway", lambda w, v, o: backward(o, [w, v], A=_Exploding())),
    (
        ".jac rows mismatch",
        ValueError,
        "Cannot accumulate",
        lambda w, v, o: backward([*o, (w**3).sum()], [w]),
    ),
    (
        "jac_to_grad without jac",
        ValueError,
        r"No tensor of `tensors` \(shapes \(1,\)\) has a `.jac`",
        lambda w, v, o: jac_to_grad([v], Mean()),
    ),
    ("jac_to_grad empty", ValueError, "cannot be empty", lambda w, v, o: jac_to_grad([], Mean())),
    (
        "jac_to_grad without A",
        TypeError,
        "needs an aggregator",
        lambda w, v, o: jac_to_grad([w], None),
    ),
    (
        "jac_to_grad bad A",
        TypeError,
        "`A` must be",
        lambda w, v, o: jac_to_grad([w], "upgrad"),  # type: ignore[arg-type]
    ),
    (
        "jac_to_grad bad aggregator",
        TypeError,
        "`aggregator` must be",
        lambda w, v, o: jac_to_grad([w], aggregator=Mean),  # type: ignore[arg-type]
    ),
    (
        "jac_to_grad A and aggregator",
        TypeError,
        "twice",
        lambda w, v, o: jac_to_grad([w], Mean(), aggregator=Mean()),
    ),
    (
        "jac_to_grad optimize not bool",
        TypeError,
        "optimize_gramian_computation",
        lambda w, v, o: jac_to_grad([w], Mean(), optimize_gramian_computation=1),  # type: ignore[arg-type]
    ),
    (
        "complex tensors",
        ValueError,
        r"`tensors\[0\]` is complex.*view_as_real",
        lambda w, v, o: backward([w * (1 + 2j)], [w], A=Mean()),
    ),
    (
        "complex outputs",
        ValueError,
        r"`outputs\[1\]` is complex",
        lambda w, v, o: jac([o[0], w * 1j], [w]),
    ),
    (
        "complex jac_tensors",
        ValueError,
        r"`jac_tensors\[0\]` is complex",
        lambda w, v, o: backward([w * 3], [w], jac_tensors=[torch.eye(2) * 1j]),
    ),
    (
        "outputs computed under no_grad, explicit inputs",
        ValueError,
        r"No tensor of `tensors` requires grad.*torch.no_grad",
        lambda w, v, o: backward([w.detach() * 2, v.detach().sum()], [w, v], A=UPGrad()),
    ),
    (
        "jac of outputs computed under no_grad",
        ValueError,
        r"No tensor of `outputs` requires grad",
        lambda w, v, o: jac([o[0].detach()], [w]),
    ),
    (
        "retain_graph not bool",
        TypeError,
        "`retain_graph` must be a bool or None, received 'no'",
        lambda w, v, o: jac(o, [w], retain_graph="no"),  # type: ignore[arg-type]
    ),
    (
        "create_graph None",
        TypeError,
        "`create_graph` must be a bool, received None",
        lambda w, v, o: backward(o, [w], create_graph=None),  # type: ignore[arg-type]
    ),
    (
        "retain_jac not bool",
        TypeError,
        "`retain_jac` must be a bool",
        lambda w, v, o: jac_to_grad([w], Mean(), retain_jac="yes"),  # type: ignore[arg-type]
    ),
    (  # (its type was named: <class 'abc.ABCMeta'>)
        "aggregator class",
        TypeError,
        r"received the class UPGrad \(an instance is made by calling it: UPGrad\(\)\)",
        lambda w, v, o: backward(o, [w], A=UPGrad),  # type: ignore[arg-type]
    ),
    (
        "aggregator class to jac_to_grad",
        TypeError,
        r"received the class Mean .*Mean\(\)",
        lambda w, v, o: jac_to_grad([w], Mean),  # type: ignore[arg-type]
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_error_and_nothing_lost(
    case: tuple[str, type[Exception], str, Callable[[Tensor, Tensor, list[Tensor]], object]],
) -> None:
    _, error, pattern, call = case
    w, v, outputs = _setup()
    before = _snapshot(w, v)
    with pytest.raises(error, match=pattern):
        call(w, v, outputs)
    for (g0, j0), (g1, j1) in zip(before, _snapshot(w, v)):
        assert (g0 is None and g1 is None) or torch.equal(g0, g1)  # type: ignore[arg-type]
        assert (j0 is None and j1 is None) or torch.equal(j0, j1)  # type: ignore[arg-type]


def test_a_jac_that_is_not_a_float_tensor_is_refused_before_writing() -> None:
    w, v, outputs = _setup()
    v.jac = [[1.0]]  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"`inputs\[1\]\.jac` must be a Tensor"):
        backward(outputs, [w, v])
    assert torch.equal(w.jac, torch.ones(2, 2))  # type: ignore[attr-defined]
    v.jac = torch.ones(2, 1, dtype=torch.long)  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"`tensors\[1\]\.jac` must be a floating-point"):
        jac_to_grad([w, v], Mean())
    assert torch.equal(w.grad, torch.tensor([7.0, 7.0]))  # type: ignore[arg-type]
    assert torch.equal(w.jac, torch.ones(2, 2))  # type: ignore[attr-defined]


def test_mtl_tasks_params_that_is_not_a_sequence_is_refused() -> None:
    W = torch.randn(2, 3, requires_grad=True)
    features = W @ torch.ones(3)
    with pytest.raises(TypeError, match="`tasks_params` must be a sequence"):
        mtl_backward([features.sum()], features, tasks_params=5)  # type: ignore[arg-type]
    assert W.grad is None


def test_jac_to_grad_differing_rows() -> None:
    a, b = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    a.jac, b.jac = torch.ones(2, 2), torch.ones(3, 3)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="same number of rows"):
        jac_to_grad([a, b], Mean())
    assert a.grad is None and b.grad is None and hasattr(a, "jac")


def test_jac_to_grad_names_the_shape_of_a_scalars_jac() -> None:
    """The expected shape of a scalar's ``.jac`` read ``[m, ]``."""
    p = torch.tensor(1.0, requires_grad=True)
    p.jac = torch.ones(())  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"= \[m\], received \(\)\."):
        jac_to_grad([p], Mean())
    assert p.grad is None and torch.equal(p.jac, torch.ones(()))  # type: ignore[attr-defined]


def _two_params_with_jac() -> tuple[Tensor, Tensor, Tensor]:
    """``p1``, ``p2`` with ``.jac`` from backward, and the reference Jacobian ``[m, n]``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    p1 = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    p2 = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)

    def fn(a: Tensor, b: Tensor) -> Tensor:
        h = torch.tanh(x @ a) @ b
        return torch.stack([h[:2].sum(), -h[2:].sum() + (b**2).sum()])

    backward(fn(p1, p2), [p1, p2])
    j1, j2 = torch.func.jacrev(fn, argnums=(0, 1))(p1.detach(), p2.detach())
    return p1, p2, torch.cat([j1.flatten(1), j2], dim=1)


def test_jac_to_grad_refuses_duplicates_before_writing() -> None:
    """A tensor listed twice was aggregated twice, then `del t.jac` failed after the writes."""
    p1, p2, matrix = _two_params_with_jac()
    before = _snapshot(p1, p2)
    with pytest.raises(ValueError, match=r"`tensors` must contain distinct.*\[0\].*\[2\]"):
        jac_to_grad([p1, p2, p1], UPGrad())
    assert p1.grad is None and p2.grad is None
    for (_, j0), (_, j1) in zip(before, _snapshot(p1, p2)):
        assert torch.equal(j0, j1)  # type: ignore[arg-type]
    jac_to_grad([p1, p2], UPGrad())
    expected = UPGrad()(matrix)
    torch.testing.assert_close(p1.grad, expected[:12].reshape(3, 4))
    torch.testing.assert_close(p2.grad, expected[12:])


@pytest.mark.parametrize(
    "stale", [torch.zeros(2, 7), torch.zeros(2, 4, 1), torch.zeros(4), torch.zeros(3, 5)]
)
def test_jac_to_grad_checks_every_jac_shape_before_writing(stale: Tensor) -> None:
    """A wrong `.jac` on the second tensor failed after the first tensor's `.grad` was written."""
    p1, p2, matrix = _two_params_with_jac()
    p1.grad = torch.ones_like(p1)
    good = p2.jac  # type: ignore[attr-defined]
    p2.jac = stale.double()  # type: ignore[attr-defined]
    before = _snapshot(p1, p2)
    with pytest.raises(ValueError, match=r"`tensors\[1\].jac` must have shape .* = \[m, 4\]"):
        jac_to_grad([p1, p2], Mean())
    for (g0, j0), (g1, j1) in zip(before, _snapshot(p1, p2)):
        assert (g0 is None and g1 is None) or torch.equal(g0, g1)  # type: ignore[arg-type]
        assert torch.equal(j0, j1)  # type: ignore[arg-type]
    p2.jac = good  # type: ignore[attr-defined]
    jac_to_grad([p1, p2], Mean())
    torch.testing.assert_close(p1.grad, 1 + matrix.mean(0)[:12].reshape(3, 4))


_REFUSING_TWO_ROWS = [
    Krum(1),
    Constant(torch.ones(3)),
    NashMTL(n_tasks=3),
    TrimmedMean(1),
    UPGrad(pref_vector=torch.ones(3)),
    ConFIG(pref_vector=torch.ones(3)),
]


@pytest.mark.parametrize("aggregator", _REFUSING_TWO_ROWS, ids=str)
@pytest.mark.parametrize("via_jac", [False, True])
def test_rows_refused_by_the_aggregator_before_differentiating(
    aggregator: Aggregator, via_jac: bool
) -> None:
    """An aggregator that refuses m = 2 rows raised after the differentiation had freed the
    graph: a second call failed ("backward through the graph a second time"). Now the graph
    is left intact; `jac_to_grad` refuses them the same way, before aggregating."""
    w, v, outputs = _setup()
    before = _snapshot(w, v)
    if via_jac:
        del w.jac  # type: ignore[attr-defined]
        backward(outputs, [w, v], retain_graph=True)
        jac_fields = [w.jac.clone(), v.jac.clone()]  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match=r"rows|objectives|entries"):
            jac_to_grad([w, v], aggregator)
        assert torch.equal(w.jac, jac_fields[0]) and torch.equal(v.jac, jac_fields[1])  # type: ignore[attr-defined]
        del w.jac, v.jac  # type: ignore[attr-defined]
    else:
        with pytest.raises(ValueError, match=r"rows|objectives|entries"):
            backward(outputs, [w, v], A=aggregator)
        assert torch.equal(w.jac, before[0][1])  # type: ignore[attr-defined, arg-type]
    after = _snapshot(w, v)
    assert torch.equal(after[0][0], before[0][0]) and v.grad is None  # type: ignore[arg-type]
    backward(outputs, [w, v], A=UPGrad())  # the graph is still there
    j_w, j_v = torch.func.jacrev(
        lambda a, b: torch.stack([(a * b).sum(), (a**2).sum()]), argnums=(0, 1)
    )(w.detach(), v.detach())
    update = UPGrad()(torch.cat([j_w, j_v], dim=1))
    torch.testing.assert_close(w.grad, before[0][0] + update[:2])  # type: ignore[operator]
    torch.testing.assert_close(v.grad, update[2:])


def _mtl_setup() -> tuple[torch.nn.Linear, torch.nn.Linear, Tensor, list[Tensor]]:
    trunk, head = torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)
    features = trunk(torch.ones(4, 2))
    losses = [head(features).mean(), features.pow(2).mean()]
    return trunk, head, features, losses


def test_mtl_errors_and_nothing_lost() -> None:
    trunk, head, features, losses = _mtl_setup()
    with pytest.raises(ValueError, match="`features` cannot be empty"):
        mtl_backward(losses, [], A=Mean())
    with pytest.raises(ValueError, match="one iterable of parameters per loss"):
        mtl_backward(losses, features, A=Mean(), tasks_params=[list(head.parameters())])
    with pytest.raises(ValueError, match="both in `tasks_params"):
        mtl_backward(
            losses,
            features,
            A=Mean(),
            tasks_params=[[trunk.weight], []],
            shared_params=trunk.parameters(),
        )
    with pytest.raises(ValueError, match="must be a scalar"):
        mtl_backward([features.sum(1), losses[1]], features)
    with pytest.raises(TypeError, match="`A` must be"):
        mtl_backward(losses, features, A=3)  # type: ignore[arg-type]
    # (the way out was `.requires_grad_()`, which on a detached copy leaves the trunk out)
    with pytest.raises(ValueError, match=r"compute it from the shared parameters.*not detached"):
        mtl_backward(losses, features.detach(), A=Mean())
    for p in [*trunk.parameters(), *head.parameters()]:
        assert p.grad is None and not hasattr(p, "jac")


@pytest.mark.parametrize("where", ["shared_params", "tasks_params"])
@pytest.mark.parametrize("aggregate", [True, False])
def test_mtl_repeated_params_are_taken_once_like_backward(where: str, aggregate: bool) -> None:
    """A parameter listed twice is taken once, as by ``backward``, torch and TorchJD (it was
    refused; before that, counted twice)."""
    results = []
    for repeat in (False, True):
        torch.manual_seed(0)
        trunk, head, features, losses = _mtl_setup()
        shared = [trunk.weight, trunk.bias]
        tasks: list[list[Tensor]] = [list(head.parameters()), []]
        if repeat and where == "shared_params":
            shared.append(trunk.weight)
        elif repeat:
            tasks[0].append(head.weight)
        A = Mean() if aggregate else None
        mtl_backward(losses, features, A=A, tasks_params=tasks, shared_params=shared)
        params = [*trunk.parameters(), *head.parameters()]
        heads = {id(p) for p in head.parameters()}
        results.append([p.grad if aggregate or id(p) in heads else p.jac for p in params])
    for once, twice in zip(*results, strict=True):
        torch.testing.assert_close(twice, once)


def test_mtl_rows_refused_by_the_aggregator_before_differentiating() -> None:
    """An aggregator that refuses the number of tasks does so before the graph is freed: the
    retry with another aggregator works."""
    trunk, head, features, losses = _mtl_setup()
    with pytest.raises(ValueError, match="Krum"):
        mtl_backward(losses, features, A=Krum(5))
    assert all(p.grad is None for p in [*trunk.parameters(), *head.parameters()])
    mtl_backward(losses, features, A=Mean())
    assert trunk.weight.grad is not None


def test_mtl_stacked_losses_told_to_pass_one_per_task() -> None:
    """One tensor of the tasks' losses: told to pass them one per task, not to reduce it (a
    mean would merge the tasks)."""
    trunk, head, features, losses = _mtl_setup()
    with pytest.raises(ValueError, match=r"one tensor of shape \(2,\).*losses.unbind\(\)"):
        mtl_backward(torch.stack(losses), features, A=Mean())
    with pytest.raises(ValueError, match=r"shape \(2, 1\).*a list"):
        mtl_backward(torch.stack(losses).unsqueeze(1), features, A=Mean())
    for p in [*trunk.parameters(), *head.parameters()]:
        assert p.grad is None and not hasattr(p, "jac")


@pytest.mark.parametrize("engine", [False, True])
def test_mtl_loss_using_a_shared_parameter_directly(engine: bool) -> None:
    """A loss that reads a trunk parameter outside ``features`` (a penalty on it), with both
    parameter lists left to their defaults: the message gives that cause (and the engine's
    name of the parameter), not a clash between lists the user did not pass."""
    from jacflow.autogram import Engine

    trunk, head = torch.nn.Sequential(torch.nn.Linear(2, 3)), torch.nn.Linear(3, 1)
    hooks = Engine(trunk, batch_dim=None) if engine else None
    features = trunk(torch.ones(4, 2))
    losses = [head(features).mean() + trunk[0].bias.pow(2).sum(), features.pow(2).mean()]
    name = "the parameter Sequential.0.bias" if engine else r"a parameter of shape \(3,\)"
    advice = (
        r"an activation of the trunk, pass it as a feature too \(`features=\[h, f\]`\).*The "
        "engine sees its modules' parameters"
        if engine
        else "pass what the loss reads"
    )
    with pytest.raises(
        ValueError, match=rf"`losses\[0\]` uses {name} outside `features`.*{advice}"
    ):
        mtl_backward(losses, features, A=Mean(), engine=hooks)
    for p in [*trunk.parameters(), *head.parameters()]:
        assert p.grad is None and not hasattr(p, "jac")


def test_mtl_explicit_params_refuse_a_shared_parameter_read_outside_the_features() -> None:
    """With ``tasks_params`` given, a loss reading a shared parameter directly lost that use
    (its ``.grad`` 0 where the engine's path gives the gradient), silently: refused, as with
    the default lists; passing it as a feature is exact."""
    trunk, head, features, losses = _mtl_setup()
    tau = torch.tensor(1.5, requires_grad=True)
    scaled = [loss * tau for loss in losses]
    shared = [*trunk.parameters(), tau]
    tasks = [list(head.parameters()), []]
    with pytest.raises(ValueError, match=r"uses a parameter of shape \(\) outside `features`"):
        mtl_backward(scaled, features, A=Mean(), tasks_params=tasks, shared_params=shared)
    assert tau.grad is None and all(p.grad is None for p in trunk.parameters())
    mtl_backward(scaled, [features, tau], A=Mean(), tasks_params=tasks, shared_params=shared)
    # (d mean(L_i tau) / d tau = mean(L_i))
    torch.testing.assert_close(tau.grad, torch.stack(losses).mean().detach())


@pytest.mark.parametrize("explicit", [False, True])
def test_mtl_loss_reading_a_sibling_output_of_a_feature_is_refused(explicit: bool) -> None:
    """``f1, f2 = out.chunk(2)``, ``features=f1``, a loss reading ``f2``: the walk stopped at
    the chunk's node for both outputs, so that path to the trunk was neither counted nor
    refused (the trunk's update off, silently). Passing both outputs is exact."""
    torch.manual_seed(0)
    trunk, head = torch.nn.Linear(2, 4), torch.nn.Linear(2, 1)
    x = torch.randn(5, 2)

    def setup() -> tuple[Tensor, Tensor, list[Tensor]]:
        first, second = trunk(x).chunk(2, dim=1)
        return first, second, [head(first).pow(2).mean(), second.sin().mean()]

    first, _, losses = setup()
    tasks = [list(head.parameters()), []] if explicit else None
    with pytest.raises(ValueError, match="another output of the operation that made a feature"):
        mtl_backward(losses, first, A=Mean(), tasks_params=tasks)
    assert all(p.grad is None for p in [*trunk.parameters(), *head.parameters()])
    first, second, losses = setup()
    expected = torch.autograd.grad(sum(losses) / 2, trunk.weight, retain_graph=True)[0]
    mtl_backward(losses, [first, second], A=Mean(), tasks_params=tasks)
    torch.testing.assert_close(trunk.weight.grad, expected)


@pytest.mark.parametrize("call", ["backward", "mtl_backward", "jac_to_grad"])
@pytest.mark.parametrize("A", [UPGrad(), Mean()], ids=["upgrad", "mean"])
def test_complex_inputs_with_an_aggregator_are_refused_before_any_write(
    call: str, A: Aggregator
) -> None:
    """Gramian-based aggregators failed deep inside (``NotImplementedError`` for
    ``max_values_cpu``): refused up front, naming the way out, with nothing written."""
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    z = torch.tensor([1 + 2j, -1 + 0.5j], requires_grad=True)
    w.grad = torch.tensor([7.0, 7.0])
    losses = [(z.abs() ** 2).sum() + w.sum(), (z.real * 3 - z.imag).sum() * w.prod()]
    name = {"backward": "inputs", "mtl_backward": "shared_params", "jac_to_grad": "tensors"}
    with pytest.raises(ValueError, match=rf"`{name[call]}\[1\]` .* is complex.*view_as_real"):
        if call == "backward":
            backward(losses, [w, z], A=A)
        elif call == "mtl_backward":
            features = torch.stack([z.abs().sum(), w.sum()])
            mtl_backward([features.sum(), features.prod()], features, A=A, shared_params=[w, z])
        else:
            backward(losses, [w, z], retain_graph=True)
            jac_to_grad([w, z], A)
    if call == "jac_to_grad":
        assert z.jac.is_complex()  # type: ignore[attr-defined]
    assert torch.equal(w.grad, torch.tensor([7.0, 7.0]))
    assert z.grad is None
    (rows,) = jac(losses, [z])  # (the graph is intact; without A, the complex Jacobian)
    assert rows.is_complex()


def test_an_aggregator_passed_as_inputs_is_told_to_go_to_A() -> None:
    """TorchJD 0.3-0.7's ``backward(tensors, A)``: jacflow's second argument is ``inputs``."""
    w, _, outputs = _setup()
    with pytest.raises(TypeError, match=r"pass the aggregator as `A=`"):
        backward(outputs, UPGrad())  # type: ignore[arg-type]
    assert torch.equal(w.grad, torch.tensor([7.0, 7.0]))  # type: ignore[arg-type]
    backward(outputs, A=UPGrad())
