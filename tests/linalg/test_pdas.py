"""Primal PDAS's building blocks: block gathers, the residual at the start, a given start."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import Tensor

from jacflow.linalg._dual_cone import _row_scales, project_weights_reference
from jacflow.linalg._pdas import (
    first_slots,
    gather_blocks,
    kkt_residual,
    lean_pdas_solve,
    multiplier_scale,
    pad_identity,
    pdas_solve,
    start_residual,
)
from tests.linalg.test_dual_cone import assert_kkt, make_gramian, problems, upgrad_rows
from tests.linalg.test_lawson_hanson import normalised


@settings(max_examples=40)
@given(
    m=st.integers(1, 40),
    batch=st.integers(1, 3),
    problems=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    spare=st.integers(0, 3),
    default_pad=st.booleans(),
)
def test_gather_blocks_is_the_indexed_block(
    m: int, batch: int, problems: int, seed: int, spare: int, default_pad: bool
) -> None:
    """Each block is ``G[which][slots, slots]`` on the used slots and the identity elsewhere,
    whatever the unused slots hold, for any identity part at least as large as the blocks."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(batch, m, m, generator=gen, dtype=torch.float64)
    mask = torch.rand(problems, m, generator=gen) < 0.5
    size = max(1, int(mask.sum(-1).amax()))
    slots, valid = first_slots(mask, size)
    slots = torch.where(valid, slots, torch.randint(0, m, slots.shape, generator=gen))
    which = torch.randint(0, batch, (problems,), generator=gen)
    padded = pad_identity(g) if default_pad else pad_identity(g, size + spare)
    assert padded.shape[-1] == (2 * m if default_pad else m + size + spare)
    blocks = gather_blocks(padded, which if batch > 1 else None, slots, valid)
    for n in range(problems):
        used = slots[n, valid[n]]
        expected = torch.eye(size, dtype=torch.float64)
        count = used.numel()
        expected[:count, :count] = g[which[n] if batch > 1 else 0][used][:, used]
        torch.testing.assert_close(blocks[n], expected, rtol=0, atol=0)


@settings(max_examples=20)
@given(m=st.integers(1, 60), seed=st.integers(0, 2**31 - 1))
def test_pdas_start_is_the_same_as_computing_it(m: int, seed: int) -> None:
    """Primal PDAS given the multipliers and residual at ``v0`` returns what it computes alone."""
    u, g = normalised(upgrad_rows(m), make_gramian(m, "conflicting", 1.0, seed))
    lam = 2 * torch.bmm(u, g)
    residual = kkt_residual(u, u, lam, multiplier_scale(g))
    given_start = pdas_solve(u, g, u, 50, 1e-12, (lam, residual))
    alone = pdas_solve(u, g, u, 50, 1e-12)
    torch.testing.assert_close(given_start, alone, rtol=0, atol=0)


@settings(max_examples=40)
@given(
    m=st.integers(1, 20),
    rows=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
    zero_row=st.booleans(),
)
def test_start_residual_is_the_kkt_residual_at_u(
    m: int, rows: int, seed: int, zero_row: bool
) -> None:
    """For rows of max-norm 1 (or 0), as ``_solve`` has them, the short form is the residual
    at ``v = u`` exactly."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(2, rows, m, generator=gen, dtype=torch.float64)
    u = u / u.abs().amax(-1, keepdim=True)
    if zero_row:
        u[0, 0] = 0.0
    g = make_gramian(m, "conflicting", 1.0, seed)[None].expand(2, m, m)
    g = g / g.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None]
    lam, c = 2 * torch.bmm(u, g), multiplier_scale(g)
    assert torch.equal(start_residual(lam, c), kkt_residual(u, u, lam, c))


@settings(max_examples=80)
@given(problem=problems(max_m=24))
@example(problem=(torch.tensor([[1.541]], dtype=torch.float64), torch.zeros(1, 1).double()))
def test_lean_certified_results_solve_the_problem(problem: tuple[Tensor, Tensor]) -> None:
    """What the lean PDAS returns meets the KKT conditions and gives the reference's ``G v``
    (``v`` is not unique on singular Gramians, ``G v`` is), whatever the Gramian's scale."""
    u, gramian = problem
    u = u / _row_scales(u)
    v = lean_pdas_solve(u, gramian, 1e-12)
    if v is None:  # a singular free block, a cycle: the general solvers' problems
        return
    assert bool((v >= u).all())
    assert_kkt(v, u, gramian, rtol=1e-9)
    ref = project_weights_reference(u, gramian)
    trace = float(gramian.trace())
    g = gramian / trace if trace > 0 else gramian  # (a zero Gramian: G v = 0 for every v)
    scale = max(1.0, float(ref.abs().max()), float(v.abs().max()))
    torch.testing.assert_close(v @ g, ref @ g, rtol=0, atol=1e-9 * scale)


@pytest.mark.parametrize("kind", ["psd", "conflicting", "zero_rows"])
@pytest.mark.parametrize("m", [5, 10, 24])
def test_lean_certifies_full_rank_problems(kind: str, m: int) -> None:
    """On Gramians whose only singular directions are zero gradients, it hands nothing over:
    the free blocks are positive definite (a zero gradient's ties stay active). The default
    device plays no part (``meta``: nothing can be computed there)."""
    for seed in range(20):
        gramian = make_gramian(m, kind, 1.0, seed)
        with torch.device("meta"):
            v = lean_pdas_solve(torch.eye(m, dtype=torch.float64, device="cpu"), gramian, 1e-10)
        assert v is not None, f"seed {seed}"
        assert_kkt(v, torch.eye(m, dtype=torch.float64), gramian, rtol=1e-9)


def test_lean_hands_singular_free_blocks_over() -> None:
    """Duplicated conflicting objectives make a singular free block: no certificate (``None``),
    or, if rounding lets the factorisation through, a certified answer; never a guess."""
    j = torch.tensor([[1.0, 0.0], [-0.9, 0.3], [-0.9, 0.3]], dtype=torch.float64)
    u, gramian = torch.eye(3, dtype=torch.float64), j @ j.T
    v = lean_pdas_solve(u, gramian, 1e-12)
    if v is not None:
        assert_kkt(v, u, gramian, rtol=1e-9)
