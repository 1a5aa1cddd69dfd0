"""Module hooks: which modules to hook, and the record of their forward calls.

A forward hook stores each grad-enabled call's inputs and the autograd *edges* of its outputs
(the node that produced each output, taken at forward time, so later in-place operations on the
output do not move it). Nothing is added to the graph, so several engines can hook one model and
un-hooked code paths are unaffected. Calls whose edges the losses do not reach (stray forwards,
forwards of other graphs) are ignored when the Gramian is computed.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from torch.nn.utils.parametrize import is_parametrized
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm
from torch.utils.hooks import RemovableHandle

from jacflow.autogram._fallback import FallbackRule, random_checkpoints, watch_checkpoints
from jacflow.autogram._flatten import leaves
from jacflow.autogram._precision import autocast_state
from jacflow.autogram._rules import (
    TRACKERS,
    BaseView,
    Call,
    OutputView,
    Rule,
    find_rule,
    is_replaying,
    no_hook,
    unread_parameters,
)

_FALLBACK = FallbackRule()


@dataclass(frozen=True)
class Unit:
    """A hooked module and the rule that computes its contribution."""

    name: str
    module: nn.Module
    rule: Rule

    def params(self) -> dict[str, Tensor]:
        """Trainable parameters covered, by name within the module (checked at every step)."""
        if self.rule.covers_children():
            named = self.module.named_parameters()
            return {n: p for n, p in named if p.requires_grad}
        # the module's own parameters, read directly (named_parameters walks a generator chain
        # per step); one registered under two names counts once, as in named_parameters
        own = {n: p for n, p in self.module._parameters.items() if p is not None}
        if len({id(p) for p in own.values()}) < len(own):
            own = dict(self.module.named_parameters(recurse=False))
        return {n: p for n, p in own.items() if p.requires_grad}


def _slot(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module that holds the parameter ``name`` of ``module`` (a dotted name, as
    ``named_parameters`` gives it) and its name there."""
    prefix, _, own = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), own


def find_units(modules: tuple[nn.Module, ...]) -> list[Unit]:
    """Hook points: a module with a closed-form rule (for its direct trainable parameters, or
    any of its trainable parameters if the rule covers the children), else a module with direct
    trainable parameters (fallback rule, covering its children too), else recurse into the
    children."""
    units: list[Unit] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        direct = [p for p in module.parameters(recurse=False) if p.requires_grad]
        # the entries of a ParameterList/ParameterDict child are read by this module's forward
        # (the container is never called): they count as its direct parameters
        held = [
            p
            for child in module.children()
            if isinstance(child, (nn.ParameterList, nn.ParameterDict))
            for p in child.parameters()
            if p.requires_grad
        ]
        direct += held
        # a parametrised tensor (torch.nn.utils.parametrize, or the hooks of weight_norm,
        # spectral_norm and prune) is computed from other parameters: no closed form sees them,
        # the generic rule (covering children) does
        parametrized = is_parametrized(module) or any(
            isinstance(hook, (WeightNorm, SpectralNorm, BasePruningMethod))
            for hook in module._forward_pre_hooks.values()
        )
        rule = None if parametrized or held else find_rule(module)
        if rule is not None and unread_parameters(module, rule):  # (e.g. a hand-made pruning
            rule = None  # hook's weight_orig: the closed form would leave it out)
        # a rule covering the children (attention: out_proj's parameters, used without calling
        # out_proj) applies as soon as any of them is trainable
        trainable = direct
        if rule is not None and rule.covers_children():
            trainable = [p for p in module.parameters() if p.requires_grad]
        if rule is not None and trainable:
            units.append(Unit(name, module, rule))
            if not rule.covers_children():  # (a child attached to it, e.g. an adapter)
                for child_name, child in module.named_children():
                    visit(f"{name}.{child_name}" if name else child_name, child)
        elif direct or parametrized:
            units.append(Unit(name, module, _FALLBACK))
        else:
            for child_name, child in module.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child)

    for i, module in enumerate(modules):
        visit(f"modules[{i}]" if len(modules) > 1 else type(module).__name__, module)
    # a module under a unit that covers its children (also given on its own, in any order)
    # is that unit's: a second unit would count its parameters twice
    covered = {
        id(sub)
        for unit in units
        if unit.rule.covers_children()
        for sub in unit.module.modules()
        if sub is not unit.module
    }
    units = [unit for unit in units if id(unit.module) not in covered]
    for unit in units:
        if isinstance(unit.module, NonDynamicallyQuantizableLinear):
            raise ValueError(
                f"{unit.name} is the out-projection of an nn.MultiheadAttention: the attention "
                "module uses its weight without calling it, so hooked on its own it would see "
                "none of its uses. Hook the attention module instead."
            )
    return units


