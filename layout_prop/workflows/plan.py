"""The work of ``layout-prop plan`` (:func:`plan_spec`): fill every ``auto`` layout with the solver, and
report the planned spec next to a baseline.

The planned spec is an ordinary spec: the inputs with their chosen layouts, the nodes, and
an explicit ``redistribute`` node wherever the plan moves a value, so that ``check``,
``run`` and ``viz`` read exactly the plan that was chosen.  The figures of the report are
measured, not modelled: bytes per rank of every redistribution of the forward, and of the
forward and backward (``check --reshard [--backward]`` on the planned spec), the modelled
time of those redistributions with the mesh's links, and the memory per rank (the memory
pass).  The baseline is the spec's own layouts (its ``auto`` layouts completed as ``check``
completes them), or another spec given with ``--baseline`` (for example ``gen llama``'s
Megatron layouts).

Examples
--------
>>> from layout_prop.io.loader import load_spec
>>> report = plan_spec(load_spec('''
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
... '''), backward=False)
>>> report.spec["inputs"]["w1"]["placements"], report.plan["forward_bytes_per_rank"]
(['S(1)'], 0)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from layout_prop.core import meta
from layout_prop.core.graph import Graph
from layout_prop.io.sizes import parse_size

__all__ = ["plan_spec", "PlanReport", "graph_to_spec", "measure", "parse_bytes", "DEFAULT_TIME_LIMIT"]


def parse_bytes(text: str) -> int:
    """``--memory-per-rank``: ``16GiB`` -> 17179869184, in the one size grammar of
    :mod:`layout_prop.io.sizes` (the same as ``run --max-memory``); refused with ``bad-value``.

    >>> parse_bytes("16GiB"), parse_bytes("1.5 KB"), parse_bytes("4096"), parse_bytes("3MB"), parse_bytes("512M")
    (17179869184, 1500, 4096, 3000000, 536870912)
    """
    return parse_size(text, code="bad-value", label="memory per rank (--memory-per-rank)")


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def graph_to_spec(graph: Graph, links: dict | None = None) -> dict:
    """The spec dict of a forward graph (inputs with their placements, nodes, outputs).

    ``links`` (axis -> :class:`~layout_prop.core.links.Link`) are written under the mesh.
    """
    mesh: dict[str, Any] = {"shape": list(graph.mesh.shape), "names": list(graph.mesh.names)}
    if links:
        mesh["links"] = {axis: {"GBps": link.GBps, "latency_us": link.latency_us} for axis, link in links.items()}
    inputs = {}
    nodes = []
    for node in graph.topo_order():
        if node.is_input:
            a = node.attrs
            inputs[node.name] = {"shape": list(a["shape"]), "dtype": a["dtype"],
                                 "placements": _plain(a["placements"]), "requires_grad": bool(a["requires_grad"])}
        else:
            nodes.append({"name": node.name, "op": node.op, "inputs": list(node.inputs),
                          "attrs": _plain(dict(node.attrs))})
    return {"mesh": mesh, "inputs": inputs, "nodes": nodes, "outputs": list(graph.outputs)}


def measure(graph: Graph, optimizer: str | None = None, links: dict | None = None, cluster=None,
            backward: bool = True) -> dict[str, Any]:
    """Bytes per rank (forward; forward and backward), modelled time and memory per rank of
    ``graph`` as ``check --reshard`` resolves it; with ``cluster``, also ``step_time_s``, the
    training step ``layout-prop estimate`` models on it (without ``backward``: the forward's
    compute and communication alone, for inference).  The graph is not changed."""
    from layout_prop.api import analyze
    from layout_prop.passes.memory import Memory
    from layout_prop.core.links import links_of
    from layout_prop.planner.solver import plan_cost

    links = links or links_of(graph)
    forward = analyze(graph.copy_structure(), reshard=True)
    full = analyze(graph.copy_structure(), reshard=True, backward=True)
    time_us = sum(plan_cost(r.plan, "time", links) for r in full.check.redistributions)
    out = {
        "ok": forward.ok and full.ok,
        "forward_bytes_per_rank": forward.check.total_bytes_per_rank,
        "bytes_per_step": full.check.total_bytes_per_rank,
        "time_us_per_step": round(time_us, 3),
        "memory_per_rank": Memory(optimizer).run(full.graph).to_dict(),
    }
    if cluster is not None:
        from layout_prop.perf.step import estimate_step

        if backward:
            out["step_time_s"] = estimate_step(full.graph, cluster).step_time_s
        else:
            step = estimate_step(forward.graph, cluster)
            out["step_time_s"] = step.compute_s + step.communication_s
    return out


def score(figures: dict[str, Any], objective: str, backward: bool) -> float:
    """The measured figure ``objective`` minimises: bytes per step (forward only without
    ``backward``), the modelled step time on the cluster when measured with one, else the
    links' modelled time of the redistributions.

    >>> score({"bytes_per_step": 10, "forward_bytes_per_rank": 4, "time_us_per_step": 2.5}, "bytes", False)
    4.0
    """
    if objective == "bytes":
        return float(figures["bytes_per_step"] if backward else figures["forward_bytes_per_rank"])
    if "step_time_s" in figures:
        return float(figures["step_time_s"])
    return float(figures["time_us_per_step"])


@dataclass
class PlanReport:
    """What ``layout-prop plan`` reports (``to_dict`` is its JSON)."""

    spec: dict
    layouts: dict[str, list[str]]
    auto: list[str]
    plan: dict[str, Any]
    baseline: dict[str, Any]
    baseline_layouts: dict[str, list[str]]
    solver: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.plan["ok"], "layouts": self.layouts, "auto": self.auto, "plan": self.plan,
                "baseline": self.baseline, "baseline_layouts": self.baseline_layouts, "solver": self.solver,
                "notes": self.notes}

    def format(self) -> str:
        from layout_prop.passes.memory import format_bytes

        s = self.solver
        objective = s["objective"] + (f" on {s['cluster']}" if s.get("cluster") else "")
        if "classes" in s:
            unit = "bytes per rank" if s["objective"] == "bytes" else "us"
            head = (f"plan: objective {objective}, {s['classes']} node classes, {s['strategies']} strategies, "
                    f"{s['seconds']:.2f} s of a {s['time_limit']:g} s limit (modelled {s['modelled_cost']:g} {unit} "
                    f"per step, measured {s['measured_cost']:g}, {s['optimality']})")
        else:
            head = f"plan: objective {objective}, no plan found in {s['seconds']:.2f} s of a {s['time_limit']:g} s limit"
        if s.get("kept") == "baseline":
            head += "; the baseline is kept"
        lines = [head]
        rows = [("input", "layout", "baseline", "declared")]
        for name, layout in self.layouts.items():
            base = self.baseline_layouts.get(name)
            rows.append((name, "(" + ", ".join(layout) + ")", "(" + ", ".join(base) + ")" if base else "-",
                         "auto" if name in self.auto else ""))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        for k, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if k == 0:
                lines.append("  ".join("-" * w for w in widths).rstrip())
        lines.append("")
        p, b = self.plan, self.baseline
        table = [("per rank", "plan", "baseline"),
                 *([("modelled step time, compute included (us)", f"{p['step_time_s'] * 1e6:.6g}",
                     f"{b['step_time_s'] * 1e6:.6g}")]
                   if "step_time_s" in p else []),
                 ("bytes per step (forward + backward)", str(p["bytes_per_step"]), str(b["bytes_per_step"])),
                 ("bytes, forward only", str(p["forward_bytes_per_rank"]), str(b["forward_bytes_per_rank"])),
                 ("redistributions on the mesh's links (us)", f"{p['time_us_per_step']:g}", f"{b['time_us_per_step']:g}"),
                 ("memory", format_bytes(p["memory_per_rank"]["total"]),
                  format_bytes(b["memory_per_rank"]["total"]))]
        widths = [max(len(r[i]) for r in table) for i in range(3)]
        for r in table:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


#: seconds the whole plan command may take by default (--time-limit): building the model, every solve, the ladder
DEFAULT_TIME_LIMIT = 60.0
#: the solver stops this many times the baseline's measurement before the limit, to measure its last plan
RESERVE = 1.5


def plan_spec(graph: Graph, *, backward: bool = True, objective: str = "bytes", memory_limit: int | None = None,
              optimizer: str | None = None, baseline: Graph | None = None,
              time_limit: float = DEFAULT_TIME_LIMIT, cluster=None,
              progress: Callable[[str], None] | None = None) -> PlanReport:
    """Solve ``graph`` (a loaded spec), realise the plan and measure it and the baseline.

    With ``memory_limit`` the plan returned holds at most that many bytes per rank as
    measured (:func:`measure`), never only by the model; :class:`InfeasiblePlan` (with the
    given limit, and the measured memory of the least plan found) when none does and the
    baseline does not fit either.

    Never worse than the baseline: the baseline (``baseline``, else ``graph``'s own layouts
    completed as ``check`` completes them) is measured first; when it fits ``memory_limit``
    and beats every plan found under ``objective`` (:func:`score`; the same score in less
    memory beats too), or the
    time ran out before a plan was found, the baseline is the plan reported and written, and
    a note says so.  ``time_limit`` seconds bound everything (the baseline's measurement, the
    model's construction, every solve and measurement of the memory ladder); the solver's
    search gets what is left.  With ``cluster`` (``objective="time"``) the solver minimises
    the modelled step time on it, compute included, and both are measured with
    ``layout-prop estimate``'s model (``step_time_s``).  ``progress`` (a
    :class:`~layout_prop.io.progress.Ticker`'s ``say``) is told each phase.
    """
    from layout_prop.core.links import links_of
    from layout_prop.planner.solver import Deadline, InfeasiblePlan, PlanTimeout

    start = time.perf_counter()
    priced = cluster if objective == "time" else None  # the solver's cluster; the figures use it either way
    links = links_of(graph)
    base_graph = baseline if baseline is not None else graph
    auto = [n.name for n in graph.inputs() if n.attrs.get("placements") == "auto"]
    notes: list[str] = []
    say = progress if progress is not None else (lambda text: None)
    say("measuring the baseline")
    base = measure(base_graph, optimizer, links, cluster, backward)
    base_spec, baseline_layouts, resolved = _baseline_spec(base_graph, links if graph.meta.get(meta.LINKS) else None)
    seeds = (resolved,)  # the baseline's layouts stay among the solver's candidates
    # the solver stops early enough to realise and measure its last plan (about what the baseline took)
    deadline = Deadline(time_limit, reserve=RESERVE * (time.perf_counter() - start), start=start)
    base_fits = base["ok"] and (memory_limit is None or base["memory_per_rank"]["total"] <= memory_limit)
    found = None
    say(f"solving ({len(auto)} auto inputs, time limit {time_limit:g} s)"
        + ("" if memory_limit is None else ", then measuring each plan against the memory limit"))
    try:
        if memory_limit is None:
            found = _attempt(graph, backward, objective, None, optimizer, links, None, deadline=deadline,
                             cluster=cluster, priced=priced, seeds=seeds)
        else:
            found = _fit(graph, backward, objective, memory_limit, optimizer, links, notes, deadline, cluster, priced,
                         seeds)
    except PlanTimeout as err:
        if not base_fits:
            raise
        notes.append(f"the time limit of {err.limit:g} s ran out while {err.doing}, before any plan was found: "
                     "the baseline is reported and written")
    except InfeasiblePlan:
        if not base_fits:
            raise
        notes.append(f"the planner found no plan within the memory limit of {memory_limit} bytes per rank, but the "
                     f"baseline fits ({base['memory_per_rank']['total']} bytes): the baseline is reported and written")
    seconds = round(deadline.elapsed(), 3)
    solver: dict[str, Any] = {"objective": objective, "cluster": None if cluster is None else cluster.name,
                              "time_limit": time_limit, "seconds": seconds, "backward": backward}
    if found is not None:
        solution, realised, moves, plan = found
        solver.update(_solver_figures(solution, moves))
        # the solver's plan as measured, in the model's unit (the model and the measurement differ: docs/planning.md)
        measured = score(plan, objective, backward)
        solver["measured_cost"] = round(measured * 1e6 if "step_time_s" in plan and objective == "time" else measured, 3)
        if not solution.optimal:
            gap = solver["gap"]
            notes.append(f"the solver ran out of time ({solution.seconds:.0f} s): the plan is the best found, " +
                         (f"within {gap:.1%} of the best bound" if gap is not None else "with no bound proven yet"))
        if base_fits and _better(base, plan, objective, backward):
            notes.append(f"the baseline beats the plan found under the {objective} objective "
                         f"({_shown(score(plan, objective, backward), objective)} against the baseline's "
                         f"{_shown(score(base, objective, backward), objective)}"
                         f"{' within the memory limit' if memory_limit is not None else ''}): "
                         "the baseline is kept, reported and written as the plan")
            found = None
    if found is None:
        solver["kept"] = "baseline"
        solver.setdefault("optimal", False)
        solver.setdefault("optimality", "the baseline: no plan found beats it")
        spec, layouts, plan = base_spec, dict(baseline_layouts), base
    else:
        solver["kept"] = "plan"
        spec = graph_to_spec(realised, links if graph.meta.get(meta.LINKS) else None)
        layouts = {name: list(spec["inputs"][name]["placements"]) for name in spec["inputs"]}
    return PlanReport(spec, layouts, auto, plan, base, baseline_layouts, solver, notes)


def _better(base: dict, plan: dict, objective: str, backward: bool) -> bool:
    """Whether the baseline beats the plan: a lower score, or the same score in less memory."""
    b, p = score(base, objective, backward), score(plan, objective, backward)
    return b < p or (b == p and base["memory_per_rank"]["total"] < plan["memory_per_rank"]["total"])


def _shown(value: float, objective: str) -> str:
    return f"{value:g} bytes per rank" if objective == "bytes" else f"{value:g}"


def _solver_figures(solution, moves: int) -> dict[str, Any]:
    """The solver's part of the report: its size, its modelled figures and what it proved."""
    gap = solution.gap if math.isfinite(solution.gap) else None  # HiGHS's gap is infinite before it has a bound
    if not solution.optimal:
        optimality = "not proven optimal"
    elif solution.pruned:
        optimality = f"optimal among the {solution.cap} strategies kept per node"
    else:
        optimality = "proven optimal"
    return {"classes": solution.classes, "strategies": solution.variables,
            "solve_seconds": round(solution.seconds, 3), "modelled_cost": round(solution.cost, 3),
            "modelled_memory": solution.memory, "moves": moves, "optimal": solution.optimal and not solution.pruned,
            "optimality": optimality, "pruned_nodes": solution.pruned, "strategies_kept_per_node": solution.cap,
            "gap": gap}


def _baseline_spec(graph: Graph, links: dict | None) -> tuple[dict, dict[str, list[str]], Graph]:
    """The baseline as a planned spec (its layouts completed, an explicit redistribute node
    wherever ``check --reshard`` moves a value), its inputs' layouts, and the resolved graph."""
    from layout_prop.api import analyze

    resolved = analyze(graph.copy_structure(), reshard=True).graph
    layouts = {}
    for node in resolved.inputs():
        placements = list(node.meta[meta.SPECS][0].layout.placement_strs())
        node.attrs["placements"] = placements
        layouts[node.name] = placements
    return graph_to_spec(resolved, links), layouts, resolved


def _attempt(graph: Graph, backward: bool, objective: str, model_limit: int | None, optimizer: str | None,
             links: dict, problem, least_memory: bool = False, deadline=None, cluster=None, priced=None,
             seeds=()):
    """Solve under ``model_limit`` (the memory model's), realise the plan and measure it:
    (solution, realised graph, moves inserted, measured figures)."""
    from layout_prop.planner.solver import realise, solve

    solution = solve(graph, backward=backward, objective=objective, memory_limit=model_limit, optimizer=optimizer,
                     problem=problem, least_memory=least_memory, deadline=deadline, cluster=priced,
                     seed_graphs=seeds)
    planned = graph.copy_structure()
    for node in planned.inputs():
        node.attrs["placements"] = solution.layouts[node.name]
    realised, moves = realise(planned, solution.strategies)
    return solution, realised, moves, measure(realised, optimizer, links, cluster, backward)


#: times the model's limit is tightened after a plan measured over the user's limit
TIGHTEN_ROUNDS = 3
#: plans on the ladder of modelled memory tried when tightening found none within the limit
LADDER = 6


def _fit(graph: Graph, backward: bool, objective: str, limit: int, optimizer: str | None, links: dict,
         notes: list[str], deadline=None, cluster=None, priced=None, seeds=()):
    """The cheapest plan found whose measured memory per rank is at most ``limit``.

    The program's memory constraint is a model, and the memory pass measures something else:

    - the model counts every forward value's local bytes once, as if all were alive when the
      backward starts; the memory pass walks each rank's lowered program and holds a value
      only from the op that makes it to its last use (the model is high there);
    - the model leaves out what the backward makes (cotangents, intermediate gradients) and
      the buffers of every redistribution (a collective's result next to its input), which
      the memory pass counts (the model is low there);
    - the model counts rank 0's shards, the memory pass the busiest rank (uneven shards).

    Liveness (a peak over the program's order, per rank, of values that exist or not
    depending on the strategies chosen) is not linear in the choices, so the model stays an
    estimate, and every plan is measured before it is reported.  A plan over ``limit`` is
    solved again with the model's limit tightened below its modelled memory by the excess,
    up to :data:`TIGHTEN_ROUNDS` times.  Then a ladder of plans is measured, chosen without
    regard to ``limit``: the plan of least modelled memory, the cheapest plan, and the
    cheapest under :data:`LADDER` modelled limits between the two; the cheapest plan within
    ``limit`` is returned.  When no plan tried fits, :class:`InfeasiblePlan` names ``limit``
    as given and the least measured memory of the plans tried (over ``limit``, and held by a
    plan the planner built): the least the search found, not a proof that nothing between
    the two fits.

    The search stops where ``deadline`` falls: the cheapest plan tried that fits is returned
    (with a note), and :class:`PlanTimeout` is raised when none was.
    """
    from layout_prop.planner.solver import InfeasiblePlan, PlanTimeout

    problem = None
    tried: dict = {}  # the plans measured: their strategies -> (measured memory, found)

    def remember(found) -> int:
        solution, _, _, plan = found
        held = plan["memory_per_rank"]["total"]
        tried[tuple(solution.strategies[n] for n in sorted(solution.strategies))] = (held, found)
        return held

    def attempt(model_limit, least_memory=False):
        return _attempt(graph, backward, objective, model_limit, optimizer, links, problem, least_memory,
                        deadline, cluster, priced, seeds)

    model_limit: int | None = limit
    for _ in range(1 + TIGHTEN_ROUNDS):
        try:
            found = attempt(model_limit)
        except InfeasiblePlan as err:  # the model puts every plan over: a plan of the ladder may still fit
            problem = err.problem
            break
        problem = found[0].problem
        held = remember(found)
        if held <= limit:
            return found
        model_limit = found[0].memory - (held - limit)  # the model was low by the excess: ask that much less
        if model_limit < 0:
            break
    over = sorted({held for held, _ in tried.values()})
    try:
        least = attempt(None, least_memory=True)
        remember(least)
        cheapest = attempt(None)
        remember(cheapest)
        low, high = least[0].memory, cheapest[0].memory
        for k in range(1, LADDER + 1):
            step = low + (high - low) * k // (LADDER + 1)
            if low < step < high:
                remember(attempt(step))
    except PlanTimeout as err:
        if not any(held <= limit for held, _ in tried.values()):
            raise
        notes.append(f"the time limit of {err.limit:g} s ran out while {err.doing} on the memory ladder: the "
                     f"cheapest of the {len(tried)} plans measured that fits is reported")
    fitting = [found for held, found in tried.values() if held <= limit]
    if not fitting:
        smallest = min(held for held, _ in tried.values())
        raise InfeasiblePlan(limit, smallest, problem, measured=True)
    found = min(fitting, key=lambda f: (f[0].cost, f[3]["memory_per_rank"]["total"]))
    why = (f"the cheaper plans the model allowed measured over it ({', '.join(map(str, over))} bytes)" if over else
           "the model put every plan over the limit")
    notes.append(f"the memory model is an estimate ({found[0].memory} bytes per rank for this plan): this plan "
                 f"measures {found[3]['memory_per_rank']['total']} bytes, within the limit of {limit}; {why}")
    return found
