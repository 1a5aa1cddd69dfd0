"""Conv1d/2d/3d: unfold the input, then the sequence-Linear closed forms (groups included).

Unfolding sample ``i`` gives ``U_i`` of shape ``[L, C_in k]`` (``L`` output positions, ``k``
the kernel volume) and the per-sample weight gradient is ``Bp_i^T U_i``: exactly the Linear
case with ``T = L`` (see :mod:`jacflow.autogram._linear`), one weight block per group.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd

from jacflow.autogram._linear import unfolded_contribution
from jacflow.autogram._rules import Call, Contribution, Rows, Rule, register_rule


def unfold(x: Tensor, module: _ConvNd) -> Tensor:
    """``[N, C, *spatial]`` -> ``[N, L, C * prod(kernel)]`` (patches in weight layout)."""
    kernel = tuple(module.kernel_size)
    nd = len(kernel)
    pad = tuple(module._reversed_padding_repeated_twice)
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


class ConvRule(Rule):
    """``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d`` (any stride, padding, dilation, groups)."""

    def prepare(
        self, module: nn.Module, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> Contribution:
        assert isinstance(module, _ConvNd)
        nd, groups = len(module.kernel_size), module.groups
        us, bps = [], []
        for call in calls:
            x = rows.samples(call.input())  # [S, *lead, C, *spatial]
            lead = x.shape[1 : x.ndim - 1 - nd]
            flat = x.reshape(-1, *x.shape[x.ndim - 1 - nd :])
            patches = unfold(flat, module)  # [S * n, L, C k]
            u = patches.reshape(rows.num_samples, -1, groups, patches.shape[-1] // groups)
            us.append(u)
            grad = call.grad()  # [R, *lead, C_out, *out_spatial]
            grad = grad.reshape(rows.num_rows, math.prod(lead), module.out_channels, -1)
            grad = grad.transpose(2, 3).reshape(
                rows.num_rows, -1, groups, module.out_channels // groups
            )
            bps.append(grad)
        return unfolded_contribution(us, bps, rows, module, params)


for _conv_type in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    register_rule(_conv_type, ConvRule())
