"""GradVac / GradVacWeighting: literal reference over several steps, state and reset."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from jacflow.aggregation import GradVac, GradVacWeighting, PCGrad
from jacflow.aggregation._gradvac import gradvac_weights
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    check_nonfinite_gramian_gives_nan,
)
from tests.aggregation._seeded import seeded

J_DOC = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])


def literal_gradvac(J: Tensor, targets: Tensor, orders: Tensor, beta: float) -> Tensor:
    """Wang et al. (2021), Algorithm 2, on explicit vectors; updates ``targets`` in place."""
    total = torch.zeros(J.shape[1], dtype=J.dtype)
    for i in range(J.shape[0]):
        g = J[i].clone()
        for j in orders[i].tolist():
            if j == i:
                continue
            phi = float(g @ J[j]) / (float(g.norm()) * float(J[j].norm()))
            target = float(targets[i, j])
            if phi < target:
                coefficient = (
                    float(g.norm())
                    * (target * math.sqrt(1 - phi**2) - phi * math.sqrt(1 - target**2))
                    / (float(J[j].norm()) * math.sqrt(1 - target**2))
                )
                g = g + coefficient * J[j]
            targets[i, j] = (1 - beta) * target + beta * phi
        total += g
    return total


def test_claimed_properties() -> None:
    check_claimed_properties(seeded(GradVac, reset=True))


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(GradVac)


def test_several_steps_match_the_literal_algorithm() -> None:
    gen = torch.Generator().manual_seed(0)
    targets_ours = torch.zeros(4, 4, dtype=torch.float64)
    targets_ref = torch.zeros(4, 4, dtype=torch.float64)
    for _ in range(5):
        J = torch.randn(4, 6, generator=gen, dtype=torch.float64)
        orders = torch.stack([torch.randperm(4, generator=gen) for _ in range(4)])
        weights, targets_ours = gradvac_weights(J @ J.T, targets_ours, orders, 0.3, 0.0)
        expected = literal_gradvac(J, targets_ref, orders, 0.3)
        torch.testing.assert_close(weights @ J, expected)
        torch.testing.assert_close(targets_ours, targets_ref)
    assert bool((targets_ref != 0).any())  # the targets moved, so later steps differ from PCGrad


def test_first_call_equals_pcgrad() -> None:
    J = torch.randn(5, 7, dtype=torch.float64)
    torch.manual_seed(2)
    expected = PCGrad()(J)
    torch.manual_seed(2)
    torch.testing.assert_close(GradVac(eps=0.0)(J), expected)


def test_documented_values_over_three_steps() -> None:
    agg = GradVac()
    expected = [[0.5848, 3.8012, 3.8012], [1.0065, 3.2644, 3.2644], [1.3245, 2.8597, 2.8597]]
    for row in expected:
        torch.testing.assert_close(agg(J_DOC), torch.tensor(row), atol=1e-4, rtol=0)


def test_reset_restores_the_initial_behaviour() -> None:
    agg = GradVac()
    first = agg(J_DOC)
    assert not torch.allclose(agg(J_DOC), first)
    agg.reset()
    torch.testing.assert_close(agg(J_DOC), first)


def test_number_of_objectives_may_change_only_after_reset() -> None:
    agg = GradVac()
    agg(J_DOC)
    with pytest.raises(ValueError, match="reset"):
        agg(torch.randn(3, 3))
    agg.reset()
    assert agg(torch.randn(3, 3)).shape == (3,)


def test_weighting_and_aggregator_agree() -> None:
    J = torch.randn(4, 6, dtype=torch.float64)
    weighting, agg = GradVacWeighting(), GradVac()
    for seed in range(3):
        torch.manual_seed(seed)
        a = agg(J)
        torch.manual_seed(seed)
        torch.testing.assert_close(weighting(J @ J.T) @ J, a)


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match=r"`beta` must be a float in \[0.0, 1.0\]"):
        GradVac(beta=1.5)
    with pytest.raises(ValueError, match=r"`eps` must be a float in \[0.0, inf\)"):
        GradVac(eps=-1.0)


def test_repr_and_str() -> None:
    assert repr(GradVac()) == "GradVac(beta=0.5, eps=1e-08)"
    assert str(GradVac()) == "GradVac"


def test_device_and_dtype(device: str, dtype: torch.dtype) -> None:
    # Two rows: the visiting order, drawn from a device-specific RNG, does not matter.
    J = torch.randn(2, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    expected = GradVac()(J)
    torch.manual_seed(0)
    out = GradVac()(J.to(device=device, dtype=dtype))
    assert out.device.type == torch.device(device).type and out.dtype == dtype
    tol = 1e-3 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gramian_gives_nan_weights(bad: float) -> None:
    check_nonfinite_gramian_gives_nan(lambda: GradVacWeighting(), bad)


def test_a_nonfinite_step_leaves_the_targets() -> None:
    """A step a GradScaler skips (a NaN Gramian) gives NaN weights and leaves the similarity
    targets as they were: the next steps are those of a run without it (it set every target
    to NaN, after which GradVac returned the weights of Sum for good)."""
    gen = torch.Generator().manual_seed(3)
    jacobians = [torch.randn(3, 5, generator=gen, dtype=torch.float64) for _ in range(3)]
    bad = torch.full((3, 3), float("nan"), dtype=torch.float64)
    clean, skipped = GradVacWeighting(beta=0.5), GradVacWeighting(beta=0.5)
    torch.manual_seed(0)
    clean(jacobians[0] @ jacobians[0].T)
    torch.manual_seed(0)
    skipped(jacobians[0] @ jacobians[0].T)
    assert bool(skipped(bad).isnan().all())
    for J in jacobians[1:]:
        torch.manual_seed(1)
        expected = clean(J @ J.T)
        torch.manual_seed(1)
        torch.testing.assert_close(skipped(J @ J.T), expected)


def test_a_skipped_first_call_does_not_fix_the_number_of_rows() -> None:
    """A NaN Jacobian on a fresh instance stored zero targets of its number of rows, and a valid
    Jacobian of another number was then refused; now it gives a fresh instance's update."""
    A = GradVac()
    assert bool(A(torch.tensor([[math.nan, 1.0], [0.0, 1.0], [1.0, 1.0]])).isnan().all())
    assert A.gramian_weighting.state_dict() == GradVac().gramian_weighting.state_dict()
    J = torch.tensor([[1.0, -0.5], [0.0, 1.0]])
    torch.manual_seed(0)
    out = A(J)
    torch.manual_seed(0)
    assert torch.equal(out, GradVac()(J))
