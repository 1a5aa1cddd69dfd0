"""Aggregation inside ``backward`` / ``jac_to_grad``: forward hooks see the aggregator's call."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from jacflow import backward, jac_to_grad, mtl_backward
from jacflow.aggregation import (
    MGDA,
    Aggregator,
    ConFIG,
    Constant,
    DualProj,
    Krum,
    Mean,
    NashMTL,
    Sum,
    TrimmedMean,
    UPGrad,
)
from jacflow.aggregation._bases import unit_peak_factor
from jacflow.autogram import Engine
from jacflow.autojac import _aggregate


def _problem() -> tuple[Tensor, Tensor, list[Tensor]]:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(3, generator=generator, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 2, generator=generator, dtype=torch.float64, requires_grad=True)
    outputs = [(a**2).sum(), (a * b[0, 0]).sum(), ((b @ b) * a[:2].sum()).sum()]
    return a, b, outputs


def _jacobian() -> Tensor:
    a, b, outputs = _problem()
    rows = []
    for output in outputs:
        grads = torch.autograd.grad(output, [a, b], allow_unused=True, materialize_grads=True)
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows)


def _zero_first_row(_module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor]:
    matrix = args[0].clone()
    matrix[0] = 0.0
    return (matrix,)


@pytest.mark.parametrize("make", [UPGrad, MGDA, Mean, Sum, ConFIG])
@pytest.mark.parametrize("via", ["backward", "jac_to_grad"])
def test_forward_hooks_on_the_aggregator_run_as_in_its_call(
    make: type[Aggregator], via: str
) -> None:
    """A pre-hook that changes ``J`` and a forward hook both run once, and the update is the
    aggregator's on the changed ``J`` (the shortcuts that skip the call are not taken)."""
    aggregator = make()
    calls: list[str] = []
    aggregator.register_forward_pre_hook(
        lambda m, args: (calls.append("pre"), _zero_first_row(m, args))[1]
    )
    aggregator.register_forward_hook(lambda m, args, out: calls.append("post"))
    changed = _jacobian()
    changed[0] = 0.0
    expected = make()(changed)
    a, b, outputs = _problem()
    if via == "backward":
        backward(outputs, A=aggregator)
    else:
        backward(outputs)
        jac_to_grad([a, b], aggregator)
    assert calls == ["pre", "post"]
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(torch.cat([a.grad, b.grad.flatten()]), expected)


def test_jac_to_grad_returns_the_weights_of_the_hooked_call() -> None:
    aggregator = UPGrad()
    aggregator.register_forward_pre_hook(_zero_first_row)
    changed = _jacobian()
    changed[0] = 0.0
    a, b, outputs = _problem()
    backward(outputs)
    weights = jac_to_grad([a, b], aggregator)
    assert weights is not None
    torch.testing.assert_close(weights, UPGrad().weights(changed))


def test_a_global_forward_hook_sees_the_aggregator() -> None:
    seen: list[type] = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, args, out: seen.append(type(m))
    )
    try:
        _, _, outputs = _problem()
        backward(outputs, A=UPGrad())
    finally:
        handle.remove()
    assert UPGrad in seen


class _Doubled(UPGrad):
    """A user's subclass whose forward changes the update."""

    def forward(self, matrix: Tensor) -> Tensor:
        return 2 * super().forward(matrix)


@pytest.mark.parametrize("hooked", [False, True])
def test_a_subclass_overriding_forward_is_called_on_the_jacobian(hooked: bool) -> None:
    """The Gramian shortcut skipped the subclass's forward, unless a hook (even a no-op one)
    sent the call through ``A(J)``: the result depended on the hook."""
    aggregator = _Doubled()
    if hooked:
        aggregator.register_forward_hook(lambda m, args, out: None)
    a, b, outputs = _problem()
    backward(outputs, A=aggregator)
    assert a.grad is not None and b.grad is not None
    update = torch.cat([a.grad, b.grad.flatten()])
    torch.testing.assert_close(update, 2 * UPGrad()(_jacobian()))


