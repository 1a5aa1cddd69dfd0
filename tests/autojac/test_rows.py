"""The row routine behind ``jac``, ``backward`` and ``mtl_backward``: the same Jacobian, graph
and dtype for every chunk size, against ``torch.autograd.grad`` row by row."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from jacflow import backward, jac, mtl_backward
from jacflow.aggregation import Constant, Mean, UPGrad

CHUNKS = [None, 1, 2]


def _point() -> Tensor:
    return torch.tensor([0.3, -1.2, 0.7], dtype=torch.float64, requires_grad=True)


def _outputs(x: Tensor) -> list[Tensor]:
    return [(x**3).sum(), (x.sin() * x[0]).sum(), (x * x[1]).sum()]


def _reference_rows(x: Tensor) -> Tensor:
    """The Jacobian row by row with ``torch.autograd.grad(create_graph=True)``."""
    outputs = _outputs(x)
    return torch.stack([torch.autograd.grad(o, x, create_graph=True)[0] for o in outputs])


@pytest.mark.parametrize("chunk", CHUNKS)
def test_jac_keeps_its_graph_under_no_grad(chunk: int | None) -> None:
    x = _point()
    outputs = _outputs(x)
    with torch.no_grad():
        (got,) = jac(outputs, [x], create_graph=True, parallel_chunk_size=chunk)
    assert got.requires_grad
    expected = _reference_rows(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    # Second derivatives: those of a function of the rows, against double autograd.grad.
    probe = torch.tensor([[1.0, -2.0, 0.5], [0.3, 0.0, 2.0], [-1.0, 1.0, 1.0]], dtype=x.dtype)
    (second,) = torch.autograd.grad((got * probe).sum() + (got**2).sum(), x)
    (reference,) = torch.autograd.grad((expected * probe).sum() + (expected**2).sum(), x)
    torch.testing.assert_close(second, reference, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("aggregate", [False, True])
def test_backward_keeps_the_graph_of_grad_and_jac_under_no_grad(
    chunk: int | None, aggregate: bool
) -> None:
    """A gradient penalty on ``.grad`` (or ``.jac``) built under ``no_grad`` keeps its
    second-order term, as after torch's ``backward(create_graph=True)``."""
    weights = torch.tensor([1.0, 2.0, -0.5], dtype=torch.float64)
    x = _point()
    outputs = _outputs(x)
    with torch.no_grad():
        backward(
            outputs,
            [x],
            A=Constant(weights) if aggregate else None,
            create_graph=True,
            parallel_chunk_size=chunk,
        )
    got = x.grad if aggregate else x.jac  # type: ignore[attr-defined]
    assert got is not None and got.requires_grad
    rows = _reference_rows(x)
    expected = weights @ rows if aggregate else rows
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    (penalty,) = torch.autograd.grad((got**2).sum() + (x**2).sum(), x)
    (reference,) = torch.autograd.grad((expected**2).sum() + (x**2).sum(), x)
    torch.testing.assert_close(penalty, reference, rtol=0, atol=1e-12)


_needs_grad_dtype = pytest.mark.skipif(
    not hasattr(Tensor, "grad_dtype"), reason="Tensor.grad_dtype needs torch >= 2.10"
)


def _mixed_precision_problem() -> tuple[Tensor, Tensor, Tensor]:
    """A bfloat16 parameter with float32 gradients (``grad_dtype``), its outputs and their
    Jacobian row by row with ``torch.autograd.grad`` (float32 rows)."""
    generator = torch.Generator().manual_seed(0)
    p = torch.randn(64, generator=generator).to(torch.bfloat16).requires_grad_()
    p.grad_dtype = torch.float32  # type: ignore[attr-defined]
    c = torch.randn(8, 64, generator=generator)
    y = torch.tanh(c @ p.float()) * 3.1
    rows = torch.stack([torch.autograd.grad(y[i], p, retain_graph=True)[0] for i in range(8)])
    assert rows.dtype == torch.float32
    return p, y, rows


@_needs_grad_dtype
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_jacobian_has_the_dtype_of_autograds_rows_for_every_chunk_size(chunk: int | None) -> None:
    p, y, rows = _mixed_precision_problem()
    (got,) = jac([y], [p], parallel_chunk_size=chunk, retain_graph=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, rows, rtol=0, atol=0)
    backward([y], [p], parallel_chunk_size=chunk)
    assert p.jac.dtype == torch.float32  # type: ignore[attr-defined]
    torch.testing.assert_close(p.jac, rows, rtol=0, atol=0)  # type: ignore[attr-defined]


@_needs_grad_dtype
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_aggregated_grad_is_not_rounded_to_the_parameters_dtype(chunk: int | None) -> None:
    p, y, rows = _mixed_precision_problem()
    backward([y], [p], A=UPGrad(), parallel_chunk_size=chunk)
    assert p.grad is not None and p.grad.dtype == torch.float32
    torch.testing.assert_close(p.grad, UPGrad()(rows), rtol=0, atol=0)


