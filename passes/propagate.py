"""propagate: run every node's transfer function in topological order.

An analysis pass: it only writes metadata (``specs``, ``violations``, ``wants``,
``attrs``; see :mod:`layout_prop.core.meta`).  Rule results are cached on (op, attrs, input
specs), so the repeated layers of a deep model cost a dictionary lookup each.

Examples
--------
>>> from layout_prop import DeviceMesh
>>> from layout_prop.core.graph import Graph
>>> g = Graph(DeviceMesh((2,), ("dp",)))
>>> x = g.input("x", shape=(4, 8), placements=["S(0)"])
>>> g.output(g.op("y", "add", [x, x]))
>>> result = Propagate().run(g)
>>> str(g.node("y").meta["specs"][0])
'float32[4, 8] (S(0))'
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import lru_cache

from layout_prop.core import meta
from layout_prop.core.errors import LayoutPropError, OpError, Violation
from layout_prop.core.graph import Graph, Node, attrs_key
from layout_prop.core.layout import Layout
from layout_prop.core.registry import apply_rule, get_rule
from layout_prop.core.spec import TensorSpec

from .base import GraphPass, PassResult

__all__ = ["Propagate", "PropagateResult", "clear_caches", "input_spec", "value_spec"]

_PREPARED = "propagate.prepared"  # private: (heads table, rule, attrs, cache-key head), once per node
_HEADS = "propagate.heads"  # private key of the cache: (op, frozen normalised attrs) -> a small int
_BY_ATTRS = "propagate.by_attrs"  # private key of the cache: (op, raw attrs) -> the prepared tuple
# Specs and layouts are uniqued (as MLIR uniques attributes in its context): equal values that
# any propagation hands out are one object, so comparing them, or the cache keys they are part
# of (the rule cache, the planner's remembered plans), stops at identity instead of comparing
# fields.  Weak both ways (value -> a weak reference to the first equal one): a value
# nobody holds any more leaves the table.
_UNIQUE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _unique(value):
    """The first live value equal to ``value`` that propagation handed out (``value`` if none)."""
    known = _UNIQUE.get(value)
    first = known() if known is not None else None
    if first is None:
        _UNIQUE[value] = weakref.ref(value)
        return value
    return first


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


@dataclass
class PropagateResult:
    nodes: int = 0
    cache_hits: int = 0
    violations: list[Violation] = field(default_factory=list)


class Propagate(GraphPass):
    """The propagate pass; ``cache`` may be shared between runs (it is keyed on pure inputs)."""

    name = "propagate"

    def __init__(self, cache: dict | None = None) -> None:
        self.cache = {} if cache is None else cache
        self._heads = self.cache.setdefault(_HEADS, {})
        self._by_attrs = self.cache.setdefault(_BY_ATTRS, {})
        self._mesh = self._inputs = None  # the mesh of the last input visited and its input specs

    def apply(self, graph: Graph, ctx: PassContext) -> PassResult:
        """Propagate ``graph`` with the context's cache (its node metadata written in place)."""
        return PassResult(graph, False, ctx.propagate.run(graph))

    def run(self, graph: Graph) -> PropagateResult:
        """Propagate every node in topological order (specs read from a local map, not the producers)."""
        result = PropagateResult()
        env: dict[str, TensorSpec | None] = {}  # every value's spec so far
        found = result.violations
        visit = self.visit
        hits = 0
        for node in graph.topo_order():
            try:
                specs = tuple([env[value] for value in node.inputs])
            except KeyError:  # a value named another way than its producer's outputs
                specs = None
            hits += visit(graph, node, specs)
            m = node.meta
            outputs = m[meta.SPECS]
            if len(outputs) == 1:
                env[node.name] = outputs[0]
            else:
                env.update(zip(node.outputs, outputs))
            if m[meta.VIOLATIONS]:
                found.extend(m[meta.VIOLATIONS])
        result.nodes = len(graph)
        result.cache_hits = hits
        return result

    def visit(self, graph: Graph, node: Node, specs: tuple | None = None) -> bool:
        """Propagate one node whose inputs are already propagated; returns whether the cache hit.

        ``specs`` may give the input specs (else they are read from the producers' metadata).
        """
        m = node.meta
        if node.op == "input":
            return self._visit_input(graph, node)
        prepared = m.get(_PREPARED)
        if prepared is None or prepared[0] is not self._heads:  # heads are numbered per cache
            prepared = self._prepare(node)
        if specs is None:
            specs = tuple(value_spec(graph, v) for v in node.inputs)
        if not specs:  # a source (a constant, a fill): its rule describes it on the graph's mesh
            return self._visit_source(graph, node, prepared)
        for spec in specs:  # identity only: ``None in specs`` would call TensorSpec.__eq__ on each
            if spec is None:
                m[meta.SPECS] = (None,) * node.num_outputs
                m[meta.VIOLATIONS] = m[meta.WANTS] = ()
                return False
        key = (prepared[3], specs)
        cached = self.cache.get(key)
        hit = cached is not None
        if not hit:
            outputs, violations, wants = self._apply(prepared[1], node, specs, prepared[2])
            cached = self.cache[key] = (self._uniqued(outputs), violations, self._uniqued(wants))
        m[meta.SPECS], violations, m[meta.WANTS] = cached
        m[meta.VIOLATIONS] = tuple([self._locate(v, node, prepared[1]) for v in violations]) if violations else ()
        return hit

    def _visit_source(self, graph: Graph, node: Node, prepared: tuple) -> bool:
        key = (prepared[3], graph.mesh)
        cached = self.cache.get(key)
        hit = cached is not None
        if not hit:
            rule = prepared[1]
            try:
                res = rule.infer_source_layout(graph.mesh, prepared[2])
            except LayoutPropError as err:
                if err.node is None:
                    err.node = node.name
                raise
            except Exception as exc:  # a rule (often a user's) that crashed: name it, never a traceback
                raise OpError("rule-failed", f"the source layout rule of {rule.name!r} raised "
                              f"{type(exc).__name__}: {exc}", node=node.name,
                              hint="fix the rule: it must return violations, not raise") from exc
            outputs = tuple(res.outputs)
            if len(outputs) != node.num_outputs or any(o is not None and not isinstance(o, TensorSpec)
                                                       for o in outputs):
                raise OpError("bad-rule", f"rule {rule.name!r} returned {outputs!r} for a node with no inputs",
                              node=node.name, hint="infer_source_layout returns one TensorSpec (or None) per output")
            cached = self.cache[key] = (self._uniqued(outputs), tuple(res.violations), ())
        m = node.meta
        m[meta.SPECS], violations, m[meta.WANTS] = cached
        m[meta.VIOLATIONS] = tuple([self._locate(v, node, prepared[1]) for v in violations]) if violations else ()
        return hit

    def _visit_input(self, graph: Graph, node: Node) -> bool:
        if graph.mesh is not self._mesh:  # the inputs' table of this mesh, looked up once per mesh object
            self._inputs = self.cache.setdefault(("input", graph.mesh), {})
            self._mesh = graph.mesh
        a = node.attrs
        key = (a.get("shape"), a.get("dtype"), a.get("placements"))
        spec = self._inputs.get(key)
        if spec is None:
            spec = input_spec(node, graph)
            spec = self._inputs[key] = _unique(spec)
        m = node.meta
        m[meta.SPECS] = (spec,)
        m[meta.VIOLATIONS] = m[meta.WANTS] = ()
        return False

    def _prepare(self, node: Node) -> tuple:
        """The heads table, the rule, the normalised attrs and a small key for (op, attrs), once per node.

        The key is an integer interned in the shared cache, so that a cache lookup hashes
        one int and the input specs (whose hashes are cached) instead of the attrs again.
        Nodes with equal op and attrs (the repeated layers of a model) share one entry.
        """
        by_attrs = self._by_attrs
        raw = [node.op]  # (op, attrs) in the attrs' own order, with types: mode 1 and mode True differ
        for name, value in node.attrs.items():
            kind = type(value)
            raw.append((name, attrs_key(value)) if kind is list or kind is tuple or kind is dict else (name, kind, value))
        raw = tuple(raw)
        try:
            prepared = by_attrs.get(raw)
        except TypeError:  # a value that cannot key a dict: prepare the node afresh
            raw = prepared = None
        if prepared is None:
            rule = get_rule(node.op, node=node.name)
            attrs = rule.normalize_attrs(node.attrs, node.name)  # raises bad-attr for this node
            heads = self._heads
            head = heads.setdefault((rule.name, attrs_key(attrs)), len(heads))
            prepared = (heads, rule, attrs, head)
            if raw is not None:
                by_attrs[raw] = prepared
        node.meta[_PREPARED] = prepared
        node.meta[meta.ATTRS] = prepared[2]  # shared between equal nodes: attrs are never written to
        return prepared

    @staticmethod
    def _uniqued(values: tuple) -> tuple:
        return tuple([None if v is None else _unique(v) for v in values])

    @staticmethod
    def _apply(rule, node: Node, specs, attrs):
        try:
            res = apply_rule(rule, specs, attrs)  # infer_layout; strided shards gathered for rules without them
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
        for out in res.outputs:
            if out is not None and not isinstance(out, TensorSpec):
                raise OpError("bad-rule", f"rule {rule.name!r} returned {type(out).__name__} {out!r} as an output",
                              node=node.name, hint="a rule returns a TensorSpec (or None) per output")
        for want in res.wants:
            if want is not None and not isinstance(want, Layout):
                raise OpError("bad-rule", f"rule {rule.name!r} wants {type(want).__name__} {want!r} for an input, "
                              f"not a Layout", node=node.name,
                              hint="return wants as Layouts, e.g. spec.layout.with_placements([...])")
        wants = tuple(res.wants) + (None,) * (len(specs) - len(res.wants))
        return tuple(res.outputs), tuple(res.violations), wants

    @staticmethod
    def _locate(v: Violation, node: Node, rule) -> Violation:
        index = _operand_indices(rule, len(node.inputs)).get(v.operand) if v.operand is not None else None
        return v.located(node.name, rule.name, None if index is None else node.inputs[index])


def clear_caches() -> None:
    """Forget the operand-name tables and uniqued values kept across runs (benchmarks call it to start cold)."""
    _operand_indices.cache_clear()
    _UNIQUE.clear()


@lru_cache(maxsize=1024)
def _operand_indices(rule, count: int) -> dict[str, int]:
    """Operand name -> input index for a node of ``rule`` with ``count`` inputs (first wins)."""
    indices: dict[str, int] = {}
    for i in range(count):
        indices.setdefault(rule.operand_name(i), i)
    return indices
