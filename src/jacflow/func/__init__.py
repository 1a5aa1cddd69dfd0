"""Function transforms for :mod:`torch.func` users: :func:`jacrev`.

Example:
    >>> import torch
    >>> from jacflow.func import jacrev
    >>> jacrev(lambda x: x ** 2)(torch.tensor([1., 2.]))
    tensor([[2., 0.],
            [0., 4.]])
"""

from jacflow.func._jacrev import jacrev

__all__ = ["jacrev"]
