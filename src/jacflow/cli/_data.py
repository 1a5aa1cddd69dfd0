"""The bundled digits data set (1797 images of 8x8 pixels, see ``data/README.md``)."""

from __future__ import annotations

import gzip
from importlib import resources

import torch
from torch import Tensor


def load_digits(dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Images ``[1797, 64]`` scaled to ``[0, 1]`` and labels ``[1797]`` (``0`` to ``9``).

    Example:
        >>> from jacflow.cli._data import load_digits
        >>> images, labels = load_digits()
        >>> images.shape, labels.shape, float(images.max()), labels[:5].tolist()
        (torch.Size([1797, 64]), torch.Size([1797]), 1.0, [0, 1, 2, 3, 4])
    """
    raw = (resources.files("jacflow.cli") / "data" / "digits.csv.gz").read_bytes()
    rows = [line.split(",") for line in gzip.decompress(raw).decode().splitlines() if line]
    table = torch.tensor([[float(value) for value in row] for row in rows], dtype=torch.float64)
    return (table[:, :64] / 16.0).to(dtype), table[:, 64].long()


def split(
    n: int, test_fraction: float, seed: int, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """A seeded random split of ``range(n)`` into train and test indices.

    Example:
        >>> from jacflow.cli._data import split
        >>> train, test = split(10, 0.2, seed=0)
        >>> len(train), len(test), sorted(train.tolist() + test.tolist()) == list(range(10))
        (8, 2, True)
    """
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = round(n * test_fraction)
    return order[n_test:].to(device), order[:n_test].to(device)
