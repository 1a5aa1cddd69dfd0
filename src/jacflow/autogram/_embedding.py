"""Embedding: sparse per-row gradients, Gramian by token equality.

Row ``r``'s gradient of the table is ``sum_t e_{x_rt} b_rt^T``: at most ``T`` nonzero rows. After
summing the backprops of equal tokens within each row (``c_{r,v}``), the Gramian is
``G[r, q] = sum_v c_{r,v} . c_{q,v}``. A token of one row only adds ``|c_{r,v}|^2`` to ``G[r, r]``;
over the tokens that several rows share, two exact ways are used, the cheaper one chosen:

* dense over the ``n_v`` shared tokens: ``M [R, n_v, p]``, ``G = M M^T``;
* pairwise over their ``U`` (row, token) pairs: ``(C C^T) * [v_a = v_b]`` scattered to rows.

``padding_idx`` receives no gradient and is excluded, like in ``nn.Embedding``'s backward.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor, nn

from jacflow.autogram._rules import (
    Call,
    Contribution,
    Rows,
    Rule,
    attribute_settings,
    register_rule,
)
from jacflow.linalg._products import row_gramian

_WEIGHT = frozenset({"weight"})


class EmbeddingContribution(Contribution):
    """Contribution of an embedding table from its ids ``[S, T]`` and backprops ``[R, T, p]``."""

    def __init__(self, ids: Tensor, bp: Tensor, rows: Rows, module: nn.Embedding) -> None:
        self.ids, self.bp, self.rows = ids, bp, rows
        # (the table's, as F.embedding reads it: num_embeddings is stale once the weight is
        # replaced by a larger table)
        self.num_embeddings = module.weight.shape[0]
        padding = module.padding_idx
        if padding is not None and padding < 0:  # (set as an attribute: read from the table's
            padding += self.num_embeddings  # end, as F.embedding reads it)
        self.padding_idx = padding
        self.sparse = module.sparse

    def _valid(self, ids: Tensor) -> Tensor:
        if self.padding_idx is None:
            return torch.ones_like(ids, dtype=torch.bool)
        return ids != self.padding_idx

    def _pairs(self) -> tuple[Tensor, Tensor, Tensor]:
        """Distinct (row, token) pairs and their summed backprops ``c`` ``[U, p]``."""
        r, t, p = self.bp.shape
        ids = self.rows.gather(self.ids)
        row_of = torch.arange(r, device=ids.device).unsqueeze(1).expand(r, t)
        valid = self._valid(ids)
        keys = row_of[valid] * self.num_embeddings + ids[valid]
        unique, inverse = torch.unique(keys, return_inverse=True)
        c = self.bp.new_zeros(unique.shape[0], p).index_add_(0, inverse, self.bp[valid])
        return unique // self.num_embeddings, unique % self.num_embeddings, c

    def gramian(self, names: set[str]) -> Tensor | None:
        if "weight" not in names:
            return None
        r, _, p = self.bp.shape
        row, token, c = self._pairs()
        _, position, rows_of = torch.unique(token, return_inverse=True, return_counts=True)
        # a token of one row only adds to that row's diagonal entry: the two forms run on the
        # tokens that several rows share (few of a large vocabulary's: a dense form over all
        # of them filled and multiplied R x n_v x p zeros, 22x the SGD step at V = 50000)
        shared = rows_of[position] > 1
        own = ~shared
        diagonal = c.new_zeros(r).index_add_(0, row[own], c[own].pow(2).sum(1))
        row, c = row[shared], c[shared]
        tokens, position = torch.unique(position[shared], return_inverse=True)
        n_pairs, n_tokens = c.shape[0], tokens.shape[0]
        if r * r * n_tokens * p <= n_pairs * n_pairs * (p + r):
            dense = c.new_zeros(r, n_tokens, p)
            dense[row, position] = c
            gramian = row_gramian(dense.reshape(r, -1))
        else:
            same = (position.unsqueeze(1) == position.unsqueeze(0)).to(c.dtype)
            pair_gram = (c @ c.T) * same
            onehot = torch.nn.functional.one_hot(row, r).to(c.dtype)  # [U, R]
            gramian = onehot.T @ pair_gram @ onehot
        gramian.diagonal().add_(diagonal)
        return gramian

    def per_row_grads(self, name: str) -> Tensor:
        r, _, p = self.bp.shape
        row, token, c = self._pairs()
        out = c.new_zeros(r, self.num_embeddings, p)
        out[row, token] = c
        return out

    def weighted_grads(self, weights: Tensor) -> dict[str, Tensor]:
        y = self.rows.reduce(weights, self.bp)  # [S, T, p]
        valid = self._valid(self.ids)
        grad = y.new_zeros(self.num_embeddings, y.shape[-1])
        grad.index_add_(0, self.ids[valid], y[valid])
        return {"weight": sparse_rows(grad, self.ids[valid]) if self.sparse else grad}


def sparse_rows(grad: Tensor, ids: Tensor) -> Tensor:
    """The rows ``ids`` of a table's gradient ``grad`` ``[V, p]``, in the layout of a sparse
    embedding's backward (one sparse dimension, the rows dense), with which autograd's
    gradients can be summed either way.

    Example:
        >>> import torch
        >>> from jacflow.autogram._embedding import sparse_rows
        >>> table = torch.tensor([[0.0, 0.0], [1.0, 2.0], [0.0, 0.0]])
        >>> grad = sparse_rows(table, torch.tensor([1, 1]))
        >>> grad.sparse_dim(), grad.dense_dim(), grad.to_dense()[1].tolist()
        (1, 1, [1.0, 2.0])
    """
    rows = torch.unique(ids)  # (sorted and distinct: coalesced, which needs no check)
    # (torch 2.11 warns that the checks are "implicitly disabled" at a process's first sparse
    # tensor whatever `check_invariants` says, unless the global setting is set: set for the call)
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        return torch.sparse_coo_tensor(
            rows.unsqueeze(0), grad[rows], grad.shape, is_coalesced=True, check_invariants=False
        )


def frequency_refusal(module: nn.Module, where: str) -> ValueError | None:
    """The refusal of an embedding (``nn.Embedding``, ``nn.EmbeddingBag``) in ``module`` with
    ``scale_grad_by_freq=True``, for the generic rule per sample (``None`` if there is none):
    that rule re-runs ``module`` sample by sample, and each re-run would count its own
    sample's tokens instead of the batch's.

    Example:
        >>> from torch import nn
        >>> bag = nn.EmbeddingBag(5, 2, scale_grad_by_freq=True)
        >>> str(frequency_refusal(bag, "bag")).split(":")[0]
        'bag is an embedding with scale_grad_by_freq=True under the generic rule'
        >>> frequency_refusal(nn.EmbeddingBag(5, 2), "bag") is None
        True
    """
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.scale_grad_by_freq:
            inner = f"{where}.{name}" if name else where
            return ValueError(
                f"{inner} is an embedding with scale_grad_by_freq=True under the generic rule: "
                "its gradient is divided by its tokens' counts over the whole batch, and the "
                "rule re-runs it sample by sample (batch_dim=0), counting one sample's tokens "
                "only. "
                + (
                    "Give the nn.Embedding a unit of its own (move the parameters of the module "
                    "that holds it into a module of their own), use batch_dim=None, or set "
                    "scale_grad_by_freq=False."
                    if isinstance(sub, nn.Embedding)
                    else "Use batch_dim=None, or set scale_grad_by_freq=False."
                )
            )
    return None


def _by_frequency(ids: Tensor, bp: Tensor, rows: Rows) -> Tensor:
    """``bp`` divided, at each position, by the count of its token in the call's ids (all the
    samples'): the backward of ``scale_grad_by_freq=True``. The counts are constants of the
    batch, so each row's gradient stays its own."""
    counts = torch.bincount(ids.flatten())
    return bp / rows.gather(counts[ids]).unsqueeze(-1).to(bp.dtype)


class EmbeddingRule(Rule):
    """``nn.Embedding`` (with ``scale_grad_by_freq=True``, each call's output gradients are
    divided by its tokens' counts in that call, as in its backward)."""

    def parameter_names(self, module: nn.Module) -> frozenset[str]:
        return _WEIGHT

    def settings(self, module: nn.Module) -> Hashable:
        # (which token gets no gradient, the division by the counts, the gradient's layout)
        return attribute_settings(module, ("padding_idx", "scale_grad_by_freq", "sparse"))

    def prepare(
        self, module: nn.Module, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> Contribution:
        assert isinstance(module, nn.Embedding)
        ids, bps = [], []
        for call in calls:
            x = rows.samples(call.input()).reshape(rows.num_samples, -1)
            bp = call.grad().reshape(rows.num_rows, -1, module.weight.shape[1])
            ids.append(x)
            bps.append(_by_frequency(x, bp, rows) if module.scale_grad_by_freq else bp)
        return EmbeddingContribution(torch.cat(ids, 1), torch.cat(bps, 1), rows, module)


register_rule(nn.Embedding, EmbeddingRule())
