"""Engine lifecycle (hooks, stray forwards, several engines) and its error messages."""

from __future__ import annotations

import contextlib
import copy
import functools
import random
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils import parametrize

from jacflow.aggregation import ConstantWeighting, Krum, MeanWeighting, UPGrad, UPGradWeighting
from jacflow.autogram import Engine, mtl_gramian_step
from jacflow.autogram import _engine as engine_module
from jacflow.autogram._fallback import FallbackRule, ReplayMismatchError
from jacflow.autogram._rules import Call, Contribution, Rows, Rule, register_rule
from tests.autogram._zoo import Scale
from tests.autogram.test_engine import assert_exact_gramian, assert_exact_step, reference_jacobian


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def _losses(model: nn.Module, x: Tensor) -> Tensor:
    return model(x).pow(2).sum(1)


def _expected(model: nn.Module, x: Tensor) -> Tensor:
    losses = _losses(model, x)
    jacobian = reference_jacobian(losses, list(model.parameters()))
    return jacobian @ jacobian.T


X = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3)


def _assert_exact(
    model: nn.Module, x: Tensor, batch_dim: int | None, between: Callable[[], object] = list
) -> None:
    """The Gramian of one forward's losses (per sample: each row's squared norm; per task: two
    losses) equals the brute-force ``J J^T``; ``between`` runs after the forward, before the
    step."""
    with Engine(model, batch_dim=batch_dim) as engine:
        out = model(x)
        losses = out.pow(2).sum(1) if batch_dim == 0 else torch.stack([out.sum(), out[0, 1]])
        jacobian = reference_jacobian(losses, [p for p in model.parameters() if p.requires_grad])
        between()
        gramian = engine.compute_gramian(losses)
    torch.testing.assert_close(gramian, jacobian @ jacobian.T, rtol=1e-6, atol=1e-6)


def test_stray_grad_forwards_are_ignored() -> None:
    model = _mlp()
    engine = Engine(model, batch_dim=0)
    _losses(model, torch.randn(7, 3, dtype=torch.float64))  # never backpropagated
    model.eval()
    _losses(model, X[:2])  # evaluation forward with grad enabled
    model.train()
    losses = _losses(model, X)
    torch.testing.assert_close(engine.compute_gramian(losses), _expected(model, X))


def test_no_grad_forwards_are_not_recorded() -> None:
    model = _mlp()
    engine = Engine(model, batch_dim=0)
    with torch.no_grad():
        model(X)
    assert engine._recorder.calls == []
    torch.testing.assert_close(engine.compute_gramian(_losses(model, X)), _expected(model, X))


def test_losses_from_older_forward_after_a_newer_one() -> None:
    model = _mlp()
    engine = Engine(model, batch_dim=0)
    losses = _losses(model, X)
    _losses(model, torch.randn(5, 3, dtype=torch.float64))
    torch.testing.assert_close(engine.compute_gramian(losses), _expected(model, X))


def test_two_engines_on_one_model() -> None:
    model = _mlp()
    whole = Engine(model, batch_dim=0)
    last = Engine(model[2], batch_dim=0)
    losses = _losses(model, X)
    jacobian = reference_jacobian(losses, list(model.parameters()))
    torch.testing.assert_close(whole.compute_gramian(losses), jacobian @ jacobian.T)
    tail = jacobian[:, -model[2].weight.numel() - model[2].bias.numel() :]
    torch.testing.assert_close(last.compute_gramian(losses), tail @ tail.T)


def test_remove_and_context_manager() -> None:
    model = _mlp()
    with Engine(model, batch_dim=0) as engine:
        assert len(engine._recorder.handles) == 2
    assert all(not module._forward_hooks for module in model.modules())
    engine.remove()  # twice is harmless
    with pytest.raises(RuntimeError, match=r"removed"):
        engine.compute_gramian(_losses(model, X))
    with pytest.raises(RuntimeError, match=r"removed"):  # before any check of the losses
        engine.compute_gramian(_losses(model, X).detach())


def test_clear_drops_recorded_calls() -> None:
    model = _mlp()
    engine = Engine(model, batch_dim=0)
    losses = _losses(model, X)
    engine.clear()
    with pytest.raises(RuntimeError, match=r"No forward call of the hooked modules"):
        engine.compute_gramian(losses)


def test_gramian_then_plain_backward_like_torchjd() -> None:
    model = _mlp()
    engine = Engine(model, batch_dim=0)
    losses = _losses(model, X)
    gramian = engine.compute_gramian(losses)
    assert not gramian.requires_grad
    weights = UPGradWeighting()(gramian)
    losses.backward(weights)
    jacobian = reference_jacobian(_losses(model, X), list(model.parameters()))
    actual = torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]
    torch.testing.assert_close(actual, weights @ jacobian)


def test_nothing_written_when_weighting_fails() -> None:
    class Broken(MeanWeighting.__mro__[1]):  # type: ignore[misc, name-defined]
        def forward(self, stat: Tensor) -> Tensor:
            raise RuntimeError("solver failed")

    model = _mlp()
    engine = Engine(model, batch_dim=0)
    with pytest.raises(RuntimeError, match="solver failed"):
        engine.backward(_losses(model, X), Broken())
    assert all(p.grad is None for p in model.parameters())


def test_batchnorm_without_running_statistics_rejected_at_construction() -> None:
    """Without running statistics a BatchNorm normalises with its batch's in every mode: it
    mixes the samples, whatever the mode of the forward."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False)).eval()
    with pytest.raises(ValueError, match=r"modules\[0\]\.1 is a BatchNorm1d without running"):
        Engine(model, batch_dim=0)
    Engine(model, batch_dim=None).remove()  # per-task mode allows it


def test_training_batchnorm_put_in_eval_mode_after_construction() -> None:
    """A module starts in training mode: created on one, then put in eval mode before the
    forward of the losses, the engine gives the exact Gramian; the forward of losses in
    training mode is refused at the step, before anything is written."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    engine = Engine(model, batch_dim=0)
    losses = model(X).sum(1)
    with pytest.raises(ValueError, match=r"normalised with its batch's statistics"):
        engine.compute_gramian(losses)
    assert all(p.grad is None for p in model.parameters())
    model.eval()
    losses = model(X).sum(1)
    jacobian = reference_jacobian(losses, list(model.parameters()))
    torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)


def test_batchnorm_switched_to_batch_statistics_rejected_at_step() -> None:
    """Switched to training mode, or its running statistics dropped, after the engine was built:
    refused at the step, before anything is written."""
    for switch in ("train", "drop_running"):
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double().eval()
        engine = Engine(model, batch_dim=0)
        if switch == "train":
            model.train()
        else:
            model[1].running_mean = model[1].running_var = None
        losses = model(X).sum(1)
        with pytest.raises(ValueError, match=r"normalised with its batch's statistics"):
            engine.compute_gramian(losses)
        assert all(p.grad is None for p in model.parameters())


def _batchnorm_mlp() -> nn.Sequential:
    layers = [nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(inplace=True), nn.Linear(4, 2)]
    return nn.Sequential(*layers).double().eval()


def test_stray_training_batchnorm_forward_is_ignored() -> None:
    """A grad-enabled forward in training mode that the losses do not read (a metric on
    another batch) mixes none of their samples: the next step is exact, its update too."""
    model = _batchnorm_mlp()
    engine = Engine(model, batch_dim=0)
    model.train()
    model(torch.randn(6, 3, dtype=torch.float64))  # (kept nowhere; updates the statistics)
    model.eval()
    losses = _losses(model, X)
    jacobian = reference_jacobian(losses, list(model.parameters()))
    torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)
    model.train()
    kept = model(torch.randn(6, 3, dtype=torch.float64))  # (kept alive: still not read)
    model.eval()
    losses = _losses(model, X)  # (the statistics changed: another Jacobian)
    jacobian = reference_jacobian(losses, list(model.parameters()))
    weights = engine.backward(losses, MeanWeighting())
    expected = weights @ jacobian
    update = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(update, expected)
    assert kept.grad_fn is not None


def test_training_batchnorm_read_by_the_losses_is_rejected() -> None:
    """Read through an in-place op on its output (which replaces the output's node) and with a
    stray forward of the same module in eval mode before it: still refused."""
    model = _batchnorm_mlp()
    engine = Engine(model, batch_dim=0)
    model(X)
    model.train()
    losses = _losses(model, X)
    with pytest.raises(ValueError, match=r"modules\[0\]\.1 \(BatchNorm1d\) normalised"):
        engine.compute_gramian(losses)
    assert all(p.grad is None for p in model.parameters())


class _OwnForwardGRU(nn.GRU):
    def forward(self, input: Tensor, hx: Tensor | None = None) -> tuple[Tensor, Tensor]:
        out, h = super().forward(input, hx)
        return out * 2, h


def test_uncovered_rnn_rejected_with_batch_dim() -> None:
    """A recurrent layer the closed form does not cover cannot be re-run per sample (torch's
    fused kernels have no vmap rule); a plain GRU is covered."""
    with pytest.raises(ValueError, match=r"is a _OwnForwardGRU.*batch_dim=None"):
        Engine(_OwnForwardGRU(3, 4, batch_first=True), batch_dim=0)
    Engine(nn.GRU(3, 4, batch_first=True), batch_dim=0).remove()


def test_compiled_module_rejected_with_workaround() -> None:
    compiled = torch.compile(_mlp())
    with pytest.raises(ValueError, match=r"is compiled.*uncompiled module.*parallel_chunk_size=1"):
        Engine(compiled, batch_dim=0)


class _CountingTokens(nn.Module):
    """An embedding inside a module with a parameter of its own: under the generic rule."""

    def __init__(self, bag: bool) -> None:
        super().__init__()
        kind = nn.EmbeddingBag if bag else nn.Embedding
        self.emb = kind(6, 3, scale_grad_by_freq=True)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, ids: Tensor) -> Tensor:
        return self.emb(ids) * self.scale


_IDS = torch.tensor([[1, 2, 2, 0], [2, 3, 1, 1], [5, 5, 5, 2]])


def _frequency_losses(module: nn.Module, batch_dim: int | None) -> Tensor:
    out = module(_IDS).reshape(3, -1)
    losses = (out * torch.arange(1.0, out.shape[1] + 1, dtype=out.dtype)).sin().sum(1)
    return losses if batch_dim == 0 else torch.stack([losses.sum(), losses[0] * losses[1]])


@pytest.mark.parametrize("batch_dim", [0, None])
def test_scale_grad_by_freq_embedding_is_exact(batch_dim: int | None) -> None:
    """The gradient divided by each token's count in the call (over the whole batch), twice
    in one forward, with padding: exact per sample and per task (it was refused)."""
    torch.manual_seed(0)
    emb = nn.Embedding(6, 3, padding_idx=0, scale_grad_by_freq=True).double()
    engine = Engine(emb, batch_dim=batch_dim)

    def losses_of() -> Tensor:
        doubled = _IDS[:, :2]
        out = emb(_IDS).reshape(3, -1) + emb(doubled).sum(1).repeat(1, 4)
        losses = (out * torch.arange(1.0, 13.0, dtype=torch.float64)).sin().sum(1)
        return losses if batch_dim == 0 else torch.stack([losses.sum(), losses[0] * losses[1]])

    assert_exact_gramian(engine, losses_of(), [emb.weight])
    jacobian = reference_jacobian(losses_of(), [emb.weight])
    weights = engine.backward(losses_of(), UPGradWeighting())
    assert emb.weight.grad is not None
    torch.testing.assert_close(emb.weight.grad.flatten(), weights.flatten() @ jacobian)


@pytest.mark.parametrize("bag", [False, True])
@pytest.mark.parametrize("when", ["creation", "step"])
def test_scale_grad_by_freq_under_the_generic_rule_is_refused_per_sample(
    bag: bool, when: str
) -> None:
    """Per sample, the generic rule re-runs its module sample by sample, which counts one
    sample's tokens: refused (an EmbeddingBag's Gramian was silently wrong, 20 off in 30).
    Per task it re-runs the whole call: exact."""
    module = _CountingTokens(bag).double()
    if when == "creation":
        with pytest.raises(ValueError, match=r"_CountingTokens\.emb is an embedding with"):
            Engine(module, batch_dim=0)
    else:
        module.emb.scale_grad_by_freq = False
        engine = Engine(module, batch_dim=0)
        module.emb.scale_grad_by_freq = True
        with pytest.raises(ValueError, match=r"scale_grad_by_freq=True under the generic rule"):
            engine.backward(_frequency_losses(module, 0), UPGradWeighting())
        assert all(p.grad is None for p in module.parameters())
        engine.remove()
    engine = Engine(module, batch_dim=None)
    assert_exact_gramian(engine, _frequency_losses(module, None), list(module.parameters()))


def _assert_refused(engine: Engine, losses: Tensor, params: list[Tensor], match: str) -> None:
    """The step raises a ``ValueError`` (or ``RuntimeError``) matching ``match`` and writes
    no ``.grad``."""
    with pytest.raises((ValueError, RuntimeError), match=match):
        engine.backward(losses, UPGradWeighting())
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("batch_dim", [0, None])
def test_embedding_bag_with_offsets(batch_dim: int | None) -> None:
    """Bags given as one flat input with ``offsets``: per sample the generic rule split the
    offsets and not the tokens (torch's own error, about offsets[0]); now refused with the
    way out. Per task, exact."""
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(9, 3, mode="mean").double()
    tokens, offsets = torch.tensor([1, 2, 2, 0, 5, 3, 3, 8, 1, 4]), torch.tensor([0, 4, 7])
    engine = Engine(bag, batch_dim=batch_dim)
    losses = bag(tokens, offsets).pow(2).sum(1)
    if batch_dim == 0:
        _assert_refused(engine, losses, [bag.weight], r"flat input and `offsets`.*2-D input")
        return
    assert_exact_gramian(engine, torch.stack([losses.sum(), losses[0] * losses[2]]), [bag.weight])


@pytest.mark.parametrize("batch_dim", [True, "0", 0.0])
def test_bad_batch_dim(batch_dim: object) -> None:
    """A value of another type than int or None (``"0"``, ``True``) is a ``TypeError``."""
    with pytest.raises(TypeError, match=r"`batch_dim` must be an int or None"):
        Engine(_mlp(), batch_dim=batch_dim)  # type: ignore[arg-type]


def _losses_with_batch_at(out: Tensor, layout: str) -> Tensor:
    """Per-sample losses from ``out`` (``[B, 2]``) with the batch elsewhere than first."""
    if layout == "[k, B]":
        return out.T.pow(2)
    if layout == "[k, 1, B]":
        return out.pow(2).T.unsqueeze(1)
    return torch.stack([out.pow(2), out.tanh()], 1).permute(2, 1, 0)  # [k, 2, B]


@pytest.mark.parametrize(
    ("layout", "batch_dim"),
    [("[k, B]", 1), ("[k, B]", -1), ("[k, 1, B]", 2), ("[k, 2, B]", -1)],
)
def test_batch_dim_of_the_losses_anywhere(layout: str, batch_dim: int) -> None:
    """Per sample with the losses' batch at ``batch_dim`` (the modules' at 0): the Gramian is
    the brute-force ``J J^T`` of ``losses.flatten()``, in that order, as TorchJD's, and the step
    writes ``w @ J`` with the weights of that Gramian, returned in the losses' shape. The
    weighting below weighs each loss by its place, so that any other order shows."""
    model = _mlp()
    params = list(model.parameters())
    losses = _losses_with_batch_at(model(X), layout)
    m = losses.numel()
    jacobian = reference_jacobian(losses, params)
    by_place = ConstantWeighting(torch.linspace(0.5, 2.0, m, dtype=torch.float64))
    with Engine(model, batch_dim=batch_dim) as engine:
        gramian = engine.compute_gramian(_losses_with_batch_at(model(X), layout))
        torch.testing.assert_close(gramian, jacobian @ jacobian.T)
        weights = engine.backward(_losses_with_batch_at(model(X), layout), UPGradWeighting())
        assert weights.shape == losses.shape
        update = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
        torch.testing.assert_close(update, weights.flatten() @ jacobian)
        # (the weights of a singular Gramian are not unique, the update is: [k, 2, B] has rank 8)
        expected = UPGradWeighting()(jacobian @ jacobian.T) @ jacobian
        torch.testing.assert_close(update, expected, rtol=0, atol=1e-8)
        model.zero_grad()
        weights = engine.backward(_losses_with_batch_at(model(X), layout), by_place)
        update = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
        torch.testing.assert_close(update, by_place.weights @ jacobian)


def test_batch_dim_other_params_follow_the_given_order() -> None:
    """``other_params`` get ``sum_i w_i grad(losses_i)`` with ``w`` in the losses' own order."""
    model, head = _mlp(), nn.Linear(2, 2).double()
    weighting = ConstantWeighting(torch.linspace(0.5, 2.0, 8, dtype=torch.float64))
    with Engine(model, batch_dim=1) as engine:
        engine.backward(head(model(X)).T.pow(2), weighting, other_params=head.parameters())
    losses = head(model(X)).T.pow(2)
    jacobian = reference_jacobian(losses, list(head.parameters()))
    update = torch.cat([p.grad.flatten() for p in head.parameters()])  # type: ignore[union-attr]
    torch.testing.assert_close(update, weighting.weights @ jacobian)


def test_batch_dim_out_of_the_losses_range_is_refused() -> None:
    """A ``batch_dim`` the losses do not have is refused, naming the shape, and the forward
    stays for a retry with the right one."""
    model = _mlp()
    params = list(model.parameters())
    with Engine(model, batch_dim=2) as engine:
        losses = model(X).T.pow(2)
        _assert_refused(engine, losses, params, r"must have a dimension 2, received shape \(2, 4\)")
        engine.batch_dim = 1
        engine.backward(losses, UPGradWeighting())
    assert all(p.grad is not None for p in params)


