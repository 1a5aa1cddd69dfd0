"""``jacflow.func.jacrev`` against ``torch.func.jacrev``: seed 002 and more."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import vmap
from torch.utils._pytree import tree_leaves, tree_structure

from jacflow.func import jacrev
from tests.autojac import _zoo

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


@pytest.mark.parametrize("chunk", [np.int64(2), np.int16(1)], ids=repr)
def test_numpy_integer_chunk_sizes_are_taken_as_by_torch_func(chunk: np.integer) -> None:
    """``torch.func.jacrev`` takes them; they were refused. A bool is not a chunk size."""
    x = torch.randn(3)
    expected = torch.func.jacrev(torch.sin, chunk_size=chunk)(x)  # type: ignore[arg-type]
    torch.testing.assert_close(jacrev(torch.sin, chunk_size=chunk)(x), expected)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`chunk_size` must be None or a positive int"):
        jacrev(torch.sin, chunk_size=True)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        jacrev(torch.sin, chunk_size=0)
    with pytest.raises(TypeError, match="callable"):
        jacrev(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out of range"):
        jacrev(torch.sin, argnums=2)(torch.ones(2))
    with pytest.raises(TypeError, match="must be a Tensor"):
        jacrev(lambda a: a, argnums=0)(3.0)


# Pytree arguments: a differentiated argument may be a (nested) tuple, list or dict of Tensors.

_LEAVES = st.builds(
    lambda shape, seed: torch.randn(
        shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    ),
    st.lists(st.integers(1, 3), max_size=2).map(tuple),
    st.integers(0, 2**16),
)
_TREES = st.recursive(
    _LEAVES,
    lambda children: st.one_of(
        st.lists(children, min_size=1, max_size=3).map(tuple),
        st.lists(children, min_size=1, max_size=3),
        st.dictionaries(st.sampled_from("abc"), children, min_size=1, max_size=3),
    ),
    max_leaves=5,
)


def _mix(*args: Any) -> dict[str, Any]:
    """Outputs of several shapes that depend on every leaf of every argument, nonlinearly."""
    z = torch.cat([leaf.reshape(-1) for leaf in tree_leaves(args)])
    return {"v": z.tanh() * z.roll(1), "s": ((z**2).sum() * z[0].sin(),)}


def _mix_with_aux(*args: Any) -> tuple[dict[str, Any], torch.Tensor]:
    return _mix(*args), tree_leaves(args)[0] * 2


def _assert_same(got: Any, expected: Any) -> None:
    assert tree_structure(got) == tree_structure(expected)
    torch.testing.assert_close(got, expected)


@given(args=st.lists(_TREES, min_size=1, max_size=3), data=st.data())
def test_pytree_arguments_match_torch_func(args: list[Any], data: st.DataObject) -> None:
    n = len(args)
    argnums = data.draw(
        st.one_of(
            st.integers(-n, n - 1),
            st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True).map(tuple),
        ),
        label="argnums",
    )
    chunk = data.draw(st.sampled_from([None, 1, 2, 5]), label="chunk_size")
    has_aux = data.draw(st.booleans(), label="has_aux")
    f = _mix_with_aux if has_aux else _mix
    got = jacrev(f, argnums=argnums, has_aux=has_aux, chunk_size=chunk)(*args)
    expected = torch.func.jacrev(f, argnums=argnums, has_aux=has_aux)(*args)
    _assert_same(got, expected)


def test_pytree_issue_examples() -> None:
    x = torch.randn(3, dtype=torch.float64)
    for arg in [(x, x.cos()), [x, x.cos()]]:
        _assert_same(
            jacrev(lambda t: t[0] * t[1])(arg), torch.func.jacrev(lambda t: t[0] * t[1])(arg)
        )
    params = {"a": x, "b": x.cos()}
    _assert_same(
        jacrev(lambda d: d["a"] * d["b"], chunk_size=2)(params),
        torch.func.jacrev(lambda d: d["a"] * d["b"])(params),
    )


def _loss(params: dict[str, torch.Tensor], x: tuple[torch.Tensor, ...]) -> torch.Tensor:
    hidden = (x[0] @ params["w"].T + params["b"]).tanh()
    return (hidden * x[1]).sum() ** 2


def _params_and_inputs() -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    params = {
        "w": torch.randn(2, 3, generator=gen, dtype=torch.float64),
        "b": torch.randn(2, generator=gen, dtype=torch.float64),
    }
    inputs = (
        torch.randn(4, 3, generator=gen, dtype=torch.float64),
        torch.randn(4, 2, generator=gen, dtype=torch.float64),
    )
    return params, inputs


@pytest.mark.parametrize("chunk", CHUNKS)
def test_pytree_hessians_match_torch_func(chunk: int | None) -> None:
    params, inputs = _params_and_inputs()
    got = jacrev(jacrev(_loss, chunk_size=chunk), chunk_size=chunk)(params, inputs)
    _assert_same(got, torch.func.hessian(_loss)(params, inputs))
    both = (0, -1)
    got = jacrev(jacrev(_loss, argnums=both, chunk_size=chunk), argnums=both)(params, inputs)
    expected = torch.func.jacrev(torch.func.jacrev(_loss, argnums=both), argnums=both)(
        params, inputs
    )
    _assert_same(got, expected)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_pytree_arguments_compose_with_vmap(chunk: int | None) -> None:
    params, inputs = _params_and_inputs()
    batched = {key: torch.stack([value, value.sin(), value.cos()]) for key, value in params.items()}
    got = vmap(jacrev(_loss, chunk_size=chunk), in_dims=(0, None))(batched, inputs)
    _assert_same(got, vmap(torch.func.jacrev(_loss), in_dims=(0, None))(batched, inputs))

    per_sample = vmap(_loss, in_dims=(None, (0, 0)))
    rows = (inputs[0][:, None], inputs[1][:, None])
    got = jacrev(per_sample, argnums=(0, 1), chunk_size=chunk)(params, rows)
    _assert_same(got, torch.func.jacrev(per_sample, argnums=(0, 1))(params, rows))


def test_pytree_with_an_empty_container_matches_torch_func() -> None:
    x = torch.randn(3)

    def f(empty: dict[str, torch.Tensor], t: torch.Tensor) -> torch.Tensor:
        return t * 2

    _assert_same(jacrev(f, argnums=(0, 1))({}, x), torch.func.jacrev(f, argnums=(0, 1))({}, x))
    with pytest.raises(ValueError, match="hold no Tensor"):
        jacrev(lambda t: x * 2)(())


def test_non_tensor_leaves_are_refused_as_by_torch_func() -> None:
    x = torch.randn(3)
    for arg, leaf in [((x, 2.0), r"\[1\]"), ({"a": x, "b": None}, r"\['b'\]")]:
        with pytest.raises(ValueError, match="must be Tensor"):
            torch.func.jacrev(lambda t: x * 2)(arg)
        with pytest.raises(TypeError, match=rf"argument 0 \(leaf {leaf}\) must be a Tensor"):
            jacrev(lambda t: x * 2)(arg)


def test_complex_inputs_and_outputs_are_refused_as_by_torch_func() -> None:
    z = torch.tensor([1 + 2j, 3 - 1j])
    x = torch.randn(2)
    cases: list[tuple[Callable[..., Any], tuple[Any, ...], str]] = [
        (lambda t: (t**2).real, (z,), r"argument 0 is complex"),
        (lambda t: (t[0] ** 2).real + t[1], ((z, x),), r"argument 0 \(leaf \[0\]\) is complex"),
        (lambda a, t: a * t["z"].abs(), (x, {"z": z}), r"argument 1 \(leaf \['z'\]\) is complex"),
        (lambda t: t * 1j, (x,), r"output 0 \(flattened\) of `func` is complex"),
    ]
    for f, args, message in cases:
        argnums = (0, 1) if len(args) == 2 else 0
        with pytest.raises(RuntimeError, match="real"):
            torch.func.jacrev(f, argnums=argnums)(*args)
        with pytest.raises(ValueError, match=message) as info:
            jacrev(f, argnums=argnums)(*args)
        assert "view_as_real" in str(info.value)


def test_duplicate_argnums_are_refused() -> None:
    x = torch.randn(3)
    with pytest.raises(RuntimeError, match="unique"):
        torch.func.jacrev(lambda a, b: a + b, argnums=(0, -2))(x, x)
    with pytest.raises(ValueError, match="each argument once"):
        jacrev(lambda a, b: a + b, argnums=(0, -2))(x, x)


_X = torch.ones(3)


@pytest.mark.parametrize(
    ("func", "has_aux", "words"),
    [
        (lambda x: 3, False, r"`func` must return a Tensor.*received int\."),
        (lambda x: (x, "a"), False, r"`func` must return a Tensor.*received str\."),
        (lambda x: x * 2, True, r"has_aux=True, `func` must return a pair.*Tensor"),
        (lambda x: (x, x, x), True, r"must return a pair.*a tuple of length 3"),
        (lambda x: (x * 2, 1), True, r"the aux of `func` must be a Tensor.*received int\."),
        (lambda x: (3, x), True, r"`func` must return a Tensor.*received int\."),
    ],
)
def test_jacrev_refuses_outputs_that_are_not_tensors(
    func: Callable[[torch.Tensor], Any], has_aux: bool, words: str
) -> None:
    with pytest.raises(TypeError, match=words):
        jacrev(func, has_aux=has_aux)(_X)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_jacrev_refuses_integer_inputs(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match=rf"argument 0 must be a floating-point.*{dtype}"):
        jacrev(lambda x: x * 2)(torch.ones(3, dtype=dtype))
    with pytest.raises(TypeError, match=r"argument 1 \(leaf \['b'\]\) must be a floating"):
        jacrev(lambda y, p: y * p["b"], argnums=(0, 1))(_X, {"b": torch.ones(3, dtype=dtype)})


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
@pytest.mark.parametrize("chunk", [None, 1])
def test_jacrev_refuses_integer_outputs(dtype: torch.dtype, chunk: int | None) -> None:
    """Refused as by torch.func.jacrev, but with torch.func.vjp's message, which named ``vjp``
    and no output. The error is a TypeError and, as torch.func.jacrev's, a RuntimeError."""
    with pytest.raises(RuntimeError, match="floating-point"):
        torch.func.jacrev(lambda x: (x * 2, x.to(dtype)))(_X)
    for expected in (TypeError, RuntimeError):
        with pytest.raises(expected, match=rf"jacrev: output 1 \(flattened\) .* is {dtype}"):
            jacrev(lambda x: (x * 2, x.to(dtype)), chunk_size=chunk)(_X)
    jacobian, aux = jacrev(lambda x: (x * 2, x.to(dtype)), has_aux=True, chunk_size=chunk)(_X)
    assert torch.equal(jacobian, 2 * torch.eye(3)) and aux.dtype == dtype


