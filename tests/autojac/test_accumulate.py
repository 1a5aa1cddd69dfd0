"""Writing into ``.grad`` and ``.jac``: each result a tensor of its own, and under several
processes a warning that nothing is averaged."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from jacflow import backward, jac, jac_to_grad, mtl_backward
from jacflow._grad_writes import owned
from jacflow.aggregation import Aggregator, Mean, Sum, UPGrad


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("call", ["backward", "mtl_backward"])
def test_writes_under_several_processes_warn_that_nothing_is_averaged(
    world_size: int, call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under DDP these calls bypass its averaging hooks (the replicas' ``.grad`` differed by
    2.26 after one step, silently): warned, naming the way out; one process: no warning."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world_size)
    trunk = torch.nn.Linear(2, 3)
    features = trunk(torch.ones(4, 2))
    losses = [features.pow(2).mean(), features.sin().mean()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if call == "backward":
            backward(losses, A=UPGrad())
        else:
            mtl_backward(losses, features, A=UPGrad())
    messages = [str(w.message) for w in caught if "drift apart" in str(w.message)]
    assert len(messages) == (1 if world_size == 2 else 0)
    assert all("jacflow.autogram.Engine(ddp_model" in m for m in messages)
    assert trunk.weight.grad is not None


@pytest.mark.parametrize("A", [None, Mean(), UPGrad()], ids=["jac", "mean", "upgrad"])
def test_no_two_results_share_memory(A: Aggregator | None) -> None:
    """``a + b`` passes one gradient buffer to both inputs: each ``.grad`` (``.jac``) gets its
    own, so that accumulating twice, or scaling one in place, matches torch's ``.grad``."""
    c = torch.tensor([5.0, 7.0])
    a, b = (
        torch.tensor([1.0, 2.0], requires_grad=True),
        torch.tensor([3.0, 4.0], requires_grad=True),
    )
    ra, rb = (t.detach().clone().requires_grad_() for t in (a, b))
    for _ in range(2):
        backward([((a + b) * c).sum()], [a, b], A=A)
        ((ra + rb) * c).sum().backward()
    if A is None:
        a.grad, b.grad = a.jac[0], b.jac[0]  # type: ignore[attr-defined]
    assert a.grad is not None and b.grad is not None
    assert a.grad.data_ptr() != b.grad.data_ptr()
    torch.testing.assert_close(a.grad, ra.grad)
    a.grad.mul_(0.5)
    torch.testing.assert_close(b.grad, rb.grad)


def test_jac_does_not_share_the_callers_jac_tensors() -> None:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    C = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    backward([x], [x], jac_tensors=[C])
    torch.testing.assert_close(x.jac, C)  # type: ignore[attr-defined]
    C.zero_()
    assert x.jac.abs().sum() > 0  # type: ignore[attr-defined]


def test_task_parameters_of_mtl_backward_do_not_share_memory() -> None:
    """Heads read as ``h1 + h2``: autograd returns one buffer for both."""
    torch.manual_seed(0)
    W, x = torch.randn(2, 3, requires_grad=True), torch.randn(4, 3)
    h1, h2, h3 = (torch.randn(2, requires_grad=True) for _ in range(3))
    features = torch.tanh(x @ W.T)
    losses = [(features @ (h1 + h2)).mean(), (features @ h3).mean()]
    expected = torch.autograd.grad(losses[0], [h1, h2], retain_graph=True)
    mtl_backward(losses, features, A=UPGrad())
    assert h1.grad is not None and h2.grad is not None
    h1.grad.mul_(0.5)
    torch.testing.assert_close(h2.grad, expected[1])


