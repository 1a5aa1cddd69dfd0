"""The convention for aggregation methods whose maths reads the loss values themselves."""

from __future__ import annotations

from abc import ABC

from torch import Tensor


class LossAware(ABC):  # noqa: B024 - a mixin with shared behaviour, no abstract method needed
    """Mixin for methods that need the current losses (MGDA ``loss`` modes, GradNorm, EPO, ...).

    Call :meth:`set_losses` with the ``m`` loss values of the step before aggregating; the
    values are detached and kept until the next :meth:`set_losses` (a call without new losses
    reuses them: set them before each call). Aggregating without having set them, or
    with a number of losses that differs from the number of Jacobian rows, raises a
    ``ValueError``.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import LossAware
        >>> class Echo(LossAware):
        ...     pass
        >>> e = Echo(); e.set_losses(torch.tensor([1., 2.])); e.require_losses(2)
        tensor([1., 2.])
    """

    _losses: Tensor | None = None

    def set_losses(self, losses: Tensor) -> None:
        """Record the loss values (any shape, flattened to ``[m]``) that the calls read until
        the next ``set_losses``: a call without new losses reuses these, so set them before
        each call with the losses of its step."""
        if not isinstance(losses, Tensor):
            raise TypeError(f"`losses` must be a torch.Tensor, received {type(losses)}.")
        self._losses = losses.detach().reshape(-1)

    def require_losses(self, m: int) -> Tensor:
        """The recorded losses, checked to have ``m`` entries."""
        if self._losses is None:
            raise ValueError(
                f"{type(self).__name__} needs the loss values: call `.set_losses(losses)` with the "
                "m losses of this step before aggregating."
            )
        if self._losses.shape[0] != m:
            raise ValueError(
                f"{type(self).__name__} received {self._losses.shape[0]} losses through "
                f"`set_losses` but the Jacobian has {m} rows; give one loss per row."
            )
        return self._losses

    def losses_like(self, m: int, like: Tensor) -> Tensor:
        """:meth:`require_losses` moved to ``like``'s device and dtype."""
        return self.require_losses(m).to(device=like.device, dtype=like.dtype)
