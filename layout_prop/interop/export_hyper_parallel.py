"""``layout-prop export --to hyper-parallel``: a Python module building hyper-parallel's ``DeviceMesh`` and ``ShardingPlan``.

The module imports from hyper-parallel's own modules (``hyper_parallel.core.device_mesh``,
``core.placement_types``, ``core.shard.sharding_plan``), defines ``make_mesh(device_type)`` and
``SHARDING_PLAN`` (``plan`` for parameters by the model's own names and dims, ``input_plan`` for
the model's inputs by argument name, ``output_plan`` with the layouts layout-prop predicts for the
outputs), ready for ``shard_module(model, make_mesh(), SHARDING_PLAN)``.  Placements are
``Shard(d)``, ``Replicate()`` and ``Partial(op)`` per mesh axis; a strided shard has no such
placement and is ``not-expressible``.  Constant inputs (rotary tables the exporter folded) are no
parameters of the model and are listed in a comment only.

A plan with a ``pipeline:`` block (1f1b or interleaved, the pipeline axis first in the mesh) is written for
the snapshot's ``PipelineStage`` and ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` on its stage (the mesh
without the pipeline axis): each chunk's parameters and modules, the values each chunk receives, and
``make_mesh`` (the stage mesh, the whole mesh built first), ``chunk_plan``, ``stage_module`` (which writes
around :data:`PIPELINE_DEFECTS`) and ``pipeline_schedule``.

>>> from layout_prop.core.mesh import DeviceMesh
>>> from layout_prop.core.layout import Layout
>>> placements_text(Layout(DeviceMesh((2, 2), ("dp", "tp")), ["S(0)", "P"], 2), "parameter", "w")
'(Shard(0), Partial("sum"))'
>>> placements_text(Layout(DeviceMesh((2, 2), ("dp", "tp")), ["S(1)", "S(1)"], 2), "input", "x")
'layout("None", ("dp", "tp"))'
"""

from __future__ import annotations

import dataclasses

from layout_prop.core.layout import Layout

from .export_plan import (ExportPlan, batch_lines, not_expressible, not_written, own_parameters, placement_args,
                          refuse_config)
from .hyper_parallel import _alias_map

__all__ = ["export_hyper_parallel", "placements_text", "alias_text", "explicit_moves", "WRONG_RULES",
           "PIPELINE_DEFECTS"]

TARGET = "hyper-parallel"


def placements_text(layout: Layout, what: str, name: str) -> str:
    """``layout`` as a tuple of hyper-parallel placements (Python text); where several mesh axes cut one
    dim, a call of the module's ``layout`` (``Layout.from_device_mesh(mesh)``) in the alias form, unpacked.

    hyper-parallel's placement form holds one mesh axis a dim (``placement_to_tensor_map``: "Dimension
    d has been sharded by Mesh axis ..."), and ``shard_module`` calls that on every parameter's layout:
    a parameter cut by several axes on a dim is ``not-expressible``.  Its alias form given as one
    tuple (``("dp", "None")``) is read as a single dim cut by every axis named (``_to_layout`` passes the
    tuple as one argument), so the module calls ``layout(...)`` with the aliases as arguments instead;
    the alias form holds no partial sum.
    """
    if not layout.has_strided and any(len(layout.dim_axes(d)) > 1 for d in range(layout.ndim)):
        if what == "parameter":
            raise not_expressible(TARGET, what, name, layout, "shard_module places a parameter by one mesh axis "
                                  "a dim (Layout.placement_to_tensor_map)", "cut that dim by one mesh axis")
        if layout.has_partial():
            raise not_expressible(TARGET, what, name, layout, "several mesh axes on one dim need the alias form, "
                                  "which has no partial sum", "reduce the partial axis first, or cut the dim by "
                                  "one mesh axis")
        return "layout" + alias_text(layout)
    items = []
    for kind, arg in placement_args(layout):
        if kind == "R":
            items.append("Replicate()")
        elif kind == "S":
            items.append(f"Shard({arg})")
        elif kind == "P":
            items.append(f'Partial("{arg}")')
        else:
            raise not_expressible(TARGET, what, name, layout, "hyper-parallel has no strided shard placement",
                                  "gather that mesh axis (R) or keep the fused weight's blocks unsplit (colwise)")
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def alias_text(layout: Layout) -> str:
    """``layout`` in the alias form: one alias (or a tuple of aliases, outer first) per tensor dim."""
    items = []
    for entry in _alias_map(layout):
        items.append("(" + ", ".join(f'"{a}"' for a in entry) + ")" if isinstance(entry, tuple) else f'"{entry}"')
    return "(" + ", ".join(items) + ")"


