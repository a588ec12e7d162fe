"""The core: value types (mesh, placements, layout, tensor spec), the graph IR, the op registry,
errors, redistribution planning and the mesh's links.

Everything else in layout-prop is built on these modules, and they import nothing outside
this package (``graph_tests/test_layering.py`` holds them to it).
"""
