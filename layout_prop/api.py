"""The Python API behind the command line: analyse a spec, report it as JSON or a table.

Examples
--------
>>> from layout_prop.api import analyze
>>> from layout_prop.io.loader import load_spec
>>> g = load_spec('''
... mesh: {shape: [2, 2], names: [dp, sp]}
... inputs:
...   x:   {shape: [4, 4, 16, 64], placements: ["S(0)", "S(2)"]}
...   cos: {shape: [1, 1, 16, 64], requires_grad: false}
...   sin: {shape: [1, 1, 16, 64], requires_grad: false}
... nodes:
...   - {name: y, op: rotary_position_embedding, inputs: [x, cos, sin], attrs: {mode: 0}}
... outputs: [y]
... ''')
>>> a = analyze(g)
>>> a.ok, a.report()["tensors"]["y"]["tensor_map"]
(True, [1, -1, 0, -1])
>>> [(r["input"], [s["kind"] for s in r["steps"]]) for r in a.report()["redistributions"]]
[('cos', ['local-slice']), ('sin', ['local-slice'])]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from json.encoder import encode_basestring_ascii  # how json.dumps writes a string (ensure_ascii)
from typing import Any

from .core import meta
from .core.graph import Graph, paused_gc

__all__ = ["Analysis", "analyze", "clear_caches", "format_table"]


@dataclass
class Analysis:
    """A graph after propagate (and optionally complete, backward, reshard) plus its check result."""

    graph: Graph
    check: Any
    notes: list[str]
    optimizer: str | None = None  # what memory_per_rank counts optimizer states for (None, sgd, adam)
    #: whether the expand pass wrote some node as its rule's subgraph (then the graph computes the
    #: subgraph's ops, and a one-device reference should run the graph as written: runner.run_graph)
    expanded: bool = False

    @property
    def ok(self) -> bool:
        return self.check.ok

    def tensors(self) -> dict[str, Any]:
        return {name: spec.to_dict() for name, spec in self._tensor_specs().items()}

    def _tensor_specs(self) -> dict[str, Any]:
        """The spec of every value ``tensors`` reports, by its name there."""
        out = {}
        inserted_by, grad_of, specs_key = meta.INSERTED_BY, meta.GRAD_OF, meta.SPECS
        for node in self.graph.topo_order():
            m = node.meta
            inserted = m.get(inserted_by)
            if inserted is not None and (inserted == "reshard" or (inserted == "backward" and not m.get(grad_of))):
                continue  # moves are listed under redistributions; backward intermediates are internal
            if node.op == "input" and node.name.startswith("cotangent/"):
                continue
            grad = m.get(grad_of)
            specs = m.get(specs_key, ())
            if len(specs) == 1 and not grad:  # the common node: one value, under its own name
                if specs[0] is not None:
                    out[node.outputs[0]] = specs[0]
                continue
            for value, spec in zip(node.outputs, specs):
                if spec is not None:
                    out[f"grad:{grad}" if grad else value] = spec
        return out

    def report(self) -> dict[str, Any]:
        out = self._report_head()
        out["tensors"] = self.tensors()
        out["violations"] = [v.to_dict() for v in self.check.violations]
        out["redistributions"] = [r.to_dict() for r in self.check.redistributions]
        out.update(self._report_tail())
        return out

    def _report_head(self) -> dict[str, Any]:
        return {"ok": self.ok, "mesh": self.graph.mesh.to_dict()}

    def _report_tail(self) -> dict[str, Any]:
        return {"total_bytes_per_rank": self.check.total_bytes_per_rank,
                "memory_per_rank": self.memory().to_dict(), "notes": list(self.notes)}

    def report_json(self) -> str:
        """:meth:`report` as compact JSON, byte for byte ``json.dumps(report(), separators=(",", ":"),
        allow_nan=False)`` (ValueError on a NaN, as there), written faster on a large graph: each
        distinct spec and plan is encoded once, not once per tensor or move.

        >>> from layout_prop.io.loader import load_spec
        >>> a = analyze(load_spec("mesh: {shape: [2]}\\ninputs: {x: {shape: [4]}}\\nnodes: []"))
        >>> a.report_json() == json.dumps(a.report(), separators=(",", ":"), allow_nan=False)
        True
        """
        with paused_gc():
            return self._report_json()

    def _report_json(self) -> str:
        dumps = partial(json.dumps, separators=(",", ":"), allow_nan=False)
        specs = self._tensor_specs()
        ids = list(map(id, specs.values()))
        # each distinct spec (uniqued specs are shared objects) written once, then every tensor in C
        texts = {key: dumps(spec.to_dict()) for key, spec in dict(zip(ids, specs.values())).items()}
        tensors = map("{}:{}".format, map(encode_basestring_ascii, specs), map(texts.__getitem__, ids))
        plans: dict[int, tuple] = {}
        moves = [r.to_json(plans) for r in self.check.redistributions]
        return (f'{dumps(self._report_head())[:-1]},"tensors":{{{",".join(tensors)}}},'
                f'"violations":{dumps([v.to_dict() for v in self.check.violations])},'
                f'"redistributions":[{",".join(moves)}],{dumps(self._report_tail())[1:]}')

    def memory(self):
        """The bytes every rank holds (:class:`~layout_prop.passes.memory.Memory`), computed once."""
        from layout_prop.passes.memory import Memory

        cached = getattr(self, "_memory", None)
        if cached is None or cached[0] != self.optimizer:
            with paused_gc():
                cached = (self.optimizer, Memory(self.optimizer).run(self.graph))
            self._memory = cached
        return cached[1]


def clear_caches() -> None:
    """Forget what the passes remember across calls (the planner's best plans, operand names,
    the table that uniques specs and layouts): the state of a new process.  The rule cache of
    :class:`Propagate` belongs to its instance.

    >>> clear_caches()
    """
    from layout_prop.passes.propagate import clear_caches as clear_propagate
    from layout_prop.core.redistribute import clear_caches as clear_redistribute

    clear_redistribute()
    clear_propagate()


def analyze(graph: Graph, *, reshard: bool = False, backward: bool = False, backend: str = "numpy",
            verify: bool = False) -> Analysis:
    """Complete ``auto`` inputs, propagate, optionally build the backward graph and reshard, check.

    With ``reshard`` on a small graph the whole-graph solver's moves replace the greedy sweep's
    when they move strictly fewer bytes per rank, but not when they no longer run an expansion
    the node's attrs ask for (``context_parallel='ring'``) as the expand pass wrote it: then the
    solver's best plan that does is tried, else the sweep's is kept, and a note says so.

    With ``backend="cann"`` the CANN kernel limits are checked on every rank's local shapes.
    With ``verify=True`` the graph verifier (:class:`~layout_prop.passes.verify.Verify`) runs
    after every pass and raises ``GraphError`` on a malformed or stale graph: what the tests
    and the op testing kit (:func:`layout_prop.testing.verify_op`) ask for.
    """
    with paused_gc():
        return _analyze(graph, reshard, backward, backend, verify)


def _analyze(graph: Graph, reshard: bool, backward: bool, backend: str, verify: bool) -> Analysis:
    from layout_prop.passes.check import Check
    from layout_prop.passes.complete import Complete
    from layout_prop.passes.propagate import Propagate
    from layout_prop.passes.reshard import Reshard
    from layout_prop.passes.verify import Verify

    notes: list[str] = list(graph.meta.get("import_notes", ()))  # what an importer noted (opaque ops...)
    was_expanded = False
    forced = []  # the expansions the nodes' attrs ask for (context_parallel='ring'), as the expand pass wrote them
    propagate = Propagate()
    autos = any(n.attrs.get("placements") == "auto" for n in graph.inputs())
    plan = _global_choice(graph, backward) if autos else None  # asked before complete fills the autos
    completed = Complete(propagate).run(graph)
    chosen = None
    if plan is not None:
        greedy = plan.solve_with(completed.chosen) if completed.chosen else None
        dropped = _dropped_rings(graph, propagate, completed, plan.layouts()) if completed.rings else []
        if dropped:  # the solver's autos drop a ring the attrs ask that the greedy choice runs: not taken
            notes.extend(completed.notes)
            notes.append(f"complete: the whole-graph choice of the auto layouts ({_layouts_text(plan.layouts())}) "
                         f"drops the ring {', '.join(dropped)} asks (context_parallel='ring'): not taken")
            chosen = greedy[0] if greedy is not None else None
        elif completed.chosen and (greedy is None or plan.cost < greedy[1] - 0.5):  # the solver's autos are better
            for name, placements in plan.layouts().items():
                graph.node(name).attrs["placements"] = placements
            propagate.run(graph)
            notes.extend(plan.notes())
            chosen = plan.chosen
        elif greedy is not None:  # the greedy choice is as good: kept, with the alternatives the solver weighed
            notes.extend(plan.notes(*greedy))
            chosen = greedy[0]
        else:
            notes.extend(completed.notes)
            chosen = plan.chosen
    else:
        notes.extend(completed.notes)
    if not completed.chosen:  # (complete leaves the graph propagated with what it chose)
        propagate.run(graph)
    if reshard:  # ops whose rule has a sharded form of several nodes (passes/expand.py) take it where cheaper
        from layout_prop.passes.expand import Expand

        expanded = Expand(propagate).run(graph)
        notes.extend(expanded.notes)
        if expanded.expanded:
            graph = expanded.graph
            was_expanded = True
            forced = expanded.forced
            if plan is not None:  # the solver's plan of the graph before: ask again on the expanded one
                plan = _global_choice(graph, backward)
                chosen = None if plan is None else plan.chosen
    if plan is None and reshard and any(v.fixable for n in graph.nodes for v in n.meta.get(meta.VIOLATIONS, ())):
        plan = _global_choice(graph, backward)  # only when there is something to fix
        chosen = None if plan is None else plan.chosen
    if verify:
        Verify().run(graph)
    forward = graph
    if backward:
        from layout_prop.passes.backward import Backward

        graph = Backward(propagate).run(graph).graph
        if verify:
            Verify().run(graph)
    if reshard:
        graph = Reshard(propagate).run(graph).graph
    check = Check().run(graph)
    if reshard and plan is not None and chosen is not None and any(
            v.fixable for n in forward.nodes for v in n.meta.get(meta.VIOLATIONS, ())):
        greedy_graph = graph
        graph, check, said = _whole_graph(forward, plan, chosen, forced, graph, check, propagate, backward)
        notes.extend(said)
        if verify and graph is not greedy_graph:
            Verify().run(graph)
    if reshard:  # an expansion the attrs ask for that the moves chosen do not run as written is said
        notes.extend(_unkept_notes(graph, forced))
    if verify:  # after reshard, a graph that checks clean must also be resolved
        Verify(resolved=reshard and check.ok).run(graph)
    if backend != "numpy":
        from layout_prop.passes.kernel_check import KernelCheck

        check.violations.extend(KernelCheck(backend).run(graph))
    return Analysis(graph, check, notes, expanded=was_expanded)


def _dropped_rings(graph: Graph, propagate, completed, layouts: dict) -> list[str]:
    """The rings the attrs ask (``context_parallel='ring'``) that the complete pass's choice runs
    (``completed.rings``) and the auto ``layouts`` would not (the expand pass would gather instead);
    ``graph`` is left with the complete pass's layouts, propagated."""
    from layout_prop.core.errors import LayoutPropError
    from layout_prop.passes.expand import Expand

    ran = {ring for rings in completed.rings.values() for ring in rings}
    if all(tuple(layouts[name]) == tuple(placements) for name, placements in completed.chosen.items()
           if name in layouts):
        return []
    try:
        for name, placements in layouts.items():
            graph.node(name).attrs["placements"] = tuple(placements)
        propagate.run(graph)
        kept = {f.node for f in Expand(propagate).run(graph).forced}
    except LayoutPropError:  # the solver's layouts do not propagate: not this function's to judge
        kept = ran
    finally:
        for name, placements in completed.chosen.items():
            graph.node(name).attrs["placements"] = placements
        propagate.run(graph)
    return sorted(ran - kept)