@pytest.mark.parametrize("call", ["upgrad", "mean", "jac_to_grad", "mtl_backward"])
def test_post_accumulate_hooks_run_once_after_the_write(call: str) -> None:
    """As after ``loss.backward()``: each hooked parameter's hook runs once, on its new
    ``.grad`` (optimizer steps in backward, gradient logging); they never ran."""
    torch.manual_seed(0)
    trunk, head = torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)
    params = [*trunk.parameters(), *head.parameters()]
    seen: list[tuple[int, Tensor]] = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda t, i=i: seen.append((i, t.grad.clone())))
    features = trunk(torch.randn(4, 2))
    losses = [head(features).mean(), features.pow(2).mean()]
    if call == "mtl_backward":
        mtl_backward(losses, features, A=UPGrad())
    elif call == "jac_to_grad":
        backward(losses, params)
        assert not seen  # (.jac only)
        jac_to_grad(params, UPGrad())
    else:
        backward(losses, params, A=UPGrad() if call == "upgrad" else Mean())
    assert sorted(i for i, _ in seen) == list(range(len(params)))
    for i, grad in seen:
        assert torch.equal(grad, params[i].grad)


def _passed_through() -> tuple[list[Tensor], Callable[[], list[Tensor]]]:
    """Two leaves whose losses reach them through ops that pass a ``sum``'s gradient on
    unchanged: ``torch.autograd.grad`` returns expanded gradients (a zero stride) for them."""
    a = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    b = torch.tensor([0.3, 2.0, -1.0], requires_grad=True)
    return [a, b], lambda: [(a + 1).sum(), (b**2).mean() + b.sum()]


@pytest.mark.parametrize("A", [Mean(), Sum(), UPGrad()], ids=["mean", "sum", "upgrad"])
def test_grad_of_a_passed_through_sum_can_be_written_in_place(A: Aggregator) -> None:
    """Mean's and Sum's single VJP stored autograd's expanded gradient as ``.grad``:
    ``clip_grad_norm_`` and ``p.grad.mul_`` then failed. Now dense, as torch's own ``.grad``."""
    params, losses = _passed_through()
    references = [p.detach().clone().requires_grad_() for p in params]
    backward(losses(), A=A)
    expected = jac(losses(), params)
    for p, ref, rows in zip(params, references, expected):
        ref.grad = A(rows)
        assert p.grad is not None
        torch.testing.assert_close(p.grad, ref.grad)
    torch.nn.utils.clip_grad_norm_(params, max_norm=0.1)
    torch.nn.utils.clip_grad_norm_(references, max_norm=0.1)
    for p, ref in zip(params, references):
        p.grad.mul_(2)  # type: ignore[union-attr]
        torch.testing.assert_close(p.grad, 2 * ref.grad)  # type: ignore[operator]


@pytest.mark.parametrize("chunk", [None, 1, 2])
def test_jac_of_one_chunk_can_be_written_in_place(chunk: int | None) -> None:
    """With all the rows in one chunk, ``.jac`` was autograd's expanded result (stride 0)."""
    params, losses = _passed_through()
    backward(losses(), parallel_chunk_size=chunk)
    for p, expected in zip(params, jac(losses(), params)):
        p.jac.mul_(2)  # type: ignore[attr-defined]
        torch.testing.assert_close(p.jac, 2 * expected)  # type: ignore[attr-defined]


def test_head_grads_of_mtl_backward_can_be_written_in_place() -> None:
    trunk = torch.nn.Linear(3, 4)
    offset = torch.randn(3, requires_grad=True)
    features = trunk(torch.randn(5, 3))
    losses = [features.pow(2).mean() + offset.sum(), features.abs().mean()]
    mtl_backward(losses, features, A=UPGrad())
    assert offset.grad is not None
    offset.grad.mul_(2)
    torch.testing.assert_close(offset.grad, torch.full((3,), 2.0))


