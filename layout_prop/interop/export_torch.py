"""``layout-prop export --to torch``: a ``parallelize_module`` plan, and explicit ``distribute_tensor`` placements.

When every parameter is sharded on one mesh axis only (the tensor-parallel axis, ``TP_AXIS``;
replicated on the others), no input is cut on that axis, layout-prop moves no value on that axis but
to reduce a partial sum (a style leaves a module's output a plain local tensor: a gather before a
softmax over a colwise output would not be run), and every sharded parameter's module is one
of torch's styles, the plan is ``parallelize_module``'s on that axis (``mesh[TP_AXIS]``), by module
name (the parameter's name without ``.weight``): a weight held as torch's ``Linear`` weight ``(out,
in)`` (read by ``linear``, by a ``matmul`` that transposes it, or stored transposed by the ONNX
exporter) cut on its output features (``Shard(0)``, bias ``Shard(0)`` or none) is
``ColwiseParallel()``, cut on the contracted features (``Shard(1)``, bias replicated or none)
``RowwiseParallel()``; a spec's ``matmul`` weight ``(in, out)`` is no ``Linear`` weight and is
placed explicitly; an embedding
table cut on its rows ``RowwiseParallel(input_layouts=Replicate())``, on its columns
``ColwiseParallel()``.  These are torch's Megatron-style styles: a colwise module's output stays a
local shard of the last dim (as layout-prop predicts it, ``S(-1)``) for the next rowwise module.
``shard_inputs`` then gives each rank its local piece of each input (data parallelism on the
other axes).  Otherwise every parameter, replicated ones included, becomes a ``DTensor`` with its
placements (``distribute_tensor`` in ``parallelize``) and the inputs ``DTensor`` too, so that the
model runs on DTensors throughout.

The training configuration is written, never dropped (:func:`config_lines`): ZeRO stage 3 is FSDP2's
``fully_shard`` over the ZeRO axes (``reshard_after_forward=True``), stages 1 and 2 ``fully_shard``
with ``reshard_after_forward=False`` (torch's ZeRO-2: it shards gradients too, and has no ZeRO-1 for
DTensor parameters: stage 1 is written so, and said so); with ZeRO the parameters are DTensors on the
mesh without the ZeRO axes (``MODEL_AXES``), as FSDP2 + tensor parallelism wants them. ``recompute:
full`` is torch's activation checkpointing of each layer (``checkpoint_layers`` for modules,
``recompute`` for a function); the step's batch is written as constants. Selective recomputation is
refused (``not-expressible``, one line naming the block).

A pipeline (the spec's ``pipeline:`` block) is ``torch.distributed.pipelining`` (:func:`pipeline_lines`):
the chunks layout-prop cut the model into (``CHUNKS``: each chunk's stage, decoder layers, parameters and
buffers, the values it receives and sends with their placements), a ``PipelineStage`` for each chunk module
of this rank on the pipeline axis's process group, its parameters DTensors on the mesh without the pipeline
axis (``MODEL_AXES``), and the spec's schedule (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B`` for virtual stages) over its micro-batches. The chunk modules are the user's
(a plan of layouts cannot cut a model's code): ``pipeline`` wraps each so that a stage sends and receives
plain tensors, each the local piece of the placements layout-prop checked for that value (partial sums
included), and the loss's target is placed as the plan places it. What torch's pipelining cannot run is
refused in one line: a value passed past the next chunk, a model input read past the first chunk (but the
loss's target), a parameter read by two chunks (tied), fewer micro-batches than stages for 1F1B. ZeRO
beside a pipeline is ``fully_shard`` of each stage's module over ``ZERO_AXES``.

Where torch's own propagation fails on the plan, the export writes the move itself (``SETTLE``,
``settle``): an embedding whose table is cut on its rows leaves torch's ``MaskPartial``, whose
reduce-scatter into a sequence-parallel layout fails an assertion in ``Partial._reduce_shard_value``;
it is all-reduced to ``Replicate`` first, then cut. Size-1 mesh axes are left out of the mesh
(:func:`~layout_prop.interop.export_plan.drop_unit_axes`): torch's redistribution planner stalls on
them. Inputs without gradient (rotary tables, masks) are buffers (``BUFFER_PLACEMENTS``).

Placements are in the module's own dims (a Linear weight the ONNX exporter stored transposed is
``(out, in)`` again).  torch's ``distribute_tensor`` takes no partial placement: a parameter or input
with one is ``not-expressible``.  A strided shard ``_S(d,k)`` (a fused q,k,v or gate,up weight cut on tp:
each rank holds its chunk of each of the ``k`` blocks) is torch's ``_StridedShard(d, split_factor=k)``,
which means the same, is accepted by ``distribute_tensor`` and redistributed by DTensor; it is private
to torch (an underscore name), so the export imports it from ``placement_types`` and says so.

>>> from layout_prop.core.mesh import DeviceMesh
>>> from layout_prop.core.layout import Layout
>>> placements_text(Layout(DeviceMesh((2, 2), ("dp", "tp")), ["R", "S(1)"], 2), "parameter", "w")
'(Replicate(), Shard(1))'
"""

