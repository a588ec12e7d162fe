"""A training step's modelled time on a cluster (``layout-prop estimate``; see :mod:`layout_prop.perf.step`):
:func:`estimate` for a spec (its ``zero:``, ``recompute:``, ``pipeline:`` blocks and the flags over them read
by the caller), :func:`estimate_pipelined` for a spec with a ``pipeline:`` block, and :func:`check_global_batch`,
the ``--global-batch`` check ``plan --search`` shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from layout_prop.core import meta

__all__ = ["Estimated", "estimate", "estimate_pipelined", "check_global_batch", "training_batch", "MAX_GLOBAL_BATCH"]

#: the most sequences ``--global-batch`` takes (estimate, plan --search): 2^24, 16M tokens a step even at one
#: token a sequence, past the largest published batches (Llama 3 405B: 16M tokens, 2,048 sequences of 8,192).
#: Past it the step's figures are no training step's (10^30 printed a step of 10^28 ms; 10^400 overflowed a float)
MAX_GLOBAL_BATCH = 2 ** 24


def check_global_batch(value: int | None) -> None:
    """Refuse a ``--global-batch`` that is no step's number of sequences (``bad-batch``, one line, exit 2).

    >>> from layout_prop.core.errors import SpecError
    >>> check_global_batch(None), check_global_batch(512)
    (None, None)
    >>> try:
    ...     check_global_batch(10**30)
    ... except SpecError as err:
    ...     print(err.code, err.message)
    bad-batch 1000000000000000000000000000000 sequences a step is more than 16,777,216 (2^24)
    """
    from layout_prop.core.errors import SpecError, cut

    if value is None or 1 <= value <= MAX_GLOBAL_BATCH:
        return
    limit = f"more than {MAX_GLOBAL_BATCH:,} (2^24)" if value > MAX_GLOBAL_BATCH else "not a positive count"
    raise SpecError("bad-batch", f"{cut(value)} sequences a step is {limit}", path="--global-batch",
                    hint="give the sequences of one optimizer step, like --global-batch 512")


@dataclass(frozen=True)
class Estimated:
    """What :func:`estimate` found: one of ``step`` (a spec without a ``pipeline:`` block), ``pipelined`` (with
    one) or ``violations`` (left after resharding: nothing estimated)."""

    step: Any = None  # a perf.step.StepEstimate
    pipelined: dict | None = None  # estimate_pipelined's record
    violations: tuple = ()


def estimate(graph, blocks, cluster, cluster_arg: str, *, global_batch: int | None = None,
             micro_batch: int | None = None, overlap: bool = True) -> Estimated:
    """The modelled training step of ``graph`` (a spec read, with its ``blocks``: :func:`.blocks.read_blocks`)
    on ``cluster`` (a profile; ``cluster_arg`` is what named it).  ``global_batch`` and ``micro_batch`` (the
    flags) win over the spec's ``training:`` block (a note in ``blocks.notes`` says so).  With a ``pipeline:``
    block, :func:`estimate_pipelined`; else ZeRO on the forward graph, the analysis (backward, reshard),
    recomputation and ZeRO's finish, and :func:`~layout_prop.perf.step.estimate_step`."""
    from layout_prop.api import analyze
    from layout_prop.perf.step import accumulation_steps, estimate_step

    global_batch, micro_batch = training_batch(graph, global_batch, micro_batch, blocks.notes)
    if blocks.pipeline is not None:
        return Estimated(pipelined=estimate_pipelined(graph, blocks, cluster, cluster_arg, global_batch=global_batch,
                                                      micro_batch=micro_batch, overlap=overlap))
    accumulation_steps(graph.mesh, global_batch, micro_batch)
    zero, recompute, layers = blocks.zero, blocks.recompute, blocks.layers
    if zero is not None:
        from layout_prop.passes.zero import Zero

        graph = Zero(zero).run(graph)
    analysis = analyze(graph, reshard=True, backward=True)
    if not analysis.ok:
        return Estimated(violations=tuple(analysis.check.violations))
    analysed = analysis.graph
    if recompute == "selective" or (recompute == "full" and layers is not None):  # before ZeRO's re-gathers
        from layout_prop.passes.recompute import Recompute

        analysed = Recompute(recompute, layers).run(analysed)
        recompute, layers = "none", None  # (the step model counts the copies)
    if zero is not None:
        from layout_prop.passes.zero import finish

        analysed = finish(analysed, zero)
    step = estimate_step(analysed, cluster, global_batch=global_batch, micro_batch=micro_batch,
                         recompute=recompute, overlap=overlap, zero=zero, recompute_layers=layers)
    step.notes.extend(blocks.notes)
    return Estimated(step=step)


