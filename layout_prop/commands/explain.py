"""``layout-prop explain``: why a value has its layout (the work is :mod:`layout_prop.workflows.explain`).

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
from pathlib import Path
from typing import Any

from layout_prop.workflows.explain import DEFAULT_DEPTH, MAX_DEPTH, explain  # noqa: F401 (explain: the doctest, tests)

from .flags import add_model_args, positive_int

__all__ = ["add_parser", "run", "format_explanation", "explain"]


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

    from layout_prop.workflows.explain import explain_value
    from layout_prop.workflows.model_input import load_graph, unapplied_blocks_note

    from .printing import print_json

    graph = load_graph(args.spec, args.plan, args.opaque)
    note = unapplied_blocks_note(graph, "explain")
    if note:
        print(note, file=sys.stderr)
    tree = explain_value(graph, args.value, reshard=args.reshard, backward=args.backward, depth=args.depth)
    print_json(tree) if args.json else print(format_explanation(tree))
    return 0
