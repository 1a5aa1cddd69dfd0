"""AlignedMTL / AlignedMTLWeighting against the SVD form of the paper."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from jacflow.aggregation import AlignedMTL, AlignedMTLWeighting
from tests.aggregation._properties import (
    check_claimed_properties,
    check_degenerate_inputs,
    check_device_and_dtype,
    check_nonfinite_gramian_gives_nan,
    make_jacobian,
)


def svd_aligned(J: Tensor, pref: Tensor, mode: str) -> Tensor:
    """Senushkin et al.: J = U S V^T, aligned rows s U V^T, update (s U V^T)^T p."""
    left, singular, right = torch.linalg.svd(J, full_matrices=False)
    keep = singular > singular.max() * 1e-10
    left, singular, right = left[:, keep], singular[keep], right[keep]
    scale = {
        "min": singular.min(),
        "median": singular.median(),
        "rmse": singular.square().mean().sqrt(),
    }[mode]
    return scale * (left @ right).T @ pref


def test_claimed_properties() -> None:
    check_claimed_properties(AlignedMTL)


def test_degenerate_inputs() -> None:
    check_degenerate_inputs(AlignedMTL)


@settings(max_examples=30)
@given(
    st.integers(1, 6),
    st.integers(1, 9),
    st.integers(1, 6),
    st.sampled_from(["min", "median", "rmse"]),
    st.integers(0, 2**31 - 1),
)
def test_matches_the_svd_form(m: int, n: int, rank: int, mode: str, seed: int) -> None:
    J = make_jacobian(m, n, min(rank, m, n), 1.0, torch.float64, seed)
    pref = torch.rand(m, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    out = AlignedMTL(pref_vector=pref, scale_mode=mode)(J)  # type: ignore[arg-type]
    torch.testing.assert_close(out, svd_aligned(J, pref, mode), atol=1e-7, rtol=1e-6)


def test_documented_values() -> None:
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    torch.testing.assert_close(
        AlignedMTL()(J), torch.tensor([0.2133, 0.9673, 0.9673]), atol=1e-4, rtol=0
    )
    torch.testing.assert_close(
        AlignedMTL(scale_mode="rmse")(J), torch.tensor([0.5764, 2.6142, 2.6142]), atol=1e-4, rtol=0
    )


def test_zero_matrix_gives_zero() -> None:
    assert torch.equal(AlignedMTL()(torch.zeros(3, 4)), torch.zeros(4))


def test_weighting_and_aggregator_agree() -> None:
    J = torch.randn(5, 8, dtype=torch.float64)
    torch.testing.assert_close(
        AlignedMTL(scale_mode="median")(J), AlignedMTLWeighting(scale_mode="median")(J @ J.T) @ J
    )


def test_errors() -> None:
    with pytest.raises(
        ValueError, match=r"`scale_mode` must be one of \('min', 'median', 'rmse'\)"
    ):
        AlignedMTL(scale_mode="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`pref_vector` must be a vector"):
        AlignedMTLWeighting(pref_vector=torch.ones(1, 2))


def test_repr_and_str() -> None:
    assert repr(AlignedMTL()) == "AlignedMTL(pref_vector=None, scale_mode='min')"
    assert str(AlignedMTL()) == "AlignedMTL"


def test_device_and_dtype(device: str, dtype: torch.dtype) -> None:
    check_device_and_dtype(lambda: AlignedMTL(), device, dtype)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gramian_gives_nan_weights(bad: float) -> None:
    check_nonfinite_gramian_gives_nan(lambda: AlignedMTLWeighting(), bad)


MODES = ["min", "median", "rmse"]


def _weights(gramian: Tensor, pref: Tensor, mode: str) -> Tensor:
    return AlignedMTLWeighting(pref_vector=pref, scale_mode=mode)(gramian)  # type: ignore[arg-type]


def _on_sym(mode: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The weights of ``sym(A)``: gradcheck perturbs one entry at a time, while ``eigh`` reads
    one triangle and a Gramian's perturbations are symmetric."""
    return lambda a, pref: _weights((a + a.T) / 2, pref, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(3))
def test_gradients_match_gradcheck(mode: str, seed: int) -> None:
    """Random float64 Gramians, of full rank and rank-deficient (``A A^T`` with ``A`` of
    ``r < m`` columns: every perturbation of ``A`` keeps the rank), with respect to the
    Gramian and the preference."""
    generator = torch.Generator().manual_seed(seed)
    for m in (1, 2, 3, 5):
        a = torch.randn(m, m + 2, dtype=torch.float64, generator=generator)
        pref = torch.rand(m, dtype=torch.float64, generator=generator).requires_grad_()
        assert torch.autograd.gradcheck(_on_sym(mode), ((a @ a.T).requires_grad_(), pref))
        for r in range(1, m):
            factor = torch.randn(m, r, dtype=torch.float64, generator=generator)
            assert torch.autograd.gradcheck(
                lambda f, p: _weights(f @ f.T, p, mode),
                (factor.requires_grad_(), pref),
            )


