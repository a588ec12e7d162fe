"""A spec's pipeline (its ``pipeline:`` block): built (:func:`build`: the micro-batch analysed on the stage mesh,
cut into chunks and lowered), summarised (:func:`summary`: stages, chunks, moves, the modelled schedule) and
executed on every rank and compared with one device on the whole batch (:func:`run_pipeline`).  The
``layout-prop pipeline`` command prints these; ``run`` and ``estimate`` build through :func:`build` too.
See docs/pipeline.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from layout_prop.core import meta
from layout_prop.core.errors import LayoutError, SpecError

__all__ = ["Built", "build", "run_pipeline", "summary", "task_seconds", "op_time_cost", "check_pipelined_run",
           "profile_of"]


@dataclass
class Built:
    """A spec's pipeline, lowered: the whole graph, the config, the analysed micro-batch graph and the program."""

    graph: object
    config: object
    micro: object
    program: object
    batch_inputs: list = field(default_factory=list)


def profile_of(cluster):
    """``cluster`` itself when it is a profile already (one read from a file keeps its own figures,
    whatever its ``name:``), else the profile it names (a built-in name or a file's path)."""
    from layout_prop.perf.clusters import Cluster, get_cluster

    return cluster if isinstance(cluster, Cluster) else get_cluster(cluster)


def op_time_cost(graph, cluster_name="a100-80g"):
    """Seconds of each node of an analysed graph on ``cluster_name``'s device (a profile, a built-in name or
    a cluster file; the step-time model's op_time): what balances stages that the spec does not cut itself."""
    from layout_prop.core import meta
    from layout_prop.passes.propagate import value_spec
    from layout_prop.perf.costs import op_cost, op_time

    cluster = profile_of(cluster_name)

    def seconds(node) -> float:
        ins, outs = [value_spec(graph, v) for v in node.inputs], node.meta[meta.SPECS]
        cost = op_cost(node.op, [s.local_shape(0) for s in ins], [s.local_shape(0) for s in outs],
                       [s.itemsize for s in ins], [s.itemsize for s in outs], node.meta[meta.ATTRS],
                       dtype=outs[0].dtype)
        return op_time(cost, cluster)
    return seconds


def build(graph, cluster: str = "a100-80g", zero=None, recompute: tuple = ("none", None),
          localize: bool = True) -> Built:
    """Check the spec's ``pipeline:`` block, analyse one micro-batch (backward, reshard) on the stage mesh,
    cut it into chunks (balanced by :func:`op_time_cost` when the block gives no cut) and lower it.

    ``zero`` (a :class:`~layout_prop.passes.zero.ZeroConfig`) and ``recompute`` (``(mode, layers)``, as
    :func:`~layout_prop.io.spec_blocks.parse_recompute` gives) are applied in the order of
    docs/zero-and-recompute.md: Zero on the micro-batch graph, the analysis, Recompute, ``finish``.
    ``localize=False`` lowers without per-rank kernel attrs (estimate executes nothing)."""
    from layout_prop.api import analyze
    from layout_prop.io.spec_blocks import parse_pipeline
    from layout_prop.passes.pipeline import forward_chunks, lower_pipeline, micro_batch_graph

    if meta.PIPELINE not in graph.meta:
        raise SpecError("bad-pipeline", "the spec has no pipeline: block", path="pipeline",
                        hint="add pipeline: {axis: pp, micro_batches: 4} and a pp axis to the mesh (docs/pipeline.md)")
    config = parse_pipeline(graph.meta[meta.PIPELINE], graph.mesh)
    micro, batch_inputs = micro_batch_graph(graph, config)
    if zero is not None and zero.stage:
        from layout_prop.passes.zero import Zero

        micro = Zero(zero).run(micro)
    try:
        analysis = analyze(micro, reshard=True, backward=True)
    except LayoutError as err:  # e.g. a micro-batch too small for its data-parallel shards
        shapes = ", ".join(f"{name} {list(micro.node(name).attrs['shape'])}" for name in batch_inputs)
        raise SpecError("bad-pipeline", f"one micro-batch ({shapes}) on the stage mesh {micro.mesh}: {err.message}",
                        path="pipeline.micro_batches", hint="use fewer micro-batches or a larger batch") from None
    if not analysis.ok:
        first = analysis.check.violations[0]
        raise SpecError("bad-pipeline", f"one micro-batch on the stage mesh has {len(analysis.check.violations)} "
                        f"violation(s) left after resharding; first: {first}", path="pipeline",
                        hint="check the spec with layout-prop check --reshard --backward")
    g = analysis.graph
    if recompute[0] != "none":
        from layout_prop.passes.recompute import Recompute

        g = Recompute(*recompute).run(g)
    if zero is not None and zero.stage:
        from layout_prop.passes.zero import finish

        g = finish(g, zero)
    chunks = forward_chunks(g, config, op_time_cost(g, cluster))
    return Built(graph, config, g, lower_pipeline(g, config, graph.mesh, batch_inputs, chunks, localize=localize),
                 batch_inputs)


