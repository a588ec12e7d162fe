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
(``b.force(reason)``: ``context_parallel='ring'``, whose ring moves the bytes of the gather).
A hook may add a note (``b.note``) saying why it kept the node as it is.  The subgraph's nodes are named ``NODE/...`` and
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
from typing import Sequence

from layout_prop.core import meta
from layout_prop.core.errors import LayoutPropError, OpError
from layout_prop.core.graph import Graph, Node
from layout_prop.core.redistribute import plan_redistribution
from layout_prop.core.registry import OpRule, get_rule
from layout_prop.core.spec import TensorSpec

from .propagate import Propagate

__all__ = ["Expand", "ExpandResult", "EXPANDED_FROM"]

#: node metadata key on the nodes of an expansion: the name of the node they replace
EXPANDED_FROM = "expanded_from"


@dataclass
class ExpandResult:
    graph: Graph
    expanded: dict[str, tuple[str, ...]] = field(default_factory=dict)  # node -> its subgraph's node names
    notes: list[str] = field(default_factory=list)


class Expand:
    name = "expand"

    def __init__(self, propagate: Propagate | None = None) -> None:
        self.propagate = propagate or Propagate()

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
                            sweep.notes)


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
        plain = _move_bytes(node, specs, set())
        mine, moved = 0, set()  # a value moved to one layout for several nodes of the subgraph is moved once
        for part in builder.nodes:
            part_specs = tuple(builder.spec(value) for value in part.inputs)
            cost = _move_bytes(part, part_specs, moved)
            cost = None if cost is None else cost + _comm_bytes(part, part_specs)
            mine = None if cost is None or mine is None else mine + cost
        if builder.forced is None and (plain is None or mine is None or mine >= plain):
            return None
        written = ", ".join(f"{part.name} ({part.op})" for part in builder.nodes)
        why = "" if builder.forced is None else f" ({builder.forced} asks it)"
        self.notes.append(f"expand: {node.name} ({node.op}) written as {written}: {mine} bytes per rank of "
                          f"redistribution instead of {plain}{why}")
        return builder.nodes


def _candidate(node: Node) -> bool:
    """Whether ``node``'s rule asks a move and has an ``expand`` hook."""
    if node.is_input or not any(v.fixable for v in node.meta.get(meta.VIOLATIONS, ())):
        return False
    return type(get_rule(node.op, node=node.name)).expand is not OpRule.expand


def _move_bytes(node: Node, specs: Sequence[TensorSpec | None], moved: set) -> int | None:
    """Bytes per rank of the moves ``node``'s rule asks for its inputs (None: some cannot be planned), but
    those in ``moved`` (``(value, layout)``, added to)."""
    total = 0
    for value, spec, want in zip(node.inputs, specs, node.meta[meta.WANTS]):
        if want is None or spec is None or (value, want) in moved:
            continue
        moved.add((value, want))
        try:
            total += plan_redistribution(spec, want).bytes_per_rank
        except LayoutPropError:
            return None
    return total


def _comm_bytes(node: Node, specs: Sequence[TensorSpec | None]) -> int:
    """Bytes per rank of the steps of an op that is communication (a ring's shift; 0 for a kernel)."""
    rule = get_rule(node.op, node=node.name)
    if type(rule).comm_steps is OpRule.comm_steps or any(spec is None for spec in specs):
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
        name, i = base, 1
        while name in graph or name in nodes or name in taken or graph.has_value(name):
            i += 1
            name = f"{base}{i}"
        return name
