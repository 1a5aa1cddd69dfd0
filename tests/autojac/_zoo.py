"""Graphs to differentiate: each case gives leaf inputs and a pure function of them.

The reference Jacobian comes from ``torch.func.jacrev`` on the pure function, independently of
jacflow's autograd-based path.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jacflow.autojac import _graph, _rows


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[torch.dtype], tuple[list[Tensor], Callable[..., tuple[Tensor, ...]]]]


def _cpu_drawn(tensor: Tensor) -> Tensor:
    """A tensor drawn with a seeded CPU generator, moved to the default device (the same values
    on every device)."""
    return tensor.to(torch.get_default_device())


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return _cpu_drawn(torch.randn(shape, generator=gen, dtype=dtype, device="cpu"))


def _leaves(dtype: torch.dtype, *shapes: tuple[int, ...]) -> list[Tensor]:
    gen = torch.Generator().manual_seed(len(shapes))
    draws = [torch.randn(s, generator=gen, dtype=dtype, device="cpu") for s in shapes]
    return [_cpu_drawn(t).requires_grad_() for t in draws]


def _mlp(dtype: torch.dtype) -> tuple[list[Tensor], Callable[..., tuple[Tensor, ...]]]:
    x = _randn(6, 4, dtype=dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    target = _cpu_drawn(torch.randint(0, 3, (6,), generator=gen, device="cpu"))

    def fn(w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> tuple[Tensor, ...]:
        hidden = torch.tanh(x @ w1.T + b1)
        return (F.cross_entropy(hidden @ w2.T + b2, target, reduction="none"),)

    return _leaves(dtype, (5, 4), (5,), (3, 5), (3,)), fn


def _conv(dtype: torch.dtype) -> tuple[list[Tensor], Callable[..., tuple[Tensor, ...]]]:
    x = _randn(3, 2, 6, 6, dtype=dtype, seed=3)

    def fn(k: Tensor, kb: Tensor, w: Tensor) -> tuple[Tensor, ...]:
        h = F.relu(F.conv2d(x, k, kb, padding=1))
        return (F.avg_pool2d(h, 2).flatten(1) @ w.T,)

    return _leaves(dtype, (4, 2, 3, 3), (4,), (2, 36)), fn


def _shared(dtype: torch.dtype) -> tuple[list[Tensor], Callable[..., tuple[Tensor, ...]]]:
    x = _randn(3, dtype=dtype, seed=4)

    def fn(w: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        h = torch.tanh(w @ x)
        return h.sum(), (h**2) @ v, h[:2] * w[0, 0]

    return _leaves(dtype, (4, 3), (4,)), fn


def _shapes(dtype: torch.dtype) -> tuple[list[Tensor], Callable[..., tuple[Tensor, ...]]]:
    def fn(a: Tensor, b: Tensor) -> tuple[Tensor, ...]:
        return (a * b).sum(), torch.outer(a, b)[:3, 0], (a[:2, None] * b[None, :2]).sin()

    return _leaves(dtype, (3,), (3,)), fn


def _unused(dtype: torch.dtype) -> tuple[list[Tensor], Callable[..., tuple[Tensor, ...]]]:
    def fn(a: Tensor, unused: Tensor) -> tuple[Tensor, ...]:
        return (a.exp(), a.sum() * 2)

    return _leaves(dtype, (3,), (2, 2)), fn


def _paths(dtype: torch.dtype) -> tuple[list[Tensor], Callable[..., tuple[Tensor, ...]]]:
    def fn(a: Tensor, b: Tensor) -> tuple[Tensor, ...]:
        return (a * b + a**2 + torch.sin(a) * b.sum(), (a @ b) * a)

    return _leaves(dtype, (4,), (4,)), fn


def _attention(dtype: torch.dtype) -> tuple[list[Tensor], Callable[..., tuple[Tensor, ...]]]:
    x = _randn(2, 5, 4, dtype=dtype, seed=5)

    def fn(wq: Tensor, wk: Tensor, wv: Tensor) -> tuple[Tensor, ...]:
        q, k, v = x @ wq, x @ wk, x @ wv
        att = torch.softmax(q @ k.transpose(1, 2) / 2.0, dim=-1)
        return ((att @ v).pow(2).mean(dim=(1, 2)),)

    return _leaves(dtype, (4, 4), (4, 4), (4, 4)), fn


ZOO = [
    Case("mlp", _mlp),
    Case("conv", _conv),
    Case("shared_subgraph", _shared),
    Case("output_shapes", _shapes),
    Case("unused_input", _unused),
    Case("several_paths", _paths),
    Case("attention", _attention),
]


def reference_jacobians(
    fn: Callable[..., tuple[Tensor, ...]], inputs: list[Tensor]
) -> tuple[Tensor, ...]:
    """``[m, *input.shape]`` per input, rows ordered as the flattened outputs."""
    detached = [i.detach() for i in inputs]
    nested = torch.func.jacrev(fn, argnums=tuple(range(len(inputs))))(*detached)
    outputs = fn(*detached)
    return tuple(
        torch.cat([nested[o][k].reshape(out.numel(), *inp.shape) for o, out in enumerate(outputs)])
        for k, inp in enumerate(inputs)
    )


def adjacency(layout: str, dtype: torch.dtype = torch.float64, nodes: int = 7) -> Tensor:
    """The weighted adjacency matrix of a random graph on ``nodes`` nodes (two edges per node),
    sparse, in ``layout`` ("coo" or "csr")."""
    gen = torch.Generator().manual_seed(3)
    edges = torch.randint(0, nodes, (2, 2 * nodes), generator=gen)
    weights = torch.rand(2 * nodes, generator=gen, dtype=dtype)
    coo = torch.sparse_coo_tensor(edges, weights, (nodes, nodes), check_invariants=True)
    if layout == "coo":
        return coo.coalesce()
    with warnings.catch_warnings():  # (torch: "Sparse CSR tensor support is in beta state")
        warnings.simplefilter("ignore", UserWarning)
        return coo.to_sparse_csr()


def hide_sparse_operands(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make jacflow blind to the saved operands of matrix products, as it is on torch before
    2.10 (no ``SavedTensor.data``): where torch shows them, the walk of the graph is told to
    skip them, and the error paths to take them for unreadable. On earlier releases this is
    already so, and nothing is changed."""
    if not _graph.SPARSE_OPERANDS_READABLE:
        return
    monkeypatch.setattr(_graph, "_PRODUCT_OPERANDS", {})
    monkeypatch.setattr(_rows, "SPARSE_OPERANDS_READABLE", False)


class GCN(nn.Module):
    """Two graph convolutions, ``A relu(A X W1) W2`` with biases: Linear layers between products
    with a sparse adjacency matrix ``A``, as graph neural networks compute them."""

    def __init__(self, adjacency: Tensor, features: int = 3, width: int = 4) -> None:
        super().__init__()
        self.adjacency = adjacency
        self.first, self.second = nn.Linear(features, width), nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        hidden = torch.relu(torch.sparse.mm(self.adjacency, self.first(x)))
        return self.adjacency @ self.second(hidden)


def rows_by_autograd(losses: Sequence[Tensor], params: Sequence[Tensor]) -> Tensor:
    """The Jacobian ``[m, n]`` of the scalar ``losses`` w.r.t. ``params`` (flattened), one
    ``torch.autograd.grad`` per loss: no vmap, which sparse products defeat."""
    rows = []
    for loss in losses:
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        rows.append(
            torch.cat(
                [
                    (torch.zeros_like(p) if g is None else g).reshape(-1)
                    for p, g in zip(params, grads)
                ]
            )
        )
    return torch.stack(rows)
