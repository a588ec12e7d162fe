"""``layout-prop run``: lower, execute every rank, assemble, and compare with one device."""

from __future__ import annotations

import json

from layout_prop.core.errors import ExecutionError, SpecError

from .model_input import load_graph
from .printing import print_json

__all__ = ["run"]


def run(args) -> int:
    from layout_prop.runner import format_nonfinite, run_graph

    backend = args.backend or ("numpy" if args.engine == "sim" else "mindspore")
    nodes = {"nodes": args.nodes, "node_rank": args.node_rank, "master_addr": args.master_addr,
             "master_port": args.master_port, "local_workers": args.local_workers, "emulate_nodes": args.emulate_nodes}
    if args.engine != "mindspore" and (args.nodes != 1 or args.emulate_nodes or args.master_addr or args.node_rank
                                       or args.master_port is not None or args.local_workers is not None
                                       or args.timeout is not None or args.keep_logs):
        raise SpecError("bad-usage", "--timeout, --keep-logs, --nodes, --emulate-nodes, --master-addr, --master-port, "
                        "--node-rank and --local-workers need --engine mindspore (the simulator runs in this "
                        "process)", hint="add --engine mindspore, or drop them")
    if args.engine == "mindspore" and args.max_time is not None:
        raise SpecError("bad-usage", "--max-time limits the simulator's estimated time; the mindspore engine runs "
                        "every rank in its own process and gives up after --timeout instead",
                        hint="drop --max-time, or use --timeout SECONDS with --engine mindspore")
    if args.engine == "mindspore":
        from layout_prop.core.dependencies import require

        require("mindspore", "run --engine mindspore")  # before the spec is read and analysed
    elif backend != "numpy":  # (run_graph says so too, but after the analysis and the one-device run)
        raise ExecutionError("backend-unavailable", f"the simulator runs the numpy kernels, not {backend!r}",
                             hint="use --engine mindspore for the mindspore and cann backends")
    timeout = 300.0 if args.timeout is None else args.timeout
    options = {"timeout": timeout, "keep": args.keep_logs, **nodes} if args.engine == "mindspore" else {}
    graph = load_graph(args)
    from layout_prop.io.progress import Progress

    with Progress(0, "msrun", enabled=False if args.json else None) as bar:  # drawn only on a terminal
        if args.engine == "mindspore":
            options["progress"] = bar.show
        rep = run_graph(graph, engine=args.engine, backend=backend, backward=args.backward, seed=args.seed,
                        reshard=not args.no_reshard, rtol=args.rtol, max_memory=args.max_memory,
                        max_time=args.max_time, **options)
    if rep.extra.get("node_rank"):  # not node 0: node 0 prints the report; the status is the same everywhere
        summary = {"ok": rep.ok, "node_rank": rep.extra["node_rank"], "nodes": len(rep.extra["nodes"])}
        print(json.dumps(summary) if args.json else f"node {summary['node_rank']} of {summary['nodes']}: "
              f"{'matches' if rep.ok else 'does NOT match'} one device (the report is printed on node 0)")
        return 0 if rep.ok else 1
    if args.json:
        print_json(rep.to_dict())
    else:
        if not rep.executed:
            for v in rep.violations:
                print(f"violation [{v['code']}] {v['node']}.{v['operand']}: {v['message']} (fix: {v['hint']})")
            if args.no_reshard:
                why = "and --no-reshard (without it, run inserts the redistributions that fix what they can)"
            else:
                why = "that no redistribution fixes"
            print(f"nothing was executed: {len(rep.violations)} violation(s) {why}")
            return 1
        print(f"engine {rep.engine}, {rep.ranks} ranks")
        for line in rep.extra.get("node_map", []):
            print(f"  {line}")
        for title, table in (("output", rep.outputs), ("grad", rep.grads)):
            for name, err in table.items():
                print(f"  {title} {name}: max abs err {err['max_abs_err']:.3g}, max rel err {err['max_rel_err']:.3g}")
        for c in rep.collectives:
            print(f"  collective {c['kind']} on {c['mesh_axis']} for {c['node']}: {c['bytes_per_rank']} bytes/rank")
        for c in rep.extra.get("emulated_collectives", []):
            print(f"  emulated on this device: {c}")
        if rep.extra.get("run_dir"):
            print(f"  worker logs: {rep.extra['run_dir']}")
        for v in rep.violations:
            print(f"  violation [{v['code']}] {v['node']}.{v['operand']}: {v['message']} (fix: {v['hint']})")
        for m in rep.mismatches:
            print(f"  MISMATCH {m}")
        result = "matches one device" if rep.ok else "does NOT match one device"
        if rep.nonfinite:  # compare counts NaN == NaN and equal infinities as agreement: say where it did
            result += ", counting NaN and inf as equal where both have them:"
        print(result)
        for item in rep.nonfinite:
            print(f"  {format_nonfinite(item)}")
    return 0 if rep.ok else 1
