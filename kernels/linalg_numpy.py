"""numpy kernels of the linalg op family (forward and backward), merged into the numpy table."""

KERNELS: dict = {}
