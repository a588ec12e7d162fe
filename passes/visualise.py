"""visualise: draw a propagated graph, or one tensor's sharding, as HTML, SVG, PNG or DOT.

An analysis pass: it only reads node metadata (``specs``, ``violations``, ``wants``,
``inserted_by``, ``grad_of``) and the :class:`~layout_prop.passes.check.CheckResult`.

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

import argparse
import html
import json
import textwrap
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any, Sequence


from layout_prop import meta
from layout_prop.errors import LayoutPropError, Violation
from layout_prop.graph import Graph, Node
from layout_prop.layout import Layout
from layout_prop.mesh import DeviceMesh
from layout_prop.placement import Replicate
from layout_prop.redistribute import Plan, Step, plan_redistribution
from layout_prop.registry import get_rule
from layout_prop.spec import TensorSpec

from .check import Check, CheckResult

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
    "add_viz_parser",
    "axis_colours",
    "cmd_viz",
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

FORMATS = ("html", "svg", "png", "dot")


class VizError(LayoutPropError):
    """A picture that cannot be made as asked: unknown format or value, bad dims, no matplotlib."""


# --------------------------------------------------------------------------- colours and text
INK = "#1F2328"
MUTED = "#57606A"
EDGE_COLOUR = "#6E7781"
VIOLATION_RED = "#C81E1E"
HATCH_COLOUR = "#57606A"
NODE_FILLS = {"input": "#EAF0F7", "op": "#FFFFFF", "backward": "#F1EAFB", "redistribute": "#FFF1CC"}
KIND_TEXT = {
    "input": "graph input",
    "op": "op",
    "backward": "backward (gradient) op",
    "redistribute": "redistribution",
}
AXIS_PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#8C6D1F", "#6A3D9A", "#117A65")
KNOWN_AXIS_COLOURS = {"dp": "#0072B2", "tp": "#E69F00", "sp": "#009E73", "cp": "#CC79A7", "pp": "#56B4E9",
                      "ep": "#8C6D1F"}
CELL_FILLS = ("#E3EEF9", "#FDF0D9", "#E2F3EA", "#F6E6F0", "#E6F4FB", "#F1ECDD", "#ECE6F5", "#E1F0EC")
FONT_FAMILY = "DejaVu Sans Mono, Menlo, Consolas, monospace"
CHAR_WIDTH = 0.602  # advance width of DejaVu Sans Mono, in font sizes


def text_width(text: str, size: float) -> float:
    """The width in pixels of ``text`` set in the monospace font at ``size`` pixels.

    >>> text_width("abcd", 10.0)
    24.08
    """
    return round(len(text) * size * CHAR_WIDTH, 6)


def axis_colours(mesh: DeviceMesh) -> dict[str, str]:
    """One fixed colour per mesh axis name.

    Common names always get the same colour (``dp`` blue, ``tp`` orange, ``sp`` green,
    ``cp``, ``pp``, ``ep``); any other name gets a colour picked from its name's CRC, the
    next free one if another axis of the mesh has it already.  Red is kept for violations.

    Examples
    --------
    >>> axis_colours(DeviceMesh((2, 2), ("dp", "tp")))
    {'dp': '#0072B2', 'tp': '#E69F00'}
    >>> axis_colours(DeviceMesh((2, 2), ("tp", "dp")))["dp"]
    '#0072B2'
    """
    chosen: dict[str, str] = {name: KNOWN_AXIS_COLOURS[name] for name in mesh.names if name in KNOWN_AXIS_COLOURS}
    used = set(chosen.values())
    for name in mesh.names:
        if name in chosen:
            continue
        start = zlib.crc32(name.encode("utf-8")) % len(AXIS_PALETTE)
        colour = AXIS_PALETTE[start]
        for step in range(len(AXIS_PALETTE)):
            candidate = AXIS_PALETTE[(start + step) % len(AXIS_PALETTE)]
            if candidate not in used:
                colour = candidate
                break
        chosen[name] = colour
        used.add(colour)
    return {name: chosen[name] for name in mesh.names}


# --------------------------------------------------------------------------- the scene
@dataclass(frozen=True)
class Span:
    """A run of text in one colour."""

    text: str
    colour: str = INK
    bold: bool = False


@dataclass(frozen=True)
class Text:
    """One line of text; ``y`` is the baseline, ``anchor`` is start, middle or end."""

    x: float
    y: float
    spans: tuple[Span, ...]
    size: float = 12.0
    anchor: str = "start"

    @property
    def content(self) -> str:
        return "".join(span.text for span in self.spans)

    @property
    def width(self) -> float:
        return text_width(self.content, self.size)


@dataclass(frozen=True)
class Shape:
    """A polygon (``closed``) or a polyline; ``rect`` set for rectangles (``radius`` rounds them).

    ``hatch`` overlays diagonal hatching (Partial blocks); ``hit`` marks an invisible wide
    line that only makes an edge easier to hover in the HTML page.
    """

    points: tuple[tuple[float, float], ...]
    fill: str | None = None
    stroke: str | None = INK
    width: float = 1.0
    closed: bool = True
    dash: bool = False
    hatch: bool = False
    radius: float = 0.0
    rect: tuple[float, float, float, float] | None = None
    hit: bool = False


def rect(x: float, y: float, w: float, h: float, **style: Any) -> Shape:
    """A rectangle :class:`Shape` with its top-left corner at ``(x, y)``."""
    return Shape(((x, y), (x + w, y), (x + w, y + h), (x, y + h)), rect=(x, y, w, h), **style)


@dataclass
class Item:
    """Shapes and texts drawn together; with an ``id`` the HTML page can show its ``info``."""

    shapes: list
    id: str | None = None
    kind: str = ""
    title: str = ""


@dataclass
class Scene:
    """A picture in pixels: items, plus what the HTML page's side panel shows.

    ``info`` maps an item id to ``{"title", "rows": [[key, value]...], "sections":
    [{"heading", "rows", "alert"}...]}``; ``summary`` is shown before anything is picked.
    """

    width: float
    height: float
    items: list[Item]
    title: str = ""
    summary: list[str] = field(default_factory=list)
    info: dict[str, dict] = field(default_factory=dict)

    def texts(self) -> list[str]:
        """Every line of text in the scene."""
        return [shape.content for item in self.items for shape in item.shapes if isinstance(shape, Text)]


def _placement_spans(layout: Layout, colours: dict[str, str]) -> list[Span]:
    spans = [Span("(")]
    for axis, placement in enumerate(layout.placements):
        if axis:
            spans.append(Span(", "))
        if isinstance(placement, Replicate):
            spans.append(Span(str(placement), MUTED))
        else:
            spans.append(Span(str(placement), colours[layout.mesh.names[axis]], bold=True))
    spans.append(Span(")"))
    return spans


def _mesh_spans(mesh: DeviceMesh, colours: dict[str, str]) -> list[Span]:
    spans: list[Span] = []
    for axis, (name, size) in enumerate(zip(mesh.names, mesh.shape)):
        if axis:
            spans.append(Span(" × "))
        spans += [Span(name, colours[name], bold=True), Span(f"={size}")]
    return spans


def _step_text(step: Step) -> str:
    kind = step.kind + (f"({step.reduce_op})" if step.reduce_op else "")
    dims = ""
    if step.dim is not None:
        dims = f", dim {step.dim}" + (f" -> {step.dst_dim}" if step.dst_dim is not None else "")
    return f"{kind} on {step.mesh_axis_name}{dims}: {step.bytes_per_rank:,} B per rank"


def _step_spans(step: Step, colours: dict[str, str]) -> list[Span]:
    kind = step.kind + (f"({step.reduce_op})" if step.reduce_op else "")
    return [Span(kind + " on "), Span(step.mesh_axis_name, colours[step.mesh_axis_name], bold=True),
            Span(f": {step.bytes_per_rank:,} B")]


def _tensor_map_text(spec: TensorSpec) -> str:
    return json.dumps(spec.to_dict()["tensor_map"])


def _spec_rows(spec: TensorSpec | None) -> list[list[str]]:
    if spec is None:
        return [["layout", "unknown (its producer has a violation)"]]
    return [
        ["shape", str(list(spec.shape))],
        ["dtype", spec.dtype],
        ["placements", str(spec.layout)],
        ["tensor_map", _tensor_map_text(spec)],
        ["local shape (rank 0)", str(list(spec.local_shape(0)))],
        ["bytes (rank 0 / all)", f"{spec.local_nbytes(0):,} / {spec.nbytes:,}"],
    ]


def _plan_rows(plan: Plan) -> list[list[str]]:
    rows = [["from", str(plan.src.layout)], ["to", str(plan.dst.layout)]]
    if not plan.steps:
        rows.append(["steps", "none (a relabel on size-1 mesh axes)"])
    for number, step in enumerate(plan.steps, 1):
        rows.append([f"step {number}", _step_text(step)])
    rows.append(["bytes per rank", f"{plan.bytes_per_rank:,}"])
    return rows


def _violation_section(v: Violation) -> dict:
    rows = [["node", str(v.node)], ["op", str(v.op)]]
    if v.input is not None:
        rows.append(["input", f"{v.input} (operand {v.operand})" if v.operand else str(v.input)])
    rows += [["message", v.message], ["fix", v.hint]]
    return {"heading": f"violation {v.code}", "rows": rows, "alert": True}


def _info_text(info: dict) -> str:
    """The plain-text form of an item's info, for the SVG ``<title>`` tooltip."""
    lines = [info["title"]]
    lines += [f"{key}: {value}" for key, value in info.get("rows", ())]
    for section in info.get("sections", ()):
        lines.append(section["heading"])
        lines += [f"  {key}: {value}" for key, value in section["rows"]]
    return "\n".join(lines)


# --------------------------------------------------------------------------- graph facts
def _spec_of(graph: Graph, value: str) -> TensorSpec | None:
    node, index = graph.producer(value)
    specs = node.meta.get(meta.SPECS, ())
    return specs[index] if index < len(specs) else None


def _node_kind(node: Node) -> str:
    if node.is_input:
        return "input"
    if node.op == "redistribute" or node.meta.get(meta.INSERTED_BY) == "reshard":
        return "redistribute"
    if node.meta.get(meta.INSERTED_BY) == "backward":
        return "backward"
    return "op"


