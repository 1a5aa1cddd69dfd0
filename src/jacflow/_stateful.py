"""The contract of every method that keeps state between calls."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any, ClassVar


class Stateful(ABC):
    """A method whose output depends on previous calls (momentum, EMA, warm starts, ...).

    :meth:`reset` restores the behaviour of a freshly constructed instance; the state each class
    keeps is listed in its docstring.

    Example:
        >>> from jacflow import Stateful
        >>> class Counter(Stateful):
        ...     def __init__(self) -> None:
        ...         self.calls = 0
        ...     def reset(self) -> None:
        ...         self.calls = 0
        >>> c = Counter(); c.calls = 3; c.reset(); c.calls
        0
    """

    @abstractmethod
    def reset(self) -> None:
        """Forget all state, as if the object had just been constructed."""


class SavesState:
    """Mixin for an ``nn.Module`` (listed before it among the bases) whose state includes plain
    attributes, named in :attr:`saved_state`: they go into ``state_dict()`` as its extra state
    and come back with ``load_state_dict``, so that a checkpoint resumes the method exactly
    (buffers and parameters are saved by ``nn.Module`` itself).

    Example:
        >>> from torch import nn
        >>> from jacflow._stateful import SavesState
        >>> class Counting(SavesState, nn.Module):
        ...     saved_state = ("calls",)
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.calls = 0
        >>> first = Counting(); first.calls = 3
        >>> second = Counting(); _ = second.load_state_dict(first.state_dict()); second.calls
        3
    """

    saved_state: ClassVar[tuple[str, ...]] = ()
    """The names of the attributes that hold state besides buffers and parameters."""

    def get_extra_state(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.saved_state}

    def set_extra_state(self, state: Any) -> None:
        expected = set(self.saved_state)
        if not isinstance(state, dict) or set(state) != expected:
            received = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the saved state must hold "
                f"{sorted(expected)}, received {received}. Load a state_dict saved from a "
                f"{type(self).__name__}."
            )
        for name, value in state.items():  # (copies: two loads of one dict share nothing)
            setattr(self, name, copy.deepcopy(value))