def _layouts_text(layouts: dict) -> str:
    """``k (S(0), R), v (R, R)``: auto layouts as a note names them."""
    return ", ".join(f"{name} ({', '.join(placements)})" for name, placements in sorted(layouts.items()))


def _global_choice(graph: Graph, backward: bool):
    """The solver's plan of a small graph (None for a larger one, or when it cannot plan it:
    the greedy passes then decide alone)."""
    from layout_prop.core.errors import LayoutPropError
    from layout_prop.planner.solver import GlobalChoice, global_applies

    if not global_applies(graph):
        return None
    try:
        return GlobalChoice(graph, backward)
    except LayoutPropError:
        return None


def _whole_graph(forward: Graph, plan, chosen, forced, greedy: Graph, check, propagate, backward: bool):
    """The solver's moves for ``forward`` when they do better than the greedy sweep's (``greedy``
    and its ``check``), else the sweep's: ``(graph, its check, notes)``.

    Better: the graph checks clean and moves strictly fewer bytes per rank (or the sweep's does
    not check), and it runs every expansion in ``forced`` (the node's attrs ask it: a ring) as
    the expand pass wrote it, unless the sweep's does not check.  When the solver's best plan
    drops such an expansion, its best plan with the expansions' nodes held as written is tried.
    """
    from layout_prop.passes.check import Check
    from layout_prop.passes.expand import unkept

    planned = _planned(forward, plan.strategies(chosen), propagate, backward)
    if planned is None:
        return greedy, check, []
    planned_check = Check().run(planned)
    better = planned_check.ok and (not check.ok or planned_check.total_bytes_per_rank < check.total_bytes_per_rank)
    if not better:
        return greedy, check, []
    dropped = [(f, what) for f in forced if (what := unkept(planned, f)) is not None]
    if not dropped or not check.ok:
        return planned, planned_check, [_chose(planned_check, check)]
    return _holding(forward, plan, forced, dropped, planned_check.total_bytes_per_rank, greedy, check, propagate,
                    backward)