def training_batch(graph, global_batch: int | None, micro_batch: int | None, notes: list[str]):
    """``(global_batch, micro_batch)``: the flags when either is given (a note says when they override the spec's
    ``training:`` block), else the block's (``io.spec_blocks.parse_training``), else ``(None, None)``."""
    from layout_prop.io.spec_blocks import parse_training

    block = graph.meta.get(meta.TRAINING)
    if block is None:
        return global_batch, micro_batch
    training = parse_training(block)
    if global_batch is None and micro_batch is None:
        return training.global_batch, training.micro_batch
    if (global_batch, micro_batch) != (training.global_batch, training.micro_batch):
        notes.append(f"--global-batch/--micro-batch given: the spec's training: block (global_batch "
                     f"{training.global_batch}, micro_batch {training.micro_batch}) is not read")
    return global_batch, micro_batch



# --------------------------------------------------------------------------- a spec with a pipeline: block
def _node_seconds(graph, cluster, flops: dict | None = None):
    """A node's roofline seconds on ``cluster`` (its op_cost on rank 0's local shapes, as estimate_step);
    ``flops`` collects the matrix FLOPs by dtype (``"total"``: every op's)."""
    from layout_prop.core import meta
    from layout_prop.passes.propagate import value_spec
    from layout_prop.perf.costs import op_cost, op_time

    def seconds(node) -> float:
        ins, outs = [value_spec(graph, v) for v in node.inputs], node.meta[meta.SPECS]
        attrs = node.meta.get(meta.ATTRS, node.attrs)
        dtype = ins[0].dtype if ins else outs[0].dtype
        cost = op_cost(node.op, [s.local_shape(0) for s in ins], [s.local_shape(0) for s in outs],
                       [s.itemsize for s in ins], [s.itemsize for s in outs], attrs, dtype=dtype)
        if flops is not None:
            flops["total"] = flops.get("total", 0.0) + cost.flops
            if cost.kind in ("matmul", "attention"):
                flops[dtype] = flops.get(dtype, 0.0) + cost.flops
        return op_time(cost, cluster)
    return seconds