def test_an_engine_refuses_a_subclass_overriding_forward() -> None:
    from jacflow import mtl_backward
    from jacflow.autogram import Engine

    trunk, head = nn.Linear(2, 3), nn.Linear(3, 2)
    engine = Engine(trunk, batch_dim=None)
    features = trunk(torch.ones(4, 2))
    losses = [head(features)[:, 0].mean(), head(features)[:, 1].pow(2).mean()]
    with pytest.raises(ValueError, match="_Doubled overrides `forward` or `weights`"):
        mtl_backward(losses, features, A=_Doubled(), engine=engine)
    assert all(p.grad is None for p in [*trunk.parameters(), *head.parameters()])


class _Alternating(UPGrad):
    """A user's subclass whose ``weights`` keeps state: all on one row, alternately."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def weights(self, matrix: Tensor) -> Tensor:
        self.calls += 1
        chosen = torch.zeros(matrix.shape[0], dtype=matrix.dtype)
        chosen[(self.calls - 1) % matrix.shape[0]] = 1.0
        return chosen


def test_a_subclass_overriding_weights_is_asked_once_and_its_weights_returned() -> None:
    """``weights`` ran twice per step (the call's, then again for the returned weights): a
    stateful one stepped twice and ``jac_to_grad`` returned weights that were not applied."""
    aggregator = _Alternating()
    a, b, outputs = _problem()
    backward(outputs)
    weights = jac_to_grad([a, b], aggregator)
    assert aggregator.calls == 1 and weights is not None
    assert a.grad is not None and b.grad is not None
    update = torch.cat([a.grad, b.grad.flatten()])
    torch.testing.assert_close(weights, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(update, _jacobian()[0])


def test_a_forward_set_on_the_instance_is_used() -> None:
    aggregator = UPGrad()
    aggregator.forward = lambda matrix: torch.zeros_like(matrix[0])  # type: ignore[method-assign]
    a, b, outputs = _problem()
    backward(outputs, A=aggregator)
    assert a.grad is not None and b.grad is not None
    assert not a.grad.any() and not b.grad.any()


def _half_problem() -> tuple[Tensor, list[Tensor]]:
    """float16 losses whose Jacobian is small (unscaled float16 gradients): methods whose
    weights grow like ``1 / ||g||`` then give weights above float16's maximum (65504)."""
    matrix = torch.tensor([[1e-5, 0.0], [0.0, 2e-5]], dtype=torch.float16)
    p = torch.zeros(2, dtype=torch.float16, requires_grad=True)
    return p, list((matrix @ p).unbind())


@pytest.mark.parametrize(
    "make",
    [lambda: NashMTL(2), lambda: Constant(torch.tensor([7e4, 1e5]))],
    ids=["NashMTL", "Constant"],
)
@pytest.mark.parametrize("via", ["backward", "jac_to_grad"])
def test_large_weights_of_a_float16_jacobian_do_not_overflow(
    make: Callable[[], Aggregator], via: str
) -> None:
    """The weights stay in float32 (as in ``A(J)``, which aggregates float16 in float32) and
    only the update is cast to float16: weights above 65504 gave an inf/NaN ``.grad``."""
    p, losses = _half_problem()
    matrix = torch.stack([torch.autograd.grad(loss, p, retain_graph=True)[0] for loss in losses])
    expected = make()(matrix)
    expected_weights = make().weights(matrix.float())
    assert torch.isfinite(expected).all() and expected_weights.max() > 65504
    weights = None
    if via == "backward":
        backward(losses, [p], A=make())
    else:
        backward(losses, [p])
        weights = jac_to_grad([p], make())
    assert p.grad is not None and p.grad.dtype == torch.float16
    torch.testing.assert_close(p.grad, expected)
    if weights is not None:
        assert weights.dtype == torch.float32
        torch.testing.assert_close(weights, expected_weights)


@pytest.mark.parametrize("make", [UPGrad, Mean, Sum, MGDA], ids=["UPGrad", "Mean", "Sum", "MGDA"])
def test_jac_to_grad_returns_float32_weights_for_half_precision_jacobians(
    make: Callable[[], Aggregator],
) -> None:
    """As the Engine's: the dtype in which the weights were computed (documented)."""
    p = torch.tensor([1.0, 2.0], dtype=torch.bfloat16, requires_grad=True)
    backward([(p**2).sum(), p.sum()])
    jacobian = p.jac.clone()  # type: ignore[attr-defined]
    weights = jac_to_grad([p], make())
    assert weights is not None and weights.dtype == torch.float32
    torch.testing.assert_close(weights, make().weights(jacobian.float()))
    torch.testing.assert_close(p.grad, make()(jacobian))


def _second_order(A: Aggregator, via: str, grad_mode: Callable[[], Any]) -> tuple[Tensor, Tensor]:
    """``p.grad`` after a differentiable call under ``grad_mode``, and the derivative of a
    gradient penalty ``|grad|^2 + |p|^2`` through it."""
    p = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    losses = [(p**2).sum(), (p**3).sum()]
    with grad_mode():
        if via == "backward":
            backward(losses, A=A, create_graph=True)
        else:
            backward(losses, create_graph=True)
            jac_to_grad([p], A)
    grad = p.grad
    assert grad is not None
    p.grad = None  # (breaks the cycle between p and its graph)
    if not grad.requires_grad:
        return grad, torch.full_like(p, torch.nan)
    (derivative,) = torch.autograd.grad((grad**2).sum() + (p**2).sum(), p)
    return grad, derivative


@pytest.mark.parametrize("make", [UPGrad, MGDA], ids=["UPGrad", "MGDA"])
@pytest.mark.parametrize("via", ["backward", "jac_to_grad"])
def test_create_graph_keeps_the_graph_of_the_update_under_no_grad(
    make: Callable[[], Aggregator], via: str
) -> None:
    """As torch's ``backward(create_graph=True)``, which records the gradient under
    ``no_grad`` too: the update's graph was lost, and with it a gradient penalty's
    second-order term. The reference is the same call with grad enabled."""
    expected_grad, expected = _second_order(make(), via, torch.enable_grad)
    grad, derivative = _second_order(make(), via, torch.no_grad)
    assert grad.requires_grad
    torch.testing.assert_close(grad, expected_grad)
    torch.testing.assert_close(derivative, expected)


def test_create_graph_under_no_grad_matches_torch_for_a_fixed_weighting() -> None:
    """The second-order term of ``.grad`` under ``no_grad``, against torch's ``backward`` of
    the same weighted sum (``Constant``'s weights do not depend on ``J``)."""
    weights = torch.tensor([0.3, 2.0], dtype=torch.float64)
    p = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    total = weights[0] * (p**2).sum() + weights[1] * (p**3).sum()
    with torch.no_grad():
        total.backward(create_graph=True)
    expected_grad = p.grad
    assert expected_grad is not None and expected_grad.requires_grad
    p.grad = None
    (expected,) = torch.autograd.grad((expected_grad**2).sum() + (p**2).sum(), p)
    grad, derivative = _second_order(Constant(weights), "backward", torch.no_grad)
    torch.testing.assert_close(grad, expected_grad)
    torch.testing.assert_close(derivative, expected)


@pytest.mark.parametrize("make", [UPGrad, Mean], ids=["UPGrad", "Mean"])
def test_create_graph_under_no_grad_keeps_the_graph_of_an_accumulated_grad(
    make: Callable[[], Aggregator],
) -> None:
    """An existing ``.grad`` plus the update (out of place) keeps the update's graph, as in
    torch's ``backward(create_graph=True)`` under ``no_grad``."""
    p = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    p.grad = torch.ones(3, dtype=torch.float64)
    losses = [(p**2).sum(), (p**3).sum()]
    with torch.no_grad():
        backward(losses, A=make(), create_graph=True)
    grad = p.grad
    p.grad = None
    assert grad is not None and grad.requires_grad
    q = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    backward([(q**2).sum(), (q**3).sum()], A=make(), create_graph=True)
    reference = q.grad
    q.grad = None
    assert reference is not None
    torch.testing.assert_close(grad, reference + 1)
    (derivative,) = torch.autograd.grad(grad.sum(), p)
    (expected,) = torch.autograd.grad(reference.sum(), q)
    torch.testing.assert_close(derivative, expected)


class _Truncated(Aggregator):
    """A bug of a user's aggregator: its update is one entry short."""

    def forward(self, matrix: Tensor) -> Tensor:
        return matrix.mean(0)[:-1]


@pytest.mark.parametrize("via", ["backward", "jac_to_grad"])
def test_an_update_of_the_wrong_shape_is_refused_with_the_aggregator_named(via: str) -> None:
    """Torch's ``split_with_sizes`` error named neither; ``.grad`` and ``.jac`` are unchanged."""
    a = torch.ones(3, requires_grad=True)
    b = torch.ones(2, requires_grad=True)
    a.grad = torch.full((3,), 7.0)
    losses = [(a**2).sum(), b.sum() + a.sum()]
    message = r"`A` \(_Truncated\(\)\) returned an update of shape \(4,\), expected \(5,\)"
    if via == "backward":
        with pytest.raises(ValueError, match=message):
            backward(losses, [a, b], A=_Truncated())
    else:
        backward(losses, [a, b])
        jacs = [a.jac.clone(), b.jac.clone()]  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match=message):
            jac_to_grad([a, b], _Truncated())
        torch.testing.assert_close(a.jac, jacs[0])  # type: ignore[attr-defined]
        torch.testing.assert_close(b.jac, jacs[1])  # type: ignore[attr-defined]
    torch.testing.assert_close(a.grad, torch.full((3,), 7.0))
    assert b.grad is None


