"""IMTLL's value, and SGD on model and scales against the analytic gradient of its formula."""

from __future__ import annotations

import math

import pytest
import torch

from jacflow.scalarization import IMTLL
from tests.scalarization._training import task_losses


def test_value(dtype: torch.dtype) -> None:
    imtl = IMTLL(2)
    with torch.no_grad():
        imtl.log_scale.copy_(torch.tensor([0.5, -1.0]))
    out = imtl(torch.tensor([1.0, 2.0], dtype=dtype))
    expected = math.exp(0.5) * 1.0 - 0.5 + math.exp(-1.0) * 2.0 + 1.0
    assert out.item() == pytest.approx(expected, rel=1e-6)
    assert imtl.log_scale.dtype == dtype


def test_training_loop_matches_analytic_updates() -> None:
    imtl, lr = IMTLL(3), 0.1
    theta = torch.tensor([0.5, -0.3, 0.8], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.SGD([theta, *imtl.parameters()], lr=lr)
    ref_theta, s = theta.detach().clone(), [0.0, 0.0, 0.0]
    for step in range(5):
        optimizer.zero_grad()
        imtl(task_losses(theta, step % 2)).backward()
        optimizer.step()
        # reference: d/dtheta = sum e^{s_i} grad L_i, d/ds_i = e^{s_i} L_i - 1
        t = ref_theta.clone().requires_grad_(True)
        losses = task_losses(t, step % 2)
        value = sum(math.exp(si) * li for si, li in zip(s, losses))
        (g,) = torch.autograd.grad(value, t)
        s = [si - lr * (math.exp(si) * li - 1) for si, li in zip(s, losses.tolist())]
        ref_theta = ref_theta - lr * g
    torch.testing.assert_close(theta.detach(), ref_theta)
    assert imtl.log_scale.tolist() == pytest.approx(s, rel=1e-12)