from __future__ import annotations

from layout_prop.core.layout import Layout

from .export_plan import (INTEGER_DTYPES, ExportPlan, ExportTensor, not_expressible, not_written, own_parameters,
                          placement_args)

__all__ = ["export_torch", "placements_text", "module_styles", "config_lines", "settle_moves", "pipeline_lines"]

TARGET = "torch"


def placements_text(layout: Layout, what: str, name: str) -> str:
    """``layout`` as a tuple of torch placements (Python text)."""
    items = []
    for kind, arg in placement_args(layout):
        if kind == "R":
            items.append("Replicate()")
        elif kind == "S":
            items.append(f"Shard({arg})")
        elif kind == "P":
            raise not_expressible(TARGET, what, name, layout, "distribute_tensor takes no partial placement",
                                  "give that tensor R or S(d) (a partial sum is made by an op, never declared)")
        else:  # layout-prop's _S(d,k) is torch's: k blocks of d, each cut on the axis, a rank's chunk of each
            dim, factor = arg
            items.append(f"_StridedShard({dim}, split_factor={factor})")
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _tp_axis(plan: ExportPlan) -> int | None:
    """The one mesh axis every sharded parameter is cut on (replicated on the others), or None."""
    axes = set()
    for t in plan.parameters.values():
        if t.kind != "parameter":
            continue
        for axis, (kind, _) in enumerate(placement_args(t.layout)):
            if kind != "R":
                axes.add(axis)
    if len(axes) != 1:
        return None
    axis = axes.pop()
    for t in plan.inputs.values():
        if placement_args(t.layout)[axis][0] != "R":
            return None
    return axis


def _shard_dim(layout: Layout, axis: int) -> int | None:
    """The dim ``layout`` shards on mesh axis ``axis``, None when replicated there."""
    kind, arg = placement_args(layout)[axis]
    return arg if kind == "S" else None


def _styles_move_as_checked(plan: ExportPlan, axis: int) -> bool:
    """Whether torch's styles make every move layout-prop makes on mesh axis ``axis``: a styled module's
    output is a plain local tensor (a colwise module's stays a local shard of its last dim), so only a
    partial sum reduced there (``RowwiseParallel``'s all-reduce) happens.  A gather, an all-to-all or a
    slice layout-prop inserts on that axis (before a softmax over a colwise output) would not be run, nor
    a partial max reduced (a vocabulary-parallel cross entropy's: the model's loss would see local logits)."""
    for _value, src, dst in plan.moves:
        (src_kind, src_arg), (dst_kind, dst_arg) = placement_args(src)[axis], placement_args(dst)[axis]
        if src_kind != "P" and (src_kind, src_arg) != (dst_kind, dst_arg):
            return False
        if src_kind == "P" and src_arg != "sum":  # a max over a colwise output's columns (a vocabulary-parallel
            return False  # cross entropy): the model's own code would take it over the local columns only
    return True


def _style(weight: ExportTensor, bias: ExportTensor | None, axis: int) -> str | None:
    """The torch style that places this module's weight (and bias) as layout-prop has them, or None."""
    dim = _shard_dim(weight.own_layout(), axis)
    bias_dim = None if bias is None else _shard_dim(bias.layout, axis)
    if "embedding" in weight.consumers and len(weight.shape) == 2 and bias is None:
        return {0: "RowwiseParallel(input_layouts=Replicate())", 1: "ColwiseParallel()"}.get(dim)
    if not weight.linear_weight:  # not held as a Linear weight (out, in): no style places it as checked
        return None
    if dim == 0 and (bias is None or bias_dim == 0):
        return "ColwiseParallel()"
    if dim == 1 and (bias is None or bias.layout.is_replicated()):
        return "RowwiseParallel()"
    return None


def module_styles(plan: ExportPlan) -> tuple[int | None, dict[str, str]]:
    """``(tensor-parallel axis, module name -> style)``; ``(None, {})`` when the parameters are no styles."""
    params = {n: t for n, t in plan.parameters.items() if t.kind == "parameter"}
    axis = _tp_axis(plan)
    if axis is None or not _styles_move_as_checked(plan, axis):
        return None, {}
    styles: dict[str, str] = {}
    covered: set[str] = set()
    for name, t in params.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or not module or t.layout.is_replicated():
            continue
        bias = params.get(module + ".bias")
        style = _style(t, bias, axis)
        if style is None:
            return None, {}
        styles[module] = style
        covered.update({name, module + ".bias"})
    if any(n not in covered and not t.layout.is_replicated() for n, t in params.items()):
        return None, {}
    return axis, styles


