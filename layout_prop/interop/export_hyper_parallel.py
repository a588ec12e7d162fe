"""``layout-prop export --to hyper-parallel``: a Python module building hyper-parallel's ``DeviceMesh`` and ``ShardingPlan``.

The module imports from hyper-parallel's own modules (``hyper_parallel.core.device_mesh``,
``core.placement_types``, ``core.shard.sharding_plan``), defines ``make_mesh(device_type)`` and
``SHARDING_PLAN`` (``plan`` for parameters by the model's own names and dims, ``input_plan`` for
the model's inputs by argument name, ``output_plan`` with the layouts layout-prop predicts for the
outputs), ready for ``shard_module(model, make_mesh(), SHARDING_PLAN)``.  Placements are
``Shard(d)``, ``Replicate()`` and ``Partial(op)`` per mesh axis; a strided shard has no such
placement and is ``not-expressible``.  Constant inputs (rotary tables the exporter folded) are no
parameters of the model and are listed in a comment only.

>>> from layout_prop.core.mesh import DeviceMesh
>>> from layout_prop.core.layout import Layout
>>> placements_text(Layout(DeviceMesh((2, 2), ("dp", "tp")), ["S(0)", "P"], 2), "parameter", "w")
'(Shard(0), Partial("sum"))'
>>> placements_text(Layout(DeviceMesh((2, 2), ("dp", "tp")), ["S(1)", "S(1)"], 2), "input", "x")
'layout("None", ("dp", "tp"))'
"""

from __future__ import annotations

from layout_prop.core.layout import Layout

from .export_plan import (ExportPlan, batch_lines, not_expressible, not_written, own_parameters, placement_args,
                          refuse_config)
from .hyper_parallel import _alias_map

__all__ = ["export_hyper_parallel", "placements_text", "alias_text", "explicit_moves", "WRONG_RULES"]

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


def _ranks(shape: tuple[int, ...]) -> str:
    import numpy as np

    return repr(np.arange(int(np.prod(shape))).reshape(shape).tolist())


def export_hyper_parallel(plan: ExportPlan) -> str:
    """The Python module text for ``plan`` (see the module docstring)."""
    plan, zero_lines = _zero(plan)
    refuse_config(plan, TARGET)
    own_parameters(plan, TARGET)  # a tied copy's refusal first: it names the model's own mistake
    _refuse_vocabulary_embedding(plan)
    moves, unwritten = explicit_moves(plan)
    mesh = plan.mesh
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
        "",
        "",
        'def make_mesh(device_type="npu"):',
        '    """The device mesh layout-prop checked the plan on."""',
        "    return DeviceMesh(device_type, RANKS, mesh_dim_names=MESH_DIM_NAMES)",
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
    ]
    return "\n".join(lines) + "\n"
