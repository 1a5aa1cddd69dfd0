"""Every example printed in ../shared/seeds, run on jacflow, with the printed result."""

from __future__ import annotations

import torch

from jacflow import backward, jac
from jacflow.aggregation import Sum, UPGrad


def test_seed_000_backward_upgrad() -> None:
    param = torch.tensor([1.0, 2.0], requires_grad=True)
    y1 = torch.tensor([-1.0, 1.0]) @ param
    y2 = (param**2).sum()
    backward([y1, y2], [param], A=UPGrad())
    assert repr(param.grad) == "tensor([0.5000, 2.5000])"


def test_seed_001_jac() -> None:
    param = torch.tensor([1.0, 2.0], requires_grad=True)
    y1 = torch.tensor([-1.0, 1.0]) @ param
    y2 = (param**2).sum()
    jacobians = jac([y1, y2], [param])
    assert repr(jacobians) == "(tensor([[-1.,  1.],\n        [ 2.,  4.]]),)"


def test_seed_001_gramian() -> None:
    weight = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    bias = torch.tensor([0.5, -0.5], requires_grad=True)
    input_vec = torch.tensor([1.0, -1.0])
    y1 = weight @ input_vec + bias
    y2 = (weight**2).sum() + (bias**2).sum()
    jacobians = jac([y1, y2], [weight, bias])
    assert [tuple(j.shape) for j in jacobians] == [(3, 2, 2), (3, 2)]
    matrices = tuple(j.flatten(1) for j in jacobians)
    combined = torch.concat(matrices, dim=1)
    gramian = combined @ combined.T
    expected = (
        "tensor([[  3.,   0.,  -1.],\n        [  0.,   3.,  -3.],\n        [ -1.,  -3., 122.]])"
    )
    assert repr(gramian) == expected


def test_seed_001_chain_rule() -> None:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    h = x**2
    y1 = h.sum()
    y2 = torch.tensor([1.0, -1.0]) @ h
    jac_h = jac([y1, y2], [h])[0]
    jac_x = jac(h, [x], jac_outputs=jac_h)[0]
    assert repr(jac_x) == "tensor([[ 2.,  4.],\n        [ 2., -4.]])"


def test_seed_001_backward_stores_jac() -> None:
    param = torch.tensor([1.0, 2.0], requires_grad=True)
    backward([torch.tensor([-1.0, 1.0]) @ param, (param**2).sum()])
    assert repr(param.jac) == "tensor([[-1.,  1.],\n        [ 2.,  4.]])"  # type: ignore[attr-defined]


def test_seed_004_r_example() -> None:
    x = torch.tensor([1.0], requires_grad=True)
    y = 2 * x
    a = torch.tensor([1.0], requires_grad=True)
    b = 3 * a
    backward([y, b], A=Sum())
    assert x.grad is not None and a.grad is not None
    assert float(x.grad) == 2.0 and float(a.grad) == 3.0
