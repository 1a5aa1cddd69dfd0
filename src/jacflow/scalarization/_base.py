"""The :class:`Scalarizer` contract and the checks shared by every scalarization method."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from jacflow._stateful import SavesState
from jacflow.aggregation._hyperparameters import (
    Check,
    Configurable,
    Hyperparameter,
    check_bool,
    check_float,
    check_int,
    check_real_values,
    floats,
    ints,
)

__all__ = [
    "Hyperparameter",
    "Scalarizer",
    "check_bool",
    "check_built_shape",
    "check_device",
    "check_float",
    "check_int",
    "check_losses",
    "check_non_negative",
    "check_optional_tensor",
    "check_readable",
    "check_same_shape",
    "check_shape",
    "check_tensor",
    "floats",
    "follow_losses",
    "ints",
    "map_tensors",
    "matching",
    "on_losses",
    "optional_tensors",
    "tensors",
]


def check_losses(losses: object, owner: str) -> Tensor:
    """Check that ``losses`` is a non-empty floating-point tensor and return it."""
    if not isinstance(losses, Tensor):
        raise TypeError(
            f"{owner} expects `losses` to be a torch.Tensor of loss values, received "
            f"{type(losses)}. Stack a list of scalar losses with `torch.stack(losses)`."
        )
    if not losses.is_floating_point():
        raise TypeError(
            f"{owner} expects `losses` to have a floating dtype, received {losses.dtype}. "
            "Convert them with `losses.float()`."
        )
    if losses.numel() == 0:
        raise ValueError(
            f"{owner} expects at least one loss, received a tensor of shape {tuple(losses.shape)}."
        )
    return losses


def check_non_negative(losses: Tensor, owner: str, remedy: str) -> None:
    """Refuse a finite negative loss, for a method whose weights or value are defined for
    non-negative losses only; ``remedy`` tells the way out. Before any state changes.

    NaN, ``inf`` and ``-inf`` pass: a non-finite loss is a step that an AMP ``GradScaler``
    skips, which every scalarizer answers with a non-finite value (not an error, which would
    stop the run the scaler was about to rescue).

    Example:
        >>> import torch
        >>> from jacflow.scalarization._base import check_non_negative
        >>> check_non_negative(torch.tensor([0.0, float("nan"), -float("inf")]), "M", "")
        >>> check_non_negative(torch.tensor([-1.0, 2.0]), "M", "Shift them.")
        Traceback (most recent call last):
        ...
        ValueError: M is defined for non-negative losses only, received [-1.0, 2.0]. Shift them.
    """
    detached = losses.detach()
    if bool(((detached < 0) & torch.isfinite(detached)).any()):
        raise ValueError(
            f"{owner} is defined for non-negative losses only, received "
            f"{losses.detach().flatten().tolist()[:8]}. {remedy}"
        )


def check_shape(shape: object, owner: str) -> torch.Size:
    """Normalise ``shape`` (an ``int`` or a sequence of ``int``) to a ``torch.Size``."""
    dims = (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else shape
    if not isinstance(dims, Sequence) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims
    ):
        raise TypeError(
            f"{owner}: `shape` must be an int or a sequence of non-negative ints (the shape of "
            f"the losses), received {shape!r}."
        )
    size = torch.Size(dims)
    if size.numel() == 0:
        raise ValueError(f"{owner}: `shape` must hold at least one loss, received {shape!r}.")
    return size


def check_optional_tensor(value: object, name: str, owner: str) -> Tensor | None:
    """Check that ``value`` is ``None`` or a real floating-point tensor of finite values."""
    if value is None:
        return None
    if not isinstance(value, Tensor):
        raise TypeError(
            f"{owner}: `{name}` must be a torch.Tensor or None, received {type(value)}."
        )
    return check_real_values(value, name, owner)


def check_tensor(value: object, name: str, owner: str) -> Tensor:
    """Check that ``value`` is a real floating-point tensor of finite values."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{owner}: `{name}` must be a torch.Tensor, received {type(value)}.")
    return check_real_values(value, name, owner)


def check_readable(losses: Tensor, owner: str) -> None:
    """Refuse losses on the meta device, for a method that reads their values."""
    if losses.device.type == "meta":
        raise ValueError(
            f"{owner} reads the values of `losses`, but they are on the meta device, which holds "
            "none; pass losses on a real device (e.g. cpu)."
        )


def tensors(owner: str) -> Check[Tensor]:
    """:func:`check_tensor` for ``owner``'s hyper-parameter, as a :data:`Check` of
    :class:`~jacflow.aggregation._hyperparameters.Hyperparameter`."""
    return functools.partial(check_tensor, owner=owner)


def optional_tensors(owner: str) -> Check[Tensor | None]:
    """:func:`check_optional_tensor` for ``owner``'s hyper-parameter, as a :data:`Check`."""
    return functools.partial(check_optional_tensor, owner=owner)


