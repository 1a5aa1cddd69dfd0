"""Small architectures for the engine tests, each with its inputs, losses and hooked modules.

A case builds ``(model, hooked_modules, forward)`` where ``forward()`` runs the model on fixed
inputs and returns the losses (shape ``[B]``, ``[B, k]``, or ``[m]`` for per-task cases).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

Forward = Callable[[], Tensor]
Built = tuple[nn.Module, tuple[nn.Module, ...], Forward]

B = 4


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[torch.dtype], Built]
    batch_dim: int | None = 0


def _per_sample_sq(out: Tensor) -> Tensor:
    return out.pow(2).flatten(1).sum(1)


def _simple(
    model: nn.Module, x: Tensor, loss: Callable[[Tensor], Tensor] = _per_sample_sq
) -> Built:
    return model, (model,), lambda: loss(model(x))


def _mlp(dtype: torch.dtype, bias: bool = True, k: int | None = None) -> Built:
    model = nn.Sequential(nn.Linear(5, 7, bias=bias), nn.ReLU(), nn.Linear(7, 3, bias=bias))
    model.to(dtype)
    x = torch.randn(B, 5, dtype=dtype)
    if k is None:
        return _simple(model, x)
    return _simple(model, x, lambda out: out.pow(2) + out)


def _deep_tanh(dtype: torch.dtype) -> Built:
    layers: list[nn.Module] = []
    for d_in, d_out in [(3, 6), (6, 6), (6, 5), (5, 2)]:
        layers += [nn.Linear(d_in, d_out), nn.Tanh()]
    model = nn.Sequential(*layers).to(dtype)
    return _simple(model, torch.randn(B, 3, dtype=dtype))


def _linear_seq(t: int, d: int, p: int) -> Callable[[torch.dtype], Built]:
    def build(dtype: torch.dtype) -> Built:
        model = nn.Sequential(nn.Linear(d, p), nn.GELU(), nn.Linear(p, 2)).to(dtype)
        return _simple(model, torch.randn(B, t, d, dtype=dtype))

    return build


def _linear_4d(dtype: torch.dtype) -> Built:
    model = nn.Linear(3, 2).to(dtype)
    return _simple(model, torch.randn(B, 2, 3, 3, dtype=dtype))


def _conv(make: Callable[[], nn.Module], shape: tuple[int, ...]) -> Callable[[torch.dtype], Built]:
    def build(dtype: torch.dtype) -> Built:
        model = make().to(dtype)
        return _simple(model, torch.randn(B, *shape, dtype=dtype))

    return build


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2, groups=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16, 3),
    )


def _cnn_groupnorm() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(36, 2)
    )


def _embedding(dtype: torch.dtype) -> Built:
    model = nn.Sequential(nn.Embedding(6, 3, padding_idx=0), nn.Linear(3, 2)).to(dtype)
    ids = torch.tensor([[1, 2, 0, 2], [0, 0, 3, 1], [5, 5, 5, 4], [2, 1, 0, 3]])
    return _simple(model, ids)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.mix = nn.Linear(4, 4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(torch.tanh(self.mix(self.embed(ids))))


def _tied(dtype: torch.dtype) -> Built:
    model = _Tied().to(dtype)
    ids = torch.randint(0, 7, (B, 3))
    return _simple(model, ids)


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.inner(torch.relu(self.inner(x))))


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = x + self.a(x)
        h = h + self.b(torch.relu(h))
        return self.head(h)


class _Block(nn.Module):
    """Pre-norm transformer block with multi-head attention and an MLP."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = nn.RMSNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return self.head(x).squeeze(-1)


def _block(dtype: torch.dtype) -> Built:
    model = _Block().to(dtype)
    return _simple(model, torch.randn(B, 3, 8, dtype=dtype))


class Scale(nn.Module):
    """An elementwise learned scale: a module without a closed form (the generic rule)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, features))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.s


class _ScaleShift(nn.Module):
    """A module with direct parameters only (generic rule)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))
        self.shift = nn.Parameter(torch.randn(d))

    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(x * self.scale + self.shift)


