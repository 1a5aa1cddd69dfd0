"""The Gramian product's two routes against float64 references, and the rule that picks one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jacflow.linalg import compute_gramian, sum_gramians
from jacflow.linalg._row_gramian import (
    ONEDNN_MIN_ROWS,
    ONEDNN_MIN_WORK,
    host_prefers_onednn,
    onednn_gramian,
    onednn_pays,
    row_gramian,
    takes_onednn,
)

has_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)
prefers_onednn = pytest.mark.skipif(
    not host_prefers_onednn(), reason="this host keeps the BLAS's product"
)
LARGE = (128, 4608)  # the small CNN's second convolution, per sample at B = 128


@pytest.mark.parametrize(
    ("vendor", "capability", "blas", "has", "expected"),
    [
        ("AuthenticAMD", "AVX512", "mkl", True, True),
        ("HygonGenuine", "AVX512", "mkl", True, True),
        ("GenuineIntel", "AVX512", "mkl", True, False),  # MKL takes AVX-512 on Intel
        ("AuthenticAMD", "AVX2", "mkl", True, False),  # both take AVX2
        ("AuthenticAMD", "DEFAULT", "mkl", True, False),
        ("AuthenticAMD", "AVX512", "other", True, False),  # e.g. OpenBLAS picks by ISA too
        ("AuthenticAMD", "AVX512", "mkl", False, False),  # no oneDNN in this build
        ("", "AVX512", "mkl", True, False),  # vendor unknown: keep torch's product
    ],
)
def test_onednn_pays_only_where_mkl_runs_below_the_processor(
    vendor: str, capability: str, blas: str, has: bool, expected: bool
) -> None:
    assert onednn_pays(vendor, capability, blas, has) is expected


@has_onednn
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 70), st.integers(1, 700), st.integers(0, 2**31 - 1))
def test_onednn_gramian_matches_float64(rows: int, columns: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(rows, columns, generator=gen)
    exact = flat.double() @ flat.double().T
    result = onednn_gramian(flat)
    assert result.dtype == torch.float32 and result.shape == (rows, rows)
    # float32 rounding of sums of `columns` products: a few ulps of the diagonal's scale
    scale = exact.diagonal().max()
    assert float((result.double() - exact).abs().max()) <= 1e-6 * columns**0.5 * scale + 1e-30


@has_onednn
def test_onednn_gramian_of_a_strided_view_and_non_finite_rows() -> None:
    flat = torch.randn(LARGE[1], LARGE[0]).T  # not contiguous
    torch.testing.assert_close(onednn_gramian(flat), flat @ flat.T, rtol=1e-5, atol=1e-2)
    flat = torch.randn(16, 300)
    flat[3, 7] = float("nan")
    flat[5, 2] = float("inf")
    gramian = onednn_gramian(flat)
    assert bool(gramian[3].isnan().all()) and bool(gramian[:, 3].isnan().all())
    assert gramian[5, 5] == float("inf")
    others = [i for i in range(16) if i not in (3, 5)]
    assert bool(gramian[others][:, others].isfinite().all())


def test_the_rule_keeps_torchs_product_where_onednn_loses_or_cannot() -> None:
    assert not takes_onednn(torch.randn(ONEDNN_MIN_ROWS - 1, 10**6))  # a few rows: 2x-7x slower
    rows = 32
    assert not takes_onednn(torch.randn(rows, ONEDNN_MIN_WORK // rows**2 - 1))  # too little work
    assert not takes_onednn(torch.randn(*LARGE, dtype=torch.float64))  # oneDNN has no float64
    x = torch.randn(*LARGE, requires_grad=True)
    assert not takes_onednn(x)  # oneDNN's product has no derivative
    with torch.no_grad():
        assert takes_onednn(x) is host_prefers_onednn()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not takes_onednn(torch.randn(*LARGE))


@prefers_onednn
def test_on_this_host_large_float32_gramians_take_onednn() -> None:
    flat = torch.randn(*LARGE)
    assert takes_onednn(flat)
    assert torch.equal(row_gramian(flat), onednn_gramian(flat))
    assert torch.equal(compute_gramian(flat), onednn_gramian(flat))
    a, b = torch.randn(128, 3000), torch.randn(128, 40, 40)
    expected = onednn_gramian(a) + onednn_gramian(b.reshape(128, -1))
    assert torch.equal(sum_gramians([a, b]), expected)


def test_compute_gramian_keeps_its_derivative_and_autocast() -> None:
    x = torch.randn(*LARGE, dtype=torch.float32, requires_grad=True)
    weights = torch.randn(LARGE[0], LARGE[0])
    (compute_gramian(x) * weights).sum().backward()
    assert x.grad is not None
    expected = (weights + weights.T) @ x.detach()  # d/dx <W, x x^T> = (W + W^T) x
    torch.testing.assert_close(x.grad, expected, rtol=1e-4, atol=1e-2)
    flat = torch.randn(*LARGE)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_gramian(flat).dtype == (flat @ flat.T).dtype == torch.bfloat16
