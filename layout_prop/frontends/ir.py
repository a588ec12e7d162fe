"""The importers' intermediate graph, and its lowering to an ordinary spec.

A frontend (ONNX, MindIR) reads a model into a :class:`ModelGraph`: values with static
shapes and dtypes (constants carry their numpy value), and nodes whose ``op`` is a
neutral name: a registry op (``add``, ``softmax``, ``reshape``...) or one of the
decomposed ops the canonicalisation pass fuses away (``pow``, ``sqrt``, ``rsqrt``,
``reciprocal``, ``sigmoid``, ``where``...), with ``source`` the model's own op type for
messages.  ``matmul_nd`` is numpy's matmul (either operand may be batched).

:func:`to_spec` lowers a canonicalised ModelGraph to a spec dict (every runtime input
and every weight still used becomes a spec input; scalar constants fold into attrs; an
op the registry does not know is an error listing every unknown op type, or with
``opaque=True`` a barrier node).  :func:`parameter_uses` tells the plan how each weight
is consumed.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
import numpy as np

from layout_prop.core.errors import OpError, SpecError
from layout_prop.core.graph import fresh_name
from layout_prop.io.plan_file import ParamUse, ShardingPlan, resolve_parameters

__all__ = ["Value", "MNode", "ModelGraph", "to_spec", "parameter_uses", "apply_plan", "sanitize", "scalar_value",
           "compare_declared", "WHY_UNMAPPED"]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")

#: the attr of an op a frontend leaves unmapped that says why (``sparse_mode 5 ... is not one
#: flash_attention_score takes``): the ``unknown-op`` error names it beside the op type
WHY_UNMAPPED = "why_unmapped"


@dataclass
class Value:
    """A value of the model: a static shape, a dtype, and for a constant its numpy value.

    ``weight`` marks a value stored in the model file (an ONNX initializer, a MindIR
    parameter): if it survives canonicalisation it becomes a spec input the plan's
    ``parameters`` patterns match.
    """

    name: str
    shape: tuple[int, ...] | None
    dtype: str
    const: np.ndarray | None = None
    weight: bool = False


@dataclass(eq=False)
class MNode:
    """A node of the model graph; ``source`` is the model's op type (``MatMul``, ``REF::Pow``)."""

    name: str
    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict = field(default_factory=dict)
    source: str = ""


