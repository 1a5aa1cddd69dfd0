"""Scale-invariant weightings, and aggregators on float32 Jacobians of extreme finite scale.

A float32 Jacobian with entries of about 1e19 has an infinite Gramian (NaN update), one with
entries of about 1e-25 a zero Gramian (UPGrad, DualProj and MGDA fell back to the mean, which
conflicts). Where the weights ignore a global scale of the Gramian
(``GramianWeighting.scale_invariant``, asserted here by its definition), the Gramian is formed
from ``J`` scaled to a largest entry of about 1.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch import Tensor

import jacflow.aggregation as aggregation
from jacflow.aggregation import Aggregator, GramianWeightedAggregator, GramianWeighting
from jacflow.aggregation._bases import peak_magnitude, scale_to_unit_peak
from jacflow.aggregation._loss_aware import LossAware
from jacflow.linalg import QuadprogProjector, TorchProjector
from tests.aggregation._properties import jacobians
from tests.aggregation.test_dtypes import LOSSES, TABLE, M

WRAPPERS: dict[str, Callable[[], GramianWeighting]] = {
    "CRMOGM(UPGrad)": lambda: aggregation.CRMOGMWeighting(aggregation.UPGradWeighting()),
    "Periodic(MGDA)": lambda: aggregation.Periodic(aggregation.MGDAWeighting(), every=2),
    "LogLoss(IMTLG)": lambda: aggregation.LogLoss(aggregation.IMTLGWeighting()),
    "MGDA(loss)": lambda: aggregation.MGDAWeighting(normalization="loss"),
    "UPGrad(TorchProjector(reg_eps))": lambda: aggregation.UPGradWeighting(
        projector=TorchProjector(reg_eps=1e-4)
    ),
}


def _weighting_factories() -> dict[str, Callable[[], GramianWeighting]]:
    factories = dict(WRAPPERS)
    for name, make in TABLE.items():
        if isinstance(make(), GramianWeightedAggregator):
            factories[name] = lambda make=make: make().gramian_weighting  # type: ignore[attr-defined]
    return factories


WEIGHTINGS = _weighting_factories()
INVARIANT = sorted(name for name, make in WEIGHTINGS.items() if make().scale_invariant)


def _weights(make: Callable[[], GramianWeighting], gramian: Tensor, calls: int = 2) -> Tensor:
    """A fresh weighting's weights after ``calls`` calls, with the same random draws."""
    torch.manual_seed(0)
    weighting = make()
    weights = gramian.new_zeros(0)
    for _ in range(calls):
        if isinstance(weighting, LossAware):
            weighting.set_losses(LOSSES[: gramian.shape[0]].to(gramian))
        weights = weighting(gramian)
    return weights


def test_the_expected_weightings_are_scale_invariant() -> None:
    assert set(INVARIANT) >= {"UPGrad", "DualProj", "MGDA", "IMTLG", "CAGrad", "AlignedMTL"}
    assert set(INVARIANT) >= {"PCGrad", "Krum", "Mean", "CRMOGM(UPGrad)", "LogLoss(IMTLG)"}
    # an absolute cut-off, or weights that scale with 1 / |g_i|, or solvers with absolute steps
    assert not aggregation.UPGradWeighting(projector=QuadprogProjector()).scale_invariant
    assert aggregation.UPGradWeighting(projector=QuadprogProjector(norm_eps=0.0)).scale_invariant
    assert not aggregation.MGDAWeighting(normalization="l2").scale_invariant
    for name in ("FairGrad", "AuxiNash", "NashMTL", "GradNorm", "GradVac", "MoDo", "PCD"):
        assert not WEIGHTINGS[name]().scale_invariant, name


@pytest.mark.parametrize("name", INVARIANT)
def test_scale_invariant_claims_hold(name: str) -> None:
    """``weights(c^2 G)`` and ``weights(G)`` give the same update ``J^T w`` (float64, to
    rounding), for each weighting claiming it. (Where ``G`` is singular the weights of some
    methods are not unique, only the update is: the difference is measured in the norm
    ``|J^T (w' - w)| = sqrt((w' - w)^T G (w' - w))``.)"""
    make = WEIGHTINGS[name]

    @given(
        jacobians(min_m=M, max_m=M, max_n=10, dtypes=(torch.float64,)),
        st.sampled_from([1e-12, 1e-3, 1e5, 1e14]),
    )
    @example(  # (a rank-1 Gramian of 1e-14 entries: the form came out negative)
        torch.tensor(
            [[-7.6053e-08], [1.5899e-07], [3.0591e-08], [-5.3145e-10]], dtype=torch.float64
        ),
        1e-12,
    )
    def check(matrix: Tensor, c2: float) -> None:
        gramian = matrix @ matrix.T
        expected = _weights(make, gramian)
        got = _weights(make, c2 * gramian)
        difference = got - expected
        # (G is PSD; rounding can make the form a tiny negative, whose root is complex)
        distance = max(float(difference @ gramian @ difference), 0.0) ** 0.5
        row_norm = float(gramian.diagonal().max()) ** 0.5
        assert distance <= 1e-6 * row_norm * (1 + float(expected.abs().sum())), (got, expected)

    check()