def _tuple(items) -> str:
    items = list(items)
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def check_config(plan: ExportPlan) -> None:
    """Refuse what this export does not write: a pipeline torch cannot run (:func:`check_pipeline`), selective
    recomputation, a parameter cut on a ZeRO axis (FSDP2 shards it there itself); one ``not-expressible`` line
    naming the block."""
    c = plan.config
    if c.pipeline_axis is not None:
        check_pipeline(plan)
    if c.recompute not in ("none", "full"):
        raise not_written(TARGET, f"recompute: {c.recompute}", "torch checkpoints whole modules or functions; "
                          "layout-prop's selective recomputation keeps chosen activations inside a layer",
                          "write recompute: full (each layer checkpointed), or leave the block out")
    for name, t in plan.parameters.items():
        for axis in c.zero_axes:
            if t.kind == "parameter" and placement_args(t.layout)[plan.mesh.axis_index(axis)][0] != "R":
                raise not_written(TARGET, f"ZeRO stage {c.zero_stage} over {axis}", f"parameter {name!r} is cut on "
                                  f"{axis} by its placements {t.layout.placement_strs()} already",
                                  f"replicate the parameters on {axis}: the zero: block shards them there")


#: the spec's schedule -> torch.distributed.pipelining's schedule class
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


def _pipeline_refused(plan: ExportPlan, why: str, hint: str):
    c = plan.config
    return not_written(TARGET, f"the pipeline: block ({c.pipeline_stages} stages on {c.pipeline_axis}, {c.schedule}, "
                       f"{c.micro_batches} micro-batches)", why, hint)


def _targets(plan: ExportPlan) -> tuple[list[str], list[str]]:
    """``(the first chunk's model inputs: schedule.step's arguments, the last chunk's other model inputs: the
    loss's targets)``."""
    chunks = plan.chunk_plan
    first = [n for n in chunks[0].reads if n in plan.inputs]
    last = [n for n in chunks[-1].reads if n in plan.inputs and n not in first]
    return first, last


def _cut_into_micro_batches(plan: ExportPlan, name: str) -> bool:
    """Whether the pipeline cuts model input ``name`` into micro-batches: its dim 0 is smaller in one micro-batch
    on the stage (``plan.stage``, where collected), else (the pipeline's default batch inputs) it is integer data."""
    stage = getattr(plan, "stage", None)
    if stage is not None and name in stage.tensors():
        return stage.tensors()[name].shape[:1] != plan.inputs[name].shape[:1]
    return plan.inputs[name].dtype in INTEGER_DTYPES