class ModelGraph:
    """A mutable graph the frontends build and the canonicalisation pass rewrites."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.values: dict[str, Value] = {}
        self.inputs: list[str] = []
        self.nodes: list[MNode] = []
        self.outputs: list[str] = []
        self.notes: list[str] = []
        # a weight's name for plans when the file's is the exporter's own (val_113 -> torch's
        # model.layers.0.self_attn.q_proj.weight), and the other names of a tensor the exporter
        # de-duplicated (one tensor for several parameters of equal value)
        self.param_names: dict[str, str] = {}
        self.aliases: dict[str, list[str]] = {}
        # weights computed from no parameter (rotary cos/sin tables folded by the exporter): constants
        self.constants: set[str] = set()
        # after to_spec: each weight's other names, by spec names (what the plan's patterns match)
        self.spec_aliases: dict[str, list[str]] = {}
        # after to_spec: the model's own name of each constant or weight input, by spec name
        self.spec_sources: dict[str, str] = {}
        # (node, input values, the split count per dim of each) a model declares (MindSpore shard())
        self.declared: list[tuple[str, list[str | None], tuple]] = []
        # the torch module path of the node producing a value (model.layers.0.self_attn.o_proj), from the
        # exporter's node metadata when a plan pins activations; after to_spec, by spec value name
        # (spec_modules) beside every value the spec's nodes produce (spec_values)
        self.modules: dict[str, str] = {}
        self.spec_modules: dict[str, str] = {}
        self.spec_values: list[str] = []

    # -------------------------------------------------------------- building
    def add_value(self, value: Value) -> str:
        self.values[value.name] = value
        return value.name

    def const(self, name: str) -> np.ndarray | None:
        value = self.values.get(name)
        return None if value is None else value.const

    def shape(self, name: str) -> tuple[int, ...] | None:
        value = self.values.get(name)
        return None if value is None else value.shape

    def producers(self) -> dict[str, MNode]:
        return {out: node for node in self.nodes for out in node.outputs}

    def uses(self) -> dict[str, list[tuple[MNode, int]]]:
        out: dict[str, list[tuple[MNode, int]]] = {}
        for node in self.nodes:
            for i, value in enumerate(node.inputs):
                out.setdefault(value, []).append((node, i))
        return out

    def replace_uses(self, old: str, new: str) -> None:
        """Every use of ``old`` (node inputs and graph outputs) reads ``new`` instead."""
        for node in self.nodes:
            if old in node.inputs:
                node.inputs = [new if v == old else v for v in node.inputs]
        self.outputs = [new if v == old else v for v in self.outputs]

    def prune(self) -> None:
        """Drop nodes whose outputs nothing reads (outputs are read by the graph)."""
        live = set(self.outputs)
        kept = []
        for node in reversed(self.nodes):
            if any(v in live for v in node.outputs):
                kept.append(node)
                live.update(node.inputs)
        self.nodes = kept[::-1]

    def fresh(self, base: str) -> str:
        return fresh_name(base, self.values.__contains__, sep="_", first=1)


_BAD = re.compile(r"[:@#]")


def sanitize(name: str) -> str:
    """A spec-safe value name: no ``:``, ``@`` or ``#``, no leading ``/``."""
    name = _BAD.sub("_", name).lstrip("/") or "v"
    if name.startswith(("grad/", "grad_", "cotangent/")):
        name = "m_" + name
    return name


def scalar_value(array: np.ndarray) -> float:
    """A size-1 constant as a Python float; a float32 one as the shortest decimal that rounds
    to it (an eps written ``1e-6`` in the model reads ``1e-06``, not ``9.99999997e-07``)."""
    item = np.asarray(array).reshape(())
    return float(str(item)) if item.dtype == np.float32 else float(item.item())


def _is_scalar(array: np.ndarray | None) -> bool:
    return array is not None and array.size == 1


