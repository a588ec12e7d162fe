"""layout_prop.kernels."""
