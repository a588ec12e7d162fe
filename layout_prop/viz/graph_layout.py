"""The graph picture: facts read off a propagated graph, the layered layout (topological layers
left to right, crossings cut, far inputs drawn again) and :func:`draw_graph`, which turns it into a scene."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

from layout_prop.core import meta
from layout_prop.core.errors import LayoutPropError, Violation
from layout_prop.core.graph import Graph, Node
from layout_prop.core.layout import Layout
from layout_prop.core.mesh import DeviceMesh
from layout_prop.passes.check import Check, CheckResult
from layout_prop.core.redistribute import Redistribution, plan_redistribution
from layout_prop.core.registry import get_rule
from layout_prop.core.spec import TensorSpec

from .scene import (
    EDGE_COLOUR,
    INK,
    KIND_TEXT,
    MUTED,
    NODE_FILLS,
    VIOLATION_RED,
    Item,
    Scene,
    Shape,
    Span,
    Text,
    VizError,
    _info_text,
    _mesh_spans,
    _placement_spans,
    _plan_rows,
    _spec_rows,
    _step_spans,
    _violation_section,
    axis_colours,
    rect,
    text_width,
)


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


def _plan_or_none(src: TensorSpec | None, dst: Layout | None) -> Redistribution | None:
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
        self.node_plans: dict[str, Redistribution] = {}
        for node in graph.nodes:
            if node.op == "redistribute" and node.inputs:
                specs = node.meta.get(meta.SPECS, ())
                target = specs[0].layout if specs and specs[0] is not None else None
                plan = _plan_or_none(_spec_of(graph, node.inputs[0]), target)
                if plan is not None:
                    self.node_plans[node.name] = plan
        # (consumer, value) -> (plan, how): "implicit" free slices and "fix" for fixable violations
        self.moves: dict[tuple[str, str], tuple[Redistribution, str]] = {}
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
    move: tuple[Redistribution, str] | None
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
                 move: tuple[Redistribution, str] | None, colours: dict[str, str]) -> list[tuple[Span, ...]]:
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
    >>> from layout_prop.io.loader import load_spec
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
