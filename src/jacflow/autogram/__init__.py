"""The Gramian engine: Gramians of many losses without their Jacobian, and fast JD steps.

:class:`Engine` hooks modules, records their inputs during the forward pass, runs one
activation-only backward (per-sample losses) or one batched backward over the tasks (per-task
losses), and combines per-layer closed forms into the Gramian ``J J^T``. Its
:meth:`Engine.backward` then applies a :class:`~jacflow.aggregation.GramianWeighting` and writes
the weighted gradient from the stored layer inputs and output gradients (book-keeping), so no
second backward is needed.

New layer types get a closed form with :func:`register_rule`; any other module with parameters
uses a generic ``torch.func`` rule.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from jacflow.autogram import Engine
    >>> _ = torch.manual_seed(0)
    >>> model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
    >>> engine = Engine(model, batch_dim=0)
    >>> losses = model(torch.randn(4, 3)).squeeze(1) ** 2
    >>> engine.compute_gramian(losses).shape
    torch.Size([4, 4])
"""

from jacflow.autogram import (  # noqa: F401  (register rules)
    _attention,
    _cells,
    _conv,
    _embedding,
    _linear,
    _norm,
    _recurrent,
)
from jacflow.autogram._engine import Engine
from jacflow.autogram._mtl import mtl_gramian_step
from jacflow.autogram._rules import Call, Contribution, Rows, Rule, register_rule

__all__ = [
    "Call",
    "Contribution",
    "Engine",
    "Rows",
    "Rule",
    "mtl_gramian_step",
    "register_rule",
]