@pytest.mark.parametrize("reorder", ["sort", "index", "sort_after", "index_after", "gather"])
def test_batch_dim_reordered_losses_are_refused_through_the_move(reorder: str) -> None:
    """Losses reordered along the batch, before the transpose that puts it at ``batch_dim`` or
    after it, are refused as at dimension 0 (with that refusal, not the separation probe's):
    the check follows the batch through the transposes."""
    model = _mlp()
    perm = torch.tensor([1, 0, 3, 2])
    with Engine(model, batch_dim=1) as engine:
        out = model(X).pow(2)
        if reorder == "sort":
            losses = out.sort(0).values.T
        elif reorder == "index":
            losses = out[perm].T
        elif reorder == "sort_after":
            losses = out.T.sort(1).values
        elif reorder == "index_after":
            losses = out.T[:, perm]
        else:
            losses = out.T.gather(1, perm.expand(2, 4))
        _assert_refused(engine, losses, list(model.parameters()), r"reordered along the batch")


@pytest.mark.parametrize("chain", ["index", "index_after_scaling", "index_select"])
def test_batch_dim_reorderings_that_cancel_out_are_exact(chain: str) -> None:
    """After the transpose that puts the batch at ``batch_dim``, a chain of reorderings along
    it that leaves each loss at its own place (a permutation then its inverse, through an
    elementwise op or not) is accepted and exact, as at dimension 0 (it was refused); one that
    does not cancel out is refused."""
    model = _mlp()
    params = list(model.parameters())
    perm, inverse = torch.tensor([2, 0, 3, 1]), torch.tensor([1, 3, 0, 2])
    with Engine(model, batch_dim=1) as engine:

        def losses_of(second: Tensor) -> Tensor:
            out = model(X).pow(2).T
            if chain == "index":
                return out[:, perm][:, second]
            if chain == "index_after_scaling":
                return (2.0 * out[:, perm]).exp()[:, second]
            return out.index_select(1, perm).index_select(1, second)

        assert_exact_gramian(engine, losses_of(inverse), params)
        _assert_refused(engine, losses_of(perm), params, r"reordered along the batch")
        # (a reordering below the pair that cancels out is still seen: the walk ended there)
        below = torch.tensor([1, 0, 3, 2])
        out = model(X)[below].pow(2).T
        _assert_refused(engine, out[:, perm][:, inverse], params, r"reordered along the batch")
        # (so is one above a gather in place, which replaced the order composed above it)
        identity = torch.arange(4).expand(2, 4)
        out = model(X).pow(2).T
        _assert_refused(
            engine, out.gather(1, identity)[:, below], params, r"reordered along the batch"
        )


def test_batch_dim_reordering_the_other_dimension_is_exact() -> None:
    """A reordering along the losses' other dimension (the tasks of ``[k, B]``) is no
    reordering of the samples: accepted, and the Gramian is the brute force's."""
    model = _mlp()
    with Engine(model, batch_dim=1) as engine:
        assert_exact_gramian(engine, model(X).pow(2).T.flip(0)[[1, 0]], list(model.parameters()))


@pytest.mark.parametrize("refusing", ["constant", "class"])
def test_a_refused_weighting_leaves_the_forward_for_a_retry(refusing: str) -> None:
    """A weighting that refuses the number of losses (``ConstantWeighting`` of another size)
    refused it after the step had taken the forward's recorded calls: the retry with a right
    weighting found none. It is refused before now (as ``jacflow.backward`` refuses an
    aggregator's rows before differentiating), as is a weighting's class given for an
    instance, named as such; the retry gives the exact step and no ``.grad`` was written."""
    model = _mlp()
    params = list(model.parameters())
    with Engine(model, batch_dim=0) as engine:
        losses = model(X).pow(2).sum(1)
        if refusing == "constant":
            weighting: Any = ConstantWeighting(torch.ones(3, dtype=torch.float64))
            match = "3 `weights` but the input has 4 rows"
            with pytest.raises(ValueError, match=match):
                engine.backward(losses, weighting)
        else:
            with pytest.raises(TypeError, match=r"the class UPGradWeighting .*UPGradWeighting\(\)"):
                engine.backward(losses, UPGradWeighting)  # type: ignore[arg-type]
        assert all(p.grad is None for p in params)
        jacobian = reference_jacobian(losses, params)
        weights = engine.backward(losses, UPGradWeighting())
    torch.testing.assert_close(weights, UPGradWeighting()(jacobian @ jacobian.T))
    torch.testing.assert_close(torch.cat([p.grad.flatten() for p in params]), weights @ jacobian)


def test_bad_modules() -> None:
    with pytest.raises(ValueError, match=r"at least one module"):
        Engine(batch_dim=0)
    with pytest.raises(TypeError, match=r"modules\[0\] is <class 'int'>"):
        Engine(3, batch_dim=0)  # type: ignore[arg-type]


def test_bad_losses() -> None:
    model = _mlp()
    engine = Engine(model, batch_dim=0)
    with pytest.raises(TypeError, match=r"`losses` must be a torch.Tensor"):
        engine.compute_gramian([1.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"received <class 'list'> \(.*torch\.stack\(losses\)\)"):
        engine.compute_gramian(list(_losses(model, X)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"does not require grad"):
        engine.compute_gramian(torch.ones(3))
    with pytest.raises(ValueError, match=r"received a scalar"):
        engine.compute_gramian(_losses(model, X).sum())
    with pytest.raises(ValueError, match=r"one element per task"):
        Engine(model, batch_dim=None).compute_gramian(torch.ones(0, requires_grad=True))


@pytest.mark.parametrize("clear", [False, True])
def test_an_empty_batch_is_refused_with_the_way_out(clear: bool) -> None:
    """A batch of no sample (every sample filtered out) is refused, naming the empty batch and
    the way out (skip the step), with ``.grad`` untouched; the next step, after
    ``engine.clear()`` or not, is the brute force's."""
    model = _mlp()
    params = list(model.parameters())
    with Engine(model, batch_dim=0) as engine:
        empty = _losses(model, X[:0])
        for step in (
            engine.compute_gramian,
            lambda losses: engine.backward(losses, UPGradWeighting()),
        ):
            with pytest.raises(ValueError, match=r"hold no sample \(shape \(0,\)\).*Skip the step"):
                step(empty)
        assert all(p.grad is None for p in params)
        # (no task's losses for a full batch: not an empty batch)
        engine.batch_dim = 1
        with pytest.raises(ValueError, match=r"at least one element, received shape \(0, 4\)"):
            engine.compute_gramian(_losses(model, X)[None][:0])
        engine.batch_dim = 0
        if clear:
            engine.clear()
        assert_exact_gramian(engine, _losses(model, X), params)


def test_batch_size_mismatch() -> None:
    model = _mlp()
    engine = Engine(model, batch_dim=0)
    losses = model(X).pow(2).sum(0)  # [2]: not per-sample
    with pytest.raises(ValueError, match=r"batch size 2 on dimension 0, received shape \(4, 5\)"):
        engine.compute_gramian(losses)


class _WithStatistic(nn.Module):
    """A learned scale that also returns a statistic of its batch, as a module returning an
    auxiliary loss term does: a 0-d one (``scalar``), or one per feature (``[d]``, without
    the batch dimension), ``detached`` or not."""

    def __init__(self, statistic: str) -> None:
        super().__init__()
        self.statistic = statistic
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.tanh(x * self.s)
        if self.statistic == "scalar":
            return h, h.pow(2).mean()
        return h, h.mean(0).detach() if self.statistic == "detached" else h.mean(0)


class _ScaleRule(Rule):
    """A closed form of :class:`_WithStatistic`'s scale, which reads its first output only:
    row ``r``'s gradient is the sum over its sample of ``x * (1 - h^2) * dL_r/dh``."""

    def prepare(
        self, module: nn.Module, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> Contribution:
        assert isinstance(module, _WithStatistic)
        (call,) = calls
        x = rows.gather(rows.samples(call.input()))
        h = torch.tanh(x * module.s.detach())
        return _RowGrads(x * (1 - h**2) * call.grad(0))


class _RowGrads(Contribution):
    def __init__(self, grads: Tensor) -> None:
        self.grads = grads

    def gramian(self, names: set[str]) -> Tensor | None:
        return self.grads @ self.grads.T

    def per_row_grads(self, name: str) -> Tensor:
        return self.grads

    def weighted_grads(self, weights: Tensor) -> dict[str, Tensor]:
        return {"s": weights @ self.grads}


class _ReplayingScaleRule(_ScaleRule):
    """:class:`_ScaleRule`, declared as a rule that replays its module (as the attention and
    recurrent rules do): the engine records what a replay needs."""

    def replays(self) -> bool:
        return True


class _ClosedWithStatistic(_WithStatistic):
    """:class:`_WithStatistic` under the closed form :class:`_ScaleRule`."""


class _ReplayedWithStatistic(_WithStatistic):
    """:class:`_WithStatistic` under :class:`_ReplayingScaleRule`."""


register_rule(_ClosedWithStatistic, _ScaleRule())
register_rule(_ReplayedWithStatistic, _ReplayingScaleRule())


@pytest.mark.parametrize(
    ("statistic", "rule"),
    [
        ("scalar", FallbackRule),
        ("detached", FallbackRule),  # (the way out that the refusal below names)
        ("per feature", _ScaleRule),
        ("per feature", _ReplayingScaleRule),
    ],
)
def test_an_unread_output_without_the_batch_is_left_out(statistic: str, rule: type) -> None:
    """A module that returned, beside its output, a statistic of its batch that the losses do
    not read (a 0-d auxiliary loss term) was refused per sample, with a message about the
    losses' shape. The statistic adds nothing to the rows' gradients: the Gramian and the step
    are exact, under the generic rule and under a closed form (which reads only the outputs
    it needs, whatever the statistic's shape), one that replays the module too."""
    module_type = {
        FallbackRule: _WithStatistic,
        _ScaleRule: _ClosedWithStatistic,
        _ReplayingScaleRule: _ReplayedWithStatistic,
    }[rule]
    model = module_type(statistic)
    with Engine(model, batch_dim=0) as engine:

        def forward() -> Tensor:
            return model(X)[0].pow(2).sum(1)

        assert type(engine._units[0].rule) is rule
        assert_exact_step(engine, forward, [model.s])


def test_an_unread_output_without_the_batch_under_the_generic_rule() -> None:
    """Under the generic rule, which re-runs the module sample by sample, an unread output
    without the batch (not 0-d) is refused with an error that names it as such and the way
    out (returning it detached, as the test above checks), not the losses' shape; no
    ``.grad`` is written."""
    model = _WithStatistic("per feature")
    with Engine(model, batch_dim=0) as engine:
        losses = model(X)[0].pow(2).sum(1)
        match = r"received shape \(3,\) for an output that the losses do not read.*detached"
        with pytest.raises(ValueError, match=match):
            engine.backward(losses, UPGradWeighting())
    assert model.s.grad is None


class _FlatHeadLM(nn.Module):
    """A language model whose head is called on the flattened tokens ``[B * T, d]`` (as GPT's
    ``lm_head`` often is), or on ``[B, T, d]``."""

    def __init__(self, flat: bool) -> None:
        super().__init__()
        self.flat = flat
        self.embed, self.head = nn.Embedding(7, 3).double(), nn.Linear(3, 7).double()

    def forward(self, ids: Tensor) -> Tensor:
        h = torch.tanh(self.embed(ids))
        logits = self.head(h.view(-1, 3)).view(*ids.shape, 7) if self.flat else self.head(h)
        return nn.functional.cross_entropy(logits.transpose(1, 2), ids, reduction="none").sum(1)


@pytest.mark.parametrize("case", ["sliced", "reduced", "flattened"])
def test_batch_size_mismatch_names_the_losses_shape_and_common_causes(case: str) -> None:
    """The refusal spoke of "the batch size 3 of `losses`" for losses that were not per sample
    (``losses[:3]``, ``out.mean(0)``). It now states the losses' shape, that their dimension 0
    is the batch, and, where the output's first size is a multiple of the batch, that the
    layer's input merges the batch with other dimensions (a reduced output of 4 rows for 2
    losses, read as 2 samples of 2 positions, whose rows every loss reads). A Linear head on
    the tokens flattened batch first (``[B T, d]``) is exact, as on ``[B, T, d]``."""
    torch.manual_seed(0)
    if case == "flattened":
        ids = torch.randint(0, 7, (4, 5))
        model = _FlatHeadLM(flat=True)
        engine = Engine(model, batch_dim=0)
        assert_exact_gramian(engine, model(ids), list(model.parameters()))
        model.flat = False
        assert_exact_gramian(engine, model(ids), list(model.parameters()))
        return
    model = _mlp()
    engine = Engine(model, batch_dim=0)
    out = model(X).pow(2)  # [4, 2]
    losses = out.sum(1)[:3] if case == "sliced" else out.mean(0)
    shape = r"\(3,\)" if case == "sliced" else r"\(2,\)"
    match = (
        rf"dimension batch_dim of `losses` is the batch \(shape {shape} with it first\).*"
        r"received shape \(4, 5\)\. (Read as the batch merged .*)?If `losses` are laid out "
        r"otherwise \(\[k, B\] with batch_dim=0: pass batch_dim=1\), or are not per sample "
        r"\(sliced.*reduced over the batch.*pass the per-sample losses"
    )
    _assert_refused(engine, losses, list(model.parameters()), match)


class _PositionsLM(nn.Module):
    """Token plus position embeddings, the positions ``[1, T]`` by default and broadcast over
    the batch (as Hugging Face's BERT and GPT-2 build them without ``position_ids``)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(7, 3).double(), nn.Embedding(5, 3).double()
        self.head = nn.Linear(3, 7).double()

    def forward(self, ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1])[None]
        logits = self.head(torch.tanh(self.tokens(ids) + self.positions(position_ids)))
        return nn.functional.cross_entropy(logits.transpose(1, 2), ids, reduction="none").sum(1)


def test_positions_broadcast_over_the_batch_name_the_position_ids() -> None:
    """A position embedding called on ``[1, T]`` positions (BERT's, GPT-2's, ALBERT's and
    DistilBERT's of Hugging Face by default) was refused with no word of its size-1 output
    nor of the ``position_ids`` that make it exact; the refusal now names both."""
    torch.manual_seed(0)
    ids = torch.randint(0, 7, (4, 5))
    model = _PositionsLM()
    engine = Engine(model, batch_dim=0)
    match = (
        r"received shape \(1, 5, 3\)\..*size 1 there: if that is broadcast.*"
        r"position_ids=torch\.arange"
    )
    _assert_refused(engine, model(ids), list(model.parameters()), match)
    assert_exact_gramian(engine, model(ids, torch.arange(5).expand(4, 5)), list(model.parameters()))


def test_one_row_selected_by_an_index_is_not_called_a_broadcast() -> None:
    """An adaptive softmax whose tail cluster gets one sample per sample: refused (a subset of
    the rows), and the size-1 hint no longer says the output is broadcast over the batch (a
    hunt's finding): it names both causes, and the subsets."""
    torch.manual_seed(0)
    model = nn.AdaptiveLogSoftmaxWithLoss(6, 10, cutoffs=[3, 6], div_value=2.0).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    engine = Engine(model, batch_dim=0)
    match = (
        r"received shape \(1, 3\)\..*if that is broadcast.*if it is one row of the batch "
        r"selected by a mask or an index.*AdaptiveLogSoftmaxWithLoss.*use batch_dim=None"
    )
    losses = -model(x, torch.tensor([0, 4, 8, 1])).output
    _assert_refused(engine, losses, list(model.parameters()), match)


def test_bad_weighting() -> None:
    model = _mlp()
    engine = Engine(model, batch_dim=0)
    with pytest.raises(TypeError, match=r"GramianWeighting"):
        engine.backward(_losses(model, X), lambda g: g.sum(0))  # type: ignore[arg-type]
    # (an aggregator given for its weighting: the message names the one it holds)
    match = (
        r"It is an aggregator: pass its Gramian weighting, its `\.gramian_weighting` \(a UPGradW"
    )
    with pytest.raises(TypeError, match=match):
        engine.backward(_losses(model, X), UPGrad())  # type: ignore[arg-type]
    # (UPGrad's weighting of J holds it too; Krum's weights read more than the Gramian, so its
    # `.gramian_weighting` would select other rows: not suggested)
    match = r"It weights the Jacobian through the Gramian: pass its `\.gramian_weighting`"
    with pytest.raises(TypeError, match=match):
        engine.backward(_losses(model, X), UPGrad().weighting)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Krum'>\. It is an aggregator whose weights do not come"):
        engine.backward(_losses(model, X), Krum(1, 2))  # type: ignore[arg-type]
    assert all(p.grad is None for p in model.parameters())


def test_input_modified_in_place_after_forward() -> None:
    model = nn.Sequential(nn.Linear(3, 3)).double()
    engine = Engine(model, batch_dim=0)
    x = X.clone()
    losses = model(x).sum(1)
    x.mul_(2)
    with pytest.raises(RuntimeError, match=r"modified in place"):
        engine.compute_gramian(losses)


def test_returned_weights_follow_losses_layout() -> None:
    model = _mlp()
    engine = Engine(model, batch_dim=0)
    losses = model(X).pow(2)  # [4, 2]
    jacobian = reference_jacobian(losses, list(model.parameters()))
    weights = engine.backward(losses, UPGradWeighting())
    assert weights.shape == (4, 2)
    torch.testing.assert_close(weights.flatten(), UPGradWeighting()(jacobian @ jacobian.T))


class _NoisyScale(nn.Module):
    """A direct parameter (generic rule) and dropout inside the module."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.dropout(x * self.scale, 0.5, self.training)


@pytest.mark.parametrize("batch_dim", [0, None])
def test_random_ops_in_generic_module_get_clear_error(batch_dim: int | None) -> None:
    """Per sample, vmap refuses the random operations of the re-run; per task, the re-run
    drawing random numbers is caught (it used to draw another mask silently)."""
    module = _NoisyScale()
    engine = Engine(module, batch_dim=batch_dim)
    out = module(torch.randn(3, 4, dtype=torch.float64))
    losses = out.pow(2).sum(1) if batch_dim == 0 else torch.stack([out.sum(), out.pow(2).sum()])
    with pytest.raises(ValueError, match=r"cannot replay its random operations"):
        engine.compute_gramian(losses)
    module.eval()  # dropout off: the generic rule applies
    out = module(torch.randn(3, 4, dtype=torch.float64))
    losses = out.pow(2).sum(1) if batch_dim == 0 else torch.stack([out.sum(), out.pow(2).sum()])
    assert_exact_gramian(engine, losses, [module.scale])


def test_sparse_embedding_gets_sparse_grad() -> None:
    embedding = nn.Embedding(6, 2, sparse=True, padding_idx=1).double()
    ids = torch.tensor([[0, 1, 1], [4, 4, 5]])
    engine = Engine(embedding, batch_dim=0)
    dense = nn.Embedding(6, 2, padding_idx=1).double()
    dense.load_state_dict(embedding.state_dict())
    jacobian = reference_jacobian(dense(ids).pow(2).sum((1, 2)), [dense.weight])
    weights = engine.backward(embedding(ids).pow(2).sum((1, 2)), UPGradWeighting())
    grad = embedding.weight.grad
    assert grad is not None and grad.is_sparse
    torch.testing.assert_close(grad.to_dense().flatten(), weights @ jacobian)


def test_all_hooked_parameters_frozen_after_construction() -> None:
    model = _mlp()
    engine = Engine(model[2], batch_dim=0)
    model[2].requires_grad_(False)
    losses = _losses(model, X)
    torch.testing.assert_close(
        engine.compute_gramian(losses), torch.zeros(4, 4, dtype=torch.float64)
    )


def test_in_place_change_after_stray_forward_is_harmless() -> None:
    model = _mlp()
    engine = Engine(model, batch_dim=0)
    stray = X.clone()
    model(stray)
    stray.add_(1)
    torch.testing.assert_close(engine.compute_gramian(_losses(model, X)), _expected(model, X))


class _Gate(nn.Module):
    """A direct parameter (generic rule, covering the child) and a child Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.ones(3, dtype=torch.float64))
        self.inner = nn.Linear(3, 3).double()

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x) * self.gate


def test_child_called_outside_its_covering_unit_is_refused() -> None:
    """A rule covering its children sees their parameters through its own module's calls only:
    a grad-enabled call of the child outside them would be missed, so it is refused (nothing
    written); a call under no_grad is fine, and so is the next step."""
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    attention = nn.MultiheadAttention(3, 1, batch_first=True).double()
    gate = _Gate()
    cases: list[tuple[nn.Module, nn.Module, str, Callable[[], Tensor]]] = [
        (gate, gate.inner, "_Gate.inner", lambda: gate(x).pow(2).sum((1, 2))),
        (
            attention,
            attention.out_proj,
            "MultiheadAttention.out_proj",
            lambda: attention(x, x, x)[0].pow(2).sum((1, 2)),
        ),
    ]
    for module, child, name, forward in cases:
        with Engine(module, batch_dim=0) as engine:
            losses = forward() + child(x).sum((1, 2))
            with pytest.raises(ValueError, match=f"{name} ran outside"):
                engine.backward(losses, MeanWeighting())
            assert all(p.grad is None for p in module.parameters())
            with torch.no_grad():
                child(x)
            losses = forward()
            assert_exact_gramian(engine, losses, list(module.parameters()))


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("child_first", [False, True])
def test_module_given_twice_through_a_covering_unit(
    batch_dim: int | None, child_first: bool
) -> None:
    """A child given on its own besides the module whose rule covers it (in either order) is
    that module's: counted once, not as a tied weight used twice."""
    gate = _Gate()
    modules = (gate.inner, gate) if child_first else (gate, gate.inner)
    x = torch.randn(4, 3, dtype=torch.float64)
    with Engine(*modules, batch_dim=batch_dim) as engine:
        out = gate(x)
        losses = out.pow(2).sum(1) if batch_dim == 0 else torch.stack([out.sum(), out.pow(2).sum()])
        assert_exact_gramian(engine, losses, list(gate.parameters()))


def test_attention_out_projection_alone_is_refused() -> None:
    attention = nn.MultiheadAttention(4, 2, batch_first=True)
    with pytest.raises(ValueError, match=r"out-projection of an nn\.MultiheadAttention"):
        Engine(nn.Linear(4, 4), attention.out_proj, batch_dim=0)
    Engine(attention, attention.out_proj, batch_dim=0).remove()  # (the attention covers it)


class _ScaledNorm(nn.Module):
    """Parameters of its own (the generic rule) around a BatchNorm and a Dropout, whose output
    depends on the training mode."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d, dtype=torch.float64))
        self.norm = nn.BatchNorm1d(d).double()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.norm(x)) * self.scale


@pytest.mark.parametrize("batch_dim", [0, None])
def test_generic_rule_replays_the_forward_mode(batch_dim: int | None) -> None:
    """A module under the generic rule is re-run in the training modes of its forward, not in
    its modes at the step (switched by ``.train()`` in between), and left in those."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _ScaledNorm(4)).double()
    model[1].norm.running_mean.uniform_(-1, 1)
    model[1].norm.running_var.uniform_(0.5, 2)
    x = torch.randn(5, 3, dtype=torch.float64)
    with Engine(model.eval(), batch_dim=batch_dim) as engine:
        out = model(x)
        losses = out.pow(2).sum(1) if batch_dim == 0 else torch.stack([out.sum(), out[0, 0]])
        jacobian = reference_jacobian(losses, list(model.parameters()))
        running = model[1].norm.running_mean.clone()
        model.train()  # (the step follows in the other mode)
        gramian = engine.compute_gramian(losses)
    torch.testing.assert_close(gramian, jacobian @ jacobian.T, rtol=1e-6, atol=1e-6)
    assert all(m.training for m in model.modules())
    torch.testing.assert_close(model[1].norm.running_mean, running, rtol=0, atol=0)


@pytest.mark.parametrize("batch_dim", [0, None])
def test_generic_rule_refuses_weights_changed_since_the_forward(batch_dim: int | None) -> None:
    """The generic rule re-runs the module with its weights as they are at the step: changed in
    place since the forward (an optimiser step in between), they are refused."""
    model = nn.Sequential(_ScaledNorm(3), nn.Linear(3, 4)).double().eval()
    x = torch.randn(5, 3, dtype=torch.float64)
    with Engine(model, batch_dim=batch_dim) as engine:
        out = model(x)
        losses = out.pow(2).sum(1) if batch_dim == 0 else torch.stack([out.sum(), out[0, 0]])
        with torch.no_grad():
            model[0].scale.mul_(2)
        with pytest.raises(RuntimeError, match="modified in place"):
            engine.backward(losses, MeanWeighting())
    assert all(p.grad is None for p in model.parameters())


def test_generic_rule_trains_batchnorm_per_task() -> None:
    """Per task, a BatchNorm in training mode under the generic rule is re-run on copies of its
    running statistics (torch.func refuses updates of the module's): exact, and the statistics
    stay as the forward left them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _ScaledNorm(4)).double()
    model[1].drop.p = 0.0
    x = torch.randn(6, 3, dtype=torch.float64)
    with Engine(model, batch_dim=None) as engine:
        out = model(x)
        losses = torch.stack([out.sum(), out.pow(2).sum(), out[0, 1]])
        jacobian = reference_jacobian(losses, list(model.parameters()))
        running = model[1].norm.running_mean.clone()
        gramian = engine.compute_gramian(losses)
    torch.testing.assert_close(gramian, jacobian @ jacobian.T, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model[1].norm.running_mean, running, rtol=0, atol=0)


class _RenormedEmbedding(nn.Module):
    """An embedding with ``max_norm`` (its forward renormalises the weight in place) and a
    parameter of its own: the generic rule."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 3, dtype=torch.float64))
        self.embedding = nn.Embedding(10, 3, max_norm=1.0).double()

    def forward(self, ids: Tensor) -> Tensor:
        return self.embedding(ids) * self.scale


def test_weights_the_forward_itself_changes_are_not_refused() -> None:
    """A module that changes its own weights during the forward (``max_norm``), called twice:
    the check compares with the last call, so only changes after the forward are refused."""
    torch.manual_seed(0)
    module, ids = _RenormedEmbedding(), torch.tensor([1, 2, 3])
    with Engine(module, batch_dim=None) as engine:
        out = module(ids) + module(ids.flip(0))
        losses = torch.stack([out.sum(), out.pow(2).sum()])
        jacobian = reference_jacobian(losses, list(module.parameters()))
        gramian = engine.compute_gramian(losses)
    torch.testing.assert_close(gramian, jacobian @ jacobian.T, rtol=1e-6, atol=1e-6)


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4, dtype=torch.float64))
        self.act: nn.Module = nn.Tanh()
        self.lstm = nn.LSTM(3, 4, batch_first=True).double()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.lstm(x)[0]) * self.scale


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("swap", "gained, lost or replaced submodules"),
        ("add", "gained, lost or replaced submodules"),
        ("parameter", "modified in place or replaced"),
        ("in_place", "modified in place or replaced"),
    ],
)
def test_generic_rule_refuses_a_module_changed_since_the_forward(change: str, message: str) -> None:
    """A submodule swapped or added, a parameter replaced or edited in place between the
    forward and the step: the re-run would differentiate another function, so it is refused
    (not mistaken for a failure of the recurrent kernels), and nothing is written."""
    module = _Holder()
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    with Engine(module, batch_dim=None) as engine:
        out = module(x)
        losses = torch.stack([out.sum(), out.pow(2).sum()])
        if change == "swap":
            module.act = nn.ReLU()
        elif change == "add":
            module.extra = nn.Identity()
        elif change == "parameter":
            module.scale = nn.Parameter(2 * torch.ones(4, dtype=torch.float64))
        else:
            with torch.no_grad():
                module.scale.add_(1.0)
        with pytest.raises((RuntimeError, ValueError), match=message):
            engine.backward(losses, MeanWeighting())
    assert all(p.grad is None for p in module.parameters())


