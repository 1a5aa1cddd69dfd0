"""Argument normalisation and validation shared by the public autojac functions.

Every check runs before any computation so that a failed call leaves ``.grad`` and ``.jac``
untouched; messages name the argument, what was expected and what was received.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable, Sequence
from typing import cast

from torch import Tensor

from jacflow._labels import received
from jacflow.aggregation import Aggregator


def as_tensor_tuple(value: Tensor | Iterable[Tensor], name: str) -> tuple[Tensor, ...]:
    """``value`` as a tuple of tensors; a single tensor becomes a 1-tuple."""
    return cast("tuple[Tensor, ...]", _tensor_items(value, name, none_ok=False))


def _tensor_items(
    value: Tensor | Iterable[Tensor | None], name: str, none_ok: bool
) -> tuple[Tensor | None, ...]:
    """:func:`as_tensor_tuple`, with ``None`` items where ``none_ok`` (the cotangents of
    :func:`checked_cotangents`)."""
    if isinstance(value, Tensor):
        return (value,)
    whole, each = "a Tensor or a sequence of Tensors", "a Tensor"
    if none_ok:
        whole, each = f"{whole} (or None for an output of one element)", f"{each} or None"
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"`{name}` must be {whole}, received {type(value)}.") from None
    for i, item in enumerate(items):
        if not (isinstance(item, Tensor) or (none_ok and item is None)):
            raise TypeError(f"`{name}[{i}]` must be {each}, received {type(item)}.")
    return items


def checked_cotangents(
    value: Tensor | Iterable[Tensor | None], outputs: tuple[Tensor, ...], name: str, out_name: str
) -> tuple[tuple[Tensor, ...], int]:
    """``value`` (``jac_tensors`` or ``jac_outputs``) checked against ``outputs`` (each
    ``[m, *output.shape]``, with one ``m``), and its number of rows ``m``.

    A ``None`` entry stands for what it stands for in torch's ``grad_tensors``: ones for an
    output of one element (``m`` of them: the other entries' rows, or one row when every entry
    is ``None``, the sum of the outputs' gradients) and zeros for an output that does not
    require grad. For any other output it is refused.

    Example:
        >>> import torch
        >>> from jacflow.autojac._checks import checked_cotangents
        >>> y, s = torch.ones(2, requires_grad=True), torch.ones((), requires_grad=True)
        >>> cotangents, m = checked_cotangents([torch.eye(2), None], (y, s), "jac", "out")
        >>> cotangents[1], m
        (tensor([1., 1.]), 2)
    """
    items = _tensor_items(value, name, none_ok=True)
    for i, item in enumerate(items):
        if item is not None:
            check_real_tensor(item, f"{name}[{i}]")
    rows = _checked_rows(items, outputs, name, out_name)
    m = 1 if rows is None else rows
    filled = []
    for i, (item, output) in enumerate(zip(items, outputs, strict=True)):
        if item is None:
            if output.requires_grad and output.numel() != 1:
                raise ValueError(
                    f"`{name}[{i}]` is None, which stands for ones only for an element of "
                    f"`{out_name}` with one element (and for zeros for one that does not require "
                    f"grad), as in torch's grad_tensors; `{out_name}[{i}]` has shape "
                    f"{tuple(output.shape)}. Pass its cotangents, of shape "
                    f"{rows_shape(output.shape)}."
                )
            fill = output.new_ones if output.requires_grad else output.new_zeros
            item = fill((m, *output.shape))
        filled.append(item)
    return tuple(filled), m


def rows_shape(shape: Sequence[int]) -> str:
    """``[m, *shape]`` written out: ``[m, 2, 3]``, or ``[m]`` for a scalar's."""
    return f"[{', '.join(['m', *map(str, shape)])}]"


def check_non_empty(tensors: tuple[Tensor, ...], name: str) -> None:
    if not tensors:
        raise ValueError(f"`{name}` cannot be empty: pass at least one tensor.")


def check_unique(tensors: tuple[Tensor, ...], name: str) -> None:
    seen: dict[int, int] = {}
    for i, tensor in enumerate(tensors):
        if id(tensor) in seen:
            raise ValueError(
                f"`{name}` must contain distinct tensors, but `{name}[{seen[id(tensor)]}]` and "
                f"`{name}[{i}]` are the same tensor. Pass each tensor once."
            )
        seen[id(tensor)] = i


def without_repeats(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """``tensors`` with each tensor kept once, at its first place (as ``torch.autograd.backward``
    takes ``inputs``)."""
    return tuple({id(t): t for t in tensors}.values())


def check_chunk_size(value: object, name: str) -> int | None:
    """``value`` as a chunk size: ``None`` or an int >= 1, given as any integer but a bool
    (numpy's too, as ``torch.func.jacrev`` and TorchJD take them: ``np.ceil`` results, config
    arrays)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be None or a positive int, received {value!r}.")
    size = operator.index(value)
    if size < 1:
        raise ValueError(
            f"`{name}` must be None (all rows at once) or an int >= 1, received {size}. Use 1 "
            "for a sequential loop without vmap."
        )
    return size


def check_inputs_require_grad(inputs: tuple[Tensor, ...], name: str, fix: str = "") -> None:
    """Refuse an input that does not require grad; ``fix``: the way out where it is not to call
    ``.requires_grad_()`` on it (a feature must come from the shared parameters)."""
    fix = fix or f"Call `.requires_grad_()` on it or remove it from `{name}`."
    for i, tensor in enumerate(inputs):
        if not tensor.requires_grad:
            raise ValueError(
                f"`{name}[{i}]` (shape {tuple(tensor.shape)}) does not require grad, so no "
                f"Jacobian can be computed with respect to it. {fix}"
            )


def check_flag(value: object, name: str, none_ok: bool = False) -> None:
    """``value`` must be a bool (or ``None`` where ``none_ok``)."""
    if isinstance(value, bool) or (none_ok and value is None):
        return
    expected = "a bool or None" if none_ok else "a bool"
    raise TypeError(f"`{name}` must be {expected}, received {value!r}.")


def check_real(tensors: Sequence[Tensor], name: str) -> None:
    """Refuse complex tensors, as ``torch.func.jacrev`` and ``torch.autograd.grad`` do (the
    Jacobian of a complex output was silently that of its real part)."""
    for i, tensor in enumerate(tensors):
        check_real_tensor(tensor, f"{name}[{i}]")


def check_real_tensor(tensor: Tensor, name: str) -> None:
    """:func:`check_real` for one tensor, named ``name`` (the autogram Engine's ``losses``)."""
    if tensor.is_complex():
        raise ValueError(
            f"`{name}` is complex ({tensor.dtype}); jacflow's Jacobians are real. "
            f"Pass torch.view_as_real({name}) (its real and imaginary parts as a last "
            "dimension of size 2) to get both parts' rows."
        )


def check_real_inputs(tensors: Sequence[Tensor], name: str) -> None:
    """Refuse complex tensors whose Jacobian an aggregator is to combine: the aggregators are
    defined on real Jacobians (a Gramian ``J J^T`` of complex rows is not the one they read),
    and would fail deep inside, or combine the rows wrongly."""
    for i, tensor in enumerate(tensors):
        if tensor.is_complex():
            raise ValueError(
                f"`{name}[{i}]` (shape {tuple(tensor.shape)}) is complex ({tensor.dtype}), and "
                "jacflow's aggregators combine the rows of real Jacobians only. Make it real: "
                "hold torch.view_as_real(p) as the parameter (its real and imaginary parts as a "
                "last dimension of size 2) and read it with torch.view_as_complex in the forward."
            )


def check_inputs_not_aggregator(inputs: object) -> None:
    """Refuse an aggregator given as ``inputs``: ``backward(tensors, A)``, the order of TorchJD
    0.3 to 0.7, where jacflow's second positional argument is ``inputs``."""
    if isinstance(inputs, Aggregator):
        raise TypeError(
            f"`inputs` received an aggregator, {inputs!r}: pass the aggregator as `A=` "
            "(`backward(tensors, A=UPGrad())`), as backward's second argument is `inputs`."
        )


def check_aggregator(aggregator: object) -> Aggregator | None:
    if aggregator is None or isinstance(aggregator, Aggregator):
        return aggregator
    raise TypeError(
        f"`A` must be a jacflow.aggregation.Aggregator (e.g. UPGrad()) or None, received "
        f"{received(aggregator)}."
    )


def _checked_rows(
    jac_outputs: Sequence[Tensor | None],
    outputs: tuple[Tensor, ...],
    jac_name: str,
    out_name: str,
) -> int | None:
    """Check that each ``jac_outputs[i]`` given (not ``None``) has shape
    ``[m, *outputs[i].shape]`` with one ``m``; return ``m`` (``None`` if none is given)."""
    if len(jac_outputs) != len(outputs):
        raise ValueError(
            f"`{jac_name}` must have one tensor per element of `{out_name}`: expected "
            f"{len(outputs)}, received {len(jac_outputs)}."
        )
    first: tuple[int, int] | None = None  # (the first entry given, its rows)
    for i, (jac, out) in enumerate(zip(jac_outputs, outputs)):
        if jac is None:
            continue
        if jac.ndim != out.ndim + 1 or jac.shape[1:] != out.shape:
            raise ValueError(
                f"`{jac_name}[{i}]` must have shape [m, *{out_name}[{i}].shape] = "
                f"{rows_shape(out.shape)}, received {tuple(jac.shape)}. Its first "
                "dimension is the number of rows of the Jacobian."
            )
        if first is None:
            first = (i, jac.shape[0])
        elif jac.shape[0] != first[1]:
            raise ValueError(
                f"All tensors of `{jac_name}` must have the same number of rows m (first "
                f"dimension): `{jac_name}[{first[0]}]` has {first[1]}, `{jac_name}[{i}]` has "
                f"{jac.shape[0]}."
            )
    return None if first is None else first[1]
