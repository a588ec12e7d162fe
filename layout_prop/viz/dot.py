"""Graphviz DOT text for the graph and for a tensor's grid."""

from __future__ import annotations

import html

from layout_prop.core.graph import Graph
from layout_prop.core.mesh import DeviceMesh
from layout_prop.passes.check import CheckResult

from .graph_layout import (
    _checked,
    _edge_labels,
    _Facts,
    _node_kind,
    _node_lines,
    _spec_of,
)
from .grid import Grid, _axis_cut_spans, _cell_lines, _extent
from .scene import (
    CELL_FILLS,
    EDGE_COLOUR,
    INK,
    KIND_TEXT,
    MUTED,
    NODE_FILLS,
    VIOLATION_RED,
    Span,
    _info_text,
    _placement_spans,
    axis_colours,
)


# --------------------------------------------------------------------------- DOT
def _dot_id(name: str) -> str:
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _dot_html(lines: list, left: bool = False) -> str:
    """Lines of spans as a Graphviz HTML-like label (centred lines, or ``left`` aligned)."""
    out = []
    for spans in lines:
        parts = []
        for span in spans:
            text = html.escape(span.text, quote=False)
            if span.bold:
                text = f"<B>{text}</B>"
            if span.colour != INK:
                text = f'<FONT COLOR="{span.colour}">{text}</FONT>'
            parts.append(text)
        out.append("".join(parts) or " ")
    if left:
        return "<" + "".join(line + '<BR ALIGN="LEFT"/>' for line in out) + ">"
    return "<" + "<BR/>".join(out) + ">"


def graph_dot(graph: Graph, check: CheckResult | None = None, *, title: str = "") -> str:
    """The graph as Graphviz DOT text (``dot -Tsvg``), with the same labels and colours.

    Examples
    --------
    >>> from layout_prop.api import analyze
    >>> from layout_prop.io.loader import load_spec
    >>> g = analyze(load_spec('''
    ... mesh: {shape: [2], names: [tp]}
    ... inputs: {a: {shape: [4]}}
    ... nodes: [{name: b, op: add, inputs: [a, a]}]
    ... ''')).graph
    >>> [line.strip() for line in graph_dot(g).splitlines() if "->" in line][0][:14]
    '"a" -> "b" [la'
    """
    facts = _Facts(graph, _checked(graph, check))
    colours = axis_colours(graph.mesh)
    heading = [[Span(title or "layout-prop graph", bold=True)], facts.subtitle(colours)]
    out = [
        'digraph "layout-prop" {',
        f'  graph [rankdir=LR, fontname="DejaVu Sans Mono", fontsize=12, labelloc=t, labeljust=l, '
        f'label=<<TABLE BORDER="0"><TR><TD ALIGN="LEFT">{_dot_html(heading, left=True)[1:-1]}</TD></TR>'
        f'<TR><TD ALIGN="LEFT">{_dot_legend(graph.mesh, colours)}</TD></TR></TABLE>>];',
        '  node [fontname="DejaVu Sans Mono", fontsize=11, shape=box];',
        '  edge [fontname="DejaVu Sans Mono", fontsize=10];',
    ]
    for node in graph.nodes:
        kind = _node_kind(node)
        violated = bool(facts.violations.get(node.name))
        attrs = {
            "shape": "hexagon" if kind == "redistribute" else "box",
            "style": '"rounded,filled"' if kind == "input" else "filled",
            "fillcolor": f'"{NODE_FILLS[kind]}"',
            "color": f'"{VIOLATION_RED if violated else INK}"',
            "penwidth": "2.6" if violated or facts.is_output(node) else "1.2",
            "label": _dot_html([list(spans) for spans, _, _ in _node_lines(node, facts, colours)]),
            "tooltip": _dot_id(_info_text(facts.node_info(node))).replace("\n", "\\n"),
        }
        out.append(f"  {_dot_id(node.name)} [{', '.join(f'{k}={v}' for k, v in attrs.items())}];")
    for node in graph.nodes:
        for key, value in enumerate(node.inputs):
            producer, out_index = graph.producer(value)
            violations = facts.edge_violations(node.name, value)
            labels = _edge_labels(_spec_of(graph, value), producer, out_index, violations,
                                  facts.moves.get((node.name, value)), colours)
            colour = VIOLATION_RED if violations else EDGE_COLOUR
            out.append(f"  {_dot_id(producer.name)} -> {_dot_id(node.name)} [label={_dot_html(labels)}, "
                       f'color="{colour}", penwidth={2.0 if violations else 1.3}, '
                       f"tooltip={_dot_id(f'{value} -> {node.name}, input {key}')}];")
    out.append("}")
    return "\n".join(out) + "\n"


