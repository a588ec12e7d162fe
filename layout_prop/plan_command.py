"""``layout-prop plan``: fill every ``auto`` layout with the solver, write the planned spec,
and report it next to a baseline.

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
>>> from layout_prop.loader import load_spec
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

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import SpecError
from .graph import Graph

__all__ = ["plan_spec", "PlanReport", "graph_to_spec", "measure", "parse_bytes", "add_plan_parser", "cmd_plan"]

from .sizes import GRAMMAR as SIZE_GRAMMAR
from .sizes import parse_size


def parse_bytes(text: str) -> int:
    """``--memory-per-rank``: ``16GiB`` -> 17179869184, in the one size grammar of
    :mod:`layout_prop.sizes` (the same as ``run --max-memory``); refused with ``bad-value``.

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

    ``links`` (axis -> :class:`~layout_prop.passes.plan.Link`) are written under the mesh.
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


def measure(graph: Graph, optimizer: str | None = None, links: dict | None = None) -> dict[str, Any]:
    """Bytes per rank (forward; forward and backward), modelled time and memory per rank of
    ``graph`` as ``check --reshard`` resolves it.  The graph is not changed."""
    from .api import analyze
    from .passes.memory import Memory
    from .passes.plan import links_of, plan_cost

    links = links or links_of(graph)
    forward = analyze(graph.copy_structure(), reshard=True)
    full = analyze(graph.copy_structure(), reshard=True, backward=True)
    time_us = sum(plan_cost(r.plan, "time", links) for r in full.check.redistributions)
    return {
        "ok": forward.ok and full.ok,
        "forward_bytes_per_rank": forward.check.total_bytes_per_rank,
        "bytes_per_step": full.check.total_bytes_per_rank,
        "time_us_per_step": round(time_us, 3),
        "memory_per_rank": Memory(optimizer).run(full.graph).to_dict(),
    }


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
        from .passes.memory import format_bytes

        s = self.solver
        lines = [f"plan: objective {s['objective']}, {s['classes']} node classes, {s['strategies']} strategies, "
                 f"solved in {s['seconds']:.2f} s (modelled {s['modelled_cost']:g} "
                 f"{'bytes per rank' if s['objective'] == 'bytes' else 'us'} per step"
                 f"{'' if s['optimal'] else ', not proven optimal'})"]
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
                 ("bytes per step (forward + backward)", str(p["bytes_per_step"]), str(b["bytes_per_step"])),
                 ("bytes, forward only", str(p["forward_bytes_per_rank"]), str(b["forward_bytes_per_rank"])),
                 ("modelled time per step (us)", f"{p['time_us_per_step']:g}", f"{b['time_us_per_step']:g}"),
                 ("memory", format_bytes(p["memory_per_rank"]["total"]),
                  format_bytes(b["memory_per_rank"]["total"]))]
        widths = [max(len(r[i]) for r in table) for i in range(3)]
        for r in table:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


def plan_spec(graph: Graph, *, backward: bool = True, objective: str = "bytes", memory_limit: int | None = None,
              optimizer: str | None = None, baseline: Graph | None = None) -> PlanReport:
    """Solve ``graph`` (a loaded spec), realise the plan and measure it and the baseline."""
    from .passes.plan import links_of, realise, solve

    links = links_of(graph)
    base_graph = baseline if baseline is not None else graph
    auto = [n.name for n in graph.inputs() if n.attrs.get("placements") == "auto"]
    solution = solve(graph, backward=backward, objective=objective, memory_limit=memory_limit, optimizer=optimizer)
    planned = graph.copy_structure()
    for node in planned.inputs():
        node.attrs["placements"] = solution.layouts[node.name]
    realised, moves = realise(planned, solution.strategies)
    spec = graph_to_spec(realised, links if graph.meta.get("links") else None)
    notes = []
    plan = measure(realised, optimizer, links)
    if memory_limit is not None:
        rounds = 0
        limit = memory_limit
        while plan["memory_per_rank"]["total"] > memory_limit and rounds < 3:  # the model was low: tighten it
            rounds += 1
            limit -= plan["memory_per_rank"]["total"] - memory_limit
            solution = solve(graph, backward=backward, objective=objective, memory_limit=limit, optimizer=optimizer,
                             problem=solution.problem)
            planned = graph.copy_structure()
            for node in planned.inputs():
                node.attrs["placements"] = solution.layouts[node.name]
            realised, moves = realise(planned, solution.strategies)
            spec = graph_to_spec(realised, links if graph.meta.get("links") else None)
            plan = measure(realised, optimizer, links)
        if plan["memory_per_rank"]["total"] > memory_limit:
            notes.append(f"the plan holds {plan['memory_per_rank']['total']} bytes per rank, above the limit: the "
                         f"memory model underestimates this graph")
    base = measure(base_graph, optimizer, links)
    from .api import analyze

    completed = analyze(base_graph.copy_structure())
    baseline_layouts = {n.name: list(n.meta["specs"][0].layout.placement_strs()) for n in completed.graph.inputs()}
    layouts = {name: list(spec["inputs"][name]["placements"]) for name in spec["inputs"]}
    solver = {"objective": objective, "classes": solution.classes, "strategies": solution.variables,
              "seconds": round(solution.seconds, 3), "modelled_cost": round(solution.cost, 3),
              "modelled_memory": solution.memory, "moves": moves, "backward": backward,
              "optimal": solution.optimal, "gap": solution.gap}
    if not solution.optimal:
        notes.append(f"the solver ran out of time ({solution.seconds:.0f} s): the plan is the best found, within "
                     f"{solution.gap:.1%} of the best bound")
    return PlanReport(spec, layouts, auto, plan, base, baseline_layouts, solver, notes)


