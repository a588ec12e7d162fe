"""plan: choose every layout at once, with the least communication per training step.

An integer linear program over each node's *strategies* (Alpa's formulation).  A
strategy of an op node is the layouts in which it receives its inputs (after any
redistribution) and, through its rule, the layouts of its outputs; a graph input's
strategies are its candidate layouts (every layout whose shards are non-empty, for an
``auto`` input; the declared one otherwise).  One binary variable per strategy, exactly
one chosen per node; one continuous variable per pair of strategies joined by an edge,
whose marginals are the two nodes' choices (so it is 1 exactly for the chosen pair).

Candidate strategies come from the node's own rule: per mesh axis, every combination of
``R``, ``S(d)`` (a dim at least as large as the axis) and ``P(sum)`` over the inputs is
tried with the other axes Replicate; the combinations the rule accepts without a
violation are combined across the axes and tried again.  A free local slice the rule
asks for (a ``wants`` that costs nothing) is part of the strategy: the input is moved
straight to the layout the kernel wants.

Costs, per training step and per rank (the busiest rank, as the redistribution cost
model counts):

- an edge: moving the producer's output to the layout the consumer receives
  (:func:`~layout_prop.core.redistribute.plan_redistribution`); with ``backward``, also the
  move of the consumer's gradient of that input back to the producer's layout (a
  Partial axis of the producer receives a Replicate cotangent), which is what the
  backward of a ``redistribute`` node does;
- a node, with ``backward``: the redistributions its gradient graph needs inside (its
  vjp built and resharded on the strategy's layouts alone);
- ``objective="bytes"`` adds bytes; ``objective="time"`` adds, per collective step on
  mesh axis ``a`` with group size ``n``, ``k * (n - 1) * latency_us[a] + bytes / GBps[a]``
  microseconds (``k`` 2 for an all-reduce, 1 otherwise), with the links of the mesh
  (:data:`DEFAULT_LINK` where none is given).

The memory limit is a linear constraint: parameters (inputs that require a gradient)
count their local bytes times 2 (the gradient) plus the optimizer's states, every other
input and every op output its local bytes (forward values are alive when the backward
starts).  That is an estimate (liveness is not linear in the choices);
:func:`layout_prop.commands.plan.plan_spec` measures every plan with the memory pass and
reports one only when it measures within the limit (its ``_fit`` says how it searches).

Identical layers are solved once: op nodes that repeat at least 3 times with the same
name up to a number (``l3_q`` and ``l7_q``, ``layers.3.q``), the same op, attrs and input
shapes and producers named alike, and inputs that repeat alike, share one set of
variables (a class), whose costs count once per member.

Examples
--------
>>> from layout_prop.io.loader import load_spec
>>> g = load_spec('''
... mesh: {shape: [2], names: [tp]}
... inputs:
...   x:  {shape: [8, 16], requires_grad: false}
...   w1: {shape: [16, 32], placements: auto}
...   w2: {shape: [32, 16], placements: auto}
... nodes:
...   - {name: h, op: matmul, inputs: [x, w1]}
...   - {name: a, op: gelu, inputs: [h]}
...   - {name: y, op: matmul, inputs: [a, w2]}
... outputs: [y]
... ''')
>>> solution = solve(g, backward=False)
>>> solution.layouts["w1"], solution.layouts["w2"], solution.cost
(('S(1)',), ('S(0)',), 0.0)
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from layout_prop.core import meta
from layout_prop.core.errors import LayoutPropError, SpecError
from layout_prop.core.graph import Graph, Node, attrs_key, fresh_name
from layout_prop.core.layout import Layout
from layout_prop.core.links import DEFAULT_LINK, Link, links_of  # noqa: F401  (DEFAULT_LINK: the doctests)
from layout_prop.core.placement import Partial, Replicate, Shard
from layout_prop.core.redistribute import LOCAL_STEPS, Redistribution, plan_redistribution
from layout_prop.core.registry import OpRule, get_rule
from layout_prop.core.spec import TensorSpec

from layout_prop.passes.base import AnalysisOptions
from layout_prop.passes.expand import EXPANDED_FROM
from layout_prop.passes.memory import optimizer_states_per_parameter
from layout_prop.passes.pass_manager import PassContext
from layout_prop.perf.parallel import optimizer_time
from layout_prop.passes.propagate import Propagate, value_spec

__all__ = ["Problem", "Strategy", "Solution", "solve", "OBJECTIVES", "plan_cost", "realise", "InfeasiblePlan",
           "Deadline", "PlanTimeout"]

OBJECTIVES = ("bytes", "time")
CAP = 32  # strategies kept per node on a mesh of at most 2 axes of more than one rank (module docstring)
CAP_MANY_AXES = 16  # ... on a mesh of 3 or more: the pairs of strategies grow as the square


def default_cap(mesh) -> int:
    """How many strategies a node keeps on ``mesh``.

    >>> from layout_prop import DeviceMesh
    >>> default_cap(DeviceMesh((2, 1, 4), ("dp", "sp", "tp"))), default_cap(DeviceMesh((2, 2, 2), ("dp", "sp", "tp")))
    (32, 16)
    """
    return CAP if sum(1 for n in mesh.shape if n > 1) <= 2 else CAP_MANY_AXES
TIME_LIMIT = 20.0  # seconds the ILP solver may search; then the best plan found, its gap reported
REPEAT = 3  # a name pattern repeated this often (with equal structure) is one class of variables


# --------------------------------------------------------------------------- costs
Moves = tuple  # of (mesh axis, kind, bytes): the collectives of a cost item


def _moves(plan: Redistribution) -> Moves:
    return tuple((s.mesh_axis, s.kind, s.bytes_per_rank) for s in plan.steps if s.kind not in LOCAL_STEPS)


TIE = 1e-3  # added per collective step: of two plans moving as many bytes, the one with fewer moves wins


def _price(moves: Moves, objective: str, links: Sequence[Link], mesh, tie: bool = False) -> float:
    if objective == "bytes":
        return float(sum(b for _, _, b in moves)) + (TIE * len(moves) if tie else 0.0)
    total = 0.0
    for axis, kind, nbytes in moves:
        link = links[axis]
        hops = (mesh.shape[axis] - 1) * (2 if kind == "all-reduce" else 1)
        total += hops * link.latency_us + nbytes / (link.GBps * 1e3)
    return total


def plan_cost(plan: Redistribution, objective: str, links: dict[str, Link]) -> float:
    """A redistribution's cost: bytes per rank, or modelled microseconds.

    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((4,), ("tp",))
    >>> p = plan_redistribution(TensorSpec((1000,), "float32", Layout(mesh, ["P(sum)"], 1)), Layout(mesh, ["R"], 1))
    >>> plan_cost(p, "bytes", {"tp": DEFAULT_LINK}), plan_cost(p, "time", {"tp": Link(1.0, 2.0)})
    (6000.0, 18.0)
    """
    mesh = plan.src.mesh
    return _price(_moves(plan), objective, [links[n] for n in mesh.names], mesh)


# --------------------------------------------------------------------------- strategies
@dataclass(frozen=True)
class Strategy:
    """One way to run a node: the layouts it receives its inputs in, and what it makes.

    ``grads`` holds, per input, the spec of the gradient the node's vjp gives that input
    (None without backward or without a gradient); ``inner`` the collectives the vjp
    needs inside.
    """

    inputs: tuple[Layout, ...]
    outputs: tuple[TensorSpec, ...]
    grads: tuple[TensorSpec | None, ...] = ()
    inner: Moves = ()
    work: tuple = ()  # the OpCost of its vjp's ops on their local shapes (the time objective on a cluster)
    op: Any = None  # the OpCost of the op itself on its local shapes (idem)
    expanded: bool = False  # run as the subgraph its rule's expand hook writes (passes/expand.py)
    forward_work: tuple = ()  # then the OpCost of the subgraph's forward ops (``op`` is None)

    def describe(self) -> str:
        return ", ".join("(" + ", ".join(s.layout.placement_strs()) + ")" for s in self.outputs)


class _Rules:
    """Memoised rule evaluations and gradient costs, shared by every node of a solve."""

    def __init__(self, propagate: Propagate, expansions: bool = True) -> None:
        self.propagate = propagate
        self.expand = expansions  # price the expand pass's forms (off: only the plain rule's moves)
        self.results: dict = {}
        self.vjps: dict = {}
        self.expansions: dict = {}

    def infer(self, node: Node, specs: tuple[TensorSpec, ...]):
        key = (node.op, attrs_key(node.meta[meta.ATTRS]), specs)
        try:
            return self.results[key]
        except KeyError:
            pass
        try:
            res = get_rule(node.op).infer_layout(specs, node.meta[meta.ATTRS])
            ok = not res.violations and all(o is not None for o in res.outputs)
            wants = tuple(res.wants) + (None,) * (len(specs) - len(res.wants))
            value = (tuple(res.outputs), wants) if ok else None
        except LayoutPropError:
            value = None
        self.results[key] = value
        return value

    def vjp(self, node: Node, inputs: tuple[TensorSpec, ...], requires: tuple[bool, ...]):
        """(grad spec per input, inner moves, OpCost of each backward op) of ``node`` run on ``inputs``."""
        key = (node.op, attrs_key(node.meta[meta.ATTRS]), inputs, requires)
        found = self.vjps.get(key)
        if found is None:
            found = self.vjps[key] = _vjp(node, inputs, requires)
        return found

    def expansion(self, node: Node, inputs: tuple[TensorSpec, ...], requires: tuple[bool, ...] | None = None):
        """The expanded form the expand pass writes for ``node`` received in ``inputs``
        (:func:`_expansion`), or None where it writes none; ``requires`` None: the forward alone."""
        if not self.expand or not _expandable(node.op):
            return None
        key = (node.op, attrs_key(node.meta[meta.ATTRS]), inputs, requires)
        try:
            return self.expansions[key]
        except KeyError:
            pass
        found = self.expansions[key] = _expansion(node, inputs, requires)
        return found


def _vjp(node: Node, inputs: tuple[TensorSpec, ...], requires: tuple[bool, ...]):
    from layout_prop.passes.resolve import RESOLVE

    mesh = inputs[0].mesh
    g = Graph(mesh)
    names = []
    for i, (spec, req) in enumerate(zip(inputs, requires)):
        names.append(g.input(f"in{i}", shape=spec.shape, dtype=spec.dtype,
                             placements=spec.layout.placement_strs(), requires_grad=req))
    outs = g.op("node", node.op, names, dict(node.attrs), node.num_outputs)
    g.output(*([outs] if isinstance(outs, str) else outs))
    ctx = PassContext(AnalysisOptions(reshard=True, backward=True))
    try:
        ctx.propagate.run(g)
        fixed = RESOLVE.apply(g, ctx).graph
        back = ctx.results["backward"]
    except LayoutPropError:
        return None
    if any(n.meta.get(meta.VIOLATIONS) for n in fixed.nodes):
        return None
    inner: list = []
    work: list = []
    for n in fixed.nodes:
        if n.meta.get(meta.INSERTED_BY) == "reshard":
            plan = plan_redistribution(value_spec(fixed, n.inputs[0]), n.meta[meta.SPECS][0].layout)
            inner.extend(_moves(plan))
        elif not n.is_input and n.name != "node" and n.op != "redistribute":
            work.append(_work(n.op, [value_spec(fixed, v) for v in n.inputs], n.meta[meta.SPECS], n.attrs))
    grads = []
    for i, name in enumerate(names):
        total = back.grads.get(name)
        grads.append(None if total is None else value_spec(fixed, fixed.node(total).inputs[0]))
    return tuple(grads), tuple(inner), tuple(w for w in work if w is not None)


def _expandable(op: str) -> bool:
    """Whether ``op``'s rule has an ``expand`` hook (passes/expand.py)."""
    return type(get_rule(op)).expand is not OpRule.expand