def _holding(forward: Graph, plan, forced, dropped, planned_bytes: int, greedy: Graph, check, propagate,
             backward: bool):
    """When the solver's plan (``planned_bytes``) does not run the ``dropped`` expansions (each with
    what it does instead) as written: its best plan that runs every ``forced`` one so, if it moves
    fewer bytes than the greedy sweep, else the sweep's graph; ``(graph, its check, notes)``."""
    from layout_prop.passes.check import Check
    from layout_prop.passes.expand import unkept

    held = _held_choice(plan, forced)
    kept = None if held is None else _planned(forward, plan.strategies(held), propagate, backward)
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
    from layout_prop.passes.expand import unkept

    return [f"expand: {f.node} ({f.op}) does not run as written, which {f.reason} asks: in the resharded graph "
            f"{what}" for f in forced if (what := unkept(graph, f)) is not None]


def _planned(forward: Graph, strategies, propagate, backward: bool) -> Graph | None:
    """``forward`` with the moves of ``strategies`` (then its backward, resharded greedily)."""
    from layout_prop.core.errors import LayoutPropError
    from layout_prop.planner.solver import realise
    from layout_prop.passes.reshard import Reshard

    try:
        graph, _ = realise(forward, strategies, propagate)
        if backward:
            from layout_prop.passes.backward import Backward

            graph = Backward(propagate).run(graph).graph
        return Reshard(propagate).run(graph).graph
    except LayoutPropError:
        return None