def _shared_rows(seed: int) -> Tensor:
    """7 float32 rows sharing a component of norm about 1e3 that differ by about 1e-2, row 0 a
    mild outlier: ``J J^T`` in float32 rounds their distances away."""
    generator = torch.Generator().manual_seed(seed)
    common = 100 * torch.randn(50, generator=generator, dtype=torch.float64)
    rows = common + 1e-3 * torch.randn(7, 50, generator=generator, dtype=torch.float64)
    rows[0] += 5e-3 * torch.randn(50, generator=generator, dtype=torch.float64)
    return rows.float()


def _exact_krum(J: Tensor, n_byzantine: int) -> Tensor:
    """The row of lowest Krum score, by brute-force float64 distances on the rows of ``J``."""
    rows = J.double()
    distances = torch.cdist(rows, rows) ** 2
    k = len(rows) - n_byzantine - 2
    scores = [
        d[torch.arange(len(rows)) != i].sort().values[:k].sum() for i, d in enumerate(distances)
    ]
    return J[int(torch.stack(scores).argmin())]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("via", ["backward", "jac_to_grad", "mtl_backward"])
def test_krum_gives_its_call_s_update_on_every_path(via: str, seed: int) -> None:
    """Krum scores the centred rows in float64 (its weighting reads J, not only J J^T): every
    path asks it on J, as its call does, instead of weighting the float32 Gramian (which picked
    the outlier)."""
    J = _shared_rows(seed)
    p = torch.zeros(J.shape[1], requires_grad=True)
    if via == "backward":
        backward(list(J @ p), [p], A=Krum(2))
    elif via == "jac_to_grad":
        backward(list(J @ p), [p])
        jac_to_grad([p], Krum(2))
    else:
        features = p * 1.0
        mtl_backward([row @ features for row in J], features, A=Krum(2))
    assert torch.equal(Krum(2)(J), _exact_krum(J, 2))
    assert torch.equal(p.grad, Krum(2)(J))


