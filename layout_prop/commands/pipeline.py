"""``layout-prop pipeline``: a spec's pipeline stages, schedule, moves and each rank's program; with
``--run``, executed on every rank (simulator or msrun) and compared with one device on the whole batch.

See docs/pipeline.md.  The drivers (``build``, ``summary``, ``run_pipeline``) are
:mod:`layout_prop.workflows.pipeline`, the Python API of a pipelined run.
"""

from __future__ import annotations

import argparse

from layout_prop.core.errors import SpecError

from layout_prop.workflows.model_input import load_graph
from .printing import print_json
from .flags import non_negative_int, seconds_arg

__all__ = ["add_parser", "run", "format_summary"]


def format_summary(data: dict) -> str:
    lines = [f"{data['stages']} stages on {data['axis']} ({data['ranks']} ranks, each stage on {data['stage_mesh']}),"
             f" {data['schedule']}" + (f" with {data['virtual_stages']} virtual stages" if data["virtual_stages"] > 1
                                       else "") + f" over {data['micro_batches']} micro-batches",
             f"bubble {data['bubble_fraction']:.3f} of the ideal time; activations in flight per stage "
             f"{data['in_flight']}"]
    for ch in data["chunks"]:
        lines.append(f"  chunk {ch['chunk']} on stage {ch['stage']}: {ch['nodes']} nodes, {ch['first']} .. "
                     f"{ch['last']}; forward {data['chunk_forward_s'][ch['chunk']] * 1e6:.1f} us, backward "
                     f"{data['chunk_backward_s'][ch['chunk']] * 1e6:.1f} us")
    lines.append(f"modelled step on {data['cluster']}: {data['step_time_s'] * 1e6:.1f} us (each chunk's op and "
                 f"collective times, moves included); the busiest stage idles {data['modelled_bubble']:.3f} of its "
                 f"busy time")
    lines.append(f"moves per micro-batch: {len(data['moves'])}, {data['bytes_moved_per_micro_batch']} bytes per rank, "
                 f"{data['move_seconds_per_micro_batch'] * 1e6:.1f} us on {data['cluster']}")
    for mv in data["moves"]:
        lines.append(f"  {mv['value']}: stage {mv['from_stage']} -> {mv['to_stage']} before {mv['before']}, "
                     f"{mv['bytes_per_rank']} bytes, {mv['seconds'] * 1e6:.1f} us")
    for mv in data["step_moves"]:  # a tied embedding's gradient: the sender's sum over the micro-batches
        lines.append(f"once a step: {mv['value']} summed over the micro-batches, stage {mv['from_stage']} -> "
                     f"{mv['to_stage']} before {mv['before']}, {mv['bytes_per_rank']} bytes, "
                     f"{mv['seconds'] * 1e6:.1f} us")
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop pipeline``'s flags, on the command line's ``subparsers``."""
    parser = subparsers.add_parser("pipeline", help="a spec's pipeline stages, schedule, bubble and moves; one rank's program; "
                            "--run executes it and compares with one device")
    parser.add_argument("spec", metavar="SPEC",
                        help="a YAML or JSON spec with a pipeline: block (- reads standard input)")
    parser.add_argument("--rank", type=non_negative_int, metavar="R",
                        help="print rank R's program: its stage, schedule, the values it receives, its local ops")
    parser.add_argument("--run", action="store_true", help="execute every rank's schedule over the micro-batches and "
                        "compare the loss and gradients with one device on the whole batch (exit 1 if they differ)")
    parser.add_argument("--engine", choices=["sim", "mindspore"], default="sim",
                        help="with --run: the simulator (default) or msrun workers (numpy kernels)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--timeout", type=seconds_arg, default=300.0,
                        help="--engine mindspore: seconds before giving up (default 300)")
    parser.add_argument("--cluster", default="a100-80g", metavar="NAME|FILE",
                        help="the device whose op times balance stages the spec does not cut (default a100-80g)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser


def run(args) -> int:
    from layout_prop.io.progress import Ticker
    from layout_prop.workflows.blocks import read_blocks
    from layout_prop.workflows.pipeline import build, profile_of, run_pipeline, summary

    # on a terminal, a line says which phase runs and for how long (the GPT example of docs/planning.md,
    # 16 ranks and 16 micro-batches, ran minutes in silence); nothing when piped or with --json
    with Ticker("pipeline" + (" --run" if args.run else ""), enabled=False if args.json else None) as ticker:
        ticker.say("reading the spec")
        graph = load_graph(args.spec)
        blocks = read_blocks(graph)  # the zero: and recompute: blocks are applied too
        profile = profile_of(args.cluster)  # read once: a file's figures, never a built-in of the same name
        ticker.say("analysing and lowering one micro-batch")
        built = build(graph, profile, blocks.zero, (blocks.recompute, blocks.layers))
        if args.rank is not None and not 0 <= args.rank < built.program.mesh.size:
            raise SpecError("bad-value", f"--rank {args.rank} is not a rank of {built.program.mesh}",
                            hint=f"use 0..{built.program.mesh.size - 1}")
        report = None
        if args.run:
            options = {}
            if args.engine == "mindspore":
                options = {"backend": "numpy", "timeout": args.timeout}
            report = run_pipeline(built, args.seed, args.engine, progress=ticker.say, **options)
    if report is not None:
        if args.json:
            print_json(report)
        else:
            print(f"pipelined run on {report['ranks']} ranks ({report['engine']}), {report['schedule']} over "
                  f"{report['micro_batches']} micro-batches: {'matches' if report['ok'] else 'DIFFERS FROM'} one "
                  f"device on the whole batch")
            for kind in ("outputs", "grads"):
                for name, err in report[kind].items():
                    label = name if kind == "outputs" else f"grad:{name}"
                    print(f"  {label}: max abs err {err['max_abs_err']:.3g}, max rel err {err['max_rel_err']:.3g}")
            for problem in report["mismatches"]:
                print(f"  mismatch: {problem}")
        return 0 if report["ok"] else 1
    if args.rank is not None:
        if args.json:
            print_json(built.program.to_dict(args.rank))
        else:
            print(built.program.format(args.rank))
        return 0
    data = summary(built, profile)
    if args.json:
        print_json(data)
    else:
        print(format_summary(data))
    return 0