@pytest.mark.parametrize("has_aux", [1, 0, "yes", None])
def test_jacrev_refuses_a_has_aux_that_is_not_a_bool(has_aux: object) -> None:
    with pytest.raises(TypeError, match="`has_aux` must be a bool"):
        jacrev(lambda x: (x, x), has_aux=has_aux)  # type: ignore[arg-type]


def test_jacrev_keeps_valid_outputs_and_aux() -> None:
    jacobian, aux = jacrev(lambda x: (x * 2, {"a": x.sum()}), has_aux=True)(_X)
    assert torch.equal(jacobian, 2 * torch.eye(3)) and torch.equal(aux["a"], _X.sum())
    assert torch.equal(jacrev(lambda x: [x * 2])(_X)[0], 2 * torch.eye(3))
    assert torch.equal(jacrev(lambda x, k: x * k, argnums=0)(_X, 2), 2 * torch.eye(3))


@pytest.mark.parametrize("chunk_size", [None, 2, 1])
def test_a_product_with_a_sparse_adjacency_matrix(chunk_size: int | None) -> None:
    """vmap cannot batch the pullback of a product with a sparse COO matrix ("expand is
    unsupported for Sparse tensors"): the chunk is differentiated again row by row (a
    functional pullback may be called again), equal to autograd's row-by-row Jacobian. (A CSR
    matrix fails in torch.func itself, as with torch.func.jacrev.)"""
    adjacency = _zoo.adjacency("coo")
    x = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def propagate(weight: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.sparse.mm(adjacency, x @ weight)).sum(1)

    weight = torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = torch.autograd.functional.jacobian(propagate, weight)
    torch.testing.assert_close(jacrev(propagate, chunk_size=chunk_size)(weight), expected)


