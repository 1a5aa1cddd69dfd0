"""A checkpoint (``state_dict`` through ``torch.save``) resumes a stateful aggregator exactly."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from jacflow.aggregation import (
    DBMTL,
    IMTL,
    PCD,
    Aggregator,
    CRMOGMWeighting,
    ExcessMTL,
    GradNorm,
    GradVac,
    GradVacWeighting,
    GramianWeightedAggregator,
    LossAware,
    MGDAWeighting,
    MoCo,
    MoDo,
    NashMTL,
    ParetoMTL,
    Periodic,
    SDMGrad,
)
from tests._checkpoint import check_resumes
from tests.aggregation._with_losses import loss_target

_GEN = torch.Generator().manual_seed(0)
_JACOBIANS = torch.randn(10, 3, 5, generator=_GEN, dtype=torch.float64)
# (increasing: for ParetoMTL's sub-problem 0, whose preference is u_0, they stay infeasible, so
# that its phase 1 lasts its n_warmup_steps calls)
_LOSSES = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64) + 0.1 * torch.rand(
    10, 3, generator=_GEN, dtype=torch.float64
)


def _call(method: Aggregator, step: int) -> Tensor:
    torch.manual_seed(step)  # (GradVac visits the rows in a random order)
    if isinstance(method, LossAware) or isinstance(
        getattr(method, "gramian_weighting", None), LossAware
    ):
        loss_target(method).set_losses(_LOSSES[step])
    return method(_JACOBIANS[step])


MAKERS: dict[str, Callable[[], Aggregator]] = {
    "CRMOGM(GradVac)": lambda: GramianWeightedAggregator(
        CRMOGMWeighting(GradVacWeighting(), alpha=0.5)
    ),
    "DBMTL": DBMTL,
    "ExcessMTL": ExcessMTL,
    "GradNorm": lambda: GradNorm(lr=0.1),
    "GradVac": GradVac,
    "IMTL": lambda: IMTL(3),
    "MoCo": MoCo,
    "MoDo": MoDo,
    "NashMTL": lambda: NashMTL(3, update_weights_every=3, max_norm=0.0),
    "ParetoMTL": lambda: ParetoMTL(torch.eye(3), index=0, n_warmup_steps=4),
    "PCD": PCD,
    "Periodic": lambda: GramianWeightedAggregator(Periodic(MGDAWeighting(), every=3)),
    "SDMGrad": SDMGrad,
}


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize("saved_at", [0, 1, 2, 4])
def test_a_reloaded_checkpoint_continues_as_the_original(name: str, saved_at: int) -> None:
    """Their state was held in plain attributes (MoCo's tracked Jacobian, NashMTL's last
    solution and call counter, ExcessMTL's squared-gradient sums, ...) that ``state_dict``
    did not hold: a reloaded checkpoint restarted from scratch."""
    check_resumes(MAKERS[name], _call, saved_at, len(_JACOBIANS))


def test_a_foreign_state_is_refused() -> None:
    state = MoCo().state_dict()
    with pytest.raises(ValueError, match=r"must hold \['_buffer', '_step'\], received"):
        DBMTL().load_state_dict(state)


def _same_state(a: object, b: object) -> bool:
    """Whether two ``state_dict`` values are equal, tensors entry by entry (NaN equal to NaN)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a.isnan(), b.isnan()))
            and bool((a.nan_to_num() == b.nan_to_num()).all())
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize("steps_before", [0, 2])
def test_a_skipped_call_leaves_the_state_as_it_was(name: str, steps_before: int) -> None:
    """A call on a Jacobian with a NaN (a step a GradScaler skips) changes no state, on a fresh
    instance too: DBMTL, MoCo, GradVac and ExcessMTL set theirs up on it (and the first three
    then refused a valid input of another shape)."""
    method = MAKERS[name]()
    for step in range(steps_before):
        _call(method, step)
    before = method.state_dict()
    nan_jacobian = _JACOBIANS[steps_before].clone()
    nan_jacobian[1, 2] = float("nan")
    torch.manual_seed(0)
    if isinstance(method, LossAware) or isinstance(
        getattr(method, "gramian_weighting", None), LossAware
    ):
        loss_target(method).set_losses(_LOSSES[steps_before])
    method(nan_jacobian)
    assert _same_state(method.state_dict(), before)
