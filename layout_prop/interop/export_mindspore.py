"""``layout-prop export --to mindspore``: ``shard()`` strategies per op node for a semi-auto-parallel run.

For every op node of the graph as ``check --reshard`` leaves it (keyed by the node's name, which for
an imported MindIR or Cell is the Cell's path, ``layers.0.attention.wq``), the module lists the
strategy of each operand as layout-prop has it received (``in_strategy``: how many pieces each dim
is cut into), the same in MindSpore's ``Layout`` form (``in_layout``: an alias per dim, a tuple of
aliases where several mesh axes cut one dim, which a plain strategy cannot place), and the
``out_strategy`` where the output has no partial sum.  ``PARAMETER_LAYOUTS`` gives each parameter's
alias tensor map (for ``Cell.shard(parameter_plan=...)``).  The redistributions layout-prop inserted
(and the explicit ``redistribute`` nodes of ``plan``'s output) are MindSpore's to insert: a node's
strategy is the layout it needs.

A partial sum arriving at a node is left to MindSpore's own redistribution: semi-auto parallel reduces
a producer's partial output itself (the AllReduce it inserts after a row-cut MatMul or a vocabulary-cut
Gather), so the consumer's strategy lists that operand reduced (``R`` on the axes it was partial on)
and ``partial_in`` names it; layout-prop's plan may add partial sums before reducing them (a residual
add of two partial sums), which costs MindSpore one more AllReduce, not a wrong value. Each node names
the MindSpore primitive its strategy is for (``primitive``: ``MatMul``, ``BatchMatMul``, ``Add``,
``Gather``... or None where no single primitive is the op), and ``shard_primitive(name)`` builds it with
its strategy. A strided shard that a tensor_map entry naming an inner mesh axis first makes (``(_S(0,2),
S(0))`` on a 2 x 2 mesh is ``((0, 1),)``, ``("tp", "dp")`` in alias form) is written as that tensor_map.
A partial sum on a model input or parameter and a strided shard no tensor_map makes (a fused weight's
``_S(1,3)``: a tensor_map entry cuts a dim by its axes in turn, into contiguous blocks) are
``not-expressible``, naming the tensor and its layout.

A plan with a ``pipeline:`` block (1f1b or gpipe) is written on its stage (:func:`stage_plan`: the mesh
without the pipeline axis, MindSpore's strategies being for one stage's devices), with each op node's and
layer's stage as ``layout-prop pipeline SPEC`` cuts the model (``NODE_STAGES``, ``LAYER_STAGES``),
``pipeline(net, cells)`` (``Cell.pipeline_stage`` and MindSpore's ``Pipeline`` micro-batch wrapper) and
``AutoParallel.pipeline`` in ``auto_parallel``; an interleaved schedule is ``not-expressible``. Selective
recomputation is written primitive by primitive (``RECOMPUTE_NODES``: ``shard_primitive`` sets
``Primitive.recompute()``), full recomputation Cell by Cell with ``Cell.recompute``'s communication options.

>>> from layout_prop.core.mesh import DeviceMesh
>>> from layout_prop.core.layout import Layout
>>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
>>> strategy(Layout(mesh, ["S(0)", "S(0)"], 2), "operand", "x"), alias_map(Layout(mesh, ["S(0)", "S(0)"], 2))
((4, 1), (('dp', 'tp'), 'None'))
"""

from __future__ import annotations

from layout_prop.core.errors import LayoutError
from layout_prop.core.layout import Layout

from .export_plan import ExportPlan, batch_lines, not_expressible, not_written, own_parameters
from .hyper_parallel import _alias_map

__all__ = ["export_mindspore", "strategy", "alias_map", "node_strategies", "PRIMITIVES", "primitive", "stage_plan"]

TARGET = "MindSpore"


#: layout-prop op -> (MindSpore primitive, its constructor's arguments as Python text, the operands it takes in
#: the primitive's order: indices into the node's operands); a matmul of operands over 2-D is a BatchMatMul
PRIMITIVES = {
    "linear": ("MatMul", "transpose_b=True", (0, 1)),
    "matmul": ("MatMul", "", (0, 1)),
    "batch_matmul": ("BatchMatMul", "", (0, 1)),
    "add": ("Add", "", (0, 1)),
    "sub": ("Sub", "", (0, 1)),
    "mul": ("Mul", "", (0, 1)),
    "div": ("RealDiv", "", (0, 1)),
    "rms_norm": ("RmsNorm", "", (0, 1)),
    "softmax": ("Softmax", "", (0,)),
    "gelu": ("GeLU", "", (0,)),
    "relu": ("ReLU", "", (0,)),
    "embedding": ("Gather", "", (1, 0)),  # Gather(table, ids, 0)
    "transpose": ("Transpose", "", (0,)),
    "reshape": ("Reshape", "", (0,)),
}