def to_spec(model: ModelGraph, *, opaque: bool = False) -> tuple[dict, list[str]]:
    """Lower a canonicalised model graph to a spec dict (mesh and placements not yet set).

    Returns the spec and the names of its weight inputs (the plan's parameters).

    Raises
    ------
    OpError
        ``unknown-op`` listing every op type the registry does not know, with its count,
        first node and the reasons its nodes carry (:data:`WHY_UNMAPPED`), unless ``opaque``
        keeps them (an op of one output only).
    """
    from layout_prop.core.registry import get_rule

    model.prune()
    spec_name: dict[str, str] = {}
    taken: set[str] = set()

    def unique(base: str) -> str:
        name, k = sanitize(base), 1
        while name in taken:
            name, k = f"{sanitize(base)}_{k}", k + 1
        taken.add(name)
        return name

    inputs: dict[str, dict] = {}
    weights: list[str] = []
    aliases: dict[str, list[str]] = {}
    constants: list[str] = []  # float weights computed from no parameter (requires_grad false)
    for name in model.inputs:
        v = model.values[name]
        spec_name[name] = unique(name)
        inputs[spec_name[name]] = {"shape": list(v.shape), "dtype": v.dtype,
                                   "requires_grad": v.dtype in FLOAT_DTYPES}
    unknown: Counter = Counter()
    first: dict[str, str] = {}
    reasons: dict[str, list[str]] = {}  # each unknown op type's distinct reasons, in node order
    several: dict[str, tuple[str, int]] = {}  # op types --opaque cannot keep: first such node, its outputs
    nodes: list[dict] = []

    def use(value: str) -> str:
        if value in spec_name:
            return spec_name[value]
        v = model.values[value]
        if v.const is None:
            raise SpecError("bad-model", f"value {value!r} is used but never produced", node=value,
                            hint="the model file is inconsistent; re-export it")
        if v.const.dtype == object or v.shape is None:
            raise SpecError("bad-model", f"constant {value!r} is not a tensor", node=value,
                            hint="the model file is inconsistent; re-export it")
        spec_name[value] = unique(model.param_names.get(value, value))
        model.spec_sources[spec_name[value]] = value
        trainable = v.weight and v.dtype in FLOAT_DTYPES and value not in model.constants and \
            not is_computed_table(model.param_names.get(value, value))
        inputs[spec_name[value]] = {"shape": list(v.shape), "dtype": v.dtype, "requires_grad": trainable}
        if trainable:
            weights.append(spec_name[value])
            if model.aliases.get(value):
                aliases[spec_name[value]] = [sanitize(a) for a in model.aliases[value]]
        elif v.weight and v.dtype in FLOAT_DTYPES and v.const.size > 1:
            constants.append(spec_name[value])
        return spec_name[value]

    def emit(base: str, op: str, args: list[str], attrs: dict, outputs: list[str], module: str = "") -> None:
        name = unique(base)  # the node's own name when it has one (/layers.0/attention/wq/MatMul)
        nodes.append({"name": name, "op": op, "inputs": args, "attrs": attrs})
        if len(outputs) == 1:
            spec_name[outputs[0]] = name
        else:
            for i, out in enumerate(outputs):
                spec_name[out] = f"{name}:{i}"
        if model.modules:  # a plan pins activations of a model with module paths
            for out in outputs:
                model.spec_values.append(spec_name[out])
                if module:
                    model.spec_modules[spec_name[out]] = module

    for node in model.nodes:
        lowered = _lower(model, node)
        if lowered is None:
            try:
                get_rule(node.op)
                known = True
            except OpError:
                known = False
            if not known or node.op in _NOT_LOWERED:
                if not opaque or len(node.outputs) != 1:
                    unknown[node.source] += 1
                    first.setdefault(node.source, node.name)
                    why = node.attrs.get(WHY_UNMAPPED)
                    if why and why not in reasons.setdefault(node.source, []):
                        reasons[node.source].append(why)
                    if len(node.outputs) != 1:
                        several.setdefault(node.source, (node.name, len(node.outputs)))
                    continue
                if unknown:  # the error comes: an opaque node may read an unknown one's outputs, never produced
                    continue
                out = model.values[node.outputs[0]]
                emit(node.name, "opaque", [use(v) for v in node.inputs if model.values[v].const is None
                                                 or model.values[v].const.size > 1],
                     {"op_type": node.source, "shape": list(out.shape), "dtype": out.dtype}, node.outputs)
                model.notes.append(f"node {sanitize(node.name)} ({node.source}) is opaque: its inputs are "
                                   "gathered to Replicate, its output is Replicate")
                continue
            lowered = [(node.op, node.inputs, dict(node.attrs))]
        if unknown:
            continue
        # a chain: each step reads the previous step's output (or the node's inputs)
        prev = None
        for k, (op, args, attrs) in enumerate(lowered):
            last = k == len(lowered) - 1
            outs = node.outputs if last else [f"{node.outputs[0]}__{k}"]
            args = [prev if a == "__prev__" else a for a in args]
            base = node.name if last else f"{node.name}__{k}"
            emit(base, op, [spec_name[a] if a in spec_name else use(a) for a in args], attrs, outs,
                 model.modules.get(node.outputs[0], ""))
            prev = outs[0]
    if unknown:
        raise unknown_op_error(unknown, first, reasons, several, opaque)
    outputs = [spec_name[v] if v in spec_name else use(v) for v in model.outputs]
    spec = {"inputs": inputs, "nodes": nodes, "outputs": outputs}
    tables = rotary_tables(spec, weights)
    for name in tables:
        inputs[name]["requires_grad"] = False
    weights = [w for w in weights if w not in tables]
    constants += tables
    if constants:
        model.notes.append(f"{len(constants)} weight(s) computed from no parameter (rotary tables, masks) are "
                           f"constants without a gradient: {', '.join(constants)}")
    model.spec_aliases = {w: a for w, a in aliases.items() if w in weights}
    return spec, weights


