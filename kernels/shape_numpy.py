"""numpy kernels of the shape op family (forward and backward), merged into the numpy table."""

KERNELS: dict = {}
