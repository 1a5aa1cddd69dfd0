"""Conv1d/2d/3d (groups included).

Unfolding sample ``i`` gives ``U_i`` of shape ``[L, C_in k]`` (``L`` output positions, ``k``
the kernel volume) and the per-sample weight gradient is ``Bp_i^T U_i``: the sequence-Linear
case with ``T = L`` (see :mod:`jacflow.autogram._linear`), one weight block per group. The
cheapest of three exact routes is taken per layer (:meth:`ConvContribution._route`, an
operation count): the ghost Gramian of the unfolded inputs (few positions, wide channels), or
per-row gradients materialised either by one ``convolution_backward`` whose groups hold the rows
side by side (the conv trick of Opacus/Rochette et al.; fast for wide channels) or by unfolding
and one batched matmul (few input channels, e.g. the first layer on RGB images). Materialised
per-row gradients are kept for the update (``weights @ per_row``) when they are no larger than
the layer's recorded inputs and output gradients; otherwise the update is one ordinary
``convolution_backward`` on the weighted output gradients.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd

from jacflow.autogram._linear import (
    PER_ROW_SLOWDOWN,
    ghost_cost,
    ghost_gramian,
    gramian_by_blocks,
)
from jacflow.autogram._rules import (
    WEIGHT_AND_BIAS,
    Call,
    Contribution,
    Rows,
    Rule,
    add_grads,
    attribute_settings,
    joined,
    kept_weighted_grads,
    register_rule,
    unbatched_refusal,
    worth_keeping,
)
from jacflow.linalg._products import row_gramian


def _windows(x: Tensor, module: _ConvNd) -> Tensor:
    """The patches of ``x`` (``[N, C, *spatial]``) as a strided view
    ``[N, C, *positions, *kernel]``: pad, then one ``Tensor.unfold`` per spatial axis."""
    kernel = tuple(module.kernel_size)
    pad = tuple(module._reversed_padding_repeated_twice)
    if any(pad):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, pad, mode=mode)
    for i in range(len(kernel)):
        dilation = module.dilation[i]
        x = x.unfold(2 + i, dilation * (kernel[i] - 1) + 1, module.stride[i])
        if dilation > 1:
            x = x[..., ::dilation]
    return x


def unfold(x: Tensor, module: _ConvNd, positions_first: bool = True) -> Tensor:
    """Patches of ``x`` (``[N, C, *spatial]``) in the weight's layout (channel-major, then the
    kernel offsets): ``[N, L, C * k]`` (``positions_first``) or ``[N, C * k, L]``.

    Strided views (:func:`_windows`) and one copy; this is several times faster than
    ``F.unfold`` on CPU, and covers 3-D, dilation and every padding mode.
    """
    x = _windows(x, module)
    nd = len(module.kernel_size)
    n, c, k = x.shape[0], x.shape[1], math.prod(module.kernel_size)
    spatial, offsets = list(range(2, 2 + nd)), list(range(2 + nd, 2 + 2 * nd))
    if positions_first:
        return x.permute([0, *spatial, 1, *offsets]).reshape(n, -1, c * k)
    return x.permute([0, 1, *offsets, *spatial]).reshape(n, c * k, -1)


def unfold_with_ones(x: Tensor, module: _ConvNd) -> Tensor:
    """:func:`unfold` of ``x`` (``[N, C, *spatial]``, positions last) with a row of ones after
    each group's patches: ``[N, groups, C k / groups + 1, L]``, in one copy. A product with the
    output gradients then gives each group's bias gradient (the sum over the positions) in its
    last column, for one more row.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from jacflow.autogram._conv import unfold, unfold_with_ones
        >>> conv, x = nn.Conv2d(2, 4, 3, groups=2), torch.randn(1, 2, 5, 5)
        >>> u = unfold_with_ones(x, conv)
        >>> u.shape, torch.equal(u[:, :, :9].flatten(1, 2), unfold(x, conv, False))
        (torch.Size([1, 2, 10, 9]), True)
        >>> bool((u[:, :, 9] == 1).all())
        True
    """
    windows = _windows(x, module)
    nd = len(module.kernel_size)
    n, c, groups = windows.shape[0], windows.shape[1], module.groups
    positions, kernel = windows.shape[2 : 2 + nd], windows.shape[2 + nd :]
    per_group = c // groups * math.prod(kernel)
    out = x.new_empty(n, groups, per_group + 1, math.prod(positions))
    out[:, :, per_group].fill_(1.0)
    patches = windows.permute([0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd)])
    out[:, :, :per_group].view(n, groups, c // groups, *kernel, *positions).copy_(
        patches.view(n, groups, c // groups, *kernel, *positions)
    )
    return out


def _padded(module: _ConvNd, x: Tensor) -> tuple[Tensor, list[int]]:
    """``x`` and the ``padding`` argument for ``convolution_backward`` (explicit padding for
    non-zero modes and asymmetric ``"same"`` padding)."""
    nd = len(module.kernel_size)
    pad = tuple(module._reversed_padding_repeated_twice)
    if module.padding_mode == "zeros" and all(pad[2 * i] == pad[2 * i + 1] for i in range(nd)):
        return x, [pad[2 * (nd - 1 - i)] for i in range(nd)]
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, pad, mode=mode), [0] * nd


def _conv_weight_grad(
    module: _ConvNd,
    grad: Tensor,
    x: Tensor,
    copies: int,
    with_bias: bool,
    out_channels: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Weight (and bias) gradient of ``copies`` side-by-side copies of the convolution (inputs
    and output gradients stacked along the channels): ``convolution_backward`` with
    ``groups * copies`` groups, so every copy's gradient comes out separately. ``out_channels``:
    of each copy's output gradient, where it holds a block of the module's (one group)."""
    nd = len(module.kernel_size)
    x, padding = _padded(module, x)
    channels = module.out_channels if out_channels is None else out_channels
    shape = (copies * channels, *module.weight.shape[1:])
    result = torch.ops.aten.convolution_backward(
        grad,
        x,
        x.new_empty(shape),
        [shape[0]] if with_bias else None,
        list(module.stride),
        padding,
        list(module.dilation),
        False,
        [0] * nd,
        module.groups * copies,
        [False, True, with_bias],
    )
    return result[1], result[2]