def _checked(graph: Graph, check: CheckResult | None) -> CheckResult:
    """``check``, or the check pass's result; refuses a graph that was never propagated."""
    missing = [node.name for node in graph.nodes if meta.SPECS not in node.meta]
    if missing:
        raise VizError("not-propagated", f"nodes {missing[:5]} have no layouts yet",
                       hint="run layout_prop.api.analyze(graph) (or the propagate pass) before drawing")
    return check if check is not None else Check().run(graph)


def _plan_or_none(src: TensorSpec | None, dst: Layout | None) -> Plan | None:
    if src is None or dst is None:
        return None
    try:
        return plan_redistribution(src, dst)
    except LayoutPropError:
        return None


class _Facts:
    """What the drawing needs from the graph and the check result, computed once."""

    def __init__(self, graph: Graph, check: CheckResult) -> None:
        self.graph = graph
        self.check = check
        self.violations: dict[str, list[Violation]] = defaultdict(list)
        for v in check.violations:
            self.violations[v.node].append(v)
        self.node_plans: dict[str, Plan] = {}
        for node in graph.nodes:
            if node.op == "redistribute" and node.inputs:
                specs = node.meta.get(meta.SPECS, ())
                target = specs[0].layout if specs and specs[0] is not None else None
                plan = _plan_or_none(_spec_of(graph, node.inputs[0]), target)
                if plan is not None:
                    self.node_plans[node.name] = plan
        # (consumer, value) -> (plan, how): "implicit" free slices and "fix" for fixable violations
        self.moves: dict[tuple[str, str], tuple[Plan, str]] = {}
        for r in check.redistributions:
            if not r.explicit:
                self.moves[(r.node, r.input)] = (r.plan, "implicit")
        for node in graph.nodes:
            wants = node.meta.get(meta.WANTS) or ()
            for v in self.violations.get(node.name, ()):
                if v.fixable and v.input in node.inputs:
                    index = node.inputs.index(v.input)
                    want = wants[index] if index < len(wants) else None
                    plan = _plan_or_none(_spec_of(graph, v.input), want)
                    if plan is not None:
                        self.moves[(node.name, v.input)] = (plan, "fix")
        self.outputs = set(graph.outputs)

    def is_output(self, node: Node) -> bool:
        return any(value in self.outputs for value in node.outputs)

    def edge_violations(self, consumer: str, value: str) -> list[Violation]:
        return [v for v in self.violations.get(consumer, ()) if v.input == value]

    def summary(self) -> list[str]:
        graph, check = self.graph, self.check
        mesh = graph.mesh
        lines = [f"mesh {' × '.join(f'{n}={s}' for n, s in zip(mesh.names, mesh.shape))} ({mesh.size} ranks), "
                 f"{len(graph)} nodes, {graph.nx.number_of_edges()} edges"]
        if check.violations:
            lines.append(f"{len(check.violations)} violation(s):")
            lines += [f"[{v.code}] {v.node}, input {v.input}: {v.message} (fix: {v.hint})" for v in check.violations]
        else:
            lines.append("no violations")
        for r in check.redistributions:
            steps = ", ".join(f"{s.kind} on {s.mesh_axis_name}" for s in r.plan.steps) or "relabel"
            lines.append(f"redistribution of {r.input} for {r.node}: {steps}, {r.plan.bytes_per_rank:,} B per rank")
        if check.redistributions:
            lines.append(f"total: {check.total_bytes_per_rank:,} B per rank")
        return lines

    def subtitle(self, colours: dict[str, str]) -> list[Span]:
        check = self.check
        spans = [Span("mesh ")] + _mesh_spans(self.graph.mesh, colours)
        spans.append(Span(f" · {len(self.graph)} nodes · "))
        count = len(check.violations)
        spans.append(Span(f"{count} violation{'s' if count != 1 else ''}", VIOLATION_RED if count else INK, bold=True))
        moves = len(check.redistributions)
        spans.append(Span(f" · {moves} redistribution{'s' if moves != 1 else ''}, "
                          f"{check.total_bytes_per_rank:,} B per rank"))
        return spans

    def node_info(self, node: Node) -> dict:
        rows = [["op", node.op], ["kind", KIND_TEXT[_node_kind(node)]]]
        if node.inputs:
            rows.append(["inputs", ", ".join(node.inputs)])
        attrs = node.meta.get(meta.ATTRS, node.attrs) if not node.is_input else {
            "requires_grad": node.attrs.get("requires_grad")}
        if attrs:
            rows.append(["attrs", json.dumps(attrs, sort_keys=True, default=str)])
        if node.meta.get(meta.GRAD_OF):
            rows.append(["gradient of", node.meta[meta.GRAD_OF]])
        if node.meta.get(meta.INSERTED_BY):
            rows.append(["inserted by", node.meta[meta.INSERTED_BY]])
        if self.is_output(node):
            rows.append(["graph output", ", ".join(v for v in node.outputs if v in self.outputs)])
        sections = []
        for value, spec in zip(node.outputs, node.meta.get(meta.SPECS, ())):
            sections.append({"heading": f"value {value}", "rows": _spec_rows(spec)})
        plan = self.node_plans.get(node.name)
        if plan is not None:
            sections.append({"heading": "redistribution", "rows": _plan_rows(plan)})
        sections += [_violation_section(v) for v in self.violations.get(node.name, ())]
        return {"title": node.name, "rows": rows, "sections": sections}

    def edge_info(self, edge: "_Edge") -> dict:
        consumer = self.graph.node(edge.dst)
        operand = get_rule(consumer.op).operand_name(edge.key)
        rows = [["value", edge.value], ["from", edge.src], ["to", f"{edge.dst}, input {edge.key} ({operand})"]]
        sections = [{"heading": f"value {edge.value}", "rows": _spec_rows(edge.spec)}]
        wants = consumer.meta.get(meta.WANTS) or ()
        want = wants[edge.key] if edge.key < len(wants) else None
        if want is not None and (edge.spec is None or want != edge.spec.layout):
            rows.append(["kernel wants", str(want)])
        if consumer.op == "redistribute" and edge.dst in self.node_plans:
            sections.append({"heading": "redistribution (node " + edge.dst + ")",
                             "rows": _plan_rows(self.node_plans[edge.dst])})
        elif edge.move is not None:
            plan, how = edge.move
            heading = {"implicit": "redistribution (local, done by the kernel's lowering)",
                       "fix": "redistribution that fixes it (--reshard inserts it)"}[how]
            sections.append({"heading": heading, "rows": _plan_rows(plan)})
        else:
            rows.append(["redistribution", "none needed"])
        sections += [_violation_section(v) for v in edge.violations]
        return {"title": f"{edge.value} -> {edge.dst}", "rows": rows, "sections": sections}


# --------------------------------------------------------------------------- graph layout
NODE_FONT = 12.0
NODE_LINE = 15.0
LABEL_FONT = 11.0
LABEL_LINE = 13.5
PAD = 8.0
HEX = 12.0  # how far a hexagon's side points stick out
DIAG = 76.0  # horizontal room in which edges change height between layers
NODE_GAP = 26.0
MARGIN = 20.0
ARROW = 8.0
MAX_SPAN = 3  # layers an edge from a graph input may skip before the input is drawn again
TITLE_HEIGHT = 52.0


@dataclass
class _Vertex:
    """A node of the drawing, or (``node is None``) a bend point of an edge that skips layers."""

    key: str
    layer: int
    node: Node | None = None
    kind: str = "dummy"
    lines: list = field(default_factory=list)  # (spans, font size, line height)
    w: float = 0.0
    h: float = 8.0
    in_top: float = 0.0
    in_gap: float = 0.0
    x: float = 0.0
    y: float = 0.0
    alias: bool = False  # a graph input drawn again just before far consumers

    def in_port(self, index: int) -> float:
        """Height of input ``index``'s arrow below the top."""
        if self.node is None:
            return self.h / 2
        return self.in_top + (index + 1) * self.in_gap

    def out_port(self, index: int) -> float:
        """Height of output ``index``'s edges below the top."""
        if self.node is None:
            return self.h / 2
        return self.h * (index + 1) / (self.node.num_outputs + 1)

    def _bulge(self, y: float) -> float:
        if self.kind != "redistribute":
            return 0.0
        return HEX * abs(y - (self.y + self.h / 2)) / (self.h / 2)

    def left(self, y: float) -> float:
        return self.x + self._bulge(y)

    def right(self, y: float) -> float:
        return self.x + self.w - self._bulge(y)


@dataclass
class _Edge:
    index: int
    src: str
    dst: str
    key: int
    value: str
    out_index: int
    spec: TensorSpec | None
    labels: list
    violations: list
    move: tuple[Plan, str] | None
    chain: list = field(default_factory=list)


def _node_lines(node: Node, facts: _Facts, colours: dict[str, str]) -> list:
    specs = node.meta.get(meta.SPECS, ())
    spec = specs[0] if specs else None
    lines: list[list[Span]] = [[Span(node.name, bold=True)]]
    if node.is_input:
        shape = list(spec.shape) if spec is not None else list(node.attrs.get("shape") or [])
        dtype = spec.dtype if spec is not None else node.attrs.get("dtype", "")
        lines.append([Span(f"input {dtype}{shape}", MUTED)])
    elif node.op == "redistribute" and spec is not None:
        lines.append([Span("redistribute → ", MUTED)] + _placement_spans(spec.layout, colours))
    else:
        lines.append([Span(node.op, MUTED)])
    if node.meta.get(meta.GRAD_OF):
        lines.append([Span(f"gradient of {node.meta[meta.GRAD_OF]}", MUTED)])
    plan = facts.node_plans.get(node.name)
    if plan is not None:
        lines += [_step_spans(step, colours) for step in plan.steps]
        lines.append([Span(f"{plan.bytes_per_rank:,} B per rank" if plan.steps else "relabel, 0 B", bold=True)])
    codes = []
    for v in facts.violations.get(node.name, ()):
        if v.code not in codes:
            codes.append(v.code)
    lines += [[Span("✗ " + code, VIOLATION_RED, bold=True)] for code in codes]
    sized = [(tuple(line), NODE_FONT, NODE_LINE) for line in lines]
    return sized