def check_pipeline(plan: ExportPlan) -> None:
    """Refuse, in one ``not-expressible`` line naming the block, a pipeline torch's pipelining cannot run as
    layout-prop cut it: ZeRO beside it (not written), 1F1B with fewer micro-batches than stages
    (``Schedule1F1B`` refuses it), interleaved micro-batches that are no multiple of its rounds, a value passed
    to a chunk past the next (a stage sends to the next stage only), a model input read past the first chunk
    (the schedule gives them to the first stage) but one target of the last chunk's loss, a model input the
    pipeline does not cut into micro-batches (torch's schedule cuts them all), a parameter read
    by two chunks (a tied weight: each stage would update its own copy), a partial value sent but as a sum."""
    c = plan.config
    chunks = plan.chunk_plan
    if c.schedule not in SCHEDULES:
        raise _pipeline_refused(plan, f"torch.distributed.pipelining has no {c.schedule} schedule",
                                f"use one of {', '.join(SCHEDULES)}")
    if c.schedule == "1f1b" and c.micro_batches < c.pipeline_stages:
        raise _pipeline_refused(plan, f"torch's Schedule1F1B needs at least as many micro-batches as stages",
                                f"use {c.pipeline_stages} micro-batches or more, or schedule: gpipe")
    rounds = max(1, c.micro_batches // c.pipeline_stages)
    if c.schedule == "interleaved" and c.micro_batches % rounds:
        raise _pipeline_refused(plan, f"torch's ScheduleInterleaved1F1B needs the micro-batches a multiple of its "
                                f"{rounds} rounds", f"use {c.pipeline_stages * rounds} micro-batches")
    if len(chunks) != c.pipeline_stages * c.virtual_stages or not all(k.first for k in chunks):
        raise _pipeline_refused(plan, f"layout-prop cut {len(chunks)} chunks, not {c.pipeline_stages} stages x "
                                f"{c.virtual_stages} virtual", "check the spec with layout-prop pipeline SPEC")
    for before, after in zip(chunks, chunks[1:]):
        sent, received = [v for v, _ in before.sends], [v for v, _ in after.receives]
        if sent != received:
            passed = sorted(set(received) - set(sent)) or sorted(set(sent) - set(received))
            raise _pipeline_refused(plan, f"{', '.join(map(repr, passed))} crosses more than one chunk boundary "
                                    f"(into chunk {after.index}), and a stage of torch's pipelining sends to the next "
                                    "stage only", "move the chunk boundaries (pipeline: boundaries or layers) so "
                                    "that each chunk reads only the chunk before it")
        for value, layout in before.sends:
            if any(kind == "P" and arg != "sum" for kind, arg in placement_args(layout)):
                raise _pipeline_refused(plan, f"{value!r} is sent between stages as {layout.placement_strs()}",
                                        "reduce it before the chunk boundary")
    readers: dict[str, list[int]] = {}
    for k in chunks:
        for name in k.reads:
            if name in plan.parameters and plan.parameters[name].kind == "parameter":
                readers.setdefault(name, []).append(k.index)
    shared = {name: ks for name, ks in readers.items() if len(ks) > 1}
    if shared:
        name, ks = next(iter(shared.items()))
        raise _pipeline_refused(plan, f"the parameter {name!r} is read by chunks {', '.join(map(str, ks))} (a tied "
                                "weight), and torch's pipelining keeps a copy a stage without summing their "
                                "gradients", "untie it (gen: without --tie-embeddings), or cut the pipeline so "
                                "that one chunk reads it")
    first, last = _targets(plan)
    whole = [n for n in first + last if c.micro_batches > 1 and not _cut_into_micro_batches(plan, n)]
    if whole:
        raise _pipeline_refused(plan, f"the model input {whole[0]!r} is no batch input of the pipeline (each "
                                "micro-batch reads it whole), and torch's schedule cuts every step argument and "
                                "target into the micro-batches on dim 0", f"name it in pipeline: batch_inputs if "
                                "its dim 0 is the batch, or make it a buffer (requires_grad: false)")
    inner = [n for k in chunks[1:-1] for n in k.reads if n in plan.inputs]
    if inner or len(last) > 1:
        raise _pipeline_refused(plan, f"the model input(s) {', '.join(inner or last)} are read past the first chunk, "
                                "and torch's schedule gives model inputs to the first stage and one target to the "
                                "last stage's loss", "move the chunk boundaries so that the first chunk reads "
                                "the model inputs, the last one at most one more (the loss's target)")


def _value_placements(layout: Layout, name: str) -> str:
    """A value's ``layout`` as torch placements for ``DTensor.from_local``: a partial sum is ``Partial()`` (a
    stage may send one: it is reduced where it is read, as layout-prop checked it)."""
    items = []
    for kind, arg in placement_args(layout):
        if kind == "R":
            items.append("Replicate()")
        elif kind == "S":
            items.append(f"Shard({arg})")
        elif kind == "P":
            items.append("Partial()")  # a sum: check_pipeline refuses the other reductions
        else:
            raise not_expressible(TARGET, "value", name, layout, "a strided value sent between pipeline stages "
                                  "is not written (only parameters' _StridedShard is run and checked)",
                                  "move the chunk boundary to a value cut plainly")
    return _tuple(items)


def _wrapped(key: str, names: list[str], width: int = 112) -> list[str]:
    """``'key': (names...),`` as lines of at most ``width`` characters (a name a line past it)."""
    lines, line = [], f"        {key!r}: ("
    for name in names:
        item = repr(name) + ", "
        if len(line) + len(item) > width and line.strip()[-1] != "(":
            lines.append(line.rstrip())
            line = "            "
        line += item
    return lines + [line.rstrip().rstrip(",") + ("," if len(names) == 1 else "") + "),"]


def pipeline_lines(plan: ExportPlan) -> list[str]:
    """The module's pipeline constants: the axis, the schedule and the chunks (see the module docstring)."""
    c = plan.config
    if c.pipeline_axis is None:
        return ["#: the pipeline's mesh axis (None: no pipeline: block)", "PP_AXIS = None"]
    first, last = _targets(plan)
    params = {n for n, t in plan.parameters.items() if t.kind == "parameter"}
    buffers = {n for n, t in plan.parameters.items() if t.kind == "buffer"}
    lines = ["#: the pipeline (the spec's pipeline: block): chunk c of CHUNKS runs on rank CHUNKS[c]['stage'] of the",
             "#: mesh axis PP_AXIS, in torch.distributed.pipelining's SCHEDULE over MICRO_BATCHES micro-batches a step",
             f"PP_AXIS = {c.pipeline_axis!r}",
             f"PIPELINE_STAGES = {c.pipeline_stages}",
             f"VIRTUAL_STAGES = {c.virtual_stages}",
             f"SCHEDULE = {SCHEDULES[c.schedule]!r}",
             "#: True: the step's loss is the mean of the micro-batches' (the gradients scaled by 1 / MICRO_BATCHES);",
             "#: False: their sum (the spec's pipeline: loss: sum)",
             f"LOSS_MEAN = {c.pipeline_loss == 'mean'}",
             "#: schedule.step's arguments (the first chunk's model inputs) and the loss's target (the last chunk's)",
             f"STAGE_INPUTS = {_tuple(repr(n) for n in first)}",
             f"TARGET = {(last[0] if last else None)!r}",
             "#: each chunk: its stage, decoder layers, parameters and buffers (the model's names), the values it",
             "#: receives from the chunk before and sends to the chunk after, with their placements (a stage sends",
             "#: and receives each as its local piece: partial sums as they are, reduced where they are read)",
             "CHUNKS = ("]
    for k in plan.chunk_plan:
        lines += ["    {", f"        'stage': {k.stage}, 'layers': {k.layers!r}, 'first': {k.first!r}, 'last': {k.last!r},",
                  *_wrapped("parameters", [n for n in k.reads if n in params]),
                  f"        'buffers': {_tuple(repr(n) for n in k.reads if n in buffers)},",
                  "        'receives': {" + ", ".join(f"{v!r}: {_value_placements(a, v)}" for v, a in k.receives) + "},",
                  "        'sends': {" + ", ".join(f"{v!r}: {_value_placements(a, v)}" for v, a in k.sends) + "},",
                  "    },"]
    return lines + [")"]


def _micro_batches(plan: ExportPlan) -> int:
    """Micro-batches a step: the pipeline's, else the gradient accumulation the training: block implies
    (global batch / (micro-batch x the data-parallel ranks))."""
    from layout_prop.passes.zero import DATA_AXES

    c = plan.config
    if c.pipeline_axis is not None or not c.global_batch or not c.micro_batch:
        return c.micro_batches
    dp = 1
    for name, size in zip(plan.mesh.names, plan.mesh.shape):
        dp *= size if name in DATA_AXES else 1
    return max(1, c.global_batch // (c.micro_batch * dp))


def config_lines(plan: ExportPlan) -> list[str]:
    """The module's constants for the training configuration (ZeRO, recomputation, the step's batch)."""
    c = plan.config
    model_axes = [n for n in plan.mesh.names if n not in c.zero_axes and n != c.pipeline_axis]
    lines = ["#: ZeRO: 3 is fully_shard (FSDP2) over ZERO_AXES, resharding after forward; 1 and 2 are fully_shard",
             "#: without resharding after forward (torch's ZeRO-2; torch has no ZeRO-1 for DTensor parameters)"]
    if c.zero_stage == 1:
        lines.append("#: NOTE: the plan asks ZeRO-1 (optimizer states sharded); this writes ZeRO-2 (gradients too)")
    lines += [f"ZERO_STAGE = {c.zero_stage}",
              f"ZERO_AXES = {_tuple(repr(a) for a in c.zero_axes)}",
              "#: the mesh axes of the parameters' DTensor placements (the mesh without ZERO_AXES and the pipeline's)",
              f"MODEL_AXES = {_tuple(repr(a) for a in model_axes)}",
              "#: activation checkpointing: 'full' checkpoints each layer in RECOMPUTE_LAYERS (None: every layer)",
              f"RECOMPUTE = {c.recompute!r}",
              f"RECOMPUTE_LAYERS = {None if c.recompute_layers is None else tuple(c.recompute_layers)!r}",
              "#: the step's batch (the spec's training: block): sequences per optimizer step, per micro-batch on one",
              "#: data-parallel rank, and micro-batches a step (the pipeline's, else gradient accumulation)",
              f"GLOBAL_BATCH = {c.global_batch!r}",
              f"MICRO_BATCH = {c.micro_batch!r}",
              f"MICRO_BATCHES = {_micro_batches(plan)!r}"]
    if plan.dropped_axes:
        lines.insert(0, f"#: left out of the mesh (size 1: they cut nothing): {', '.join(plan.dropped_axes)}")
    return lines


def settle_moves(plan: ExportPlan) -> dict[str, tuple[str, Layout]]:
    """``value -> (table name, layout)``: an embedding's output that layout-prop reduces from a partial sum,
    with the layout it moves to. torch's embedding over a row-cut table leaves a ``MaskPartial``, whose
    reduce-scatter (``Partial._reduce_shard_value``) fails an assertion: the export reduces it itself."""
    out = {}
    for value, src, dst in plan.moves:
        table = plan.embeddings.get(value)
        if table is not None and any(kind == "P" for kind, _ in placement_args(src)):
            out.setdefault(value, (table, dst))
    return out


def export_torch(plan: ExportPlan) -> str:
    """The Python module text for ``plan`` (see the module docstring)."""
    check_config(plan)
    mesh = plan.mesh
    comma = "," if mesh.ndim == 1 else ""
    params = own_parameters(plan, TARGET)
    for name, t in params:
        placements_text(t.layout, "parameter", name)  # refuses what torch cannot place
    axis, styles = module_styles(plan) if plan.config.pipeline_axis is None else (None, {})
    tp_axis = "None" if axis is None else repr(mesh.names[axis])
    settle = {} if axis is not None else settle_moves(plan)
    strided = []  # imported only where used: torch's strided shard is private to DTensor
    if any(t.layout.has_strided for t in plan.tensors().values()):
        strided = ["# a fused weight's strided shard (_S(d,k): a rank's chunk of each of k blocks); private to DTensor",
                   "from torch.distributed.tensor.placement_types import _StridedShard  # noqa: F401"]
    lines = [
        f'"""torch plan written by layout-prop export from {plan.source or "a graph"}.',
        "",
        "Every layout was checked by layout-prop (check --reshard); names and dims are the model's own.",
        "Use: mesh = make_mesh(); model = parallelize(model, mesh); out = model(**shard_inputs(mesh, **inputs))",
        "(and settle(name, x) where SETTLE names a value; checkpoint_layers(...) or recompute(...) for RECOMPUTE;",
        "with PP_AXIS: schedule = pipeline({chunk: module for chunk in stage_chunks(mesh)}, mesh, loss_fn), then",
        "losses = pipeline_step(schedule, mesh, **inputs))",
        '"""',
        "import torch",
        "from torch.distributed.device_mesh import init_device_mesh",
        "from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: F401",
        "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: F401",
        *strided,
        "",
        f"MESH_SHAPE = ({', '.join(map(str, mesh.shape))}{comma})",
        f"MESH_DIM_NAMES = ({', '.join(repr(n) for n in mesh.names)}{comma})",
        *config_lines(plan),
        *pipeline_lines(plan),
        "#: the mesh axis of parallelize_module's styles (None: every parameter is placed as a DTensor)",
        f"TP_AXIS = {tp_axis}",
        "",
        "#: parallelize_module's plan on mesh[TP_AXIS]: module name -> style",
        "PARALLELIZE_PLAN = {",
    ]
    lines += [f"    {module!r}: {style}," for module, style in styles.items()]
    lines += ["}", "#: every parameter's placements as layout-prop checked them, in the model's own dims",
              "PARAMETER_PLACEMENTS = {"]
    for name, t in params:
        lines.append(f"    {name!r}: {placements_text(t.own_layout(), 'parameter', name)},")
    lines += ["}", "#: tensors without gradient the model holds (rotary tables, masks): registered as buffers",
              "BUFFER_PLACEMENTS = {"]
    lines += [f"    {name!r}: {placements_text(t.layout, 'buffer', name)},"
              for name, t in plan.parameters.items() if t.kind == "buffer"]
    lines += ["}", "#: the model's inputs: name -> placements", "INPUT_PLACEMENTS = {"]
    lines += [f"    {name!r}: {placements_text(t.layout, 'input', name)}," for name, t in plan.inputs.items()]
    lines += ["}",
              "#: values moved here, not by torch: an embedding over a row-cut table leaves torch's MaskPartial, whose",
              "#: reduce-scatter fails an assertion (Partial._reduce_shard_value); settle() all-reduces it first",
              "SETTLE = {"]
    for value, (table, layout) in settle.items():
        lines.append(f"    {value!r}: {placements_text(layout, 'value', value)},  # the embedding of {table}")
    lines += ["}", "#: the outputs' layouts layout-prop predicts", "PREDICTED_OUTPUTS = {"]
    lines += [f"    {name!r}: {layout.placement_strs()!r}," for name, layout in plan.outputs.items()]
    hooks = {value: table.rpartition(".")[0] for value, (table, _) in settle.items() if "." in table}
    lines += ["}", "#: SETTLE's values made by a module: settled by a forward hook on it",
              f"SETTLE_MODULES = {hooks!r}"]
    lines += _FUNCTIONS + (_PIPELINE_FUNCTIONS if plan.config.pipeline_axis is not None else [])
    return "\n".join(lines) + "\n"


_FUNCTIONS = '''

def make_mesh(device_type="cpu"):
    """The device mesh layout-prop checked the plan on (torch.distributed must be initialised)."""
    return init_device_mesh(device_type, MESH_SHAPE, mesh_dim_names=MESH_DIM_NAMES)


def _sub(mesh, axes):
    """mesh's sub-mesh over ``axes`` (flattened to one dim when several: FSDP2 shards over one)."""
    if tuple(axes) == MESH_DIM_NAMES:
        return mesh
    sub = mesh[axes[0]] if len(axes) == 1 else mesh[tuple(axes)]
    return sub if len(axes) == 1 else sub._flatten()


def _model_mesh(mesh):
    """mesh's sub-mesh over MODEL_AXES, one dim an axis (the parameters' placements), or None without them."""
    if not MODEL_AXES:
        return None
    if tuple(MODEL_AXES) == MESH_DIM_NAMES:
        return mesh
    return mesh[MODEL_AXES[0]] if len(MODEL_AXES) == 1 else mesh[tuple(MODEL_AXES)]


def _model_placements(placements):
    return tuple(p for p, name in zip(placements, MESH_DIM_NAMES) if name in MODEL_AXES)


def parallelize(model, mesh, names=None, zero=True):
    """Styles on mesh[TP_AXIS], or every parameter and buffer a DTensor on the model mesh; then ZeRO (unless
    ``zero`` is false). ``names``: place only these parameters and buffers (a pipeline's chunk module's)."""
    if TP_AXIS is not None:
        sub = mesh[TP_AXIS] if len(MESH_SHAPE) > 1 else mesh
        if PARALLELIZE_PLAN:
            model = parallelize_module(model, sub, PARALLELIZE_PLAN)
    elif MODEL_AXES:
        on = _model_mesh(mesh)
        for table, leaves in ((PARAMETER_PLACEMENTS, "parameter"), (BUFFER_PLACEMENTS, "buffer")):
            for name, placements in table.items():
                if names is not None and name not in names:
                    continue
                module_name, _, leaf = name.rpartition(".")
                module = model.get_submodule(module_name) if module_name else model
                value = getattr(module, leaf)
                placed = distribute_tensor(value.detach(), on, _model_placements(placements))
                if leaves == "parameter":
                    module.register_parameter(leaf, torch.nn.Parameter(placed, requires_grad=value.requires_grad))
                else:
                    module.register_buffer(leaf, placed)
        for value, module_name in SETTLE_MODULES.items():
            if names is None or any(n.startswith(module_name + ".") for n in names):
                model.get_submodule(module_name).register_forward_hook(
                    lambda _module, _args, out, value=value: settle(value, out))
    if ZERO_STAGE and zero:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=_sub(mesh, ZERO_AXES), reshard_after_forward=ZERO_STAGE == 3)
    return model


def shard_inputs(mesh, **inputs):
    """Each input's piece: a local tensor with styles, a pipeline (its stages place them) or without model
    axes, else a DTensor on the model mesh (with ZeRO: this rank's piece on the ZeRO axes, a DTensor on the others)."""
    out = {}
    for name, value in inputs.items():
        placements = INPUT_PLACEMENTS.get(name, (Replicate(),) * len(MESH_SHAPE))
        placed = distribute_tensor(value, mesh, placements)
        if TP_AXIS is not None or not MODEL_AXES or PP_AXIS is not None:
            out[name] = placed.to_local()
        elif ZERO_STAGE:
            out[name] = DTensor.from_local(placed.to_local(), _model_mesh(mesh), _model_placements(placements),
                                           run_check=False)
        else:
            out[name] = placed
    return out


def settle(name, x):
    """``x`` (the value ``name``) moved to SETTLE's placements by hand: its partial sums all-reduced to
    Replicate first (torch's MaskPartial cannot be reduce-scattered), then cut; other values as they are."""
    if name not in SETTLE or not isinstance(x, DTensor):
        return x
    target = _model_placements(SETTLE[name])
    reduced = [Replicate() if p.is_partial() else p for p in x.placements]
    return x.redistribute(x.device_mesh, reduced).redistribute(x.device_mesh, target)


def checkpoint_layers(layers):
    """Wrap each module of ``layers`` (name -> module) in activation checkpointing when RECOMPUTE asks it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if RECOMPUTE != "full":
        return dict(layers)
    return {name: checkpoint_wrapper(module) if RECOMPUTE_LAYERS is None or name in RECOMPUTE_LAYERS else module
            for name, module in layers.items()}


def recompute(layer, fn, *args):
    """``fn(*args)``, checkpointed (its activations recomputed in backward) when RECOMPUTE asks it for ``layer``."""
    if RECOMPUTE == "full" and (RECOMPUTE_LAYERS is None or layer in RECOMPUTE_LAYERS):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)'''.splitlines()

#: the functions of a pipelined plan (written when the spec has a pipeline: block)
_PIPELINE_FUNCTIONS = '''

def stage_chunks(mesh):
    """The chunks this rank's pipeline stage runs (indices into CHUNKS): the modules pipeline() takes."""
    rank = mesh[PP_AXIS].get_local_rank()
    return [index for index, chunk in enumerate(CHUNKS) if chunk["stage"] == rank]


class _Boundary(torch.nn.Module):
    """A chunk module between stages: what it receives (plain tensors, each the local piece of its placements)
    made DTensors on the model mesh, what it sends made the local pieces of the placements CHUNKS gives them
    (from_local and to_local carry the gradients back: a partial sum's gradient is replicated). The last
    chunk's output (the loss function's input) stays a DTensor."""

    def __init__(self, module, index, mesh):
        super().__init__()
        self.module, self.index = module, index
        self.mesh = _model_mesh(mesh)
        chunk = CHUNKS[index]
        self.receives = [_model_placements(INPUT_PLACEMENTS[name]) for name in STAGE_INPUTS] if index == 0 else [
            _model_placements(p) for p in chunk["receives"].values()]
        self.sends = None if index == len(CHUNKS) - 1 else [_model_placements(p) for p in chunk["sends"].values()]

    def forward(self, *args):
        if self.mesh is not None:
            args = [DTensor.from_local(a, self.mesh, p, run_check=False) for a, p in zip(args, self.receives)]
        out = self.module(*args)
        if self.sends is None:
            return out
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if len(outs) != len(self.sends):
            raise ValueError(f"chunk {self.index} returned {len(outs)} value(s); CHUNKS[{self.index}] sends "
                             f"{list(CHUNKS[self.index]['sends'])}")
        local = tuple(o.redistribute(self.mesh, p).to_local() if isinstance(o, DTensor) else o
                      for o, p in zip(outs, self.sends))
        return local[0] if len(local) == 1 else local


def pipeline(modules, mesh, loss_fn, device="cpu"):
    """torch.distributed.pipelining's SCHEDULE over this rank's chunk modules (``modules``: chunk index ->
    module, for the indices stage_chunks(mesh) gives): each parallelized with its chunk's parameters and
    buffers, wrapped to send and receive the planned placements, made a PipelineStage on mesh[PP_AXIS]'s
    process group. ``loss_fn(output, target)`` is the loss of one micro-batch (its target placed as TARGET
    is). Returns the schedule; pipeline_step runs one step of it."""
    from torch.distributed import pipelining

    group = mesh[PP_AXIS].get_group()
    stages = []
    for index in sorted(modules):
        chunk = CHUNKS[index]
        module = parallelize(modules[index], mesh, set(chunk["parameters"]) | set(chunk["buffers"]), zero=False)
        stage_module = _Boundary(module, index, mesh)
        if ZERO_STAGE:  # the stage's own module is FSDP2's: the schedule syncs its gradients once a step
            from torch.distributed.fsdp import fully_shard

            fully_shard(stage_module, mesh=_sub(mesh, ZERO_AXES), reshard_after_forward=ZERO_STAGE == 3)
        stages.append(pipelining.PipelineStage(stage_module, index, len(CHUNKS), torch.device(device), group=group))
    target_placements = _model_placements(INPUT_PLACEMENTS[TARGET]) if TARGET is not None else None
    model_mesh = _model_mesh(mesh)

    def loss(output, target):
        if model_mesh is not None and isinstance(output, DTensor) and target_placements is not None:
            target = DTensor.from_local(target, model_mesh, target_placements, run_check=False)
        return loss_fn(output, target)

    schedule = getattr(pipelining, SCHEDULE)
    return schedule(stages if SCHEDULE == "ScheduleInterleaved1F1B" else stages[0], n_microbatches=MICRO_BATCHES,
                    loss_fn=loss, scale_grads=LOSS_MEAN)


def pipeline_step(schedule, mesh, **inputs):
    """One step of ``schedule`` on the batch ``inputs`` (whole tensors, every rank the same): this rank's
    pieces (shard_inputs), STAGE_INPUTS to the first stage, TARGET to the last. Returns the micro-batches'
    losses on the last stage's ranks, else None (the parameters' gradients are accumulated)."""
    pieces = shard_inputs(mesh, **inputs)
    chunks = stage_chunks(mesh)
    args = [pieces[name] for name in STAGE_INPUTS] if 0 in chunks else []
    last = len(CHUNKS) - 1 in chunks
    losses = [] if last else None
    target = pieces[TARGET] if last and TARGET is not None else None
    schedule.step(*args, target=target, losses=losses)
    return losses'''.splitlines()