# oneDNN's convolution kernels work on blocks of 16 channels (one AVX-512 register of float32),
# so a grouped convolution with fewer channels per group pays for the padded block; a batched
# matmul on unfolded inputs has no such padding but runs its small per-sample products slower
# (PER_ROW_SLOWDOWN). With one input and one output channel per group (depthwise, and the
# copies of a 1 -> 1 convolution side by side) the convolution is depthwise, whose kernels
# vectorise over the channels: no padded block (measured, 1 thread, depthwise 3x3 on 64
# channels of 32 x 32, B = 32: grouped 16.5 ms, unfolded 60.2 ms). The constants only pick
# between exact routes.
_CHANNEL_BLOCK = 16


def _blocked(channels: int) -> int:
    return -(-channels // _CHANNEL_BLOCK) * _CHANNEL_BLOCK


# Both materialising routes write ``R`` gradients of the whole weight, a pass their
# multiply-adds do not count: on small maps it is most of their time. The grouped
# backward-weights kernel takes about 0.4 ns per weight entry written (1 thread, float32,
# R = 32, 64 -> 64 3x3 on 1x1 maps: 0.44 ms), against 0.02-0.04 ns per multiply-add, and about
# 4 ns where glibc hands the buffer back to the system at each free and its pages are faulted in
# again (4.3 ms; see benchmarks/_timing.keep_heap). Charged per entry written at the first
# figure; it only picks between exact routes (ghost, which writes none, on small maps).
MATERIALIZED_ENTRY_COST = 16

# The ghost Gramian takes one group at a time (:func:`ghost_gramian`'s loop: a few small products
# and passes each, about 10 us): charged per group beyond the first (measured, 1 thread, a
# depthwise 3x3 on 64 channels of 1x1 maps, B = 32: the ghost route 0.7 ms slower than the
# grouped convolution, its multiply-adds 8% fewer).
GHOST_GROUP_COST = 300_000


def grouped_cost(rows: Rows, positions: int, groups: int, c_in: int, k: int, p: int) -> int:
    """Cost of the per-row gradients by a grouped ``convolution_backward`` (``c_in`` and
    ``p`` channels per group, kernel volume ``k``), of writing them, and of their Gramian."""
    r = rows.num_rows
    block = 1 if c_in == p == 1 else _blocked(c_in) * _blocked(p)
    written = r * c_in * k * p * MATERIALIZED_ENTRY_COST
    return groups * (r * positions * k * block + written + r * r * c_in * k * p)


def unfolded_cost(rows: Rows, positions: int, groups: int, d: int, p: int) -> int:
    """Cost of the per-row gradients by unfolding and one batched matmul, and of their
    Gramian: the products, the copy of the unfolded inputs, the per-row gradients written, and
    the Gramian."""
    r, s = rows.num_rows, rows.num_samples
    products = (1 if rows.per_task else PER_ROW_SLOWDOWN) * r * positions * d * p
    written = r * d * p * MATERIALIZED_ENTRY_COST
    return groups * (products + s * positions * d + written + r * r * d * p)


class ConvContribution(Contribution):
    """Per-row gradients (grouped ``convolution_backward``, or unfolded inputs and one batched
    matmul) or, for layers with few positions, the ghost Gramian of the unfolded inputs; the
    cheapest exact route is taken. The update is ``weights @ per_row`` when the per-row
    gradients are small enough to keep, else one ``convolution_backward`` on the weighted
    output gradients."""

    def __init__(
        self, module: _ConvNd, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> None:
        self.module, self.calls, self.rows = module, calls, rows
        self.weight_name = "weight" if "weight" in params else None
        self.bias_name = "bias" if "bias" in params else None
        self.nd = len(module.kernel_size)
        self.kept: Tensor | None = None  # per-row weight gradients [R, weight.numel()]
        self.bias_kept: Tensor | None = None  # per-row bias gradients [R, C_out]

    def _split(self, t: Tensor, channels: int) -> tuple[Tensor, int]:
        """``[N, *lead, channels, *spatial]`` -> ``[N, n, channels, *spatial]``, ``n``."""
        spatial = t.shape[t.ndim - self.nd :]
        flat = t.reshape(t.shape[0], -1, channels, *spatial)
        return flat, flat.shape[1]

    def _row_grads(
        self,
        route: str | None = None,
        with_bias: bool = False,
        channels: slice = slice(None),
    ) -> tuple[Tensor, Tensor | None]:
        """Per-row weight gradients ``[R, *weight.shape]`` by the cheaper materialising route,
        and with ``with_bias`` the per-row bias gradients ``[R, C_out]`` from the same pass
        (``None`` without); with ``channels`` (one group only), those of a block of output
        channels (``[R, c, ...]`` and ``[R, c]``)."""
        route = self._route() if route is None else route
        if route == "unfold":
            return self._row_grads_unfolded(with_bias, channels)
        return self._row_grads_conv(with_bias, channels)

    def _row_grads_conv(self, with_bias: bool, channels: slice) -> tuple[Tensor, Tensor | None]:
        """Per-row weight (and bias) gradients from one grouped ``convolution_backward`` per
        call."""
        m, r = self.module, self.rows.num_rows
        weight_total: Tensor | None = None
        bias_total: Tensor | None = None
        for call in self.calls:
            x, n = self._split(self.rows.gather(self.rows.samples(call.input())), m.in_channels)
            g, _ = self._split(call.grad(), m.out_channels)
            g = g[:, :, channels]
            c = g.shape[2]
            x = x.transpose(0, 1).reshape(n, r * m.in_channels, *x.shape[3:])
            g_stacked = g.transpose(0, 1).reshape(n, r * c, *g.shape[3:])
            weight, bias = _conv_weight_grad(m, g_stacked, x, r, with_bias, c)
            weight = weight.reshape(r, c, *m.weight.shape[1:])
            weight_total = weight if weight_total is None else weight_total + weight
            if with_bias and bias is not None:
                bias = bias.reshape(r, c)
                bias_total = bias if bias_total is None else bias_total + bias
        assert weight_total is not None
        return weight_total, bias_total

    def _row_grads_unfolded(self, with_bias: bool, channels: slice) -> tuple[Tensor, Tensor | None]:
        """Per-row weight gradients from the unfolded inputs ``[S, g, d, T]`` and output
        gradients ``[R, g, p, T]`` (all calls joined along the positions ``T``); with
        ``with_bias``, a row of ones after each group's ``d`` gives the bias gradients too."""
        m, rows, groups = self.module, self.rows, self.module.groups
        r, s = rows.num_rows, rows.num_samples
        p = m.out_channels // groups
        us, gs = [], []
        for call in self.calls:
            x, n = self._split(rows.samples(call.input()), m.in_channels)
            if with_bias:
                u = unfold_with_ones(x.flatten(0, 1), m)  # [S n, g, d + 1, L]
                u = u.reshape(s, n, groups, u.shape[2], u.shape[3])
            else:
                patches = unfold(x.flatten(0, 1), m, positions_first=False)  # [S n, C k, L]
                u = patches.reshape(s, n, groups, -1, patches.shape[-1])
            us.append(u.permute(0, 2, 3, 1, 4).reshape(s, groups, u.shape[3], -1))
            g, _ = self._split(call.grad(), m.out_channels)
            g = g.reshape(r, n, groups, p, -1)[:, :, :, channels]
            gs.append(g.permute(0, 2, 3, 1, 4).reshape(r, groups, g.shape[3], -1))
        u, g = joined(us, -1), joined(gs, -1)
        if rows.per_task:  # one sample seen by every row: a single product per group
            c = g.shape[2]  # (the block's output channels)
            flat_g = g.transpose(0, 1).reshape(groups, r * c, -1)
            grads = torch.matmul(flat_g, u[0].transpose(1, 2)).view(groups, r, c, -1)
            grads = grads.transpose(0, 1)  # [R, g, p, d]
        else:
            grads = torch.matmul(rows.gather(u), g.transpose(2, 3)).transpose(2, 3)
        shape = (r, grads.shape[1] * grads.shape[2], *m.weight.shape[1:])
        if not with_bias:
            return grads.reshape(shape), None
        return grads[..., :-1].reshape(shape), grads[..., -1].reshape(r, -1)

    def _bias_rows(self) -> Tensor:
        if self.bias_kept is not None:
            return self.bias_kept
        total = None
        for call in self.calls:
            g, _ = self._split(call.grad(), self.module.out_channels)
            bias = g.sum(dim=[1, *range(3, g.ndim)])
            total = bias if total is None else total + bias
        assert total is not None
        return total

    def _route(self) -> str:
        """``"ghost"``, ``"conv"`` or ``"unfold"``: the cheapest exact Gramian route."""
        m, rows = self.module, self.rows
        positions = 0
        for call in self.calls:
            g, n = self._split(call.grad(), m.out_channels)
            positions += n * math.prod(g.shape[3:])
        groups, k = m.groups, math.prod(m.kernel_size)
        c_in, p = m.in_channels // groups, m.out_channels // groups
        costs = {
            "ghost": ghost_cost(rows, positions, groups, c_in * k, p)
            + (groups - 1) * GHOST_GROUP_COST,
            "conv": grouped_cost(rows, positions, groups, c_in, k, p),
            "unfold": unfolded_cost(rows, positions, groups, c_in * k, p),
        }
        return min(costs, key=costs.__getitem__)

    def _unfolded(self) -> tuple[Tensor, Tensor]:
        m, rows, groups = self.module, self.rows, self.module.groups
        us, bps = [], []
        for call in self.calls:
            x, _ = self._split(rows.samples(call.input()), m.in_channels)
            patches = unfold(x.flatten(0, 1), m)  # [S * n, L, C k]
            us.append(patches.reshape(rows.num_samples, -1, groups, patches.shape[-1] // groups))
            g, _ = self._split(call.grad(), m.out_channels)
            g = g.flatten(3).transpose(2, 3)  # [R, n, L, C_out]
            bps.append(g.reshape(rows.num_rows, -1, groups, m.out_channels // groups))
        return joined(us, 1), joined(bps, 1)

    def _held(self) -> list[Tensor]:
        return [t for call in self.calls for t in (call.input(), call.grad())]

    def gramian(self, names: set[str]) -> Tensor | None:
        weight = self.weight_name is not None and self.weight_name in names
        bias = self.bias_name is not None and self.bias_name in names
        total: Tensor | None = None
        if weight:
            route = self._route()
            if route == "ghost":
                return ghost_gramian(*self._unfolded(), self.rows, with_bias=bias)
            total = self._materialized_gramian(route, bias)
        if bias:
            s = self.bias_kept = self._bias_rows()
            total = s @ s.T if total is None else total + s @ s.T
        return total

    def _materialized_gramian(self, route: str, with_bias: bool) -> Tensor:
        """The weight's Gramian from its per-row gradients, kept for the update where
        :func:`worth_keeping`; else, with one group, by blocks of output channels
        (:func:`gramian_by_blocks`: a 256 -> 256 3 x 3 convolution on 8 x 8 maps at B = 64
        holds 2M elements; its per-row gradients have 38M). The per-row bias gradients come
        from the same passes."""
        m, held = self.module, self._held()
        per_channel = self.rows.num_rows * m.weight[0].numel()
        keep = worth_keeping(per_channel * m.out_channels, *held)  # (all R x weight entries)
        if m.groups > 1 or keep:
            grads, self.bias_kept = self._row_grads(route, with_bias)
            flat = grads.flatten(1)
            if keep:
                self.kept = flat
            return row_gramian(flat)
        biases: list[Tensor] = []

        def block_rows(channels: slice) -> Tensor:
            grads, bias = self._row_grads(route, with_bias, channels)
            biases.extend([] if bias is None else [bias])
            return grads

        size = sum(t.numel() for t in held)
        total = gramian_by_blocks(m.out_channels, per_channel, size, block_rows)
        self.bias_kept = torch.cat(biases, dim=1) if biases else None
        return total

    def per_row_grads(self, name: str) -> Tensor:
        return self._row_grads()[0] if name == self.weight_name else self._bias_rows()

    def weighted_grads(self, weights: Tensor) -> dict[str, Tensor]:
        m = self.module
        with_bias = self.bias_name is not None
        if self.kept is not None:  # only set when the weight is differentiated
            return kept_weighted_grads(
                weights, self.kept, "weight", m.weight.shape, self.bias_name, self._bias_rows
            )
        out: dict[str, Tensor] = {}
        for call in self.calls:
            y = self.rows.reduce(weights, call.grad())
            y, _ = self._split(y, m.out_channels)
            x, _ = self._split(self.rows.samples(call.input()), m.in_channels)
            weight, bias = _conv_weight_grad(m, y.flatten(0, 1), x.flatten(0, 1), 1, with_bias)
            new = {"weight": weight} if self.weight_name is not None else {}
            if with_bias and bias is not None:
                new["bias"] = bias
            add_grads(out, new)
        return out


def stale_sizes(module: _ConvNd) -> ValueError | None:
    """The refusal of a convolution whose weight's shape is not the one its attributes give
    (a weight replaced by one of another shape), which the closed form reads; else ``None``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from jacflow.autogram._conv import stale_sizes
        >>> conv = nn.Conv2d(2, 3, 3)
        >>> conv.weight = nn.Parameter(torch.randn(5, 2, 3, 3))
        >>> print(stale_sizes(conv))  # doctest: +ELLIPSIS
        Conv2d's weight has shape (5, 2, 3, 3), but its attributes give (3, 2, 3, 3) ...
    """
    expected = (module.out_channels, module.in_channels // module.groups, *module.kernel_size)
    if tuple(module.weight.shape) == expected:
        return None
    return ValueError(
        f"{type(module).__name__}'s weight has shape {tuple(module.weight.shape)}, but its "
        f"attributes give {expected} (out_channels, in_channels // groups, *kernel_size), "
        "which the engine's closed form reads. Set them to the weight's (or build a new "
        "layer around it)."
    )


# What the closed form reads of a convolution besides its tensors: its kernel's size and the
# geometry of its windows (the last: what padding="same" gives, per side)
_CONV_SETTINGS = (
    "kernel_size",
    "stride",
    "padding",
    "dilation",
    "groups",
    "padding_mode",
    "_reversed_padding_repeated_twice",
)


class ConvRule(Rule):
    """``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d`` (any stride, padding, dilation, groups)."""

    def delegates(self) -> tuple[str, ...]:
        return ("_conv_forward",)  # (overridden for weight standardisation, FFT convs, ...)

    def parameter_names(self, module: nn.Module) -> frozenset[str]:
        return WEIGHT_AND_BIAS

    def settings(self, module: nn.Module) -> Hashable:
        return attribute_settings(module, _CONV_SETTINGS)

    def validate(self, module: nn.Module, call: Call, rows: Rows) -> None:
        assert isinstance(module, _ConvNd)
        if (stale := stale_sizes(module)) is not None:
            raise stale
        x = call.input()
        if not rows.per_task and x.dim() == len(module.kernel_size) + 1:  # [C, *spatial]
            raise unbatched_refusal(module, x)

    def prepare(
        self, module: nn.Module, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> Contribution:
        assert isinstance(module, _ConvNd)
        return ConvContribution(module, params, calls, rows)


for _conv_type in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    register_rule(_conv_type, ConvRule())
