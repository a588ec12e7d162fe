"""The linalg op family (rules registered beside their definitions)."""
