"""The registry of per-layer Gramian rules and the data every rule reads.

A rule turns what the engine recorded for one hooked module (its inputs, and the gradient of
every loss row with respect to its outputs) into a :class:`Contribution`: that module's share of
the Gramian, per-row gradients of its parameters when they must be combined with another module
(weight tying), and the weighted gradient of the book-keeping step.

The registry maps module types to rules, in the manner of a primitive-rule table: small
``register_rule`` calls fill it, and :func:`find_rule` looks a module up along its type's MRO.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Rows:
    """How the ``R`` rows of the Gramian map onto the samples the modules saw.

    Per-sample mode: the modules saw ``S = B`` samples stacked on dimension 0 and row ``r``
    belongs to sample ``index[r]`` (``index is None``: row ``r`` is sample ``r``).
    Per-task mode: the whole batch is one sample (``S = 1``) seen by every row.
    """

    num_rows: int
    num_samples: int
    index: Tensor | None
    per_task: bool

    def samples(self, raw: Tensor) -> Tensor:
        """Module-side tensor ``[N, ...]`` -> samples ``[S, *sample_shape]``."""
        return raw.unsqueeze(0) if self.per_task else raw

    def gather(self, per_sample: Tensor) -> Tensor:
        """Samples ``[S, ...]`` -> one entry per row ``[R, ...]`` (a view where possible)."""
        if self.per_task:
            return per_sample.expand(self.num_rows, *per_sample.shape[1:])
        if self.index is None:
            return per_sample
        return per_sample[self.index]

    def reduce(self, weights: Tensor, per_row: Tensor) -> Tensor:
        """``y[s] = sum_{r: sample(r) = s} weights[r] * per_row[r]``, shape ``[S, ...]``."""
        scaled = per_row * weights.to(per_row.dtype).reshape(-1, *([1] * (per_row.ndim - 1)))
        if self.per_task:
            return scaled.sum(0, keepdim=True)
        if self.index is None:
            return scaled
        out = scaled.new_zeros(self.num_samples, *per_row.shape[1:])
        return out.index_add_(0, self.index, scaled)


@dataclass
class Call:
    """One recorded forward call of a hooked module.

    ``grads[j]`` is filled by the engine with the gradient of every row with respect to the
    ``j``-th recorded output (shape ``[R, *sample_output_shape]``), or ``None`` when that output
    is not in the graph of the losses.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output_positions: list[int]
    output_shapes: list[torch.Size]
    edges: list[Any]
    versions: list[tuple[Tensor, int]]
    grads: list[Tensor | None] = field(default_factory=list)

    def grad(self, j: int = 0) -> Tensor:
        """Gradient of the rows w.r.t. output ``j``, zeros when the output was unused."""
        grad = self.grads[j]
        if grad is None:
            raise RuntimeError("internal: `grad` called on a call whose output was not reached")
        return grad

    def input(self) -> Tensor:
        """The first positional argument (the layer input of Linear, Conv, norms, ...)."""
        value = self.args[0] if self.args else next(iter(self.kwargs.values()), None)
        if not isinstance(value, Tensor):
            raise TypeError(f"expected the module's input to be a Tensor, received {type(value)}")
        return value


class Contribution(ABC):
    """What one hooked module contributes, once its calls and rows are known."""

    @abstractmethod
    def gramian(self, names: set[str]) -> Tensor | None:
        """``[R, R]`` Gramian contribution of the parameters in ``names`` (None if empty)."""

    @abstractmethod
    def per_row_grads(self, name: str) -> Tensor:
        """Per-row gradients ``[R, *param.shape]`` of one parameter (used for shared ones)."""

    @abstractmethod
    def weighted_grads(self, weights: Tensor) -> dict[str, Tensor]:
        """``sum_r weights[r] g_r`` for every covered parameter (the book-keeping update)."""


class Rule(ABC):
    """Builds a :class:`Contribution` from the calls of one module."""

    @abstractmethod
    def prepare(
        self, module: nn.Module, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> Contribution:
        """``params``: the trainable parameters this rule covers, by name within ``module``."""

    def covers_children(self) -> bool:
        """Whether the rule covers the parameters of the module's children too."""
        return False


_RULES: dict[type[nn.Module], Rule] = {}


def register_rule(module_type: type[nn.Module], rule: Rule) -> None:
    """Use ``rule`` for modules of ``module_type`` (and subclasses that keep its ``forward``)."""
    _RULES[module_type] = rule


def find_rule(module: nn.Module) -> Rule | None:
    """The registered rule of ``module``'s nearest registered base type, if its ``forward``
    is that base type's own (a subclass with another ``forward`` gets no closed form)."""
    for klass in type(module).__mro__:
        rule = _RULES.get(klass)
        if rule is not None:
            forward: Callable[..., Any] = type(module).forward
            return rule if forward is klass.forward else None  # type: ignore[attr-defined]
    return None


def stack_grads(grads: dict[str, Tensor]) -> Tensor:
    """Concatenate per-row gradients ``{name: [R, ...]}`` into ``[R, P]``."""
    return torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], dim=1)


class MaterializedContribution(Contribution):
    """A contribution given by explicit per-row gradients ``{name: [R, *shape]}``."""

    def __init__(self, grads: dict[str, Tensor]) -> None:
        self.grads = grads

    def gramian(self, names: set[str]) -> Tensor | None:
        kept = {n: g for n, g in self.grads.items() if n in names}
        if not kept:
            return None
        flat = stack_grads(kept)
        return flat @ flat.T

    def per_row_grads(self, name: str) -> Tensor:
        return self.grads[name]

    def weighted_grads(self, weights: Tensor) -> dict[str, Tensor]:
        out = {}
        for name, grad in self.grads.items():
            out[name] = torch.tensordot(weights.to(grad.dtype), grad, dims=1)
        return out


def add_grads(total: dict[str, Tensor], new: dict[str, Tensor]) -> dict[str, Tensor]:
    """Sum two ``{name: tensor}`` dictionaries key by key."""
    for name, value in new.items():
        total[name] = total[name] + value if name in total else value
    return total