def run_pipeline(built: Built, seed: int = 0, engine: str = "sim", progress: Callable[[str], None] | None = None,
                 **engine_options) -> dict:
    """Execute ``built`` on every rank and compare with one device on the whole batch.

    ``progress`` (a :class:`~layout_prop.io.progress.Ticker`'s ``say``) is told each phase and
    its count: the one-device run's kernels, the ranks' tasks, msrun's ranks.

    Returns ``{"ok", "engine", "ranks", "outputs": {name: errors}, "grads": {input: errors},
    "mismatches": [...], "moves": bytes moved per rank and micro-batch, "in_flight": [...]}``.
    """
    from layout_prop.api import analyze
    from layout_prop.engines.pipeline import execute_pipeline, gather_rank_results
    from layout_prop.runner import (TOLERANCES, _quiet_numerics, compare, execute_global, exact_errors,
                                    random_inputs, rounding_tolerance)

    from layout_prop.kernels.numpy_backend import KERNELS

    say = progress if progress is not None else (lambda text: None)
    pprog, config = built.program, built.config
    m = config.micro_batches
    say("analysing the whole batch on one device")
    analysis = analyze(built.graph, reshard=True, backward=True)  # the whole batch (the block is not read)
    if not analysis.ok:
        raise SpecError("bad-pipeline", f"the whole batch on one mesh has {len(analysis.check.violations)} "
                        f"violation(s) left after resharding; first: {analysis.check.violations[0]}",
                        hint="check the spec with layout-prop check --reshard --backward")
    whole = analysis.graph
    limits = {key: engine_options.pop(key, None) for key in ("max_memory", "max_time")}
    check_pipelined_run(built, whole, engine, **limits)  # refused before anything is drawn or run
    inputs = random_inputs(whole, seed)
    kernels = KERNELS
    if progress is not None:
        nodes = sum(1 for node in whole.nodes if not node.is_input)
        kernels = _counting(KERNELS, lambda done: say(f"one device on the whole batch: node {done:,}/{nodes:,}"))
    with _quiet_numerics():
        reference = execute_global(whole, inputs, kernels=kernels, wanted=list(whole.outputs))
    scale = 1.0 / m if config.loss == "mean" else 1.0
    shared = {name: value * scale if name.startswith("cotangent/") else value
              for name, value in inputs.items() if name not in built.batch_inputs}
    micro_inputs = [{name: np.split(inputs[name], m, axis=0)[k] for name in built.batch_inputs} for k in range(m)]
    report: dict = {"ok": False, "engine": engine, "ranks": pprog.mesh.size, "schedule": config.schedule,
                    "micro_batches": m}
    with _quiet_numerics():
        if engine == "sim":
            ranks = pprog.mesh.size
            run = execute_pipeline(pprog, micro_inputs, shared, progress=lambda done, total: say(
                f"{ranks} simulated ranks: task {done:,}/{total:,} (a stage's chunk of one micro-batch)"))
            values = run.values
            report["in_flight"] = run.in_flight
        else:
            from layout_prop.engines.msrun_engine import MsrunEngine
            from layout_prop.passes.pipeline import rank_programs

            programs = rank_programs(pprog)
            given = dict(shared)
            for k, batch in enumerate(micro_inputs):
                given.update({f"{name}@mb{k}": value for name, value in batch.items()})
            given.update(programs.placeholder_inputs())
            if progress is not None:
                engine_options = {**engine_options, "progress": lambda text: say(f"msrun: {text}")}
            msrun = MsrunEngine(**engine_options)
            values = gather_rank_results(programs, msrun.execute(programs, given, wanted=programs.wanted()))
            report.update(msrun.report_extra())
    grad_of = {v: v[len("grad/"):] for v in reference if v.startswith("grad/")}
    report.update({"outputs": {}, "grads": {}, "mismatches": []})
    exact = exact_errors(whole, inputs, reference)  # float16, bfloat16: one device's own rounding, measured
    for name, want in reference.items():
        spec = whole.producer(name)[0].meta[meta.SPECS][whole.producer(name)[1]]
        tol = rounding_tolerance(TOLERANCES.get(spec.dtype, 1e-5), exact.get(name))
        errors, problem = compare(name, values[name], want, spec, tol)
        (report["grads"] if name in grad_of else report["outputs"])[grad_of.get(name, name)] = errors
        if problem:
            report["mismatches"].append(problem)
    report["ok"] = not report["mismatches"]
    return report


