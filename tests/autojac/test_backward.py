"""``backward``: ``.jac`` accumulation, aggregation into ``.grad``, and the seeds' examples."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from jacflow import backward, jac, jac_to_grad
from jacflow.aggregation import (
    IMTLG,
    MGDA,
    Aggregator,
    AlignedMTL,
    ConFIG,
    Constant,
    DualProj,
    GradDrop,
    Mean,
    Sum,
    UPGrad,
)
from jacflow.linalg import QuadprogProjector
from tests.autojac import _zoo
from tests.autojac._held import assert_left_alone, torch_leaves_alone
from tests.autojac._zoo import ZOO, Case, reference_jacobians


def test_seed_000_upgrad_example() -> None:
    param = torch.tensor([1.0, 2.0], requires_grad=True)
    y1 = torch.tensor([-1.0, 1.0]) @ param
    y2 = (param**2).sum()
    backward([y1, y2], [param], A=UPGrad())
    torch.testing.assert_close(param.grad, torch.tensor([0.5, 2.5]))


def test_seed_003_004_sum_of_gradients() -> None:
    """OneFlow / R torch ``backward(list(y, b))``: sum of gradients, x.grad == 2, a.grad == 3."""
    x = torch.tensor([1.0], requires_grad=True)
    y = 2 * x
    a = torch.tensor([1.0], requires_grad=True)
    b = 3 * a
    backward([y, b], A=Sum())
    torch.testing.assert_close(x.grad, torch.tensor([2.0]))
    torch.testing.assert_close(a.grad, torch.tensor([3.0]))


def test_grad_tensors_as_jac_tensors() -> None:
    """``grad_tensors`` of seeds 003/004 is ``jac_tensors`` with a single row."""
    x = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    y = x**2
    v = torch.tensor([1.0, 0.1, -3.0])
    backward(y, jac_tensors=v[None], A=Sum())
    torch.testing.assert_close(x.grad, 2 * x.detach() * v)


def test_none_grad_tensors_of_seeds_003_004() -> None:
    """``None`` in ``grad_tensors`` (seeds 003/004: for a scalar tensor, or one that does not
    require grad) means in ``jac_tensors`` what it means in torch's ``backward``."""
    x = torch.tensor([1.0, 2.0], requires_grad=True)

    def outputs() -> list[Tensor]:
        return [x**2, (x**3).sum(), torch.ones(3)]  # (the last one does not require grad)

    v = torch.tensor([1.0, 10.0])
    torch.autograd.backward(outputs()[:2], [v, None])
    expected, x.grad = x.grad, None
    backward(outputs(), [x], A=Sum(), jac_tensors=[v[None], None, None])
    torch.testing.assert_close(x.grad, expected)
    # (with m rows, each row gets the scalar's gradient: the Jacobian's rows one by one)
    rows = torch.tensor([[1.0, 0.0], [0.0, 10.0]])
    (jacobian,) = jac(outputs()[:2], [x], jac_outputs=[rows, None])
    reference = [
        torch.autograd.grad([x**2, (x**3).sum()], [x], [r, torch.ones(())])[0] for r in rows
    ]
    torch.testing.assert_close(jacobian, torch.stack(reference))
    # (every entry None: one row, the sum of the outputs' gradients, as torch's default)
    x.grad = None
    backward([(x**2).sum(), (x**3).sum()], jac_tensors=[None, None], A=UPGrad())
    torch.testing.assert_close(x.grad, 2 * x.detach() + 3 * x.detach() ** 2)


def test_none_jac_tensors_for_a_tensor_of_several_elements_are_refused() -> None:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    x.grad = before = torch.tensor([5.0, 6.0])
    with pytest.raises(ValueError, match=r"`jac_tensors\[0\]` is None.*shape \(2,\).*\[m, 2\]"):
        backward([x**2, x.sum()], jac_tensors=[None, torch.ones(1)], A=Sum())
    assert x.grad is before and torch.equal(before, torch.tensor([5.0, 6.0]))
    with pytest.raises(TypeError, match=r"`jac_outputs\[1\]` must be a Tensor or None"):
        jac([x**2, x.sum()], [x], jac_outputs=[torch.ones(1, 2), 1.0])  # type: ignore[list-item]
    # (the messages name the entries given, not a None filled in)
    with pytest.raises(ValueError, match=r"`jac_tensors\[1\]` is complex"):
        backward([x.sum(), x**2], jac_tensors=[None, torch.ones(1, 2, dtype=torch.cfloat)])
    with pytest.raises(ValueError, match=r"`jac_outputs\[1\]` has 4, `jac_outputs\[2\]` has 5"):
        jac([x.sum(), x**2, x**3], [x], jac_outputs=[None, torch.ones(4, 2), torch.ones(5, 2)])
    assert x.grad is before and torch.equal(before, torch.tensor([5.0, 6.0]))


@pytest.mark.parametrize("case", ZOO, ids=lambda c: c.name)
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_jac_fields_match_reference(case: Case, chunk: int | None) -> None:
    inputs, fn = case.build(torch.float64)
    backward(fn(*inputs), inputs, parallel_chunk_size=chunk)
    for t, expected in zip(inputs, reference_jacobians(fn, inputs)):
        assert t.grad is None
        if case.name == "unused_input" and t.shape == (2, 2):
            # (no row reaches it: it gets no `.jac`, as torch's backward writes it no `.grad`)
            assert not hasattr(t, "jac")
            continue
        torch.testing.assert_close(t.jac, expected)  # type: ignore[attr-defined]


