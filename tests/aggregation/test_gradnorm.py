"""GradNorm: the weight update against a literal autograd implementation of the paper's step."""

from __future__ import annotations

import pytest
import torch

from jacflow import Stateful
from jacflow.aggregation import GradNorm, GradNormWeighting
from tests.aggregation._properties import check_claimed_properties, check_degenerate_inputs
from tests.aggregation._with_losses import with_losses


def _reference_weights(
    jacobians: list[torch.Tensor], losses: list[torch.Tensor], alpha: float, lr: float
) -> list[torch.Tensor]:
    """Algorithm 1 of Chen et al. (2018), written with autograd on a weight parameter."""
    m = jacobians[0].shape[0]
    w = torch.ones(m, dtype=torch.float64, requires_grad=True)
    used = []
    for J, L in zip(jacobians, losses):
        used.append(w.detach().clone())
        norms = torch.stack([(w[i] * J[i]).norm() for i in range(m)])
        mean_norm = norms.mean().detach()
        ratio = L / losses[0]
        targets = (mean_norm * (ratio / ratio.mean()) ** alpha).detach()
        grad_loss = (norms - targets).abs().sum()
        (gw,) = torch.autograd.grad(grad_loss, w)
        with torch.no_grad():
            new = w - lr * gw
            w = (m * new / new.sum()).requires_grad_(True)
    return used


def test_matches_the_paper_update_over_several_steps() -> None:
    torch.manual_seed(0)
    m, n, steps = 4, 7, 6
    jacobians = [torch.randn(m, n, dtype=torch.float64) for _ in range(steps)]
    losses = [torch.rand(m, dtype=torch.float64) + 0.5 for _ in range(steps)]
    expected = _reference_weights(jacobians, losses, alpha=1.5, lr=0.05)
    W = GradNormWeighting(alpha=1.5, lr=0.05)
    A = GradNorm(alpha=1.5, lr=0.05)
    for J, L, w in zip(jacobians, losses, expected):
        W.set_losses(L)
        A.set_losses(L)
        torch.testing.assert_close(W(J @ J.T), w)
        torch.testing.assert_close(A(J), w @ J)  # the aggregator agrees with the weighting


_TINY = 1e-300


@pytest.mark.parametrize(
    ("losses", "stand_ins"),
    [
        # task 0 starts at 0 (an auxiliary or masked loss), stays there, then rises: 0/0 is no
        # change, x/0 the limit of x/eps for eps -> 0
        (
            [[0.0, 1.0], [0.0, 0.9], [0.3, 0.9], [0.2, 0.8], [0.1, 0.7]],
            [[_TINY, 1.0], [_TINY, 0.9], [0.3, 0.9], [0.2, 0.8], [0.1, 0.7]],
        ),
        # every loss reaches 0: equal ratios, as when both shrink by the same tiny factor
        (
            [[1.0, 2.0], [0.5, 1.5], [0.0, 0.0], [0.4, 1.0]],
            [[1.0, 2.0], [0.5, 1.5], [_TINY, 2 * _TINY], [0.4, 1.0]],
        ),
    ],
)
def test_zero_losses_keep_the_weights_finite(
    losses: list[list[float]], stand_ins: list[list[float]]
) -> None:
    """A zero initial loss made the weights NaN for good (0/0); they are now the limit of the
    paper's step with tiny positive losses in place of the zeros."""
    torch.manual_seed(0)
    jacobians = [torch.randn(2, 3, dtype=torch.float64) for _ in losses]
    expected = _reference_weights(
        jacobians, [torch.tensor(L, dtype=torch.float64) for L in stand_ins], alpha=1.5, lr=0.1
    )
    W = GradNormWeighting(alpha=1.5, lr=0.1)
    for J, L, w in zip(jacobians, losses, expected):
        W.set_losses(torch.tensor(L, dtype=torch.float64))
        torch.testing.assert_close(W(J @ J.T), w)
    assert W._weights is not None and bool(torch.isfinite(W._weights).all())


def test_negative_losses_are_refused_before_any_change() -> None:
    J = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    reference, A = GradNorm(), GradNorm()
    for method in (reference, A):
        method.set_losses(torch.tensor([1.0, 2.0]))
        method(J)
    A.set_losses(torch.tensor([-0.5, 1.0]))  # gave NaN weights for good (a ratio of -0.5)
    with pytest.raises(ValueError, match="non-negative losses"):
        A(J)
    for method in (reference, A):
        method.set_losses(torch.tensor([0.5, 1.0]))
    torch.testing.assert_close(A(J), reference(J))


def test_reset_restores_first_step_behaviour() -> None:
    A = GradNorm()
    assert isinstance(A, Stateful)
    J = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    A.set_losses(torch.tensor([1.0, 2.0]))
    first = A(J)
    A.set_losses(torch.tensor([0.2, 2.0]))
    assert not torch.equal(A(J), first)
    A.reset()
    A.set_losses(torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(A(J), first)
    torch.testing.assert_close(first, J.sum(0))  # the first step is Sum


def test_claimed_properties_and_degenerate_inputs() -> None:
    check_claimed_properties(with_losses(GradNorm))
    check_degenerate_inputs(with_losses(GradNorm))


def test_changed_number_of_objectives_is_an_error() -> None:
    W = GradNormWeighting()
    W.set_losses(torch.ones(2))
    W(torch.eye(2))
    W.set_losses(torch.ones(3))
    with pytest.raises(ValueError, match="reset"):
        W(torch.eye(3))


def test_nan_propagates_and_leaves_the_state_untouched() -> None:
    J = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    reference, A = GradNorm(), GradNorm()
    for L in (torch.ones(2), torch.tensor([0.5, 1.0])):
        reference.set_losses(L)
        reference(J)
        A.set_losses(L)
        A(J)
        A.set_losses(torch.tensor([1.0, float("nan")]))
        assert bool(torch.isnan(A(J)).all())
        A.set_losses(L)
        assert bool(torch.isnan(A(torch.tensor([[float("inf"), 0.0], [0.0, 1.0]]))).all())
    reference.set_losses(torch.ones(2))
    A.set_losses(torch.ones(2))
    torch.testing.assert_close(A(J), reference(J))  # the skipped steps changed nothing


def test_construction_errors_and_repr() -> None:
    with pytest.raises(ValueError, match=r"`alpha` must be a float in \[0.0, inf\)"):
        GradNorm(alpha=-1.0)
    with pytest.raises(ValueError, match=r"`lr` must be a float in \(0.0, inf\)"):
        GradNorm(lr=0.0)
    with pytest.raises(TypeError, match="lr"):
        GradNormWeighting(lr="fast")  # type: ignore[arg-type]
    assert repr(GradNorm()) == "GradNorm(alpha=1.5, lr=0.025)"
    assert str(GradNorm()) == "GradNorm"
    with pytest.raises(ValueError, match="set_losses"):
        GradNorm()(torch.eye(2))