class _Scaled(nn.Module):
    """A parameter of its own: the generic rule."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x * self.scale)


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("kind", ["generic", "attention", "gru"])
def test_weights_edited_between_two_calls_are_refused(kind: str, batch_dim: int | None) -> None:
    """A weight edited between two calls of one module in the forward: every call is replayed
    with the weights of the step, so the step is refused, and nothing is written."""
    torch.manual_seed(0)
    module: nn.Module
    if kind == "generic":
        module, x = _Scaled(), torch.randn(4, 3, dtype=torch.float64)
    elif kind == "attention":
        module = nn.MultiheadAttention(3, 1, batch_first=True).double()
        x = torch.randn(4, 2, 3, dtype=torch.float64)
    else:
        module, x = (
            nn.GRU(3, 3, batch_first=True).double(),
            torch.randn(4, 2, 3, dtype=torch.float64),
        )

    def call(inputs: Tensor) -> Tensor:
        if kind == "generic":
            return module(inputs)
        return module(inputs, inputs, inputs)[0] if kind == "attention" else module(inputs)[0]

    weight = next(module.parameters())
    with Engine(module, batch_dim=batch_dim) as engine:
        first = call(x)
        with torch.no_grad():
            weight.mul_(1.5)
        per_sample = (first + call(x).pow(2)).flatten(1).sum(1)
        losses = per_sample if batch_dim == 0 else torch.stack([per_sample.sum(), per_sample[0]])
        with pytest.raises(RuntimeError, match="between two of its calls"):
            engine.backward(losses, MeanWeighting())
    assert all(p.grad is None for p in module.parameters())


def test_batchnorm_reads_the_statistics_its_call_read() -> None:
    """One BatchNorm called in eval mode, then in training mode (which updates its running
    statistics in place, without a version bump): the eval call is replayed with the
    statistics it read. Against finite differences, since autograd itself reads the updated
    statistics there (it is about 5% off)."""
    torch.manual_seed(1)
    x = torch.randn(6, 4, dtype=torch.float64)
    start = nn.BatchNorm1d(4).double()
    start.running_mean.uniform_(-1, 1)
    with torch.no_grad():
        start.weight.uniform_(0.5, 1.5)
        start.bias.uniform_(-0.5, 0.5)

    def losses_of(norm: nn.BatchNorm1d) -> Tensor:
        norm.eval()
        first = norm(x)
        norm.train()
        out = torch.tanh(first) + torch.tanh(norm(2 * x))
        return torch.stack([out.pow(2).sum(), out[:, 0].sum()])

    def at(flat: Tensor) -> Tensor:  # (a fresh module each time: the same statistics)
        norm = copy.deepcopy(start)
        with torch.no_grad():
            norm.weight.copy_(flat[:4])
            norm.bias.copy_(flat[4:])
            return losses_of(norm)

    flat, step = torch.cat([start.weight.detach(), start.bias.detach()]), 1e-6
    columns = [(at(flat + step * e) - at(flat - step * e)) / (2 * step) for e in torch.eye(8)]
    jacobian = torch.stack(columns, 1)
    norm = copy.deepcopy(start)
    with Engine(norm, batch_dim=None) as engine:
        gramian = engine.compute_gramian(losses_of(norm))
    torch.testing.assert_close(gramian, jacobian @ jacobian.T, rtol=1e-7, atol=1e-7)


class _RenormedTwice(nn.Module):
    """A generic unit whose forward renormalises an embedding's weight in place and reads it
    again (the tied output layer of a language model)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float64))
        self.embedding = nn.Embedding(8, 3, max_norm=1.0).double()

    def forward(self, ids: Tensor) -> Tensor:
        return (self.embedding(ids) * self.scale) @ self.embedding.weight.T


def test_the_step_leaves_parameter_versions_alone() -> None:
    """The generic rule re-runs a module on copies of its parameters: a re-run that
    renormalises a weight in place does not bump the parameter's version, so a plain backward
    through the forward's graph still works after the step."""
    torch.manual_seed(0)
    module, ids = _RenormedTwice(), torch.tensor([1, 2, 5])
    with Engine(module, batch_dim=None) as engine:
        out = module(ids)
        losses = torch.stack([out.sum(), out.pow(2).sum()])
        version = module.embedding.weight._version
        engine.compute_gramian(losses)
        assert module.embedding.weight._version == version
        losses.sum().backward()  # (it would fail on a bumped version)
    assert module.scale.grad is not None


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
def test_older_weight_norm_hooks_use_the_generic_rule(norm: str, batch_dim: int | None) -> None:
    """torch.nn.utils.weight_norm / spectral_norm (the hook-based ones) compute the weight from
    other parameters before each call: the generic rule, exactly (they had the Linear rule,
    which saw no `weight` parameter and gave them nothing)."""
    torch.manual_seed(0)
    wrap = getattr(torch.nn.utils, norm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (deprecated for parametrizations)
        model = nn.Sequential(wrap(nn.Linear(3, 4)), nn.Tanh(), nn.Linear(4, 2)).double()
    _assert_exact(model, torch.randn(5, 3, dtype=torch.float64), batch_dim)


def test_generic_rule_where_vmap_fails_per_sample() -> None:
    """A module that vmap cannot re-run sample by sample (an embedding renormalising its weight
    in place) is re-run one sample at a time: exact (it was refused)."""
    module = _RenormedTwice()
    with Engine(module, batch_dim=0) as engine:
        losses = module(torch.tensor([[1], [2]])).sum((1, 2))
        assert_exact_gramian(engine, losses, list(module.parameters()))


class _FixedBatch(nn.Module):
    """Reads the batch size of its forward as a constant: one sample cannot be re-run."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return (x * self.scale).reshape(2, -1)


def test_generic_rule_failing_per_sample_is_named() -> None:
    """A module that no re-run of one sample can run, batched or not: the error names the
    module and the ways out, and nothing is written."""
    module = _FixedBatch()
    with Engine(module, batch_dim=0) as engine:
        losses = module(torch.ones(2, 3, dtype=torch.float64)).sum(1)
        with pytest.raises(RuntimeError, match=r"_FixedBatch has no closed-form.*batch_dim"):
            engine.backward(losses, MeanWeighting())
    assert all(p.grad is None for p in module.parameters())


def test_step_inside_parametrize_cached_is_refused() -> None:
    layer = nn.Linear(3, 2).double()
    parametrize.register_parametrization(layer, "weight", _Double())
    x = torch.randn(4, 3, dtype=torch.float64)
    with Engine(layer, batch_dim=0) as engine, parametrize.cached():
        losses = layer(x).sum(1)
        with pytest.raises(RuntimeError, match=r"outside the cached\(\) block"):
            engine.compute_gramian(losses)


class _Double(nn.Module):
    def forward(self, weight: Tensor) -> Tensor:
        return 2 * weight


@pytest.mark.parametrize("batch_dim", [0, None])
def test_two_engines_and_the_generic_re_run(batch_dim: int | None) -> None:
    """The generic rule's re-run calls the module: no engine records those calls (the second
    engine's step was refused, and the model held vmap's tensors until the next step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), _Scaled()).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with (
        Engine(model, batch_dim=batch_dim) as first,
        Engine(model[1], batch_dim=batch_dim) as second,
    ):
        for _ in range(2):
            out = model(x)
            losses = out.pow(2).sum(1) if batch_dim == 0 else torch.stack([out.sum(), out[0, 1]])
            jacobian = reference_jacobian(losses, [model[1].scale])
            full = reference_jacobian(losses, list(model.parameters()))
            torch.testing.assert_close(first.compute_gramian(losses), full @ full.T)
            model.zero_grad()
            weights = second.backward(losses, MeanWeighting())
            torch.testing.assert_close(model[1].scale.grad, weights @ jacobian)
            assert not first._recorder.calls and not second._recorder.calls
    copy.deepcopy(model)  # (no tensor of a transform is left on it)


