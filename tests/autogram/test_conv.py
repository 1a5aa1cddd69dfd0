"""The closed form of ``nn.Conv1d/2d/3d`` against the brute-force Jacobian of an unhooked copy."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from jacflow.aggregation import ConstantWeighting
from jacflow.autogram import Engine, _linear
from jacflow.autogram._conv import ConvContribution
from tests.autogram.test_linear import (
    _losses_of,
    assert_change_refused,
    assert_exact_backward,
    assert_refused_per_sample,
)


class _UnbatchedConv(nn.Module):
    """A head on the batch ``[B, 4]`` plus a convolution on a buffer ``[1, *spatial]`` without
    the batch dimension: its output ``[3, *positions]`` starts with the batch's size (B = 3)."""

    def __init__(self, conv: nn.Module, spatial: tuple[int, ...]) -> None:
        super().__init__()
        self.head, self.conv = nn.Linear(4, 3), conv
        self.register_buffer("context", torch.randn(1, *spatial))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(x).sum(1) + self.conv(self.context).flatten(1).sum(1)


# each convolution type (built with 1 input channel, 3 outputs, kernel 2) and its input's size
UNBATCHED: list[tuple[type[nn.Module], tuple[int, ...]]] = [
    (nn.Conv1d, (5,)),
    (nn.Conv2d, (6, 6)),
    (nn.Conv3d, (3, 3, 3)),
]


@pytest.mark.parametrize("route", ["ghost", "conv", "unfold"])
@pytest.mark.parametrize(("conv", "spatial"), UNBATCHED, ids=["1d", "2d", "3d"])
def test_unbatched_input_per_sample_is_refused(
    conv: type[nn.Module], spatial: tuple[int, ...], route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per sample, the call without a batch dimension is refused as such on every route,
    before anything is written (the routes' reshapes failed with raw torch errors)."""
    monkeypatch.setattr(ConvContribution, "_route", lambda self: route)
    model = _UnbatchedConv(conv(1, 3, 2), spatial).double()
    assert_refused_per_sample(model, r"Conv\dd received an unbatched input of shape \(1, ")


@pytest.mark.parametrize(("conv", "spatial"), UNBATCHED, ids=["1d", "2d", "3d"])
def test_unbatched_input_per_task_is_exact(conv: type[nn.Module], spatial: tuple[int, ...]) -> None:
    """Per task the batch is one sample: the same call is differentiated exactly."""
    model = _UnbatchedConv(conv(1, 3, 2), spatial).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    assert_exact_backward(model, lambda m: torch.stack([m(x).pow(2).sum(), m(x).sum()]), None)


@pytest.mark.parametrize(
    ("channels", "size", "batch_dim", "k"),
    [(64, 32, 0, 1), (64, 32, 0, 4), (64, 32, None, 2), (128, 56, 0, 1), (64, 8, 0, 1)],
)
def test_depthwise_convolution_takes_the_grouped_route(
    channels: int, size: int, batch_dim: int | None, k: int
) -> None:
    """One input and one output channel per group: the grouped ``convolution_backward`` is a
    depthwise convolution, with no padded channel block (charged as one, the unfolded route
    was taken at 2-3.6x its time, measured: e.g. 60 against 16.5 ms for 64 channels of 32 x
    32, B = 32, 1 thread)."""
    conv = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
    with Engine(conv, batch_dim=batch_dim) as engine:
        out = conv(torch.randn(8, channels, size, size)).flatten(1)
        terms = [out[:, i::k].pow(2).sum(1) for i in range(k)]
        if batch_dim is None:
            losses = torch.stack([t.sum() for t in terms])
        else:
            losses = terms[0] if k == 1 else torch.stack(terms, dim=1)
        contribution = engine._prepare(losses, False, ())[0][0][1]
    assert isinstance(contribution, ConvContribution)
    assert contribution._route() == "conv"


# an attribute of a Conv2d(2, 3, 3, padding=1) set between its forward and the step
CHANGES: list[tuple[str, object]] = [
    ("stride", (2, 2)),
    ("dilation", (2, 2)),
    ("padding", (0, 0)),
    ("padding_mode", "circular"),
]


@pytest.mark.parametrize(("name", "value"), CHANGES, ids=[name for name, _ in CHANGES])
def test_attributes_changed_after_the_forward_are_refused(name: str, value: object) -> None:
    """The closed form reads the convolution's geometry at the step: one changed since the
    forward is refused, naming it, before anything is written (a raw shape error, or for the
    padding mode, whose shapes stay, a wrong step, silently); a forward after the change is
    differentiated exactly."""
    conv = nn.Conv2d(2, 3, 3, padding=1).double()
    x = torch.randn(3, 2, 5, 6, dtype=torch.float64)

    def change() -> None:
        setattr(conv, name, value)
        if name == "padding":  # (what the forward reads of it)
            conv._reversed_padding_repeated_twice = [0, 0, 0, 0]

    assert_change_refused(conv, lambda m: m(x).pow(2).sum((1, 2, 3)), change, 0, name)
    assert_exact_backward(conv, lambda m: m(x).pow(2).sum((1, 2, 3)), 0)


class _FunctionalConv(nn.Module):
    """A convolution run as ``F.conv2d`` on its child's parameters: the child is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.conv2d(x, self.conv.weight, self.conv.bias)


def test_functional_use_of_a_hooked_weight_is_named() -> None:
    """A parent that convolves with its child's weight functionally has no call recorded: the
    refusal names the parameter that the losses read and the functional use as a cause (it
    gave only the causes of a missing forward), and writes nothing."""
    model = _FunctionalConv().double()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with Engine(model, batch_dim=0) as engine:
        losses = model(torch.randn(2, 2, 5, 5, dtype=torch.float64)).pow(2).sum((1, 2, 3))
        with pytest.raises(
            RuntimeError, match=r"reads? the hooked parameter .*conv\.(weight|bias)"
        ):
            engine.backward(losses, ConstantWeighting(torch.ones(2, dtype=torch.float64)))
    assert all(bool((p.grad == 1).all()) for p in model.parameters())


@pytest.mark.parametrize("route", ["conv", "unfold"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("batch_dim", "k"), [(0, 1), (0, 2), (None, 3)])
def test_per_row_gradients_larger_than_the_inputs_are_formed_by_blocks(
    route: str, bias: bool, batch_dim: int | None, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A convolution's per-row gradients larger than its inputs and output gradients (a
    kernel of 8 x 8 x 3 x 3 on 2 x 2 maps, called twice) are formed by blocks of output
    channels, each at most their size (here with no floor), their Gramians summed and their
    bias rows joined: exact."""
    monkeypatch.setattr(_linear, "PER_ROW_BLOCK_FLOOR", 1)
    monkeypatch.setattr(ConvContribution, "_route", lambda self: route)
    blocks: list[int] = []
    row_grads = ConvContribution._row_grads

    def counted(
        self: ConvContribution,
        route: str | None = None,
        with_bias: bool = False,
        channels: slice = slice(None),
    ) -> tuple[Tensor, Tensor | None]:
        grads, bias_rows = row_grads(self, route, with_bias, channels)
        blocks.append(grads.shape[1])
        return grads, bias_rows

    monkeypatch.setattr(ConvContribution, "_row_grads", counted)
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, 3, padding=1, bias=bias)
    model = nn.Sequential(conv, nn.Tanh(), conv, nn.Flatten()).double()
    x = torch.randn(4, 8, 2, 2, dtype=torch.float64)
    assert_exact_backward(model, _losses_of(x, batch_dim, k), batch_dim)
    assert max(blocks) < 8 and len(blocks) >= 2
