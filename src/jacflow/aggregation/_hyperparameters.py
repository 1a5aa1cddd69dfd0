"""Hyper-parameters: validated at construction and on every later assignment.

A class declares each constructor argument that it keeps as a :class:`Hyperparameter` in its
body, with the function that checks a value; the constructor then assigns it like any
attribute (``self.c = c``) and so does the user later (``weighting.c = 2.0``): the same check
runs both times, and a failed assignment leaves the object unchanged. An aggregator that is
configured by its weighting declares the weighting's hyper-parameters as :class:`Forwarded`:
reading and assigning them go to the weighting. Both work on subclasses of
:class:`Configurable` (every :class:`~jacflow.aggregation.Aggregator` and
:class:`~jacflow.aggregation.Weighting`).

A hyper-parameter can be assigned after construction only when the class's constructor takes
an argument of that name (a named method such as ``CAGrad`` builds its weighting itself, so its
``gramian_weighting`` cannot be swapped), and not when it is declared ``frozen`` (e.g. a size
that the method's state or trainable parameters have): those raise an ``AttributeError`` that
says to build a new instance.
"""

from __future__ import annotations

import functools
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

import torch
from torch import Tensor, nn

T = TypeVar("T")

Check = Callable[[object, str], T]
"""Validates a value for the hyper-parameter of the given name: the value to keep, or a
``ValueError``/``TypeError`` that names the argument, what it expects and what it received."""


