"""The generic rule (``_fallback.py``): its re-run checks, against a brute-force reference on
an unhooked copy (``G = J J^T``, ``.grad = w @ J`` plus the ``.grad`` already there), and its
refusals, which leave the ``.grad`` and the random generators as they were."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from jacflow.aggregation import UPGradWeighting
from jacflow.autogram import Engine
from jacflow.autogram import _fallback as fallback
from jacflow.autogram._fallback import ReplayMismatchError
from tests.autogram.test_engine import reference_jacobian

Losses = Callable[[nn.Module], Tensor]


def _hooked(model: nn.Module) -> nn.Module:
    """The module the engine hooks: ``model.inner`` where it has one, else ``model``."""
    return model.inner if hasattr(model, "inner") else model


def _params(model: nn.Module) -> list[Tensor]:
    return list(_hooked(model).parameters())


def _seed_grads(model: nn.Module) -> list[Tensor]:
    """Put a random ``.grad`` on the hooked parameters; return copies of them."""
    for p in _params(model):
        p.grad = torch.randn_like(p)
    return [p.grad.clone() for p in _params(model)]  # type: ignore[union-attr]


def _assert_exact(model: nn.Module, losses: Losses, batch_dim: int | None) -> None:
    """The engine's Gramian and step on ``model`` match the reference on a deep copy."""
    reference = copy.deepcopy(model)
    jacobian = reference_jacobian(losses(reference), _params(reference))
    previous = torch.cat([g.flatten() for g in _seed_grads(model)])
    with Engine(_hooked(model), batch_dim=batch_dim) as engine:
        torch.testing.assert_close(engine.compute_gramian(losses(model)), jacobian @ jacobian.T)
        weights = engine.backward(losses(model), UPGradWeighting())
    actual = torch.cat([p.grad.flatten() for p in _params(model)])  # type: ignore[union-attr]
    torch.testing.assert_close(actual, weights.flatten() @ jacobian + previous)


def _assert_refused(
    model: nn.Module, losses: Losses, batch_dim: int | None, error: type[Exception], match: str
) -> str:
    """Both the Gramian and the step are refused, with the ``.grad`` unchanged; the message."""
    previous = _seed_grads(model)
    with Engine(_hooked(model), batch_dim=batch_dim) as engine:
        with pytest.raises(error, match=match):
            engine.compute_gramian(losses(model))
        with pytest.raises(error, match=match) as caught:
            engine.backward(losses(model), UPGradWeighting())
    for p, g in zip(_params(model), previous, strict=True):
        assert torch.equal(p.grad, g)  # type: ignore[arg-type]
    return str(caught.value)


def _squares(model: nn.Module) -> Tensor:
    return model(X).pow(2).sum(1)


def _task_losses(model: nn.Module) -> Tensor:
    out = model(X)
    return torch.stack([out.pow(2).sum(), out[0].sum()])


def _losses(batch_dim: int | None) -> Losses:
    return _squares if batch_dim == 0 else _task_losses


X = torch.linspace(-1.3, 1.7, 15, dtype=torch.float64).reshape(5, 3).sin()


class _BatchStatNorm(nn.Module):
    """A batch norm by hand (training mode): the variance of one sample is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return (x - x.mean(0)) / (x.var(0) + 1e-5).sqrt() * self.gain


@pytest.mark.filterwarnings("ignore:var.*degrees of freedom:UserWarning")
def test_nan_in_the_re_run_is_a_mismatch() -> None:
    """Per sample, the re-run's NaN passed the check: the Gramian and ``.grad`` were NaN."""
    _assert_refused(_BatchStatNorm(), _squares, 0, ReplayMismatchError, "NaN or inf")
    _assert_exact(_BatchStatNorm(), _task_losses, None)