def _channels_last_step(call: str) -> tuple[torch.nn.Conv2d, Tensor]:
    """A channels_last convolution after ``call``, and its ``.grad`` after torch's backward of
    the losses' sum (the reference, in the layout autograd gives it)."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    head = torch.nn.Conv2d(4, 2, 3).to(memory_format=torch.channels_last)
    reference = torch.nn.Conv2d(4, 2, 3).to(memory_format=torch.channels_last)
    reference.load_state_dict(head.state_dict())
    x = torch.randn(2, 3, 7, 7).to(memory_format=torch.channels_last)
    features = conv(x)
    sum(r.pow(2).mean() for r in reference(features.detach()).unbind(1)).backward()  # type: ignore[union-attr]
    losses = list(head(features).pow(2).mean((0, 2, 3)).unbind())
    if call == "mtl_backward":
        mtl_backward(losses, features, A=UPGrad())
        return head, reference.weight.grad  # type: ignore[return-value]
    if call == "jac_to_grad":
        backward(losses, list(head.parameters()), retain_graph=True)
        jac_to_grad(list(head.parameters()), Mean())
    else:
        backward(losses, list(head.parameters()), A=Sum() if call == "sum" else UPGrad())
    return head, reference.weight.grad  # type: ignore[return-value]


@pytest.mark.parametrize("call", ["sum", "upgrad", "jac_to_grad", "mtl_backward"])
def test_grad_of_a_channels_last_parameter_has_its_layout(call: str) -> None:
    """As autograd's accumulation lays it out (DDP's bucket views and channels_last kernels
    rely on it); jacflow stored contiguous ones."""
    head, reference = _channels_last_step(call)
    assert head.weight.grad is not None
    assert head.weight.grad.stride() == head.weight.stride() == reference.stride()
    if call in ("sum", "mtl_backward"):  # (the sum of the losses' gradients)
        torch.testing.assert_close(head.weight.grad, reference)


def test_writes_copy_only_what_needs_it() -> None:
    """An ordinary gradient is stored as it is (no copy on the hot path)."""
    p = torch.randn(2, 3, requires_grad=True)
    grad = torch.randn(2, 3)
    assert owned([grad], like=[p])[0] is grad
    assert owned([torch.ones(1).expand(2, 3)], like=[p])[0].stride() == (3, 1)


def _two_inputs() -> tuple[Tensor, Tensor, Callable[[], list[Tensor]]]:
    p = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    q = torch.tensor([0.5, -1.0], requires_grad=True)
    return p, q, lambda: [(p**2).sum() + q.sum(), p.sum() * q.prod()]


@pytest.mark.parametrize("where", ["sparse", "meta"])
@pytest.mark.parametrize("call", ["backward", "mtl_backward"])
def test_a_jac_of_another_layout_or_device_is_refused_before_any_write(
    where: str, call: str
) -> None:
    """It passed the check, then the sum failed (torch's error) after ``p.jac`` was written."""
    p, q, losses = _two_inputs()
    p.jac = torch.zeros(2, 3)  # type: ignore[attr-defined]
    q.jac = torch.zeros(2, 2).to_sparse() if where == "sparse" else torch.zeros(2, 2, device="meta")  # type: ignore[attr-defined]
    p_jac, q_jac = p.jac, q.jac  # type: ignore[attr-defined]
    pattern = (
        "must be a dense \\(strided\\)" if where == "sparse" else "is on meta, but .* is on cpu"
    )
    with pytest.raises(ValueError, match=rf"`(inputs|shared_params)\[1\]\.jac` {pattern}"):
        if call == "backward":
            backward(losses(), inputs=[p, q])
        else:
            features = torch.stack([p.sum(), q.sum()])
            mtl_backward([features.pow(2).sum(), features.prod()], features, shared_params=[p, q])
    assert p.jac is p_jac and q.jac is q_jac  # type: ignore[attr-defined]
    assert not p_jac.any()


def test_jac_to_grad_refuses_a_sparse_jac() -> None:
    """It failed inside the aggregation, with torch's error."""
    p = torch.randn(3, requires_grad=True)
    p.jac = torch.randn(2, 3).to_sparse()  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"`tensors\[0\]\.jac` must be a dense"):
        jac_to_grad([p], UPGrad())
    assert p.grad is None