def test_jac_accumulates() -> None:
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    backward([w.sum(), (w**2).sum()], [w])
    backward([w.sum(), (w**2).sum()], [w])
    torch.testing.assert_close(w.jac, 2 * torch.tensor([[1.0, 1.0], [2.0, 4.0]]))  # type: ignore[attr-defined]


@pytest.mark.parametrize("case", ZOO, ids=lambda c: c.name)
@pytest.mark.parametrize("aggregator", [Mean(), UPGrad()], ids=str)
def test_aggregated_grad_matches_reference(case: Case, aggregator: object, on_device: str) -> None:
    inputs, fn = case.build(torch.float64)
    for t in inputs:
        t.grad = torch.ones_like(t)  # accumulation onto an existing gradient
    backward(fn(*inputs), inputs, A=aggregator)  # type: ignore[arg-type]
    expected = reference_jacobians(fn, inputs)
    matrix = torch.cat([e.flatten(1) for e in expected], dim=1)
    update = aggregator(matrix)  # type: ignore[operator]
    offset = 0
    for t in inputs:
        piece = update[offset : offset + t.numel()].reshape(t.shape)
        offset += t.numel()
        torch.testing.assert_close(t.grad, 1 + piece)


def test_backward_then_jac_to_grad_equals_backward_with_aggregator() -> None:
    inputs, fn = ZOO[0].build(torch.float64)
    backward(fn(*inputs), inputs)
    weights = jac_to_grad(inputs, UPGrad())
    assert weights is not None and weights.shape == (6,)
    via_jac = [t.grad.clone() for t in inputs]  # type: ignore[union-attr]
    assert all(not hasattr(t, "jac") for t in inputs)
    for t in inputs:
        t.grad = None
    backward(fn(*inputs), inputs, A=UPGrad())
    for t, g in zip(inputs, via_jac):
        torch.testing.assert_close(t.grad, g)


def test_create_graph_makes_grad_differentiable() -> None:
    x = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    backward([(x**3).sum(), x.sin().sum()], [x], A=Mean(), create_graph=True)
    grad = x.grad
    assert grad is not None and grad.requires_grad
    (second,) = torch.autograd.grad(grad.sum(), x)
    expected = torch.autograd.functional.hessian(
        lambda t: 0.5 * ((t**3).sum() + t.sin().sum()), x.detach()
    ).sum(0)
    torch.testing.assert_close(second, expected)


def _hessian_losses(x: Tensor) -> list[Tensor]:
    return [(x**3).sum(), x.sin().sum() - x.prod(), (x[0] - 2 * x[1]).exp()]