class _Tree(nn.Module):
    """A generic module that calls itself on the halves of its input (a recursive network),
    renormalising an embedding's weight at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))
        self.embedding = nn.Embedding(6, 3, max_norm=1.0).double()

    def forward(self, ids: Tensor) -> Tensor:
        own = torch.tanh(self.embedding(ids) * self.scale).sum(1)
        if ids.shape[1] == 1:
            return own
        half = ids.shape[1] // 2
        return own * (self(ids[:, :half]) + self(ids[:, half:]))


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("renormalised", [True, False])
def test_module_calling_itself(batch_dim: int | None, renormalised: bool) -> None:
    """The re-run of the outermost call runs the calls made inside it: counted once (they
    were counted twice), and the module's own renormalisations are not refused."""
    torch.manual_seed(0)
    module, ids = _Tree(), torch.randint(0, 6, (3, 4))
    module.embedding.max_norm = 1.0 if renormalised else None
    with Engine(module, batch_dim=batch_dim) as engine:
        out = module(ids)
        losses = out.pow(2).sum(1) if batch_dim == 0 else torch.stack([out.sum(), out[0, 1]])
        jacobian = reference_jacobian(losses, list(module.parameters()))
        # (per sample with max_norm, vmap cannot re-run it: one sample at a time instead)
        gramian = engine.compute_gramian(losses)
    torch.testing.assert_close(gramian, jacobian @ jacobian.T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("batch_dim", [0, None])
def test_pruned_layers_use_the_generic_rule(batch_dim: int | None) -> None:
    """torch.nn.utils.prune computes the weight from `weight_orig` and a mask before each call:
    the generic rule, exactly (the Linear rule gave `weight_orig` nothing)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    torch.nn.utils.prune.random_unstructured(model[0], "weight", amount=0.5)
    _assert_exact(model, torch.randn(5, 3, dtype=torch.float64), batch_dim)


def test_forwards_that_raise_leave_nothing_behind() -> None:
    """A call that raises still takes its recorded start off the stack: retries of a failing
    forward keep no copies of the buffers."""

    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3, dtype=torch.float64))
            self.register_buffer("big", torch.zeros(1000, dtype=torch.float64))

        def forward(self, x: Tensor) -> Tensor:
            if x.shape[0] > 2:
                raise MemoryError("too large")
            return x * self.scale

    module = Fails()
    with Engine(module, batch_dim=0) as engine:
        for _ in range(5):
            with pytest.raises(MemoryError):
                module(torch.randn(4, 3, dtype=torch.float64))
        assert not any(engine._recorder._starts.values())
        out = module(torch.randn(2, 3, dtype=torch.float64))
        engine.backward(out.sum(1), MeanWeighting())
    assert module.scale.grad is not None


class _Supervised(nn.Module):
    """Calls itself on a transformed input and keeps the inner output (deep supervision): the
    inner call reaches the losses through the outer call and on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))
        self.aux: Tensor | None = None

    def forward(self, x: Tensor, depth: int = 2) -> Tensor:
        own = torch.tanh(x * self.scale)
        if depth == 0:
            return own
        inner = self(own.flip(1), depth - 1)  # (its input carries the outer call's uses)
        self.aux = inner
        return own * inner


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("reads", ["outer", "inner", "both", "inner_then_second_call"])
def test_module_calling_itself_read_at_several_depths(batch_dim: int | None, reads: str) -> None:
    """Each call is re-run with its own output gradients, the calls made inside it using the
    parameters as constants: exact whichever calls the losses read (an inner output read on
    its own was dropped, or counted twice)."""
    torch.manual_seed(0)
    module, x = _Supervised(), torch.randn(4, 3, dtype=torch.float64)

    def losses_of(out: Tensor) -> Tensor:
        per_sample = out.pow(2).sum(1) + out[:, 0]
        return per_sample if batch_dim == 0 else torch.stack([per_sample.sum(), per_sample[1]])

    with Engine(module, batch_dim=batch_dim) as engine:
        out = module(x)
        assert module.aux is not None
        if reads == "outer":
            losses = losses_of(out)
        elif reads == "inner":
            losses = losses_of(module.aux)
        elif reads == "both":
            losses = losses_of(out) + losses_of(module.aux)
        else:
            first = module.aux
            losses = losses_of(first) + losses_of(module(0.7 * x))
        jacobian = reference_jacobian(losses, [module.scale])
        gramian = engine.compute_gramian(losses)
    torch.testing.assert_close(gramian, jacobian @ jacobian.T, rtol=1e-6, atol=1e-6)


def test_checkpointed_forward_recomputed_by_the_step_is_not_recorded() -> None:
    """Activation checkpointing recomputes the forward inside the step's backward: those are
    not forward calls (one stayed recorded, with its tensors, until the next step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    with Engine(model, batch_dim=0) as engine:
        out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
        losses = out.pow(2).sum(1)
        assert_exact_gramian(engine, losses, list(model.parameters()))
        assert not engine._recorder.calls


@pytest.mark.parametrize("batch_dim", [0, None])
def test_checkpoint_with_dropout_and_several_rows(batch_dim: int | None) -> None:
    """A checkpointed block with a dropout, in training mode: its backward draws the dropout
    again (the same mask, from the restored random state), which vmap refuses in a backward
    batched over the rows ([B, k] losses, or tasks). The rows are pulled back one by one; the
    Gramian and the update equal the brute force on the same forward."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Tanh(), nn.Linear(4, 4)).double()
    head = nn.Linear(4, 2).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    params = [*block.parameters(), *head.parameters()]

    def forward() -> Tensor:
        torch.manual_seed(1)  # (the same dropout mask at each forward)
        out = head(torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)).pow(2)
        return out if batch_dim == 0 else torch.stack([out.sum(), out[0, 1]])

    with Engine(block, head, batch_dim=batch_dim) as engine:
        assert_exact_step(engine, forward, params)


class _Recursive(nn.Module):
    """Calls itself ``fanout`` times per level, on inputs that depend on its parameters or not,
    and keeps every inner output (any of which the losses may read)."""

    def __init__(self, dependent: bool, fanout: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(-1.0, 1.5, 3, dtype=torch.float64))
        self.lin = nn.Linear(3, 3).double()
        self.dependent, self.fanout = dependent, fanout
        self.kept: list[Tensor] = []

    def forward(self, x: Tensor, depth: int) -> Tensor:
        own = torch.tanh(self.lin(x) * self.scale)
        total = own
        for k in range(self.fanout if depth else 0):
            inner = self((own if self.dependent else x).flip(1) * (k + 1), depth - 1)
            self.kept.append(inner)
            total = total * (0.5 + inner) if k % 2 == 0 else total + inner.sin()
        return total


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    per_sample=st.booleans(),
    dependent=st.booleans(),
    fanout=st.integers(1, 2),
    depth=st.integers(1, 3),
    reads=st.sampled_from(["outer", "inner", "both", "two_forwards"]),
)
def test_random_recursions(
    seed: int, per_sample: bool, dependent: bool, fanout: int, depth: int, reads: str
) -> None:
    """Random self-calling modules, the losses reading the outermost output and/or inner ones
    at any depth, against the brute-force Jacobian."""
    rng, batch_dim = random.Random(seed), 0 if per_sample else None
    torch.manual_seed(seed)
    module, x = _Recursive(dependent, fanout), torch.randn(4, 3, dtype=torch.float64)
    with Engine(module, batch_dim=batch_dim) as engine:
        out = module(x, depth)
        read = [out] if reads in ("outer", "both") else []
        if reads in ("inner", "both"):
            read += rng.sample(module.kept, rng.randint(1, len(module.kept)))
        if reads == "two_forwards":
            read += [rng.choice(module.kept), module(0.3 * x, depth)]
        per = sum(r.pow(2).sum(1) + r[:, 0] for r in read)
        assert isinstance(per, Tensor)
        losses = per if per_sample else torch.stack([per.sum(), per[0]])
        jacobian = reference_jacobian(losses, list(module.parameters()))
        gramian = engine.compute_gramian(losses)
    scale = jacobian.pow(2).sum(1).max() + 1.0
    torch.testing.assert_close(gramian / scale, jacobian @ jacobian.T / scale, rtol=1e-6, atol=1e-6)


