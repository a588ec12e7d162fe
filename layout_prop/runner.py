"""``run``: random inputs, lower, execute every rank, assemble, compare with one device.

The single-device reference executes the same (joint forward and backward) graph on
global arrays with the numpy kernels; any difference is a wrong transfer function,
localize rule or collective, since both sides use the same kernels.  (The kernels
themselves are checked against finite differences and MindSpore in their own tests.)

Examples
--------
>>> from layout_prop.io.loader import load_spec
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

import contextlib
import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .core import meta
from .core.errors import ExecutionError, LayoutPropError, SpecError, cut
from .core.graph import Graph, last_uses
from .core.placement import shard_dim
from .core.spec import FLOAT_DTYPES, is_float_dtype, numpy_dtype

__all__ = ["RunReport", "run_graph", "MemoryEstimate", "estimate_run_memory", "check_run_memory",
           "TimeEstimate", "estimate_run_time", "check_run_time", "SIM_COSTS", "DEFAULT_MAX_TIME",
           "available_memory", "execute_global", "random_inputs", "check_given_inputs", "TOLERANCES", "compare", "count_nonfinite",
           "format_nonfinite"]

#: the relative tolerance of each dtype (against the reference's largest magnitude).  bfloat16
#: keeps 8 significant bits, 3 fewer than float16 (a roundoff 8 times larger): its 8e-2 is
#: float16's 1e-2 scaled by that.  The sharded run and one device round every op's output
#: alike, but a partial sum is rounded before its reduction and a sum is reduced in another
#: order; later ops carry each difference.  Measured on the Llama block (dp=2, sp=2, tp=2, run
#: --backward, seeds 0-9): worst 2.3e-2 with 1 layer, 4.1e-2 with 2 (float16: 1.3e-2 with 2,
#: over its 1e-2 once)
TOLERANCES = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-2, "bfloat16": 8e-2, "int32": 0.0, "int64": 0.0,
              "bool": 0.0}
#: when the ranks run other kernels than the numpy reference (MindSpore, CANN), results differ by
#: their own rounding too: measured up to 2.5e-5 (float32) on the Llama block's gradients on CPU
CROSS_BACKEND_TOLERANCES = {"float64": 1e-10, "float32": 1e-4, "float16": 1e-2, "bfloat16": 8e-2, "int32": 0.0,
                            "int64": 0.0, "bool": 0.0}


@dataclass
class RunReport:
    ok: bool
    engine: str
    ranks: int
    outputs: dict[str, dict[str, float]] = field(default_factory=dict)
    grads: dict[str, dict[str, float]] = field(default_factory=dict)
    #: the outputs and gradients whose reference holds NaN or inf (:func:`count_nonfinite`), which
    #: :func:`compare` counts as equal where the ranks have the same: ``{"kind": "output" or "grad",
    #: "name", "elements", "nan", "inf", "alike"}``
    nonfinite: list[dict[str, Any]] = field(default_factory=list)
    collectives: list[dict[str, Any]] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    violations: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    executed: bool = True  # False when violations stopped the run before anything ran

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready and strict: an error that is not a finite number (a shape mismatch) is ``null``."""
        d = {"ok": self.ok, "executed": self.executed, "engine": self.engine, "ranks": self.ranks,
             "outputs": _finite(self.outputs), "grads": _finite(self.grads), "nonfinite": self.nonfinite,
             "collectives": self.collectives,
             "mismatches": self.mismatches, "violations": self.violations, "notes": self.notes}
        d.update(self.extra)
        return d


def _finite(errors: dict[str, dict[str, float]]) -> dict[str, dict[str, float | None]]:
    return {name: {k: (v if math.isfinite(v) else None) for k, v in err.items()} for name, err in errors.items()}


def random_inputs(graph: Graph, seed: int, given=()) -> dict[str, np.ndarray]:
    """Seeded global arrays for every graph input of a propagated graph: normal floats (with
    the scale the consumers ask for, :meth:`OpRule.input_scale`: 1/sqrt(fan-in) for the
    weights of products), small ints in [0, 8).  An input whose consumers declare a domain
    (:meth:`OpRule.input_domain`: an index within the indexed dim, multinomial's positive
    weights) is drawn within it: uniform in it, integers for an integer dtype (ints in
    [0, 8) where they fit, as without one).  The inputs named in ``given`` are left out (and draw
    nothing: the others' draws then differ from a run that draws every input)."""
    rng = np.random.default_rng(seed)
    out = {}
    for node in graph.inputs():
        if node.name in given:
            continue
        spec = node.meta[meta.SPECS][0]
        dt = numpy_dtype(spec.dtype)
        domain = _input_domain(graph, node.name) if dt.kind != "b" else None
        if domain is not None and domain.high > domain.low and not (
                not is_float_dtype(dt) and domain.low <= 0 and domain.high >= 8):  # (ints in [0, 8) fit: as before)
            out[node.name] = _draw_in(rng, domain, spec.shape, dt)
        elif is_float_dtype(dt):
            out[node.name] = (rng.standard_normal(spec.shape) * _input_scale(graph, node.name)).astype(dt)
        elif dt.kind == "b":
            out[node.name] = rng.integers(0, 2, spec.shape).astype(bool)
        else:
            out[node.name] = rng.integers(0, 8, spec.shape).astype(dt)
    return out


