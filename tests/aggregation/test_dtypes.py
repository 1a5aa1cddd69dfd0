"""Every exported aggregator on float16 and bfloat16 Jacobians, against its float32 result.

Half-precision inputs are aggregated in float32 and the update is returned in the input's
dtype (``Aggregator.__call__``), so the half-precision update is the float32 update of the same
(exactly representable) Jacobian, rounded once. Before, MGDA, IMTLG, ConFIG and AlignedMTL
failed inside ``torch.linalg`` and CAGrad returned zeros in bfloat16.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import jacflow.aggregation as aggregation
from jacflow.aggregation import Aggregator, GramianWeightedAggregator, Weighting
from jacflow.aggregation._loss_aware import LossAware

M, N = 4, 6
LOSSES = torch.tensor([1.0, 2.0, 0.5, 1.5])

TABLE: dict[str, Callable[[], Aggregator]] = {
    "AlignedMTL": aggregation.AlignedMTL,
    "AuxiNash": lambda: aggregation.AuxiNash(torch.ones(M)),
    "CAGrad": lambda: aggregation.CAGrad(c=0.5),
    "ConFIG": aggregation.ConFIG,
    "Constant": lambda: aggregation.Constant(torch.tensor([1.0, 2.0, 0.5, 0.25])),
    "DBMTL": aggregation.DBMTL,
    "DualProj": aggregation.DualProj,
    "EPO": lambda: aggregation.EPO(torch.ones(M)),
    "ExcessMTL": aggregation.ExcessMTL,
    "FairGrad": lambda: aggregation.FairGrad(alpha=1.0),
    "GradDrop": aggregation.GradDrop,
    "GradNorm": aggregation.GradNorm,
    "GradVac": aggregation.GradVac,
    "GramianWeightedAggregator": lambda: GramianWeightedAggregator(aggregation.UPGradWeighting()),
    "IMTL": lambda: aggregation.IMTL(n_tasks=M),
    "IMTLG": aggregation.IMTLG,
    "Krum": lambda: aggregation.Krum(n_byzantine=1),
    "MGDA": aggregation.MGDA,
    "Mean": aggregation.Mean,
    "MoCo": aggregation.MoCo,
    "MoDo": aggregation.MoDo,
    "NashMTL": lambda: aggregation.NashMTL(n_tasks=M),
    "PCD": aggregation.PCD,
    "PCGrad": aggregation.PCGrad,
    "ParetoMTL": lambda: aggregation.ParetoMTL(torch.eye(M), index=0),
    "Random": aggregation.Random,
    "SDMGrad": aggregation.SDMGrad,
    "Sum": aggregation.Sum,
    "TrimmedMean": lambda: aggregation.TrimmedMean(trim_number=1),
    "UPGrad": aggregation.UPGrad,
    "WeightedAggregator": lambda: aggregation.WeightedAggregator(aggregation.MeanWeighting()),
}
HALF = [torch.float16, torch.bfloat16]


def _exported_aggregators() -> set[str]:
    names = set()
    for name in aggregation.__all__:
        value = getattr(aggregation, name)
        if isinstance(value, type) and issubclass(value, Aggregator):
            names |= set() if inspect.isabstract(value) else {name}
    return names


def test_the_table_lists_every_exported_aggregator() -> None:
    assert set(TABLE) == _exported_aggregators()


def _run(make: Callable[[], Aggregator], matrix: Tensor, steps: int = 2) -> Tensor:
    """A fresh aggregator called ``steps`` times (stateful ones update their state), with the
    same random draws for every dtype."""
    torch.manual_seed(0)
    aggregator = make()
    out = matrix.new_zeros(0)
    for _ in range(steps):
        if isinstance(aggregator, LossAware):
            aggregator.set_losses(LOSSES)
        out = aggregator(matrix)
    return out


def _jacobian(scale: float, dtype: torch.dtype) -> Tensor:
    gen = torch.Generator().manual_seed(7)
    return (scale * torch.randn(M, N, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("scale", [1.0, 300.0])  # 300: a float16 Gramian would overflow
@pytest.mark.parametrize("name", sorted(TABLE))
def test_half_precision_matches_float32(name: str, scale: float, dtype: torch.dtype) -> None:
    matrix = _jacobian(scale, dtype)
    expected = _run(TABLE[name], matrix.float())
    out = _run(TABLE[name], matrix)
    assert out.dtype == dtype and out.shape == (N,)
    eps = torch.finfo(dtype).eps
    peak = float(expected.abs().max())
    assert bool(torch.isfinite(expected).all())
    torch.testing.assert_close(out.float(), expected, rtol=eps, atol=eps * peak)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize(
    "name", sorted(n for n, make in TABLE.items() if isinstance(make(), GramianWeightedAggregator))
)
def test_half_precision_gramian_weightings_match_float32(name: str, dtype: torch.dtype) -> None:
    """The weightings alone (the Gramian engine's path) on a half-precision Gramian."""
    aggregator = TABLE[name]()
    assert isinstance(aggregator, GramianWeightedAggregator)
    matrix = _jacobian(1.0, torch.float32)
    gramian = (matrix @ matrix.T).to(dtype)

    def weights(stat: Tensor) -> Tensor:
        torch.manual_seed(0)
        weighting: Weighting = TABLE[name]().gramian_weighting  # type: ignore[attr-defined]
        if isinstance(weighting, LossAware):
            weighting.set_losses(LOSSES)
        return weighting(stat)

    expected = weights(gramian.float())
    out = weights(gramian)
    assert out.dtype == dtype
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(
        out.float(), expected, rtol=eps, atol=eps * float(expected.abs().max())
    )


def test_half_precision_keeps_the_graph() -> None:
    """A differentiable aggregator stays differentiable through the float32 round trip."""
    matrix = _jacobian(1.0, torch.bfloat16).requires_grad_()
    out = aggregation.Mean()(matrix)
    assert out.dtype == torch.bfloat16 and out.requires_grad
    out.sum().backward()
    assert matrix.grad is not None and matrix.grad.dtype == torch.bfloat16
