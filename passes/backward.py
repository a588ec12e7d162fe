"""backward: append the gradient graph, built from each op's vjp rule.

A transforming pass.  The new graph holds the forward nodes, one cotangent input per
forward output (``cotangent/NAME``, the output's layout with Partial axes Replicate:
every term of a partial sum receives the whole cotangent), the nodes the vjp rules add,
and for every input that requires a gradient a final node ``grad/NAME`` that brings the
accumulated gradient to the input's own layout: a partial sum is reduced (all-reduce), a
locally sliced Replicate value is gathered.  Gradient layouts are propagated by the same
rules as the forward.  Inputs with ``requires_grad: false`` get no gradient.

Examples
--------
>>> from layout_prop.io.loader import load_spec
>>> from layout_prop.core import meta
>>> g = load_spec('''
... mesh: {shape: [2], names: [dp]}
... inputs:
...   x: {shape: [4, 8], placements: ["S(0)"]}
...   b: {shape: [8]}
... nodes:
...   - {name: y, op: add, inputs: [x, b]}
... ''')
>>> new = Backward().run(g).graph
>>> [(n.name, str(n.meta["specs"][0].layout)) for n in new.nodes if n.meta.get(meta.GRAD_OF)]
[('grad/x', '(S(0))'), ('grad/b', '(R)')]
>>> new.node("grad/b").op
'redistribute'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from layout_prop.core import meta
from layout_prop.core.graph import Graph, Node
from layout_prop.core.registry import get_rule
from layout_prop.core.spec import TensorSpec

from .base import GraphPass, PassResult
from .propagate import Propagate, value_spec

__all__ = ["Backward", "BackwardResult", "COTANGENT_PREFIX", "GRAD_PREFIX"]

COTANGENT_PREFIX = "cotangent/"
GRAD_PREFIX = "grad/"


@dataclass
class BackwardResult:
    graph: Graph
    grads: dict[str, str]  # primal input name -> value holding its gradient
    cotangents: dict[str, str]  # forward output -> cotangent input


class _Builder:
    """The GradBuilder handed to vjp rules: adds nodes and propagates them at once."""

    def __init__(self, graph: Graph, propagate: Propagate, prefix: str) -> None:
        self.graph = graph
        self.propagate = propagate
        self.prefix = prefix
        self.count = 0

    def op(self, op: str, inputs: Sequence[str], attrs: dict | None = None, num_outputs: int = 1):
        rule = get_rule(op)
        self.count += 1
        name = f"{self.prefix}{rule.name}{self.count}"
        while name in self.graph:
            self.count += 1
            name = f"{self.prefix}{rule.name}{self.count}"
        node = Node(name, rule.name, tuple(inputs), dict(attrs or {}), num_outputs,
                    meta={meta.INSERTED_BY: "backward"})
        outs = self.graph.add_node(node)
        self.propagate.visit(self.graph, node)
        return outs[0] if num_outputs == 1 else outs

    def spec(self, value: str) -> TensorSpec:
        return value_spec(self.graph, value)


class Backward(GraphPass):
    name = "backward"
    transforms = True

    def __init__(self, propagate: Propagate | None = None) -> None:
        self.propagate = propagate or Propagate()

    def applies(self, ctx: PassContext) -> bool:
        return ctx.options.backward

    def apply(self, graph: Graph, ctx: PassContext) -> PassResult:
        result = Backward(ctx.propagate).run(graph)
        return PassResult(result.graph, True, result)

    def run(self, graph: Graph) -> BackwardResult:
        new = graph.copy_structure()
        self.propagate.run(new)
        requires = self._requires_grad(new)
        cot: dict[str, list[str]] = {}
        cotangents = {}
        for value in new.outputs:
            spec = value_spec(new, value)
            if spec is None or not requires.get(value):
                continue
            name = f"{COTANGENT_PREFIX}{value}"
            placements = ["R" if p.is_partial() else str(p) for p in spec.layout.placements]
            new.input(name, shape=spec.shape, dtype=spec.dtype, placements=placements, requires_grad=False)
            self.propagate.visit(new, new.node(name))
            cot.setdefault(value, []).append(name)
            cotangents[value] = name
        forward = [n for n in new.topo_order() if not n.is_input and not n.name.startswith(COTANGENT_PREFIX)]
        for node in reversed(forward):
            outs_cot = tuple(self._total(new, cot.get(v), v) for v in node.outputs)
            if all(c is None for c in outs_cot):
                continue
            needs = tuple(bool(requires.get(v)) for v in node.inputs)
            if not any(needs):
                continue
            rule = get_rule(node.op, node=node.name)
            builder = _Builder(new, self.propagate, f"{GRAD_PREFIX}{node.name}/")
            grads = rule.vjp(builder, node.inputs, node.outputs, outs_cot, node.meta[meta.ATTRS], needs)
            for value, grad, need in zip(node.inputs, grads, needs):
                if need and grad is not None:
                    cot.setdefault(value, []).append(grad)
        grads = {}
        for node in new.inputs():
            if not node.attrs.get("requires_grad") or node.name.startswith(COTANGENT_PREFIX):
                continue
            total = self._total(new, cot.get(node.name), node.name)
            if total is None:
                continue
            grads[node.name] = self._finish(new, node, total)
        new.outputs.extend(grads.values())
        return BackwardResult(new, grads, cotangents)

    def _total(self, graph: Graph, parts: list[str] | None, value: str) -> str | None:
        """Sum the cotangent contributions of ``value`` (one ``add`` per extra use)."""
        if not parts:
            return None
        while len(parts) > 1:
            a, b = parts.pop(), parts.pop()
            builder = _Builder(graph, self.propagate, f"{GRAD_PREFIX}{value}/acc")
            parts.append(builder.op("add", [a, b]))
        return parts[0]

    def _finish(self, graph: Graph, primal: Node, total: str) -> str:
        """The node ``grad/NAME``: the gradient in the primal input's own layout."""
        want = primal.meta[meta.SPECS][0].layout
        target = ["R" if p.is_partial() else str(p) for p in want.placements]
        have = value_spec(graph, total)
        op = "identity" if have is not None and have.layout.placement_strs() == target else "redistribute"
        attrs = {} if op == "identity" else {"placements": target}
        name = f"{GRAD_PREFIX}{primal.name}"
        node = Node(name, op, (total,), attrs, meta={meta.INSERTED_BY: "backward", meta.GRAD_OF: primal.name,
                                                     meta.FOR: (name, total)})
        graph.add_node(node)
        self.propagate.visit(graph, node)
        return name

    @staticmethod
    def _requires_grad(graph: Graph) -> dict[str, bool]:
        req: dict[str, bool] = {}
        for node in graph.topo_order():
            if node.is_input:
                req[node.name] = bool(node.attrs.get("requires_grad"))
                continue
            rule = get_rule(node.op)
            flag = rule.differentiable and any(req.get(v) for v in node.inputs)
            for v in node.outputs:
                req[v] = flag
        return req