def _edge_labels(spec: TensorSpec | None, producer: Node, out_index: int, violations: list[Violation],
                 move: tuple[Plan, str] | None, colours: dict[str, str]) -> list[tuple[Span, ...]]:
    first: list[Span] = []
    if producer.num_outputs > 1:
        first.append(Span(f":{out_index} ", MUTED))
    if spec is None:
        first.append(Span("layout unknown", MUTED))
    else:
        first += _placement_spans(spec.layout, colours)
    labels = [tuple(first)]
    if spec is not None:
        labels.append((Span(f"local {list(spec.local_shape(0))}", MUTED),))
    if move is not None and move[1] == "implicit":
        plan = move[0]
        labels.append(tuple([Span("sliced to ", MUTED)] + _placement_spans(plan.dst.layout, colours)))
    labels += [(Span("✗ " + v.code, VIOLATION_RED, bold=True),) for v in violations]
    return labels


def _collect(graph: Graph, facts: _Facts, colours: dict[str, str]) -> tuple[dict[str, _Vertex], list[_Edge]]:
    vertices: dict[str, _Vertex] = {}
    for node in graph.nodes:
        vertices[node.name] = _Vertex(node.name, 0, node, _node_kind(node), _node_lines(node, facts, colours))
    edges: list[_Edge] = []
    for node in graph.nodes:
        for key, value in enumerate(node.inputs):
            producer, out_index = graph.producer(value)
            spec = _spec_of(graph, value)
            violations = facts.edge_violations(node.name, value)
            move = facts.moves.get((node.name, value))
            labels = _edge_labels(spec, producer, out_index, violations, move, colours)
            edges.append(_Edge(len(edges), producer.name, node.name, key, value, out_index, spec, labels,
                               violations, move))
    return vertices, edges


def _assign_layers(graph: Graph, vertices: dict[str, _Vertex], edges: list[_Edge]) -> int:
    """Topological generations; a source moves right to just before its first consumer.

    An edge that skips layers bends through one point per layer it crosses.  A source
    whose consumer lies more than :data:`MAX_SPAN` layers further is drawn again (an
    alias, dashed) just before that consumer, so a weight read by every block of a deep
    model adds one box per block, not a line through all of them.
    """
    import networkx as nx

    layer: dict[str, int] = {}
    for number, generation in enumerate(nx.topological_generations(graph.nx)):
        for name in generation:
            layer[name] = number
    for name in graph.nx.nodes:
        if graph.nx.in_degree(name) == 0 and graph.nx.out_degree(name) > 0:
            layer[name] = min(layer[s] for s in graph.nx.successors(name)) - 1
    for name, vertex in vertices.items():
        vertex.layer = layer[name]
    for edge in edges:
        start = edge.src
        if graph.nx.in_degree(edge.src) == 0 and layer[edge.dst] - 1 - layer[edge.src] > MAX_SPAN:
            start = f"{edge.src}~alias~{layer[edge.dst] - 1}"
            if start not in vertices:
                source = vertices[edge.src]
                vertices[start] = _Vertex(start, layer[edge.dst] - 1, source.node, source.kind, source.lines,
                                          alias=True)
                layer[start] = layer[edge.dst] - 1
        chain = [start]
        for number in range(layer[start] + 1, layer[edge.dst]):
            key = f"~{edge.index}~{number}"
            vertices[key] = _Vertex(key, number)
            chain.append(key)
        chain.append(edge.dst)
        edge.chain = chain
    return max(layer.values(), default=-1) + 1


def _segments(edges: list[_Edge], vertices: dict[str, _Vertex]):
    """Each piece of each edge between adjacent layers: (upper key, its port, lower key, its port)."""
    for edge in edges:
        for a, b in zip(edge.chain, edge.chain[1:]):
            out = vertices[a].out_port(edge.out_index) if a == edge.chain[0] else vertices[a].h / 2
            into = vertices[b].in_port(edge.key) if b == edge.dst else vertices[b].h / 2
            yield a, out, b, into, edge


def _order_layers(graph: Graph, vertices: dict[str, _Vertex], edges: list[_Edge], count: int) -> list[list[str]]:
    """Order the vertices of each layer by the barycentre of their neighbours' ports (a few sweeps)."""
    insertion = {node.name: i for i, node in enumerate(graph.nodes)}
    origin = {key: insertion[key] for key in insertion}
    for edge in edges:
        origin[edge.chain[0]] = insertion[edge.src]
        for key in edge.chain[1:-1]:
            origin[key] = insertion[edge.src] + 0.5
    layers: list[list[str]] = [[] for _ in range(count)]
    for key in sorted(vertices, key=lambda k: origin[k]):
        layers[vertices[key].layer].append(key)
    preds: dict[str, list] = defaultdict(list)
    succs: dict[str, list] = defaultdict(list)
    for edge in edges:
        for a, b in zip(edge.chain, edge.chain[1:]):
            out_offset = _fraction(edge.out_index, graph.node(edge.src).num_outputs) if a == edge.chain[0] else 0.0
            in_offset = _fraction(edge.key, len(graph.node(b).inputs)) if b == edge.dst else 0.0
            succs[a].append((b, in_offset))
            preds[b].append((a, out_offset))
    position = {key: i for layer in layers for i, key in enumerate(layer)}
    for _ in range(4):
        for number in range(1, count):
            _sort_layer(layers[number], preds, position)
        for number in range(count - 2, -1, -1):
            _sort_layer(layers[number], succs, position)
    return layers


def _fraction(index: int, count: int) -> float:
    return (index + 1) / (count + 1) - 0.5


def _sort_layer(layer: list[str], neighbours: dict[str, list], position: dict[str, int]) -> None:
    def barycentre(key: str) -> float:
        found = neighbours.get(key)
        if not found:
            return float(position[key])
        return sum(position[other] + offset for other, offset in found) / len(found)

    keys = {key: (barycentre(key), position[key]) for key in layer}
    layer.sort(key=keys.__getitem__)
    for i, key in enumerate(layer):
        position[key] = i


def _size_vertices(vertices: dict[str, _Vertex], edges: list[_Edge]) -> None:
    label_heights: dict[str, list[float]] = defaultdict(list)
    for edge in edges:
        label_heights[edge.dst].append(len(edge.labels) * LABEL_LINE)
    for vertex in vertices.values():
        if vertex.node is None:
            continue
        widths = [text_width("".join(s.text for s in spans), size) for spans, size, _ in vertex.lines]
        vertex.w = max(widths) + 2 * PAD + (2 * HEX if vertex.kind == "redistribute" else 0)
        text_height = sum(line for _, _, line in vertex.lines)
        inputs = len(vertex.node.inputs)
        vertex.in_gap = max(label_heights[vertex.key], default=0.0) + 10 if inputs else 0.0
        needed = inputs * vertex.in_gap
        vertex.h = max(text_height + 2 * PAD, needed + 12, 36.0)
        vertex.in_top = (vertex.h - needed) / 2 - 2


def _pack(layer: list[str], vertices: dict[str, _Vertex], desired: dict[str, float]) -> None:
    """Place a layer's vertices in order, without overlap, as near their desired tops as can be.

    Pool adjacent vertices that would overlap into blocks placed at their members' mean
    desired position (least squares), as in isotonic regression.
    """
    blocks: list[list] = []  # [first index, last index + 1, top]

    def offsets(first: int, stop: int) -> list[float]:
        out, y = [], 0.0
        for key in layer[first:stop]:
            out.append(y)
            y += vertices[key].h + NODE_GAP
        return out

    def height(first: int, stop: int) -> float:
        return sum(vertices[k].h for k in layer[first:stop]) + NODE_GAP * (stop - first - 1)

    for i, key in enumerate(layer):
        blocks.append([i, i + 1, desired[key]])
        while len(blocks) > 1:
            upper, lower = blocks[-2], blocks[-1]
            if upper[2] + height(upper[0], upper[1]) + NODE_GAP <= lower[2]:
                break
            first, stop = upper[0], lower[1]
            offs = offsets(first, stop)
            top = sum(desired[layer[j]] - offs[j - first] for j in range(first, stop)) / (stop - first)
            blocks[-2:] = [[first, stop, top]]
    for first, stop, top in blocks:
        for j, off in zip(range(first, stop), offsets(first, stop)):
            vertices[layer[j]].y = top + off


def _assign_heights(layers: list[list[str]], vertices: dict[str, _Vertex], edges: list[_Edge]) -> None:
    tallest = 0.0
    for layer in layers:
        tallest = max(tallest, sum(vertices[k].h for k in layer) + NODE_GAP * max(len(layer) - 1, 0))
    for layer in layers:
        total = sum(vertices[k].h for k in layer) + NODE_GAP * max(len(layer) - 1, 0)
        y = (tallest - total) / 2
        for key in layer:
            vertices[key].y = y
            y += vertices[key].h + NODE_GAP
    segments = list(_segments(edges, vertices))
    into_layer: dict[int, list] = defaultdict(list)  # segments by the layer of their lower (right) end
    from_layer: dict[int, list] = defaultdict(list)  # segments by the layer of their upper (left) end
    for segment in segments:
        into_layer[vertices[segment[2]].layer].append(segment)
        from_layer[vertices[segment[0]].layer].append(segment)
    for sweep in range(8):  # alternately pull each layer towards its left, then its right neighbours' ports
        forward = sweep % 2 == 0
        order = range(1, len(layers)) if forward else range(len(layers) - 2, -1, -1)
        for number in order:
            pulls: dict[str, list[float]] = defaultdict(list)
            # a vertex's centre goes to the mean of its neighbours' ports (the centre of a consumer when
            # pulled back), so a long chain stays level instead of stepping to every input port
            if forward:  # aliases follow their consumers, never lead them
                for a, out, b, into, _ in into_layer[number]:
                    if not vertices[a].alias:
                        pulls[b].append(vertices[a].y + out - vertices[b].h / 2)
            else:
                for a, out, b, into, _ in from_layer[number]:
                    pulls[a].append(vertices[b].y + vertices[b].h / 2 - out)
            desired = {key: sum(pulls[key]) / len(pulls[key]) if pulls.get(key) else vertices[key].y
                       for key in layers[number]}
            _pack(layers[number], vertices, desired)


