"""numpy kernels of the nn op family (forward and backward), merged into the numpy table."""

KERNELS: dict = {}