def _draw_in(rng, domain, shape, dt) -> np.ndarray:
    """Seeded values in ``domain``: integers for an integer dtype, uniform floats for a float one."""
    if is_float_dtype(dt):
        return rng.uniform(domain.low, domain.high, shape).astype(dt)
    return rng.integers(math.ceil(domain.low), math.ceil(domain.high), shape).astype(dt)


def _input_domain(graph: Graph, value: str):
    """The values every consumer of ``value`` takes (:meth:`OpRule.input_domain`, met over the consumers,
    looking through redistributions), or None when none declares a domain."""
    from layout_prop.passes.propagate import value_spec

    from .core.registry import get_rule

    found = None
    for node, index in graph.consumers(value):
        if node.op == "redistribute":
            domain = _input_domain(graph, node.name)
        else:
            specs = tuple(value_spec(graph, v) for v in node.inputs)
            if any(s is None for s in specs):
                continue
            domain = get_rule(node.op).input_domain(index, specs, node.meta.get(meta.ATTRS, node.attrs))
        if domain is not None:
            found = domain if found is None else found.meet(domain)
    return found


def check_given_inputs(graph: Graph, arrays: dict[str, Any], source: str = "inputs") -> dict[str, np.ndarray]:
    """The arrays a user gives for some graph inputs, checked against the graph's input specs
    (by name: its shape and dtype) and returned as the run takes them.

    The dtype must be the input's own, but for bfloat16, which numpy cannot save as such: a
    bfloat16 input also takes float32 or float64 values (rounded to bfloat16, to nearest even)
    and the 2-byte void arrays ``numpy.save`` writes for ``ml_dtypes.bfloat16`` (its bits).

    Raises
    ------
    SpecError
        ``unknown-input`` (a name that is no graph input), ``shape-mismatch``, ``bad-dtype``;
        each names ``source`` and the input (``path``: ``SOURCE:NAME``).

    Examples
    --------
    >>> from layout_prop.io.loader import load_spec
    >>> g = load_spec("mesh: {shape: [2]}\\ninputs: {x: {shape: [2], dtype: bfloat16}}\\nnodes: []")
    >>> check_given_inputs(g, {"x": np.array([1.0, 1.00390625])})["x"].tolist()  # 1 + 2^-8 rounds to 1
    [1.0, 1.0]
    >>> check_given_inputs(g, {"y": np.zeros(2)}, "a.npz")
    Traceback (most recent call last):
        ...
    layout_prop.core.errors.SpecError: unknown-input at a.npz:y: a.npz holds 'y', which is not an input of the graph (hint: name arrays by the graph's inputs: ['x'])
    """
    nodes = {node.name: node for node in graph.inputs()}
    out = {}
    for name, array in arrays.items():
        where = f"{source}:{name}"
        node = nodes.get(name)
        if node is None:
            raise SpecError("unknown-input", f"{source} holds {cut(name)}, which is not an input of the graph",
                            path=where, hint=f"name arrays by the graph's inputs: {cut(list(nodes))}")
        array = np.asarray(array)
        shape, dtype = tuple(node.attrs["shape"]), node.attrs["dtype"]
        if array.shape != shape:
            raise SpecError("shape-mismatch", f"{source} gives {name} shape {list(array.shape)}, but the graph's "
                            f"input has shape {list(shape)}", path=where,
                            hint=f"save an array of shape {list(shape)} under {cut(name)}")
        out[name] = _given_dtype(array, dtype, source, name)
    return out


def _given_dtype(array: np.ndarray, dtype: str, source: str, name: str) -> np.ndarray:
    """``array`` as an input of dtype ``dtype`` (:func:`check_given_inputs`), or ``bad-dtype``."""
    if array.dtype.name == dtype:
        return array
    if dtype == "bfloat16":
        if array.dtype.kind == "V" and array.dtype.itemsize == 2 and array.dtype.fields is None:
            return array.view(numpy_dtype("bfloat16"))  # np.save's record of an ml_dtypes.bfloat16 array
        if array.dtype.kind == "f" and array.dtype.itemsize >= 4:
            return array.astype(numpy_dtype("bfloat16"))
    also = " (or float32 values, rounded)" if dtype == "bfloat16" else ""
    raise SpecError("bad-dtype", f"{source} gives {name} dtype {array.dtype}, but the graph's input is {dtype}",
                    path=f"{source}:{name}", hint=f"save {cut(name)} as {dtype}{also}: array.astype({dtype!r})")