def draw_graph(graph: Graph, check: CheckResult | None = None, *, title: str = "") -> Scene:
    """Lay out and draw a propagated graph as a :class:`Scene`.

    Parameters
    ----------
    graph : Graph
        A graph whose nodes carry ``specs`` (run :func:`layout_prop.api.analyze` first).
    check : CheckResult, optional
        Its check result (computed when not given).
    title : str
        The first line of the picture (for example the spec's file name).

    Returns
    -------
    Scene
        Item ids are ``n<i>`` for nodes (graph order) and ``e<i>`` for edges.

    Raises
    ------
    VizError
        ``not-propagated`` when a node has no layouts.

    Examples
    --------
    >>> from layout_prop.api import analyze
    >>> from layout_prop.loader import load_spec
    >>> g = load_spec('''
    ... mesh: {shape: [2], names: [tp]}
    ... inputs:
    ...   a: {shape: [4, 6], placements: ["S(0)"]}
    ... nodes:
    ...   - {name: b, op: add, inputs: [a, a]}
    ... ''')
    >>> scene = draw_graph(analyze(g).graph, title="two adds")
    >>> "a" in scene.texts() and "b" in scene.texts() and "(S(0))" in scene.texts()
    True
    >>> sorted(scene.info)
    ['e0', 'e1', 'n0', 'n1']
    """
    facts = _Facts(graph, _checked(graph, check))
    colours = axis_colours(graph.mesh)
    vertices, edges = _collect(graph, facts, colours)
    count = _assign_layers(graph, vertices, edges)
    layers = _order_layers(graph, vertices, edges, count)
    _size_vertices(vertices, edges)
    _assign_heights(layers, vertices, edges)

    column = [max((vertices[k].w for k in layer), default=0.0) for layer in layers]
    band = [0.0] * count
    for edge in edges:
        widest = max(text_width("".join(s.text for s in line), LABEL_FONT) for line in edge.labels)
        band[vertices[edge.dst].layer] = max(band[vertices[edge.dst].layer], widest + 16)
    xs: list[float] = []
    for number in range(count):
        xs.append(MARGIN + band[0] if number == 0 else xs[-1] + column[number - 1] + DIAG + band[number])
    top = min((v.y for v in vertices.values()), default=0.0)
    for vertex in vertices.values():
        vertex.x = xs[vertex.layer]
        vertex.y += MARGIN + TITLE_HEIGHT - top

    items: list[Item] = []
    info: dict[str, dict] = {}
    ids = {node.name: f"n{i}" for i, node in enumerate(graph.nodes)}
    for edge in edges:
        item_id = f"e{edge.index}"
        info[item_id] = facts.edge_info(edge)
        items.append(_edge_item(edge, vertices, xs, column, band, item_id, info[item_id]))
    for node in graph.nodes:
        item_id = ids[node.name]
        info[item_id] = facts.node_info(node)
        items.append(_node_item(vertices[node.name], facts, item_id, info[item_id]))
    aliases = [v for v in vertices.values() if v.alias]
    for vertex in aliases:  # the same node again: same id, so hovering it shows the same details
        items.append(_node_item(vertex, facts, ids[vertex.node.name], info[ids[vertex.node.name]]))

    graph_right = max((xs[v.layer] + column[v.layer] for v in vertices.values()), default=MARGIN)
    graph_bottom = max((v.y + v.h for v in vertices.values()), default=MARGIN + TITLE_HEIGHT)
    heading = [Text(MARGIN, MARGIN + 14, (Span(title or "layout-prop graph", bold=True),), 15.0),
               Text(MARGIN, MARGIN + 34, tuple(facts.subtitle(colours)), 12.0)]
    items.insert(0, Item(heading, kind="heading"))
    legend, legend_w, legend_h = _graph_legend(graph.mesh, colours, graph_bottom + 30, bool(aliases))
    items.append(legend)
    width = max(graph_right, legend_w, MARGIN + max(t.width for t in heading)) + MARGIN
    height = graph_bottom + 30 + legend_h + MARGIN
    return Scene(width, height, items, title=title or "layout-prop graph", summary=facts.summary(), info=info)


def _node_item(vertex: _Vertex, facts: _Facts, item_id: str, info: dict) -> Item:
    node = vertex.node
    x, y, w, h = vertex.x, vertex.y, vertex.w, vertex.h
    violated = bool(facts.violations.get(node.name))
    stroke = VIOLATION_RED if violated else INK
    width = 2.6 if violated or facts.is_output(node) else 1.2
    fill = NODE_FILLS[vertex.kind]
    if vertex.kind == "redistribute":
        points = ((x + HEX, y), (x + w - HEX, y), (x + w, y + h / 2), (x + w - HEX, y + h), (x + HEX, y + h),
                  (x, y + h / 2))
        shapes: list = [Shape(points, fill=fill, stroke=stroke, width=width)]
    else:
        shapes = [rect(x, y, w, h, fill=fill, stroke=stroke, width=width, dash=vertex.alias,
                       radius=12.0 if vertex.kind == "input" else 3.0)]
    text_height = sum(line for _, _, line in vertex.lines)
    baseline = y + (h - text_height) / 2 + NODE_LINE * 0.78
    for spans, size, line in vertex.lines:
        shapes.append(Text(x + w / 2, baseline, spans, size, "middle"))
        baseline += line
    kind = f"node {vertex.kind}" + (" alias" if vertex.alias else "")
    return Item(shapes, item_id, kind, _info_text(info))


def _edge_item(edge: _Edge, vertices: dict[str, _Vertex], xs: list[float], column: list[float],
               band: list[float], item_id: str, info: dict) -> Item:
    source = vertices[edge.chain[0]]
    y = source.y + source.out_port(edge.out_index)
    points = [(source.right(y), y), (xs[source.layer] + column[source.layer] + 6, y)]
    for key in edge.chain[1:-1]:
        bend = vertices[key]
        yb = bend.y + bend.h / 2
        points += [(xs[bend.layer] - band[bend.layer], yb), (xs[bend.layer] + column[bend.layer] + 6, yb)]
    target = vertices[edge.dst]
    ty = target.y + target.in_port(edge.key)
    tip = target.left(ty)
    start = xs[target.layer] - band[target.layer]
    points += [(start, ty), (tip - ARROW, ty)]
    colour = VIOLATION_RED if edge.violations else EDGE_COLOUR
    width = 2.0 if edge.violations else 1.3
    shapes: list = [
        Shape(tuple(points), stroke="#000000", width=10.0, closed=False, hit=True),
        Shape(tuple(points), stroke=colour, width=width, closed=False),
        Shape(((tip - ARROW, ty - 4), (tip, ty), (tip - ARROW, ty + 4)), fill=colour, stroke=None),
    ]
    count = len(edge.labels)
    for number, spans in enumerate(edge.labels):
        shapes.append(Text(start + 6, ty - 5 - (count - 1 - number) * LABEL_LINE, spans, LABEL_FONT))
    return Item(shapes, item_id, "edge violated" if edge.violations else "edge", _info_text(info))


def _graph_legend(mesh: DeviceMesh, colours: dict[str, str], y: float,
                  aliases: bool = False) -> tuple[Item, float, float]:
    shapes: list = []
    x = MARGIN
    shapes.append(Text(x, y + 11, (Span("legend", bold=True),), 12.0))
    row = y + 22
    x = MARGIN
    shapes.append(Text(x, row + 11, (Span("mesh axes:", MUTED),), 11.0))
    x += text_width("mesh axes: ", 11.0) + 4
    for axis, (name, size) in enumerate(zip(mesh.names, mesh.shape)):
        shapes.append(rect(x, row + 1, 12, 12, fill=colours[name], stroke=None))
        label = f"{name} (mesh axis {axis}, {size} ranks)"
        shapes.append(Text(x + 17, row + 11, (Span(name, colours[name], bold=True), Span(label[len(name):])), 11.0))
        x += 17 + text_width(label, 11.0) + 18
    right = x
    row += 26
    x = MARGIN
    samples = [
        ("input", "graph input"),
        ("op", "op"),
        ("backward", "backward (gradient) op"),
        ("redistribute", "redistribution: steps, bytes per rank"),
        ("output", "graph output (thick border)"),
        ("violation", "violation (red, with its code)"),
    ]
    if aliases:
        samples.append(("alias", "input drawn again near a far consumer"))
    for kind, label in samples:
        w, h = 34.0, 18.0
        if kind == "redistribute":
            shapes.append(Shape(((x + 7, row), (x + w - 7, row), (x + w, row + h / 2), (x + w - 7, row + h),
                                 (x + 7, row + h), (x, row + h / 2)), fill=NODE_FILLS[kind], stroke=INK, width=1.2))
        elif kind == "alias":
            shapes.append(rect(x, row, w, h, fill=NODE_FILLS["input"], stroke=INK, width=1.2, radius=8.0, dash=True))
        elif kind in ("output", "violation"):
            shapes.append(rect(x, row, w, h, fill=NODE_FILLS["op"], radius=3.0, width=2.6,
                               stroke=VIOLATION_RED if kind == "violation" else INK))
        else:
            shapes.append(rect(x, row, w, h, fill=NODE_FILLS[kind], stroke=INK, width=1.2,
                               radius=8.0 if kind == "input" else 3.0))
        colour = VIOLATION_RED if kind == "violation" else INK
        shapes.append(Text(x + w + 6, row + 13, (Span(label, colour),), 11.0))
        x += w + 6 + text_width(label, 11.0) + 18
    right = max(right, x)
    row += 30
    x = MARGIN
    shapes.append(Shape(((x, row + 8), (x + 26, row + 8)), stroke=EDGE_COLOUR, width=1.3, closed=False))
    shapes.append(Shape(((x + 26, row + 4), (x + 34, row + 8), (x + 26, row + 12)), fill=EDGE_COLOUR, stroke=None))
    lines = [
        "edge label: the value's placements, one per mesh axis, coloured by axis (S(d) shards tensor dim d,",
        "R replicates, P(op) holds partial terms), then the local shape of rank 0; 'sliced to' marks a free",
        "local slice the kernel's lowering does; a red edge is an input that breaks the op's rule",
    ]
    for number, line in enumerate(lines):
        shapes.append(Text(x + 40, row + 12 + number * 15, (Span(line),), 11.0))
    right = max(right, x + 40 + max(text_width(line, 11.0) for line in lines))
    height = row + 12 + (len(lines) - 1) * 15 + 6 - y
    return Item(shapes, kind="legend"), right, height