def _expansion(node: Node, inputs: tuple[TensorSpec, ...], requires: tuple[bool, ...] | None):
    """What ``node`` costs when it receives ``inputs`` and the expand pass writes it as its rule's
    subgraph (vocab-parallel cross entropy, top-k or cumsum along a sharded dim): None where the
    pass would not (no violation, no subgraph, or one moving no fewer bytes than the plain rule's
    moves), else ``(outputs, grads, inner, work, forward work)``: the subgraph's output specs, the
    gradient spec per input (``requires`` None: the forward alone, ``()``), the collectives of the
    subgraph resharded (its forward's, and with ``requires`` its backward's), the OpCost of each
    backward op and of each forward op of the subgraph.  The one-node graph goes through the passes
    :func:`layout_prop.api.analyze` runs (propagate, expand, backward, reshard), so the plan is priced
    as the measurement of its realised graph resolves it."""
    from layout_prop.passes.expand import Expand
    from layout_prop.passes.resolve import RESOLVE

    mesh = inputs[0].mesh
    flags = requires if requires is not None else (False,) * len(inputs)
    g = Graph(mesh)
    names = []
    for i, (spec, req) in enumerate(zip(inputs, flags)):
        names.append(g.input(f"in{i}", shape=spec.shape, dtype=spec.dtype,
                             placements=spec.layout.placement_strs(), requires_grad=req))
    outs = g.op("node", node.op, names, dict(node.attrs), node.num_outputs)
    g.output(*([outs] if isinstance(outs, str) else outs))
    ctx = PassContext(AnalysisOptions(reshard=True, backward=requires is not None and any(requires)))
    try:
        ctx.propagate.run(g)
        result = Expand(ctx.propagate).run(g)
        if not result.expanded:
            return None
        forward = result.graph
        outputs = tuple(forward.node("node").meta[meta.SPECS])
        fixed = RESOLVE.apply(forward, ctx).graph
        back = ctx.results.get("backward")
    except LayoutPropError:
        return None
    if any(o is None for o in outputs) or any(n.meta.get(meta.VIOLATIONS) for n in fixed.nodes):
        return None
    parts = set(result.expanded["node"])
    inner: list = []
    work: list = []
    forward_work: list = []
    for n in fixed.nodes:
        if n.meta.get(meta.INSERTED_BY) == "reshard":
            plan = plan_redistribution(value_spec(fixed, n.inputs[0]), n.meta[meta.SPECS][0].layout)
            inner.extend(_moves(plan))
        elif not n.is_input and n.op != "redistribute":
            cost = _work(n.op, [value_spec(fixed, v) for v in n.inputs], n.meta[meta.SPECS], n.attrs)
            (forward_work if n.name in parts else work).append(cost)
    grads: list = []
    if back is not None:
        for name in names:
            total = back.grads.get(name)
            grads.append(None if total is None else value_spec(fixed, fixed.node(total).inputs[0]))
    return (outputs, tuple(grads), tuple(inner), tuple(w for w in work if w is not None),
            tuple(w for w in forward_work if w is not None))


