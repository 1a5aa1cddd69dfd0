"""Embedding: sparse per-row gradients, Gramian by token equality.

Row ``r``'s gradient of the table is ``sum_t e_{x_rt} b_rt^T``: at most ``T`` nonzero rows. After
summing the backprops of equal tokens within each row (``c_{r,v}``), the Gramian is
``G[r, q] = sum_v c_{r,v} . c_{q,v}``. A token of one row only adds ``|c_{r,v}|^2`` to ``G[r, r]``;
over the tokens that several rows share, three exact ways are used, the cheapest one chosen:

* dense over the ``n_v`` shared tokens: ``M [R, n_v, p]``, ``G = M M^T``;
* pairwise over their ``U`` (row, token) pairs: ``(C C^T) * [v_a = v_b]`` scattered to rows;
* by token: each token's rows ``C_v [n_v(rows), p]`` give ``C_v C_v^T``, scattered to rows;
  tokens with about as many rows (counts rounded up to a power of two, zero-padded) share one
  batched product. It costs ``sum_v count_v^2 p``: where most shared tokens are in a few of
  many rows, the dense form's ``M`` is mostly zeros.

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
    joined,
    register_rule,
)
from jacflow.linalg._products import row_gramian

_WEIGHT = frozenset({"weight"})


# The by-token form's costs, in multiply-adds (about 0.03 ns each in the dense form's product):
# gathering each token's padded block (two passes over ``p`` entries per slot, about 2 ns per
# entry), scattering each entry of its Gram matrices to the rows (an accumulating index_put,
# about 15 ns) and each block size's own dispatches (about 50 us). Measured, 1 thread, float32,
# whole steps against the dense form over the shared tokens: vocabulary 1000, p = 16, T = 16,
# B = 128: 2.0 against 3.0 ms; vocabulary 50000, p = 256, T = 128, B = 64: 35 against 47 ms; a
# vocabulary of 300 (each token in about 6 of 32 rows) is left to the dense form (0.62 ms by
# token against 0.31 ms for the Gramian alone). They only pick between exact forms.
BY_TOKEN_GATHER_COST = 64
BY_TOKEN_SCATTER_COST = 500
BY_TOKEN_SIZE_COST = 1_500_000


def _buckets(counts: Tensor) -> Tensor:
    """Each token's row count rounded up to a power of two: the padded size of its block."""
    return torch.pow(2, torch.ceil(torch.log2(counts.double()))).to(counts.dtype)


def _by_token_cost(buckets: Tensor, sizes: Tensor, p: int) -> int:
    """Multiply-adds of :func:`_gramian_by_token`, its index passes charged as above."""
    slots, entries = torch.stack([buckets.sum(), (buckets * buckets).sum()]).tolist()
    gathers = slots * p * BY_TOKEN_GATHER_COST
    return gathers + entries * (p + BY_TOKEN_SCATTER_COST) + len(sizes) * BY_TOKEN_SIZE_COST


def _gramian_by_token(
    row: Tensor,
    position: Tensor,
    counts: Tensor,
    buckets: Tensor,
    sizes: list[int],
    c: Tensor,
    r: int,
) -> Tensor:
    """``G = sum_v C_v C_v^T`` scattered to the rows, ``C_v`` the summed backprops (``c``) of
    the ``counts[v]`` pairs of token ``v`` (``position``: each pair's token), one batched
    product per block size in ``sizes`` (the distinct ``buckets``)."""
    order = torch.argsort(position, stable=True)  # the pairs, token by token
    starts = torch.cumsum(counts, 0) - counts
    gramian = c.new_zeros(r + 1, r + 1)  # (row r: the padding's, dropped)
    for size in sizes:
        chosen = (buckets == size).nonzero().squeeze(1)
        slots = torch.arange(size, device=c.device)
        present = slots < counts[chosen, None]  # [n, size]
        pair = order[(starts[chosen, None] + slots).clamp(max=order.shape[0] - 1)]
        block = torch.where(present.unsqueeze(-1), c[pair], 0.0)  # [n, size, p]
        rows_of = torch.where(present, row[pair], r)
        grams = block @ block.mT  # [n, size, size]
        index = (rows_of.unsqueeze(2).expand_as(grams), rows_of.unsqueeze(1).expand_as(grams))
        gramian.index_put_(index, grams, accumulate=True)
    return gramian[:r, :r]


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
        keys, backprops = row_of * self.num_embeddings + ids, self.bp
        if self.padding_idx is not None:
            valid = ids != self.padding_idx
            keys, backprops = keys[valid], backprops[valid]
        # (without padding, the backprops as they are: a mask copied all R T p of them, the
        # tasks' gradients of every token per task)
        unique, inverse = torch.unique(keys.flatten(), return_inverse=True)
        flat = backprops.reshape(inverse.shape[0], p)  # (not -1: ambiguous at p = 0)
        c = self.bp.new_zeros(unique.shape[0], p).index_add_(0, inverse, flat)
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
        tokens, position, counts = torch.unique(
            position[shared], return_inverse=True, return_counts=True
        )
        n_pairs, n_tokens = c.shape[0], tokens.shape[0]
        dense_cost, pairwise_cost = r * r * n_tokens * p, n_pairs * n_pairs * (p + r)
        by_token = False
        if min(dense_cost, pairwise_cost) > BY_TOKEN_SIZE_COST:  # (else it cannot pay)
            buckets = _buckets(counts)
            sizes = torch.unique(buckets)
            by_token = _by_token_cost(buckets, sizes, p) < min(dense_cost, pairwise_cost)
        if by_token:
            gramian = _gramian_by_token(row, position, counts, buckets, sizes.tolist(), c, r)
        elif dense_cost <= pairwise_cost:
            dense = c.new_zeros(r, n_tokens, p)
            dense[row, position] = c
            gramian = row_gramian(dense.reshape(r, n_tokens * p))
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
                "rule re-runs it sample by sample (batch_dim set), counting one sample's tokens "
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

    def maps_rows(self, module: nn.Module) -> bool:
        return True  # (each id to its row: ids [T, B] read sequence first, as Linear's inputs)

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
            # (the positions from the ids: -1 is ambiguous for an embedding of zero width)
            bp = call.grad().reshape(rows.num_rows, x.shape[1], module.weight.shape[1])
            ids.append(x)
            bps.append(_by_frequency(x, bp, rows) if module.scale_grad_by_freq else bp)
        return EmbeddingContribution(joined(ids, 1), joined(bps, 1), rows, module)


register_rule(nn.Embedding, EmbeddingRule())
