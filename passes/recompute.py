"""recompute: activation recomputation, none, selective or full, for chosen layers.

A transforming pass over a graph analysed with its backward (and resharded).  It picks
*segments* of forward nodes, one per layer:

- ``full``: every forward node of the layer (Megatron-LM's full recomputation: only the
  layer's inputs stay);
- ``selective``: the layer's attention core (Korthikanti et al., 2022, "Reducing Activation
  Recomputation in Large Transformer Models", section 4.2): the fused attention op
  (``scaled_dot_product_attention``) and the ops whose output is an attention score or
  probability, 4-D with its last two dims equal (batch, heads, seq, seq);
- ``none``: nothing.

``layers`` limits the segments to some layers (names such as ``l0``, read from node names as
:func:`layout_prop.passes.zero._layer_of` does); None means every layer.  A node outside any
layer (embedding, head, loss) is never recomputed.

Every value a segment makes that the layer's own backward reads (or a backward node of no
layer: the final norm's reads the last layer's output) is made again: the segment's nodes it
depends on are copied (``recompute/NAME``, ``meta["inserted_by"] = "recompute"``, the same op,
attrs and layouts; dropout's mask comes from its seed, so the copy draws the same mask) and
placed right before the first of those backward nodes, which read the copies.  ``full`` also copies
every product and collective of the layer the backward reads nothing of (the MLP's down projection
and the reduction after it), as Megatron-LM's checkpointed layer runs its forward again whole
(:func:`_rerun`); ``selective`` only the attention core's nodes the backward reads.  Another layer's
backward reading the layer's output (its own input, which stays) reads the original: so the
copies run in the layer's own backward, on its own pipeline stage.  So the memory pass (a value lives from the op that makes it
to its last reader) frees the segment's activations after their last forward use and keeps the
segment's inputs until the copies have read them, and the step model counts the copies as the
recomputation's forward.  The values are the same: the graph still matches one device.

Apply it before :func:`layout_prop.passes.zero.finish` (whose re-gather then serves the copies
too) and before a pipeline pass.
"""

from __future__ import annotations

from layout_prop.core import meta
from layout_prop.core.errors import SpecError, cut
from layout_prop.core.graph import Graph, Node, fresh_name

from layout_prop.io.spec_blocks import MODES, parse_recompute  # noqa: F401 (names of this module)

from .zero import _is_backward, _layer_of

__all__ = ["Recompute", "MODES", "PREFIX", "ATTENTION_OPS", "segments", "layer_activations", "held_values",
           "parse_recompute", "layers_on_stages"]

PREFIX = "recompute/"
INSERTED = "recompute"
ATTENTION_OPS = ("scaled_dot_product_attention",)


def layers_on_stages(chunks: dict[str, int], stages: int, chosen) -> tuple[str, ...]:
    """The layers whose nodes run on pipeline stages ``chosen``: recomputation per stage.

    ``chunks`` is the chunk of every forward node (:func:`layout_prop.passes.pipeline.forward_chunks`),
    chunk ``c`` running on stage ``c % stages``; a layer split between stages counts for each.

    >>> layers_on_stages({"l0_a": 0, "l1_a": 0, "l2_a": 1, "l3_a": 1, "head": 1}, 2, [0])
    ('l0', 'l1')
    """
    wanted = set(chosen)
    layers = {_layered(name) for name, chunk in chunks.items() if chunk % stages in wanted}
    return tuple(sorted(layers - {None}, key=lambda x: (len(x), x)))


def _layered(name: str) -> str | None:
    layer = _layer_of(name)
    return None if layer == name else layer


def _is_core(node: Node) -> bool:
    if node.op in ATTENTION_OPS:
        return True
    return any(s is not None and len(s.shape) == 4 and s.shape[-1] == s.shape[-2]
               for s in node.meta.get(meta.SPECS, ()))


