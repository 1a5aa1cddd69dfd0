"""Jacobians over autograd graphs: ``backward``, ``jac``, ``jac_to_grad``, ``mtl_backward``.

Example:
    >>> import torch
    >>> from jacflow.autojac import backward
    >>> from jacflow.aggregation import UPGrad
    >>> param = torch.tensor([1., 2.], requires_grad=True)
    >>> backward([torch.tensor([-1., 1.]) @ param, (param ** 2).sum()], A=UPGrad())
    >>> param.grad
    tensor([0.5000, 2.5000])
"""

from jacflow.autojac._backward import backward
from jacflow.autojac._jac import jac
from jacflow.autojac._jac_to_grad import jac_to_grad
from jacflow.autojac._mtl_backward import mtl_backward

__all__ = ["backward", "jac", "jac_to_grad", "mtl_backward"]
