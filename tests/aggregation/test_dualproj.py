"""DualProj: claimed properties, TorchJD's values, and agreement with quadprog."""

from __future__ import annotations

import numpy as np
import pytest
import quadprog
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jacflow.aggregation import DualProj, DualProjWeighting
from jacflow.linalg import QuadprogProjector, TorchProjector
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    make_jacobian,
)

J_DOC = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])


def test_claimed_properties() -> None:
    check_claimed_properties(DualProj)


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(DualProj)


def test_documented_values() -> None:
    # TorchJD 0.18 normalises and regularises the Gramian by 1e-4: the same settings give its
    # numbers; the defaults solve the exact problem.
    torchjd_like = DualProj(projector=TorchProjector(norm_eps=1e-4, reg_eps=1e-4))(J_DOC)
    torch.testing.assert_close(
        DualProj(projector=QuadprogProjector())(J_DOC), torchjd_like, atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        torchjd_like, torch.tensor([0.5563, 1.1109, 1.1109]), atol=1e-4, rtol=0
    )
    torch.testing.assert_close(DualProj()(J_DOC), torch.tensor([5 / 9, 10 / 9, 10 / 9]))


def _quadprog_weights(gramian: np.ndarray, u: np.ndarray) -> np.ndarray:
    """min v^T G v s.t. v >= u, by quadprog (needs a positive definite G)."""
    m = gramian.shape[0]
    return quadprog.solve_qp(2 * gramian, np.zeros(m), np.eye(m), u)[0]


@settings(max_examples=25)
@given(st.integers(1, 8), st.integers(0, 2**31 - 1), st.sampled_from([1e-3, 1.0, 1e3]))
def test_matches_quadprog(m: int, seed: int, scale: float) -> None:
    J = make_jacobian(m, m + 3, m, scale, torch.float64, seed)  # full row rank: G is PD
    G = J @ J.T
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(m, generator=gen, dtype=torch.float64)
    expected = _quadprog_weights(G.numpy(), u.numpy())
    weights = DualProjWeighting(pref_vector=u)(G)
    np.testing.assert_allclose(weights.numpy(), expected, rtol=1e-6, atol=1e-8 * float(u.max()))
    torch.testing.assert_close(DualProj(pref_vector=u)(J), weights @ J)


def test_no_conflict_means_no_projection() -> None:
    J = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    torch.testing.assert_close(DualProj()(J), J.mean(dim=0))


def test_float32_and_device(device: str, dtype: torch.dtype) -> None:
    J = J_DOC.to(device=device, dtype=dtype)
    out = DualProj()(J)
    assert out.device == J.device and out.dtype == dtype
    torch.testing.assert_close(
        out.cpu().double(), torch.tensor([5 / 9, 10 / 9, 10 / 9]).double(), atol=1e-5, rtol=0
    )


def test_errors_and_repr() -> None:
    with pytest.raises(TypeError, match="projector"):
        DualProj(projector="quadprog")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pref_vector"):
        DualProj(pref_vector=torch.ones(2, 2))
    with pytest.raises(ValueError, match="one preference per objective"):
        DualProj(pref_vector=torch.ones(3))(J_DOC)
    with pytest.raises(ValueError, match="square Gramian"):
        DualProjWeighting()(torch.ones(2, 3))
    assert repr(DualProj()).startswith("DualProj(pref_vector=None, projector=TorchProjector(")
    assert str(DualProj()) == "DualProj"
