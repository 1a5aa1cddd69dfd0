"""The registry of per-layer Gramian rules and the data every rule reads.

A rule turns what the engine recorded for one hooked module (its inputs, and the gradient of
every loss row with respect to its outputs) into a :class:`Contribution`: that module's share of
the Gramian, per-row gradients of its parameters when they must be combined with another module
(weight tying), and the weighted gradient of the book-keeping step.

The registry maps module types to rules, in the manner of a primitive-rule table: small
``register_rule`` calls fill it, and :func:`find_rule` looks a module up along its type's MRO.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge
from torch.nn.modules import module as torch_module
from torch.utils.hooks import unserializable_hook

from jacflow.linalg._cholesky import cholesky_ex
from jacflow.linalg._products import row_gramian


@dataclass(frozen=True)
class Rows:
    """How the ``R`` rows of the Gramian map onto the samples the modules saw.

    Per-sample mode: the modules saw ``S = B`` samples stacked on dimension 0 and row ``r``
    belongs to sample ``index[r]`` (``index is None``: row ``r`` is sample ``r``).
    Per-task mode: the whole batch is one sample (``S = 1``) seen by every row.

    Example:
        >>> import torch
        >>> from jacflow.autogram import Rows
        >>> rows = Rows(num_rows=3, num_samples=2, index=torch.tensor([0, 1, 1]), per_task=False)
        >>> rows.gather(torch.tensor([10., 20.]))
        tensor([10., 20., 20.])
        >>> rows.reduce(torch.tensor([1., 2., 3.]), torch.tensor([1., 1., 1.]))
        tensor([1., 5.])
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
        if self.per_task:  # (weighted_sum converts the weights' dtype)
            return weighted_sum(weights, per_row, (1, *per_row.shape[1:]))
        if weights.dtype != per_row.dtype:
            weights = weights.to(per_row.dtype)
        scaled = per_row * weights.reshape(-1, *([1] * (per_row.ndim - 1)))
        if self.index is None:
            return scaled
        out = scaled.new_zeros(self.num_samples, *per_row.shape[1:])
        return out.index_add_(0, self.index, scaled)


def backward_hooks(module: nn.Module | None) -> tuple[bool, bool]:
    """Whether ``module`` (``None``: every module, the global registrations) has full module
    backward hooks or pre-hooks (``register_full_backward_hook``), and whether it has older
    ones (``register_backward_hook``); torch keeps one kind of hooks per module.

    Example:
        >>> from torch import nn
        >>> from jacflow.autogram._rules import backward_hooks
        >>> layer = nn.Linear(2, 2)
        >>> _ = layer.register_full_backward_hook(lambda module, grads_in, grads_out: None)
        >>> backward_hooks(layer)
        (True, False)
    """
    if module is None:
        hooks, pre_hooks = (
            torch_module._global_backward_hooks,
            torch_module._global_backward_pre_hooks,
        )
        full = torch_module._global_is_full_backward_hook  # (read now: torch rebinds it)
    else:
        hooks, pre_hooks, full = (
            module._backward_hooks,
            module._backward_pre_hooks,
            module._is_full_backward_hook,
        )
    return bool(pre_hooks) or (bool(hooks) and bool(full)), bool(hooks) and not full


@unserializable_hook
def no_hook(grad: Tensor) -> None:
    """The engine's own gradient hook on each recorded output: it opens the tensor's dict of
    hooks, where a user's later hooks land (see :attr:`Call.output_hooks`)."""
    return None


class BaseView(NamedTuple):
    """Where a recorded output lies in its contiguous base: the base's shape and the output's
    size, strides and storage offset (relative to the base's)."""

    base_shape: torch.Size
    size: torch.Size
    stride: tuple[int, ...]
    offset: int

    def of(self, grad: Tensor) -> Tensor:
        """The output's gradient from its base's ``grad`` (``[*lead, *base_shape]``), with the
        leading dimensions kept.

        Example:
            >>> import torch
            >>> from jacflow.autogram._rules import BaseView
            >>> base = torch.arange(6.0).reshape(2, 3)
            >>> out = base.t()
            >>> view = BaseView(base.shape, out.shape, out.stride(), 0)
            >>> torch.equal(view.of(torch.stack([base, 2 * base])), torch.stack([out, 2 * out]))
            True
        """
        lead = grad.shape[: grad.ndim - len(self.base_shape)]
        grad = grad.contiguous()
        strides = grad.stride()[: len(lead)]
        return grad.as_strided(
            (*lead, *self.size), (*strides, *self.stride), grad.storage_offset() + self.offset
        )


class OutputView(NamedTuple):
    """A recorded output that is a view: its position among the call's recorded outputs, the
    view, its own node and its base's at the forward, and, where the output may be read at
    its base instead (all of a contiguous tensor made inside the module for this view only),
    the base's edge and where the output lay in it at the forward, else ``None``."""

    position: int
    view: Tensor
    node: Any
    base_node: Any
    at_base: tuple[GradientEdge, BaseView] | None


def multi_grad_hook(hook: Callable[[Tensor], Tensor | None]) -> bool:
    """Whether ``hook`` is one of the tensor hooks of ``register_multi_grad_hook`` (torch's
    module trackers, ``FlopCounterMode``, FSDP, or a user's): they only observe, must not
    change the gradient, and raise when run outside a backward. Autograd runs them in the
    engine's backward (once per backward: once per row where the rows are pulled back one by
    one), so the step does not run them again on the captured gradients."""
    code = getattr(hook, "__code__", None)
    return (
        code is not None
        and code.co_filename == _GRAPH_FILE
        and code.co_name in ("inner_hook", "wrapped_fn")
    )