def _input_scale(graph: Graph, value: str) -> float:
    """The smallest scale the consumers of ``value`` ask for (1 without any), looking through
    redistributions."""
    from layout_prop.passes.propagate import value_spec

    from .core.registry import get_rule

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
                   wanted: Sequence[str] | None = None, compute_dtype: str | None = None) -> dict[str, np.ndarray]:
    """Execute the graph on one device: every value's global array.

    With ``wanted`` (value names), every other value is dropped right after its last use
    (as the simulator does with its ``wanted``) and only the wanted values are returned.
    With ``compute_dtype`` (``float64``), every floating value is computed in that dtype instead
    of its own (give the inputs in it): the exact reference :func:`exact_errors` measures by.
    """
    from layout_prop.engines.simulator import call_kernel
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
        dtypes = tuple(None if s is None else compute_dtype if compute_dtype and s.dtype in FLOAT_DTYPES else s.dtype
                       for s in node.meta[meta.SPECS])
        try:
            res = call_kernel(fn, args, node.meta[meta.ATTRS], dtypes)
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
    rank = next((r for r in range(spec.mesh.size)  # dim_indices: strided shards too
                 if all(i in spec.dim_indices(d, spec.mesh.coords(r)) for d, i in enumerate(index))), None)
    return errors, (f"{name}: relative error {max_rel:.3g} > {tol:g}; first differing index {list(index)} "
                    f"(held by rank {rank}): got {g64[index].item()!r}, expected {r64[index].item()!r}")


#: the dtypes whose rounding :func:`exact_errors` measures (a run in them is compared with a tolerance
#: derived from one device's own error, :func:`rounding_tolerance`)
LOW_PRECISION = ("float16", "bfloat16")
#: how many times one device's own rounding error the ranks may differ from it: both runs round as
#: one device does (the ranks' partial sums in another order), so they differ by at most twice
#: that error; 1.5 on top for the order (measured: the ratio of the ranks' difference to one
#: device's error was at most 1.41 on gen gpt, float16, tp=2, run --backward)
ROUNDING_FACTOR = 3.0
#: the largest tolerance a derived one may reach: past it, one device's own result is too inexact
#: in its dtype to judge a sharded run by (a mismatch is reported)
MAX_DERIVED_TOLERANCE = 0.25


def exact_errors(graph: Graph, inputs: dict[str, np.ndarray], reference: dict[str, np.ndarray],
                 kernels=None) -> dict[str, float]:
    """How far one device's result in the graph's own dtypes (``reference``) is from the same
    computation in float64 (the same inputs, every floating value in float64): per value of
    ``reference``, its largest absolute difference relative to the float64 result's largest
    magnitude.  Empty when the graph holds no :data:`LOW_PRECISION` value (nothing to measure).

    This is the accumulation error of float16 and bfloat16 on this graph (its reduction sizes,
    its softmax and norm backward's cancellations), measured rather than assumed.
    """
    if not any(s is not None and s.dtype in LOW_PRECISION for n in graph.nodes for s in n.meta[meta.SPECS]):
        return {}
    wide = {name: np.asarray(a, dtype=np.float64) if np.asarray(a).dtype.kind == "f" or
            np.asarray(a).dtype.name == "bfloat16" else a for name, a in inputs.items()}
    with _quiet_numerics():
        exact = execute_global(graph, wide, kernels=kernels, wanted=list(reference), compute_dtype="float64")
    out = {}
    for name, ref in reference.items():
        e, r = exact[name], np.asarray(ref, dtype=np.float64)
        finite = np.isfinite(e) & np.isfinite(r)
        scale = float(np.abs(np.where(finite, e, 0.0)).max()) if e.size else 0.0
        diff = float(np.abs(np.where(finite, r - e, 0.0)).max()) if e.size else 0.0
        out[name] = diff / scale if scale > 0 else diff
    return out


def rounding_tolerance(base: float | None, exact_error: float | None) -> float | None:
    """The tolerance of a value: ``base`` (its dtype's, :data:`TOLERANCES`), or :data:`ROUNDING_FACTOR`
    times one device's own rounding error on it (:func:`exact_errors`) when that is larger, at most
    :data:`MAX_DERIVED_TOLERANCE`.

    >>> rounding_tolerance(1e-2, 2.03e-2), rounding_tolerance(1e-2, 1e-3), rounding_tolerance(1e-2, None)
    (0.0609, 0.01, 0.01)
    """
    if base is None or exact_error is None:
        return base
    return round(max(base, min(ROUNDING_FACTOR * exact_error, MAX_DERIVED_TOLERANCE)), 12)


