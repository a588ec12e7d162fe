"""layout_prop.passes."""
