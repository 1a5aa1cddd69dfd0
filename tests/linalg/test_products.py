"""The products' two routes against float64 references, and the rule that picks one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import forward_ad
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode

from jacflow.linalg import _products, compute_gramian, sum_gramians
from jacflow.linalg._products import (
    ONEDNN_MIN_ROWS,
    ONEDNN_MIN_WORK,
    host_prefers_onednn,
    onednn_pays,
    onednn_product,
    product,
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


def onednn_gramian(flat: torch.Tensor) -> torch.Tensor:
    return onednn_product(flat, flat.T)


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
@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 60),
    st.integers(1, 300),
    st.integers(1, 60),
    st.booleans(),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_onednn_product_matches_float64(
    n: int, k: int, p: int, a_transposed: bool, b_transposed: bool, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(k, n, generator=gen).T if a_transposed else torch.randn(n, k, generator=gen)
    b = torch.randn(p, k, generator=gen).T if b_transposed else torch.randn(k, p, generator=gen)
    exact = a.double() @ b.double()
    result = onednn_product(a, b)
    assert result.dtype == torch.float32 and result.shape == (n, p)
    assert float((result.double() - exact).abs().max()) <= 1e-6 * k + 1e-30  # entries ~ sqrt(k)


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


@has_onednn
@pytest.mark.parametrize("layout", ["rows_strided", "columns_strided", "column_major_gapped"])
def test_onednn_gets_a_dense_weight(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN reorders a weight (``b.T``) that is neither row- nor column-major by a slow
    generic path: the Gramian of a group's slice of a grouped convolution's ghost inputs (rows
    strided, ``u[:, :, j]``) took 3 s for [512, 576] against 1.8 ms dense (1 thread), a step
    of Conv2d(256, 256, 3, groups=2) on 3 x 3 maps at B = 32 3.9 s against 13 ms. It gets a
    dense copy, and the same product."""
    base = torch.randn(2 * 64, 2 * 96)
    flat = {
        "rows_strided": base[:64, :96],
        "columns_strided": base[:64, ::2],
        "column_major_gapped": base[::2, :64].T,
    }[layout]
    weights: list[torch.Tensor] = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(a: torch.Tensor, weight: torch.Tensor, *args: object) -> torch.Tensor:
        weights.append(weight)
        return real(a, weight, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    torch.testing.assert_close(onednn_gramian(flat), flat @ flat.T, rtol=1e-5, atol=1e-4)
    assert weights and all(w.is_contiguous() or w.T.is_contiguous() for w in weights)


def gramian_takes_onednn(flat: torch.Tensor) -> bool:
    return takes_onednn(flat, flat.T)


def test_the_rule_keeps_torchs_product_where_onednn_loses_or_cannot() -> None:
    few = torch.randn(ONEDNN_MIN_ROWS - 1, 10**6)
    assert not gramian_takes_onednn(few)  # a few rows: 2x-7x slower
    assert not takes_onednn(torch.randn(4096, 4096), torch.randn(4096, ONEDNN_MIN_ROWS - 1))
    rows = 32
    assert not gramian_takes_onednn(torch.randn(rows, ONEDNN_MIN_WORK // rows**2 - 1))  # little
    assert not gramian_takes_onednn(torch.randn(*LARGE, dtype=torch.float64))  # no float64
    assert not takes_onednn(torch.randn(*LARGE), torch.randn(LARGE[1], 64, dtype=torch.float64))
    x = torch.randn(*LARGE, requires_grad=True)
    assert not gramian_takes_onednn(x)  # oneDNN's product has no derivative
    assert not takes_onednn(torch.randn(64, LARGE[0]), x)
    with torch.no_grad():
        assert gramian_takes_onednn(x) is host_prefers_onednn()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not gramian_takes_onednn(torch.randn(*LARGE))

    class Wrapped(torch.Tensor):  # a subclass may not handle the private operator
        pass

    assert not gramian_takes_onednn(torch.randn(*LARGE).as_subclass(Wrapped))


def test_the_rule_keeps_torchs_product_with_onednn_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flat = torch.randn(*LARGE)
    assert gramian_takes_onednn(flat) is host_prefers_onednn()
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert not gramian_takes_onednn(flat)


@prefers_onednn
def test_on_this_host_large_float32_gramians_take_onednn() -> None:
    flat = torch.randn(*LARGE)
    assert gramian_takes_onednn(flat)
    assert torch.equal(row_gramian(flat), onednn_gramian(flat))
    a, b = torch.randn(1024, 128), torch.randn(128, 1024)
    assert torch.equal(product(a, b), onednn_product(a, b))
    out = torch.full((1024, 1024), float("nan"))
    assert product(a, b, out=out) is out  # (by slices of rows: equal up to rounding)
    torch.testing.assert_close(out, onednn_product(a, b), rtol=1e-6, atol=1e-5)
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


@pytest.mark.parametrize("shape", [(3, 5, 4), (64, 128, 64), (1024, 128, 1024), (2, 4096, 9)])
def test_product_into_out_matches_float64(shape: tuple[int, int, int]) -> None:
    n, k, p = shape
    a, b = torch.randn(n, k), torch.randn(k, p)
    out = torch.full((n, p), float("nan"))
    assert product(a, b, out=out) is out
    exact = a.double() @ b.double()
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=1e-6 * k)
    torch.testing.assert_close(product(a, b).double(), exact, rtol=0, atol=1e-6 * k)


def test_a_build_without_the_private_operator_keeps_torchs_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _products._onednn_works() is torch.backends.mkldnn.is_available()

    def missing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("No such operator mkldnn::_linear_pointwise")

    monkeypatch.setattr(_products, "onednn_product", missing)
    assert not _products._onednn_works()
    monkeypatch.setattr(_products, "onednn_product", lambda a, b: (a @ b) + 1)  # another meaning
    assert not _products._onednn_works()


def test_forward_mode_and_torch_func_keep_the_derivatives(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's product has no forward derivative and no batching rule: under forward-mode AD
    and ``torch.func`` transforms the product is torch's, with exact tangents."""
    x, t = torch.randn(*LARGE), torch.randn(*LARGE)
    expected = t @ x.T + x @ t.T
    with forward_ad.dual_level():
        tangent = forward_ad.unpack_dual(compute_gramian(forward_ad.make_dual(x, t))).tangent
    assert tangent is not None
    torch.testing.assert_close(tangent, expected, rtol=1e-4, atol=1e-2)
    _, jvp = torch.func.jvp(compute_gramian, (x,), (t,))
    torch.testing.assert_close(jvp, expected, rtol=1e-4, atol=1e-2)
    weights = torch.randn(LARGE[0], LARGE[0])
    grad = torch.func.grad(lambda y: (compute_gramian(y) * weights).sum())(x)
    torch.testing.assert_close(grad, (weights + weights.T) @ x, rtol=1e-4, atol=1e-2)
    calls: list[int] = []
    real = _products.onednn_product

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(_products, "onednn_product", spy)
    stacked = torch.randn(2, *LARGE)
    batched = torch.vmap(compute_gramian)(stacked)  # (no batching rule: a loop, slowly)
    torch.testing.assert_close(batched, stacked @ stacked.mT, rtol=1e-5, atol=1e-2)
    assert not calls
    compute_gramian(stacked[0])
    assert len(calls) == host_prefers_onednn()


def test_tracers_and_counters_see_torchs_product() -> None:
    """``make_fx``, ``FlopCounterMode``, ``torch.jit`` and ``torch.fx`` record or count
    ``aten.mm``: a recorded private operator would lose the gradients (it has no derivative)."""
    x = torch.randn(*LARGE)
    graph = make_fx(compute_gramian)(x)
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert torch.ops.aten.mm.default in targets
    assert all("mkldnn" not in str(target) for target in targets)
    leaf = x.clone().requires_grad_()
    graph(leaf).sum().backward()
    assert leaf.grad is not None
    # d/dx sum(x x^T) = 2 * ones @ x
    expected = 2 * torch.ones(LARGE[0], LARGE[0]) @ x
    torch.testing.assert_close(leaf.grad, expected, rtol=1e-4, atol=1e-1)
    with FlopCounterMode(display=False) as counter:
        compute_gramian(x)
    assert counter.get_total_flops() == 2 * LARGE[0] ** 2 * LARGE[1]
    small = torch.randn(32, 8192)
    for compiled in (
        torch.jit.script(compute_gramian),
        torch.jit.trace(compute_gramian, (small,), check_trace=False),
        torch.fx.symbolic_trace(compute_gramian),
    ):
        torch.testing.assert_close(compiled(small), small @ small.T, rtol=1e-5, atol=1e-2)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_and_mismatched_out_keep_torchs_product() -> None:
    sparse = torch.randn(64, 4096).to_sparse()
    gramian = compute_gramian(sparse)
    dense = sparse.to_dense()
    torch.testing.assert_close(gramian.to_dense(), dense @ dense.T, rtol=1e-5, atol=1e-2)
    a, b = torch.randn(1024, 128), torch.randn(128, 1024)
    with pytest.raises(RuntimeError):  # as torch.mm: `out` of another dtype is refused
        product(a, b, out=torch.empty(1024, 1024, dtype=torch.float64))
    taller = torch.full((1100, 1024), float("nan"))  # as torch.mm: resized, not half-written
    with pytest.warns(UserWarning, match="resized"):
        expected = torch.mm(a, b, out=torch.full((1100, 1024), float("nan")))
    with pytest.warns(UserWarning, match="resized"):
        assert torch.equal(product(a, b, out=taller), expected)


def test_the_probe_ignores_the_callers_settings() -> None:
    """The one-time probe builds its own float32 CPU tensors and runs outside any mode: a first
    call under another default dtype or device, or inside a tracer, neither fails it nor
    records it."""
    expected = _products._onednn_works()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert _products._onednn_works() is expected
    finally:
        torch.set_default_dtype(previous)
    with torch.device("meta"):
        assert _products._onednn_works() is expected
    graph = make_fx(lambda y: (_products._onednn_works(), y + 1)[1])(torch.randn(3))
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert targets == [torch.ops.aten.add.Tensor]


@pytest.mark.parametrize("n", [8, 100, 1000, 1024])
def test_product_into_out_by_slices_matches_float64(n: int) -> None:
    """A result written into ``out`` by slices of rows (the last one short) is the product."""
    a, b = torch.randn(64, n).T, torch.randn(64, 1024)  # (a transposed view, as the engine's)
    out = torch.full((n, 1024), float("nan"))
    assert product(a, b, out=out) is out
    torch.testing.assert_close(out.double(), a.double() @ b.double(), rtol=0, atol=1e-4)