def matching(tensor: Tensor, name: str, losses: Tensor, owner: str) -> Tensor:
    """``tensor`` on the losses' device and dtype, after checking that the shapes are equal."""
    if tensor.shape != losses.shape:
        raise ValueError(
            f"{owner}: `{name}` has shape {tuple(tensor.shape)} but `losses` has shape "
            f"{tuple(losses.shape)}; give one entry of `{name}` per loss."
        )
    return tensor.to(device=losses.device, dtype=losses.dtype)


def check_same_shape(state: Tensor, losses: Tensor, owner: str) -> None:
    """Check that the losses have the shape of the state kept from previous calls."""
    if state.shape != losses.shape:
        raise ValueError(
            f"{owner} keeps state for losses of shape {tuple(state.shape)} but received "
            f"`losses` of shape {tuple(losses.shape)}. Call `reset()` before changing the shape."
        )


def check_built_shape(shape: torch.Size, losses: Tensor, owner: str, name: str = "losses") -> None:
    """Check that ``losses`` (the argument ``name``) have the ``shape`` that a method built for
    one shape holds its parameters or buffers in. ``reset()`` cannot change that shape: an
    optimizer holds the parameters, so the message says to build a new instance.

    Example:
        >>> import torch
        >>> from jacflow.scalarization._base import check_built_shape
        >>> check_built_shape(torch.Size([3]), torch.ones(2), "UW")
        Traceback (most recent call last):
        ...
        ValueError: UW was built for losses of shape (3,) but `losses` has shape (2,). Build a
        new `UW(2)` for losses of that shape ... `reset()` keeps the shape it was built for.
    """
    if losses.shape == shape:
        return
    new = str(losses.shape[0]) if losses.dim() == 1 else str(tuple(losses.shape))
    raise ValueError(
        f"{owner} was built for losses of shape {tuple(shape)} but `{name}` has shape "
        f"{tuple(losses.shape)}. Build a new `{owner}({new})` for losses of that shape (and give "
        "its parameters, if any, to the optimizer in place of the old ones); `reset()` keeps "
        "the shape it was built for."
    )


def loss_ratio(losses: Tensor, reference: Tensor) -> Tensor:
    """``losses / reference`` with ``0 / 0`` taken as 1 (no change), as DWA's rates and LBTW's
    ratios read it.

    Example:
        >>> import torch
        >>> from jacflow.scalarization._base import loss_ratio
        >>> loss_ratio(torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0.0, 0.0, 4.0]))
        tensor([1.0000,    inf, 0.5000])
    """
    return torch.where((losses == 0) & (reference == 0), 1.0, losses / reference)


