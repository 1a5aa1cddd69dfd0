"""The weighting of a Gramian-based aggregator reads ``J`` (as TorchJD's), and ``weighting << fn``.

TorchJD's ``GramianWeightedAggregator.weighting`` is ``gramian_weighting << compute_gramian``:
``A.weighting(J)`` are the weights of the rows of ``J``, and ``A.gramian_weighting(G)`` those of
the Gramian. A square ``J`` passed to the weighting must not be taken for a Gramian.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook

import jacflow
import jacflow.aggregation as agg
from jacflow.aggregation import _bases as bases
from jacflow.linalg import QuadprogProjector, compute_gramian
from tests.aggregation._properties import check_claimed_properties, jacobians

torch.set_num_threads(1)

# (Mean, Sum, Random and Constant are left out: their Gramian weightings read only the number
# of rows, so they give the weights of J from J too; TorchJD's parity below covers Mean and Sum)
GRAMIAN_BASED: list[Callable[[], agg.GramianWeightedAggregator]] = [
    agg.UPGrad,
    agg.DualProj,
    agg.MGDA,
    agg.IMTLG,
    agg.PCGrad,
    agg.AlignedMTL,
    agg.GradVac,
    agg.PCD,
    agg.MoDo,
    agg.SDMGrad,
    lambda: agg.CAGrad(c=0.5),
    lambda: agg.FairGrad(alpha=1.0),
    lambda: agg.Krum(n_byzantine=0),
    lambda: agg.NashMTL(n_tasks=3),
    lambda: agg.AuxiNash(torch.ones(3)),
    lambda: agg.GramianWeightedAggregator(agg.UPGradWeighting()),
]


def _name(make: Callable[[], agg.Aggregator]) -> str:
    return str(make())


def _jacobians() -> list[Tensor]:
    torch.manual_seed(0)
    square = torch.randn(3, 3, dtype=torch.float64)
    return [torch.randn(3, 5, dtype=torch.float64), square, square[:, :2] @ square[:2]]


@pytest.mark.parametrize("make", GRAMIAN_BASED, ids=_name)
def test_weighting_reads_the_jacobian(make: Callable[[], agg.GramianWeightedAggregator]) -> None:
    """``A.weighting(J)`` = ``A.weights(J)`` = ``A.gramian_weighting(J J^T)``, square ``J``
    (and rank-deficient) included, from the same state and random draws."""
    for J in _jacobians():
        results = []
        for weigh in (
            lambda A, J=J: A.weighting(J),
            lambda A, J=J: A.weights(J),
            lambda A, J=J: A.gramian_weighting(J @ J.T),
        ):
            torch.manual_seed(1)
            results.append(weigh(make()))
        torch.testing.assert_close(results[0], results[1])
        torch.testing.assert_close(results[0], results[2], rtol=1e-6, atol=1e-9)
        torch.manual_seed(1)
        A = make()
        weights = A.weighting(J)
        torch.manual_seed(1)
        torch.testing.assert_close(weights @ J, make()(J))


def test_weighting_equals_torchjd() -> None:
    tj = pytest.importorskip("torchjd.aggregation")
    pytest.importorskip("quadprog")
    pairs: list[tuple[Any, agg.GramianWeightedAggregator]] = [
        (tj.UPGrad(), agg.UPGrad(projector=QuadprogProjector())),
        (tj.DualProj(), agg.DualProj(projector=QuadprogProjector())),
        (tj.Mean(), agg.Mean()),
        (tj.Sum(), agg.Sum()),
        (tj.IMTLG(), agg.IMTLG()),
        (tj.AlignedMTL(), agg.AlignedMTL()),
        (tj.Krum(n_byzantine=0), agg.Krum(n_byzantine=0)),
    ]
    for J in _jacobians():
        for theirs, ours in pairs:
            if isinstance(ours, agg.IMTLG) and torch.linalg.matrix_rank(J) < J.shape[0]:
                continue  # (a singular Gramian: TorchJD's G^+ n, the paper's system here)
            expected = theirs.weighting(J)
            torch.testing.assert_close(ours.weighting(J), expected, rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(ours.weights(J), expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weighting_of_half_precision_jacobians(dtype: torch.dtype) -> None:
    """Weighted in float32, the weights in the input's dtype (as ``A.weights``)."""
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]], dtype=dtype)
    for A in (agg.UPGrad(), agg.MGDA(), agg.CAGrad(c=0.5)):
        weights = A.weighting(J)
        assert weights.dtype == dtype
        torch.testing.assert_close(weights, A.weights(J))
        torch.testing.assert_close(weights, A.weighting(J.float()).to(dtype))