#: the most reasons the ``unknown-op`` line names for one op type (the import notes say each node's)
MAX_REASONS = 3


def unknown_op_error(unknown: Counter, first: dict[str, str], reasons: dict[str, list[str]],
                     several: dict[str, tuple[str, int]], opaque: bool) -> OpError:
    """The one ``unknown-op`` error for the op types an import could not map.

    Parameters
    ----------
    unknown : Counter
        How many nodes of each op type (the model's own name) are unmapped.
    first : dict
        The first such node of each op type.
    reasons : dict
        The distinct reasons the frontend gave (:data:`WHY_UNMAPPED`) for an op type's nodes.
    several : dict
        The op types ``--opaque`` cannot keep (an opaque node has one output): their first
        such node and its number of outputs.
    opaque : bool
        Whether ``--opaque`` was passed.

    Returns
    -------
    OpError
        One line: each op type with its count, its first node and its reasons; the hint
        offers ``--opaque`` for the op types it can keep.

    Examples
    --------
    >>> unknown_op_error(Counter({"Abs": 2}), {"Abs": "mlp/Abs"}, {"Abs": ["its x is complex"]}, {}, False).message
    '1 op type(s) the importer cannot map: Abs (x2, first mlp/Abs: its x is complex)'
    """
    listed = ", ".join(_unknown_op_item(op, n, first[op], reasons.get(op, [])) for op, n in unknown.most_common())
    return OpError("unknown-op", f"{len(unknown)} op type(s) the importer cannot map: {listed}",
                   hint=_unknown_op_hint(unknown, several, opaque))


def _unknown_op_item(op: str, count: int, first: str, reasons: list[str]) -> str:
    """``Op (xN, first NODE)``, with the reasons after the node when the frontend gave any."""
    why = "; ".join(reasons[:MAX_REASONS])
    if len(reasons) > MAX_REASONS:
        why += f"; {len(reasons) - MAX_REASONS} more reason(s) in the import notes (--opaque)"
    return f"{op} (x{count}, first {sanitize(first)}{': ' + why if why else ''})"


def _unknown_op_hint(unknown: Counter, several: dict[str, tuple[str, int]], opaque: bool) -> str:
    """Pass ``--opaque`` when it keeps every unknown op; else say which ops it cannot keep."""
    barrier = "(inputs gathered, output replicated)"
    if not several:
        return f"pass --opaque to treat each as a barrier {barrier}, or write the model with supported ops"
    kept = ", ".join(f"{op} (first {sanitize(name)}) has {k} outputs" for op, (name, k) in several.items())
    cannot = f"--opaque keeps only an op with one output as a barrier, and {kept}: write the model with supported ops"
    if opaque or len(several) == len(unknown):
        return cannot
    return f"pass --opaque to treat the others as barriers {barrier}; {cannot}"


#: names of buffers and tables computed from no parameter (Hugging Face's rotary embedding
#: keeps ``inv_freq`` and, in older releases, ``cos_cached``/``sin_cached``): never trainable
COMPUTED_TABLE_PATTERNS = ("*rotary_emb.*", "*rotary_emb_*", "*.inv_freq", "*_cached")


def is_computed_table(name: str) -> bool:
    """Whether ``name`` names a rotary table or buffer (:data:`COMPUTED_TABLE_PATTERNS`)."""
    import fnmatch

    return any(fnmatch.fnmatchcase(name, p) for p in COMPUTED_TABLE_PATTERNS)


#: ops that move or copy a table's elements without computing new ones (followed from a weight
#: to the op that reads it)
_TABLE_MOVES = {"reshape", "unsqueeze", "squeeze", "slice", "slice_step", "concat", "cast", "identity", "transpose"}