def batch_statistics(module: nn.Module) -> bool:
    """Whether a BatchNorm normalises with the statistics of its batch (mixing the samples):
    in training mode, or without running statistics (``track_running_stats=False``).

    Example:
        >>> from torch import nn
        >>> from jacflow.autogram._hooks import batch_statistics
        >>> batch_statistics(nn.BatchNorm1d(3).eval())
        False
        >>> batch_statistics(nn.BatchNorm1d(3, track_running_stats=False).eval())
        True
    """
    return module.training or not running_statistics(module)


def running_statistics(module: nn.Module) -> bool:
    """Whether a BatchNorm holds running statistics, which it normalises with in eval mode.

    Example:
        >>> from torch import nn
        >>> from jacflow.autogram._hooks import running_statistics
        >>> running_statistics(nn.BatchNorm1d(3)), running_statistics(nn.BatchNorm1d(3).eval())
        (True, True)
        >>> running_statistics(nn.BatchNorm1d(3, track_running_stats=False))
        False
    """
    return getattr(module, "running_mean", None) is not None


def _from_fused_rnn(node: Any, depth: int = 3) -> bool:
    """Whether ``node`` or a node it reads first within ``depth`` steps (a layer's outputs pass
    through a transpose or a squeeze) is the backward of torch's fused recurrent kernel."""
    for _ in range(depth):
        if node is None:
            return False
        if node.name().startswith(("CudnnRnn", "MiopenRnn")):
            return True
        node = node.next_functions[0][0] if node.next_functions else None
    return False


@dataclass
class _Start:
    """A replayed module's call under way: its weights' versions, copies of its buffers and its
    submodules' modes at the start, whether it runs inside another call of the module, and the
    calls of the module made inside it (``None`` for one without a recorded call)."""

    weights: list[tuple[Tensor, int]]
    buffers: dict[str, Tensor]
    modes: tuple[tuple[nn.Module, bool], ...]
    nested: bool
    children: list[Call | None]
    sequence: int | None  # autograd's next sequence number (see next_sequence_nr)


# (a private function of torch's autograd: without it, calls have no span)
_SEQUENCE_NR: Callable[[], int] | None = getattr(torch._C._autograd, "_get_sequence_nr", None)


def next_sequence_nr() -> int | None:
    """The sequence number autograd gives the next node it creates (in this thread): the nodes
    of a call's forward have numbers from the one at its start to the one at its end."""
    return None if _SEQUENCE_NR is None else int(_SEQUENCE_NR())


# (the reason Dynamo gives for its graph break at the engine's hooks: with fullgraph=True, its
# error; it read "Tensor with grad_fn()", naming neither the Engine nor a way out)
_OUTSIDE_GRAPHS = (
    "jacflow.autogram.Engine: the Engine's forward hooks, which record the autograd nodes of "
    "each call of the modules given to it, run outside Dynamo's graphs, so "
    "torch.compile(..., fullgraph=True) cannot be used on code that calls those modules with "
    "the Engine attached. Compile without fullgraph=True (the hooks run between the compiled "
    "pieces), or compile with fullgraph=True only parts that call none of those modules."
)


def _run_outside_graphs() -> None:
    """Called by the engine's hooks while Dynamo traces them: disabled for torch.compile, so
    Dynamo breaks its graph there, with :data:`_OUTSIDE_GRAPHS` as the reason (an error with
    ``fullgraph=True``); the hook then runs eagerly."""


if "reason" in inspect.signature(torch.compiler.disable).parameters:  # (torch >= 2.8)
    _run_outside_graphs = torch.compiler.disable(_run_outside_graphs, reason=_OUTSIDE_GRAPHS)
else:  # pragma: no cover
    _run_outside_graphs = torch.compiler.disable(_run_outside_graphs)


def _hooks_of(tensor: Tensor) -> dict[Any, Any]:
    """The dict of ``tensor``'s gradient hooks, opened with a no-op one: hooks registered on it
    later land in that dict, which outlives the tensor (its node keeps it)."""
    tensor.register_hook(no_hook)
    return tensor._backward_hooks  # type: ignore[return-value]