@pytest.mark.parametrize(
    "make",
    [UPGrad, MGDA, DualProj, AlignedMTL, Mean, lambda: Constant(torch.tensor([0.2, 1.0, 0.5]))],
)
def test_create_graph_derivative_of_grad_matches_finite_differences(
    make: Callable[[], Aggregator],
) -> None:
    """The derivative of ``.grad`` is that of the update, weights included (UPGrad's,
    MGDA's, DualProj's and AlignedMTL's change with ``J``): central differences of the update
    computed without a graph."""
    x = torch.tensor([0.3, -0.8], dtype=torch.float64, requires_grad=True)
    backward(_hessian_losses(x), [x], A=make(), create_graph=True)
    assert x.grad is not None
    rows = [torch.autograd.grad(x.grad[i], x, retain_graph=True)[0] for i in range(2)]

    def update(point: Tensor) -> Tensor:
        leaf = point.clone().requires_grad_()
        backward(_hessian_losses(leaf), [leaf], A=make())
        assert leaf.grad is not None
        return leaf.grad

    h = 1e-6
    columns = [
        (update(x.detach() + h * e) - update(x.detach() - h * e)) / (2 * h)
        for e in torch.eye(2, dtype=torch.float64)
    ]
    torch.testing.assert_close(torch.stack(rows), torch.stack(columns, 1), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("make", [IMTLG, lambda: DualProj(projector=QuadprogProjector()), ConFIG])
def test_create_graph_refuses_weights_computed_without_autograd(
    make: Callable[[], Aggregator],
) -> None:
    """Their derivative would hold the weights constant (1.3-4.6 off on these losses): refused
    before anything is differentiated or written."""
    x = torch.tensor([0.3, -0.8], dtype=torch.float64, requires_grad=True)
    x.grad = torch.ones(2, dtype=torch.float64)
    losses = _hessian_losses(x)
    with pytest.raises(ValueError, match=r"create_graph=True needs an aggregator whose update"):
        backward(losses, [x], A=make(), create_graph=True)
    torch.testing.assert_close(x.grad, torch.ones(2, dtype=torch.float64))
    backward(losses, [x], A=make())  # (the graph is intact)


def _penalty_step(case: str) -> tuple[list[Tensor], list[Tensor], Callable[[], list[Tensor]]]:
    """Leaves, inputs, and outputs where the gradient of one input is saved by the graph of
    another's (with ``create_graph``): ``pass_on``, ``a``'s is the cotangent that ``a + sin(b)``
    passes on, which ``b``'s (``cos(b)`` times it) saves; ``non_leaf``, ``h = v * w``'s, which
    ``w``'s (it times ``v``) saves."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(3, generator=gen, dtype=torch.float64).requires_grad_() for _ in "ab")
    if case == "pass_on":
        return [a, b], [a, b], lambda: [a + b.sin()]
    h = a * b
    return [a, b], [b, h], lambda: [h * 3.0]


def _rows(outputs: list[Tensor], inputs: list[Tensor]) -> list[Tensor]:
    """The Jacobians by ``torch.autograd.grad``, row by row, with their graph."""
    flat = torch.cat([o.reshape(-1) for o in outputs])
    rows = [
        [
            torch.zeros_like(i) if g is None else g
            for g, i in zip(
                torch.autograd.grad(
                    v, inputs, retain_graph=True, create_graph=True, allow_unused=True
                ),
                inputs,
            )
        ]
        for v in flat
    ]
    return [torch.stack([r[k] for r in rows]) for k in range(len(inputs))]


@pytest.mark.parametrize("case", ["pass_on", "non_leaf"])
@pytest.mark.parametrize("chunk", [None, 1, 2])
@pytest.mark.parametrize("A", [None, Sum(), Mean(), UPGrad()], ids=["jac", "Sum", "Mean", "UPGrad"])
def test_create_graph_accumulated_twice_keeps_the_graphs(
    case: str, chunk: int | None, A: Aggregator | None
) -> None:
    """Gradient accumulation with a gradient penalty: the first call stored autograd's gradient
    of one input as it was, saved by the graph of another's, and the second added to it in
    place, so the penalty's derivative failed with torch's "modified by an inplace operation".
    As torch's ``backward(create_graph=True)``, each result is stored as a copy."""
    leaves, inputs, outputs = _penalty_step(case)
    blocks = _rows(outputs(), inputs)
    matrix = torch.cat([2 * j.reshape(j.shape[0], -1) for j in blocks], dim=1)
    expected = (UPGrad() if A is None else A)(matrix)
    penalty_derivative = torch.autograd.grad(
        (expected**2).sum(), leaves, retain_graph=True, materialize_grads=True
    )
    for _ in range(2):
        backward(outputs(), inputs, A=A, parallel_chunk_size=chunk, create_graph=True)
    if A is None:
        jac_to_grad(inputs, UPGrad())
    grads = [i.grad for i in inputs]
    torch.testing.assert_close(torch.cat([g.reshape(-1) for g in grads]), expected)
    penalty = sum((g**2).sum() for g in grads)
    derivative = torch.autograd.grad(penalty, leaves, materialize_grads=True)
    torch.testing.assert_close(derivative, penalty_derivative)


def test_create_graph_grad_clipped_in_place_keeps_the_graphs() -> None:
    """``a.grad`` was the cotangent that ``b.grad``'s graph saves: clipping it in place broke
    that graph."""
    a, b = (torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True) for _ in "ab")
    backward(a + b.sin(), [a, b], A=Sum(), create_graph=True)
    assert a.grad is not None and b.grad is not None
    a.grad.mul_(0.5)
    (derivative,) = torch.autograd.grad((b.grad**2).sum(), b)
    torch.testing.assert_close(derivative, -(2 * b).sin().detach())


def test_grad_has_no_graph_without_create_graph() -> None:
    """As after torch's ``backward``: a preference that requires grad leaves ``.grad``
    without a graph, and the next accumulation is in place."""
    pref = torch.tensor([0.7, 0.3], requires_grad=True)
    x = torch.tensor([0.3, -0.8], requires_grad=True)
    backward([(x**2).sum(), x.sin().sum()], [x], A=UPGrad(pref_vector=pref))
    assert x.grad is not None and not x.grad.requires_grad
    first = x.grad
    backward([(x**2).sum(), x.sin().sum()], [x], A=Constant(pref))
    assert x.grad is first and not x.grad.requires_grad


def test_non_leaf_inputs_receive_grad() -> None:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    h = x * 3
    backward([h.sum(), (h**2).sum()], [h], A=Sum())
    torch.testing.assert_close(h.grad, 1 + 2 * h.detach())
    assert x.grad is None


@pytest.mark.parametrize("chunk", [None, 1])
def test_non_leaf_input_grad_accumulates_without_retain_grad(chunk: int | None) -> None:
    """``retain_grad()`` on a non-leaf input made later vmapped differentiations through it store
    a vmap BatchedTensor in its ``.grad``; ``.grad`` is now written directly and accumulates."""
    p = torch.randn(4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.float64)
    h = x @ p

    def fn(t: torch.Tensor) -> torch.Tensor:
        return torch.stack([t.sum(), (t**2).sum()])

    z = fn(h)
    expected = UPGrad()(torch.func.jacrev(fn)(h.detach()))
    backward(z, [h], A=UPGrad(), retain_graph=True, parallel_chunk_size=chunk)
    assert not h.retains_grad
    torch.testing.assert_close(h.grad, expected)
    jac(z, [p], retain_graph=True)  # vmapped through h, with respect to p only
    torch.testing.assert_close(h.grad, expected)
    backward(z, [h], A=UPGrad(), retain_graph=True, parallel_chunk_size=chunk)
    torch.testing.assert_close(h.grad, 2 * expected)
    assert p.grad is None and not h.retains_grad