def _sparse_step(call: str, layout: torch.layout) -> tuple[Tensor, Tensor, Tensor]:
    """A dense parameter with a ``.grad`` and a sparse leaf (through ``torch.sparse.mm``) stepped
    with UPGrad by ``call``: both, and the update expected for them (from the dense rows)."""
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    dense[dense.abs() < 0.5] = 0.0
    sparse = dense.to_sparse(layout=layout).requires_grad_()
    other = torch.randn(3, 2, generator=generator, dtype=torch.float64)
    p = torch.randn(4, 2, generator=generator, dtype=torch.float64, requires_grad=True)
    p.grad = torch.ones_like(p)

    def losses() -> tuple[Tensor, list[Tensor]]:
        features = torch.sparse.mm(sparse, other) * p
        return features, [features.sin().sum(), features.pow(2).sum()]

    rows = jac(losses()[1], [p, sparse])
    expected = UPGrad()(torch.cat([r.reshape(2, -1) for r in rows], dim=1))
    features, values = losses()
    if call == "upgrad":
        backward(values, [p, sparse], A=UPGrad())
    elif call == "jac_to_grad":
        backward(values, [p, sparse])
        jac_to_grad([p, sparse], UPGrad())
    else:
        mtl_backward(values, features, A=UPGrad(), shared_params=[p, sparse])
    return p, sparse, expected


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
@pytest.mark.parametrize("call", ["upgrad", "jac_to_grad", "mtl_backward"])
def test_aggregated_grad_of_a_sparse_leaf_has_its_layout(call: str, layout: torch.layout) -> None:
    """As autograd's gradient of it; the dense update was refused by the ``.grad`` setter (torch's
    "data of a different type"), after the other inputs' ``.grad`` had been written."""
    p, sparse, expected = _sparse_step(call, layout)
    assert sparse.grad is not None and sparse.grad.layout == layout
    torch.testing.assert_close(sparse.grad.to_dense(), expected[8:].reshape(4, 3))
    assert p.grad is not None
    torch.testing.assert_close(p.grad, 1.0 + expected[:8].reshape(4, 2))


def test_jac_accumulates_in_place() -> None:
    """``+=`` as TorchJD (and migration.md) say: a reference to ``.jac`` sees the sum; it
    was replaced by a new tensor."""
    p, q, losses = _two_inputs()
    backward(losses())
    held = p.jac  # type: ignore[attr-defined]
    backward(losses())
    assert p.jac is held  # type: ignore[attr-defined]
    for t, expected in zip((p, q), jac(losses(), [p, q])):
        torch.testing.assert_close(t.jac, 2 * expected)  # type: ignore[attr-defined]


def test_jac_shared_with_jac_tensors_is_not_changed() -> None:
    """Adding in place to a ``.jac`` that is the caller's ``jac_tensors`` would change them."""
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    C = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    x.jac = C  # type: ignore[attr-defined]
    backward([x], [x], jac_tensors=[C])
    torch.testing.assert_close(C, torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]))
    torch.testing.assert_close(x.jac, 2 * C)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["graph", "float64", "expanded", "shared"])
def test_jac_that_cannot_take_the_sum_in_place_is_replaced(kind: str) -> None:
    """A ``.jac`` with a graph, of another dtype, expanded, or shared with another input's
    ``.jac`` (out of place, from the values before the call): the sum, each its own."""
    p, q, losses = _two_inputs()
    first = torch.ones(2, 3)
    if kind == "graph":
        first = first.requires_grad_()
    elif kind == "float64":
        first = first.double()
    elif kind == "expanded":
        first = torch.ones(1, 3).expand(2, 3)
    p.jac = first  # type: ignore[attr-defined]
    q.jac = first[:, :2] if kind == "shared" else torch.ones(2, 2)  # type: ignore[attr-defined]
    backward(losses())
    expected = jac(losses(), [p, q])
    torch.testing.assert_close(p.jac, 1 + expected[0], check_dtype=False)  # type: ignore[attr-defined]
    torch.testing.assert_close(q.jac, 1 + expected[1])  # type: ignore[attr-defined]
    assert kind == "shared" or torch.equal(first, torch.ones(2, 3))


_NO_GRAD_DTYPE = pytest.mark.skipif(
    not hasattr(torch.Tensor, "grad_dtype"), reason="Tensor.grad_dtype needs torch >= 2.10"
)


def _grad_dtype_params() -> tuple[Tensor, Tensor]:
    """bfloat16 parameters, the second with float32 gradients (its ``grad_dtype``)."""
    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16, requires_grad=True)
    b = torch.tensor([3.0, 4.0], dtype=torch.bfloat16, requires_grad=True)
    b.grad_dtype = torch.float32  # type: ignore[attr-defined]
    return a, b