#: what ``layout-prop audit`` finds hyper-parallel's rules do with the values layout-prop moves (the snapshot
#: in ../shared/upstream/hyper-parallel, its torch platform): the export writes each such move itself
WRONG_RULES = {
    "partial input": "its rules take a partial-sum operand without reducing it (audit: linear answers S(1) for a "
                     "P(sum) input with a column-cut weight, wrong)",
    "operand move": "its linear and matmul never redistribute their operands (they refuse: Contracting dimensions "
                    "must have same layout)",
    "vocabulary embedding": "its embedding over a table cut on its rows does not mask the ids outside a rank's "
                            "rows (IndexError, or wrong values when they happen to be in range)",
}


def _module(plan: ExportPlan, node: str) -> str | None:
    """The module whose forward is op node ``node`` (its weight ``M.weight`` -> ``M``), or None."""
    weight = plan.weights.get(node)
    if weight is None or "." not in weight:
        return None
    module, _, leaf = weight.rpartition(".")
    return module if leaf == "weight" else None


def explicit_moves(plan: ExportPlan) -> tuple[dict[str, tuple[Layout, str]], list[str]]:
    """``(entries, unwritten)``: the moves layout-prop makes that the export writes for hyper-parallel, as
    ``shard_module`` forward-plan keys (``"M.output"``: a module's partial output reduced; ``"M.input"``: a
    module's operand moved before it) -> (layout, why), and the moves it cannot attach to a module (left to
    hyper-parallel's own rules, said in the file and on stderr)."""
    entries: dict[str, tuple[Layout, str]] = {}
    unwritten: list[str] = []

    def put(key: str, layout: Layout, why: str, value: str) -> None:
        if key in entries and entries[key][0] != layout:
            unwritten.append(f"{value} -> {layout.placement_strs()} (the module {key} has another move)")
        else:
            entries[key] = (layout, why)

    for value, src, dst in plan.moves:
        if src.has_partial():
            module = _module(plan, value)
            if module is not None:
                put(f"{module}.output", dst, "partial input", value)
                continue
        else:
            modules = {_module(plan, c) for c in plan.move_consumers.get(value, ())}
            if modules and None not in modules:
                for module in sorted(modules):
                    put(f"{module}.input", dst, "operand move", value)
                continue
        unwritten.append(f"{value}: {src.placement_strs()} -> {dst.placement_strs()}")
    return entries, unwritten


def _refuse_vocabulary_embedding(plan: ExportPlan) -> None:
    for table in plan.embeddings.values():
        t = plan.parameters.get(table)
        if t is not None and any(kind == "S" and arg == 0 for kind, arg in placement_args(t.layout)):
            raise not_expressible(TARGET, "parameter", table, t.layout, WRONG_RULES["vocabulary embedding"],
                                  "replicate the embedding table's rows (vocab) for hyper-parallel, or cut its "
                                  "columns (hidden)")


