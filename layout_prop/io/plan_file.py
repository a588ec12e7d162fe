"""Sharding plans: the mesh, the inputs' layouts and the parameters' layouts of an imported model.

A plan is YAML or JSON (a stable user interface, see docs/importing-models.md)::

    mesh: {shape: [2, 4], names: [dp, tp]}
    inputs:                          # graph inputs by name: placements or tensor_map, as in specs
      input_ids: ["S(0)", R]
    parameters:                      # fnmatch globs over parameter names; the first match wins
      "*.attention.w[qkv].weight": colwise
      "*.attention.wo.weight": rowwise
      "tok_embeddings.weight": vocab
      "*": R                         # explicit placements work too, and `auto`
    constraints:                     # pinned activations, as in specs (value names or globs -> placements)
      "*.attention.wo*": ["S(0)", "S(1)"]

A parameter's entry is a semantic preset (``colwise``, ``rowwise``, ``vocab``,
``replicate``, optionally naming the mesh axis: ``colwise(tp)``; ``tp`` by default;
``colwise_fused(K)`` / ``colwise_fused(K, tp)`` for K projections fused into one weight),
``auto``, ``R`` (replicated on every mesh axis), a list of placements (one per mesh
axis) or a mapping ``{placements: [...]}`` / ``{tensor_map: [...]}``.  An input's entry
is a list of placements, ``auto``, ``R``, or a mapping that may also give ``shape`` (for a
model whose input dims are dynamic), ``tensor_map`` and ``requires_grad`` (default: true
for a floating input).

Presets are resolved from how the parameter is consumed (:class:`ParamUse`): ``colwise``
shards the dim that becomes the consumer's output features, ``rowwise`` the contracted
dim, ``vocab`` an embedding table's rows; the user never counts dims.  ``colwise_fused(3)``
cuts each of the 3 blocks of the output features column-wise (the strided shard
``_S(d,3)``), so that a later ``split3`` into q, k and v leaves each ``S(d)`` with no
communication, as Megatron shards GPT-2's ``c_attn``.

Examples
--------
>>> plan = load_plan('''
... mesh: {shape: [2], names: [tp]}
... parameters: {"*.wq": colwise, "*": R}
... ''')
>>> use = ParamUse("matmul", out_dim=1, in_dim=0)   # an ONNX MatMul weight (in, out)
>>> resolve_parameters(plan, {"l0.wq": (8, 16), "l0.norm": (8,)}, {"l0.wq": [use], "l0.norm": []})
{'l0.wq': ['S(1)'], 'l0.norm': ['R']}
>>> fused = load_plan({"mesh": {"shape": [2], "names": ["tp"]}, "parameters": {"*.c_attn": "colwise_fused(3)"}})
>>> resolve_parameters(fused, {"h0.c_attn": (8, 24)}, {"h0.c_attn": [use]})
{'h0.c_attn': ['_S(1,3)']}
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from layout_prop.core.errors import LayoutPropError, SpecError, cut
from layout_prop.core.layout import Layout
from layout_prop.core.mesh import DeviceMesh
from layout_prop.core.placement import parse_placement
from layout_prop.core.spec import TensorSpec

__all__ = ["ShardingPlan", "ParamRule", "ParamUse", "load_plan", "resolve_parameters", "PRESETS"]

PRESETS = ("colwise", "rowwise", "vocab", "replicate", "colwise_fused")
PLAN_KEYS = {"mesh", "inputs", "parameters", "constraints"}
INPUT_KEYS = {"shape", "placements", "tensor_map", "requires_grad"}
_PRESET = re.compile(r"^\s*(colwise|rowwise|vocab|replicate)\s*(?:\(\s*([^()\s]+)\s*\))?\s*$")
_FUSED = re.compile(r"^\s*colwise_fused\s*\(\s*([^(),\s]+)\s*(?:,\s*([^(),\s]+)\s*)?\)\s*$")


@dataclass(frozen=True)
class ParamRule:
    """One ``pattern: entry`` line of a plan's ``parameters``.

    ``kind`` is ``"preset"`` (``preset`` and ``axis`` set; ``blocks`` for ``colwise_fused``),
    ``"placements"`` (``placements`` set), ``"tensor_map"`` (``tensor_map`` set) or ``"auto"``.
    """

    pattern: str
    kind: str
    preset: str | None = None
    axis: str | None = None
    placements: tuple[str, ...] | None = None
    tensor_map: tuple | None = None
    blocks: int | None = None

    @property
    def path(self) -> str:
        return f"parameters[{self.pattern!r}]"


@dataclass(frozen=True)
class ParamUse:
    """How a parameter is consumed: by a product (``matmul``, ``linear``) or an ``embedding``.

    ``out_dim`` is the parameter's dim that becomes the consumer's output features (an
    embedding table's columns), ``in_dim`` the contracted dim (an embedding table's rows).
    ``op`` is the consumer's op for messages.
    """

    op: str
    out_dim: int
    in_dim: int
    embedding: bool = False


@dataclass(frozen=True)
class ShardingPlan:
    """A parsed sharding plan (see the module docstring)."""

    mesh: DeviceMesh
    mesh_data: Mapping[str, Any]
    inputs: Mapping[str, Mapping[str, Any]]
    parameters: tuple[ParamRule, ...]
    source: str
    #: pinned activations (``constraints:``, as in specs: :mod:`layout_prop.io.constraints`)
    constraints: tuple = ()

    def constraints_entry(self) -> dict:
        """The plan's constraints as a spec's ``constraints:`` mapping (empty when it has none);
        a pin an importer resolved keeps the pattern it came from, so messages still name it."""
        return {c.pattern: {"placements": list(c.placements), "pattern": c.origin} if c.origin else list(c.placements)
                for c in self.constraints}


def _err(code: str, message: str, path: str, hint: str) -> SpecError:
    return SpecError(code, message, path=path, hint=hint)


def load_plan(source: str | Path | dict) -> ShardingPlan:
    """Read a plan from a path, YAML/JSON text or a parsed dict.

    Raises
    ------
    SpecError
        ``plan-not-found``, ``plan-too-large``, ``plan-syntax`` (also not UTF-8),
        ``plan-too-deep``, ``unknown-key``, ``bad-type``, ``bad-plan``, ``unknown-mesh-axis``
        with the entry's path and a hint.
    """
    from .loader import parse_spec

    name = "<plan>"
    if isinstance(source, dict):
        data = source
    else:
        text = str(source)
        if isinstance(source, Path) or ("\n" not in text and (text.endswith((".yaml", ".yml", ".json")) or
                                                               _is_file(text))):
            name = text
            from .loader import MAX_SPEC_BYTES
            from .reader import read_text

            text = read_text(Path(source), MAX_SPEC_BYTES, what="plan", missing="plan-not-found",
                             too_large="plan-too-large", syntax="plan-syntax",
                             hint="give the path of a YAML or JSON sharding plan")
        try:
            data = parse_spec(text, name, what="plan")
        except SpecError as err:  # the spec reader's codes (spec-syntax, spec-too-deep...) said of a plan
            if not err.code.startswith("spec-"):
                raise
            raise SpecError("plan-" + err.code[len("spec-"):], err.message, path=err.path, node=err.node,
                            input=err.input, hint=err.hint) from None
    if not isinstance(data, dict):
        raise _err("bad-type", f"a plan is a mapping, got {type(data).__name__}", "plan",
                   "write mesh, inputs and parameters")
    from .reader import check_keys

    check_keys(data, PLAN_KEYS, "plan")
    if "mesh" not in data:
        raise _err("missing-key", "the plan has no mesh", "mesh", "add mesh: {shape: [2, 4], names: [dp, tp]}")
    mesh = _mesh(data["mesh"])
    inputs = data.get("inputs") or {}
    if not isinstance(inputs, dict):
        raise _err("bad-type", f"inputs must be a mapping of input name -> placements, got {inputs!r}", "inputs",
                   "write inputs: {x: [\"S(0)\", R]}")
    parsed_inputs = {str(k): _input_entry(mesh, k, v) for k, v in inputs.items()}
    params = data.get("parameters") or {}
    if not isinstance(params, dict):
        raise _err("bad-type", f"parameters must be a mapping of glob -> entry, got {params!r}", "parameters",
                   "write parameters: {\"*.wq.weight\": colwise}")
    rules = tuple(_param_rule(mesh, str(pattern), entry) for pattern, entry in params.items())
    from .constraints import parse_constraints

    constraints = parse_constraints(data.get("constraints"), mesh)
    return ShardingPlan(mesh, dict(data["mesh"]), parsed_inputs, rules, name, constraints)


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False


def _mesh(data: Any) -> DeviceMesh:
    from .loader import _mesh as spec_mesh

    return spec_mesh(data)


def _check_placements(mesh: DeviceMesh, raw: Any, path: str) -> tuple[str, ...]:
    if not isinstance(raw, list):
        raise _err("bad-type", f"placements must be a list, got {raw!r}", path,
                   "write one placement per mesh axis, like [\"S(0)\", R]")
    if len(raw) != mesh.ndim:
        raise _err("invalid-layout", f"{len(raw)} placements for a mesh of {mesh.ndim} axes {list(mesh.names)}",
                   path, "give one placement per mesh axis")
    out = []
    for i, p in enumerate(raw):
        try:
            out.append(str(parse_placement(p)))
        except LayoutPropError as err:
            raise _err(err.code, err.message, f"{path}[{i}]", err.hint or "write R, S(d), P or P(op)") from None
    return tuple(out)


def _input_entry(mesh: DeviceMesh, name: Any, entry: Any) -> dict:
    path = f"inputs.{name}"
    if entry in ("R", "Replicate"):
        entry = ["R"] * mesh.ndim
    if entry == "auto" or isinstance(entry, list):
        entry = {"placements": entry}
    if not isinstance(entry, dict):
        raise _err("bad-type", f"input {name!r} takes placements, auto, or a mapping, got {entry!r}", path,
                   "write [\"S(0)\", R], auto, or {shape: [...], placements: [...]}")
    unknown = sorted(set(entry) - INPUT_KEYS)
    if unknown:
        raise _err("unknown-key", f"unknown key(s) {unknown}", f"{path}.{unknown[0]}",
                   f"allowed keys: {sorted(INPUT_KEYS)}")
    if "placements" in entry and "tensor_map" in entry:
        raise _err("conflicting-keys", "both placements and tensor_map are given", path,
                   "give exactly one of placements and tensor_map")
    out: dict = {}
    if "shape" in entry:
        shape = entry["shape"]
        if not isinstance(shape, list) or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape):
            raise _err("bad-type", f"shape must be a list of sizes, got {shape!r}", f"{path}.shape",
                       "write shape: [2, 8]")
        out["shape"] = list(shape)
    if "requires_grad" in entry:
        if not isinstance(entry["requires_grad"], bool):
            raise _err("bad-type", f"requires_grad must be true or false, got {entry['requires_grad']!r}",
                       f"{path}.requires_grad", "write requires_grad: false")
        out["requires_grad"] = entry["requires_grad"]
    if entry.get("placements") == "auto":
        out["placements"] = "auto"
    elif "placements" in entry:
        out["placements"] = list(_check_placements(mesh, entry["placements"], f"{path}.placements"))
    elif "tensor_map" in entry:
        if not isinstance(entry["tensor_map"], list):
            raise _err("bad-type", f"tensor_map must be a list, got {entry['tensor_map']!r}", f"{path}.tensor_map",
                       "write one entry per tensor dim, like [1, -1]")
        out["tensor_map"] = list(entry["tensor_map"])
    return out


def _param_rule(mesh: DeviceMesh, pattern: str, entry: Any) -> ParamRule:
    path = f"parameters[{pattern!r}]"
    if isinstance(entry, str):
        if entry.strip() == "auto":
            return ParamRule(pattern, "auto")
        if entry.strip() in ("R", "Replicate", "Replicate()"):
            return ParamRule(pattern, "placements", placements=("R",) * mesh.ndim)
        if _FUSED.match(entry) or entry.strip().startswith("colwise_fused"):
            return _fused_rule(mesh, pattern, entry, path)
        m = _PRESET.match(entry)
        if m is None:
            raise _err("bad-plan", f"{entry!r} is not a preset, auto, R, or a list of placements", path,
                       f"write one of {', '.join(PRESETS[:4])} (optionally with a mesh axis: colwise(tp)), "
                       "colwise_fused(3) for a fused q/k/v weight, auto, R, or placements like [R, \"S(0)\"]")
        preset, axis = m.group(1), m.group(2)
        if preset != "replicate":
            axis = axis or "tp"
            if axis not in mesh.names:
                raise _err("unknown-mesh-axis", f"{entry!r} names mesh axis {axis!r}, which the mesh "
                           f"{list(mesh.names)} does not have", path,
                           f"name one of {list(mesh.names)}: {preset}({mesh.names[-1]})")
        return ParamRule(pattern, "preset", preset=preset, axis=axis)
    if isinstance(entry, list):
        return ParamRule(pattern, "placements", placements=_check_placements(mesh, entry, path))
    if isinstance(entry, dict):
        keys = set(entry)
        if keys == {"placements"}:
            if entry["placements"] == "auto":
                return ParamRule(pattern, "auto")
            return ParamRule(pattern, "placements",
                             placements=_check_placements(mesh, entry["placements"], f"{path}.placements"))
        if keys == {"tensor_map"} and isinstance(entry["tensor_map"], list):
            tm = tuple(tuple(e) if isinstance(e, list) else e for e in entry["tensor_map"])
            return ParamRule(pattern, "tensor_map", tensor_map=tm)
    raise _err("bad-plan", f"cannot read the entry {entry!r}", path,
               "write a preset (colwise, rowwise, vocab, replicate), auto, R, a list of placements, "
               "{placements: [...]} or {tensor_map: [...]}")


def _fused_rule(mesh: DeviceMesh, pattern: str, entry: str, path: str) -> ParamRule:
    """``colwise_fused(K)`` or ``colwise_fused(K, AXIS)``: K projections fused along the output features
    (GPT-2's ``c_attn``, Phi-3's ``qkv_proj`` and ``gate_up_proj``), each cut column-wise on AXIS
    (``tp`` by default): the strided shard ``_S(out, K)``, as Megatron shards a fused weight."""
    m = _FUSED.match(entry)
    count = m.group(1) if m else None
    if count is None or not count.isdigit() or int(count) < 2:
        raise _err("bad-plan", f"{entry!r} does not give a number of fused projections >= 2", path,
                   "write colwise_fused(3) for q/k/v fused into one weight, colwise_fused(2) for gate/up, "
                   "optionally with a mesh axis: colwise_fused(3, tp)")
    axis = m.group(2) or "tp"
    if axis not in mesh.names:
        raise _err("unknown-mesh-axis", f"{entry!r} names mesh axis {axis!r}, which the mesh {list(mesh.names)} "
                   "does not have", path, f"name one of {list(mesh.names)}: colwise_fused({count}, "
                   f"{mesh.names[-1]})")
    return ParamRule(pattern, "preset", preset="colwise_fused", axis=axis, blocks=int(count))


def resolve_parameters(plan: ShardingPlan, shapes: Mapping[str, Sequence[int]],
                       uses: Mapping[str, Sequence[ParamUse]]) -> dict[str, Any]:
    """Each parameter's spec entry: a placements list, ``"auto"`` or ``{"tensor_map": [...]}``.

    ``shapes`` maps every parameter name (in graph order) to its shape and ``uses`` to
    how it is consumed.  A parameter no pattern matches is replicated.

    Raises
    ------
    SpecError
        ``unmatched-pattern`` (a pattern that matches no parameter), ``preset-misfit``
        (a preset the consumer does not fit), ``invalid-layout`` (placements that cannot
        exist for the matched parameter), each naming the pattern.
    """
    names = list(shapes)
    for rule in plan.parameters:
        if not any(fnmatch.fnmatchcase(n, rule.pattern) for n in names):
            close = [n for n in names if fnmatch.fnmatchcase(n, "*" + rule.pattern.strip("*") + "*")][:1]
            hint = f"did you mean a pattern matching {close[0]!r}?" if close else \
                f"parameters are named like {names[0]!r}" if names else "the model has no parameters"
            raise _err("unmatched-pattern", f"pattern {rule.pattern!r} matches no parameter", rule.path, hint)
    out: dict[str, Any] = {}
    for name in names:
        rule = next((r for r in plan.parameters if fnmatch.fnmatchcase(name, r.pattern)), None)
        shape = tuple(shapes[name])
        if rule is None:
            out[name] = ["R"] * plan.mesh.ndim
        elif rule.kind == "auto":
            out[name] = "auto"
        elif rule.kind == "tensor_map":
            try:
                layout = Layout.from_tensor_map(plan.mesh, list(rule.tensor_map))
                TensorSpec(shape, "float32", layout)
            except LayoutPropError as err:
                raise _err(err.code, f"{err.message} (parameter {name!r}, shape {list(shape)})", rule.path,
                           err.hint or "fix the tensor_map") from None
            out[name] = list(layout.placement_strs())
        elif rule.kind == "placements":
            out[name] = _valid(plan, rule, name, shape, list(rule.placements))
        else:
            out[name] = _valid(plan, rule, name, shape, _preset_placements(plan, rule, name, shape,
                                                                               list(uses.get(name, ()))))
    return out


def _valid(plan: ShardingPlan, rule: ParamRule, name: str, shape: tuple, placements: list[str]) -> list[str]:
    try:
        TensorSpec(shape, "float32", Layout(plan.mesh, placements, len(shape)))
    except LayoutPropError as err:
        raise _err(err.code, f"{err.message} (parameter {name!r}, shape {list(shape)}, placements {placements})",
                   rule.path, err.hint or "choose placements that fit the parameter") from None
    return placements


def _preset_placements(plan: ShardingPlan, rule: ParamRule, name: str, shape: tuple, uses: list[ParamUse]) -> list[str]:
    placements = ["R"] * plan.mesh.ndim
    if rule.preset == "replicate":
        return placements
    fitting = [u for u in uses if u.embedding or rule.preset != "vocab"]
    if not fitting:
        consumers = sorted({u.op for u in uses})
        what = f"consumed by {', '.join(consumers)}" if consumers else \
            "not consumed by a matmul, linear or embedding (a bias, a norm weight, or an elementwise operand)"
        need = "an embedding table" if rule.preset == "vocab" else "the weight of a matmul, linear or embedding"
        raise _err("preset-misfit", f"{rule.preset} fits {need}, but parameter {name!r} (shape {list(shape)}) is "
                   f"{what}", rule.path, "give this parameter explicit placements, replicate, or auto; "
                   "or narrow the pattern")
    dims = {(u.in_dim if rule.preset in ("rowwise", "vocab") else u.out_dim) for u in fitting}
    if len(dims) > 1:
        raise _err("preset-misfit", f"{rule.preset} is ambiguous for parameter {name!r}: its consumers "
                   f"{sorted({u.op for u in fitting})} need dims {sorted(dims)} sharded", rule.path,
                   "give this parameter explicit placements")
    dim = dims.pop()
    if rule.blocks is not None and shape[dim] % rule.blocks:
        raise _err("preset-misfit", f"colwise_fused({rule.blocks}) cuts dim {dim} of parameter {name!r} (shape "
                   f"{list(shape)}) into {rule.blocks} fused projections, but {shape[dim]} is not a multiple of "
                   f"{rule.blocks}", rule.path, "give the number of projections fused into this weight")
    placements[plan.mesh.names.index(rule.axis)] = f"_S({dim},{rule.blocks})" if rule.blocks else f"S({dim})"
    return placements