def primitive(op: str, in_layouts) -> tuple[str, str, tuple[int, ...]] | None:
    """The MindSpore primitive that carries node ``op``'s strategy, or None (no single primitive is the op)."""
    entry = PRIMITIVES.get(op)
    if entry is None:
        return None
    name, args, order = entry
    ranks = [layout.ndim for layout in in_layouts if layout is not None]
    if name == "MatMul" and any(rank > 2 for rank in ranks[:2]):
        name = "BatchMatMul"
    return name, args, order


def _reduced(layout: Layout) -> Layout:
    """``layout`` with each partial sum reduced (``R`` there): what MindSpore hands the consumer."""
    from layout_prop.core.placement import Partial, Replicate

    return Layout(layout.mesh, [Replicate() if isinstance(p, Partial) else p for p in layout.placements],
                  layout.ndim)


def _check_config(plan: ExportPlan) -> None:
    """Refuse what this export does not write (one ``not-expressible`` line naming it and the workaround): an
    interleaved pipeline (MindSpore 2.10's ``AutoParallel.pipeline(interleave=True)`` takes no assignment of model
    chunks to stages that this export could write and check: ``Cell.pipeline_segment`` is documented for its
    ``zero_bubble_v`` scheduler only)."""
    c = plan.config
    if c.pipeline_axis is not None and c.schedule == "interleaved":
        raise not_written(TARGET, f"the pipeline: block's interleaved schedule ({c.pipeline_stages} stages x "
                          f"{c.virtual_stages} virtual on {c.pipeline_axis})", "MindSpore's interleave=True takes no "
                          "model chunks per stage this export can write (Cell.pipeline_segment is documented for "
                          "zero_bubble_v only)", "write schedule: 1f1b (or gpipe) with virtual_stages: 1, or "
                          "export --to torch")


def stage_plan(plan: ExportPlan) -> ExportPlan:
    """``plan`` on the stage mesh for a plan with a ``pipeline:`` block (``plan`` itself without one): its stage
    (:attr:`ExportPlan.stage`: one micro-batch on the mesh without the pipeline axis, as ``check SPEC --reshard``
    analyses it) with its size-1 axes dropped, carrying the whole plan's configuration, chunks and recomputed
    nodes. MindSpore's strategies are for one stage's devices (``pipeline_stages`` divides the devices);
    hyper-parallel shards each chunk on its stage's mesh."""
    import dataclasses

    from .export_plan import drop_unit_axes

    if plan.stage is None:
        return plan
    stage = drop_unit_axes(plan.stage)
    return dataclasses.replace(stage, config=plan.config, chunks=plan.chunks, recomputed=plan.recomputed,
                               source=plan.source, model=plan.model, stage=None)


def _layer(name: str) -> str:
    """The layer a node belongs to (``l3_q`` -> ``l3``, as the recompute and ZeRO passes read names), else itself."""
    from layout_prop.passes.zero import _layer_of

    return _layer_of(name)


def _pipeline_lines(plan: ExportPlan) -> list[str]:
    c = plan.config
    if c.pipeline_axis is None:
        return ["#: pipeline: none (PIPELINE_STAGES = 1: no Pipeline wrapper, no pipeline_stage)",
                "PIPELINE_STAGES = 1", "MICRO_BATCHES = 1", "PIPELINE_SCHEDULER = '1f1b'", "NODE_STAGES = {}",
                "LAYER_STAGES = {}"]
    stages = c.pipeline_stages
    node_stages = {name: chunk % stages for name, chunk in plan.chunks.items()}
    layers: dict[str, set[int]] = {}
    for name, stage in node_stages.items():
        if _layer(name) != name:  # a node outside any layer (embedding, head, loss) is in NODE_STAGES only
            layers.setdefault(_layer(name), set()).add(stage)
    lines = [f"#: pipeline: the mesh axis {c.pipeline_axis!r} ({stages} stages) is MindSpore's pipeline_stages; every "
             "strategy and Layout above is for one stage's devices",
             "#: (AutoParallel.pipeline(stages=PIPELINE_STAGES, scheduler=PIPELINE_SCHEDULER); Pipeline(net, "
             "MICRO_BATCHES) splits each batch into micro-batches)",
             f"PIPELINE_STAGES = {stages}", f"MICRO_BATCHES = {c.micro_batches}",
             f"PIPELINE_SCHEDULER = {c.schedule!r}",
             "#: each op node's stage, as layout-prop pipeline SPEC cuts the model",
             "NODE_STAGES = {"]
    lines += [f"    {name!r}: {stage}," for name, stage in node_stages.items()]
    lines.append("}")
    lines.append("#: each layer's stage (l0, l1... as the nodes name them; a layer split between stages is left out: set its")
    lines.append("#: Cells' stages by NODE_STAGES)")
    lines.append("LAYER_STAGES = {")
    lines += [f"    {layer!r}: {next(iter(s))}," for layer, s in layers.items() if len(s) == 1]
    lines.append("}")
    return lines