def _zero(plan: ExportPlan) -> tuple[ExportPlan, list[str]]:
    """``(plan without its ZeRO, the module's ZeRO lines)``: ZeRO as hyper-parallel's own ``fully_shard`` over the
    whole mesh, when the ZeRO axes are the whole mesh (data parallelism only; with other axes it is refused:
    fully_shard beside shard_module's tensor parallelism is not checked here). Stages 1 and 2 shard without
    resharding after forward; stage 3 reshards after forward, which failed its backward on the snapshot's torch
    platform on CPU (a WARNING line says so)."""
    import dataclasses

    c = plan.config
    if not c.zero_stage:
        return plan, []
    if set(c.zero_axes) != set(plan.mesh.names):
        raise not_written(TARGET, f"the zero: block (ZeRO stage {c.zero_stage} over {', '.join(c.zero_axes)})",
                          f"hyper-parallel's fully_shard beside shard_module on the other mesh axes "
                          f"({', '.join(n for n in plan.mesh.names if n not in c.zero_axes)}) is not checked here",
                          "export --to torch writes ZeRO with tensor parallelism (FSDP2), or use data parallelism only")
    for name, t in plan.parameters.items():
        if t.kind == "parameter" and not t.layout.is_replicated():
            raise not_written(TARGET, f"the zero: block (ZeRO stage {c.zero_stage} over {', '.join(c.zero_axes)})",
                              f"parameter {name!r} is cut on the ZeRO axes by its placements "
                              f"{t.layout.placement_strs()} already", "replicate the parameters: ZeRO shards them")
    lines = ["#: ZeRO as hyper-parallel's fully_shard over the mesh: apply_zero(model, mesh) INSTEAD of shard_module",
             "#: (every parameter is replicated in the plan; the snapshot's fully_shard refuses shard_module's",
             "#: DTensors) with shard_inputs' local pieces; stages 1 and 2 without resharding after forward",
             f"ZERO_STAGE = {c.zero_stage}"]
    if c.zero_stage == 3:
        lines.append("# WARNING: ZeRO-3 is fully_shard(reshard_after_forward=True), whose backward failed on the "
                     "snapshot's torch platform on CPU (RuntimeError: a variable needed for gradient computation "
                     "has been modified by an inplace operation); stage 2 (reshard_after_forward=False) ran equal "
                     "to one process")
    return dataclasses.replace(plan, config=dataclasses.replace(c, zero_stage=0, zero_axes=())), lines


#: what the snapshot's pipeline (``hyper_parallel.core.pipeline_parallel``, its torch platform) does wrong or
#: refuses, found running it on CPU (graph_tests/test_export_pipeline.py): the export writes around each
PIPELINE_DEFECTS = {
    "gpipe": "the snapshot's ScheduleGPipe fails when it is built (AttributeError: 'ScheduleGPipe' object has no "
             "attribute 'stage', in construct_exec_order)",
    "send": "the snapshot's PipelineStage sends a stage's DTensor output with platform.isend, which its torch "
            "DTensor dispatch has no rule for (RuntimeError: Operator isend dose not contain parallel layout infer "
            "func): each chunk sends local tensors and the next chunk makes them DTensors again",
    "sum": "the snapshot's schedule sums the micro-batches' losses' gradients: a mean loss is divided by the "
           "micro-batches in the last chunk",
}


def _producer(value: str) -> tuple[str, int]:
    node, _, index = value.partition(":")
    return node, int(index) if index.isdigit() else 0


