"""``run``: random inputs, lower, execute every rank, assemble, compare with one device.

The single-device reference executes the same (joint forward and backward) graph on
global arrays with the numpy kernels; any difference is a wrong transfer function,
localize rule or collective, since both sides use the same kernels.  (The kernels
themselves are checked against finite differences and MindSpore in their own tests.)

Examples
--------
>>> from layout_prop.loader import load_spec
>>> g = load_spec('''
... mesh: {shape: [2, 2], names: [dp, tp]}
... inputs:
...   x:   {shape: [4, 4, 6, 8], placements: ["S(0)", "S(1)"]}
...   cos: {shape: [1, 1, 6, 8]}
...   sin: {shape: [1, 1, 6, 8]}
... nodes:
...   - {name: y, op: rope, inputs: [x, cos, sin], attrs: {mode: 1}}
... ''')
>>> rep = run_graph(g, backward=True, seed=0)
>>> rep.ok, sorted(rep.grads), rep.outputs["y"]["max_abs_err"] < 1e-6
(True, ['cos', 'sin', 'x'], True)
>>> [(c["kind"], c["mesh_axis"]) for c in rep.collectives]
[('all-reduce', 'dp'), ('all-reduce', 'tp'), ('all-reduce', 'dp'), ('all-reduce', 'tp')]
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from . import meta
from .errors import ExecutionError, LayoutPropError
from .graph import Graph, last_uses

__all__ = ["RunReport", "run_graph", "execute_global", "random_inputs", "TOLERANCES", "compare"]

TOLERANCES = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-2, "int32": 0.0, "int64": 0.0, "bool": 0.0}
#: when the ranks run other kernels than the numpy reference (MindSpore, CANN), results differ by
#: their own rounding too: measured up to 2.5e-5 (float32) on the Llama block's gradients on CPU
CROSS_BACKEND_TOLERANCES = {"float64": 1e-10, "float32": 1e-4, "float16": 1e-2, "int32": 0.0, "int64": 0.0,
                            "bool": 0.0}


@dataclass
class RunReport:
    ok: bool
    engine: str
    ranks: int
    outputs: dict[str, dict[str, float]] = field(default_factory=dict)
    grads: dict[str, dict[str, float]] = field(default_factory=dict)
    collectives: list[dict[str, Any]] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    violations: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    executed: bool = True  # False when violations stopped the run before anything ran

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready and strict: an error that is not a finite number (a shape mismatch) is ``null``."""
        d = {"ok": self.ok, "executed": self.executed, "engine": self.engine, "ranks": self.ranks,
             "outputs": _finite(self.outputs), "grads": _finite(self.grads), "collectives": self.collectives,
             "mismatches": self.mismatches, "violations": self.violations, "notes": self.notes}
        d.update(self.extra)
        return d


def _finite(errors: dict[str, dict[str, float]]) -> dict[str, dict[str, float | None]]:
    return {name: {k: (v if math.isfinite(v) else None) for k, v in err.items()} for name, err in errors.items()}


def random_inputs(graph: Graph, seed: int) -> dict[str, np.ndarray]:
    """Seeded global arrays for every graph input of a propagated graph: normal floats (with
    the scale the consumers ask for, :meth:`OpRule.input_scale`: 1/sqrt(fan-in) for the
    weights of products), small ints."""
    rng = np.random.default_rng(seed)
    out = {}
    for node in graph.inputs():
        spec = node.meta[meta.SPECS][0]
        dt = np.dtype(spec.dtype)
        if dt.kind == "f":
            out[node.name] = (rng.standard_normal(spec.shape) * _input_scale(graph, node.name)).astype(dt)
        elif dt.kind == "b":
            out[node.name] = rng.integers(0, 2, spec.shape).astype(bool)
        else:
            out[node.name] = rng.integers(0, 8, spec.shape).astype(dt)
    return out


