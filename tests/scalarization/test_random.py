"""Random weighting against an independent draw of softmax(randn) with the same seed."""

from __future__ import annotations

import math

import torch

from jacflow.scalarization import Random


def test_weights_are_softmax_of_a_standard_normal_draw(dtype: torch.dtype) -> None:
    losses = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=dtype, requires_grad=True)
    torch.manual_seed(7)
    out = Random()(losses)
    torch.manual_seed(7)
    z = torch.randn(4, dtype=dtype).tolist()
    expected = [math.exp(v) / sum(math.exp(u) for u in z) for v in z]
    out.backward()
    torch.testing.assert_close(losses.grad, torch.tensor(expected, dtype=dtype))
    assert math.isclose(
        out.item(), sum(w * v for w, v in zip(expected, [1, 2, 3, 4])), rel_tol=1e-5
    )


def test_fresh_positive_weights_summing_to_one_at_each_call() -> None:
    losses = torch.ones(5, requires_grad=True)
    scalarizer = Random()
    grads = []
    for _ in range(3):
        (grad,) = torch.autograd.grad(scalarizer(losses), losses)
        assert (grad > 0).all()
        assert math.isclose(grad.sum().item(), 1.0, rel_tol=1e-6)
        grads.append(grad)
    assert not torch.equal(grads[0], grads[1])
