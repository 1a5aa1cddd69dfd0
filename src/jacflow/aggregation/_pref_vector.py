"""Preference vectors shared by the methods that take ``pref_vector``."""

from __future__ import annotations

from torch import Tensor

from jacflow.aggregation._hyperparameters import check_real_values
from jacflow.aggregation._mean import mean_weights


def check_pref_vector(pref_vector: object, name: str = "pref_vector") -> Tensor | None:
    """Validate a user-given preference vector (at construction and on assignment)."""
    if pref_vector is None:
        return None
    if not isinstance(pref_vector, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor or None, received {type(pref_vector)}.")
    if pref_vector.ndim != 1:
        raise ValueError(
            f"`{name}` must be a vector (1-D tensor) with one entry per objective, received "
            f"shape {tuple(pref_vector.shape)}."
        )
    return check_real_values(pref_vector, name)


def resolve_pref_vector(pref_vector: Tensor | None, m: int, like: Tensor) -> Tensor:
    """The preference weights for ``m`` rows: the given vector, or ``1/m`` each by default."""
    if pref_vector is None:
        return mean_weights(m, like)
    check_pref_rows(pref_vector, m)
    return pref_vector.to(device=like.device, dtype=like.dtype)


def check_pref_rows(pref_vector: Tensor | None, m: int) -> None:
    """Raise unless ``pref_vector`` (if given) has one entry per row, ``m``."""
    if pref_vector is not None and pref_vector.shape[0] != m:
        raise ValueError(
            f"`pref_vector` has {pref_vector.shape[0]} entries but the matrix has {m} rows; give "
            "one preference per objective."
        )
