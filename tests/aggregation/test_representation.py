"""representation_weights: the Gramian of dL/dz against torch.func.jacrev, and the final step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jacflow.aggregation import (
    GradNormWeighting,
    LogLoss,
    MeanWeighting,
    UPGradWeighting,
    representation_gramian,
    representation_weights,
)


def _model() -> tuple[nn.Module, list[nn.Module], torch.Tensor]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 5), nn.Tanh()).double()
    heads = [nn.Linear(5, 1).double() for _ in range(3)]
    x = torch.randn(6, 4, dtype=torch.float64)
    return trunk, heads, x


def _losses_of_features(heads: list[nn.Module], z: torch.Tensor) -> torch.Tensor:
    return torch.stack([(head(z) ** 2).mean() + 0.1 * k for k, head in enumerate(heads)])


def test_gramian_matches_explicit_jacobian() -> None:
    trunk, heads, x = _model()
    z = trunk(x)
    losses = _losses_of_features(heads, z)
    Z = torch.func.jacrev(lambda f: _losses_of_features(heads, f))(z.detach()).reshape(3, -1)
    torch.testing.assert_close(representation_gramian(losses, z), Z @ Z.T)
    torch.testing.assert_close(
        representation_weights(losses, z, UPGradWeighting()), UPGradWeighting()(Z @ Z.T)
    )


def test_backward_of_weighted_losses_gives_the_weighted_jacobian() -> None:
    trunk, heads, x = _model()
    z = trunk(x)
    losses = _losses_of_features(heads, z)
    w = representation_weights(list(losses), z, UPGradWeighting())
    (w * losses).sum().backward()
    params = dict(trunk.named_parameters())

    def losses_of_params(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return _losses_of_features(heads, torch.func.functional_call(trunk, p, (x,)))

    jac = torch.func.jacrev(losses_of_params)({k: v.detach() for k, v in params.items()})
    for name, param in params.items():
        expected = torch.einsum("m,m...->...", w, jac[name])
        torch.testing.assert_close(param.grad, expected)


def test_several_features_sum_their_gramians_and_unused_give_zero_rows() -> None:
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    b = torch.tensor([3.0], requires_grad=True)
    c = torch.tensor(5.0, requires_grad=True)
    losses = [a.sum() + b.sum(), (a**2).sum(), c * 2]
    G = representation_gramian(losses, [a, b])
    Z = torch.tensor([[1.0, 1.0, 1.0], [2.0, 4.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(G, Z @ Z.T)


def test_loss_aware_weighting_receives_the_losses() -> None:
    trunk, heads, x = _model()
    z = trunk(x)
    losses = _losses_of_features(heads, z)
    W = LogLoss(MeanWeighting())
    w = representation_weights(losses, z, W)
    torch.testing.assert_close(w, 1.0 / (3 * losses.detach()))
    assert isinstance(representation_weights(losses, z, GradNormWeighting()), torch.Tensor)


def test_errors() -> None:
    z = torch.ones(2)
    with pytest.raises(ValueError, match="require grad"):
        representation_weights(z.sum()[None], z, MeanWeighting())
    with pytest.raises(TypeError, match="GramianWeighting"):
        representation_weights(z, z, object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one loss"):
        representation_gramian([], z.requires_grad_())
    with pytest.raises(TypeError, match=r"features\[1\]"):
        representation_gramian(z, [z.requires_grad_(), 3])  # type: ignore[list-item]