# --------------------------------------------------------------------------- tensor grid
@dataclass(frozen=True)
class GridCell:
    """One block of a grid: every rank that holds it, and those ranks grouped by Partial term.

    ``terms`` has one group when the tensor is not Partial; otherwise one group per term
    (ranks that differ on a Partial mesh axis hold different terms of the block).
    """

    row: int
    col: int
    ranks: tuple[int, ...]
    terms: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class GridPanel:
    """The cells for one piece of every non-drawn sharded dim: ``fixed`` holds (dim, start, stop)."""

    fixed: tuple[tuple[int, int, int], ...]
    cells: tuple[GridCell, ...]

    def label(self) -> str:
        return ", ".join(f"dim {d} [{a}:{b}]" for d, a, b in self.fixed)


@dataclass(frozen=True)
class Grid:
    """Which ranks hold which block of a tensor, along two drawn dims.

    ``row_edges`` and ``col_edges`` are the block boundaries of the row and column dims
    (``(0, 1)`` for a missing row dim: a 1-D tensor is one row of columns).  ``panels``
    hold one grid of cells per combination of pieces of the non-drawn sharded dims
    (``split_dims``); ``whole_dims`` are held whole by every rank; ``empty_ranks`` hold an
    empty piece (uneven shards).
    """

    spec: TensorSpec
    row_dim: int | None
    col_dim: int | None
    row_edges: tuple[int, ...]
    col_edges: tuple[int, ...]
    panels: tuple[GridPanel, ...]
    whole_dims: tuple[int, ...]
    split_dims: tuple[int, ...]
    split_pieces: tuple[tuple[tuple[int, int], ...], ...]
    empty_ranks: tuple[int, ...]

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(d for d in (self.row_dim, self.col_dim) if d is not None)

    @property
    def row_sizes(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.row_edges, self.row_edges[1:]))

    @property
    def col_sizes(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.col_edges, self.col_edges[1:]))

    @property
    def nrows(self) -> int:
        return max(len(self.row_edges) - 1, 0)

    @property
    def ncols(self) -> int:
        return max(len(self.col_edges) - 1, 0)

    @property
    def partial(self) -> dict[str, str]:
        """Mesh axes (of more than one rank) on which the tensor is Partial -> reduce op."""
        mesh = self.spec.mesh
        return {mesh.names[a]: op for a, op in self.spec.layout.partial_axes().items() if mesh.shape[a] > 1}

    def cell(self, row: int, col: int, panel: int = 0) -> GridCell:
        return self.panels[panel].cells[row * self.ncols + col]

    def ranks(self, row: int, col: int, panel: int = 0) -> tuple[int, ...]:
        """Every rank that holds block ``(row, col)`` of ``panel``."""
        return self.cell(row, col, panel).ranks

    def blocks(self) -> dict[tuple[int, int, int], tuple[int, ...]]:
        """``(panel, row, col) -> ranks`` for every block."""
        return {(p, c.row, c.col): c.ranks for p, panel in enumerate(self.panels) for c in panel.cells}

    def caption(self) -> list[str]:
        """Sentences that summarise what the drawn dims do not show.

        >>> from layout_prop import DeviceMesh, Layout, TensorSpec
        >>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
        >>> tensor_grid(TensorSpec((4, 6, 8), "float32", Layout(mesh, ["S(0)", "S(2)"], 3)), dims=(0, 1)).caption()
        ['dim 2 split by tp into 2 pieces (4, 4): one panel per piece']
        """
        layout, mesh = self.spec.layout, self.spec.mesh
        lines = []
        if self.whole_dims:
            plural = "s" if len(self.whole_dims) > 1 else ""
            lines.append(f"dim{plural} {', '.join(map(str, self.whole_dims))} whole on every rank")
        for dim, pieces in zip(self.split_dims, self.split_pieces):
            axes = " then ".join(mesh.names[a] for a in layout.dim_axes(dim))
            sizes = ", ".join(str(b - a) for a, b in pieces)
            lines.append(f"dim {dim} split by {axes} into {len(pieces)} pieces ({sizes}): one panel per piece")
        replicated = [mesh.names[a] for a, p in enumerate(layout.placements) if isinstance(p, Replicate)
                      and mesh.shape[a] > 1]
        if replicated:
            lines.append(f"replicated on {', '.join(replicated)}: every rank listed in a block holds a copy of it")
        for name, op in self.partial.items():
            lines.append(f"P({op}) on {name}: a hatched block's rank groups (joined by +) hold terms; "
                         f"the block is their {op}")
        if self.empty_ranks:
            ranks = ", ".join(map(str, self.empty_ranks))
            lines.append(f"ranks {ranks} hold an empty piece (uneven shards)" if len(self.empty_ranks) > 1
                         else f"rank {ranks} holds an empty piece (uneven shards)")
        return lines


def _choose_dims(spec: TensorSpec, dims: Sequence[int] | None) -> tuple[int | None, int | None]:
    ndim = spec.ndim
    if dims is None:
        chosen = [d for d in range(ndim) if spec.layout.shard_count(d) > 1][:2]
        for d in range(ndim):
            if len(chosen) >= min(2, ndim):
                break
            if d not in chosen:
                chosen.append(d)
        chosen.sort()
    else:
        chosen = list(dims)
        hint = (f"give one or two distinct dims in {-ndim}..{ndim - 1}, such as --dims 0,{min(1, ndim - 1)}"
                if ndim else "a scalar has no dims to choose")
        where = f"for a tensor of shape {list(spec.shape)}"
        if not chosen or len(chosen) > 2 or (ndim and len(chosen) > ndim):
            raise VizError("bad-dims", f"dims {chosen} {where}: give one or two", hint=hint)
        for d in chosen:
            if isinstance(d, bool) or not isinstance(d, int) or not -ndim <= d < ndim:
                raise VizError("bad-dims", f"dim {d!r} is out of range {where}", hint=hint)
        chosen = [d % ndim for d in chosen]
        if len(set(chosen)) != len(chosen):
            raise VizError("bad-dims", f"dims {list(dims)} name the same dim twice {where}", hint=hint)
    if not chosen:
        return None, None
    if len(chosen) == 1:
        return None, chosen[0]
    return chosen[0], chosen[1]


def tensor_grid(spec: TensorSpec, dims: Sequence[int] | None = None) -> Grid:
    """Which ranks hold which block of ``spec``, along two drawn dims.

    Parameters
    ----------
    spec : TensorSpec
        The tensor, of any rank.
    dims : sequence of int, optional
        The dims drawn as rows and columns (one dim: columns only).  Default: the
        sharded dims (the first two), completed with the lowest other dims, ascending.

    Returns
    -------
    Grid
        Block boundaries per drawn dim (the union of every rank's ``torch.chunk`` piece,
        so uneven shards keep their sizes) and, per panel, each block's ranks.

    Raises
    ------
    VizError
        ``bad-dims`` when ``dims`` is out of range, repeats a dim or has more than two.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
    >>> g = tensor_grid(TensorSpec((4, 6, 8), "float32", Layout(mesh, ["S(0)", "R"], 3)))
    >>> g.dims, g.row_edges, g.col_edges, g.whole_dims
    ((0, 1), (0, 2, 4), (0, 6), (2,))
    >>> g.ranks(0, 0), g.ranks(1, 0)
    ((0, 1), (2, 3))
    >>> p = tensor_grid(TensorSpec((4, 6), "float32", Layout(mesh, ["S(1)", "P(sum)"], 2)))
    >>> p.dims, p.cell(0, 1).ranks, p.cell(0, 1).terms
    ((0, 1), (2, 3), ((2,), (3,)))
    """
    row_dim, col_dim = _choose_dims(spec, dims)
    mesh = spec.mesh
    slices = [spec.local_slices(rank) for rank in range(mesh.size)]
    empty = tuple(rank for rank, s in enumerate(slices) if any(b <= a for a, b in s))
    holders = [rank for rank in range(mesh.size) if rank not in empty]
    pieces = {d: tuple(sorted({slices[r][d] for r in holders})) for d in range(spec.ndim)}
    drawn = {d for d in (row_dim, col_dim) if d is not None}
    split = tuple(d for d in range(spec.ndim) if d not in drawn and len(pieces[d]) > 1)
    whole = tuple(d for d in range(spec.ndim) if d not in drawn and d not in split)

    def edges(dim: int | None) -> tuple[int, ...]:
        if dim is None:
            return (0, 1)
        return tuple(sorted({end for piece in pieces[dim] for end in piece}))

    def holds(rank: int, dim: int | None, start: int, stop: int) -> bool:
        if dim is None:
            return True
        lo, hi = slices[rank][dim]
        return lo <= start and stop <= hi

    row_edges, col_edges = edges(row_dim), edges(col_dim)
    partial_axes = sorted(spec.layout.partial_axes())
    panels = []
    for combo in product(*(pieces[d] for d in split)):
        fixed = tuple((d, a, b) for d, (a, b) in zip(split, combo))
        cells = []
        for i, (r0, r1) in enumerate(zip(row_edges, row_edges[1:])):
            for j, (c0, c1) in enumerate(zip(col_edges, col_edges[1:])):
                ranks = tuple(r for r in holders if holds(r, row_dim, r0, r1) and holds(r, col_dim, c0, c1)
                              and all(slices[r][d] == (a, b) for d, a, b in fixed))
                terms: dict[tuple, list[int]] = {}
                for r in ranks:
                    coords = mesh.coords(r)
                    terms.setdefault(tuple(coords[a] for a in partial_axes), []).append(r)
                cells.append(GridCell(i, j, ranks, tuple(tuple(t) for t in terms.values())))
        panels.append(GridPanel(fixed, tuple(cells)))
    return Grid(spec, row_dim, col_dim, row_edges, col_edges, tuple(panels), whole, split,
                tuple(pieces[d] for d in split), empty)


