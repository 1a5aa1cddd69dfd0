"""The ``jacflow`` command end to end (one epoch into a temporary folder) and its errors."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from jacflow.cli import main
from jacflow.cli._data import load_digits
from jacflow.cli._model import TASKS


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as file:
        return list(csv.DictReader(file))


def _one_epoch_run(tmp_path: Path) -> tuple[Path, list[str]]:
    """A one-epoch ``train`` run into ``tmp_path / "run"``, done; its folder and arguments."""
    out = tmp_path / "run"
    argv = ["train", "--epochs", "1", "--quiet", "--no-plots", "--out", str(out)]
    assert main(argv) == 0
    return out, argv


def test_train_one_epoch_writes_run_folder_and_losses_decrease(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    code = main(["train", "--epochs", "1", "--out", str(out), "--quiet", "--seed", "3"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "digit_acc" in printed and str(out) in printed
    for name in ("metrics_steps.csv", "metrics_epochs.csv", "metrics.json"):
        assert (out / name).is_file()
    pytest.importorskip("matplotlib")
    for name in ("losses.png", "cosine_over_training.png", "weights.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_metrics_are_consistent(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--out", str(out), "--quiet", "--no-plots"]) == 0
    payload = json.loads((out / "metrics.json").read_text())
    before, after = payload["epochs"]
    for task in TASKS:  # one epoch lowers every task's test loss
        assert after[f"test_loss/{task}"] < before[f"test_loss/{task}"]
    steps = _read_csv(out / "metrics_steps.csv")
    n_train = round(1797 * 0.8)
    assert len(steps) == -(-n_train // 64) == payload["summary"]["steps"]
    for row in steps:
        # UPGrad never conflicts with a task: every update cosine is >= 0 (up to rounding).
        assert min(float(row[f"update_cos/{t}"]) for t in TASKS) > -1e-4
        weights = [float(row[f"weight/{t}"]) for t in TASKS]
        assert all(w >= 1 / 3 - 1e-4 for w in weights)  # UPGrad weights dominate the mean's
    # the recorded accuracy is the accuracy of the model on the test split: re-derive a bound
    assert 0.0 <= after["digit_acc"] <= 1.0 and after["digit_acc"] > before["digit_acc"]


def test_iwrm_compares_mean_and_upgrad(tmp_path: Path) -> None:
    out = tmp_path / "iwrm"
    code = main(["train", "--mode", "iwrm", "--epochs", "1", "--out", str(out), "--quiet"])
    assert code == 0
    rows = _read_csv(out / "comparison.csv")
    assert [row["aggregator"] for row in rows] == ["mean", "upgrad"]
    assert (out / "comparison.md").read_text().count("\n| ") == 3
    for name in ("mean", "upgrad"):
        epochs = json.loads((out / name / "metrics.json").read_text())["epochs"]
        assert epochs[1]["train_loss"] < epochs[0]["train_loss"]
    upgrad_steps = _read_csv(out / "upgrad" / "metrics_steps.csv")
    assert len(upgrad_steps) == 1024 // 32
    assert all(float(row["min_update_cos"]) > -1e-4 for row in upgrad_steps)
    mean_steps = _read_csv(out / "mean" / "metrics_steps.csv")
    assert any(float(row["min_update_cos"]) < 0 for row in mean_steps)  # the mean does conflict


def test_compare_writes_table(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    args = ["compare", "--aggregators", "mean,upgrad", "--epochs", "1", "--out", str(out)]
    assert main([*args, "--quiet", "--no-plots"]) == 0
    rows = _read_csv(out / "comparison.csv")
    assert [row["aggregator"] for row in rows] == ["mean", "upgrad"]
    for row, name in zip(rows, ("mean", "upgrad")):
        summary = json.loads((out / name / "metrics.json").read_text())["summary"]
        assert float(row["digit_acc"]) == pytest.approx(summary["digit_acc"])
    assert "| mean |" in (out / "comparison.md").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--epochs", "-1"], "expected a positive integer, received -1"),
        (["train", "--epochs", "two"], "expected a positive integer, received 'two'"),
        (["train", "--lr", "nan"], "expected a positive finite number"),
        (["train", "--batch-size", "0"], "expected a positive integer, received 0"),
        (["train", "--seed", "-3"], "expected a non-negative integer"),
        (["train", "--seed", str(2**64 - 1)], "expected a non-negative integer at most"),
        (["train", "--seed", str(2**64)], f"at most {2**63 - 1}, received {2**64}"),
        (["train", "--threads", "99999999999"], "expected a positive integer at most 1024"),
        (["train", "--threads", "0"], "expected a positive integer at most 1024, received 0"),
        (["train", "--aggregator", "nope"], "unknown aggregator 'nope'. Valid names: "),
        (["compare", "--aggregators", "mean,nope"], "unknown aggregator 'nope'"),
        (["compare", "--aggregators", ","], "--aggregators is empty"),
        (["train", "--device", "nodevice"], "invalid --device 'nodevice'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_exit_2_with_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", ["", " , ", "upgrad,mgda", "mean,mean", "nope"])
def test_iwrm_train_takes_one_known_aggregator_name(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As in mtl mode: "" ran mean alone (rc 0), "upgrad,mgda" three aggregators, and "mean,mean"
    blamed an option --aggregators that train does not have."""
    out = tmp_path / "run"
    argv = ["train", "--mode", "iwrm", "--aggregator", name, "--quiet", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"unknown aggregator {name!r}. Valid names: " in err
    assert "--aggregators" not in err
    assert not out.exists()


def test_unknown_aggregator_lists_valid_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--aggregator", "nope"]) == 2
    err = capsys.readouterr().err
    assert "mean" in err and "upgrad" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_unavailable_cuda_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--device", "cuda", "--out", "unused"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_unwritable_out_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert main(["train", "--epochs", "1", "--out", str(blocker / "run")]) == 2
    assert "cannot write the run folder --out" in capsys.readouterr().err


def test_missing_tensorboard_exits_2_with_install_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    argv = ["train", "--epochs", "1", "--tensorboard", "--out", str(tmp_path), "--quiet"]
    assert main(argv) == 2
    assert 'pip install "jacflow[tensorboard]"' in capsys.readouterr().err


def test_without_matplotlib_plots_are_skipped_with_notice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["train", "--epochs", "1", "--out", str(tmp_path), "--quiet"]) == 0
    assert "plots skipped: matplotlib is not installed" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.png"))


