"""``layout-prop estimate``: a training step's modelled time on a cluster (see :mod:`layout_prop.perf.step`)."""

from __future__ import annotations

from .model_input import load_graph
from .printing import print_json

__all__ = ["run", "format_estimate"]


def run(args) -> int:
    from layout_prop.api import analyze
    from layout_prop.perf.clusters import get_cluster
    from layout_prop.perf.step import accumulation_steps, estimate_step

    cluster = get_cluster(args.cluster)  # a bad profile or batch is said before the model is read
    graph = load_graph(args)
    accumulation_steps(graph.mesh, args.global_batch, args.micro_batch)
    zero, recompute, layers = _zero_and_recompute(args, graph)
    if zero is not None:
        from layout_prop.passes.zero import Zero

        graph = Zero(zero).run(graph)
    analysis = analyze(graph, reshard=True, backward=True)
    if not analysis.ok:
        first = analysis.check.violations[0]
        print(f"cannot estimate: the graph has {len(analysis.check.violations)} violation(s) left after resharding; "
              f"first: {first}")
        return 1
    analysed = analysis.graph
    if recompute == "selective" or (recompute == "full" and layers is not None):  # before ZeRO's re-gathers
        from layout_prop.passes.recompute import Recompute

        analysed = Recompute(recompute, layers).run(analysed)
        recompute, layers = "none", None  # (the step model counts the copies)
    if zero is not None:
        from layout_prop.passes.zero import finish

        analysed = finish(analysed, zero)
    estimate = estimate_step(analysed, cluster, global_batch=args.global_batch, micro_batch=args.micro_batch,
                             recompute=recompute, overlap=not args.no_overlap, zero=zero, recompute_layers=layers)
    if args.json:
        print_json(estimate.to_dict())
    else:
        print(format_estimate(estimate))
    return 0


def _zero_and_recompute(args, graph):
    """The ZeRO config (None without one) and the recompute mode and layers: ``--zero N``,
    ``--recompute``, ``--recompute-layers`` over the spec's ``zero:`` and ``recompute:`` blocks."""
    from layout_prop.passes.recompute import parse_recompute
    from layout_prop.passes.zero import parse_zero

    zero = None
    if getattr(args, "zero", None) is not None:
        zero = parse_zero(args.zero, graph.mesh, path="--zero")
    elif graph.meta.get("zero") is not None:
        zero = parse_zero(graph.meta["zero"], graph.mesh)
    mode, layers = parse_recompute(graph.meta["recompute"]) if graph.meta.get("recompute") is not None else ("none",
                                                                                                            None)
    if getattr(args, "recompute", None) is not None:
        mode = args.recompute
    if getattr(args, "recompute_layers", None):
        layers = tuple(x.strip() for x in args.recompute_layers.split(",") if x.strip())
        mode = "full" if mode == "none" else mode
    return zero, mode, layers


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


def format_estimate(e) -> str:
    """The estimate as text: the step, its parts, the exposed collectives per mesh axis, the top ops."""
    lines = [f"step time {_ms(e.step_time_s)} on {e.devices:,} devices of {e.cluster} "
             f"({e.accumulation} accumulation step{'s' if e.accumulation != 1 else ''})",
             f"  compute        {_ms(e.compute_s)}  (forward {_ms(e.forward_s)}, backward {_ms(e.backward_s)}, "
             f"recompute {_ms(e.recompute_s)})",
             f"  communication  {_ms(e.communication_s)} exposed  (gradient sync {_ms(e.grad_sync_s)}, of it exposed "
             f"{_ms(e.grad_sync_exposed_s)})"]
    for axis, kinds in sorted(e.communication.items()):
        parts = ", ".join(f"{kind} {_ms(t)}" for kind, t in sorted(kinds.items()))
        lines.append(f"    {axis}: {parts}")
    if e.zero_stage:
        lines.append(f"  ZeRO stage {e.zero_stage}: parameter all-gathers {_ms(e.zero_gather_s)} (in the sync)")
    lines += [f"  optimizer      {_ms(e.optimizer_s)}  (AdamW)",
              f"{e.tflops_per_device:,.1f} TFLOP/s per device, MFU {e.mfu:.1%} (the graph's FLOPs executed)",
              f"memory per rank {e.memory_per_rank_bytes:,} bytes (device: {e.hbm_bytes:,})",
              "most expensive ops (per step):"]
    for op in e.top_ops:
        lines.append(f"  {_ms(op['seconds']):>14}  {op['name']} ({op['op']}, {op['phase']})")
    lines += [f"note: {note}" for note in e.notes]
    return "\n".join(lines)