def segments(graph: Graph, mode: str, layers=None) -> dict[str, list[Node]]:
    """The forward nodes ``mode`` recomputes, by layer, in graph order.

    A reshard move (a ``redistribute`` node) belongs to the layer of the node it serves.
    """
    if mode not in MODES:
        raise SpecError("bad-value", f"unknown recompute mode {mode!r}", path="recompute.mode",
                        hint=f"use one of {', '.join(MODES)}")
    out: dict[str, list[Node]] = {}
    if mode == "none":
        return out
    wanted = None if layers is None else set(layers)
    for node in graph.topo_order():
        if node.is_input or _is_backward(graph, node) or node.meta.get(meta.INSERTED_BY) in (INSERTED, "zero") \
                or node.name.startswith(("zero/gather/", "zero/regather/")):  # (ZeRO's gathers: finish re-gathers)
            continue
        owner = node.meta.get(meta.FOR, (node.name,))[0] if node.op == "redistribute" else node.name
        layer = _layered(owner)
        if layer is None or (wanted is not None and layer not in wanted):
            continue
        if mode == "selective" and not _is_core(node if node.op != "redistribute" or owner not in graph
                                                else graph.node(owner)):
            continue
        out.setdefault(layer, []).append(node)
    if wanted is not None:
        known = {_layered(n.name) for n in graph.nodes} - {None}
        unknown = sorted(wanted - known)
        if unknown:
            raise SpecError("bad-value", f"no layer named {unknown[0]!r} to recompute", path="recompute.layers",
                            hint=f"the graph's layers: {', '.join(sorted(known)[:8]) or 'none'}")
    return out


class Recompute:
    """The recompute pass (module docstring); ``run`` returns a new graph, or the same one
    when nothing is recomputed.  ``recomputed`` after a run: layer -> the copied nodes' names."""

    name = "recompute"

    def __init__(self, mode: str = "none", layers=None) -> None:
        if mode not in MODES:
            raise SpecError("bad-value", f"unknown recompute mode {mode!r}", path="recompute.mode",
                            hint=f"use one of {', '.join(MODES)}")
        self.mode = mode
        self.layers = None if layers is None else tuple(layers)
        self.recomputed: dict[str, list[str]] = {}

    def run(self, graph: Graph) -> Graph:
        chosen = segments(graph, self.mode, self.layers)
        if not chosen:
            return graph
        nodes = graph.topo_order()
        backward = {n.name for n in nodes if _is_backward(graph, n)}
        readers: dict[str, list[str]] = {}  # value -> backward nodes reading it
        for node in nodes:
            if node.name in backward:
                for value in node.inputs:
                    readers.setdefault(value, []).append(node.name)
        position = {n.name: i for i, n in enumerate(nodes)}
        plans = []  # (the first backward reader's position, the layer, the nodes to copy, value -> its readers)
        for layer, seg in chosen.items():
            made = {v: n for n in seg for v in n.outputs}
            # a value another layer's backward reads (the layer's output: the next layer's input) is that
            # layer's input, which stays: its readers keep the original, and the copies run right before
            # this layer's own backward (on this layer's pipeline stage), not before the next layer's
            own = {v: [r for r in readers.get(v, ()) if _reader_layer(graph, r) in (layer, None)] for v in made}
            saved = [v for v in made if own[v]]
            if not saved:
                continue
            needed: set[str] = set()
            stack = [made[v].name for v in saved]
            by_name = {n.name: n for n in seg}
            while stack:  # the segment's nodes the saved values depend on
                name = stack.pop()
                if name in needed:
                    continue
                needed.add(name)
                stack.extend(made[v].name for v in by_name[name].inputs if v in made)
            if self.mode == "full":
                needed = _rerun(seg, needed, made)
            copies = [n for n in seg if n.name in needed]
            first = min(position[r] for v in saved for r in own[v])
            plans.append((first, layer, copies, {v: own[v] for v in saved}))
        if not plans:
            return graph
        taken = set(position)
        insert_before: dict[int, list[Node]] = {}
        rename: dict[str, dict[str, str]] = {}  # backward node -> {old value: copy}
        for first, layer, copies, saved in plans:  # saved: value -> the backward nodes that read its copy
            mapping: dict[str, str] = {}
            new_nodes = []
            for node in copies:
                name = _fresh(PREFIX + node.name, taken)
                taken.add(name)
                copy = Node(name, node.op, tuple(mapping.get(v, v) for v in node.inputs), node.attrs,
                            node.num_outputs, {**node.meta, meta.INSERTED_BY: INSERTED})
                copy.meta.pop(meta.FOR, None)
                mapping.update(zip(node.outputs, copy.outputs))
                new_nodes.append(copy)
            insert_before.setdefault(first, []).extend(new_nodes)
            self.recomputed[layer] = [n.name for n in new_nodes]
            for value, own_readers in saved.items():
                for reader in own_readers:
                    rename.setdefault(reader, {})[value] = mapping[value]
        out: dict[str, Node] = {}
        for index, node in enumerate(nodes):
            for copy in insert_before.get(index, ()):
                out[copy.name] = copy
            change = rename.get(node.name)
            if change:
                node = Node(node.name, node.op, tuple(change.get(v, v) for v in node.inputs), node.attrs,
                            node.num_outputs, dict(node.meta))
            out[node.name] = node
        return Graph.from_nodes(graph.mesh, out, graph.outputs, graph.meta)


