"""``kernel_gram``: the per-task ghost Gramian, by Cholesky blocks or directly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jacflow.autogram._rules import blocks_pay, kernel_gram


@settings(max_examples=60)
@given(
    t=st.integers(1, 70),
    r=st.integers(1, 6),
    p=st.integers(1, 5),
    kind=st.sampled_from(["full_rank", "low_rank", "duplicated", "with_bias"]),
    block=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
)
def test_equals_the_direct_products(
    t: int, r: int, p: int, kind: str, block: int, seed: int
) -> None:
    """Any number of blocks (or the direct route below the sizes), full-rank and singular
    kernels: ``G[k, l] = <K rows[k], rows[l]>`` to rounding."""
    gen = torch.Generator().manual_seed(seed)
    columns = max(1, t // 3) if kind == "low_rank" else t + 3
    x = torch.randn(t, columns, generator=gen, dtype=torch.float64)
    if kind == "duplicated" and t > 1:
        x[t // 2 :] = x[: t - t // 2].clone()
    kernel = x @ x.T + (1.0 if kind == "with_bias" else 0.0)
    rows = torch.randn(r, t, p, generator=gen, dtype=torch.float64)
    direct = torch.einsum("st,ktp,lsp->kl", kernel, rows, rows)
    actual = kernel_gram(kernel, rows, block=block, blocks=True)
    bound = float(torch.linalg.matrix_norm(kernel, ord=2)) * float(rows.square().sum((1, 2)).max())
    torch.testing.assert_close(actual, direct, rtol=0, atol=1e-12 * t * max(bound, 1e-300))
    torch.testing.assert_close(actual, actual.T, rtol=0, atol=1e-12 * t * max(bound, 1e-300))


def test_the_blocks_are_taken_when_the_kernel_factorises(monkeypatch: pytest.MonkeyPatch) -> None:
    """A positive definite kernel goes through the factor when the blocks pay (the direct
    product is never formed); a kernel that is not factorisable goes to the direct products."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(128, 150, generator=gen, dtype=torch.float64)
    rows = torch.randn(4, 128, 3, generator=gen, dtype=torch.float64)
    calls: list[tuple[int, ...]] = []
    original = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: calls.append(tuple(a.shape)) or original(a, b))
    kernel_gram(x @ x.T, rows, blocks=True)
    assert (4, 128, 128) not in calls  # no direct product K rows[k]
    indefinite = x @ x.T - 1e3 * torch.eye(128, dtype=torch.float64)
    direct = torch.einsum("st,ktp,lsp->kl", indefinite, rows, rows)
    torch.testing.assert_close(kernel_gram(indefinite, rows, blocks=True), direct)
    assert (4, 128, 128) in calls
    calls.clear()
    kernel_gram(x @ x.T, rows)  # 4 x 128 x 3: too small for the blocks to pay
    assert (4, 128, 128) in calls


@pytest.mark.parametrize(
    ("r", "t", "p", "expected"),
    [
        (6, 256, 1024, True),  # the multi-task benchmark's wide trunk: 0.83x the direct time
        (3, 256, 1024, True),
        (2, 512, 1024, True),
        (2, 256, 1024, False),  # 1.05x in float32
        (4, 128, 128, False),  # 2.7x
        (10, 256, 256, False),  # within 8% either way
        (4, 1024, 256, False),  # 1.2x: the factorisation of T = 1024 dominates
    ],
)
def test_blocks_pay_where_measured(r: int, t: int, p: int, expected: bool) -> None:
    """The route rule against the measurements it was drawn from (the comments)."""
    assert blocks_pay(r, t, p) is expected
