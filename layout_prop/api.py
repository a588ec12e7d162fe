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

__all__ = ["Analysis", "analysis_pipeline", "analyze", "clear_caches", "format_table"]


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
    #: what a spec's zero:, recompute: and pipeline: blocks made of the check (workflows/check.py), reported last
    #: as "config"; None without blocks
    config: dict | None = None
    #: a passes.zero.ZeroConfig: memory_per_rank counts with the ZeRO paper's figures (None: without ZeRO)
    zero: Any = None

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
        tail = {"total_bytes_per_rank": self.check.total_bytes_per_rank,
                "memory_per_rank": self.memory().to_dict(), "notes": list(self.notes)}
        if self.config is not None:
            tail["config"] = self.config
        return tail

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
        if cached is None or cached[0] != (self.optimizer, self.zero):
            with paused_gc():
                cached = ((self.optimizer, self.zero), Memory(self.optimizer, zero=self.zero).run(self.graph))
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

    The passes run are :func:`analysis_pipeline`'s; ``graph``'s inputs and nodes are left as they
    were (an ``auto`` input stays ``auto``), its nodes may receive the propagated metadata.
    """
    from layout_prop.passes.base import AnalysisOptions
    from layout_prop.passes.pass_manager import PassContext

    ctx = PassContext(AnalysisOptions(reshard=reshard, backward=backward, backend=backend, verify=verify))
    ctx.notes.extend(graph.meta.get(meta.IMPORT_NOTES, ()))  # what an importer noted (opaque ops...)
    with paused_gc():
        result = analysis_pipeline().apply(graph, ctx)
    choice = ctx.results["sweep-or-solver"]
    return Analysis(result.graph, ctx.results["check"], ctx.notes, expanded=choice.expanded)


def analysis_pipeline():
    """The passes :func:`analyze` runs, in order: the greedy sweep or the whole-graph solver
    (:class:`~layout_prop.planner.choice.SweepOrSolver`: the auto layouts, the expansions, the
    backward, the moves, the check), the verifier of the resolved graph (with ``verify``), the
    backend's kernel limits (a backend other than numpy).

    >>> analysis_pipeline()
    PassPipeline(sweep-or-solver, verify, kernel_check)
    """
    from layout_prop.passes.pass_manager import PassPipeline
    from layout_prop.passes.kernel_check import KernelCheck
    from layout_prop.passes.verify import Verify
    from layout_prop.planner.choice import SweepOrSolver

    return PassPipeline(SweepOrSolver(), Verify(resolved=None), KernelCheck())


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
