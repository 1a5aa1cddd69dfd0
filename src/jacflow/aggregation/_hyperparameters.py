"""Validation of scalar hyper-parameters at construction time, with messages naming the range."""

from __future__ import annotations

import math


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