def test_weighting_of_extreme_jacobians_does_not_overflow() -> None:
    """A scale-invariant weighting sees ``J`` scaled to a unit peak first, as the aggregator."""
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    for scale in (1e25, 1e-25):
        weights = agg.UPGrad().weighting(scale * J)
        torch.testing.assert_close(weights, agg.UPGrad().weighting(J))


def test_hooks_on_the_weighting_see_the_jacobian_and_the_weights() -> None:
    """As in TorchJD, whose ``jac_to_grad`` reads the weights with a hook on ``A.weighting``;
    hooks on ``A.gramian_weighting`` see the Gramian."""
    A = agg.UPGrad()
    seen: dict[str, tuple[Tensor, Tensor]] = {}

    def keep(key: str) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], None]:
        def hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
            seen[key] = (args[0], output)

        return hook

    A.weighting.register_forward_hook(keep("weighting"))
    A.gramian_weighting.register_forward_hook(keep("gramian_weighting"))
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    update = A(J)
    stat, weights = seen["weighting"]
    assert stat.shape == J.shape
    torch.testing.assert_close(weights @ J, update)
    gramian, gramian_weights = seen["gramian_weighting"]
    assert gramian.shape == (2, 2)
    torch.testing.assert_close(gramian_weights, weights)


def test_the_weighting_of_a_gramian_aggregator_follows_its_gramian_weighting() -> None:
    A = agg.GramianWeightedAggregator(agg.MeanWeighting())
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    A.gramian_weighting = agg.UPGradWeighting()
    torch.testing.assert_close(A.weighting(J), agg.UPGradWeighting()(J @ J.T))
    torch.testing.assert_close(A(J), agg.UPGrad()(J))
    with pytest.raises(AttributeError, match="gramian_weighting << gramian"):
        A.weighting = agg.MeanWeighting()
    with pytest.raises(TypeError, match=r"`gramian_weighting` must be a .*GramianWeighting"):
        A.gramian_weighting = agg.ExcessMTLWeighting()  # type: ignore[assignment]


def test_lshift_composes_a_weighting_with_a_function() -> None:
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    inner = agg.UPGradWeighting()
    calls: list[Tensor] = []
    inner.register_forward_hook(lambda module, args, output: calls.append(args[0]))
    composed = inner << compute_gramian
    assert isinstance(composed, agg.Weighting)
    torch.testing.assert_close(composed(J), inner(J @ J.T))
    assert len(calls) == 2 and calls[0].shape == (2, 2)  # the hooks of `inner` run
    # (any function of tensors, e.g. a lambda; a composition composes again)
    twice = (agg.MeanWeighting() << compute_gramian) << (lambda x: x.T)
    torch.testing.assert_close(twice(torch.ones(5, 3)), torch.full((3,), 1 / 3))
    assert "UPGradWeighting" in repr(composed) and "compute_gramian" in repr(composed)
    with pytest.raises(TypeError, match="`fn` must be callable"):
        _ = inner << 3  # type: ignore[operator]


