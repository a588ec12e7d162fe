"""The pass protocol: a pass and its result (the context and the pipeline: :mod:`.pass_manager`).

In the manner of xDSL's ``ModulePass`` and torch.fx's ``PassBase`` and ``PassResult``: a pass
is a :class:`GraphPass` with a ``name`` and ``apply(graph, ctx) -> PassResult``; it leaves
``graph`` as it was (an analysis pass writes node metadata only, a transforming pass builds
a new graph), says what it noticed in ``ctx.notes`` and hands its own record (a
``CheckResult``, an ``ExpandResult``...) on as :attr:`PassResult.detail`.  ``ctx`` is the
:class:`~.pass_manager.PassContext` every pass of one run shares (the propagation cache, the
notes, the options); :class:`~.pass_manager.PassPipeline` runs passes in order.
Each pass keeps its own ``run(graph)`` (the typed result the tests and commands read);
``apply`` is the one shape a pipeline sees.  This module imports no pass: every pass imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from layout_prop.core.graph import Graph, Node

__all__ = ["AnalysisOptions", "GraphPass", "PassResult", "own_copy"]


@dataclass(frozen=True)
class AnalysisOptions:
    """What an analysis is asked for: ``reshard`` (insert the moves), ``backward`` (append the
    gradient graph), ``backend`` (whose kernel limits to check), ``verify`` (run the graph
    verifier after every transforming pass)."""

    reshard: bool = False
    backward: bool = False
    backend: str = "numpy"
    verify: bool = False


@dataclass(frozen=True)
class PassResult:
    """What a pass gives back: the graph after it (the given one when it changed nothing),
    whether it changed anything, and its own record (``detail``)."""

    graph: Graph
    modified: bool = False
    detail: Any = None


class GraphPass:
    """A pass over the graph IR: ``apply(graph, ctx)`` leaves ``graph`` as it was and returns
    the :class:`PassResult`; ``applies(ctx)`` says whether it runs with ``ctx.options``."""

    name: ClassVar[str] = ""
    #: whether the pass builds a new graph (the pipeline verifies after it, when asked)
    transforms: ClassVar[bool] = False

    def applies(self, ctx: PassContext) -> bool:
        return True

    def apply(self, graph: Graph, ctx: PassContext) -> PassResult:
        raise NotImplementedError(f"{type(self).__name__}.apply")


def own_copy(graph: Graph) -> Graph:
    """``graph`` with every node copied, its attrs and metadata dicts its own (in the same order):
    what a pass may write on without touching the given graph."""
    nodes = [Node(n.name, n.op, n.inputs, dict(n.attrs), n.num_outputs, dict(n.meta)) for n in graph.nodes]
    return Graph.from_nodes(graph.mesh, nodes, graph.outputs, graph.meta)
