"""complete: give ``placements: auto`` inputs the layout their consumers need.

Like Shardy's backward propagation from consumers: for an auto input, each consumer's
rule says, through its ``wants``, which layout it would like that input in (given the
other inputs).  Every candidate (those wants, plus all-Replicate) is tried; the one with
the fewest violations, then the fewest bytes of redistribution over the whole graph,
then the smallest local pieces of the inputs (memory), then the fewest moves wins.  The choice and each
alternative with its cost are reported as notes.  Inputs are completed in input order.

An auto input read by a node whose attrs ask a ring (``context_parallel='ring'``: the expand
pass writes ring attention where q, k and v shard their sequence on one mesh axis) also tries
the layouts of that node's other attention operands (q, k, v: the input cut like them runs the
ring; the node's other auto operands completed later are tried alike meanwhile, so that k and
v both auto can reach the ring), and each candidate is scored on the graph as the expand pass
writes it (the ring's shifts counted among the moves): the fewest violations, then the fewest rings the attrs ask
left unwritten, then bytes... as above.  The ring moves the bytes of the gather it replaces
(or more, where the gather moved only v), so on bytes alone the layout that drops the ring
would win; the notes say which candidates run the ring and which drop it.

A transforming pass: the layouts are written on a copy of the graph (:attr:`CompleteResult.graph`,
left propagated with what was chosen); the given graph keeps its ``auto`` inputs.

This is greedy (one input at a time, each scored by the graph's wants as they stand).  On
graphs of 2 to :data:`~layout_prop.planner.solver.GLOBAL_NODES` ops,
:func:`layout_prop.api.analyze` also solves every ``auto`` input together with the solver of
:mod:`layout_prop.planner.solver`, takes its layouts when they cost strictly fewer bytes, and
notes every alternative the solver weighed with the whole graph's bytes given it.

Examples
--------
>>> from layout_prop.io.loader import load_spec
>>> g = load_spec('''
... mesh: {shape: [2], names: [sp]}
... inputs:
...   x:   {shape: [2, 2, 8, 16], placements: ["S(2)"]}
...   cos: {shape: [1, 1, 8, 16], placements: auto}
...   sin: {shape: [1, 1, 8, 16], placements: auto}
... nodes:
...   - {name: y, op: rope, inputs: [x, cos, sin]}
... ''')
>>> res = Complete().run(g)
>>> res.chosen["cos"], res.graph.node("cos").attrs["placements"]
(('S(2)',), ('S(2)',))
>>> g.node("cos").attrs["placements"]  # the given graph is unchanged
'auto'
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layout_prop.core import meta
from layout_prop.core.errors import LayoutPropError
from layout_prop.core.graph import Graph
from layout_prop.core.registry import get_rule

from .base import GraphPass, PassResult, own_copy
from .expand import Expand, comm_bytes
from .propagate import Propagate, value_spec

__all__ = ["Complete", "CompleteResult"]


#: the operands of an attention node whose ring the attrs ask: q, k, v (the first three)
RING_OPERANDS = 3


@dataclass
class CompleteResult:
    chosen: dict[str, tuple[str, ...]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    rings: dict[str, tuple[str, ...]] = field(default_factory=dict)  # auto input -> the rings its choice runs
    #: the graph with the chosen layouts, propagated (a copy); the given graph itself when it has no ``auto``
    graph: Graph | None = None


class Complete(GraphPass):
    name = "complete"
    transforms = True

    def __init__(self, propagate: Propagate | None = None) -> None:
        self.propagate = propagate or Propagate()

    def apply(self, graph: Graph, ctx: PassContext) -> PassResult:
        """:meth:`run` with the context's cache; its notes said in ``ctx.notes``."""
        result = Complete(ctx.propagate).run(graph)
        ctx.notes.extend(result.notes)
        return PassResult(result.graph, bool(result.chosen), result)

    def run(self, graph: Graph) -> CompleteResult:
        """The layouts of ``graph``'s ``auto`` inputs, written on a copy of it (``graph`` is left as it was)."""
        autos = [n.name for n in graph.inputs() if n.attrs.get("placements") == "auto"]
        if not autos:
            return CompleteResult(graph=graph)
        graph = own_copy(graph)
        result = CompleteResult(graph=graph)
        autos = [graph.node(name) for name in autos]
        replicated = ("R",) * graph.mesh.ndim
        for node in autos:
            node.attrs["placements"] = replicated
        for i, node in enumerate(autos):
            self.propagate.run(graph)
            rings = _ring_consumers(graph, node.name)
            candidates = {replicated} | _wanted(graph, node.name)
            followers = []  # the autos completed later that are operands of the same rings: tried alike
            if rings:
                candidates |= _ring_layouts(graph, node.name)
                followers = _ring_partners(graph, rings, autos[i + 1:])
            scored = []
            for cand in sorted(candidates):
                for follower in (node, *followers):
                    follower.attrs["placements"] = cand
                try:
                    self.propagate.run(graph)
                    scored.append(self._ring_cost(graph, rings) + (cand,) if rings else
                                  (self._cost(graph), (), cand))
                except LayoutPropError:
                    continue
            for follower in followers:
                follower.attrs["placements"] = replicated
            scored.sort(key=lambda entry: (entry[0], entry[2]))
            best_cost, best_rings, best = scored[0]
            node.attrs["placements"] = best
            result.chosen[node.name] = best
            if best_rings:
                result.rings[node.name] = best_rings
            alts = "; ".join(f"({', '.join(c)}): {cost[-3]} bytes/rank, {cost[0]} violation(s)"
                             + _ring_clause(rings, ran) for cost, ran, c in scored[1:]) or "none"
            result.notes.append(f"auto layout of {node.name!r}: ({', '.join(best)}) with {best_cost[-3]} bytes/rank "
                                f"of redistribution{_ring_clause(rings, best_rings)}; alternatives: {alts}")
        self.propagate.run(graph)  # the metadata of the chosen layouts, not of the last candidate tried
        return result

    def _ring_cost(self, graph: Graph, rings: list[str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The cost of the candidate in place on ``graph`` (propagated) as the expand pass writes it,
        with the number of ``rings`` (nodes whose attrs ask one) it leaves unwritten after the
        violations; and the rings it runs."""
        expanded = Expand(self.propagate).run(graph)
        ran = tuple(f.node for f in expanded.forced if f.node in rings)
        violations, total, local, moves = self._cost(expanded.graph)
        return (violations, len(rings) - len(ran), total, local, moves), ran

    @staticmethod
    def _cost(graph: Graph) -> tuple[int, int, int, int]:
        from layout_prop.core.redistribute import plan_redistribution

        violations = moves = total = 0
        for node in graph.topo_order():
            if node.is_input:
                continue
            violations += len(node.meta.get(meta.VIOLATIONS, ()))
            for value, want in zip(node.inputs, node.meta.get(meta.WANTS, ())):
                if want is None:
                    continue
                moves += 1
                try:
                    total += plan_redistribution(value_spec(graph, value), want).bytes_per_rank
                except LayoutPropError:
                    violations += 1
            if get_rule(node.op).is_communication:  # a ring's shift: its bytes are moves too
                total += comm_bytes(node, [value_spec(graph, value) for value in node.inputs])
        local = sum(n.meta[meta.SPECS][0].local_nbytes(0) for n in graph.inputs())
        return violations, total, local, moves


def _wanted(graph: Graph, name: str) -> set[tuple[str, ...]]:
    """The layouts the consumers of input ``name`` want it in (their rules' wants)."""
    found = set()
    for consumer, index in graph.consumers(name):
        wants = consumer.meta.get(meta.WANTS, ())
        if index < len(wants) and wants[index] is not None:
            found.add(tuple(wants[index].placement_strs()))
    return found


def _ring_consumers(graph: Graph, name: str) -> list[str]:
    """The consumers of ``name`` whose attrs ask a ring (``context_parallel='ring'``) on it, an attention operand."""
    return sorted({consumer.name for consumer, index in graph.consumers(name)
                   if index < RING_OPERANDS and consumer.meta.get(meta.ATTRS, consumer.attrs).get(
                       "context_parallel") == "ring"})


def _ring_partners(graph: Graph, rings: list[str], pending: list) -> list:
    """The input nodes of ``pending`` (autos not yet completed) that are attention operands of the ``rings``."""
    operands = {value for ring in rings for value in graph.node(ring).inputs[:RING_OPERANDS]}
    return [node for node in pending if node.name in operands]


def _ring_layouts(graph: Graph, name: str) -> set[tuple[str, ...]]:
    """The layouts of the other attention operands of the consumers asking a ring on ``name``: cut
    like them, ``name`` runs the ring (shapes it cannot take are refused when tried)."""
    rings = set(_ring_consumers(graph, name))
    found = set()
    for consumer, index in graph.consumers(name):
        if consumer.name not in rings:
            continue
        for other in consumer.inputs[:RING_OPERANDS]:
            spec = value_spec(graph, other)
            if other != name and spec is not None:
                found.add(tuple(spec.layout.placement_strs()))
    return found


def _ring_clause(rings: list[str], ran: tuple[str, ...]) -> str:
    """What a note says of the rings asked (``rings``) that a candidate runs (``ran``): nothing when none is asked.

    >>> _ring_clause(["attn"], ("attn",)), _ring_clause(["attn"], ())
    (", runs the ring attn asks (context_parallel='ring')", ", drops the ring attn asks (context_parallel='ring')")
    """
    if not rings:
        return ""
    dropped = [r for r in rings if r not in ran]
    parts = []
    if ran:
        parts.append(f"runs the ring {', '.join(ran)} asks (context_parallel='ring')")
    if dropped:
        parts.append(f"drops the ring {', '.join(dropped)} asks (context_parallel='ring')")
    return ", " + ", ".join(parts)