@pytest.mark.parametrize("layout", ["expanded", "sparse"])
def test_grad_that_cannot_be_written_in_place_is_replaced(layout: str) -> None:
    """An expanded ``.grad`` on the second input made ``backward`` fail after the first input's
    ``.grad`` was written; it is now replaced out of place, the others keep their identity."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    p1 = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    p2 = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ a) @ b

    p1.grad = torch.ones(3, 4, dtype=torch.float64)
    ones = torch.ones(1, dtype=torch.float64).expand(4)
    p2.grad = ones if layout == "expanded" else ones.to_sparse()
    first_grad = p1.grad
    backward(fn(p1, p2), [p1, p2], A=UPGrad())
    j1, j2 = torch.func.jacrev(fn, argnums=(0, 1))(p1.detach(), p2.detach())
    expected = UPGrad()(torch.cat([j1.flatten(1), j2], dim=1))
    assert p1.grad is first_grad
    torch.testing.assert_close(p1.grad, 1 + expected[:12].reshape(3, 4))
    torch.testing.assert_close(p2.grad, 1 + expected[12:])


@pytest.mark.parametrize("existing", ["expanded", "with a graph"])
@pytest.mark.parametrize("aggregator", [Mean(), Sum(), UPGrad()], ids=str)
def test_sparse_update_replaces_a_dense_grad_out_of_place(
    existing: str, aggregator: Aggregator
) -> None:
    """A sparse embedding's update (``Mean``'s and ``Sum``'s single weighted backward keeps
    autograd's sparse gradient) onto a dense ``.grad`` that cannot take it in place failed
    with torch's "add(sparse, dense) is not supported": the out-of-place sum put the sparse
    update first. It is ``.grad + update`` now, as autograd's accumulation forms it."""
    torch.manual_seed(0)
    table = torch.nn.Embedding(6, 3, sparse=True).double()
    ids = torch.tensor([1, 2, 2, 5])

    def losses() -> torch.Tensor:
        rows = table(ids)
        return torch.stack([rows.pow(2).sum(), rows.sin().sum()])

    rows = [torch.autograd.grad(losses()[i], table.weight)[0].to_dense() for i in range(2)]
    jacobian = torch.stack([row.flatten() for row in rows])
    expected = 1 + aggregator(jacobian).reshape(6, 3)
    ones = torch.ones(1, 1, dtype=torch.float64)
    if existing == "expanded":
        table.weight.grad = ones.expand(6, 3)
    else:  # (from a differentiation with create_graph=True)
        table.weight.grad = ones.requires_grad_().expand(6, 3) * 1
    backward(losses(), [table.weight], A=aggregator)
    torch.testing.assert_close(table.weight.grad.to_dense(), expected)


@pytest.mark.parametrize(
    "aggregator", [Mean(), Sum(), UPGrad(), MGDA(), ConFIG(), GradDrop()], ids=str
)
@pytest.mark.parametrize("via_jac", [False, True])
def test_empty_jacobian_adds_zeros(aggregator: Aggregator, via_jac: bool) -> None:
    """m = 0 (an empty output) raised an internal reshape error with Gramian-based or
    Jacobian-based aggregators; it adds the zero update, as autograd on an empty output does."""
    p = torch.randn(2, 3, requires_grad=True)
    q = torch.randn(3, requires_grad=True)
    q.grad = torch.ones(3)
    y = (p @ q)[:0]
    if via_jac:
        backward(y, [p, q])
        weights = jac_to_grad([p, q], aggregator)
        assert weights is None or weights.shape == (0,)
    else:
        backward(y, [p, q], A=aggregator)
    reference_p = torch.randn(2, 3, requires_grad=True)
    reference_q = torch.randn(3, requires_grad=True)
    reference_q.grad = torch.ones(3)
    (reference_p @ reference_q)[:0].backward(torch.zeros(0))
    torch.testing.assert_close(p.grad, reference_p.grad)
    torch.testing.assert_close(q.grad, reference_q.grad)


@pytest.mark.parametrize("aggregator", [Sum(), UPGrad()], ids=str)
def test_leaf_output_without_inputs(aggregator: Aggregator) -> None:
    """``backward(leaf)`` with ``inputs=None`` raised "has no grad_fn"; the leaf is its own input
    (``A=Sum()`` gives what ``x.backward(torch.ones_like(x))`` gives)."""
    x = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    backward(x, A=aggregator)
    reference = x.detach().clone().requires_grad_()
    expected = aggregator(torch.func.jacrev(lambda t: t)(reference.detach()))
    torch.testing.assert_close(x.grad, expected)
    if isinstance(aggregator, Sum):
        reference.backward(torch.ones_like(reference))
        torch.testing.assert_close(x.grad, reference.grad)


def test_retain_graph() -> None:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = [x.exp().sum(), x.prod()]
    backward(y, [x], retain_graph=True, parallel_chunk_size=1)
    backward(y, [x], parallel_chunk_size=1)
    with pytest.raises(RuntimeError, match="second time"):
        backward(y, [x])


@pytest.mark.parametrize(
    ("dtype", "scale"),
    [(torch.float32, 1e19), (torch.float32, 1e-25), (torch.float16, 100.0), (torch.bfloat16, 1.0)],
)
def test_gramian_aggregation_of_extreme_or_half_precision_jacobians(
    dtype: torch.dtype, scale: float
) -> None:
    """``backward`` forms the Gramian of its Jacobian blocks as the aggregator forms it from
    ``J``: from ``J`` scaled to a largest entry about 1 (a float32 ``J`` of 1e19 gave NaN, of
    1e-25 the conflicting mean), in float32 for half-precision blocks (a float16 Gramian
    overflowed at 100). Compared with UPGrad on the float64 Jacobian."""
    torch.manual_seed(0)
    x = torch.randn(6, dtype=dtype, requires_grad=True)
    b = torch.randn(2, dtype=dtype, requires_grad=True)
    w = 0.1 * torch.randn(4, 6, dtype=torch.float64)
    w[0, 0], w[1, 0], w[1, 1] = 4.0, -1.0, 0.5  # (the mean conflicts with the second row)
    jacobian = torch.cat([w, torch.ones(4, 2, dtype=torch.float64)], dim=1) * scale
    y = (w.to(dtype) * scale) @ x + b.sum() * scale
    backward(y, A=UPGrad(), inputs=[x, b])
    expected = UPGrad()(jacobian)
    assert x.grad is not None and b.grad is not None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got = torch.cat([x.grad.double(), b.grad.double()])
    torch.testing.assert_close(got / scale, expected / scale, rtol=tol, atol=tol)


