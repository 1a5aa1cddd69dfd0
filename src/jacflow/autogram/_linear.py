"""Closed forms for layers whose per-row gradient is ``g_r = sum_t b_rt a_rt^T``.

Linear (with or without sequence dimensions) and, after unfolding, every convolution share this
form. With ``U`` the unfolded inputs ``[S, T, g, d]`` (``g`` independent groups of weights) and
``Bp`` the output gradients ``[R, T, g, p]``:

* ghost: ``<g_r, g_q> = sum_{t,s} (a_rt . a_qs)(b_rt . b_qs)``, from the two Gram matrices of
  the positions (cost about ``(ST)^2 d + (RT)^2 p`` and elementwise passes over the ``(RT)^2``
  entries, or ``T^2 d + R T^2 p + R^2 T p`` when the whole batch is one sample, per-task mode);
* materialised: form ``g_r`` (``R T d p``) then ``g g^T`` (``R^2 d p``).

The cheaper of the two is chosen per layer. The bias gradient is ``sum_t b_rt``; on the ghost
route it costs nothing extra (``1`` is added to the kernel ``U U^T``: the ``A A^T + 1`` form).
Gram matrices are one product each (:func:`~jacflow.linalg._products.row_gramian`), and
materialised per-row gradients are kept for the update when they are small enough.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from jacflow.autogram._rules import (
    WEIGHT_AND_BIAS,
    Call,
    Contribution,
    Rows,
    Rule,
    joined,
    kept_weighted_grads,
    kernel_gram,
    register_named_rule,
    register_rule,
    unbatched_refusal,
    weighted_sum,
    worth_keeping,
)
from jacflow.linalg._products import product, row_gramian

# Per sample with several positions, the ghost route also multiplies the ``[R T, R T]`` Gram
# matrix of the backprops with the kernel's and sums over the positions, and with several rows
# per sample it first gathers the kernel to the rows (two indexing copies, the slowest pass):
# memory-bound passes, charged in multiply-adds per entry. Measured (1 thread, float32, 4M
# entries): multiply and sum 2.4 ns, gather 5.4 ns, against 0.02-0.04 ns per multiply-add of a
# large product; the charges are lower, as entries that stay in cache cost less (a transformer's
# feed-forward layer on 16 positions, B = 32, [B] losses: the ghost form at 0.46-0.89x the
# materialised one keeps its route). It only picks between exact routes.
MULTIPLY_SUM_COST = 32
GATHER_COST = 96


def ghost_cost(rows: Rows, positions: int, groups: int, d: int, p: int) -> int:
    """Multiply-adds of the ghost Gramian of one layer, with its elementwise passes over the
    ``[R T, R T]`` entries (per sample, ``T > 1``) at :data:`MULTIPLY_SUM_COST` and
    :data:`GATHER_COST` each."""
    r, s, t = rows.num_rows, rows.num_samples, positions
    if rows.per_task:
        return groups * (t * t * d + r * t * t * p + r * r * t * p)
    per_entry = p
    if t > 1:
        per_entry += MULTIPLY_SUM_COST + (GATHER_COST if rows.index is not None else 0)
    return groups * ((s * t) ** 2 * d + (r * t) ** 2 * per_entry)


# Per-sample gradients come from one batched matmul of small per-sample ``[p, T] x [T, d]``
# products, writing ``R p d`` values: about four times slower per multiply-add than the large
# products of the ghost Gramian or of the convolution kernels (measured, 1 thread: the
# benchmark CNN's layers; a transformer encoder's feed-forward layers on 16 positions, where
# the ghost form took 0.79x the step at B = 32 and tied at B = 64). In per-task mode they are
# one large product, at full speed. It only picks between exact routes.
PER_ROW_SLOWDOWN = 4


# The fewest elements of a block of per-row weight gradients formed at once (16 MB in float32):
# blocks of the size of small layers' inputs would cost a dispatch each, for no memory saved.
PER_ROW_BLOCK_FLOOR = 2**22


def gramian_by_blocks(
    units: int, per_unit: int, held: int, rows_of: Callable[[slice], Tensor]
) -> Tensor:
    """The Gramian of per-row gradients formed by blocks of a layer's ``units`` output features
    or channels: the sum of the Gramians of ``rows_of(block)`` (``[R, ...]``, ``per_unit``
    elements per unit), each block of at most ``held`` elements (the inputs and backprops its
    contribution holds anyway) or :data:`PER_ROW_BLOCK_FLOOR`, so that the step's memory stays
    within one more copy of them.

    Example:
        >>> import torch
        >>> from jacflow.autogram._linear import gramian_by_blocks
        >>> rows = torch.randn(3, 5, 4, dtype=torch.float64)  # [R, units, per unit / R]
        >>> blocked = gramian_by_blocks(5, 12, 24, lambda block: rows[:, block])
        >>> torch.allclose(blocked, rows.flatten(1) @ rows.flatten(1).T)
        True
    """
    block = max(1, max(held, PER_ROW_BLOCK_FLOOR) // per_unit)
    total: Tensor | None = None
    for start in range(0, units, block):
        term = row_gramian(rows_of(slice(start, start + block)).flatten(1))
        total = term if total is None else total.add_(term)
    assert total is not None
    return total


def materialized_cost(rows: Rows, positions: int, groups: int, d: int, p: int) -> int:
    """Multiply-adds of materialising the per-row gradients and their Gramian, the first
    weighted by :data:`PER_ROW_SLOWDOWN` per sample."""
    r = rows.num_rows
    products = (1 if rows.per_task else PER_ROW_SLOWDOWN) * r * positions * d * p
    return groups * (products + r * r * d * p)


def ghost_gramian(u: Tensor, bp: Tensor, rows: Rows, with_bias: bool = False) -> Tensor:
    """Gramian of ``g_r = sum_t Bp[r, t, j]^T U[sample(r), t, j]`` summed over groups ``j``.

    ``with_bias`` adds the Gramian of the bias rows ``s_r = sum_t Bp[r, t]``: a bias is a weight
    whose input is ``1`` at every position, so it adds ``1`` to every entry of the kernel
    ``U U^T`` (the ``A A^T + 1`` form), at no extra product.
    """
    s, t, groups, d = u.shape
    r, p = bp.shape[0], bp.shape[3]
    total: Tensor | None = None
    for j in range(groups):
        # (one group, as in Linear: views without the select, one dispatch fewer each)
        uj = u.reshape(s * t, d) if groups == 1 else u[:, :, j].reshape(s * t, d)
        bj = bp.reshape(r, t, p) if groups == 1 else bp[:, :, j]
        kernel = row_gramian(uj)
        if with_bias:
            kernel += 1
        if rows.per_task:
            term = kernel_gram(kernel, bj)
        else:
            flat_b = bj.reshape(r * t, p)
            term = row_gramian(flat_b)
            if t == 1:
                if rows.index is not None:
                    kernel = kernel[rows.index][:, rows.index]
                term.mul_(kernel)
            else:
                kernel4 = kernel.view(s, t, s, t)
                if rows.index is not None:
                    kernel4 = kernel4[rows.index][:, :, rows.index]
                term = (kernel4 * term.view(r, t, r, t)).sum(dim=(1, 3))
        total = term if total is None else total + term
    assert total is not None
    return total


def per_row_weight_grads(u: Tensor, bp: Tensor, rows: Rows) -> Tensor:
    """Per-row weight gradients ``[R, g, p, d]``."""
    return torch.einsum("rtgp,rtgd->rgpd", bp, rows.gather(u))


def weighted_weight_grad(u: Tensor, y: Tensor, out: Tensor | None = None) -> Tensor:
    """``sum_r w_r g_r`` as ``[g, p, d]`` (``[p, d]`` when ``g = 1``) from the reduced backprops
    ``y = rows.reduce(w, Bp)`` (``[S, T, g, p]``, or ``[S T, p]`` when ``g = 1``): one
    weight-gradient product, as in the plain backward; written into ``out`` (``g = 1`` only,
    ``p d`` elements, the dtype of ``u`` and ``y``) when given."""
    if u.shape[2] == 1:
        flat_y, flat_u = y.flatten(0, -2).T, u.flatten(0, 2)  # (no -1: y or u may be empty)
        if out is None:
            return product(flat_y, flat_u)
        product(flat_y, flat_u, out=out.view(flat_y.shape[0], flat_u.shape[1]))
        return out
    if out is not None:
        raise ValueError("internal: `out` is only written for one group of weights")
    return torch.einsum("stgp,stgd->gpd", y, u)


class UnfoldedContribution(Contribution):
    """Contribution of a weight acting on unfolded inputs, plus an optional bias.

    When the materialised route is taken, the per-row gradients are kept for the update
    (``weights @ per_row``, no weight-gradient product) if they take no more memory than the
    inputs and backprops the contribution holds anyway.

    Args:
        u: unfolded inputs ``[S, T, g, d]``.
        bp: output gradients ``[R, T, g, p]``.
        rows: the row layout.
        weight_shape: shape of the weight parameter (``g * p * d`` elements).
        weight_name / bias_name: parameter names, ``None`` when absent or frozen.
    """

    def __init__(
        self,
        u: Tensor,
        bp: Tensor,
        rows: Rows,
        weight_shape: torch.Size,
        weight_name: str | None,
        bias_name: str | None,
    ) -> None:
        self.u, self.bp, self.rows = u, bp, rows
        self.weight_shape = weight_shape
        self.weight_name, self.bias_name = weight_name, bias_name
        self.kept: Tensor | None = None  # per-row weight gradients [R, g * p * d]

    def _bias_rows(self) -> Tensor:
        return self.bp.sum(dim=1).flatten(1)

    def _ghost_cheaper(self) -> bool:
        _, t, g, d = self.u.shape
        p = self.bp.shape[3]
        return ghost_cost(self.rows, t, g, d, p) <= materialized_cost(self.rows, t, g, d, p)

    def gramian(self, names: set[str]) -> Tensor | None:
        # (an empty weight, of a Linear without input or output features, adds 0)
        weight = self.weight_name in names and self.weight_shape.numel() > 0
        bias = self.bias_name is not None and self.bias_name in names
        if weight and self._ghost_cheaper():
            return ghost_gramian(self.u, self.bp, self.rows, with_bias=bias)
        total: Tensor | None = None
        if weight:
            total = self._materialized_gramian()
        if bias:
            s = self._bias_rows()
            total = s @ s.T if total is None else total + s @ s.T
        return total

    def _materialized_gramian(self) -> Tensor:
        """The weight's Gramian from its per-row gradients, kept for the update where
        :func:`worth_keeping`; else by blocks of output features (:func:`gramian_by_blocks`: a
        transformer's feed-forward layer at B = 128 holds 1.3M elements and its per-row
        gradients have 8.4M)."""
        u, bp, rows = self.u, self.bp, self.rows
        per_feature = rows.num_rows * bp.shape[2] * u.shape[3]  # (elements per output feature)
        p = bp.shape[3]
        if worth_keeping(per_feature * p, u, bp):
            self.kept = per_row_weight_grads(u, bp, rows).flatten(1)
            return row_gramian(self.kept)
        return gramian_by_blocks(
            p,
            per_feature,
            u.numel() + bp.numel(),
            lambda block: per_row_weight_grads(u, bp[..., block], rows),
        )

    def per_row_grads(self, name: str) -> Tensor:
        if name == self.weight_name:
            grads = per_row_weight_grads(self.u, self.bp, self.rows)
            return grads.reshape(grads.shape[0], *self.weight_shape)
        return self._bias_rows()

    def weighted_grads(self, weights: Tensor) -> dict[str, Tensor]:
        return self.weighted_grads_into(weights, lambda name, dtype: None)

    def weighted_grads_into(
        self, weights: Tensor, buffer_for: Callable[[str, torch.dtype], Tensor | None]
    ) -> dict[str, Tensor]:
        if self.kept is not None and self.weight_name is not None:
            return kept_weighted_grads(
                weights,
                self.kept,
                self.weight_name,
                self.weight_shape,
                self.bias_name,
                self._bias_rows,
            )
        out = {}
        _, t, g, _ = self.u.shape
        if self.rows.per_task and g == 1:
            # [T, p] straight from one product over the rows (the common Linear case; it
            # spares the reshapes of the general [S, T, g, p] form)
            y = weighted_sum(weights, self.bp, (t, self.bp.shape[3]))
            bias_dims: tuple[int, ...] = (0,)
        else:
            y = self.rows.reduce(weights, self.bp)
            bias_dims = (0, 1)
        if self.weight_name is not None:
            same = g == 1 and y.dtype == self.u.dtype
            buffer = buffer_for(self.weight_name, y.dtype) if same else None
            out[self.weight_name] = weighted_weight_grad(self.u, y, buffer)
        if self.bias_name is not None:
            out[self.bias_name] = y.sum(dim=bias_dims)
        return out


def unfolded_contribution(
    us: list[Tensor],
    bps: list[Tensor],
    rows: Rows,
    module: nn.Module,
    params: dict[str, Tensor],
    weight_shape: torch.Size | None = None,
) -> UnfoldedContribution:
    """Join the calls of one module along the position axis (exact for repeated calls: their
    per-row gradients add up) and wrap them with the module's ``weight`` and ``bias``
    (``weight_shape``: the ``[out, in]`` of the products, where it is not the weight's own)."""
    u, bp = joined(us, 1), joined(bps, 1)
    if weight_shape is None:
        weight: Tensor = getattr(module, "weight")  # noqa: B009 (get_parameter parses a path)
        weight_shape = weight.shape
    return UnfoldedContribution(
        u,
        bp,
        rows,
        weight_shape,
        "weight" if "weight" in params else None,
        "bias" if "bias" in params else None,
    )


class JoinedLinear(Contribution):
    """Linear-form contributions of one module's disjoint parameters (e.g. an attention
    module's two projections, a recurrent layer's input and hidden weights), as one."""

    def __init__(self, parts: list[tuple[set[str], UnfoldedContribution]]) -> None:
        self.parts = parts

    def gramian(self, names: set[str]) -> Tensor | None:
        total: Tensor | None = None
        for owned, part in self.parts:
            if names & owned:
                term = part.gramian(names & owned)
                if term is not None:
                    total = term if total is None else total + term
        return total

    def per_row_grads(self, name: str) -> Tensor:
        return next(part for owned, part in self.parts if name in owned).per_row_grads(name)

    def weighted_grads(self, weights: Tensor) -> dict[str, Tensor]:
        return self.weighted_grads_into(weights, lambda name, dtype: None)

    def weighted_grads_into(
        self, weights: Tensor, buffer_for: Callable[[str, torch.dtype], Tensor | None]
    ) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for _, part in self.parts:
            out.update(part.weighted_grads_into(weights, buffer_for))
        return out


def by_position(x: Tensor, n: int, width: int) -> Tensor:
    """``x`` (``[*lead, width]``, the leading sizes ``n`` times a number ``T`` of positions) as
    ``[n, T, 1, width]``. ``T`` is counted from the leading sizes, not inferred: an empty
    ``x`` (``width = 0``, a Linear with no input or no output features) has any ``T``.

    Example:
        >>> import torch
        >>> from jacflow.autogram._linear import by_position
        >>> by_position(torch.ones(3, 2, 0), 3, 0).shape
        torch.Size([3, 2, 1, 0])
    """
    return x.reshape(n, x.shape[:-1].numel() // n, 1, width)


def linear_part(
    us: list[Tensor],
    grads: list[Tensor],
    rows: Rows,
    weight: Tensor,
    names: tuple[str, str],
    params: dict[str, Tensor],
) -> tuple[set[str], UnfoldedContribution]:
    """A Linear contribution of ``weight`` (and its bias) from the inputs ``us`` and output
    gradients ``grads`` of every call (joined along the positions: their gradients add up), with
    the names of the two parameters that are in ``params``."""
    u = joined([by_position(x, rows.num_samples, x.shape[-1]) for x in us], 1)
    bp = joined([by_position(g, rows.num_rows, g.shape[-1]) for g in grads], 1)
    weight_name, bias_name = (n if n in params else None for n in names)
    part = UnfoldedContribution(u, bp, rows, weight.shape, weight_name, bias_name)
    return {n for n in names if n in params}, part


def _batched_input(module: nn.Module, call: Call, rows: Rows) -> Tensor:
    """The call's input, refused per sample without a batch dimension (an input ``[d]``, whose
    output ``[p]`` may happen to have ``p = B``)."""
    x = call.input()
    if not rows.per_task and x.dim() < 2:
        raise unbatched_refusal(module, x)
    return x


class LinearRule(Rule):
    """``nn.Linear`` with any number of leading dimensions (sequence, heads, ...)."""

    def parameter_names(self, module: nn.Module) -> frozenset[str]:
        return WEIGHT_AND_BIAS

    def maps_rows(self, module: nn.Module) -> bool:
        return True

    def validate(self, module: nn.Module, call: Call, rows: Rows) -> None:
        _batched_input(module, call, rows)

    def prepare(
        self, module: nn.Module, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> Contribution:
        assert isinstance(module, nn.Linear)
        p, d = module.weight.shape  # (as F.linear reads them: the attributes may be stale)
        us, bps = [], []
        for call in calls:
            # (per-task mode: the whole batch is the one sample; no unsqueeze needed)
            us.append(by_position(call.input(), rows.num_samples, d))
            bps.append(by_position(call.grad(), rows.num_rows, p))
        return unfolded_contribution(us, bps, rows, module, params)


class TransposedWeight(Contribution):
    """A Linear contribution whose weight is stored transposed (``[in, out]``, ``y = x W + b``):
    the same Gramian (the rows' inner products do not see the layout), and the weight's
    gradients transposed."""

    def __init__(self, inner: UnfoldedContribution) -> None:
        self.inner = inner

    def gramian(self, names: set[str]) -> Tensor | None:
        return self.inner.gramian(names)

    def per_row_grads(self, name: str) -> Tensor:
        grads = self.inner.per_row_grads(name)
        return grads.transpose(-2, -1) if name == self.inner.weight_name else grads

    def weighted_grads(self, weights: Tensor) -> dict[str, Tensor]:
        return self.weighted_grads_into(weights, lambda name, dtype: None)

    def weighted_grads_into(
        self, weights: Tensor, buffer_for: Callable[[str, torch.dtype], Tensor | None]
    ) -> dict[str, Tensor]:
        weight = self.inner.weight_name

        def untransposed_only(name: str, dtype: torch.dtype) -> Tensor | None:
            # (the weight's buffer has the stored layout, not the product's [out, in])
            return None if name == weight else buffer_for(name, dtype)

        out = self.inner.weighted_grads_into(weights, untransposed_only)
        if weight is not None and weight in out:
            out[weight] = out[weight].T.contiguous()
        return out


class TransposedLinearRule(Rule):
    """Hugging Face's ``Conv1D`` (GPT-2, GPT, ...): ``y = x @ weight + bias`` with ``weight``
    ``[in, out]`` (a Linear's transposed) and any number of leading dimensions."""

    def parameter_names(self, module: nn.Module) -> frozenset[str]:
        return WEIGHT_AND_BIAS

    def maps_rows(self, module: nn.Module) -> bool:
        return True

    def validate(self, module: nn.Module, call: Call, rows: Rows) -> None:
        x = _batched_input(module, call, rows)
        weight = getattr(module, "weight")  # noqa: B009
        if weight.dim() != 2 or x.shape[-1] != weight.shape[0]:
            raise ValueError(
                f"{type(module).__name__}'s closed form reads its weight as [in, out] = "
                f"{tuple(weight.shape)} applied to the last dimension of its input, of shape "
                f"{tuple(x.shape)}: this version's forward computes otherwise. Register "
                "another rule for it (jacflow.autogram.register_rule) or wrap it in a module "
                "of your own, which the generic rule takes."
            )

    def prepare(
        self, module: nn.Module, params: dict[str, Tensor], calls: list[Call], rows: Rows
    ) -> Contribution:
        weight: Tensor = getattr(module, "weight")  # noqa: B009
        d, p = weight.shape
        us = [by_position(call.input(), rows.num_samples, d) for call in calls]
        bps = [by_position(call.grad(), rows.num_rows, p) for call in calls]
        shape = torch.Size((p, d))  # (the products' [out, in])
        return TransposedWeight(unfolded_contribution(us, bps, rows, module, params, shape))


register_rule(nn.Linear, LinearRule())
register_named_rule("transformers.pytorch_utils.Conv1D", TransposedLinearRule())