def _work(op: str, inputs: Sequence[TensorSpec | None], outputs: Sequence[TensorSpec | None], attrs: dict):
    """The :class:`~layout_prop.perf.costs.OpCost` of ``op`` on rank 0's local shapes (None: a spec unknown)."""
    from layout_prop.perf.costs import op_cost

    if any(s is None for s in inputs) or not outputs or any(s is None for s in outputs):
        return None
    dtype = inputs[0].dtype if inputs else outputs[0].dtype
    return op_cost(op, [s.local_shape(0) for s in inputs], [s.local_shape(0) for s in outputs],
                   [s.itemsize for s in inputs], [s.itemsize for s in outputs], dict(attrs), dtype=dtype)


def _axis_options(spec: TensorSpec, axis: int, partial: bool) -> list:
    mesh = spec.mesh
    if mesh.shape[axis] == 1:
        return [Replicate()]
    opts: list = [Replicate()]
    opts += [Shard(d) for d in range(spec.ndim) if spec.shape[d] >= mesh.shape[axis]]
    if partial:
        opts.append(Partial("sum"))
    return opts


def _layout(spec: TensorSpec, placements) -> Layout | None:
    try:
        layout = Layout(spec.mesh, placements, spec.ndim)
        spec.with_layout(layout)
    except LayoutPropError:
        return None
    for d in range(spec.ndim):  # no empty shards: every mesh axis cutting d has something to cut
        cut = int(np.prod([spec.mesh.shape[a] for a, p in enumerate(layout.placements) if p == Shard(d)]))
        if cut > spec.shape[d]:
            return None
    return layout


def input_candidates(spec: TensorSpec) -> list[Layout]:
    """Every layout of an ``auto`` input: R or S(d) per mesh axis, no empty shard.

    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> [str(l) for l in input_candidates(TensorSpec((4, 1), "float32", Layout(mesh, ["R"], 2)))]
    ['(R)', '(S(0))']
    """
    per_axis = [_axis_options(spec, a, False) for a in range(spec.mesh.ndim)]
    out = []
    for combo in itertools.product(*per_axis):
        layout = _layout(spec, combo)
        if layout is not None:
            out.append(layout)
    return out


def node_strategies(node: Node, specs: Sequence[TensorSpec], rules: _Rules, partial_ok: Sequence[bool],
                    seeds: Iterable[tuple[Layout, ...]] = (), cap: int | None = None,
                    limit: int = 20000, dropped: list | None = None
                    ) -> list[tuple[tuple[Layout, ...], tuple[TensorSpec, ...]]]:
    """The (received input layouts, output specs) the node's rule accepts (module docstring).

    At most ``cap`` of them: the ``seeds`` the rule accepts first (the layouts the node
    has in the propagated and in the greedily resharded graph, so that the greedy plan
    stays a candidate), then the ones holding the fewest bytes per rank.  ``dropped``, when
    given, gets the number of accepted strategies left out (by ``cap``, or because more than
    ``limit`` combinations were there to try) appended.
    """
    found: dict[tuple[Layout, ...], tuple[TensorSpec, ...]] = {}
    for seed in seeds:
        _try(node, specs, seed, rules, found)
    first = len(found)
    mesh = specs[0].mesh
    replicated = [s.with_layout(Layout.replicated(mesh, s.ndim)) for s in specs]
    per_axis_valid = []
    for axis in range(mesh.ndim):
        options = [_axis_options(s, axis, p) for s, p in zip(specs, partial_ok)]
        valid = []
        for combo in itertools.product(*options):
            layouts = []
            for s, p in zip(replicated, combo):
                layout = _layout(s, [p if a == axis else Replicate() for a in range(mesh.ndim)])
                if layout is None:
                    break
                layouts.append(layout)
            else:
                given = tuple(s.with_layout(l) for s, l in zip(specs, layouts))
                if rules.infer(node, given) is not None or rules.expansion(node, given) is not None:
                    valid.append(combo)
        per_axis_valid.append(valid)
    count = 0
    cut = 0
    for combos in itertools.product(*per_axis_valid):
        count += 1
        if count > limit:
            cut = 1  # at least one combination was not tried
            break
        layouts = []
        for i, s in enumerate(specs):
            layout = _layout(s, [combos[a][i] for a in range(mesh.ndim)])
            if layout is None:
                break
            layouts.append(layout)
        else:
            _try(node, specs, tuple(layouts), rules, found)
    items = list(found.items())
    if cap is not None and len(items) > cap:
        rest = sorted(items[first:], key=lambda item: (_held_bytes(item), str(item[0])))
        kept = items[:first] + rest[:max(0, cap - first)]
        cut += len(items) - len(kept)
        items = kept
    if dropped is not None:
        dropped.append(cut)
    return items


def _held_bytes(item) -> int:
    layouts, outputs = item
    return sum(o.local_nbytes(0) for o in outputs)


def _try(node: Node, specs: Sequence[TensorSpec], layouts: tuple[Layout, ...], rules: _Rules, found: dict) -> None:
    """Add the strategy of receiving ``layouts`` (after the free slices the rule asks for) if accepted."""
    given = tuple(s.with_layout(l) for s, l in zip(specs, layouts))
    res = rules.infer(node, given)
    if res is None:  # the rule asks a move: the expand pass may write the node's sharded form instead
        expanded = rules.expansion(node, given)
        if expanded is not None:
            found.setdefault(layouts, expanded[0])
        return
    outputs, wants = res
    if any(w is not None and w != g.layout for w, g in zip(wants, given)):
        received = tuple(g if w is None else g.with_layout(w) for w, g in zip(wants, given))
        again = rules.infer(node, received)
        if again is None:
            return
        outputs = again[0]
        given = received
    found.setdefault(tuple(g.layout for g in given), outputs)


# --------------------------------------------------------------------------- classes of identical nodes
_NUMBER = re.compile(r"\d+")


def _pattern(name: str) -> str:
    return _NUMBER.sub("#", name, count=1)


def node_classes(graph: Graph, repeat: int = REPEAT, auto: Iterable[str] = ()) -> dict[str, str]:
    """Node name -> class name: nodes repeated ``repeat`` times alike share a class (``auto``:
    the inputs whose layout is to be chosen)."""
    auto = set(auto)
    signature: dict[str, tuple] = {}
    for node in graph.topo_order():
        if node.is_input:
            a = node.attrs
            signature[node.name] = (_pattern(node.name), "input", a.get("shape"), a.get("dtype"),
                                    str(a.get("placements")), a.get("requires_grad"), node.name in auto)
        else:
            ins = []
            for value in node.inputs:
                producer, index = graph.producer(value)
                spec = value_spec(graph, value)
                ins.append((_pattern(producer.name), index, None if spec is None else (spec.shape, spec.dtype)))
            signature[node.name] = (_pattern(node.name), node.op, attrs_key(node.attrs), tuple(ins))
    members: dict[tuple, list[str]] = {}
    for name, sig in signature.items():
        members.setdefault(sig, []).append(name)
    out = {}
    for names in members.values():
        shared = len(names) >= repeat
        for name in names:
            out[name] = names[0] if shared else name
    return out


def _cluster_price(moves: Moves, mesh, cluster) -> float:
    """Microseconds of ``moves`` priced by algorithm on ``cluster``'s links
    (:func:`~layout_prop.perf.collectives.collective_time`)."""
    from layout_prop.perf.collectives import collective_time

    shape = tuple(mesh.shape)
    return sum(collective_time(kind, nbytes, shape, axis, cluster) for axis, kind, nbytes in moves) * 1e6


