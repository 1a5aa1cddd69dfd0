"""``jacrev``: the reverse-mode Jacobian as a function transform, on the chunked-VJP core."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import (
    TreeSpec,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_unflatten,
)

from jacflow.autojac._checks import check_chunk_size
from jacflow.autojac._rows import functional_vjp, stacked_vjps


class _CallTypeError(TypeError, RuntimeError):
    """A refusal of a call that :func:`torch.func.jacrev` refuses with a ``RuntimeError``
    (integer inputs or outputs, non-Tensor leaves, bad ``argnums``): a ``TypeError`` that code
    written for torch still catches."""


class _CallValueError(ValueError, RuntimeError):
    """As :class:`_CallTypeError`, for a value refused (complex Tensors, ``argnums`` out of
    range or repeated)."""


class _NotATensorError(TypeError, ValueError):
    """A differentiated argument that is not a Tensor, which :func:`torch.func.jacrev` refuses
    with a ``ValueError``."""


def _check_argnums(argnums: int | tuple[int, ...], n_args: int) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else argnums
    if not isinstance(nums, tuple) or not nums or not all(isinstance(a, int) for a in nums):
        raise _CallTypeError(
            f"jacrev: `argnums` must be an int or a non-empty tuple of ints, got {argnums!r}."
        )
    for a in nums:
        if not -n_args <= a < n_args:
            raise _CallValueError(
                f"jacrev: `argnums` {a} is out of range for a function called with {n_args} "
                "positional arguments."
            )
    wrapped = tuple(a % n_args for a in nums)
    if len(set(wrapped)) != len(wrapped):
        raise _CallValueError(
            f"jacrev: `argnums` must name each argument once, got {argnums!r} (which refers to "
            f"positions {wrapped} of the {n_args} positional arguments)."
        )
    return wrapped


def _flatten_argument(value: Any, position: int) -> tuple[list[Tensor], TreeSpec]:
    """The Tensors of the differentiated argument ``position`` (a Tensor or a pytree of them)."""
    with_paths, spec = tree_flatten_with_path(value)
    leaves: list[Tensor] = []
    for path, leaf in with_paths:
        where = f"argument {position}" + (f" (leaf {keystr(path)})" if path else "")
        if not isinstance(leaf, Tensor):
            raise _NotATensorError(
                f"jacrev: {where} must be a Tensor to be differentiated, received "
                f"{type(leaf)}. Differentiated arguments are Tensors or tuples, lists and dicts "
                "of Tensors; pass other values through an argument not in `argnums`."
            )
        if leaf.is_complex():
            raise _CallValueError(
                f"jacrev: {where} is complex ({leaf.dtype}); like torch.func.jacrev, jacrev "
                "differentiates with respect to real Tensors only. Pass torch.view_as_real(z) "
                "and rebuild z with torch.view_as_complex inside `func` to get the Jacobian "
                "with respect to its real and imaginary parts."
            )
        if not leaf.is_floating_point():
            raise _CallTypeError(
                f"jacrev: {where} must be a floating-point Tensor to be differentiated, "
                f"received {leaf.dtype}; convert it with `.float()`."
            )
        leaves.append(leaf)
    return leaves, spec


def _non_tensors(tree: Any) -> str:
    """The type names of the leaves of ``tree`` that are not Tensors ("" if none)."""
    names = {type(leaf).__name__ for leaf in tree_flatten(tree)[0] if not isinstance(leaf, Tensor)}
    return ", ".join(sorted(names))


def _check_result(result: Any, has_aux: bool) -> Any:
    """``func``'s result, checked before ``torch.func.vjp`` sees it (its errors are
    ``RuntimeError``s that do not say what was received)."""
    output = result
    if has_aux:
        if not isinstance(result, tuple) or len(result) != 2:
            got = f"a tuple of length {len(result)}" if isinstance(result, tuple) else type(result)
            raise _CallTypeError(
                "jacrev: with has_aux=True, `func` must return a pair (output, aux), received "
                f"{got}."
            )
        output, aux = result
        if bad := _non_tensors(aux):
            raise _CallTypeError(
                "jacrev: with has_aux=True, the aux of `func` must be a Tensor or a pytree "
                f"(tuples, lists, dicts) of Tensors, received {bad}."
            )
    if bad := _non_tensors(output):
        raise _CallTypeError(
            "jacrev: `func` must return a Tensor or a pytree (tuples, lists, dicts) of Tensors, "
            f"received {bad}."
        )
    # (torch.func.vjp's own refusal names vjp, not the transform that the caller used)
    for k, out in enumerate(tree_flatten(output)[0]):
        if not (out.is_floating_point() or out.is_complex()):
            raise _CallTypeError(
                f"jacrev: output {k} (flattened) of `func` is {out.dtype}; like "
                "torch.func.jacrev, jacrev differentiates floating-point outputs only. Return "
                "it as a float (`.float()`), or as aux (`has_aux=True`) to keep it apart."
            )
    return result


def jacrev(
    func: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    *,
    has_aux: bool = False,
    chunk_size: int | None = None,
) -> Callable[..., Any]:
    """The Jacobian of ``func`` with respect to the argument(s) at ``argnums``, in reverse mode.

    Same semantics as :func:`torch.func.jacrev`: the returned function takes ``func``'s
    arguments and returns the Jacobian, whose leaves have shape
    ``output.shape + input.shape``; with a tuple ``argnums`` one Jacobian per argument (nested
    per output when ``func`` returns several tensors). A differentiated argument may be a
    pytree (tuple, list, dict, nested) of Tensors: per output, the Jacobian then has that
    argument's structure, as with :func:`torch.func.jacrev`. Composes with
    :func:`torch.func.vmap` and with itself (Hessians), and respects ``torch.no_grad`` inside
    ``func`` but not around the call (it is a function transform). Like
    :func:`torch.func.jacrev`, it refuses complex inputs and outputs (differentiate
    ``torch.view_as_real`` views instead). Its refusals of a call (integer or complex inputs
    and outputs, non-Tensor leaves, bad ``argnums``) are ``TypeError``s or ``ValueError``s that
    are also instances of the class :func:`torch.func.jacrev` raises (``RuntimeError``, or
    ``ValueError`` for a differentiated argument that is not a Tensor). A chunk whose pullback
    vmap cannot batch because of a sparse COO tensor (a product with a graph's adjacency
    matrix) is differentiated again row by row; torch.func itself fails on sparse CSR
    tensors.

    Args:
        func: takes one or more arguments, at least one a Tensor, and returns one or more
            Tensors (or ``(output, aux)`` with ``has_aux``).
        argnums: which positional argument(s) to differentiate with respect to; each a real
            floating-point Tensor or a pytree of them.
        has_aux: ``func`` returns ``(output, aux)``; the transform returns ``(jacobian, aux)``.
        chunk_size: rows per vmapped VJP call; ``None`` = all at once, ``1`` = a loop without
            vmap.

    Example:
        >>> import torch
        >>> from jacflow.func import jacrev
        >>> x = torch.tensor([0.0, 1.0, 2.0])
        >>> jacrev(torch.exp)(x)
        tensor([[1.0000, 0.0000, 0.0000],
                [0.0000, 2.7183, 0.0000],
                [0.0000, 0.0000, 7.3891]])
        >>> jacobian = jacrev(lambda p: p["w"] * p["b"])({"w": x, "b": torch.ones(3)})
        >>> jacobian["b"]
        tensor([[0., 0., 0.],
                [0., 1., 0.],
                [0., 0., 2.]])
    """
    size = check_chunk_size(chunk_size, "chunk_size")
    if not callable(func):
        raise TypeError(f"jacrev: `func` must be callable, received {type(func)}.")
    if not isinstance(has_aux, bool):
        raise TypeError(f"jacrev: `has_aux` must be a bool, received {type(has_aux)}.")

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nums = _check_argnums(argnums, len(args))
        flat_args = [_flatten_argument(args[a], a) for a in nums]
        primals = tuple(leaf for leaves, _ in flat_args for leaf in leaves)
        if not primals:
            raise _CallValueError(
                f"jacrev: the differentiated argument(s) {nums} hold no Tensor (empty "
                "containers), so there is nothing to differentiate."
            )
        counts = [len(leaves) for leaves, _ in flat_args]

        def rebuild(flat: tuple[Any, ...]) -> list[Any]:
            """``flat`` (one entry per primal) regrouped into one pytree per differentiated arg."""
            trees, start = [], 0
            for count, (_, spec) in zip(counts, flat_args):
                trees.append(tree_unflatten(list(flat[start : start + count]), spec))
                start += count
            return trees

        def partial(*diff_leaves: Tensor) -> Any:
            full = list(args)
            for a, value in zip(nums, rebuild(diff_leaves)):
                full[a] = value
            return _check_result(func(*full, **kwargs), has_aux)

        aux: Any = None
        if has_aux:
            output, pullback, aux = torch.func.vjp(partial, *primals, has_aux=True)  # type: ignore[misc]
        else:
            output, pullback = torch.func.vjp(partial, *primals)  # type: ignore[misc]
        flat_out, out_spec = tree_flatten(output)  # (Tensors: checked by _check_result)
        for k, o in enumerate(flat_out):
            if o.is_complex():
                raise _CallValueError(
                    f"jacrev: output {k} (flattened) of `func` is complex ({o.dtype}); like "
                    "torch.func.jacrev, jacrev differentiates real outputs only. Return "
                    "torch.view_as_real(output) to get the Jacobian of its real and imaginary "
                    "parts."
                )

        def pullback_flat(cotangents: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            return tuple(pullback(tree_unflatten(list(cotangents), out_spec)))

        rows = sum(o.numel() for o in flat_out)
        # stacked_vjps returns [rows, *primal.shape] per primal (the leaves of all the args).
        stacked, _ = stacked_vjps(
            functional_vjp(pullback_flat),
            flat_out,
            primals,
            rows,
            size,
            preallocate=False,
            sparse_retry=True,
        )
        single_arg = isinstance(argnums, int)
        leaves: list[Any] = []
        start = 0
        for o in flat_out:
            stop = start + o.numel()
            blocks = tuple(
                s[start:stop].reshape(o.shape + p.shape) for s, p in zip(stacked, primals)
            )
            # Per output, the Jacobian has the inputs' structure: torch.func.jacrev's layout.
            trees = rebuild(blocks)
            leaves.append(trees[0] if single_arg else tuple(trees))
            start = stop
        jacobian = tree_unflatten(leaves, out_spec)
        return (jacobian, aux) if has_aux else jacobian

    return wrapper