def test_help_and_aggregators_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "train" in capsys.readouterr().out
    assert main(["aggregators"]) == 0
    assert "upgrad" in capsys.readouterr().out


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    completed = subprocess.run(
        [sys.executable, "-m", "jacflow", "train", "--epochs", "nope"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert completed.returncode == 2
    assert "expected a positive integer" in completed.stderr


def test_bundled_digits_match_the_published_description() -> None:
    images, labels = load_digits()
    assert images.shape == (1797, 64)
    assert torch.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert float(images.min()) == 0.0 and float(images.max()) == 1.0


def test_without_tqdm_one_line_per_epoch_is_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    assert main(["train", "--epochs", "2", "--out", str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "tqdm not installed" in out
    epoch_lines = [line for line in out.splitlines() if line.startswith("upgrad epoch ")]
    assert [line.split(":")[0] for line in epoch_lines] == ["upgrad epoch 1", "upgrad epoch 2"]
    assert "digit_acc=" in epoch_lines[0]


@pytest.mark.parametrize("device", ["meta", "xpu", "hip", "lazy", "ipu", "mkldnn"])
def test_unusable_device_exits_2_before_the_run_folder(
    device: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(["train", "--device", device, "--epochs", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"unsupported --device {device!r}: expected cpu, cuda[:N] or mps" in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_iwrm_drops_the_incomplete_last_batch() -> None:
    from jacflow.cli._train import RunConfig, train_iwrm

    # 1024 = 3 * 300 + 124: three steps of 300 objectives (constant is built for m = 300)
    config = RunConfig(aggregator="constant", epochs=2, batch_size=300, lr=0.1)
    result = train_iwrm(config, progress=False)
    assert len(result.steps) == 2 * 3
    assert all(row["update_norm"] >= 0 for row in result.steps)
    with pytest.raises(ValueError, match="`batch_size` must be at most 1024"):
        train_iwrm(RunConfig(batch_size=1025), progress=False)


@pytest.mark.parametrize("name", ["epo", "dbmtl"])
def test_iwrm_runs_the_methods_that_need_positive_losses(name: str) -> None:
    """A confident sample's cross-entropy rounds to 0 (or -0.0), which EPO and DB-MTL refuse:
    the run stopped with a traceback; the loss values they get are now at least tiny."""
    from jacflow.cli._train import RunConfig, train_iwrm

    config = RunConfig(aggregator=name, epochs=1, batch_size=16, lr=0.1)
    result = train_iwrm(config, progress=False)
    assert len(result.steps) == 1024 // 16


def test_iwrm_batch_size_above_the_samples_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--mode", "iwrm", "--batch-size", "2000", "--out", str(out)]
    assert main(argv) == 2
    assert "--batch-size must be at most 1024" in capsys.readouterr().err
    assert not out.exists()


def test_reusing_out_is_refused_unless_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, argv = _one_epoch_run(tmp_path)
    (out / "norms.png").write_text("an earlier run's plot")
    (out / "notes.txt").write_text("mine")
    before = (out / "metrics.json").read_text()
    capsys.readouterr()
    assert main([*argv, "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert "already holds files" in err and "--overwrite" in err
    assert (out / "metrics.json").read_text() == before  # nothing lost
    assert main([*argv, "--seed", "1", "--overwrite"]) == 0
    assert json.loads((out / "metrics.json").read_text())["config"]["seed"] == 1
    assert not (out / "norms.png").exists()  # no plot of the earlier run is left
    assert (out / "notes.txt").read_text() == "mine"


def test_empty_out_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--out", ""]) == 2
    assert "expected a folder name, received an empty string" in capsys.readouterr().err


def test_iwrm_logs_each_steps_metrics_and_mean_loss_to_the_loggers() -> None:
    """What `--tensorboard` gets in iwrm mode: every step's conflict metrics, as the run's own
    rows hold them, and the batch's mean loss (it was refused there)."""
    from jacflow.cli._train import RunConfig, train_iwrm
    from jacflow.monitor import Logger

    class Recorder(Logger):
        def __init__(self) -> None:
            self.logged: dict[int, dict[str, float]] = {}
            self.closed = False

        def log(self, metrics: dict[str, float], step: int) -> None:
            self.logged.setdefault(step, {}).update(metrics)

        def close(self) -> None:
            self.closed = True

    recorder = Recorder()
    config = RunConfig(aggregator="upgrad", epochs=1, batch_size=256)
    result = train_iwrm(config, loggers=[recorder], progress=False)
    assert sorted(recorder.logged) == list(range(4)) and recorder.closed
    for row in result.steps:
        logged = recorder.logged[int(row["step"])]
        assert logged == {k: v for k, v in row.items() if k not in ("step", "epoch")}
        assert "conflict_fraction" in logged and "loss" in logged


def test_tensorboard_with_iwrm_writes_each_runs_events(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    out = tmp_path / "run"
    argv = ["train", "--mode", "iwrm", "--epochs", "1", "--quiet", "--no-plots"]
    assert main([*argv, "--tensorboard", "--out", str(out)]) == 0
    for name in ("mean", "upgrad"):
        assert list((out / name / "tensorboard").glob("events.out.tfevents.*"))
    assert main([*argv, "--out", str(out), "--overwrite"]) == 0  # (the events are cleared)
    assert not (out / "upgrad" / "tensorboard").exists()


def test_compare_takes_tensorboard_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["compare", "--aggregators", "mean,upgrad", "--epochs", "1", "--quiet", "--no-plots"]
    out = tmp_path / "runs"
    if importlib.util.find_spec("tensorboard") is not None:
        assert main([*argv, "--tensorboard", "--out", str(out)]) == 0
        for name in ("mean", "upgrad"):
            assert list((out / name / "tensorboard").glob("events.out.tfevents.*"))
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    fresh = tmp_path / "fresh"
    assert main([*argv, "--tensorboard", "--out", str(fresh)]) == 2
    assert 'pip install "jacflow[tensorboard]"' in capsys.readouterr().err
    assert not fresh.exists()


def test_overwrite_clears_an_interrupted_comparisons_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A comparison stopped before its table (Ctrl-C) left its runs' files, TensorBoard events
    included, which `--overwrite` missed: `comparison.json` named no folder yet (a review's
    finding). It names them from the start now."""
    from jacflow.cli import _compare

    real = _compare.train_iwrm

    def interrupted(config: Any, **kwargs: Any) -> Any:
        if config.aggregator == "upgrad":
            board = tmp_path / "run" / "upgrad" / "tensorboard"
            board.mkdir(parents=True)
            (board / "events.out.tfevents.1.host").write_text("stale")
            raise KeyboardInterrupt
        return real(config, **kwargs)

    argv = ["compare", "--mode", "iwrm", "--aggregators", "mean,upgrad", "--epochs", "1"]
    argv += ["--quiet", "--no-plots", "--out", str(tmp_path / "run")]
    monkeypatch.setattr(_compare, "train_iwrm", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    earlier = json.loads((tmp_path / "run" / "comparison.json").read_text())
    assert earlier["complete"] is False
    assert [r["aggregator"] for r in earlier["runs"]] == ["mean", "upgrad"]
    monkeypatch.setattr(_compare, "train_iwrm", real)
    assert main([*argv, "--overwrite"]) == 0
    assert not (tmp_path / "run" / "upgrad" / "tensorboard").exists()
    assert json.loads((tmp_path / "run" / "comparison.json").read_text())["complete"] is True


def test_repeated_aggregator_names_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Their runs would share one folder (files overwritten, logs mixed)."""
    out = tmp_path / "run"
    assert main(["compare", "--aggregators", "upgrad,mean,upgrad", "--out", str(out)]) == 2
    assert "--aggregators names upgrad more than once" in capsys.readouterr().err
    assert main(["compare", "--aggregators", "UPGrad,mean,upgrad", "--out", str(out)]) == 2
    assert "--aggregators names upgrad more than once" in capsys.readouterr().err
    assert not out.exists()


def test_iwrm_train_with_mean_in_any_case_compares_mean_and_upgrad(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["train", "--mode", "iwrm", "--aggregator", " Mean ", "--epochs", "1", "--quiet"]
    assert main([*argv, "--no-plots", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["mean", "upgrad"]


def test_missing_tensorboard_with_iwrm_exits_2_before_the_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    out = tmp_path / "run"
    assert main(["train", "--mode", "iwrm", "--tensorboard", "--out", str(out)]) == 2
    assert 'pip install "jacflow[tensorboard]"' in capsys.readouterr().err
    assert not out.exists()


def test_overwrite_clears_only_the_earlier_comparisons_folders(tmp_path: Path) -> None:
    """`--overwrite` deletes the files of the runs the earlier comparison's `comparison.json`
    names, and no other folder's, even one holding a `metrics.json` (another run kept there)."""
    out = tmp_path / "runs"
    argv = ["compare", "--aggregators", "mean,upgrad", "--epochs", "1", "--quiet", "--no-plots"]
    assert main([*argv, "--out", str(out)]) == 0
    other = out / "exp-a"
    other.mkdir()
    (other / "metrics.json").write_text("{}")
    assert main([*argv[:2], "mean", *argv[3:], "--out", str(out), "--overwrite"]) == 0
    assert (other / "metrics.json").read_text() == "{}"
    assert not (out / "upgrad").exists()  # (emptied by the clearing, then removed)
    assert (out / "mean" / "metrics.json").is_file()


def test_a_refusal_after_overwrite_deletes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing optional dependency is found before the earlier run's files are deleted."""
    out, argv = _one_epoch_run(tmp_path)
    before = (out / "metrics.json").read_text()
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert main([*argv, "--tensorboard", "--overwrite"]) == 2
    assert (out / "metrics.json").read_text() == before
    fresh = tmp_path / "fresh"
    assert main([*argv[:-1], str(fresh), "--tensorboard"]) == 2
    assert not fresh.exists()


def test_overwrite_of_files_that_cannot_be_deleted_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An earlier run's files that cannot be deleted: one line and exit code 2 (a traceback)."""
    out, argv = _one_epoch_run(tmp_path)
    unlink = Path.unlink

    def refused(path: Path, missing_ok: bool = False) -> None:
        if path.parent == out and path.exists():
            raise PermissionError(1, "Operation not permitted", str(path))
        unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refused)
    assert main([*argv, "--overwrite"]) == 2
    assert "could not delete the earlier run's files" in capsys.readouterr().err


def test_compare_refuses_a_run_folder_that_is_a_file_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``out/<aggregator>`` is a file: refused before any training (it trained, then raised)
    and before ``--overwrite`` deletes the earlier comparison (it deleted it, then refused)."""
    out = tmp_path / "cmp"
    argv = ["compare", "--aggregators", "mean,upgrad", "--epochs", "1", "--quiet", "--no-plots"]
    assert main([*argv, "--out", str(out)]) == 0
    before = (out / "comparison.json").read_text()
    shutil.rmtree(out / "upgrad")
    (out / "upgrad").write_text("mine")
    assert main([*argv, "--out", str(out), "--overwrite"]) == 2
    assert "the run folder" in capsys.readouterr().err
    assert (out / "upgrad").read_text() == "mine"
    assert (out / "comparison.json").read_text() == before
    assert (out / "mean" / "metrics.json").exists()


def test_overwrite_refuses_a_run_file_that_is_a_folder_before_deleting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, argv = _one_epoch_run(tmp_path)
    (out / "metrics_steps.csv").unlink()
    (out / "metrics_steps.csv").mkdir()
    assert main([*argv, "--overwrite"]) == 2
    assert "metrics_steps.csv" in capsys.readouterr().err
    assert (out / "metrics.json").exists()


def test_huge_iwrm_batch_size_in_compare_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """The batch size is checked before an aggregator is built for m = --batch-size (constant
    allocated its weights first: a raw memory error)."""
    huge = str(10**11)
    argv = ["compare", "--mode", "iwrm", "--aggregators", "constant", "--batch-size", huge]
    assert main(argv) == 2
    assert "--batch-size must be at most 1024" in capsys.readouterr().err


def test_default_folders_of_runs_in_the_same_second_differ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt, *args: "20260101-000000")
    argv = ["train", "--epochs", "1", "--quiet", "--no-plots"]
    assert main(argv) == 0
    assert main(argv) == 0
    names = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert names == ["train-upgrad-20260101-000000", "train-upgrad-20260101-000000-2"]


@pytest.mark.parametrize("name", ["..", ".", "../x", "a/b", "/tmp", "a\\b", ""])
def test_overwrite_refuses_a_comparison_naming_a_run_outside_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """A `comparison.json` naming the run ".." made `--overwrite` delete the run files of the
    parent folder (and remove it when that left it empty)."""
    parent = tmp_path / "dd"
    out = parent / "inner"
    out.mkdir(parents=True)
    (parent / "metrics.json").write_text("an earlier run in the parent")
    (out / "metrics.json").write_text("an earlier run here")
    (out / "comparison.json").write_text(json.dumps({"runs": [{"aggregator": name}]}))
    argv = ["train", "--mode", "iwrm", "--epochs", "1", "--quiet", "--no-plots"]
    assert main([*argv, "--out", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"names the run {name!r}, which is not a folder name" in err
    assert (parent / "metrics.json").read_text() == "an earlier run in the parent"
    assert (out / "metrics.json").read_text() == "an earlier run here"  # nothing deleted


@pytest.mark.parametrize("buffered", [True, False])
def test_a_reader_that_stops_early_ends_the_command_without_a_traceback(buffered: bool) -> None:
    """``jacflow aggregators | head -1`` ended with a BrokenPipeError traceback (unbuffered) or
    "Exception ignored ... BrokenPipeError" and exit status 120 (buffered, the output written
    at exit); the command now stops quietly with exit status 1 (Python's convention for
    EPIPE) when its reader has gone."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    read, write = os.pipe()
    os.close(read)  # (the reader is gone before the first line: every write fails)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "jacflow", "aggregators"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env=env,
        )
    finally:
        os.close(write)
    assert done.returncode == 1
    assert "BrokenPipeError" not in done.stderr and "Traceback" not in done.stderr


def test_a_broken_pipe_without_a_stdout_descriptor_is_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where stdout is captured in memory (a notebook, ``redirect_stdout``), a broken pipe is
    not stdout's: it is raised as it is, not hidden behind an error of the handler."""

    def broken() -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("jacflow.cli._cmd_aggregators", broken)
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(BrokenPipeError):
        main(["aggregators"])


def _files_under(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("command", ["train", "compare"])
@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ('{"runs": 5}', '"runs" is 5, not a list'),
        ('{"runs": null}', '"runs" is null, not a list'),
        ('{"runs": true}', '"runs" is true, not a list'),
        ('{"runs": "upgrad"}', '"runs" is "upgrad", not a list'),
        ('{"runs": [{"aggregator": ["a"]}]}', 'run 0 is {"aggregator": ["a"]}, not an object'),
        ('{"runs": [{"aggregator": "upgrad"}, 5]}', "run 1 is 5, not an object"),
        ("[]", 'no "runs" entry'),
        ("{not json", "not valid JSON"),
    ],
)
def test_overwrite_refuses_a_malformed_comparison_and_deletes_nothing(
    command: str, content: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Valid JSON of another shape ("runs" 5, null or true, a list as an aggregator) stopped
    `--overwrite` with a TypeError traceback, and the other shapes were skipped: the earlier
    comparison's run folders were then left beside the new run. Each is refused in one line."""
    out = tmp_path / "run"
    (out / "upgrad").mkdir(parents=True)
    (out / "upgrad" / "metrics.json").write_text("an earlier run")
    (out / "metrics.json").write_text("an earlier run here")
    (out / "comparison.json").write_text(content)
    before = _files_under(out)
    argv = [command, "--epochs", "1", "--quiet", "--no-plots", "--out", str(out), "--overwrite"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"jacflow {command}: error: {out / 'comparison.json'} is not a ")
    assert problem in err and "--overwrite deleted nothing" in err
    assert _files_under(out) == before


@pytest.mark.parametrize("command", ["train", "compare", "bench", "aggregators"])
def test_an_unknown_option_prints_the_commands_usage(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed the top-level usage ("usage: jacflow [-h] COMMAND ...") and "jacflow: error",
    where docs/cli.md says the command's usage, as for a bad option value."""
    assert main([command, "--foo", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith(f"usage: jacflow {command} [-h]")
    assert lines[-1] == f"jacflow {command}: error: unrecognized arguments: --foo 1"
    # (given before the command, it is the top level's: its usage and name)
    assert main(["--foo", command]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("usage: jacflow [-h]")
    assert lines[-1] == "jacflow: error: unrecognized arguments: --foo"


def _summary_lines(printed: str) -> dict[str, str]:
    """The ``key : value`` lines of a printed summary."""
    pairs = (line.split(" : ", 1) for line in printed.splitlines() if " : " in line)
    return {key.strip(): value.strip() for key, value in pairs}


def test_a_diverged_run_shows_nan_and_a_note_apart_from_not_applicable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its NaN losses printed as `n/a`, the token of a value that does not apply (the weights
    of `config`), and `metrics.json` held `null` for both."""
    out = tmp_path / "run"
    argv = ["train", "--aggregator", "config", "--lr", "1e30", "--epochs", "1", "--quiet"]
    assert main([*argv, "--no-plots", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    summary = _summary_lines(printed)
    for task in TASKS:  # (Adam's steps of about 1e30 make every loss NaN)
        assert summary[f"test_loss/{task}"] == "nan"
        assert summary[f"mean_weight/{task}"] == "n/a"  # (config exposes no weights)
    assert summary["mean_min_update_cos"] == "n/a"
    assert "note: the config run diverged" in printed
    saved = json.loads((out / "metrics.json").read_text())["summary"]
    assert saved["test_loss/digit"] == "nan" and saved["mean_min_update_cos"] is None
    assert all(saved[f"mean_weight/{task}"] is None for task in TASKS)


def test_a_diverged_comparison_row_shows_nan_where_a_value_applies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In the table too: mean's update cosines diverged (`nan`), config has none (`n/a`)."""
    out = tmp_path / "run"
    argv = ["compare", "--mode", "iwrm", "--aggregators", "mean,config", "--lr", "1e30"]
    assert main([*argv, "--epochs", "1", "--quiet", "--no-plots", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = {line.split(" | ")[0]: line.split(" | ") for line in printed.splitlines()}
    # | aggregator | train_loss | train_acc | test_loss | test_acc | mean_conflict_fraction |
    # mean_min_update_cos | seconds |
    assert rows["| mean"][1] == "nan" and rows["| mean"][6] == "nan"
    assert rows["| config"][1] == "nan" and rows["| config"][6] == "n/a"
    assert "note: the mean run diverged" in printed
    assert "note: the config run diverged" in printed
    runs = json.loads((out / "comparison.json").read_text())["runs"]
    assert [run["mean_min_update_cos"] for run in runs] == ["nan", None]
    csv_rows = _read_csv(out / "comparison.csv")
    assert [row["mean_min_update_cos"] for row in csv_rows] == ["nan", ""]