@_NO_GRAD_DTYPE
@pytest.mark.parametrize("A", [Sum(), Mean(), UPGrad()], ids=["Sum", "Mean", "UPGrad"])
@pytest.mark.parametrize("existing", [False, True])
def test_grad_is_written_in_the_parameters_grad_dtype(A: Aggregator, existing: bool) -> None:
    """As torch's ``backward`` writes it (the setter refuses another dtype): the call failed
    after writing the other parameters' ``.grad``."""
    a, b = _grad_dtype_params()
    if existing:
        a.grad = torch.ones(2, dtype=torch.bfloat16)
        b.grad = torch.ones(2, dtype=torch.float32)
    losses = [(a**2).sum(), (a * b).sum()]
    backward(losses, [a, b], A=A)
    ra, rb = _grad_dtype_params()
    matrix = torch.stack(
        [
            torch.cat(
                torch.autograd.grad(
                    loss, [ra, rb], retain_graph=True, allow_unused=True, materialize_grads=True
                )
            )
            for loss in [(ra**2).sum(), (ra * rb).sum()]
        ]
    )
    update = A(matrix.float())
    assert a.grad is not None and b.grad is not None
    assert (a.grad.dtype, b.grad.dtype) == (torch.bfloat16, torch.float32)
    offset = 1.0 if existing else 0.0
    torch.testing.assert_close(a.grad.float(), update[:2] + offset, atol=0.05, rtol=0.01)
    torch.testing.assert_close(b.grad, update[2:] + offset, atol=0.05, rtol=0.01)


@_NO_GRAD_DTYPE
def test_sum_in_grad_dtype_matches_torchs_backward() -> None:
    a, b = _grad_dtype_params()
    ((a**2).sum() + (a * b).sum()).backward()
    ra, rb = _grad_dtype_params()
    backward([(ra**2).sum(), (ra * rb).sum()], [ra, rb], A=Sum())
    for got, expected in [(ra.grad, a.grad), (rb.grad, b.grad)]:
        assert got is not None and expected is not None
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected)


@_NO_GRAD_DTYPE
def test_jac_to_grad_writes_in_grad_dtype_and_none_accepts_the_tensors_dtype() -> None:
    """``grad_dtype=None`` accepts any dtype: torch's backward keeps the tensor's."""
    a, b = _grad_dtype_params()
    a.grad_dtype = None  # type: ignore[attr-defined]
    backward([(a**2).sum(), (a * b).sum()], [a, b])
    jac_to_grad([a, b], UPGrad())
    assert a.grad is not None and b.grad is not None
    assert (a.grad.dtype, b.grad.dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("call", ["upgrad", "mean", "mtl_backward"])
def test_the_hook_of_an_unreached_input_does_not_run(call: str) -> None:
    """As after torch's ``backward(inputs=...)``: an input that no loss reaches keeps its
    ``.grad`` and its post-accumulate hook does not run; the reached inputs' hooks run once."""
    torch.manual_seed(0)
    used, unused, head = (torch.randn(3, requires_grad=True) for _ in range(3))
    ran: list[int] = []
    for i, p in enumerate((used, unused, head)):
        p.grad = torch.full_like(p, 7.0)
        p.register_post_accumulate_grad_hook(lambda _, i=i: ran.append(i))
    torch.autograd.backward([(used * head).sum()], inputs=[used, unused, head])
    assert sorted(ran) == [0, 2] and torch.equal(unused.grad, torch.full((3,), 7.0))
    ran.clear()
    features = used * 2
    losses = [(features * head).sum(), features.pow(2).sum()]
    if call == "mtl_backward":
        mtl_backward(losses, features, A=UPGrad(), shared_params=[used, unused])
    else:
        backward(losses, [used, unused, head], A=UPGrad() if call == "upgrad" else Mean())
    assert sorted(ran) == [0, 2]
    assert torch.equal(unused.grad, torch.full((3,), 7.0))
