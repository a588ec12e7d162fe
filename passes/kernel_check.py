"""kernel_check: a backend's kernel limits on every rank's LOCAL shapes, before launch.

An analysis pass.  Some kernels accept only some shapes (the CANN RotaryPositionEmbedding
kernel: D, B and N limits, cos layouts per mode, no backward for modes 2 and 3).  Whether
a sharded graph fits them depends on the local shapes each rank sees, so this pass asks
each op's rule (:meth:`~layout_prop.core.registry.OpRule.check_kernel`) for each distinct set of
local input shapes, and reports what breaks as violations (``kernel-constraint``,
``no-backward-kernel``) naming the node, the rank and the shapes.

Examples
--------
>>> from layout_prop.io.loader import load_spec
>>> from layout_prop.api import analyze
>>> g = analyze(load_spec('''
... mesh: {shape: [2], names: [dp]}
... inputs:
...   x:   {shape: [2, 2, 4, 8], placements: ["S(0)"]}
...   cos: {shape: [1, 1, 4, 8]}
...   sin: {shape: [1, 1, 4, 8]}
... nodes:
...   - {name: y, op: rope, inputs: [x, cos, sin], attrs: {mode: 2}}
... '''), backward=True).graph
>>> [(v.node, v.code) for v in KernelCheck("cann").run(g)]  # quarter mode: Ascend 910_95 only, no backward
[('y', 'kernel-constraint'), ('grad/y/rotary_position_embedding_grad1', 'no-backward-kernel')]
>>> KernelCheck("numpy").run(g)
[]
"""

from __future__ import annotations

from layout_prop.core import meta
from layout_prop.core.errors import Violation
from layout_prop.core.graph import Graph
from layout_prop.core.registry import get_rule
from layout_prop.core.spec import TensorSpec, class_ranks, rank_classes

from .base import GraphPass, PassResult
from .propagate import value_spec

__all__ = ["KernelCheck"]


class KernelCheck(GraphPass):
    """The limits of ``backend``'s kernels; in a pipeline, those of ``ctx.options.backend`` when
    ``backend`` is None, its violations added to the check's (``ctx.results["check"]``)."""

    name = "kernel_check"

    def __init__(self, backend: str | None = None) -> None:
        self.backend = backend

    def applies(self, ctx: PassContext) -> bool:
        return (self.backend or ctx.options.backend) != "numpy"

    def apply(self, graph: Graph, ctx: PassContext) -> PassResult:
        found = KernelCheck(self.backend or ctx.options.backend).run(graph)
        ctx.results["check"].violations.extend(found)
        return PassResult(graph, False, found)

    def run(self, graph: Graph) -> list[Violation]:
        found: list[Violation] = []
        mesh = graph.mesh
        for node in graph.topo_order():
            if node.is_input or node.meta.get(meta.VIOLATIONS):
                continue
            rule = get_rule(node.op)
            specs = []
            for value, want in zip(node.inputs, node.meta.get(meta.WANTS, ())):
                spec = value_spec(graph, value)
                specs.append(spec if want is None else TensorSpec(spec.shape, spec.dtype, want))
            # each distinct set of local shapes, with the lowest rank that has it, in rank order:
            # from the classes of alike ranks (rank_classes, per mesh axis), not from every rank
            first: dict[tuple, int] = {}
            for rank in class_ranks(rank_classes(specs, mesh), mesh):  # lowest ranks, increasing
                first.setdefault(tuple(s.local_shape(rank) for s in specs), rank)
            for shapes, rank in first.items():
                for v in rule.check_kernel(self.backend, shapes, tuple(specs), node.meta[meta.ATTRS]):
                    found.append(Violation(v.code, f"rank {rank}: {v.message}", v.hint, v.operand, node.name,
                                           rule.name, node.inputs[0] if node.inputs else None))
                    break
                else:
                    continue
                break  # one report per node: the first rank that breaks a limit
        return found
