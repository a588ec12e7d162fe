"""propagate: run every node's transfer function in topological order.

An analysis pass: it only writes metadata (``specs``, ``violations``, ``wants``,
``attrs``; see :mod:`layout_prop.meta`).  Rule results are cached on (op, attrs, input
specs), so the repeated layers of a deep model cost a dictionary lookup each.

Examples
--------
>>> from layout_prop import DeviceMesh
>>> from layout_prop.graph import Graph
>>> g = Graph(DeviceMesh((2,), ("dp",)))
>>> x = g.input("x", shape=(4, 8), placements=["S(0)"])
>>> g.output(g.op("y", "add", [x, x]))
>>> result = Propagate().run(g)
>>> str(g.node("y").meta["specs"][0])
'float32[4, 8] (S(0))'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from layout_prop import meta
from layout_prop.errors import LayoutPropError, OpError, Violation
from layout_prop.graph import Graph, Node, attrs_key
from layout_prop.layout import Layout
from layout_prop.registry import get_rule
from layout_prop.spec import TensorSpec

__all__ = ["Propagate", "PropagateResult", "input_spec", "value_spec"]

_PREPARED = "propagate.prepared"  # private: (heads table, rule, attrs, cache-key head), once per node
_HEADS = "propagate.heads"  # private key of the cache: (op, frozen normalised attrs) -> a small int
_BY_ATTRS = "propagate.by_attrs"  # private key of the cache: (op, raw attrs) -> the prepared tuple


def input_spec(node: Node, graph: Graph) -> TensorSpec:
    """The declared spec of a graph input node."""
    attrs = node.attrs
    placements = attrs["placements"]
    if isinstance(placements, str):
        if placements != "auto":
            raise LayoutPropError("bad-placement", f"placements {placements!r} is not a list", node=node.name,
                                  hint="give a list of placements, or 'auto'")
        raise OpError("auto-layout", f"input {node.name!r} has placements 'auto'", node=node.name,
                      hint="run the complete pass first (layout-prop check completes auto inputs)")
    if attrs.get("shape") is None:
        raise LayoutPropError("missing-shape", f"input {node.name!r} has no shape", node=node.name,
                              hint="give every graph input a shape")
    return TensorSpec(attrs["shape"], attrs["dtype"], Layout(graph.mesh, placements, len(attrs["shape"])))


def value_spec(graph: Graph, value: str) -> TensorSpec | None:
    """The propagated spec of ``value`` (None when its producer could not be described)."""
    node, index = graph.producer(value)
    return node.meta[meta.SPECS][index]  # KeyError here means the producer was not propagated


def _has_none(specs: tuple) -> bool:
    for spec in specs:  # identity only: ``None in specs`` would call TensorSpec.__eq__ on each
        if spec is None:
            return True
    return False


@dataclass
class PropagateResult:
    nodes: int = 0
    cache_hits: int = 0
    violations: list[Violation] = field(default_factory=list)


class Propagate:
    """The propagate pass; ``cache`` may be shared between runs (it is keyed on pure inputs)."""

    name = "propagate"

    def __init__(self, cache: dict | None = None) -> None:
        self.cache = {} if cache is None else cache
        self._heads = self.cache.setdefault(_HEADS, {})
        self._by_attrs = self.cache.setdefault(_BY_ATTRS, {})

    def run(self, graph: Graph) -> PropagateResult:
        """Propagate every node in topological order (specs read from a local map, not the producers)."""
        result = PropagateResult()
        env: dict[str, TensorSpec | None] = {}  # every value's spec so far
        for node in graph.topo_order():
            result.nodes += 1
            try:
                specs = tuple([env[value] for value in node.inputs])
            except KeyError:  # a value named another way than its producer's outputs
                specs = None
            result.cache_hits += self.visit(graph, node, specs)
            m = node.meta
            env.update(zip(node.outputs, m[meta.SPECS]))
            if m[meta.VIOLATIONS]:
                result.violations.extend(m[meta.VIOLATIONS])
        return result

    def visit(self, graph: Graph, node: Node, specs: tuple | None = None) -> bool:
        """Propagate one node whose inputs are already propagated; returns whether the cache hit.

        ``specs`` may give the input specs (else they are read from the producers' metadata).
        """
        m = node.meta
        if node.is_input:
            a = node.attrs
            key = ("input", graph.mesh, a.get("shape"), a.get("dtype"), a.get("placements"))
            spec = self.cache.get(key)
            if spec is None:
                spec = self.cache[key] = input_spec(node, graph)
            m[meta.SPECS] = (spec,)
            m[meta.VIOLATIONS] = ()
            m[meta.WANTS] = ()
            return False
        prepared = m.get(_PREPARED)
        if prepared is None or prepared[0] is not self._heads:  # heads are numbered per cache
            prepared = self._prepare(node)
        _, rule, attrs, head = prepared
        if specs is None:
            specs = tuple(value_spec(graph, v) for v in node.inputs)
        if _has_none(specs):
            m[meta.SPECS] = (None,) * node.num_outputs
            m[meta.VIOLATIONS] = ()
            m[meta.WANTS] = ()
            return False
        key = (head, specs)
        cached = self.cache.get(key)
        hit = cached is not None
        if not hit:
            cached = self._apply(rule, node, specs, attrs)
            self.cache[key] = cached
        outputs, violations, wants = cached
        m[meta.SPECS] = outputs
        m[meta.VIOLATIONS] = tuple(self._locate(v, node, rule) for v in violations) if violations else ()
        m[meta.WANTS] = wants
        return hit

    def _prepare(self, node: Node) -> tuple:
        """The heads table, the rule, the normalised attrs and a small key for (op, attrs), once per node.

        The key is an integer interned in the shared cache, so that a cache lookup hashes
        one int and the input specs (whose hashes are cached) instead of the attrs again.
        Nodes with equal op and attrs (the repeated layers of a model) share one entry.
        """
        by_attrs, attrs = self._by_attrs, node.attrs
        types = tuple(map(type, attrs.values()))  # part of the key: mode 1 and mode True differ
        if list in types or dict in types:
            raw = (node.op, attrs_key(attrs))
        else:
            raw = (node.op, tuple(attrs.items()), types)
        try:
            prepared = by_attrs.get(raw)
        except TypeError:  # an unhashable value inside a tuple
            raw = (node.op, attrs_key(attrs))
            prepared = by_attrs.get(raw)
        if prepared is None:
            rule = get_rule(node.op, node=node.name)
            attrs = rule.normalize_attrs(node.attrs, node.name)  # raises bad-attr for this node
            heads = self._heads
            head = heads.setdefault((rule.name, attrs_key(attrs)), len(heads))
            prepared = by_attrs[raw] = (heads, rule, attrs, head)
        node.meta[_PREPARED] = prepared
        node.meta[meta.ATTRS] = prepared[2]  # shared between equal nodes: attrs are never written to
        return prepared

    @staticmethod
    def _apply(rule, node: Node, specs, attrs):
        try:
            res = rule.infer_layout(specs, attrs)
        except LayoutPropError as err:
            if err.node is None:
                err.node = node.name
            raise
        except Exception as exc:  # a rule (often a user's) that crashed: name it, never a traceback
            raise OpError("rule-failed", f"the layout rule of {rule.name!r} raised {type(exc).__name__}: {exc} "
                          f"for inputs {[str(s) for s in specs]}", node=node.name,
                          hint="fix the rule: it must return violations, not raise") from exc
        if len(res.outputs) != node.num_outputs:
            raise OpError("bad-rule", f"rule {rule.name!r} returned {len(res.outputs)} outputs for {node.num_outputs}",
                          node=node.name, hint="a rule returns one spec per output")
        wants = tuple(res.wants) + (None,) * (len(specs) - len(res.wants))
        return tuple(res.outputs), tuple(res.violations), wants

    @staticmethod
    def _locate(v: Violation, node: Node, rule) -> Violation:
        index = _operand_indices(rule, len(node.inputs)).get(v.operand) if v.operand is not None else None
        return v.located(node.name, rule.name, None if index is None else node.inputs[index])


@lru_cache(maxsize=1024)
def _operand_indices(rule, count: int) -> dict[str, int]:
    """Operand name -> input index for a node of ``rule`` with ``count`` inputs (first wins)."""
    indices: dict[str, int] = {}
    for i in range(count):
        indices.setdefault(rule.operand_name(i), i)
    return indices