def _dot_legend(mesh: DeviceMesh, colours: dict[str, str]) -> str:
    """The legend as a Graphviz HTML table (it goes in the graph's label, so it adds no node)."""
    cells = []
    for axis, (name, size) in enumerate(zip(mesh.names, mesh.shape)):
        cells.append(f'<TD BGCOLOR="{colours[name]}" WIDTH="14"> </TD>'
                     f'<TD ALIGN="LEFT">{html.escape(name)} (mesh axis {axis}, {size} ranks)</TD>')
    for kind in ("input", "op", "backward", "redistribute"):
        style = ' STYLE="ROUNDED"' if kind == "input" else ""
        label = "hexagon: " + KIND_TEXT[kind] if kind == "redistribute" else KIND_TEXT[kind]
        cells.append(f'<TD BGCOLOR="{NODE_FILLS[kind]}" BORDER="1"{style} WIDTH="24"> </TD>'
                     f'<TD ALIGN="LEFT">{label}</TD>')
    cells.append(f'<TD BORDER="2" COLOR="{INK}" WIDTH="24"> </TD><TD ALIGN="LEFT">graph output</TD>')
    cells.append(f'<TD BORDER="2" COLOR="{VIOLATION_RED}" WIDTH="24"> </TD>'
                 f'<TD ALIGN="LEFT"><FONT COLOR="{VIOLATION_RED}">violation, with its code</FONT></TD>')
    return ('<TABLE BORDER="0" CELLSPACING="3" CELLPADDING="1"><TR><TD ALIGN="LEFT"><B>legend</B></TD>'
            + "".join(cells) + "</TR></TABLE>")


def grid_dot(grid: Grid, *, name: str = "", title: str = "") -> str:
    """A tensor's grid as Graphviz DOT text: one HTML table per panel, cells sized to scale.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> from layout_prop.viz.grid import tensor_grid
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> text = grid_dot(tensor_grid(TensorSpec((4, 6), "float32", Layout(mesh, ["S(1)"], 2))), name="w")
    >>> text.count("<TD BGCOLOR"), "rank<BR/>1" in text
    (2, True)
    """
    spec = grid.spec
    colours = axis_colours(spec.mesh)
    heading = [[Span(title or "layout-prop tensor grid", MUTED)],
               [Span(f"{name or 'tensor'}: {spec.dtype}{list(spec.shape)} ", bold=True)]
               + _placement_spans(spec.layout, colours),
               _axis_cut_spans("rows", grid.row_dim, grid, colours),
               _axis_cut_spans("columns", grid.col_dim, grid, colours)]
    heading += [[Span(line)] for line in grid.caption()]
    out = [f"digraph {_dot_id('tensor ' + (name or 'grid'))} {{",
           f'  graph [fontname="DejaVu Sans Mono", fontsize=12, labelloc=t, labeljust=l, label={_dot_html(heading, left=True)}];',
           '  node [shape=plaintext, fontname="DejaVu Sans Mono", fontsize=10];']
    width = _extent(grid.col_sizes, 360.0, 56.0, 900.0) * 0.75
    height = _extent(grid.row_sizes, 140.0, 46.0, 520.0) * 0.75 if grid.row_dim is not None else 40.0
    for p, panel in enumerate(grid.panels):
        rows = [f'<TR><TD BORDER="0">{html.escape(panel.label())}</TD>'
                + "".join(f'<TD BORDER="0">{a}:{b}</TD>' for a, b in zip(grid.col_edges, grid.col_edges[1:]))
                + "</TR>"]
        for i, (r0, r1) in enumerate(zip(grid.row_edges, grid.row_edges[1:])):
            head = f"{r0}:{r1}" if grid.row_dim is not None else ""
            cells = []
            for j, size in enumerate(grid.col_sizes):
                cell = grid.cell(i, j, p)
                w = max(int(width * size / max(sum(grid.col_sizes), 1)), 24)
                h = max(int(height * grid.row_sizes[i] / max(sum(grid.row_sizes), 1)), 24)
                text = "<BR/>".join(html.escape(line) for line in _cell_lines(grid, cell, 1000, 1000))
                fill = CELL_FILLS[(i * grid.ncols + j) % len(CELL_FILLS)]
                style = ' STYLE="dashed"' if grid.partial else ""
                cells.append(f'<TD BGCOLOR="{fill}" WIDTH="{w}" HEIGHT="{h}"{style}>{text}</TD>')
            rows.append(f'<TR><TD BORDER="0">{head}</TD>{"".join(cells)}</TR>')
        table = '<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="4">' + "".join(rows) + "</TABLE>"
        out.append(f"  {_dot_id(f'panel {p}')} [label=<{table}>];")
    out.append("}")
    return "\n".join(out) + "\n"