def rotary_tables(spec: dict, weights: list[str]) -> list[str]:
    """The weights of ``spec`` read (through reshapes, slices, concats, casts...) only as the cos
    or sin operand of ``rotary_position_embedding``: tables the exporter computed and folded, not
    parameters (a gradient into them would be computed and all-reduced for nothing)."""
    consumers: dict[str, list[tuple[dict, int]]] = {}
    for nd in spec["nodes"]:
        for i, v in enumerate(nd["inputs"]):
            consumers.setdefault(v, []).append((nd, i))
    out = []
    for w in weights:
        stack, seen, ends = [w], {w}, []
        while stack:
            for nd, i in consumers.get(stack.pop(), []):
                if nd["op"] in _TABLE_MOVES:
                    if nd["name"] not in seen:
                        seen.add(nd["name"])
                        stack.append(nd["name"])
                else:
                    ends.append((nd["op"], i))
        if ends and all(op == "rotary_position_embedding" and i in (1, 2) for op, i in ends):
            out.append(w)
    return out


# decomposed ops the registry does not know (the canonicalisation pass fuses them away)
# (pow is lowered with its exponent as an attr; sqrt, sigmoid... are layout_prop.frontends.pointwise ops)
_NOT_LOWERED = {"pow", "expand", "tile", "take", "matmul_nd", "split"}


def _registered(op: str) -> bool:
    from layout_prop.core.registry import is_registered

    return is_registered(op)


def _lower(model: ModelGraph, node: MNode) -> list[tuple[str, list[str], dict]] | None:
    """A registry-op chain for a neutral node, or None when the node is a registry op as is
    (or unknown: the caller decides)."""
    op, a = node.op, node.attrs
    consts = [model.const(v) for v in node.inputs]
    if op == "matmul_nd":
        x, w = node.inputs
        if len(model.shape(w)) == 2 and len(model.shape(x)) >= 2:
            return [("matmul", [x, w], {"transpose_a": bool(a.get("transpose_a")),
                                          "transpose_b": bool(a.get("transpose_b"))})]
        return [("batch_matmul", [x, w], {"transpose_a": bool(a.get("transpose_a")),
                                            "transpose_b": bool(a.get("transpose_b"))})]
    if op in ("mul", "div") and len(node.inputs) == 2:
        x, y = node.inputs
        if _is_scalar(consts[1]) and model.values[x].dtype in FLOAT_DTYPES:
            c = scalar_value(consts[1])
            if op == "div" and c == 0:
                return None
            return [("scale", [x], {"factor": c if op == "mul" else 1.0 / c})]
        if op == "mul" and _is_scalar(consts[0]) and model.values[y].dtype in FLOAT_DTYPES:
            return [("scale", [y], {"factor": scalar_value(consts[0])})]
    if op == "expand":  # numpy broadcasting to the output's shape, by unsqueezes and concats of copies
        x = node.inputs[0]
        src, out = model.shape(x), model.shape(node.outputs[0])
        if src is None or out is None or len(out) < len(src):
            return None
        steps: list[tuple[str, list[str], dict]] = []
        shape = (1,) * (len(out) - len(src)) + tuple(src)
        for _ in range(len(out) - len(src)):
            steps.append(("unsqueeze", [x if not steps else "__prev__"], {"dim": 0}))
        copies = [(d, t) for d, (s_, t) in enumerate(zip(shape, out)) if s_ != t]
        if any(shape[d] != 1 for d, _ in copies):
            return None  # not a broadcast
        if int(np.prod([t for _, t in copies] or [1])) > 64:  # too many copies to spell out: torch's expand
            return [("expand", [x], {"shape": list(out)})] if _registered("expand") else None
        for d, t in copies:
            steps.append(("concat", [x if not steps else "__prev__"] * t, {"axis": d}))
        return steps or [("identity", [x], {})]
    if op == "take":  # numpy's take (ONNX Gather) with a 1-D index: index_select
        x, index = node.inputs
        rank = len(model.shape(x))
        if len(model.shape(index)) != 1 or not -rank <= a.get("axis", 0) < rank:
            return None
        return [("index_select", [x, index], {"dim": a.get("axis", 0) % rank})]
    if op == "tile":  # copies side by side along each dim: concatenations of the whole tensor
        copies = [(d, m) for d, m in enumerate(a["multiples"]) if m != 1]
        if any(m < 1 for _, m in copies) or int(np.prod([m for _, m in copies] or [1])) > 64:
            return None
        steps = [("concat", [node.inputs[0] if k == 0 else "__prev__"] * m, {"axis": d})
                 for k, (d, m) in enumerate(copies)]
        return steps or [("identity", [node.inputs[0]], {})]
    if op == "pow":
        if _is_scalar(consts[1]) and model.values[node.inputs[0]].dtype in FLOAT_DTYPES:
            return [("pow", [node.inputs[0]], {"exponent": scalar_value(consts[1])})]
        return None
    if op == "split":
        n = len(node.outputs)
        if 2 <= n <= 8:
            return [(f"split{n}", [node.inputs[0]], {"axis": a["axis"], "sizes": list(a["sizes"])})]
        if n > 8:  # torch's split: as many outputs as sizes
            return [("split", [node.inputs[0]], {"axis": a["axis"], "split_size_or_sections": list(a["sizes"])})]
        return None
    if op == "unsqueeze":
        dims = sorted(a["dims"])
        steps, src = [], node.inputs[0]
        for k, d in enumerate(dims):
            steps.append(("unsqueeze", [src if k == 0 else "__prev__"], {"dim": d}))
        return steps
    if op == "squeeze":
        rank = len(model.shape(node.inputs[0]))
        dims = sorted((d % rank for d in a["dims"]), reverse=True)
        steps = []
        for k, d in enumerate(dims):
            steps.append(("squeeze", [node.inputs[0] if k == 0 else "__prev__"], {"dim": d}))
        return steps or [("identity", [node.inputs[0]], {})]
    if op == "slice":
        if a.get("step", 1) != 1:
            return None
        return [("slice", [node.inputs[0]], {"axis": a["axis"], "start": a["start"], "stop": a["stop"]})]
    return None