@pytest.mark.parametrize(
    "make",
    [lambda: agg.NashMTL(2), lambda: agg.FairGrad(1.0), agg.PCD, agg.MoDo, agg.GradVac],
    ids=["NashMTL", "FairGrad", "PCD", "MoDo", "GradVac"],
)
def test_weightings_that_read_the_scale_survive_an_overflowing_float32_gramian(
    make: Callable[[], agg.GramianWeightedAggregator],
) -> None:
    """Finite float32 entries near 1e19 overflow ``J J^T``: those weightings gave NaN where
    float64 has an answer; the Gramian is then formed in float64 (directly and in jac_to_grad)."""
    J = torch.tensor([[3e19, 1e19, 0.0], [-1e19, 2e19, 1e19]])
    torch.manual_seed(0)
    expected = make()(J.double()).float()
    torch.manual_seed(0)
    out = make()(J)
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=0.0)
    x = torch.zeros(3, requires_grad=True)
    x.jac = J.clone()  # type: ignore[attr-defined]
    torch.manual_seed(0)
    jacflow.jac_to_grad([x], make())
    assert x.grad is not None
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=0.0)


SHORTCUT_METHODS = pytest.mark.parametrize(
    "make",
    [agg.Mean, agg.Sum, agg.Random, lambda: agg.Constant(torch.tensor([0.5, 2.0, 1.0]))],
    ids=["Mean", "Sum", "Random", "Constant"],
)


@SHORTCUT_METHODS
@pytest.mark.parametrize("where", ["weighting", "gramian_weighting"])
def test_hooks_on_the_weightings_of_the_shortcut_methods_run(
    make: Callable[[], agg.Aggregator], where: str
) -> None:
    """Mean, Sum, Random and Constant skip the Gramian; a forward hook on their weighting (TorchJD's
    monitoring pattern, or one that changes the weights) must still run, on a call and through
    ``jac_to_grad`` (it was skipped: the update ignored it)."""
    J = torch.tensor([[1.0, -2.0], [0.5, 1.0], [3.0, 0.0]], dtype=torch.float64)
    aggregator = make()
    torch.manual_seed(0)
    plain = aggregator(J)
    seen: list[Tensor] = []

    def double(module: nn.Module, args: Any, out: Tensor) -> Tensor:
        seen.append(out)
        return 2 * out

    getattr(aggregator, where).register_forward_hook(double)
    torch.manual_seed(0)
    torch.testing.assert_close(aggregator(J), 2 * plain)
    param = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    param.jac = J.clone()  # type: ignore[attr-defined]
    torch.manual_seed(0)
    jacflow.jac_to_grad([param], aggregator)
    torch.testing.assert_close(param.grad, 2 * plain)
    assert len(seen) == 2


