"""layout_prop.ops."""
