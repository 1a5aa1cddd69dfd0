"""``jac_to_grad`` called as TorchJD 0.18 calls it: ``aggregator=`` and
``optimize_gramian_computation``, against the aggregator on the brute-force Jacobian."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from jacflow import backward, jac, jac_to_grad
from jacflow.aggregation import IMTLG, MGDA, Aggregator, AlignedMTL, ConFIG, Mean, UPGrad


def _params_with_jac() -> tuple[list[torch.Tensor], torch.Tensor]:
    """Two parameters with ``.jac`` from ``backward``, and the ``[m, n]`` Jacobian by rows."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    p1 = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    p2 = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    h = torch.tanh(x @ p1) @ p2
    losses = torch.stack([h[:2].sum(), -h[2:].sum() + (p2**2).sum(), (h**2).mean()])
    rows = [torch.autograd.grad(loss, [p1, p2], retain_graph=True) for loss in losses]
    matrix = torch.stack([torch.cat([g1.flatten(), g2]) for g1, g2 in rows])
    backward(losses, [p1, p2])
    return [p1, p2], matrix


@pytest.mark.parametrize("aggregator", [UPGrad(), Mean(), ConFIG()], ids=str)
@pytest.mark.parametrize("by_name", [False, True])
@pytest.mark.parametrize("optimize", [None, False, True])
def test_torchjd_keywords(aggregator: Aggregator, by_name: bool, optimize: bool | None) -> None:
    """``jac_to_grad(ps, aggregator=UPGrad())`` and ``optimize_gramian_computation=True``
    raised TypeError (TorchJD's names); ``optimize_gramian_computation`` changes nothing (even
    for a non-Gramian aggregator, which TorchJD refuses with it)."""
    params, matrix = _params_with_jac()
    kwargs: dict[str, Any] = {}
    if optimize is not None:
        kwargs["optimize_gramian_computation"] = optimize
    if by_name:
        weights = jac_to_grad(params, aggregator=aggregator, **kwargs)
    else:
        weights = jac_to_grad(params, aggregator, **kwargs)
    update = aggregator(matrix)
    torch.testing.assert_close(params[0].grad, update[:12].reshape(3, 4))
    torch.testing.assert_close(params[1].grad, update[12:])
    if isinstance(aggregator, ConFIG):
        assert weights is None
    else:
        assert weights is not None
        torch.testing.assert_close(weights @ matrix, update)
    assert not any(hasattr(p, "jac") for p in params)


@pytest.mark.parametrize(
    ("name", "ours"),
    [("backward", backward), ("jac", jac), ("jac_to_grad", jac_to_grad)],
)
def test_every_torchjd_keyword_is_accepted(name: str, ours: Any) -> None:
    """Every parameter that TorchJD 0.18 lets its users name is a parameter of ours, and ours
    has no more required ones (its positional-only ones may be named differently).
    ``mtl_backward`` differs: it has no ``grad_tensors`` (docs/migration.md)."""
    torchjd_autojac = pytest.importorskip("torchjd.autojac")
    theirs = inspect.signature(getattr(torchjd_autojac, name)).parameters.values()
    mine = inspect.signature(ours).parameters
    for p in theirs:
        if p.kind is not inspect.Parameter.POSITIONAL_ONLY:
            assert p.name in mine, f"{name}: TorchJD's `{p.name}` is missing"
    required_theirs = sum(p.default is inspect.Parameter.empty for p in theirs)
    required_mine = sum(p.default is inspect.Parameter.empty for p in mine.values())
    assert required_mine <= required_theirs


def test_grad_graph_only_from_a_jacobian_with_one_and_a_differentiable_aggregator() -> None:
    """``.jac`` with a graph: UPGrad's, MGDA's and AlignedMTL's updates keep it (their
    derivative is the update's), IMTLG's has none (its weights are computed without
    autograd), as their calls on ``J``. ``.jac`` without one: no graph, although the
    preference requires grad (as torch's ``backward``)."""
    x = torch.tensor([0.3, -0.8], dtype=torch.float64, requires_grad=True)
    cases = ((UPGrad(), True), (MGDA(), True), (AlignedMTL(), True), (IMTLG(), False))
    for aggregator, graph in cases:
        x.grad = None
        (x.jac,) = jac([(x**3).sum(), x.sin().sum()], [x], create_graph=True)  # type: ignore[attr-defined]
        jac_to_grad([x], aggregator)
        assert x.grad is not None and x.grad.requires_grad is graph
    x.grad = None
    x.jac = torch.tensor([[1.0, 0.0], [-1.0, 2.0]], dtype=torch.float64)  # type: ignore[attr-defined]
    pref = torch.tensor([0.4, 0.6], dtype=torch.float64, requires_grad=True)
    jac_to_grad([x], UPGrad(pref_vector=pref))
    assert x.grad is not None and not x.grad.requires_grad


