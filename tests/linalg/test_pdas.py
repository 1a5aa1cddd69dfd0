"""PDAS on the inverse Gramian: the same iterates from systems of the size of the active set."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from jacflow.linalg import project_weights
from jacflow.linalg._dual_cone import _inverse, project_weights_reference
from jacflow.linalg._pdas import _solve_active, _solve_free, pdas_solve
from tests.linalg.test_dual_cone import assert_kkt, make_gramian, upgrad_rows
from tests.linalg.test_lawson_hanson import normalised


def per_sample_gramian(m: int, seed: int) -> Tensor:
    """The Gramian of the per-sample gradients of a small classifier's cross-entropy (from
    ``torch.func``): strongly conflicting rows, so that UPGrad's projections leave most weights
    free and only a few constraints active."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 5)).double()
    params = {k: p.detach() for k, p in model.named_parameters()}
    x, y = torch.randn(m, 10, dtype=torch.float64), torch.randint(0, 5, (m,))

    def loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    j = torch.cat([g.reshape(m, -1) for g in grads.values()], dim=1)
    return j @ j.T


@settings(max_examples=40)
@given(
    m=st.integers(2, 70),
    seed=st.integers(0, 2**31 - 1),
    fraction=st.floats(0.0, 1.0),
)
def test_active_systems_give_the_free_systems_iterate(m: int, seed: int, fraction: float) -> None:
    """For any active set, ``v = H mu`` with ``H_AA mu_A = u_A`` is the primal PDAS iterate."""
    u, g = normalised(upgrad_rows(m), make_gramian(m, "psd", 1.0, seed))
    gen = torch.Generator().manual_seed(seed)
    active = torch.rand(1, m, m, generator=gen) < fraction
    inverse = _inverse(g)
    assert inverse is not None
    dual = _solve_active(u, inverse, active)
    assert dual is not None
    torch.testing.assert_close(dual, _solve_free(u, g, active), rtol=0, atol=1e-9)


@settings(max_examples=30)
@given(m=st.integers(2, 90), seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["ps", "psd"]))
def test_inverse_gives_the_same_solutions(m: int, seed: int, kind: str) -> None:
    """PDAS with the inverse solves the problems plain PDAS solves, to the same ``v`` (PDAS may
    cycle on others: ``project_weights`` then hands them over to ADMM or Lawson-Hanson)."""
    gramian = per_sample_gramian(m, seed) if kind == "ps" else make_gramian(m, "psd", 1.0, seed)
    u, g = normalised(upgrad_rows(m), gramian)
    inverse = _inverse(g)
    assert inverse is not None
    v, residual = pdas_solve(u, g, u, 50, 1e-12, inverse)
    plain, plain_residual = pdas_solve(u, g, u, 50, 1e-12)
    solved = residual <= 1e-10
    assert torch.equal(solved, plain_residual <= 1e-10)
    torch.testing.assert_close(v[solved], plain[solved], rtol=0, atol=1e-9)
    if bool(solved.all()):
        assert_kkt(v[0], u[0], g[0], rtol=1e-9)


@settings(max_examples=10)
@given(m=st.integers(33, 70), seed=st.integers(0, 2**31 - 1), scale=st.integers(-6, 6))
def test_project_weights_on_per_sample_gramians(m: int, seed: int, scale: int) -> None:
    """The automatic route (PDAS on the inverse, then ADMM on what it leaves) is exact."""
    gramian = 10.0**scale * per_sample_gramian(m, seed)
    u = upgrad_rows(m)
    v = project_weights(u, gramian)
    assert_kkt(v, u, gramian, rtol=1e-9)
    torch.testing.assert_close(v, project_weights_reference(u, gramian), rtol=0, atol=1e-8)


def test_dual_only_stops_where_free_systems_are_needed() -> None:
    """``dual_only`` never solves a free system: problems it leaves are returned unsolved."""
    m = 60
    u, g = normalised(upgrad_rows(m), per_sample_gramian(m, 0))
    inverse = _inverse(g)
    assert inverse is not None
    v, residual = pdas_solve(u, g, u, 50, 1e-12, inverse, dual_only=True)
    assert bool((residual <= 1e-10).all())  # these active sets are small: solved on H alone
    assert_kkt(v[0], u[0], g[0], rtol=1e-9)
    unsolved_v, unsolved_residual = pdas_solve(u, g, u, 50, 1e-12, None, dual_only=True)
    assert torch.equal(unsolved_v, u)  # no inverse: nothing to do
    assert bool((unsolved_residual > 1e-10).any())


def test_inaccurate_inverse_hands_over_to_the_free_systems() -> None:
    """A perturbed inverse finds the active sets; the free systems then make them exact."""
    m = 60
    u, g = normalised(upgrad_rows(m), per_sample_gramian(m, 2))
    inverse = _inverse(g)
    assert inverse is not None
    noise = torch.randn(m, m, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rough = inverse + 1e-5 * inverse.abs().max() * (noise + noise.T)
    v, residual = pdas_solve(u, g, u, 50, 1e-12, rough)
    assert bool((residual <= 1e-10).all()), float(residual.amax())
    assert_kkt(v[0], u[0], g[0], rtol=1e-9)


def test_inverse_only_for_safely_positive_definite_gramians() -> None:
    singular = normalised(upgrad_rows(8), make_gramian(8, "more_rows", 1.0, 0))[1]
    assert _inverse(singular) is None
    regular = normalised(upgrad_rows(8), make_gramian(8, "psd", 1.0, 0))[1]
    inverse = _inverse(regular)
    assert inverse is not None
    torch.testing.assert_close(inverse @ regular, torch.eye(8, dtype=torch.float64)[None])
