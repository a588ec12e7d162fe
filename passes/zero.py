"""zero: ZeRO stages 1, 2 and 3 over the data-parallel mesh axes (Rajbhandari et al., 2020).

A transforming pass, applied to the forward graph before the analysis (before the pipeline
pass too: it only changes layouts and adds ``redistribute`` nodes, so any later pass sees an
ordinary graph).  ZeRO shards the training state over the data-parallel ranks:

- stage 1: the optimizer states; stage 2: the gradients too; stage 3: the parameters too.

Stages 1 and 2 leave the graph as it is (forward and backward compute on whole parameters):
the memory pass divides the sharded figures (:meth:`ZeroConfig.shard_bytes`), the step model
prices the gradients' reduce-scatter and the updated parameters' all-gather, and
:mod:`layout_prop.engines.training` executes the sharded update.  Stage 3 changes the graph:
each parameter is *stored* sharded over the ZeRO axes (:func:`stored_layout`: on a tensor dim
its tensor-parallel layout leaves whole, else composed with it), and a node
``zero/gather/NAME`` (a ``redistribute`` back to the parameter's own layout: an all-gather
over those axes) is placed right before its first consumer in each layer; the consumers read
the gathered copy.  The backward pass's rule for ``redistribute`` turns the gather's
cotangent (a partial sum over the data-parallel axes) into the stored layout: a
reduce-scatter, not an all-reduce.  :func:`regather` (after the backward and reshard passes)
gives the backward consumers their own all-gather ``zero/regather/...``, placed before the
first of them, so that the forward copy dies after its last forward use, as FSDP frees it.

Hybrid (HSDP): ``axes`` names a subset of the data-parallel axes (the ones inside a node);
the state is replicated over the others, whose gradients are still all-reduced.

Examples
--------
>>> from layout_prop.io.loader import load_spec
>>> g = load_spec('''
... mesh: {shape: [2, 2], names: [dp, tp]}
... inputs:
...   x: {shape: [4, 8], placements: ["S(0)", R], requires_grad: false}
...   w: {shape: [8, 6], placements: [R, "S(1)"]}
... nodes:
...   - {name: y, op: matmul, inputs: [x, w]}
... ''')
>>> z = Zero(ZeroConfig(3, ("dp",))).run(g)
>>> z.node("w").attrs["placements"], z.node("zero/gather/w").attrs["placements"], z.node("y").inputs
(('S(0)', 'S(1)'), ['R', 'S(1)'], ('x', 'zero/gather/w'))
"""

from __future__ import annotations

import math
import re

from layout_prop.core import meta
from layout_prop.core.errors import LayoutPropError
from layout_prop.core.graph import Graph, Node, fresh_name
from layout_prop.core.layout import Layout
from layout_prop.core.placement import Replicate, Shard, shard_dim
from layout_prop.core.redistribute import plan_redistribution
from layout_prop.core.spec import FLOAT_DTYPES, TensorSpec
from layout_prop.io.spec_blocks import DATA_AXES, STAGES, ZeroConfig, parse_zero  # noqa: F401 (names of this module)

__all__ = ["Zero", "ZeroConfig", "DATA_AXES", "STAGES", "parse_zero", "stored_layout", "regather", "GATHER_PREFIX",
           "REGATHER_PREFIX", "zero_parameters", "shard_layouts", "whole_layouts", "finish"]

GATHER_PREFIX = "zero/gather/"
REGATHER_PREFIX = "zero/regather/"