def check_float(
    value: object,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a finite float in the interval described, else a ``ValueError``/``TypeError``.

    Example:
        >>> from jacflow.aggregation._hyperparameters import check_float
        >>> check_float(0.5, "beta", low=0.0, high=1.0)
        0.5
        >>> check_float(2, "beta", low=0.0, high=1.0)
        Traceback (most recent call last):
        ...
        ValueError: `beta` must be a float in [0.0, 1.0], received 2.
    """
    interval = (
        f"{'(' if low_open else '['}{'-inf' if low is None else low}, "
        f"{'inf' if high is None else high}{')' if high_open or high is None else ']'}"
    )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a float in {interval}, received {type(value)}.")
    number = float(value)
    ok = math.isfinite(number)
    if ok and low is not None:
        ok = number > low if low_open else number >= low
    if ok and high is not None:
        ok = number < high if high_open else number <= high
    if not ok:
        raise ValueError(f"`{name}` must be a float in {interval}, received {value!r}.")
    return number


def check_int(value: object, name: str, *, low: int) -> int:
    """``value`` as an int ``>= low``, else a ``ValueError``/``TypeError``.

    Example:
        >>> from jacflow.aggregation._hyperparameters import check_int
        >>> check_int(3, "every", low=1)
        3
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int >= {low}, received {type(value)}.")
    if value < low:
        raise ValueError(f"`{name}` must be an int >= {low}, received {value}.")
    return value


def floats(
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> Check[float]:
    """The :func:`check_float` of an interval, as a :data:`Check`."""
    return functools.partial(
        check_float, low=low, high=high, low_open=low_open, high_open=high_open
    )


def ints(*, low: int) -> Check[int]:
    """The :func:`check_int` of a lower bound, as a :data:`Check`."""
    return functools.partial(check_int, low=low)


def or_none(check: Check[T]) -> Check[T | None]:
    """``check``, letting ``None`` through (an optional hyper-parameter)."""

    def check_optional(value: object, name: str) -> T | None:
        return None if value is None else check(value, name)

    return check_optional


def check_real_values(value: Tensor, name: str, owner: str = "") -> Tensor:
    """``value`` if it is a real floating-point tensor of finite values that can be read (not on
    the meta device), else a ``TypeError``/``ValueError`` naming ``name`` (and ``owner``, the
    class, when given). The shared value check of every tensor hyper-parameter.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._hyperparameters import check_real_values
        >>> check_real_values(torch.tensor([1.0, float("nan")]), "pref_vector")
        Traceback (most recent call last):
        ...
        ValueError: `pref_vector` must be finite, received [1.0, nan].
    """
    where = f"{owner}: " if owner else ""
    if value.is_complex() or not value.is_floating_point():
        raise TypeError(
            f"{where}`{name}` must be a real floating-point tensor (e.g. float32), received dtype "
            f"{value.dtype}. Convert it with `.float()`."
        )
    if value.device.type == "meta":
        raise ValueError(
            f"{where}`{name}` is on the meta device, which holds no values; create it on a real "
            "device (e.g. cpu)."
        )
    if not bool(torch.isfinite(value).all()):
        raise ValueError(
            f"{where}`{name}` must be finite, received {value.detach().flatten().tolist()[:8]}."
        )
    return value


def check_unit_vector(value: object, name: str, expected: str) -> Tensor:
    """``value`` if it is a vector (1-D tensor) of entries in [0, 1], else a ``ValueError``
    saying that ``name`` must be ``expected``.

    Example:
        >>> import torch
        >>> from jacflow.aggregation._hyperparameters import check_unit_vector
        >>> check_unit_vector(torch.tensor([0.2, 1.0]), "leak", "a vector")
        tensor([0.2000, 1.0000])
    """
    if not isinstance(value, Tensor) or value.ndim != 1:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value)
        raise ValueError(f"`{name}` must be {expected}, received {shape}.")
    check_real_values(value, name)
    if not bool(((value >= 0) & (value <= 1)).all()):
        raise ValueError(f"`{name}` values must lie in [0, 1], received {value.tolist()}.")
    return value


def check_bool(value: object, name: str) -> bool:
    """``value`` if it is a bool, else a ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, received {type(value)}.")
    return value


def check_callable(value: object, name: str) -> Callable[..., Any]:
    """``value`` if it is callable, else a ``TypeError``."""
    if not callable(value):
        raise TypeError(f"`{name}` must be callable, received {type(value)}.")
    return value


_TAKES: dict[tuple[type, str], bool] = {}
_DECLARED: dict[tuple[type, str], bool] = {}


def _constructor_takes(cls: type, name: str) -> bool:
    """Whether ``cls``'s constructor takes an argument ``name`` (or any keyword: a subclass's
    ``**kwargs`` passed on)."""
    key = (cls, name)
    if key not in _TAKES:
        parameters = inspect.signature(cls).parameters.values()
        _TAKES[key] = any(
            p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters
        )
    return _TAKES[key]


def _constructing(module: nn.Module) -> bool:
    """Whether a constructor of ``module`` is running (a subclass's sets what it likes)."""
    return bool(module.__dict__.get(_CONSTRUCTING))


_CONSTRUCTING = "_jacflow_constructing"


def _is_set(module: nn.Module, name: str) -> bool:
    return name in module.__dict__ or name in module._modules or name in module._parameters


def _refuse_assignment(module: nn.Module, name: str, frozen: str | None) -> None:
    cls = type(module).__name__
    reason = frozen or f"{cls}'s constructor takes no `{name}`"
    raise AttributeError(
        f"`{name}` of {cls} cannot be assigned after construction ({reason}); build a new "
        f"{cls} instead."
    )


def _store(module: nn.Module, name: str, value: object) -> None:
    """Put ``value`` where ``nn.Module.__setattr__`` would: a parameter, a submodule or a plain
    attribute (it cannot do it itself: it would call the descriptor again)."""
    for table in (module.__dict__, module._parameters, module._modules):
        table.pop(name, None)
    if isinstance(value, nn.Parameter):
        module._parameters[name] = value
    elif isinstance(value, nn.Module):
        module._modules[name] = value
    else:
        module.__dict__[name] = value


_D = TypeVar("_D", bound="_Declared[Any]")


class _Declared(ABC, Generic[T]):
    """A class attribute through which an instance's hyper-parameter is read and assigned."""

    def __init__(self) -> None:
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self: _D, instance: None, owner: type) -> _D: ...

    @overload
    def __get__(self, instance: object, owner: type) -> T: ...

    def __get__(self: _D, instance: object, owner: type) -> _D | T:
        if instance is None:
            return self
        assert isinstance(instance, nn.Module)
        return self._read(instance)

    @abstractmethod
    def _read(self, instance: nn.Module) -> T:
        """The value of the hyper-parameter of ``instance``."""

    @abstractmethod
    def __set__(self, instance: nn.Module, value: T) -> None:
        """Check ``value`` and make it the hyper-parameter of ``instance``, or raise."""