def _pipeline(plan: ExportPlan) -> tuple[ExportPlan, dict | None]:
    """``(plan on the stage mesh, the pipeline's pieces)`` for a plan with a ``pipeline:`` block, else
    ``(plan, None)``: each chunk's parameters and modules, and the values each chunk receives (made by an earlier
    chunk, read by it or a later one) with their layouts on the stage mesh."""
    from layout_prop.core.placement import Partial, Replicate

    from .export_mindspore import stage_plan

    c = plan.config
    if c.pipeline_axis is None:
        return plan, None
    block = f"the pipeline: block ({c.pipeline_stages} stages on {c.pipeline_axis}, {c.schedule})"
    if c.schedule == "gpipe":
        raise not_written(TARGET, block, PIPELINE_DEFECTS["gpipe"], "write schedule: 1f1b (or export --to torch)")
    if plan.mesh.names[0] != c.pipeline_axis:
        raise not_written(TARGET, block, "the snapshot's PipelineStage runs stage s on ranks s*n .. s*n+n-1 (the "
                          "pipeline axis first in the mesh)", f"put {c.pipeline_axis} first in the mesh")
    staged = stage_plan(plan)
    chunk_of = plan.chunks
    producers = {node.name: node for node in staged.nodes}
    parameters = {name for name, t in staged.parameters.items() if t.kind == "parameter"}
    param_chunks: dict[str, set[int]] = {}
    reads: dict[str, set[int]] = {}  # op-made value -> the chunks reading it
    for node in staged.nodes:
        if node.name not in chunk_of:
            continue
        chunk = chunk_of[node.name]
        for value in node.inputs:
            if value in parameters:
                param_chunks.setdefault(value, set()).add(chunk)
            elif _producer(value)[0] in producers and _producer(value)[0] in chunk_of:
                reads.setdefault(value, set()).add(chunk)
    for value, readers in staged.move_consumers.items():  # a moved value's readers read its moved copy
        if _producer(value)[0] in producers and _producer(value)[0] in chunk_of:
            reads.setdefault(value, set()).update(chunk_of[r] for r in readers if r in chunk_of)
    for name, chunks in param_chunks.items():
        if len(chunks) > 1:
            t = staged.parameters[name]
            raise not_expressible(TARGET, "parameter", name, t.layout, f"it is read on chunks {sorted(chunks)}: the "
                                  "snapshot shares a parameter between stages by SharedParameterInfo, which this "
                                  "export does not write", "untie it (a copy per chunk), or keep its readers on one "
                                  "stage (the pipeline: block's boundaries)")
    receives: dict[int, list[tuple[str, Layout]]] = {}
    for chunk in range(1, c.pipeline_stages * c.virtual_stages):
        for value, readers in reads.items():
            node, index = _producer(value)
            if chunk_of[node] < chunk <= max(readers):
                layout = producers[node].out_layouts[index]
                # hyper-parallel redistributes to no partial layout: a partial sum crossing stages is reduced first
                layout = Layout(layout.mesh, [Replicate() if isinstance(p, Partial) else p
                                              for p in layout.placements], layout.ndim)
                receives.setdefault(chunk, []).append((value, layout))
    modules: dict[int, set[str]] = {}
    for node in plan.weights:
        module = _module(plan, node)
        if module is not None and node in chunk_of:
            modules.setdefault(chunk_of[node], set()).add(module)
    chunk_params: dict[int, list[str]] = {}
    for name, chunks in param_chunks.items():
        chunk_params.setdefault(next(iter(chunks)), []).append(name)
    return staged, {"receives": receives, "parameters": chunk_params, "modules": modules}


def _pipeline_lines(plan: ExportPlan, pieces: dict) -> list[str]:
    c = plan.config
    chunks = c.pipeline_stages * c.virtual_stages
    aliases = {name: t.aliases for name, t in plan.parameters.items()}
    lines = [f"#: pipeline: the mesh axis {c.pipeline_axis!r} holds {c.pipeline_stages} stages (axis 0: the snapshot's "
             "PipelineStage runs stage s on ranks s*n .. s*n+n-1);",
             f"#: the model is cut into {chunks} chunks, chunk c on stage c % PIPELINE_STAGES, each sharded on its "
             "stage's mesh",
             f"PIPELINE_STAGES = {c.pipeline_stages}", f"CHUNKS = {chunks}", f"MICRO_BATCHES = {c.micro_batches}",
             f"SCHEDULE = {c.schedule!r}  # Schedule1F1B, or ScheduleInterleaved1F1B",
             f"LOSS = {c.pipeline_loss!r}  # the batch loss over the micro-batches",
             f"STAGE_MESH_DIM_NAMES = ({', '.join(repr(n) for n in plan.mesh.names)}{',' if plan.mesh.ndim == 1 else ''})",
             "#: each chunk's parameters (the model's own names): build chunk c as the model without the other "
             "chunks' modules",
             "CHUNK_PARAMETERS = {"]
    for chunk in range(chunks):
        names = [n for name in pieces["parameters"].get(chunk, []) for n in (name, *aliases.get(name, ()))]
        lines.append(f"    {chunk}: {tuple(names)!r},")
    lines.append("}")
    lines.append("#: each chunk's modules named in the plan's input_plan and output_plan")
    lines.append("CHUNK_MODULES = {")
    for chunk in range(chunks):
        lines.append(f"    {chunk}: {tuple(sorted(pieces['modules'].get(chunk, ())))!r},")
    lines.append("}")
    lines.append("#: " + PIPELINE_DEFECTS["send"])
    lines.append("#: " + PIPELINE_DEFECTS["sum"])
    return lines


