"""Writing into ``.grad`` and ``.jac``: each result a tensor of its own, and under several
processes a warning that nothing is averaged."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor

from jacflow import backward, jac_to_grad, mtl_backward
from jacflow.aggregation import Aggregator, Mean, UPGrad


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("call", ["backward", "mtl_backward"])
def test_writes_under_several_processes_warn_that_nothing_is_averaged(
    world_size: int, call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under DDP these calls bypass its averaging hooks (the replicas' ``.grad`` differed by
    2.26 after one step, silently): warned, naming the way out; one process: no warning."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world_size)
    trunk = torch.nn.Linear(2, 3)
    features = trunk(torch.ones(4, 2))
    losses = [features.pow(2).mean(), features.sin().mean()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if call == "backward":
            backward(losses, A=UPGrad())
        else:
            mtl_backward(losses, features, A=UPGrad())
    messages = [str(w.message) for w in caught if "drift apart" in str(w.message)]
    assert len(messages) == (1 if world_size == 2 else 0)
    assert all("jacflow.autogram.Engine(ddp_model" in m for m in messages)
    assert trunk.weight.grad is not None


@pytest.mark.parametrize("A", [None, Mean(), UPGrad()], ids=["jac", "mean", "upgrad"])
def test_no_two_results_share_memory(A: Aggregator | None) -> None:
    """``a + b`` passes one gradient buffer to both inputs: each ``.grad`` (``.jac``) gets its
    own, so that accumulating twice, or scaling one in place, matches torch's ``.grad``."""
    c = torch.tensor([5.0, 7.0])
    a, b = (
        torch.tensor([1.0, 2.0], requires_grad=True),
        torch.tensor([3.0, 4.0], requires_grad=True),
    )
    ra, rb = (t.detach().clone().requires_grad_() for t in (a, b))
    for _ in range(2):
        backward([((a + b) * c).sum()], [a, b], A=A)
        ((ra + rb) * c).sum().backward()
    if A is None:
        a.grad, b.grad = a.jac[0], b.jac[0]  # type: ignore[attr-defined]
    assert a.grad is not None and b.grad is not None
    assert a.grad.data_ptr() != b.grad.data_ptr()
    torch.testing.assert_close(a.grad, ra.grad)
    a.grad.mul_(0.5)
    torch.testing.assert_close(b.grad, rb.grad)


def test_jac_does_not_share_the_callers_jac_tensors() -> None:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    C = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    backward([x], [x], jac_tensors=[C])
    torch.testing.assert_close(x.jac, C)  # type: ignore[attr-defined]
    C.zero_()
    assert x.jac.abs().sum() > 0  # type: ignore[attr-defined]


def test_task_parameters_of_mtl_backward_do_not_share_memory() -> None:
    """Heads read as ``h1 + h2``: autograd returns one buffer for both."""
    torch.manual_seed(0)
    W, x = torch.randn(2, 3, requires_grad=True), torch.randn(4, 3)
    h1, h2, h3 = (torch.randn(2, requires_grad=True) for _ in range(3))
    features = torch.tanh(x @ W.T)
    losses = [(features @ (h1 + h2)).mean(), (features @ h3).mean()]
    expected = torch.autograd.grad(losses[0], [h1, h2], retain_graph=True)
    mtl_backward(losses, features, A=UPGrad())
    assert h1.grad is not None and h2.grad is not None
    h1.grad.mul_(0.5)
    torch.testing.assert_close(h2.grad, expected[1])


@pytest.mark.parametrize("call", ["upgrad", "mean", "jac_to_grad", "mtl_backward"])
def test_post_accumulate_hooks_run_once_after_the_write(call: str) -> None:
    """As after ``loss.backward()``: each hooked parameter's hook runs once, on its new
    ``.grad`` (optimizer steps in backward, gradient logging); they never ran."""
    torch.manual_seed(0)
    trunk, head = torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)
    params = [*trunk.parameters(), *head.parameters()]
    seen: list[tuple[int, Tensor]] = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda t, i=i: seen.append((i, t.grad.clone())))
    features = trunk(torch.randn(4, 2))
    losses = [head(features).mean(), features.pow(2).mean()]
    if call == "mtl_backward":
        mtl_backward(losses, features, A=UPGrad())
    elif call == "jac_to_grad":
        backward(losses, params)
        assert not seen  # (.jac only)
        jac_to_grad(params, UPGrad())
    else:
        backward(losses, params, A=UPGrad() if call == "upgrad" else Mean())
    assert sorted(i for i, _ in seen) == list(range(len(params)))
    for i, grad in seen:
        assert torch.equal(grad, params[i].grad)
