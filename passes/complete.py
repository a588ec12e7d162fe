"""complete: give ``placements: auto`` inputs the layout their consumers need.

Like Shardy's backward propagation from consumers: for an auto input, each consumer's
rule says, through its ``wants``, which layout it would like that input in (given the
other inputs).  Every candidate (those wants, plus all-Replicate) is tried; the one with
the fewest violations, then the fewest bytes of redistribution over the whole graph,
then the smallest local pieces of the inputs (memory), then the fewest moves wins.  The choice and each
alternative with its cost are reported as notes.  Inputs are completed in input order.

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
>>> g.node("cos").attrs["placements"]
('S(2)',)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layout_prop.core import meta
from layout_prop.core.errors import LayoutPropError
from layout_prop.core.graph import Graph

from .propagate import Propagate, value_spec

__all__ = ["Complete", "CompleteResult"]


@dataclass
class CompleteResult:
    chosen: dict[str, tuple[str, ...]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class Complete:
    name = "complete"

    def __init__(self, propagate: Propagate | None = None) -> None:
        self.propagate = propagate or Propagate()

    def run(self, graph: Graph) -> CompleteResult:
        result = CompleteResult()
        autos = [n for n in graph.inputs() if n.attrs.get("placements") == "auto"]
        if not autos:
            return result
        replicated = ("R",) * graph.mesh.ndim
        for node in autos:
            node.attrs["placements"] = replicated
        for node in autos:
            self.propagate.run(graph)
            candidates = {replicated}
            for consumer, index in graph.consumers(node.name):
                wants = consumer.meta.get(meta.WANTS, ())
                if index < len(wants) and wants[index] is not None:
                    candidates.add(tuple(wants[index].placement_strs()))
            scored = []
            for cand in sorted(candidates):
                node.attrs["placements"] = cand
                try:
                    self.propagate.run(graph)
                except LayoutPropError:
                    continue
                scored.append((self._cost(graph), cand))
            scored.sort()
            best_cost, best = scored[0]
            node.attrs["placements"] = best
            result.chosen[node.name] = best
            alts = "; ".join(f"({', '.join(c)}): {cost[1]} bytes/rank, {cost[0]} violation(s)"
                             for cost, c in scored[1:]) or "none"
            result.notes.append(f"auto layout of {node.name!r}: ({', '.join(best)}) with {best_cost[1]} bytes/rank "
                                f"of redistribution; alternatives: {alts}")
        self.propagate.run(graph)  # the metadata of the chosen layouts, not of the last candidate tried
        return result

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
        local = sum(n.meta[meta.SPECS][0].local_nbytes(0) for n in graph.inputs())
        return violations, total, local, moves