# --------------------------------------------------------------------------- the time limit
class PlanTimeout(LayoutPropError):
    """The plan's time limit (``limit`` seconds, the whole command's) ran out while ``doing``."""

    def __init__(self, limit: float, doing: str) -> None:
        self.limit, self.doing = limit, doing
        super().__init__("plan-timeout", f"the time limit of {limit:g} s ran out while {doing}",
                         hint="raise --time-limit, or give fewer auto inputs")


class Deadline:
    """A time limit of ``limit`` seconds from now, for everything a plan does.

    >>> d = Deadline(30)
    >>> 29 < d.remaining() <= 30, d.check("building")
    (True, None)
    >>> Deadline(0).check("solving")
    Traceback (most recent call last):
    ...
    layout_prop.planner.solver.PlanTimeout: plan-timeout: the time limit of 0 s ran out while solving (hint: raise --time-limit, or give fewer auto inputs)
    """

    def __init__(self, limit: float, reserve: float = 0.0, start: float | None = None) -> None:
        import time

        self.limit = float(limit)
        self.start = time.perf_counter() if start is None else start  # a time.perf_counter() value
        self.end = self.start + self.limit - reserve  # ``reserve``: seconds kept for the work after the last check

    def remaining(self) -> float:
        import time

        return self.end - time.perf_counter()

    def elapsed(self) -> float:
        import time

        return time.perf_counter() - self.start

    def check(self, doing: str) -> None:
        """Raise :class:`PlanTimeout` when the time is up."""
        if self.remaining() <= 0:
            raise PlanTimeout(self.limit, doing)


# --------------------------------------------------------------------------- the program
class InfeasiblePlan(LayoutPropError):
    """No plan fits the memory limit ``limit`` (bytes per rank, as the user gave it).

    ``least`` is the memory of the plan holding the least: by the memory model (raised by
    :func:`solve`, ``measured`` false), or as the memory pass measures the realised plan
    (raised by :func:`layout_prop.commands.plan.plan_spec`, ``measured`` true: the least of the
    plans it tried, each over ``limit``).  ``problem`` is the program solved, to solve it again.
    """

    def __init__(self, limit: int, least: int, problem: "Problem | None" = None, measured: bool = False) -> None:
        from layout_prop.passes.memory import format_bytes

        self.limit, self.least, self.problem, self.measured = limit, least, problem, measured
        given = f"{limit} bytes per rank" if limit < 1024 else f"{format_bytes(limit)} ({limit} bytes) per rank"
        if measured:
            message = (f"no plan the planner tried fits in {given}: the least memory of those it tried is "
                       f"{format_bytes(least)} ({least} bytes) per rank, as check --reshard --backward measures it")
            hint = f"raise --memory-per-rank to at least {least}, or use a larger mesh"
        else:
            message = (f"no plan fits in {given}: the smallest any plan needs is {format_bytes(least)} ({least} "
                       "bytes) by the planner's memory model")
            hint = f"raise the limit to at least {least}, or use a larger mesh"
        super().__init__("memory-limit", message, hint=hint)


@dataclass
class Solution:
    """The solver's choice: a strategy per node and a layout per input, with the objective."""

    strategies: dict[str, Strategy]
    layouts: dict[str, tuple[str, ...]]  # every graph input -> placements
    cost: float  # the objective (bytes or microseconds per step, as modelled)
    memory: int  # the memory model's bytes per rank
    objective: str
    classes: int  # variables' classes (nodes of identical layers share one)
    variables: int
    seconds: float = 0.0
    alternatives: dict[str, list[tuple[tuple[str, ...], float]]] = field(default_factory=dict)
    optimal: bool = True  # proven optimal (else the best found within the time limit)
    gap: float = 0.0  # the solver's relative gap to the best bound
    problem: Any = field(default=None, repr=False)  # the Problem solved (to solve again under another limit)
    pruned: int = 0  # node classes whose accepted strategies were cut to ``cap``: optimal among those kept only
    cap: int | None = None  # strategies kept per node


