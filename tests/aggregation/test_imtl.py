"""IMTL hybrid: IMTL-G on the scaled losses' Jacobian (paper's closed form) and IMTL-L's scales."""

from __future__ import annotations

import pytest
import torch

from jacflow import Stateful, backward
from jacflow.aggregation import IMTL
from tests.aggregation._properties import check_claimed_properties, jacobians


def _paper_closed_form(grads: torch.Tensor) -> torch.Tensor:
    """Liu et al. (2021), Eq. of IMTL-G: alpha_{2:m} = g_1 U^T (D U^T)^{-1}, alpha_1 = 1 - sum."""
    units = grads / grads.norm(dim=1, keepdim=True)
    D = grads[0:1] - grads[1:]
    U = units[0:1] - units[1:]
    rest = grads[0] @ U.T @ torch.linalg.inv(D @ U.T)
    alpha = torch.cat([(1 - rest.sum())[None], rest])
    return alpha @ grads


def test_one_training_step_against_the_paper() -> None:
    torch.manual_seed(0)
    shared = torch.randn(5, dtype=torch.float64, requires_grad=True)
    heads = torch.randn(3, 5, dtype=torch.float64)
    imtl = IMTL(3).double()
    with torch.no_grad():
        imtl.imtl_l.log_scale.copy_(torch.tensor([0.3, -1.0, 0.5]))
    losses = ((heads * shared).sum(1) - 1) ** 2 + torch.tensor([0.5, 1.0, 2.0]).double()
    scaled = imtl.scale_losses(losses)
    J = torch.stack([torch.autograd.grad(x, shared, retain_graph=True)[0] for x in scaled])
    torch.testing.assert_close(imtl(J), _paper_closed_form(J))
    # The Jacobian of the scaled losses is the original one with rows scaled by e^s.
    J_raw = torch.func.jacrev(lambda x: ((heads * x).sum(1) - 1) ** 2)(shared.detach())
    torch.testing.assert_close(J, torch.exp(imtl.imtl_l.log_scale.detach())[:, None] * J_raw)
    scaled.sum().backward()
    s = imtl.imtl_l.log_scale.detach()
    torch.testing.assert_close(imtl.imtl_l.log_scale.grad, torch.exp(s) * losses.detach() - 1)


def test_reset_sets_the_scales_back_to_zero() -> None:
    imtl = IMTL(2)
    assert isinstance(imtl, Stateful)
    with torch.no_grad():
        imtl.imtl_l.log_scale.fill_(2.0)
    imtl.reset()
    losses = torch.tensor([3.0, 4.0])
    torch.testing.assert_close(imtl.scale_losses(losses), losses)
    assert list(imtl.parameters()) == [imtl.imtl_l.log_scale]


@pytest.mark.parametrize("m", [1, 2, 5])
def test_claimed_properties(m: int) -> None:
    # (n_tasks fixes the number of rows: each size gets its own strategy)
    check_claimed_properties(lambda: IMTL(m), jacobians(min_m=m, max_m=m))


def test_degenerate_inputs() -> None:
    """check_degenerate_inputs with n_tasks matching each input (it mixes m = 2 and m = 3)."""
    empty_rows = IMTL(4)(torch.zeros(0, 5))
    assert empty_rows.shape == (5,) and bool((empty_rows == 0).all())
    assert IMTL(3)(torch.zeros(3, 0)).shape == (0,)
    nan_matrix = torch.tensor([[1.0, float("nan")], [0.5, 2.0]])
    assert not bool(torch.isfinite(IMTL(2)(nan_matrix)).all())


def test_a_jacobian_of_another_number_of_rows_is_refused() -> None:
    """``n_tasks`` is the number of scales: refused by the call and, before it differentiates,
    by ``jacflow.backward``, which then leaves ``.grad`` unchanged."""
    with pytest.raises(ValueError, match=r"built with `n_tasks=2`.*received 3 objectives"):
        IMTL(2)(torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"received 3 objectives"):
        IMTL(2).weights(torch.ones(3, 4))
    p = torch.ones(4, requires_grad=True)
    with pytest.raises(ValueError, match=r"construct it with `n_tasks=3`"):
        backward(torch.stack([p.sum(), p.pow(2).sum(), p.sin().sum()]), A=IMTL(2))
    assert p.grad is None


def test_errors_and_repr() -> None:
    with pytest.raises(ValueError, match="n_tasks"):
        IMTL(0)
    with pytest.raises(ValueError, match="n_tasks losses"):
        IMTL(2).scale_losses(torch.ones(3))
    with pytest.raises(TypeError, match="losses"):
        IMTL(2).scale_losses([1.0, 2.0])  # type: ignore[arg-type]
    assert repr(IMTL(2)) == "IMTL(n_tasks=2)"
    assert str(IMTL(2)) == "IMTL"
