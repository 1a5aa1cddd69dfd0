"""Primal PDAS's building blocks: block gathers and a given start."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jacflow.linalg._pdas import (
    first_slots,
    gather_blocks,
    kkt_residual,
    multiplier_scale,
    pad_identity,
    pdas_solve,
)
from tests.linalg.test_dual_cone import make_gramian, upgrad_rows
from tests.linalg.test_lawson_hanson import normalised


@settings(max_examples=40)
@given(
    m=st.integers(1, 40),
    batch=st.integers(1, 3),
    problems=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_gather_blocks_is_the_indexed_block(m: int, batch: int, problems: int, seed: int) -> None:
    """Each block is ``G[which][slots, slots]`` on the used slots and the identity elsewhere,
    whatever the unused slots hold."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(batch, m, m, generator=gen, dtype=torch.float64)
    mask = torch.rand(problems, m, generator=gen) < 0.5
    size = max(1, int(mask.sum(-1).amax()))
    slots, valid = first_slots(mask, size)
    slots = torch.where(valid, slots, torch.randint(0, m, slots.shape, generator=gen))
    which = torch.randint(0, batch, (problems,), generator=gen)
    blocks = gather_blocks(pad_identity(g), which if batch > 1 else None, slots, valid.sum(-1))
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