class _MaskedScores(nn.Module):
    """Scores with their last column masked to -inf, divided by the batch size if ``read``."""

    def __init__(self, read: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(3, 4))
        self.read = read

    def forward(self, x: Tensor) -> Tensor:
        scores = x @ self.weight / (x.shape[0] if self.read else 1)
        mask = torch.zeros_like(scores, dtype=torch.bool)
        mask[:, -1] = True
        return scores.masked_fill(mask, float("-inf"))


def _logsumexp(model: nn.Module) -> Tensor:
    return model(X).logsumexp(1)


def test_inf_in_the_output_keeps_the_check() -> None:
    """An inf in the recorded output made the tolerance infinite: a module reading the batch
    size was not refused (its Gramian B^2 too large); the infs are now compared exactly."""
    _assert_refused(_MaskedScores(read=True), _logsumexp, 0, ReplayMismatchError, "other outputs")
    _assert_exact(_MaskedScores(read=False), _logsumexp, 0)
    _assert_exact(_MaskedScores(read=True), lambda m: m(X).logsumexp(1)[:2], None)


class _ReZero(nn.Module):
    """``x + alpha * tanh(c(x) @ W)``, its gate ``alpha`` at 0 (as initialised), whose branch
    mixes the samples: ``c`` centres the batch, or, if ``straight``, adds a straight-through
    ``m - m.detach()`` of the batch mean (zero in value, not in gradient)."""

    def __init__(self, straight: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1, 1, 9, dtype=torch.float64).reshape(3, 3))
        self.alpha = nn.Parameter(torch.zeros((), dtype=torch.float64))
        self.straight = straight

    def forward(self, x: Tensor) -> Tensor:
        mean = (x * self.weight[0]).mean(0)
        if self.straight:
            return x * self.weight[1] + (mean - mean.detach())
        return x + self.alpha * torch.tanh((x - x.mean(0)) @ self.weight)


@pytest.mark.parametrize("straight", [False, True])
def test_mixing_the_outputs_do_not_show_is_refused(straight: bool) -> None:
    """Per sample, a module mixing the samples with no effect on its outputs (a gate at 0) gave
    a Gramian of zeros where the reference's is not: the rows' gradients are now checked
    against a re-run on the whole batch. Per task, it is exact."""
    _assert_refused(_ReZero(straight), _squares, 0, ReplayMismatchError, "mixes the samples")
    _assert_exact(_ReZero(straight), _task_losses, None)


class _Gated(nn.Module):
    """The per-sample counterpart of :class:`_ReZero`, which the check lets through."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1, 1, 9, dtype=torch.float64).reshape(3, 3))
        self.alpha = nn.Parameter(torch.zeros((), dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.alpha * torch.tanh((x - x.mean(1, keepdim=True)) @ self.weight)


def test_a_gate_at_zero_without_mixing_stays_exact() -> None:
    _assert_exact(_Gated(), _squares, 0)
    _assert_exact(_Gated(), lambda m: m(X).pow(2)[:, :2], 0)  # (two rows per sample)


class _Float32Norm(nn.Module):
    """An RMS norm computed in float32 whatever the input's dtype, as Gemma's (its gain cast
    too); ``mix``: plus a straight-through ``m - m.detach()`` of the batch mean, in float32."""

    def __init__(self, mix: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-0.5, 0.5, 16, dtype=torch.float64))
        self.mix = mix

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.weight.float())
        if self.mix:
            mean = (h * self.weight.float()).mean(0)
            h = h + (mean - mean.detach())
        return h.type_as(x)


def test_a_forward_in_a_lower_precision_is_checked_at_that_precision() -> None:
    """A float64 model whose module computes in float32 (the RMSNorm of Gemma in a float64
    model): the sum of the re-run's per-sample gradients differed from the forward's backward
    by float32 roundoff, far beyond float64's, and the exact step was refused as mixing the
    samples. The check now allows the lowest precision in the module's forward graph; a module
    that does mix the samples so is still refused."""
    x = torch.linspace(-2, 2, 6 * 5 * 16, dtype=torch.float64).reshape(6, 5, 16).sin()

    def squares(model: nn.Module) -> Tensor:
        return model(x).pow(2).mean((1, 2))

    torch.manual_seed(0)
    _assert_exact(nn.Sequential(nn.Linear(16, 16, dtype=torch.float64), _Float32Norm()), squares, 0)
    _assert_refused(_Float32Norm(mix=True), squares, 0, ReplayMismatchError, "mixes the samples")


class _OwnGeneratorDropout(nn.Module):
    """A dropout drawing its mask from the module's own generator."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1, 1, 9, dtype=torch.float64).reshape(3, 3))
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x: Tensor) -> Tensor:
        keep = torch.rand(x.shape, generator=self.generator, dtype=x.dtype) > 0.5
        return x @ self.weight * keep * 2