def _retaining() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A leaf ``a``, a non-leaf ``h = 2a`` that called ``retain_grad()``, and three losses."""
    a = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64, requires_grad=True)
    h = a * 2
    h.retain_grad()
    return a, h, list(_losses_of_h(h))


def _losses_of_h(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (h**2).sum(), h.sin().sum(), (h[:2] * h[1:]).sum()


def _jacobian_at_h(h: torch.Tensor) -> torch.Tensor:
    """The ``[3, 3]`` Jacobian of the losses at ``h``, by ``jacrev`` on a graph of its own."""
    return torch.func.jacrev(lambda t: torch.stack(_losses_of_h(t)))(h.detach())


@pytest.mark.parametrize("aggregator", [None, Sum(), Mean(), UPGrad()], ids=str)
@pytest.mark.parametrize("chunk", [None, 1])
@pytest.mark.parametrize("prior", [False, True])
@pytest.mark.parametrize("with_leaf", [False, True])
def test_input_that_retains_grad_is_written_once(
    aggregator: Aggregator | None, chunk: int | None, prior: bool, with_leaf: bool
) -> None:
    """``h.retain_grad()`` on a non-leaf input made torch's hook write ``h.grad`` during the
    differentiation and ``backward`` add its result on top: twice the update with Sum and Mean,
    a vmap BatchedTensor with UPGrad (or with no aggregator, beside ``h.jac``). ``h.grad`` now
    gets the result once, as ``torch.autograd.backward(w @ losses, inputs=[h])`` gives it."""
    a, h, losses = _retaining()
    h.grad = torch.full((3,), 0.5, dtype=torch.float64) if prior else None
    before = None if h.grad is None else h.grad.clone()
    inputs = [a, h] if with_leaf else [h]
    backward(losses, inputs, A=aggregator, parallel_chunk_size=chunk)
    j_h = _jacobian_at_h(h)
    j_a = 2 * j_h  # (h = 2a)
    if aggregator is None:
        torch.testing.assert_close(h.jac, j_h)  # type: ignore[attr-defined]
        assert (h.grad is None) if before is None else torch.equal(h.grad, before)
        return
    matrix = torch.cat([j_a, j_h], dim=1) if with_leaf else j_h
    update = aggregator(matrix)[-3:]
    assert h.grad is not None and type(h.grad) is torch.Tensor
    torch.testing.assert_close(h.grad, update if before is None else before + update)
    if isinstance(aggregator, (Sum, Mean)) and not with_leaf:  # the plain torch call
        reference = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64, requires_grad=True) * 2
        reference.retain_grad()
        reference.grad = None if before is None else before.clone()
        weights = aggregator.weights(torch.zeros(3, 0, dtype=torch.float64))
        torch.autograd.backward(weights @ torch.stack(_losses_of_h(reference)), inputs=[reference])
        torch.testing.assert_close(h.grad, reference.grad)


@pytest.mark.parametrize("aggregator", [Sum(), Mean()], ids=str)
def test_intermediate_that_retains_grad_gets_the_weighted_gradient(aggregator: Aggregator) -> None:
    """With Sum and Mean (one differentiation of the weighted losses), a ``retain_grad()``
    tensor between the losses and the inputs gets what ``(w @ losses).backward()`` gives it."""
    a, h, losses = _retaining()
    backward(losses, [a], A=aggregator)
    leaf = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64, requires_grad=True)
    reference = leaf * 2
    reference.retain_grad()
    weights = aggregator.weights(torch.zeros(3, 0, dtype=torch.float64))
    (weights @ torch.stack(_losses_of_h(reference))).backward()
    torch.testing.assert_close(h.grad, reference.grad)
    torch.testing.assert_close(a.grad, leaf.grad)


@pytest.mark.parametrize("aggregator", [None, Sum(), UPGrad()], ids=str)
@pytest.mark.parametrize("chunk", [None, 1])
def test_repeated_input_is_taken_once(aggregator: Aggregator | None, chunk: int | None) -> None:
    """``inputs=[a, b, a]`` raised ValueError; it is taken as ``[a, b]``, as
    ``torch.autograd.backward`` takes it (one gradient) and as TorchJD does (one ``.jac``)."""
    a = torch.tensor([0.3, -1.2], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([2.0], dtype=torch.float64, requires_grad=True)

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.stack([(x**2).sum() * y[0], x.sin().sum() - y[0]])

    backward(fn(a, b), [a, b, a], A=aggregator, parallel_chunk_size=chunk)
    j_a, j_b = torch.func.jacrev(fn, argnums=(0, 1))(a.detach(), b.detach())
    if aggregator is None:
        torch.testing.assert_close(a.jac, j_a)  # type: ignore[attr-defined]
        torch.testing.assert_close(b.jac, j_b)  # type: ignore[attr-defined]
        return
    update = aggregator(torch.cat([j_a, j_b], dim=1))
    torch.testing.assert_close(a.grad, update[:2])
    torch.testing.assert_close(b.grad, update[2:])
    if isinstance(aggregator, Sum):  # the plain torch call
        leaf_a, leaf_b = a.detach().requires_grad_(), b.detach().requires_grad_()
        torch.autograd.backward(fn(leaf_a, leaf_b).sum(), inputs=[leaf_a, leaf_b, leaf_a])
        torch.testing.assert_close(a.grad, leaf_a.grad)


@pytest.mark.parametrize("A", [UPGrad(), MGDA(), DualProj(), Mean()], ids=str)
def test_inputs_without_elements_get_the_empty_update(A: Aggregator) -> None:
    """n = 0: the aggregator's own result on the ``[m, 0]`` Jacobian (a bare stacking error
    from the Gramian's scaling before)."""
    e = torch.zeros(0, requires_grad=True)
    backward([e.sum(), (2 * e).sum()], [e], A=A)
    assert e.grad is not None and e.grad.shape == (0,)
    f = torch.zeros(0, requires_grad=True)
    backward([f.sum(), (2 * f).sum()], [f])
    jac_to_grad([f], A)
    assert f.grad is not None and f.grad.shape == (0,)


