"""reshard: insert the cheapest redistribution for every input a rule wants moved.

A transforming pass: one sweep in topological order builds the new graph, inserting
``redistribute`` nodes before the consumers that need them and propagating only what
they change; unchanged nodes are shared with the given graph, which is left as it was.
Only wants that cost communication, or that a violation names, get a node; free local
slices stay implicit (lowering slices locally).  A value moved to the same layout for
several consumers is moved once, and a node that asks for moves, or passes a partial sum
through, may read another consumer's moved value or an all-reduced partial input instead
where that moves fewer bytes (``_Sweep._reuse_moves``: what makes the backward of
Megatron's layouts cost what Megatron-LM's collectives cost).  A node that asks to move a
value the backward pass moved for it alone (the gradient of an explicit ``redistribute``,
moving a cotangent back to the layout its primal had) may read the value before that move
instead, and the move is dropped, where that moves fewer bytes (``_Sweep._skip_vjp_move``:
a cotangent gathered, then sliced back to be added to another one, then the sum gathered
again).  Violations that no redistribution can fix (a bad mode, shapes that do not
broadcast) remain.

This sweep is greedy: each node's moves are chosen when it is reached.  On graphs of 2 to
:data:`~layout_prop.planner.solver.GLOBAL_NODES` ops, :func:`layout_prop.api.analyze` (so
``check --reshard``, ``run``, ``lower``, ``viz``) also asks the solver of
:mod:`layout_prop.planner.solver` where to redistribute over the whole graph, and keeps its
plan when it moves strictly fewer bytes than this sweep (and still runs every expansion the
spec forces, such as a ring asked for by ``context_parallel='ring'``); larger graphs keep the
sweep (its speed is what ``benchmarks/propagate.py`` measures).

Examples
--------
>>> from layout_prop import DeviceMesh
>>> from layout_prop.core.graph import Graph
>>> g = Graph(DeviceMesh((2,), ("dp",)))
>>> a = g.input("a", shape=(4,), placements=["P(sum)"])
>>> b = g.input("b", shape=(4,), placements=["S(0)"])
>>> g.output(g.op("c", "add", [a, b]))
>>> new = Reshard().run(g).graph
>>> print(new.format())
graph(mesh=DeviceMesh(dp=2)):
  a = input() {shape=[4], dtype=float32, placements=["P(sum)"], requires_grad=true}
  b = input() {shape=[4], dtype=float32, placements=["S(0)"], requires_grad=true}
  c/x = redistribute(a) {placements=["S(0)"]}
  c = add(c/x, b)
  return c
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from layout_prop.core import meta
from layout_prop.core.errors import LayoutPropError
from layout_prop.core.graph import Graph, Node, fresh_name
from layout_prop.core.redistribute import plan_redistribution
from layout_prop.core.registry import get_rule
from layout_prop.core.spec import TensorSpec

from .backward import GRAD_PREFIX
from .base import GraphPass, PassResult
from .propagate import Propagate

__all__ = ["Reshard", "ReshardResult"]


@dataclass
class ReshardResult:
    graph: Graph
    inserted: int


class Reshard(GraphPass):
    name = "reshard"
    transforms = True
    max_rounds = 8  # moves inserted for one node, again and again while its rule still asks

    def __init__(self, propagate: Propagate | None = None) -> None:
        self.propagate = propagate or Propagate()

    def applies(self, ctx: PassContext) -> bool:
        return ctx.options.reshard

    def apply(self, graph: Graph, ctx: PassContext) -> PassResult:
        result = Reshard(ctx.propagate).run(graph)
        return PassResult(result.graph, result.graph is not graph, result)

    def run(self, graph: Graph) -> ReshardResult:
        """Propagate ``graph`` (in place, if it is not yet), then build the resharded graph.

        One sweep in topological order: a node whose rule asks for moves gets its
        redistribution nodes inserted just before it and is propagated again; a node
        that reads a value whose spec changed on the way is propagated again too (a copy:
        the given graph is left as it was); every other node is shared with the given
        graph.  Since a node is only reached after all its inputs, what a move changes
        downstream is settled in the same sweep.
        """
        nodes = graph.topo_order()
        if any(meta.SPECS not in n.meta for n in nodes):
            violations = self.propagate.run(graph).violations
        else:
            violations = (v for n in nodes for v in n.meta[meta.VIOLATIONS])
        fixable = any(v.fixable for v in violations)
        # a graph with a backward (the gradients among its outputs) may hold the backward's moves (_skip_vjp_move)
        backward = any(v.startswith(GRAD_PREFIX) for v in graph.outputs)
        if not fixable and not (backward and any(
                n.op == "redistribute" and n.meta.get(meta.INSERTED_BY) == "backward" for n in nodes)):
            return ReshardResult(graph, 0)  # nothing a redistribution can fix, no move to skip: the graph as it is
        sweep = _Sweep(self, graph, skip_only=not fixable)
        add = sweep.add_backward if backward else sweep.add
        for node in nodes:
            add(node)
        if not sweep.inserted and not sweep.dropped:
            return ReshardResult(graph, 0)
        return ReshardResult(Graph.from_nodes(graph.mesh, sweep.nodes, graph.outputs, graph.meta), sweep.inserted)


_FREE = "reshard.free"  # private key of the propagate cache: (spec, wanted layout) -> plan is free (None: no plan)
_BYTES = "reshard.bytes"  # private key of the propagate cache: (spec, wanted layout) -> bytes per rank of the move
_MOVE_META = "reshard.move_meta"  # private key of the propagate cache: (spec, wanted layout) -> a move's attrs, meta


_SPECS, _VIOLATIONS = meta.SPECS, meta.VIOLATIONS  # read on every node of the sweep
_UNKNOWN = object()  # a cache's answer for a key it has not seen
_PARTIAL: dict = {}  # id(layout) -> (the layout, whether it has a Partial axis), asked of every node's values


def _partial(layout) -> bool:
    """Whether ``layout`` has a Partial axis.

    Cached by identity in ``_PARTIAL``: a Layout's hash is a Python call, an ``id`` is not, and
    this runs on every node of the sweep.  Each entry holds its layout, so no other object can
    take its id while the entry lives (layouts only: a held spec would outlive the weak
    uniquing table's promise).
    """
    known = _PARTIAL.get(id(layout))
    if known is None:
        if len(_PARTIAL) > 4096:
            _PARTIAL.clear()
        known = _PARTIAL[id(layout)] = (layout, layout.has_partial())
    return known[1]


def _all_fixable(violations) -> bool:
    """Whether a redistribution can fix every one of ``violations`` (true of none)."""
    for v in violations:  # a plain loop: cheaper than all() over a generator on this path
        if not v.fixable:
            return False
    return True


def _any_fixable(violations) -> bool:
    """Whether a redistribution can fix one of ``violations``."""
    for v in violations:
        if v.fixable:
            return True
    return False


@lru_cache(maxsize=4096)
def _reduced(layout):
    """``layout`` with every Partial axis Replicate (cached: a model's layers repeat a few layouts)."""
    return layout.with_placements(["R" if p.is_partial() else p for p in layout.placements])


@lru_cache(maxsize=4096)
def _reduced_spec(spec):
    """``spec`` with every Partial axis Replicate (cached: one object for equal specs)."""
    return spec.with_layout(_reduced(spec.layout))


class _Sweep:
    """The state of one resharding sweep: the new graph's nodes so far, by name, in order.

    A value's spec is read from its producer in the new graph (the node itself when it
    is shared with the given graph), so the sweep keeps no second map of every value.
    """

    def __init__(self, reshard: Reshard, graph: Graph, skip_only: bool = False) -> None:
        self.reshard = reshard
        # no fixable violation in the graph: only the backward's moves are looked at (``_skip_vjp_move``),
        # and a node is only moved for when skipping one left it asking (as before, the rest is as given)
        self.skip_only = skip_only
        self.propagate = reshard.propagate
        self.graph = graph
        self.nodes: dict[str, Node] = {}
        self.changed: set[str] = set()  # values whose spec differs from the given graph's
        self.moved: dict[tuple[str, object], str] = {}  # (value, wanted layout) -> redistribute node
        self.moves_of: dict[str, list[str]] = {}  # value -> its redistribute nodes so far, in order
        self.inserted = 0
        self.dropped = 0  # the backward's moves no node reads any more (``_skip_vjp_move``), left out
        self.graph_outputs: set[str] | None = None  # made when first asked (``_skip_vjp_move``)
        self.vjp_moves: set[str] = set()  # the backward's redistribute nodes so far (``_skip_vjp_move``)
        self.graph_inputs = {n.name for n in graph.inputs()}
        # pure functions of (spec, wanted layout), kept in the propagate cache so that later runs share them
        self.free: dict = self.propagate.cache.setdefault(_FREE, {})
        self.move_meta: dict = self.propagate.cache.setdefault(_MOVE_META, {})
        self.bytes: dict = self.propagate.cache.setdefault(_BYTES, {})
        self.operands: dict[tuple[str, int], str] = {}  # (op, input index) -> the operand's name

    def add(self, node: Node) -> None:
        """Append ``node`` (shared, or a propagated copy) after the moves its rule asks for."""
        m = node.meta
        changed = self.changed
        if changed and not changed.isdisjoint(node.inputs):
            node = self._visit_copy(node, node.inputs)
        if not node.meta[_VIOLATIONS] and (not node.inputs or not self._passes_partial(node)):
            # the common case, kept short: nothing to move, no partial sum passed through
            if node.meta is not m and node.meta[_SPECS] != m[_SPECS]:
                changed.update(node.outputs)
            self.nodes[node.name] = node
            return
        self._add_moved(node, m)

    def add_backward(self, node: Node) -> None:
        """:meth:`add`, in a graph with a backward: first, a node reading a move the backward made
        may read the value before it instead (:meth:`_skip_vjp_move`)."""
        vjp_moves = self.vjp_moves
        if not vjp_moves or vjp_moves.isdisjoint(node.inputs):
            if node.op == "redistribute" and node.meta.get(meta.INSERTED_BY) == "backward":
                vjp_moves.add(node.name)
            self.add(node)
            return
        m = node.meta
        changed = self.changed
        if changed and not changed.isdisjoint(node.inputs):
            node = self._visit_copy(node, node.inputs)
        node = self._skip_vjp_move(node, [self.spec(value) for value in node.inputs])
        if not node.meta[_VIOLATIONS] and (not node.inputs or not self._passes_partial(node)):
            if node.meta is not m and node.meta[_SPECS] != m[_SPECS]:
                changed.update(node.outputs)
            self.nodes[node.name] = node
            return
        self._add_moved(node, m)

    def _add_moved(self, node: Node, m: dict) -> None:
        """Append ``node``, which asks for moves or passes a partial sum through, after its moves
        (``m``: the meta of the given graph's node, which ``node`` may be a copy of)."""
        if self.skip_only and not node.meta[_VIOLATIONS]:  # a partial sum passed through is left as given
            if node.meta is not m and node.meta[_SPECS] != m[_SPECS]:
                self.changed.update(node.outputs)
            self.nodes[node.name] = node
            return
        spec = self.spec
        specs = [spec(value) for value in node.inputs]  # read once for the reuse step and the first round of moves
        reused = self._reuse_moves(node, specs)
        if reused is not node:
            node, specs = reused, None
        if node.meta[meta.VIOLATIONS]:
            for _ in range(self.reshard.max_rounds):
                if not _any_fixable(node.meta[meta.VIOLATIONS]):
                    break
                inputs = self._move_inputs(node, specs)
                if inputs == node.inputs:
                    break
                node, specs = self._visit_copy(node, inputs), None
        if node.meta is not m and node.meta[meta.SPECS] != m[meta.SPECS]:
            self.changed.update(node.outputs)
        self.nodes[node.name] = node

    def spec(self, value: str):
        """The spec of ``value`` in the new graph."""
        node = self.nodes.get(value)
        if node is not None and node.num_outputs == 1:
            return node.meta[meta.SPECS][0]
        producer, index = self.graph.producer(value)
        return self.nodes[producer.name].meta[meta.SPECS][index]

    def _visit_copy(self, node: Node, inputs: tuple[str, ...]) -> Node:
        copy = Node(node.name, node.op, tuple(inputs), node.attrs, node.num_outputs, dict(node.meta))
        spec = self.spec
        self.propagate.visit(self.graph, copy, tuple([spec(value) for value in inputs]))
        return copy

    def _reuse_moves(self, node: Node, specs: list | None = None) -> Node:
        """``node``, with an input read from a redistribute node already in the graph, or from a
        new all-reduce of a partial input, where that makes the node cheaper.

        A move another consumer asked for is paid once, whoever reads it; a rule that sees only
        its own operands does not know that, and chooses each product alone.  The backward of a
        linear is the case: the output cotangent is moved for the input gradient, and the
        weight gradient reading that moved cotangent needs no move of its own and is no partial
        sum; and with a partial (tp) output cotangent, gathering the weight for the input
        gradient moves fewer bytes than reducing the cotangent, but leaves the input gradient a
        partial sum, while the reduced cotangent also serves the weight gradient.  A node that
        passes a partial sum through (a layer norm's backward on a tp-partial cotangent) is
        tried too: reducing its input first may leave its outputs (the norm weights' gradients)
        whole.  Each input is tried in turn with each version, and a version kept when the
        node's cost (:meth:`_cost`: its moves, reducing a partial output, and a new all-reduce)
        falls strictly.  The rule's own choice stands on a tie; a node with a violation no move
        fixes is left as it is.  ``specs`` may give the input specs (else they are read).
        """
        violations = node.meta[meta.VIOLATIONS]
        if not _all_fixable(violations) or not (violations or self._passes_partial(node)):
            return node  # what no move fixes is reported as it is
        if specs is None:
            specs = [self.spec(value) for value in node.inputs]
        if self.moves_of.keys().isdisjoint(node.inputs):
            for s in specs:
                if s is not None and _partial(s.layout):
                    break
            else:
                return node  # no other version of any input
        values = list(node.inputs)
        best = self._cost(node, values, specs)
        if not best:
            return node  # nothing to save
        choice: list[str | TensorSpec | None] = [None] * len(specs)  # per input: a moved value, a reduced spec
        for i, value in enumerate(node.inputs):
            for option, spec, extra in self._versions(value, specs[i]):
                if extra >= best:
                    continue  # its cost is at least ``extra`` and must fall strictly: not worth a visit
                trial, named = list(specs), list(values)
                trial[i] = spec
                named[i] = option if isinstance(option, str) else None
                copy = Node(node.name, node.op, node.inputs, node.attrs, node.num_outputs, dict(node.meta))
                self.propagate.visit(self.graph, copy, tuple(trial))
                cost = extra + self._cost(copy, named, trial)
                if cost < best:
                    best, specs, values, choice[i] = cost, trial, named, option
        if not any(c is not None for c in choice):
            return node
        inputs = list(node.inputs)
        for i, option in enumerate(choice):
            if isinstance(option, str):
                inputs[i] = option
            elif option is not None:
                inputs[i] = self._move(node, i, node.inputs[i], self.spec(node.inputs[i]), option.layout)
        return self._visit_copy(node, tuple(inputs))

    def _skip_vjp_move(self, node: Node, specs: list) -> Node:
        """``node`` reading, in place of a move the backward pass made for it alone, the value
        before that move, where that moves strictly fewer bytes counting the move dropped.

        The gradient of an explicit ``redistribute`` moves the cotangent back to the layout
        its primal had (``ops/redistribute.py``), before the backward pass sums it with the
        value's other cotangents.  When the add summing them then asks to move it again (to
        the other cotangent's layout), that first move was paid for nothing: on a plan's
        Llama with ``x`` replicated on tp and the first norm's input sharded there, x's
        cotangent from the norm was all-gathered on tp, sliced back for the add, and the sum
        all-gathered again for ``grad/x``.  Here the add reads the norm's cotangent itself
        and the sum is moved once.  A move is skipped only when this node is its one
        consumer and it is no output of the graph (so nothing else reads it and the graph
        without it is well formed), and only when the node's cost (:meth:`_cost`) reading
        the value before it is strictly below its cost now plus the move's bytes: the global
        value is the same either way (a redistribution changes where the pieces are, never
        the tensor), so only the bytes decide.
        """
        nodes, wants = self.nodes, node.meta.get(meta.WANTS)
        if not wants or not _all_fixable(node.meta[meta.VIOLATIONS]):
            return node  # nothing asked, or what no move fixes, which is reported as it is
        for i, value in enumerate(node.inputs):
            if wants[i] is None or value not in self.vjp_moves:
                continue
            move = nodes[value]
            if self.graph_outputs is None:
                self.graph_outputs = set(self.graph.outputs)
            if value in self.graph_outputs or len(self.graph.consumers(value)) != 1:
                continue
            source = move.inputs[0]
            source_spec, moved_spec = self.spec(source), specs[i]
            if source_spec is None or moved_spec is None:
                continue
            paid = self._bytes(source_spec, moved_spec.layout)
            if not paid:
                continue  # a free move: nothing to save
            trial, named = list(specs), list(node.inputs)
            trial[i], named[i] = source_spec, source
            copy = Node(node.name, node.op, node.inputs, node.attrs, node.num_outputs, dict(node.meta))
            self.propagate.visit(self.graph, copy, tuple(trial))
            if self._cost(copy, named, trial) < self._cost(node, node.inputs, specs) + paid:
                del nodes[value]
                self.vjp_moves.discard(value)
                self.dropped += 1
                return self._skip_vjp_move(self._visit_copy(node, tuple(named)), trial)
        return node

    def _passes_partial(self, node: Node) -> bool:
        """Whether ``node`` has a partial output and reads a partial input (a partial sum passed
        through a linear op: reducing before may be cheaper than after)."""
        if not node.inputs:
            return False
        known = _PARTIAL.get  # plain loops and identity lookups: this runs on every node of the sweep
        for spec in node.meta[meta.SPECS]:
            if spec is not None:
                entry = known(id(spec.layout))
                if entry[1] if entry is not None else _partial(spec.layout):
                    break
        else:
            return False
        for value in node.inputs:
            if value in self.graph_inputs:  # a partial graph input is the user's declared layout: kept
                continue
            spec = self.spec(value)
            if spec is not None and _partial(spec.layout):
                return True
        return False

    def _versions(self, value: str, spec):
        """``(option, spec, bytes)`` of every other version of ``value`` a node could read: the
        redistribute nodes of it so far (paid already), and its all-reduce when it is partial."""
        for moved in self.moves_of.get(value, ()):
            yield moved, self.spec(moved), 0
        if spec is not None and _partial(spec.layout):
            reduced = _reduced_spec(spec)
            if (value, reduced.layout) not in self.moved:
                yield reduced, reduced, self._bytes(spec, reduced.layout)

    def _cost(self, node: Node, values, specs) -> float:
        """Bytes per rank of the moves ``node``'s rule asks for on inputs ``values`` of ``specs``
        (none for a move already made: it is paid), plus reducing any partial output to
        Replicate (what a partial sum costs its consumers at most); infinite when a violation
        is not fixable by a move."""
        m = node.meta
        if not _all_fixable(m[meta.VIOLATIONS]):
            return float("inf")
        total = 0
        moved = self.moved
        for value, spec, want in zip(values, specs, m[meta.WANTS]):
            if want is not None and (value, want) not in moved:
                total += self._bytes(spec, want)
        for spec in m[meta.SPECS]:
            if spec is not None and _partial(spec.layout):
                total += self._bytes(spec, _reduced(spec.layout))
        return total

    def _bytes(self, spec, want) -> float:
        """Bytes per rank of moving ``spec`` to ``want`` (infinite when no redistribution can)."""
        key = (spec, want)
        known = self.bytes.get(key)
        if known is None:
            try:
                known = plan_redistribution(spec, want).bytes_per_rank
            except LayoutPropError:
                known = float("inf")
            self.bytes[key] = known
        return known

    def _is_free(self, spec, want) -> bool | None:
        """Whether moving ``spec`` to ``want`` costs nothing (None: no redistribution can)."""
        key = (spec, want)
        free = self.free.get(key, _UNKNOWN)
        if free is not _UNKNOWN:
            return free
        try:
            free = plan_redistribution(spec, want).is_free
        except LayoutPropError:
            free = None
        self.free[key] = free
        return free

    def _move_inputs(self, node: Node, specs: list | None = None) -> tuple[str, ...]:
        """The node's inputs with a redistribute node in place of each move that is needed.

        A move is needed when it costs communication, or when a violation asks for it (a
        relabel on a size-1 axis); free local slices stay implicit.  ``specs`` may give the
        input specs (else they are read).
        """
        flagged = None  # the inputs a fixable violation names, made when a free move asks
        inputs = list(node.inputs)
        for i, (value, want) in enumerate(zip(node.inputs, node.meta[meta.WANTS])):
            if want is None:
                continue
            spec = self.spec(value) if specs is None else specs[i]
            free = self._is_free(spec, want)
            if free is None:
                continue
            if free:
                if flagged is None:
                    flagged = {v.input for v in node.meta[meta.VIOLATIONS] if v.fixable}
                if value not in flagged:
                    continue
            inputs[i] = self._move(node, i, value, spec, want)
        return tuple(inputs)

    def _move(self, node: Node, index: int, value: str, spec, want) -> str:
        """The redistribute node moving ``value`` to ``want``: the one already made, or a new one."""
        key = (value, want)  # a Layout: its hash is cached
        name = self.moved.get(key)
        if name is None:
            name = self._insert_move(node, index, value, spec, want)
            self.moved[key] = name
            self.moves_of.setdefault(value, []).append(name)
        return name

    def _insert_move(self, node: Node, index: int, value: str, spec, want) -> str:
        """Append a redistribute node moving ``value`` (``spec``) to ``want`` for input ``index`` of ``node``."""
        operand = self.operands.get((node.op, index))
        if operand is None:
            operand = self.operands[(node.op, index)] = get_rule(node.op).operand_name(index)
        name = self._fresh(f"{node.name}/{operand}")
        known = self.move_meta.get((spec, want))
        if known is not None:  # the same move seen before: its rule's result is a pure function of it
            attrs, template = known
            move = Node(name, "redistribute", (value,), dict(attrs),  # each node its own attrs
                        meta={**template, meta.INSERTED_BY: self.reshard.name, meta.FOR: (node.name, value)})
        else:
            attrs = {"placements": tuple(want.placement_strs())}
            move = Node(name, "redistribute", (value,), attrs,
                        meta={meta.INSERTED_BY: self.reshard.name, meta.FOR: (node.name, value)})
            self.propagate.visit(self.graph, move, (spec,))
            if not move.meta[meta.VIOLATIONS]:  # violations name the node: those are not shared
                template = {k: v for k, v in move.meta.items() if k not in (meta.INSERTED_BY, meta.FOR)}
                self.move_meta[(spec, want)] = (dict(attrs), template)
        self.nodes[name] = move
        self.inserted += 1
        return name

    def _fresh(self, base: str) -> str:
        """``base``, or ``base2``, ``base3``...: the first name neither graph has."""
        return fresh_name(base, lambda name: name in self.graph or name in self.nodes)
