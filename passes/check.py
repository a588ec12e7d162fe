"""check: collect every violation and every redistribution of a propagated graph.

An analysis pass.  Violations come in a stable order: node order (topological, ties by
insertion), then input order.  It never raises for a violation and never stops at the
first one.  Redistributions are the explicit ``redistribute`` nodes (inserted by
reshard or backward, or written by the user), the implicit free local slices a
kernel's ``wants`` ask for, and the steps of an op that is communication (a ring
attention's ``ring_shift``, a cyclic ``permute``: its rule's ``comm_steps``).

Examples
--------
>>> from layout_prop import DeviceMesh
>>> from layout_prop.core.graph import Graph
>>> from layout_prop.passes.propagate import Propagate
>>> g = Graph(DeviceMesh((2,), ("dp",)))
>>> a = g.input("a", shape=(4,), placements=["P(sum)"])
>>> b = g.input("b", shape=(4,), placements=["S(0)"])
>>> g.output(g.op("c", "add", [a, b]))
>>> _ = Propagate().run(g)
>>> res = Check().run(g)
>>> res.ok, [v.code for v in res.violations]
(False, ['partial-input'])
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii  # how json.dumps writes a string (ensure_ascii)
from typing import Any

from layout_prop.core import meta
from layout_prop.core.errors import LayoutPropError, Violation
from layout_prop.core.graph import Graph
from layout_prop.core.layout import Layout
from layout_prop.core.redistribute import Redistribution, plan_redistribution

from .base import GraphPass, PassResult
from .propagate import value_spec

__all__ = ["Check", "CheckResult", "InputRedistribution"]


@dataclass(frozen=True)
class InputRedistribution:
    """One move of a value: for the consumer ``node``'s input ``input``."""

    node: str
    input: str
    plan: Redistribution
    explicit: bool  # a redistribute node (True) or a kernel's implicit free slice (False)

    def to_dict(self) -> dict[str, Any]:
        d = {"node": self.node, "input": self.input}
        d.update(self.plan.to_dict())
        return d

    def to_json(self, plans: dict[int, tuple]) -> str:
        """``to_dict()`` as compact JSON (``json.dumps(to_dict(), separators=(",", ":"))``); ``plans``
        remembers each plan's text by identity, for the many moves that share one plan."""
        known = plans.get(id(self.plan))
        if known is None:
            known = plans[id(self.plan)] = (self.plan, json.dumps(self.plan.to_dict(), separators=(",", ":"),
                                                                  allow_nan=False))
        return f'{{"node":{encode_basestring_ascii(self.node)},"input":{encode_basestring_ascii(self.input)},' \
               f'{known[1][1:]}'


@dataclass
class CheckResult:
    violations: list[Violation] = field(default_factory=list)
    redistributions: list[InputRedistribution] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def total_bytes_per_rank(self) -> int:
        return sum(r.plan.bytes_per_rank for r in self.redistributions)


class Check(GraphPass):
    name = "check"

    def apply(self, graph: Graph, ctx: PassContext) -> PassResult:
        return PassResult(graph, False, self.run(graph))

    def run(self, graph: Graph) -> CheckResult:
        result = CheckResult()
        stopped: dict[str, str | None] = {}  # value without a layout -> the node that stopped it (None: a violation)
        comm_ops = _comm_ops()
        for node in graph.topo_order():
            if node.op == "input":
                continue
            violations = node.meta.get(meta.VIOLATIONS)
            specs = node.meta.get(meta.SPECS)
            if specs is None or None in specs:
                result.violations.extend(_no_layout(graph, node, specs, stopped, bool(violations)))
            if violations:
                found = sorted(violations, key=lambda v: _input_index(node, v))
                result.violations.extend(_with_fix(graph, node, v) for v in found)
                continue  # its wants are the fixes the violations describe, not moves that happen
            if node.op == "redistribute":
                src = value_spec(graph, node.inputs[0])
                dst = node.meta[meta.SPECS][0]
                if src is not None and dst is not None:
                    consumer, value = node.meta.get(meta.FOR, (node.name, node.inputs[0]))
                    result.redistributions.append(
                        InputRedistribution(consumer, value, plan_redistribution(src, dst.layout), True))
                continue
            if node.op in comm_ops:  # an op that is communication (a ring's shift): its steps are a move
                move = _comm_move(graph, node)
                if move is not None:
                    result.redistributions.append(move)
                    continue
            wants = node.meta.get(meta.WANTS)
            if not wants or not any(wants):
                continue
            for value, want in zip(node.inputs, wants):
                if want is None:
                    continue
                plan = _plan_or_none(value_spec(graph, value), want)
                if plan is not None:
                    result.redistributions.append(InputRedistribution(node.name, value, plan, False))
        return result


