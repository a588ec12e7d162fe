"""resolve: the backward, then the moves: the one chain that follows a settled forward graph.

:data:`RESOLVE` appends the gradient graph (:class:`~.backward.Backward`, with
``ctx.options.backward``) and inserts the redistributions (:class:`~.reshard.Reshard`, with
``ctx.options.reshard``).  :func:`layout_prop.api.analyze` runs it on the greedy sweep's
forward graph and on the whole-graph solver's, and the solver prices a node's gradient and
its rule's subgraph through it, so every graph is resolved the same way.

Examples
--------
>>> from layout_prop.io.loader import load_spec
>>> from layout_prop.passes.base import AnalysisOptions
>>> from layout_prop.passes.pass_manager import PassContext
>>> g = load_spec('''
... mesh: {shape: [2], names: [dp]}
... inputs: {x: {shape: [4, 8], placements: ["S(0)"]}, b: {shape: [8]}}
... nodes: [{name: y, op: add, inputs: [x, b]}]
... ''')
>>> ctx = PassContext(AnalysisOptions(reshard=True, backward=True))
>>> resolved = RESOLVE.apply(g, ctx).graph
>>> sorted(ctx.results), resolved.outputs
(['backward', 'reshard'], ['y', 'grad/x', 'grad/b'])
"""

from __future__ import annotations

from .backward import Backward
from .pass_manager import PassPipeline
from .reshard import Reshard

__all__ = ["RESOLVE"]

#: the backward (``options.backward``), then the moves (``options.reshard``)
RESOLVE = PassPipeline(Backward(), Reshard())
