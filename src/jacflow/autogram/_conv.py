"""Conv1d/2d/3d (groups included).

Unfolding sample ``i`` gives ``U_i`` of shape ``[L, C_in k]`` (``L`` output positions, ``k``
the kernel volume) and the per-sample weight gradient is ``Bp_i^T U_i``: the sequence-Linear
case with ``T = L`` (see :mod:`jacflow.autogram._linear`), one weight block per group. The
cheaper of two exact routes is taken per layer: the ghost Gramian of the unfolded inputs (few
positions, wide channels), or per-row gradients materialised by one ``convolution_backward``
whose groups hold the rows side by side (the conv trick of Opacus/Rochette et al.), which is
much faster than unfolding. The weighted update is one ordinary ``convolution_backward``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd

from jacflow.autogram._linear import ghost_cost, ghost_gramian, materialized_cost
from jacflow.autogram._rules import Call, Contribution, Rows, Rule, add_grads, register_rule


def unfold(x: Tensor, module: _ConvNd) -> Tensor:
    """``[N, C, *spatial]`` -> ``[N, L, C * prod(kernel)]`` (patches in weight layout).

    1-D and 2-D convolutions with zero (symmetric) padding use ``F.unfold`` (im2col) and return
    a transposed view; other cases pad explicitly and unfold axis by axis.
    """
    kernel = tuple(module.kernel_size)
    nd = len(kernel)
    pad = tuple(module._reversed_padding_repeated_twice)
    symmetric = all(pad[2 * i] == pad[2 * i + 1] for i in range(nd))
    if nd <= 2 and module.padding_mode == "zeros" and symmetric:
        if nd == 1:
            x = x.unsqueeze(2)
        lift = (1,) * (2 - nd)
        patches = F.unfold(
            x,
            lift + kernel,
            dilation=lift + tuple(module.dilation),
            padding=(0,) * (2 - nd) + tuple(pad[::2][::-1]),
            stride=lift + tuple(module.stride),
        )
        return patches.transpose(1, 2)
    if any(pad):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, pad, mode=mode)
    for i in range(nd):
        dilation = module.dilation[i]
        x = x.unfold(2 + i, dilation * (kernel[i] - 1) + 1, module.stride[i])
        if dilation > 1:
            x = x[..., ::dilation]
    n, c = x.shape[:2]
    order = [0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd)]
    return x.permute(order).reshape(n, -1, c * math.prod(kernel))


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
    module: _ConvNd, grad: Tensor, x: Tensor, copies: int, with_bias: bool
) -> tuple[Tensor, Tensor | None]:
    """Weight (and bias) gradient of ``copies`` side-by-side copies of the convolution (inputs
    and output gradients stacked along the channels): ``convolution_backward`` with
    ``groups * copies`` groups, so every copy's gradient comes out separately."""
    nd = len(module.kernel_size)
    x, padding = _padded(module, x)
    shape = (copies * module.out_channels, *module.weight.shape[1:])
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


class ConvContribution(Contribution):
    """Per-row gradients by grouped ``convolution_backward`` (materialised) or, for layers with
    few positions, the ghost Gramian of the unfolded inputs; the weighted gradient is one
    ``convolution_backward`` on the weighted output gradients."""

    def __init__(
        self, module: _ConvNd, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> None:
        self.module, self.calls, self.rows = module, calls, rows
        self.weight_name = "weight" if "weight" in params else None
        self.bias_name = "bias" if "bias" in params else None
        self.nd = len(module.kernel_size)

    def _split(self, t: Tensor, channels: int) -> tuple[Tensor, int]:
        """``[N, *lead, channels, *spatial]`` -> ``[N, n, channels, *spatial]``, ``n``."""
        spatial = t.shape[t.ndim - self.nd :]
        flat = t.reshape(t.shape[0], -1, channels, *spatial)
        return flat, flat.shape[1]

    def _row_grads(self) -> Tensor:
        """Per-row weight gradients ``[R, *weight.shape]``."""
        m, r = self.module, self.rows.num_rows
        weight_total = None
        for call in self.calls:
            x, n = self._split(self.rows.gather(self.rows.samples(call.input())), m.in_channels)
            g, _ = self._split(call.grad(), m.out_channels)
            x = x.transpose(0, 1).reshape(n, r * m.in_channels, *x.shape[3:])
            g_stacked = g.transpose(0, 1).reshape(n, r * m.out_channels, *g.shape[3:])
            weight, _ = _conv_weight_grad(m, g_stacked, x, r, with_bias=False)
            weight = weight.reshape(r, *m.weight.shape)
            weight_total = weight if weight_total is None else weight_total + weight
        assert weight_total is not None
        return weight_total

    def _bias_rows(self) -> Tensor:
        total = None
        for call in self.calls:
            g, _ = self._split(call.grad(), self.module.out_channels)
            bias = g.sum(dim=[1, *range(3, g.ndim)])
            total = bias if total is None else total + bias
        assert total is not None
        return total

    def _ghost_cheaper(self) -> bool:
        m, rows = self.module, self.rows
        positions = 0
        for call in self.calls:
            g, n = self._split(call.grad(), m.out_channels)
            positions += n * math.prod(g.shape[3:])
        groups = m.groups
        d = m.in_channels // groups * math.prod(m.kernel_size)
        p = m.out_channels // groups
        ghost = ghost_cost(rows, positions, groups, d, p)
        return ghost <= materialized_cost(rows, positions, groups, d, p)

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
        return torch.cat(us, dim=1), torch.cat(bps, dim=1)

    def gramian(self, names: set[str]) -> Tensor | None:
        total: Tensor | None = None
        if self.weight_name is not None and self.weight_name in names:
            if self._ghost_cheaper():
                total = ghost_gramian(*self._unfolded(), self.rows)
            else:
                flat = self._row_grads().flatten(1)
                total = flat @ flat.T
        if self.bias_name is not None and self.bias_name in names:
            s = self._bias_rows()
            total = s @ s.T if total is None else total + s @ s.T
        return total

    def per_row_grads(self, name: str) -> Tensor:
        return self._row_grads() if name == self.weight_name else self._bias_rows()

    def weighted_grads(self, weights: Tensor) -> dict[str, Tensor]:
        m = self.module
        with_bias = self.bias_name is not None
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


class ConvRule(Rule):
    """``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d`` (any stride, padding, dilation, groups)."""

    def prepare(
        self, module: nn.Module, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> Contribution:
        assert isinstance(module, _ConvNd)
        return ConvContribution(module, params, calls, rows)


for _conv_type in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    register_rule(_conv_type, ConvRule())
