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


_PENDING = object()  # (no saved attributes met yet in the load under way)


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
        """The attributes named in :attr:`saved_state`, for ``state_dict()``."""
        # (copies: a state_dict kept in memory is a snapshot, not a view of state that later
        # calls update in place, while its counters stay as they were)
        return {name: copy.deepcopy(getattr(self, name)) for name in self.saved_state}

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        """``nn.Module``'s, with the saved attributes applied only if this module's own
        tensors loaded without error (a size mismatch is raised after the whole load: the
        module must then be as it was)."""
        error_msgs: list[str] = args[-1]
        before = len(error_msgs)
        self.__dict__["_jacflow_loading"] = _PENDING
        try:
            super()._load_from_state_dict(state_dict, prefix, *args)  # type: ignore[misc]
            pending = self.__dict__["_jacflow_loading"]
        finally:
            del self.__dict__["_jacflow_loading"]
        if pending is not _PENDING and len(error_msgs) == before:
            self._apply_saved(pending)

    def set_extra_state(self, state: Any) -> None:
        """Restore the attributes of :meth:`get_extra_state` (``load_state_dict``), once the
        module's own tensors have loaded without error; a state of other names is refused."""
        self._check_saved(state)
        if "_jacflow_loading" in self.__dict__:  # (applied once the load succeeded)
            self.__dict__["_jacflow_loading"] = state
        else:
            self._apply_saved(state)

    def _apply_saved(self, state: dict[str, Any]) -> None:
        for name, value in state.items():  # (copies: two loads of one dict share nothing)
            setattr(self, name, copy.deepcopy(value))

    def _check_saved(self, state: Any) -> None:
        expected = set(self.saved_state)
        if not isinstance(state, dict) or set(state) != expected:
            received = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the saved state must hold "
                f"{sorted(expected)}, received {received}. Load a state_dict saved from a "
                f"{type(self).__name__}."
            )
