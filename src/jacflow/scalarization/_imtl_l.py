"""IMTL-L: learned loss scales of impartial multi-task learning."""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import torch
from torch import Tensor, nn

from jacflow._stateful import Stateful
from jacflow.scalarization._base import (
    Scalarizer,
    check_built_shape,
    check_shape,
)


@final
class IMTLL(Scalarizer, Stateful):
    r"""IMTL-L: :math:`\sum_i \big(e^{s_i} L_i - s_i\big)` with learnable scales :math:`s`.

    Minimising over :math:`s_i` gives :math:`e^{s_i} L_i = 1`: every scaled loss is pulled to the
    same magnitude. The :math:`- s_i` term prevents :math:`s_i \to -\infty`. Up to a factor 2 and
    the sign of the parameter this is :class:`UW`.

    Paper: L. Liu, Y. Li, Z. Kuang, J.-H. Xue, Y. Chen, W. Yang, Q. Liao, W. Zhang, *Towards
    Impartial Multi-task Learning*, ICLR 2021 (the loss-balance part; the gradient part is the
    aggregator IMTL-G). Same names, parameters and defaults as TorchJD 0.18's ``IMTLL``.

    State: the parameter ``log_scale`` (initialised to 0); pass ``imtl.parameters()`` to the
    optimizer. It follows the losses' device and float32/float64 dtype until the first call in
    training mode (or a loaded ``state_dict``), and keeps them after that: a call on losses of
    another dtype computes in the wider one, and losses on another device raise (move it with
    ``.to(device)``; see :class:`Scalarizer`). :meth:`reset` sets it back to 0. It keeps the shape
    ``IMTLL`` was built for: for another number of losses, build a new ``IMTLL`` and give its
    parameters to the optimizer.

    Args:
        shape: the shape of the losses (an ``int`` ``m`` means ``(m,)``).

    Example:
        >>> import torch
        >>> from jacflow.scalarization import IMTLL
        >>> imtl = IMTLL(2)
        >>> with torch.no_grad():
        ...     _ = imtl.log_scale.copy_(torch.tensor([0.0, -1.0]))
        >>> imtl(torch.tensor([1.0, 2.0]))  # 1 + 2 / e + 1
        tensor(2.7358, grad_fn=<SumBackward0>)
    """

    def __init__(self, shape: int | Sequence[int]) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.zeros(check_shape(shape, "IMTLL")))

    def forward(self, losses: Tensor, /) -> Tensor:
        check_built_shape(self.log_scale.shape, losses, "IMTLL")
        self.follow([self.log_scale], losses)
        return (torch.exp(self.log_scale) * losses - self.log_scale).sum()

    def reset(self) -> None:
        with torch.no_grad():
            self.log_scale.zero_()

    def extra_repr(self) -> str:
        return f"shape={tuple(self.log_scale.shape)}"
