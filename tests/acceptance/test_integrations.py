"""docs/integrations.md's route inside PyTorch Lightning and the Hugging Face Trainer: the Gramian
from the engine, the weights, and the framework's own backward of ``losses @ weights``. Its
updates must be those of ``engine.backward`` in a plain loop on the same batches."""

from __future__ import annotations

import copy
import logging
import tempfile
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from jacflow.aggregation import UPGradWeighting
from jacflow.autogram import Engine

L = pytest.importorskip("lightning", reason='pip install "jacflow[integrations]"')
transformers = pytest.importorskip("transformers", reason='pip install "jacflow[integrations]"')

LR = 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


class _HFStyle(nn.Module):
    """A model whose ``forward`` takes ``**kwargs``, as Hugging Face models' do (the Trainer
    then leaves the loss of accumulated steps to it, unless told otherwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def _plain_loop(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The reference: ``engine.backward`` (book-keeping, no second backward) and SGD."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with Engine(model, batch_dim=0) as engine:
        for x, y in batches:
            optimizer.zero_grad()
            engine.backward(F.cross_entropy(model(x), y, reduction="none"), UPGradWeighting())
            optimizer.step()


def _assert_same_parameters(model: nn.Module, reference: nn.Module) -> None:
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def _quiet_frameworks() -> Any:
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "transformers")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    yield
    for logger, level in zip(loggers, levels, strict=True):
        logger.setLevel(level)


class _PerSampleJD(L.LightningModule):  # type: ignore[misc,name-defined]
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.engine = Engine(self.model, batch_dim=0)
        self.automatic_optimization = False
        self.dtypes: list[tuple[torch.dtype, torch.dtype]] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        losses = F.cross_entropy(self.model(x), y, reduction="none")
        gramian = self.engine.compute_gramian(losses)
        weights = UPGradWeighting()(gramian)
        self.dtypes.append((gramian.dtype, weights.dtype))
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(losses @ weights)
        optimizer.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _lightning_fit(module: nn.Module, loader: DataLoader[Any], **trainer_args: Any) -> Any:
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_args,
    )
    trainer.fit(module, loader)
    return trainer


def test_lightning_manual_backward_gives_the_engines_updates() -> None:
    x, y = _data(48)
    model, reference = _model(), _model()
    trainer = _lightning_fit(_PerSampleJD(model), DataLoader(TensorDataset(x, y), batch_size=16))
    assert trainer.global_step == 6
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 48, 16)] * 2
    _plain_loop(reference, batches)
    _assert_same_parameters(model, reference)


def test_lightning_bf16_mixed_gives_a_float32_gramian_and_weights() -> None:
    x, y = _data(32)
    module = _PerSampleJD(_model())
    _lightning_fit(module, DataLoader(TensorDataset(x, y), batch_size=16), precision="bf16-mixed")
    assert module.dtypes == [(torch.float32, torch.float32)] * 4
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


class _PerSampleJDTrainer(transformers.Trainer):  # type: ignore[misc,name-defined]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine = Engine(self.model, batch_dim=0)
        self.model_accepts_loss_kwargs = False

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        logits = model(inputs["x"])
        losses = F.cross_entropy(logits, inputs["labels"], reduction="none")
        if model.training and torch.is_grad_enabled():
            loss = losses @ UPGradWeighting()(self.engine.compute_gramian(losses))
        else:
            loss = losses.mean()
        return (loss, logits) if return_outputs else loss


def _hf_train(model: nn.Module, n: int, batch_size: int, accumulation: int) -> None:
    x, y = _data(n)
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        num_train_epochs=2,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,  # (no clipping: the plain loop has none)
        train_sampling_strategy="sequential",
        remove_unused_columns=False,
        label_names=["labels"],
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    dataset = [{"x": x[i], "labels": y[i]} for i in range(n)]
    trainer = _PerSampleJDTrainer(model=model, args=args, train_dataset=dataset)
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.train()


def test_hf_trainer_compute_loss_gives_the_engines_updates() -> None:
    model, reference = _model(), _model()
    _hf_train(model, n=32, batch_size=16, accumulation=1)
    x, y = _data(32)
    _plain_loop(reference, [(x[:16], y[:16]), (x[16:], y[16:])] * 2)
    _assert_same_parameters(model, reference)


def test_hf_trainer_accumulation_averages_the_micro_batches_updates() -> None:
    """Two micro-batches of 8 per step: the step's update is the mean of their updates, each
    weighted by its own Gramian."""
    model, reference = _HFStyle(), copy.deepcopy(_model())
    _hf_train(model, n=32, batch_size=8, accumulation=2)
    x, y = _data(32)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    with Engine(reference, batch_dim=0) as engine:
        for _ in range(2):
            for start in (0, 16):
                optimizer.zero_grad()
                for micro in (slice(start, start + 8), slice(start + 8, start + 16)):
                    losses = F.cross_entropy(reference(x[micro]), y[micro], reduction="none")
                    engine.backward(losses / 2, UPGradWeighting())
                optimizer.step()
    _assert_same_parameters(model, reference)