class _TwoOutputs(nn.Module):
    """Returns ``h`` and ``h.exp()``: the second output is computed from the first."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.tanh(x * self.scale)
        return h, h.exp()


@pytest.mark.parametrize("batch_dim", [0, None])
def test_outputs_computed_from_one_another(batch_dim: int | None) -> None:
    """The captured gradient of ``h`` counts the path through ``h.exp()``: the re-run would
    count it twice (it did, silently). Refused when the losses read both, exact with one."""
    torch.manual_seed(0)
    module, x = _TwoOutputs(), torch.randn(4, 3, dtype=torch.float64)

    def losses_of(per_sample: Tensor) -> Tensor:
        return per_sample if batch_dim == 0 else torch.stack([per_sample.sum(), per_sample[1]])

    with Engine(module, batch_dim=batch_dim) as engine:
        h, e = module(x)
        with pytest.raises(ValueError, match="count those paths twice"):
            engine.backward(losses_of(h.sum(1) + e.pow(2).sum(1)), MeanWeighting())
        assert module.scale.grad is None
        h, _ = module(x)
        losses = losses_of(h.pow(2).sum(1))
        assert_exact_gramian(engine, losses, [module.scale])


class _PassesThrough(nn.Module):
    """Returns ``h`` with its input as it is (the (hidden, residual) pattern), or ``h`` twice."""

    def __init__(self, twice: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))
        self.twice = twice

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.tanh(x) * self.scale
        return (h, h) if self.twice else (h, x)


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("twice", [False, True])
def test_an_input_returned_or_one_output_returned_twice(batch_dim: int | None, twice: bool) -> None:
    """An input returned as it is depends on no parameter of the re-run, and one tensor returned
    twice is one output: both were refused as outputs computed from one another. The losses read
    both outputs, each along its own path; the update is exact too."""
    torch.manual_seed(0)
    first, block, last = nn.Linear(3, 3).double(), _PassesThrough(twice), nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    params = [*first.parameters(), *block.parameters(), *last.parameters()]

    def forward() -> Tensor:
        h, other = block(first(x))
        out = last(h) + other[:, :2].pow(2)
        per_sample = out.pow(2).sum(1)
        return per_sample if batch_dim == 0 else torch.stack([per_sample.sum(), out[1, 0]])

    with Engine(first, block, last, batch_dim=batch_dim) as engine:
        assert_exact_step(engine, forward, params)


class _OnItsOutput(nn.Module):
    """Returns its state and calls itself on it (depth 1), keeping the inner output; or, with
    ``detach_middle``, returns a detached state from the middle call of three."""

    def __init__(self, detach_middle: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))
        self.detach_middle, self.kept = detach_middle, []

    def forward(self, x: Tensor, depth: int) -> Tensor:
        h = torch.tanh(x * self.scale)
        if self.detach_middle:
            if depth:
                h = h + self(h, depth - 1)
            return h.detach() if depth == 1 else h
        if depth:
            self.kept.append(self(h, depth - 1))
        return h


@pytest.mark.parametrize("batch_dim", [0, None])
def test_calls_of_itself_on_its_output_and_through_a_detached_middle(
    batch_dim: int | None,
) -> None:
    """A call of the module on its own output is refused (its captured gradient counts the
    inner call's path); a middle call whose output is detached keeps the calls made inside it
    (it crashed) and is exact."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, dtype=torch.float64)

    def losses_of(per_sample: Tensor) -> Tensor:
        return per_sample if batch_dim == 0 else torch.stack([per_sample.sum(), per_sample[1]])

    module = _OnItsOutput(detach_middle=False)
    with Engine(module, batch_dim=batch_dim) as engine:
        out = module(x, 1)
        losses = losses_of(out.sum(1) + module.kept[0].pow(2).sum(1))
        with pytest.raises(ValueError, match="called on its own output"):
            engine.compute_gramian(losses)
    module = _OnItsOutput(detach_middle=True)
    with Engine(module, batch_dim=batch_dim) as engine:
        losses = losses_of(module(x, 2).pow(2).sum(1))
        assert_exact_gramian(engine, losses, [module.scale])


class _WeighsByGramian(nn.Module):
    """Runs an engine step inside its forward (weights its outputs by an inner Gramian)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))
        self.inner = nn.Linear(3, 2).double()
        self.engine = Engine(self.inner, batch_dim=None)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(x * self.scale)
        y = self.inner(h)
        gramian = self.engine.compute_gramian(y.pow(2).sum(0))
        return (y * (gramian.diagonal() / gramian.trace()).detach()).sum(1, keepdim=True) * h


def test_engine_step_inside_a_re_run_module_is_named() -> None:
    """Another engine's re-run of that module records none of its calls: the inner step says
    so (it said that no forward call was in the graph), and nothing is written."""
    torch.manual_seed(0)
    module = _WeighsByGramian()
    with Engine(module, batch_dim=None) as outer:
        out = module(torch.randn(4, 3, dtype=torch.float64))
        with pytest.raises(RuntimeError, match="outside the module's forward"):
            outer.backward(torch.stack([out.sum(), out[0, 0]]), MeanWeighting())
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("kind", ["BatchNorm1d", "LayerNorm", "GroupNorm"])
def test_one_parameter_in_two_slots(kind: str, batch_dim: int | None) -> None:
    """A norm whose bias is its weight (one Parameter in both slots, registered once): the
    closed form sums both slots' gradients into it."""
    torch.manual_seed(0)
    norm = nn.GroupNorm(1, 2) if kind == "GroupNorm" else getattr(nn, kind)(2)
    norm = norm.double().eval()
    norm.bias = norm.weight
    model = nn.Sequential(nn.Linear(3, 2), norm, nn.Tanh(), nn.Linear(2, 2)).double().eval()
    _assert_exact(model, torch.randn(5, 3, dtype=torch.float64), batch_dim)


@pytest.mark.parametrize("batch_dim", [0, None])
def test_lazy_module_before_its_first_forward_is_refused(batch_dim: int | None) -> None:
    """A lazy module has no parameters to hook before its first forward: refused, and the model
    still runs; after one forward the engine takes it."""
    model = nn.Sequential(nn.LazyLinear(3), nn.LazyBatchNorm1d()).double().eval()
    with pytest.raises(ValueError, match=r"lazy module .* Run one forward"):
        Engine(model, batch_dim=batch_dim)
    x = torch.randn(4, 2, dtype=torch.float64)
    model(x)
    _assert_exact(model, x, batch_dim)


class _FreezesItsNorm(nn.Module):
    """Uses its BatchNorm in training mode, then switches it to eval mode (freezing the
    statistics after the first call)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))
        self.norm = nn.BatchNorm1d(3).double()

    def forward(self, x: Tensor) -> Tensor:
        y = self.norm(x)
        self.norm.eval()
        return y * self.scale


def test_generic_rule_replays_the_modes_a_call_started_in() -> None:
    """The generic rule re-runs a call from the modes it started in: a forward that switches a
    child's mode replays the switch itself."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), _FreezesItsNorm(), nn.Tanh(), nn.Linear(3, 1)).double()
    with Engine(model, batch_dim=None) as engine:
        out = model(torch.randn(5, 2, dtype=torch.float64) * 3 + 2)
        losses = torch.stack([out.sum(), out.pow(2).sum()])
        jacobian = reference_jacobian(losses, list(model.parameters()))
        gramian = engine.compute_gramian(losses)
    torch.testing.assert_close(gramian, jacobian @ jacobian.T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["Linear", "BatchNorm1d"])
def test_forward_hook_replacing_the_output_before_the_engine(kind: str) -> None:
    """A user's forward hook that replaces a module's output, registered before the engine:
    the engine still records the module's own output (its hook runs first)."""
    torch.manual_seed(0)
    layer = nn.Linear(2, 2) if kind == "Linear" else nn.BatchNorm1d(2)
    layer = layer.double().eval()
    layer.register_forward_hook(lambda module, args, output: output * 2 + 1)
    model = nn.Sequential(nn.Linear(2, 2), layer, nn.Tanh(), nn.Linear(2, 1)).double().eval()
    with Engine(model, batch_dim=0) as engine:
        losses = model(torch.randn(4, 2, dtype=torch.float64)).pow(2).sum(1)
        jacobian = reference_jacobian(losses, list(model.parameters()))
        gramian = engine.compute_gramian(losses)
    torch.testing.assert_close(gramian, jacobian @ jacobian.T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("batch_dim", [0, None])
def test_batchnorm_reads_running_statistics_its_call_found(batch_dim: int | None) -> None:
    """A BatchNorm's running statistics dropped after an eval forward: the closed form uses
    those the call found, not the batch's."""
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(2).double().eval()
    norm.running_mean.uniform_(-1, 1)
    model = nn.Sequential(nn.Linear(3, 2), norm, nn.Tanh(), nn.Linear(2, 2)).double().eval()

    def drop_statistics() -> None:
        norm.running_mean = norm.running_var = None

    _assert_exact(model, torch.randn(5, 3, dtype=torch.float64), batch_dim, drop_statistics)


def _recorders_of(model: nn.Module) -> list[Any]:
    """The recorders behind the engines' forward hooks on ``model`` (bound methods in partials)."""
    found = {
        id(hook.func.__self__): hook.func.__self__
        for sub in model.modules()
        for hook in sub._forward_hooks.values()
        if isinstance(hook, functools.partial) and hasattr(hook.func, "__self__")
    }
    return list(found.values())


@pytest.mark.parametrize("batch_dim", [0, None])
def test_deep_copy_between_forward_and_step(batch_dim: int | None) -> None:
    """A deep copy of a hooked model (an average of the weights), taken between the forward and
    the step, copies no pending call: its hooks record nothing, and the step stays exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _ScaledNorm(4), nn.Linear(4, 2)).double().eval()
    engine = Engine(model, batch_dim=batch_dim)
    x = torch.randn(5, 3, dtype=torch.float64)
    out = model(x)
    losses = out.pow(2).sum(1) if batch_dim == 0 else torch.stack([out.sum(), out[0, 1]])
    jacobian = reference_jacobian(losses, list(model.parameters()))
    twin = copy.deepcopy(model)
    torch.testing.assert_close(twin(x), out.detach())  # (grad-enabled: recorded by no one)
    torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)
    recorders = _recorders_of(twin)
    assert recorders and all(r.idle and not r.calls for r in recorders)


def test_hooked_model_saved_between_forward_and_step() -> None:
    """``torch.save`` of a whole hooked model (generic and attention units, whose hooks watch
    their children): the loaded copy's hooks are idle, and the original's step stays exact."""
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), _ScaledNorm(4), nn.Linear(4, 4)).double().eval()
    attention = nn.MultiheadAttention(4, 2, batch_first=True).double()
    engine = Engine(model, attention, batch_dim=None)
    x = torch.randn(10, 3, dtype=torch.float64)
    h = model(x)
    tokens = h.reshape(5, 2, 4)
    out = attention(tokens, tokens, tokens, need_weights=False)[0]
    losses = torch.stack([out.sum(), out.pow(2).mean()])
    jacobian = reference_jacobian(losses, [*model.parameters(), *attention.parameters()])
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x), h.detach())
    torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)
    recorders = _recorders_of(loaded)
    assert recorders and all(r.idle and not r.calls for r in recorders)


def test_engine_is_not_copied() -> None:
    engine = Engine(nn.Linear(2, 1), batch_dim=0)
    with pytest.raises(TypeError, match="Create a new Engine on the copied model"):
        copy.deepcopy(engine)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # (torch deprecates these hooks)
@pytest.mark.parametrize("where", ["module", "global"])
def test_older_module_backward_hooks_on_a_closed_form_are_refused(where: str) -> None:
    """``register_backward_hook`` (the older kind) changes the gradients of a module's last
    node, its weights' included, which the closed form does not see: refused, nothing written."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    halve = lambda m, grads_in, grads_out: tuple(  # noqa: E731
        None if g is None else g * 0.5 for g in grads_in
    )
    if where == "module":
        handle = model[0].register_backward_hook(halve)
    else:
        handle = torch.nn.modules.module.register_module_backward_hook(halve)
    try:
        engine = Engine(model, batch_dim=0)
        losses = model(torch.randn(5, 3, dtype=torch.float64)).pow(2).sum(1)
        with pytest.raises(ValueError, match="older kind"):
            engine.backward(losses, UPGradWeighting())
    finally:
        handle.remove()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("frozen", ["first_layer", "whole_model", "generic_scale"])
@pytest.mark.parametrize("batch_dim", [0, None])
def test_unfrozen_parameters_are_hooked(frozen: str, batch_dim: int | None) -> None:
    """A module frozen when the Engine is created (a backbone during a warm-up) and unfrozen
    later is hooked at the next forward: the Gramian and the update are exact (its share was
    silently missing, 41% of the Gramian here, and it got no `.grad`)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), Scale(8), nn.Linear(8, 3)).double()
    part = {"first_layer": model[0], "whole_model": model, "generic_scale": model[2]}[frozen]
    part.requires_grad_(False)
    engine = Engine(model, batch_dim=batch_dim)
    x = torch.randn(5, 4, dtype=torch.float64)

    def losses_of(out: Tensor) -> Tensor:
        per_sample = out.pow(2).sum(1)
        return per_sample if batch_dim == 0 else torch.stack([per_sample.sum(), per_sample[0]])

    if frozen != "whole_model":  # (a warm-up step)
        engine.backward(losses_of(model(x)), MeanWeighting())
        model.zero_grad()
    part.requires_grad_(True)
    losses = losses_of(model(x))
    params = list(model.parameters())
    jacobian = reference_jacobian(losses, params)
    weights = engine.backward(losses, UPGradWeighting())
    expected = weights.reshape(-1) @ jacobian
    got = torch.cat([p.grad.reshape(-1) for p in params])
    torch.testing.assert_close(got, expected)


def test_parameters_unfrozen_between_forward_and_step() -> None:
    """Unfrozen after the forward, which they took no part in: the step is autograd's, with
    no gradient for them (it was refused), and the next forward is hooked again and exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    model[0].requires_grad_(False)
    engine = Engine(model, batch_dim=0)
    x = torch.randn(5, 4, dtype=torch.float64)
    forward = lambda: model(x).pow(2).sum(1)  # noqa: E731
    losses = forward()
    model[0].requires_grad_(True)
    assert_exact_gramian(engine, losses, list(model[2].parameters()))
    model[0].requires_grad_(False)
    losses = forward()
    model[0].requires_grad_(True)
    expected = reference_jacobian(losses, list(model[2].parameters()))
    weights = engine.backward(losses, UPGradWeighting())
    assert all(p.grad is None for p in model[0].parameters())
    actual = torch.cat([p.grad.flatten() for p in model[2].parameters()])  # type: ignore[union-attr]
    torch.testing.assert_close(actual, weights @ expected)
    model.zero_grad(set_to_none=True)
    assert_exact_step(engine, forward, list(model.parameters()))
    copy.deepcopy(model)(x)  # (a copy of the hooked model carries no engine)


def _freeze(model: nn.Module, part: str) -> None:
    """Freeze ``part`` of a ``Linear, Tanh, Scale, Linear`` model."""
    if part == "first_layer":
        model[0].requires_grad_(False)
    elif part == "first_weight":
        model[0].weight.requires_grad_(False)
    elif part == "generic_scale":
        model[2].requires_grad_(False)
    else:  # (every parameter: a zero Gramian and no update)
        model.requires_grad_(False)


_FROZEN_WHEN = [
    (part, when)
    for part in ["first_layer", "first_weight", "generic_scale", "whole_model"]
    for when in ["after_stray_forward", "after_forward"]
    # (a frozen model's forward gives losses that do not require grad)
    if (part, when) != ("whole_model", "after_stray_forward")
]


@pytest.mark.parametrize(("part", "when"), _FROZEN_WHEN)
@pytest.mark.parametrize("batch_dim", [0, None])
def test_parameters_frozen_while_calls_are_pending(
    part: str, when: str, batch_dim: int | None
) -> None:
    """Parameters frozen while calls are pending (after a stray grad-enabled forward, or
    between the forward and the step) were refused as "a frozen parameter made trainable". The
    calls recorded give the exact step without them: the Gramian is ``J J^T`` and ``.grad``
    gains ``w @ J`` over the parameters still trainable (the reference: autograd row by row on
    an unhooked copy frozen alike), the frozen ones keep their ``.grad``; the next forward is
    hooked again and exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), Scale(8), nn.Linear(8, 3)).double()
    reference = copy.deepcopy(model)
    _freeze(reference, part)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    x = torch.randn(5, 4, dtype=torch.float64)
    weighting = ConstantWeighting(torch.linspace(0.3, 1.7, 5 if batch_dim == 0 else 3))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    old = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    def losses_of(out: Tensor) -> Tensor:
        per_sample = out.pow(2).sum(1)
        return per_sample if batch_dim == 0 else torch.stack([per_sample.sum(), *per_sample[:2]])

    def pending_losses() -> Tensor:
        if when == "after_stray_forward":
            model(x)
            _freeze(model, part)
            return losses_of(model(x))
        losses = losses_of(model(x))
        _freeze(model, part)
        return losses

    reference_losses = losses_of(reference(x))
    jacobian = (
        reference_jacobian(reference_losses, trainable)
        if trainable
        else reference_losses.new_zeros(reference_losses.numel(), 0)
    )
    with Engine(model, batch_dim=batch_dim) as engine:
        torch.testing.assert_close(engine.compute_gramian(pending_losses()), jacobian @ jacobian.T)
        model.requires_grad_(True)
        engine.clear()
        weights = engine.backward(pending_losses(), weighting)
        torch.testing.assert_close(weights, weighting(jacobian @ jacobian.T))
        update = iter((weights @ jacobian).split([p.numel() for p in trainable]))
        for p, q, before in zip(model.parameters(), reference.parameters(), old, strict=True):
            expected = before + next(update).view_as(p) if q.requires_grad else before
            torch.testing.assert_close(p.grad, expected)
        if trainable:  # (hooked again for the parameters trainable now)
            now = [p for p in model.parameters() if p.requires_grad]
            assert_exact_gramian(engine, losses_of(model(x)), now)


class _BatchScaled(Scale):
    """Divides by the batch size: per sample, its re-run (a batch of one) is another function."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x * self.s / x.shape[0])


class _Counted(Scale):
    """Reads a call counter that its forward increments: its re-run sees another count."""

    def __init__(self, features: int) -> None:
        super().__init__(features)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return torch.tanh(x * self.s * self.calls)


class _CountedLinear(_Counted):
    """A call counter before a Linear of its own (a bfloat16 output under autocast)."""

    def __init__(self, features: int) -> None:
        super().__init__(features)
        self.lin = nn.Linear(features, features)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(super().forward(x))


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("kind", ["batch_size", "counter", "in_place_after", "bfloat16_counter"])
def test_generic_re_run_must_reproduce_the_forward(kind: str, batch_dim: int | None) -> None:
    """A generic module whose re-run gives other outputs than its forward (the batch size read
    as a number, per sample; state the forward changes) is refused: its Gramian was silently
    2-30% off. A faithful module whose output is changed in place after the forward is
    exact."""
    torch.manual_seed(0)
    module = {"batch_size": _BatchScaled, "in_place_after": Scale, "counter": _Counted}.get(
        kind, _CountedLinear
    )
    low = kind == "bfloat16_counter"
    dtype = torch.float32 if low else torch.float64
    model = nn.Sequential(nn.Linear(3, 4), module(4), nn.Linear(4, 2)).to(dtype)
    if kind == "in_place_after":
        model.insert(2, nn.ReLU(inplace=True))
    engine = Engine(model, batch_dim=batch_dim)
    # (under bfloat16 autocast the check's tolerance is capped: 1e4 units of roundoff would
    # have let the counter through)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
        out = model(torch.randn(5, 3, dtype=dtype)).to(dtype).pow(2).sum(1)
    losses = out if batch_dim == 0 else torch.stack([out.sum(), out[0], out.pow(2).mean()])
    refused = "counter" in kind or (kind == "batch_size" and batch_dim == 0)
    if refused:
        with pytest.raises(RuntimeError, match="gave other outputs than its forward"):
            engine.backward(losses, UPGradWeighting())
        assert all(p.grad is None for p in model.parameters())
        return
    assert_exact_gramian(engine, losses, list(model.parameters()))


class _Codebook(nn.Module):
    """Attention of each sample over a shared table passed as an argument (no batch dim)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4, dtype=torch.float64))

    def forward(self, x: Tensor, table: Tensor) -> Tensor:
        return ((x @ table.T).softmax(-1) @ table) * self.scale


@pytest.mark.parametrize("rows_in_table", [5, 3])
def test_generic_re_run_names_arguments_split_per_sample(rows_in_table: int) -> None:
    """A shared argument whose first size happens to be the batch size is split per sample by
    the generic rule; the refusal names the arguments split (it pointed at the batch size as a
    number only). With another size the Gramian is exact."""
    torch.manual_seed(0)
    module = _Codebook()
    x = torch.randn(3, 4, dtype=torch.float64)
    table = torch.randn(rows_in_table, 4, dtype=torch.float64)
    engine = Engine(module, batch_dim=0)
    losses = module(x, table).pow(2).sum(1)
    if rows_in_table == 3:
        _assert_refused(engine, losses, [module.scale], r"shapes \[3, 4\], \[3, 4\]\. Make such")
        return
    assert_exact_gramian(engine, losses, [module.scale])


class _BatchDivided(Scale):
    """Divides by the batch size; its backward saves no output (an in-place op may follow)."""

    def forward(self, x: Tensor) -> Tensor:
        return x * self.s / x.shape[0]


class _ShiftInPlace(nn.Module):
    """An in-place op on its input, as a residual ``h.add_(x)``."""

    def forward(self, h: Tensor) -> Tensor:
        return h.add_(0.5)


@pytest.mark.parametrize("after", ["relu", "add_"])
@pytest.mark.parametrize("kind", ["batch_size", "split_table", "faithful"])
def test_generic_re_run_is_checked_after_an_in_place_op_on_its_output(
    kind: str, after: str
) -> None:
    """An in-place op on a generic module's output after its forward (an in-place ReLU, a
    residual ``h.add_(x)``) skipped the check of its re-run: a module refused out of place gave
    a Gramian and ``.grad`` 30-125% off, silently. Its re-run per sample is now compared with a
    re-run on the whole batch: refused as out of place (the batch size read as a number, a
    shared argument split per sample); a module that its re-run reproduces stays exact."""
    torch.manual_seed(0)
    x, table = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    first, head = nn.Linear(3, 4).double(), nn.Linear(4, 2).double()
    in_place = nn.ReLU(inplace=True) if after == "relu" else _ShiftInPlace()
    middle: nn.Module = {"batch_size": _BatchDivided(4), "split_table": _Codebook()}.get(
        kind, Scale(4)
    )
    middle.double()
    params = [*first.parameters(), *middle.parameters(), *head.parameters()]
    engine = Engine(first, middle, head, batch_dim=0)

    def forward() -> Tensor:
        h = first(x)
        h = middle(h, table) if kind == "split_table" else middle(h)
        return head(in_place(h)).pow(2).sum(1)

    if kind == "faithful":
        assert_exact_step(engine, forward, params)
        return
    with pytest.raises(ReplayMismatchError, match="gave other outputs than its forward"):
        engine.backward(forward(), UPGradWeighting())
    assert all(p.grad is None for p in params)


def test_a_step_without_trainable_parameters_gives_zeros() -> None:
    """Every parameter frozen from the start: a zero Gramian and no update (it failed, saying
    no call was recorded)."""
    model = nn.Sequential(nn.Linear(3, 2)).double().requires_grad_(False)
    engine = Engine(model, batch_dim=0)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    gramian = engine.compute_gramian(model(x).sum(1))
    torch.testing.assert_close(gramian, torch.zeros(4, 4, dtype=torch.float64))


class _Backbone(nn.Module):
    """Layers and a parameter of its own (a position embedding): a unit of the generic rule."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(4))
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc2(torch.tanh(self.fc1(x + self.pos))))


def test_unfrozen_after_a_step_that_froze_parameters_of_its_forward() -> None:
    """A step that takes parameters frozen after its forward hooks the modules again at its
    end, also where no forward would (an ``nn.ModuleList`` whose modules the loop calls): a
    module frozen during the next forward and unfrozen before its step gets no gradient from
    it, as from autograd (with the old hooks its share of the Gramian was read through a graph
    that has none; then it was refused), and the step after it is exact."""
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(4, 8), nn.Tanh(), Scale(8), nn.Linear(8, 3)]).double()
    engine = Engine(model, batch_dim=0)
    x = torch.randn(5, 4, dtype=torch.float64)

    def losses_of() -> Tensor:
        out = x
        for module in model:  # (the container itself is never called)
            out = module(out)
        return out.pow(2).sum(1)

    losses = losses_of()
    model[2].requires_grad_(False)
    engine.backward(losses, MeanWeighting())
    model.zero_grad()
    losses = losses_of()
    model[2].requires_grad_(True)
    assert_exact_gramian(engine, losses, [p for i in (0, 3) for p in model[i].parameters()])
    assert_exact_step(engine, losses_of, list(model.parameters()))