class _Then(nn.Module):
    """``inner``, then an in-place ReLU on its output if ``in_place``, else an out-of-place one."""

    def __init__(self, inner: nn.Module, in_place: bool) -> None:
        super().__init__()
        self.inner, self.in_place = inner, in_place

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu_(self.inner(x)) if self.in_place else torch.relu(self.inner(x))


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("batch_dim", [0, None])
def test_random_draws_of_a_module_generator_are_refused_before_they_draw(
    in_place: bool, batch_dim: int | None
) -> None:
    """Per task, the re-run drew from the module's own generator unseen: refused, it had
    advanced it; after an in-place op, the Gramian was another mask's. Now refused, before the
    draw: the module's generator and the global one are as the forward left them."""
    model = _Then(_OwnGeneratorDropout(), in_place)
    previous = _seed_grads(model)
    with Engine(model.inner, batch_dim=batch_dim) as engine:
        for step in (engine.compute_gramian, lambda t: engine.backward(t, UPGradWeighting())):
            losses = _losses(batch_dim)(model)
            states = model.inner.generator.get_state(), torch.get_rng_state()
            with pytest.raises(ValueError, match="random operations"):
                step(losses)
            assert torch.equal(states[0], model.inner.generator.get_state())
            assert torch.equal(states[1], torch.get_rng_state())
    for p, g in zip(_params(model), previous, strict=True):
        assert torch.equal(p.grad, g)  # type: ignore[arg-type]


class _Counter(nn.Module):
    """A module that scales its output by the number of times it was called."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return x * self.gain * self.calls


@pytest.mark.parametrize("in_place", [False, True])
def test_a_call_counter_is_refused_per_task_after_an_in_place_op(in_place: bool) -> None:
    """Per task, an output changed in place was not compared: a call counter gave a Gramian
    4x the reference's. It is now compared with a second re-run."""
    _assert_refused(_Then(_Counter(), in_place), _task_losses, None, ReplayMismatchError, "counter")


