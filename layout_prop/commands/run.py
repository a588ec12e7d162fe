"""``layout-prop run``: lower, execute every rank, assemble, and compare with one device.

The graph inputs are drawn at random (``--seed``) unless given: ``--inputs FILE.npz`` holds
arrays by input name, and a model run with ``--plan`` feeds the model's own initialisers; the file
wins over the model's weights.  The work is :mod:`layout_prop.workflows.run` (``run_spec``,
``run_pipelined``, ``read_inputs``, ``load_with_weights``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from layout_prop.core.errors import ExecutionError, SpecError, cut

from .flags import (
    add_model_args, count_arg, memory_size_arg, node_rank_arg, non_negative_int, positive_int, seconds_arg,
    tolerance_arg,
)
from .printing import print_json

__all__ = ["add_parser", "run", "load_with_weights"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop run``'s flags, on the command line's ``subparsers``."""
    parser = subparsers.add_parser("run", help="lower, execute every rank, and compare with one device")
    parser.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file (- reads standard input)")
    parser.add_argument("--engine", choices=["sim", "mindspore"], default="sim", help="execution engine (default sim)")
    parser.add_argument("--backend", choices=["numpy", "mindspore", "cann"], default=None,
                        help="kernel backend (default: numpy on sim, mindspore on the mindspore engine)")
    parser.add_argument("--backward", action="store_true", help="also run the backward and compare gradients")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--no-reshard", action="store_true",
                        help="refuse (exit 1) instead of inserting redistributions")
    parser.add_argument("--timeout", type=seconds_arg, default=None,
                        help="mindspore engine: seconds before giving up (default 300, at most a week)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="mindspore engine: keep the run folder (worker logs) after a successful run too")
    parser.add_argument("--nodes", type=count_arg, default=1,
                        help="mindspore engine: machines the run spans (default 1)")
    parser.add_argument("--node-rank", type=node_rank_arg, default=0,
                        help="mindspore engine: this machine's node (default 0)")
    parser.add_argument("--master-addr", metavar="HOST", help="mindspore engine: host of msrun's scheduler (--nodes)")
    parser.add_argument("--master-port", type=positive_int, metavar="P",
                        help="mindspore engine: its port (1024-65535; default a free one on one machine, msrun's 8118 "
                             "across machines)")
    parser.add_argument("--local-workers", type=count_arg, metavar="W",
                        help="mindspore engine: workers a node (default the mesh's ranks over --nodes)")
    parser.add_argument("--emulate-nodes", type=count_arg, metavar="N",
                        help="mindspore engine: run N nodes on this machine, each through its own msrun (for tests)")
    parser.add_argument("--rtol", type=tolerance_arg, default=None,
                        help="relative tolerance (default by dtype: float64 1e-12, float32 1e-5, float16 1e-2, bfloat16 "
                             "8e-2)")
    parser.add_argument("--inputs", type=Path, default=None, metavar="FILE.npz",
                        help="global arrays of some or all graph inputs, keyed by input name (numpy.savez; no pickles); "
                             "the others are drawn at random, or with MODEL --plan PLAN are the model's own weights")
    from layout_prop.io.sizes import GRAMMAR as SIZE_GRAMMAR  # --max-memory's grammar, the same as plan --memory-per-rank's
    parser.add_argument("--max-memory", type=memory_size_arg, default=None, metavar="SIZE",
                        help="refuse a run whose estimated memory exceeds SIZE (like 4096, 512M, 8GB, 1.5TiB; default: "
                             f"the memory available now); {SIZE_GRAMMAR}")
    parser.add_argument("--max-time", type=seconds_arg, default=None, metavar="SECONDS",
                        help="refuse a run on the simulator estimated to take longer than SECONDS (default 300, at most "
                             "a week); the estimate counts elements, bytes and ranks")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(parser)
    return parser


def run(args) -> int:
    from layout_prop.runner import format_nonfinite

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
    from layout_prop.io.progress import Ticker

    quiet = False if args.json else None  # the progress lines: on a terminal only, never with --json
    with Ticker("run", enabled=quiet) as ticker:
        ticker.say("reading the spec")
        graph, weights, unread = load_with_weights(args)
    from layout_prop.workflows.blocks import read_blocks
    from layout_prop.workflows.run import read_inputs, run_spec

    blocks = read_blocks(graph)  # the spec's zero:, recompute:, pipeline: blocks (a bad one: exit 2)
    if blocks.pipeline is not None:
        return _run_pipelined(args, graph, blocks, weights, backend)
    from_file = {}
    if args.inputs is not None:  # checked here, so that an error names the file
        from layout_prop.runner import check_given_inputs

        from_file = check_given_inputs(graph, read_inputs(args.inputs), str(args.inputs))
    with Ticker("run", enabled=quiet) as ticker:  # the simulator reports no steps: the phase and the time
        ticker.say(f"{graph.mesh.size:,} ranks on {'msrun' if args.engine == 'mindspore' else 'the simulator'}: "
                   "analysing, lowering, one device, every rank")
        if args.engine == "mindspore":
            options["progress"] = lambda text: ticker.say(f"msrun: {text}")  # ranks joined and finished
        rep = run_spec(graph, blocks, engine=args.engine, backend=backend, backward=args.backward, seed=args.seed,
                       reshard=not args.no_reshard, rtol=args.rtol, max_memory=args.max_memory,
                       max_time=args.max_time, weights=weights, from_file=from_file, unread=unread, options=options)
    given = {**weights, **from_file}
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
        if given:
            print(f"  inputs: {_sources_line(rep.extra['inputs'], args.inputs)}")
        for line in rep.extra.get("node_map", []):
            print(f"  {line}")
        for line in rep.extra.get("compute_notes", []):  # how the engine computed (bfloat16 on mindspore)
            print(f"  note: {line}")
        for line in rep.notes:  # what was executed instead of a node as written (a ring, a vocabulary-parallel
            if line.startswith("expand:"):  # loss), or why a form asked for was not taken
                print(f"  note: {line}")
        if "config" in rep.extra:
            print(f"  note: config: {rep.extra['config']['note']}")
        step = rep.extra.get("optimizer_step")
        if step is not None:
            worst = max((e["max_rel_err"] for e in step["params"].values()), default=0.0)
            print(f"  optimizer step ({step['optimizer']} on the ZeRO-{step['stage']} shards, "
                  f"{len(step['update_collectives'])} collectives after the update): {len(step['params'])} parameters "
                  f"{'equal to' if step['ok'] else 'NOT equal to'} one device's update, max rel err {worst:.3g}")
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


def load_with_weights(args) -> tuple:
    """:func:`layout_prop.workflows.run.load_with_weights` of ``args.spec``, ``args.plan``, ``args.opaque``."""
    from layout_prop.workflows.run import load_with_weights as load

    return load(args.spec, args.plan, args.opaque)


#: the run options a pipelined run does not take (they are the single-program run's)
_NOT_PIPELINED = (("inputs", None, "--inputs"), ("no_reshard", False, "--no-reshard"), ("rtol", None, "--rtol"),
                  ("keep_logs", False, "--keep-logs"), ("nodes", 1, "--nodes"), ("node_rank", 0, "--node-rank"),
                  ("master_addr", None, "--master-addr"), ("master_port", None, "--master-port"),
                  ("local_workers", None, "--local-workers"), ("emulate_nodes", None, "--emulate-nodes"))


def _run_pipelined(args, graph, blocks, weights: dict, backend: str) -> int:
    """A spec with a ``pipeline:`` block: the flags a pipelined run does not take refused, then
    :func:`layout_prop.workflows.run.run_pipelined`, printed."""
    from layout_prop.workflows.run import run_pipelined

    for attr, default, flag in _NOT_PIPELINED:
        if vars(args)[attr] != default:
            raise SpecError("bad-usage", f"{flag} is not taken by a pipelined run (the spec has a pipeline: block)",
                            hint="drop it; layout-prop pipeline SPEC --run takes --engine, --seed and --timeout")
    if weights:
        raise SpecError("bad-usage", "a pipelined run draws its inputs at random; the model's own weights are not "
                        "fed to it", hint="write the model as a spec (layout-prop import) and run that")
    if backend != "numpy":
        raise SpecError("bad-usage", f"a pipelined run computes with the numpy kernels, not {backend!r}",
                        hint="drop --backend (msrun workers run numpy kernels with --engine mindspore)")
    from layout_prop.io.progress import Ticker

    with Ticker("run", enabled=False if args.json else None) as ticker:  # on a terminal only
        report = run_pipelined(graph, blocks, engine=args.engine, seed=args.seed, backward=args.backward,
                               timeout=args.timeout, max_memory=args.max_memory, max_time=args.max_time,
                               progress=ticker.say)
    c = blocks.pipeline
    note = report["config"]["note"]
    if args.json:
        print_json(report)
    else:
        print(f"engine {report['engine']}, {report['ranks']} ranks: {c.stages} pipeline stages on {c.axis}, "
              f"{report['schedule']} over {report['micro_batches']} micro-batches")
        print(f"  note: config: {note}")
        for kind in ("outputs", "grads"):
            for name, err in report[kind].items():
                print(f"  {'output' if kind == 'outputs' else 'grad'} {name}: max abs err {err['max_abs_err']:.3g}, "
                      f"max rel err {err['max_rel_err']:.3g}")
        for problem in report["mismatches"]:
            print(f"  MISMATCH {problem}")
        print("matches one device" if report["ok"] else "does NOT match one device")
    return 0 if report["ok"] else 1


def _sources_line(sources: dict[str, list[str]], path) -> str:
    """``2 from in.npz, 9 the model's own, 1 drawn at random (x)``."""
    parts = []
    if sources["file"]:
        parts.append(f"{len(sources['file'])} from {cut(str(path))}")
    if sources["model"]:
        parts.append(f"{len(sources['model'])} the model's own")
    if sources["random"]:
        shown = ", ".join(sources["random"][:4]) + (", ..." if len(sources["random"]) > 4 else "")
        parts.append(f"{len(sources['random'])} drawn at random ({cut(shown)})")
    line = ", ".join(parts)
    if sources["unread"]:
        line += f"; {len(sources['unread'])} weights in external data files are not read (drawn at random)"
    return line