def test_own_parameters_of_a_generic_unit_frozen_while_calls_are_pending() -> None:
    """Freezing the own parameters of a module whose rule covers its children changes which
    modules hold the units (its children, hooked on their own): with calls pending, refused
    with a message that names it (it named "a frozen parameter made trainable" only), before
    anything is written; the next step is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(_Backbone(), nn.Linear(8, 2)).double()
    engine = Engine(model, batch_dim=0)
    x = torch.randn(5, 4, dtype=torch.float64)
    losses = model(x).pow(2).sum(1)
    model[0].pos.requires_grad_(False)
    with pytest.raises(ValueError, match="own parameters frozen under a rule that covered"):
        engine.backward(losses, UPGradWeighting())
    assert all(p.grad is None for p in model.parameters())
    now = [p for p in model.parameters() if p.requires_grad]
    assert_exact_gramian(engine, model(x).pow(2).sum(1), now)


@pytest.mark.parametrize("given", ["generic_module", "sequential", "container"])
def test_a_given_generic_module_unfrozen_or_a_module_added_later(given: str) -> None:
    """Hooked again inside its own forward's pre-hook, a given module under the generic rule
    gets this call's start too (it was refused at every later step); a module added to a given
    model is hooked at its next forward (it was silently missing); a container that the
    forward never calls gets its modules hooked again at the first step after the change,
    which is refused, the next one exact."""
    torch.manual_seed(0)
    backbone, head = _Backbone().double(), nn.Linear(8, 2).double()
    backbone.requires_grad_(False)
    kind = nn.ModuleList if given == "container" else nn.Sequential
    model = kind([backbone, head]) if given == "container" else kind(backbone, head)
    hooked = (backbone, head) if given == "generic_module" else (model,)
    engine = Engine(*hooked, batch_dim=0)
    x = torch.randn(5, 4, dtype=torch.float64)

    def losses_of() -> Tensor:
        out = x
        for module in model:  # (the modules one by one: a container is never called)
            out = module(out)
        return out.pow(2).sum(1)

    engine.backward(losses_of(), MeanWeighting())
    backbone.requires_grad_(True)
    if given != "generic_module":
        model.append(nn.Linear(2, 2).double())
    if given == "container":
        with pytest.raises(ValueError, match="modules changed since it hooked them"):
            engine.compute_gramian(losses_of())
    params = list(model.parameters())
    for _ in range(2):
        losses = model(x).pow(2).sum(1) if given == "sequential" else losses_of()
        assert_exact_gramian(engine, losses, params)


class _Encoder(nn.Module):
    """A learned initial state around an LSTM: per sample, refused under the generic rule."""

    def __init__(self) -> None:
        super().__init__()
        self.h0 = nn.Parameter(torch.zeros(1, 1, 6))
        self.rnn = nn.LSTM(4, 6, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        h0 = self.h0.expand(1, x.shape[0], 6).contiguous()
        return self.rnn(x, (h0, torch.zeros_like(h0)))[0][:, -1]


def test_a_refused_layout_after_an_unfreeze_is_refused_by_the_step() -> None:
    """Unfreezing makes a layout the engine refuses: the model's forwards still run (they
    raised, under no_grad too); the step refuses it."""
    torch.manual_seed(0)
    encoder = _Encoder().double()
    encoder.h0.requires_grad_(False)
    engine = Engine(encoder, batch_dim=0)
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    engine.backward(encoder(x).pow(2).sum(1), MeanWeighting())
    encoder.h0.requires_grad_(True)
    with torch.no_grad():
        encoder(x)
    losses = encoder(x).pow(2).sum(1)
    grads = [p.grad.clone() for p in encoder.rnn.parameters()]
    with pytest.raises(ValueError, match="under the generic rule"):
        engine.backward(losses, MeanWeighting())
    assert all(torch.equal(p.grad, g) for p, g in zip(encoder.rnn.parameters(), grads, strict=True))


def test_an_engine_dropped_without_remove_unhooks() -> None:
    """An engine collected without remove() takes its hooks along (its recorder kept every
    forward's calls, a leak)."""
    import gc

    model = nn.Linear(3, 2)
    Engine(model, batch_dim=0)
    gc.collect()
    assert not model._forward_hooks and not model._forward_pre_hooks


@pytest.mark.parametrize("change", ["weight_replaced", "assigned", "parameter_added"])
def test_replaced_or_added_parameters_are_hooked(change: str) -> None:
    """A frozen weight replaced by a trainable one, a frozen module loaded with
    ``assign=True`` and unfrozen, a parameter registered later on a module that had none: the
    next forward hooks them (they were silently missing: 19-69% off)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    model[0].requires_grad_(False)
    engine = Engine(model, batch_dim=0)
    x = torch.randn(6, 4, dtype=torch.float64)
    if change == "weight_replaced":
        model[0].weight = nn.Parameter(model[0].weight.detach().clone())
    elif change == "assigned":
        state = {k: v.clone() for k, v in model[0].state_dict().items()}
        model[0].load_state_dict(state, assign=True)
        model[0].requires_grad_(True)
    else:
        model[1] = Scale(5).double()  # (a module with a parameter where there was none)
    for _ in range(2):
        losses = model(x).pow(2).sum(1)
        params = [p for p in model.parameters() if p.requires_grad]
        assert_exact_gramian(engine, losses, params)


class _Rebuilds(nn.Module):
    """Builds a module without parameters at every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.act: nn.Module = nn.Tanh()

    def forward(self, x: Tensor) -> Tensor:
        self.act = nn.Tanh()
        return self.act(self.lin(x))


def test_modules_without_parameters_rebuilt_at_each_forward() -> None:
    """Not a change to hook again (every step was refused)."""
    model = _Rebuilds().double()
    engine = Engine(model, batch_dim=0)
    x = torch.randn(6, 4, dtype=torch.float64)
    for _ in range(3):
        losses = model(x).pow(2).sum(1)
        assert_exact_gramian(engine, losses, list(model.parameters()))


def test_a_model_keeping_its_engine_is_collected() -> None:
    """A model holding its own engine (a generic unit: a parameter of its own) and pending
    calls is freed with it (the engine's finalizer held it)."""
    import gc
    import weakref

    model = _Backbone()  # (a parameter of its own: the model is the unit)
    model.engine = Engine(model, batch_dim=0)  # type: ignore[assignment]
    model(torch.randn(3, 4))
    model_ref, engine_ref = weakref.ref(model), weakref.ref(model.engine)
    del model
    gc.collect()
    assert model_ref() is None and engine_ref() is None


class _Block(nn.Module):
    """A parameter of its own around an inner module: a unit of the generic rule."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.3))
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x) * self.s


@pytest.mark.parametrize("change", ["moved_in", "pruned", "adapter_added"])
def test_units_that_change_after_the_engine(change: str) -> None:
    """A Linear moved into a generic module (counted twice: 259% off), pruning applied after
    the engine (14% off), an adapter added to a Linear and applied by a forward hook (missing):
    the modules are hooked again, exact."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(nn.Identity()), nn.Tanh(), nn.Linear(3, 3)).double()
    engine = Engine(model, batch_dim=0)
    x = torch.randn(5, 3, dtype=torch.float64)
    engine.compute_gramian(model(x).pow(2).sum(1))
    if change == "moved_in":
        linear, model[2] = model[2], nn.Identity()
        model[0].inner = linear
    elif change == "pruned":
        torch.nn.utils.prune.l1_unstructured(model[2], "weight", amount=0.3)
    else:
        model[2].adapter = nn.Linear(3, 3, bias=False).double()
        model[2].register_forward_hook(lambda module, args, out: out + module.adapter(args[0]))
    for _ in range(2):
        losses = model(x).pow(2).sum(1)
        params = [p for p in model.parameters() if p.requires_grad]
        assert_exact_gramian(engine, losses, params)


class _Mover(nn.Module):
    """A generic block then a Linear; the Linear may be moved into the block (the modules'
    preorder stays the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _Block(nn.Identity())
        self.lin = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.block(x)
        return self.lin(x) if "lin" in self._modules else x


@pytest.mark.parametrize("change", ["same_preorder", "instance_forward", "frequency"])
def test_changes_that_keep_the_modules_listed_alike(change: str) -> None:
    """A Linear moved into the generic block before it (the same modules in the same order:
    counted twice), a forward set on a Linear's instance (its closed form kept), an embedding
    set to scale by frequency: seen at the next step (they were silently wrong; the last one,
    refused later, is now exact)."""
    torch.manual_seed(0)
    model = _Mover().double()
    emb = nn.Embedding(5, 3).double()
    engine = Engine(model, emb, batch_dim=0)
    x, ids = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 3])

    def losses_of() -> Tensor:
        return (model(x) + emb(ids)).pow(2).sum(1)

    engine.compute_gramian(losses_of())
    if change == "same_preorder":
        model.block.inner = model._modules.pop("lin")
    elif change == "class":
        model.lin.__class__ = type(
            "Shifted", (nn.Linear,), {"forward": lambda s, x: s.weight @ x.T}
        )
    elif change == "instance_forward":
        linear = model.lin
        linear.forward = lambda x: torch.tanh(x @ linear.weight.T)  # type: ignore[method-assign]
    else:
        emb.scale_grad_by_freq = True
    for _ in range(2):
        losses = losses_of()
        params = [*model.parameters(), *emb.parameters()]
        assert_exact_gramian(engine, losses, params)


def test_forwards_piling_up_without_a_step_are_warned_about(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plain training steps with the engine attached (a warm-up) keep every forward's recorded
    calls, and their inputs, until a step: once 64 such forwards hold much memory (here a
    threshold lowered to 1 KiB), a warning names the way out (``clear()``); Jacobian-descent
    steps, which take the calls, are never warned about."""
    monkeypatch.setattr(engine_module, "_PENDING_BYTES_WARNING", 1024)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(5, 3)
    engine = Engine(model, batch_dim=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(100):
            engine.backward(model(x).squeeze(1), MeanWeighting())
        for _ in range(64):
            model(x).sum().backward()
        engine.clear()
    with pytest.warns(UserWarning, match=r"engine\.clear\(\)"):
        for _ in range(65):
            model(x).sum().backward()


def test_a_cell_called_in_a_loop_is_not_warned_about() -> None:
    """A given recurrent cell called 100 times in one forward starts 100 forwards of a given
    module: it was warned about at its first step. The warning waits for much memory held."""
    cell, head = nn.GRUCell(3, 4), nn.Linear(4, 1)
    engine = Engine(cell, head, batch_dim=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h = torch.zeros(5, 4)
        for _ in range(100):
            h = cell(torch.randn(5, 3), h)
        engine.backward(head(h).squeeze(1), MeanWeighting())


@pytest.mark.parametrize("where", ["prepended", "global"])
def test_forward_hook_before_the_engines_is_refused(where: str) -> None:
    """A forward hook that runs before the engine's recording hook (registered with
    ``prepend=True`` after the Engine, or a global one) and replaces the output made the
    engine read the gradient at the hook's output: the Gramian came back 1/9 of J J^T and the
    update 1/3 of it for ``o -> 3 o``, silently (a review's finding). It is refused, nothing
    written; a hook registered after the Engine's, or one on an unhooked module, is fine."""
    model = _mlp()
    triple = lambda module, args, output: 3 * output  # noqa: E731
    with Engine(model, batch_dim=0) as engine:
        if where == "prepended":
            handle = model[0].register_forward_hook(triple, prepend=True)
        else:
            handle = nn.modules.module.register_module_forward_hook(triple)
        try:
            losses = _losses(model, X)
            with pytest.raises(ValueError, match="forward hook ran before the Engine's"):
                engine.backward(losses, MeanWeighting())
        finally:
            handle.remove()
        assert all(p.grad is None for p in model.parameters())
        model[0].register_forward_hook(triple)  # (after the Engine's: it sees the output)
        model[1].register_forward_hook(triple, prepend=True)  # (Tanh: not hooked)
        losses = _losses(model, X)
        jacobian = reference_jacobian(losses, list(model.parameters()))
        torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)


@pytest.mark.parametrize("when", ["construction", "unfrozen"])
def test_complex_parameters_are_refused(when: str) -> None:
    """A complex parameter gave a Gramian that was neither ``Re(J J^H)`` nor Hermitian,
    silently (a review's finding): it is refused at construction, or when its module is
    unfrozen later and the Engine hooks the modules again."""
    model = nn.Sequential(nn.Linear(3, 2).double(), _ComplexLinear())
    if when == "construction":
        with pytest.raises(TypeError, match=r"1\.weight is a complex parameter"):
            Engine(model, batch_dim=0)
        return
    model[1].requires_grad_(False)
    engine = Engine(model, batch_dim=0)
    model[1].requires_grad_(True)
    with pytest.raises(TypeError, match=r"1\.weight is a complex parameter"):
        engine.compute_gramian(model(X).abs().pow(2).sum(1))


@pytest.mark.parametrize(
    ("call", "batch_dim"),
    [
        ("compute_gramian", 0),
        ("compute_gramian", None),
        ("backward", 0),
        ("backward", None),
        ("mtl_gramian_step", None),
    ],
)
def test_complex_losses_are_refused(call: str, batch_dim: int | None) -> None:
    """The backward of complex losses differentiates their real part: the imaginary part's rows
    were dropped from the Gramian and the update, silently (a review's finding). Refused as
    ``jacflow.backward`` refuses them, before anything is written or consumed: the same
    forward's real losses then step exactly."""
    model = _mlp()
    params = list(model.parameters())
    engine = Engine(model, batch_dim=batch_dim)
    for param in params:
        param.grad = torch.full_like(param, 0.25)
    out = model(X)
    real = out.pow(2).sum(1) if batch_dim == 0 else torch.stack([out.sum(), out.pow(2).mean()])
    losses = real + 1j * real.sin()
    steps: dict[str, Callable[[], object]] = {
        "compute_gramian": lambda: engine.compute_gramian(losses),
        "backward": lambda: engine.backward(losses, UPGradWeighting()),
        "mtl_gramian_step": lambda: mtl_gramian_step(losses, engine, UPGradWeighting()),
    }
    with pytest.raises(
        ValueError,
        match=r"`losses` is complex \(torch\.complex128\); .* Pass torch\.view_as_real\(losses\)",
    ):
        steps[call]()
    assert all(torch.equal(p.grad, torch.full_like(p, 0.25)) for p in params)
    jacobian = reference_jacobian(real, params)
    weights = engine.backward(real, UPGradWeighting())
    actual = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    torch.testing.assert_close(actual, 0.25 + weights @ jacobian)


class _ComplexLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 2, dtype=torch.complex128))

    def forward(self, x: Tensor) -> Tensor:
        return x.to(self.weight.dtype) @ self.weight.T


def test_forward_hook_check_reads_only_the_calls_the_losses_reach() -> None:
    """The check is per call: a forward with a prepended hook whose losses are dropped, then
    one without it, steps exactly (the first version flagged the whole record); a shallow copy
    of a hooked module, which runs the original's hooks, forwards as before (it raised a
    KeyError inside the forward). Both found by a review."""
    model = _mlp()
    with Engine(model, batch_dim=0) as engine:
        handle = model[0].register_forward_hook(lambda m, a, o: 3 * o, prepend=True)
        _losses(model, X)  # (dropped)
        handle.remove()
        losses = _losses(model, X)
        jacobian = reference_jacobian(losses, list(model.parameters()))
        torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)
        twin = copy.copy(model[2])
        twin(torch.tanh(model[0](X))).sum().backward()  # (raised: KeyError)
        # the copy runs the original's hooks, an observer after the Engine's among them (the
        # copy's recording hook was looked up by the copy's id, missed, and the observer was
        # taken for one before it: refused, in the second version)
        model[2].register_forward_hook(lambda module, args, output: None)
        losses = twin(torch.tanh(model[0](X))).pow(2).sum(1)
        jacobian = reference_jacobian(losses, list(model.parameters()))
        torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)


def test_parameters_made_complex_in_place_are_refused_at_the_step() -> None:
    """``model.to(torch.complex128)`` converts the parameters in place (the same objects, no
    re-hooking): the Gramian came back complex and wrong, silently (a review's finding)."""
    model = _mlp()
    engine = Engine(model, batch_dim=0)
    with warnings.catch_warnings():  # (torch: complex modules are a new feature)
        warnings.simplefilter("ignore", UserWarning)
        model.to(torch.complex128)
    losses = model(X.to(torch.complex128)).abs().pow(2).sum(1)
    with pytest.raises(TypeError, match=r"0\.weight is a complex parameter"):
        engine.compute_gramian(losses)


def test_forward_under_torchs_flop_counter_is_accepted() -> None:
    """torch's module trackers (here FlopCounterMode's) register global forward hooks that only
    observe: a forward under one is not refused (the first version of the check refused it)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = _mlp()
    with Engine(model, batch_dim=0) as engine:
        with FlopCounterMode(display=False):
            losses = _losses(model, X)
        jacobian = reference_jacobian(losses, list(model.parameters()))
        torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)


def _step_grads(model: nn.Module, context: Callable[[], Any]) -> list[Tensor]:
    """The ``.grad`` of one UPGrad step of an Engine on ``model``, forward and step under
    ``context()``."""
    with Engine(model, batch_dim=0) as engine, context():
        engine.backward(_losses(model, X), UPGradWeighting())
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("generic", [False, True])
def test_step_under_torchs_flop_counter(generic: bool) -> None:
    """The whole step runs under FlopCounterMode, whose module tracker puts multi-grad hooks on
    every module's outputs; they raised "expected this hook to be called inside a backward
    call" when the engine ran them again on the captured gradients. Also with a module of the
    generic rule (replayed by torch.func)."""
    from torch.utils.flop_counter import FlopCounterMode

    def model() -> nn.Module:
        torch.manual_seed(0)
        layers = [nn.Linear(3, 5), nn.Tanh(), Scale(5) if generic else nn.Linear(5, 5)]
        return nn.Sequential(*layers, nn.Linear(5, 2)).double()

    expected = _step_grads(model(), contextlib.nullcontext)
    counter = FlopCounterMode(display=False)
    got = _step_grads(model(), lambda: counter)
    assert counter.get_total_flops() > 0
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


def test_multi_grad_hook_on_an_output_runs_once() -> None:
    """A hook of register_multi_grad_hook on a hooked module's output runs once per backward
    of the engine, as in a plain backward, and was not run again outside it (where it raised).
    (The first step of a batch size also runs the separation probe's backwards.)"""
    model = _mlp()
    reference = copy.deepcopy(model)
    seen: list[int] = []

    def forward_hook(module: nn.Module, args: Any, output: Tensor) -> None:
        torch.autograd.graph.register_multi_grad_hook([output], lambda grads: seen.append(1))

    model[2].register_forward_hook(forward_hook)  # (an output the backward flows through)
    with Engine(model, batch_dim=0) as engine, Engine(reference, batch_dim=0) as plain:
        for _ in range(2):
            seen.clear()
            model.zero_grad()
            reference.zero_grad()
            engine.backward(_losses(model, X), UPGradWeighting())
            plain.backward(_losses(reference, X), UPGradWeighting())
    assert seen == [1]
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad)


@pytest.mark.parametrize("trunk_end", ["linear", "attention_in_place"])
@pytest.mark.parametrize("mode", ["any", "all"])
def test_multi_grad_hook_where_tasks_meet_runs_once(mode: str, trunk_end: str) -> None:
    """Per task, with scalar heads stacked, the engine pulls the heads back one by one to the
    trunk's output unless that output has gradient hooks: a multi-grad hook there counts as
    one, so it runs once per step, as in a plain backward (it ran once per task and once
    more in a review of the first version). Also on attention's output changed in place and
    hooked after the change, which the step reads at its projection (it ran once per task in
    a second review)."""
    torch.manual_seed(0)
    first = nn.Linear(3, 4).double()
    last: nn.Module
    if trunk_end == "linear":
        last, x = nn.Linear(4, 4).double(), X
    else:
        last, x = nn.MultiheadAttention(4, 2, batch_first=True).double(), X.reshape(2, 2, 3)
    heads = [nn.Linear(4, 1).double() for _ in range(3)]
    params = [*first.parameters(), *last.parameters()]
    seen: list[int] = []

    def forward() -> Tensor:
        h = first(x).tanh()
        features = last(h) if trunk_end == "linear" else last(h, h, h, need_weights=False)[0]
        if trunk_end != "linear":
            features.relu_()
        torch.autograd.graph.register_multi_grad_hook(
            [features], lambda grads: seen.append(1), mode=mode
        )
        return torch.stack([head(features).sum() for head in heads])

    forward().sum().backward()
    assert seen == [1]
    with Engine(first, last, batch_dim=None) as engine:
        for _ in range(2):
            losses = forward()
            jacobian = reference_jacobian(losses, params)
            seen.clear()
            for param in params:
                param.grad = None
            weights = engine.backward(losses, UPGradWeighting())
            assert seen == [1]
    got = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    torch.testing.assert_close(got, weights @ jacobian)