def _config_lines(plan: ExportPlan) -> list[str]:
    c = plan.config
    degree = 1
    for axis in c.zero_axes:
        degree *= plan.mesh.shape[plan.mesh.axis_index(axis)]
    lines = ["#: ZeRO as MindSpore's parallel optimizer: AutoParallel.hsdp(shard_size=ZERO_SHARD_SIZE, threshold=0,",
             "#: optimizer_level='level<ZERO_STAGE>') (level1: weights' optimizer states, level2: and gradients,",
             "#: level3: and weights); 0: none",
             f"ZERO_STAGE = {c.zero_stage}",
             f"ZERO_SHARD_SIZE = {degree}  # the ranks of the ZeRO axes {', '.join(c.zero_axes) or '(none)'}",
             "#: recomputation: 'full' recomputes each layer's Cell (recompute_cells); 'selective' the primitives of",
             "#: RECOMPUTE_NODES (shard_primitive sets Primitive.recompute() on them)",
             f"RECOMPUTE = {c.recompute!r}",
             f"RECOMPUTE_LAYERS = {None if c.recompute_layers is None else tuple(c.recompute_layers)!r}",
             "#: Cell.recompute's communication options: layout-prop's recomputation copies a layer's moves too",
             "#: (mp_comm_recompute), and ZeRO-3 gathers the weights again for it (parallel_optimizer_comm_recompute)",
             "MP_COMM_RECOMPUTE = True",
             f"PARALLEL_OPTIMIZER_COMM_RECOMPUTE = {c.zero_stage == 3}"]
    if c.recompute == "selective":
        lines.append("#: the op nodes selective recomputation makes again, by layer (the attention core: scores, "
                     "probabilities)")
        lines.append("RECOMPUTE_NODES = {")
        lines += [f"    {layer!r}: {nodes!r}," for layer, nodes in plan.recomputed.items()]
        lines.append("}")
    else:
        lines.append("RECOMPUTE_NODES = {}")
    return lines


def _refuse(layout: Layout, what: str, name: str, partial_ok: bool = False) -> None:
    """Refuse what a strategy cannot state: a strided shard that no tensor_map writes (a tensor_map entry
    naming an inner mesh axis first is a strided layout, written back as that entry), a partial sum (unless
    ``partial_ok``)."""
    if layout.has_strided:
        try:
            layout.tensor_map()
        except LayoutError:
            raise not_expressible(TARGET, what, name, layout, "a tensor_map cuts a dim by its mesh axes in turn, "
                                  "each into contiguous blocks, and no order of them makes this strided shard",
                                  "gather that mesh axis (R) or keep the fused weight's blocks unsplit (colwise) "
                                  "before exporting to MindSpore") from None
    if layout.has_partial() and not partial_ok:
        raise not_expressible(TARGET, what, name, layout, "a shard strategy has no partial-sum input",
                              "reduce it first (an all-reduce in the graph) or give that input R or S(d)")


def strategy(layout: Layout, what: str, name: str) -> tuple[int, ...]:
    """How many pieces each dim of ``layout`` is cut into (MindSpore's plain strategy)."""
    _refuse(layout, what, name)
    return tuple(_pieces(layout, d) for d in range(layout.ndim))


def _pieces(layout: Layout, dim: int) -> int:
    """How many pieces ``dim`` is cut into by its plain and strided shards (``shard_count`` counts plain ones)."""
    n = 1
    for axis in layout.cut_axes(dim):
        n *= layout.mesh.shape[axis]
    return n


def alias_map(layout: Layout) -> tuple:
    """``layout``'s tensor_map in MindSpore's ``Layout`` alias form (``"None"`` for an uncut dim)."""
    return _alias_map(layout)


