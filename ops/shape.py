"""The shape op family (rules registered beside their definitions)."""