def _counting(kernels: dict[str, Callable], tick: Callable[[int], None]) -> dict[str, Callable]:
    """``kernels`` with each kernel calling ``tick(calls so far)`` after it returns (the one-device run's
    progress: execute_global calls one kernel a node)."""
    calls = [0]

    def counted(fn: Callable) -> Callable:
        def call(*args, **attrs):
            result = fn(*args, **attrs)
            calls[0] += 1
            tick(calls[0])
            return result
        return call
    return {op: counted(fn) for op, fn in kernels.items()}


def check_pipelined_run(built: Built, whole, engine: str = "sim", max_memory: int | None = None,
                        max_time: float | None = None) -> tuple[int, float]:
    """Refuse (``run-too-large``) a pipelined run too large for this process, as ``run`` refuses an
    unpipelined one (:func:`layout_prop.runner.check_run_memory`, ``check_run_time``), before anything
    is allocated: the one-device reference on the whole batch (``whole``, analysed), plus the ranks'
    program of one micro-batch on the stage mesh counted once per micro-batch (every micro-batch's
    activations may be in flight at once: GPipe holds them all).  Returns ``(bytes, seconds)`` estimated.
    """
    from layout_prop.core.errors import ExecutionError
    from layout_prop.passes.lower import Lower
    from layout_prop.runner import (DEFAULT_MAX_TIME, available_memory, estimate_run_memory, estimate_run_time,
                                    format_bytes, format_seconds)

    m = built.config.micro_batches
    reference = estimate_run_memory(whole, Lower(localize=False).run(whole).program)
    micro = estimate_run_memory(built.micro, built.program.program)
    needed = reference.needed + m * micro.needed
    limit = max_memory if max_memory is not None else available_memory()
    if limit is not None and needed > limit:
        what = "the --max-memory limit of" if max_memory is not None else "the available"
        raise ExecutionError("run-too-large", f"the pipelined run needs about {format_bytes(needed)} ({needed} bytes, "
                             f"estimated: one device on the whole batch, and {m} micro-batches on "
                             f"{built.program.mesh.size} ranks), over {what} {format_bytes(limit)} ({limit} bytes)",
                             hint="use smaller shapes or fewer ranks; --max-memory SIZE sets the limit if the "
                                  "estimate is too cautious")
    seconds = 0.0
    if engine == "sim":
        seconds = estimate_run_time(whole).seconds + m * estimate_run_time(built.micro).seconds
        time_limit = DEFAULT_MAX_TIME if max_time is None else max_time
        if seconds > time_limit:
            what = "the --max-time limit of" if max_time is not None else "the default limit of"
            raise ExecutionError("run-too-large", f"the pipelined run would take about {format_seconds(seconds)} on "
                                 f"the simulator ({seconds:.3g} s estimated: one device on the whole batch, and {m} "
                                 f"micro-batches on {built.program.mesh.size} ranks), over {what} {time_limit:g} s",
                                 hint="use fewer ranks or smaller shapes; --max-time SECONDS raises the limit if "
                                      "the run may take that long")
    return needed, seconds


