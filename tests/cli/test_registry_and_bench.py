"""Aggregator names of the command line and the built-in benchmark."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jacflow import aggregation
from jacflow.aggregation import Aggregator, UPGrad
from jacflow.cli import main
from jacflow.cli._bench import benchmark_scripts, find_benchmarks
from jacflow.cli._errors import CLIError
from jacflow.cli._registry import aggregator_classes, make_aggregator


def test_registry_holds_every_concrete_exported_aggregator_with_buildable_defaults() -> None:
    classes = aggregator_classes()
    exported = {name.lower() for name in aggregation.__all__}
    assert set(classes) <= exported
    bases = {"aggregator", "weightedaggregator", "gramianweightedaggregator"}
    concrete = {
        name.lower()
        for name in aggregation.__all__
        if isinstance(getattr(aggregation, name), type)
        and issubclass(getattr(aggregation, name), Aggregator)
    }
    # (the documented exceptions: a protocol of its own, and preference vectors to choose)
    assert concrete - bases - set(classes) == {"imtl", "paretomtl"}
    J = torch.randn(3, 5)
    for name in classes:
        try:
            aggregator = make_aggregator(name, 3)
        except CLIError as error:  # an optional dependency that is not installed
            assert "unavailable" in str(error)
            continue
        assert isinstance(aggregator, Aggregator)
        if isinstance(aggregator, aggregation.LossAware):
            aggregator.set_losses(torch.ones(3))
        assert aggregator(J).shape == (5,)


def test_mean_and_upgrad_from_registry_give_the_reference_updates() -> None:
    J = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    torch.testing.assert_close(make_aggregator("mean", 2)(J), J.mean(dim=0))
    torch.testing.assert_close(make_aggregator("UPGRAD", 2)(J), UPGrad()(J))


def test_bench_list_finds_repository_scripts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "jacflow"\n')
    (tmp_path / "benchmarks").mkdir()
    for name in ("bench_a.py", "_helper.py", "bench_b.py"):
        (tmp_path / "benchmarks" / name).write_text("print('ratio 1.0')\n")
    folder = find_benchmarks(tmp_path / "benchmarks")
    assert folder == tmp_path / "benchmarks"
    assert [p.name for p in benchmark_scripts(folder)] == ["bench_a.py", "bench_b.py"]
    assert [p.name for p in benchmark_scripts(folder, "h_b")] == ["bench_b.py"]


@pytest.mark.parametrize(
    ("pyproject", "ours"),
    [
        ('[project]\nname = "other"\n', False),
        ('[tool.other]\nname = "jacflow"\n[project]\nname = "other"\n', False),
        ('[project]\nname = "jacflow"  # the library\n', True),
    ],
)
def test_bench_runs_only_jacflows_benchmarks(tmp_path: Path, pyproject: str, ours: bool) -> None:
    """A folder of another project (its own pyproject.toml and benchmarks/) above the working
    directory: its scripts are not ours to run (they were run); jacflow's ``[project]`` table
    is read as TOML (a trailing comment did not match, another table's name did)."""
    (tmp_path / "pyproject.toml").write_text(pyproject)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bench_other.py").write_text("print('other')\n")
    assert (find_benchmarks(tmp_path / "benchmarks") == tmp_path / "benchmarks") == ours


def test_bench_builtin_prints_ratio_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--builtin"]) == 0
    out = capsys.readouterr().out
    assert "| sum().backward() |" in out and "| jacflow UPGrad |" in out
    baseline = next(line for line in out.splitlines() if line.startswith("| sum().backward()"))
    assert baseline.rstrip(" |").endswith("1.0000")  # the baseline's ratio to itself


def _fake_repository(root: Path) -> Path:
    """A jacflow repository at ``root`` whose ``benchmarks/`` holds two scripts."""
    (root / "pyproject.toml").write_text('[project]\nname = "jacflow"\n')
    (root / "benchmarks").mkdir()
    for name in ("bench_a.py", "bench_b.py"):
        (root / "benchmarks" / name).write_text("print('ratio 1.0')\n")
    return root / "benchmarks"


@pytest.mark.parametrize("option", [["--filter", "bench_a"], ["--timeout", "5"]])
def test_bench_builtin_refuses_the_options_of_the_scripts(
    option: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--builtin` ran the whole built-in subset, saying nothing of `--filter` or `--timeout`."""
    assert main(["bench", "--builtin", *option]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("usage: jacflow bench [-h]")
    assert lines[-1].startswith(
        f"jacflow bench: error: argument {option[0]}: not allowed with argument --builtin"
    )


def test_bench_list_builtin_says_what_the_builtin_subset_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It said "no benchmark scripts found" in the repository, which has them."""
    assert main(["bench", "--list", "--builtin"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("no script (--builtin): the built-in subset times one multi-task")
    assert "UPGrad weights for 2, 8 and 32 objectives" in printed


def test_bench_list_filter_lists_the_matches_or_says_none_matches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A filter matching no script said "no benchmark scripts found; `jacflow bench` runs the
    built-in subset", where `jacflow bench --filter` refuses it."""
    folder = _fake_repository(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--list", "--filter", "_b"]) == 0
    assert capsys.readouterr().out.splitlines() == [str(folder / "bench_b.py")]
    assert main(["bench", "--list", "--filter", "zzz"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    expected = f"jacflow bench: error: no benchmark script in {folder} matches --filter 'zzz'."
    assert captured.err == expected + "\n"


@pytest.mark.parametrize("option", [["--filter", "bench_a"], ["--timeout", "5"]])
def test_bench_without_scripts_refuses_their_options_and_lists_the_builtin_subset(
    option: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """From an installed package (no benchmarks/ folder), `--filter` and `--timeout` were
    ignored: the built-in subset ran, and `--list` said so only in part."""
    monkeypatch.setattr("jacflow.cli._bench.find_benchmarks", lambda: None)
    assert main(["bench", *option]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jacflow bench: error: {option[0]} applies to the benchmark scripts")
    assert "(no benchmarks/ folder of jacflow's repository here)" in err
    assert err.count("\n") == 1
    assert main(["bench", "--list"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("no script (no benchmarks/ folder of jacflow's repository here): ")
    assert "the built-in subset times one multi-task step" in printed
