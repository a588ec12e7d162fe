"""``layout-prop check``: propagate layouts and report every layout and violation."""

from __future__ import annotations

import sys

from .model_input import load_graph
from .printing import print_json

__all__ = ["run"]


def run(args) -> int:
    from layout_prop.api import analyze, format_table

    graph = load_graph(args)
    analysis = analyze(graph, reshard=args.reshard, backward=args.backward, backend=args.backend)
    analysis.optimizer = args.optimizer
    if args.json:
        try:  # on one line: the same text, each distinct spec and plan encoded once
            text = None if sys.stdout.isatty() else analysis.report_json()
        except ValueError:  # a NaN or an infinity somewhere: _print_json writes null there
            text = None
        if text is not None:
            print(text)
        else:
            print_json(analysis.report())
    else:
        print(format_table(analysis))
    return 0 if analysis.ok else 1
