"""Monitor, loggers and the aggregator watch on real training steps."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch

import jacflow
from jacflow.aggregation import Mean, Sum, UPGrad
from jacflow.monitor import (
    AggregatorWatch,
    CSVLogger,
    Logger,
    Monitor,
    TensorBoardLogger,
    conflict_metrics,
)


class _Collect(Logger):
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, metrics))

    def close(self) -> None:
        self.closed = True


def test_monitor_logs_every_kth_step_and_closes_loggers() -> None:
    collect = _Collect()
    J = torch.tensor([[1.0, 0.0], [-1.0, 1.0]])
    with Monitor([collect], names=["a", "b"], every=2) as monitor:
        results = [monitor.record(J @ J.T, losses=torch.tensor([1.0, 2.0])) for _ in range(5)]
    assert [step for step, _ in collect.rows] == [0, 2, 4]
    assert results[1] is None and results[0] is not None
    assert collect.closed
    assert [row["step"] for row in monitor.history] == [0.0, 2.0, 4.0]
    assert collect.rows[0][1]["loss/b"] == 2.0
    assert collect.rows[0][1] == conflict_metrics(J @ J.T).to_dict(["a", "b"]) | {
        "loss/a": 1.0,
        "loss/b": 2.0,
    }


def test_monitor_validates_arguments() -> None:
    with pytest.raises(ValueError, match="`every` must be a positive int"):
        Monitor(every=0)
    with pytest.raises(TypeError, match=r"`loggers\[0\]`"):
        Monitor([object()])  # type: ignore[list-item]
    # (a class for an instance was named by its metaclass)
    with pytest.raises(TypeError, match=r"received the class CSVLogger .*CSVLogger\(\.\.\.\)"):
        Monitor([CSVLogger])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="`losses` must hold 2 values"):
        Monitor().record(torch.eye(2), losses=[1.0])


def test_a_refused_record_changes_nothing() -> None:
    """A step refused for its losses left ``last`` set to it and advanced the step count."""
    collect = _Collect()
    monitor = Monitor([collect])
    monitor.record(torch.eye(2))
    before = monitor.last
    with pytest.raises(ValueError, match="`losses` must hold 2 values"):
        monitor.record(2 * torch.eye(2), losses=[1.0])
    assert monitor.last is before
    monitor.record(torch.eye(2))
    assert [step for step, _ in collect.rows] == [0, 1]


def test_csv_logger_extends_header_on_new_keys(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "m.csv"
    logger = CSVLogger(path)
    logger.log({"a": 1.0}, 0)
    logger.log({"a": 2.0}, 1)
    logger.log({"a": 3.0, "b": 4.0}, 2)
    logger.close()
    with path.open() as file:
        rows = list(csv.DictReader(file))
    assert rows == [
        {"step": "0", "a": "1.0", "b": ""},
        {"step": "1", "a": "2.0", "b": ""},
        {"step": "2", "a": "3.0", "b": "4.0"},
    ]


def test_tensorboard_logger_missing_dependency_names_install_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r'pip install "jacflow\[tensorboard\]"'):
        TensorBoardLogger("unused")


def test_tensorboard_logger_writes_events(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    logger = TensorBoardLogger(tmp_path)
    logger.log({"a": 1.0}, 0)
    logger.close()
    assert list(tmp_path.glob("events.out.tfevents.*"))


def _jacobian_step(aggregator: torch.nn.Module) -> torch.Tensor:
    torch.manual_seed(0)
    J = torch.randn(3, 6, dtype=torch.float64)
    J[1] = -J[0] + 0.1 * J[2]  # force a conflict
    return J


@pytest.mark.parametrize("make", [UPGrad, Mean])
def test_watch_captures_gramian_and_weights_of_the_update(make: type) -> None:
    aggregator = make()
    watch = AggregatorWatch(aggregator)
    J = _jacobian_step(aggregator)
    update = aggregator(J)
    gramian, weights = watch.pop()
    assert gramian is not None and weights is not None
    torch.testing.assert_close(gramian, J @ J.T)
    torch.testing.assert_close(J.T @ weights, update)
    assert watch.pop() == (None, None)
    watch.remove()
    aggregator(J)
    assert watch.pop() == (None, None)


def test_watch_rejects_non_aggregators() -> None:
    with pytest.raises(TypeError, match=r"`aggregator` must be a jacflow\.aggregation\.Aggregator"):
        AggregatorWatch(torch.nn.Linear(1, 1))  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [UPGrad, Mean, Sum])
@pytest.mark.parametrize("via", ["backward", "jac_to_grad", "mtl_backward"])
def test_watch_inside_library_calls_gets_the_gramian_of_the_jacobian(make: type, via: str) -> None:
    """Inside ``backward``, ``jac_to_grad`` and ``mtl_backward`` the watch gets ``J J^T`` of
    the unscaled Jacobian (the aggregator's call runs on ``J``) and the update's weights."""
    generator = torch.Generator().manual_seed(0)
    trunk = torch.randn(3, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    heads = torch.randn(2, 3, dtype=torch.float64, generator=generator)
    x = torch.randn(4, dtype=torch.float64, generator=generator)
    features = torch.tanh(trunk @ x)
    losses = [(heads[i] * features).sum() * 37.0 for i in range(2)]
    rows = [torch.autograd.grad(loss, trunk, retain_graph=True)[0].flatten() for loss in losses]
    J = torch.stack(rows)
    aggregator = make()
    watch = AggregatorWatch(aggregator)
    if via == "backward":
        jacflow.backward(losses, inputs=[trunk], A=aggregator)
    elif via == "jac_to_grad":
        jacflow.backward(losses, inputs=[trunk])
        jacflow.jac_to_grad([trunk], aggregator)
    else:
        jacflow.mtl_backward(losses, features, A=aggregator)
    gramian, weights = watch.pop()
    assert gramian is not None and weights is not None and trunk.grad is not None
    torch.testing.assert_close(gramian, J @ J.T)
    torch.testing.assert_close(J.T @ weights, trunk.grad.flatten())
    watch.remove()