class Hyperparameter(_Declared[T]):
    """A constructor argument kept as an attribute whose every assignment is validated.

    Args:
        check: validates a value (called with the value and the attribute's name) and returns
            the value to keep.
        fits: called with the object and the checked value, for conditions that involve other
            attributes; raises to refuse the value.
        frozen: the reason why the value cannot change after construction (``None``: it can,
            when the class's constructor takes an argument of its name).

    Example:
        >>> from jacflow.aggregation import CAGradWeighting
        >>> W = CAGradWeighting(c=0.5)
        >>> W.c = 2.0
        >>> W.c
        2.0
        >>> W.c = -1.0
        Traceback (most recent call last):
        ...
        ValueError: `c` must be a float in [0.0, inf), received -1.0.
        >>> W.c
        2.0
    """

    def __init__(
        self,
        check: Check[T],
        *,
        fits: Callable[[Any, T], None] | None = None,
        frozen: str | None = None,
    ) -> None:
        super().__init__()
        self._check = check
        self._fits = fits
        self._frozen = frozen

    def _read(self, instance: nn.Module) -> T:
        tables: tuple[dict[str, Any], ...] = (
            instance.__dict__,
            instance._modules,
            instance._parameters,
        )
        for table in tables:
            if self.name in table:
                value: T = table[self.name]
                return value
        raise AttributeError(f"{type(instance).__name__} has no `{self.name}` yet.")

    def __set__(self, instance: nn.Module, value: T) -> None:
        if (
            _is_set(instance, self.name)
            and not _constructing(instance)
            and (self._frozen is not None or not _constructor_takes(type(instance), self.name))
        ):
            _refuse_assignment(instance, self.name, self._frozen)
        checked = self._check(value, self.name)
        if self._fits is not None:
            self._fits(instance, checked)
        _store(instance, self.name, checked)


class Forwarded(_Declared[T]):
    """An aggregator's hyper-parameter that its weighting holds: reading and assigning it read
    and assign the weighting's (with its checks).

    Args:
        hyperparameter: the weighting class's :class:`Hyperparameter` (gives the type).
        via: the aggregator's attribute that holds the weighting.

    Example:
        >>> from jacflow.aggregation import CAGrad
        >>> A = CAGrad(c=0.5)
        >>> A.c = 2.0
        >>> A.c, A.gramian_weighting.c
        (2.0, 2.0)
    """

    def __init__(
        self, hyperparameter: Hyperparameter[T], *, via: str = "gramian_weighting"
    ) -> None:
        super().__init__()
        self._via = via

    def _read(self, instance: nn.Module) -> T:
        value: T = getattr(getattr(instance, self._via), self.name)
        return value

    def __set__(self, instance: nn.Module, value: T) -> None:
        if not _constructing(instance) and not _constructor_takes(type(instance), self.name):
            _refuse_assignment(instance, self.name, None)
        setattr(getattr(instance, self._via), self.name, value)


def _declared(cls: type, name: str) -> bool:
    key = (cls, name)
    if key not in _DECLARED:
        owner = next((klass for klass in cls.__mro__ if name in vars(klass)), None)
        _DECLARED[key] = owner is not None and isinstance(vars(owner)[name], _Declared)
    return _DECLARED[key]


class Configurable(nn.Module):
    """An ``nn.Module`` whose :class:`Hyperparameter` and :class:`Forwarded` attributes check
    every assignment.

    ``nn.Module.__setattr__`` registers a module or parameter value itself, without looking at
    the class; the assignments of declared hyper-parameters go to their descriptor instead.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None:
            cls.__init__ = _tracking_construction(init)  # type: ignore[method-assign]

    def __setattr__(self, name: str, value: Any) -> None:
        if _declared(type(self), name):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


def _tracking_construction(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` marking the object as under construction while it runs (nested in the
    subclasses' constructors), so that their assignments of hyper-parameters are accepted."""

    @functools.wraps(init)
    def tracked(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        depth = self.__dict__.get(_CONSTRUCTING, 0)
        self.__dict__[_CONSTRUCTING] = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            if depth:
                self.__dict__[_CONSTRUCTING] = depth
            else:
                self.__dict__.pop(_CONSTRUCTING, None)

    return tracked