@SHORTCUT_METHODS
def test_the_shortcut_methods_share_one_hook_check(
    make: Callable[[], agg.GramianWeightedAggregator], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mean, Sum, Random and Constant weigh through ``weights_without_gramian`` (the check for
    hooks, written once): without a hook, their weights come without a Gramian; with a global
    forward hook, through their weighting and its Gramian."""
    from jacflow.aggregation._bases import weights_without_gramian

    J = torch.tensor([[1.0, -2.0], [0.5, 1.0], [3.0, 0.0]], dtype=torch.float64)
    aggregator = make()
    torch.manual_seed(0)
    expected = aggregator.weighting(J)
    formed: list[Tensor] = []
    monkeypatch.setattr(bases, "compute_gramian", lambda x: formed.append(x) or x @ x.T)
    for weights in (aggregator.weights, lambda x: weights_without_gramian(aggregator, x)):
        torch.manual_seed(0)
        torch.testing.assert_close(weights(J), expected)
    assert not formed
    handle = register_module_forward_hook(lambda module, args, out: None)
    try:
        torch.manual_seed(0)
        torch.testing.assert_close(aggregator.weights(J), expected)
    finally:
        handle.remove()
    assert len(formed) == 1


def test_str_labels_are_torchjds() -> None:
    """``str`` gives TorchJD 0.18's labels (users' logs and result tables compare them): the
    preference or leak vector with two decimals, trailing zeros dropped; FairGrad's alpha as
    given (``2`` stays ``2``). Checked against the literal labels, and against TorchJD where it
    is installed."""
    pref = torch.tensor([0.2, 0.8])
    made = {
        "UPGrad([0.2, 0.8])": lambda m: m.UPGrad(pref_vector=pref),
        "DualProj([0.2, 0.8])": lambda m: m.DualProj(pref_vector=pref),
        "AlignedMTL([0.2, 0.8])": lambda m: m.AlignedMTL(pref_vector=pref),
        "ConFIG([0.2, 0.8])": lambda m: m.ConFIG(pref_vector=pref),
        "UPGrad": lambda m: m.UPGrad(),
        "Constant([1., 2.35])": lambda m: m.Constant(torch.tensor([1.0, 2.345])),
        "1.0-FairGrad": lambda m: m.FairGrad(alpha=1.0),
        "2-FairGrad": lambda m: m.FairGrad(alpha=2),
        "0.5-FairGrad": lambda m: m.FairGrad(alpha=0.5),
        "GradDrop([0.1, 0.5])": lambda m: m.GradDrop(leak=torch.tensor([0.1, 0.5])),
    }
    for label, make in made.items():
        assert str(make(agg)) == label
    try:
        import torchjd.aggregation as tj
    except ImportError:
        return
    for label, make in made.items():
        assert str(make(tj)) == label


def test_str_of_a_method_whose_pref_vector_is_not_a_tensor() -> None:
    """A method of your own with a ``pref_vector`` attribute of another type (a list): its
    class name, as before (the label's vector formatting raised an AttributeError); a
    preference that requires grad is labelled without a warning."""

    class Listed(agg.Mean):
        def __init__(self) -> None:
            super().__init__()
            self.pref_vector = [0.5, 0.5]

    assert str(Listed()) == "Listed"
    pref = torch.tensor([0.25, 0.75], requires_grad=True)
    assert str(agg.UPGrad(pref_vector=pref)) == "UPGrad([0.25, 0.75])"


_PREFERRING = [agg.UPGrad, agg.DualProj, agg.AlignedMTL, agg.ConFIG]


@pytest.mark.parametrize("make", _PREFERRING, ids=lambda cls: cls.__name__)
def test_a_non_uniform_preference_drops_permutation_invariance(make: type) -> None:
    """They claimed permutation invariance for every pref_vector; with unequal preferences a
    permutation of the rows changes the update (the preference stays with the positions), so
    the claim of that configuration is dropped, and kept for a uniform one."""
    J = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    perm = [2, 0, 1]
    preferring = make(pref_vector=torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    assert not torch.allclose(preferring(J[perm]), preferring(J))  # (the claim is false)
    assert agg.Property.PERMUTATION_INVARIANT in make.properties
    assert preferring.claimed_properties() == make.properties - {agg.Property.PERMUTATION_INVARIANT}
    assert make().claimed_properties() == make.properties
    assert make(pref_vector=torch.full((3,), 2.0)).claimed_properties() == make.properties


@pytest.mark.parametrize("make", _PREFERRING, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("pref", [[1.0, 2.0, 3.0], [2.0, 2.0, 2.0]])
def test_the_claims_of_a_configuration_with_a_preference_hold(
    make: type, pref: list[float]
) -> None:
    """Every claim of ``claimed_properties()`` is checked on random 3-row Jacobians."""
    pref_vector = torch.tensor(pref, dtype=torch.float64)
    check_claimed_properties(lambda: make(pref_vector=pref_vector), jacobians(min_m=3, max_m=3))


@pytest.mark.parametrize("make", [agg.UPGrad, lambda: agg.WeightedAggregator(agg.MeanWeighting())])
def test_assigning_weights_on_a_weighted_aggregator_is_refused(make: Callable[[], Any]) -> None:
    """``weights`` is the method ``weights(matrix)`` of every weighted aggregator: an
    assignment hid it and the next call failed. It is refused (as a frozen hyper-parameter's
    is), without the hint of ``Constant``'s weighting, which these do not have, and the
    aggregator is unchanged."""
    aggregator = make()
    matrix = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    before = aggregator(matrix)
    with pytest.raises(AttributeError, match=r"would hide that method\. Its weights come from"):
        aggregator.weights = torch.ones(2)
    torch.testing.assert_close(aggregator(matrix), before, rtol=0, atol=0)
    torch.testing.assert_close(before, make()(matrix), rtol=0, atol=0)