@pytest.mark.parametrize("chunk_size", [None, 2, 1])
def test_a_sparse_embedding(chunk_size: int | None) -> None:
    """The pullback of an ``nn.Embedding(sparse=True)`` gives sparse gradients, which vmap
    cannot stack (torch.func.jacrev fails: "Could not run 'aten::view' with arguments from the
    'SparseCPU' backend"): the rows are taken one by one and densified."""
    table = torch.nn.Embedding(5, 3, sparse=True).double()
    ids = torch.tensor([1, 3, 3])
    params = {name: p.detach() for name, p in table.named_parameters()}

    def looked_up(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(table, p, (ids,)).pow(2).sum(1)

    got = jacrev(looked_up, chunk_size=chunk_size)(params)["weight"]
    expected = torch.autograd.functional.jacobian(
        lambda w: torch.nn.functional.embedding(ids, w).pow(2).sum(1), params["weight"]
    )
    assert got.layout == torch.strided
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    ("func", "args", "argnums", "kind"),
    [
        (lambda a: a * 2, (torch.arange(3),), 0, TypeError),
        (lambda a: a.abs(), (torch.ones(3, dtype=torch.cfloat),), 0, ValueError),
        (lambda a: a * 1j, (_X,), 0, ValueError),
        (lambda a: a.long(), (_X,), 0, TypeError),
        (lambda a: 3, (_X,), 0, TypeError),
        (lambda a, b: a + b, (_X, _X), (0, -2), ValueError),
        (lambda a: a, (_X,), 1, ValueError),
        (lambda a, b: a + b, (_X, _X), [0, 1], TypeError),
        (lambda a, n: a * n, (_X, 3), 1, TypeError),
        (lambda t: t[0] * 2, ((_X, 3),), 0, TypeError),
    ],
    ids=[
        "int-input",
        "complex-input",
        "complex-output",
        "int-output",
        "non-tensor-output",
        "repeated-argnums",
        "argnums-out-of-range",
        "argnums-list",
        "non-tensor-argument",
        "non-tensor-leaf",
    ],
)
def test_call_refusals_are_also_of_torch_funcs_class(
    func: Callable[..., Any], args: tuple[Any, ...], argnums: Any, kind: type[Exception]
) -> None:
    """Every call that torch.func.jacrev refuses is refused with a TypeError or ValueError that
    is also an instance of torch's class, which code written for torch catches."""
    with pytest.raises((RuntimeError, ValueError)) as torch_error:
        torch.func.jacrev(func, argnums=argnums)(*args)
    for expected in (kind, type(torch_error.value)):
        with pytest.raises(expected, match="jacrev: "):
            jacrev(func, argnums=argnums)(*args)