def node_strategies(plan: ExportPlan) -> dict[str, dict]:
    """Each op node's ``op``, ``in_strategy``, ``in_layout`` and ``out_strategy`` (None where partial)."""
    out = {}
    for node in plan.nodes:
        if node.op == "redistribute":  # plan's explicit moves: MindSpore inserts its own redistributions
            continue
        ins, maps, partial_in = [], [], []
        for value, layout in zip(node.inputs, node.in_layouts):
            if layout is None:
                continue
            if layout.has_partial():  # MindSpore reduces the producer's partial output itself
                partial_in.append(value)
                layout = _reduced(layout)
            what = f"operand {value!r} of node"
            ins.append(strategy(layout, what, node.name))
            maps.append(alias_map(layout))
        outs = []
        for layout in node.out_layouts:
            if layout is None:
                continue
            _refuse(layout, "the output of node", node.name, partial_ok=True)
            outs.append(None if layout.has_partial() else tuple(_pieces(layout, d) for d in range(layout.ndim)))
        prim = primitive(node.op, node.in_layouts)
        out[node.name] = {"op": node.op, "primitive": None if prim is None else prim[0],
                          "in_strategy": tuple(ins), "in_layout": tuple(maps),
                          "out_strategy": tuple(outs) if outs and None not in outs else None,
                          "partial_in": tuple(partial_in)}
    return out


