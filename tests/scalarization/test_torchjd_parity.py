"""Same names, parameters and defaults as TorchJD 0.18: equal values, gradients and training
trajectories (skipped where torchjd is not installed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import jacflow.scalarization as jf

tj = pytest.importorskip("torchjd.scalarization")

W = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
Z = torch.tensor([0.1, 0.0, 0.2], dtype=torch.float64)

STATELESS: dict[str, Callable[[Any], Any]] = {
    "Mean": lambda lib: lib.Mean(),
    "Sum": lambda lib: lib.Sum(),
    "Constant": lambda lib: lib.Constant(W),
    "Random": lambda lib: lib.Random(),
    "GeometricMean": lambda lib: lib.GeometricMean(),
    "STCH": lambda lib: lib.STCH(0.3, W, Z),
    "STCH-defaults": lambda lib: lib.STCH(0.5),
    "PBI": lambda lib: lib.PBI(5.0, W, Z),
    "COSMOS": lambda lib: lib.COSMOS(2.0, W),
}


@pytest.mark.parametrize("name", list(STATELESS))
def test_same_value_and_gradient(name: str) -> None:
    losses = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64, requires_grad=True)
    results = []
    for lib in (jf, tj):
        torch.manual_seed(1)
        value = STATELESS[name](lib)(losses)
        (grad,) = torch.autograd.grad(value, losses)
        results.append((value.detach(), grad))
    # TorchJD's PBI adds 1e-12 under the square root of d2; jacflow does not.
    torch.testing.assert_close(results[0], results[1], rtol=1e-10, atol=1e-10)


def _trajectory(make: Callable[[Any], Any], lib: Any, kind: str) -> list[float]:
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    theta = torch.tensor([0.5, -0.3, 0.8], dtype=torch.float64, requires_grad=True)
    scalarizer = make(lib)
    params = [theta] if kind == "famo" else [theta, *scalarizer.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.05)
    values = []
    for _ in range(4):
        for _ in range(2):
            value = scalarizer(((x @ theta)[:, None] - y).pow(2).mean(0) + 0.05)
            values.append(value.item())
            optimizer.zero_grad()
            value.backward()
            optimizer.step()
            if kind == "famo":
                with torch.no_grad():
                    scalarizer.update(((x @ theta)[:, None] - y).pow(2).mean(0) + 0.05)
        if kind == "epoch":
            scalarizer.step()
    return values


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda lib: lib.DWA(), "epoch"),
        (lambda lib: lib.FAMO(3), "famo"),
        (lambda lib: lib.IMTLL(3), ""),
        (lambda lib: lib.UW(3), ""),
    ],
    ids=["DWA", "FAMO", "IMTLL", "UW"],
)
def test_same_training_trajectory(make: Callable[[Any], Any], kind: str) -> None:
    ours = _trajectory(make, jf, kind)
    theirs = _trajectory(make, tj, kind)
    assert ours == pytest.approx(theirs, rel=1e-7)
