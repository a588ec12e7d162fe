"""The work of ``layout-prop check``: a spec's graph analysed (:func:`layout_prop.api.analyze`) as its
``zero:``, ``recompute:`` and ``pipeline:`` blocks ask (:func:`check_graph`).

Without blocks, the analysis.  With ``zero:`` or ``recompute:``, the forward with ZeRO-3's gathers and, with
``reshard`` and ``backward``, the analysed graph with the recomputation and ZeRO's finish, checked again.
With ``pipeline:``, one micro-batch on the stage mesh and (``reshard`` and ``backward``) its cut into chunks,
the moves and the pipeline verifier.  What was checked is the analysis's ``config`` (its report's
``"config"``; a ``note: config: ...`` line).
"""

from __future__ import annotations

__all__ = ["check_graph"]


def check_graph(graph, *, reshard: bool = False, backward: bool = False, backend: str = "numpy",
                optimizer: str | None = None):
    """``graph`` (a spec read: :func:`.model_input.load_graph`) analysed as ``layout-prop check`` analyses it:
    an :class:`~layout_prop.api.Analysis` whose report counts ``optimizer``'s states (and, with a ZeRO stage,
    the ZeRO paper's figures) and holds the blocks' ``config`` (None without blocks).  A bad block is its
    one-line typed error."""
    from layout_prop.api import analyze

    from .blocks import read_blocks

    blocks = read_blocks(graph)
    config = None
    if blocks.pipeline is not None:
        analysis, config = _check_pipelined(graph, blocks, reshard, backward, backend)
    elif blocks.any:
        analysis, config = _check_configured(graph, blocks, reshard, backward, backend)
    else:
        analysis = analyze(graph, reshard=reshard, backward=backward, backend=backend)
    analysis.optimizer = optimizer
    if config is not None:
        analysis.notes.append(f"config: {config['note']}")
        analysis.config = config
        if blocks.zero is not None and blocks.zero.stage:  # the memory figure with the ZeRO paper's convention
            analysis.zero = blocks.zero
    return analysis


def _counts(graph) -> dict[str, int]:
    """What the blocks' passes put in a graph: ZeRO's gathers and re-gathers, the gradients brought to their
    ZeRO shard, the recomputation copies."""
    from layout_prop.core import meta

    out = {"zero_gathers": 0, "zero_regathers": 0, "zero_sharded_gradients": 0, "recompute_copies": 0}
    for node in graph.nodes:
        if node.name.startswith("zero/gather/"):
            out["zero_gathers"] += 1
        elif node.name.startswith("zero/regather/"):
            out["zero_regathers"] += 1
        elif node.name.startswith("recompute/"):
            out["recompute_copies"] += 1
    params = {n.name: n for n in graph.inputs() if n.attrs.get("requires_grad")}
    for node in graph.nodes:
        primal = node.meta.get(meta.GRAD_OF)
        if primal in params and node.op == "redistribute" and graph.producer(node.inputs[0])[0].op != "input":
            spec = (node.meta.get(meta.SPECS) or (None,))[0]
            param = (params[primal].meta.get(meta.SPECS) or (None,))[0]
            if spec is not None and param is not None and spec.layout != param.layout:
                out["zero_sharded_gradients"] += 1
    return out


def _applied(blocks, counts: dict[str, int], backward: bool = True) -> str:
    """What of the zero:/recompute: blocks the checked graph holds (``backward``: the backward passes ran)."""
    parts = []
    if blocks.zero is not None and blocks.zero.stage == 3:
        parts.append(f"ZeRO stage 3 over {', '.join(blocks.zero.axes)} ({counts['zero_gathers']} gathers"
                     + (f", {counts['zero_regathers']} re-gathers for the backward)" if backward else ")"))
    elif blocks.zero is not None and blocks.zero.stage and backward:
        parts.append(f"ZeRO stage {blocks.zero.stage} over {', '.join(blocks.zero.axes)} "
                     f"({counts['zero_sharded_gradients']} gradients reduce-scattered to their shard)")
    if blocks.recompute != "none" and backward:
        parts.append(f"recompute {blocks.recompute} ({counts['recompute_copies']} copies)")
    return ", ".join(parts)


def _missing(blocks, reshard: bool, backward: bool, ok: bool) -> str:
    """What of the zero:/recompute: blocks was not applied, and why ("" when everything was)."""
    if not (reshard and backward):
        what = []
        if blocks.zero is not None and blocks.zero.stage:
            what.append(f"ZeRO stage {blocks.zero.stage}'s " + ("re-gathers" if blocks.zero.stage == 3 else
                                                               "gradient reduce-scatters"))
        if blocks.recompute != "none":
            what.append("the recomputation")
        return f"{' and '.join(what)} act on the backward: not checked without --reshard --backward" if what else ""
    if not ok:
        return "the backward passes of the blocks (recompute, ZeRO's finish) are not applied to a graph with violations"
    return ""