class _ParentWithParams(nn.Module):
    """Direct parameters and a child: one generic unit for both."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(3))
        self.lin = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * self.gain


class _TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = x @ self.w
        return torch.tanh(y), y.pow(2)


class _UsesTwo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.two = _TwoOutputs()
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.two(x)
        return self.head(a + b)


def _frozen(dtype: torch.dtype) -> Built:
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    model.to(dtype)
    model[0].requires_grad_(False)
    model[2].bias.requires_grad_(False)
    return _simple(model, torch.randn(B, 3, dtype=dtype))


def _subset(dtype: torch.dtype) -> Built:
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    model.to(dtype)
    x = torch.randn(B, 3, dtype=dtype)
    return model, (model[2:],), lambda: _per_sample_sq(model(x))


def _eval_batchnorm(dtype: torch.dtype) -> Built:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).to(dtype)
    model[1].running_mean.normal_()
    model[1].eval()
    return _simple(model, torch.randn(B, 3, dtype=dtype))


def _eval_batchnorm_cnn(dtype: torch.dtype) -> Built:
    """BatchNorm2d and BatchNorm1d on [N, C, L] in eval mode, with running statistics."""
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Flatten(2),
        nn.BatchNorm1d(3),
        nn.Flatten(),
        nn.Linear(3 * 16, 2),
    ).to(dtype)
    for norm in (model[1], model[4]):
        norm.running_mean.normal_()
        norm.running_var.uniform_(0.5, 2.0)
    model.eval()
    return _simple(model, torch.randn(B, 2, 6, 6, dtype=dtype))


def _tasks_batchnorm(dtype: torch.dtype) -> Built:
    """Per task, BatchNorms normalising with their batch's statistics: in training mode, and
    in eval mode without running statistics; and a BatchNorm3d in eval mode."""
    trunk = nn.Sequential(  # (a nonlinearity after each, or the next one's statistics
        # would cancel its affine parameters)
        nn.Conv3d(1, 2, 2),
        nn.BatchNorm3d(2).eval(),
        nn.Tanh(),
        nn.Flatten(2),
        nn.BatchNorm1d(2),
        nn.Tanh(),
        nn.BatchNorm1d(2, track_running_stats=False).eval(),
        nn.Tanh(),
    )
    trunk[1].running_mean.normal_()
    return _tasks(trunk, 2 * 8, torch.randn(5, 1, 3, 3, 3, dtype=dtype), 3, dtype)


def _generic(
    module: Callable[[], nn.Module], shape: tuple[int, ...]
) -> Callable[[torch.dtype], Built]:
    def build(dtype: torch.dtype) -> Built:
        model = nn.Sequential(module(), nn.Linear(shape[-1], 2)).to(dtype)
        return _simple(model, torch.randn(B, *shape, dtype=dtype))

    return build


# ----------------------------------------------------------------------------- per-task cases
def _tasks(trunk: nn.Module, feature_dim: int, x: Tensor, m: int, dtype: torch.dtype) -> Built:
    heads = nn.ModuleList([nn.Linear(feature_dim, 1) for _ in range(m)])
    model = nn.ModuleDict({"trunk": trunk, "heads": heads}).to(dtype)

    def forward() -> Tensor:
        features = trunk(x).flatten(1)
        return torch.stack([head(features).pow(2).mean() for head in heads])

    return model, (trunk,), forward


def _tasks_mlp(dtype: torch.dtype) -> Built:
    trunk = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5), nn.Tanh())
    return _tasks(trunk, 5, torch.randn(6, 4, dtype=dtype), 3, dtype)


def _tasks_cnn(dtype: torch.dtype) -> Built:
    trunk = nn.Sequential(nn.Conv2d(1, 3, 3), nn.GroupNorm(1, 3), nn.ReLU(), nn.Conv1d(3, 2, 2))
    trunk = nn.Sequential(nn.Conv2d(1, 3, 3), nn.GroupNorm(1, 3), nn.ReLU(), nn.Flatten(2))
    return _tasks(trunk, 12, torch.randn(5, 1, 4, 4, dtype=dtype), 2, dtype)


def _tasks_conv_groups(dtype: torch.dtype) -> Built:
    trunk = nn.Sequential(nn.Conv1d(4, 4, 3, groups=2, dilation=2, padding=1), nn.Tanh())
    return _tasks(trunk, 20, torch.randn(5, 4, 7, dtype=dtype), 3, dtype)


def _tasks_block(dtype: torch.dtype) -> Built:
    trunk = nn.Sequential(_BlockTrunk())
    return _tasks(trunk, 3 * 8, torch.randn(3, 3, 8, dtype=dtype), 4, dtype)


class _BlockTrunk(_Block):
    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def _tasks_tied(dtype: torch.dtype) -> Built:
    model = _Tied().to(dtype)
    ids = torch.randint(0, 7, (B, 3))

    def forward() -> Tensor:
        out = model(ids)
        return torch.stack([out[..., :3].pow(2).mean(), out[..., 3:].sin().mean()])

    return model, (model,), forward


def _tasks_seq_bk(dtype: torch.dtype) -> Built:
    """Per-sample, per-output losses ``[B, k]`` through a sequence model."""
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).to(dtype)
    x = torch.randn(B, 3, 3, dtype=dtype)
    return model, (model,), lambda: model(x).pow(2).sum(1)


CASES = [
    Case("mlp", lambda dt: _mlp(dt)),
    Case("mlp_no_bias", lambda dt: _mlp(dt, bias=False)),
    Case("mlp_losses_Bk", lambda dt: _mlp(dt, k=3)),
    Case("deep_tanh", _deep_tanh),
    Case("linear_seq_ghost", _linear_seq(2, 16, 16)),
    Case("linear_seq_materialized", _linear_seq(10, 2, 2)),
    Case("linear_4d_input", _linear_4d),
    Case("conv1d", _conv(lambda: nn.Conv1d(2, 3, 3, stride=2, padding=1), (2, 9))),
    Case(
        "conv2d_dilation_groups", _conv(lambda: nn.Conv2d(4, 6, 3, dilation=2, groups=2), (4, 7, 7))
    ),
    Case("conv2d_depthwise", _conv(lambda: nn.Conv2d(3, 3, 3, groups=3, bias=False), (3, 5, 5))),
    Case(
        "conv2d_same_reflect",
        _conv(lambda: nn.Conv2d(2, 3, (2, 3), padding="same", padding_mode="reflect"), (2, 5, 4)),
    ),
    Case("conv3d", _conv(lambda: nn.Conv3d(2, 2, 2, stride=(1, 2, 1), padding=1), (2, 3, 4, 3))),
    Case(
        "conv1d_circular_dilation_groups",
        _conv(
            lambda: nn.Conv1d(4, 6, 3, dilation=2, padding=2, padding_mode="circular", groups=2),
            (4, 8),
        ),
    ),
    Case(
        "conv3d_replicate_dilation_groups",
        _conv(
            lambda: nn.Conv3d(
                2, 4, (2, 1, 2), padding=1, dilation=(1, 1, 2), padding_mode="replicate", groups=2
            ),
            (2, 3, 2, 4),
        ),
    ),
    Case("cnn", _conv(_cnn, (2, 6, 6))),
    Case("cnn_groupnorm", _conv(_cnn_groupnorm, (2, 5, 5))),
    Case("embedding_padding", _embedding),
    Case("weight_tying", _tied),
    Case("called_twice", lambda dt: _simple(_Twice().to(dt), torch.randn(B, 4, dtype=dt))),
    Case("residual", lambda dt: _simple(_Residual().to(dt), torch.randn(B, 4, dtype=dt))),
    Case("transformer_block", _block),
    Case(
        "layernorm_mlp", _generic(lambda: nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), (3, 4))
    ),
    Case("rmsnorm_seq", _generic(lambda: nn.RMSNorm([2, 4]), (2, 4))),
    Case("generic_direct_params", _generic(lambda: _ScaleShift(3), (3,))),
    Case("generic_parent_and_child", _generic(_ParentWithParams, (3,))),
    Case("generic_two_outputs", lambda dt: _simple(_UsesTwo().to(dt), torch.randn(B, 3, dtype=dt))),
    Case("frozen_params", _frozen),
    Case("engine_on_subset", _subset),
    Case("eval_batchnorm", _eval_batchnorm),
    Case("eval_batchnorm_cnn", _eval_batchnorm_cnn),
    Case("tasks_batchnorm", _tasks_batchnorm, batch_dim=None),
    Case("seq_losses_Bk", _tasks_seq_bk),
    Case("tasks_mlp", _tasks_mlp, batch_dim=None),
    Case("tasks_cnn", _tasks_cnn, batch_dim=None),
    Case("tasks_conv_groups", _tasks_conv_groups, batch_dim=None),
    Case("tasks_transformer_block", _tasks_block, batch_dim=None),
    Case("tasks_weight_tying", _tasks_tied, batch_dim=None),
    Case("tasks_embedding_per_sample_losses", _embedding, batch_dim=None),
]
