"""Dual-cone projectors and their use by UPGrad."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import Tensor

from jacflow.aggregation import UPGrad, UPGradWeighting
from jacflow.linalg import (
    DualConeProjector,
    QuadprogProjector,
    TorchProjector,
    project_weights,
)
from jacflow.linalg._dual_cone import project_weights_reference


class ReferenceProjector(DualConeProjector):
    """A user-defined projector: the slow exact oracle."""

    def __call__(self, u: Tensor, gramian: Tensor) -> Tensor:
        return project_weights_reference(u, gramian)

    def _repr_args(self) -> str:
        return ""


def test_torch_projector_is_project_weights() -> None:
    torch.manual_seed(3)
    j = torch.randn(7, 5, dtype=torch.float64)
    u = torch.randn(3, 7, dtype=torch.float64)
    projector = TorchProjector(norm_eps=1e-4, reg_eps=1e-3, method="fista")
    expected = project_weights(u, j @ j.T, norm_eps=1e-4, reg_eps=1e-3, method="fista")
    torch.testing.assert_close(projector(u, j @ j.T), expected)
    assert repr(projector) == (
        "TorchProjector(norm_eps=0.0001, reg_eps=0.001, method='fista', max_iter=None, tol=None)"
    )


def test_quadprog_projector_matches_torch_on_the_regularised_problem() -> None:
    torch.manual_seed(4)
    j = torch.randn(6, 3, dtype=torch.float64)  # rank 3 < 6: regularisation makes it definite
    u = torch.eye(6, dtype=torch.float64)
    got = QuadprogProjector()(u, j @ j.T)
    expected = project_weights(u, j @ j.T, norm_eps=1e-4, reg_eps=1e-4)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-8)
    assert repr(QuadprogProjector()) == "QuadprogProjector(norm_eps=0.0001, reg_eps=0.0001)"


def test_quadprog_projector_keeps_dtype_and_shape() -> None:
    g = torch.tensor([[2.0, -1.0], [-1.0, 2.0]])
    out = QuadprogProjector()(torch.eye(2).reshape(1, 2, 2), g)
    assert out.shape == (1, 2, 2) and out.dtype == torch.float32


def test_quadprog_projector_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    zero = torch.zeros(2, 2, dtype=torch.float64)  # singular: quadprog needs reg_eps > 0
    with pytest.raises(ValueError, match="reg_eps > 0"):
        QuadprogProjector(reg_eps=0.0)(torch.eye(2, dtype=torch.float64), zero)
    with pytest.raises(ValueError, match=r"\[m, m\]"):
        QuadprogProjector()(torch.eye(2), torch.eye(2).expand(3, 2, 2))
    with pytest.raises(ValueError, match="norm_eps"):
        QuadprogProjector(norm_eps=-1.0)
    monkeypatch.setitem(sys.modules, "quadprog", None)
    with pytest.raises(ImportError, match="pip install quadprog"):
        QuadprogProjector()


def test_torch_projector_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="`method`"):
        TorchProjector(method="qp")
    with pytest.raises(ValueError, match="`max_iter`"):
        TorchProjector(max_iter=-2)
    with pytest.raises(ValueError, match="`tol`"):
        TorchProjector(tol=0.0)


def test_upgrad_with_projectors() -> None:
    torch.manual_seed(5)
    j = torch.randn(5, 9, dtype=torch.float64)
    default = UPGrad()(j)
    torch.testing.assert_close(UPGrad(projector=ReferenceProjector())(j), default)
    # TorchJD's regularisation moves the result away from the exact one, by a small amount.
    torchjd_like = UPGrad(projector=QuadprogProjector())(j)
    assert 0 < float((torchjd_like - default).norm()) < 1e-2 * float(default.norm())
    assert "projector=TorchProjector(" in repr(UPGradWeighting())
