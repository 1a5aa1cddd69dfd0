"""DB-MTL: several steps against a literal row-by-row implementation on autograd Jacobians."""

from __future__ import annotations

import math

import pytest
import torch

from jacflow import Stateful
from jacflow.aggregation import DBMTL
from tests.aggregation._properties import check_claimed_properties, check_degenerate_inputs
from tests.aggregation._with_losses import with_losses


def _reference(
    thetas: list[torch.Tensor], losses_fn: object, beta: float, sigma: float
) -> list[torch.Tensor]:
    """The paper's loop: EMA of grad log(L_i + 1e-8), rows rescaled to the largest norm."""
    assert callable(losses_fn)
    ema: list[torch.Tensor] | None = None
    updates = []
    for t, theta in enumerate(thetas, start=1):
        rows = []
        for i in range(3):
            x = theta.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(torch.log(losses_fn(x)[i] + 1e-8), x)
            rows.append(g)
        beta_t = beta / t**sigma
        if ema is None:
            ema = [torch.zeros_like(r) for r in rows]
        ema = [beta_t * e + (1 - beta_t) * r for e, r in zip(ema, rows)]
        biggest = max(float(e.norm()) for e in ema)
        updates.append(sum(biggest / (float(e.norm()) + 1e-8) * e for e in ema))
    return updates  # type: ignore[return-value]


@pytest.mark.parametrize("sigma", [0.0, 0.5])
def test_matches_the_paper_loop(sigma: float) -> None:
    torch.manual_seed(0)
    A_mat = torch.randn(3, 4, dtype=torch.float64)

    def losses_fn(x: torch.Tensor) -> torch.Tensor:
        return (A_mat @ x) ** 2 + torch.tensor([0.5, 1.0, 4.0], dtype=torch.float64)

    thetas = [torch.randn(4, dtype=torch.float64) for _ in range(5)]
    expected = _reference(thetas, losses_fn, 0.9, sigma)
    A = DBMTL(beta=0.9, beta_sigma=sigma)
    for theta, e in zip(thetas, expected):
        A.set_losses(losses_fn(theta))
        torch.testing.assert_close(A(torch.func.jacrev(losses_fn)(theta)), e)
    assert not math.isclose(float(expected[0].norm()), float(expected[-1].norm()))


def test_reset_restores_first_step_behaviour() -> None:
    A = DBMTL()
    assert isinstance(A, Stateful)
    J = torch.tensor([[4.0, 0.0], [1.0, 1.0]])
    A.set_losses(torch.tensor([2.0, 0.5]))
    first = A(J)
    assert not torch.equal(A(J), first)
    A.reset()
    torch.testing.assert_close(A(J), first)
    with pytest.raises(ValueError, match="reset"):
        A(torch.ones(2, 3))


def test_claimed_properties_and_degenerate_inputs() -> None:
    check_claimed_properties(with_losses(DBMTL))
    check_degenerate_inputs(with_losses(DBMTL))


def test_construction_errors_and_repr() -> None:
    with pytest.raises(ValueError, match=r"`beta` must be a float in \[0.0, 1.0\)"):
        DBMTL(beta=1.0)
    with pytest.raises(ValueError, match="beta_sigma"):
        DBMTL(beta_sigma=-0.1)
    with pytest.raises(ValueError, match="set_losses"):
        DBMTL()(torch.eye(2))
    assert repr(DBMTL()) == "DBMTL(beta=0.9, beta_sigma=0.0)"
    assert str(DBMTL()) == "DBMTL"


def test_nan_gives_nan_and_leaves_the_state_untouched() -> None:
    J = torch.tensor([[2.0, 0.0], [-1.0, 1.0]])
    reference, A = DBMTL(), DBMTL()
    for _ in range(2):
        A.set_losses(torch.tensor([2.0, 0.5]))
        reference.set_losses(torch.tensor([2.0, 0.5]))
        expected = reference(J)
        assert bool(torch.isnan(A(torch.tensor([[float("nan"), 0.0], [0.0, 1.0]]))).all())
        torch.testing.assert_close(A(J), expected)


@pytest.mark.parametrize("bad", [-0.5, 0.0, -1e-8, float("nan"), float("inf"), -float("inf")])
def test_bad_losses_leave_the_state_untouched(bad: float) -> None:
    """Finite losses <= 0 were taken: a negative loss made its task ascend (d = [-0.2, 0.2] for
    J = I), and -1e-8 divided by 0 and made the EMA NaN for good. They are refused (on a first
    call too); NaN and infinite losses are a skipped step (NaN update)."""
    J = torch.tensor([[2.0, 0.0], [-1.0, 1.0]])
    reference, A, fresh, new = DBMTL(), DBMTL(), DBMTL(), DBMTL()
    for method in (reference, A):
        method.set_losses(torch.tensor([2.0, 0.5]))
        method(J)
    for method in (A, fresh):
        method.set_losses(torch.tensor([bad, 0.5]))
        if math.isfinite(bad):
            with pytest.raises(ValueError, match="positive losses"):
                method(J)
        else:
            assert bool(method(J).isnan().all())
    for method in (reference, A, fresh, new):
        method.set_losses(torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(A(J), reference(J))
    torch.testing.assert_close(fresh(J), new(J))


def test_a_skipped_first_call_does_not_fix_the_shape() -> None:
    """A NaN Jacobian on a fresh instance set the EMA up (zeros of its shape), and a valid
    Jacobian of another shape was then refused; now it gives a fresh instance's update."""
    A = DBMTL()
    A.set_losses(torch.ones(2))
    assert bool(A(torch.tensor([[math.nan, 1.0, 2.0], [0.0, 1.0, 1.0]])).isnan().all())
    J = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    fresh = DBMTL()
    fresh.set_losses(torch.ones(2))
    A.set_losses(torch.ones(2))
    assert torch.equal(A(J), fresh(J))


def test_rows_whose_squared_norm_overflows_give_a_finite_update() -> None:
    """float32 rows of norm 2e30: their squared norms overflowed, inf / inf gave a NaN update."""
    J = torch.tensor([[2e30, 0.0, 1e30], [0.0, 1e30, 0.0]])
    updates = []
    for dtype in (torch.float32, torch.float64):
        A = DBMTL()
        A.set_losses(torch.tensor([1.0, 2.0]))
        updates.append(A(J.to(dtype)))
    torch.testing.assert_close(updates[0], updates[1].float())