class Problem:
    """The candidate strategies of every node class of a graph, and the program over them.

    ``deadline`` (a :class:`Deadline`) bounds the construction and the solves: past it,
    :class:`PlanTimeout`.  ``cache_moves`` remembers each move's cost by (source spec,
    target layout, gradient spec) across all edges (off: only within an edge, as before;
    ``benchmarks/plan.py --no-cache`` measures the difference).  ``cluster`` (a
    :class:`~layout_prop.perf.clusters.Cluster`, with ``objective="time"``) prices the
    collectives by algorithm on its links and adds every op's compute (module docstring).
    With a cluster, ``overlap`` (the default) counts the data-parallel gradient
    synchronisation (the moves of a parameter's gradient back to its layout) as ``layout-prop
    estimate`` does: hidden behind the backward's compute, only what exceeds it exposed (one
    continuous variable at least their difference; the estimate's floor of the last bucket is
    left out).  ``pruned`` counts the node classes whose accepted strategies were cut to ``cap``.
    ``seed_graphs`` are resolved graphs of the same model (a baseline as ``check --reshard``
    resolves it) whose layouts every node keeps among its candidates, as it keeps the greedy
    plan's, so that the program can choose the baseline.  With ``expansions`` (the default) a node
    whose rule has an ``expand`` hook also has the strategies the expand pass writes as a subgraph
    (vocab-parallel cross entropy, top-k and cumsum along a sharded dim): it receives its input
    where the plain rule would move it, and costs the subgraph's own moves, forward and backward
    (:func:`_expansion`); off, such a node is priced as the plain rule's moves only.  With
    ``partial_moves`` (the default) a consumer may receive a replicated value as a Partial one (a
    free local step, as ``scatter_add`` asks for its zero buffer); :class:`GlobalChoice` turns it
    off, as the greedy reshard sweep of ``check --reshard`` never makes a Partial by a move.
    """

    def __init__(self, graph: Graph, backward: bool, objective: str, optimizer: str | None,
                 repeat: int = REPEAT, cap: int | None = None, *, deadline: "Deadline | None" = None,
                 cache_moves: bool = True, cluster=None, overlap: bool = True, seed_graphs: Sequence[Graph] = (),
                 expansions: bool = True, partial_moves: bool = True) -> None:
        if objective not in OBJECTIVES:
            raise SpecError("bad-value", f"unknown objective {objective!r}", hint="use bytes or time")
        if cluster is not None and objective != "time":
            raise SpecError("bad-value", f"a cluster prices time, not the objective {objective!r}",
                        hint="use the time objective with a cluster")
        self.deadline = deadline
        self.cluster = cluster
        self.overlap = overlap
        self.cache_moves = cache_moves
        self.partial_moves = partial_moves
        self._move_cache: dict = {}
        self.pruned = 0
        links = links_of(graph)
        self.graph = graph = graph.copy_structure()  # auto inputs propagated as Replicate, the caller's untouched
        self.auto = set()
        for node in graph.inputs():
            if node.attrs.get("placements") == "auto":
                node.attrs["placements"] = ("R",) * graph.mesh.ndim
                self.auto.add(node.name)
        self.mesh = graph.mesh
        self.objective = objective
        self.links = [links[n] for n in self.mesh.names]
        self.backward = backward
        self.states = optimizer_states_per_parameter(optimizer)
        self.propagate = Propagate()
        self.propagate.run(graph)
        self.rules = _Rules(self.propagate, expansions)
        self.classes = node_classes(graph, repeat, self.auto)
        self.requires = _requires_grad(graph)
        self.cap = cap
        self.time_limit = TIME_LIMIT
        self.optimal, self.gap = True, 0.0
        self.seeds = self._seeds(seed_graphs)
        self.strategies: dict[str, list[Strategy]] = {}
        self._build()

    def _seeds(self, extra: Sequence[Graph] = ()) -> dict[str, list[tuple[Layout, ...]]]:
        """Per op node, the layouts it receives as propagated and after the greedy reshard."""
        from layout_prop.passes.reshard import Reshard

        seeds: dict[str, list] = {}
        graphs = [self.graph, *extra]
        try:
            graphs.append(Reshard(self.propagate).run(self.graph).graph)
        except LayoutPropError:
            pass
        self.seed_inputs: dict[str, list[Layout]] = {}  # an auto input's layouts in the extra graphs
        for g in graphs:
            for node in g.topo_order():
                if node.meta.get(meta.INSERTED_BY) or node.name not in self.graph:
                    continue
                if node.is_input:
                    spec = value_spec(g, node.name)
                    if node.name in self.auto and spec is not None and _same_shapes([spec], [node.name], self.graph):
                        self.seed_inputs.setdefault(node.name, []).append(spec.layout)
                    continue
                own = self.graph.node(node.name)
                # a node the expand pass wrote as a subgraph (its last node has its name) received the values
                # the node reads, before the subgraph's own moves
                read = own.inputs if node.meta.get(EXPANDED_FROM) == node.name and node.op != own.op else node.inputs
                specs = [value_spec(g, v) for v in read]
                if any(s is None for s in specs) or not _same_shapes(specs, own.inputs, self.graph):
                    continue
                seeds.setdefault(node.name, []).append(tuple(s.layout for s in specs))
        return seeds

    def price(self, moves: Moves) -> float:
        if self.cluster is not None:
            return _cluster_price(moves, self.mesh, self.cluster)
        return _price(moves, self.objective, self.links, self.mesh, tie=True)

    def compute(self, strategy: Strategy, backward_only: bool = False) -> float:
        """Microseconds of the strategy's op and its vjp's ops on ``cluster`` (0 without one);
        ``backward_only``: the vjp's alone."""
        if self.cluster is None:
            return 0.0
        from layout_prop.perf.costs import op_time

        ops = tuple(strategy.work)
        if not backward_only:
            ops += (() if strategy.op is None else (strategy.op,)) + tuple(strategy.forward_work)
        return sum(op_time(w, self.cluster) for w in ops) * 1e6

    def optimizer_time(self, spec: TensorSpec) -> float:
        """Microseconds of AdamW's step on a parameter's local shard on ``cluster`` (0 without one or without
        backward): the bytes a parameter :func:`layout_prop.perf.parallel.optimizer_bytes_per_param` says (28 for
        16-bit and float32 parameters), as the estimate and the search price it."""
        if self.cluster is None or not self.backward:
            return 0.0
        return optimizer_time(spec.local_nbytes(0), spec.itemsize, self.cluster) * 1e6

    def check_time(self, doing: str) -> None:
        if self.deadline is not None:
            self.deadline.check(doing)

    # ---------------------------------------------------------------- candidates
    def _build(self) -> None:
        graph = self.graph
        partial_ok = {}
        for node in graph.topo_order():
            cls = self.classes[node.name]
            if cls in self.strategies:
                continue
            if node.is_input:
                spec = node.meta[meta.SPECS][0]
                if node.name in self.auto:
                    layouts = input_candidates(spec.with_layout(Layout.replicated(self.mesh, spec.ndim)))
                    layouts += [l for l in dict.fromkeys(self.seed_inputs.get(node.name, ())) if l not in layouts]
                else:
                    layouts = [spec.layout]
                self.strategies[cls] = [Strategy((), (spec.with_layout(l),)) for l in layouts]
                continue
            specs = [value_spec(graph, v) for v in node.inputs]
            if any(s is None for s in specs):
                raise LayoutPropError("unplannable", f"node {node.name!r} has inputs whose layout no rule can "
                                      f"describe", node=node.name, hint="fix the violations check reports first")
            self.check_time("building the candidate strategies")
            flags = [partial_ok.setdefault(v, self._may_be_partial(v)) for v in node.inputs]
            dropped: list[int] = []
            found = node_strategies(node, specs, self.rules, flags, self.seeds.get(node.name, ()), self.cap,
                                    dropped=dropped)
            self.pruned += 1 if dropped[0] else 0
            requires = tuple(self.requires.get(v, False) for v in node.inputs)
            out = []
            for layouts, outputs in found:
                self.check_time("building the candidate strategies' gradients")
                received = tuple(s.with_layout(l) for s, l in zip(specs, layouts))
                grads, inner, work, forward = (), (), (), ()
                expanded = self.rules.infer(node, received) is None
                if expanded:  # priced as the expand pass writes it
                    differentiates = self.backward and any(requires) and get_rule(node.op).differentiable
                    got = self.rules.expansion(node, received, requires if differentiates else None)
                    if got is None:
                        continue
                    outputs, grads, inner, work, forward = got
                elif self.backward and any(requires) and get_rule(node.op).differentiable:
                    got = self.rules.vjp(node, received, requires)
                    if got is None:
                        continue
                    grads, inner, work = got
                op = None
                if self.cluster is not None:
                    op = None if expanded else _work(node.op, received, outputs, node.meta[meta.ATTRS])
                else:
                    work = forward = ()
                out.append(Strategy(layouts, outputs, grads, inner, work, op, expanded, forward))
            if not out:
                raise LayoutPropError("unplannable", f"no layout of node {node.name!r} ({node.op}) is accepted by "
                                      f"its rule", node=node.name, hint="check the node's shapes and attrs")
            self.strategies[cls] = out

    def _may_be_partial(self, value: str) -> bool:
        producer, _ = self.graph.producer(value)
        return not producer.is_input

    # ---------------------------------------------------------------- the program
    def solve(self, memory_limit: int | None, fix: dict[str, int] | None = None,
              minimise_memory: bool = False) -> tuple[dict[str, int], float, int] | None:
        """The optimal choice (class -> strategy index), its objective and modelled memory;
        None when nothing fits ``memory_limit``.  ``fix`` holds classes to given strategies;
        ``minimise_memory`` minimises the memory model instead."""
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        p = self._program()
        nvars, total = p["nvars"], p["total"]
        rows, cols, vals, lo, hi = list(p["rows"]), list(p["cols"]), list(p["vals"]), list(p["lo"]), list(p["hi"])
        if memory_limit is not None:
            nrow = len(lo)
            for v in range(nvars):
                if p["mem"][v]:
                    rows.append(nrow)
                    cols.append(v)
                    vals.append(p["mem"][v])
            lo.append(-np.inf)
            hi.append(float(memory_limit))
        lower = [0.0] * total
        upper = list(p["upper"])
        for (cls, k), var in p["index"].items():
            if fix and cls in fix:
                if fix[cls] == k:
                    lower[var] = 1.0
                else:
                    upper[var] = 0.0
        cost = np.array(p["cost"])
        mem = np.concatenate([p["mem"], np.zeros(total - nvars)])
        # ties go to the plan holding less memory (a billionth per byte: below any byte or move)
        objective = mem if minimise_memory else cost + 1e-9 * mem
        a = coo_matrix((vals, (rows, cols)), shape=(len(lo), total)).tocsr()
        integrality = np.concatenate([np.ones(nvars), np.zeros(total - nvars)])
        limit = self.time_limit
        if self.deadline is not None:
            self.deadline.check("solving")
            limit = min(limit, self.deadline.remaining())
        res = milp(objective, constraints=LinearConstraint(a, lo, hi), integrality=integrality,
                   bounds=Bounds(lower, upper), options={"time_limit": limit})
        if res.x is None:
            if res.status == 1:  # out of time before any plan was found
                if self.deadline is not None:
                    raise PlanTimeout(self.deadline.limit, "solving")
                raise LayoutPropError("plan-timeout", f"the solver found no plan within {limit:g} s",
                                      hint="raise the time limit, or give fewer auto inputs")
            return None
        self.optimal = res.status == 0
        self.gap = float(getattr(res, "mip_gap", 0.0) or 0.0)
        chosen = {}
        for (cls, k), var in p["index"].items():
            if res.x[var] > 0.5:
                chosen[cls] = k
        return chosen, float(np.dot(cost, res.x)), self._memory(chosen)

    def _program(self) -> dict:
        """The constraint matrix and costs, built once.

        Variables: one binary per (class, strategy); per edge class and pair of strategies a
        continuous ``e`` (its marginals are the two choices); per producer value class,
        producer strategy and target layout a continuous ``z`` at least the sum of the
        ``e`` that move the value there, which carries the forward move's cost: a value
        moved to one layout for several consumers is moved once, as the reshard pass does.
        The backward's moves stay on the ``e`` (each consumer's gradient is moved back).
        """
        if getattr(self, "_built", None) is not None:
            return self._built
        graph = self.graph
        index: dict[tuple[str, int], int] = {}
        for cls, strats in self.strategies.items():
            for k in range(len(strats)):
                index[(cls, k)] = len(index)
        nvars = len(index)
        cost = [0.0] * nvars
        mem = [0.0] * nvars
        upper = [1.0] * nvars
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        lo: list[float] = []
        hi: list[float] = []

        def add_row(entries, low, high):
            n = len(lo)
            for col, val in entries:
                rows.append(n)
                cols.append(col)
                vals.append(val)
            lo.append(low)
            hi.append(high)

        def new_var(c: float, up: float = 1.0) -> int:
            cost.append(c)
            upper.append(up)
            return len(cost) - 1

        for cls, strats in self.strategies.items():
            add_row([(index[(cls, k)], 1.0) for k in range(len(strats))], 1.0, 1.0)
        overlap = self.cluster is not None and self.backward and self.overlap
        sync: list[tuple[int, float]] = []  # the gradient synchronisation, minus the backward's compute
        pairs: dict[tuple, dict] = {}
        counts: dict[tuple, int] = {}
        readers = self._gradient_readers() if self.cluster is not None and self.backward else {}
        for node in graph.topo_order():
            cls = self.classes[node.name]
            for k, s in enumerate(self.strategies[cls]):
                var = index[(cls, k)]
                if node.is_input:
                    factor = 2 + self.states if node.attrs.get("requires_grad") else 1
                    mem[var] += factor * s.outputs[0].local_nbytes(0)
                    if node.attrs.get("requires_grad"):
                        cost[var] += self.optimizer_time(s.outputs[0])
                    continue
                mem[var] += sum(o.local_nbytes(0) for o in s.outputs)
                cost[var] += self.price(s.inner) + self.compute(s) + self._accumulation(node, s, readers)
                if overlap:
                    sync.append((var, -self.compute(s, backward_only=True)))
            if node.is_input:
                continue
            for i, value in enumerate(node.inputs):
                producer, j = graph.producer(value)
                key = (self.classes[producer.name], j, cls, i)
                if key not in pairs:
                    self.check_time("building the edge costs")
                    pairs[key] = self._edge(*key, self.requires.get(value, False))
                counts[key] = counts.get(key, 0) + 1
        z_vars: dict[tuple, int] = {}
        z_count: dict[tuple, int] = {}
        for (pcls, j, cls, i), table in pairs.items():
            count = counts[(pcls, j, cls, i)]
            if pcls == cls:  # a class feeding itself: only equal strategies meet
                for k in range(len(self.strategies[cls])):
                    c = table.get((k, k))
                    if c is None:
                        upper[index[(cls, k)]] = 0.0
                    else:
                        cost[index[(cls, k)]] += count * (c[0] + c[1])
                continue
            by_u: dict[int, list[int]] = {}
            by_n: dict[int, list[int]] = {}
            by_move: dict[tuple[int, Layout], list[int]] = {}
            producer = graph.node(pcls)
            syncs = overlap and producer.is_input and bool(producer.attrs.get("requires_grad"))
            for (ku, kn), (fwd, bwd) in table.items():
                var = new_var(0.0 if syncs else count * bwd)
                if syncs:
                    sync.append((var, count * bwd))
                by_u.setdefault(ku, []).append(var)
                by_n.setdefault(kn, []).append(var)
                target = self.strategies[cls][kn].inputs[i]
                by_move.setdefault((ku, target), []).append(var)
                zkey = (pcls, j, ku, target)
                if zkey not in z_vars:
                    z_vars[zkey] = new_var(fwd)
                z_count[zkey] = max(z_count.get(zkey, 0), count)
            for ku in range(len(self.strategies[pcls])):
                add_row([(v, 1.0) for v in by_u.get(ku, [])] + [(index[(pcls, ku)], -1.0)], 0.0, 0.0)
            for kn in range(len(self.strategies[cls])):
                add_row([(v, 1.0) for v in by_n.get(kn, [])] + [(index[(cls, kn)], -1.0)], 0.0, 0.0)
            for (ku, target), es in by_move.items():
                add_row([(v, 1.0) for v in es] + [(z_vars[(pcls, j, ku, target)], -1.0)], -np.inf, 0.0)
        for zkey, var in z_vars.items():
            cost[var] *= z_count[zkey]
        if overlap and sync:  # exposed >= synchronisation - backward compute, and >= 0 (the estimate's floor of
            # the last bucket is left out: which gradient is synchronised last is not linear in the choices, and
            # a floor on each parameter's own led the solver to plans the estimate measures slower)
            add_row(sync + [(new_var(1.0, np.inf), -1.0)], -np.inf, 0.0)
        self._built = {"index": index, "nvars": nvars, "total": len(cost), "cost": cost,
                       "mem": np.array(mem), "upper": upper, "rows": rows, "cols": cols, "vals": vals,
                       "lo": lo, "hi": hi}
        return self._built

    def _gradient_readers(self) -> dict[str, int]:
        """Value -> how many node inputs read it and give it a gradient (the backward sums their cotangents)."""
        readers: dict[str, int] = {}
        for node in self.graph.topo_order():
            if node.is_input or not get_rule(node.op).differentiable:
                continue
            for value in node.inputs:
                if self.requires.get(value, False):
                    readers[value] = readers.get(value, 0) + 1
        return readers

    def _accumulation(self, node: Node, strategy: Strategy, readers: dict[str, int]) -> float:
        """Microseconds of the adds that sum the cotangents of ``node``'s inputs (with a cluster): an input read
        by ``k`` gradient-giving inputs is summed by ``k - 1`` adds, charged ``(k - 1) / k`` to each reader, on the
        local shape of the gradient it gives."""
        if not readers or not strategy.grads:
            return 0.0
        from layout_prop.perf.costs import op_time

        total = 0.0
        for value, grad in zip(node.inputs, strategy.grads):
            k = readers.get(value, 0)
            if k > 1 and grad is not None:
                work = _work("add", [grad, grad], [grad], {})
                total += (k - 1) / k * op_time(work, self.cluster) * 1e6 if work is not None else 0.0
        return total

    def _memory(self, chosen: dict[str, int]) -> int:
        total = 0
        for node in self.graph.topo_order():
            s = self.strategies[self.classes[node.name]][chosen[self.classes[node.name]]]
            if node.is_input:
                factor = 2 + self.states if node.attrs.get("requires_grad") else 1
                total += factor * s.outputs[0].local_nbytes(0)
            else:
                total += sum(o.local_nbytes(0) for o in s.outputs)
        return total

    def _edge(self, pcls: str, j: int, cls: str, i: int, grad: bool) -> dict:
        """(producer strategy, consumer strategy) -> (forward cost, backward cost) of the edge;
        missing: impossible."""
        table: dict = {}
        moves: dict = self._move_cache if self.cache_moves else {}
        for kn, s in enumerate(self.strategies[cls]):
            self.check_time("building the edge costs")
            want = s.inputs[i]
            g = s.grads[i] if self.backward and grad and s.grads else None
            for ku, p in enumerate(self.strategies[pcls]):
                out = p.outputs[j]
                key = (out, want, g)
                c = moves.get(key, False)
                if c is False:
                    c = moves[key] = self._move_cost(out, want, g)
                if c is not None:
                    table[(ku, kn)] = c
        return table

    def _move_cost(self, out: TensorSpec, want: Layout, grad: TensorSpec | None) -> tuple[float, float] | None:
        for have, new in zip(out.layout.placements, want.placements):
            # a Partial is made by a computation, not by moving data; but a replicated value is a Partial one whose
            # other terms are zero, a free local step that a rule asks for (scatter_add into a P(sum) update)
            if new.is_partial() and have != new and not (self.partial_moves and isinstance(have, Replicate)):
                return None
        try:
            fwd = _moves(plan_redistribution(out, want))
            bwd: Moves = ()
            if grad is not None:
                target = [Replicate() if p.is_partial() else p for p in out.layout.placements]
                bwd = _moves(plan_redistribution(grad, Layout(self.mesh, target, out.ndim)))
        except LayoutPropError:
            return None
        return self.price(fwd), self.price(bwd)

    def solution(self, chosen: dict[str, int]) -> dict[str, Strategy]:
        """Each node's strategy under ``chosen`` (class -> strategy index)."""
        return {n.name: self.strategies[self.classes[n.name]][chosen[self.classes[n.name]]]
                for n in self.graph.topo_order()}