def test_the_weightings_that_do_not_read_the_gramian() -> None:
    """Those whose weights read only the number of rows (the Engine skips its range test of
    their Gramian, a host read); a wrapper reads it (Periodic's reuse steps check it for a NaN
    or an infinity)."""
    assert {n for n, make in WEIGHTINGS.items() if not make().reads_gramian} == {
        "Constant",
        "Mean",
        "Random",
        "Sum",
    }


@pytest.mark.parametrize(
    "name", sorted(n for n, make in WEIGHTINGS.items() if not make().reads_gramian)
)
def test_reads_gramian_claims_hold(name: str) -> None:
    """A weighting that says it does not read the Gramian gives the same weights, bit for bit
    (with the same random draws), for any Gramian of the same size and dtype: overflowed,
    NaN, zero or of an ordinary scale."""
    make = WEIGHTINGS[name]
    torch.manual_seed(1)
    matrix = torch.randn(M, 5)
    expected = _weights(make, matrix @ matrix.T)
    for fill in (torch.inf, torch.nan, 0.0, 1e-30):
        assert torch.equal(_weights(make, torch.full((M, M), fill)), expected), fill


INVARIANT_AGGREGATORS = [
    "ConFIG",
    *sorted(
        name
        for name, make in TABLE.items()
        if isinstance(agg := make(), GramianWeightedAggregator)
        and agg.gramian_weighting.scale_invariant
    ),
]


def _aggregate(make: Callable[[], Aggregator], matrix: Tensor, calls: int = 2) -> Tensor:
    torch.manual_seed(0)
    aggregator = make()
    out = matrix.new_zeros(0)
    for _ in range(calls):
        if isinstance(aggregator, LossAware):
            aggregator.set_losses(LOSSES)
        out = aggregator(matrix)
    return out


@pytest.mark.parametrize("scale", [1e19, 1e-25])
@pytest.mark.parametrize("name", INVARIANT_AGGREGATORS)
def test_extreme_float32_scales_match_scale_one(name: str, scale: float) -> None:
    """``A(s J) = s A(J)`` for a float32 ``J`` at ``s = 1e19`` (the Gramian overflowed: NaN)
    and ``s = 1e-25`` (it underflowed to 0), against ``J`` at scale 1 in float64."""
    gen = torch.Generator().manual_seed(11)
    J = torch.randn(M, 6, generator=gen, dtype=torch.float64)
    J[1] = -0.8 * J[0] + 0.3 * J[1]  # a conflict, so that the mean is not the answer
    expected = _aggregate(TABLE[name], J) * scale
    out = _aggregate(TABLE[name], (J * scale).float())
    assert out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    peak = float(expected.abs().max())
    torch.testing.assert_close(out.double(), expected, rtol=1e-3, atol=1e-3 * peak)


@pytest.mark.parametrize("scale", [1e19, 1e-25])
@pytest.mark.parametrize("make", [aggregation.UPGrad, aggregation.DualProj, aggregation.MGDA])
def test_non_conflicting_at_extreme_float32_scales(
    make: Callable[[], Aggregator], scale: float
) -> None:
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    out = make()(J * scale).double()
    products = (J.double() @ out) / (J.double().norm(dim=1) * out.norm())
    assert bool((products >= -1e-6).all()), products


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scale_to_unit_peak(dtype: torch.dtype) -> None:
    """A power of two: the peak lands in [1/2, 1), every entry is scaled by the same exact
    factor, and zero, empty and non-finite matrices are left as they are."""
    tiny, huge = torch.finfo(dtype).tiny, torch.finfo(dtype).max
    for peak in (1.0, 3.0, 1e-25, 1e19, tiny, huge, 1e-45 if dtype == torch.float32 else 1e-320):
        matrix = torch.tensor([[peak, -peak / 3], [peak / 7, 0.0]], dtype=dtype)
        scaled = scale_to_unit_peak(matrix)
        top = float(scaled.abs().max())
        factor = top / float(matrix.abs().max())
        assert 2.0 ** round(torch.log2(torch.tensor(factor, dtype=torch.float64)).item()) == factor
        if peak >= tiny:
            assert 0.5 <= top < 1.0
            assert torch.equal(scaled / factor, matrix)
    for matrix in (torch.zeros(2, 3), torch.zeros(0, 3), torch.tensor([[float("inf"), 1.0]])):
        assert torch.equal(scale_to_unit_peak(matrix.to(dtype)), matrix.to(dtype))
    assert bool(scale_to_unit_peak(torch.tensor([[float("nan"), 1.0]])).isnan()[0, 0])


