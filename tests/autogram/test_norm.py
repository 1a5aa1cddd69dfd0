"""The closed form of LayerNorm, RMSNorm, GroupNorm and BatchNorm: what it reads of the module
at the step."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests.autogram.test_linear import assert_change_refused, assert_exact_backward, row_losses

# a norm, its input's shape, an attribute set between its forward and the step, and whether a
# forward after the change is one the module can run
CHANGES: list[tuple[Callable[[], nn.Module], tuple[int, ...], str, object, bool]] = [
    (lambda: nn.LayerNorm(4), (3, 5, 4), "eps", 0.5, True),
    (lambda: nn.LayerNorm((5, 4)), (3, 5, 4), "normalized_shape", (4,), False),
    (lambda: nn.RMSNorm(4), (3, 5, 4), "eps", 0.5, True),
    (lambda: nn.RMSNorm(4, eps=0.5), (3, 5, 4), "eps", None, True),
    (lambda: nn.GroupNorm(2, 4), (3, 4, 5), "num_groups", 4, True),
    (lambda: nn.GroupNorm(2, 4), (3, 4, 5), "eps", 0.5, True),
    (lambda: nn.BatchNorm1d(4).eval(), (3, 4, 5), "eps", 0.5, True),
]
IDS = ["layer_eps", "layer_shape", "rms_eps", "rms_eps_none", "group_groups", "group_eps", "batch"]


@pytest.mark.parametrize("batch_dim", [0, None])
@pytest.mark.parametrize(("make", "shape", "name", "value", "exact"), CHANGES, ids=IDS)
def test_attributes_changed_after_the_forward_are_refused(
    make: Callable[[], nn.Module],
    shape: tuple[int, ...],
    name: str,
    value: object,
    exact: bool,
    batch_dim: int | None,
) -> None:
    """The closed form normalises the recorded input again with the module's ``eps``,
    ``normalized_shape`` and ``num_groups`` at the step: one changed since the forward is
    refused, naming it, before anything is written (the step was silently wrong, 17-68% off;
    a changed ``normalized_shape`` blamed a gradient hook); a forward after the change is
    differentiated exactly."""
    norm = make().double()
    x = torch.randn(shape, dtype=torch.float64)

    def losses_of(m: nn.Module) -> torch.Tensor:
        return row_losses(m(x).sin(), batch_dim)

    assert_change_refused(norm, losses_of, lambda: setattr(norm, name, value), batch_dim, name)
    if exact:
        assert_exact_backward(norm, losses_of, batch_dim)
