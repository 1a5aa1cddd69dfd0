"""jacflow: Jacobian-based autodiff and Jacobian descent for PyTorch."""
