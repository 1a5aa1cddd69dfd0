"""jacflow: Jacobian-based autodiff and Jacobian descent for PyTorch.

Example:
    >>> import torch
    >>> from jacflow import backward
    >>> from jacflow.aggregation import UPGrad
    >>> param = torch.tensor([1., 2.], requires_grad=True)
    >>> backward([torch.tensor([-1., 1.]) @ param, (param ** 2).sum()], A=UPGrad())
    >>> param.grad
    tensor([0.5000, 2.5000])
"""

from jacflow._stateful import Stateful
from jacflow.autojac import backward, jac, jac_to_grad, mtl_backward
from jacflow.func import jacrev

__all__ = ["Stateful", "backward", "jac", "jac_to_grad", "jacrev", "mtl_backward"]