@pytest.mark.parametrize("aggregator", [Mean(), UPGrad()], ids=str)
def test_grads_with_a_graph_are_tensors_of_their_own(aggregator: Aggregator) -> None:
    """From ``.jac`` fields with a graph, each ``.grad`` is its own tensor, as after torch's
    ``backward(create_graph=True)``: an in-place change of one in grad mode works, and one
    under ``no_grad`` (a clipping) leaves a penalty built from another differentiable (against
    the aggregator on the Jacobian built row by row with a graph)."""
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)

    def losses() -> torch.Tensor:
        return torch.stack([a.sin().sum() + b.sum(), (a**2).sum() * b.prod()])

    rows = [torch.autograd.grad(loss, [a, b], create_graph=True) for loss in losses()]
    update = aggregator(torch.stack([torch.cat(row) for row in rows]))
    (expected,) = torch.autograd.grad(update[3:].pow(2).sum(), b)
    backward(losses(), create_graph=True)
    jac_to_grad([a, b], aggregator)
    assert a.grad is not None and b.grad is not None
    assert a.grad.untyped_storage().data_ptr() != b.grad.untyped_storage().data_ptr()
    penalty = b.grad.pow(2).sum()
    with torch.no_grad():
        a.grad.mul_(0.5)
    assert torch.allclose(torch.autograd.grad(penalty, b)[0], expected)
    a.grad.mul_(2.0)  # (grad mode: an in-place change of a tensor with a graph)


@pytest.mark.parametrize("aggregator", [UPGrad(), Mean(), ConFIG()], ids=str)
@pytest.mark.parametrize("existing", [False, True])
def test_a_tensor_without_jac_is_skipped(aggregator: Aggregator, existing: bool) -> None:
    """A tensor without ``.jac`` (one that ``backward`` did not reach) was refused; it is
    skipped, its ``.grad`` left as it is (``None``, or the tensor it held), and the others get
    the aggregation of their columns, their ``.jac`` deleted."""
    params, matrix = _params_with_jac()
    lone = torch.randn(3, requires_grad=True, dtype=torch.float64)
    held = torch.full_like(lone, 7.0) if existing else None
    lone.grad = held
    hooked: list[torch.Tensor] = []
    lone.register_post_accumulate_grad_hook(hooked.append)
    jac_to_grad([params[0], lone, params[1]], aggregator)
    assert lone.grad is held and not hasattr(lone, "jac") and not hooked
    if held is not None:
        assert torch.equal(held, torch.full_like(lone, 7.0))
    update = aggregator(matrix)
    torch.testing.assert_close(params[0].grad, update[:12].view(3, 4))
    torch.testing.assert_close(params[1].grad, update[12:])
    assert all(not hasattr(p, "jac") for p in params)


def test_a_tensor_without_jac_takes_part_as_zero_columns() -> None:
    """``backward(losses, [unused, w])`` then ``jac_to_grad`` gives the update of
    ``backward(..., A=...)``: the unreached input (no ``.jac``) takes part as zero columns. With
    GradDrop, which draws a number per coordinate, aggregating only the others' columns shifted
    its draws (another update under the same seed)."""
    from jacflow.aggregation import GradDrop

    def problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        unused = torch.randn(3, generator=g, requires_grad=True)
        w = torch.randn(4, generator=g, requires_grad=True)
        h = torch.randn(6, 4, generator=g) @ w
        return unused, w, torch.stack([h.sin().sum(), h.pow(2).mean(), -h.sum()])

    unused, w, losses = problem()
    torch.manual_seed(1)
    backward(losses, [unused, w], A=GradDrop())
    direct = w.grad
    unused, w, losses = problem()
    backward(losses, [unused, w])
    assert not hasattr(unused, "jac")
    torch.manual_seed(1)
    jac_to_grad([unused, w], GradDrop())
    assert unused.grad is None and direct is not None
    torch.testing.assert_close(w.grad, direct, rtol=0, atol=0)
