"""UW and RevisedUW: values, the minimiser over the uncertainty, and SGD against the analytic
gradients of their formulas; parameters follow the losses' device/dtype in place."""

from __future__ import annotations

import math

import pytest
import torch

from jacflow.scalarization import UW, RevisedUW
from tests.scalarization._training import task_losses


def test_uw_value(dtype: torch.dtype) -> None:
    uw = UW(2)
    with torch.no_grad():
        uw.log_var.copy_(torch.tensor([0.5, -1.0]))
    out = uw(torch.tensor([1.0, 2.0], dtype=dtype))
    expected = 0.5 * math.exp(-0.5) + 0.25 + 0.5 * math.exp(1.0) * 2.0 - 0.5
    assert out.item() == pytest.approx(expected, rel=1e-6)


def test_revised_uw_value(dtype: torch.dtype) -> None:
    ruw = RevisedUW(2)
    with torch.no_grad():
        ruw.sigma.copy_(torch.tensor([0.5, 2.0]))
    out = ruw(torch.tensor([1.0, 2.0], dtype=dtype))
    expected = 1.0 / (2 * 0.25) + math.log(1.25) + 2.0 / (2 * 4.0) + math.log(5.0)
    assert out.item() == pytest.approx(expected, rel=1e-6)


def test_minimisers_over_the_uncertainty() -> None:
    losses = torch.tensor([0.3, 4.0], dtype=torch.float64)
    uw, ruw = UW(2), RevisedUW(2)
    with torch.no_grad():
        uw.log_var.copy_(torch.log(losses))  # sigma^2 = L
        # 2 sigma^4 = L (1 + sigma^2): sigma^2 = (L + sqrt(L^2 + 8 L)) / 4
        ruw.sigma.copy_(((losses + torch.sqrt(losses**2 + 8 * losses)) / 4).sqrt())
    for scalarizer in (uw, ruw):
        (grad,) = torch.autograd.grad(scalarizer(losses), list(scalarizer.parameters()))
        torch.testing.assert_close(grad, torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("name", ["UW", "RevisedUW"])
def test_training_loop_matches_analytic_updates(name: str) -> None:
    lr = 0.1
    scalarizer = UW(3) if name == "UW" else RevisedUW(3)
    theta = torch.tensor([0.5, -0.3, 0.8], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.SGD([theta, *scalarizer.parameters()], lr=lr)
    ref_theta, p = theta.detach().clone(), [0.0] * 3 if name == "UW" else [1.0] * 3
    for step in range(5):
        optimizer.zero_grad()
        scalarizer(task_losses(theta, step % 2)).backward()
        optimizer.step()
        t = ref_theta.clone().requires_grad_(True)
        losses = task_losses(t, step % 2)
        if name == "UW":  # coefficient e^{-s}/2, d/ds = -e^{-s} L / 2 + 1/2
            coefficients = [0.5 * math.exp(-s) for s in p]
            dp = [-0.5 * math.exp(-s) * li + 0.5 for s, li in zip(p, losses.tolist())]
        else:  # coefficient 1/(2 sigma^2), d/dsigma = -L / sigma^3 + 2 sigma / (1 + sigma^2)
            coefficients = [1 / (2 * s**2) for s in p]
            dp = [-li / s**3 + 2 * s / (1 + s**2) for s, li in zip(p, losses.tolist())]
        (g,) = torch.autograd.grad(sum(c * li for c, li in zip(coefficients, losses)), t)
        p = [pi - lr * di for pi, di in zip(p, dp)]
        ref_theta = ref_theta - lr * g
    torch.testing.assert_close(theta.detach(), ref_theta)
    (param,) = scalarizer.parameters()
    assert param.tolist() == pytest.approx(p, rel=1e-12)


def test_parameter_follows_the_losses_in_place() -> None:
    uw = UW(2)
    optimizer = torch.optim.SGD(uw.parameters(), lr=0.5)
    before = uw.log_var
    uw(torch.tensor([1.0, 3.0], dtype=torch.float64)).backward()
    optimizer.step()
    assert uw.log_var is before  # the optimizer still holds the same parameter
    assert uw.log_var.dtype == torch.float64
    assert uw.log_var.tolist() == pytest.approx([0.0, 0.5])  # -lr * (1/2 - L/2)
