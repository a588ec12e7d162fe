"""verify: the graph verifier the tests run after every pass (as fx ``Graph.lint``).

Checks that the graph is well formed (:meth:`Graph.lint`), that every value has a spec
whose mesh is the graph's, that the metadata is not stale (every node's specs, violation
codes and wants are what a fresh propagation of the graph gives: a pass that changes
the graph and leaves old specs behind is caught here), and, with ``resolved=True``
(after reshard), that every consumer sees a layout its rule accepts: no violations, and
every remaining want is a free local slice.

Examples
--------
>>> from layout_prop.io.loader import load_spec
>>> from layout_prop.passes.propagate import Propagate
>>> g = load_spec('''
... mesh: {shape: [2], names: [dp]}
... inputs: {a: {shape: [4], placements: ["P(sum)"]}, b: {shape: [4], placements: ["S(0)"]}}
... nodes: [{name: c, op: add, inputs: [a, b]}]
... ''')
>>> _ = Propagate().run(g)
>>> Verify().run(g)
>>> Verify(resolved=True).run(g)
Traceback (most recent call last):
...
layout_prop.core.errors.GraphError: unresolved-violation at node 'c': partial-input ... (hint: run the reshard pass)
"""

from __future__ import annotations

from layout_prop.core import meta
from layout_prop.core.errors import GraphError, LayoutPropError
from layout_prop.core.graph import Graph
from layout_prop.core.redistribute import plan_redistribution

from .base import GraphPass, PassResult
from .propagate import Propagate, value_spec

__all__ = ["Verify"]


class Verify(GraphPass):
    """The verifier; ``resolved`` None (in a pipeline): resolved when the run resharded and its
    check (``ctx.results["check"]``) is clean."""

    name = "verify"

    def __init__(self, resolved: bool | None = False) -> None:
        self.resolved = resolved

    def applies(self, ctx: PassContext) -> bool:
        return ctx.options.verify

    def apply(self, graph: Graph, ctx: PassContext) -> PassResult:
        resolved = self.resolved
        if resolved is None:
            check = ctx.results.get("check")
            resolved = ctx.options.reshard and check is not None and check.ok
        Verify(resolved).run(graph)
        return PassResult(graph, False, None)

    def run(self, graph: Graph) -> None:
        graph.lint()
        for node in graph.topo_order():
            specs = node.meta.get(meta.SPECS)
            if specs is None or len(specs) != node.num_outputs:
                raise GraphError("missing-spec", f"node {node.name!r} has no propagated spec", node=node.name,
                                 hint="run the propagate pass")
            for spec in specs:
                if spec is not None and spec.mesh != graph.mesh:
                    raise GraphError("foreign-mesh", f"node {node.name!r} has a spec on {spec.mesh}, not "
                                     f"{graph.mesh}", node=node.name, hint="a graph has one mesh")
        self._check_fresh(graph)
        if not self.resolved:
            return
        for node in graph.topo_order():
            if node.is_input:
                continue
            specs = node.meta[meta.SPECS]
            violations = node.meta.get(meta.VIOLATIONS, ())
            if violations:
                raise GraphError("unresolved-violation", f"{violations[0]}", node=node.name,
                                 hint="run the reshard pass")
            if any(s is None for s in specs):
                raise GraphError("missing-spec", f"node {node.name!r} has an unusable output", node=node.name,
                                 hint="fix its inputs")
            for value, want in zip(node.inputs, node.meta.get(meta.WANTS, ())):
                if want is None:
                    continue
                try:
                    free = plan_redistribution(value_spec(graph, value), want).is_free
                except LayoutPropError:
                    free = False
                if not free:
                    raise GraphError("unresolved-want", f"input {value!r} of {node.name!r} needs communication to "
                                     f"reach {want}", node=node.name, input=value, hint="run the reshard pass")

    @staticmethod
    def _check_fresh(graph: Graph) -> None:
        """Every node carries what a fresh propagation (own cache, empty metadata) gives it."""
        fresh = graph.copy_structure()
        Propagate().run(fresh)
        for node in graph.topo_order():
            got, want = node.meta, fresh.node(node.name).meta
            for key in (meta.SPECS, meta.WANTS):
                if got.get(key) != want[key]:
                    raise GraphError("stale-spec", f"node {node.name!r} carries {key} {_text(got.get(key))}, but "
                                     f"propagating the graph afresh gives {_text(want[key])}", node=node.name,
                                     hint=_STALE_HINT)
            codes = [v.code for v in got.get(meta.VIOLATIONS, ())]
            if codes != [v.code for v in want[meta.VIOLATIONS]]:
                raise GraphError("stale-spec", f"node {node.name!r} carries violations {codes}, but propagating "
                                 f"the graph afresh gives {[v.code for v in want[meta.VIOLATIONS]]}",
                                 node=node.name, hint=_STALE_HINT)


_STALE_HINT = ("propagate again after changing a graph; an op node's attrs are treated as immutable "
               "(replace node.attrs, do not edit it in place, or propagate with a new Propagate)")


def _text(values) -> str:
    return "None" if values is None else "[" + ", ".join(str(v) for v in values) + "]"
