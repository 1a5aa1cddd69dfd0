"""LayerNorm, RMSNorm, GroupNorm and BatchNorm: materialise the (small) per-row affine
gradients.

With ``x_hat`` the normalised input (recomputed from the saved input), row ``r``'s gradients are
``g_gamma = sum x_hat * b_r`` and ``g_beta = sum b_r``, summed over every axis except the
affine one. They have the size of the affine parameters, so ``G = Gamma Gamma^T + Beta Beta^T``.
A BatchNorm normalises with its running statistics (eval mode), or with its batch's (training
mode, or without running statistics: per task only, since it mixes the samples), as its
forward did; the gradient flowing back through the batch's statistics is the capture's.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from jacflow.autogram._rules import (
    WEIGHT_AND_BIAS,
    Call,
    Contribution,
    MaterializedContribution,
    Rows,
    Rule,
    add_grads,
    attribute_settings,
    register_rule,
)

# what ``_normalized`` reads of the module (each type has some of them)
_SETTINGS = ("normalized_shape", "num_groups", "eps")


def _normalized(module: nn.Module, x: Tensor, call: Call) -> tuple[Tensor, int]:
    """``x_hat`` and the number of trailing axes that the affine parameters span, as ``call``
    computed it (its mode, and a BatchNorm's running statistics as the call found them)."""
    if isinstance(module, nn.LayerNorm):
        shape = tuple(module.normalized_shape)
        return F.layer_norm(x, shape, None, None, module.eps), len(shape)
    if isinstance(module, nn.RMSNorm):
        shape = tuple(module.normalized_shape)
        return F.rms_norm(x, shape, None, module.eps), len(shape)
    if isinstance(module, _BatchNorm):
        found = call.found_buffers(module)
        if call.trained(module) or "running_mean" not in found:  # the batch's statistics
            return F.batch_norm(x, None, None, None, None, True, 0.0, module.eps), 0
        # (in the dtype of the call's tensors: float32 for a float16 layer's upcast ones)
        running = (found["running_mean"].to(x.dtype), found["running_var"].to(x.dtype))
        return F.batch_norm(x, *running, None, None, False, 0.0, module.eps), 0
    assert isinstance(module, nn.GroupNorm)
    return F.group_norm(x, module.num_groups, None, None, module.eps), 0


def _keep_axes(module: nn.Module, x: Tensor, trailing: int) -> tuple[int, ...]:
    """Axes of a per-row ``[R, *sample]`` tensor that the affine parameters index (from the
    end)."""
    if isinstance(module, (nn.GroupNorm, _BatchNorm)):
        return (-(x.ndim - 1),)  # the channel axis of [N, C, *spatial]
    return tuple(range(-trailing, 0))


class NormRule(Rule):
    """Affine parameters (``weight``, ``bias``) of LayerNorm, RMSNorm, GroupNorm and
    BatchNorm."""

    def parameter_names(self, module: nn.Module) -> frozenset[str]:
        return WEIGHT_AND_BIAS

    def maps_rows(self, module: nn.Module) -> bool:
        # (over the last dimensions; GroupNorm's and BatchNorm's channels are dimension 1)
        return isinstance(module, (nn.LayerNorm, nn.RMSNorm))

    def settings(self, module: nn.Module) -> Hashable:
        return attribute_settings(module, _SETTINGS)

    def prepare(
        self, module: nn.Module, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> Contribution:
        total: dict[str, Tensor] = {}
        names = {id(tensor): name for name, tensor in params.items()}
        for call in calls:
            raw = call.input()
            x_hat, trailing = _normalized(module, raw, call)
            keep = _keep_axes(module, raw, trailing)
            grad = call.grad()
            dims = [a for a in range(1, grad.ndim) if a - grad.ndim not in keep]
            # (by the tensor in each slot: one Parameter in both, registered once, sums both)
            if (weight := names.get(id(getattr(module, "weight", None)))) is not None:
                product = rows.gather(rows.samples(x_hat.detach())) * grad
                add_grads(total, {weight: product.sum(dim=dims) if dims else product})
            if (bias := names.get(id(getattr(module, "bias", None)))) is not None:
                add_grads(total, {bias: grad.sum(dim=dims) if dims else grad})
        return MaterializedContribution(total)


class BatchNormRule(Rule):
    """BatchNorm: :class:`NormRule`'s form with the running statistics each call found
    (recorded at its start: the engine replays what the forward read, and refuses weights
    changed since)."""

    def replays(self) -> bool:
        return True

    def parameter_names(self, module: nn.Module) -> frozenset[str]:
        return WEIGHT_AND_BIAS

    def settings(self, module: nn.Module) -> Hashable:
        return _NORM.settings(module)

    def prepare(
        self, module: nn.Module, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> Contribution:
        return _NORM.prepare(module, params, calls, rows)


_NORM = NormRule()


for _norm_type in (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm):
    register_rule(_norm_type, _NORM)
for _batch_norm_type in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
    register_rule(_batch_norm_type, BatchNormRule())