def count_nonfinite(got: np.ndarray, ref: np.ndarray) -> dict[str, int] | None:
    """How many elements of ``ref`` are NaN or inf, and at how many of them ``got`` is the
    same (NaN, or the same infinity: what :func:`compare` counts as agreement); None when
    every element of ``ref`` is finite.  Counts only, so that a report stays strict JSON.

    >>> count_nonfinite(np.array([np.nan, np.inf, 1.0]), np.array([np.nan, np.inf, 1.0]))
    {'elements': 3, 'nan': 1, 'inf': 1, 'alike': 2}
    >>> count_nonfinite(np.array([0.0, -np.inf]), np.array([np.nan, np.inf]))
    {'elements': 2, 'nan': 1, 'inf': 1, 'alike': 0}
    >>> count_nonfinite(np.array([1, 2]), np.array([1, 2])) is None
    True
    """
    if ref.dtype.kind not in "fc" and not is_float_dtype(ref.dtype):
        return None
    bad = ~np.isfinite(ref)
    if not bad.any():
        return None
    nan = int(np.count_nonzero(np.isnan(ref)))
    total = int(np.count_nonzero(bad))
    alike = 0
    if got.shape == ref.shape:
        g, r = got[bad], ref[bad]
        alike = int(np.count_nonzero((g == r) | (np.isnan(g) & np.isnan(r))))
    return {"elements": int(ref.size), "nan": nan, "inf": total - nan, "alike": alike}


def format_nonfinite(item: dict[str, Any]) -> str:
    """One line of :attr:`RunReport.nonfinite`.

    >>> format_nonfinite({"kind": "output", "name": "y", "elements": 32, "nan": 12, "inf": 0, "alike": 12})
    'output y: 12 of 32 elements are NaN or inf (12 NaN) on one device and alike on the ranks, compared as equal'
    """
    total = item["nan"] + item["inf"]
    kinds = ", ".join(f"{n} {what}" for n, what in ((item["nan"], "NaN"), (item["inf"], "inf")) if n)
    head = (f"{item['kind']} {item['name']}: {total} of {item['elements']} elements are NaN or inf ({kinds}) "
            "on one device")
    if item["alike"] == total:
        return head + " and alike on the ranks, compared as equal"
    return head + f"; the ranks have the same at {item['alike']} of them"


@dataclass(frozen=True)
class MemoryEstimate:
    """What a run will hold at its peak, estimated before anything is allocated.

    ``needed`` bytes: the graph inputs' global arrays (and the float64 draw of the largest),
    plus the larger of the one-device reference's peak and (the reference's outputs + the
    simulated ranks' peak + the assembled outputs and their comparison), plus twice the
    largest tensor for kernel temporaries.  ``biggest``: the largest values, as
    ``(name, shape, dtype, bytes on all ranks and the reference)``.
    """

    needed: int
    biggest: tuple[tuple[str, tuple[int, ...], str, int], ...]


#: what one numpy array costs beyond its data (the object and its header), per rank and value
ARRAY_OVERHEAD = 128


def _ranks_bytes(spec) -> int:
    """Bytes of a value summed over every rank's piece: shards partition a dim (uneven ones
    too), Replicate and Partial axes hold a whole copy each, so no rank is visited; plus one
    array object per rank (what counts on a mesh of many ranks and small tensors)."""
    copies = 1
    for size, placement in zip(spec.mesh.shape, spec.layout.placements):
        if not placement.is_shard():
            copies *= size
    return spec.nbytes * copies + ARRAY_OVERHEAD * spec.mesh.size


def _live_peak(steps, sizes: dict[str, int], keep: set[str], held: int = 0) -> int:
    """The most bytes live at once when ``steps`` run in order and every value not in
    ``keep`` is dropped after its last use (as the simulator and the reference do)."""
    dying = last_uses(steps, keep)
    live = peak = held
    for index, step in enumerate(steps):
        live += sum(sizes.get(v, 0) for v in step.outputs)
        peak = max(peak, live)
        live -= sum(sizes.get(v, 0) for v in dying.get(index, ()))
    return peak