def _pipeline_functions(pieces: dict) -> list[str]:
    lines = ["", "", "def received(mesh):",
             '    """The values each chunk receives from the chunk before (made by an earlier chunk, read by it or a',
             "    later one), in the spec's order, as (name, placements on the stage mesh): the arguments of a chunk's",
             '    forward after the first chunk, and what the chunk before returns."""',
             "    return {"]
    for chunk, values in sorted(pieces["receives"].items()):
        lines.append(f"        {chunk}: (")
        for value, layout in values:
            text = placements_text(layout, "value", value)
            if text.startswith("layout"):
                raise not_expressible(TARGET, "value", value, layout, "it crosses pipeline stages, whose received "
                                      "tensors take placements (one mesh axis a dim)", "cut that dim by one mesh axis")
            lines.append(f"            ({value!r}, {text}),")
        lines.append("        ),")
    lines += [
        "    }",
        "",
        "",
        "def stage_of_rank(rank, world_size):",
        '    """The pipeline stage rank ``rank`` runs (stage s: ranks s*n .. s*n+n-1)."""',
        "    return rank // (world_size // PIPELINE_STAGES)",
        "",
        "",
        'def make_stage_mesh(device_type="npu"):',
        '    """This rank\'s stage mesh (the mesh without the pipeline axis, on its stage\'s ranks). The whole mesh is',
        "    built first on every rank: its process groups are made by every rank in one order (a stage mesh built",
        '    on its own ranks alone makes groups other stages do not, and the ranks wait on each other for ever)."""',
        "    import torch.distributed as dist",
        "",
        "    DeviceMesh(device_type, RANKS, mesh_dim_names=MESH_DIM_NAMES)",
        "    stage = stage_of_rank(dist.get_rank(), dist.get_world_size())",
        "    return DeviceMesh(device_type, RANKS[stage], mesh_dim_names=STAGE_MESH_DIM_NAMES)",
        "",
        "",
        "def local_chunks(rank, world_size):",
        '    """The chunks rank ``rank`` runs (chunk c on stage c % PIPELINE_STAGES)."""',
        "    return [c for c in range(CHUNKS) if c % PIPELINE_STAGES == stage_of_rank(rank, world_size)]",
        "",
        "",
        "def chunk_plan(mesh, chunk):",
        '    """sharding_plan(mesh) for chunk ``chunk``\'s module only (shard_module refuses names it does not hold)."""',
        "    full = sharding_plan(mesh)",
        "    keep = lambda key: key.rpartition('.')[0] in CHUNK_MODULES[chunk]  # noqa: E731",
        "    return ShardingPlan(",
        "        plan={k: v for k, v in full.plan.items() if k in CHUNK_PARAMETERS[chunk]},",
        "        input_plan={k: v for k, v in (full.input_plan or {}).items() if k == 'input' and chunk == 0 or keep(k)},",
        "        output_plan={k: v for k, v in (full.output_plan or {}).items() if keep(k)},",
        "    )",
        "",
        "",
        "def stage_module(module, mesh, chunk):",
        '    """Chunk ``chunk``\'s module (sharded with chunk_plan) as a pipeline stage runs it: the tensors it receives',
        "    made DTensors with their planned placements, its outputs sent as local tensors in the placements the next",
        '    chunk receives (see the defects above), and the last chunk\'s loss divided by MICRO_BATCHES for a mean."""',
        "    import torch",
        "",
        "    from hyper_parallel.core.dtensor import DTensor, distribute_tensor",
        "",
        "    into, out_of = received(mesh).get(chunk, ()), received(mesh).get(chunk + 1, ())",
        '    planned = (sharding_plan(mesh).input_plan or {}).get("input", {})',
        "",
        "    class Stage(torch.nn.Module):",
        "        def __init__(self):",
        "            super().__init__()",
        "            self.module = module",
        "",
        "        def forward(self, *args, **kwargs):",
        "            # the model's inputs, by name, one micro-batch of the whole batch each: placed here as planned",
        "            kwargs = {k: distribute_tensor(v, mesh, planned[k]) if k in planned and not isinstance(v, DTensor)",
        "                      else v for k, v in kwargs.items()}",
        "            if chunk:",
        "                args = tuple(a if isinstance(a, DTensor) else DTensor.from_local(a, mesh, placements)",
        "                             for a, (_, placements) in zip(args, into))",
        "            out = self.module(*args, **kwargs)",
        "            if chunk == CHUNKS - 1:  # the loss: reduced first (the snapshot divides no partial sum)",
        "                if isinstance(out, DTensor):",
        "                    out = out.redistribute(mesh, tuple(Replicate() for _ in range(mesh.ndim)))",
        "                return out / MICRO_BATCHES if LOSS == 'mean' else out",
        "            outs = out if isinstance(out, tuple) else (out,)",
        "            return tuple(o.redistribute(mesh, placements).to_local() for o, (_, placements) in zip(outs, out_of))",
        "",
        "    return Stage()",
        "",
        "",
        'def pipeline_schedule(modules, mesh, device="cpu"):',
        '    """The schedule running this rank\'s chunks: ``modules`` maps each of local_chunks() to its module,',
        "    sharded with shard_module(module, mesh, chunk_plan(mesh, chunk)). Then schedule.run(**inputs) on each",
        "    rank with the model inputs its chunks read (the first chunk's, the last's labels), the whole batch as",
        "    plain tensors: stage_module places each micro-batch (the snapshot's micro-batching of a DTensor cuts each",
        '    rank\'s local rows, so the micro-batches of a batch cut on the stage mesh would interleave)."""',
        "    from hyper_parallel.core.pipeline_parallel import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B",
        "",
        "    stages = [PipelineStage(stage_module(m, mesh, c), c, CHUNKS, device=device) for c, m in sorted(modules.items())]",
        "    if SCHEDULE == 'interleaved':",
        "        return ScheduleInterleaved1F1B(stages, MICRO_BATCHES)",
        "    return Schedule1F1B(stages[0], MICRO_BATCHES)",
    ]
    return lines