_GRAPH_FILE = torch.autograd.graph.__file__
# torch's own trackers of module calls (FlopCounterMode's, the memory and communication
# debuggers'): their global forward hooks observe the outputs and return nothing, and put
# multi-grad hooks on them
TRACKERS = ("torch.utils.module_tracker", "torch.distributed._tools", "torch.distributed.tensor")


def tracker_hook(hook: Callable[[Tensor], Tensor | None]) -> bool:
    """Whether ``hook`` is a multi-grad hook that one of torch's module trackers put on an
    output (its function is defined in one of :data:`TRACKERS`)."""
    if not multi_grad_hook(hook):
        return False
    code, closure = hook.__code__, getattr(hook, "__closure__", None) or ()
    names = dict(zip(code.co_freevars, closure, strict=False))
    fn = names["fn"].cell_contents if "fn" in names else None
    return str(getattr(fn, "__module__", "")).startswith(TRACKERS)


@dataclass
class Call:
    """One recorded forward call of a hooked module.

    ``grads[j]`` is filled by the engine with the gradient of every row with respect to the
    ``j``-th recorded output (shape ``[R, *sample_output_shape]``), or ``None`` when that output
    is not in the graph of the losses.

    Example:
        >>> import torch
        >>> from jacflow.autogram import Call
        >>> x = torch.tensor([[1., 2.]])
        >>> call = Call((x,), {}, [0], [torch.Size([2])], [None], [], [torch.ones(1, 2)])
        >>> call.input() * call.grad()
        tensor([[1., 2.]])
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output_positions: list[int]
    output_shapes: list[torch.Size]
    edges: list[Any]
    versions: list[tuple[Tensor, int]]
    grads: list[Tensor | None] = field(default_factory=list)
    # ``(device type, dtype)`` of the autocast the forward ran under, else ``None``
    autocast: tuple[str, torch.dtype] | None = None
    # the module's training mode during the forward (``None``: not recorded)
    training: bool | None = None
    # for the rules that replay the module (``Rule.replays``): its parameters with their
    # versions at the forward, and its submodules (``module.modules()``) with their modes
    weight_versions: list[tuple[Tensor, int]] = field(default_factory=list)
    modes: tuple[tuple[nn.Module, bool], ...] | None = None
    # the same at the call's start: the weights' versions, and copies of the module's buffers
    # (a replay reads the buffers the call read, not those the step finds)
    start_weights: list[tuple[Tensor, int]] = field(default_factory=list)
    buffers: dict[str, Tensor] | None = None
    # a module that calls itself: whether this call runs inside another of its calls, and the
    # calls made inside this one, in order (``None``: one without a recorded call)
    nested: bool = False
    children: list[Call | None] = field(default_factory=list)
    parent: Call | None = None
    # which recorded outputs the losses reach (set with ``grads``)
    reached: list[bool] = field(default_factory=list)
    # the unit's parameters (trainable when it was hooked) that were frozen during this call
    # (``requires_grad_(False)`` around it): the call gives them no gradient; ``all_frozen``:
    # every one of them was (the call adds nothing to the Gramian: a GAN's critic under the
    # generator's loss)
    frozen: list[Tensor] = field(default_factory=list)
    all_frozen: bool = False
    # per sample: the positions merged with the batch on dimension 0 of a call of a module
    # that maps rows one by one (``Rule.maps_rows``), given its batch flattened with them
    # (``x.view(-1, d)``, batch first); 1: none
    merged: int = 1
    # per sample: the dimension that holds the batch in the input and output of a call of a
    # module that maps rows, when it is not dimension 0 (``[T, B, d]``, sequence first, as
    # ``nn.Transformer``'s layers by default); the rule is handed the input with it moved first
    batch_at: int = 0
    # each recorded output's dict of gradient hooks, opened by the engine with a no-op hook of
    # its own (``no_hook``: a user's hooks registered later land in it), else ``None``
    output_hooks: list[dict[Any, Any]] | None = None
    # the recorded outputs that are views (held until the step): an in-place op on one under
    # autograd after the forward gives the base a new node, through which the gradient
    # bypasses the recorded one
    output_views: list[OutputView] = field(default_factory=list)
    # recorded outputs whose gradient is read at their base (index -> where the output lies in
    # it): a Linear's from the forward on, an attention's after an in-place op on it (see
    # ``OutputView.at_base``)
    base_views: dict[int, BaseView] = field(default_factory=dict)
    # whether the outputs read at their base after an in-place op have a user's gradient hooks
    above_hooks: dict[int, bool] = field(default_factory=dict)
    # for the rules that do not replay: what the forward read as the module's parameters
    # (``torch.func.functional_call`` puts other tensors in their place; see
    # ``_hooks.parameters_read``)
    params_read: tuple[Tensor | weakref.ref[Tensor], ...] | None = None
    # for the rules that replay: the recorded outputs with their versions at the forward (a
    # re-run is checked against them)
    outputs: list[tuple[Tensor, int]] = field(default_factory=list)
    # for the rules that replay: autograd's sequence numbers of the nodes the forward created
    # (from, to), where known
    span: tuple[int, int] | None = None
    # a forward hook that is not a recorder's ran before the recording one (it may have
    # replaced the output the engine reads)
    preceded: bool = False
    # the module's attributes that its rule reads at the step (``Rule.settings``), at the
    # forward
    settings: Hashable = None

    def user_hooks(self) -> list[list[Callable[[Tensor], Tensor | None]]]:
        """The gradient hooks on each recorded output other than the engine's own (none when
        they were not watched)."""
        if self.output_hooks is None:
            return [[] for _ in self.edges]
        return [[h for h in hooks.values() if h is not no_hook] for hooks in self.output_hooks]

    def read_at_base(
        self, index: int, edge: GradientEdge, view: BaseView, output: Tensor | None = None
    ) -> None:
        """Read output ``index``'s gradient at its base's ``edge``: the user's hooks on the
        output (the recorded tensor ``output`` after an in-place op) run in the backward before
        it, and are not run again."""
        self.edges[index] = edge
        self.base_views[index] = view
        if self.output_hooks is not None:
            dicts = [self.output_hooks[index], getattr(output, "_backward_hooks", None) or {}]
            self.above_hooks[index] = any(h is not no_hook for d in dicts for h in d.values())
            self.output_hooks[index] = {}

    def hooks_above(self) -> list[bool]:
        """Whether each recorded output read at its base after an in-place op has gradient
        hooks of a user's, which run in the backward between the losses and its edge."""
        if not self.above_hooks:
            return [False] * len(self.edges)
        return [self.above_hooks.get(i, False) for i in range(len(self.edges))]

    def trained(self, module: nn.Module) -> bool:
        """Whether the forward ran in training mode (the module's mode now, if unrecorded).

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from jacflow.autogram import Call
            >>> call = Call((), {}, [0], [torch.Size([1])], [None], [], training=False)
            >>> call.trained(nn.Dropout().train())
            False
        """
        return module.training if self.training is None else self.training

    def check_weights_unchanged(self, module: nn.Module) -> None:
        """Raise if, since this call, a parameter of ``module`` was modified in place or
        replaced, or a submodule added, removed or replaced: a rule that replays the module
        (:meth:`Rule.replays`) would differentiate another function than the forward's. Check
        the module's last call (a module may change its own weights during the forward, e.g.
        an embedding's ``max_norm``). Edits through ``.data`` bypass the version counters and
        cannot be seen.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from jacflow.autogram import Call
            >>> layer = nn.Linear(2, 1)
            >>> call = Call((), {}, [0], [torch.Size([1])], [None], [])
            >>> call.weight_versions = [(p, p._version) for p in layer.parameters()]
            >>> call.modes = ((layer, True),)
            >>> call.check_weights_unchanged(layer)  # unchanged: nothing happens
            >>> with torch.no_grad():
            ...     _ = layer.weight.mul_(2)
            >>> call.check_weights_unchanged(layer)
            Traceback (most recent call last):
            ...
            RuntimeError: A parameter of Linear was modified in place or replaced between ...
        """
        if self.modes is None:
            raise RuntimeError(
                "The engine records the weights and submodules of a call only for the rules that "
                "replay their module: return True from the rule's `replays()`."
            )
        if not _same_weights([(p, p._version) for p in module.parameters()], self.weight_versions):
            raise RuntimeError(
                f"A parameter of {type(module).__name__} was modified in place or replaced "
                "between the forward and the Jacobian-descent step; the Gramian needs the weights "
                "the forward used. Run the step before changing them."
            )
        subs = list(module.modules())
        if len(subs) != len(self.modes) or any(s is not r for s, (r, _) in zip(subs, self.modes)):
            raise RuntimeError(
                f"{type(module).__name__} gained, lost or replaced submodules between the "
                "forward and the Jacobian-descent step; the engine replays it as the forward ran "
                "it. Run the step before changing the module."
            )

    def found_buffers(self, module: nn.Module) -> dict[str, Tensor]:
        """The module's buffers as this call found them (copies recorded at its start, for the
        rules that replay the module), else as they are now.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from jacflow.autogram import Call
            >>> norm = nn.BatchNorm1d(2)
            >>> call = Call((), {}, [0], [torch.Size([1])], [None], [])
            >>> call.found_buffers(norm)["running_var"]
            tensor([1., 1.])
        """
        return dict(module.named_buffers()) if self.buffers is None else self.buffers

    @contextlib.contextmanager
    def forward_modes(self, module: nn.Module) -> Iterator[None]:
        """The module's submodules (itself included) in the training modes of this call's
        forward (recorded for the rules that replay it), their modes now restored after.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from jacflow.autogram import Call
            >>> block = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
            >>> call = Call((), {}, [0], [torch.Size([1])], [None], [])
            >>> call.modes = tuple((sub, False) for sub in block.modules())
            >>> with call.forward_modes(block):
            ...     print(block[1].training)
            False
            >>> block[1].training
            True
        """
        recorded = self.modes or ()
        now = [(sub, sub.training) for sub, _ in recorded]
        for sub, mode in recorded:
            sub.training = mode
        try:
            yield
        finally:
            for sub, mode in now:
                sub.training = mode

    def grad(self, j: int = 0) -> Tensor:
        """Gradient of the rows w.r.t. output ``j``, zeros when the output was unused."""
        grad = self.grads[j]
        if grad is None:
            raise RuntimeError("internal: `grad` called on a call whose output was not reached")
        return grad

    def first_argument(self) -> Any:
        """The first positional argument, else the first keyword one (``None``: none)."""
        return self.args[0] if self.args else next(iter(self.kwargs.values()), None)

    def input(self) -> Tensor:
        """The first positional argument (the layer input of Linear, Conv, norms, ...)."""
        value = self.first_argument()
        if not isinstance(value, Tensor):
            raise TypeError(f"expected the module's input to be a Tensor, received {type(value)}")
        return value


