"""The contract of every method that keeps state between calls."""

from __future__ import annotations

from abc import ABC, abstractmethod


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