def _same_shapes(specs: Sequence[TensorSpec], values: Sequence[str], graph: Graph) -> bool:
    """Whether ``specs`` (another graph's) have the shapes and dtypes of ``values`` in ``graph``."""
    if len(specs) != len(values):
        return False
    for spec, value in zip(specs, values):
        own = value_spec(graph, value)
        if own is None or (own.shape, own.dtype, own.mesh) != (spec.shape, spec.dtype, spec.mesh):
            return False
    return True


def _requires_grad(graph: Graph) -> dict[str, bool]:
    req: dict[str, bool] = {}
    for node in graph.topo_order():
        if node.is_input:
            req[node.name] = bool(node.attrs.get("requires_grad"))
            continue
        flag = get_rule(node.op).differentiable and any(req.get(v) for v in node.inputs)
        for v in node.outputs:
            req[v] = flag
    return req


def solve(graph: Graph, *, backward: bool = True, objective: str = "bytes", memory_limit: int | None = None,
          optimizer: str | None = None, repeat: int = REPEAT, cap: int | None = None,
          alternatives: bool = False, problem: "Problem | None" = None, least_memory: bool = False,
          deadline: Deadline | None = None, cluster=None, cache_moves: bool = True,
          seed_graphs: Sequence[Graph] = (), expansions: bool = True) -> Solution:
    """Choose every ``auto`` input's layout and every node's strategy (module docstring).

    Parameters
    ----------
    graph : Graph
        A forward graph; inputs with ``placements: auto`` are decided, the others kept.
    backward : bool
        Count the backward of a training step too (gradients moved back, vjps' own moves).
    objective : {"bytes", "time"}
        Bytes per rank per step, or microseconds with the mesh's links.
    memory_limit : int, optional
        Bytes per rank (the memory model in the module docstring).
    optimizer : str, optional
        ``adam`` counts two states per parameter in the memory model.
    repeat : int
        Nodes repeated this often alike share their variables.
    cap : int, optional
        Strategies kept per node (default :func:`default_cap`).
    alternatives : bool
        Also solve with each ``auto`` input held at each of its other layouts, and keep
        those optima (``Solution.alternatives``).
    problem : Problem, optional
        A problem built before for this graph and these settings (``Solution.problem``):
        solving it again under another memory limit skips building it.
    least_memory : bool
        Choose the plan holding the least memory by the memory model (the cheapest of those),
        whatever ``memory_limit`` says.
    deadline : Deadline, optional
        The time limit of everything (building the problem, every solve): past it,
        :class:`PlanTimeout`.
    cluster : Cluster, optional
        With ``objective="time"``: price collectives and every op's compute on this cluster.
    cache_moves : bool
        Remember move costs across edges (:class:`Problem`).
    seed_graphs : sequence of Graph
        Resolved graphs (a baseline) whose layouts stay candidates (:class:`Problem`).
    expansions : bool
        Price the forms the expand pass writes (:class:`Problem`).

    Raises
    ------
    InfeasiblePlan
        No plan fits ``memory_limit`` (with the least memory a plan needs).
    """
    import time

    start = time.perf_counter()
    if problem is None:
        problem = Problem(graph, backward, objective, optimizer, repeat=repeat, cap=cap or default_cap(graph.mesh),
                          deadline=deadline, cluster=cluster, cache_moves=cache_moves, seed_graphs=seed_graphs,
                          expansions=expansions)
    elif deadline is not None:
        problem.deadline = deadline
    found = None if least_memory else problem.solve(memory_limit)
    if found is None:
        least = problem.solve(None, minimise_memory=True)
        if least is None:
            raise LayoutPropError("unplannable", "no assignment of strategies is consistent", hint="report this graph")
        if not least_memory:
            raise InfeasiblePlan(memory_limit, least[2], problem)
        found = problem.solve(least[2]) or least  # the cheapest plan of that memory
        memory_limit = least[2]  # (for the alternatives)
    chosen, value, memory = found
    if objective == "bytes":
        value = float(round(value))  # without the tie-breaking thousandths
    strategies = problem.solution(chosen)
    layouts = {n.name: tuple(strategies[n.name].outputs[0].layout.placement_strs()) for n in graph.inputs()}
    variables = sum(len(s) for s in problem.strategies.values())
    sol = Solution(strategies, layouts, value, memory, objective, len(problem.strategies), variables,
                   optimal=problem.optimal, gap=problem.gap, problem=problem, pruned=problem.pruned,
                   cap=problem.cap)
    if alternatives:
        for node in graph.inputs():
            if node.attrs.get("placements") != "auto":
                continue
            cls = problem.classes[node.name]
            options = []
            for k, s in enumerate(problem.strategies[cls]):
                if k == chosen[cls]:
                    continue
                other = problem.solve(memory_limit, fix={cls: k})
                if other is not None:
                    cost = float(round(other[1])) if objective == "bytes" else other[1]
                    options.append((tuple(s.outputs[0].layout.placement_strs()), cost))
            sol.alternatives[node.name] = sorted(options, key=lambda o: o[1])
    sol.seconds = time.perf_counter() - start
    return sol