class _SparseModel:
    """A sparse embedding (``sparse=True``: autograd's gradient of its table is sparse) under a
    linear layer, in float64, with two outputs."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(5, 3, sparse=True).double()
        self.linear = torch.nn.Linear(3, 2).double()
        self.ids = torch.tensor([0, 2, 2])
        self.params = [self.embedding.weight, self.linear.weight, self.linear.bias]

    def outputs(self) -> list[Tensor]:
        y = self.linear(self.embedding(self.ids))
        return [y[:, 0].sum(), (y[:, 1] ** 2).sum()]

    def reference_rows(self) -> list[Tensor]:
        """Per parameter, its dense Jacobian row by row with ``torch.autograd.grad``."""
        grads = [torch.autograd.grad(o, self.params, retain_graph=True) for o in self.outputs()]
        return [torch.stack([g[k].to_dense() for g in grads]) for k in range(len(self.params))]


def _flat(blocks: list[Tensor]) -> Tensor:
    return torch.cat([b.reshape(b.shape[0], -1) for b in blocks], dim=1)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_sparse_gradients_give_the_dense_jacobian(chunk: int | None) -> None:
    model = _SparseModel()
    expected = model.reference_rows()
    got = jac(model.outputs(), model.params, parallel_chunk_size=chunk)
    for g, e in zip(got, expected):
        assert g.layout == torch.strided
        torch.testing.assert_close(g, e, rtol=0, atol=1e-14)
    backward(model.outputs(), model.params, parallel_chunk_size=chunk)
    for p, e in zip(model.params, expected):
        assert p.jac.layout == torch.strided  # type: ignore[attr-defined]
        torch.testing.assert_close(p.jac, e, rtol=0, atol=1e-14)  # type: ignore[attr-defined]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_sparse_gradients_are_aggregated_into_a_dense_grad(chunk: int | None) -> None:
    model = _SparseModel()
    expected = model.reference_rows()
    update = UPGrad()(_flat(expected))
    backward(model.outputs(), model.params, A=UPGrad(), parallel_chunk_size=chunk)
    got = torch.cat([p.grad.reshape(-1) for p in model.params])  # type: ignore[union-attr]
    assert all(p.grad is not None and p.grad.layout == torch.strided for p in model.params)
    torch.testing.assert_close(got, update, rtol=0, atol=1e-12)
    assert update[: model.embedding.weight.numel()].abs().sum() > 0


def test_mean_keeps_autograds_sparse_grad() -> None:
    """``Mean()``'s single differentiation writes autograd's gradient (sparse), as before."""
    model = _SparseModel()
    expected = model.reference_rows()
    backward(model.outputs(), model.params, A=Mean())
    table = model.embedding.weight.grad
    assert table is not None and table.layout == torch.sparse_coo
    torch.testing.assert_close(table.to_dense(), expected[0].mean(0), rtol=0, atol=1e-14)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_gather_with_sparse_grad(chunk: int | None) -> None:
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[0, 1, 1], [3, 3, 0]])
    y = torch.gather(x, 0, index, sparse_grad=True) ** 2
    expected = torch.stack(
        [torch.autograd.grad(v, x, retain_graph=True)[0].to_dense() for v in y.reshape(-1)]
    )
    (got,) = jac(y, [x], parallel_chunk_size=chunk)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-14)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_a_sparse_input(chunk: int | None) -> None:
    """A sparse leaf (through ``torch.sparse.mm``) has sparse gradients too: its Jacobian was
    refused by vmap at the default chunk size; it is autograd's rows, densified."""
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    dense[dense.abs() < 0.5] = 0.0
    sparse = dense.to_sparse().requires_grad_()
    other = torch.randn(3, 2, generator=generator, dtype=torch.float64)
    y = torch.sparse.mm(sparse, other).sum(1).sin()
    expected = torch.stack(
        [torch.autograd.grad(v, sparse, retain_graph=True)[0].to_dense() for v in y]
    )
    (got,) = jac(y, [sparse], parallel_chunk_size=chunk)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-14)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_mtl_backward_with_a_sparse_embedding_trunk(chunk: int | None) -> None:
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(5, 3, sparse=True).double()
    heads = [torch.nn.Linear(3, 1).double() for _ in range(2)]
    ids = torch.tensor([0, 2, 2])

    def losses() -> tuple[list[Tensor], Tensor]:
        feature = embedding(ids)
        return [heads[0](feature).sum(), heads[1](feature).pow(2).sum()], feature

    table = embedding.weight
    references = [
        torch.autograd.grad(loss, [table, *head.parameters()], retain_graph=True)
        for loss, head in zip(losses()[0], heads)
    ]
    rows = torch.stack([r[0].to_dense() for r in references])
    loss_list, feature = losses()
    mtl_backward(loss_list, feature, A=UPGrad(), parallel_chunk_size=chunk)
    assert table.grad is not None and table.grad.layout == torch.strided
    torch.testing.assert_close(
        table.grad, UPGrad()(rows.reshape(2, -1)).reshape(table.shape), rtol=0, atol=1e-12
    )
    for head, reference in zip(heads, references):
        for p, r in zip(head.parameters(), reference[1:]):
            torch.testing.assert_close(p.grad, r, rtol=0, atol=1e-14)