def parameter_uses(spec: dict, weights: list[str]) -> dict[str, list[ParamUse]]:
    """How each weight input of ``spec`` is consumed (through transposes, casts and identities)."""
    consumers: dict[str, list[tuple[dict, int]]] = {}
    for nd in spec["nodes"]:
        for i, v in enumerate(nd["inputs"]):
            consumers.setdefault(v, []).append((nd, i))
    out: dict[str, list[ParamUse]] = {}
    for w in weights:
        rank = len(spec["inputs"][w]["shape"])
        found: list[ParamUse] = []
        stack = [(w, list(range(rank)))]  # value, and which weight dim each of its dims is
        while stack:
            value, dims = stack.pop()
            for nd, i in consumers.get(value, []):
                op, attrs = nd["op"], nd["attrs"]
                if op in ("cast", "identity"):
                    stack.append((nd["name"], dims))
                elif op == "transpose" and attrs.get("dims") is not None:
                    stack.append((nd["name"], [dims[d] for d in attrs["dims"]]))
                elif op == "transpose" and len(dims) == 2:
                    stack.append((nd["name"], dims[::-1]))
                elif len(dims) != 2:
                    continue  # a product with a weight of another rank: no preset fits it
                elif op in ("matmul", "batch_matmul") and i == 1:
                    k, n = (1, 0) if attrs.get("transpose_b") else (0, 1)
                    found.append(ParamUse(op, out_dim=dims[n], in_dim=dims[k]))
                elif op == "linear" and i == 1:
                    found.append(ParamUse(op, out_dim=dims[0], in_dim=dims[1]))
                elif op == "embedding" and i == 1:
                    found.append(ParamUse(op, out_dim=dims[1], in_dim=dims[0], embedding=True))
        out[w] = found
    return out


