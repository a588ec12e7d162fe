"""Load a spec (YAML or JSON, see DESIGN.md) into a :class:`~layout_prop.graph.Graph`.

Every mistake is a :class:`~layout_prop.errors.SpecError` (or the LayoutError /
OpError of the value at fault) carrying a code, the path in the spec
(``nodes[2].inputs[1]``) and a hint.

Examples
--------
>>> g = load_spec('''
... mesh: {shape: [2, 2], names: [dp, tp]}
... inputs:
...   x: {shape: [4, 8], placements: ["S(0)", R]}
... nodes:
...   - {name: y, op: add, inputs: [x, x]}
... outputs: [y]
... ''')
>>> g.mesh, g.outputs
(DeviceMesh(shape=(2, 2), names=('dp', 'tp')), ['y'])
>>> load_spec("mesh: {shape: [2]}\\ninputs: {x: {shape: [4], placements: [Q]}}\\nnodes: []")
Traceback (most recent call last):
...
layout_prop.errors.SpecError: bad-placement at inputs.x.placements[0]: cannot parse placement 'Q' (hint: write R, S(d) (d an integer, may be negative), P or P(sum|avg|max|min))
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from .errors import GraphError, LayoutPropError, SpecError
from .graph import Graph, Node, split_value
from .layout import Layout
from .mesh import DeviceMesh
from .placement import parse_placement
from .registry import get_rule
from .spec import TensorSpec, check_dtype

__all__ = ["load_spec", "parse_spec"]

TOP_KEYS = {"mesh", "inputs", "nodes", "outputs", "name", "description"}
MESH_KEYS = {"shape", "names"}
INPUT_KEYS = {"shape", "dtype", "placements", "tensor_map", "requires_grad"}
NODE_KEYS = {"name", "op", "inputs", "attrs"}


def _err(code: str, message: str, path: str, hint: str) -> SpecError:
    return SpecError(code, message, path=path, hint=hint)


def _rethrow(err: LayoutPropError, path: str) -> SpecError:
    return SpecError(err.code, err.message, path=path, hint=err.hint)


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser when PyYAML has it
    """A safe YAML loader that refuses a key written twice in one mapping (YAML keeps the last
    silently) and reads ``1e-6`` as a number, as JSON and YAML 1.2 do (PyYAML, a YAML 1.1
    parser, reads a float without a dot as a string)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if duplicate:
                raise _DuplicateKey(None, None, f"key {key!r} is written twice in one mapping", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


# floats with an exponent and no dot (1e-6, 2E+3), which YAML 1.1's float pattern misses
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")  # read by YAML instead, as the string it is there


def _json_mapping(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("a key written twice")  # YAML reports it with its position
    return dict(pairs)


def parse_spec(text: str, source: str = "<spec>") -> dict:
    """Parse YAML or JSON text into a dict (``spec-syntax`` on malformed text or a key written twice).

    Text that is a JSON object is read by the json module (fast on large generated specs);
    anything else, and JSON with a problem, by the YAML loader, which reports where.

    >>> parse_spec("attrs: {eps: 1e-6, mode: 1}")["attrs"]
    {'eps': 1e-06, 'mode': 1}
    """
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text, object_pairs_hook=_json_mapping, parse_constant=_not_json)
        except ValueError:
            pass
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        lines = text.splitlines()
        line = lines[mark.line] if mark and mark.line < len(lines) else ""
        if mark and mark.column < len(line):  # libyaml's messages do not name what it found there
            where += f" (at {line[mark.column]!r})"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        hint = "write each key once" if isinstance(exc, _DuplicateKey) else \
            "check the indentation, brackets and quotes there"
        raise SpecError("spec-syntax", f"{source} is not valid YAML/JSON at {where}: {problem}", path=source,
                        hint=hint) from None
    if not isinstance(data, dict):
        raise SpecError("spec-syntax", f"{source} holds a {type(data).__name__}, not a mapping", path=source,
                        hint="a spec is a mapping with mesh, inputs, nodes and outputs")
    return data


def load_spec(source: str | Path | dict) -> Graph:
    """Load a spec from a path, a YAML/JSON string or an already parsed dict."""
    if isinstance(source, dict):
        return _build(source)
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source and (
            source.endswith((".yaml", ".yml", ".json")) or _is_path(source))):
        path = Path(source)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise SpecError("spec-not-found", f"cannot read {str(path)!r}: {exc.strerror}", path=str(path),
                            hint="give the path of a YAML or JSON spec file") from None
        except UnicodeDecodeError as exc:
            raise SpecError("spec-syntax", f"{str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})",
                            path=str(path), hint="save the spec as UTF-8 YAML or JSON") from None
        return _build(parse_spec(text, str(path)))
    return _build(parse_spec(source))


