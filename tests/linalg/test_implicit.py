"""Gradients of ``project_weights`` (implicit differentiation) against finite differences."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from jacflow.aggregation import DualProj, UPGrad
from jacflow.linalg import project_weights
from jacflow.linalg._dual_cone import project_diagonal


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


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize(("m", "where"), [(3, (1, 1)), (8, (1, 1)), (8, (0, 1)), (40, (2, 2))])
def test_non_finite_inputs_leave_the_other_gradients_finite(
    bad: float, m: int, where: tuple[int, int]
) -> None:
    """A non-finite Gramian of a batch gives NaN rows forward; its backward raised a
    ``LinAlgError`` from ``pinv``. A non-finite row of ``u`` made the whole Gramian's gradient
    NaN. Now the finite inputs' gradients are those they have alone; a non-finite row of ``u``
    gets no gradient, and a non-finite Gramian NaN where the loss uses its rows."""
    gen = torch.Generator().manual_seed(m)
    a = torch.randn(2, m, m + 2, generator=gen, dtype=torch.float64)
    gramians = a @ a.mT
    gramians[0, where[0], where[1]] = gramians[0, where[1], where[0]] = bad
    u = torch.eye(m, dtype=torch.float64).expand(2, m, m).clone()
    u[1, 2, 0] = bad
    w = torch.randn(2, m, m, generator=gen, dtype=torch.float64)
    rows = [0, 1, *range(3, m)]

    def gradients(loss_on_nan_rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
        g_leaf, u_leaf = gramians.clone().requires_grad_(True), u.clone().requires_grad_(True)
        v = project_weights(u_leaf, g_leaf)
        loss = (v[1, rows] * w[1, rows]).sum()
        if loss_on_nan_rows:
            loss = loss + v[0, 0, 0] + v[1, 2, 1]
        loss.backward()
        assert g_leaf.grad is not None and u_leaf.grad is not None
        return g_leaf.grad, u_leaf.grad

    g_alone = gramians[1].clone().requires_grad_(True)
    u_alone = u[1, rows].clone().requires_grad_(True)
    (project_weights(u_alone, g_alone) * w[1, rows]).sum().backward()
    for loss_on_nan_rows in (False, True):
        grad_g, grad_u = gradients(loss_on_nan_rows)
        torch.testing.assert_close(grad_g[1], g_alone.grad)
        torch.testing.assert_close(grad_u[1, rows], u_alone.grad)
        assert bool((grad_u[1, 2] == 0).all()) and bool((grad_u[0, 1:] == 0).all())
        if loss_on_nan_rows:
            assert bool(grad_g[0].isnan().all()) and bool(grad_u[0, 0].isnan().all())
        else:  # (the non-finite Gramian's own gradient may be NaN: 0 * inf in its rescaling)
            assert bool((grad_u[0] == 0).all())


@pytest.mark.parametrize("diagonal", [False, True])
def test_non_finite_rows_leave_second_derivatives_finite(diagonal: bool) -> None:
    """A rescaled Gramian (diagonal spread 400) and a non-finite row of ``u`` (or entry of
    ``pref``) that the loss does not use: the second derivatives w.r.t. ``G`` were NaN (the
    rescaling's ``u * d`` multiplied the NaN by a zero cotangent in the double backward; a
    review's finding). They equal those of the same problem with that row set to 0."""
    gramian = torch.tensor(
        [[1.0, -0.5, 0.2], [-0.5, 100.0, -3.0], [0.2, -3.0, 400.0]], dtype=torch.float64
    )
    w = torch.tensor([[1.0, 2.0, -1.0], [0.5, -1.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)

    def second(bad: float) -> tuple[torch.Tensor, torch.Tensor]:
        g = gramian.clone().requires_grad_(True)
        if diagonal:
            v = project_diagonal(torch.tensor([1.0, 2.0, bad], dtype=torch.float64), g)
        else:
            u = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [bad, 0.0, 0.0]])
            v = project_weights(u.double(), g)
        loss = (v[:2] * w[:2]).sum()
        (grad_g,) = torch.autograd.grad(loss, (g,), create_graph=True)
        (hessian_term,) = torch.autograd.grad((grad_g**2).sum(), (g,))
        return grad_g.detach(), hessian_term

    expected = second(0.0)
    for bad in (float("nan"), float("inf")):
        for got, want in zip(second(bad), expected, strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("rows", ["three", "four", "four rescaled"])
def test_a_trivial_dual_cone_gives_a_zero_gradient(rows: str) -> None:
    """Rows that positively span the space (the dual cone ``{x : J x >= 0}`` is ``{0}`` for J
    and every J near it): the update ``J^T v`` is 0 around J, so its gradient is 0. The
    constraints held at ``v_i = u_i`` there have zero multipliers (weakly active); held with
    ``dv_i = du_i`` they gave gradients of 0.3 (UPGrad, DualProj) and 1.2 (the projections).
    Rescaled (a diagonal spread of 1e4), ``v_i = u_i`` also took ``u_i``'s gradient."""
    if rows == "three":
        j = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    else:
        j = torch.tensor([[2.0, 1.0], [-1.0, -0.5], [0.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    if rows == "four rescaled":
        j = j * torch.tensor([[1.0], [10.0], [1.0], [0.1]], dtype=torch.float64)
    m = j.shape[0]
    w = torch.tensor([1.0, -2.0], dtype=torch.float64)
    j = j.requires_grad_()
    updates = {
        "upgrad": UPGrad()(j),
        "dualproj": DualProj()(j),
        "projections": project_weights(torch.eye(m, dtype=torch.float64), j @ j.T) @ j,
    }
    for name, update in updates.items():
        assert float(update.detach().abs().max()) < 1e-12, name
        (grad,) = torch.autograd.grad((update @ w).sum(), j)
        torch.testing.assert_close(grad, torch.zeros_like(grad), atol=1e-12, rtol=0, msg=name)