def export_mindspore(plan: ExportPlan) -> str:
    """The Python module text for ``plan`` (see the module docstring)."""
    _check_config(plan)
    plan = stage_plan(plan)
    mesh = plan.mesh
    comma = "," if mesh.ndim == 1 else ""
    for name, t in plan.tensors().items():
        if t.kind != "constant":
            _refuse(t.layout, "input" if t.kind == "input" else "parameter", name)
    strategies = node_strategies(plan)
    lines = [
        f'"""MindSpore shard strategies written by layout-prop export from {plan.source or "a graph"}.',
        "",
        "Keyed by the graph's node names (an imported MindIR's Cell paths). in_strategy: pieces per dim of",
        "each operand, as layout-prop checked it (check --reshard); in_layout: the same in Layout alias form.",
        "Semi-auto parallel runs on Ascend and GPU; layout-prop checked these layouts by simulation only.",
        '"""',
        "",
        f"DEVICE_MATRIX = ({', '.join(map(str, mesh.shape))}{comma})",
        f"ALIAS_NAME = ({', '.join(repr(n) for n in mesh.names)}{comma})",
        *([f"#: left out of the mesh (size 1: they cut nothing): {', '.join(plan.dropped_axes)}"]
          if plan.dropped_axes else []),
        *(batch_lines(plan) if plan.config.global_batch is not None else []),
        *_config_lines(plan),
        *_pipeline_lines(plan),
        "",
        "STRATEGIES = {",
    ]
    for name, s in strategies.items():
        extra = f", 'partial_in': {s['partial_in']!r}" if s["partial_in"] else ""
        lines.append(f"    {name!r}: {{'op': {s['op']!r}, 'primitive': {s['primitive']!r}, "
                     f"'in_strategy': {s['in_strategy']!r}, 'in_layout': {s['in_layout']!r}, "
                     f"'out_strategy': {s['out_strategy']!r}{extra}}},")
    lines.append("}")
    if any(s["partial_in"] for s in strategies.values()):
        lines.append("#: partial_in: operands layout-prop hands over as partial sums; MindSpore reduces the producer's "
                     "output itself (its AllReduce), so they are listed reduced")
    lines.append("#: the primitives' constructor arguments and operand order (indices into in_strategy)")
    lines.append("PRIMITIVE_ARGS = {")
    for op in sorted({s["op"] for s in strategies.values() if s["primitive"] is not None}):
        _, args, order = PRIMITIVES[op]
        lines.append(f"    {op!r}: ({args!r}, {order!r}),")
    lines.append("}")
    lines.append("")
    lines.append("#: each parameter's tensor map in the alias form: parameter_layouts() builds the Layout objects")
    lines.append("PARAMETER_LAYOUTS = {")
    for name, t in own_parameters(plan, TARGET):  # constants and tied copies are no parameters of the model
        lines.append(f"    {name!r}: {alias_map(t.layout)!r},")
    lines.append("}")
    lines.append("#: tensors without gradient the model holds (rotary tables, masks), alias form")
    lines.append("BUFFER_LAYOUTS = {")
    for name, t in plan.parameters.items():
        if t.kind == "buffer":
            lines.append(f"    {name!r}: {alias_map(t.layout)!r},")
    lines.append("}")
    lines.append("INPUT_STRATEGIES = {")
    for name, t in plan.inputs.items():
        lines.append(f"    {name!r}: {strategy(t.layout, 'input', name)!r},")
    lines.append("}")
    lines += [
        "",
        "",
        "def _layout():",
        "    from mindspore.parallel import Layout",
        "",
        "    return Layout(DEVICE_MATRIX, ALIAS_NAME)",
        "",
        "",
        "def in_layouts(name):",
        '    """Node ``name``\'s operands as MindSpore Layouts (for shard(in_strategy=...) with several axes on a dim)."""',
        "    layout = _layout()",
        "    return tuple(layout(*alias) for alias in STRATEGIES[name]['in_layout'])",
        "",
        "",
        "def parameter_layouts():",
        '    """Each parameter\'s Layout object (a tensor map in the alias form is no Layout: Layout(...)(*alias))."""',
        "    layout = _layout()",
        "    return {name: layout(*alias) for name, alias in PARAMETER_LAYOUTS.items()}",
        "",
        "",
        "def auto_parallel(net):",
        '    """``net`` in MindSpore\'s semi-auto parallel mode, with the plan\'s ZeRO as its parallel optimizer."""',
        "    from mindspore.parallel.auto_parallel import AutoParallel",
        "",
        '    parallel = AutoParallel(net, parallel_mode="semi_auto")',
        "    if ZERO_STAGE:",
        '        parallel.hsdp(shard_size=ZERO_SHARD_SIZE, threshold=0, optimizer_level=f"level{ZERO_STAGE}")',
        "    if PIPELINE_STAGES > 1:",
        "        parallel.pipeline(stages=PIPELINE_STAGES, scheduler=PIPELINE_SCHEDULER)",
        "    return parallel",
        "",
        "",
        "def pipeline(net_with_loss, cells):",
        '    """Each Cell of ``cells`` (a layer or op node name -> the Cell running it) given its pipeline_stage, and',
        "    ``net_with_loss`` wrapped to split each batch into MICRO_BATCHES micro-batches (MindSpore's Pipeline);",
        '    ``net_with_loss`` as it is without a pipeline."""',
        "    if PIPELINE_STAGES == 1:",
        "        return net_with_loss",
        "    from mindspore.parallel.nn import Pipeline",
        "",
        "    for name, cell in cells.items():",
        "        stage = LAYER_STAGES.get(name, NODE_STAGES.get(name))",
        "        if stage is None:",
        '            raise KeyError(f"{name!r} is no layer or op node of the plan: its stage is unknown")',
        "        cell.pipeline_stage = stage",
        "    return Pipeline(net_with_loss, MICRO_BATCHES)",
        "",
        "",
        "def recompute_cells(cells):",
        '    """Recompute each Cell of ``cells`` (layer name -> Cell) when RECOMPUTE asks it for that layer (full)."""',
        "    for name, cell in cells.items():",
        "        if RECOMPUTE == 'full' and (RECOMPUTE_LAYERS is None or name in RECOMPUTE_LAYERS):",
        "            cell.recompute(mp_comm_recompute=MP_COMM_RECOMPUTE,",
        "                           parallel_optimizer_comm_recompute=PARALLEL_OPTIMIZER_COMM_RECOMPUTE)",
        "    return cells",
        "",
        "",
        "def recompute_primitives(primitives):",
        '    """Set Primitive.recompute() on each primitive of ``primitives`` (op node name -> primitive) that',
        '    selective recomputation makes again (RECOMPUTE_NODES)."""',
        "    chosen = {node for nodes in RECOMPUTE_NODES.values() for node in nodes}",
        "    for name, prim in primitives.items():",
        "        if name in chosen:",
        "            prim.recompute()",
        "    return primitives",
        "",
        "",
        "def shard_primitive(name):",
        '    """Node ``name``\'s MindSpore primitive with its strategy (Layouts where several axes cut a dim), or None."""',
        "    from mindspore import ops",
        "",
        "    entry = STRATEGIES[name]",
        "    if entry['primitive'] is None:",
        "        return None",
        "    args, order = PRIMITIVE_ARGS[entry['op']]",
        "    prim = eval(f\"ops.{entry['primitive']}({args})\", {'ops': ops})  # noqa: S307 (this file's own table)",
        "    nested = any(isinstance(a, tuple) for alias in entry['in_layout'] for a in alias)",
        "    given = in_layouts(name) if nested else entry['in_strategy']",
        "    prim = prim.shard(in_strategy=tuple(given[i] for i in order if i < len(given)))",
        "    return recompute_primitives({name: prim})[name]",
    ]
    return "\n".join(lines) + "\n"