_ENTRIES = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.sampled_from([0.0, -0.0, 1e-45, -3e38]),
)


@given(
    st.lists(_ENTRIES, min_size=1, max_size=24),
    st.sampled_from([1, 5000]),  # (5000 copies: past the size where the extremes are read)
    st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
)
def test_peak_magnitude_is_the_largest_absolute_entry(
    entries: list[float], copies: int, dtype: torch.dtype
) -> None:
    """``peak_magnitude`` is ``t.abs().amax()`` bit for bit, NaN where an entry is NaN, for
    any real entries (signed zeros, subnormals, infinities) and shapes."""
    t = torch.tensor(entries, dtype=torch.float32).to(dtype).repeat(copies)
    for shaped in (t, t.reshape(1, -1, 1), t.flip(0)):
        got, expected = peak_magnitude(shaped), shaped.abs().amax()
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected) or bool(got.isnan() & expected.isnan())


SCALE_READING_AGGREGATORS = sorted(
    name
    for name, make in TABLE.items()
    if isinstance(agg := make(), GramianWeightedAggregator)
    and not agg.gramian_weighting.scale_invariant
)


@pytest.mark.parametrize("scale", [1e19, 1e-22, 1e-25])
@pytest.mark.parametrize("name", SCALE_READING_AGGREGATORS)
def test_weightings_that_read_the_scale_get_a_float64_gramian_out_of_range(
    name: str, scale: float
) -> None:
    """A float32 ``J`` whose Gramian overflows (1e19), loses digits as subnormal numbers (1e-22)
    or underflows to 0 (1e-25): the update is that of the same ``J`` in float64 (it was up to
    2% off at 1e-22 and zero at 1e-25 for FairGrad and MGDA with l2 normalisation)."""
    gen = torch.Generator().manual_seed(11)
    J = torch.randn(M, 6, generator=gen, dtype=torch.float64)
    J[1] = -0.8 * J[0] + 0.3 * J[1]
    J32 = (J * scale).float()
    expected = _aggregate(TABLE[name], J32.double())
    out = _aggregate(TABLE[name], J32)
    peak = float(expected.abs().max())
    torch.testing.assert_close(out.double(), expected, rtol=1e-3, atol=1e-3 * peak)


# The methods whose update does not scale with the Jacobian, as documented in the mixed
# precision section of docs/getting-started.md (a GradScaler's unscaled update is then wrong).
NOT_HOMOGENEOUS = {"AuxiNash", "FairGrad", "GradNorm", "MoCo", "MoDo", "NashMTL"}


def test_the_documented_methods_are_those_whose_update_does_not_scale_with_j() -> None:
    """``A(S J) / S == A(J)`` (a GradScaler's loss scale S = 2^16, at the first and second
    call) for every method except the documented ones, which the docs name."""
    gen = torch.Generator().manual_seed(11)
    J = torch.randn(M, 6, generator=gen, dtype=torch.float64)
    J[1] = -0.8 * J[0] + 0.3 * J[1]
    scale = 2.0**16
    failing = set()
    for name, make in TABLE.items():
        for calls in (1, 2):
            plain = _aggregate(make, J, calls)
            unscaled = _aggregate(make, scale * J, calls) / scale
            if float((unscaled - plain).norm()) > 1e-6 * float(plain.norm()):
                failing.add(name)
    assert failing == NOT_HOMOGENEOUS
    section = (Path(__file__).parents[2] / "docs" / "getting-started.md").read_text()
    section = section.split("GradScaler", 1)[1][:1500]
    assert all(name in section for name in NOT_HOMOGENEOUS), section