class _Checkpointed(nn.Module):
    """``tanh(x @ W)`` under a non-reentrant activation checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1, 1, 9, dtype=torch.float64).reshape(3, 3))

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(
            lambda z: torch.tanh(z @ self.weight), x, use_reentrant=False
        )


@pytest.mark.parametrize("batch_dim", [0, None])
def test_a_non_reentrant_checkpoint_inside_is_exact(batch_dim: int | None) -> None:
    """torch.func failed on the saved tensor hooks of ``use_reentrant=False`` (a raw torch
    error per task); the re-run now calls the checkpointed function plainly."""
    _assert_exact(_Checkpointed(), _losses(batch_dim), batch_dim)


def _checkpoint_runs(function_runs: list[int]) -> int:
    """How often a checkpointed function runs in one forward and backward (2 where the
    checkpoint recomputes it in the backward, 1 where it runs plainly)."""
    before = len(function_runs)
    x = torch.ones(2, 3, requires_grad=True)
    checkpointed = torch.utils.checkpoint.checkpoint(
        lambda z: function_runs.append(1) or z.sin(), x, use_reentrant=False
    )
    checkpointed.sum().backward()
    return len(function_runs) - before


def test_plain_checkpoints_only_in_the_re_running_thread() -> None:
    """The re-run's plain checkpoints apply to its own thread only, and end with it, also when
    re-runs of two threads overlap (A starts, B starts, A ends, B ends): a swap of torch's
    function left checkpoints plain in every thread, and for good after such an overlap."""
    runs: list[int] = []
    counts: dict[str, int] = {}
    a_in, b_in, a_out, other_done = (threading.Event() for _ in range(4))

    def thread_a() -> None:
        with fallback._plain_checkpoints():
            counts["inside"] = _checkpoint_runs(runs)
            a_in.set()
            b_in.wait()
        a_out.set()

    def thread_b() -> None:
        a_in.wait()
        with fallback._plain_checkpoints():
            b_in.set()
            other_done.wait()
            a_out.wait()

    def other() -> None:  # (a checkpoint in a third thread while both re-runs are under way)
        b_in.wait()
        counts["other"] = _checkpoint_runs(runs)
        other_done.set()

    threads = [threading.Thread(target=f) for f in (thread_a, thread_b, other)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counts == {"inside": 1, "other": 2}
    assert _checkpoint_runs(runs) == 2  # (after both: torch's checkpoint again)


class _RReLUBlock(nn.Module):
    """A generic-rule module with an eval-mode RReLU (a fixed slope: no random draw, though
    torch tags the operation as random)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1, 1, 9, dtype=torch.float64).reshape(3, 3))
        self.act = nn.RReLU().eval()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(x @ self.weight)


@pytest.mark.parametrize("batch_dim", [0, None])
def test_an_eval_mode_rrelu_is_exact(batch_dim: int | None) -> None:
    """``rrelu_with_noise`` says ``training``, not ``train``: in eval mode it was taken for a
    random draw and refused (with the advice to call ``.eval()``)."""
    _assert_exact(_RReLUBlock(), _losses(batch_dim), batch_dim)


class _Square(torch.autograd.Function):
    """``x * x * w``, its forward taking ``ctx`` (no ``setup_context``)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, w: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x * x * w

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        x, w = ctx.saved_tensors  # type: ignore[attr-defined]
        return 2 * x * w * grad, x * x * grad


class _OldStyleFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return _Square.apply(x, self.gain)  # type: ignore[no-any-return]


@pytest.mark.parametrize("batch_dim", [0, None])
def test_a_function_without_setup_context_gets_a_clear_refusal(batch_dim: int | None) -> None:
    """Per task, torch's raw error escaped; per sample, it advised batch_dim=None, which fails
    the same way."""
    message = _assert_refused(
        _OldStyleFunction(), _losses(batch_dim), batch_dim, RuntimeError, "setup_context"
    )
    assert "_OldStyleFunction has no closed-form" in message
    assert "Use batch_dim=None" not in message


class _Noisy(nn.Module):
    def __init__(self, child: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1, 1, 9, dtype=torch.float64).reshape(3, 3))
        self.dropout = nn.Dropout(0.5) if child else None

    def forward(self, x: Tensor) -> Tensor:
        h = x @ self.weight
        return self.dropout(h) if self.dropout is not None else h + torch.randn_like(h)


@pytest.mark.parametrize("child", [False, True])
@pytest.mark.parametrize("batch_dim", [0, None])
def test_random_refusal_advises_randomness_outside_the_module(
    child: bool, batch_dim: int | None
) -> None:
    """The advice was a separate module such as nn.Dropout, which as a child is refused too."""
    message = _assert_refused(_Noisy(child), _losses(batch_dim), batch_dim, ValueError, "random")
    assert "outside this module" in message and "nn.Sequential(module, nn.Dropout(p))" in message


class _SequenceFirst(nn.Module):
    """``x @ W`` of ``x`` ``[B, T, d]``, returned ``[T, B, d]``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1, 1, 9, dtype=torch.float64).reshape(3, 3))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return x @ self.weight * y.T


