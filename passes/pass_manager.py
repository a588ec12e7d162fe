"""The pass manager: the context the passes of one run share, and a pipeline of passes.

A :class:`PassPipeline` (as xDSL's ``PassPipeline``) runs :class:`~.base.GraphPass` es in order,
each on the graph the one before gave, skipping a pass whose ``applies(ctx)`` is false; it keeps
each pass's detail in ``ctx.results`` under the pass's name and, with ``ctx.options.verify``,
runs the graph verifier after every transforming pass.  Whatever several passes of one run
share (the propagation cache, the notes, the options) is one :class:`PassContext`,
not threaded through constructors.

Examples
--------
>>> from layout_prop.io.loader import load_spec
>>> from layout_prop.passes.backward import Backward
>>> from layout_prop.passes.base import AnalysisOptions
>>> from layout_prop.passes.reshard import Reshard
>>> g = load_spec('''
... mesh: {shape: [2], names: [dp]}
... inputs: {a: {shape: [4], placements: ["P(sum)"]}, b: {shape: [4], placements: ["S(0)"]}}
... nodes: [{name: c, op: add, inputs: [a, b]}]
... ''')
>>> ctx = PassContext(AnalysisOptions(reshard=True))
>>> result = PassPipeline(Backward(), Reshard()).apply(g, ctx)
>>> [n.name for n in result.graph.nodes], result.modified, sorted(ctx.results)
(['a', 'b', 'c/x', 'c'], True, ['reshard'])
>>> [n.name for n in g.nodes]  # the given graph is unchanged
['a', 'b', 'c']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from layout_prop.core.graph import Graph

from .base import AnalysisOptions, GraphPass, PassResult
from .propagate import Propagate
from .verify import Verify

__all__ = ["PassContext", "PassPipeline"]


@dataclass
class PassContext:
    """What the passes of one run share.

    ``cache``: the propagation cache (rule results by value), held by ``propagate``, the one
    :class:`~layout_prop.passes.propagate.Propagate` every pass of the run propagates with;
    ``notes``: what the passes said, in the order they said it; ``results``: each pass's
    detail (its own result record) by its name, the last run of a name kept.

    It holds no cluster profile: no pass prices time (the analysis prices moves in bytes), and
    what does takes its cluster as an argument (``planner.solver.solve``, ``perf.step.estimate_step``).
    """

    options: AnalysisOptions = field(default_factory=AnalysisOptions)
    cache: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    propagate: Any = None

    def __post_init__(self) -> None:
        if self.propagate is None:
            self.propagate = Propagate(self.cache)
        else:
            self.cache = self.propagate.cache


class PassPipeline(GraphPass):
    """Passes run in order, each on the graph the one before gave (itself a pass, so that a
    pipeline may hold another).  ``ctx.results`` gets each pass's detail under its name."""

    name = "pipeline"
    transforms = False  # each of its passes is verified on its own

    def __init__(self, *passes: GraphPass) -> None:
        self.passes = tuple(passes)

    def __repr__(self) -> str:
        return f"PassPipeline({', '.join(p.name for p in self.passes)})"

    def apply(self, graph: Graph, ctx: PassContext) -> PassResult:
        modified = False
        for p in self.passes:
            if not p.applies(ctx):
                continue
            result = p.apply(graph, ctx)
            if p.name != PassPipeline.name:
                ctx.results[p.name] = result.detail
            modified = modified or result.modified
            graph = result.graph
            if p.transforms and ctx.options.verify:
                Verify().run(graph)
        return PassResult(graph, modified)
