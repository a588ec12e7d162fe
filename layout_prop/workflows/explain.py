"""The work of ``layout-prop explain``: why a value has its layout (:func:`explain`, on an analysed graph;
:func:`explain_value`, the analysis as the command asks it).

Walks back from a value through the transfer functions that produced it to the annotated
graph inputs.  Each step names the op, the rule that decided (its module), the layouts of
the inputs it saw, the moves its kernel needs (free local slices, or the redistributions a
violation asks for) and, for a violation, the input that caused it.  The derivation is data
(a tree of dicts); ``commands/explain.py`` prints it (``format_explanation``).
"""

from __future__ import annotations

import difflib
from typing import Any

from layout_prop.core import meta
from layout_prop.core.errors import GraphError
from layout_prop.core.graph import Graph
from layout_prop.core.registry import get_rule

__all__ = ["explain", "explain_value", "DEFAULT_DEPTH", "MAX_DEPTH"]


#: how many producers :func:`explain` walks back by default, and at most: the tree nests one
#: level per op (a chain of 1,000 ops was deeper than Python's recursion limit allows), and
#: the rules that decided a layout are the nearest ones
DEFAULT_DEPTH = 100
MAX_DEPTH = 300


def explain(graph: Graph, value: str, depth: int = DEFAULT_DEPTH) -> dict[str, Any]:
    """The derivation tree of ``value``'s layout in a propagated graph (a JSON-able dict).

    Walks back ``depth`` producers (1 to :data:`MAX_DEPTH`); a value further up is a leaf
    with ``"more": true``, to be explained on its own.
    """
    if not 1 <= depth <= MAX_DEPTH:
        raise GraphError("bad-value", f"explain depth {depth} is out of range",
                         hint=f"give a depth from 1 to {MAX_DEPTH}, and explain a value further up on its own")
    if value.startswith("grad:"):
        name = f"grad/{value[5:]}"
        if name not in graph:
            raise GraphError("unknown-value", f"no gradient {value!r} in the graph", input=value,
                             hint="run with --backward, and name an input that requires a gradient")
        value = name
    if not graph.has_value(value):
        raise GraphError("unknown-value", f"no value named {value!r}", input=value, hint=_name_hint(graph, value))
    return _explain(graph, value, set(), depth)


def explain_value(graph: Graph, value: str, *, reshard: bool = False, backward: bool = False,
                  depth: int = DEFAULT_DEPTH) -> dict[str, Any]:
    """``graph`` analysed (:func:`layout_prop.api.analyze` with ``reshard``, ``backward``) and ``value``'s
    derivation in it (:func:`explain`)."""
    from layout_prop.api import analyze

    analysis = analyze(graph, reshard=reshard, backward=backward)
    return explain(analysis.graph, value, depth)


def _name_hint(graph: Graph, value: str) -> str:
    """The value of ``graph`` whose name is closest to ``value`` (a typo), else how values are named.

    >>> from layout_prop.core.graph import Graph
    >>> from layout_prop.core.mesh import DeviceMesh
    >>> g = Graph(DeviceMesh((2,), ("dp",)))
    >>> _ = g.input("l0_query", shape=(4,)); _ = g.op("l0_key", "neg", ["l0_query"])
    >>> _name_hint(g, "l0_qeury"), _name_hint(g, "zzz")
    ("did you mean 'l0_query'?", 'name a graph input or a node output (node:i for multi-output ops), e.g. l0_query')
    """
    names = [v for node in graph.nodes for v in node.outputs if not v.startswith(("grad/", "cotangent/"))]
    close = difflib.get_close_matches(value, names, n=1)
    if close:
        return f"did you mean {close[0]!r}?"
    return "name a graph input or a node output (node:i for multi-output ops)" + (f", e.g. {names[0]}" if names else "")


def _layout(spec) -> str | None:
    return str(spec.layout) if spec is not None else None


def _explain(graph: Graph, value: str, seen: set, depth: int) -> dict[str, Any]:
    node, index = graph.producer(value)
    spec = node.meta[meta.SPECS][index]
    if node.is_input:
        return {"value": value, "op": "input", "placements": _layout(spec), "declared": True}
    if value in seen:
        return {"value": value, "op": node.op, "placements": _layout(spec), "see_above": True}
    if depth == 0:
        return {"value": value, "op": node.op, "placements": _layout(spec), "more": True}
    seen.add(value)
    rule = get_rule(node.op)
    wants = node.meta.get(meta.WANTS, ())
    violations = node.meta.get(meta.VIOLATIONS, ())
    inputs = []
    for i, inp in enumerate(node.inputs):
        producer, k = graph.producer(inp)
        in_spec = producer.meta[meta.SPECS][k]
        want = wants[i] if i < len(wants) else None
        entry = {"value": inp, "operand": rule.operand_name(i), "placements": _layout(in_spec),
                 "wanted": str(want) if want is not None else None,
                 "violations": [v.to_dict() for v in violations if v.input == inp],
                 "from": _explain(graph, inp, seen, depth - 1)}
        inputs.append(entry)
    return {"value": value, "op": rule.name, "rule": f"{rule.name} in {type(rule).__module__}",
            "placements": _layout(spec), "inputs": inputs,
            "violations": [v.to_dict() for v in violations if v.input not in node.inputs]}