def test_multi_grad_hook_on_a_generic_output_is_refused() -> None:
    """A user's multi-grad hook on the output of a module the engine re-runs with torch.func
    (the generic rule) would run twice, its forward registering it again: refused, as any
    gradient hook there is (a first version let it through); torch's module trackers' hooks
    are let through (``test_step_under_torchs_flop_counter``)."""
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), Scale(5), nn.Linear(5, 2)).double()
    model[2].register_forward_hook(
        lambda module, args, out: (
            torch.autograd.graph.register_multi_grad_hook([out], lambda grads: None) and None
        )
    )
    with Engine(model, batch_dim=0) as engine, pytest.raises(ValueError, match="gradient hook"):
        engine.backward(_losses(model, X), UPGradWeighting())
    assert all(p.grad is None for p in model.parameters())


def test_a_module_called_on_two_batches_with_concatenated_losses_is_refused() -> None:
    """Per sample, the losses of two batches concatenated do not match either call's batch:
    refused, naming that case and the way out; per task it is exact."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 2).double()
    first, second = torch.randn(3, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)

    def losses_of() -> Tensor:
        return torch.cat([layer(first), layer(second)]).pow(2).sum(1)

    engine = Engine(layer, batch_dim=0)
    _assert_refused(engine, losses_of(), list(layer.parameters()), r"several batches.*once on")
    engine.remove()
    engine = Engine(layer, batch_dim=None)
    assert_exact_gramian(engine, losses_of(), list(layer.parameters()))


# a learned table per class (of 3, and of B = 4 rows) and one per example, taken at labels
# or ids: no reordering of the samples
_CLASS_TABLE = torch.zeros(3, dtype=torch.float64, requires_grad=True)
_B_ROWS_TABLE = torch.zeros(4, dtype=torch.float64, requires_grad=True)
_EXAMPLE_TABLE = torch.zeros(20, dtype=torch.float64, requires_grad=True)
_AT_LABELS, _AT_IDS = torch.tensor([0, 2, 1, 2]), torch.tensor([10, 3, 7, 1])
# labels that form a permutation of the batch (as many classes as samples, one each)
_PERMUTATION = torch.tensor([3, 1, 0, 2])
_RAMP = torch.arange(4, dtype=torch.float64)

_REORDERINGS: dict[str, Callable[[Tensor], Tensor]] = {
    "sort": lambda out: out.sum(1).sort().values,
    "sort -1": lambda out: out.sum(1).sort(dim=-1).values,
    "stable sort": lambda out: out.sum(1).sort(stable=True).values,
    "sort then elementwise": lambda out: (2.0 * out.sum(1).sort().values.clone()).double(),
    "argsort index": lambda out: out.sum(1)[out.sum(1).argsort()],
    "argsort gather": lambda out: out.sum(1).gather(0, out.sum(1).argsort()),
    "index_select": lambda out: out.sum(1).index_select(0, torch.tensor([3, 2, 1, 0])),
    "swap behind relu": lambda out: torch.relu(out.sum(1)[torch.tensor([1, 0, 2, 3])]),
    "swap behind where": lambda out: torch.where(
        out[:, 0] > 0, out.sum(1)[torch.tensor([1, 0, 2, 3])], 0.0
    ),
    "swap unsqueezed": lambda out: out.sum(1)[torch.tensor([1, 0, 2, 3])][:, None],
    # (a chain that cancels out, or a gather in place, above a reordering: the walk goes on
    # past it; it ended there, and the reordering below was missed)
    "swap below a cancelling pair, past transposes": lambda out: out[
        torch.tensor([1, 0, 2, 3])
    ].T.T[torch.tensor([2, 0, 3, 1])][torch.tensor([1, 3, 0, 2])],
    "swap below a gather in place": lambda out: out[torch.tensor([1, 0, 2, 3])].gather(
        0, torch.arange(4)[:, None].expand(4, 2)
    ),
    "swap above a gather in place": lambda out: out.gather(
        0, torch.arange(4)[:, None].expand(4, 2)
    )[torch.tensor([1, 0, 2, 3])],
    "swap, whole slice": lambda out: out.sum(1)[torch.tensor([1, 0, 2, 3])][0:4],
    "swap, whole step slice": lambda out: out.sum(1)[torch.tensor([1, 0, 2, 3])][::1],
    "swap, whole slice from the end": lambda out: out.sum(1)[torch.tensor([1, 0, 2, 3])][-4:],
    "swap, sliced along dim 1": lambda out: out[torch.tensor([1, 0, 2, 3])][:, 1:],
    "swap, a column selected": lambda out: out[torch.tensor([1, 0, 2, 3])][:, 0],
    # (torch 2.6 to 2.8 record a whole slice for each ``[:, ...]``: 20 more nodes there)
    "swap, ten columns selected in turn": lambda out: functools.reduce(
        lambda t, _: t[:, None][:, 0], range(10), out.sum(1)[torch.tensor([1, 0, 2, 3])]
    ),
    "swap, one minus": lambda out: 1 - out.sum(1)[torch.tensor([1, 0, 2, 3])],
    "swap, two to its power": lambda out: 2 ** out.sum(1)[torch.tensor([1, 0, 2, 3])],
    "swap, clamped by tensors": lambda out: out.sum(1)[torch.tensor([1, 0, 2, 3])].clamp(
        torch.zeros(4, dtype=torch.float64), torch.full((4,), 9.0, dtype=torch.float64)
    ),
    "swap, log1p": lambda out: out.sum(1)[torch.tensor([1, 0, 2, 3])].log1p(),
    "topk of all": lambda out: out.sum(1).topk(4).values,
    "swap, one chunk": lambda out: out.sum(1)[torch.tensor([1, 0, 2, 3])].chunk(1)[0],
    "swap, columns chunked": lambda out: out[torch.tensor([1, 0, 2, 3])].chunk(2, dim=1)[1],
    "swap, columns split": lambda out: out[torch.tensor([1, 0, 2, 3])].split([1, 1], dim=1)[0],
    "swap, columns unbound": lambda out: out[torch.tensor([1, 0, 2, 3])].unbind(1)[1],
    "swap, whole slice without an end": lambda out: torch.ops.aten.slice.Tensor(
        out.sum(1)[torch.tensor([1, 0, 2, 3])], 0, 0, None
    ),
    "swap times a loss": lambda out: out.sum(1)[torch.tensor([1, 0, 2, 3])] * out[:, 0],
    # exact: each sample's own losses sorted, or taken in place
    "[B, k] sorted along dim 1": lambda out: out.sort(dim=1).values,
    "gathered along dim 1": lambda out: out.gather(1, torch.zeros(4, 1, dtype=torch.long)),
    "in place index": lambda out: out.sum(1)[torch.arange(4)],
    "in place after a permutation and its inverse": lambda out: (
        2.0 * out.sum(1)[torch.tensor([2, 0, 3, 1])]
    )[torch.tensor([1, 3, 0, 2])],
    "in place after a permutation, a whole slice and its inverse": lambda out: (
        out.sum(1)[torch.tensor([2, 0, 3, 1])][0:4]
    )[torch.tensor([1, 3, 0, 2])],
    "gathered by a matrix, its in-place column kept": lambda out: out.gather(
        0, torch.tensor([[0, 1], [1, 0], [2, 3], [3, 2]])
    )[:, :1],
    "gathered by a matrix, its in-place column selected": lambda out: out.gather(
        0, torch.tensor([[0, 1], [1, 0], [2, 3], [3, 2]])
    )[:, 0],
    "gathered by a matrix, its in-place column unbound": lambda out: out.gather(
        0, torch.tensor([[0, 1], [1, 0], [2, 3], [3, 2]])
    ).unbind(1)[0],
    "class table at labels": lambda out: (
        out.sum(1) * torch.exp(-_CLASS_TABLE[_AT_LABELS]) + _CLASS_TABLE.gather(0, _AT_LABELS)
    ),
    "table of B rows at labels": lambda out: out.sum(1) * _B_ROWS_TABLE[_AT_LABELS].exp(),
    "example table at ids": lambda out: out.sum(1) * torch.sigmoid(_EXAMPLE_TABLE[_AT_IDS]),
    "table of B rows at permuted labels": lambda out: out.sum(1) * _B_ROWS_TABLE[_PERMUTATION],
    "table of B rows gathered at permuted labels": lambda out: (
        out.sum(1) * _B_ROWS_TABLE.gather(0, _PERMUTATION).exp()
    ),
    "table of B rows selected at permuted labels": lambda out: (
        out.sum(1) + _B_ROWS_TABLE.index_select(0, _PERMUTATION)
    ),
    "table computed from parameters, sorted": lambda out: (
        out.sum(1) * (_B_ROWS_TABLE - _RAMP).sort().values.exp()
    ),
    "swap times a table at permuted labels": lambda out: (
        out.sum(1)[torch.tensor([1, 0, 2, 3])] * _B_ROWS_TABLE[_PERMUTATION]
    ),
    "swap of the losses plus a table": lambda out: (out.sum(1) + _B_ROWS_TABLE)[_PERMUTATION],
}
_EXACT = {
    "[B, k] sorted along dim 1",
    "gathered along dim 1",
    "in place index",
    "in place after a permutation and its inverse",
    "in place after a permutation, a whole slice and its inverse",
    "gathered by a matrix, its in-place column kept",
    "gathered by a matrix, its in-place column selected",
    "gathered by a matrix, its in-place column unbound",
    "class table at labels",
    "table of B rows at labels",
    "example table at ids",
    "table of B rows at permuted labels",
    "table of B rows gathered at permuted labels",
    "table of B rows selected at permuted labels",
    "table computed from parameters, sorted",
}


@pytest.mark.parametrize("name", _REORDERINGS)
def test_losses_reordered_along_the_batch_are_refused(name: str) -> None:
    """Losses sorted, indexed, gathered or selected along the batch: rows of other samples,
    which the probe missed when the probed samples mapped onto themselves (the Gramian 17%
    off, weights on the wrong losses). Each sample's own losses reordered, the batch taken in
    place, and learned tables taken at labels or ids (refused by a first version; then still
    where the labels formed a permutation of the batch) stay exact."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    engine = Engine(layer, batch_dim=0)

    def losses_of() -> Tensor:
        return _REORDERINGS[name](layer(x).pow(2))

    if name in _EXACT:
        assert_exact_gramian(engine, losses_of(), list(layer.parameters()))
        return
    _assert_refused(engine, losses_of(), list(layer.parameters()), r"reordered along the batch")


def test_learned_class_weights_at_labels_that_form_a_permutation() -> None:
    """Learned class weights outside the Engine taken at the labels (``ce * class_w[y]``),
    with as many classes as samples: refused as a reordering of the batch whenever the
    labels formed a permutation (at every step with one sample per class). Exact, and the
    weights' ``.grad`` untouched."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 6).double()
    class_w = nn.Parameter(torch.linspace(0.5, 1.5, 6, dtype=torch.float64))
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.tensor([5, 1, 4, 2, 3, 0])
    engine = Engine(layer, batch_dim=0)

    def forward() -> Tensor:
        return nn.functional.cross_entropy(layer(x), y, reduction="none") * class_w[y]

    assert_exact_step(engine, forward, list(layer.parameters()))
    assert class_w.grad is None


def test_losses_that_hold_an_already_stepped_forward_are_told_so() -> None:
    """The earlier forward's calls were taken by its step: its graph reaches the parameters
    outside the recorded calls, and the refusal says why (it spoke only of tied weights)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    engine = Engine(model, batch_dim=0)
    x1, x2 = torch.randn(5, 4), torch.randn(5, 4)
    first = model(x1).squeeze(1) ** 2
    engine.backward(first, UPGradWeighting(), retain_graph=True)
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    second = model(x2).squeeze(1) ** 2
    with pytest.raises(ValueError, match="earlier forward whose calls a step already took"):
        engine.backward(first + second, UPGradWeighting())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))  # type: ignore[arg-type]


def test_a_delegate_set_on_the_instance_after_hooking_changes_the_rule() -> None:
    """A convolution's ``_conv_forward`` replaced on the instance after the Engine hooked it
    (as its ``forward`` would be) is seen at the next forward: the generic rule, exact."""
    torch.manual_seed(0)
    conv = nn.Conv1d(2, 3, 2).double()
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(9, 1)).double()
    x = torch.randn(4, 2, 4, dtype=torch.float64)
    with Engine(model, batch_dim=0) as engine:
        engine.compute_gramian(model(x).squeeze(1))
        plain = conv._conv_forward
        conv._conv_forward = lambda x, w, b: plain(x, w**2, b)  # type: ignore[method-assign]
        assert_exact_gramian(engine, model(x).squeeze(1).pow(2), list(model.parameters()))


def test_a_module_called_on_a_subset_of_the_rows_is_refused_with_the_reason() -> None:
    """A layer called on some of the batch's rows (routing, ``x[mask]``) is refused per sample,
    and the message says so (it only spoke of expanding a tensor to the batch)."""
    first, expert = nn.Linear(3, 2).double(), nn.Linear(2, 2).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    with Engine(first, expert, batch_dim=0) as engine:
        h = first(x)
        routed = h.clone()
        routed[:2] = expert(h[:2])
        with pytest.raises(ValueError, match=r"subset of the batch's rows .* batch_dim=None"):
            engine.compute_gramian(routed.pow(2).sum(1))


_CHAIN_PERMS = [torch.tensor(p) for p in ([2, 0, 3, 1], [1, 3, 0, 2], [3, 2, 1, 0], [0, 1, 2, 3])]


def _apply_op(op: str, t: Tensor) -> Tensor:
    """One op of a chain on a ``[4, 2]`` or ``[2, 4]`` tensor whose batch (of 4) is the
    dimension of size 4: a transpose, an elementwise op, or a take along the batch."""
    if op == "T":
        return t.T
    if op == "exp":
        return t.exp() if t.is_floating_point() and t.requires_grad else t
    axis = 0 if t.shape[0] == 4 else 1
    perm = _CHAIN_PERMS[int(op[-1])]
    if op.startswith("index"):
        return t[perm] if axis == 0 else t[:, perm]
    if op.startswith("select"):
        return t.index_select(axis, perm)
    index = perm[:, None].expand(4, 2) if axis == 0 else perm[None].expand(2, 4)
    return t.gather(axis, index)


@given(
    st.lists(
        st.sampled_from(
            [
                "T",
                "exp",
                *(f"{kind}{i}" for kind in ("index", "select", "gather") for i in range(4)),
            ]
        ),
        min_size=1,
        max_size=6,
    )
)
@settings(max_examples=200, deadline=None)
def test_the_reordering_check_never_accepts_a_reordered_batch(ops: list[str]) -> None:
    """Soundness of the check on chains of transposes, elementwise ops and takes along the
    batch (as the losses of ``batch_dim`` 0 or 1 reach it): where it accepts, every loss is at
    its own sample's place, as the sample indices carried through the same chain show."""
    t = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    samples = torch.arange(4)[:, None].expand(4, 2)  # (each entry's sample)
    for op in ops:
        t, samples = _apply_op(op, t), _apply_op(op, samples)
    batch_first = t if t.shape[0] == 4 else t.movedim(1, 0)
    samples = samples if samples.shape[0] == 4 else samples.movedim(1, 0)
    try:
        engine_module._check_not_ordered_by_value(batch_first, lambda _: True)
    except ValueError:
        return
    assert torch.equal(samples, torch.arange(4)[:, None].expand(4, 2))


class _Critic(nn.Module):
    """A generator and a critic in one model; the critic (or its weight only) frozen around
    its call in the generator's loss (the usual GAN toggle), trainable again after it unless
    told not to."""

    def __init__(self, unfreeze: bool, part: str = "critic") -> None:
        super().__init__()
        self.generator, self.critic = nn.Linear(3, 4).double(), nn.Linear(4, 2).double()
        self.unfreeze, self.part = unfreeze, part

    def forward(self, x: Tensor) -> Tensor:
        fake = torch.tanh(self.generator(x))
        frozen = self.critic if self.part == "critic" else self.critic.weight
        frozen.requires_grad_(False)
        out = self.critic(fake) + self.critic(x[:, :1].expand(-1, 4))
        frozen.requires_grad_(self.unfreeze)
        return out


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("unfreeze", [True, False])
def test_a_module_frozen_for_its_call_only(batch_dim: int | None, unfreeze: bool) -> None:
    """A closed-form module frozen around its calls and trainable again at the step (or not):
    autograd gives its parameters no gradient from those calls. Its closed form gave them one
    (a wrong Gramian and a ``.grad`` on the critic); then the step was refused. Now those
    calls are left out, as autograd leaves them."""
    torch.manual_seed(0)
    model = _Critic(unfreeze=unfreeze)
    params = list(model.generator.parameters())
    with Engine(model, batch_dim=batch_dim) as engine:

        def forward() -> Tensor:
            out = model(X).pow(2)
            return out.sum(1) if batch_dim == 0 else out.mean(0)

        assert_exact_step(engine, forward, params)
    assert all(p.grad is None for p in model.critic.parameters())