def estimate_pipelined(graph, blocks, cluster, cluster_arg: str, *, global_batch=None, micro_batch=None,
                       overlap: bool = True) -> dict:
    """The modelled step of a spec with a ``pipeline:`` block (and its ``zero:``/``recompute:`` blocks).

    The pipeline is built as ``layout-prop pipeline`` builds it (:func:`.pipeline.build`: one
    micro-batch on the stage mesh, ZeRO, the analysis, recomputation, the cut into chunks, the moves).  Each
    chunk's forward and backward seconds add its kernels' op_time and its collectives' collective_time on the
    stage mesh, the gradient synchronisation (and ZeRO-3's gathers) left out; ``passes.schedule.simulate``
    times the schedule with them and the largest move's time on every edge between stages.  Then, per stage,
    as ``perf.step.estimate_step`` places them: the gradient synchronisation of the stage's parameters (once
    a step after the backward, overlapped with it, at least the last; ZeRO 2 and 3 every micro-batch), ZeRO
    1 and 2's all-gather of the updated shards, AdamW on the stage's parameters, and the sum of the
    micro-batches' weight gradients (``perf.parallel.accumulation_time``: ``accumulate_s``, the longest stage's,
    added to the step after the schedule, as plan --search adds it; estimate_step counts the same in its
    backward).  The step is the simulated schedule plus the accumulation and the slowest stage's sync and
    optimizer; the memory is the busiest stage's: its parameters' share of the model states (passes.memory with the ZeRO config) and the most activations its
    order holds at once (each chunk's values held from its forward into its backward, ``held_values``).
    """
    from layout_prop.core import meta
    from layout_prop.core.errors import SpecError
    from layout_prop.core.redistribute import plan_redistribution
    from layout_prop.core.spec import TensorSpec
    from layout_prop.passes.memory import Memory
    from layout_prop.passes.propagate import value_spec
    from layout_prop.passes.recompute import held_values
    from layout_prop.passes.schedule import bubble_fraction, simulate
    from layout_prop.perf.calibration import CALIBRATION
    from layout_prop.perf.collectives import collective_time
    from layout_prop.perf.parallel import accumulation_time, optimizer_time, zero3_exposed
    from layout_prop.perf.step import accumulation_steps

    from .pipeline import build

    c = blocks.pipeline
    if global_batch is not None or micro_batch is not None:
        from layout_prop.passes.pipeline import stage_mesh

        acc = accumulation_steps(stage_mesh(graph.mesh, c.axis), global_batch, micro_batch)
        if acc != c.micro_batches:
            raise SpecError("bad-value", f"--global-batch {global_batch} / (--micro-batch {micro_batch} x dp) is "
                            f"{acc} micro-batches, the spec's pipeline block has micro_batches {c.micro_batches}",
                            path="pipeline.micro_batches", hint="drop --global-batch and --micro-batch (the block's "
                            "micro-batches are the step's), or make them agree")
    built = build(graph, cluster_arg, blocks.zero, (blocks.recompute, blocks.layers), localize=False)
    pprog, g = built.program, built.micro
    zero = blocks.zero
    stage = blocks.zero_stage
    p, m, v = c.stages, c.micro_batches, c.virtual_stages
    shape = tuple(pprog.program.mesh.shape)
    flops: dict[str, float] = {}  # one micro-batch's, on rank 0 of the stage mesh, every chunk's
    seconds = _node_seconds(g, cluster, flops)
    nodes = {n.name: n for n in g.nodes}
    params = {n.name for n in g.inputs() if n.attrs.get("requires_grad") and n.name not in built.batch_inputs}

    def is_sync(source: str) -> bool:
        node = nodes.get(source)
        return node is not None and (node.meta.get(meta.GRAD_OF) in params or source.startswith("grad/zero/gather/"))

    forward, backward = [0.0] * c.chunks, [0.0] * c.chunks
    # what hides the gradient synchronisation, as estimate_step counts it: the kernels alone, the backward's
    # without the recomputation (ZeRO 0-2), the forward's, backward's and recomputation's (ZeRO 3)
    hide = {"F": [0.0] * c.chunks, "B": [0.0] * c.chunks, "R": [0.0] * c.chunks}
    sync, gathers = [0.0] * p, [0.0] * p
    regathers = [0.0] * p  # of the gathers, ZeRO-3's for the backward
    last_sync: list[float | None] = [None] * p  # the sync op run last on a stage: its lowest chunk's backward
    first_gather: list[float | None] = [None] * p
    chunk_of: dict[str, int] = {}
    for (chunk, phase), ops in sorted(pprog.tasks.items(), key=lambda kv: (kv[0][0], kv[0][1] == "B")):
        s = chunk % p
        for op in ops:
            if phase == "F":
                chunk_of[op.source] = chunk
            if op.kind == "kernel" and op.source in nodes:
                t = seconds(nodes[op.source])
                (forward if phase == "F" else backward)[chunk] += t
                recomputed = nodes[op.source].meta.get(meta.INSERTED_BY) == "recompute"
                hide["R" if recomputed else phase][chunk] += t
            elif op.kind == "collective":
                t = collective_time(op.step.kind, op.step.bytes_per_rank, shape, op.step.mesh_axis, cluster)
                if is_sync(op.source):
                    sync[s] += t
                    if chunk == s:
                        last_sync[s] = t
                elif stage == 3 and op.source.startswith(("zero/gather/", "zero/regather/")):
                    gathers[s] += t
                    regathers[s] += t if op.source.startswith("zero/regather/") else 0.0
                    if first_gather[s] is None and phase == "F" and chunk == s:
                        first_gather[s] = t
                else:
                    (forward if phase == "F" else backward)[chunk] += t
    # a task waits for the moves from the stage of the task it follows (F: chunk - 1's, B: chunk + 1's), sent one
    # after another on the link; a move from another stage (a tied embedding's gradient) was sent earlier.  A move
    # once a step (the tied gradient's sum over the micro-batches) delays the last micro-batch's task alone
    moves, step_moves, t_move = [], [], {}
    received = [(key, mv, False) for key, mvs in sorted(pprog.moves.items()) for mv in mvs]
    received += [(key, mv, True) for key, mvs in sorted(pprog.step_moves.items()) for mv in mvs]
    for (chunk, phase), mv, once in received:
        before = (chunk - 1 if phase == "F" else chunk + 1) % p
        # the largest piece a rank sends, rank 0's (the permute step's bytes_per_rank, without building the step for
        # every rank of the mesh: 3 s a move on a 16,384-rank mesh)
        sent = pprog.program.specs[mv.value].local_nbytes(0)
        t = collective_time("permute", sent, pprog.mesh.shape, pprog.axis, cluster)
        (step_moves if once else moves).append(t)
        key = (chunk, phase, m - 1) if once else (chunk, phase)
        if mv.src_stage == before:
            t_move[key] = t_move.get(key, 0.0) + t
    timeline = simulate(pprog.orders, p, v, forward, backward, t_move=t_move)
    # memory: the model states by the stage's share of the parameters, the activations its order holds
    from layout_prop.passes.zero import ZeroConfig

    # (the ZeRO paper's convention with or without ZeRO, as plan --search counts: 16-bit models keep an fp32 copy)
    report = Memory(optimizer="adam", zero=zero if zero is not None else ZeroConfig(0, ())).run(g).max
    states_all = report.parameters + report.gradients + report.optimizer_states
    # (the memory pass counts every input with a gradient, a float batch input too: so do the shares)
    param_bytes = {n.name: value_spec(g, n.name).local_nbytes(0) for n in g.inputs() if n.attrs.get("requires_grad")}
    total_params = sum(param_bytes.values()) or 1
    held = [0] * c.chunks
    for value, (_, nbytes) in held_values(g).items():
        producer = g.producer(value)[0].name
        held[chunk_of.get(producer, 0)] += nbytes
    shards = {}
    if stage in (1, 2):
        from layout_prop.passes.zero import shard_layouts

        shards = shard_layouts(g, zero)
    stages = []
    for s in range(p):
        mine = [name for name in pprog.stage_inputs.get(s, ()) if name in params]
        counted = [name for name in pprog.stage_inputs.get(s, ()) if name in param_bytes]
        own = [ch for ch in range(s, c.chunks, p)]
        fwd, bwd = sum(forward[ch] for ch in own), sum(backward[ch] for ch in own)
        hide_f, hide_b, hide_r = (sum(hide[k][ch] for ch in own) for k in "FBR")
        last = last_sync[s] or 0.0
        if stage <= 1:
            exposed = max(sync[s] - hide_b, last) if overlap else sync[s]
            total = sync[s]
        elif stage == 2:
            exposed = m * (max(sync[s] - hide_b, last) if overlap else sync[s])
            total = m * sync[s]
        else:
            per_mb = sync[s] + gathers[s]
            exposed = m * (zero3_exposed(gathers[s] - regathers[s], regathers[s] + sync[s], hide_f, hide_b + hide_r,
                                         first_gather[s] or 0.0, last) if overlap else per_mb)
            total = m * per_mb
        after, optimizer, grads = 0.0, 0.0, 0
        for name in mine:
            spec = value_spec(g, name)
            if name in shards:
                shard = TensorSpec(spec.shape, spec.dtype, shards[name])
                optimizer += optimizer_time(shard.local_nbytes(0), spec.itemsize, cluster)
                grads += shard.local_nbytes(0) if stage == 2 else param_bytes[name]
                for step in plan_redistribution(shard, spec.layout).steps:
                    after += collective_time(step.kind, step.bytes_per_rank, shape, step.mesh_axis, cluster)
            else:
                optimizer += optimizer_time(param_bytes[name], spec.itemsize, cluster)
                grads += param_bytes[name]
        # the micro-batches' weight gradients summed (m - 1 adds; ZeRO 2 and 3: of the reduce-scattered shard)
        accumulate = accumulation_time(grads, m, cluster)
        share = sum(param_bytes[name] for name in counted) / total_params
        live = peak = 0
        for task in pprog.orders[s]:
            live += held[task.chunk] if task.phase == "F" else -held[task.chunk]
            peak = max(peak, live)
        stages.append({"stage": s, "chunks": own, "forward_s": fwd, "backward_s": bwd, "parameters": len(mine),
                       "grad_sync_s": total + after, "grad_sync_exposed_s": exposed + after, "optimizer_s": optimizer,
                       "accumulate_s": accumulate,
                       "model_states_bytes": int(round(states_all * share)), "held_bytes_per_micro_batch":
                       [held[ch] for ch in own], "activation_bytes": peak,
                       "memory_bytes": int(round(states_all * share)) + peak})
    slowest = max(stages, key=lambda st: st["grad_sync_exposed_s"] + st["optimizer_s"])
    busiest = max(stages, key=lambda st: st["memory_bytes"])
    accumulate = max(st["accumulate_s"] for st in stages)  # every stage sums its own: the step waits for the longest
    step = timeline.makespan + accumulate + slowest["grad_sync_exposed_s"] + slowest["optimizer_s"]
    # FLOPs of the step: each stage-mesh rank's piece of every chunk, m micro-batches, on every stage-mesh rank
    step_flops = flops.get("total", 0.0) * m * pprog.program.mesh.size
    tflops = step_flops / step / graph.mesh.size / 1e12 if step > 0 else 0.0
    matrix = {k: v for k, v in flops.items() if k != "total"}
    peak = cluster.peak_flops(max(matrix, key=matrix.get) if matrix else "float32")
    notes = list(blocks.notes)
    notes.append("the gradient synchronisation is placed as estimate without a pipeline and plan --search place it "
                 "(ZeRO 0 and 1: once a step, after the last micro-batch's backward), though the pipelined program "
                 "that run and pipeline --run execute reduces each micro-batch's gradients; the memory leaves out the "
                 "working memory of the op running")
    if busiest["memory_bytes"] > cluster.hbm_bytes:
        notes.append(f"memory per rank {busiest['memory_bytes']:,} bytes exceeds the device's {cluster.hbm_bytes:,}")
    return {"cluster": cluster.name, "devices": graph.mesh.size, "config": blocks.to_dict(),
            "stage_mesh": str(pprog.program.mesh), "step_time_s": step, "flops_per_step": step_flops,
            "tflops_per_device": tflops, "mfu": tflops * 1e12 / peak if peak else 0.0, "pipeline_s": timeline.makespan,
            "ideal_s": timeline.ideal, "bubble": timeline.bubble,
            "bubble_fraction": bubble_fraction(c.schedule, p, m, v), "moves": len(moves),
            "move_s": sum(moves), "step_moves": len(step_moves), "step_move_s": sum(step_moves),
            "task_move_s": {f"{key[1]}{key[0]}" + (f".mb{key[2]}" if len(key) == 3 else ""): t
                            for key, t in sorted(t_move.items(), key=lambda kv: (kv[0][:2], len(kv[0])))},
            "chunk_forward_s": forward, "chunk_backward_s": backward,
            "grad_sync_exposed_s": slowest["grad_sync_exposed_s"], "optimizer_s": slowest["optimizer_s"],
            "accumulate_s": accumulate,
            "slowest_stage": slowest["stage"], "memory_per_rank_bytes": busiest["memory_bytes"],
            "busiest_stage": busiest["stage"], "hbm_bytes": cluster.hbm_bytes, "stages": stages, "notes": notes,
            "model_error": CALIBRATION.to_dict()}