def _ranks(shape: tuple[int, ...]) -> str:
    import numpy as np

    return repr(np.arange(int(np.prod(shape))).reshape(shape).tolist())


def export_hyper_parallel(plan: ExportPlan) -> str:
    """The Python module text for ``plan`` (see the module docstring)."""
    plan, zero_lines = _zero(plan)
    refuse_config(dataclasses.replace(plan, config=dataclasses.replace(
        plan.config, pipeline_axis=None)) if plan.config.pipeline_axis is not None else plan, TARGET)
    whole = plan
    plan, pieces = _pipeline(plan)
    own_parameters(plan, TARGET)  # a tied copy's refusal first: it names the model's own mistake
    _refuse_vocabulary_embedding(plan)
    moves, unwritten = explicit_moves(plan)
    mesh = whole.mesh if pieces is not None else plan.mesh  # RANKS: the whole mesh (a stage's ranks: RANKS[s])
    comma = "," if mesh.ndim == 1 else ""
    lines = [
        f'"""hyper-parallel sharding plan written by layout-prop export from {plan.source or "a graph"}.',
        "",
        "Every layout was checked by layout-prop (check --reshard). Parameters are keyed by the model's own",
        "names and laid out in its own dims.",
        "Use: mesh = make_mesh(); model = shard_module(model, mesh, sharding_plan(mesh));",
        "out = model(**shard_inputs(mesh, **inputs))",
        '"""',
        "from hyper_parallel.core.device_mesh import DeviceMesh",
        "from hyper_parallel.core.layout import Layout",
        "from hyper_parallel.core.placement_types import Partial, Replicate, Shard  # noqa: F401",
        "from hyper_parallel.core.shard.sharding_plan import ShardingPlan",
        "",
        f"MESH_SHAPE = ({', '.join(map(str, mesh.shape))}{comma})",
        f"MESH_DIM_NAMES = ({', '.join(repr(n) for n in mesh.names)}{comma})",
        f"RANKS = {_ranks(tuple(mesh.shape))}",
        *([f"#: left out of the mesh (size 1: they cut nothing): {', '.join(plan.dropped_axes)}"]
          if plan.dropped_axes else []),
        *(batch_lines(plan) if plan.config.global_batch is not None else []),
        *zero_lines,
        *([] if pieces is None else _pipeline_lines(plan, pieces)),
        "",
        "",
        'def make_mesh(device_type="npu"):',
        '    """The device mesh layout-prop checked the plan on."""' if pieces is None else
        '    """This rank\'s stage mesh: the mesh the plan\'s layouts are on (each stage\'s chunks)."""',
        "    return DeviceMesh(device_type, RANKS, mesh_dim_names=MESH_DIM_NAMES)" if pieces is None else
        "    return make_stage_mesh(device_type)",
        "",
        "",
        "def sharding_plan(mesh):",
        '    """The ShardingPlan for shard_module on ``mesh`` (make_mesh()\'s)."""',
        "    layout = Layout.from_device_mesh(mesh)  # noqa: F841 (the alias form, where several axes cut a dim)",
        "    return ShardingPlan(",
        "        plan={",
    ]
    constants = [name for name, t in plan.parameters.items() if t.kind == "constant"]
    for name, t in own_parameters(plan, TARGET):
        lines.append(f"            {name!r}: {placements_text(t.own_layout(), 'parameter', name)},")
    lines.append("        },")
    def written(suffix: str) -> list[str]:
        out, said = [], None
        for key, (layout, why) in moves.items():
            if key.endswith(suffix):
                if why != said:  # each kind's reason once, above its entries
                    out.append(f"            # written here, as hyper-parallel would not: {WRONG_RULES[why]}")
                    said = why
                out.append(f"            {key!r}: [{placements_text(layout, 'value', key)}],")
        return out

    inputs_written = written(".input")
    if plan.inputs or inputs_written:
        lines.append("        input_plan={")
        if plan.inputs:
            lines.append('            "input": {')
            for name, t in plan.inputs.items():
                lines.append(f"                {name!r}: {placements_text(t.layout, 'input', name)},")
            lines.append("            },")
        lines += inputs_written
        lines.append("        },")
    partial = [name for name, layout in plan.outputs.items() if layout.has_partial()]
    outputs_written = written(".output")
    if (plan.outputs and not partial) or outputs_written:
        lines.append("        output_plan={")
        if plan.outputs and not partial:
            lines.append('            "output": [  # as layout-prop predicts them')
            for name, layout in plan.outputs.items():
                lines.append(f"                {placements_text(layout, 'output', name)},  # {name}")
            lines.append("            ],")
        lines += outputs_written
        lines.append("        },")
    lines.append("    )")
    if unwritten:
        lines.append("# WARNING: moves layout-prop makes that this plan does not write (no module to attach them to): "
                     "hyper-parallel's own rules decide them, unchecked: " + "; ".join(unwritten))
    if partial:  # hyper-parallel's redistribute refuses a partial target ("to_layout must be non-partial")
        lines.append("# no output_plan: layout-prop predicts partial sums, which hyper-parallel redistributes to no "
                     "layout: " + "; ".join(f"{n}: {plan.outputs[n].placement_strs()}" for n in partial))
    if constants:
        lines.append(f"# constants (no parameters of the model, not in the plan): {', '.join(constants)}")
    buffers = [(name, t) for name, t in plan.parameters.items() if t.kind == "buffer"]
    if buffers:
        lines += ["", "", "#: tensors without gradient (rotary tables, masks): the model's buffers, placed so",
                  "def buffer_plan(mesh):", "    layout = Layout.from_device_mesh(mesh)  # noqa: F841", "    return {"]
        lines += [f"        {name!r}: {placements_text(t.layout, 'buffer', name)}," for name, t in buffers]
        lines.append("    }")
    lines += [
        "",
        "",
        *([] if not zero_lines else [
            "def apply_zero(model, mesh):",
            '    """ZeRO: hyper-parallel\'s fully_shard over the mesh (in place of shard_module: see ZERO_STAGE)."""',
            "    from hyper_parallel.core.fully_shard.api import fully_shard",
            "",
            "    fully_shard(model, mesh=mesh, reshard_after_forward=ZERO_STAGE == 3)",
            "    return model",
            "",
            ""]),
        "def shard_inputs(mesh, **inputs):",
        '    """Each input as a DTensor with its planned placements (input_plan redistributes DTensor arguments only)."""',
        "    from hyper_parallel.core.dtensor import distribute_tensor",
        "",
        '    planned = (sharding_plan(mesh).input_plan or {}).get("input", {})',
        '    placed = {name: distribute_tensor(value, mesh, planned[name]) for name, value in inputs.items()}',
        *(['    return {name: value.to_local() for name, value in placed.items()}  # fully_shard takes local batches']
          if zero_lines else ['    return placed']),
        *([] if pieces is None else _pipeline_functions(pieces)),
    ]
    return "\n".join(lines) + "\n"
