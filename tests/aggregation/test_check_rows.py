"""``check_rows(m)`` refuses exactly the numbers of rows that calling the aggregator refuses.

``jacflow.backward`` calls it before differentiating, so it must agree with the call itself:
compared here with the aggregator on a random ``[m, 4]`` matrix, for m from 0 to 6, on methods
whose configuration fixes or bounds m and on some that accept any m.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from jacflow.aggregation import (
    DBMTL,
    EPO,
    MGDA,
    PCD,
    Aggregator,
    AlignedMTL,
    AuxiNash,
    ConFIG,
    Constant,
    CRMOGMWeighting,
    DualProj,
    GradDrop,
    GradNorm,
    GradVac,
    GramianWeightedAggregator,
    Krum,
    KrumWeighting,
    LogLoss,
    Mean,
    MoCo,
    NashMTL,
    ParetoMTL,
    Periodic,
    SDMGrad,
    TrimmedMean,
    UPGrad,
    UPGradWeighting,
)
from jacflow.aggregation._loss_aware import LossAware

_THREE = torch.tensor([1.0, 2.0, 3.0])

FACTORIES: dict[str, Callable[[], Aggregator]] = {
    "Krum1": lambda: Krum(1),
    "Krum0-3": lambda: Krum(0, n_selected=3),
    "Constant": lambda: Constant(_THREE),
    "TrimmedMean1": lambda: TrimmedMean(1),
    "NashMTL": lambda: NashMTL(n_tasks=3),
    "UPGrad": lambda: UPGrad(pref_vector=_THREE),
    "DualProj": lambda: DualProj(pref_vector=_THREE),
    "AlignedMTL": lambda: AlignedMTL(pref_vector=_THREE),
    "SDMGrad": lambda: SDMGrad(pref_vector=_THREE),
    "ConFIG": lambda: ConFIG(pref_vector=_THREE),
    "GradDrop": lambda: GradDrop(leak=_THREE / 4),
    "AuxiNash": lambda: AuxiNash(_THREE),
    "EPO": lambda: EPO(_THREE),
    "ParetoMTL": lambda: ParetoMTL(torch.eye(3), index=0),
    "Periodic": lambda: GramianWeightedAggregator(Periodic(KrumWeighting(1), every=2)),
    "CRMOGM": lambda: GramianWeightedAggregator(CRMOGMWeighting(KrumWeighting(1))),
    "LogLoss": lambda: GramianWeightedAggregator(LogLoss(KrumWeighting(1))),
    "Mean": Mean,
    "UPGrad default": UPGrad,
    "MGDA": MGDA,
    "PCD tau": lambda: PCD(tau=torch.tensor([0.1, 0.1])),
    "CRMOGM initial": lambda: GramianWeightedAggregator(
        CRMOGMWeighting(UPGradWeighting(), initial_weights=torch.ones(3))
    ),
}


def _with_losses(aggregator: Aggregator, m: int) -> Aggregator:
    """``aggregator`` with ``m`` losses given to its loss-aware parts."""
    for part in [aggregator, *aggregator.modules()]:
        if isinstance(part, LossAware):
            part.set_losses(torch.arange(1.0, m + 1.0))
    return aggregator


def _called(aggregator: Aggregator, m: int) -> ValueError | None:
    """The ``ValueError`` that calling ``aggregator`` on ``m`` rows raises, if any."""
    _with_losses(aggregator, m)
    matrix = torch.randn(m, 4, generator=torch.Generator().manual_seed(m))
    try:
        aggregator(matrix)
    except ValueError as error:
        return error
    return None


@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("m", range(7))
def test_check_rows_agrees_with_the_call(name: str, m: int) -> None:
    expected = _called(FACTORIES[name](), m)
    if expected is None:
        _with_losses(FACTORIES[name](), m).check_rows(m)
    else:
        with pytest.raises(ValueError) as raised:
            _with_losses(FACTORIES[name](), m).check_rows(m)
        assert str(raised.value) == str(expected)


def test_some_method_refuses_each_m() -> None:
    """The table above exercises refusals (not only acceptances) for every configured method."""
    for name, make in FACTORIES.items():
        refused = [m for m in range(7) if _called(make(), m) is not None]
        assert bool(refused) == (name not in ("Mean", "UPGrad default", "MGDA")), name


@pytest.mark.parametrize(
    "make",
    [
        lambda: MGDA(normalization="loss"),
        GradNorm,
        lambda: EPO(_THREE),
        DBMTL,
        lambda: GramianWeightedAggregator(LogLoss(UPGradWeighting())),
        lambda: ParetoMTL(torch.eye(3), index=0),
    ],
)
@pytest.mark.parametrize("given", [None, 2])
def test_check_rows_asks_for_the_losses_the_call_needs(
    make: Callable[[], Aggregator], given: int | None
) -> None:
    """Losses not set, or set with another count: refused by ``check_rows`` as by the call
    (``backward`` failed after differentiating, the graph freed)."""
    aggregator = make() if given is None else _with_losses(make(), given)
    with pytest.raises(ValueError, match="set_losses") as raised:
        aggregator(torch.randn(3, 4))
    with pytest.raises(ValueError) as checked:
        aggregator.check_rows(3)
    assert str(checked.value) == str(raised.value)


@pytest.mark.parametrize(
    "make",
    [
        GradNorm,
        GradVac,
        lambda: GramianWeightedAggregator(Periodic(UPGradWeighting(), every=3)),
        DBMTL,
        MoCo,
    ],
)
def test_check_rows_refuses_a_new_count_that_the_state_fixes(
    make: Callable[[], Aggregator],
) -> None:
    """A stateful method used on 3 rows refuses 2 until ``reset()``; ``check_rows`` refused
    nothing, so ``backward`` failed after differentiating (a retry after ``reset()`` then
    found the graph freed)."""
    aggregator = _with_losses(make(), 3)
    aggregator(torch.randn(3, 4))
    _with_losses(aggregator, 2)
    with pytest.raises(ValueError, match="reset") as checked:
        aggregator.check_rows(2)
    with pytest.raises(ValueError) as called:
        aggregator(torch.randn(2, 4))
    assert str(checked.value) == str(called.value)