def test_a_batch_off_dimension_0_names_the_cause() -> None:
    """The refusal quoted vmap's "Mismatch in shape" in place of the cause."""
    y = torch.linspace(0.5, 1.5, 15, dtype=torch.float64).reshape(3, 5)
    message = _assert_refused(
        _SequenceFirst(), lambda m: m(X, y).pow(2).sum(1), 0, ReplayMismatchError, "of shape"
    )
    assert "Mismatch in shape" not in message and "[1, 3] was expected" in message


def _re_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the generic rule's re-runs on the whole batch for its gradient check."""
    runs: list[int] = []
    original = fallback._whole_batch_run

    def counted(*args: Any) -> Any:
        runs.append(1)
        return original(*args)

    monkeypatch.setattr(fallback, "_whole_batch_run", counted)
    return runs


class _Twice(nn.Module):
    """``inner(inner(x))``: two calls of the hooked module per forward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(self.inner(x))  # type: ignore[no-any-return]


def test_the_check_reads_the_forward_s_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per sample, the parameters' gradient that the rows must sum to is taken in the engine's
    own backward (no re-run of the module on the whole batch), summed over the module's calls:
    called twice, the mixing module is refused, the other exact."""
    runs = _re_runs(monkeypatch)
    for straight in (False, True):
        _assert_refused(_ReZero(straight), _squares, 0, ReplayMismatchError, "the forward's")
    _assert_refused(_Twice(_ReZero(False)), _squares, 0, ReplayMismatchError, "mixes the")
    _assert_exact(_Twice(_Gated()), _squares, 0)
    _assert_exact(_Gated(), _squares, 0)
    assert not runs
    _assert_exact(_Gated(), lambda m: m(X).pow(2)[:, :2], 0)  # (two rows per sample: re-run)
    assert runs


class _TiedToLinear(nn.Module):
    """A generic module (a :class:`_ReZero` or :class:`_Gated`) then an ``nn.Linear`` whose
    weight is the module's: a parameter of two hooked units."""

    def __init__(self, first: nn.Module) -> None:
        super().__init__()
        self.first, self.linear = first, nn.Linear(3, 3).double()
        self.linear.weight = first.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(self.first(x))  # type: ignore[no-any-return]


def test_a_parameter_tied_to_another_unit_keeps_the_re_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where a parameter is also another hooked module's, the engine's backward gives the sum of
    both uses: the generic rule checks its rows against a re-run on the whole batch instead,
    exact where the module is per sample, and refusing the mixing one."""
    runs = _re_runs(monkeypatch)
    _assert_exact(_TiedToLinear(_Gated()), _squares, 0)
    assert runs
    _assert_refused(_TiedToLinear(_ReZero(False)), _squares, 0, ReplayMismatchError, "mixes the")


def test_parameter_hooks_run_once_on_the_update() -> None:
    """The engine's backward takes the generic module's parameters' gradient for the check
    with their gradient hooks left out: a hook (doubling the gradient) and a post-accumulate
    hook run once per step, on the update, none for the Gramian."""
    model = _Gated()
    reference = copy.deepcopy(model)
    jacobian = reference_jacobian(_squares(reference), _params(reference))
    previous = torch.cat([g.flatten() for g in _seed_grads(model)])
    fired: list[str] = []
    model.weight.register_hook(lambda g: fired.append("hook") or g * 2)  # type: ignore[func-returns-value]
    model.weight.register_post_accumulate_grad_hook(lambda p: fired.append("post"))
    with Engine(model, batch_dim=0) as engine:
        torch.testing.assert_close(engine.compute_gramian(_squares(model)), jacobian @ jacobian.T)
        assert not fired
        weights = engine.backward(_squares(model), UPGradWeighting())
    assert fired == ["hook", "post"]
    update = weights @ jacobian
    update[1:] *= 2  # (the weight's entries, after the gate's)
    actual = torch.cat([p.grad.flatten() for p in _params(model)])  # type: ignore[union-attr]
    torch.testing.assert_close(actual, update + previous)
    assert model.weight._backward_hooks  # (kept)


@pytest.mark.filterwarnings("ignore:var.*degrees of freedom:UserWarning")
def test_an_output_changed_in_place_is_compared_with_a_re_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Per sample, with the gradients checked against the engine's backward, an output changed
    in place since the forward (an in-place ReLU after the module) is still compared with a
    re-run of the outputs on the whole batch: a batch norm by hand is refused, the per-sample
    module exact, neither re-running the module's gradient."""
    runs = _re_runs(monkeypatch)
    _assert_refused(_Then(_BatchStatNorm(), True), _squares, 0, ReplayMismatchError, "other outp")
    _assert_exact(_Then(_Gated(), True), _squares, 0)
    assert not runs


