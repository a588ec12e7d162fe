"""``layout-prop estimate``: a training step's modelled time on a cluster (the driver is
:func:`layout_prop.workflows.estimate.estimate`; the model :mod:`layout_prop.perf.step`)."""

from __future__ import annotations

import argparse

from layout_prop.workflows.model_input import load_graph
from .printing import print_json
from .flags import add_model_args, non_negative_int, positive_int

__all__ = ["add_parser", "run", "format_estimate", "format_pipelined"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop estimate``'s flags, on the command line's ``subparsers``."""
    parser = subparsers.add_parser("estimate", help="a training step's modelled time on a cluster: compute, exposed "
                            "communication, optimizer, MFU, memory")
    parser.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file, or a model with --plan (- reads stdin)")
    parser.add_argument("--cluster", required=True, metavar="NAME|FILE",
                        help="a built-in profile (a100-80g, h100-80g, ascend-910b) or a cluster YAML file")
    parser.add_argument("--global-batch", type=positive_int, metavar="N", help="sequences a step (with --micro-batch)")
    parser.add_argument("--micro-batch", type=positive_int, metavar="M",
                        help="sequences a micro-batch on one data-parallel rank; accumulation is N / (M x dp)")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default=None,
                        help="full: recompute every activation in the backward (one more forward); selective: the "
                        "attention core (default: the spec's recompute block, else none)")
    parser.add_argument("--recompute-layers", metavar="L0,L1", help="recompute only these layers (full unless "
                        "--recompute selective)")
    parser.add_argument("--zero", type=non_negative_int, choices=[0, 1, 2, 3], metavar="STAGE", help="ZeRO stage 0-3 over every "
                        "data-parallel mesh axis (dp, data, fsdp; default: the spec's zero block, else 0)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="expose the whole gradient synchronisation (default: overlapped with the backward)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    add_model_args(parser)
    return parser


def run(args) -> int:
    from layout_prop.perf.clusters import get_cluster
    from layout_prop.workflows.blocks import read_blocks
    from layout_prop.workflows.estimate import check_global_batch, estimate

    check_global_batch(args.global_batch)
    cluster = get_cluster(args.cluster)  # a bad profile or batch is said before the model is read
    graph = load_graph(args.spec, args.plan, args.opaque)
    # the spec's zero:, recompute:, pipeline: blocks, the flags over them
    blocks = read_blocks(graph, zero=args.zero, recompute=args.recompute, recompute_layers=args.recompute_layers)
    result = estimate(graph, blocks, cluster, args.cluster, global_batch=args.global_batch,
                      micro_batch=args.micro_batch, overlap=not args.no_overlap)
    if result.violations:
        print(f"cannot estimate: the graph has {len(result.violations)} violation(s) left after resharding; "
              f"first: {result.violations[0]}")
        return 1
    if result.pipelined is not None:
        if args.json:
            print_json(result.pipelined)
        else:
            print(format_pipelined(result.pipelined))
        return 0
    if args.json:
        print_json(result.step.to_dict())
    else:
        print(format_estimate(result.step))
    return 0


def format_pipelined(d: dict) -> str:
    """:func:`~layout_prop.workflows.estimate.estimate_pipelined`'s result as text (times in microseconds: a
    stage's micro-batch is short)."""
    def us(seconds: float) -> str:
        return f"{seconds * 1e6:,.1f} us"

    cfg = d["config"]["pipeline"]
    v = f", {cfg['virtual_stages']} virtual stages" if cfg["virtual_stages"] > 1 else ""
    lines = [f"step time {us(d['step_time_s'])} on {d['devices']:,} devices of {d['cluster']}: {cfg['stages']} "
             f"pipeline stages on {cfg['axis']} ({cfg['schedule']}{v}, {cfg['micro_batches']:,} micro-batches), "
             f"each stage on {d['stage_mesh']}",
             f"  pipeline       {us(d['pipeline_s'])}  (the schedule simulated with each chunk's times and the "
             f"moves, {d['moves']} a micro-batch, {us(d['move_s'])}"
             + (f", {d['step_moves']} once a step, {us(d['step_move_s'])}" if d.get("step_moves") else "")
             + f"; the busiest stage idles {d['bubble']:.3f} of "
             f"its busy time, the closed form's bubble {d['bubble_fraction']:.3f})",
             f"  gradient sync  {us(d['grad_sync_exposed_s'])} exposed  (stage {d['slowest_stage']})",
             f"  optimizer      {us(d['optimizer_s'])}  (AdamW, stage {d['slowest_stage']})"]
    if "accumulate_s" in d:  # the micro-batches' weight gradients summed, after the schedule (perf.parallel)
        longest = max(d["stages"], key=lambda st: st.get("accumulate_s", 0.0))["stage"]
        lines.insert(2, f"  accumulation   {us(d['accumulate_s'])}  (the micro-batches' gradients summed, stage "
                        f"{longest})")
    for st in d["stages"]:
        n = st["parameters"]
        lines.append(f"  stage {st['stage']}: forward {us(st['forward_s'])}, backward {us(st['backward_s'])} a "
                     f"micro-batch; {n} parameter{'s' if n != 1 else ''}, sync {us(st['grad_sync_s'])} "
                     f"({us(st['grad_sync_exposed_s'])} exposed); memory {st['memory_bytes']:,} bytes "
                     f"(activations {st['activation_bytes']:,})")
    zero, recompute = d["config"]["zero"], d["config"]["recompute"]
    if zero is not None and zero["stage"]:
        lines.append(f"  ZeRO stage {zero['stage']} over {', '.join(zero['axes'])}")
    if recompute["mode"] != "none":
        lines.append(f"  recompute {recompute['mode']}" + (f" of {', '.join(recompute['layers'])}"
                                                            if recompute["layers"] else ""))
    lines.append(f"{_tflops(d['tflops_per_device'])} TFLOP/s per device, MFU {_mfu(d['mfu'])} (the graph's FLOPs "
                 "executed)")
    lines.append(f"memory per rank {d['memory_per_rank_bytes']:,} bytes on stage {d['busiest_stage']} "
                 f"(device: {d['hbm_bytes']:,})")
    lines.append(_model_error())
    lines += [f"note: {note}" for note in d["notes"]]
    return "\n".join(lines)


def _model_error() -> str:
    """The line that says how far the model is from published runs (:data:`layout_prop.perf.calibration.CALIBRATION`)."""
    from layout_prop.perf.calibration import CALIBRATION

    return CALIBRATION.text()


def _time(seconds: float) -> str:
    """A time of the estimate in the unit that shows it: ms to three decimals from a millisecond up (as estimate
    always printed them, so large models' transcripts stay), below in plan --search's us or ns
    (:func:`~layout_prop.planner.search.format_seconds`: ``0.000 ms`` said nothing on small models); an exact
    zero (no recomputation) is ``0 ms``.

    >>> _time(5.5064), _time(0.0010004), _time(0.00099951), _time(1.8e-5), _time(4.2e-9), _time(0.0)
    ('5,506.400 ms', '1.000 ms', '1.000 ms', '18.0 us', '4.2 ns', '0 ms')
    """
    from layout_prop.planner.search import format_seconds

    if seconds == 0:
        return "0 ms"
    if abs(seconds) >= 0.9995e-3:  # (0.9995 ms and up printed '1.000 ms' before: they still do)
        return f"{seconds * 1e3:,.3f} ms"
    return format_seconds(seconds)


def _tflops(value: float) -> str:
    """TFLOP/s per device to one decimal, as before, or to two significant digits where one decimal would
    round a non-zero rate to ``0.0`` (a small model's).

    >>> _tflops(125.06), _tflops(0.0123), _tflops(0.00004567), _tflops(0.0)
    ('125.1', '0.012', '0.000046', '0.0')
    """
    import math

    text = f"{value:,.1f}"
    if value > 0 and text == "0.0":
        text = f"{value:.{1 - math.floor(math.log10(value))}f}"
    return text


def _mfu(value: float) -> str:
    """The model FLOPs utilisation to a tenth of a percent, ``<0.1%`` where that would round a non-zero
    utilisation to ``0.0%``.

    >>> _mfu(0.4012), _mfu(0.00004), _mfu(0.0)
    ('40.1%', '<0.1%', '0.0%')
    """
    text = f"{value:.1%}"
    return "<0.1%" if value > 0 and text == "0.0%" else text


def format_estimate(e) -> str:
    """The estimate as text: the step, its parts, the exposed collectives per mesh axis, the top ops."""
    lines = [f"step time {_time(e.step_time_s)} on {e.devices:,} devices of {e.cluster} "
             f"({e.accumulation:,} accumulation step{'s' if e.accumulation != 1 else ''})",
             f"  compute        {_time(e.compute_s)}  (forward {_time(e.forward_s)}, backward "
             f"{_time(e.backward_s)}, recompute {_time(e.recompute_s)})",
             f"  communication  {_time(e.communication_s)} exposed  (gradient sync {_time(e.grad_sync_s)}, of it "
             f"exposed {_time(e.grad_sync_exposed_s)})"]
    for axis, kinds in sorted(e.communication.items()):
        parts = ", ".join(f"{kind} {_time(t)}" for kind, t in sorted(kinds.items()))
        lines.append(f"    {axis}: {parts}")
    if e.zero_stage:
        lines.append(f"  ZeRO stage {e.zero_stage}: parameter all-gathers {_time(e.zero_gather_s)} (in the sync)")
    lines += [f"  optimizer      {_time(e.optimizer_s)}  (AdamW)",
              f"{_tflops(e.tflops_per_device)} TFLOP/s per device, MFU {_mfu(e.mfu)} (the graph's FLOPs executed)",
              f"memory per rank {e.memory_per_rank_bytes:,} bytes (device: {e.hbm_bytes:,})",
              _model_error(),
              "most expensive ops (per step):"]
    for op in e.top_ops:
        lines.append(f"  {_time(op['seconds']):>14}  {op['name']} ({op['op']}, {op['phase']})")
    lines += [f"note: {note}" for note in e.notes]
    return "\n".join(lines)