# --------------------------------------------------------------------------- command line
def add_plan_parser(sub) -> None:
    """Register ``layout-prop plan`` on the CLI's subparsers."""
    p = sub.add_parser("plan", help="choose every auto layout with the least communication per training step")
    p.add_argument("spec", metavar="SPEC_OR_MODEL", type=Path,
                   help="a YAML or JSON spec with placements: auto inputs, or a model (.onnx, .mindir) with --plan")
    p.add_argument("--memory-per-rank", metavar="SIZE", help="the memory limit per rank, like 16GiB, 512M or 2GB "
                   f"(default none); {SIZE_GRAMMAR}")
    p.add_argument("--objective", choices=["bytes", "time"], default="bytes",
                   help="minimise bytes per rank per step (default) or modelled time with the mesh's links")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default=None,
                   help="count the optimizer's states in memory (adam: 2 per parameter; default none, as sgd)")
    p.add_argument("--forward-only", action="store_true", help="plan for inference: the forward's moves only")
    p.add_argument("--baseline", metavar="SPEC", type=Path, help="compare with this spec's layouts (default: SPEC's own)")
    p.add_argument("-o", "--output", type=Path, help="write the planned spec here (.yaml or .json)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    from .frontends.cli import add_model_args

    add_model_args(p)  # a model with its sharding plan (parameters: auto for the ones to choose)


def cmd_plan(args) -> int:
    from .frontends.cli import load_graph
    from .loader import load_spec
    from .passes.plan import InfeasiblePlan

    limit = parse_bytes(args.memory_per_rank) if args.memory_per_rank is not None else None
    graph = load_graph(args)
    baseline = load_spec(args.baseline) if args.baseline is not None else None
    if baseline is not None and (baseline.mesh != graph.mesh or
                                 [n.name for n in baseline.inputs()] != [n.name for n in graph.inputs()]):
        raise SpecError("bad-baseline", f"the baseline {str(args.baseline)!r} is not the same model on the same mesh",
                        hint="give a baseline with the same mesh and inputs (gen llama with the same sizes)")
    try:
        report = plan_spec(graph, backward=not args.forward_only, objective=args.objective, memory_limit=limit,
                           optimizer=args.optimizer, baseline=baseline)
    except InfeasiblePlan as err:
        if args.json:
            print(json.dumps({"ok": False, "error": err.code, "message": err.message,
                              "memory_limit": err.limit, "least_memory_per_rank": err.least}, indent=1))
        else:
            print(f"layout-prop: infeasible: {err}", file=sys.stderr)
        return 1
    if args.output is not None:
        _write(report.spec, args.output)
        report.notes.append(f"wrote {args.output}")
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.format())
    return 0 if report.plan["ok"] else 1


def _write(spec: dict, path: Path) -> None:
    from .loader import dump_yaml

    if path.suffix.lower() == ".json":
        text = json.dumps(spec, indent=1)
    else:
        text = dump_yaml(spec)
    from .output import write_output

    write_output(path, text)  # atomic: a full disk leaves the old file, never a truncated plan
