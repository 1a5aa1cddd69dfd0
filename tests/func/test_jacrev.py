"""``jacflow.func.jacrev`` against ``torch.func.jacrev``: seed 002 and more."""

from __future__ import annotations

import pytest
import torch
from torch.func import vmap

from jacflow.func import jacrev

CHUNKS = [None, 1, 2, 3]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_seed_002_examples(chunk: int | None) -> None:
    x = torch.randn(5)
    assert torch.allclose(jacrev(torch.sin, chunk_size=chunk)(x), torch.diag(torch.cos(x)))

    def g(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = t.sin()
        return r, r

    jacobian_f, f_x = jacrev(g, has_aux=True, chunk_size=chunk)(x)
    assert torch.allclose(f_x, x.sin()) and torch.allclose(jacobian_f, torch.diag(x.cos()))
    assert vmap(jacrev(torch.sin, chunk_size=chunk))(torch.randn(64, 5)).shape == (64, 5, 5)
    hessian = jacrev(jacrev(lambda t: t.sin().sum(), chunk_size=chunk))(x)
    assert torch.allclose(hessian, torch.diag(-x.sin()))
    y = torch.randn(5)
    assert torch.allclose(jacrev(lambda a, b: a + b**2, argnums=1)(x, y), torch.diag(2 * y))
    jx, jy = jacrev(lambda a, b: a + b**2, argnums=(0, 1), chunk_size=chunk)(x, y)
    assert torch.allclose(jx, torch.eye(5)) and torch.allclose(jy, torch.diag(2 * y))


def test_no_grad_inside_is_respected_outside_is_not() -> None:
    def f(t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            c = t**2
        return t - c

    x = torch.randn(4)
    assert torch.allclose(jacrev(f)(x), torch.eye(4))
    with torch.no_grad():
        assert torch.allclose(jacrev(lambda t: t**2)(x), torch.diag(2 * x))


def _several_outputs(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (a[:, None] * b).tanh(), (a.sum() * b).exp()


@pytest.mark.parametrize("chunk", [*CHUNKS, 100])
@pytest.mark.parametrize("argnums", [0, 1, (0, 1), (1,)])
def test_matches_torch_func(chunk: int | None, argnums: int | tuple[int, ...]) -> None:
    a, b = torch.randn(3, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    got = jacrev(_several_outputs, argnums=argnums, chunk_size=chunk)(a, b)
    expected = torch.func.jacrev(_several_outputs, argnums=argnums)(a, b)
    torch.testing.assert_close(got, expected)


SHAPES = [(), (3,), (2, 3)]


@pytest.mark.parametrize("chunk", [None, 1])
@pytest.mark.parametrize("out_shape", SHAPES, ids=str)
@pytest.mark.parametrize("in_shape", SHAPES, ids=str)
def test_scalar_and_tensor_shapes_match_torch_func(
    in_shape: tuple[int, ...], out_shape: tuple[int, ...], chunk: int | None
) -> None:
    """A scalar input or output (``reshape(*(), *())``) crashed; shapes now follow torch.func."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(in_shape, generator=gen, dtype=torch.float64)
    y = torch.randn(in_shape, generator=gen, dtype=torch.float64)
    w = torch.randn(out_shape + in_shape, generator=gen, dtype=torch.float64)
    in_dims = tuple(range(len(out_shape), w.ndim))

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        product = w * (a.sin() * b)
        return product.sum(dim=in_dims) if in_dims else product

    for argnums in (0, (0, 1)):
        got = jacrev(f, argnums=argnums, chunk_size=chunk)(x, y)
        expected = torch.func.jacrev(f, argnums=argnums)(x, y)
        torch.testing.assert_close(got, expected)
    assert jacrev(f, chunk_size=chunk)(x, y).shape == out_shape + in_shape


def test_composes_with_vmap_and_itself() -> None:
    xs = torch.randn(4, 3, dtype=torch.float64)

    def f(t: torch.Tensor) -> torch.Tensor:
        return (t.sin() * t.roll(1)).sum()

    got = vmap(jacrev(jacrev(f, chunk_size=2)))(xs)
    expected = vmap(torch.func.hessian(f))(xs)
    torch.testing.assert_close(got, expected)
    mixed = torch.func.jacfwd(jacrev(f))(xs[0])
    torch.testing.assert_close(mixed, expected[0])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        jacrev(torch.sin, chunk_size=0)
    with pytest.raises(TypeError, match="callable"):
        jacrev(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out of range"):
        jacrev(torch.sin, argnums=2)(torch.ones(2))
    with pytest.raises(TypeError, match="must be a Tensor"):
        jacrev(lambda a: a, argnums=0)(3.0)