#: the ops full recomputation re-runs though the backward reads nothing they make: the layer's products and its
#: collectives (the MLP's down projection and the row-parallel reduction after it)
RERUN_OPS = ("matmul", "linear", "batch_matmul", "einsum", "redistribute")


def _rerun(seg: list[Node], needed: set[str], made: dict[str, Node]) -> set[str]:
    """The nodes of a layer's segment full recomputation copies: those the backward needs (``needed``), and every
    product and collective of the layer besides with what they read in the segment, as Megatron-LM's checkpointed
    layer runs its forward again whole (torch.utils.checkpoint calls the layer's forward function: the down
    projection too, whose output only the residual add reads).  The elementwise tail after the last product (a
    bias add, dropout, the residual add), whose outputs nothing reads, is left out: copies nothing reads would
    have no task of their own on a pipeline stage (nor would ZeRO-3's re-gather of the bias they read)."""
    out = set(needed)
    stack = [n.name for n in seg if n.op in RERUN_OPS]
    by_name = {n.name: n for n in seg}
    while stack:
        name = stack.pop()
        if name in out:
            continue
        out.add(name)
        stack.extend(made[v].name for v in by_name[name].inputs if v in made)
    return out


def _reader_layer(graph: Graph, name: str) -> str | None:
    """The layer a backward node works for (``grad/l2_h/...``: l2; a reshard move: its consumer's), or None."""
    node = graph.node(name)
    owner = node.meta.get(meta.FOR, (name,))[0] if node.op == "redistribute" else name
    return _layered(owner)


def _fresh(base: str, taken) -> str:
    return fresh_name(base, taken.__contains__, sep="/")  # (not "#" or "@": lowering names its local values with them)


def held_values(graph: Graph, rank: int = 0) -> dict[str, tuple[str | None, int]]:
    """The forward values held into the backward: value -> (its layer or None, bytes on ``rank``).

    A value is held when it is made before the first backward node and read at or after it
    (or is a graph output).  Its layer is that of the node that makes it (a reshard move: of
    the node it serves).  After :class:`Recompute`, a recomputed value is read only by its
    copy's readers, so only what each segment keeps is held.
    """
    nodes = graph.topo_order()
    boundary = next((i for i, n in enumerate(nodes) if _is_backward(graph, n)), len(nodes))
    last: dict[str, int] = {}
    for index, node in enumerate(nodes):
        for value in node.inputs:
            last[value] = index
    kept = set(graph.outputs)
    out: dict[str, tuple[str | None, int]] = {}
    for node in nodes[:boundary]:
        if node.is_input:
            continue
        owner = node.meta.get(meta.FOR, (node.name,))[0] if node.op == "redistribute" else node.name
        for value, spec in zip(node.outputs, node.meta.get(meta.SPECS, ())):
            if spec is not None and (value in kept or last.get(value, -1) >= boundary):
                out[value] = (_layered(owner), spec.local_nbytes(rank))
    return out


def layer_activations(graph: Graph, rank: int = 0) -> dict[str, int]:
    """The bytes each layer holds from its forward into the backward (:func:`held_values`
    summed by layer): the quantity of Korthikanti et al.'s per-layer formulas."""
    out: dict[str, int] = {}
    for layer, nbytes in held_values(graph, rank).values():
        if layer is not None:
            out[layer] = out.get(layer, 0) + nbytes
    return out
