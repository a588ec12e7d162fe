"""``layout-prop export --to torch``: a ``parallelize_module`` plan, and explicit ``distribute_tensor`` placements.

On a 1-D mesh, a module whose weight layout-prop shards as torch's styles do gets the style (by the
module's name, the parameter's name without ``.weight``): a product's weight cut on its output
features (torch's ``Linear`` weight ``Shard(0)``, bias ``Shard(0)`` or none) is ``ColwiseParallel()``,
cut on the contracted features (``Shard(1)``, bias replicated or none) ``RowwiseParallel()``; an
embedding table cut on its rows ``RowwiseParallel()``, on its columns ``ColwiseParallel()``.  These
are torch's Megatron-style styles: a colwise module's output stays a local shard of the last dim (as
layout-prop predicts it, ``S(-1)``) for the next rowwise module.  Every other sharded parameter, and
every parameter on a mesh of several axes, is placed explicitly (``EXPLICIT_PLACEMENTS``, applied by
``distribute_tensor`` in ``parallelize``); the model's inputs by ``shard_inputs``.  Replicated
parameters stay plain tensors, as ``parallelize_module`` leaves them.

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

from .export_plan import ExportPlan, ExportTensor, not_expressible, placement_args

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


def _shard_dim(layout: Layout) -> int | None:
    """The dim a 1-D mesh's layout shards, None when replicated."""
    kind, arg = placement_args(layout)[0]
    return arg if kind == "S" else None


def _style(weight: ExportTensor, bias: ExportTensor | None) -> str | None:
    """The torch style that places this module's weight (and bias) as layout-prop has them, or None."""
    dim = _shard_dim(weight.own_layout())
    bias_dim = None if bias is None else _shard_dim(bias.layout)
    if bias is not None and bias.layout.has_partial():
        return None
    if "embedding" in weight.consumers and len(weight.shape) == 2 and bias is None:
        return {0: "RowwiseParallel()", 1: "ColwiseParallel()"}.get(dim)
    if not set(weight.consumers) <= {"matmul", "linear"} or len(weight.shape) != 2:
        return None
    if dim == 0 and (bias is None or bias_dim == 0):
        return "ColwiseParallel()"
    if dim == 1 and (bias is None or (bias_dim is None and bias.layout.is_replicated())):
        return "RowwiseParallel()"
    return None


def module_styles(plan: ExportPlan) -> tuple[dict[str, str], dict[str, ExportTensor]]:
    """``(module name -> style, parameter name -> tensor placed explicitly)`` for the plan's sharded parameters."""
    params = {n: t for n, t in plan.parameters.items() if t.kind == "parameter"}
    styles: dict[str, str] = {}
    explicit: dict[str, ExportTensor] = {}
    covered: set[str] = set()
    if plan.mesh.ndim == 1:
        for name, t in params.items():
            module, _, leaf = name.rpartition(".")
            if leaf != "weight" or not module or t.layout.is_replicated():
                continue
            bias = params.get(module + ".bias")
            style = _style(t, bias)
            if style is not None:
                styles[module] = style
                covered.update({name, module + ".bias"})
    for name, t in params.items():
        if name not in covered and not t.layout.is_replicated():
            explicit[name] = t
    return styles, explicit


def export_torch(plan: ExportPlan) -> str:
    """The Python module text for ``plan`` (see the module docstring)."""
    mesh = plan.mesh
    comma = "," if mesh.ndim == 1 else ""
    for name, t in plan.parameters.items():
        if t.kind == "parameter":
            placements_text(t.layout, "parameter", name)  # refuses what torch cannot place
    styles, explicit = module_styles(plan)
    lines = [
        f'"""torch tensor-parallel plan written by layout-prop export from {plan.source or "a graph"}.',
        "",
        "Every layout was checked by layout-prop (check --reshard); names and dims are the model's own.",
        "Use: mesh = make_mesh(); model = parallelize(model, mesh); out = model(**shard_inputs(mesh, **inputs))",
        '"""',
        "import torch",
        "from torch.distributed.device_mesh import init_device_mesh",
        "from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: F401",
        "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: F401",
        "",
        f"MESH_SHAPE = ({', '.join(map(str, mesh.shape))}{comma})",
        f"MESH_DIM_NAMES = ({', '.join(repr(n) for n in mesh.names)}{comma})",
        "",
        "#: parallelize_module's plan: module name -> style",
        "PARALLELIZE_PLAN = {",
    ]
    lines += [f"    {module!r}: {style}," for module, style in styles.items()]
    lines += ["}", "#: parameters no style places: name -> placements (distribute_tensor)", "EXPLICIT_PLACEMENTS = {"]
    lines += [f"    {name!r}: {placements_text(t.own_layout(), 'parameter', name)}," for name, t in explicit.items()]
    lines += ["}", "#: the model's inputs: name -> placements", "INPUT_PLACEMENTS = {"]
    lines += [f"    {name!r}: {placements_text(t.layout, 'input', name)}," for name, t in plan.inputs.items()]
    lines += ["}", "#: every parameter's placements as layout-prop checked them (replicated ones included)",
              "PARAMETER_PLACEMENTS = {"]
    for name, t in plan.parameters.items():
        if t.kind == "parameter":
            lines.append(f"    {name!r}: {placements_text(t.own_layout(), 'parameter', name)},")
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
        '    """Apply the styles, then place the other sharded parameters explicitly."""',
        "    if PARALLELIZE_PLAN:",
        "        model = parallelize_module(model, mesh, PARALLELIZE_PLAN)",
        "    for name, placements in EXPLICIT_PLACEMENTS.items():",
        '        module_name, _, leaf = name.rpartition(".")',
        "        module = model.get_submodule(module_name)",
        "        param = getattr(module, leaf)",
        "        placed = distribute_tensor(param.detach(), mesh, placements)",
        "        module.register_parameter(leaf, torch.nn.Parameter(placed, requires_grad=param.requires_grad))",
        "    return model",
        "",
        "",
        "def shard_inputs(mesh, **inputs):",
        '    """The model\'s inputs: replicated ones as given, the others distributed as layout-prop checked them."""',
        "    out = {}",
        "    for name, value in inputs.items():",
        "        placements = INPUT_PLACEMENTS.get(name)",
        "        replicated = placements is None or all(p == Replicate() for p in placements)",
        "        out[name] = value if replicated else distribute_tensor(value, mesh, placements)",
        "    return out",
    ]
    return "\n".join(lines) + "\n"