def _is_path(text: str) -> bool:
    """Whether ``text`` names an existing path (a long one-line JSON spec is not a path)."""
    try:
        return bool(text) and Path(text).exists()
    except (OSError, ValueError):
        return False


def _check_keys(obj: Any, allowed: set, required: set, path: str) -> None:
    if not isinstance(obj, dict):
        raise _err("bad-type", f"expected a mapping, got {type(obj).__name__} {obj!r}", path,
                   "write a mapping such as {key: value}")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise _err("unknown-key", f"unknown key(s) {unknown}", f"{path}.{unknown[0]}" if path else unknown[0],
                   f"allowed keys: {sorted(allowed)}")
    missing = sorted(required - set(obj))
    if missing:
        raise _err("missing-key", f"missing key(s) {missing}", path or "<top>", f"add {missing[0]}")


def _int_list(value: Any, path: str, what: str, minimum: int) -> list[int]:
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise _err("bad-type", f"{what} must be a list of integers, got {value!r}", path,
                   f"write {what} like [2, 2]")
    for i, v in enumerate(value):
        if v < minimum:
            raise _err("bad-value", f"{what}[{i}] is {v}; it must be at least {minimum}", f"{path}[{i}]",
                       f"use sizes of at least {minimum}")
    return value


def _mesh(data: Any) -> DeviceMesh:
    _check_keys(data, MESH_KEYS, {"shape"}, "mesh")
    shape = _int_list(data["shape"], "mesh.shape", "mesh shape", 1)
    if not shape:
        raise _err("bad-value", "mesh shape is empty", "mesh.shape", "give at least one mesh axis")
    names = data.get("names")
    if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
        raise _err("bad-type", f"mesh names must be a list of strings, got {names!r}", "mesh.names",
                   "write names like [dp, tp]")
    try:
        return DeviceMesh(shape, names)
    except LayoutPropError as err:
        raise _rethrow(err, "mesh.names") from None  # sizes are checked above: a names problem


def _input(g: Graph, name: str, data: Any, path: str) -> None:
    _check_keys(data, INPUT_KEYS, {"shape"}, path)
    shape = _int_list(data["shape"], f"{path}.shape", "shape", 0)
    dtype = data.get("dtype", "float32")
    try:
        dtype = check_dtype(dtype) if isinstance(dtype, str) else check_dtype(repr(dtype))
    except LayoutPropError as err:
        raise _rethrow(err, f"{path}.dtype") from None
    if "placements" in data and "tensor_map" in data:
        raise _err("conflicting-keys", "both placements and tensor_map are given", path,
                   "give exactly one of placements (per mesh axis) and tensor_map (per tensor dim)")
    requires_grad = data.get("requires_grad", True)
    if not isinstance(requires_grad, bool):
        raise _err("bad-type", f"requires_grad must be true or false, got {requires_grad!r}",
                   f"{path}.requires_grad", "write requires_grad: false")
    placements: Any
    if "tensor_map" in data:
        tm = data["tensor_map"]
        if not isinstance(tm, list):
            raise _err("bad-type", f"tensor_map must be a list, got {tm!r}", f"{path}.tensor_map",
                       "write one entry per tensor dim, like [1, -1, 0, -1]")
        if len(tm) != len(shape):
            raise _err("invalid-layout", f"tensor_map has {len(tm)} entries for a tensor of rank {len(shape)}",
                       f"{path}.tensor_map", "give one entry per tensor dim")
        entries = [tuple(e) if isinstance(e, list) else e for e in tm]
        for d in range(len(entries)):  # prefixes: the first entry that breaks the layout is the one at fault
            try:
                layout = Layout.from_tensor_map(g.mesh, entries[:d + 1] + [-1] * (len(entries) - d - 1))
                TensorSpec(shape, dtype, layout)
            except LayoutPropError as err:
                raise _rethrow(err, f"{path}.tensor_map[{d}]") from None
        placements = Layout.from_tensor_map(g.mesh, entries).placement_strs()
    elif data.get("placements") == "auto":
        placements = "auto"
    else:
        raw = data.get("placements", ["R"] * g.mesh.ndim)
        if not isinstance(raw, list):
            raise _err("bad-type", f"placements must be a list or 'auto', got {raw!r}", f"{path}.placements",
                       "write one placement per mesh axis, like [\"S(0)\", R]")
        if len(raw) != g.mesh.ndim:
            raise _err("invalid-layout", f"{len(raw)} placements for a mesh of {g.mesh.ndim} axes "
                       f"{list(g.mesh.names)}", f"{path}.placements", "give one placement per mesh axis")
        for i in range(len(raw)):  # prefixes: the first placement that breaks the layout is the one at fault
            try:
                prefix = [parse_placement(p) for p in raw[:i + 1]] + ["R"] * (len(raw) - i - 1)
                TensorSpec(shape, dtype, Layout(g.mesh, prefix, len(shape)))
            except LayoutPropError as err:
                raise _rethrow(err, f"{path}.placements[{i}]") from None
        placements = raw
    if placements != "auto":
        try:
            TensorSpec(shape, dtype, Layout(g.mesh, placements, len(shape)))
        except LayoutPropError as err:
            raise _rethrow(err, f"{path}.placements") from None
    g.input(name, shape=shape, dtype=dtype, placements=placements, requires_grad=requires_grad)


