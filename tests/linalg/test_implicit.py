"""Gradients of ``project_weights`` (implicit differentiation) against finite differences."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from jacflow.aggregation import UPGrad
from jacflow.linalg import project_weights


def conflicting_jacobian(m: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(1, n, generator=gen, dtype=torch.float64)
    signs = torch.tensor([(-1.0) ** i for i in range(m)], dtype=torch.float64)[:, None]
    return signs * base + 0.5 * torch.randn(m, n, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("method", ["pdas", "admm", "fista"])
def test_gradient_matches_finite_differences(method: str) -> None:
    j = conflicting_jacobian(4, 6, seed=0).requires_grad_()
    u = (torch.rand(2, 4, dtype=torch.float64) + 0.1).requires_grad_()
    v = project_weights(u.detach(), j.detach() @ j.detach().T)
    assert bool(((v - u.detach()) > 1e-6).any()), "the example must project something"

    def f(j: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return project_weights(u, j @ j.T, method=method, tol=1e-13)

    assert gradcheck(f, (j, u), eps=1e-6, atol=1e-5)


def test_second_derivatives_match_finite_differences() -> None:
    j = conflicting_jacobian(3, 5, seed=1).requires_grad_()
    u = torch.eye(3, dtype=torch.float64)

    def f(j: torch.Tensor) -> torch.Tensor:
        return project_weights(u, j @ j.T, tol=1e-13)

    assert gradgradcheck(f, (j,), eps=1e-6, atol=1e-5)


def test_batched_gramians_and_regularisation() -> None:
    j = torch.stack([conflicting_jacobian(3, 4, seed=s) for s in (2, 3)]).requires_grad_()
    u = torch.eye(3, dtype=torch.float64).expand(2, 3, 3)

    def f(j: torch.Tensor) -> torch.Tensor:
        return project_weights(u, j @ j.mT, norm_eps=1e-8, reg_eps=1e-2, tol=1e-13)

    assert gradcheck(f, (j,), eps=1e-6, atol=1e-5)


def test_upgrad_under_create_graph() -> None:
    j = conflicting_jacobian(3, 5, seed=4).requires_grad_()
    assert gradcheck(lambda j: UPGrad()(j), (j,), eps=1e-6, atol=1e-5)
    assert gradgradcheck(lambda j: UPGrad()(j), (j,), eps=1e-6, atol=1e-5)
    update = UPGrad()(j)
    (grad,) = torch.autograd.grad(update.square().sum(), j, create_graph=True)
    assert grad.requires_grad


def test_no_graph_without_requires_grad() -> None:
    j = conflicting_jacobian(3, 5, seed=5)
    assert not project_weights(torch.eye(3, dtype=torch.float64), j @ j.T).requires_grad