def test_an_engine_refuses_krum() -> None:
    """The engine has the Gramian only, not the centred rows that Krum scores: refused rather
    than another row picked silently."""
    trunk = nn.Linear(3, 4)
    features = trunk(torch.ones(2, 3))
    losses = [features.sum(), features.pow(2).sum(), features[0].sum()]
    with pytest.raises(ValueError, match="more than their Gramian"):
        mtl_backward(losses, features, A=Krum(0), engine=Engine(trunk, batch_dim=None))


_FUSED_OR_NOT = [
    pytest.param(_aggregate._FUSED_MAX_BYTES, id="concatenated"),
    pytest.param(0, id="block-by-block"),
]


@pytest.mark.parametrize("limit", _FUSED_OR_NOT)
@pytest.mark.parametrize(
    "make",
    [UPGrad, MGDA, DualProj, Mean, Sum, ConFIG, lambda: Krum(1), lambda: TrimmedMean(1)],
    ids=["UPGrad", "MGDA", "DualProj", "Mean", "Sum", "ConFIG", "Krum", "TrimmedMean"],
)
@settings(max_examples=15)
@given(
    rows=st.integers(1, 5),
    shapes=st.lists(
        st.lists(st.integers(1, 4), min_size=0, max_size=2).map(tuple), min_size=1, max_size=5
    ),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_blocks_are_aggregated_as_the_aggregator_calls_the_jacobian(
    limit: int,
    make: Callable[[], Aggregator],
    rows: int,
    shapes: list[tuple[int, ...]],
    dtype: torch.dtype,
    seed: int,
) -> None:
    """A Jacobian split into blocks (one per input) is aggregated as the aggregator aggregates
    the concatenated matrix, whether the blocks are concatenated first (small Jacobians) or
    combined one by one: the updates (cut per block, in the blocks' shapes and dtype) and the
    weights agree up to rounding."""
    if rows < 4 and not isinstance(make, type):  # (Krum(1), TrimmedMean(1): 4 rows or more)
        return
    generator = torch.Generator().manual_seed(seed)
    blocks = [torch.randn(rows, *shape, generator=generator, dtype=dtype) for shape in shapes]
    matrix = torch.cat([b.reshape(rows, -1) for b in blocks], dim=1)
    expected = make()(matrix)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_aggregate, "_FUSED_MAX_BYTES", limit)
        updates, weights = _aggregate.aggregate_blocks(make(), blocks)
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {}
    assert [u.shape for u in updates] == [b.shape[1:] for b in blocks]
    assert all(u.dtype == dtype for u in updates)
    got = torch.cat([u.reshape(-1) for u in updates])
    torch.testing.assert_close(got, expected, **tolerance)
    if weights is not None:
        torch.testing.assert_close(weights @ matrix, expected, **tolerance)