def summary(built: Built, cluster: str = "a100-80g") -> dict:
    """Stages, chunks (first and last node, layers), the schedule's bubble and in-flight numbers, and the
    moves with their bytes and modelled seconds on ``cluster`` (perf.collectives: one link transfer)."""
    from layout_prop.passes.schedule import bubble_fraction, in_flight, simulate
    from layout_prop.perf.collectives import collective_time

    pprog, c = built.program, built.config
    profile = profile_of(cluster)
    chunks = []
    for chunk in range(c.chunks):
        kernels = [op.source for op in pprog.tasks.get((chunk, "F"), ()) if op.kind == "kernel"]
        chunks.append({"chunk": chunk, "stage": chunk % c.stages, "first": kernels[0] if kernels else None,
                       "last": kernels[-1] if kernels else None, "nodes": len(kernels)})
    def move_row(mv, before: str) -> dict:
        nbytes = pprog.permute(mv).bytes_per_rank
        return {"value": mv.value, "from_stage": mv.src_stage, "to_stage": mv.dst_stage,
                "before": f"{before}{'forward' if mv.phase == 'F' else 'backward'} chunk {mv.chunk}",
                "bytes_per_rank": nbytes,
                "seconds": collective_time("permute", nbytes, pprog.mesh.shape, pprog.axis, profile)}

    moves = [move_row(mv, "") for key in sorted(pprog.moves) for mv in pprog.moves[key]]
    once = [move_row(mv, "the last micro-batch's ") for key in sorted(pprog.step_moves) for mv in pprog.step_moves[key]]
    timeline = simulate(pprog.orders, c.stages, c.virtual_stages)
    forward, backward = task_seconds(built, profile)
    move = max((mv["seconds"] for mv in moves), default=0.0)
    modelled = simulate(pprog.orders, c.stages, c.virtual_stages, forward, backward, t_move=move)
    return {"axis": c.axis, "stages": c.stages, "virtual_stages": c.virtual_stages, "schedule": c.schedule,
            "micro_batches": c.micro_batches, "ranks": pprog.mesh.size, "stage_mesh": str(pprog.program.mesh),
            "bubble_fraction": bubble_fraction(c.schedule, c.stages, c.micro_batches, c.virtual_stages),
            "simulated_bubble": round(timeline.bubble, 12), "in_flight": in_flight(pprog.orders),
            "chunks": chunks, "moves": moves, "step_moves": once, "cluster": profile.name,
            "bytes_moved_per_micro_batch": sum(mv["bytes_per_rank"] for mv in moves),
            "move_seconds_per_micro_batch": sum(mv["seconds"] for mv in moves),
            "chunk_forward_s": forward, "chunk_backward_s": backward,
            "step_time_s": modelled.makespan, "modelled_bubble": modelled.bubble}


def task_seconds(built: Built, cluster) -> tuple[list[float], list[float]]:
    """Each chunk's forward and backward seconds for one micro-batch on ``cluster``: its kernels' op_time and
    its collectives' collective_time on the stage mesh (the step-time model's pieces, added up)."""
    from layout_prop.perf.collectives import collective_time

    pprog, c = built.program, built.config
    seconds = op_time_cost(built.micro, cluster)
    nodes = {n.name: n for n in built.micro.nodes}
    shape = pprog.program.mesh.shape
    out = {"F": [0.0] * c.chunks, "B": [0.0] * c.chunks}
    for (chunk, phase), ops in pprog.tasks.items():
        for op in ops:
            if op.kind == "kernel" and op.source in nodes:
                out[phase][chunk] += seconds(nodes[op.source])
            elif op.kind == "collective":
                out[phase][chunk] += collective_time(op.step.kind, op.step.bytes_per_rank, shape, op.step.mesh_axis,
                                                     cluster)
    return out["F"], out["B"]
