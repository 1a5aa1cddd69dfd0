"""The engine's reused ``.grad`` memory: right values, and nothing a caller holds overwritten."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import Tensor, nn

from jacflow.aggregation import UPGradWeighting
from jacflow.autogram import Engine, _buffers, mtl_gramian_step
from jacflow.autogram._buffers import GradientBuffers
from tests.autogram.test_engine import reference_jacobian

# float64 Linear(512, 512): 2 MiB weights, above the smallest the engine keeps buffers for
WIDTH = 512
# (without torch's storage reference count, the engine never reuses memory)
counted = pytest.mark.skipif(_buffers._use_count is None, reason="no storage use count")


def _model(tied: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    first, second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    if tied:
        second.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), second, nn.Tanh(), nn.Linear(WIDTH, 3)).double()


def _batch(seed: int) -> Tensor:
    return torch.randn(6, WIDTH, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _losses(model: nn.Module, x: Tensor) -> Tensor:
    return model(x).pow(2).sum(1)


def _expected_grads(model: nn.Module, x: Tensor) -> list[Tensor]:
    """UPGrad's update ``w @ J`` from the reference Jacobian, split per parameter."""
    params = list(model.parameters())
    losses = _losses(model, x)
    jacobian = reference_jacobian(losses, params)
    update = UPGradWeighting()(jacobian @ jacobian.T) @ jacobian
    return [u.reshape(p.shape) for p, u in zip(params, update.split([p.numel() for p in params]))]


def _step(model: nn.Module, engine: Engine, x: Tensor) -> None:
    engine.backward(_losses(model, x), UPGradWeighting())


def _assert_grads(model: nn.Module, expected: list[Tensor]) -> None:
    for param, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(_grad(param), grad)


def _grad(param: Tensor) -> Tensor:
    assert param.grad is not None
    return param.grad


@counted
def test_memory_is_reused_once_the_gradients_are_dropped() -> None:
    model = _model()
    engine = Engine(model, batch_dim=0)
    _step(model, engine, _batch(1))
    address = _grad(model[0].weight).data_ptr()
    model.zero_grad()  # set_to_none
    _step(model, engine, _batch(2))
    assert _grad(model[0].weight).data_ptr() == address
    _assert_grads(model, _expected_grads(model, _batch(2)))


def test_gradients_the_caller_keeps_are_not_overwritten() -> None:
    """A kept ``.grad``, a view of one: their values survive the next steps."""
    model = _model()
    engine = Engine(model, batch_dim=0)
    _step(model, engine, _batch(1))
    kept = _grad(model[0].weight)
    kept_values = kept.clone()
    model.zero_grad()
    _step(model, engine, _batch(2))
    view = _grad(model[2].weight).view(-1)
    view_values = view.clone()
    model.zero_grad()
    _step(model, engine, _batch(3))
    torch.testing.assert_close(kept, kept_values, rtol=0, atol=0)
    torch.testing.assert_close(view, view_values, rtol=0, atol=0)
    _assert_grads(model, _expected_grads(model, _batch(3)))


def test_memory_held_another_way_is_not_overwritten() -> None:
    """The storage object of a ``.grad`` kept by the caller, and a ``.grad`` whose memory was
    shared with other processes (what a ``torch.multiprocessing`` queue does): both survive."""
    model = _model()
    engine = Engine(model, batch_dim=0)
    _step(model, engine, _batch(1))
    storage = _grad(model[0].weight).untyped_storage()
    stored_values = _grad(model[0].weight).clone()
    _grad(model[2].weight).share_memory_()  # then dropped: only its sharing is left
    model.zero_grad()
    _step(model, engine, _batch(2))
    view = torch.empty(0, dtype=torch.float64).set_(storage).view(WIDTH, WIDTH)
    torch.testing.assert_close(view, stored_values, rtol=0, atol=0)
    assert not _grad(model[2].weight).is_shared()  # fresh memory, not the shared buffer
    _assert_grads(model, _expected_grads(model, _batch(2)))