def _comm_ops() -> frozenset:
    """The ops whose rule has ``comm_steps``."""
    from layout_prop.core.registry import registered_ops

    return frozenset(name for name, rule in registered_ops().items() if rule.is_communication)


def _comm_move(graph: Graph, node) -> InputRedistribution | None:
    """The move a communication op's steps make of its first input (None where it runs a kernel)."""
    from layout_prop.core.registry import get_rule

    specs = tuple(value_spec(graph, v) for v in node.inputs)
    if any(spec is None for spec in specs):
        return None
    outputs = node.meta[meta.SPECS]
    steps = get_rule(node.op).comm_steps(node.meta[meta.ATTRS], specs, outputs)
    if not steps:
        return None
    return InputRedistribution(node.name, node.inputs[0], Redistribution(specs[0], outputs[0], tuple(steps)), True)


def _no_layout(graph: Graph, node, specs, stopped: dict, explained: bool) -> list[Violation]:
    """``no-layout`` for each value of ``node`` that has no layout, naming the node that stopped
    propagation (this one when its inputs all have layouts); none for values that a violation
    upstream (or of this node) already explains.  ``stopped`` is filled as the walk goes."""
    missing = [v for i, v in enumerate(node.outputs) if specs is None or specs[i] is None]
    cause = next((value for value in node.inputs if value in stopped), None)
    root = None if explained else stopped[cause] if cause is not None else node.name
    found = []
    for value in missing:
        stopped[value] = root
        if root is None:
            continue
        if root == node.name:
            why = (f"node {node.name!r} ({node.op}) has no inputs and its rule describes no output"
                   if not node.inputs else f"the rule of {node.op!r} describes no output for its inputs")
            hint = ("give the op a layout rule for this case (opaque nodes from an import take their declared "
                    "shape), or replace the node")
        else:
            why = f"propagation stopped at node {root!r} ({graph.node(root).op}), upstream of it"
            hint = f"fix node {root!r} (its own no-layout violation says how); every value after it has no layout"
        found.append(Violation("no-layout", f"value {value!r} has no layout: {why}", hint, node=node.name,
                               op=node.op, details={"value": value, "stopped_at": root}))
    return found


def _with_fix(graph: Graph, node, v: Violation) -> Violation:
    """The violation with its hint extended by what ``--reshard`` would insert for its input."""
    if not v.fixable or v.input not in node.inputs:
        return v
    want = node.meta.get(meta.WANTS, ())[node.inputs.index(v.input)]
    plan = _plan_or_none(value_spec(graph, v.input), want) if want is not None else None
    if plan is None:
        return v
    steps = ", ".join(f"{s.kind} on {graph.mesh.names[s.mesh_axis]}" for s in plan.steps) or "a relabel"
    hint = f"{v.hint}; --reshard inserts {steps} ({plan.bytes_per_rank} bytes per rank)"
    return Violation(v.code, v.message, hint, v.operand, v.node, v.op, v.input, v.fixable, v.details)


def _plan_or_none(src, want: Layout) -> Redistribution | None:
    try:
        return plan_redistribution(src, want)
    except LayoutPropError:
        return None


def _input_index(node, v: Violation) -> int:
    if v.input in node.inputs:
        return node.inputs.index(v.input)
    return len(node.inputs)