def apply_plan(spec: dict, weights: list[str], plan: ShardingPlan, aliases: dict[str, list[str]] | None = None,
               notes: list[str] | None = None) -> dict:
    """Set the plan's mesh, input layouts and parameter layouts on a lowered spec (a new dict).

    ``aliases`` gives the other names of a weight the exporter de-duplicated (one tensor for
    several parameters): a pattern matching any of its names applies to it, a note (in
    ``notes``) says the tensor is shared, and names given different layouts are ``bad-plan``."""
    spec = {"mesh": dict(plan.mesh_data), "inputs": {k: dict(v) for k, v in spec["inputs"].items()},
            "nodes": spec["nodes"], "outputs": spec["outputs"]}
    if plan.constraints:  # pinned activations: the loader pins the values they match (io/constraints.py)
        spec["constraints"] = plan.constraints_entry()
    weight_set = set(weights)
    runtime = [n for n in spec["inputs"] if n not in weight_set]
    for name, entry in plan.inputs.items():
        if sanitize(name) not in spec["inputs"] or sanitize(name) in weight_set:
            raise SpecError("unknown-input", f"the plan names input {name!r}, which the model does not have",
                            path=f"inputs.{name}", hint=f"the model's inputs are {runtime}")
        target = spec["inputs"][sanitize(name)]
        for key in ("placements", "tensor_map", "requires_grad"):
            if key in entry:
                target[key] = entry[key]
    aliases = {w: [a for a in aliases.get(w, ()) if a != w] for w in weights} if aliases else {}
    shapes = {w: spec["inputs"][w]["shape"] for w in weights}
    uses = parameter_uses(spec, weights)
    for w, names in aliases.items():  # each other name resolves as a parameter of its own, then they must agree
        for a in names:
            shapes.setdefault(a, shapes[w])
            uses.setdefault(a, uses[w])
    resolved = resolve_parameters(plan, shapes, uses)
    for w in weights:
        spec["inputs"][w]["placements"] = resolved[w]
        if not aliases.get(w):
            continue
        others = aliases[w]
        differ = next((a for a in others if resolved[a] != resolved[w]), None)
        if differ is not None:
            raise SpecError("bad-plan", f"the plan gives {w!r} {resolved[w]} and {differ!r} {resolved[differ]}, "
                            f"but the exporter stores them as one shared tensor (also named {', '.join(others)})",
                            path="parameters", hint="give every name of a shared tensor the same layout, or "
                            "export with distinct weights")
        if notes is not None:
            shared = ", ".join([w] + others)
            notes.append(f"parameter {w} is one tensor the exporter de-duplicated, shared as {shared}: "
                         f"its layout {resolved[w]} applies to all of them")
    return spec



def compare_declared(model: ModelGraph, spec: dict) -> list[str]:
    """Notes comparing the split counts a model declares (MindSpore ``shard()`` strategies) with
    the plan's layouts of the same graph inputs and parameters (other operands are not compared)."""
    shape = spec["mesh"]["shape"]
    notes = []
    for node, values, strategy in model.declared:
        for k, (value, splits) in enumerate(zip(values, strategy)):
            entry = spec["inputs"].get(sanitize(value)) if value is not None else None
            if entry is None or not isinstance(entry.get("placements"), list):
                continue
            planned = [1] * len(entry["shape"])
            for axis, p in enumerate(entry["placements"]):
                if p.startswith("S("):
                    planned[int(p[2:-1]) % len(planned)] *= shape[axis]
            declared = [int(s) for s in splits]
            if declared != planned:
                notes.append(f"MindSpore shard() of node {sanitize(node)} splits input {k} ({sanitize(value)}) as "
                             f"{tuple(declared)}, but the plan gives {sanitize(value)} {entry['placements']}, which "
                             f"splits it as {tuple(planned)}")
    return notes