@pytest.mark.parametrize("A", [Mean(), Sum()], ids=str)
def test_a_gradient_hook_on_an_input_sees_each_row_with_mean_and_sum(A: Aggregator) -> None:
    """A clipping hook on the input gives the weighted sum of the clipped rows, as with any
    other aggregator of the same weights; the one-VJP shortcut clipped their weighted sum."""

    def hooked() -> Tensor:
        p = torch.tensor([1.0, 2.0], requires_grad=True)
        p.register_hook(lambda g: g.clamp(max=1.0))
        return p

    p = hooked()
    backward([3 * p.sum(), -(p**2).sum()], [p], A=A)
    q = hooked()
    rows = torch.stack([torch.autograd.grad(y, q)[0] for y in (3 * q.sum(), -(q**2).sum())])
    expected = rows.mean(0) if isinstance(A, Mean) else rows.sum(0)
    torch.testing.assert_close(p.grad, expected)


class _InnerGradientSteps(Aggregator):
    """An aggregator of your own that takes gradient steps inside (weights fitted by gradient
    descent on a small objective of its own)."""

    def forward(self, matrix: Tensor) -> Tensor:
        weights = torch.full((matrix.shape[0],), 1.0 / matrix.shape[0], requires_grad=True)
        weights = weights.to(matrix.dtype).detach().requires_grad_()
        for _ in range(3):
            objective = (weights @ matrix.detach()).square().sum() - weights.log().sum()
            (grad,) = torch.autograd.grad(objective, weights)
            weights = (weights - 0.01 * grad).detach().requires_grad_()
        return weights.detach() @ matrix


def test_an_aggregator_of_your_own_may_use_autograd_inside() -> None:
    """``backward`` and ``jac_to_grad`` run it with autograd on (a Jacobian without a graph
    only makes the update a constant): the same update as its call on ``J``."""
    x = torch.tensor([0.3, -0.8, 0.5], dtype=torch.float64, requires_grad=True)
    losses = [(x**2).sum(), x.sin().sum(), (x * 2).prod()]
    (J,) = jac(losses, [x], retain_graph=True)
    expected = _InnerGradientSteps()(J)
    backward(losses, [x], A=_InnerGradientSteps())
    assert x.grad is not None and not x.grad.requires_grad
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("chunk", [None, 2, 1])
def test_a_sparse_input_is_differentiated_row_by_row(chunk: int | None) -> None:
    """Vmapped rows fail on a sparse input of a Linear ("expand is unsupported for Sparse
    tensors"): the walk of the graph finds the product's sparse operand and takes the rows one
    by one at every chunk size (before, the default failed with a hint to pass
    ``parallel_chunk_size=1``)."""
    dense, model = _sparse_input_problem()
    backward(
        model(dense.to_sparse()).pow(2).sum(1),
        A=Constant(torch.ones(4, dtype=torch.float64)),
        parallel_chunk_size=chunk,
    )
    _assert_grads_of_dense_input(dense, model)


def _sparse_input_problem() -> tuple[Tensor, torch.nn.Module]:
    """A ``[4, 3]`` input with zeros (given sparse to the model) and a Linear + Tanh model."""
    torch.manual_seed(0)
    dense = torch.randn(4, 3, dtype=torch.float64)
    dense[dense.abs() < 0.7] = 0
    return dense, torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh()).double()


def _assert_grads_of_dense_input(dense: Tensor, model: torch.nn.Module) -> None:
    """The model's ``.grad`` are autograd's gradient of the summed losses on the dense input."""
    params = list(model.parameters())
    expected = torch.autograd.grad(model(dense).pow(2).sum(), params)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-12, atol=1e-12)