def _input_scale(graph: Graph, value: str) -> float:
    """The smallest scale the consumers of ``value`` ask for (1 without any), looking through
    redistributions."""
    from layout_prop.passes.propagate import value_spec

    from .registry import get_rule

    scales = []
    for node, index in graph.consumers(value):
        if node.op == "redistribute":
            scales.append(_input_scale(graph, node.name))
            continue
        specs = tuple(value_spec(graph, v) for v in node.inputs)
        if any(s is None for s in specs):
            continue
        scales.append(get_rule(node.op).input_scale(index, specs, node.meta.get(meta.ATTRS, node.attrs)))
    return min(scales, default=1.0)


def execute_global(graph: Graph, inputs: dict[str, np.ndarray], kernels=None,
                   wanted: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Execute the graph on one device: every value's global array.

    With ``wanted`` (value names), every other value is dropped right after its last use
    (as the simulator does with its ``wanted``) and only the wanted values are returned.
    """
    from layout_prop.kernels.numpy_backend import KERNELS, get_kernel

    kernels = KERNELS if kernels is None else kernels
    env: dict[str, np.ndarray] = {}
    nodes = graph.topo_order()
    if wanted is not None:
        for value in wanted:
            if not graph.has_value(value):
                raise ExecutionError("missing-output", f"the graph has no value {value!r} to return",
                                     input=value, hint="ask only for values of the graph, such as its outputs "
                                                       f"{', '.join(graph.outputs)}")
    dying = {} if wanted is None else last_uses(nodes, set(wanted))
    for index, node in enumerate(nodes):
        if node.is_input:
            env[node.name] = inputs[node.name]
            continue
        fn = get_kernel(node.op, kernels)
        args = [env[v] for v in node.inputs]
        try:
            res = fn(*args, **node.meta[meta.ATTRS])
        except LayoutPropError:
            raise
        except Exception as exc:  # a kernel that cannot run these inputs: say where, never a traceback
            raise ExecutionError("kernel-failed", f"kernel {node.op!r} failed on one device with shapes "
                                 f"{[list(a.shape) for a in args]} and dtypes {[str(a.dtype) for a in args]}: "
                                 f"{type(exc).__name__}: {exc}", node=node.name,
                                 hint="the op's rule should reject these inputs; check their dtypes") from exc
        if node.num_outputs == 1:
            env[node.name] = np.asarray(res)
        else:
            for value, r in zip(node.outputs, res):
                env[value] = np.asarray(r)
        for value in dying.get(index, ()):
            del env[value]
    return env if wanted is None else {value: env[value] for value in wanted}


def compare(name: str, got: np.ndarray, ref: np.ndarray, spec, rtol: float | None = None,
            tolerances: dict[str, float] = TOLERANCES) -> tuple[dict[str, float], str | None]:
    """Errors of ``got`` against ``ref``, and a mismatch message naming the rank and index.

    The tolerance is relative to the largest magnitude of ``ref``; by default it is the
    dtype's (:data:`TOLERANCES`).
    """
    if got.shape != ref.shape:
        return {"max_abs_err": float("inf"), "max_rel_err": float("inf")}, (
            f"{name}: assembled shape {list(got.shape)} differs from the reference {list(ref.shape)}")
    g64, r64 = got.astype(np.float64), ref.astype(np.float64)
    same = (g64 == r64) | (np.isnan(g64) & np.isnan(r64))  # equal infinities and NaNs agree
    with np.errstate(invalid="ignore"):
        diff = np.where(same, 0.0, np.abs(g64 - r64))
    diff = np.nan_to_num(diff, nan=np.inf)
    finite = np.where(np.isfinite(r64), r64, 0.0)  # the scale ignores the reference's own inf/NaN
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(finite).max()) if finite.size else 0.0
    max_rel = max_abs / scale if scale > 0 else max_abs
    tol = tolerances.get(spec.dtype, 1e-5) if rtol is None else rtol
    errors = {"max_abs_err": max_abs, "max_rel_err": max_rel}
    if max_rel <= tol or not diff.size:
        return errors, None
    bad = np.argwhere(diff > tol * max(scale, 1.0))
    index = tuple(int(i) for i in bad[0]) if len(bad) else tuple(int(i) for i in np.unravel_index(
        int(diff.argmax()), diff.shape))
    rank = next((r for r in range(spec.mesh.size)
                 if all(a <= i < b for i, (a, b) in zip(index, spec.local_slices(r)))), None)
    return errors, (f"{name}: relative error {max_rel:.3g} > {tol:g}; first differing index {list(index)} "
                    f"(held by rank {rank}): got {g64[index].item()!r}, expected {r64[index].item()!r}")


def run_graph(graph: Graph, *, engine: str = "sim", backend: str | None = None, backward: bool = False,
              seed: int = 0, reshard: bool = True, rtol: float | None = None, verify: bool = False,
              **engine_options) -> RunReport:
    """Analyse, lower and execute ``graph`` on every rank; compare with one device.

    ``backend`` defaults to numpy on the simulator and mindspore on the mindspore engine;
    results are compared with the tolerance of the least precise float dtype in the graph;
    ``rtol`` overrides it (deep graphs amplify rounding; other
    backends' kernels round differently from the numpy reference:
    :data:`CROSS_BACKEND_TOLERANCES`).  ``verify`` runs the graph verifier after every pass
    (see :func:`layout_prop.api.analyze`).
    """
    if backend is None:
        backend = "numpy" if engine == "sim" else "mindspore"
    from layout_prop.api import analyze
    from layout_prop.kernels.collectives import assemble
    from layout_prop.passes.lower import Lower

    analysis = analyze(graph, reshard=reshard, backward=backward, verify=verify)
    g = analysis.graph
    report = RunReport(ok=False, engine=engine, ranks=g.mesh.size, notes=list(analysis.notes))
    if not analysis.ok:
        report.violations = [v.to_dict() for v in analysis.check.violations]
        report.executed = False
        return report
    program = Lower().run(g).program
    report.collectives = [dict(node=op.source, value=op.outputs[0], **op.step.to_dict())
                          for op in program.collectives]
    inputs = random_inputs(g, seed)
    reference = execute_global(g, inputs, wanted=list(g.outputs))
    rng = np.random.default_rng(seed + 1)
    if engine == "sim":
        from layout_prop.kernels.simulator import Simulator

        if backend != "numpy":
            raise ExecutionError("backend-unavailable", f"the simulator runs the numpy kernels, not {backend!r}",
                                 hint="use --engine mindspore for the mindspore and cann backends")
        local = Simulator().execute(program, inputs, rng, wanted=list(g.outputs))
    elif engine == "mindspore":
        from layout_prop.kernels.msrun_engine import MsrunEngine

        engine_obj = MsrunEngine(backend=backend, **engine_options)
        local = engine_obj.execute(program, inputs, rng, wanted=list(g.outputs))
        report.extra.update(engine_obj.report_extra())
    else:
        raise ExecutionError("bad-engine", f"unknown engine {engine!r}", hint="use sim or mindspore")
    grad_of = {n.name: n.meta.get(meta.GRAD_OF) for n in g.nodes}
    # a value is only as exact as the least precise dtype it went through: use the loosest tolerance of the graph
    table = TOLERANCES if backend == "numpy" else CROSS_BACKEND_TOLERANCES
    dtypes = {s.dtype for n in g.nodes for s in n.meta[meta.SPECS] if s is not None}
    loosest = max((table[d] for d in dtypes if d.startswith("float")), default=None)
    for value in g.outputs:
        node, index = g.producer(value)
        spec = node.meta[meta.SPECS][index]
        try:
            got = assemble(local[value], spec)
        except LayoutPropError as err:
            report.mismatches.append(f"{value}: {err.message}")
            continue
        errors, problem = compare(value, got, reference[value], spec, rtol if rtol is not None else loosest)
        primal = grad_of.get(value)
        (report.grads if primal else report.outputs)[primal or value] = errors
        if problem:
            report.mismatches.append(problem)
    report.ok = not report.mismatches
    return report