def test_per_sample_a_sparse_product_inside_is_refused_clearly() -> None:
    """Per sample, a module of the generic rule that multiplies by a sparse adjacency matrix
    over the samples (the nodes) cannot be re-run sample by sample: a ValueError naming the
    sparse product and the ways out, not torch's wrapped "addmm: ... Expected dim 0 size 6",
    and no ``.grad`` written."""

    class Propagate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 4))

        def forward(self, x: Tensor) -> Tensor:
            return torch.sparse.mm(adjacency, x @ self.weight)

    edges = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 0]])
    adjacency = torch.sparse_coo_tensor(edges, torch.ones(6), (6, 6), check_invariants=True)
    layer = Propagate()
    with Engine(layer, batch_dim=0) as engine:
        losses = layer(torch.randn(6, 3)).pow(2).sum(1)
        with pytest.raises(ValueError, match=r"(?s)multiplies by a sparse tensor.*batch_dim=None"):
            engine.backward(losses, UPGradWeighting())
    assert layer.weight.grad is None


class _TanhProduct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x @ self.weight)


def test_a_lossy_saved_tensor_hook_is_named_in_the_mismatch() -> None:
    """A pack hook that casts the saved tensors to bfloat16 puts its rounding in the forward's
    backward, which the per-sample re-run (without the hook) does not have: refused, and the
    message blamed a mixing of the samples only, which the module does not do. It names the
    hook now."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 8), _TanhProduct()).double()
    x = torch.randn(4, 3, dtype=torch.float64)

    def pack(t: Tensor) -> Tensor:
        return t.to(torch.bfloat16) if t.is_floating_point() else t

    def unpack(t: Tensor) -> Tensor:
        return t.double() if t.is_floating_point() else t

    with Engine(module, batch_dim=0) as engine:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            losses = module(x).pow(2).sum(1)
        with pytest.raises(ReplayMismatchError, match=r"saved-tensor hooks.*bfloat16"):
            engine.backward(losses, UPGradWeighting())


@pytest.mark.skipif(
    not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"),
    reason="torch before 2.7 does not tell whether default saved-tensor hooks are active",
)
def test_a_step_run_inside_save_on_cpu_is_told_to_leave_it() -> None:
    """The whole training step inside ``save_on_cpu`` (as in torch's example): the generic
    rule's re-run runs under its hooks, which torch.func refuses; the refusal said to take
    them out of the module's forward, though they were around the step. It says to run the
    step outside them now; the same forward with the step outside is exact."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 8), _TanhProduct()).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    params = list(module.parameters())
    with Engine(module, batch_dim=0) as engine:
        with torch.autograd.graph.save_on_cpu():
            losses = module(x).pow(2).sum(1)
            with pytest.raises(
                RuntimeError, match=r"active around the step .* run the step outside"
            ):
                engine.backward(losses, UPGradWeighting())
        assert all(p.grad is None for p in params)
        with torch.autograd.graph.save_on_cpu():
            losses = module(x).pow(2).sum(1)
        jacobian = reference_jacobian(losses, params)
        torch.testing.assert_close(engine.compute_gramian(losses), jacobian @ jacobian.T)