def _with_spectrum(eigenvalues: list[float], seed: int = 0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    m = len(eigenvalues)
    basis, _ = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64, generator=generator))
    return basis @ torch.diag(torch.tensor(eigenvalues, dtype=torch.float64)) @ basis.T


_U = torch.tensor([1.0, 0.5, -0.8], dtype=torch.float64)


@pytest.mark.parametrize(
    ("gramian", "modes"),
    [
        # 4 I minus a rank-one change: eigenvalues (4 - |u|^2, 4, 4), the smallest simple
        (4 * torch.eye(3, dtype=torch.float64) - torch.outer(_U, _U), MODES[::2]),
        # 4 I plus a rank-one change: (4, 4, 4 + |u|^2), the smallest repeated
        (4 * torch.eye(3, dtype=torch.float64) + torch.outer(_U, _U), ["rmse"]),
        (_with_spectrum([1.0, 2.0, 4.0, 4.0]), MODES),
        (_with_spectrum([1.0, 4.0, 4.0, 4.0]), MODES[::2]),
    ],
)
def test_repeated_eigenvalues_give_finite_exact_gradients(
    gramian: Tensor, modes: list[str]
) -> None:
    """Autograd through ``eigh`` gives NaN or inf there (the eigenvectors of a repeated
    eigenvalue are not differentiable), while the weights are a smooth function of ``G``
    wherever the scale's eigenvalue is simple (or the scale is ``"rmse"``): the gradients are
    finite and match central differences."""
    pref = torch.tensor([0.5, 0.2, 0.3, 0.1][: gramian.shape[0]], dtype=torch.float64)
    for mode in modes:
        tracked = gramian.clone().requires_grad_()
        (grad,) = torch.autograd.grad(_on_sym(mode)(tracked, pref) @ pref, tracked)
        assert bool(torch.isfinite(grad).all())
        assert torch.autograd.gradcheck(_on_sym(mode), (tracked, pref.clone().requires_grad_()))


@pytest.mark.parametrize("mode", MODES)
def test_rank_deficient_with_a_repeated_eigenvalue(mode: str) -> None:
    """``G = F F^T`` with two orthogonal columns of equal norms in ``F`` (eigenvalues 0, c,
    c), differentiated through ``F`` (a perturbation of ``G`` itself would lift the zero
    eigenvalue above the threshold: not continuous there): finite, and central differences
    (a tied pair: the shared derivative of the scale is their mean)."""
    generator = torch.Generator().manual_seed(1)
    basis, _ = torch.linalg.qr(torch.randn(3, 2, dtype=torch.float64, generator=generator))
    pref = torch.tensor([0.5, 0.2, 0.3], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda f, p: _weights(f @ f.T, p, mode), ((2 * basis).requires_grad_(), pref)
    )


def test_orthogonal_rows_of_equal_norms() -> None:
    """The very case that Aligned-MTL produces (``G = c I``): TorchJD's autograd through
    ``eigh`` gives NaN. With two rows every mode matches central differences (the tied scale's
    derivative shared evenly is their mean); with three, ``"rmse"`` does, and ``"min"``
    and ``"median"`` (not differentiable there: the smallest eigenvalue of ``G + h E`` bends
    with ``E``) give finite gradients exact along every perturbation that keeps the tie: a
    rescaling or a rotation of the rows, under which the update rotates with them."""
    generator = torch.Generator().manual_seed(0)
    for m in (2, 3):
        basis, _ = torch.linalg.qr(torch.randn(5, m, dtype=torch.float64, generator=generator))
        J = 3 * basis.T
        for mode in MODES:
            tracked = J.clone().requires_grad_()
            aggregator = AlignedMTL(scale_mode=mode)  # type: ignore[arg-type]
            (grad,) = torch.autograd.grad(aggregator(tracked).sum(), tracked)
            assert bool(torch.isfinite(grad).all())
            if m == 2 or mode == "rmse":
                assert torch.autograd.gradcheck(aggregator, (tracked,))
                continue
            skew = torch.randn(5, 5, dtype=torch.float64, generator=generator)
            for direction in (J, J @ (skew - skew.T)):
                h = 1e-6
                expected = (aggregator(J + h * direction) - aggregator(J - h * direction)) / (2 * h)
                torch.testing.assert_close((grad * direction).sum(), expected.sum())


def test_the_weights_are_differentiable_once() -> None:
    """The update keeps its graph (``create_graph=True`` accepts AlignedMTL, as TorchJD's);
    differentiating its gradient again raises rather than silently missing terms."""
    import jacflow

    assert AlignedMTL().differentiable and AlignedMTLWeighting().differentiable
    x = torch.tensor([0.3, -0.8], dtype=torch.float64, requires_grad=True)
    jacflow.backward([(x**3).sum(), x.sin().sum()], [x], A=AlignedMTL(), create_graph=True)
    assert x.grad is not None and x.grad.requires_grad
    (second,) = torch.autograd.grad(x.grad.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="AlignedMTL's weights are differentiable once"):
        torch.autograd.grad(second.sum(), x)
