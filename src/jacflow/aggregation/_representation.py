"""Representation-level ("MGDA-UB") weights: any Gramian weighting on the Gramian of dL/dz."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from jacflow.aggregation._bases import GramianWeighting, check_gramian_weighting
from jacflow.aggregation._loss_aware import LossAware


def _as_tuple(value: Tensor | Sequence[Tensor], name: str) -> tuple[Tensor, ...]:
    items = (value,) if isinstance(value, Tensor) else tuple(value)
    for index, item in enumerate(items):
        if not isinstance(item, Tensor):
            raise TypeError(f"`{name}[{index}]` must be a torch.Tensor, received {type(item)}.")
    return items


def _loss_vector(losses: Tensor | Sequence[Tensor]) -> Tensor:
    items = _as_tuple(losses, "losses")
    if len(items) == 1:
        return items[0].reshape(-1)
    if not items:
        raise ValueError("`losses` must hold at least one loss, received an empty sequence.")
    return torch.stack([item.reshape(()) for item in items])


def representation_gramian(
    losses: Tensor | Sequence[Tensor], features: Tensor | Sequence[Tensor]
) -> Tensor:
    r"""Gramian :math:`Z Z^\top` of the gradients :math:`Z_i = \partial L_i / \partial z`.

    One backward pass to the features per loss (the graph is retained); a loss that does not
    depend on the features gives a zero row.

    Args:
        losses: the ``m`` scalar losses, as a ``[m]`` tensor or a sequence of scalars.
        features: the shared representation ``z`` (one tensor or several), requiring grad.

    Returns:
        The ``[m, m]`` Gramian, in the features' dtype and on their device, without a graph.

    Example:
        >>> import torch
        >>> from jacflow.aggregation import representation_gramian
        >>> z = torch.tensor([1., 2.], requires_grad=True)
        >>> representation_gramian(torch.stack([z.sum(), (z**2).sum()]), z)
        tensor([[ 2.,  6.],
                [ 6., 20.]])
    """
    flat_losses = _loss_vector(losses)
    feats = _as_tuple(features, "features")
    if not all(f.requires_grad for f in feats):
        raise ValueError(
            "`features` must require grad: pass the shared representation z computed from the "
            "model's parameters (not a detached tensor)."
        )
    m = flat_losses.shape[0]
    like = feats[0]
    gramian = torch.zeros(m, m, dtype=like.dtype, device=like.device)
    rows = []
    for i in range(m):
        grads = torch.autograd.grad(
            flat_losses[i], feats, retain_graph=True, allow_unused=True, materialize_grads=True
        )
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    if rows:
        Z = torch.stack(rows)
        gramian = Z @ Z.T
    return gramian.detach()


def representation_weights(
    losses: Tensor | Sequence[Tensor],
    features: Tensor | Sequence[Tensor],
    weighting: GramianWeighting,
) -> Tensor:
    r"""Weights of ``weighting`` on the Gramian of the losses' gradients w.r.t. shared features.

    The representation-level mode of Sener & Koltun, *Multi-Task Learning as Multi-Objective
    Optimization*, NeurIPS 2018 (their MGDA-UB), for any :class:`GramianWeighting`: with
    :math:`z` the shared representation (the output of the trunk) and
    :math:`Z_i = \partial L_i / \partial z`,

    .. math:: w = W(Z Z^\top),

    then back-propagate :math:`\sum_i w_i L_i` through the whole network, e.g.
    ``(weights * losses).sum().backward()``: the trunk receives :math:`J^\top w` and each head
    its own loss gradient scaled by :math:`w_i`. This costs one backward pass to ``z`` per
    loss instead of one through the trunk, and for MGDA it minimises an upper bound of the
    parameter-level objective. When ``weighting`` is :class:`LossAware`, its losses are set
    from ``losses`` first; a wrapper of one (``Periodic(MGDAWeighting(normalization="loss"),
    every=2)``) is not loss-aware itself: set the inner weighting's losses before the call.

    Args:
        losses: the ``m`` scalar losses, as a ``[m]`` tensor or a sequence of scalars.
        features: the shared representation ``z`` (one tensor or several), requiring grad.
        weighting: the Gramian weighting to apply.

    Returns:
        The ``[m]`` weights, detached from the graph (which is kept for the final backward).

    Example:
        >>> import torch
        >>> from jacflow.aggregation import UPGradWeighting, representation_weights
        >>> x = torch.tensor([[1., 2.], [3., 4.]])
        >>> trunk = torch.nn.Linear(2, 2); _ = torch.nn.init.eye_(trunk.weight)
        >>> _ = torch.nn.init.zeros_(trunk.bias)
        >>> z = trunk(x)
        >>> losses = torch.stack([z[:, 0].sum(), -z.sum() + (z**2).sum() / 10])
        >>> w = representation_weights(losses, z, UPGradWeighting())
        >>> w
        tensor([0.8000, 1.0000])
        >>> (w * losses).sum().backward()  # the update of the trunk is J^T w
    """
    weighting = check_gramian_weighting(weighting)
    gramian = representation_gramian(losses, features)
    if isinstance(weighting, LossAware):
        weighting.set_losses(_loss_vector(losses))
    return weighting(gramian).detach()