# --------------------------------------------------------------------------- realising a solution
def realise(graph: Graph, strategies: dict[str, Strategy], propagate: Propagate | None = None,
            inserted_by: str = "reshard") -> tuple[Graph, int]:
    """A new graph whose nodes receive their inputs as ``strategies`` say: a ``redistribute``
    node before each input that moves (a free local slice that the rule itself asks for
    stays implicit), every node propagated again.  Returns the graph and the moves inserted."""
    propagate = propagate or Propagate()
    new = Graph(graph.mesh)
    new.meta = dict(graph.meta)
    moved: dict[tuple[str, Layout], str] = {}
    inserted = 0
    for node in graph.topo_order():
        if node.is_input:
            copy = Node(node.name, node.op, (), dict(node.attrs), 1, dict(node.meta))
            new.add_node(copy)
            propagate.visit(new, copy)
            continue
        strategy = strategies.get(node.name)
        inputs = list(node.inputs)
        if strategy is not None:
            free = []
            for i, (value, want) in enumerate(zip(node.inputs, strategy.inputs)):
                spec = value_spec(new, value)
                if spec.layout == want:
                    continue
                if plan_redistribution(spec, want).is_free:
                    free.append(i)
                    continue
                inputs[i], added = _move(new, graph, node, i, value, want, moved, propagate, inserted_by)
                inserted += added
            if free:  # a free slice stays implicit when the rule asks for it itself (lowering slices)
                trial = Node(node.name, node.op, tuple(inputs), dict(node.attrs), node.num_outputs, dict(node.meta))
                propagate.visit(new, trial)
                if trial.meta[meta.VIOLATIONS] or any(trial.meta[meta.WANTS][i] != strategy.inputs[i] for i in free):
                    for i in free:
                        inputs[i], added = _move(new, graph, node, i, node.inputs[i], strategy.inputs[i], moved,
                                                 propagate, inserted_by)
                        inserted += added
        copy = Node(node.name, node.op, tuple(inputs), dict(node.attrs), node.num_outputs,
                    {k: v for k, v in node.meta.items()})
        new.add_node(copy)
        propagate.visit(new, copy)
    new.outputs = list(graph.outputs)
    return new, inserted