@pytest.mark.parametrize("batch_dim", [0, None])
def test_a_module_partly_frozen_for_its_call_only_is_refused(batch_dim: int | None) -> None:
    """A module with some of its parameters frozen around its call and trainable again at the
    step: the closed forms cannot leave out a part of a call's parameters. Refused, naming the
    module; kept frozen to the step, the step is exact (the frozen ones left out)."""
    torch.manual_seed(0)
    model = _Critic(unfreeze=True, part="weight")
    with Engine(model, batch_dim=batch_dim) as engine:
        out = model(X).pow(2)
        losses = out.sum(1) if batch_dim == 0 else out.mean(0)
        match = r"_Critic.critic \(Linear\) was called with some of its parameters frozen"
        _assert_refused(engine, losses, list(model.parameters()), match)
    model = _Critic(unfreeze=False, part="weight")
    with Engine(model, batch_dim=batch_dim) as engine:
        out = model(X).pow(2)
        losses = out.sum(1) if batch_dim == 0 else out.mean(0)
        params = [*model.generator.parameters(), model.critic.bias]
        assert_exact_gramian(engine, losses, params)


class _Centred(nn.Module):
    """Mixes the samples outside its hooked layers: ``h - h.mean(0)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 5).double(), nn.Linear(5, 2).double()

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h - h.mean(0))


@pytest.mark.parametrize("corrupt", ["one entry", "one sample"])
def test_a_non_finite_probe_does_not_turn_the_mixing_check_off(corrupt: str) -> None:
    """A batch with a NaN (a corrupt sample, an overflow) made the probe that refuses losses
    mixing the samples give no verdict, and the pattern was then marked as checked: the later
    clean steps of that model were accepted with a wrong Gramian. The probe now judges the
    finite entries, and a probe with no verdict is run again at the next step."""
    torch.manual_seed(0)
    model = _Centred()
    corrupted = X.clone()
    if corrupt == "one entry":
        corrupted[2, 0] = float("nan")
    else:
        corrupted[2] = float("nan")
    with Engine(model, batch_dim=0) as engine:
        try:
            engine.compute_gramian(model(corrupted).pow(2).sum(1))
        except ValueError as error:  # (where the finite entries show the mixing)
            assert "at other samples than their own" in str(error)
            assert corrupt == "one entry"
        with pytest.raises(ValueError, match=r"at other samples than their own"):
            engine.compute_gramian(model(X).pow(2).sum(1))


def test_a_hook_that_changes_the_losses_gradient_in_place_leaves_later_steps_exact() -> None:
    """Per task, the identity cotangents are kept from step to step; a gradient hook on the
    losses that changed its gradient in place at one step changed them, and every later step
    (without the hook) had a wrong Gramian. They are built again when changed."""
    model = _mlp()
    params = list(model.parameters())
    with Engine(model, batch_dim=None) as engine:
        for step in range(3):
            losses = model(X).pow(2).sum(0)
            if step == 1:
                losses.register_hook(lambda grad: grad.clamp_(max=0.5))
                engine.compute_gramian(losses)
                continue
            assert_exact_gramian(engine, losses, params)


@pytest.mark.parametrize("layout", ["[B, k]", "per task", "generic"])
def test_steps_under_anomaly_mode_are_exact(layout: str) -> None:
    """Under ``torch.autograd.detect_anomaly()`` (whose NaN check of each backward's output
    vmap cannot batch), the rows are pulled back one by one: the steps that batched them
    failed with an error blaming cuDNN or hooks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Linear(4, 2)).double()
    modules = [model] if layout == "generic" else [model[0], model[2]]
    params = [p for module in modules for p in module.parameters()]
    engine = Engine(*modules, batch_dim=None if layout == "per task" else 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (anomaly mode's own warning, at its creation)
        anomaly = torch.autograd.detect_anomaly()
    with engine, anomaly:
        out = model(X).pow(2)
        assert_exact_gramian(engine, out.mean(0) if layout == "per task" else out, params)


class _Mixer(nn.Module):
    """A generic-rule module that, behind a flag, also reads another hooked layer's weight
    (not a child of its own): a use outside that layer's calls."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-0.5, 0.5, 9, dtype=torch.float64).reshape(3, 3))
        self.other = [other]  # (a list: not registered as a child)
        self.reads_other = False

    def forward(self, h: Tensor) -> Tensor:
        out = torch.tanh(h @ self.w)
        return out + F.linear(h, self.other[0].weight) if self.reads_other else out


@pytest.mark.parametrize("batch_dim", [0, None])
def test_a_generic_module_that_starts_reading_another_weight_is_refused(
    batch_dim: int | None,
) -> None:
    """The check of hooked parameters used outside their modules' calls ran once per pattern,
    keyed by the graph outside the calls: a generic-rule module whose forward started to read
    another hooked layer's weight at a later step kept the key, and the step missed that use
    (a wrong Gramian). The calls that the generic rule re-runs are now walked through."""
    layer = nn.Linear(3, 3).double()
    mixer = _Mixer(layer)
    model = nn.Sequential(mixer, layer)
    with Engine(model, batch_dim=batch_dim) as engine:
        out = model(X).pow(2)
        assert_exact_gramian(
            engine,
            out.sum(1) if batch_dim == 0 else out.mean(0),
            [*mixer.parameters(), *layer.parameters()],
        )
        mixer.reads_other = True
        out = model(X).pow(2)
        losses = out.sum(1) if batch_dim == 0 else out.mean(0)
        match = r"Sequential.1.weight is used outside the forward calls of the hooked modules"
        _assert_refused(engine, losses, list(model.parameters()), match)


@pytest.mark.parametrize("passing", ["frozen attack", "teacher through functional_call"])
def test_a_forward_in_a_passing_state_before_the_step_forward_is_exact(
    passing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grad-enabled forward made in a passing state before the training forward (the
    model frozen for an attack on its inputs; a teacher's pass through ``functional_call``
    with detached tensors) hooked the modules for that state at the one look between steps,
    and every step was then refused ("run the forward again"). The look is made at every
    grad-enabled forward with no call pending: each step is the brute force's, and the
    checks made once per pattern (the probe of the samples' separation) are not made again
    when the modules are hooked back to a layout seen before."""
    model = _mlp()
    params = list(model.parameters())
    probes: list[int] = []
    check = engine_module._check_separable
    monkeypatch.setattr(engine_module, "_check_separable", lambda *a: probes.append(1) or check(*a))
    with Engine(model, batch_dim=0) as engine:
        for _ in range(3):
            if passing == "frozen attack":
                model.requires_grad_(False)
                x = X.clone().requires_grad_()
                attack = torch.autograd.grad(model(x).pow(2).sum(), x)[0]
                model.requires_grad_(True)
                inputs, target = X + 0.01 * attack.sign(), 0.0
            else:
                detached = {name: p.detach().clone() for name, p in model.named_parameters()}
                inputs, target = X, torch.func.functional_call(model, detached, (X,)).sin()
            assert_exact_gramian(engine, (model(inputs) - target).pow(2).sum(1), params)
    assert len(probes) == 1


def test_hooked_modules_run_under_vmap_get_a_refusal_that_names_it() -> None:
    """A forward that maps the model over the samples with ``torch.func.vmap`` records no
    call (the outputs carry no graph inside the transform): the refusal said only to create
    the Engine before the forward; it now names the transform and the way out."""
    model = _mlp()
    with Engine(model, batch_dim=0) as engine:
        losses = torch.func.vmap(model)(X).pow(2).sum(1)
        match = r"No forward call.*ran under a torch.func transform \(vmap, jvp, grad\)"
        _assert_refused(engine, losses, list(model.parameters()), match)
        # (the next step, without the transform, records its calls again)
        assert_exact_gramian(engine, model(X).pow(2).sum(1), list(model.parameters()))


@pytest.mark.parametrize("compile_with", ["script", "trace"])
def test_a_torchscript_module_is_refused_at_construction(compile_with: str) -> None:
    """A TorchScript module runs no Python forward hooks: a scripted one crashed the
    constructor with torch's error, a traced one was refused at the step for "no forward
    call" without naming TorchScript."""
    model = _mlp()
    with warnings.catch_warnings():  # (torch 2.14 deprecates TorchScript, trace_method too)
        warnings.simplefilter("ignore", FutureWarning)
        scripted = (
            torch.jit.script(model) if compile_with == "script" else torch.jit.trace(model, X)
        )
    with pytest.raises(TypeError, match=r"modules\[0\] is a TorchScript module.*eager module"):
        Engine(scripted, batch_dim=0)
    outer = nn.Sequential(scripted)
    with pytest.raises(TypeError, match=r"modules\[0\]\.0 is a TorchScript module"):
        Engine(outer, batch_dim=0)
    # (one without a trainable parameter is no unit: the model around it is exact, as before)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        activation = torch.jit.script(nn.Tanh())
    model = nn.Sequential(nn.Linear(3, 4), activation, nn.Linear(4, 2)).double()
    with Engine(model, batch_dim=0) as engine:
        assert_exact_gramian(engine, model(X).pow(2).sum(1), list(model.parameters()))


@pytest.mark.parametrize("when", ["before the Engine", "after the Engine"])
def test_a_forward_patched_on_a_registered_class_loses_the_closed_form(
    when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``nn.Linear.forward`` patched on the class (or on a subclass after the Engine hooked
    it) kept Linear's closed form, which assumes ``x @ W^T + b``: a wrong Gramian. Such a
    module now takes the generic rule, whose re-run follows the patched forward."""

    class Linear(nn.Linear):
        pass

    def squared(self: nn.Linear, x: Tensor) -> Tensor:
        return F.linear(x, self.weight * self.weight.abs(), self.bias)

    torch.manual_seed(0)
    model = nn.Sequential(Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    params = list(model.parameters())
    if when == "before the Engine":
        monkeypatch.setattr(nn.Linear, "forward", squared)
    with Engine(model, batch_dim=0) as engine:
        if when == "after the Engine":
            monkeypatch.setattr(Linear, "forward", squared)
        assert_exact_gramian(engine, model(X).pow(2).sum(1), params)


def test_calls_on_a_frozen_model_that_the_losses_do_not_read_are_left_out() -> None:
    """An attack's forward on the frozen model, recorded (its outputs require grad through the
    input) but not read by the losses, then the training forward: the refusal of a module
    frozen during a call looked at every recorded call and refused each step; it looks at the
    calls the losses read only. (The Engine on a container whose own forward is never called,
    so that no forward looks for changed modules.)"""
    model = _mlp()
    params = list(model.parameters())
    with Engine(nn.ModuleDict({"net": model}), batch_dim=0) as engine:
        for _ in range(2):
            model.requires_grad_(False)
            x = X.clone().requires_grad_()
            attack = torch.autograd.grad(model(x).pow(2).sum(), x)[0]
            model.requires_grad_(True)
            assert_exact_gramian(engine, model(X + 0.01 * attack.sign()).pow(2).sum(1), params)


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("order", ["frozen_first", "frozen_second"])
def test_a_generic_module_called_trainable_and_frozen(batch_dim: int | None, order: str) -> None:
    """A module under the generic rule called twice, trainable and frozen around the other
    call: autograd gives it the trainable call's share only. Its re-run gave it both calls'
    per task (a wrong Gramian) and failed per sample; the frozen call is now left out. With
    only some of its parameters frozen around a call, it is refused."""
    torch.manual_seed(0)
    pre, scale = nn.Linear(3, 3).double(), _ScaleShift().double()

    def forward(frozen: nn.Module | Tensor) -> Tensor:
        h = pre(X)
        if order == "frozen_second":
            trained = scale(2 * h)
        frozen.requires_grad_(False)
        out = scale(h)
        frozen.requires_grad_(True)
        if order == "frozen_first":
            trained = scale(2 * h)
        losses = (out * trained).pow(2).sum(1)
        return losses if batch_dim == 0 else torch.stack([losses.sum(), losses[0]])

    params = [*pre.parameters(), *scale.parameters()]
    with Engine(pre, scale, batch_dim=batch_dim) as engine:
        assert_exact_step(engine, lambda: forward(scale), params)
        for p in params:
            p.grad = None
        first = next(scale.parameters())
        match = r"_ScaleShift\) was called with some of its parameters frozen"
        _assert_refused(engine, forward(first), params, match)


@pytest.mark.parametrize("batch_dim", [0, None])
def test_a_step_whose_calls_were_all_frozen_is_zero(batch_dim: int | None) -> None:
    """Every call that the losses read was made with its module frozen, trainable again at the
    step: autograd gives a zero Jacobian, the engine a zero Gramian and no ``.grad`` (it said
    that no forward call of its modules was in the losses' graph)."""
    model = _Critic(unfreeze=True)
    with Engine(model.critic, batch_dim=batch_dim) as engine:
        out = model(X).pow(2)
        losses = out.sum(1) if batch_dim == 0 else out.mean(0)
        m = losses.numel()
        assert torch.equal(engine.compute_gramian(losses), torch.zeros(m, m, dtype=torch.float64))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("batch_dim", [0, None])
def test_parameters_replaced_then_frozen_around_a_call(batch_dim: int | None) -> None:
    """Parameters replaced under their names (``load_state_dict(assign=True)``, resuming) and
    then frozen around a call: the freezing was read from the old ones, and the call's share
    given to the new ones. Read from those the module holds at the call, the call is left
    out."""
    torch.manual_seed(0)
    model = _Critic(unfreeze=True)
    state = {k: v.clone() + 0.5 for k, v in model.critic.state_dict().items()}
    with Engine(model, batch_dim=batch_dim) as engine:
        model.critic.load_state_dict(state, assign=True)

        def forward() -> Tensor:
            out = model(X).pow(2)
            return out.sum(1) if batch_dim == 0 else out.mean(0)

        assert_exact_step(engine, forward, list(model.generator.parameters()))
    assert all(p.grad is None for p in model.critic.parameters())


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize("critic_kind", ["plain", "spectral_norm"])
def test_a_gan_loop_with_one_engine_on_both_networks(
    batch_dim: int | None, critic_kind: str
) -> None:
    """``Engine(generator, critic)``: the critic's step, then the generator's with the critic
    frozen for its forward and trainable again before the step (the order of many GAN loops).
    The generator's step was refused at every iteration ("modules changed"); it is
    autograd's now, the critic left alone. Unfrozen in the middle of the forward and called
    trainable, the critic's calls were not recorded: still refused."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4)).double()
    critic = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    if critic_kind == "spectral_norm":  # (a generic-rule unit with no parameter when frozen)
        parametrize.register_parametrization(critic[0], "weight", _Halved())
    engine = Engine(generator, critic, batch_dim=batch_dim)
    z, real = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)

    def reduced(per_sample: Tensor) -> Tensor:
        return per_sample if batch_dim == 0 else torch.stack([per_sample.sum(), per_sample[0]])

    def critic_losses() -> Tensor:
        fake = generator(z).detach()
        return reduced((critic(real) - 1).pow(2).squeeze(1) + critic(fake).pow(2).squeeze(1))

    def generator_losses() -> Tensor:
        critic.requires_grad_(False)
        losses = reduced((critic(generator(z)) - 1).pow(2).squeeze(1))
        critic.requires_grad_(True)
        return losses

    generator_params, critic_params = list(generator.parameters()), list(critic.parameters())
    for _ in range(2):
        assert_exact_step(engine, critic_losses, critic_params)
        assert all(p.grad is None for p in generator_params)
        critic.zero_grad(set_to_none=True)
        assert_exact_step(engine, generator_losses, generator_params)
        assert all(p.grad is None for p in critic_params)
        generator.zero_grad(set_to_none=True)
    critic.requires_grad_(False)
    fake = generator(z)
    critic.requires_grad_(True)
    losses = reduced((critic(fake) - 1).pow(2).squeeze(1))
    _assert_refused(engine, losses, generator_params + critic_params, "modules changed since")


class _Halved(nn.Module):
    """A parametrization (as ``spectral_norm``'s, without its power iteration's state)."""

    def forward(self, weight: Tensor) -> Tensor:
        return weight / 2


class _ScaleShift(nn.Module):
    """``x * s + t``: two parameters of its own, without a closed form (the generic rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.s, self.t = nn.Parameter(torch.linspace(0.5, 1.5, 3)), nn.Parameter(torch.ones(3))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.s + self.t


@pytest.mark.parametrize("unfreeze", [True, False])
def test_a_parametrized_critic_frozen_for_the_forward_on_twice_the_batch(unfreeze: bool) -> None:
    """Per sample, a parametrized critic (a unit with no trainable parameter while frozen)
    frozen for the generator's forward and called on ``cat([real, fake])``, ``2 B`` rows: its
    calls are left out, as those of a plain frozen critic are (its rows, not the batch's, were
    refused: "must have its batch size")."""
    torch.manual_seed(0)
    generator = nn.Linear(3, 4).double()
    critic = nn.Linear(4, 1).double()
    parametrize.register_parametrization(critic, "weight", _Halved())
    real = torch.randn(4, 4, dtype=torch.float64)
    with Engine(generator, critic, batch_dim=0) as engine:

        def forward() -> Tensor:
            critic.requires_grad_(False)
            scores = critic(torch.cat([real, torch.tanh(generator(X))]))
            critic.requires_grad_(unfreeze)
            return (scores[4:] - scores[:4]).squeeze(1).pow(2)

        assert_exact_step(engine, forward, list(generator.parameters()))
    critic.requires_grad_(True)
    assert all(p.grad is None for p in critic.parameters())


@pytest.mark.parametrize("batch_dim", [0, None])
def test_a_hook_run_before_the_engines_that_freezes_the_module_is_refused(
    batch_dim: int | None,
) -> None:
    """A forward hook run before the engine's (``prepend=True`` after the Engine) that freezes
    the module after its call: the call's graph holds the parameters, yet the call was read as
    one made frozen and left out (a wrong Gramian). The refusal of such a hook comes first."""
    torch.manual_seed(0)
    pre, layer = nn.Linear(3, 4).double(), nn.Linear(4, 2).double()
    params = [*pre.parameters(), *layer.parameters()]
    with Engine(pre, layer, batch_dim=batch_dim) as engine:
        layer.register_forward_hook(lambda m, i, o: m.requires_grad_(False) and None, prepend=True)
        out = layer(torch.tanh(pre(X))).pow(2)
        layer.requires_grad_(True)
        losses = out.sum(1) if batch_dim == 0 else out.mean(0)
        _assert_refused(engine, losses, params, "A forward hook ran before the Engine's")
