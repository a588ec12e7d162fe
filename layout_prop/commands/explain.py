"""``explain``: why a value has its layout.

Walks back from a value through the transfer functions that produced it to the annotated
graph inputs.  Each step names the op, the rule that decided (its module), the layouts of
the inputs it saw, the moves its kernel needs (free local slices, or the redistributions a
violation asks for) and, for a violation, the input that caused it.

Examples
--------
>>> from layout_prop.io.loader import load_spec
>>> from layout_prop.api import analyze
>>> a = analyze(load_spec('''
... mesh: {shape: [2], names: [sp]}
... inputs:
...   x:   {shape: [1, 2, 4, 8], placements: ["S(2)"]}
...   cos: {shape: [1, 1, 4, 8]}
...   sin: {shape: [1, 1, 4, 8]}
... nodes:
...   - {name: y, op: rope, inputs: [x, cos, sin]}
...   - {name: z, op: neg, inputs: [y]}
... '''))
>>> print(format_explanation(explain(a.graph, "z")))
z = neg(y) -> (S(2))   [rule neg in layout_prop.ops.elementwise]
  y (as x) = rotary_position_embedding(x, cos, sin) -> (S(2))   [rule rotary_position_embedding in layout_prop.ops.rpe]
    x: graph input, declared (S(2))
    cos: graph input, declared (R); sliced locally to (S(2))
    sin: graph input, declared (R); sliced locally to (S(2))
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path
from typing import Any

from layout_prop.core import meta
from layout_prop.core.errors import GraphError
from layout_prop.core.graph import Graph
from layout_prop.core.registry import get_rule
from .flags import add_model_args, positive_int

__all__ = ["explain", "format_explanation"]


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


def format_explanation(tree: dict[str, Any], indent: int = 0, use: dict | None = None) -> str:
    """Plain text of :func:`explain`'s tree; ``use`` is how the consumer one level up sees it."""
    pad = "  " * indent
    label = tree["value"]
    suffix = ""
    if use is not None:
        if use["operand"] != use["value"]:
            label += f" (as {use['operand']})"
        if use["wanted"]:
            suffix = f"; sliced locally to {use['wanted']}" if not use["violations"] else f"; needs {use['wanted']}"
    if tree["op"] == "input":
        return f"{pad}{label}: graph input, declared {tree['placements']}{suffix}"
    if tree.get("see_above"):
        return f"{pad}{label} = {tree['op']}(...) -> {tree['placements']} (derived above){suffix}"
    if tree.get("more"):
        return (f"{pad}{label} = {tree['op']}(...) -> {tree['placements']}{suffix} (further up: "
                f"explain {tree['value']}, or a larger --depth)")
    args = ", ".join(i["value"] for i in tree["inputs"])
    lines = [f"{pad}{label} = {tree['op']}({args}) -> {tree['placements']}{suffix}   [rule {tree['rule']}]"]
    for v in tree["violations"]:
        lines.append(f"{pad}  VIOLATION [{v['code']}] {v['message']} (fix: {v['hint']})")
    for i in tree["inputs"]:
        lines.append(format_explanation(i["from"], indent + 1, use=i))
        for v in i["violations"]:
            lines.append(f"{pad}    VIOLATION [{v['code']}] caused by {i['value']}: {v['message']} "
                         f"(fix: {v['hint']})")
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line
def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop explain``'s flags, on the command line's ``subparsers``."""
    parser = subparsers.add_parser("explain", help="why a value has its layout: the chain of rules back to the inputs",
                            description="Why a value has its layout: the chain of rules back to the declared inputs, "
                                        "with the violations on the way. Exits 0 once the explanation is printed, "
                                        "violations or not (check exits 1 on them).")
    parser.add_argument("spec", metavar="SPEC", type=Path, help="a YAML or JSON spec file (- reads standard input)")
    parser.add_argument("value", metavar="NAME", help="a value name (node, node:i, an input, or grad:INPUT)")
    parser.add_argument("--reshard", action="store_true", help="explain the resharded graph")
    parser.add_argument("--backward", action="store_true", help="include the gradient graph")
    parser.add_argument("--json", action="store_true", help="print the derivation as JSON")
    
    parser.add_argument("--depth", type=positive_int, default=DEFAULT_DEPTH, metavar="N",
                        help=f"producers to walk back, at most {MAX_DEPTH} (default {DEFAULT_DEPTH}); a value further "
                             "up is marked, to be explained on its own")
    add_model_args(parser)
    return parser


def run(args) -> int:
    import sys

    from layout_prop.api import analyze

    from layout_prop.workflows.model_input import load_graph, unapplied_blocks_note
    from .printing import print_json
    
    graph = load_graph(args.spec, args.plan, args.opaque)
    note = unapplied_blocks_note(graph, "explain")
    if note:
        print(note, file=sys.stderr)
    analysis = analyze(graph, reshard=args.reshard, backward=args.backward)
    tree = explain(analysis.graph, args.value, args.depth)
    print_json(tree) if args.json else print(format_explanation(tree))
    return 0
