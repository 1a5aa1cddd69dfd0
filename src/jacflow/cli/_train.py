"""The training runs of the command line: multi-task (default) and instance-wise (IWRM)."""

from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from jacflow import autojac
from jacflow.aggregation import Aggregator, LossAware
from jacflow.cli._data import load_digits, split
from jacflow.cli._model import TASKS, DigitsMTL, mlp_classifier
from jacflow.cli._progress import Progress
from jacflow.cli._registry import make_aggregator
from jacflow.monitor import AggregatorWatch, Logger, Monitor


@dataclass(frozen=True)
class RunConfig:
    """What to train; the command-line options of ``jacflow train``."""

    aggregator: str = "upgrad"
    epochs: int = 30
    seed: int = 0
    device: str = "cpu"
    lr: float = 3e-3
    batch_size: int = 64
    test_fraction: float = 0.2
    noise: float = 0.1


@dataclass
class RunResult:
    """What a run produced: per-step rows, per-epoch evaluations and the final summary."""

    config: RunConfig
    steps: list[dict[str, float]] = field(default_factory=list)
    epochs: list[dict[str, float]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    names: tuple[str, ...] = TASKS


def _task_losses(
    model: DigitsMTL, images: Tensor, labels: Tensor, noise: Tensor
) -> tuple[Tensor, list[Tensor]]:
    features = model.trunk(images + noise)
    digit, parity, recon = model.heads_forward(features)
    losses = [
        F.cross_entropy(digit, labels),
        F.binary_cross_entropy_with_logits(parity, (labels % 2).to(parity.dtype)),
        F.mse_loss(recon, images),
    ]
    return features, losses


@torch.no_grad()
def _evaluate_mtl(model: DigitsMTL, images: Tensor, labels: Tensor) -> dict[str, float]:
    digit, parity, recon = model(images)
    return {
        "test_loss/digit": float(F.cross_entropy(digit, labels)),
        "test_loss/parity": float(
            F.binary_cross_entropy_with_logits(parity, (labels % 2).to(parity.dtype))
        ),
        "test_loss/recon": float(F.mse_loss(recon, images)),
        "digit_acc": float((digit.argmax(-1) == labels).float().mean()),
        "parity_acc": float(((parity > 0).long() == labels % 2).float().mean()),
        "recon_mse": float(F.mse_loss(recon, images)),
    }


def _mean(rows: list[dict[str, float]], key: str) -> float:
    """:func:`_recorded_mean`, NaN where no row records ``key`` (the epochs' float columns)."""
    mean = _recorded_mean(rows, key)
    return float("nan") if mean is None else mean


def _recorded_mean(rows: list[dict[str, float]], key: str) -> float | None:
    """The mean of ``key`` over ``rows``; ``None`` when no row records it (not applicable: e.g.
    the weights of an aggregator that exposes none), kept apart from the NaN of a diverged run.

    Example:
        >>> from jacflow.cli._train import _recorded_mean
        >>> _recorded_mean([{"a": 1.0}, {"a": 3.0}], "a"), _recorded_mean([{"a": 1.0}], "b")
        (2.0, None)
        >>> _recorded_mean([{"a": 1.0}, {"a": float("nan")}], "a")
        nan
    """
    values = [row[key] for row in rows if key in row]
    return sum(values) / len(values) if values else None


def _summary(result: RunResult, mode: str, seconds: float) -> dict[str, Any]:
    return {
        "mode": mode,
        "aggregator": result.config.aggregator,
        "seconds": seconds,
        "steps": len(result.steps),
        **{key: value for key, value in result.epochs[-1].items() if key != "epoch"},
        "mean_conflict_fraction": _recorded_mean(result.steps, "conflict_fraction"),
        "mean_min_update_cos": _recorded_mean(result.steps, "min_update_cos"),
    }


def train_mtl(
    config: RunConfig,
    *,
    loggers: list[Logger] | None = None,
    progress: bool = True,
    label: str | None = None,
) -> RunResult:
    """Train the 3-task network of :class:`~jacflow.cli._model.DigitsMTL` with Jacobian descent.

    Each step calls ``jacflow.autojac.mtl_backward(losses, features, A=aggregator)``: the heads
    get their own gradients and the trunk gets the aggregation of its ``[3, n]`` Jacobian. The
    Gramian and weights of every step are monitored with :class:`jacflow.monitor.Monitor`.
    """
    torch.manual_seed(config.seed)
    device = torch.device(config.device)
    images, labels = load_digits()
    images, labels = images.to(device), labels.to(device)
    train_idx, test_idx = split(len(labels), config.test_fraction, config.seed, device)
    model = DigitsMTL().to(device)
    aggregator = make_aggregator(config.aggregator, len(TASKS))
    aggregator.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    heads = [list(model.digit.parameters()), list(model.parity.parameters())]
    heads.append(list(model.recon.parameters()))
    shared = list(model.trunk.parameters())
    generator = torch.Generator(device=device).manual_seed(config.seed + 1)
    watch = AggregatorWatch(aggregator)
    monitor = Monitor(loggers or [], names=TASKS)
    result = RunResult(config)
    result.epochs.append({"epoch": 0.0, **_evaluate_mtl(model, images[test_idx], labels[test_idx])})
    steps_per_epoch = -(-len(train_idx) // config.batch_size)
    start = time.perf_counter()
    step = 0
    with Progress(
        config.epochs * steps_per_epoch, label or config.aggregator, enabled=progress
    ) as bar:
        for epoch in range(1, config.epochs + 1):
            order = train_idx[torch.randperm(len(train_idx), generator=generator, device=device)]
            for batch in order.split(config.batch_size):
                x, y = images[batch], labels[batch]
                noise = config.noise * torch.randn(x.shape, generator=generator, device=device)
                features, losses = _task_losses(model, x, y, noise)
                if isinstance(aggregator, LossAware):
                    aggregator.set_losses(_positive(torch.stack(losses)))
                optimizer.zero_grad(set_to_none=True)
                autojac.mtl_backward(
                    losses, features, A=aggregator, tasks_params=heads, shared_params=shared
                )
                optimizer.step()
                values = [float(loss.detach()) for loss in losses]
                row = {"step": float(step), "epoch": float(epoch)}
                row |= {f"loss/{name}": v for name, v in zip(TASKS, values)}
                gramian, weights = watch.pop()
                if gramian is not None:
                    metrics = monitor.record(gramian, weights, step, losses=values)
                    row |= metrics or {}
                result.steps.append(row)
                bar.update(dict(zip(TASKS, values)))
                step += 1
            evaluation = _evaluate_mtl(model, images[test_idx], labels[test_idx])
            epoch_rows = [r for r in result.steps if r["epoch"] == epoch]
            train_losses = {f"train_loss/{n}": _mean(epoch_rows, f"loss/{n}") for n in TASKS}
            result.epochs.append({"epoch": float(epoch), **train_losses, **evaluation})
            bar.epoch_done(epoch, {k: v for k, v in evaluation.items() if "/" not in k})
    watch.remove()
    monitor.close()
    result.summary = _summary(result, "mtl", time.perf_counter() - start)
    result.summary |= {
        f"mean_weight/{n}": _recorded_mean(result.steps, f"weight/{n}") for n in TASKS
    }
    return result


IWRM_SAMPLES = 1024
IWRM_BATCH = 32


def train_iwrm(
    config: RunConfig,
    *,
    loggers: list[Logger] | None = None,
    progress: bool = True,
    label: str | None = None,
) -> RunResult:
    """Instance-wise risk minimization: every sample of a batch is its own objective.

    Trains :func:`~jacflow.cli._model.mlp_classifier` on 1024 digits with batches of 32 and
    plain SGD; each step calls ``jacflow.autojac.backward(losses, A=aggregator)`` on the ``[32]``
    per-sample cross-entropy losses. With ``mean`` this is ordinary SGD on the average loss.
    ``loggers`` get every step's conflict metrics (those of :class:`jacflow.monitor.Monitor`
    without the per-sample and pairwise ones) and the batch's mean loss as ``loss``.

    The aggregator is built for ``m = config.batch_size`` objectives, so every batch has that
    many samples: when the batch size does not divide 1024, the incomplete last batch of each
    epoch is dropped (its samples change with the shuffle).

    Raises:
        ValueError: when ``config.batch_size`` exceeds the 1024 training samples.
    """
    if config.batch_size > IWRM_SAMPLES:
        raise ValueError(
            f"`batch_size` must be at most {IWRM_SAMPLES} (the number of training samples) in "
            f"iwrm mode, received {config.batch_size}. Use a smaller batch size."
        )
    torch.manual_seed(config.seed)
    device = torch.device(config.device)
    images, labels = load_digits()
    images, labels = images.to(device), labels.to(device)
    train_all, test_idx = split(len(labels), config.test_fraction, config.seed, device)
    train_idx = train_all[:IWRM_SAMPLES]
    model = mlp_classifier().to(device)
    params = list(model.parameters())
    aggregator: Aggregator = make_aggregator(config.aggregator, config.batch_size)
    aggregator.to(device)
    optimizer = torch.optim.SGD(params, lr=config.lr)
    generator = torch.Generator(device=device).manual_seed(config.seed + 1)
    watch = AggregatorWatch(aggregator)
    monitor = Monitor(loggers or [], per_objective=False, pairwise=False)
    result = RunResult(config, names=("loss",))

    @torch.no_grad()
    def evaluate() -> dict[str, float]:
        out: dict[str, float] = {}
        for name, idx in (("train", train_idx), ("test", test_idx)):
            logits = model(images[idx])
            out[f"{name}_loss"] = float(F.cross_entropy(logits, labels[idx]))
            out[f"{name}_acc"] = float((logits.argmax(-1) == labels[idx]).float().mean())
        return out

    result.epochs.append({"epoch": 0.0, **evaluate()})
    steps_per_epoch = len(train_idx) // config.batch_size
    start = time.perf_counter()
    step = 0
    with Progress(
        config.epochs * steps_per_epoch, label or config.aggregator, enabled=progress
    ) as bar:
        for epoch in range(1, config.epochs + 1):
            order = train_idx[torch.randperm(len(train_idx), generator=generator, device=device)]
            # drop the incomplete last batch: the aggregator is built for batch_size objectives
            order = order[: steps_per_epoch * config.batch_size]
            for batch in order.split(config.batch_size):
                losses = F.cross_entropy(model(images[batch]), labels[batch], reduction="none")
                if isinstance(aggregator, LossAware):
                    aggregator.set_losses(_positive(losses))
                optimizer.zero_grad(set_to_none=True)
                autojac.backward(losses, inputs=params, A=aggregator)
                optimizer.step()
                row = {
                    "step": float(step),
                    "epoch": float(epoch),
                    "loss": float(losses.detach().mean()),
                }
                gramian, weights = watch.pop()
                if gramian is not None:
                    row |= monitor.record(gramian, weights, step) or {}
                for logger in monitor.loggers:
                    logger.log({"loss": row["loss"]}, step)
                result.steps.append(row)
                bar.update({"loss": row["loss"]})
                step += 1
            evaluation = evaluate()
            result.epochs.append({"epoch": float(epoch), **evaluation})
            bar.epoch_done(epoch, evaluation)
    watch.remove()
    monitor.close()
    result.summary = _summary(result, "iwrm", time.perf_counter() - start)
    return result


RUN_FILES = (
    "metrics_steps.csv",
    "metrics_epochs.csv",
    "metrics.json",
    "losses.png",
    "test_losses.png",
    "cosine_over_training.png",
    "weights.png",
    "norms.png",
    "comparison.csv",
    "comparison.md",
    "comparison.json",
    "comparison.png",
)
"""The files a ``jacflow train`` or ``compare`` run may write in its folder."""


def check_run_name(name: str, source: Path) -> str:
    """Return ``name``, a run's folder name read from ``source``, if it is one plain folder
    name: not empty, ``.`` or ``..``, and without a path separator (``--overwrite`` deletes
    files in it: ``..`` deleted the earlier run's files of the parent folder).

    Raises:
        CLIError: naming the file and the run, for any other name.

    Example:
        >>> from pathlib import Path
        >>> from jacflow.cli._train import check_run_name
        >>> check_run_name("upgrad", Path("comparison.json"))
        'upgrad'
        >>> check_run_name("..", Path("comparison.json"))
        Traceback (most recent call last):
        ...
        jacflow.cli._errors.CLIError: comparison.json names the run '..', which is not a ...
    """
    from jacflow.cli._errors import CLIError

    separators = {"/", "\\", os.sep, *([os.altsep] if os.altsep else [])}
    if name in ("", ".", "..") or any(s in name for s in separators) or "\0" in name:
        raise CLIError(
            f"{source} names the run {name!r}, which is not a folder name (a run is named by "
            "its aggregator, e.g. 'upgrad'); --overwrite deletes nothing outside --out. Correct "
            "or delete that file, then run the command again."
        )
    return name


def _compared_folders(path: Path) -> list[Path]:
    """The per-aggregator sub-folders of ``path`` that an earlier comparison there wrote: those
    its ``comparison.json`` names (no other sub-folder, whatever it holds).

    Raises:
        CLIError: when ``comparison.json`` is not the file a comparison writes (an object whose
            ``"runs"`` is a list of objects, each naming its ``"aggregator"``), or names a run
            that is not a plain folder name.
    """
    source = path / "comparison.json"
    try:
        content = source.read_bytes()
    except OSError:  # (missing; a folder there is refused with the other run files)
        return []
    names = [check_run_name(name, source) for name in _run_names(content, source)]
    return [path / name for name in sorted(set(names)) if (path / name).is_dir()]


def _run_names(content: bytes | str, source: Path) -> list[str]:
    """The ``"aggregator"`` of every run that ``content``, that of ``source`` (a
    ``comparison.json``), names.

    Raises:
        CLIError: naming ``source`` and what is wrong, when ``content`` is not a comparison's JSON
            (``--overwrite`` would not know which sub-folders to clear: it deletes nothing).

    Example:
        >>> from pathlib import Path
        >>> from jacflow.cli._train import _run_names
        >>> _run_names('{"runs": [{"aggregator": "mean"}]}', Path("comparison.json"))
        ['mean']
        >>> _run_names('{"runs": 5}', Path("comparison.json"))
        Traceback (most recent call last):
        ...
        jacflow.cli._errors.CLIError: comparison.json is not a comparison that jacflow wrote ...
    """
    from jacflow.cli._errors import CLIError

    def shown(value: object) -> str:  # (short: the message stays one line)
        text = json.dumps(value)
        return text if len(text) <= 40 else text[:37] + "..."

    def refuse(problem: str) -> CLIError:
        return CLIError(
            f"{source} is not a comparison that jacflow wrote ({problem}; expected "
            '{"runs": [{"aggregator": NAME}, ...]}); --overwrite deleted nothing. '
            "Correct or delete that file, then run the command again."
        )

    try:
        comparison = json.loads(content)
    except ValueError:  # (UnicodeDecodeError is one too)
        raise refuse("not valid JSON") from None
    if not isinstance(comparison, dict) or "runs" not in comparison:
        raise refuse('no "runs" entry')
    runs = comparison["runs"]
    if not isinstance(runs, list):
        raise refuse(f'"runs" is {shown(runs)}, not a list')
    names: list[str] = []
    for index, run in enumerate(runs):
        name = run.get("aggregator") if isinstance(run, dict) else None
        if not isinstance(name, str):
            raise refuse(f"run {index} is {shown(run)}, not an object with an aggregator name")
        names.append(name)
    return names


def _positive(losses: Tensor) -> Tensor:
    """The loss values given to a loss-aware method, at least the dtype's smallest positive
    normal: a confident sample's cross-entropy rounds to 0 (or -0.0), which the methods that
    take logs or ratios of the losses (EPO, DB-MTL) refuse.

    Example:
        >>> import torch
        >>> from jacflow.cli._train import _positive
        >>> _positive(torch.tensor([-0.0, 0.5])).tolist()
        [1.1754943508222875e-38, 0.5]
    """
    detached = losses.detach()
    return detached.clamp_min(torch.finfo(detached.dtype).tiny)


def clear_run_files(path: Path) -> None:
    """Delete the files of an earlier run in ``path``: the :data:`RUN_FILES`, the TensorBoard
    event files, and the same in the per-aggregator sub-folders that an earlier comparison's
    ``comparison.json`` names (removed when that leaves them empty). Other files and folders
    are kept.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from jacflow.cli._train import clear_run_files
        >>> out = Path(tempfile.mkdtemp())
        >>> for name in ("metrics.json", "norms.png", "notes.txt"):
        ...     _ = (out / name).write_text("x")
        >>> clear_run_files(out)
        >>> sorted(p.name for p in out.iterdir())
        ['notes.txt']
    """
    compared = _compared_folders(path)
    for folder in [*compared, path]:  # (a run file that is a folder: refused before deleting)
        for name in RUN_FILES:
            if (folder / name).is_dir():
                raise IsADirectoryError(errno.EISDIR, "Is a directory", str(folder / name))
    for folder in [*compared, path]:
        for name in RUN_FILES:
            (folder / name).unlink(missing_ok=True)
        board = folder / "tensorboard"
        if board.is_dir():
            for event in board.glob("events.out.tfevents.*"):
                event.unlink()
            if not any(board.iterdir()):
                board.rmdir()
        if folder != path and not any(folder.iterdir()):
            folder.rmdir()


def check_out_dir(path: Path) -> Path:
    """Create ``path`` and check that files can be written in it.

    Raises:
        CLIError: with the reason, when the folder cannot be created or written.
    """
    from jacflow.cli._errors import CLIError

    probe = path / ".jacflow-write-test"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise CLIError(
            f"cannot write the run folder --out {str(path)!r}: {error.strerror or error}. "
            "Choose a writable folder."
        ) from error
    return path
