"""The networks trained by the command line."""

from __future__ import annotations

from typing import final

from torch import Tensor, nn

TASKS = ("digit", "parity", "recon")
"""The three tasks of the default run: digit class, parity of the digit, reconstruction."""


@final
class DigitsMTL(nn.Module):
    """A shared MLP trunk with one head per task of :data:`TASKS`.

    Example:
        >>> import torch
        >>> from jacflow.cli._model import DigitsMTL
        >>> model = DigitsMTL()
        >>> [o.shape for o in model.heads_forward(model.trunk(torch.zeros(2, 64)))]
        [torch.Size([2, 10]), torch.Size([2]), torch.Size([2, 64])]
    """

    def __init__(self, hidden: int = 64, features: int = 32) -> None:
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, features), nn.ReLU()
        )
        self.digit = nn.Linear(features, 10)
        self.parity = nn.Linear(features, 1)
        self.recon = nn.Linear(features, 64)

    def heads_forward(self, features: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Digit logits ``[B, 10]``, parity logit ``[B]``, reconstruction ``[B, 64]``."""
        return self.digit(features), self.parity(features).squeeze(-1), self.recon(features)

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.heads_forward(self.trunk(images))


def mlp_classifier(hidden: int = 32) -> nn.Sequential:
    """The small classifier of the instance-wise (IWRM) mode: ``64 -> hidden -> 10``.

    Example:
        >>> from jacflow.cli._model import mlp_classifier
        >>> sum(p.numel() for p in mlp_classifier().parameters())
        2410
    """
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