def _move(new: Graph, graph: Graph, node: Node, i: int, value: str, want: Layout, moved: dict,
          propagate: Propagate, inserted_by: str) -> tuple[str, int]:
    """The value holding ``value`` moved to ``want`` (a new redistribute node, or the one made
    before for the same move), and how many nodes were added."""
    key = (value, want)
    name = moved.get(key)
    if name is not None:
        return name, 0
    operand = get_rule(node.op).operand_name(i)
    name = _fresh(f"{node.name}/{operand}", graph, new)
    move = Node(name, "redistribute", (value,), {"placements": tuple(want.placement_strs())},
                meta={meta.INSERTED_BY: inserted_by, meta.FOR: (node.name, value)})
    new.add_node(move)
    propagate.visit(new, move)
    moved[key] = name
    return name, 1


def _fresh(base: str, *graphs: Graph) -> str:
    return fresh_name(base, lambda name: any(name in g for g in graphs))


# --------------------------------------------------------------------------- for check --reshard and auto
GLOBAL_NODES = 16  # graphs of 2 to this many ops are resharded and completed by the solver in analyze
GLOBAL_RANKS = 256  # ... on meshes of at most this many ranks (the cost model's work grows with them)


def global_applies(graph: Graph) -> bool:
    """Whether :func:`layout_prop.api.analyze` asks the solver: a graph of 2 to
    :data:`GLOBAL_NODES` ops (a single op's rule already picks its cheapest fix) on at most
    :data:`GLOBAL_RANKS` ranks, scipy installed."""
    if graph.mesh.size > GLOBAL_RANKS or not 2 <= sum(1 for n in graph.nodes if not n.is_input) <= GLOBAL_NODES:
        return False
    try:
        from scipy.optimize import milp  # noqa: F401
    except ImportError:
        return False
    return True


class GlobalChoice:
    """The solver's view of a graph for ``analyze``: the best ``auto`` layouts with the
    alternatives it weighed, and each node's strategy for a given choice of them.

    The objective is bytes per rank: the forward's, and the backward's too with ``backward``.
    """

    def __init__(self, graph: Graph, backward: bool) -> None:
        self.problem = Problem(graph, backward, "bytes", None, repeat=REPEAT,
                               cap=default_cap(graph.mesh), partial_moves=False)
        self.autos = sorted(self.problem.auto)
        found = self.problem.solve(None)
        if found is None:
            raise LayoutPropError("unplannable", "no assignment of strategies is consistent",
                                  hint="check the violations without --reshard")
        self.chosen, self.cost, _ = found
        self.backward = backward

    def layouts(self, chosen: dict[str, int] | None = None) -> dict[str, tuple[str, ...]]:
        chosen = chosen or self.chosen
        return {name: tuple(self._strategy(name, chosen).outputs[0].layout.placement_strs()) for name in self.autos}

    def _strategy(self, name: str, chosen: dict[str, int]) -> Strategy:
        cls = self.problem.classes[name]
        return self.problem.strategies[cls][chosen[cls]]

    def _fix(self, layouts: dict[str, Sequence[str]]) -> dict[str, int] | None:
        fix = {}
        for name, placements in layouts.items():
            cls = self.problem.classes[name]
            for k, s in enumerate(self.problem.strategies[cls]):
                if s.outputs[0].layout.placement_strs() == list(placements):
                    fix[cls] = k
                    break
            else:
                return None
        return fix

    def solve_with(self, layouts: dict[str, Sequence[str]]) -> tuple[dict[str, int], float] | None:
        """The best choice with the ``auto`` inputs at ``layouts`` (None: not a candidate)."""
        fix = self._fix(layouts)
        if fix is None:
            return None
        found = self.problem.solve(None, fix=fix)
        return None if found is None else (found[0], found[1])

    def strategies(self, chosen: dict[str, int]) -> dict[str, Strategy]:
        return self.problem.solution(chosen)

    def notes(self, chosen: dict[str, int] | None = None, cost: float | None = None) -> list[str]:
        """Per ``auto`` input: the choice (the solver's, or ``chosen`` costing ``cost``) and every
        alternative weighed, each with the least bytes of the whole graph given it."""
        chosen = chosen or self.chosen
        cost = self.cost if cost is None else cost
        scope = "forward and backward" if self.backward else "forward"
        notes = []
        best = self.layouts(chosen)
        for name in self.autos:
            cls = self.problem.classes[name]
            options = []
            for k, s in enumerate(self.problem.strategies[cls]):
                if k == chosen[cls]:
                    continue
                found = self.problem.solve(None, fix={cls: k})
                placements = ", ".join(s.outputs[0].layout.placement_strs())
                options.append((math.inf if found is None else round(found[1]), placements))
            options.sort()
            alts = "; ".join(f"({p}): " + ("impossible" if c == math.inf else f"{c} bytes/rank") for c, p in options)
            notes.append(f"auto layout of {name!r}: ({', '.join(best[name])}) with {round(cost)} bytes/rank of "
                         f"redistribution ({scope}, the whole graph planned together); alternatives weighed: "
                         f"{alts or 'none'}")
        return notes
