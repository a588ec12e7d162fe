"""layout_prop.viz: draw a propagated graph, or one tensor's sharding, as HTML, SVG, PNG or DOT.

It only reads node metadata (``specs``, ``violations``, ``wants``, ``inserted_by``,
``grad_of``) and the :class:`~layout_prop.passes.check.CheckResult`.  One module per
part: :mod:`.scene` (the boxes, lines and texts every picture is made of, colours, text
metrics), :mod:`.graph_layout` (the graph's layered layout), :mod:`.grid` (a tensor's
sharding grid), one module per output format (:mod:`.svg`, :mod:`.html_page`,
:mod:`.png`, :mod:`.dot`), and :mod:`.files` (writing files, the ``viz`` command).

Two pictures:

- The graph (:func:`draw_graph`): topological layers from left to right, nodes ordered
  within a layer to cut crossings.  Every edge carries its value's placements (each one
  coloured by its mesh axis; every axis name has a fixed colour) and rank 0's local
  shape.  Redistributions are hexagons listing their steps and bytes per rank;
  violations are red with their code; a legend explains colours and shapes.  A graph
  input read far downstream (a weight shared by every block) is drawn again, dashed,
  next to its far consumers, so deep graphs stay readable and cheap to lay out.
- One tensor's sharding grid (:func:`tensor_grid`, :func:`draw_grid`): which ranks hold
  which block.  Two dims are drawn (rows and columns) to scale, so uneven shards show
  their sizes; the other dims are summarised in a caption (whole on every rank), or,
  when one is sharded too, drawn as one small panel per piece.  Every block lists all
  the ranks holding it (replicas); Partial blocks are hatched and list the rank groups
  that hold the terms.

Both pictures are a :class:`Scene` (boxes, lines and texts in pixels).
:func:`scene_svg` writes it as SVG with Python alone (no Graphviz), :func:`scene_html`
embeds that SVG in a self-contained page (no network, inline script) whose side panel
shows the full spec and redistribution of whatever node, edge or block is hovered or
clicked, and :func:`scene_png` draws the same scene with matplotlib when it is
installed.  :func:`graph_dot` and :func:`grid_dot` write Graphviz text instead.

Examples
--------
>>> from layout_prop import DeviceMesh, Layout, TensorSpec
>>> mesh = DeviceMesh((4,), ("tp",))
>>> grid = tensor_grid(TensorSpec((10, 8), "float32", Layout(mesh, ["S(0)"], 2)))
>>> grid.dims, grid.row_sizes, grid.col_sizes
((0, 1), (3, 3, 3, 1), (8,))
>>> [grid.ranks(row, 0) for row in range(4)]
[(0,), (1,), (2,), (3,)]
>>> svg = scene_svg(draw_grid(grid, name="x"))
>>> svg.startswith("<svg"), svg.count('class="cell"')
(True, 4)
"""

from __future__ import annotations

from .dot import graph_dot, grid_dot
from .files import Visualise, find_value, output_format, parse_dims, write_graph, write_grid
from .graph_layout import draw_graph
from .grid import Grid, GridCell, GridPanel, draw_grid, tensor_grid
from .html_page import scene_html
from .png import scene_png
from .scene import FORMATS, Item, Scene, Shape, Span, Text, VizError, axis_colours
from .svg import scene_svg

__all__ = [
    "FORMATS",
    "Grid",
    "GridCell",
    "GridPanel",
    "Item",
    "Scene",
    "Shape",
    "Span",
    "Text",
    "Visualise",
    "VizError",
    "axis_colours",
    "draw_graph",
    "draw_grid",
    "find_value",
    "graph_dot",
    "grid_dot",
    "output_format",
    "parse_dims",
    "scene_html",
    "scene_png",
    "scene_svg",
    "tensor_grid",
    "write_graph",
    "write_grid",
]
