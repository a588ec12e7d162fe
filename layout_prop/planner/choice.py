"""The greedy sweep or the whole-graph solver: one pass, :class:`SweepOrSolver`, that
:func:`layout_prop.api.analyze` runs.

The greedy sweep decides one thing at a time: :class:`~layout_prop.passes.complete.Complete`
gives each ``auto`` input the layout its consumers want, :class:`~layout_prop.passes.expand.Expand`
writes a node as its rule's subgraph where that moves fewer bytes (or where the attrs ask it:
``context_parallel='ring'``), then :data:`~layout_prop.passes.resolve.RESOLVE` appends the
backward and inserts the moves.  On a small graph (:func:`~.solver.global_applies`) the
solver of :mod:`.solver` plans the same graph as a whole, and this pass arbitrates, in two
places:

- **the auto layouts**: the solver's are taken over complete's when its whole-graph plan
  with complete's layouts costs more, unless they drop a ring the attrs ask that complete's
  run (``complete:`` note);
- **the moves**: the solver's plan of the forward graph, resolved the same way, replaces the
  sweep's when it checks clean and moves strictly fewer bytes per rank, unless it does not
  run an expansion the attrs ask as the expand pass wrote it; then the solver's best plan
  holding that expansion's nodes as written is tried, else the sweep's is kept
  (``reshard:`` notes).

Last, an expansion the attrs ask that the graph chosen does not run as written is said
(``expand:``).  Everything the arbitration says goes to ``ctx.notes``; the check of the
graph chosen is ``ctx.results["check"]``.

Examples
--------
>>> from layout_prop.io.loader import load_spec
>>> from layout_prop.passes.base import AnalysisOptions
>>> from layout_prop.passes.pass_manager import PassContext
>>> g = load_spec('''
... mesh: {shape: [2], names: [tp]}
... inputs:
...   x: {shape: [4, 8], placements: ["S(1)"]}
...   w: {shape: [8, 6], placements: auto}
... nodes: [{name: y, op: matmul, inputs: [x, w]}, {name: z, op: relu, inputs: [y]}]
... ''')
>>> ctx = PassContext(AnalysisOptions(reshard=True))
>>> result = SweepOrSolver().apply(g, ctx)
>>> result.graph.node("w").attrs["placements"], ctx.results["check"].ok
(('R',), True)
>>> g.node("w").attrs["placements"]  # the given graph is unchanged
'auto'
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layout_prop.core import meta
from layout_prop.core.errors import LayoutPropError
from layout_prop.core.graph import Graph
from layout_prop.passes.base import GraphPass, PassResult, own_copy
from layout_prop.passes.check import Check, CheckResult
from layout_prop.passes.complete import Complete, CompleteResult
from layout_prop.passes.expand import Expand, Forced, unkept
from layout_prop.passes.pass_manager import PassContext
from layout_prop.passes.resolve import RESOLVE
from layout_prop.passes.verify import Verify

__all__ = ["Choice", "SweepOrSolver"]


@dataclass
class Choice:
    """What :class:`SweepOrSolver` decided: the forward graph it resolved (layouts chosen,
    expansions written), whether the expand pass wrote any node, the expansions the attrs ask
    (:class:`~layout_prop.passes.expand.Forced`) and the check of the graph chosen."""

    forward: Graph
    check: CheckResult
    expanded: bool = False
    forced: list[Forced] = field(default_factory=list)


class SweepOrSolver(GraphPass):
    """The auto layouts, the expansions, the backward and the moves: the greedy sweep's, or the
    whole-graph solver's where it does better and runs what the attrs ask (module docstring)."""

    name = "sweep-or-solver"
    transforms = True

    def apply(self, graph: Graph, ctx: PassContext) -> PassResult:
        options = ctx.options
        autos = any(n.attrs.get("placements") == "auto" for n in graph.inputs())
        plan = _global_choice(graph, options.backward) if autos else None  # asked before complete fills the autos
        forward, chosen = _layouts(graph, plan, ctx)
        expanded, forced = False, []
        if options.reshard:  # ops whose rule has a sharded form of several nodes (passes/expand.py) take it where cheaper
            written = Expand().apply(forward, ctx)
            if written.modified:
                forward, expanded, forced = written.graph, True, written.detail.forced
                if plan is not None:  # the solver's plan of the graph before: ask again on the expanded one
                    plan = _global_choice(forward, options.backward)
                    chosen = None if plan is None else plan.chosen
            if plan is None and _fixable(forward):
                plan = _global_choice(forward, options.backward)  # only when there is something to fix
                chosen = None if plan is None else plan.chosen
        if options.verify:
            Verify().run(forward)
        resolved = RESOLVE.apply(forward, ctx).graph
        check = Check().run(resolved)
        if options.reshard and plan is not None and chosen is not None and _fixable(forward):
            swept = resolved
            resolved, check, said = _whole_graph(forward, plan, chosen, forced, swept, check, ctx)
            ctx.notes.extend(said)
            if options.verify and resolved is not swept:
                Verify().run(resolved)
        if options.reshard:  # an expansion the attrs ask for that the moves chosen do not run as written is said
            ctx.notes.extend(_unkept_notes(resolved, forced))
        ctx.results["check"] = check
        return PassResult(resolved, resolved is not graph, Choice(forward, check, expanded, forced))