class Contribution(ABC):
    """What one hooked module contributes, once its calls and rows are known.

    The example holds the per-row gradients ``[R, d]`` of one parameter explicitly.

    Example:
        >>> import torch
        >>> from jacflow.autogram import Contribution
        >>> class Explicit(Contribution):
        ...     def __init__(self, grads):
        ...         self.grads = grads
        ...     def gramian(self, names):
        ...         return self.grads @ self.grads.T if "weight" in names else None
        ...     def per_row_grads(self, name):
        ...         return self.grads
        ...     def weighted_grads(self, weights):
        ...         return {"weight": weights @ self.grads}
        >>> c = Explicit(torch.tensor([[1., 0.], [1., 1.]]))
        >>> c.gramian({"weight"})
        tensor([[1., 1.],
                [1., 2.]])
        >>> c.weighted_grads(torch.tensor([1., -1.]))
        {'weight': tensor([ 0., -1.])}
    """

    @abstractmethod
    def gramian(self, names: set[str]) -> Tensor | None:
        """``[R, R]`` Gramian contribution of the parameters in ``names`` (None if empty)."""

    @abstractmethod
    def per_row_grads(self, name: str) -> Tensor:
        """Per-row gradients ``[R, *param.shape]`` of one parameter (used for shared ones)."""

    @abstractmethod
    def weighted_grads(self, weights: Tensor) -> dict[str, Tensor]:
        """``sum_r weights[r] g_r`` for every covered parameter (the book-keeping update), in any
        shape with the parameter's number of elements (the engine reshapes it)."""

    def weighted_grads_into(
        self, weights: Tensor, buffer_for: Callable[[str, torch.dtype], Tensor | None]
    ) -> dict[str, Tensor]:
        """:meth:`weighted_grads`, possibly written into ``buffer_for(name, dtype)`` (memory the
        engine reuses across steps, with the parameter's shape, or ``None``, which it is when
        the parameter's dtype is not ``dtype``; ask only when about to write into it) and
        returned as such. The default ignores the buffers.

        Example:
            >>> import torch
            >>> from jacflow.autogram import Contribution
            >>> class Into(Contribution):
            ...     def gramian(self, names):
            ...         return None
            ...     def per_row_grads(self, name):
            ...         return torch.eye(2)
            ...     def weighted_grads(self, weights):
            ...         return {"weight": weights @ torch.eye(2)}
            ...     def weighted_grads_into(self, weights, buffer_for):
            ...         out = buffer_for("weight", weights.dtype)
            ...         if out is None:
            ...             return self.weighted_grads(weights)
            ...         return {"weight": torch.mv(torch.eye(2), weights, out=out)}
            >>> memory = torch.empty(2)
            >>> grads = Into().weighted_grads_into(torch.tensor([1.0, 2.0]), lambda n, d: memory)
            >>> grads["weight"] is memory, memory
            (True, tensor([1., 2.]))
        """
        return self.weighted_grads(weights)


