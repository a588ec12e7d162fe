"""The ``layout-prop`` command line.

Exit codes everywhere: 0 ok, 1 violations or a numerical mismatch, 2 unusable input (a
bad spec, an unknown op, a bad flag) with one line on stderr and never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from . import __version__
from .errors import LayoutPropError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag on one line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"layout-prop: error: bad-usage: {message} (hint: see layout-prop {self.prog.split()[-1]} --help)",
              file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="layout-prop", description="Layout propagation, checking, resharding and SPMD execution "
                "for sharded tensor graphs.")
    p.add_argument("--version", action="version", version=f"layout-prop {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    c = sub.add_parser("check", help="propagate layouts and report every layout and violation")
    c.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file")
    c.add_argument("--reshard", action="store_true", help="insert the cheapest redistributions that fix violations")
    c.add_argument("--backward", action="store_true", help="also build the gradient graph (grad:NAME values)")
    c.add_argument("--backend", choices=["numpy", "mindspore", "cann"], default="numpy",
                   help="the kernel backend whose constraints to check (default numpy)")
    c.add_argument("--json", action="store_true", help="print one JSON object")

    r = sub.add_parser("run", help="lower, execute every rank, and compare with one device")
    r.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file")
    r.add_argument("--engine", choices=["sim", "mindspore"], default="sim", help="execution engine (default sim)")
    r.add_argument("--backend", choices=["numpy", "mindspore", "cann"], default=None,
                   help="kernel backend (default: numpy on sim, mindspore on the mindspore engine)")
    r.add_argument("--backward", action="store_true", help="also run the backward and compare gradients")
    r.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    r.add_argument("--no-reshard", action="store_true", help="refuse (exit 1) instead of inserting redistributions")
    r.add_argument("--timeout", type=float, default=300.0, help="mindspore engine: seconds before giving up")
    r.add_argument("--json", action="store_true", help="print one JSON object")

    sub.add_parser("demo", help="analyse and simulate a built-in example (no files needed)")

    lo = sub.add_parser("lower", help="print one rank's local subgraph")
    lo.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file")
    lo.add_argument("--rank", type=int, required=True, help="the rank to print")
    lo.add_argument("--backward", action="store_true", help="lower the joint forward and backward graph")
    lo.add_argument("--no-reshard", action="store_true", help="refuse (exit 1) instead of inserting redistributions")
    lo.add_argument("--json", action="store_true", help="print the rank's subgraph as JSON")
    return p


def _cmd_check(args) -> int:
    from .api import analyze, format_table
    from .loader import load_spec

    graph = load_spec(Path(args.spec))
    analysis = analyze(graph, reshard=args.reshard, backward=args.backward)
    if args.json:
        print(json.dumps(analysis.report(), indent=1))
    else:
        print(format_table(analysis))
    return 0 if analysis.ok else 1


def _cmd_run(args) -> int:
    from .loader import load_spec
    from .runner import run_graph

    graph = load_spec(Path(args.spec))
    backend = args.backend or ("numpy" if args.engine == "sim" else "mindspore")
    options = {"timeout": args.timeout} if args.engine == "mindspore" else {}
    rep = run_graph(graph, engine=args.engine, backend=backend, backward=args.backward, seed=args.seed,
                    reshard=not args.no_reshard, **options)
    if args.json:
        print(json.dumps(rep.to_dict(), indent=1))
    else:
        print(f"engine {rep.engine}, {rep.ranks} ranks")
        for title, table in (("output", rep.outputs), ("grad", rep.grads)):
            for name, err in table.items():
                print(f"  {title} {name}: max abs err {err['max_abs_err']:.3g}, max rel err {err['max_rel_err']:.3g}")
        for c in rep.collectives:
            print(f"  collective {c['kind']} on {c['mesh_axis']} for {c['node']}: {c['bytes_per_rank']} bytes/rank")
        for v in rep.violations:
            print(f"  violation [{v['code']}] {v['node']}.{v['operand']}: {v['message']} (fix: {v['hint']})")
        for m in rep.mismatches:
            print(f"  MISMATCH {m}")
        print("matches one device" if rep.ok else "does NOT match one device")
    return 0 if rep.ok else 1


def _cmd_lower(args) -> int:
    from .api import analyze
    from .loader import load_spec
    from .passes.lower import Lower

    graph = load_spec(Path(args.spec))
    analysis = analyze(graph, reshard=not args.no_reshard, backward=args.backward)
    if not analysis.ok:
        for v in analysis.check.violations:
            print(f"violation [{v.code}] {v.node}.{v.operand}: {v.message} (fix: {v.hint})", file=sys.stderr)
        return 1
    program = Lower().run(analysis.graph).program
    graph.mesh.coords(args.rank)
    print(program.to_json(args.rank) if args.json else program.format(args.rank))
    return 0


def _cmd_demo(args) -> int:
    from .demo import run_demo

    return 0 if run_demo() else 1


COMMANDS = {"demo": _cmd_demo, "check": _cmd_check, "run": _cmd_run, "lower": _cmd_lower}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except LayoutPropError as err:
        print(f"layout-prop: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("layout-prop: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