def stored_layout(layout: Layout, shape: tuple[int, ...], axes: tuple[str, ...]) -> Layout | None:
    """The layout ZeRO stores a parameter in: ``layout`` with each of ``axes`` (now Replicate)
    sharding one tensor dim, or None when the parameter stays as it is.

    The dim is the largest one no mesh axis shards yet whose size the ZeRO degree divides; else
    the largest one (even or not) whose local size is at least the degree, composed with the
    tensor-parallel axes that already shard it (a strided shard too: a fused projection's, as
    GPT-2's ``c_attn`` bias ``_S(0,3)``).  A parameter with a ZeRO axis not Replicate (already
    sharded or partial there) is left alone.

    >>> from layout_prop.core.mesh import DeviceMesh
    >>> m = DeviceMesh((2, 2), ("dp", "tp"))
    >>> str(stored_layout(Layout(m, ["R", "S(0)"], 2), (8, 6), ("dp",)))
    '(S(1), S(0))'
    >>> str(stored_layout(Layout(m, ["R", "S(0)"], 1), (8,), ("dp",)))
    '(S(0), S(0))'
    >>> str(stored_layout(Layout(m, ["R", "_S(1,3)"], 2), (8, 24), ("dp",)))
    '(S(0), _S(1,3))'
    >>> str(stored_layout(Layout(m, ["R", "_S(0,3)"], 1), (24,), ("dp",)))
    '(S(0), _S(0,3))'
    """
    mesh = layout.mesh
    index = [mesh.axis_index(a) for a in axes]
    if not index or any(not isinstance(layout.placements[i], Replicate) for i in index):
        return None
    degree = math.prod(mesh.shape[i] for i in index)
    taken = {shard_dim(p) for p in layout.placements} - {None}
    local = [size // max(1, layout.shard_count(d)) for d, size in enumerate(shape)]
    free = [d for d in range(len(shape)) if d not in taken and shape[d] % degree == 0]
    if free:
        dim = max(free, key=lambda d: (shape[d], -d))
    else:
        fits = [d for d in range(len(shape)) if local[d] >= degree]
        if not fits:
            return None
        dim = max(fits, key=lambda d: (local[d], -d))
    placements = list(layout.placements)
    for i in index:
        placements[i] = Shard(dim)
    try:
        stored = Layout(mesh, placements, layout.ndim)
        spec = TensorSpec(tuple(shape), "float32", stored)
        plan_redistribution(spec, layout)
    except LayoutPropError:
        return None
    return stored


def zero_parameters(graph: Graph) -> list[Node]:
    """The graph inputs ZeRO treats as parameters: floating, requiring a gradient, with a layout."""
    return [n for n in graph.inputs() if n.attrs.get("requires_grad") and n.attrs.get("dtype") in FLOAT_DTYPES
            and isinstance(n.attrs.get("placements"), tuple) and not n.name.startswith("cotangent/")]


_LAYER = re.compile(r"^(?:.*?[/_.])?(l\d+|layer\d+|layers?[._/]\d+|h\.\d+)(?=[/_.]|$)")


def _layer_of(name: str) -> str:
    """A node's layer (``l3`` of ``l3_fc1``), or its own name when it names none.

    >>> _layer_of("l3_fc1"), _layer_of("grad/l0_q/matmul1"), _layer_of("model.layers.2.mlp"), _layer_of("logits")
    ('l3', 'l0', 'layers.2', 'logits')
    """
    found = _LAYER.match(name)
    return found.group(1) if found else name


class Zero:
    """The ZeRO pass: stage 3 stores each parameter sharded and gathers it before use.

    ``run`` returns a new graph (its input is left as it was), with ``graph.meta[meta.ZERO]``
    set to the config; for stages 0 to 2 the graph's nodes are unchanged.  Parameters whose
    layout cannot take the ZeRO axes (:func:`stored_layout` is None) stay whole; their names
    are in ``meta[meta.ZERO_WHOLE]``.
    """

    name = "zero"

    def __init__(self, config: ZeroConfig) -> None:
        self.config = config

    def run(self, graph: Graph) -> Graph:
        mesh = graph.mesh
        params = {n.name: n for n in zero_parameters(graph)} if self.config.stage == 3 else {}
        stored: dict[str, tuple] = {}
        whole = []
        for name, node in params.items():
            shape = tuple(node.attrs["shape"])
            try:
                layout = Layout(mesh, node.attrs["placements"], len(shape))
            except LayoutPropError:
                whole.append(name)
                continue
            new = stored_layout(layout, shape, self.config.axes)
            if new is None:
                whole.append(name)
            else:
                stored[name] = (tuple(new.placement_strs()), node.attrs["placements"])
        nodes: dict[str, Node] = {}
        gathers: dict[tuple[str, str], str] = {}  # (parameter, layer) -> its gathered copy
        for node in graph.topo_order():
            if node.is_input:
                attrs = dict(node.attrs)
                if node.name in stored:
                    attrs["placements"] = stored[node.name][0]
                nodes[node.name] = Node(node.name, node.op, (), attrs, node.num_outputs)
                continue
            inputs = list(node.inputs)
            for k, value in enumerate(inputs):
                if value not in stored:
                    continue
                key = (value, _layer_of(node.name))
                copy = gathers.get(key)
                if copy is None:
                    copy = _fresh(f"{GATHER_PREFIX}{value}", nodes)
                    nodes[copy] = Node(copy, "redistribute", (value,), {"placements": list(stored[value][1])},
                                       meta={meta.INSERTED_BY: "zero"})
                    gathers[key] = copy
                inputs[k] = copy
            nodes[node.name] = Node(node.name, node.op, tuple(inputs), dict(node.attrs), node.num_outputs)
        out = Graph.from_nodes(mesh, nodes, graph.outputs, graph.meta)
        out.meta[meta.ZERO] = self.config
        out.meta[meta.ZERO_WHOLE] = tuple(whole)
        return out


def _fresh(base: str, taken) -> str:
    return fresh_name(base, taken.__contains__, sep="/")  # (not "#" or "@": lowering names its local values with them)


def _is_backward(graph: Graph, node: Node) -> bool:
    if node.meta.get(meta.INSERTED_BY) in ("backward", "recompute") or node.name.startswith("grad/"):
        return True  # (a recomputed forward node runs in the backward)
    if node.op == "redistribute":
        consumer = node.meta.get(meta.FOR, (None,))[0]
        return consumer is not None and consumer in graph and _is_backward(graph, graph.node(consumer))
    return False


def regather(graph: Graph, propagate=None) -> Graph:
    """Give the backward readers of each ZeRO-3 gathered copy their own all-gather.

    ``graph`` is analysed with its backward (and resharded); each ``zero/gather/...`` node read
    by backward nodes gets a twin ``zero/regather/...`` (the same redistribute of the stored
    parameter) placed right before the first of them, and those nodes read the twin.  Values
    are unchanged; the forward copy now dies after its last forward use.  Returns a new graph
    (propagated); a graph without gathers is returned as it is.
    """
    from .propagate import Propagate

    nodes = graph.topo_order()
    gathers = {n.name for n in nodes if n.name.startswith(GATHER_PREFIX) and n.op == "redistribute"}
    if not gathers:
        return graph
    propagate = propagate or Propagate()
    out: dict[str, Node] = {}
    twins: dict[str, str] = {}
    for node in nodes:
        if node.is_input or not _is_backward(graph, node) or not gathers.intersection(node.inputs):
            out[node.name] = node
            continue
        inputs = list(node.inputs)
        for k, value in enumerate(inputs):
            if value not in gathers:
                continue
            twin = twins.get(value)
            if twin is None:
                source = graph.node(value)
                twin = _fresh(REGATHER_PREFIX + value[len(GATHER_PREFIX):], graph._nodes.keys() | out.keys())
                out[twin] = Node(twin, "redistribute", source.inputs, dict(source.attrs),
                                 meta={meta.INSERTED_BY: "zero", meta.SPECS: source.meta[meta.SPECS],
                                       meta.VIOLATIONS: (), meta.WANTS: source.meta.get(meta.WANTS, ()),
                                       meta.ATTRS: source.meta.get(meta.ATTRS, source.attrs)})
                twins[value] = twin
            inputs[k] = twin
        out[node.name] = Node(node.name, node.op, tuple(inputs), node.attrs, node.num_outputs, dict(node.meta))
    new = Graph.from_nodes(graph.mesh, out, graph.outputs, graph.meta)
    return new


def shard_layouts(graph: Graph, config: ZeroConfig) -> dict[str, Layout]:
    """For each parameter of ``graph`` (propagated), the layout its optimizer state lives in:
    its own layout at stage 0, else the ZeRO-sharded one (at stage 3 the stored layout, which
    is the graph input's own after :class:`Zero`).  A parameter ZeRO cannot shard keeps its
    own layout."""
    out = {}
    for node in zero_parameters(graph):
        spec = node.meta[meta.SPECS][0]
        if config.stage in (1, 2):
            out[node.name] = stored_layout(spec.layout, spec.shape, config.axes) or spec.layout
        else:
            out[node.name] = spec.layout
    return out


def whole_layouts(graph: Graph) -> dict[str, Layout]:
    """For each parameter, the layout the ops read it in: the gathered copy's at ZeRO stage 3,
    its own otherwise."""
    out = {}
    for node in zero_parameters(graph):
        gather = graph._nodes.get(GATHER_PREFIX + node.name)
        source = gather if gather is not None and meta.SPECS in gather.meta else node
        out[node.name] = source.meta[meta.SPECS][0].layout
    return out


def finish(graph: Graph, config: ZeroConfig, propagate=None) -> Graph:
    """The ZeRO steps that follow the backward and reshard passes, on the analysed graph.

    Stage 3: :func:`regather`.  Stages 1 and 2: every parameter's gradient ``grad/NAME`` is
    brought to the ZeRO-sharded layout (a reduce-scatter of the partial sum over the ZeRO
    axes instead of its all-reduce); the optimizer then updates one shard per rank.  Stage 0:
    the graph as it is.
    """
    from .propagate import Propagate

    if config.stage == 3:
        return regather(graph, propagate)
    if config.stage == 0:
        return graph
    propagate = propagate or Propagate()
    targets = {name: layout for name, layout in shard_layouts(graph, config).items()
               if layout != graph.node(name).meta[meta.SPECS][0].layout}
    out: dict[str, Node] = {}
    changed = False
    for node in graph.topo_order():
        primal = node.meta.get(meta.GRAD_OF)
        if primal in targets and node.op in ("redistribute", "identity"):
            new = Node(node.name, "redistribute", node.inputs, {"placements": targets[primal].placement_strs()},
                       meta={k: v for k, v in node.meta.items() if k in (meta.INSERTED_BY, meta.GRAD_OF, meta.FOR)})
            out[node.name] = new
            changed = True
            continue
        out[node.name] = node
    if not changed:
        return graph
    new_graph = Graph.from_nodes(graph.mesh, out, graph.outputs, graph.meta)
    for node in new_graph.topo_order():
        if meta.SPECS not in node.meta:
            propagate.visit(new_graph, node)
    return new_graph