def test_an_unseen_sparse_product_names_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch before 2.10 cannot show jacflow a product's saved sparse operand (emulated on later
    releases): the batched rows then fail inside torch, and the error names the release that
    routes them and the row-by-row option, which gives autograd's update. The failed call
    writes no ``.grad``."""
    _zoo.hide_sparse_operands(monkeypatch)
    dense, model = _sparse_input_problem()
    ones = Constant(torch.ones(4, dtype=torch.float64))
    hint = r"(?s)Sparse tensors.*torch 2\.10 and later.*this is torch .*parallel_chunk_size=1"
    with pytest.raises(RuntimeError, match=hint):
        backward(model(dense.to_sparse()).pow(2).sum(1), A=ones)
    assert all(p.grad is None for p in model.parameters())
    backward(model(dense.to_sparse()).pow(2).sum(1), A=ones, parallel_chunk_size=1)
    _assert_grads_of_dense_input(dense, model)


def test_a_checkpointed_block_is_recomputed_once() -> None:
    """The walk that looks for sparse products read every product's saved operands, which a
    non-reentrant checkpoint recomputes its forward to unpack: an 8-layer checkpointed block ran
    17 times in one call (and kept the recomputed activations). Operands are read as stored:
    the forward and the one recomputation of the batched backward."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4).double()
    runs = [0]

    def block(x: Tensor) -> Tensor:
        runs[0] += 1
        for _ in range(8):
            x = torch.tanh(layer(x))
        return x

    x = torch.randn(5, 4, dtype=torch.float64)
    out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    losses = [out[:, :2].pow(2).mean(), out[:, 2:].abs().mean()]
    params = list(layer.parameters())
    rows = [torch.autograd.grad(loss, params, retain_graph=True) for loss in losses]
    jacobian = torch.stack([torch.cat([g.reshape(-1) for g in row]) for row in rows])
    runs[0] = 1
    backward(losses, A=UPGrad())
    assert runs[0] == 2
    torch.testing.assert_close(torch.cat([p.grad.reshape(-1) for p in params]), UPGrad()(jacobian))


@pytest.mark.parametrize("A", [Mean(), Sum()], ids=str)
def test_mean_and_sum_of_float16_jac_tensors_whose_sum_overflows_float16(A: Aggregator) -> None:
    """The single differentiation of Mean and Sum summed the m rows of float16 ``jac_tensors``
    in float16: 100 rows of about 1000 overflowed to an infinite ``.grad``, where each row of
    the Jacobian, their mean and their sum (at the parameter) fit."""
    m = 100
    p = torch.tensor([1.0, -2.0], requires_grad=True)
    y = (p * 2**-10).half()  # a float16 output, its Jacobian diag(2^-10)
    cotangents = (1000 + torch.arange(2 * m).reshape(m, 2)).half()
    backward(y, [p], A=A, jac_tensors=cotangents)
    rows = cotangents.double() * 2**-10  # (exact: a power of two times float16 values)
    expected = rows.mean(0) if isinstance(A, Mean) else rows.sum(0)
    assert p.grad is not None and p.grad.dtype == torch.float32
    torch.testing.assert_close(p.grad.double(), expected, rtol=1e-6, atol=0.0)