def own_parameters(module: nn.Module) -> tuple[Tensor, ...]:
    """The module's own parameters (the tensors its forward reads as such)."""
    return tuple(p for p in module._parameters.values() if p is not None)


def parameters_read(module: nn.Module) -> tuple[Tensor | weakref.ref[Tensor], ...]:
    """What a forward call read as the module's parameters, to be compared with them at the
    step: a parameter itself (a weak reference would stop ``torch.utils.swap_tensors``, which
    ``module.to()`` may use), another tensor put in its place by
    ``torch.func.functional_call`` by a weak reference (the call must not keep it alive; a
    dead one is no parameter). Not by ``id``: a freed tensor's id can go to a new parameter."""
    return tuple(
        p if isinstance(p, nn.Parameter) else weakref.ref(p) for p in own_parameters(module)
    )


def same_parameters(read: Sequence[Tensor | weakref.ref[Tensor]], module: nn.Module) -> bool:
    """Whether ``read`` (:func:`parameters_read` of a call) are the module's parameters now."""
    own = own_parameters(module)
    return len(read) == len(own) and all(
        (r() if isinstance(r, weakref.ref) else r) is p for r, p in zip(read, own)
    )


def _base_read(
    module: nn.Module, position: int, view: Tensor, base: Tensor
) -> tuple[GradientEdge, BaseView] | None:
    """The base's edge and where ``view`` lies in it, when ``module``'s output ``position``
    can be read at its base, else ``None``: ``view`` is all of the contiguous ``base``, a
    tensor made inside the module for this view only (a Linear's product on ``[..., T, d]``
    inputs, reshaped; MultiheadAttention's output projection, viewed and transposed). An
    in-place op on the output (ReLU(inplace)) gives it or its base a new node, which the
    output's own misses."""
    if not (
        isinstance(module, nn.Linear)
        or (position == 0 and isinstance(module, nn.MultiheadAttention))
    ):
        return None
    node = base.grad_fn
    if node is None or view.numel() != base.numel() or not base.is_contiguous():
        return None
    offset = int(view.storage_offset() - base.storage_offset())
    return GradientEdge(node, base.output_nr), BaseView(
        base.shape, view.shape, view.stride(), offset
    )


def _enter(depth: list[int], module: nn.Module, args: Any) -> None:
    if not is_replaying():
        depth[0] += 1


def _leave(depth: list[int], module: nn.Module, args: Any, output: Any) -> None:
    if not is_replaying():
        depth[0] -= 1