def test_parameters_can_still_be_swapped() -> None:
    """No weak reference to a parameter (``torch.utils.swap_tensors`` refuses those): swapping
    conversions and ``load_state_dict`` keep working after steps."""
    model = _model()
    engine = Engine(model, batch_dim=0)
    _step(model, engine, _batch(1))
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.zero_grad()
        model.load_state_dict(_model().state_dict())
        model.float().double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    model.zero_grad()
    _step(model, engine, _batch(2))
    _assert_grads(model, _expected_grads(model, _batch(2)))


def test_steps_without_zero_grad_accumulate() -> None:
    model = _model()
    engine = Engine(model, batch_dim=0)
    first, second = _expected_grads(model, _batch(1)), _expected_grads(model, _batch(2))
    _step(model, engine, _batch(1))
    _step(model, engine, _batch(2))
    _assert_grads(model, [a + b for a, b in zip(first, second, strict=True)])


def test_a_tied_weight_gets_both_uses_over_steps() -> None:
    model = _model(tied=True)
    engine = Engine(model, batch_dim=0)
    for seed in (1, 2, 3):
        model.zero_grad()
        _step(model, engine, _batch(seed))
        _assert_grads(model, _expected_grads(model, _batch(seed)))


@counted
def test_small_held_or_accumulated_parameters_get_no_buffer() -> None:
    buffers = GradientBuffers()
    small = nn.Parameter(torch.zeros(8, 8))
    assert buffers.take(small) is None
    large = nn.Parameter(torch.zeros(512, 512))
    large.grad = torch.zeros(512, 512)
    assert buffers.take(large) is None  # accumulated into instead
    large.grad = None
    buffer = buffers.take(large)
    assert buffer is not None and buffer.shape == large.shape and buffer.dtype == large.dtype
    large.data = torch.zeros(512, 512, dtype=torch.float64)  # dtype changed: a fresh buffer
    again = buffers.take(large)
    assert again is not None and again.dtype == torch.float64


@counted
def test_remove_releases_the_kept_memory() -> None:
    model = _model()
    engine = Engine(model, batch_dim=0)
    _step(model, engine, _batch(1))
    base = _grad(model[0].weight)._base
    assert base is not None  # .grad is a view of the engine's buffer
    kept = weakref.ref(base)
    del base
    model.zero_grad()
    assert kept() is not None  # held by the engine between steps
    engine.remove()
    gc.collect()
    assert kept() is None


def _per_task_step(trunk: nn.Module, engine: Engine, x: Tensor, m: int) -> Tensor:
    """One per-task step on ``m`` losses of the trunk's features; returns the reference
    update ``w @ J`` (``w`` from the reference Gramian) over the trunk's parameters."""
    features = trunk(x)
    losses = torch.stack([features[:, k::m].pow(2).mean() * (k + 1) for k in range(m)])
    jacobian = reference_jacobian(losses, list(trunk.parameters()))
    expected = UPGradWeighting()(jacobian @ jacobian.T) @ jacobian
    mtl_gramian_step(losses, engine, UPGradWeighting())
    return expected


@counted
def test_per_task_steps_reuse_memory_only_when_their_gradients_dominate() -> None:
    """Two tasks on a small batch: the new gradients outweigh the captured ones, and their
    memory is reused; many rows (the captured gradients outweigh the weights): fresh tensors."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)).double()
    engine = Engine(trunk, batch_dim=None)
    addresses = []
    for seed in (1, 2):
        trunk.zero_grad()
        expected = _per_task_step(trunk, engine, _batch(seed), m=2)
        actual = torch.cat([_grad(p).flatten() for p in trunk.parameters()])
        torch.testing.assert_close(actual, expected)
        addresses.append(_grad(trunk[0].weight).data_ptr())
    assert addresses[0] == addresses[1]
    trunk.zero_grad()
    # 256 rows, 3 tasks: captured 1.5 x a weight per layer (and the ghost route, not the kept
    # per-row gradients, which never use buffers)
    wide = torch.randn(WIDTH // 2, WIDTH, dtype=torch.float64)
    expected = _per_task_step(trunk, engine, wide, m=3)
    actual = torch.cat([_grad(p).flatten() for p in trunk.parameters()])
    torch.testing.assert_close(actual, expected)
    # a fresh tensor: the kept memory, still held by the engine, is elsewhere
    assert _grad(trunk[0].weight).data_ptr() != addresses[1]
