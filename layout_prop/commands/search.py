"""``layout-prop plan MODEL --search``: the whole parallel configuration ranked by predicted step time (its
flags are ``plan``'s, :mod:`.plan` hands the command here).

The work is :mod:`layout_prop.workflows.search` (the search itself :func:`layout_prop.planner.search.search`);
this module checks the request, shows progress, prints the top candidates and writes the best as a spec
(``-o``) and a sharding plan file (``--plan-out``).
"""

from __future__ import annotations

import json
import sys

from layout_prop.core.errors import SpecError
from .flags import refuse_stdout_output

__all__ = ["run"]


def run(args) -> int:
    from layout_prop.io.progress import Progress, Ticker
    from layout_prop.perf.clusters import get_cluster
    from layout_prop.planner.search import InfeasibleSearch, parse_axes, parse_axis_order
    from layout_prop.workflows.estimate import check_global_batch
    from layout_prop.workflows.plan import parse_bytes
    from layout_prop.workflows.search import (best_spec, format_result, load_model_shape, load_search_graph,
                                              plan_file_text, run_search, search_notes)

    if args.time_limit is not None:  # (the search has no deadline: it reports the seconds it took)
        raise SpecError("bad-usage", "plan --search does not take --time-limit: it prices every configuration "
                        "(its time is printed)", path="--time-limit",
                        hint="drop --time-limit, or narrow the search with --axes (like --axes tp=8,pp=8)")
    if args.cluster is None:
        raise SpecError("bad-usage", "plan --search needs --cluster", hint="give --cluster a100-80g, h100-80g, "
                        "ascend-910b or a cluster YAML file")
    if args.devices is None or args.global_batch is None:
        raise SpecError("bad-usage", "plan --search needs --devices and --global-batch",
                        hint="give --devices N (the whole cluster's) and --global-batch B (sequences a step)")
    check_global_batch(args.global_batch)
    cluster = get_cluster(args.cluster)
    limit = parse_bytes(args.memory_per_rank) if args.memory_per_rank is not None else None
    order = parse_axis_order(args.axis_order)
    fixed = parse_axes(args.axes)
    from layout_prop.io.output import check_distinct_outputs, check_output

    for flag, path in (("-o", args.output), ("--plan-out", args.plan_out)):
        if path is not None:
            refuse_stdout_output("plan --search", flag, path)
            check_output(path)
    check_distinct_outputs({"-o": args.output, "--plan-out": args.plan_out})
    with Ticker("plan --search", enabled=False if args.json else None) as ticker:  # on a terminal only
        ticker.say("reading the model and its layers")
        model = load_model_shape(load_search_graph(args.spec, args.plan, args.opaque))
    progress = Progress(0, "plan --search: layers evaluated", enabled=False if args.json else None)
    try:
        result = run_search(model, cluster, args.devices, args.global_batch, memory_limit=limit, fixed=fixed,
                            order=order, progress=progress)
    except InfeasibleSearch as err:
        if args.json:
            print(json.dumps({"ok": False, "error": err.code, "message": err.message, "memory_limit": err.limit,
                              "least_memory_per_rank": int(err.least), "least_memory_config": err.config.to_dict()},
                             indent=1))
            return 2
        raise
    finally:
        progress.close()
    written = []
    if args.output is not None:
        _write(args.output, best_spec(result, order))
        written.append(str(args.output))
        if model.imported is not None:
            result.notes.append(f"-o wrote the gen {model.family} generator's graph of the imported sizes, not the "
                                "imported model (import MODEL --plan with --plan-out's plan is the imported one)")
    if args.plan_out is not None:
        from layout_prop.io.output import write_output

        write_output(args.plan_out, plan_file_text(result, order))
        written.append(str(args.plan_out))
    if args.json:
        print(json.dumps({"ok": True, "model": result.model.describe(), "cluster": result.cluster,
                          "devices": result.devices, "global_batch": result.global_batch,
                          "memory_limit": result.memory_limit, "candidates": result.candidates,
                          "feasible": len(result.ranked), "layer_evaluations": result.layer_evaluations,
                          "seconds": round(result.seconds, 3), "why": result.why(),
                          "uncertainty": result.uncertainty(), "ties": len(result.ties()),
                          "preferred": result.preferred() + 1,
                          "top": [c.to_dict() for c in result.ranked[:args.top]], "written": written,
                          "imported": None if model.imported is None else {
                              "architecture": model.imported.architecture, "priced_as": f"gen {model.family}",
                              "differences": list(model.imported.differences)},
                          "notes": result.notes + search_notes(result)}, indent=1))
    else:
        print(format_result(result, args.top))
        for path in written:
            print(f"wrote {path}")
    return 0


def _write(path, spec: dict) -> None:
    from layout_prop.io.loader import format_spec
    from layout_prop.io.output import write_output

    write_output(path, format_spec(spec, path))
    print(f"wrote {path} ({len(spec['nodes'])} nodes)", file=sys.stderr)