def _partly_reached() -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Two losses over a trunk and three heads: ``head_a`` reached by the first loss only,
    ``head_b`` by none (its task absent from the step), ``tail`` (a leaf) by none either.
    Returns the losses, the reached inputs and the unreached ones."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3, generator=gen, dtype=torch.float64)

    def leaf(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    trunk, head_a, head_b, head_c, tail = leaf(3, 4), leaf(4), leaf(4), leaf(4), leaf(2)
    f = torch.tanh(x @ trunk)
    unused = f @ head_b  # (computed, but no loss reads it)
    del unused
    losses = [(f @ head_a).pow(2).mean(), (f @ head_c).sin().mean()]
    return losses, [trunk, head_a, head_c], [head_b, tail]


def _reference_rows(losses: list[Tensor], inputs: list[Tensor]) -> list[Tensor]:
    """Per input, the ``[m, *shape]`` Jacobian from one ``autograd.grad`` per loss (zeros
    where a loss does not reach the input)."""
    grads = [
        torch.autograd.grad(loss, inputs, retain_graph=True, allow_unused=True) for loss in losses
    ]
    return [
        torch.stack([torch.zeros_like(t) if g[k] is None else g[k] for g in grads])
        for k, t in enumerate(inputs)
    ]


def _aggregated(aggregator: Aggregator, rows: list[Tensor]) -> list[Tensor]:
    """``aggregator`` on the stacked Jacobian whose column blocks are ``rows``, split back."""
    matrix = torch.cat([r.flatten(1) for r in rows], dim=1)
    update = aggregator(matrix)
    pieces = update.split([r[0].numel() for r in rows])
    return [p.view_as(r[0]) for p, r in zip(pieces, rows)]


@pytest.mark.parametrize(
    "aggregator",
    [Mean(), Sum(), UPGrad(), MGDA(), DualProj(), ConFIG(), Constant(torch.tensor([0.3, 2.0]))],
    ids=str,
)
@pytest.mark.parametrize("chunk", [None, 1])
@pytest.mark.parametrize("existing", [False, True])
def test_an_unreached_input_keeps_its_grad_as_torch_does(
    aggregator: Aggregator, chunk: int | None, existing: bool
) -> None:
    """An input that no loss reaches got a zero ``.grad`` (momentum and weight decay then moved
    an unused head); it keeps its ``.grad`` (``None`` stays ``None``, an existing one is not
    touched), as after ``torch.autograd.backward(loss, inputs=...)``. An input that only some
    rows reach gets the aggregation of the Jacobian with zeros in the other rows, as before.
    The Mean/Sum shortcut (one VJP) and the rows (vmapped or one by one) alike. Their
    post-accumulate hooks do not run either (an optimizer step in such a hook moved them)."""
    losses, reached, unreached = _partly_reached()
    inputs = [reached[0], unreached[0], reached[1], unreached[1], reached[2]]
    # torch on the same graph: the unreached inputs' `.grad` left alone, their hooks not run
    held, hooked = torch_leaves_alone(
        lambda: torch.autograd.backward(sum(losses), inputs=inputs, retain_graph=True),
        inputs,
        unreached,
        existing,
    )
    expected = _aggregated(aggregator, _reference_rows(losses, inputs))
    backward(losses, inputs, A=aggregator, parallel_chunk_size=chunk)
    assert_left_alone(unreached, held, hooked)
    for t, e in zip(inputs, expected):
        if any(t is r for r in reached):
            torch.testing.assert_close(t.grad, e)
    assert reached[1].grad is not None and reached[1].grad.abs().max() > 0


@pytest.mark.parametrize("aggregator", [Mean(), UPGrad()], ids=str)
def test_an_unreached_input_keeps_its_grad_with_create_graph(aggregator: Aggregator) -> None:
    """With ``create_graph=True`` too: no ``.grad`` for an unreached input, a differentiable
    one for the reached inputs."""
    losses, reached, unreached = _partly_reached()
    backward(losses, [*reached, *unreached], A=aggregator, create_graph=True)
    assert all(t.grad is None for t in unreached)
    assert all(t.grad is not None and t.grad.requires_grad for t in reached)


def test_no_input_reached_writes_nothing() -> None:
    """Inputs none of which a loss reaches: nothing written (zeros before), with ``A`` or not,
    as torch's ``backward(inputs=...)``."""
    losses, _, unreached = _partly_reached()
    for aggregator in [Mean(), UPGrad(), None]:
        backward(losses, unreached, A=aggregator, retain_graph=True)
        assert all(t.grad is None and not hasattr(t, "jac") for t in unreached)
    torch.autograd.backward(sum(losses), inputs=unreached)
    assert all(t.grad is None for t in unreached)


@pytest.mark.parametrize("chunk", [None, 1])
def test_an_unreached_input_gets_no_jac(chunk: int | None) -> None:
    """Without ``A``, an unreached input got a zero ``.jac``; it gets none (and one it has is
    left unchanged), the reached inputs their Jacobians. ``jac_to_grad`` then skips it: its
    ``.grad`` is left as torch's ``backward`` leaves it."""
    losses, reached, unreached = _partly_reached()
    kept = torch.ones(2, 2, dtype=torch.float64)
    unreached[1].jac = kept  # type: ignore[attr-defined]
    inputs = [*reached, *unreached]
    rows = _reference_rows(losses, reached)
    backward(losses, inputs, parallel_chunk_size=chunk, retain_graph=True)
    assert not hasattr(unreached[0], "jac")
    assert unreached[1].jac is kept and torch.equal(kept, torch.ones(2, 2, dtype=torch.float64))  # type: ignore[attr-defined]
    for t, r in zip(reached, rows):
        torch.testing.assert_close(t.jac, r)  # type: ignore[attr-defined]
    del unreached[1].jac  # type: ignore[attr-defined]
    unreached[1].grad = torch.full_like(unreached[1], 7.0)
    held = unreached[1].grad
    jac_to_grad(inputs, UPGrad())
    assert unreached[0].grad is None and unreached[1].grad is held
    assert torch.equal(held, torch.full_like(unreached[1], 7.0))
    for t, e in zip(reached, _aggregated(UPGrad(), rows)):
        torch.testing.assert_close(t.grad, e)
        assert not hasattr(t, "jac")


@pytest.mark.parametrize("aggregator", [Mean(), UPGrad(), None], ids=str)
def test_empty_jacobian_leaves_an_unreached_input_alone(aggregator: Aggregator | None) -> None:
    """m = 0: an input that the graph reaches gets zeros (``[0, *shape]`` in ``.jac``), one
    that it does not reach nothing, as ``y.backward(torch.zeros(0), inputs=...)`` does."""
    p = torch.randn(2, 3, requires_grad=True)
    q = torch.randn(3, requires_grad=True)
    y = (p * 2)[:0]
    backward(y, [p, q], A=aggregator, retain_graph=True)
    if aggregator is None:
        assert p.jac.shape == (0, 2, 3) and not hasattr(q, "jac")  # type: ignore[attr-defined]
        assert p.grad is None and q.grad is None
        return
    reference_p, reference_q = p.detach().requires_grad_(), q.detach().requires_grad_()
    torch.autograd.backward(
        (reference_p * 2)[:0], torch.zeros(0, 3), inputs=[reference_p, reference_q]
    )
    assert reference_q.grad is None and q.grad is None
    torch.testing.assert_close(p.grad, reference_p.grad)


def test_rows_under_anomaly_mode_are_the_jacobians() -> None:
    """Under ``torch.autograd.detect_anomaly()``, whose NaN check of each backward's output
    vmap cannot batch, the rows go one by one (they failed with vmap's error): ``jac`` gives
    the row-by-row Jacobians of ``torch.autograd.grad``."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (anomaly mode's own warning, at its creation)
        anomaly = torch.autograd.detect_anomaly()
    with anomaly:
        out = layer(x).pow(2).sum(0)
        jacobians = jac(out, list(layer.parameters()), retain_graph=True)
    for jacobian, param in zip(jacobians, layer.parameters(), strict=True):
        rows = [torch.autograd.grad(o, param, retain_graph=True)[0] for o in out]
        torch.testing.assert_close(jacobian, torch.stack(rows))
