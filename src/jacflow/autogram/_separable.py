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

Probing backwards show it, from the losses of some samples (:func:`probe_sets`): the gradient
w.r.t. each output must vanish, exactly, at every sample outside those pulled back (zero rows
stay zero through every operation that keeps the samples apart). For every pair of samples,
one probe pulls back the first's loss and not the second's, and another the reverse: a read
that the data hide from one (a zero gradient, as at an all-zero position before a ReLU) shows
in the other.
"""

from __future__ import annotations

import torch
from torch import Tensor


def probe_sets(num_samples: int) -> list[list[int]]:
    """The samples whose losses each probing backward pulls back: for each binary digit of the
    samples' indices, those with a 1 there and those with a 0. Any two samples differ in a
    digit, so for every pair ``(a, b)`` one probe pulls back ``a``'s loss and not ``b``'s: a
    loss that reads another sample's output shows, whichever (2 log2(B) backwards; two halves
    alone miss a read within a half, as a sequence-first ``[T, B, d]`` layer with ``T == B``
    pooled at a position of the same half).

    Example:
        >>> from jacflow.autogram._separable import probe_sets
        >>> probe_sets(3)
        [[1], [0, 2], [2], [0, 1]]
        >>> probe_sets(1)
        []
    """
    sets = []
    for digit in range(max(num_samples - 1, 0).bit_length()):
        ones = [b for b in range(num_samples) if b >> digit & 1]
        sets += [ones, [b for b in range(num_samples) if not b >> digit & 1]]
    return sets


def probe_cotangents(losses: Tensor, sets: list[list[int]]) -> Tensor:
    """One row per set (``[len(sets), *losses.shape]``): ones on the losses of its samples
    (batch on dimension 0), zeros elsewhere.

    Example:
        >>> import torch
        >>> from jacflow.autogram._separable import probe_cotangents
        >>> probe_cotangents(torch.zeros(3), [[0, 2], [1]])
        tensor([[1., 0., 1.],
                [0., 1., 0.]])
    """
    cotangents = torch.zeros(len(sets), *losses.shape, dtype=losses.dtype, device=losses.device)
    for row, samples in zip(cotangents, sets, strict=True):
        row[samples] = 1.0
    return cotangents


def leaks(
    grad: Tensor, dim: int, samples: list[int], row_samples: Tensor | None = None
) -> bool | None:
    """Whether ``grad``, the probing losses' gradient w.r.t. an output whose batch is on
    ``dim``, is nonzero at a finite entry of a sample outside ``samples``; ``None`` (no
    verdict) where it is zero at every finite entry there and some entry there is not finite
    (the step propagates NaN as it is; a later step probes again). ``row_samples``: for an
    output without a batch dimension (a packed sequence's data), the sample of each of its
    entries along ``dim``.

    Example:
        >>> import torch
        >>> from jacflow.autogram._separable import leaks
        >>> leaks(torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 0.0]]), 0, [0, 2])
        False
        >>> leaks(torch.tensor([[1.0, 2.0], [0.0, 1e-30], [3.0, 0.0]]), 0, [0, 2])
        True
        >>> leaks(torch.tensor([[1.0], [2.0], [0.0]]), 0, [1], torch.tensor([1, 1, 0]))
        False
        >>> leaks(torch.tensor([[1.0, 2.0], [float("nan"), 0.5], [3.0, 0.0]]), 0, [0, 2])
        True
        >>> print(leaks(torch.tensor([[1.0, 2.0], [float("nan"), 0.0], [3.0, 0.0]]), 0, [0, 2]))
        None
    """
    if row_samples is None:
        others = torch.ones(grad.shape[dim], dtype=torch.bool, device=grad.device)
        others[samples] = False
    else:
        chosen = torch.tensor(samples, dtype=row_samples.dtype, device=row_samples.device)
        others = ~torch.isin(row_samples, chosen).to(grad.device)
    rest = grad.movedim(dim, 0)[others]
    finite = torch.isfinite(rest)
    if rest[finite].count_nonzero():
        return True
    return False if bool(finite.all()) else None
