"""``layout-prop check``: propagate layouts and report every layout and violation.

A spec's ``zero:``, ``recompute:`` and ``pipeline:`` blocks are checked and applied (workflows/check.py):
ZeRO stage 3's stored shards and gathers in the forward; with ``--reshard --backward`` the recomputation
copies and ZeRO's re-gathers and gradient reduce-scatters; with a ``pipeline:`` block the graph checked is one
micro-batch on the stage mesh, and with ``--reshard --backward`` its cut into stages, the moves between them and
the pipeline verifier.  One ``note: config: ...`` line (JSON: ``"config"``) says what was checked and what not.
"""

from __future__ import annotations

import argparse
import sys

from layout_prop.workflows.model_input import load_graph

from .flags import add_model_args
from .printing import print_json

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop check``'s flags, on the command line's ``subparsers``."""
    parser = subparsers.add_parser("check", help="propagate layouts and report every layout and violation")
    parser.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file (- reads standard input)")
    parser.add_argument("--reshard", action="store_true",
                        help="insert the cheapest redistributions that fix violations")
    parser.add_argument("--backward", action="store_true", help="also build the gradient graph (grad:NAME values)")
    parser.add_argument("--backend", choices=["numpy", "mindspore", "cann"], default="numpy",
                        help="the kernel backend whose constraints to check (default numpy)")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default=None,
                        help="count the optimizer's states in memory per rank (adam: 2 per parameter; default none, as "
                             "sgd)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(parser)
    return parser


def run(args) -> int:
    from layout_prop.api import format_table
    from layout_prop.workflows.check import check_graph

    graph = load_graph(args.spec, args.plan, args.opaque)
    analysis = check_graph(graph, reshard=args.reshard, backward=args.backward, backend=args.backend,
                           optimizer=args.optimizer)
    if args.json:
        try:  # on one line: the same text, each distinct spec and plan encoded once
            text = None if sys.stdout.isatty() else analysis.report_json()
        except ValueError:  # a NaN or an infinity somewhere: print_json writes null there
            text = None
        if text is not None:
            print(text)
        else:
            print_json(analysis.report())
    else:
        print(format_table(analysis))
    return 0 if analysis.ok else 1
