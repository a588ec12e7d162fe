"""``layout-prop lower``: print one rank's local program."""

from __future__ import annotations

import sys

from .model_input import load_graph, unapplied_blocks_note

__all__ = ["run"]


def run(args) -> int:
    from layout_prop.api import analyze

    from layout_prop.passes.lower import Lower

    graph = load_graph(args)
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