def on_losses(state: Tensor, losses: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``state`` kept from earlier calls, on the losses' device and in ``dtype`` (default
    theirs): a checkpoint loaded on the CPU resumes with losses on a GPU.

    Example:
        >>> import torch
        >>> from jacflow.scalarization._base import on_losses
        >>> on_losses(torch.tensor([1.0]), torch.zeros(1, dtype=torch.float64))
        tensor([1.], dtype=torch.float64)
    """
    return state.to(device=losses.device, dtype=losses.dtype if dtype is None else dtype)


def map_tensors(fn: Callable[[Tensor], Tensor], value: Any) -> Any:
    """``value`` with ``fn`` applied to it if it is a tensor, or to the tensors of a list of
    them (the shapes of the scalarizers' plain state); anything else is returned as it is."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, list):
        return [map_tensors(fn, item) for item in value]
    return value


def check_device(parameters: Sequence[Tensor], losses: Tensor, owner: str) -> None:
    """Refuse losses on another device than ``parameters``, which an optimizer holds: moved
    in place, they would no longer match its state (Adam fails at its next step)."""
    for parameter in parameters:
        if parameter.device != losses.device:
            raise ValueError(
                f"{owner}'s parameters are on {parameter.device} but `losses` are on "
                f"{losses.device}. Move it with `.to({str(losses.device)!r})` as you move the "
                "model (before giving its parameters to the optimizer): they follow the losses "
                "only until the first call in training mode or a loaded state_dict."
            )


def follow_losses(tensors: Sequence[Tensor], losses: Tensor, *, dtype: bool = True) -> None:
    """Move parameters or buffers in place to the losses' device (and, with ``dtype``, to their
    dtype when it is float32 or float64), keeping the tensor objects so that optimizers holding
    them stay valid."""
    follow = dtype and losses.dtype in (torch.float32, torch.float64)
    for tensor in tensors:
        target_dtype = losses.dtype if follow else tensor.dtype
        if tensor.device == losses.device and tensor.dtype == target_dtype:
            continue
        tensor.data = tensor.data.to(device=losses.device, dtype=target_dtype)
        if tensor.grad is not None:
            tensor.grad = tensor.grad.to(device=losses.device, dtype=target_dtype)


class Scalarizer(Configurable, ABC):
    """Reduces a tensor of losses of any shape to one scalar, to call ``.backward()`` on.

    Calling a scalarizer checks that ``losses`` is a non-empty floating-point tensor, then runs
    :meth:`forward`. Stateful methods also subclass :class:`jacflow.Stateful`; learnable ones
    hold ``nn.Parameter`` s to add to the optimizer.

    **Training and evaluation.** A stateful scalarizer updates its state only at a call in
    training mode (the default). After ``.eval()`` (``training`` is ``False``) a call computes
    its value from the current state and changes nothing, as ``BatchNorm`` uses its running
    statistics: scalarizing validation losses does not feed them into training (LBTW took them
    as its reference losses, SoftAdapt as the previous losses of its slopes). ``.train()``
    resumes the updates. Each class says what its evaluation calls compute; ``step()``,
    ``update()`` and ``reset()`` act in both modes.

    **Devices and dtypes.** Parameters and buffers take the losses' device and dtype (float32
    or float64) in place, keeping the tensor objects, until the first call in training mode or
    a loaded ``state_dict`` (which gives them the saved dtype) settles them. After that:

    * their dtype stays: a call on losses of another dtype computes in the wider of the two
      (torch's type promotion). A float32 validation call in a float64 run no longer rounds the
      learned values, and a float64 call after float32 optimizer steps no longer changes the
      dtype of what the optimizer holds (Adam failed at its next step);
    * parameters stay on their device: losses on another one raise a ``ValueError``; move the
      scalarizer with ``.to(device)``, as the model. Buffers that no optimizer holds (FAMO's)
      follow the losses' device at every call.

    The state kept as plain tensors (DWA's averages, LBTW's reference losses, ...) is read on
    the losses' device, and ``.to()`` moves it with the parameters and buffers: a checkpoint
    loaded on the CPU resumes on a GPU. To resume a run, load the scalarizer's state before the
    optimizer's: torch's optimizer casts its state to its parameters' dtype as it loads it.

    **Non-finite losses.** A NaN or an infinite loss (``-inf`` included) gives a non-finite
    value, never an error: it is a step that an AMP ``GradScaler`` skips, and the stateful
    methods leave their state untouched by it. The exception is a ``-inf`` loss in the maxima
    of :class:`Tchebycheff` and :class:`STCH`, which it never wins: their value and gradient
    stay finite, as the maximum's (check the losses themselves to skip such a step).

    Example:
        >>> import torch
        >>> from jacflow.scalarization import Mean
        >>> Mean()(torch.tensor([1.0, 2.0, 6.0]))
        tensor(3.)
    """

    _settled = False
    """Whether the parameters' and buffers' device and dtype are fixed (see the class)."""

    reads_losses: ClassVar[bool] = False
    """Whether the method reads the losses' values (then losses on the meta device are refused)."""

    def __call__(self, losses: Tensor, /) -> Tensor:
        check_losses(losses, type(self).__name__)
        if self.reads_losses:
            check_readable(losses, type(self).__name__)
        return super().__call__(losses)

    def follow(self, tensors: Sequence[Tensor], losses: Tensor) -> None:
        """Give this module's ``tensors`` (its parameters and buffers) the losses' device and
        dtype until they are settled, then only the device to the buffers (see the class)."""
        if self._settled:
            parameters = [t for t in tensors if isinstance(t, nn.Parameter)]
            check_device(parameters, losses, type(self).__name__)
            follow_losses(tensors, losses, dtype=False)
            return
        follow_losses(tensors, losses)
        if self.training:  # (an evaluation call changes no state: the next call still follows)
            self._settled = True

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Scalarizer:
        """``nn.Module``'s (``.to()``, ``.double()``, ...), also applied to the tensors of the
        state kept as plain attributes (its ``saved_state``)."""
        super()._apply(fn, recurse)
        for name in self.saved_state if isinstance(self, SavesState) else ():
            setattr(self, name, map_tensors(fn, getattr(self, name)))
        return self

    @abstractmethod
    def forward(self, losses: Tensor, /) -> Tensor:
        """Return the scalarization of ``losses`` (a 0-dim tensor)."""

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        """``nn.Module``'s, after giving this module's parameters and buffers the dtype of the
        saved ones: a float64 run's state loaded into float32 ones was rounded (the resumed run
        drifted; FAMO's ``update`` then mixed dtypes). A successful load settles them (see the
        class); a failed one gives them their own back."""
        error_msgs: list[str] = args[-1]
        before = len(error_msgs)
        own = [
            (n, t) for n, t in (*self._parameters.items(), *self._buffers.items()) if t is not None
        ]
        kept = [(t.data, t.grad) for _, t in own]
        for name, tensor in own:
            saved = state_dict.get(prefix + name)
            if isinstance(saved, Tensor) and saved.dtype in (torch.float32, torch.float64):
                tensor.data = tensor.data.to(saved.dtype)
                if tensor.grad is not None:
                    tensor.grad = tensor.grad.to(saved.dtype)
        super()._load_from_state_dict(state_dict, prefix, *args)
        if len(error_msgs) != before:
            for (_, tensor), (data, grad) in zip(own, kept, strict=True):
                tensor.data, tensor.grad = data, grad
        else:  # (the optimizer loaded next holds them as they are now)
            self._settled = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

    def __str__(self) -> str:
        return type(self).__name__