def strides_like_channels_last(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a 4-d or 5-d tensor's strides read as channels-last to torch's
    ``Tensor.suggest_memory_format()`` (a mirror of ``is_channels_last_strides_2d/3d``): the
    layout whose GroupNorm backward queries the memory format, which vmap cannot run. A
    contiguous tensor may read so too (``[N, C, 1, 1]`` with the channel stride 1 after
    ``.to(memory_format=torch.channels_last)``); ambiguous strides read as contiguous.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from jacflow.autogram._hooks import strides_like_channels_last
        >>> conv = nn.Conv2d(3, 3, 1).to(memory_format=torch.channels_last)
        >>> y = conv(torch.randn(2, 3, 1, 1))
        >>> y.stride(), y.is_contiguous(), strides_like_channels_last(y.shape, y.stride())
        ((3, 1, 3, 3), True, True)
        >>> strides_like_channels_last((2, 3, 1, 1), (3, 1, 1, 1))
        False
    """
    if len(shape) not in (4, 5) or strides[1] == 0:
        return False
    low = 0
    for d in (1, *range(len(shape) - 1, 1, -1), 0):  # channels, spatial from last, batch
        if shape[d] == 0 or strides[d] < low:
            return False
        if d == 0 and low == strides[1]:  # (an ambiguous N111 reads as contiguous)
            return False
        low = strides[d] * (shape[d] if shape[d] > 1 else 1)
    return True


def _tracks(hook: Callable[..., Any]) -> bool:
    """Whether a global forward hook is a method of one of torch's module trackers."""
    owner = getattr(hook, "__self__", None)
    return owner is not None and type(owner).__module__.startswith(TRACKERS)


class Recorder:
    """Holds the hooks and the calls recorded since the last Gramian."""

    def __init__(self, idle: bool = False) -> None:
        self.idle = idle  # (a deep copy's: it records nothing, see __deepcopy__)
        self.calls: list[tuple[int, Call]] = []
        self.handles: list[RemovableHandle] = []
        # (name, autograd node) of each grad-enabled call of a module that mixes the samples:
        # refused where the losses read it (the nodes die with the next step's record)
        self.coupled: list[tuple[str, Any]] = []
        self.outside: tuple[str, str] | None = None  # (child, unit) of a call outside the unit
        self.fused_rnn = False  # a recurrent layer ran torch's fused kernel (cuDNN, MIOpen)
        # a hooked module ran under a torch.func transform (vmap, jvp), where no call can be
        # recorded (its output has no graph there), since the last step; and at that step
        self.under_transform = self.took_under_transform = False
        self.strided_norm = False  # a GroupNorm ran on a non-contiguous (channels_last) input
        if not idle:
            watch_checkpoints()
        self._random_mark = random_checkpoints()  # (see random_checkpoint)
        # (by id: the index of the unit whose call returned that trainable leaf as it is, a
        # parameter of its own: no node, so no call is recorded, and a step's refusal of its
        # use outside the calls names that cause)
        self.returned: dict[int, int] = {}
        # per replayed module under way: its weights' versions and copies of its buffers at
        # the start of each call (a stack: a module may call itself)
        self._starts: dict[int, list[_Start]] = {}
        # (by id of the module: the recorder does not keep modules alive)
        self._pre_hooks: list[tuple[int, Callable[[nn.Module, Any], None]]] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> Recorder:
        """A deep copy of a hooked model (an average of the weights, an evaluation copy) takes
        its hooks along but no engine: they get an idle recorder, which keeps nothing (the
        pending calls' graphs could not be copied, and no engine would read the copy's)."""
        return Recorder(idle=True)

    def __reduce__(self) -> tuple[type[Recorder], tuple[bool]]:
        """Pickled with a hooked model (``torch.save(model)``): idle, as a deep copy's."""
        return Recorder, (True,)

    def _pre_hook(
        self, module: nn.Module, hook: Callable[[nn.Module, Any], None], prepend: bool = False
    ) -> None:
        self.handles.append(module.register_forward_pre_hook(hook, prepend=prepend))
        self._pre_hooks.append((id(module), hook))

    def run_pre_hooks(self, module: nn.Module, args: Any) -> None:
        """Run this recorder's forward pre-hooks of ``module`` for a call under way: hooks
        registered inside one of its pre-hooks miss that call (torch has fixed its list)."""
        for hooked, hook in self._pre_hooks:
            if hooked == id(module):
                hook(module, args)

    def hook(self, index: int, unit: Unit) -> None:
        replays = unit.rule.replays()
        if replays:  # (first: before other pre-hooks, e.g. spectral_norm's, change the module)
            self._pre_hook(unit.module, self._start, prepend=True)
        # (each parameter by its owner and name: one replaced under its name later, as by
        # load_state_dict(assign=True), is read as it is at the call)
        slots = tuple(_slot(unit.module, name) for name in unit.params())
        record = partial(self._record, index, replays, unit.rule.settings, slots)
        # (always: a call that raises still takes its start off the stack; first: the module's
        # own output, before a user's hook replaces it)
        handle = unit.module.register_forward_hook(
            record, with_kwargs=True, always_call=True, prepend=True
        )
        self.handles.append(handle)

    def _foreign_hook_first(self, module: nn.Module) -> bool:
        """Whether a forward hook that is not a recorder's (nor one of torch's module
        trackers') runs before this recorder's on ``module`` (registered with ``prepend=True``
        after it, or a global one): the output recorded may then be that hook's."""
        global_hooks = nn.modules.module._global_forward_hooks  # (usually none: one test)
        if global_hooks and any(not _tracks(hook) for hook in global_hooks.values()):
            return True
        # (read from the hooks themselves: a shallow copy of a module runs the original's)
        for hook in module._forward_hooks.values():
            if not (
                isinstance(hook, partial)
                and getattr(hook.func, "__func__", None) is Recorder._record
            ):
                return True
            if getattr(hook.func, "__self__", None) is self:
                return False
        return False

    def watch_children(self, unit: Unit) -> None:
        """Flag grad-enabled calls of a child with trainable parameters made outside the
        forward of ``unit``, whose rule covers the child's parameters but sees them only through
        the unit's own calls."""
        depth = [0]  # the unit's forward calls under way
        self._pre_hook(unit.module, partial(_enter, depth))
        leave = partial(_leave, depth)
        self.handles.append(unit.module.register_forward_hook(leave, always_call=True))
        for name, child in unit.module.named_modules():
            if child is not unit.module and next(child.parameters(recurse=False), None) is not None:
                flag = partial(self._flag_outside, f"{unit.name}.{name}", unit.name, depth)
                self._pre_hook(child, flag)

    def _flag_outside(
        self, child: str, unit: str, depth: list[int], module: nn.Module, args: Any
    ) -> None:
        # (inside the unit's forward, the usual case, nothing more is read; in a backward, a
        # checkpoint's recompute of the unit's function, not a forward)
        if depth[0] or self.idle or not torch.is_grad_enabled() or is_replaying():
            return
        if torch._C._current_graph_task_id() != -1:
            return
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            self.outside = (child, unit)

    def watch_coupling(self, name: str, module: nn.Module) -> None:
        """Flag training-mode, grad-enabled forwards of a module that mixes the samples, with
        the nodes of their outputs (a user's hook that replaced one: the output read on)."""
        self.handles.append(module.register_forward_hook(partial(self._flag, name)))

    def _flag(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        if self.idle or not torch.is_grad_enabled() or is_replaying():
            return
        if batch_statistics(module):
            label = f"{name} ({type(module).__name__})"
            for leaf in leaves(output):
                if isinstance(leaf, Tensor) and leaf.grad_fn is not None:
                    self.coupled.append((label, leaf.grad_fn))

    @property
    def random_checkpoint(self) -> bool:
        """Whether a non-reentrant checkpoint drew random numbers since the record started
        (in any model: at worst, a step pulled back row by row that needed not be)."""
        return random_checkpoints() != self._random_mark

    def watch_fused_rnn(self, module: nn.Module) -> None:
        """Flag grad-enabled forwards of a recurrent layer that may run torch's fused kernel
        (cuDNN, MIOpen): its backward has no batching rule, so the rows' gradients cannot be
        captured in one batched backward. Judged by the input, which the kernel accepts, or by
        the outputs, which come from it (a subclass's own forward may hide them)."""
        self.handles.append(module.register_forward_hook(self._flag_fused))

    def _flag_fused(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.idle or not torch.is_grad_enabled() or is_replaying():
            return
        first = next((x for x in leaves(args) if isinstance(x, Tensor)), None)
        if (first is not None and torch.backends.cudnn.is_acceptable(first)) or any(
            _from_fused_rnn(leaf.grad_fn)
            for leaf in leaves(output)
            if isinstance(leaf, Tensor) and leaf.grad_fn is not None
        ):
            self.fused_rnn = True

    def watch_group_norm(self, module: nn.Module) -> None:
        """Flag grad-enabled forwards of a GroupNorm (hooked, or without affine parameters)
        on a non-contiguous input (channels_last): its backward queries the memory format,
        which vmap does not support ("NYI: querying is_contiguous inside of vmap"), so the
        rows' gradients are pulled back one by one (exact, slower)."""
        self.handles.append(module.register_forward_hook(self._flag_strided_norm))

    def _flag_strided_norm(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.idle or not torch.is_grad_enabled() or is_replaying():
            return
        first = next((x for x in leaves(args) if isinstance(x, Tensor)), None)
        # (a contiguous tensor may read as channels_last too: [N, C, 1, 1], see the function)
        if first is not None and strides_like_channels_last(first.shape, first.stride()):
            self.strided_norm = True

    def _start(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and not is_replaying() and not self.idle:
            if torch.compiler.is_compiling():
                _run_outside_graphs()
            weights: list[tuple[Tensor, int]] = [(p, p._version) for p in module.parameters()]
            buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
            modes = tuple((sub, sub.training) for sub in module.modules())
            stack = self._starts.setdefault(id(module), [])
            stack.append(_Start(weights, buffers, modes, bool(stack), [], next_sequence_nr()))

    def _record(
        self,
        index: int,
        replays: bool,
        settings: Callable[[nn.Module], Hashable],
        slots: tuple[tuple[nn.Module, str], ...],
        module: nn.Module,
        args: Any,
        kwargs: Any,
        output: Any,
    ) -> None:
        if self.idle or not torch.is_grad_enabled() or is_replaying():
            return
        if torch.compiler.is_compiling():
            _run_outside_graphs()
        if torch._C._functorch.maybe_current_level() is not None:
            self.under_transform = True
        preceded = self._foreign_hook_first(module)
        pending = self._starts.get(id(module)) if replays else None
        start = pending.pop() if pending else None
        parent = pending[-1] if pending else None  # (the call this one runs inside)
        # Fast path for the common single-tensor output and tensor-only positional inputs.
        flat = [output] if isinstance(output, Tensor) else leaves(output)
        positions = [
            j
            for j, leaf in enumerate(flat)
            if isinstance(leaf, Tensor) and leaf.requires_grad and leaf.grad_fn is not None
        ]
        if len(positions) < len(flat):  # (rare: a leaf, or something not a tensor, returned)
            for leaf in flat:
                if isinstance(leaf, Tensor) and leaf.requires_grad and leaf.grad_fn is None:
                    self.returned[id(leaf)] = index
        # (a call with no output to record is kept in the tree of a module's calls of itself
        # when calls were made inside it: its re-run carries its uses to their inputs)
        bare = not positions and not (start is not None and any(start.children))
        if bare:
            if parent is not None:
                parent.children.append(None)
            return
        if not kwargs and all(isinstance(a, Tensor) for a in args):
            inputs = args
        else:
            inputs = leaves((args, kwargs))
        call = Call(
            args=tuple(args),
            kwargs=dict(kwargs),
            output_positions=positions,
            output_shapes=[flat[j].shape for j in positions],
            edges=[get_gradient_edge(flat[j]) for j in positions],
            versions=[(t, t._version) for t in inputs if isinstance(t, Tensor)],
            autocast=autocast_state(flat[positions[0]].device.type) if positions else None,
            training=module.training,
            preceded=preceded,
        )
        params = [owner._parameters.get(name) for owner, name in slots]
        frozen: list[Tensor] = [p for p in params if p is not None and not p.requires_grad]
        # (rare: a module frozen for this call only, e.g. a GAN's discriminator; or a unit
        # hooked with no trainable parameter, a parametrized module frozen then)
        if frozen or not params:
            call.frozen, call.all_frozen = frozen, len(frozen) == len(params)
        call.output_hooks = []
        for i, j in enumerate(positions):
            leaf, base = flat[j], flat[j]._base
            view = None
            if base is not None:
                at_base = _base_read(module, j, leaf, base)
                if at_base is not None and isinstance(module, nn.Linear):
                    # a Linear's product reshaped: read at the product from the start (as cheap,
                    # and no hook to open on the output; the user's hooks on it run before)
                    call.output_hooks.append({})
                    call.read_at_base(i, *at_base)
                    continue
                view = OutputView(i, leaf, leaf.grad_fn, base.grad_fn, at_base)
            # (the step runs a user's hooks on this output where autograd's capture skips them)
            call.output_hooks.append(_hooks_of(leaf))
            if view is not None:  # (an in-place op on a view would bypass its node; kept until
                # the step, so that one made after the view is freed is seen too)
                call.output_views.append(view)
        # (the attributes that the rule reads at the step: a convolution's stride, an attention's
        # num_heads)
        call.settings = settings(module)
        if not replays:  # (a closed form: which tensors the forward read as its parameters)
            call.params_read = parameters_read(module)
        else:  # (what a replay of the module needs: the weights, buffers and modes)
            call.weight_versions = [(p, p._version) for p in module.parameters()]
            call.outputs = [(flat[j], flat[j]._version) for j in positions]
            call.modes = tuple((sub, sub.training) for sub in module.modules())
            if start is not None:  # (the modes the call started in: its forward may change them)
                call.modes, call.training = start.modes, start.modes[0][1]
                call.start_weights, call.buffers = start.weights, start.buffers
                call.nested, call.children = start.nested, start.children
                end = next_sequence_nr()
                if start.sequence is not None and end is not None:
                    call.span = (start.sequence, end)
                for child in call.children:
                    if child is not None:
                        child.parent = call
            if parent is not None:
                parent.children.append(call)
        if positions:
            self.calls.append((index, call))

    def take(self) -> list[tuple[int, Call]]:
        """The recorded calls; the record starts afresh."""
        calls, self.calls = self.calls, []
        self.took_under_transform, self.under_transform = self.under_transform, False
        self.coupled, self.outside = [], None
        self.fused_rnn = self.strided_norm = False
        self._random_mark = random_checkpoints()
        self._starts, self.returned = {}, {}
        return calls

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self._pre_hooks = []
        self.calls, self.coupled = [], []
        self._starts = {}
