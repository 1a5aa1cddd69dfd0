"""Hypothesis strategies for Jacobians and the checks behind each aggregator property claim.

Usage in a test module of a method::

    from tests.aggregation._properties import check_claimed_properties
    def test_properties(): check_claimed_properties(lambda: MyMethod(...))

``check_claimed_properties`` runs one hypothesis test per claimed :class:`Property` plus the
structural checks every aggregator must pass (shape, finiteness, zero rows, NaN propagation).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from jacflow.aggregation import Aggregator, Property, WeightedAggregator, Weighting


def make_jacobian(m: int, n: int, rank: int, scale: float, dtype: torch.dtype, seed: int) -> Tensor:
    """A ``[m, n]`` matrix of exactly ``min(rank, m, n)`` rank with Haar-random singular vectors."""
    gen = torch.Generator().manual_seed(seed)
    r = max(0, min(rank, m, n))
    u, _ = torch.linalg.qr(torch.randn(m, max(m, 1), generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, max(n, 1), generator=gen, dtype=torch.float64))
    singular = torch.rand(r, generator=gen, dtype=torch.float64) + 0.1
    matrix = (u[:, :r] * singular) @ v[:, :r].T
    return (scale * matrix).to(dtype)


@st.composite
def jacobians(
    draw: st.DrawFn,
    max_m: int = 32,
    max_n: int = 40,
    min_m: int = 1,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64),
    scales: tuple[float, ...] = (1e-6, 1e-3, 1.0, 1e3, 1e6),
) -> Tensor:
    """Random Jacobians of random shape, rank, scale and dtype."""
    m = draw(st.integers(min_m, max_m))
    n = draw(st.integers(1, max_n))
    rank = draw(st.integers(0, min(m, n)))
    scale = draw(st.sampled_from(scales))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    return make_jacobian(m, n, rank, scale, dtype, seed)


def on_a_coarse_grid(matrix: Tensor) -> Tensor:
    """``matrix`` rounded to quarters of its largest entry: exact ties in norms, distances and
    inner products, where a method that selects or sorts rows must not let their order decide."""
    peak = matrix.abs().max() if matrix.numel() else matrix.new_zeros(())
    step = torch.where(peak > 0, peak / 4, torch.ones_like(peak))
    return (matrix / step).round() * step


def _tolerance(matrix: Tensor) -> float:
    eps = 1e-3 if matrix.dtype == torch.float32 else 1e-6
    return eps * float(matrix.norm()) ** 2 + 1e-30


def check_structure(make: Callable[[], Aggregator], matrix: Tensor) -> Tensor:
    out = make()(matrix)
    assert out.shape == (matrix.shape[1],)
    assert out.dtype == matrix.dtype
    assert bool(torch.isfinite(out).all()), (
        f"non-finite output {out} for input of shape {matrix.shape}"
    )
    return out


def check_non_conflicting(make: Callable[[], Aggregator], matrix: Tensor) -> None:
    out = make()(matrix)
    products = matrix.double() @ out.double()
    assert bool((products >= -_tolerance(matrix)).all()), f"J @ A(J) = {products}"


def check_permutation_invariant(make: Callable[[], Aggregator], matrix: Tensor, seed: int) -> None:
    perm = torch.randperm(matrix.shape[0], generator=torch.Generator().manual_seed(seed))
    a, b = make()(matrix), make()(matrix[perm])
    scale = float(matrix.abs().max()) + 1e-30
    tol = 1e-3 if matrix.dtype == torch.float32 else 1e-6
    assert torch.allclose(a / scale, b / scale, atol=tol, rtol=tol)


def check_linear_under_scaling(make: Callable[[], Aggregator], matrix: Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    m = matrix.shape[0]
    c1 = torch.rand(m, generator=gen, dtype=matrix.dtype) + 0.5
    c2 = torch.rand(m, generator=gen, dtype=matrix.dtype) + 0.5
    alpha, beta = 0.7, 1.3
    lhs = make()((alpha * c1 + beta * c2)[:, None] * matrix)
    rhs = alpha * make()(c1[:, None] * matrix) + beta * make()(c2[:, None] * matrix)
    scale = float(matrix.abs().max()) + 1e-30
    tol = 2e-2 if matrix.dtype == torch.float32 else 1e-4
    assert torch.allclose(lhs / scale, rhs / scale, atol=tol, rtol=tol)


def check_weighted(make: Callable[[], Aggregator], matrix: Tensor) -> None:
    aggregator = make()
    assert isinstance(aggregator, WeightedAggregator)
    weights = aggregator.weights(matrix)
    out = aggregator(matrix)
    scale = float(matrix.abs().max()) + 1e-30
    tol = 1e-4 if matrix.dtype == torch.float32 else 1e-9
    assert torch.allclose(out / scale, (weights.to(matrix.dtype) @ matrix) / scale, atol=tol)


def _accepts(make: Callable[[], Aggregator], m: int) -> bool:
    """Whether the aggregator takes ``m`` rows (configured for a fixed or least ``m``)."""
    try:
        make()(torch.ones(m, 1, dtype=torch.float64))
    except ValueError:
        return False
    return True


def check_differentiable(make: Callable[[], Aggregator]) -> None:
    """``differentiable``: autograd's directional derivative of the update at a generic ``J``
    equals central finite differences (every call seeded alike: a random method draws the
    same); else the update has no graph, so that no derivative holds the weights constant."""
    m = next(m for m in (3, 4, 5, 6, 7, 8, 2, 1) if _accepts(make, m))
    J = make_jacobian(m, 4, m, 1.0, torch.float64, seed=7)
    direction = make_jacobian(m, 4, m, 1.0, torch.float64, seed=8)
    cotangent = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)

    def update(matrix: Tensor) -> Tensor:
        torch.manual_seed(0)
        return make()(matrix) @ cotangent

    if not make().differentiable:
        assert not update(J.clone().requires_grad_()).requires_grad
        return
    tracked = J.clone().requires_grad_()
    (grad,) = torch.autograd.grad(update(tracked), tracked)
    h = 1e-6
    expected = (update(J + h * direction) - update(J - h * direction)) / (2 * h)
    torch.testing.assert_close(grad.flatten() @ direction.flatten(), expected, rtol=1e-5, atol=1e-7)


def check_claimed_properties(
    make: Callable[[], Aggregator],
    strategy: st.SearchStrategy[Tensor] | None = None,
) -> None:
    """Assert the structure, :func:`check_differentiable` and every claimed property of the
    aggregator built by ``make``."""
    check_differentiable(make)
    claims = make().claimed_properties()
    strategy = strategy if strategy is not None else jacobians()

    @given(strategy)
    def structure(matrix: Tensor) -> None:
        check_structure(make, matrix)

    structure()
    checks: dict[Property, Callable[[], None]] = {}

    @given(strategy)
    def non_conflicting(matrix: Tensor) -> None:
        check_non_conflicting(make, matrix)

    # also on inputs with ties: a tie broken by the row index breaks the claim (Krum did).
    @given(st.one_of(strategy, strategy.map(on_a_coarse_grid)), st.integers(0, 1000))
    def permutation_invariant(matrix: Tensor, seed: int) -> None:
        check_permutation_invariant(make, matrix, seed)

    @given(strategy, st.integers(0, 1000))
    def linear_under_scaling(matrix: Tensor, seed: int) -> None:
        check_linear_under_scaling(make, matrix, seed)

    @given(strategy)
    def weighted(matrix: Tensor) -> None:
        check_weighted(make, matrix)

    checks = {
        Property.NON_CONFLICTING: non_conflicting,
        Property.PERMUTATION_INVARIANT: permutation_invariant,
        Property.LINEAR_UNDER_SCALING: linear_under_scaling,
        Property.WEIGHTED: weighted,
    }
    for claim in claims:
        checks[claim]()


def check_degenerate_inputs(make: Callable[[], Aggregator]) -> None:
    """m = 0 gives zeros; n = 0 gives an empty vector; NaN rows propagate without hanging."""
    empty_rows = make()(torch.zeros(0, 5))
    assert empty_rows.shape == (5,) and bool((empty_rows == 0).all())
    no_columns = make()(torch.zeros(3, 0))
    assert no_columns.shape == (0,)
    nan_matrix = torch.tensor([[1.0, float("nan")], [0.5, 2.0]])
    assert not bool(torch.isfinite(make()(nan_matrix)).all())


def check_device_and_dtype(make: Callable[[], Aggregator], device: str, dtype: torch.dtype) -> None:
    """The aggregator follows its input's device and dtype, whatever the default device (here
    ``meta``, on which nothing can be computed), and agrees with float64 on CPU."""
    matrix = torch.randn(5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    expected = make()(matrix)
    aggregator = make()
    with torch.device("meta"):
        out = aggregator(matrix.to(device=device, dtype=dtype))
    assert out.device.type == torch.device(device).type and out.dtype == dtype
    tol = 1e-3 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


def check_nonfinite_gramian_gives_nan(make: Callable[[], Weighting], bad: float) -> None:
    """A NaN or infinite entry in the Gramian gives NaN weights (and never hangs)."""
    for m in (2, 3, 5):
        gramian = torch.eye(m)
        gramian[1, 0] = gramian[0, 1] = bad
        assert bool(make()(gramian).isnan().all())