RESERVED_CHARS = (":", "@", "#")  # value indexes, and the names lowering gives local slices and steps
RESERVED_PREFIXES = ("grad:", "grad/", "cotangent/")  # the names the backward pass gives its values


def _check_name(name: Any, path: str) -> str:
    if not isinstance(name, str) or not name:
        raise _err("bad-name", f"name {name!r} is not a non-empty string", path, "name values like x, q_rot, l0_h")
    bad = [c for c in RESERVED_CHARS if c in name]
    if bad or name.startswith(RESERVED_PREFIXES):
        raise _err("bad-name", f"name {name!r} uses {bad[0]!r}" if bad else
                   f"name {name!r} starts with a prefix the backward pass uses", path,
                   "use names without ':', '@' or '#' and not starting with grad/ or cotangent/")
    return name


def _nodes(data: Any, defined: set[str]) -> list[tuple[int, dict, Any]]:
    if not isinstance(data, list):
        raise _err("bad-type", f"nodes must be a list, got {type(data).__name__}", "nodes",
                   "write nodes as a list of {name, op, inputs, attrs}")
    seen: dict[str, int] = {}
    out = []
    for i, nd in enumerate(data):
        path = f"nodes[{i}]"
        _check_keys(nd, NODE_KEYS, {"name", "op"}, path)
        name = _check_name(nd["name"], f"{path}.name")
        if name in defined or name in seen:
            raise _err("duplicate-name", f"name {name!r} is defined twice", f"{path}.name",
                       "give every input and node a distinct name")
        seen[name] = i
        if not isinstance(nd["op"], str):
            raise _err("bad-type", f"op must be a string, got {nd['op']!r}", f"{path}.op", "write op: add")
        try:
            rule = get_rule(nd["op"], node=name)
        except LayoutPropError as err:
            raise SpecError(err.code, err.message, path=f"{path}.op", node=name, hint=err.hint) from None
        inputs = nd.get("inputs", [])
        if not isinstance(inputs, list) or not all(isinstance(v, str) for v in inputs):
            raise _err("bad-type", f"inputs must be a list of value names, got {inputs!r}", f"{path}.inputs",
                       "write inputs: [x, cos, sin]")
        attrs = nd.get("attrs", {}) or {}
        if not isinstance(attrs, dict):
            raise _err("bad-type", f"attrs must be a mapping, got {attrs!r}", f"{path}.attrs",
                       "write attrs: {mode: 0}")
        try:
            attrs = rule.normalize_attrs(attrs, name)
        except LayoutPropError as err:
            raise SpecError(err.code, err.message, path=f"{path}.attrs", node=name, hint=err.hint) from None
        low, high = rule.arity()
        if len(inputs) < low or (high is not None and len(inputs) > high):
            raise SpecError("bad-arity", f"op {rule.name!r} takes {rule.arity_text()}, got {len(inputs)}",
                            path=f"{path}.inputs", node=name, hint=f"give {rule.name} {rule.arity_text()}")
        out.append((i, {"name": name, "op": rule.name, "inputs": inputs, "attrs": nd.get("attrs", {}) or {}},
                    rule))
    return out