def format_table(analysis: Analysis) -> str:
    """A table a person reads at a glance: values, violations, redistributions with bytes."""
    with paused_gc():
        return _format_table(analysis)


def _format_table(analysis: Analysis) -> str:
    specs = analysis._tensor_specs()
    columns: dict[int, tuple] = {}  # id of a spec -> (the spec, its columns): each distinct spec written once
    for spec in specs.values():
        if id(spec) not in columns:
            t = spec.to_dict()
            columns[id(spec)] = (spec, (str(t["shape"]), t["dtype"], "(" + ", ".join(t["placements"]) + ")",
                                        # a strided shard has no MindSpore tensor_map (JSON null)
                                        "none (strided)" if t["tensor_map"] is None else str(t["tensor_map"]),
                                        str(t["local_shape"])))
    header = ("value", "shape", "dtype", "placements", "tensor_map", "local shape")
    widths = [max([len(header[0]), *map(len, specs)])] + [
        max([len(header[i]), *(len(cols[i - 1]) for _, cols in columns.values())]) for i in range(1, len(header))]
    rests = {key: "  ".join(c.ljust(w) for c, w in zip(cols, widths[1:])).rstrip()  # the row after its name
             for key, (_, cols) in columns.items()}
    mesh = analysis.graph.mesh
    lines = ["mesh " + " x ".join(f"{n}={s}" for n, s in zip(mesh.names, mesh.shape))]
    lines.append("  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(f"{name.ljust(widths[0])}  {rests[id(spec)]}" for name, spec in specs.items())
    lines.append("")
    violations = [v.to_dict() for v in analysis.check.violations]
    if violations:
        lines.append(f"{len(violations)} violation(s):")
        for v in violations:
            where = "" if v["input"] is None and v["operand"] is None else f", input {v['input']} ({v['operand']})"
            lines.append(f"  [{v['code']}] {v['node']} ({v['op']}){where}: {v['message']}")
            lines.append(f"      fix: {v['hint']}")
    else:
        lines.append("no violations")
    moves = analysis.check.redistributions
    if moves:
        lines.append("")
        lines.append("redistributions:")
        plans: dict[int, tuple] = {}  # id of a plan -> (the plan, its text): many moves share one plan
        for move in moves:
            known = plans.get(id(move.plan))
            if known is None:
                r = move.plan.to_dict()
                steps = ", ".join(f"{s['kind']}({s['mesh_axis']})" for s in r["steps"]) or "none"
                known = plans[id(move.plan)] = (move.plan, f"({', '.join(r['from'])}) -> ({', '.join(r['to'])}) "
                                                           f"by {steps}: {r['bytes_per_rank']} bytes/rank")
            lines.append(f"  {move.input} -> {move.node}: {known[1]}")
        lines.append(f"  total: {analysis.check.total_bytes_per_rank} bytes per rank")
    lines.append("")
    lines.append(analysis.memory().format())
    for note in analysis.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
