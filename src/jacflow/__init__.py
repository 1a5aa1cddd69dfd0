"""jacflow: Jacobian-based autodiff and Jacobian descent for PyTorch."""

from jacflow._stateful import Stateful

__all__ = ["Stateful"]
