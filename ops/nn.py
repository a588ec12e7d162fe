"""The nn op family (rules registered beside their definitions)."""