_REPLAYING = [0]  # the rules' re-runs of modules under way (the hooks record none of them)


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """A rule's re-run of a module: every engine's hooks ignore the calls it makes (they are
    not forward calls of the model, and would be recorded as such).

    Example:
        >>> from jacflow.autogram._rules import is_replaying, replaying
        >>> with replaying():
        ...     print(is_replaying())
        True
        >>> is_replaying()
        False
    """
    _REPLAYING[0] += 1
    try:
        yield
    finally:
        _REPLAYING[0] -= 1


def is_replaying() -> bool:
    return _REPLAYING[0] > 0


def _same_weights(a: list[tuple[Tensor, int]], b: list[tuple[Tensor, int]]) -> bool:
    """Whether two records of weights hold the same tensors at the same versions."""
    return len(a) == len(b) and all(t is u and v == w for (t, v), (u, w) in zip(a, b))


def check_replayed_calls(module: nn.Module, calls: list[Call]) -> None:
    """Raise if ``module``'s weights were modified in place or replaced outside its own
    forward since the first of ``calls`` (its recorded calls in order, from the first that the
    losses reach): between two calls, or after the last. A rule that replays the module reads
    the weights as they are now; changes the module makes in its own forward (an embedding's
    ``max_norm``) are part of its function.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from jacflow.autogram import Call
        >>> from jacflow.autogram._rules import check_replayed_calls
        >>> layer = nn.Linear(2, 1)
        >>> def call() -> Call:  # (as the engine records one for a replaying rule)
        ...     c = Call((), {}, [0], [torch.Size([1])], [None], [])
        ...     c.start_weights = c.weight_versions = [(p, p._version) for p in layer.parameters()]
        ...     c.modes, c.buffers = ((layer, True),), {}
        ...     return c
        >>> first = call()
        >>> with torch.no_grad():
        ...     _ = layer.weight.mul_(2)  # between the two calls
        >>> check_replayed_calls(layer, [first, call()])
        Traceback (most recent call last):
        ...
        RuntimeError: A parameter of Linear was modified in place or replaced between two of ...
    """
    for before, after in itertools.pairwise(calls):
        if after.buffers is None:  # (no start recorded)
            continue
        if not _same_weights(before.weight_versions, after.start_weights):
            raise RuntimeError(
                f"A parameter of {type(module).__name__} was modified in place or replaced "
                "between two of its calls in the forward; the engine replays every call with "
                "the weights as they are at the step. Change the weights before the forward or "
                "after the step."
            )
    calls[-1].check_weights_unchanged(module)


