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

MindSpore's strategies state neither a partial sum on an input nor a strided shard (a tensor_map
cuts a dim into contiguous blocks): either is ``not-expressible``, naming the node, the operand and
its layout.

>>> from layout_prop.core.mesh import DeviceMesh
>>> from layout_prop.core.layout import Layout
>>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
>>> strategy(Layout(mesh, ["S(0)", "S(0)"], 2), "operand", "x"), alias_map(Layout(mesh, ["S(0)", "S(0)"], 2))
((4, 1), (('dp', 'tp'), 'None'))
"""

from __future__ import annotations

from layout_prop.core.layout import Layout

from .export_plan import ExportPlan, batch_lines, not_expressible, own_parameters, refuse_config
from .hyper_parallel import _alias_map

__all__ = ["export_mindspore", "strategy", "alias_map", "node_strategies"]

TARGET = "MindSpore"


def _refuse(layout: Layout, what: str, name: str, partial_ok: bool = False) -> None:
    if layout.has_strided:
        raise not_expressible(TARGET, what, name, layout, "a tensor_map cuts a dim into contiguous blocks only "
                              "(strided shard)", "gather that mesh axis (R) or keep the fused weight's blocks "
                              "unsplit (colwise) before exporting to MindSpore")
    if layout.has_partial() and not partial_ok:
        raise not_expressible(TARGET, what, name, layout, "a shard strategy has no partial-sum input",
                              "reduce it first (an all-reduce in the graph) or give that input R or S(d)")


def strategy(layout: Layout, what: str, name: str) -> tuple[int, ...]:
    """How many pieces each dim of ``layout`` is cut into (MindSpore's plain strategy)."""
    _refuse(layout, what, name)
    return tuple(layout.shard_count(d) for d in range(layout.ndim))


def alias_map(layout: Layout) -> tuple:
    """``layout``'s tensor_map in MindSpore's ``Layout`` alias form (``"None"`` for an uncut dim)."""
    return _alias_map(layout)


def node_strategies(plan: ExportPlan) -> dict[str, dict]:
    """Each op node's ``op``, ``in_strategy``, ``in_layout`` and ``out_strategy`` (None where partial)."""
    out = {}
    for node in plan.nodes:
        if node.op == "redistribute":  # plan's explicit moves: MindSpore inserts its own redistributions
            continue
        ins, maps = [], []
        for value, layout in zip(node.inputs, node.in_layouts):
            if layout is None:
                continue
            what = f"operand {value!r} of node"
            ins.append(strategy(layout, what, node.name))
            maps.append(alias_map(layout))
        outs = []
        for layout in node.out_layouts:
            if layout is None:
                continue
            _refuse(layout, "the output of node", node.name, partial_ok=True)
            outs.append(None if layout.has_partial() else tuple(layout.shard_count(d) for d in range(layout.ndim)))
        out[node.name] = {"op": node.op, "in_strategy": tuple(ins), "in_layout": tuple(maps),
                          "out_strategy": tuple(outs) if outs and None not in outs else None}
    return out


def export_mindspore(plan: ExportPlan) -> str:
    """The Python module text for ``plan`` (see the module docstring)."""
    refuse_config(plan, TARGET)
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
        "",
        "STRATEGIES = {",
    ]
    for name, s in strategies.items():
        lines.append(f"    {name!r}: {{'op': {s['op']!r}, 'in_strategy': {s['in_strategy']!r}, "
                     f"'in_layout': {s['in_layout']!r}, 'out_strategy': {s['out_strategy']!r}}},")
    lines.append("}")
    lines.append("")
    lines.append("PARAMETER_LAYOUTS = {")
    for name, t in own_parameters(plan, TARGET):  # constants and tied copies are no parameters of the model
        lines.append(f"    {name!r}: {alias_map(t.layout)!r},")
    lines.append("}")
    lines.append("INPUT_STRATEGIES = {")
    for name, t in plan.inputs.items():
        lines.append(f"    {name!r}: {strategy(t.layout, 'input', name)!r},")
    lines.append("}")
    lines += [
        "",
        "",
        "def in_layouts(name):",
        '    """Node ``name``\'s operands as MindSpore Layouts (for shard(in_strategy=...) with several axes on a dim)."""',
        "    from mindspore.parallel import Layout",
        "",
        "    layout = Layout(DEVICE_MATRIX, ALIAS_NAME)",
        "    return tuple(layout(*alias) for alias in STRATEGIES[name]['in_layout'])",
    ]
    return "\n".join(lines) + "\n"