def _fixable(graph: Graph) -> bool:
    """Whether some node of ``graph`` (propagated) has a violation a move fixes."""
    return any(v.fixable for n in graph.nodes for v in n.meta.get(meta.VIOLATIONS, ()))


# --------------------------------------------------------------------------- the auto layouts
def _layouts(graph: Graph, plan, ctx: PassContext) -> tuple[Graph, dict | None]:
    """``graph`` with its auto layouts chosen (complete's, or the solver's ``plan``'s), propagated,
    and the solver's choice (class -> strategy) that goes with them (None: no plan, or none fits)."""
    completed = Complete(ctx.propagate).run(graph)
    forward, chosen = completed.graph, None
    if plan is None:
        ctx.notes.extend(completed.notes)
    else:
        forward, chosen = _arbitrate_layouts(completed, plan, ctx)
    if not completed.chosen:  # (complete leaves its graph propagated with what it chose)
        ctx.propagate.run(forward)
    return forward, chosen


def _arbitrate_layouts(completed: CompleteResult, plan, ctx: PassContext) -> tuple[Graph, dict | None]:
    """Complete's layouts or the solver's (the module docstring): the graph and the solver's choice."""
    forward = completed.graph
    greedy = plan.solve_with(completed.chosen) if completed.chosen else None
    dropped = _dropped_rings(completed, plan.layouts(), ctx) if completed.rings else []
    if dropped:  # the solver's autos drop a ring the attrs ask that the greedy choice runs: not taken
        ctx.notes.extend(completed.notes)
        ctx.notes.append(f"complete: the whole-graph choice of the auto layouts ({_layouts_text(plan.layouts())}) "
                         f"drops the ring {', '.join(dropped)} asks (context_parallel='ring'): not taken")
        return forward, greedy[0] if greedy is not None else None
    if completed.chosen and (greedy is None or plan.cost < greedy[1] - 0.5):  # the solver's autos are better
        ctx.notes.extend(plan.notes())
        return _with_layouts(forward, plan.layouts(), ctx), plan.chosen
    if greedy is not None:  # the greedy choice is as good: kept, with the alternatives the solver weighed
        ctx.notes.extend(plan.notes(*greedy))
        return forward, greedy[0]
    ctx.notes.extend(completed.notes)
    return forward, plan.chosen


def _with_layouts(graph: Graph, layouts: dict, ctx: PassContext) -> Graph:
    """A copy of ``graph`` with the inputs of ``layouts`` at those placements, propagated."""
    new = own_copy(graph)
    for name, placements in layouts.items():
        new.node(name).attrs["placements"] = tuple(placements)
    ctx.propagate.run(new)
    return new


def _dropped_rings(completed: CompleteResult, layouts: dict, ctx: PassContext) -> list[str]:
    """The rings the attrs ask (``context_parallel='ring'``) that the complete pass's choice runs
    (``completed.rings``) and the auto ``layouts`` would not (the expand pass would gather instead)."""
    ran = {ring for rings in completed.rings.values() for ring in rings}
    if all(tuple(layouts[name]) == tuple(placements) for name, placements in completed.chosen.items()
           if name in layouts):
        return []
    try:
        trial = _with_layouts(completed.graph, layouts, ctx)
        kept = {f.node for f in Expand(ctx.propagate).run(trial).forced}
    except LayoutPropError:  # the solver's layouts do not propagate: not this function's to judge
        kept = ran
    return sorted(ran - kept)


def _layouts_text(layouts: dict) -> str:
    """``k (S(0), R), v (R, R)``: auto layouts as a note names them."""
    return ", ".join(f"{name} ({', '.join(placements)})" for name, placements in sorted(layouts.items()))


def _global_choice(graph: Graph, backward: bool):
    """The solver's plan of a small graph (None for a larger one, or when it cannot plan it:
    the greedy passes then decide alone)."""
    from .solver import GlobalChoice, global_applies

    if not global_applies(graph):
        return None
    try:
        return GlobalChoice(graph, backward)
    except LayoutPropError:
        return None


