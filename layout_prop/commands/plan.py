"""``layout-prop plan``: fill every ``auto`` layout with the solver, write the planned spec, and report it
next to a baseline (the work is :func:`layout_prop.workflows.plan.plan_spec`); with ``--search``, the whole
parallel configuration (:mod:`.search`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from layout_prop.core.errors import SpecError

from .flags import add_model_args, positive_int, refuse_stdout_output, time_limit_arg

__all__ = ["add_parser", "run"]


# --------------------------------------------------------------------------- command line
def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop plan``'s flags (and ``plan --search``'s), on the command line's ``subparsers``."""
    from layout_prop.io.sizes import GRAMMAR as SIZE_GRAMMAR

    parser = subparsers.add_parser("plan",
                                   help="choose every auto layout with the least communication per training step")
    parser.add_argument("spec", metavar="SPEC_OR_MODEL", type=Path,
                   help="a YAML or JSON spec with placements: auto inputs, or a model (.onnx, .mindir) with --plan")
    parser.add_argument("--memory-per-rank", metavar="SIZE", help="the memory limit per rank, like 16GiB, 512M or 2GB "
                   f"(default none); {SIZE_GRAMMAR}")
    parser.add_argument("--objective", choices=["bytes", "time"], default=None,
                   help="minimise bytes per rank per step (the default without --cluster) or modelled time: with "
                   "--cluster the training step's (compute and collectives; the default with it), else the "
                   "redistributions' with the mesh's links")
    parser.add_argument("--cluster", metavar="NAME|FILE", help="price the step on this cluster profile (a100-80g, "
                   "h100-80g, ascend-910b, or a cluster YAML file), as layout-prop estimate does")
    parser.add_argument("--time-limit", metavar="SECONDS", type=time_limit_arg, default=None,
                   help="seconds the whole command may take: building the model, the solves, the memory ladder "
                   "(default 60; up to 86400)")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default=None,
                   help="count the optimizer's states in memory (adam: 2 per parameter; default none, as sgd)")
    parser.add_argument("--forward-only", action="store_true", help="plan for inference: the forward's moves only")
    parser.add_argument("--baseline", metavar="SPEC", type=Path,
                        help="compare with this spec's layouts (default: SPEC's own)")
    parser.add_argument("-o", "--output", type=Path, help="write the planned spec here (.yaml or .json)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(parser)  # a model with its sharding plan (parameters: auto for the ones to choose)
    # plan --search: the whole parallel configuration (layout_prop/commands/search.py)
    parser.add_argument("--search", action="store_true", help="search dp, tp, cp, ep, pp, ZeRO, recomputation, schedule "
                   "and micro-batch, ranked by predicted step time (needs --cluster, --devices, --global-batch)")
    parser.add_argument("--devices", metavar="N", type=positive_int, help="with --search: the devices to use")
    parser.add_argument("--global-batch", metavar="B", type=positive_int, help="with --search: sequences a step")
    parser.add_argument("--top", metavar="K", type=positive_int, default=5, help="with --search: candidates shown (5)")
    parser.add_argument("--plan-out", metavar="FILE", type=Path,
                        help="with --search: write the best as a sharding plan")
    parser.add_argument("--axis-order", metavar="AXES", help="with --search: mesh axes outermost first, the last filling "
                   "a node first (default pp,dp,ep,cp,tp)")
    parser.add_argument("--axes", metavar="AXIS=N,...", help="with --search: degrees kept fixed, like tp=8,pp=8")
    return parser


def run(args) -> int:
    if args.search:  # the whole parallel configuration: commands/search.py
        from .search import run as run_search

        return run_search(args)
    given = [flag for flag, value in (("--devices", args.devices), ("--global-batch", args.global_batch),
                                      ("--plan-out", args.plan_out), ("--axis-order", args.axis_order),
                                      ("--axes", args.axes)) if value is not None]
    if given:  # (search options without --search were ignored silently)
        raise SpecError("bad-usage", f"{given[0]} is an option of plan --search", path=given[0],
                        hint="add --search, or drop " + ", ".join(given))
    from layout_prop.io.loader import load_spec
    from layout_prop.workflows.plan import DEFAULT_TIME_LIMIT, parse_bytes, plan_spec

    from layout_prop.workflows.model_input import load_graph
    from layout_prop.core.dependencies import require

    require("scipy", "plan")  # the solver; before anything is read (it was an internal error after 30 s)
    from layout_prop.planner.solver import InfeasiblePlan

    limit = parse_bytes(args.memory_per_rank) if args.memory_per_rank is not None else None
    cluster = None
    if args.cluster is not None:
        from layout_prop.perf.clusters import get_cluster

        cluster = get_cluster(args.cluster)
    objective = args.objective or ("time" if cluster is not None else "bytes")
    time_limit = args.time_limit if args.time_limit is not None else DEFAULT_TIME_LIMIT
    if args.output is not None:
        from layout_prop.io.output import check_output

        refuse_stdout_output("plan", "-o", args.output)
        check_output(args.output)  # a folder, a missing folder, /dev/full: said now, not after the solve
    from layout_prop.io.progress import Ticker

    with Ticker("plan", enabled=False if args.json else None) as ticker:  # on a terminal only
        ticker.say("reading the model")  # (an imported model with its plan takes a while)
        graph = load_graph(args.spec, args.plan, args.opaque)
    baseline = load_spec(args.baseline) if args.baseline is not None else None
    if baseline is not None and (baseline.mesh != graph.mesh or
                                 [n.name for n in baseline.inputs()] != [n.name for n in graph.inputs()]):
        raise SpecError("bad-baseline", f"the baseline {str(args.baseline)!r} is not the same model on the same mesh",
                        hint="give a baseline with the same mesh and inputs (gen llama with the same sizes)")
    try:
        with Ticker("plan", enabled=False if args.json else None) as ticker:
            report = plan_spec(graph, backward=not args.forward_only, objective=objective, memory_limit=limit,
                               optimizer=args.optimizer, baseline=baseline, time_limit=time_limit, cluster=cluster,
                               progress=ticker.say)
    except InfeasiblePlan as err:
        if args.json:
            print(json.dumps({"ok": False, "error": err.code, "message": err.message,
                              "memory_limit": err.limit, "least_memory_per_rank": err.least}, indent=1))
        else:
            print(f"layout-prop: infeasible: {err}", file=sys.stderr)
        return 1
    if args.output is not None:
        _write(report.spec, args.output)
        report.notes.append(f"wrote {args.output}")
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.format())
    return 0 if report.plan["ok"] else 1


def _write(spec: dict, path: Path) -> None:
    from layout_prop.io.loader import format_spec
    from layout_prop.io.output import write_output

    text = format_spec(spec, path)

    write_output(path, text)  # atomic: a full disk leaves the old file, never a truncated plan
