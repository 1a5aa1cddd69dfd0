"""Gradients of the dual-cone projection by implicit differentiation of its KKT system.

At the solution ``v`` of ``min v^T G v s.t. v >= u`` with active set ``A`` (``v_A = u_A``) and
free set ``F``, the optimality conditions are ``v_A = u_A`` and ``(G v)_F = 0``. Where the active
set is locally constant (strict complementarity), differentiating them gives

    dv_A = du_A,    G_FF dv_F = -G_FA du_A - (dG v)_F.

So, for an output cotangent ``gv`` and ``y`` solving ``G_FF y_F = gv_F`` (``y_A = 0``;
pseudo-inverse when ``G_FF`` is singular):

    grad_u = 1_A * (gv - G y),    grad_G = -y v^T   (symmetrised: the solver reads sym(G)).

A weakly active constraint (``v_i = u_i`` with the multiplier ``(G v)_i = 0``) belongs to ``F``:
where the projection is differentiable there, its derivative keeps ``(G v)_i = 0`` (e.g. a
dual cone ``{0}``, whose update ``J^T v = 0`` does not move), not ``v_i = u_i``.

The backward pass is made of differentiable torch operations, so second derivatives
(``create_graph=True``) work too, with the active set held fixed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

_ACTIVE_RTOL = 1e-9  # v_i - u_i below this (relative to max |v|) counts as active


def _backward(
    u: Tensor, g: Tensor, v: Tensor, grad_v: Tensor, active_rtol: float = _ACTIVE_RTOL
) -> tuple[Tensor, Tensor]:
    """Cotangents of ``u`` ``[B, k, m]`` and ``g`` ``[B, m, m]`` (the matrix actually solved).

    The NaN rows of ``v`` (every row of a non-finite Gramian; :func:`project_weights` solves a
    non-finite row of ``u`` as a zero row under autograd) are left out of the systems (a NaN
    Gramian made ``pinv`` raise, and a NaN row made all of ``grad_g`` NaN): a NaN row whose
    cotangent is not zero gives NaN to its row of ``u`` (and to its Gramian if that is the
    non-finite input), and nothing to the others."""
    finite_g = torch.isfinite(g).all(-1).all(-1)[:, None, None]
    bad = v.isnan().any(-1, keepdim=True)
    used = bad & (grad_v != 0).any(-1, keepdim=True)
    g = torch.where(finite_g, g, 0.0)
    u, v, grad_v = (torch.where(bad, 0.0, x) for x in (u, v, grad_v))
    grad_u, grad_g = _finite_backward(u, g, v, grad_v, active_rtol)
    grad_g = torch.where(finite_g | ~used.any(1, keepdim=True), grad_g, math.nan)
    return torch.where(used, math.nan, grad_u), grad_g


def _finite_backward(
    u: Tensor, g: Tensor, v: Tensor, grad_v: Tensor, active_rtol: float
) -> tuple[Tensor, Tensor]:
    """:func:`_backward` on finite inputs."""
    scale = torch.maximum(v.abs().amax(-1, keepdim=True), u.abs().amax(-1, keepdim=True))
    free = v - u > active_rtol * scale
    # A weakly active constraint (v_i = u_i and (G v)_i = 0, of a nonzero objective, on a
    # nonzero row) is held as (G dv)_i = -(dG v)_i, not dv_i = du_i: where the map is
    # differentiable (its critical cone a subspace) that is its derivative. Held at v_i = u_i, a
    # trivial dual cone's update, J^T v = 0 for every nearby J, got a gradient as large as J's.
    diagonal = g.diagonal(dim1=-2, dim2=-1)[:, None]
    lam_scale = diagonal.amax(-1, keepdim=True) * scale
    weak = (torch.bmm(v, g).abs() <= active_rtol * lam_scale) & (diagonal > 0) & (scale > 0)
    free = (free | weak).to(g.dtype)
    pair = free[..., :, None] * free[..., None, :]
    system = g[:, None] * pair + torch.diag_embed(1 - free)
    y = (torch.linalg.pinv(system, hermitian=True) @ (grad_v * free)[..., None]).squeeze(-1)
    y = y * free
    grad_u = (1 - free) * (grad_v - torch.bmm(y, g))
    outer = torch.bmm(y.mT, v)
    grad_g = -(outer + outer.mT) / 2
    return grad_u, grad_g


class _Projection(torch.autograd.Function):
    """``v = solve(u, g)`` with the implicit-function gradients of :func:`_backward`."""

    @staticmethod
    def forward(
        ctx: Any, u: Tensor, g: Tensor, solve: Callable[[Tensor, Tensor], Tensor]
    ) -> Tensor:
        v = solve(u.detach(), g.detach())
        ctx.save_for_backward(u, g, v)
        return v

    @staticmethod
    def backward(ctx: Any, grad_v: Tensor) -> tuple[Tensor, Tensor, None]:
        u, g, v = ctx.saved_tensors
        grad_u, grad_g = _backward(u, g, v, grad_v)
        return grad_u, grad_g, None


def differentiable_projection(
    u: Tensor, g: Tensor, solve: Callable[[Tensor, Tensor], Tensor]
) -> Tensor:
    """Apply ``solve`` (batched ``u`` ``[B, k, m]``, ``g`` ``[B, m, m]``) with KKT gradients.

    Example:
        >>> import torch
        >>> from jacflow.linalg._implicit import differentiable_projection
        >>> from jacflow.linalg._dual_cone import project_weights_reference
        >>> g = torch.tensor([[[1.0, -1.0], [-1.0, 4.0]]], dtype=torch.float64, requires_grad=True)
        >>> u = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
        >>> v = differentiable_projection(u, g, lambda a, b: project_weights_reference(a, b[0]))
        >>> v[0, 0, 1].backward()  # v_2 = -G_21 / G_22
        >>> g.grad[0, 1]
        tensor([-0.1250, -0.0625], dtype=torch.float64)
    """
    result: Tensor = _Projection.apply(u, g, solve)
    return result
