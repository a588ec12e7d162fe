"""``layout-prop lower``: print one rank's local program."""

from __future__ import annotations

import argparse
import sys

from layout_prop.workflows.model_input import load_graph, unapplied_blocks_note
from .flags import add_model_args, integer_arg

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop lower``'s flags, on the command line's ``subparsers``."""
    parser = subparsers.add_parser("lower", help="print one rank's local subgraph")
    parser.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file (- reads standard input)")
    parser.add_argument("--rank", type=integer_arg, required=True, help="the rank to print")
    parser.add_argument("--backward", action="store_true", help="lower the joint forward and backward graph")
    parser.add_argument("--no-reshard", action="store_true",
                        help="refuse (exit 1) instead of inserting redistributions")
    parser.add_argument("--json", action="store_true", help="print the rank's subgraph as JSON")
    add_model_args(parser)
    return parser


def run(args) -> int:
    from layout_prop.api import analyze

    from layout_prop.passes.lower import Lower

    graph = load_graph(args.spec, args.plan, args.opaque)
    note = unapplied_blocks_note(graph, "lower")
    if note:
        print(note, file=sys.stderr)
    analysis = analyze(graph, reshard=not args.no_reshard, backward=args.backward)
    if not analysis.ok:
        for v in analysis.check.violations:
            print(f"violation [{v.code}] {v.node}.{v.operand}: {v.message} (fix: {v.hint})", file=sys.stderr)
        return 1
    program = Lower().run(analysis.graph).program
    print(program.to_json(args.rank) if args.json else program.format(args.rank))
    return 0
