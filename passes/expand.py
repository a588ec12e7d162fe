"""expand: write a node as the subgraph its rule offers where that moves fewer bytes.

A transforming pass, run by :func:`layout_prop.api.analyze` after propagation when it
reshards (``check --reshard``, ``run``, ``lower``, ``plan``'s measurements).  Some ops
have a sharded strategy that one node cannot hold, because a node runs one kernel and a
kernel cannot communicate: vocabulary-parallel cross entropy, top-k and cumsum along a
sharded dim.  Their rules offer it through :meth:`~layout_prop.core.registry.OpRule.expand`:
given the input specs, a subgraph of other ops (``max``, ``cross_entropy_parts``,
``cross_entropy_combine``; ``topk_candidates``, ``topk_merge``; ``chunk_sum``, ``cumsum``,
``chunk_cumsum``) that computes the node without moving its big input.

One sweep in topological order builds the new graph: a node that reads a value whose spec
an expansion changed is propagated again (a copy), every other node is shared with the
given graph, which is left as it was.  A node whose rule asks a move (a
fixable violation) and whose rule has an ``expand`` hook is offered to the hook; its
subgraph replaces the node when every violation in it is fixable and its moves cost
strictly fewer bytes per rank than the moves the plain rule asks (the forward node's own
moves: the backward is not compared; the subgraph's moves count the steps of its ops that
are communication, a ring's shifts), or when the hook says the node's attrs ask for it
(``b.force(reason)``: ``context_parallel='ring'``, whose ring moves the bytes of the gather),
unless one of the subgraph's own moves cannot be planned (the reshard pass could not make it: the
node stays, with a note).  A hook may add a note (``b.note``) saying why it kept the node as it
is.  A forced expansion is recorded (:class:`Forced`: how each part reads its inputs, what its
communication parts move) so that a later choice of moves that no longer runs it as written (the
whole-graph plan of :func:`layout_prop.api.analyze` gathering k and v, or not sharding the
sequence at all) is seen (:func:`unkept`) and said.  The subgraph's nodes are named ``NODE/...`` and
its last node takes the node's own name and outputs, so consumers and graph outputs read
it unchanged; its result must have the node's output shapes and dtypes.  The reshard pass
then inserts the subgraph's (small) moves, and the
backward pass differentiates it through its own ops' vjps.

Examples
--------
>>> from layout_prop.io.loader import load_spec
>>> g = load_spec('''
... mesh: {shape: [4], names: [tp]}
... inputs: {x: {shape: [6, 40], placements: ["S(1)"]}}
... nodes: [{name: top, op: topk, inputs: [x], attrs: {k: 2}}]
... outputs: ["top:0", "top:1"]
... ''')
>>> result = Expand().run(g)
>>> [(n.name, n.op) for n in result.graph.nodes]
[('x', 'input'), ('top/candidates', 'topk_candidates'), ('top', 'topk_merge')]
>>> result.notes
['expand: top (topk) written as top/candidates (topk_candidates), top (topk_merge): 432 bytes per rank of \
redistribution instead of 720']
>>> [n.op for n in g.nodes]  # the given graph is unchanged
['input', 'topk']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from layout_prop.core import meta
from layout_prop.core.errors import LayoutPropError, OpError
from layout_prop.core.graph import Graph, Node, fresh_name
from layout_prop.core.layout import Layout
from layout_prop.core.redistribute import plan_redistribution
from layout_prop.core.registry import OpRule, get_rule
from layout_prop.core.spec import TensorSpec

from .base import GraphPass, PassResult
from .propagate import Propagate, value_spec

__all__ = ["Expand", "ExpandResult", "EXPANDED_FROM", "Forced", "unkept", "comm_bytes"]

#: node metadata key on the nodes of an expansion: the name of the node they replace
EXPANDED_FROM = "expanded_from"


class Read(NamedTuple):
    """How a part of an expansion reads one input, as the expand pass wrote it."""

    value: str
    layout: Layout | None
    asked: bool  # moved to ``layout`` by the part's own rule (a move the expansion counts)


@dataclass(frozen=True)
class Forced:
    """An expansion kept because the node's attrs ask it (``b.force``), as the expand pass wrote it.

    ``reads``: per part, how it reads each input; ``comm``: per part that is communication (a
    ring's shift), the kind and mesh axis of each of its steps.
    """

    node: str
    op: str
    reason: str  # what asks it, as the note says: "context_parallel='ring' on mesh axis 'cp'"
    inputs: tuple[str, ...]  # the node's inputs
    parts: tuple[str, ...]
    reads: dict[str, tuple[Read, ...]]
    comm: dict[str, tuple[tuple[str, int], ...]]

    def axes(self, ndim: int) -> tuple[int, ...]:
        """The mesh axes its communication parts take steps on (all ``ndim`` when they take none)."""
        found = sorted({axis for steps in self.comm.values() for _, axis in steps})
        return tuple(found) if found else tuple(range(ndim))


@dataclass
class ExpandResult:
    graph: Graph
    expanded: dict[str, tuple[str, ...]] = field(default_factory=dict)  # node -> its subgraph's node names
    notes: list[str] = field(default_factory=list)
    forced: list[Forced] = field(default_factory=list)  # the expansions kept because the node's attrs ask them


class Expand(GraphPass):
    name = "expand"
    transforms = True

    def __init__(self, propagate: Propagate | None = None) -> None:
        self.propagate = propagate or Propagate()

    def applies(self, ctx: PassContext) -> bool:
        return ctx.options.reshard

    def apply(self, graph: Graph, ctx: PassContext) -> PassResult:
        """:meth:`run` with the context's cache; its notes said in ``ctx.notes``."""
        result = Expand(ctx.propagate).run(graph)
        ctx.notes.extend(result.notes)
        return PassResult(result.graph, bool(result.expanded), result)

    def run(self, graph: Graph) -> ExpandResult:
        """Propagate ``graph`` (in place, if it is not yet), then build the expanded graph.

        The graph itself is returned when no node is a candidate (no rule with an ``expand``
        hook asks a move), or when no hook's subgraph is kept.
        """
        nodes = graph.topo_order()
        if any(meta.SPECS not in n.meta for n in nodes):
            self.propagate.run(graph)
        if not any(_candidate(n) for n in nodes):
            return ExpandResult(graph)
        sweep = _Sweep(self.propagate, graph)
        for node in nodes:
            sweep.add(node)
        if not sweep.expanded:
            return ExpandResult(graph, notes=sweep.notes)
        return ExpandResult(Graph.from_nodes(graph.mesh, sweep.nodes, graph.outputs, graph.meta), sweep.expanded,
                            sweep.notes, sweep.forced)


class _Sweep:
    """The state of one sweep: the new graph's nodes so far, by name, in order.

    A node whose inputs kept their specs is shared with the given graph; one that reads a
    value whose spec changed (downstream of an expansion) is propagated again as a copy,
    and so is a candidate, before its hook is asked.
    """

    def __init__(self, propagate: Propagate, graph: Graph) -> None:
        self.propagate = propagate
        self.graph = graph
        self.nodes: dict[str, Node] = {}
        self.changed: set[str] = set()  # values whose spec differs from the given graph's
        self.expanded: dict[str, tuple[str, ...]] = {}
        self.notes: list[str] = []
        self.forced: list[Forced] = []

    def spec(self, value: str) -> TensorSpec | None:
        """The spec of ``value`` (a value of the given graph) in the new graph."""
        producer, index = self.graph.producer(value)
        return self.nodes[producer.name].meta[meta.SPECS][index]

    def add(self, node: Node) -> None:
        m = node.meta
        if not _candidate(node) and self.changed.isdisjoint(node.inputs):
            self.nodes[node.name] = node
            return
        copy = Node(node.name, node.op, node.inputs, node.attrs, node.num_outputs, dict(m))
        specs = tuple([self.spec(value) for value in node.inputs])
        self.propagate.visit(self.graph, copy, specs)
        built = self._expansion(copy, specs) if _candidate(copy) else None
        last = copy if built is None else built[-1]
        for part in built or (copy,):
            self.nodes[part.name] = part
        if built is not None:
            self.expanded[node.name] = tuple(part.name for part in built)
        if last.meta[meta.SPECS] != m[meta.SPECS]:
            self.changed.update(node.outputs)

    def _expansion(self, node: Node, specs: tuple) -> list[Node] | None:
        """The subgraph ``node``'s rule offers, when it is kept (see the module docstring), else None."""
        if any(spec is None for spec in specs):
            return None
        rule = get_rule(node.op, node=node.name)
        builder = _Builder(self, node, specs)
        try:
            got = rule.expand(builder, node.inputs, node.meta[meta.ATTRS], specs)
        except LayoutPropError as err:  # the hook's ops refused these inputs: the node stays as written
            self.notes.append(f"expand: {node.name} ({node.op}) kept as it is: its expansion failed: {err}")
            return None
        if got is None:
            return None
        _check_result(rule, node, builder)
        if any(not v.fixable for part in builder.nodes for v in part.meta[meta.VIOLATIONS]):
            return None
        plain = _priced(node, specs, set())
        mine, moved = 0, set()  # a value moved to one layout for several nodes of the subgraph is moved once
        for part in builder.nodes:
            part_specs = tuple(builder.spec(value) for value in part.inputs)
            try:
                mine += _move_bytes(part, part_specs, moved) + comm_bytes(part, part_specs)
            except LayoutPropError as err:  # not kept, even when forced: the reshard pass could not make the move
                if builder.forced is not None:
                    self.notes.append(f"expand: {node.name} ({node.op}) kept as it is, though {builder.forced} "
                                      f"asks its expansion: the moves of {part.name} ({part.op}) cannot be "
                                      f"planned: {err}")
                return None
        if builder.forced is None and (plain is None or mine >= plain):
            return None
        written = ", ".join(f"{part.name} ({part.op})" for part in builder.nodes)
        self.notes.append(f"expand: {node.name} ({node.op}) written as {written}: "
                          f"{_bytes_clause(mine, plain, builder.forced)}")
        if builder.forced is not None:
            self.forced.append(_forced(node, builder))
        return builder.nodes


def _bytes_clause(mine: int, plain: int | None, forced: str | None) -> str:
    """What an expansion's note says of its bytes: the subgraph's moves against the plain rule's
    (None: one of those cannot be planned; only a forced expansion is kept then).

    >>> _bytes_clause(432, 720, None)
    '432 bytes per rank of redistribution instead of 720'
    >>> _bytes_clause(256, None, "context_parallel='ring' on mesh axis 'cp'")
    "256 bytes per rank of redistribution; the plain rule's moves cannot be planned (context_parallel='ring' on \
mesh axis 'cp' asks it)"
    """
    why = "" if forced is None else f" ({forced} asks it)"
    if plain is None:
        return f"{mine} bytes per rank of redistribution; the plain rule's moves cannot be planned{why}"
    return f"{mine} bytes per rank of redistribution instead of {plain}{why}"


def _forced(node: Node, builder: "_Builder") -> Forced:
    """The record of the forced expansion of ``node`` that ``builder`` wrote."""
    reads, comm = {}, {}
    for part in builder.nodes:
        specs = tuple(builder.spec(value) for value in part.inputs)
        reads[part.name] = tuple(Read(value, want, True) if want is not None else
                                 Read(value, None if spec is None else spec.layout, False)
                                 for value, spec, want in zip(part.inputs, specs, part.meta[meta.WANTS]))
        steps = _comm_steps(part, specs)
        if steps is not None:
            comm[part.name] = steps
    return Forced(node.name, node.op, builder.forced, tuple(node.inputs), tuple(p.name for p in builder.nodes),
                  reads, comm)


def _comm_steps(node: Node, specs: Sequence[TensorSpec | None]) -> tuple[tuple[str, int], ...] | None:
    """The (kind, mesh axis) of each step of an op that is communication (None for a kernel)."""
    rule = get_rule(node.op, node=node.name)
    if not rule.is_communication:
        return None
    if any(spec is None for spec in specs):
        return ()
    return tuple((step.kind, step.mesh_axis) for step in rule.comm_steps(node.meta[meta.ATTRS], tuple(specs),
                                                                          node.meta[meta.SPECS]))


def unkept(graph: Graph, forced: Forced) -> str | None:
    """What ``graph`` (the forward holding ``forced``'s parts, moves inserted) does instead of the
    expansion as written, or None when it runs it so.

    It runs it so when every communication part still takes its steps (the same kinds on the
    same mesh axes) and no part reads, through a move the expansion did not ask itself, an
    input placed otherwise on those axes than as written (every axis, for an expansion without
    communication).  A layout changed on other axes (the batch gathered on dp for a ring on cp,
    a partial sum reduced before the shift) keeps it.
    """
    if any(part not in graph for part in forced.parts):
        return "its nodes are not in the graph"
    axes = forced.axes(graph.mesh.ndim)
    silent, moved = [], []
    reads: dict[str, list[Layout]] = {}  # the node's inputs, by the layouts the parts read them in
    for name in forced.parts:
        part = graph.node(name)
        specs = [value_spec(graph, value) for value in part.inputs]
        for value, spec, written in zip(part.inputs, specs, forced.reads[name]):
            origin = _origin(graph, value)
            if origin in forced.inputs and spec is not None and spec.layout not in reads.setdefault(origin, []):
                reads[origin].append(spec.layout)
            if (origin != value and not written.asked and spec is not None
                    and not _same_on(spec.layout, written.layout, axes)):
                moved.append(f"{name} ({part.op}) reads {origin} moved to {spec.layout}")
        if name in forced.comm:
            steps = _comm_steps(part, specs)
            if steps != forced.comm[name]:
                silent.append((name, part.op, steps))
    if not silent and not moved:
        return None
    said = []
    written = _read_layouts(forced)
    changed = {value: (_distinct_on(layouts, axes), _distinct_on(written[value], axes))
               for value, layouts in reads.items()
               if written.get(value) and not any(_same_on(now, was, axes) for now in layouts for was in written[value])}
    if changed:
        said.append(f"its nodes read {_reads_text(changed)}")
    said.extend(moved)
    quiet = [name for name, _, steps in silent if not steps]
    if quiet:
        ops = sorted({op for _, op, steps in silent if not steps})
        said.append(f"{', '.join(quiet)} ({', '.join(ops)}) move nothing")
    said.extend(f"{name} ({op}) moves by {', '.join(f'{kind}({graph.mesh.names[axis]})' for kind, axis in steps)}"
                for name, op, steps in silent if steps)
    return "; ".join(said)


def _same_on(a: Layout | None, b: Layout | None, axes: Sequence[int]) -> bool:
    """Whether layouts ``a`` and ``b`` place the tensor alike on the mesh ``axes``."""
    if a is None or b is None:
        return a is b
    return all(a.placements[axis] == b.placements[axis] for axis in axes)


def _distinct_on(layouts: list[Layout], axes: Sequence[int]) -> list[Layout]:
    """The first of ``layouts`` of each placement on ``axes`` (the ones that differ elsewhere only are one)."""
    out: list[Layout] = []
    for layout in layouts:
        if not any(_same_on(layout, seen, axes) for seen in out):
            out.append(layout)
    return out


def _read_layouts(forced: Forced) -> dict[str, list[Layout]]:
    """The layouts the parts read each of the node's inputs in, as the expansion was written."""
    out: dict[str, list[Layout]] = {}
    for name in forced.parts:
        for value, layout, _ in forced.reads[name]:
            if value in forced.inputs and layout is not None and layout not in out.setdefault(value, []):
                out[value].append(layout)
    return out


def _reads_text(changed: dict[str, tuple[list[Layout], list[Layout]]]) -> str:
    """``q, k, v as (R, R), not (S(0), S(1))`` when they changed alike, else ``q as ..., not ...; k as ...``.

    >>> from layout_prop.core.mesh import DeviceMesh
    >>> mesh = DeviceMesh((2,), ("cp",))
    >>> r, s = Layout(mesh, ["R"], 4), Layout(mesh, ["S(2)"], 4)
    >>> _reads_text({"q": ([r], [s]), "k": ([r], [s])})
    'q, k as (R), not (S(2))'
    >>> _reads_text({"q": ([r], [s]), "k": ([r, s], [s])})
    'q as (R), not (S(2)); k as (R) or (S(2)), not (S(2))'
    """
    texts = {value: (" or ".join(map(str, now)), " or ".join(map(str, was))) for value, (now, was) in changed.items()}
    if len(set(texts.values())) == 1:
        now, was = next(iter(texts.values()))
        return f"{', '.join(texts)} as {now}, not {was}"
    return "; ".join(f"{value} as {now}, not {was}" for value, (now, was) in texts.items())


def _origin(graph: Graph, value: str) -> str:
    """``value``, or the value a chain of inserted moves (``redistribute`` nodes) started from."""
    while True:
        producer, _ = graph.producer(value)
        if producer.op != "redistribute" or not producer.meta.get(meta.INSERTED_BY):
            return value
        value = producer.inputs[0]


def _candidate(node: Node) -> bool:
    """Whether ``node``'s rule asks a move and has an ``expand`` hook."""
    if node.is_input or not any(v.fixable for v in node.meta.get(meta.VIOLATIONS, ())):
        return False
    return type(get_rule(node.op, node=node.name)).expand is not OpRule.expand


def _priced(node: Node, specs: Sequence[TensorSpec | None], moved: set) -> int | None:
    """:func:`_move_bytes`, None when one of the moves cannot be planned."""
    try:
        return _move_bytes(node, specs, moved)
    except LayoutPropError:
        return None


def _move_bytes(node: Node, specs: Sequence[TensorSpec | None], moved: set) -> int:
    """Bytes per rank of the moves ``node``'s rule asks for its inputs, but those in ``moved``
    (``(value, layout)``, added to); the error of the first one that cannot be planned is raised."""
    total = 0
    for value, spec, want in zip(node.inputs, specs, node.meta[meta.WANTS]):
        if want is None or spec is None or (value, want) in moved:
            continue
        moved.add((value, want))
        total += plan_redistribution(spec, want).bytes_per_rank
    return total


def comm_bytes(node: Node, specs: Sequence[TensorSpec | None]) -> int:
    """Bytes per rank of the steps of an op that is communication (a ring's shift; 0 for a kernel)."""
    rule = get_rule(node.op, node=node.name)
    if not rule.is_communication or any(spec is None for spec in specs):
        return 0
    return sum(step.bytes_per_rank for step in rule.comm_steps(node.meta[meta.ATTRS], tuple(specs),
                                                               node.meta[meta.SPECS]))


def _check_result(rule, node: Node, builder: "_Builder") -> None:
    """``bad-rule`` unless the hook ended with ``result`` and its outputs have the node's shapes and dtypes."""
    last = builder.nodes[-1] if builder.nodes else None
    if last is None or last is not builder.done:
        raise OpError("bad-rule", f"the expand hook of {rule.name!r} did not end its subgraph with b.result(...)",
                      node=node.name, hint="write the last node of the subgraph with b.result")
    for value, have, want in zip(node.outputs, last.meta[meta.SPECS], node.meta[meta.SPECS]):
        if want is not None and (have is None or have.shape != want.shape or have.dtype != want.dtype):
            got = "no spec" if have is None else f"{have.dtype}{list(have.shape)}"
            raise OpError("bad-rule", f"the expansion of {rule.name!r} gives {value} as {got}, not the node's "
                          f"{want.dtype}{list(want.shape)}", node=node.name,
                          hint="an expansion computes the node's own outputs")


class _Builder:
    """The ExpandBuilder handed to an expand hook: nodes named after ``node``, propagated at once."""

    def __init__(self, sweep: _Sweep, node: Node, specs: tuple) -> None:
        self.sweep = sweep
        self.node = node
        self.nodes: list[Node] = []
        self.specs: dict[str, TensorSpec | None] = dict(zip(node.inputs, specs))  # what the subgraph may read
        self.done: Node | None = None
        self.forced: str | None = None

    def force(self, reason: str) -> None:
        """Keep this expansion even where it moves no fewer bytes: the node's attrs ask for it
        (``reason`` says which, in the note)."""
        self.forced = reason

    def note(self, text: str) -> None:
        """A note of the expand pass (why a hook kept its node as it is, say)."""
        self.sweep.notes.append(text)

    def op(self, op: str, inputs: Sequence[str], attrs: dict | None = None, num_outputs: int = 1,
           name: str | None = None) -> str | tuple[str, ...]:
        rule = get_rule(op, node=self.node.name)
        return self._add(Node(self._fresh(f"{self.node.name}/{name or rule.name}"), rule.name, tuple(inputs),
                              dict(attrs or {}), num_outputs))

    def result(self, op: str, inputs: Sequence[str], attrs: dict | None = None) -> str | tuple[str, ...]:
        rule = get_rule(op, node=self.node.name)
        self.done = Node(self.node.name, rule.name, tuple(inputs), dict(attrs or {}), self.node.num_outputs)
        return self._add(self.done)

    def spec(self, value: str) -> TensorSpec | None:
        return self.specs[value]

    def _add(self, node: Node) -> str | tuple[str, ...]:
        if self.done is not None and node is not self.done:
            raise OpError("bad-rule", f"the expand hook of {self.node.op!r} added {node.op} after b.result",
                          node=self.node.name, hint="b.result writes the last node of the subgraph")
        for value in node.inputs:
            if value not in self.specs:
                raise OpError("bad-rule", f"the expansion of {self.node.op!r} reads {value!r}, which is neither "
                              "an input of the node nor a value of its subgraph", node=self.node.name,
                              hint="an expansion reads the node's inputs and its own values")
        node.meta[EXPANDED_FROM] = self.node.name
        self.sweep.propagate.visit(self.sweep.graph, node, tuple([self.specs[value] for value in node.inputs]))
        self.specs.update(zip(node.outputs, node.meta[meta.SPECS]))
        self.nodes.append(node)
        return node.outputs[0] if node.num_outputs == 1 else node.outputs

    def _fresh(self, base: str) -> str:
        """``base``, or ``base2``, ``base3``...: the first name no graph nor the subgraph has."""
        graph, nodes = self.sweep.graph, self.sweep.nodes
        taken = {part.name for part in self.nodes}
        return fresh_name(base, lambda name: name in graph or name in nodes or name in taken or graph.has_value(name))