def _order(nodes, g: Graph) -> list:
    """Order nodes so every value is defined before use; report undefined values and cycles."""
    producers = {}
    for i, nd, rule in nodes:
        for k in range(rule.num_outputs):
            producers[nd["name"] if rule.num_outputs == 1 else f"{nd['name']}:{k}"] = i
    deps: dict[int, set[int]] = {}
    for i, nd, rule in nodes:
        deps[i] = set()
        for j, value in enumerate(nd["inputs"]):
            if g.has_value(value):
                continue
            if value in producers:
                deps[i].add(producers[value])
                continue
            base, _ = split_value(value)
            hint = "define the value as an input or a node before using it"
            if base in producers or base in g:
                hint = f"{base!r} has several outputs: name one as {base}:0, {base}:1, ..."
            raise SpecError("undefined-value", f"input {j} of node {nd['name']!r} is {value!r}, which is not defined",
                            path=f"nodes[{i}].inputs[{j}]", node=nd["name"], input=value, hint=hint)
    # Depth-first, deps in index order, iteratively: a long chain given in reverse order
    # must not hit Python's recursion limit, and no closure may keep the spec alive in a cycle.
    nodes_by = {i: nd for i, nd, _ in nodes}
    state: dict[int, int] = {}  # 1: on the current path, 2: placed
    done: list[int] = []
    for root, _, _ in nodes:
        if state.get(root) == 2:
            continue
        state[root] = 1
        path = [(root, iter(sorted(deps[root])))]
        while path:
            i, pending = path[-1]
            for d in pending:
                if state.get(d) == 2:
                    continue
                if state.get(d) == 1:
                    on_path = [k for k, _ in path]
                    names = [nodes_by[k]["name"] for k in on_path[on_path.index(d):]] + [nodes_by[d]["name"]]
                    raise SpecError("cycle", f"nodes form a cycle: {' -> '.join(names)}", path=f"nodes[{d}]",
                                    node=nodes_by[d]["name"], hint="a value cannot depend on itself; break the loop")
                state[d] = 1
                path.append((d, iter(sorted(deps[d]))))
                break
            else:
                path.pop()
                state[i] = 2
                done.append(i)
    by_index = {i: (i, nd, rule) for i, nd, rule in nodes}
    return [by_index[i] for i in done]


def _build(data: dict) -> Graph:
    _check_keys(data, TOP_KEYS, {"mesh", "inputs", "nodes"}, "")
    g = Graph(_mesh(data["mesh"]))
    inputs = data["inputs"]
    if not isinstance(inputs, dict) or not inputs:
        raise _err("bad-type", f"inputs must be a non-empty mapping of name -> spec, got {inputs!r}", "inputs",
                   "write inputs: {x: {shape: [4, 8]}}")
    for name, spec in inputs.items():
        _check_name(name, f"inputs.{name}")
        _input(g, name, spec, f"inputs.{name}")
    nodes = _nodes(data["nodes"], set(inputs))
    for i, nd, rule in _order(nodes, g):
        try:
            g.add_node(Node(nd["name"], nd["op"], tuple(nd["inputs"]), dict(nd["attrs"]), rule.num_outputs))
        except GraphError as err:
            raise SpecError(err.code, err.message, path=f"nodes[{i}]", node=nd["name"], hint=err.hint) from None
    outputs = data.get("outputs")
    if outputs is None:
        used = {v for n in g.nodes for v in n.inputs}
        outputs = [v for n in g.nodes if not n.is_input for v in n.outputs if v not in used]
    if not isinstance(outputs, list) or not all(isinstance(v, str) for v in outputs):
        raise _err("bad-type", f"outputs must be a list of value names, got {outputs!r}", "outputs",
                   "write outputs: [y]")
    for k, value in enumerate(outputs):
        if not g.has_value(value):
            raise _err("undefined-value", f"output {value!r} is not defined", f"outputs[{k}]",
                       "name a node (or node:i) as an output")
    g.output(*outputs)
    return g
