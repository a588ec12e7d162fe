"""reshard: insert the cheapest redistribution for every input a rule wants moved.

A transforming pass: it builds a new graph through an old -> new map (inputs are
rewired to the inserted ``redistribute`` nodes) and propagates it.  Only wants that cost
communication, or that a violation names, get a node; free local slices stay implicit
(lowering slices locally).  A
value moved to the same layout for several consumers is moved once.  Violations that no
redistribution can fix (a bad mode, shapes that do not broadcast) remain.

Examples
--------
>>> from layout_prop import DeviceMesh
>>> from layout_prop.graph import Graph
>>> g = Graph(DeviceMesh((2,), ("dp",)))
>>> a = g.input("a", shape=(4,), placements=["P(sum)"])
>>> b = g.input("b", shape=(4,))
>>> g.output(g.op("c", "add", [a, b]))
>>> new = Reshard().run(g).graph
>>> print(new.format())
graph(mesh=DeviceMesh(dp=2)):
  a = input() {shape=[4], dtype=float32, placements=["P(sum)"], requires_grad=true}
  b = input() {shape=[4], dtype=float32, placements=["R"], requires_grad=true}
  c/x = redistribute(a) {placements=["R"]}
  c = add(c/x, b)
  return c
"""

from __future__ import annotations

from dataclasses import dataclass

from layout_prop import meta
from layout_prop.errors import LayoutPropError
from layout_prop.graph import Graph, Node
from layout_prop.redistribute import plan_redistribution
from layout_prop.registry import get_rule

from .propagate import Propagate, value_spec

__all__ = ["Reshard", "ReshardResult"]


@dataclass
class ReshardResult:
    graph: Graph
    inserted: int


class Reshard:
    name = "reshard"
    max_rounds = 8

    def __init__(self, propagate: Propagate | None = None) -> None:
        self.propagate = propagate or Propagate()

    def run(self, graph: Graph) -> ReshardResult:
        propagated = self.propagate.run(graph)
        total = 0
        for _ in range(self.max_rounds):
            if not any(v.fixable for v in propagated.violations):
                break  # nothing (more) a redistribution can fix: keep the graph as it is
            new, inserted, touched = self._round(graph)
            if not inserted:
                break
            total += inserted
            propagated = self.propagate.run(new, touched)  # only what the new nodes can change is visited
            graph = new
        return ReshardResult(graph, total)

    def _round(self, graph: Graph) -> tuple[Graph, int, set[str]]:
        """The graph with this round's redistributions; the count; the nodes to propagate again.

        Nodes without violations are shared with the old graph; rewired consumers are
        copies with a copy of their metadata.  Propagation then revisits the inserted
        nodes, the rewired ones and what changes downstream of them, copying a shared
        node before it writes to it, so the old graph is left as it was.
        """
        nodes: list[Node] = []
        names = set(graph._nodes)  # noqa: SLF001 - fresh names must not clash with the old graph's
        moved: dict[tuple[str, tuple], str] = {}
        touched: set[str] = set()
        inserted = 0
        for node in graph.topo_order():
            if not node.meta.get(meta.VIOLATIONS):  # nothing to move: the node is shared with the old graph
                nodes.append(node)
                continue
            inputs = list(node.inputs)
            rule = get_rule(node.op)
            flagged = {v.input for v in node.meta[meta.VIOLATIONS] if v.fixable}
            for i, (value, want) in enumerate(zip(node.inputs, node.meta.get(meta.WANTS, ()))):
                if want is None or not self._needs_node(graph, value, want, value in flagged):
                    continue
                key = (value, tuple(want.placements))
                if key not in moved:
                    name = self._fresh(names, f"{node.name}/{rule.operand_name(i)}")
                    names.add(name)
                    nodes.append(Node(name, "redistribute", (value,), {"placements": tuple(want.placement_strs())},
                                      meta={meta.INSERTED_BY: self.name, "for": (node.name, value)}))
                    moved[key] = name
                    touched.add(name)
                    inserted += 1
                inputs[i] = moved[key]
                touched.add(node.name)
            nodes.append(Node(node.name, node.op, tuple(inputs), node.attrs, node.num_outputs, dict(node.meta)))
        return Graph.from_nodes(graph.mesh, nodes, graph.outputs, graph.meta), inserted, touched

    @staticmethod
    def _needs_node(graph: Graph, value: str, want, flagged: bool) -> bool:
        """A move that costs communication, or one a violation asks for (a relabel on a size-1 axis)."""
        spec = value_spec(graph, value)
        try:
            plan = plan_redistribution(spec, want)
        except LayoutPropError:
            return False
        return flagged or not plan.is_free

    @staticmethod
    def _fresh(taken: set[str], base: str) -> str:
        name, i = base, 1
        while name in taken:
            i += 1
            name = f"{base}{i}"
        return name