def _extent(sizes: Sequence[int], low: float, per_smallest: float, high: float) -> float:
    """Pixels for a whole dim: at least ``low``, enough for the smallest piece, at most ``high``."""
    positive = [s for s in sizes if s > 0]
    if not positive:
        return low
    return min(high, max(low, per_smallest * sum(positive) / min(positive)))


def _axis_cut_spans(label: str, dim: int | None, grid: Grid, colours: dict[str, str]) -> list[Span]:
    spec = grid.spec
    if dim is None:
        return [Span(f"{label}: none")]
    spans = [Span(f"{label}: dim {dim} (size {spec.shape[dim]})")]
    axes = spec.layout.dim_axes(dim)
    if not axes:
        return spans + [Span(", whole")]
    spans.append(Span(", cut by "))
    for number, axis in enumerate(axes):
        if number:
            spans.append(Span(" then "))
        name = spec.mesh.names[axis]
        spans.append(Span(name, colours[name], bold=True))
    sizes = list(grid.row_sizes if label == "rows" else grid.col_sizes)
    spans.append(Span(f" into {len(sizes)} pieces ({', '.join(map(str, sizes))})"))
    return spans


def _cell_lines(grid: Grid, cell: GridCell, width: float, height: float) -> list[str]:
    chars = max(1, int((width - 8) / text_width("0", 11.0)))
    if grid.partial:
        head = " ".join(f"P({op})" for op in dict.fromkeys(grid.partial.values()))
        body = " + ".join(",".join(map(str, term)) for term in cell.terms)
    else:
        head = "rank" if len(cell.ranks) == 1 else "ranks"
        body = ", ".join(map(str, cell.ranks))
    lines = [head] + (textwrap.wrap(body, chars) or [""])
    room = max(1, int((height - 6) / 13.0))
    if len(lines) > room:
        lines = lines[:room]
        lines[-1] = lines[-1][: max(chars - 1, 0)] + "…"
    return [line[:chars] if len(line) > chars else line for line in lines]


def _cell_info(grid: Grid, panel: GridPanel, cell: GridCell) -> dict:
    spec = grid.spec
    mesh = spec.mesh
    where = []
    if grid.row_dim is not None:
        where.append(f"dim {grid.row_dim} [{grid.row_edges[cell.row]}:{grid.row_edges[cell.row + 1]}]")
    if grid.col_dim is not None:
        where.append(f"dim {grid.col_dim} [{grid.col_edges[cell.col]}:{grid.col_edges[cell.col + 1]}]")
    where += [f"dim {d} [{a}:{b}]" for d, a, b in panel.fixed]
    rows = [["block", ", ".join(where) or "the whole tensor"]]
    if cell.ranks:
        first = cell.ranks[0]
        rows.append(["global slice", "[" + ", ".join(f"{a}:{b}" for a, b in spec.local_slices(first)) + "]"])
        rows.append(["local shape", str(list(spec.local_shape(first)))])
    rows.append(["ranks", ", ".join(map(str, cell.ranks)) or "none"])
    coords = [[f"rank {r}", ", ".join(f"{n}={c}" for n, c in zip(mesh.names, mesh.coords(r)))] for r in cell.ranks]
    sections = [{"heading": "ranks and their mesh coordinates", "rows": coords}]
    if grid.partial:
        ops = ", ".join(f"P({op}) on {name}" for name, op in grid.partial.items())
        terms = [[f"term {k}", "ranks " + ", ".join(map(str, t))] for k, t in enumerate(cell.terms, 1)]
        sections.append({"heading": f"partial terms ({ops})", "rows": terms})
    return {"title": f"block {', '.join(where) or 'whole tensor'}", "rows": rows, "sections": sections}