@settings(max_examples=25)
@given(
    rows=st.integers(2, 6),
    widths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    exponent=st.integers(-15, 15),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_the_gramian_scaled_after_its_products_gives_the_same_weights(
    rows: int, widths: list[int], exponent: int, dtype: torch.dtype, seed: int
) -> None:
    """``factor^2 sum_k J_k J_k^T`` (no scaled copy of the blocks) is the Gramian of the
    scaled blocks, and UPGrad's weights from it are theirs, bit for bit, for Jacobians whose
    peak is near 1 (the power of two scales every product and sum exactly)."""
    generator = torch.Generator().manual_seed(seed)
    scale = 2.0**exponent
    blocks = [torch.randn(rows, w, generator=generator, dtype=dtype) * scale for w in widths]
    gramians: list[Tensor] = []

    def weights() -> Tensor:
        aggregator = UPGrad()  # (its weighting records the Gramian it gets)
        aggregator.gramian_weighting.register_forward_pre_hook(
            lambda _, args: gramians.append(args[0])
        )
        return _aggregate._gramian_weights(aggregator, blocks)

    assert _aggregate._scales_after(blocks, unit_peak_factor(blocks))
    after = weights()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_aggregate, "_SCALED_AFTER", (math.inf, -math.inf))  # (always before)
        assert not _aggregate._scales_after(blocks, unit_peak_factor(blocks))
        before = weights()
    assert torch.equal(gramians[0], gramians[1])
    assert torch.equal(after, before)
