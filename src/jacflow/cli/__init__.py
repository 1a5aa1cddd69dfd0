"""The ``jacflow`` command: train with Jacobian descent on bundled data, compare, benchmark.

Sub-commands:

* ``jacflow train``: the main job. A 3-task network (digit class, parity, reconstruction) on the
  bundled digits data, trained with ``mtl_backward`` and an aggregator (``upgrad`` by default),
  or, with ``--mode iwrm``, instance-wise risk minimization comparing ``mean`` with ``upgrad``.
  Writes a run folder with metrics (CSV, JSON) and plots (PNG, when matplotlib is installed).
* ``jacflow compare --aggregators mean,upgrad,...``: trains each with the same seed and writes a
  comparison table (CSV, markdown) and plot.
* ``jacflow bench``: runs the benchmark scripts of ``benchmarks/`` (or a built-in subset).

User errors (unknown aggregator, unwritable folder, bad numbers, missing extra) print one message
and return exit code 2.

Example:
    >>> from jacflow.cli import main
    >>> main(["train", "--epochs", "-1"])
    2
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from jacflow.cli._errors import CLIError
from jacflow.monitor import Logger

__all__ = ["main"]


def _int_at_least(minimum: int, what: str, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, received {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {what}, received {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
BENCH_TIMEOUT = 600.0
"""The seconds each benchmark script may run without ``--timeout``."""
MAX_SEED = 2**63 - 1
"""The largest ``--seed`` (torch generators take 64-bit seeds; runs also seed ``seed + 1``)."""
MAX_THREADS = 1024
"""The largest ``--threads`` (``torch.set_num_threads`` takes a C int)."""
_seed = _int_at_least(0, f"a non-negative integer at most {MAX_SEED}", MAX_SEED)
_threads = _int_at_least(1, f"a positive integer at most {MAX_THREADS}", MAX_THREADS)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, received {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, received {text}")
    return value


def _out_path(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a folder name, received an empty string")
    return Path(text)


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=_positive_int, help="epochs (train: 30, iwrm: 10)")
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="also log to TensorBoard (in the run folder, or each aggregator's)",
    )
    parser.add_argument("--seed", type=_seed, default=0, help="random seed")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument(
        "--lr", type=_positive_float, help="learning rate (Adam 3e-3; iwrm SGD 0.1)"
    )
    parser.add_argument("--batch-size", type=_positive_int, help="batch size (64; iwrm: 32)")
    parser.add_argument(
        "--out",
        type=_out_path,
        help="run folder (default: runs/train-<aggregator>-<time>, runs/compare-<names>-<time>)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="reuse a non-empty --out: delete the files of the earlier run first",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--no-plots", action="store_true", help="do not draw PNG plots")
    parser.add_argument("--threads", type=_threads, default=1, help="torch threads (1)")


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``jacflow`` parser, and the parser of each command by name."""
    parser = argparse.ArgumentParser(
        prog="jacflow", description="Jacobian descent on bundled offline data."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser("train", help="train a network with Jacobian descent")
    train.add_argument("--aggregator", default="upgrad", help="aggregator name (default upgrad)")
    train.add_argument(
        "--mode",
        choices=["mtl", "iwrm"],
        default="mtl",
        help="mtl: 3 tasks on a shared trunk; iwrm: one objective per sample, mean vs upgrad",
    )
    _add_run_options(train)
    compare = commands.add_parser("compare", help="train several aggregators with one seed")
    compare.add_argument(
        "--aggregators",
        default="mean,upgrad,mgda",
        help="comma-separated aggregator names (default: %(default)s)",
    )
    compare.add_argument("--mode", choices=["mtl", "iwrm"], default="mtl")
    _add_run_options(compare)
    bench = commands.add_parser("bench", help="run the benchmark suite and print ratio tables")
    bench.add_argument("--builtin", action="store_true", help="run the quick built-in subset")
    bench.add_argument("--filter", help="only scripts whose name contains this text")
    bench.add_argument(
        "--list",
        action="store_true",
        help="list what would run (the scripts, or the built-in subset) and exit",
    )
    bench.add_argument(  # (default None: an explicit --timeout with --builtin is refused)
        "--timeout", type=_positive_float, help=f"seconds per script ({BENCH_TIMEOUT:.0f})"
    )
    aggregators = commands.add_parser("aggregators", help="list the aggregator names")
    by_name = {"train": train, "compare": compare, "bench": bench, "aggregators": aggregators}
    return parser, by_name


def _check_bench_usage(args: argparse.Namespace, bench: argparse.ArgumentParser) -> None:
    """Refuse, as a usage error of ``bench``, the options that ``--builtin`` would ignore: they
    select and time the benchmark scripts, and the built-in subset runs none."""
    if args.command != "bench" or not args.builtin:
        return
    for option, value in (("--filter", args.filter), ("--timeout", args.timeout)):
        if value is not None:
            bench.error(
                f"argument {option}: not allowed with argument --builtin (it applies to the "
                "benchmark scripts, and --builtin runs none)"
            )


def _check_device(name: str) -> str:
    """``name`` when it is a device the runs can use here: ``cpu``, ``cuda[:N]`` (when CUDA is
    available and ``N`` is a visible GPU) or ``mps`` (when available); a :class:`CLIError`
    otherwise (e.g. ``meta``, ``xpu``, ``lazy``: parsed by torch but not usable for a run)."""
    try:
        with warnings.catch_warnings():  # e.g. "'mkldnn' is no longer used as device type"
            warnings.simplefilter("ignore")
            device = torch.device(name)
    except (RuntimeError, ValueError) as error:
        raise CLIError(f"invalid --device {name!r}: {error}") from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CLIError(
                f"--device {name!r} requested but CUDA is not available; use --device cpu."
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise CLIError(
                f"--device {name!r} requested but only {count} CUDA device(s) are visible; "
                f"use --device cuda:0 to cuda:{count - 1}."
            )
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise CLIError(
                f"--device {name!r} requested but MPS is not available; use --device cpu."
            )
    elif device.type != "cpu":
        raise CLIError(
            f"unsupported --device {name!r}: expected cpu, cuda[:N] or mps, received device "
            f"type {device.type!r}."
        )
    return name


def _run_config(args: argparse.Namespace, aggregator: str) -> object:
    from jacflow.cli._train import IWRM_BATCH, IWRM_SAMPLES, RunConfig

    iwrm = args.mode == "iwrm"
    if iwrm and args.batch_size is not None and args.batch_size > IWRM_SAMPLES:
        raise CLIError(
            f"--batch-size must be at most {IWRM_SAMPLES} (the number of training samples) in "
            f"iwrm mode, received {args.batch_size}."
        )
    return RunConfig(
        aggregator=aggregator,
        epochs=args.epochs or (10 if iwrm else 30),
        seed=args.seed,
        device=_check_device(args.device),
        lr=args.lr or (0.1 if iwrm else 3e-3),
        batch_size=args.batch_size or (IWRM_BATCH if iwrm else 64),
    )


def _fresh_folder(name: str) -> Path:
    """``runs/<name>-<time>``, created here (``-2``, ``-3``, ... appended when a run that
    started in the same second holds it): a default folder is never shared."""
    from jacflow.cli._train import check_out_dir

    base = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_out_dir(base.parent)
    for attempt in range(1, 1000):
        folder = base if attempt == 1 else base.with_name(f"{base.name}-{attempt}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return folder
    raise CLIError(f"could not create a fresh run folder next to {str(base)!r}; pass --out.")


def _out_dir(args: argparse.Namespace, name: str) -> Path:
    from jacflow.cli._train import check_out_dir, clear_run_files

    if args.out is None:
        return check_out_dir(_fresh_folder(name))
    out = args.out
    if out.is_dir() and any(out.iterdir()):
        if not args.overwrite:
            raise CLIError(
                f"--out {str(out)!r} already holds files (an earlier run?); choose a new folder "
                "or pass --overwrite to delete the earlier run's files first."
            )
        try:
            clear_run_files(out)
        except OSError as error:
            where = f" ({error.filename})" if error.filename else ""
            raise CLIError(
                f"--overwrite could not delete the earlier run's files in --out {str(out)!r}: "
                f"{error.strerror or error}{where}. Nothing was deleted if the first file could "
                "not be; choose a writable folder."
            ) from error
    return check_out_dir(out)


def _check_tensorboard(args: argparse.Namespace) -> None:
    """With ``--tensorboard``, refuse a missing TensorBoard before the run folder is created or
    cleared: a refusal changes nothing."""
    if not args.tensorboard:
        return
    from jacflow.monitor._optional import require

    try:
        require("tensorboard", "tensorboard", "--tensorboard")
        require("torch.utils.tensorboard", "tensorboard", "--tensorboard")
    except ImportError as error:
        raise CLIError(str(error)) from error


def _cmd_train(args: argparse.Namespace) -> int:
    from jacflow.cli._registry import aggregator_key, make_aggregator

    if args.mode == "iwrm":  # (a comparison, which checks the other options itself)
        # (one known name, checked here: compare's list would split "a,b", drop "", and name its
        # own --aggregators in its errors; built for m = --batch-size once that is checked)
        chosen = aggregator_key(args.aggregator)
        # (mean runs anyway: then beside upgrad, the default)
        args.aggregators = ",".join(["mean", "upgrad" if chosen == "mean" else chosen])
        return _cmd_compare(args, title="iwrm")
    make_aggregator(args.aggregator, 3)  # fail early on a bad name
    loggers: list[Logger] = []
    config = _run_config(args, args.aggregator)
    _check_tensorboard(args)
    out = _out_dir(args, f"train-{args.aggregator}")
    if args.tensorboard:
        from jacflow.monitor import TensorBoardLogger

        loggers.append(TensorBoardLogger(out / "tensorboard"))
    from jacflow.cli._report import (
        PLOT_NOTICE,
        divergence_note,
        format_summary,
        matplotlib_available,
        plot_run,
        write_run,
    )
    from jacflow.cli._train import RunConfig, train_mtl

    assert isinstance(config, RunConfig)
    result = train_mtl(config, loggers=loggers, progress=not args.quiet)  # (closes them)
    files = write_run(result, out)
    if args.no_plots:
        pass
    elif matplotlib_available():
        files += plot_run(result, out)
    else:
        print(PLOT_NOTICE)
    print(f"\nRun folder: {out}")
    print(format_summary(result.summary))
    note = divergence_note(result)
    if note:
        print(note)
    print(f"Files: {', '.join(p.name for p in files)}")
    return 0


def _cmd_compare(args: argparse.Namespace, title: str = "compare") -> int:
    from jacflow.cli._compare import compare

    names = [name.strip() for name in args.aggregators.split(",") if name.strip()]
    if not names:
        raise CLIError("--aggregators is empty; give comma-separated names, e.g. mean,upgrad.")
    lowered = [name.lower() for name in names]  # (the names are case-insensitive)
    repeated = sorted({name for name in lowered if lowered.count(name) > 1})
    if repeated:  # (their runs would share a folder: files overwritten, logs mixed)
        raise CLIError(
            f"--aggregators names {', '.join(repeated)} more than once; give each name once."
        )
    from jacflow.cli._registry import make_aggregator

    # (the run settings first: an aggregator for m = --batch-size is built only once it is
    # valid)
    configs = [_run_config(args, name) for name in names]
    m = 3 if args.mode == "mtl" else (args.batch_size or 32)
    for name in names:
        make_aggregator(name, m)  # fail early on a bad name
    _check_tensorboard(args)
    if args.out is not None:  # (before --overwrite deletes anything)
        for name in names:  # (each run's folder is named as its --aggregators entry)
            folder = args.out / name
            if folder.exists() and not folder.is_dir():
                raise CLIError(
                    f"the run folder {str(folder)!r} of {name} in --out is a file; move it away "
                    "or choose another --out."
                )
    out = _out_dir(args, f"{title}-{'-'.join(names)}")
    return compare(
        configs,
        args.mode,
        out,
        progress=not args.quiet,
        plots=not args.no_plots,
        tensorboard=args.tensorboard,
    )


def _cmd_bench(args: argparse.Namespace) -> int:
    from jacflow.cli._bench import (
        BUILTIN_SUBSET,
        benchmark_scripts,
        builtin_bench,
        find_benchmarks,
        run_scripts,
    )

    folder = None if args.builtin else find_benchmarks()
    scripts = benchmark_scripts(folder, args.filter) if folder is not None else []
    if folder is not None and args.filter and not scripts:
        raise CLIError(f"no benchmark script in {folder} matches --filter {args.filter!r}.")
    if scripts:
        if args.list:  # (what the same command without --list runs)
            for script in scripts:
                print(script)
            return 0
        print(f"Running {len(scripts)} benchmark script(s) from {folder}")
        return (
            1
            if run_scripts(scripts, BENCH_TIMEOUT if args.timeout is None else args.timeout)
            else 0
        )
    # the built-in subset (with --builtin, main has refused --filter and --timeout)
    if args.builtin:
        reason = "--builtin"
    elif folder is None:  # (an installed package: the scripts are in jacflow's repository)
        reason = "no benchmarks/ folder of jacflow's repository here"
    else:
        reason = f"no script in {folder}"
    given = (("--filter", args.filter), ("--timeout", args.timeout))
    ignored = [option for option, value in given if value is not None]
    if ignored:
        several = len(ignored) > 1
        raise CLIError(
            f"{' and '.join(ignored)} {'apply' if several else 'applies'} to the benchmark "
            f"scripts, and there are none to run ({reason}); without {'them' if several else 'it'}"
            ", `jacflow bench` times the built-in subset."
        )
    if args.list:
        print(f"no script ({reason}): the built-in subset times {BUILTIN_SUBSET}")
        return 0
    print(f"Built-in benchmark subset ({reason}): {BUILTIN_SUBSET}\n")
    print(builtin_bench())
    return 0


def _cmd_aggregators() -> int:
    from jacflow.cli._registry import aggregator_classes

    for name, cls in sorted(aggregator_classes().items()):
        print(f"{name:16s} {cls.__module__.rsplit('.', 1)[0]}.{cls.__name__}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``jacflow`` command with ``argv`` (default ``sys.argv[1:]``); return the exit
    code: 0 on success, 2 on a user error (its message goes to stderr).

    Example:
        >>> from jacflow.cli import main
        >>> main(["compare", "--aggregators", "no-such-method"])
        2
    """
    parser, commands = _parser()
    try:
        given = sys.argv[1:] if argv is None else list(argv)
        args, unknown = parser.parse_known_args(given)
        if unknown:  # (parse_args reports them on the top parser, whose usage lists no option)
            # (an option before the command is the top parser's, `jacflow --foo train`)
            before = given[: given.index(args.command)] if args.command in given else given
            owner = parser if set(unknown) & set(before) else commands[args.command]
            owner.error(f"unrecognized arguments: {' '.join(unknown)}")
        _check_bench_usage(args, commands["bench"])
    except SystemExit as exit_:
        return int(exit_.code or 0) if not isinstance(exit_.code, str) else 2
    torch.set_num_threads(getattr(args, "threads", 1))
    try:
        code = _run(args)
        sys.stdout.flush()  # (here: a reader that stopped early shows in the try, not at exit)
        return code
    except CLIError as error:
        print(f"jacflow {args.command}: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # (the reader of the output stopped: `jacflow aggregators | head -1`)
        if not _silenced_stdout():
            raise
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "train":
        return _cmd_train(args)
    if args.command == "compare":
        return _cmd_compare(args)
    if args.command == "bench":
        return _cmd_bench(args)
    return _cmd_aggregators()


def _silenced_stdout() -> bool:
    """Send the rest of stdout to devnull (Python flushes it again at exit, which would raise
    once more), where it is a file descriptor (not one captured in memory, as in a notebook:
    then ``False``, and the error is the caller's)."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation is both)
        return False
    os.dup2(os.open(os.devnull, os.O_WRONLY), descriptor)
    return True