class Rule(ABC):
    """Builds a :class:`Contribution` from the calls of one module.

    See :func:`register_rule` for a complete rule. A rule covers only the module's own
    parameters unless :meth:`covers_children` says otherwise.

    Example:
        >>> from jacflow.autogram import Rule
        >>> class OwnParameters(Rule):
        ...     def prepare(self, module, params, calls, rows):
        ...         raise NotImplementedError
        >>> OwnParameters().covers_children()
        False
    """

    @abstractmethod
    def prepare(
        self, module: nn.Module, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> Contribution:
        """``params``: the trainable parameters this rule covers, by name within ``module``."""

    def covers_children(self) -> bool:
        """Whether the rule covers the parameters of the module's children too."""
        return False

    def delegates(self) -> tuple[str, ...]:
        """The methods that the registered type's ``forward`` calls and the closed form assumes
        (a convolution's ``_conv_forward``): a subclass, or an instance, with one of its own
        gets no closed form, as one with its own ``forward`` (:func:`find_rule`).

        Example:
            >>> from jacflow.autogram import Rule
            >>> class ForwardOnly(Rule):
            ...     def prepare(self, module, params, calls, rows):
            ...         raise NotImplementedError
            >>> ForwardOnly().delegates()
            ()
        """
        return ()

    def parameter_names(self, module: nn.Module) -> frozenset[str] | None:
        """The names of ``module``'s own parameters that the closed form reads (``None``: any,
        the rule checking them itself). A module with a trainable parameter of its own in none
        of these slots (one a forward pre-hook computes the weight from, as in a hand-made
        pruning mask or AWD-LSTM's WeightDrop) gets the generic rule: the closed form would
        leave that parameter out (:func:`unread_parameters`).

        Example:
            >>> from torch import nn
            >>> from jacflow.autogram import Rule
            >>> class ChecksItself(Rule):
            ...     def prepare(self, module, params, calls, rows):
            ...         raise NotImplementedError
            >>> ChecksItself().parameter_names(nn.Linear(2, 2)) is None
            True
        """
        return None

    def replays(self) -> bool:
        """Whether the rule recomputes part of the module's forward from the recorded inputs
        and the module's weights or buffers (attention, recurrent layers, BatchNorm, the generic
        rule). The engine then records, at each call, the parameters' versions (checked with
        :func:`check_replayed_calls`), copies of the buffers at its start
        (:meth:`Call.found_buffers`) and the training modes of the module and its submodules
        (:meth:`Call.forward_modes`); other rules read only the recorded inputs and output
        gradients and skip that work.

        Example:
            >>> from jacflow.autogram import Rule
            >>> class FromInputsOnly(Rule):
            ...     def prepare(self, module, params, calls, rows):
            ...         raise NotImplementedError
            >>> FromInputsOnly().replays()
            False
        """
        return False

    def settings(self, module: nn.Module) -> Hashable:
        """The module's attributes that the rule reads at the step besides its parameters and
        the recorded tensors (a convolution's stride, padding, ...; an attention's number of
        heads), taken at each forward call: a step whose module has others (set between the
        forward and the step) refuses the call, whose graph they did not make (default:
        ``None``, none; the generic rule instead checks its re-run against the forward's
        outputs and gradients).

        Example:
            >>> from torch import nn
            >>> from jacflow.autogram import Rule
            >>> class Scaled(Rule):
            ...     def prepare(self, module, params, calls, rows):
            ...         raise NotImplementedError
            ...     def settings(self, module):
            ...         return module.scale
            >>> module = nn.Identity()
            >>> module.scale = 2.0
            >>> Scaled().settings(module), Rule.settings(Scaled(), module)
            (2.0, None)
        """
        return None

    def validate(self, module: nn.Module, call: Call, rows: Rows) -> None:
        """Refuse a reached call that the rule cannot handle, with its own message, before
        the engine's checks of the outputs' batch size (default: accept).

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from jacflow.autogram import Call, Rows, Rule
            >>> class TensorsOnly(Rule):
            ...     def prepare(self, module, params, calls, rows):
            ...         raise NotImplementedError
            ...     def validate(self, module, call, rows):
            ...         if not isinstance(call.args[0], torch.Tensor):
            ...             raise ValueError("expected a tensor input")
            >>> call = Call(([1.0],), {}, [0], [torch.Size([1])], [None], [])
            >>> TensorsOnly().validate(nn.Identity(), call, Rows(1, 1, None, per_task=False))
            Traceback (most recent call last):
            ...
            ValueError: expected a tensor input
        """
        return None  # (every call is accepted by default)

    def output_batch_dim(self, module: nn.Module, call: Call, position: int) -> int | None:
        """The batch dimension of the output leaf ``position`` of ``call`` (per-sample mode);
        the engine hands the rule that output's gradients with it taken out (``[R, ...]``).
        ``None``: the output has none (a packed sequence's data); the engine then hands its
        gradient as captured (``[*output shape]`` with one row per sample, ``[k, *output
        shape]`` with ``k``), or ``None`` when the losses do not reach it.

        Example:
            >>> from torch import nn
            >>> from jacflow.autogram import Rule
            >>> class SequenceFirst(Rule):
            ...     def prepare(self, module, params, calls, rows):
            ...         raise NotImplementedError
            ...     def output_batch_dim(self, module, call, position):
            ...         return 1  # outputs [T, B, ...]
            >>> SequenceFirst().output_batch_dim(nn.Identity(), None, 0)
            1
        """
        return 0

    def maps_rows(self, module: nn.Module) -> bool:
        """Whether ``module`` maps the rows of its input along dimension 0 one by one, each
        row of its outputs from the same row of its input (a Linear, a LayerNorm over the last
        dimensions). Per sample, with one loss per sample, a call on the batch merged with
        other dimensions (``x.view(-1, d)``, ``[B k, d]``, as language models' heads and OPT's
        layers are called) is then read as one on ``[B, k, d]``, batch first; the engine's
        check of the first step of each pattern of calls refuses another order (``[k B, d]``,
        the samples interleaved). A call on a sequence-first input (``[T, B, d]``, the batch
        on the only leading dimension of its size, ``T != B``) is read with the batch moved
        first, which that check confirms too. Default ``False``: such calls are refused.

        Example:
            >>> from torch import nn
            >>> from jacflow.autogram import Rule
            >>> class Plain(Rule):
            ...     def prepare(self, module, params, calls, rows):
            ...         raise NotImplementedError
            >>> Plain().maps_rows(nn.Linear(2, 2))
            False
        """
        return False

    def output_samples(self, module: nn.Module, call: Call, position: int) -> Tensor | None:
        """For an output leaf without a batch dimension (:meth:`output_batch_dim` ``None``):
        the sample of each of its rows along dimension 0 where the rule knows it (a packed
        sequence's data), with which the per-sample engine checks that each loss reads that
        output at its own sample only; ``None`` (the default): not known, not checked.

        Example:
            >>> from torch import nn
            >>> from jacflow.autogram import Rule
            >>> class Plain(Rule):
            ...     def prepare(self, module, params, calls, rows):
            ...         raise NotImplementedError
            >>> print(Plain().output_samples(nn.Identity(), None, 0))
            None
        """
        return None


_RULES: dict[type[nn.Module], Rule] = {}
# rules of types of other libraries, by their qualified names (``module.QualName``): found
# without importing those libraries
_NAMED_RULES: dict[str, Rule] = {}
# the methods some rule's module type must keep (``forward`` and the rules' delegates)
_KEPT_METHODS: dict[str, None] = {"forward": None}
# each registered type's methods that its rule relies on, as they were at its registration
# (a patch of the type itself, `nn.Linear.forward = ...`, then reads as another computation)
_ORIGINAL_METHODS: dict[type, dict[str, object]] = {}
WEIGHT_AND_BIAS = frozenset({"weight", "bias"})


def unbatched_refusal(module: nn.Module, x: Tensor) -> ValueError:
    """The refusal of a per-sample step (``batch_dim=0``) whose call of ``module`` got an
    input ``x`` without a batch dimension.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from jacflow.autogram._rules import unbatched_refusal
        >>> print(unbatched_refusal(nn.GRU(3, 2), torch.ones(4, 3)))  # doctest: +ELLIPSIS
        GRU received an unbatched input of shape (4, 3): the per-sample engine ... batch_dim=None).
    """
    return ValueError(
        f"{type(module).__name__} received an unbatched input of shape {tuple(x.shape)}: the "
        "per-sample engine (batch_dim set) needs the batch on dimension 0 of each hooked call's "
        "input. Either the input lacks that dimension (a single sample: x.unsqueeze(0); a loop "
        "calling the module on one sample at a time: call it once on the batch), or it is not "
        "per sample: a tensor shared by all samples (a learned token: expand it to the batch "
        "first, e.g. token.expand(B, -1)) or a batch statistic (x.mean(0), which mixes the "
        "samples: use batch_dim=None)."
    )


def attribute_settings(module: nn.Module, names: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    """``(name, value)`` for each attribute of ``module`` in ``names`` that it has, lists as
    tuples (compared by value, and hashable): the :meth:`Rule.settings` of a rule that reads
    those attributes at the step, which the engine refuses naming the changed ones.

    Example:
        >>> from torch import nn
        >>> from jacflow.autogram._rules import attribute_settings
        >>> attribute_settings(nn.GroupNorm(2, 4), ("num_groups", "eps", "normalized_shape"))
        (('num_groups', 2), ('eps', 1e-05))
    """
    pairs = ((name, getattr(module, name)) for name in names if hasattr(module, name))
    return tuple((name, tuple(v) if isinstance(v, list) else v) for name, v in pairs)


def register_rule(module_type: type[nn.Module], rule: Rule) -> None:
    """Use ``rule`` for modules of ``module_type`` (and subclasses that keep its ``forward``).

    The example adds an elementwise scale ``y = x * w``: row ``r``'s gradient of ``w`` is the
    sum of ``x * dL_r/dy`` over the sample, and the Gramian matches ``J J^T`` computed with
    ``torch.func.jacrev``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from jacflow.autogram import Contribution, Engine, Rule, register_rule
        >>> class Scale(nn.Module):
        ...     def __init__(self, d):
        ...         super().__init__()
        ...         self.weight = nn.Parameter(torch.ones(d))
        ...     def forward(self, x):
        ...         return x * self.weight
        >>> class ScaleContribution(Contribution):
        ...     def __init__(self, grads):  # [R, d]
        ...         self.grads = grads
        ...     def gramian(self, names):
        ...         return self.grads @ self.grads.T if "weight" in names else None
        ...     def per_row_grads(self, name):
        ...         return self.grads
        ...     def weighted_grads(self, weights):
        ...         return {"weight": weights.to(self.grads.dtype) @ self.grads}
        >>> class ScaleRule(Rule):
        ...     def prepare(self, module, params, calls, rows):
        ...         grads = 0
        ...         for call in calls:
        ...             product = rows.gather(rows.samples(call.input())) * call.grad()
        ...             d = product.shape[-1]
        ...             grads = grads + product.reshape(rows.num_rows, -1, d).sum(1)
        ...         return ScaleContribution(grads)
        >>> register_rule(Scale, ScaleRule())
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Linear(4, 1))
        >>> x = torch.randn(5, 3)
        >>> def losses_of(p):
        ...     return torch.func.functional_call(model, p, (x,)).squeeze(1) ** 2
        >>> jac = torch.func.jacrev(losses_of)(dict(model.named_parameters()))
        >>> J = torch.cat([j.reshape(5, -1) for j in jac.values()], dim=1)
        >>> G = Engine(model, batch_dim=0).compute_gramian(model(x).squeeze(1) ** 2)
        >>> torch.allclose(G, J @ J.T)
        True
    """
    _RULES[module_type] = rule
    _KEPT_METHODS.update(dict.fromkeys(rule.delegates()))
    _ORIGINAL_METHODS[module_type] = _methods_of(module_type, ("forward", *rule.delegates()))


def register_named_rule(qualified_name: str, rule: Rule) -> None:
    """Use ``rule`` for the module type of ``qualified_name`` (``"package.module.QualName"``),
    a type of a library that jacflow does not import, as :func:`register_rule` does.

    Example:
        >>> from jacflow.autogram._rules import _NAMED_RULES
        >>> "transformers.pytorch_utils.Conv1D" in _NAMED_RULES
        True
    """
    _NAMED_RULES[qualified_name] = rule
    _KEPT_METHODS.update(dict.fromkeys(rule.delegates()))


def kept_methods(module: nn.Module) -> tuple[tuple[object, bool], ...]:
    """Per method that a rule relies on (``forward``, :meth:`Rule.delegates`): ``module``'s
    type's, and whether one is set on the instance (which the engine watches: patching or
    setting one changes its rule).

    Example:
        >>> from torch import nn
        >>> from jacflow.autogram._rules import kept_methods
        >>> conv = nn.Conv2d(1, 1, 3)
        >>> before = kept_methods(conv)
        >>> conv._conv_forward = lambda x, w, b: x
        >>> [set_on for (_, set_on) in kept_methods(conv)] != [s for (_, s) in before]
        True
    """
    cls, own = type(module), module.__dict__
    return tuple([(getattr(cls, name, None), name in own) for name in _KEPT_METHODS])


def find_rule(module: nn.Module) -> Rule | None:
    """The registered rule of ``module``'s nearest registered base type, if its ``forward``
    and the methods that ``forward`` delegates to (:meth:`Rule.delegates`) are that base
    type's own (a subclass that overrides one, or one set on the instance, gets no closed
    form: the rule assumes the base type's computation).

    Example:
        >>> from torch import nn
        >>> from jacflow.autogram._rules import find_rule
        >>> class SquaredWeight(nn.Conv2d):
        ...     def _conv_forward(self, input, weight, bias):
        ...         return super()._conv_forward(input, weight**2, bias)
        >>> find_rule(nn.Conv2d(1, 1, 3)) is None, find_rule(SquaredWeight(1, 1, 3)) is None
        (False, True)
    """
    for klass in type(module).__mro__:
        rule = _RULES.get(klass) or _NAMED_RULES.get(f"{klass.__module__}.{klass.__qualname__}")
        if rule is not None:
            names = ("forward", *rule.delegates())
            return rule if _keeps_methods(module, klass, names) else None
    return None


def _keeps_methods(module: nn.Module, klass: type, names: tuple[str, ...]) -> bool:
    """Whether ``module`` runs ``klass``'s own methods ``names``: none set on the instance,
    none overridden by a subclass, none patched on ``klass`` since its rule was registered
    (a type registered by name: since its first lookup)."""
    originals = _ORIGINAL_METHODS.setdefault(klass, _methods_of(klass, names))
    return not any(name in module.__dict__ for name in names) and all(
        getattr(type(module), name, None) is originals.get(name, getattr(klass, name, None))
        for name in names
    )


def _methods_of(klass: type, names: tuple[str, ...]) -> dict[str, object]:
    """``klass``'s attributes ``names`` (``None`` where it has none)."""
    return {name: getattr(klass, name, None) for name in names}


def unread_parameters(module: nn.Module, rule: Rule) -> list[str]:
    """The names of ``module``'s own trainable parameters that ``rule`` does not read (none in
    the slots of :meth:`Rule.parameter_names`; one registered under a second name is read).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from jacflow.autogram._linear import LinearRule
        >>> from jacflow.autogram._rules import unread_parameters
        >>> layer = nn.Linear(2, 2)
        >>> layer.register_parameter("weight_orig", nn.Parameter(torch.ones(2, 2)))
        >>> unread_parameters(layer, LinearRule())
        ['weight_orig']
    """
    names = rule.parameter_names(module)
    if names is None:
        return []
    own = module._parameters
    read = {id(own[name]) for name in names if own.get(name) is not None}
    return [n for n, p in own.items() if p is not None and p.requires_grad and id(p) not in read]


@contextlib.contextmanager
def quiet_vmap_fallback() -> Iterator[None]:
    """Silence vmap's warning that an op without a batching rule runs in a loop.

    Inside the engine that loop is only slower, and accepted; the warning (which torch gives
    for some ops, e.g. CPU flash attention under bfloat16 autocast, even with its fallback
    warnings switched off) would point the user at code that is not theirs.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*performance drop because we have not")
        yield


# The Cholesky blocks of kernel_gram pay when the multiply-adds they save (about half of
# R T^2 p) exceed their fixed costs: the factorisation (T^3 / 3 flops, at a lower rate than a
# product) and some 10-36 smaller products. Measured (one-off, 1 thread, float32 and float64,
# T = 128-1024, p = 64-4096, R = 2-10, interleaved with the direct route): they pay from
# R T p >= 600_000 + T^2 (0.83-0.96x the time there) and lose up to 2.7x below it (T = 128,
# p = 128, R = 4; T = 1024, p <= 256, R = 4 and 10 with p = 64: 1.2-1.9x, the factorisation
# dominating).
_BLOCKS_MIN_WORK = 600_000


def blocks_pay(r: int, t: int, p: int) -> bool:
    """Whether :func:`kernel_gram` takes the Cholesky blocks for ``rows`` ``[r, t, p]`` (CPU).

    Example:
        >>> from jacflow.autogram._rules import blocks_pay
        >>> blocks_pay(6, 256, 1024), blocks_pay(4, 128, 128)
        (True, False)
    """
    return r * t * p >= _BLOCKS_MIN_WORK + t * t


def kernel_gram(
    kernel: Tensor, rows: Tensor, block: int = 32, blocks: bool | None = None
) -> Tensor:
    """``G[k, l] = <K rows[k], rows[l]>`` for a PSD kernel ``K`` ``[T, T]`` and ``rows``
    ``[R, T, p]``: the per-task ghost Gramian.

    The products ``K rows[k]`` cost ``R T^2 p``. ``K = L L^T`` (Cholesky, backward stable)
    gives ``G = Y Y^T`` with ``Y[k] = L^T rows[k]``, whose products only need the lower triangle
    of ``L``: by ``q`` blocks of rows (at most 8, at least ``block`` rows each),
    ``(q + 1) / 2q`` of the multiply-adds (one-off: 17% faster at ``T = 256``, ``p = 1024``,
    ``R = 6``, float32, 1 thread). ``blocks``: whether to take them (``None``: on the CPU, from
    ``T = 4 block`` when :func:`blocks_pay`; off the CPU the factorisation, its check and the
    blocks' launches cost more than the multiply-adds they save). A kernel whose factorisation
    fails (numerically singular) takes the direct products.

    Example:
        >>> import torch
        >>> from jacflow.autogram._rules import kernel_gram
        >>> x = torch.randn(8, 10, dtype=torch.float64)
        >>> rows = torch.randn(3, 8, 2, dtype=torch.float64)
        >>> k = x @ x.T + 1
        >>> direct = torch.einsum("st,ktp,lsp->kl", k, rows, rows)
        >>> torch.allclose(kernel_gram(k, rows, block=2, blocks=True), direct)
        True
    """
    r, t, p = rows.shape
    if blocks is None:
        blocks = kernel.device.type == "cpu" and t >= 4 * block and blocks_pay(r, t, p)
    factor = None
    if blocks and t >= block:
        factor, info = cholesky_ex(kernel)
        if bool(info.any()):
            factor = None
    if factor is None:
        mixed = torch.bmm(kernel.expand(r, -1, -1), rows)
        return mixed.reshape(r, -1) @ rows.reshape(r, -1).T
    size = -(-t // min(8, t // block))
    edges = [*range(0, t, size), t]
    total: Tensor | None = None
    for i, (a, b) in enumerate(itertools.pairwise(edges)):
        # rows a:b of L^T rows[k]: the blocks of L's columns a:b from its diagonal down
        part = torch.matmul(factor[a:b, a:b].mT, rows[:, a:b])
        for c, d in itertools.pairwise(edges[i + 1 :]):
            part.baddbmm_(factor[c:d, a:b].mT.expand(r, -1, -1), rows[:, c:d])
        flat = part.reshape(r, -1)
        term = flat @ flat.T
        total = term if total is None else total + term
    assert total is not None
    return total


def weighted_sum(weights: Tensor, per_row: Tensor, shape: tuple[int, ...] | None = None) -> Tensor:
    """``sum_r weights[r] * per_row[r]`` (one matrix-vector product), with the shape of a row
    or the given ``shape`` (same number of elements)."""
    flat = per_row.reshape(per_row.shape[0], -1)
    if weights.dtype != per_row.dtype:
        weights = weights.to(per_row.dtype)
    return (weights @ flat).reshape(per_row.shape[1:] if shape is None else shape)


def stack_grads(grads: dict[str, Tensor]) -> Tensor:
    """Concatenate per-row gradients ``{name: [R, ...]}`` into ``[R, P]``."""
    return torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], dim=1)


class MaterializedContribution(Contribution):
    """A contribution given by explicit per-row gradients ``{name: [R, *shape]}``."""

    def __init__(self, grads: dict[str, Tensor]) -> None:
        # (a sparse table's rows, as an EmbeddingBag(sparse=True)'s re-run gives: dense)
        self.grads = {n: g.to_dense() if g.is_sparse else g for n, g in grads.items()}

    def gramian(self, names: set[str]) -> Tensor | None:
        kept = {n: g for n, g in self.grads.items() if n in names}
        if not kept:
            return None
        flat = stack_grads(kept)  # (float16's range: in float32, as the closed forms)
        return row_gramian(flat.float() if flat.dtype == torch.float16 else flat)

    def per_row_grads(self, name: str) -> Tensor:
        return self.grads[name]

    def weighted_grads(self, weights: Tensor) -> dict[str, Tensor]:
        out = {}
        for name, grad in self.grads.items():
            out[name] = weighted_sum(weights, grad)
        return out


def joined(tensors: list[Tensor], dim: int) -> Tensor:
    """The calls' tensors of one layer joined along ``dim`` (their positions): one call's as it
    is, with no copy (a concatenation of one tensor copies it: per task, the output gradients
    of every task, e.g. 52 MB and 18 ms for an LSTM's ``[15, 640, 1356]``).

    Example:
        >>> import torch
        >>> from jacflow.autogram._rules import joined
        >>> t = torch.ones(2, 3)
        >>> joined([t], 1) is t, joined([t, t], 1).shape
        (True, torch.Size([2, 6]))
    """
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def worth_keeping(per_row: int, *held: Tensor) -> bool:
    """Whether per-row gradients of ``per_row`` elements, once formed for the Gramian, should
    be kept until the update (which is then ``weights @ per_row``): only when they are no larger
    than the tensors the contribution holds anyway, so that keeping them at most doubles its
    memory."""
    return per_row <= sum(t.numel() for t in held)


def kept_weighted_grads(
    weights: Tensor,
    kept: Tensor,
    weight_name: str,
    weight_shape: torch.Size,
    bias_name: str | None,
    bias_rows: Callable[[], Tensor],
) -> dict[str, Tensor]:
    """The update from per-row gradients kept since the Gramian (see :func:`worth_keeping`):
    ``weights @ kept`` for the weight, ``weights @ bias_rows()`` for the bias if any."""
    out = {weight_name: weighted_sum(weights, kept, weight_shape)}
    if bias_name is not None:
        out[bias_name] = weighted_sum(weights, bias_rows())
    return out


def add_grads(total: dict[str, Tensor], new: dict[str, Tensor]) -> dict[str, Tensor]:
    """Sum two ``{name: tensor}`` dictionaries key by key."""
    for name, value in new.items():
        total[name] = total[name] + value if name in total else value
    return total