def _check_configured(graph, blocks, reshard: bool, backward: bool, backend: str):
    """``zero:`` and ``recompute:`` without a pipeline: the forward with ZeRO-3's gathers, and with
    ``--reshard --backward`` the analysed graph with the recomputation and ZeRO's finish, checked again."""
    from layout_prop.api import Analysis, analyze
    from layout_prop.passes.check import Check
    from layout_prop.passes.verify import Verify

    from .blocks import describe, forward, transform

    analysis = analyze(forward(graph, blocks), reshard=reshard, backward=backward, backend=backend)
    applied_backward = reshard and backward and analysis.ok
    if applied_backward:
        g = transform(analysis.graph, blocks)
        Verify(resolved=True).run(g)  # the transformed graph is well formed (a GraphError is a bug)
        check = Check().run(g)
        if backend != "numpy":
            from layout_prop.passes.kernel_check import KernelCheck

            check.violations.extend(KernelCheck(backend).run(g))
        analysis = Analysis(g, check, analysis.notes)
    counts = _counts(analysis.graph)
    missing = _missing(blocks, reshard, backward, analysis.ok)
    note = f"{describe(blocks)}: checked {_applied(blocks, counts, applied_backward) or 'nothing of it'}"
    if missing:
        note += f"; {missing}"
    note += "; layout-prop run SPEC --backward executes them, estimate SPEC prices them"
    return analysis, {**blocks.to_dict(), **counts, "backward_applied": applied_backward, "note": note}


def _check_pipelined(graph, blocks, reshard: bool, backward: bool, backend: str):
    """A ``pipeline:`` block: one micro-batch on the stage mesh (with the zero:/recompute: blocks) is the graph
    checked; with ``--reshard --backward`` also its cut into chunks, the moves and ``verify_pipeline``."""
    from layout_prop.api import Analysis, analyze
    from layout_prop.core.errors import LayoutError, SpecError
    from layout_prop.passes.check import Check
    from layout_prop.passes.pipeline import forward_chunks, lower_pipeline, micro_batch_graph

    from .blocks import describe, forward, transform
    from .pipeline import op_time_cost

    c = blocks.pipeline
    micro, batch_inputs = micro_batch_graph(graph, c)
    try:
        analysis = analyze(forward(micro, blocks), reshard=reshard, backward=backward, backend=backend)
    except LayoutError as err:  # e.g. a micro-batch too small for its data-parallel shards (as pipeline says it)
        shapes = ", ".join(f"{name} {list(micro.node(name).attrs['shape'])}" for name in batch_inputs)
        raise SpecError("bad-pipeline", f"one micro-batch ({shapes}) on the stage mesh {micro.mesh}: {err.message}",
                        path="pipeline.micro_batches", hint="use fewer micro-batches or a larger batch") from None
    pipeline = {"stage_mesh": str(micro.mesh), "batch_inputs": list(batch_inputs), "lowered": False}
    head = (f"{describe(blocks)}: checked one micro-batch ({', '.join(batch_inputs) or 'no batch input'} cut in "
            f"{c.micro_batches}) on the stage mesh {micro.mesh} (its memory figure: every stage's parameters and one "
            f"micro-batch on one rank; estimate SPEC gives each stage's)")
    if reshard and backward and analysis.ok:
        g = transform(analysis.graph, blocks)
        pprog = lower_pipeline(g, c, graph.mesh, batch_inputs, forward_chunks(g, c, op_time_cost(g)))
        check = Check().run(g)
        analysis = Analysis(g, check, analysis.notes)
        moves = [mv for key in sorted(pprog.moves) for mv in pprog.moves[key]]
        nbytes = sum(pprog.permute(mv).bytes_per_rank for mv in moves)
        pipeline.update(lowered=True, chunks=c.chunks, moves=len(moves), move_bytes_per_micro_batch=nbytes,
                        chunk_first_nodes=[next((op.source for op in pprog.tasks.get((ch, "F"), ())
                                                 if op.kind == "kernel"), None) for ch in range(c.chunks)])
        counts = _counts(g)
        applied = _applied(blocks, counts)
        note = (f"{head}{', with ' + applied if applied else ''}; its cut into {c.chunks} chunks on {c.stages} stages, "
                f"{len(moves)} moves between stages ({nbytes} bytes per rank and micro-batch) and the pipeline "
                f"verifier (no edge back in time, none across stages without a move) pass; the schedule's execution "
                f"is checked by layout-prop run SPEC (or pipeline SPEC --run), its time by estimate SPEC")
    else:
        counts = _counts(analysis.graph)
        applied = _applied(blocks, counts, False)
        head += f", with {applied}" if applied else ""
        why = "without --reshard --backward" if not (reshard and backward) else "with violations"
        note = (f"{head}; the cut into stages, the moves and the pipeline verifier are not checked {why} "
                f"(layout-prop pipeline SPEC shows them)")
        missing = _missing(blocks, reshard, backward, analysis.ok)
        if missing:
            note += f"; {missing}"
    return analysis, {**blocks.to_dict(), **counts, "pipeline_check": pipeline, "note": note}
