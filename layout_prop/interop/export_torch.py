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

Placements are in the module's own dims (a Linear weight the ONNX exporter stored transposed is
``(out, in)`` again).  torch's ``distribute_tensor`` takes no partial placement and its strided shard
is private: a parameter or input with either is ``not-expressible``.

>>> from layout_prop.core.mesh import DeviceMesh
>>> from layout_prop.core.layout import Layout
>>> placements_text(Layout(DeviceMesh((2, 2), ("dp", "tp")), ["R", "S(1)"], 2), "parameter", "w")
'(Replicate(), Shard(1))'
"""

from __future__ import annotations

from layout_prop.core.layout import Layout

from .export_plan import ExportPlan, ExportTensor, not_expressible, own_parameters, placement_args

__all__ = ["export_torch", "placements_text", "module_styles"]

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
        else:
            raise not_expressible(TARGET, what, name, layout, "torch's strided shard is private to DTensor",
                                  "gather that mesh axis (R) or keep the fused weight's blocks unsplit (colwise)")
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
    slice layout-prop inserts on that axis (before a softmax over a colwise output) would not be run."""
    for _value, src, dst in plan.moves:
        (src_kind, src_arg), (dst_kind, dst_arg) = placement_args(src)[axis], placement_args(dst)[axis]
        if src_kind != "P" and (src_kind, src_arg) != (dst_kind, dst_arg):
            return False
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


def export_torch(plan: ExportPlan) -> str:
    """The Python module text for ``plan`` (see the module docstring)."""
    mesh = plan.mesh
    comma = "," if mesh.ndim == 1 else ""
    params = own_parameters(plan, TARGET)
    for name, t in params:
        placements_text(t.layout, "parameter", name)  # refuses what torch cannot place
    axis, styles = module_styles(plan)
    tp_axis = "None" if axis is None else repr(mesh.names[axis])
    lines = [
        f'"""torch tensor-parallel plan written by layout-prop export from {plan.source or "a graph"}.',
        "",
        "Every layout was checked by layout-prop (check --reshard); names and dims are the model's own.",
        "Use: mesh = make_mesh(); model = parallelize(model, mesh); out = model(**shard_inputs(mesh, **inputs))",
        '"""',
        "import torch",
        "from torch.distributed.device_mesh import init_device_mesh",
        "from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor  # noqa: F401",
        "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: F401",
        "",
        f"MESH_SHAPE = ({', '.join(map(str, mesh.shape))}{comma})",
        f"MESH_DIM_NAMES = ({', '.join(repr(n) for n in mesh.names)}{comma})",
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
    lines += ["}", "#: the model's inputs: name -> placements", "INPUT_PLACEMENTS = {"]
    lines += [f"    {name!r}: {placements_text(t.layout, 'input', name)}," for name, t in plan.inputs.items()]
    lines += ["}", "#: the outputs' layouts layout-prop predicts", "PREDICTED_OUTPUTS = {"]
    lines += [f"    {name!r}: {layout.placement_strs()!r}," for name, layout in plan.outputs.items()]
    lines += [
        "}",
        "",
        "",
        'def make_mesh(device_type="cpu"):',
        '    """The device mesh layout-prop checked the plan on (torch.distributed must be initialised)."""',
        "    return init_device_mesh(device_type, MESH_SHAPE, mesh_dim_names=MESH_DIM_NAMES)",
        "",
        "",
        "def parallelize(model, mesh):",
        '    """The styles on mesh[TP_AXIS]; without styles, every parameter a DTensor with its placements."""',
        "    if TP_AXIS is not None:",
        "        sub = mesh[TP_AXIS] if len(MESH_SHAPE) > 1 else mesh",
        "        return parallelize_module(model, sub, PARALLELIZE_PLAN) if PARALLELIZE_PLAN else model",
        "    for name, placements in PARAMETER_PLACEMENTS.items():",
        '        module_name, _, leaf = name.rpartition(".")',
        "        module = model.get_submodule(module_name) if module_name else model",
        "        param = getattr(module, leaf)",
        "        placed = distribute_tensor(param.detach(), mesh, placements)",
        "        module.register_parameter(leaf, torch.nn.Parameter(placed, requires_grad=param.requires_grad))",
        "    return model",
        "",
        "",
        "def shard_inputs(mesh, **inputs):",
        '    """With styles, each rank\'s local piece of each input; without, each input a DTensor."""',
        "    out = {}",
        "    for name, value in inputs.items():",
        "        placements = INPUT_PLACEMENTS.get(name, (Replicate(),) * len(MESH_SHAPE))",
        "        placed = distribute_tensor(value, mesh, placements)",
        "        out[name] = placed.to_local() if TP_AXIS is not None else placed",
        "    return out",
    ]
    return "\n".join(lines) + "\n"