# --------------------------------------------------------------------------- the moves
def _whole_graph(forward: Graph, plan, chosen, forced, greedy: Graph, check, ctx: PassContext):
    """The solver's moves for ``forward`` when they do better than the greedy sweep's (``greedy``
    and its ``check``), else the sweep's: ``(graph, its check, notes)``.

    Better: the graph checks clean and moves strictly fewer bytes per rank (or the sweep's does
    not check), and it runs every expansion in ``forced`` (the node's attrs ask it: a ring) as
    the expand pass wrote it, unless the sweep's does not check.  When the solver's best plan
    drops such an expansion, its best plan with the expansions' nodes held as written is tried.
    """
    planned = _planned(forward, plan.strategies(chosen), ctx)
    if planned is None:
        return greedy, check, []
    planned_check = Check().run(planned)
    better = planned_check.ok and (not check.ok or planned_check.total_bytes_per_rank < check.total_bytes_per_rank)
    if not better:
        return greedy, check, []
    dropped = [(f, what) for f in forced if (what := unkept(planned, f)) is not None]
    if not dropped or not check.ok:
        return planned, planned_check, [_chose(planned_check, check)]
    return _holding(forward, plan, forced, dropped, planned_check.total_bytes_per_rank, greedy, check, ctx)


def _holding(forward: Graph, plan, forced, dropped, planned_bytes: int, greedy: Graph, check, ctx: PassContext):
    """When the solver's plan (``planned_bytes``) does not run the ``dropped`` expansions (each with
    what it does instead) as written: its best plan that runs every ``forced`` one so, if it moves
    fewer bytes than the greedy sweep, else the sweep's graph; ``(graph, its check, notes)``."""
    held = _held_choice(plan, forced)
    kept = None if held is None else _planned(forward, plan.strategies(held), ctx)
    kept_check = None if kept is None else Check().run(kept)
    if (kept_check is None or not kept_check.ok or kept_check.total_bytes_per_rank >= check.total_bytes_per_rank
            or any(unkept(kept, f) is not None for f in forced)):
        kept, kept_check = greedy, check
        instead = f"the greedy sweep's {check.total_bytes_per_rank} bytes per rank run it as written"
    else:
        instead = f"the solver's best plan that runs it as written moves {kept_check.total_bytes_per_rank}"
    said = [f"reshard: the whole-graph plan of {planned_bytes} bytes per rank does not run {f.node} ({f.op}) as "
            f"the expand pass wrote it, which {f.reason} asks: {what}; not taken: {instead}" for f, what in dropped]
    if kept is not greedy:
        said.append(_chose(kept_check, check))
    return kept, kept_check, said


def _chose(planned_check, check) -> str:
    """The note of a whole-graph plan taken: its bytes and the greedy sweep's."""
    return (f"reshard: chose where to redistribute over the whole graph: {planned_check.total_bytes_per_rank} bytes "
            f"per rank (the greedy sweep moves {check.total_bytes_per_rank})")


def _held_choice(plan, forced):
    """The solver's best choice (class -> strategy) with every part of the ``forced`` expansions
    receiving its inputs as the expand pass wrote them, their strategies held fixed in the
    program (None when a part has no such strategy, or nothing is consistent with them)."""
    problem = plan.problem
    fix = {}
    for f in forced:
        for part in f.parts:
            cls = problem.classes.get(part)
            if cls is None:
                return None
            want = tuple(read.layout for read in f.reads[part])
            k = next((k for k, s in enumerate(problem.strategies[cls]) if tuple(s.inputs) == want), None)
            if k is None or fix.get(cls, k) != k:
                return None
            fix[cls] = k
    found = problem.solve(None, fix=fix)
    return None if found is None else found[0]


def _unkept_notes(graph: Graph, forced) -> list[str]:
    """A note per expansion of ``forced`` that ``graph`` (resharded) does not run as the expand pass
    wrote it: ``expand:``, as it takes back that pass's note (``run`` prints those)."""
    return [f"expand: {f.node} ({f.op}) does not run as written, which {f.reason} asks: in the resharded graph "
            f"{what}" for f in forced if (what := unkept(graph, f)) is not None]


def _planned(forward: Graph, strategies, ctx: PassContext) -> Graph | None:
    """``forward`` with the moves of ``strategies``, then resolved as the sweep's is (its backward,
    the moves the solver left to the greedy sweep)."""
    from .solver import realise

    try:
        graph, _ = realise(forward, strategies, ctx.propagate)
        return RESOLVE.apply(graph, ctx).graph
    except LayoutPropError:
        return None