def estimate_run_memory(graph: Graph, program) -> MemoryEstimate:
    """A simple, conservative estimate of a run's peak memory in this process (the values of
    all ranks in the simulator and the one-device reference), made from specs alone.

    Separate from the planner's per-rank memory model (``passes/memory.py``), which answers
    what one device of a real cluster holds: this one answers whether ``run`` fits here.
    Donated buffers are not subtracted, so it errs on the high side.
    """
    global_specs = {}
    for node in graph.nodes:
        for value, spec in zip(node.outputs, node.meta[meta.SPECS]):
            if spec is not None:
                global_specs[value] = spec
    input_names = {n.name for n in graph.inputs()}
    inputs = sum(global_specs[v].nbytes for v in input_names if v in global_specs)
    # random_inputs draws float64 normals and scales them (two float64 temporaries) before the cast
    draw = max((2 * 8 * (global_specs[v].nbytes // global_specs[v].itemsize) for v in input_names
                if v in global_specs), default=0)
    computed = {v: s.nbytes for v, s in global_specs.items() if v not in input_names}  # inputs: counted once
    outputs = sum(global_specs[v].nbytes for v in graph.outputs)
    reference = _live_peak(graph.topo_order(), computed, set(graph.outputs))
    if any(s.dtype in LOW_PRECISION for s in global_specs.values()):  # exact_errors: the reference in float64 too
        reference += _live_peak(graph.topo_order(), {v: 8 * (s.nbytes // s.itemsize) for v, s in
                                                      global_specs.items()}, set(graph.outputs))
    local = {v: _ranks_bytes(spec) for v, spec in program.specs.items()}
    ranks = _live_peak(program.ops, local, set(program.outputs.values()))
    # then, one output at a time: assembled, and compared in float64 (about five temporaries)
    checking = max((global_specs[v].nbytes + 5 * 8 * (global_specs[v].nbytes // global_specs[v].itemsize)
                    for v in graph.outputs), default=0)
    after = outputs + sum(local.get(v, 0) for v in program.outputs.values()) + checking
    largest = max((s.nbytes for s in global_specs.values()), default=0)
    needed = inputs + draw + max(reference, outputs + ranks, after) + 2 * largest
    shown = [(_user_name(v), spec, local.get(v, 0) + spec.nbytes) for v, spec in global_specs.items()
             if not v.startswith("cotangent/")]  # a cotangent is as big as its output, listed already
    biggest = tuple((name, spec.shape, spec.dtype, size) for name, spec, size in
                    sorted(shown, key=lambda item: -item[2])[:3])
    return MemoryEstimate(needed, biggest)


def _user_name(value: str) -> str:
    """A graph value as the user names it (``grad/x`` is ``grad:x``)."""
    return f"grad:{value[5:]}" if value.startswith("grad/") else value


def available_memory() -> int | None:
    """Bytes this process may still allocate: the least of the kernel's MemAvailable, the
    cgroup's limit less its usage, and the address-space limit; None when none is known."""
    import os
    import resource

    candidates = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    candidates.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    if not candidates:
        try:
            candidates.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError, AttributeError):
            pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            candidates.append(max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        candidates.append(soft)  # the whole address space, not what is left: an upper bound
    return min(candidates) if candidates else None


def format_bytes(count: int) -> str:
    """``1536`` -> ``'1.5 KiB'``; ``3 * 2**30`` -> ``'3.0 GiB'``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"


def check_run_memory(graph: Graph, program, max_memory: int | None = None) -> MemoryEstimate:
    """Refuse (``run-too-large``) a run whose estimated peak exceeds ``max_memory`` bytes, or
    the available memory when ``max_memory`` is None, before anything is allocated."""
    estimate = estimate_run_memory(graph, program)
    limit = max_memory if max_memory is not None else available_memory()
    if limit is not None and estimate.needed > limit:
        what = "the --max-memory limit of" if max_memory is not None else "the available"
        biggest = ", ".join(f"{v} {list(shape)} {dtype} {format_bytes(b)}" for v, shape, dtype, b in estimate.biggest)
        raise ExecutionError("run-too-large", f"the run needs about {format_bytes(estimate.needed)} "
                             f"({estimate.needed} bytes, estimated), over {what} {format_bytes(limit)} ({limit} "
                             f"bytes); biggest tensors (all ranks and the reference): {biggest}",
                             hint="use smaller shapes or fewer ranks; --max-memory SIZE sets the limit if the "
                                  "estimate is too cautious")
    return estimate


# --------------------------------------------------------------------------- time
#: What a run on the simulator costs, measured by ``benchmarks/run_estimate.py`` (numpy
#: kernels, CPython 3.11, one core of a shared 2-core x86-64 VM; its table prints these
#: beside the measured figures), rounded up:
#:
#: - ``kernel_call``: one kernel call on one rank, beyond its elements (measured 0.7 us for
#:   add to 20 us for RoPE; its rank's lowering and attrs included);
#: - ``element``: one element a kernel reads or writes, on a rank or on the one-device
#:   reference (0.15 to 0.9 ns by op; rounded up to cover what the per-op figures miss);
#: - ``step_rank``: one rank's part of a slice or collective, beyond its bytes (1.4 to 11 us);
#: - ``step_piece``: a local slice or an all-to-all cuts every rank's array into one view per
#:   rank of its group: per rank and member of its group (0.35 to 0.75 us on groups of
#:   256 to 1,024; more on larger groups);
#: - ``byte``: one byte a collective (or a local partial, or the cut of a graph input) reads or
#:   writes, over all ranks (0.02 to 0.1 ns; a plain local slice is a view: none);
#: - ``donation_pair``: a reduction whose input dies there checks, for every rank, every
#:   other rank's slot before it reuses the buffer (the simulator's buffer donation): per
#:   pair of ranks of the mesh, per such step (30 ns);
#: - ``rank_io``: one rank's piece of a graph input (cut) or output (assembled and checked; 4 us);
#: - ``input_element``: one element of a graph input drawn at random (float64 normals, scaled
#:   and cast: 12 ns);
#: - ``output_element``: one element of a graph output assembled and compared with the
#:   reference in float64 (27 ns);
#: - ``fixed``: what does not grow with the graph.
#:
#: Against whole runs (the table's last part) the estimate was 0.9 to 1.7 times the measured
#: time past a fraction of a second (RoPE on 1,024 to 4,096 ranks, Llama on 1 and 64 ranks).
SIM_COSTS = {"kernel_call": 10e-6, "element": 1e-9, "step_rank": 3e-6, "step_piece": 0.6e-6, "byte": 0.1e-9,
             "donation_pair": 35e-9, "rank_io": 5e-6, "input_element": 15e-9, "output_element": 30e-9,
             "fixed": 0.05}
#: the longest estimated run ``run`` starts on the simulator without ``--max-time`` (seconds): five
#: minutes, as long as the mindspore engine waits by default (``--timeout``)
DEFAULT_MAX_TIME = 300.0


@dataclass(frozen=True)
class TimeEstimate:
    """What a run on the simulator will take, estimated from element counts and ranks before
    anything runs (:func:`estimate_run_time`): ``seconds``, and the counts it is made of."""

    seconds: float
    ranks: int
    kernel_calls: int  # kernel ops times ranks
    elements: int  # elements the kernels read and write, over all ranks and the one-device reference
    step_calls: int  # slices and collectives times ranks
    step_pieces: int  # views of local slices and all-to-alls: ranks times their group size, per step
    step_bytes: int  # bytes the collectives and local partials read and write, over all ranks
    donation_pairs: int  # ranks squared, per reduction whose input dies there
    io_calls: int  # graph inputs and outputs times ranks
    io_bytes: int  # bytes of the graph inputs' pieces, over all ranks
    input_elements: int  # elements of the graph inputs (drawn once)
    output_elements: int  # elements of the graph outputs (assembled and compared)

    def parts(self) -> dict[str, float]:
        """Seconds by what they are spent on (they add up to ``seconds``)."""
        c = SIM_COSTS
        return {"kernels": self.kernel_calls * c["kernel_call"] + self.elements * c["element"],
                "slices and collectives": (self.step_calls * c["step_rank"] + self.step_pieces * c["step_piece"]
                                           + self.step_bytes * c["byte"]),
                "buffer reuse in reductions": self.donation_pairs * c["donation_pair"],
                "inputs and outputs": (self.io_calls * c["rank_io"] + self.io_bytes * c["byte"]
                                       + self.input_elements * c["input_element"]
                                       + self.output_elements * c["output_element"]),
                "fixed": c["fixed"]}


def _ranks_elements(spec) -> int:
    """Elements of a value summed over every rank's piece: shards (strided ones too) partition a
    dim, Replicate and Partial axes hold a whole copy each; no rank is visited."""
    copies = 1
    for size, placement in zip(spec.mesh.shape, spec.layout.placements):
        if shard_dim(placement) is None:
            copies *= size
    return math.prod(spec.shape) * copies


def estimate_run_time(graph: Graph) -> TimeEstimate:
    """How long ``run`` on the simulator takes for ``graph`` (analysed and resharded, without
    violations), from element counts and ranks: walks the lowered program's ops
    (:func:`~layout_prop.passes.lower.local_ops`, not built) once, never a rank.  The
    costs are :data:`SIM_COSTS`; an estimate, to tell a run of minutes from one of days."""
    from layout_prop.engines.collectives import DONATING_STEPS
    from layout_prop.passes.lower import local_ops

    mesh = graph.mesh
    ranks = mesh.size
    kernels = steps = pieces = elements = step_bytes = inputs = input_bytes = 0
    spec_of: dict[str, Any] = {}  # every local value's spec
    last: dict[str, int] = {}  # every local value's last reader
    reductions: list[tuple[int, str]] = []
    for index, (_, kind, _, ins, outs, specs, step, _, _, _, _) in enumerate(local_ops(graph)):
        for value in ins:
            last[value] = index
        if kind == "input":
            inputs += 1
            input_bytes += _ranks_elements(specs[0]) * specs[0].itemsize
        elif kind == "kernel":
            kernels += 1
            elements += sum(_ranks_elements(s) for s in (*map(spec_of.get, ins), *specs) if s is not None)
        else:
            steps += 1
            if step.kind in ("local-slice", "all-to-all"):
                pieces += mesh.shape[step.mesh_axis]
            if kind != "slice":  # (a plain local slice is a view)
                step_bytes += (_ranks_elements(step.src) * step.src.itemsize
                               + _ranks_elements(step.dst) * step.dst.itemsize)
            if step.kind in DONATING_STEPS:
                reductions.append((index, ins[0]))
        spec_of.update(zip(outs, specs))
    kept = set(graph.outputs)
    donations = sum(1 for index, value in reductions if value not in kept and last.get(value) == index)
    # the one-device reference (each node's inputs and outputs), the random inputs, and each
    # output assembled and compared
    global_specs = {value: spec for node in graph.nodes for value, spec in zip(node.outputs, node.meta[meta.SPECS])}
    drawn = 0
    for node in graph.nodes:
        if node.is_input:
            drawn += sum(math.prod(s.shape) for s in node.meta[meta.SPECS] if s is not None)
            continue
        elements += sum(math.prod(s.shape) for s in map(global_specs.get, (*node.inputs, *node.outputs))
                        if s is not None)
    outputs = len(graph.outputs)
    checked = sum(math.prod(s.shape) for s in map(global_specs.get, graph.outputs) if s is not None)
    estimate = TimeEstimate(0.0, ranks, kernels * ranks, elements, steps * ranks, pieces * ranks, step_bytes,
                            donations * ranks ** 2, (inputs + outputs) * ranks, input_bytes, drawn, checked)
    return dataclasses.replace(estimate, seconds=sum(estimate.parts().values()))


def format_seconds(seconds: float) -> str:
    """``42.0`` -> ``'42 s'``, ``5400`` -> ``'1.5 hours'``; a person's unit.

    >>> format_seconds(0.25), format_seconds(42.0), format_seconds(5400), format_seconds(3 * 86400)
    ('0.25 s', '42 s', '1.5 hours', '3 days')
    """
    if seconds < 1:
        return f"{seconds:.2g} s"
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= 2 * size if unit != "hours" else seconds >= 5400:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def check_run_time(graph: Graph, max_time: float | None = None) -> TimeEstimate:
    """Refuse (``run-too-large``) a run on the simulator estimated (:func:`estimate_run_time`) to
    take more than ``max_time`` seconds (default :data:`DEFAULT_MAX_TIME`), before anything
    is allocated or run."""
    estimate = estimate_run_time(graph)
    limit = DEFAULT_MAX_TIME if max_time is None else max_time
    if estimate.seconds > limit:
        what = "the --max-time limit of" if max_time is not None else "the default limit of"
        parts = sorted(estimate.parts().items(), key=lambda item: -item[1])[:2]
        spent = " and ".join(f"{name} {format_seconds(sec)}" for name, sec in parts)
        raise ExecutionError("run-too-large", f"the run would take about {format_seconds(estimate.seconds)} on the "
                             f"simulator ({estimate.seconds:.3g} s estimated for {estimate.ranks} ranks, mostly "
                             f"{spent}), over {what} {limit:g} s",
                             hint="use fewer ranks or smaller shapes; --max-time SECONDS raises the limit if the run "
                                  "may take that long")
    return estimate


@contextlib.contextmanager
def _quiet_numerics():
    """No numpy warning while kernels run: a floating-point one (sqrt of a negative) or a
    RuntimeWarning such as "Mean of empty slice" would be printed with a line of our code; a
    NaN or inf in an output is reported with its count instead (:func:`count_nonfinite`)."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def run_graph(graph: Graph, *, engine: str = "sim", backend: str | None = None, backward: bool = False,
              seed: int = 0, reshard: bool = True, rtol: float | None = None, verify: bool = False,
              max_memory: int | None = None, check_memory: bool = True, max_time: float | None = None,
              check_time: bool = True, inputs: dict[str, Any] | None = None, transform=None, reference_graph=None,
              **engine_options) -> RunReport:
    """Analyse, lower and execute ``graph`` on every rank; compare with one device.

    ``backend`` defaults to numpy on the simulator and mindspore on the mindspore engine;
    results are compared with the tolerance of the least precise float dtype in the graph, or
    for float16 and bfloat16 one derived from one device's own rounding error on each value
    against float64 (:func:`exact_errors`, :func:`rounding_tolerance`) when larger;
    ``rtol`` overrides it (deep graphs amplify rounding; other
    backends' kernels round differently from the numpy reference:
    :data:`CROSS_BACKEND_TOLERANCES`).  ``verify`` runs the graph verifier after every pass
    (see :func:`layout_prop.api.analyze`).  Before anything is allocated, the run's memory
    is estimated (:func:`estimate_run_memory`) and a run over ``max_memory`` bytes (default:
    the memory available) is refused with ``run-too-large``; ``check_memory=False`` skips it.
    On the simulator its time is estimated next (:func:`estimate_run_time`) and a run over
    ``max_time`` seconds (default :data:`DEFAULT_MAX_TIME`) is refused with
    ``run-too-large`` too; ``check_time=False`` skips it.  Both before any rank's attrs
    are made.  ``inputs`` gives the global arrays of some or all graph inputs by name
    (checked first, :func:`check_given_inputs`); the others are drawn from ``seed``
    (:func:`random_inputs`).  ``transform``, a function of the analysed graph, gives the graph that is
    lowered and executed (a spec's recomputation and ZeRO passes, commands/config_blocks.py);
    ``reference_graph`` is then the graph, analysed without them, whose one-device execution the ranks
    are compared with (default: the analysed graph itself, or, when the expand pass wrote a node as its
    rule's subgraph, the graph analysed without resharding, so the expansion is judged too).
    """
    given = check_given_inputs(graph, inputs or {})
    if backend is None:
        backend = "numpy" if engine == "sim" else "mindspore"
    from layout_prop.api import analyze
    from layout_prop.engines.collectives import assemble
    from layout_prop.passes.lower import Lower

    engine_obj = None
    if engine == "mindspore":  # its options and its worker count, before any work (a mesh of 65,536 ranks
        from layout_prop.engines.msrun_engine import MsrunEngine  # would start as many processes)

        engine_obj = MsrunEngine(backend=backend, **engine_options)
        engine_obj.check_workers(graph.mesh.size)
    analysis = analyze(graph, reshard=reshard, backward=backward, verify=verify)
    g = analysis.graph
    report = RunReport(ok=False, engine=engine, ranks=g.mesh.size, notes=list(analysis.notes))
    report.extra["memory_per_rank"] = analysis.memory().to_dict()  # the training step's bytes per rank
    if not analysis.ok:
        report.violations = [v.to_dict() for v in analysis.check.violations]
        report.executed = False
        return report
    if transform is not None:
        g = transform(g)
    timed = check_time and engine == "sim"
    if check_memory or timed:  # refused before the per-rank attrs are made: at once on a mesh of many ranks
        if check_memory:  # (the ops and specs only: the estimate reads nothing else)
            check_run_memory(g, Lower(localize=False).run(g).program, max_memory)
        if timed:
            check_run_time(g, max_time)
    program = Lower().run(g).program
    report.collectives = [dict(node=op.source, value=op.outputs[0], **op.step.to_dict())
                          for op in program.collectives]
    inputs = {**random_inputs(g, seed, given=given), **given}
    if reference_graph is None and analysis.expanded:
        # an expanded node computes its rule's subgraph (a ring, a vocabulary-parallel loss...): one device runs
        # the graph as written, so that a wrong expansion is a mismatch, not the reference's own answer
        reference_graph = analyze(graph, reshard=False, backward=backward).graph
    with _quiet_numerics():
        reference = execute_global(g if reference_graph is None else reference_graph, inputs,
                                   wanted=list(g.outputs))
    rng = np.random.default_rng(seed + 1)
    if engine == "sim":
        from layout_prop.engines.simulator import Simulator

        if backend != "numpy":
            raise ExecutionError("backend-unavailable", f"the simulator runs the numpy kernels, not {backend!r}",
                                 hint="use --engine mindspore for the mindspore and cann backends")
        with _quiet_numerics():
            local = Simulator().execute(program, inputs, rng, wanted=list(g.outputs))
    elif engine_obj is not None:
        local = engine_obj.execute(program, inputs, rng, wanted=list(g.outputs))
        report.extra.update(engine_obj.report_extra())
    else:
        raise ExecutionError("bad-engine", f"unknown engine {engine!r}", hint="use sim or mindspore")
    grad_of = {n.name: n.meta.get(meta.GRAD_OF) for n in g.nodes}
    # float16 and bfloat16: the tolerance is derived from one device's own rounding error on each value
    exact = {} if rtol is not None else exact_errors(g if reference_graph is None else reference_graph, inputs,
                                                     reference)
    # a value is only as exact as the least precise dtype it went through: use the loosest tolerance of the graph
    table = TOLERANCES if backend == "numpy" else CROSS_BACKEND_TOLERANCES
    dtypes = {s.dtype for n in g.nodes for s in n.meta[meta.SPECS] if s is not None}
    loosest = max((table[d] for d in dtypes if d in FLOAT_DTYPES), default=None)
    for value in g.outputs:
        node, index = g.producer(value)
        spec = node.meta[meta.SPECS][index]
        try:
            got = assemble(local[value], spec)
        except LayoutPropError as err:
            report.mismatches.append(f"{value}: {err.message}")
            continue
        tol = rtol if rtol is not None else rounding_tolerance(loosest, exact.get(value))
        errors, problem = compare(value, got, reference[value], spec, tol)
        primal = grad_of.get(value)
        (report.grads if primal else report.outputs)[primal or value] = errors
        counts = count_nonfinite(got, reference[value])
        if counts is not None:
            report.nonfinite.append({"kind": "grad" if primal else "output", "name": primal or value, **counts})
        if problem:
            report.mismatches.append(problem)
    report.ok = not report.mismatches
    return report