def draw_grid(grid: Grid, *, name: str = "", title: str = "") -> Scene:
    """Draw a :class:`Grid` as a :class:`Scene`: blocks to scale, ranks listed, Partial hatched.

    Parameters
    ----------
    grid : Grid
        From :func:`tensor_grid`.
    name : str
        The tensor's name, shown in the heading.
    title : str
        Where it comes from (the spec's file name), shown above the heading.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((4,), ("tp",))
    >>> scene = draw_grid(tensor_grid(TensorSpec((3, 10), "float32", Layout(mesh, ["S(1)"], 2))))
    >>> [round(item.shapes[0].rect[2]) for item in scene.items if item.kind == "cell"]
    [168, 168, 168, 56]
    """
    spec = grid.spec
    mesh = spec.mesh
    colours = axis_colours(mesh)
    width = _extent(grid.col_sizes, 360.0, 56.0, 900.0) if grid.col_dim is not None else 120.0
    height = _extent(grid.row_sizes, 140.0, 46.0, 520.0) if grid.row_dim is not None else 64.0
    col_x = [0.0]
    for size in grid.col_sizes:
        col_x.append(col_x[-1] + width * size / max(sum(grid.col_sizes), 1))
    row_y = [0.0]
    for size in grid.row_sizes:
        row_y.append(row_y[-1] + height * size / max(sum(grid.row_sizes), 1))
    row_labels = [f"{a}:{b}" for a, b in zip(grid.row_edges, grid.row_edges[1:])] if grid.row_dim is not None else []
    row_head = max([text_width(label, 10.0) for label in row_labels] + [24.0]) + 12
    panel_head = 22.0 if grid.split_dims else 0.0
    col_head = 18.0
    panel_w = row_head + width + 28
    panel_h = panel_head + col_head + height + 22
    per_line = max(1, min(len(grid.panels), int(1300 // panel_w)))

    heading_spans = [Span(f"{name or 'tensor'}: ", bold=True), Span(f"{spec.dtype}{list(spec.shape)} ", bold=True)]
    heading_spans += _placement_spans(spec.layout, colours)
    lines = [
        Text(MARGIN, MARGIN + 14, (Span(title or "layout-prop tensor grid", MUTED),), 12.0),
        Text(MARGIN, MARGIN + 34, tuple(heading_spans), 15.0),
        Text(MARGIN, MARGIN + 54, tuple([Span(f"tensor_map {_tensor_map_text(spec)} on mesh ")]
                                        + _mesh_spans(mesh, colours) + [Span(f" ({mesh.size} ranks)")]), 12.0),
        Text(MARGIN, MARGIN + 72, tuple(_axis_cut_spans("rows", grid.row_dim, grid, colours)), 12.0),
        Text(MARGIN, MARGIN + 90, tuple(_axis_cut_spans("columns", grid.col_dim, grid, colours)), 12.0),
    ]
    items = [Item(lines, kind="heading")]
    info: dict[str, dict] = {}
    top = MARGIN + 106
    for p, panel in enumerate(grid.panels):
        px = MARGIN + (p % per_line) * panel_w
        py = top + (p // per_line) * panel_h
        shapes: list = []
        if panel_head:
            shapes.append(Text(px + row_head, py + 14, (Span(panel.label(), bold=True),), 12.0))
        gx, gy = px + row_head, py + panel_head + col_head
        if grid.col_dim is not None:
            for j, (a, b) in enumerate(zip(grid.col_edges, grid.col_edges[1:])):
                shapes.append(Text(gx + (col_x[j] + col_x[j + 1]) / 2, gy - 5, (Span(f"{a}:{b}", MUTED),), 10.0,
                                   "middle"))
        for i, label in enumerate(row_labels):
            shapes.append(Text(gx - 6, gy + (row_y[i] + row_y[i + 1]) / 2 + 4, (Span(label, MUTED),), 10.0, "end"))
        items.append(Item(shapes, kind="panel"))
        for cell in panel.cells:
            x0, x1 = gx + col_x[cell.col], gx + col_x[cell.col + 1]
            y0, y1 = gy + row_y[cell.row], gy + row_y[cell.row + 1]
            fill = CELL_FILLS[(cell.row * grid.ncols + cell.col) % len(CELL_FILLS)]
            cell_shapes: list = [rect(x0, y0, x1 - x0, y1 - y0, fill=fill, stroke=INK, width=1.0,
                                      hatch=bool(grid.partial))]
            texts = _cell_lines(grid, cell, x1 - x0, y1 - y0)
            baseline = (y0 + y1) / 2 - (len(texts) - 1) * 13.0 / 2 + 4
            if grid.partial:  # keep the rank list readable over the hatching
                widest = max(text_width(t, 11.0) for t in texts) + 8
                cell_shapes.append(rect((x0 + x1 - widest) / 2, baseline - 13, widest, len(texts) * 13.0 + 5,
                                        fill="#FFFFFF", stroke=None, radius=3.0))
            for number, text in enumerate(texts):
                bold = number > 0
                cell_shapes.append(Text((x0 + x1) / 2, baseline + number * 13.0, (Span(text, INK, bold),), 11.0,
                                        "middle"))
            item_id = f"c{p}-{cell.row}-{cell.col}"
            info[item_id] = _cell_info(grid, panel, cell)
            items.append(Item(cell_shapes, item_id, "cell", _info_text(info[item_id])))
    rows_of_panels = (len(grid.panels) + per_line - 1) // per_line
    y = top + rows_of_panels * panel_h + 6
    caption = grid.caption() + ["each block lists every rank that holds it; widths and heights are to scale"]
    caption_texts = [Text(MARGIN, y + 12 + k * 16, (Span(line),), 12.0) for k, line in enumerate(caption)]
    y += 12 + len(caption) * 16
    legend: list = []
    x = MARGIN
    for axis, (axis_name, size) in enumerate(zip(mesh.names, mesh.shape)):
        legend.append(rect(x, y + 2, 12, 12, fill=colours[axis_name], stroke=None))
        label = f"{axis_name} (mesh axis {axis}, {size} ranks)"
        legend.append(Text(x + 17, y + 12, (Span(label),), 11.0))
        x += 17 + text_width(label, 11.0) + 18
    legend.append(rect(x, y, 34, 16, fill="#FFFFFF", stroke=INK, hatch=True))
    legend.append(Text(x + 40, y + 12, (Span("hatched: Partial (ranks hold terms)"),), 11.0))
    x += 40 + text_width("hatched: Partial (ranks hold terms)", 11.0)
    items.append(Item(caption_texts + legend, kind="legend"))
    right = max([MARGIN + per_line * panel_w, x] + [MARGIN + t.width for t in lines + caption_texts])
    summary = [f"{name or 'tensor'}: {spec.dtype}{list(spec.shape)} {spec.layout} on {mesh}"] + caption
    return Scene(right + MARGIN, y + 16 + MARGIN, items, title=f"{title} {name}".strip() or "tensor grid",
                 summary=summary, info=info)


# --------------------------------------------------------------------------- SVG, HTML, PNG
def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def _num(value: float) -> str:
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def _points(points) -> str:
    return " ".join(f"{_num(x)},{_num(y)}" for x, y in points)


def _svg_shape(shape: Shape) -> str:
    if shape.hit:
        return (f'<polyline class="hit" points="{_points(shape.points)}" fill="none" stroke="{shape.stroke}" '
                f'stroke-opacity="0" stroke-width="{_num(shape.width)}" pointer-events="stroke"/>')
    style = f' fill="{shape.fill or "none"}"'
    style += f' stroke="{shape.stroke}" stroke-width="{_num(shape.width)}"' if shape.stroke else ' stroke="none"'
    if shape.dash:
        style += ' stroke-dasharray="4 3"'
    if shape.rect is not None:
        x, y, w, h = shape.rect
        radius = f' rx="{_num(shape.radius)}"' if shape.radius else ""
        geometry = f'x="{_num(x)}" y="{_num(y)}" width="{_num(w)}" height="{_num(h)}"{radius}'
        out = f"<rect {geometry}{style}/>"
        if shape.hatch:
            out += f'<rect {geometry} fill="url(#lp-hatch)" stroke="none"/>'
        return out
    tag = "polygon" if shape.closed else "polyline"
    out = f'<{tag} points="{_points(shape.points)}"{style}/>'
    if shape.hatch and shape.closed:
        out += f'<polygon points="{_points(shape.points)}" fill="url(#lp-hatch)" stroke="none"/>'
    return out


def _svg_text(text: Text) -> str:
    bold = ' font-weight="bold"'
    spans = "".join(f'<tspan fill="{span.colour}"{bold if span.bold else ""}>{_esc(span.text)}</tspan>'
                    for span in text.spans)
    return (f'<text x="{_num(text.x)}" y="{_num(text.y)}" font-size="{_num(text.size)}" '
            f'text-anchor="{text.anchor}" xml:space="preserve">{spans}</text>')


def scene_svg(scene: Scene, *, standalone: bool = False) -> str:
    """The scene as SVG text; ``standalone`` adds the XML declaration of an ``.svg`` file.

    Examples
    --------
    >>> svg = scene_svg(Scene(40, 20, [Item([Text(2, 14, (Span("a<b"),))], "n0", "node", "a<b")]))
    >>> '<g data-id="n0" tabindex="0" class="node">' in svg, "<title>a&lt;b</title>" in svg
    (True, True)
    """
    width, height = _num(scene.width), _num(scene.height)
    out = []
    if standalone:
        out.append('<?xml version="1.0" encoding="UTF-8"?>')
    out.append(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
               f'viewBox="0 0 {width} {height}" font-family="{FONT_FAMILY}" role="img" '
               f'aria-label="{_esc(scene.title)}">')
    out.append(f"<title>{_esc(scene.title)}</title>")
    out.append('<defs><pattern id="lp-hatch" patternUnits="userSpaceOnUse" width="7" height="7" '
               f'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="7" stroke="{HATCH_COLOUR}" '
               'stroke-width="1.6"/></pattern></defs>')
    out.append(f'<rect width="{width}" height="{height}" fill="#FFFFFF"/>')
    for item in scene.items:
        attrs = f' data-id="{_esc(item.id)}" tabindex="0"' if item.id else ""
        if item.kind:
            attrs += f' class="{_esc(item.kind)}"'
        out.append(f"<g{attrs}>")
        if item.title:
            out.append(f"<title>{_esc(item.title)}</title>")
        for shape in item.shapes:
            out.append(_svg_text(shape) if isinstance(shape, Text) else _svg_shape(shape))
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


_CSS = """
body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1F2328; background: #FFFFFF; }
main { display: flex; align-items: flex-start; }
#picture { flex: 1 1 auto; overflow: auto; padding: 8px; }
#picture svg { display: block; max-width: none; }
#picture [data-id] { cursor: pointer; outline: none; }
#picture .node:hover, #picture .cell:hover { filter: drop-shadow(0 0 3px #8AB4F8); }
#picture .edge:hover polyline:not(.hit) { stroke-width: 3; }
#picture .selected { filter: drop-shadow(0 0 4px #1A73E8); }
#picture .edge.selected polyline:not(.hit) { stroke: #1A73E8; stroke-width: 3; }
#panel { flex: 0 0 400px; position: sticky; top: 0; max-height: 100vh; overflow: auto; box-sizing: border-box;
         padding: 12px 16px; border-left: 1px solid #D0D7DE; background: #F6F8FA; }
#panel h2 { font-size: 16px; margin: 0 0 4px; }
#panel .hint { color: #57606A; font-size: 12px; margin: 0 0 10px; }
#details h3 { font: bold 14px "DejaVu Sans Mono", Menlo, Consolas, monospace; overflow-wrap: anywhere; margin: 8px 0; }
#details h4 { font-size: 13px; margin: 12px 0 4px; }
#details h4.alert { color: #C81E1E; }
#details table { border-collapse: collapse; width: 100%; table-layout: fixed;
                 font: 12px "DejaVu Sans Mono", Menlo, Consolas, monospace; }
#details th { width: 11.5em; text-align: left; vertical-align: top; padding: 2px 10px 2px 0; color: #57606A;
              font-weight: normal; overflow-wrap: anywhere; }
#details td { padding: 2px 0; overflow-wrap: anywhere; }
#summary { padding-left: 18px; margin: 0; font-size: 13px; }
"""

_JS = """
(function () {
  "use strict";
  var info = JSON.parse(document.getElementById("viz-data").textContent);
  var details = document.getElementById("details");
  var summary = details.cloneNode(true);
  var items = Array.prototype.slice.call(document.querySelectorAll("#picture [data-id]"));
  var pinned = null;

  function element(tag, text, cls) {
    var node = document.createElement(tag);
    if (text !== undefined && text !== null) { node.textContent = String(text); }
    if (cls) { node.className = cls; }
    return node;
  }
  function table(rows) {
    var body = element("table");
    rows.forEach(function (row) {
      var line = element("tr");
      line.appendChild(element("th", row[0]));
      line.appendChild(element("td", row[1]));
      body.appendChild(line);
    });
    return body;
  }
  function show(id) {
    var item = info[id];
    if (!item) { return; }
    details.textContent = "";
    details.appendChild(element("h3", item.title));
    if (item.rows && item.rows.length) { details.appendChild(table(item.rows)); }
    (item.sections || []).forEach(function (section) {
      details.appendChild(element("h4", section.heading, section.alert ? "alert" : ""));
      details.appendChild(table(section.rows));
    });
    details.setAttribute("data-showing", id);
  }
  function release() {
    if (pinned) { pinned.classList.remove("selected"); }
    pinned = null;
  }
  function reset() {
    release();
    details.replaceChildren.apply(details, Array.prototype.slice.call(summary.cloneNode(true).childNodes));
    details.removeAttribute("data-showing");
  }
  function pin(g) {
    release();
    pinned = g;
    g.classList.add("selected");
    show(g.getAttribute("data-id"));
  }
  items.forEach(function (g) {
    var id = g.getAttribute("data-id");
    g.addEventListener("mouseenter", function () { if (!pinned) { show(id); } });
    g.addEventListener("focus", function () { if (!pinned) { show(id); } });
    g.addEventListener("click", function (event) {
      event.stopPropagation();
      if (pinned === g) { release(); } else { pin(g); }
    });
    g.addEventListener("keydown", function (event) {
      if (event.key === "Enter" || event.key === " ") { event.preventDefault(); pin(g); }
    });
  });
  document.addEventListener("keydown", function (event) { if (event.key === "Escape") { reset(); } });
  var wanted = decodeURIComponent(window.location.hash.slice(1));
  items.forEach(function (g) { if (wanted && g.getAttribute("data-id") === wanted) { pin(g); } });
  document.body.setAttribute("data-ready", "1");
})();
"""


def scene_html(scene: Scene) -> str:
    """A self-contained page: the SVG, a details panel and a small inline script.

    Nothing is fetched (a Content-Security-Policy forbids it).  Hovering, focusing or
    clicking a node, an edge or a block shows its ``info`` in the panel; a click pins it;
    ``#<id>`` in the address pins that item on load; the script sets ``data-ready="1"``
    on ``<body>`` when it has run.

    Examples
    --------
    >>> page = scene_html(Scene(10, 10, [], title="t", summary=["no violations"]))
    >>> page.startswith("<!DOCTYPE html>"), '<li>no violations</li>' in page, "src=" in page or "href=" in page
    (True, True, False)
    """
    data = json.dumps(scene.info, sort_keys=True, ensure_ascii=True)
    data = data.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
    summary = "\n".join(f"<li>{_esc(line)}</li>" for line in scene.summary)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; \
script-src 'unsafe-inline'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_esc(scene.title)}</title>
<style>{_CSS}</style>
</head>
<body data-ready="0">
<main>
<div id="picture">
{scene_svg(scene)}</div>
<aside id="panel" aria-live="polite">
<h2>Details</h2>
<p class="hint">Hover or click a node, an edge or a block for its full spec; a click pins it, Escape releases.</p>
<div id="details"><ul id="summary">
{summary}
</ul></div>
</aside>
</main>
<script type="application/json" id="viz-data">{data}</script>
<script>{_JS}</script>
</body>
</html>
"""


def _matplotlib():
    try:
        from matplotlib import patches
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise VizError("png-unavailable", "writing a .png needs matplotlib, which is not installed",
                       hint="pip install matplotlib (or pip install 'layout-prop[viz]'), or write .svg or .html, "
                            "which need nothing else") from None
    return Figure, FigureCanvasAgg, patches


def scene_png(scene: Scene, path: str | Path, *, scale: float = 1.5) -> None:
    """Draw the scene with matplotlib (Agg, no window) into a PNG file.

    Raises
    ------
    VizError
        ``png-unavailable`` when matplotlib is not installed.
    """
    Figure, FigureCanvasAgg, patches = _matplotlib()
    from matplotlib import rc_context

    # unhinted glyphs keep the font's fractional advances, so text spans land where the layout put them
    with rc_context({"text.hinting": "no_hinting"}):
        figure = Figure(figsize=(scene.width / 100, scene.height / 100), dpi=100)
        FigureCanvasAgg(figure)
        axes = figure.add_axes((0, 0, 1, 1))
        axes.set_xlim(0, scene.width)
        axes.set_ylim(scene.height, 0)
        axes.set_axis_off()
        for item in scene.items:
            for shape in item.shapes:
                if isinstance(shape, Text):
                    _mpl_text(axes, shape)
                elif not shape.hit:
                    _mpl_shape(axes, patches, shape)
        figure.savefig(path, format="png", dpi=100 * scale, facecolor="white")


_PT = 0.72  # points per pixel at 100 dpi


def _mpl_shape(axes, patches, shape: Shape) -> None:
    width = shape.width * _PT if shape.stroke else 0.0
    style = (0, (4, 3)) if shape.dash else "solid"
    if not shape.closed:
        xs, ys = zip(*shape.points)
        axes.plot(xs, ys, color=shape.stroke, linewidth=width, linestyle=style, solid_capstyle="butt",
                  solid_joinstyle="miter")
        return
    common = dict(facecolor=shape.fill or "none", edgecolor=shape.stroke or "none", linewidth=width, linestyle=style)
    if shape.rect is not None and shape.radius:
        x, y, w, h = shape.rect
        patch = patches.FancyBboxPatch((x, y), w, h, boxstyle=f"round,pad=0,rounding_size={shape.radius}", **common)
    else:
        patch = patches.Polygon(shape.points, closed=True, **common)
    axes.add_patch(patch)
    if shape.hatch:
        axes.add_patch(patches.Polygon(shape.points, closed=True, facecolor="none", edgecolor=HATCH_COLOUR,
                                       linewidth=0, hatch="////"))


def _mpl_text(axes, text: Text) -> None:
    x = text.x - {"start": 0.0, "middle": text.width / 2, "end": text.width}[text.anchor]
    for span in text.spans:
        axes.text(x, text.y, span.text.replace("$", r"\$"), fontsize=text.size * _PT, family="DejaVu Sans Mono",
                  color=span.colour, weight="bold" if span.bold else "normal", ha="left", va="baseline")
        x += text_width(span.text, text.size)


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
    >>> from layout_prop.loader import load_spec
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


# --------------------------------------------------------------------------- files and CLI
def output_format(path: str | Path) -> str:
    """The picture format named by ``path``'s extension (``.html``, ``.svg``, ``.png``, ``.dot``).

    Examples
    --------
    >>> output_format("block.SVG"), output_format("out/graph.dot")
    ('svg', 'dot')
    >>> try:
    ...     output_format("graph.pdf")
    ... except VizError as err:
    ...     print(err.code, "|", err.message)
    bad-format | cannot tell a picture format from the extension '.pdf'
    """
    suffix = Path(path).suffix.lower()
    fmt = {".htm": "html"}.get(suffix, suffix.lstrip("."))
    if fmt not in FORMATS:
        shown = repr(suffix) if suffix else "(none)"
        raise VizError("bad-format", f"cannot tell a picture format from the extension {shown}", path=str(path),
                       hint="name the output .html (interactive), .svg, .png (needs matplotlib) or .dot (Graphviz text)")
    return fmt


def parse_dims(text: str) -> tuple[int, ...]:
    """Parse ``--dims``: ``"0,2"`` -> ``(0, 2)``.

    >>> parse_dims("0,2"), parse_dims(" -1 ")
    ((0, 2), (-1,))
    """
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise VizError("bad-dims", f"--dims {text!r} is not a comma-separated list of integers",
                       hint="name one or two tensor dims, such as --dims 0,2") from None


def find_value(graph: Graph, name: str) -> TensorSpec:
    """The spec of value ``name`` (an input, a node output, ``node:i``, or ``grad:INPUT``).

    Raises
    ------
    VizError
        ``unknown-value`` when there is no such value, ``no-layout`` when its producer's
        violation left it without a layout.
    """
    specs: dict[str, TensorSpec | None] = {}
    for node in graph.topo_order():
        for value, spec in zip(node.outputs, node.meta.get(meta.SPECS, ())):
            specs[value] = spec
            if node.meta.get(meta.GRAD_OF):
                specs[f"grad:{node.meta[meta.GRAD_OF]}"] = spec
    if name not in specs:
        shown = [v for v in specs if not v.startswith(("grad/", "cotangent/"))]
        known = ", ".join(shown[:12]) + (", ..." if len(shown) > 12 else "")
        hint = f"name one of the graph's values: {known}"
        if name.startswith("grad:"):
            hint = "gradients exist with --backward; " + hint
        raise VizError("unknown-value", f"no value named {name!r} in the graph", input=name, hint=hint)
    spec = specs[name]
    if spec is None:
        raise VizError("no-layout", f"value {name!r} has no layout: its producer has a violation",
                       input=name, hint="fix the violation, or add --reshard")
    return spec


def _write_failed(path: Path, exc: OSError) -> VizError:
    return VizError("write-failed", f"cannot write {str(path)!r}: {exc.strerror or exc}", path=str(path),
                    hint="check that the folder exists and is writable")


def _write_text(path: Path, text: str) -> None:
    """Write atomically (a temporary file beside ``path``, renamed): a full disk leaves no truncated file."""
    from layout_prop.output import write_text_atomic

    try:
        write_text_atomic(path, text)
    except OSError as exc:
        raise _write_failed(path, exc) from None


def _write_scene(scene: Scene, path: Path, fmt: str) -> None:
    if fmt == "png":
        from layout_prop.output import atomic_path

        try:
            with atomic_path(path) as tmp:
                scene_png(scene, tmp)
        except OSError as exc:
            raise _write_failed(path, exc) from None
    elif fmt == "svg":
        _write_text(path, scene_svg(scene, standalone=True))
    else:
        _write_text(path, scene_html(scene))


def write_graph(graph: Graph, path: str | Path, *, check: CheckResult | None = None, title: str = "") -> Path:
    """Write the graph's picture; the extension of ``path`` picks the format (:data:`FORMATS`)."""
    path = Path(path)
    fmt = output_format(path)
    if fmt == "dot":
        _write_text(path, graph_dot(graph, check, title=title))
    else:
        _write_scene(draw_graph(graph, check, title=title), path, fmt)
    return path


def write_grid(grid: Grid, path: str | Path, *, name: str = "", title: str = "") -> Path:
    """Write a tensor grid's picture; the extension of ``path`` picks the format."""
    path = Path(path)
    fmt = output_format(path)
    if fmt == "dot":
        _write_text(path, grid_dot(grid, name=name, title=title))
    else:
        _write_scene(draw_grid(grid, name=name, title=title), path, fmt)
    return path


class Visualise:
    """The visualise pass: ``run(graph)`` returns the picture of a propagated graph (reads metadata only)."""

    name = "visualise"

    def run(self, graph: Graph, check: CheckResult | None = None) -> Scene:
        return draw_graph(graph, check)


def add_viz_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``viz`` subcommand (``layout-prop viz SPEC -o FILE``) to an argparse subparsers object."""
    viz = subparsers.add_parser(
        "viz", help="draw the graph (or one tensor's sharding grid) as HTML, SVG, PNG or DOT",
        description="Draw the propagated graph: layers left to right, placements and local shapes on the edges, "
                    "redistributions with their steps and bytes, violations in red. With --tensor, draw which "
                    "ranks hold which block of one value instead.")
    viz.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file")
    viz.add_argument("-o", "--output", required=True, metavar="FILE",
                     help="the picture to write; its extension picks the format: .html (interactive, "
                          "self-contained), .svg, .png (needs matplotlib) or .dot (Graphviz text)")
    viz.add_argument("--reshard", action="store_true", help="draw the graph with the redistributions reshard inserts")
    viz.add_argument("--backward", action="store_true", help="also draw the gradient graph (grad:NAME values)")
    viz.add_argument("--tensor", metavar="NAME",
                     help="draw one value's sharding grid instead: an input, a node output (name:i), or grad:NAME "
                          "with --backward")
    viz.add_argument("--dims", metavar="D0,D1",
                     help="with --tensor: the dims drawn as rows and columns (default: the sharded ones)")
    return viz


def cmd_viz(args: argparse.Namespace) -> int:
    """Run ``layout-prop viz``: 0 when the picture is written; typed errors (exit 2) otherwise."""
    from layout_prop.api import analyze
    from layout_prop.loader import load_spec

    out = Path(args.output)
    fmt = output_format(out)
    tensor = getattr(args, "tensor", None)
    dims = parse_dims(args.dims) if getattr(args, "dims", None) is not None else None
    if dims is not None and tensor is None:
        raise VizError("bad-usage", "--dims chooses the drawn dims of a tensor's grid, but no --tensor was given",
                       hint="add --tensor NAME, or drop --dims")
    if fmt == "png":
        _matplotlib()  # say so before any work
    graph = getattr(args, "graph", None) or load_spec(Path(args.spec))  # the CLI loads models (--plan) itself
    analysis = analyze(graph, reshard=args.reshard, backward=args.backward)
    flags = [flag for flag, on in (("--reshard", args.reshard), ("--backward", args.backward)) if on]
    title = " ".join([Path(args.spec).name] + flags)
    if tensor is None:
        write_graph(analysis.graph, out, check=analysis.check, title=title)
        what = f"{len(analysis.graph)} nodes, {len(analysis.check.violations)} violations"
    else:
        grid = tensor_grid(find_value(analysis.graph, tensor), dims)
        write_grid(grid, out, name=tensor, title=title)
        what = f"tensor {tensor}, {len(grid.panels) * grid.nrows * grid.ncols} blocks"
    print(f"wrote {out} ({what})")
    return 0
