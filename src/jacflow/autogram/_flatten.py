"""The leaves of a module's inputs and outputs, the same on every supported torch."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.utils._pytree import tree_flatten


def leaves(tree: Any) -> list[Any]:
    """``tree_flatten(tree)``'s leaves, with the fields of a tuple subclass that torch's pytree
    takes as a leaf opened too: torch 2.8 opens a ``PackedSequence`` (a subclass of a
    namedtuple) into its data, batch sizes and indices, earlier releases do not, and the
    recorded positions of a recurrent layer's outputs count those fields. A dataclass instance
    that torch's pytree takes as a leaf (an output type of a module) is opened into its fields,
    so that the tensors it returns are recorded.

    Example:
        >>> import torch
        >>> from torch.nn.utils.rnn import pack_padded_sequence
        >>> packed = pack_padded_sequence(torch.ones(2, 3, 1), torch.tensor([3, 2]), True)
        >>> [type(leaf).__name__ for leaf in leaves((packed, torch.ones(1)))]
        ['Tensor', 'Tensor', 'NoneType', 'NoneType', 'Tensor']
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Out:
        ...     h: torch.Tensor
        ...     n: int
        >>> [type(leaf).__name__ for leaf in leaves(Out(torch.ones(1), 2))]
        ['Tensor', 'int']
    """
    found: list[Any] = []
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, tuple):  # (never on torch 2.8 and later: tuples are opened there)
            found.extend(leaves(tuple(leaf)))
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found.extend(leaves(tuple(getattr(leaf, f.name) for f in dataclasses.fields(leaf))))
        else:
            found.append(leaf)
    return found
