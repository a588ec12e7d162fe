"""Pinned activations: a spec's (or sharding plan's) ``constraints:`` section.

JAX's ``with_sharding_constraint``, MindSpore's per-op ``shard()`` and torch's
``SequenceParallel`` let a user fix the layout of an intermediate value; here a
``constraints:`` mapping does, from a value name or an fnmatch glob over the values the
nodes produce to placements (a list, ``R``, ``{placements: [...]}`` or
``{tensor_map: [...]}``)::

    constraints:
      l0_attn_out: ["S(0)", "S(1)", R]      # sequence-parallel after the row-parallel projection
      "l*_q_heads": {tensor_map: [1, -1, 0, -1]}

The loader inserts after each pinned value ``v`` a node ``v/pinned``
(``sharding_constraint``, :class:`layout_prop.ops.shape.ShardingConstraint`) that every
consumer of ``v`` (and the graph's outputs) read instead: the pinned layout is the value's
layout for every consumer.  Propagation meets it: a move that costs communication is a
``constraint-unmet`` violation, which ``--reshard`` fixes by inserting the redistribution,
and ``plan`` sees a node whose output layout is fixed.

For a model torch's dynamo exporter wrote, a pattern also matches the module path of the
node producing a value: ``model.layers.*.self_attn.o_proj`` pins each layer's ``o_proj``
output (a value produced inside a module that a node outside it reads, :func:`module_outputs`).
The importer resolves such patterns to the values they pin (:func:`resolve_module_pins`), each
entry ``VALUE: {placements: [...], pattern: PATTERN}`` keeping the pattern for messages.

Unusable constraints are :class:`SpecError` (exit 2), each naming the pattern:
``bad-type`` / ``bad-placement`` / ``invalid-layout`` (a malformed entry),
``unmatched-constraint`` (a pattern that matches no value: graph inputs take their
layout in ``inputs``), ``conflicting-constraints`` (two patterns pinning one value
differently).  A pinned layout that does not fit the value's shape is found when the
node is propagated (``invalid-layout`` at ``constraints[PATTERN]``).

Examples
--------
>>> from layout_prop.io.loader import load_spec
>>> g = load_spec({"mesh": {"shape": [2]}, "inputs": {"x": {"shape": [4, 4], "placements": ["S(0)"]}},
...                "nodes": [{"name": "y", "op": "relu", "inputs": ["x"]},
...                          {"name": "z", "op": "exp", "inputs": ["y"]}],
...                "constraints": {"y": ["R"]}})
>>> [(n.name, n.op, list(n.inputs)) for n in g.nodes if not n.is_input]
[('y', 'relu', ['x']), ('y/pinned', 'sharding_constraint', ['y']), ('z', 'exp', ['y/pinned'])]
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass
from typing import Any

from layout_prop.core.errors import CONTROL_CHARS, LayoutPropError, SpecError, cut
from layout_prop.core.graph import Graph, Node, fresh_name
from layout_prop.core.layout import Layout
from layout_prop.core.mesh import DeviceMesh
from layout_prop.core.placement import parse_placement

__all__ = ["Constraint", "parse_constraints", "apply_constraints", "match_pins", "module_outputs",
           "resolve_module_pins", "PINNED_SUFFIX", "CONSTRAINT_OP"]

#: the name of the node pinning value ``v`` is ``v + PINNED_SUFFIX``
PINNED_SUFFIX = "/pinned"
CONSTRAINT_OP = "sharding_constraint"
#: the longest pattern (a value name is at most 256 characters; a spec's strings at most 4,096)
MAX_PATTERN = 1024
_GLOB = re.compile(r"[*?\[]")
_UNPRINTABLE = re.compile(f"[\n{CONTROL_CHARS}]")


@dataclass(frozen=True)
class Constraint:
    """One ``pattern: placements`` entry of a ``constraints:`` section.

    ``origin`` is the pattern the user wrote when ``pattern`` is a value name an importer
    resolved it to (a module path of an imported model, :func:`resolve_module_pins`); messages
    name it."""

    pattern: str
    placements: tuple[str, ...]
    origin: str = ""

    @property
    def label(self) -> str:
        """The pattern as the user wrote it."""
        return self.origin or self.pattern

    @property
    def path(self) -> str:
        return f"constraints[{self.label!r}]"


def _err(code: str, message: str, path: str, hint: str) -> SpecError:
    return SpecError(code, message, path=path, hint=hint)


def parse_constraints(data: Any, mesh: DeviceMesh, path: str = "constraints") -> tuple[Constraint, ...]:
    """The constraints of a ``constraints:`` mapping (checked against ``mesh``), in order.

    Raises
    ------
    SpecError
        ``bad-type``, ``bad-placement``, ``invalid-layout`` naming the entry.
    """
    if data is None:
        return ()
    if not isinstance(data, dict):
        raise _err("bad-type", f"constraints must be a mapping of value name or glob -> placements, got {cut(data)}",
                   path, "write constraints: {l0_attn_out: [\"S(0)\", R]}")
    out = []
    for pattern, entry in data.items():
        if not isinstance(pattern, str) or not pattern:
            raise _err("bad-type", f"a constraint's pattern must be a value name or a glob, got {cut(pattern)}",
                       path, "write the value's name (node, or node:i), or a glob such as \"l*_attn_out\"")
        if len(pattern) > MAX_PATTERN or _UNPRINTABLE.search(pattern):
            raise _err("bad-value", f"constraint pattern {cut(pattern, 60)} is "
                       + (f"{len(pattern)} characters long, over the limit {MAX_PATTERN}"
                          if len(pattern) > MAX_PATTERN else "not printable (a control or invisible character)"),
                       path, "write a value name or a glob of printable characters")
        origin = ""
        if isinstance(entry, dict) and "pattern" in entry and len(entry) == 2:  # a pin an importer resolved
            origin = entry["pattern"]
            if not isinstance(origin, str) or not origin or len(origin) > MAX_PATTERN or _UNPRINTABLE.search(origin):
                raise _err("bad-type", f"a constraint's pattern must be a printable string, got {cut(origin)}",
                           f"{path}[{pattern!r}].pattern", "write the pattern the pin came from, or leave it out")
            entry = {k: v for k, v in entry.items() if k != "pattern"}
        out.append(Constraint(pattern, _placements(entry, mesh, f"{path}[{pattern!r}]"), origin))
    return tuple(out)


def _placements(entry: Any, mesh: DeviceMesh, path: str) -> tuple[str, ...]:
    hint = "write a list of placements (one per mesh axis, like [\"S(0)\", R]), R, {placements: [...]} or " \
           "{tensor_map: [...]}"
    if isinstance(entry, str) and entry.strip() in ("R", "Replicate", "Replicate()"):
        return ("R",) * mesh.ndim
    if isinstance(entry, dict) and set(entry) == {"placements"}:
        entry = entry["placements"]
    elif isinstance(entry, dict) and set(entry) == {"tensor_map"}:
        if not isinstance(entry["tensor_map"], list):
            raise _err("bad-type", f"tensor_map must be a list, got {cut(entry['tensor_map'])}", f"{path}.tensor_map",
                       "write one entry per tensor dim, like [1, -1]")
        try:
            layout = Layout.from_tensor_map(mesh, entry["tensor_map"])
        except LayoutPropError as err:
            raise _err(err.code, err.message, f"{path}.tensor_map", err.hint or hint) from None
        return tuple(layout.placement_strs())
    if not isinstance(entry, list):
        raise _err("bad-type", f"a constraint takes placements, got {cut(entry)}", path, hint)
    if len(entry) != mesh.ndim:
        raise _err("invalid-layout", f"{len(entry)} placements {cut(entry)} for a mesh of {mesh.ndim} axes "
                   f"{list(mesh.names)}", path, "give exactly one placement per mesh axis")
    placements = []
    for i, p in enumerate(entry):
        try:
            placements.append(str(parse_placement(p)))
        except LayoutPropError as err:
            raise _err(err.code, err.message, f"{path}[{i}]", err.hint or hint) from None
        except ValueError:  # int() of a dim of more than 4,300 digits, as inputs: refuses it
            raise _err("bad-placement", f"cannot parse placement {cut(p)}: its dim is not an integer a tensor "
                       "can have", f"{path}[{i}]", "write R, S(d) (d a small integer, may be negative), P or "
                       "P(sum|avg|max|min)") from None
    return tuple(placements)


def apply_constraints(graph: Graph, constraints: tuple[Constraint, ...]) -> Graph:
    """``graph`` with a ``sharding_constraint`` node after each pinned value (module docstring).

    A new graph; ``graph`` is left as it was.

    Raises
    ------
    SpecError
        ``unmatched-constraint``, ``conflicting-constraints``, each naming the pattern(s).
    """
    if not constraints:
        return graph
    values = [v for node in graph.nodes if not node.is_input for v in node.outputs]
    inputs = [n.name for n in graph.inputs()]
    pins = match_pins(constraints, values, inputs=inputs)
    taken = {n.name for n in graph.nodes} | set(values)
    renamed: dict[str, str] = {}
    nodes: list[Node] = []
    for node in graph.topo_order():
        inputs = tuple(renamed.get(v, v) for v in node.inputs)
        nodes.append(node if inputs == node.inputs else
                     Node(node.name, node.op, inputs, node.attrs, node.num_outputs, dict(node.meta)))
        for v in node.outputs:
            c = pins.get(v)
            if c is None or node.is_input:
                continue
            name = _fresh(v + PINNED_SUFFIX, taken)
            taken.add(name)
            renamed[v] = name
            nodes.append(Node(name, CONSTRAINT_OP, (v,), {"placements": list(c.placements), "pattern": c.label}))
    outputs = [renamed.get(v, v) for v in graph.outputs]
    return Graph.from_nodes(graph.mesh, nodes, outputs, graph.meta)


def match_pins(constraints: tuple[Constraint, ...], values: list[str], modules: dict[str, list[str]] | None = None,
               inputs: list[str] = ()) -> dict[str, Constraint]:
    """Each pinned value of ``values`` with the constraint pinning it.

    A pattern matches a value's name and, given ``modules`` (value -> the module paths it is an
    output of, :func:`module_outputs`), those module paths: ``model.layers.*.self_attn.o_proj``
    pins the output of every layer's ``o_proj``.

    Raises
    ------
    SpecError
        ``unmatched-constraint`` (a pattern that matches no value), ``conflicting-constraints``
        (two patterns pinning one value differently), each naming the pattern.
    """
    known = set(values)
    pins: dict[str, Constraint] = {}
    for c in constraints:
        if _GLOB.search(c.pattern):  # one compiled pattern over every value
            match = re.compile(fnmatch.translate(c.pattern)).match
            matched = [v for v in values if match(v)]
        else:  # a value's name (or a module's path)
            match = c.pattern.__eq__
            matched = [c.pattern] if c.pattern in known else []
        if modules:
            taken = set(matched)
            matched += [v for v, paths in modules.items() if v not in taken and any(match(p) for p in paths)]
        if not matched:
            raise _err("unmatched-constraint", f"constraint pattern {cut(c.label)} matches no value"
                       + (" and no module's output" if modules else ""), c.path,
                       _unmatched_hint(inputs, c.pattern, values, modules))
        for v in matched:
            other = pins.setdefault(v, c)
            if other.placements != c.placements:
                raise _err("conflicting-constraints", f"value {cut(v)} is pinned to {list(other.placements)} by "
                           f"{other.label!r} and to {list(c.placements)} by {c.label!r}", c.path,
                           "pin each value once: narrow one of the patterns, or give both the same placements")
    return pins


def module_outputs(nodes: list[dict], outputs: list[str], modules: dict[str, str]) -> dict[str, list[str]]:
    """The module paths each value of an imported spec is an output of, deepest first.

    ``modules`` gives the module path of the node producing a value (torch's
    ``model.layers.0.self_attn.o_proj``, from the exporter's node metadata).  A value is an
    output of its producer's module and of each enclosing module (``model.layers.0.self_attn``,
    ``model.layers.0``, ...) that a node outside it reads it from, or that the graph returns it
    from; a value read only inside a module is none of its outputs.  A node whose module is
    unknown counts as outside every module.

    Examples
    --------
    >>> nodes = [{"name": "mm", "inputs": ["x"]}, {"name": "bias", "inputs": ["mm"]},
    ...          {"name": "act", "inputs": ["bias"]}]
    >>> module_outputs(nodes, ["act"], {"mm": "l.0.fc", "bias": "l.0.fc", "act": "l.0.act"})
    {'bias': ['l.0.fc'], 'act': ['l.0.act', 'l.0', 'l']}
    """
    readers: dict[str, list[str | None]] = {}
    for nd in nodes:
        name = nd["name"]
        module = modules.get(name, modules.get(f"{name}:0"))
        for v in nd.get("inputs", ()):
            readers.setdefault(v, []).append(module)
    returned = set(outputs)
    out: dict[str, list[str]] = {}
    for v, path in modules.items():
        if not path:
            continue
        parts = path.split(".")
        found = []
        for k in range(len(parts), 0, -1):
            scope = ".".join(parts[:k])
            inside = scope + "."
            if v not in returned and all(q is not None and (q == scope or q.startswith(inside))
                                         for q in readers.get(v, ())):
                break  # read only inside this module: an output of no enclosing module either
            found.append(scope)
        if found:
            out[v] = found
    return out


def resolve_module_pins(constraints: tuple[Constraint, ...], spec: dict, values: list[str],
                        modules: dict[str, str]) -> dict:
    """An imported spec's ``constraints:`` entry with every pin named by its value.

    ``values`` are the values the spec's nodes produce, ``modules`` the module path of the
    node producing each (:func:`module_outputs`); a pattern matches value names and module
    paths (:func:`match_pins`).  Each pin keeps the pattern it came from (``{placements: [...],
    pattern: PATTERN}``), which messages name.

    Raises
    ------
    SpecError
        ``unmatched-constraint``, ``conflicting-constraints``, naming the pattern.
    """
    inputs = list(spec.get("inputs", ()))
    pins = match_pins(constraints, values, module_outputs(spec["nodes"], spec.get("outputs", []), modules), inputs)
    return {v: {"placements": list(c.placements), "pattern": c.label} for v, c in pins.items()}


def _fresh(base: str, taken: set[str]) -> str:
    return fresh_name(base, taken.__contains__)


def _unmatched_hint(inputs: list[str], pattern: str, values: list[str],
                    modules: dict[str, list[str]] | None = None) -> str:
    inputs = [n for n in inputs if fnmatch.fnmatchcase(n, pattern)]
    if inputs:
        return f"{cut(inputs[0])} is a graph input: give its layout in inputs (constraints pin values nodes produce)"
    paths = list(dict.fromkeys(p for found in (modules or {}).values() for p in found))
    close = difflib.get_close_matches(pattern, paths + values, n=1)
    if close:
        return f"did you mean {close[0]!r}?"
    return f"values are named like {values[0]!r}" if values else "the graph has no nodes"
