"""The per-sample engine's premise, checked: each loss reads a hooked call's output only at its
own sample.

Per sample, the engine takes every sample's gradient w.r.t. a call's output from one backward
of the losses' sum: its row ``b`` is loss ``b``'s own gradient only when no other loss reads
that row. The shapes cannot tell when it is not:

* a module called on a tensor without the batch dimension whose first size equals the batch
  size (position embeddings of ``torch.arange(T)`` with ``T == B``, a Linear on a table kept as
  a buffer or a parameter), whose output is then broadcast over the batch;
* anything after the call that mixes the samples: a loss over pairs of samples (contrastive),
  a BatchNorm in training mode outside the engine's modules, ``h - h.mean(0)``.

Two probing backwards show it: one from the losses of about half the samples, one from the
other samples' losses, as the gradient w.r.t. each output must vanish, exactly, at every sample
outside those pulled back (zero rows stay zero through every operation that keeps the samples
apart). One of them alone misses a read where the data zero the gradient: a sequence-first
``[T, B, d]`` Linear with ``T == B`` whose rows are positions, one position all zero before a
ReLU, hides from the first that the probed losses read it, but not from the second that the
other losses read the probed positions.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor


def probe_samples(num_samples: int) -> list[int]:
    """The samples whose losses the probe pulls back: the first, the last (a mixing along the
    batch in either direction, as a cumulative sum) and a fixed pseudo-random half of the
    others; the first of two. A mixing shows when a probed sample's loss reads an unprobed
    sample's output: one over many pairs (a mixup, a contrastive loss, a centring) almost
    surely, but one sample reading one other only for the pairs this fixed set splits (about
    half of them, never the first and the last), and a read decided by the data (the batch's
    largest output) when it falls on an unprobed sample.

    Example:
        >>> from jacflow.autogram._separable import probe_samples
        >>> probe_samples(2), probe_samples(3), len(probe_samples(10))
        ([0], [0, 2], 6)
    """
    if num_samples == 2:
        return [0]
    middle = random.Random(num_samples).sample(range(1, num_samples - 1), (num_samples - 2) // 2)
    return sorted([0, num_samples - 1, *middle])


def probe_cotangents(losses: Tensor, samples: list[int]) -> Tensor:
    """Two rows (``[2, *losses.shape]``): ones on the losses of ``samples`` (batch on dimension
    0), zeros elsewhere; and its complement.

    Example:
        >>> import torch
        >>> from jacflow.autogram._separable import probe_cotangents
        >>> probe_cotangents(torch.zeros(3), [0, 2])
        tensor([[1., 0., 1.],
                [0., 1., 0.]])
    """
    cotangent = torch.zeros_like(losses)
    cotangent[samples] = 1.0
    return torch.stack([cotangent, 1.0 - cotangent])


def others(num_samples: int, samples: list[int]) -> list[int]:
    """The samples outside ``samples``: those of the complementary probe.

    Example:
        >>> from jacflow.autogram._separable import others
        >>> others(5, [0, 2, 4])
        [1, 3]
    """
    chosen = set(samples)
    return [b for b in range(num_samples) if b not in chosen]


def leaks(grad: Tensor, dim: int, samples: list[int]) -> bool:
    """Whether ``grad``, the probing losses' gradient w.r.t. an output whose batch is on
    ``dim``, is nonzero at a sample outside ``samples`` (not judged where it is not finite:
    the step propagates NaN as it is).

    Example:
        >>> import torch
        >>> from jacflow.autogram._separable import leaks
        >>> leaks(torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 0.0]]), 0, [0, 2])
        False
        >>> leaks(torch.tensor([[1.0, 2.0], [0.0, 1e-30], [3.0, 0.0]]), 0, [0, 2])
        True
    """
    others = torch.ones(grad.shape[dim], dtype=torch.bool, device=grad.device)
    others[samples] = False
    rest = grad.movedim(dim, 0)[others]
    nonzero, finite = bool(rest.count_nonzero()), bool(torch.isfinite(rest).all())
    return nonzero and finite
