"""Judge hyper-parallel's ``infer_layout`` answers by execution with layout-prop's kernels.

For each upstream op with audit cases (:mod:`.cases`), every input layout combination
(each operand R, S(d) for each dim of size > 1 and, where the case allows, P(sum), on
each mesh axis; a seeded sample beyond ``budget`` combinations) on each mesh is put to the
upstream rule.  An answer is judged the way layout-prop judges its own rules: the seeded
global inputs are cut by the input layouts (Partial inputs split into random terms), the
op runs on every rank with layout-prop's numpy kernel (the rule's localized attrs; the
rule's own ``get_expand_impl`` where it has one, around the same kernel), the local
results are assembled by the layouts the rule claims, and compared with one device.

Each combination lands in one class: ``right`` (accepted, equal to one device), ``wrong``
(accepted, different, or a local shape that does not fit the claimed layout),
``over_strict`` (rejected, while layout-prop's rule accepts the same inputs without any
redistribution and its answer, judged the same way, is right), ``rejected`` (the rest of
the refusals) and ``unjudged`` (an answer outside what can be executed here: a partial op
layout-prop does not model, an expansion that does not run on numpy arrays).  The first
combination of each class with the fewest mesh axes and sharded or partial placements is
kept as its reproducer, written in hyper-parallel's terms and as a layout-prop spec.

Only the forward is judged: an upstream rule has no gradient rule of its own to execute.
Uneven shards are cut as ``torch.chunk`` does (DTensor's convention, and layout-prop's).
"""

from __future__ import annotations

import functools
import itertools
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from layout_prop.core import meta
from layout_prop.core.errors import ExecutionError, LayoutPropError, OpError, SpecError, cut, describe
from layout_prop.core.layout import Layout
from layout_prop.core.mesh import DeviceMesh
from layout_prop.core.redistribute import plan_redistribution
from layout_prop.core.registry import OpRule, get_rule
from layout_prop.core.spec import TensorSpec
from layout_prop.engines.collectives import apply_plan, assemble, scatter_global
from layout_prop.io.loader import load_spec
from layout_prop.kernels.numpy_backend import KERNELS, get_kernel
from layout_prop.passes.propagate import Propagate

from . import judges
from .cases import NOT_MAPPED, Case, cases_for
from .hyper_parallel import CheckoutFiles, from_upstream, upstream_text
from .sandbox import Limits, Worker, WorkerFailure, decode_array, decode_value, encode_value, remote_describe

__all__ = ["AuditReport", "OpAudit", "Finding", "run_audit", "DEFAULT_MESHES", "CLASSES", "Limits"]

DEFAULT_MESHES = ((4,), (2, 2))
MESH_NAMES = {1: ("tp",), 2: ("dp", "tp"), 3: ("dp", "tp", "sp")}
CLASSES = ("right", "wrong", "over_strict", "rejected", "unjudged")
RTOL = 1e-9  # float64 throughout: the comparison only has rounding to forgive


@dataclass
class Finding:
    """One combination, as a reproducer in both projects' terms."""

    kind: str
    upstream_op: str
    case: Case
    mesh: DeviceMesh
    placements: tuple[tuple[str, ...], ...]
    upstream_answer: str
    ours: str
    message: str = ""
    silent: bool = False  # (wrong only) every rank ran; the assembled values or replicas differ

    def weight(self) -> tuple[int, int]:
        sharded = sum(1 for ps in self.placements for p in ps if p != "R")
        return (self.mesh.ndim, sharded)

    def upstream_code(self) -> str:
        lines = ["from hyper_parallel.core.layout import Layout",
                 "from hyper_parallel.core.shard.ops.parallel_ops_register import get_distributed_op"]
        names = []
        for i, (shape, ps) in enumerate(zip(self.case.shapes, self.placements)):
            var = f"in{i}"
            names.append(var)
            lines += upstream_text(Layout(self.mesh, ps, len(shape)), var)
        slots = ", ".join("None" if s is None else names[s] for s in self.case.slots)
        comma = "," if len(self.case.slots) == 1 else ""
        lines.append(f"get_distributed_op({self.upstream_op!r}).infer_layout(({slots}{comma}), "
                     f"{self.case.extra_args!r})  # global shapes {[list(s) for s in self.case.shapes]}")
        return "\n".join(lines)

    def spec(self) -> dict | None:
        return _single_spec(self.case, self.mesh, self.placements)

    def to_dict(self) -> dict:
        judged_by = {"judged_by": f"interop/judges.py {self.case.kernel}" + (
            f" (layout-prop's {self.case.op} rule as a stand-in)" if self.case.op else "")} if self.case.kernel else {}
        return {"class": self.kind, "mesh": list(self.mesh.shape), **judged_by,
                "inputs": {f"in{i}": {"shape": list(s), "placements": list(p)}
                           for i, (s, p) in enumerate(zip(self.case.shapes, self.placements))},
                "extra_args": repr(self.case.extra_args), "upstream": self.upstream_code(),
                "upstream_answer": self.upstream_answer, "layout_prop_answer": self.ours,
                "layout_prop_spec": self.spec(), "message": self.message}


@dataclass
class OpAudit:
    """The counts of one upstream op over its cases and meshes, with one reproducer per class."""

    name: str
    op: str
    source: str
    combinations: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {k: 0 for k in CLASSES})
    examples: dict[str, Finding] = field(default_factory=dict)
    unjudged_reasons: dict[str, int] = field(default_factory=dict)
    silent: int = 0  # wrong answers whose local kernels ran: the result differs without any error
    failure: tuple[str, str] | None = None  # (kind, message): the op could not be audited (crashed, timeout...)

    @property
    def accepted(self) -> int:
        return self.counts["right"] + self.counts["wrong"] + self.counts["unjudged"]

    def add(self, finding: Finding) -> None:
        self.combinations += 1
        self.counts[finding.kind] += 1
        if finding.kind == "wrong" and finding.silent:
            self.silent += 1
        if finding.kind == "unjudged":
            self.unjudged_reasons[finding.message] = self.unjudged_reasons.get(finding.message, 0) + 1
        old = self.examples.get(finding.kind)
        if old is None or finding.weight() < old.weight():
            self.examples[finding.kind] = finding

    def to_dict(self) -> dict:
        if self.failure is not None:
            return {"op": self.name, "layout_prop_op": self.op, "source": self.source,
                    "failure": {"kind": self.failure[0], "message": self.failure[1]}}
        return {"op": self.name, "layout_prop_op": self.op, "source": self.source,
                "combinations": self.combinations, "accepted": self.accepted,
                **{k: self.counts[k] for k in CLASSES}, "wrong_silently": self.silent,
                "unjudged_reasons": dict(sorted(self.unjudged_reasons.items())),
                "reproducers": {k: self.examples[k].to_dict() for k in CLASSES
                                if k in self.examples and k in ("wrong", "over_strict", "rejected")}}


@dataclass
class AuditReport:
    root: str
    meshes: list
    platform: str = ""
    ops: list[OpAudit] = field(default_factory=list)
    not_mapped: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No wrong answer, no op failed, and every accepted answer judged (an unjudged one is no "right")."""
        judged = [a for a in self.ops if a.failure is None]
        return not any(a.counts["wrong"] or a.counts["unjudged"] for a in judged) and not self.failures()

    def failures(self) -> dict[str, int]:
        """How many ops could not be audited, by kind (crashed, timeout, bad-answer, load-failed)."""
        out: dict[str, int] = {}
        for a in self.ops:
            if a.failure is not None:
                out[a.failure[0]] = out.get(a.failure[0], 0) + 1
        return dict(sorted(out.items()))

    def totals(self) -> dict[str, int]:
        judged = [a for a in self.ops if a.failure is None]
        out = {k: sum(a.counts[k] for a in judged) for k in CLASSES}
        out["wrong_silently"] = sum(a.silent for a in judged)
        out["combinations"] = sum(a.combinations for a in judged)
        return out

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checkout": self.root, "platform": self.platform, "failures": self.failures(),
                "meshes": [list(m) for m in self.meshes],
                "totals": self.totals(), "ops": [a.to_dict() for a in self.ops],
                "not_mapped": dict(sorted(self.not_mapped.items())),
                "failed_to_load": dict(sorted(self.failed.items()))}


# --------------------------------------------------------------------------- combinations
def _choices(shape: Sequence[int], partial: bool) -> list[str]:
    out = ["R"] + [f"S({d})" for d, n in enumerate(shape) if n != 1]
    return out + (["P(sum)"] if partial else [])


def _combos(case: Case, mesh: DeviceMesh, budget: int, rng: random.Random):
    """Per operand, its placements (one per mesh axis): every combination, or a seeded sample of ``budget``.

    An operand ``case.tied`` maps to another takes that one's placements (attention's key and value)."""
    tied = dict(case.tied)
    if tied:
        free = [i for i in range(len(case.shapes)) if i not in tied]
        sub = Case(case.op, tuple(case.shapes[i] for i in free), case.slots, partial=case.partial)
        for combo in _combos(sub, mesh, budget, rng):
            by = dict(zip(free, combo))
            yield tuple(by[i] if i in by else by[tied[i]] for i in range(len(case.shapes)))
        return
    per_operand = [list(itertools.product(*[_choices(s, case.partial)] * mesh.ndim)) for s in case.shapes]
    total = 1
    for options in per_operand:
        total *= len(options)
    if total <= budget:
        yield from itertools.product(*per_operand)
        return
    seen = set()
    while len(seen) < budget:
        combo = tuple(rng.choice(options) for options in per_operand)
        if combo not in seen:
            seen.add(combo)
            yield combo


def _single_spec(case: Case, mesh: DeviceMesh, placements) -> dict | None:
    if case.op is None:
        return None
    rule = get_rule(case.op)
    names = [rule.operand_name(i) for i in range(len(case.shapes))]
    inputs = {}
    for i, (name, shape, ps) in enumerate(zip(names, case.shapes, placements)):
        entry: dict[str, Any] = {"shape": list(shape), "placements": list(ps)}
        if case.dtypes:
            entry["dtype"] = case.dtypes[i]
        else:
            entry["dtype"] = "float64"
        inputs[name] = entry
    outs = [rule.name] if rule.num_outputs == 1 else [f"{rule.name}:{k}" for k in range(rule.num_outputs)]
    return {"mesh": {"shape": list(mesh.shape), "names": list(mesh.names)}, "inputs": inputs,
            "nodes": [{"name": rule.name, "op": rule.name, "inputs": names, "attrs": dict(case.attrs)}],
            "outputs": outs}


def _global_inputs(case: Case, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for i, shape in enumerate(case.shapes):
        dtype = case.dtypes[i] if case.dtypes else "float64"
        gen = case.gen[i] if case.gen else None
        if gen == "positive":
            out.append(rng.uniform(0.5, 2.0, shape).astype(dtype))
        elif gen == "int":
            out.append(rng.integers(-4, 5, shape).astype(dtype))
        elif isinstance(gen, tuple) and gen[0] == "unique":
            _, dim, high = gen
            keys = rng.random(tuple(shape[:dim]) + (high,) + tuple(shape[dim + 1:]))
            out.append(np.argsort(keys, axis=dim).take(range(shape[dim]), axis=dim).astype(dtype))
        elif np.dtype(dtype).kind == "f":
            out.append(rng.standard_normal(shape).astype(dtype))
        else:
            high = case.int_high[i] if case.int_high else 4
            out.append(rng.integers(0, max(high, 1), shape).astype(dtype))
    return out


def _outputs(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


# --------------------------------------------------------------------------- execution
#: an object's address in a repr (``<Layout at 0x7f...>``): dropped from upstream's messages
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")

#: the start of execute()'s answer when the rule's own expansion (get_expand_impl) failed outside the kernel
EXPANSION_FAILED = "the rule's expansion did not run on numpy arrays"
#: ... and when the expansion refused the layouts itself (a ValueError or NotImplementedError as it runs)
EXPANSION_REFUSED = "refused when it runs, by the rule's expansion"


class _KernelFailed(Exception):
    """A layout-prop kernel raised (args[0]), as opposed to the upstream code around it."""


def _localized(rule: OpRule, attrs: dict, in_specs, out_specs, rank: int) -> dict:
    if type(rule).localize is OpRule.localize:
        return attrs
    return rule.localize(attrs, tuple(in_specs), tuple(out_specs), rank)


def execute(rule: OpRule | None, attrs: dict, in_specs: Sequence[TensorSpec], locals_in: Sequence[list],
            out_specs: Sequence[TensorSpec], reference: Sequence[np.ndarray],
            wrap: Callable | None = None, kernel: Callable | None = None, localize: bool = True,
            check: Callable | None = None, globals_: Sequence[np.ndarray] = ()) -> str | None:
    """Run ``rule``'s kernel (or ``kernel``) on every rank, assemble by ``out_specs``, compare with ``reference``.

    ``wrap(rank, call)`` may return the callable to run on a rank's local arrays instead of
    ``call`` (an upstream expansion around the kernel).  ``localize=False`` gives every rank
    ``attrs`` as they are (a helper kernel, or attrs the upstream rule returned for the
    local call).  ``check(assembled, globals_, attrs)`` judges an output by its invariants
    instead of equality with ``reference``.  Returns None when every output agrees, else
    what differs (a kernel failure or a local shape the layout does not give counts as a
    difference).
    """
    if kernel is None:
        kernel = get_kernel(rule.name, KERNELS)
    size = in_specs[0].mesh.size
    per_rank = []
    for rank in range(size):
        local_attrs = _localized(rule, attrs, in_specs, out_specs, rank) if localize and rule is not None else attrs
        args = [locals_in[i][rank] for i in range(len(in_specs))]

        def call(*a, _attrs=local_attrs, **over):
            try:
                return kernel(*a, **{**_attrs, **over})
            except Exception as exc:
                raise _KernelFailed(exc) from exc

        try:
            fn = wrap(rank, call) if wrap is not None else None
            with np.errstate(all="ignore"):  # rsqrt of a negative input is NaN on both sides, and agrees
                res = fn(*args) if fn is not None else call(*args)
        except _KernelFailed as failed:  # the local shapes the layouts give do not run: the answer is wrong
            exc = failed.args[0]
            if isinstance(exc, LayoutPropError):
                return f"rank {rank}: {exc}"
            return f"the kernel failed on rank {rank} with local shapes {[list(a.shape) for a in args]}: " \
                   f"{describe(exc)}"
        except _ExpansionRaised as raised:  # the rule's expansion raised in the worker
            return f"{EXPANSION_REFUSED if raised.refused else EXPANSION_FAILED}: {raised.text}"
        except (ValueError, NotImplementedError) as exc:  # the expansion refuses the layouts when it runs
            return f"{EXPANSION_REFUSED}: {describe(exc)}"
        except Exception as exc:  # the rule's own expansion around the kernel: not ours to judge
            return f"{EXPANSION_FAILED}: {describe(exc)}"
        per_rank.append(_outputs(res))
    for k, (spec, ref) in enumerate(zip(out_specs, reference)):
        try:
            got = assemble([np.asarray(r[k]) for r in per_rank], spec, rtol=RTOL, atol=RTOL)
        except ExecutionError as err:
            return f"output {k}: {err.message}"
        if check is not None:
            problem = check(got, globals_, attrs)
            if problem is not None:
                return f"output {k}: {problem}"
            continue
        if got.shape != ref.shape:
            return f"output {k}: assembled shape {list(got.shape)}, one device {list(ref.shape)}"
        ok = np.array_equal(got, ref) if ref.dtype.kind not in "fc" else \
            np.allclose(got, ref, rtol=RTOL, atol=RTOL * max(1.0, float(np.nanmax(np.abs(ref), initial=0))),
                        equal_nan=True)
        if not ok:
            diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
            at = [int(i) for i in np.unravel_index(int(diff.argmax()), diff.shape)]
            return f"output {k} differs from one device: max abs error {float(diff.max()):.3g} at {at}"
    return None


def _our_answer(case: Case, mesh: DeviceMesh, placements):
    """layout-prop's rule on the same inputs: (violation codes, output specs, wants, attrs)."""
    if case.op is None:
        return ["no-layout-prop-op"], (), (), dict(case.attrs)
    graph = load_spec(_single_spec(case, mesh, placements))
    Propagate().run(graph)
    node = next(n for n in graph.topo_order() if n.op != "input")
    m = node.meta
    codes = sorted({v.code for v in m.get(meta.VIOLATIONS, ())})
    return codes, tuple(m[meta.SPECS]), tuple(m.get(meta.WANTS, ())), m[meta.ATTRS]


#: layout-prop's answers during one run_audit, by what they depend on: many upstream ops share a case
#: (Add, add, add_; the comparisons all stand in with maximum on the same shapes)
_OURS: dict = {}


def _our_answer_shared(case: Case, mesh: DeviceMesh, placements):
    """:func:`_our_answer`, computed once per (op, shapes, dtypes, attrs, mesh, placements) in a run."""
    key = (case.op, case.shapes, case.dtypes, repr(sorted(case.attrs.items())), tuple(mesh.shape), placements)
    hit = _OURS.get(key)
    if hit is None:
        try:
            hit = (None, _our_answer(case, mesh, placements))
        except LayoutPropError as err:  # layout-prop cannot even state these inputs
            hit = (err.code, None)
        _OURS[key] = hit
    code, answer = hit
    if code is not None:
        return code, None
    codes, specs, wants, attrs = answer
    return None, (list(codes), specs, wants, dict(attrs))


def _describe_ours(codes, out_specs) -> str:
    if codes == ["no-layout-prop-op"]:
        return "no layout-prop op (judged with a numpy kernel of interop/judges.py)"
    if codes:
        return "rejects: " + ", ".join(codes)
    return "accepts: " + "; ".join(str(s.layout) for s in out_specs if s is not None)


def _judge_ours(rule, in_specs, locals_in, out_specs, wants, attrs, reference, **how) -> str | None:
    """Our accepted answer, judged by the same execution (free wanted moves applied first)."""
    specs, arrays = list(in_specs), list(locals_in)
    for i, want in enumerate(wants):
        if want is None or want == specs[i].layout:
            continue
        plan = plan_redistribution(specs[i], want)
        if not plan.is_free:
            return f"operand {i} needs communication ({specs[i].layout} -> {want})"
        arrays[i] = apply_plan(plan, arrays[i])
        specs[i] = plan.dst
    return execute(rule, attrs, specs, arrays, out_specs, reference, **how)


# --------------------------------------------------------------------------- one op
@dataclass(frozen=True)
class UpLayout:
    """A ``Layout`` a rule answered, as plain data read from the worker (checked)."""

    mesh_shape: tuple
    tensor_map: Any
    partial: tuple


_BIG = 1 << 31


def _small_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -_BIG < v < _BIG


def _up_layout(data, where: str) -> UpLayout:
    """The worker's ``{"layout": ...}`` item as an :class:`UpLayout`; ``bad-answer`` unless plain and small."""
    if not isinstance(data, dict) or set(data) != {"mesh_shape", "tensor_map", "partial"}:
        raise WorkerFailure("bad-answer", f"a Layout the worker could not describe {where}")
    shape, tmap, partial = (decode_value(data[k]) for k in ("mesh_shape", "tensor_map", "partial"))
    if not isinstance(shape, (tuple, list)) or not all(_small_int(n) for n in shape):
        raise WorkerFailure("bad-answer", f"a Layout whose mesh_shape is {cut(shape)} {where}")
    if tmap is not None and not (isinstance(tmap, (tuple, list)) and len(tmap) <= 64 and all(
            _small_int(e) or (isinstance(e, (tuple, list)) and all(_small_int(k) for k in e)) for e in tmap)):
        raise WorkerFailure("bad-answer", f"a Layout whose tensor_map is {cut(tmap)} {where}")
    if not isinstance(partial, (tuple, list)) or len(partial) != len(shape) or not all(
            p is None or isinstance(p, str) for p in partial):
        raise WorkerFailure("bad-answer", f"a Layout whose partial status is {cut(partial)} {where}")
    return UpLayout(tuple(shape), tmap, tuple(partial))


def _item(item, where: str):
    if isinstance(item, dict) and set(item) == {"layout"}:
        return _up_layout(item["layout"], where)
    if isinstance(item, dict) and set(item) == {"value"}:
        return decode_value(item["value"])
    raise WorkerFailure("bad-answer", f"an answer item that is not the protocol's {where}")


def _layout_desc(layout: Layout) -> dict:
    """Our ``layout`` as the worker builds the checkout's ``Layout``: device matrix, alias names and map, partial."""
    from .hyper_parallel import _alias_map

    mesh = layout.mesh
    return {"mesh_shape": list(mesh.shape), "alias_name": list(mesh.names),
            "alias_map": [list(e) if isinstance(e, tuple) else e for e in _alias_map(layout)],
            "partial": [[mesh.names[axis], op] for axis, op in layout.partial_axes().items()]}


class _ExpansionRaised(Exception):
    """The rule's expansion raised in the worker (``text`` as ``describe`` writes it)."""

    def __init__(self, refused: bool, text: str) -> None:
        super().__init__(text)
        self.refused = refused
        self.text = text


class Session:
    """The audit's worker for one checkout: started on demand, stopped after a failure and
    between two modules' ops (:func:`_code_of`)."""

    def __init__(self, checkout: CheckoutFiles, limits: Limits) -> None:
        self.checkout = checkout
        self.limits = limits
        self.worker: Worker | None = None
        self.loaded: dict[str, bool] = {}  # op name -> whether its class has its own get_expand_impl

    def _started(self) -> Worker:
        if self.worker is None or not self.worker.alive:
            self.loaded = {}
            self.worker = Worker(self.checkout.root, self.checkout.platform, self.limits)
            self.worker.start()
        return self.worker

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None

    def module_names(self) -> list[str]:
        worker = self._started()
        worker.send({"cmd": "names", "files": list(self.checkout.modules)})
        reply = worker.read(self.limits.call_seconds, "while importing the --module files")
        if "error" in reply:
            raise OpError("module-failed", f"importing the --module files failed: {remote_describe(reply['error'])}",
                          hint="run the file with python, with the checkout on PYTHONPATH, to see the full error")
        names = reply.get("names")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise WorkerFailure("bad-answer", "the --module files' op names are not a list of names")
        return names

    def load(self, name: str, from_modules: bool) -> None:
        """Instantiate op ``name`` in the worker; ``WorkerFailure`` ``load-failed`` when it does not load."""
        if name in self.loaded:
            return
        worker = self._started()
        entry = None if from_modules else self.checkout.entries[name]
        worker.send({"cmd": "load", "op": name, "module": entry.module if entry else None,
                     "class": entry.cls if entry else None, "files": list(self.checkout.modules) if from_modules else []})
        reply = worker.read(self.limits.call_seconds, f"while loading {name}")
        if "error" in reply:
            source = entry.source if entry else "--module"
            raise WorkerFailure("load-failed", f"{source}: {remote_describe(reply['error'])}")
        if reply.get("ok") is not True or not isinstance(reply.get("expands"), bool):
            raise WorkerFailure("bad-answer", f"the reply to loading {name} is not the protocol's")
        self.loaded[name] = reply["expands"]

    def infer(self, name: str, calls: list, where: str) -> list[dict]:
        """``infer_layout`` on each ``(layouts, extra_args)``; one reply a call, in order."""
        worker = self._started()
        worker.send({"cmd": "infer", "op": name,
                     "cases": [{"id": k, "layouts": layouts, "extra": encode_value(extra)}
                               for k, (layouts, extra) in enumerate(calls)]})
        replies = []
        for k in range(len(calls)):
            reply = worker.read(self.limits.call_seconds, f"from {name}'s infer_layout ({where}, call {k + 1})")
            if "error" in reply:
                raise WorkerFailure("crashed", f"the worker failed on {name}'s inputs ({where}): "
                                    f"{remote_describe(reply['error'])}")
            if reply.get("id") != k:
                raise WorkerFailure("bad-answer", f"a reply out of order from {name}'s infer_layout ({where})")
            replies.append(reply)
        return replies

    def expand(self, name: str, call_id: int, out: list[int], case: Case, rank: int, args, call: Callable,
               where: str):
        """The rule's expansion on ``rank``'s ``args``, its kernel calls answered by ``call``.

        Returns the outputs (a tuple of arrays), or None when the rule has no expansion for these
        layouts; raises ``_KernelFailed`` (our kernel refused what the expansion passed) or
        ``_ExpansionRaised``.
        """
        worker = self._started()
        position = {i: p for p, i in enumerate(case.slots) if i is not None}
        worker.send({"cmd": "expand", "op": name, "id": call_id, "out": out, "rank": rank,
                     "position": {str(i): p for i, p in position.items()}, "call_attrs": dict(case.call_attrs),
                     "extra": encode_value(case.extra_args),
                     "n_args": max([len(case.slots)] + [p + 1 for p in case.call_values]),
                     "call_values": [[p, encode_value(v)] for p, v in case.call_values.items()],
                     "args": [encode_value(np.asarray(a)) for a in args],
                     "host": bool(case.call_attrs or case.call_values or case.tied),
                     "call_kwargs": encode_value(dict(case.call_kwargs))})
        failed = None
        doing = f"from {name}'s expansion ({where}, rank {rank})"
        for _ in range(64):  # an expansion calls the kernel once; a few more at most
            reply = worker.read(self.limits.call_seconds, doing)
            if "call" in reply:
                request = reply["call"]
                if not isinstance(request, dict) or not isinstance(request.get("args"), list) \
                        or not isinstance(request.get("over"), dict):
                    raise WorkerFailure("bad-answer", f"a kernel call that is not the protocol's {doing}")
                arrays = [decode_array(a.get("__nd__") if isinstance(a, dict) else None) for a in request["args"]]
                over = {}
                for attr, value in request["over"].items():
                    if attr not in case.call_attrs:
                        raise WorkerFailure("bad-answer", f"a kernel call with attr {cut(attr)} {doing}")
                    over[attr] = _plain(decode_value(value))
                try:
                    result = _outputs(call(*arrays, **over))
                except _KernelFailed as exc:
                    failed = exc
                    worker.send({"kernel_failed": describe(exc.args[0])})
                    continue
                worker.send({"result": [encode_value(np.asarray(r)) for r in result],
                             "single": len(result) == 1})
            elif reply.get("none") is True:
                return None
            elif "result" in reply and isinstance(reply["result"], list):
                return tuple(decode_array(r.get("__nd__") if isinstance(r, dict) else None) for r in reply["result"])
            elif "raised" in reply:
                if failed is not None:  # our kernel refused the local shapes the expansion passed
                    raise failed
                pair = reply["raised"]
                text = remote_describe(pair)
                raise _ExpansionRaised(pair[0] in ("ValueError", "NotImplementedError"), text)
            else:
                raise WorkerFailure("bad-answer", f"a reply that is not the protocol's {doing}")
        raise WorkerFailure("bad-answer", f"more than 64 kernel calls {doing}")


def _wrap_for(session: Session, name: str, call_id: int, out: list[int], case: Case, where: str):
    """The upstream expansion around the kernel (Add and Linear scale a term), run in the worker."""
    if not case.expansion or not session.loaded.get(name):
        return None

    def wrap(rank: int, call: Callable):
        def run(*args):
            result = session.expand(name, call_id, out, case, rank, args, call, where)
            return call(*args) if result is None else result

        return run

    return wrap


def audit_case(session: Session, name: str, case: Case, mesh: DeviceMesh, audit: OpAudit,
               budget: int, seed: int) -> None:
    """Every input combination of ``case`` on ``mesh``, into ``audit``'s counts.

    The rule answers in the worker (one batch of calls); each answer is checked and judged here.
    Raises ``WorkerFailure`` when the worker crashes, times out or answers what is not a Layout.
    """
    rule = None if case.op is None else get_rule(case.op)
    globals_ = _global_inputs(case, seed)
    kernel = judges.kernel(case.kernel) if case.kernel else get_kernel(rule.name, KERNELS)
    attrs = dict(case.attrs) if case.kernel or rule is None else rule.normalize_attrs(dict(case.attrs))
    with np.errstate(all="ignore"):
        reference = _outputs(kernel(*globals_, **attrs))
    reference = tuple(np.asarray(r) for r in reference)
    # attrs the expansion adjusts for a rank (call_attrs) replace layout-prop's localization, not add to it
    how = {"kernel": kernel, "localize": case.kernel is None and not case.call_attrs,
           "check": judges.check(case.check) if case.check else None, "globals_": globals_}
    rng = random.Random(f"{seed}:{name}:{case.describe()}:{mesh.shape}")
    split_rng = np.random.default_rng(seed)
    prepared = []
    for placements in _combos(case, mesh, budget, rng):
        try:
            in_specs = [TensorSpec(s, (case.dtypes[i] if case.dtypes else "float64"), Layout(mesh, ps, len(s)))
                        for i, (s, ps) in enumerate(zip(case.shapes, placements))]
        except LayoutPropError:  # a layout that cannot exist (a size-1 dim on several devices): not tried
            continue
        locals_in = [scatter_global(g, spec, split_rng) for g, spec in zip(globals_, in_specs)]
        prepared.append((placements, in_specs, locals_in))
    where = f"mesh {'x'.join(map(str, mesh.shape))}, {case.describe()}"
    calls = [(tuple(None if s is None else _layout_desc(in_specs[s].layout) for s in case.slots), case.extra_args)
             for _, in_specs, _ in prepared]
    replies = session.infer(name, calls, where)
    for call_id, ((placements, in_specs, locals_in), reply) in enumerate(zip(prepared, replies)):
        at = f"({where}, inputs {' '.join('(' + ', '.join(p) + ')' for p in placements)})"
        error, ours = _our_answer_shared(case, mesh, placements)
        if error is not None:  # layout-prop cannot even state these inputs: no answer to offer
            codes, our_specs, wants, our_attrs = [error], (), (), attrs
        else:
            codes, our_specs, wants, our_attrs = ours
        ours = _describe_ours(codes, our_specs)
        finding = Finding("rejected", name, case, mesh, tuple(tuple(p) for p in placements), "", ours)
        judge_ours = functools.partial(_judge_ours, rule, in_specs, locals_in, our_specs, wants, our_attrs,
                                       reference, **how)
        if "raises" in reply:  # the rule refuses these inputs (ValueError, mostly)
            finding.upstream_answer = "raises " + _ADDRESS.sub("", remote_describe(reply["raises"]))
            _judge_refusal(finding, codes, judge_ours)
            audit.add(finding)
            continue
        if "bad" in reply:
            raise WorkerFailure("bad-answer", f"{printable_text(reply['bad'])} {at}")
        items = reply.get("answer")
        if not isinstance(items, list):
            raise WorkerFailure("bad-answer", f"a reply that is not the protocol's {at}")
        answer = tuple(_item(item, at) for item in items)
        indices = list(case.outputs) if case.outputs is not None else list(range(len(answer)))
        raw = tuple(answer[i] if i < len(answer) else None for i in indices)
        out = [i for i in indices if i < len(answer) and isinstance(answer[i], UpLayout)]
        up_out = [answer[i] for i in out]
        n = len(reference)
        if len(up_out) < n:  # 42, None, a tuple without Layouts: no claim to judge
            shown = "; ".join(cut(a) if not isinstance(a, UpLayout) else "a Layout" for a in raw) or "nothing"
            raise WorkerFailure("bad-answer", f"the rule answered {shown}, not {n} Layout{'s' * (n > 1)} {at}")
        for up in up_out:
            if tuple(up.mesh_shape) != tuple(mesh.shape):
                raise WorkerFailure("bad-answer", f"the rule answered a Layout on mesh {list(up.mesh_shape)} "
                                    f"for inputs on mesh {list(mesh.shape)} {at}")
        finding.upstream_answer = "; ".join(str(_safe_layout(a, mesh, case.partial_as)) for a in up_out)
        for attr, position in case.answer_attrs.items():
            if position >= len(answer):
                raise WorkerFailure("bad-answer", f"the rule answered no {attr} (value {position}) {at}")
            finding.upstream_answer += f"; {attr} {answer[position]!r}"
        try:
            out_specs = [TensorSpec(reference[k].shape, str(reference[k].dtype),
                                    from_upstream(up_out[k], mesh, case.partial_as)) for k in range(n)]
        except LayoutPropError as err:
            unsupported = err.code == "unsupported-layout"
            finding.kind = "unjudged" if unsupported else "wrong"
            finding.message = err.message if unsupported else f"the claimed layout cannot exist: {err.message}"
            audit.add(finding)
            continue
        run_how, run_attrs = dict(how), attrs
        if case.answer_attrs:  # the local values the rule returned, as upstream's dispatcher passes them
            run_attrs = {**attrs, **{k: _plain(answer[i]) for k, i in case.answer_attrs.items()}}
            run_how["localize"] = False
        wrap = _wrap_for(session, name, call_id, out, case, where)
        problem = execute(rule, run_attrs, in_specs, locals_in, out_specs, reference[:n], wrap, **run_how)
        if problem is not None and problem.startswith(EXPANSION_REFUSED):  # a refusal, at run time
            finding.upstream_answer = f"{finding.upstream_answer}, then {problem}"
            finding.kind = "rejected"
            _judge_refusal(finding, codes, judge_ours)
            audit.add(finding)
            continue
        finding.kind = "right" if problem is None else "wrong"
        finding.message = problem or ""
        if problem is not None and problem.startswith(EXPANSION_FAILED):
            finding.kind = "unjudged"  # (the message says how the expansion failed)
        finding.silent = problem is not None and problem.startswith("output ")
        audit.add(finding)


def printable_text(value) -> str:
    """A worker's text, cut and with control characters escaped."""
    return cut(value) if not isinstance(value, str) else cut(value)[1:-1]


def _judge_refusal(finding: Finding, codes, judge_ours: Callable[[], str | None]) -> None:
    """An upstream refusal: over-strict where layout-prop accepts (no ``codes``) and its own answer,
    executed by ``judge_ours()``, is right; else it stays rejected (saying so where ours is wrong too)."""
    if codes:
        return
    problem = judge_ours()
    if problem is None:
        finding.kind = "over_strict"
    else:
        finding.message = f"layout-prop's own answer is wrong here too: {problem}"


def _plain(value):
    """A value a rule returned (a tuple or list of ints, maybe numpy ints) as plain Python."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return int(value) if isinstance(value, (int, np.integer)) else value


def _safe_layout(up, mesh: DeviceMesh, partial_as=None) -> str:
    try:
        return str(from_upstream(up, mesh, partial_as))
    except LayoutPropError:
        return f"tensor_map {up.tensor_map} partial {up.partial}"


def _code_of(checkout: CheckoutFiles, name: str, from_modules: set) -> str:
    """Where op ``name``'s rule comes from: its yaml entry's module, or ``--module`` (the user's files).

    The audit runs the ops of one module in one worker and starts a fresh worker for the next
    module: a thread or a process one module's code leaves running, or a class it patches,
    cannot reach another module's ops.
    """
    return "--module" if name in from_modules or name not in checkout.entries else checkout.entries[name].module


def run_audit(checkout: CheckoutFiles, ops: Sequence[str] | None = None,
              meshes: Sequence[Sequence[int]] = DEFAULT_MESHES, budget: int = 256, seed: int = 0,
              progress: Callable[[str, int, int], None] | None = None, limits: Limits = Limits()) -> AuditReport:
    """Audit the checkout's ops (all, or the names in ``ops``) on ``meshes``, the rules running in a worker.

    ``budget`` bounds the combinations tried per case and mesh (a seeded sample beyond it);
    ``limits`` bound the worker (a call's wall time, memory, CPU).  An op whose worker crashes,
    times out or answers what is not a Layout is reported failed (``OpAudit.failure``); the
    others are judged as usual.  ``progress(name, done, total)`` is called before each op.
    Raises ``OpError`` ``unknown-op`` for a name in ``ops`` that the checkout does not declare,
    ``SpecError`` ``invalid-mesh`` for a mesh of more than 3 axes, ``upstream-import-failed``
    when the checkout's base modules do not load.
    """
    for shape in meshes:
        if len(shape) not in MESH_NAMES:
            raise SpecError("invalid-mesh", f"audit meshes have 1 to {max(MESH_NAMES)} axes; "
                            f"{'x'.join(map(str, shape))} has {len(shape)}", hint="give a mesh such as 4, 2x2 or 2x2x2")
    report = AuditReport(checkout.given or str(checkout.root), [tuple(m) for m in meshes],
                         "package" if checkout.platform else "stand-in")
    session = Session(checkout, limits)
    _OURS.clear()
    try:
        try:
            session._started()
        except WorkerFailure as failure:
            raise SpecError("upstream-import-failed", f"the checkout cannot be loaded: {failure.message}",
                            hint="its base modules (hyper_parallel.core.layout, core.shard.ops.parallel_ops) "
                                 "must import with the stand-in platform") from None
        try:
            from_modules = set(session.module_names()) if checkout.modules else set()
        except WorkerFailure as failure:
            raise OpError("module-failed", f"importing the --module files failed: {failure.message}",
                          hint="run the file with python, with the checkout on PYTHONPATH, to see why") from None
        known = set(checkout.entries) | from_modules
        names = sorted(known) if ops is None else list(ops)
        for name in names:
            if name not in known:
                shown = ", ".join(sorted(known)[:8])
                raise OpError("unknown-op", f"the checkout registers no op {cut(name)}",
                              hint=f"name an op of its ops/yaml files (e.g. {shown})")
        for name in names:
            if not cases_for(name):
                report.not_mapped[name] = NOT_MAPPED.get(name, "no audit case written")
        audits: dict[str, OpAudit] = {}
        code_of = {name: _code_of(checkout, name, from_modules) for name in names}
        position = {name: k for k, name in enumerate(names)}
        last_code = "--module" if checkout.modules else None  # what the running worker has run
        for done, name in enumerate(sorted(names, key=lambda n: (code_of[n], position[n]))):
            cases = cases_for(name)
            if not cases:
                continue
            if last_code is not None and code_of[name] != last_code:  # a fresh worker for each module's ops
                session.stop()
            last_code = code_of[name]
            if progress is not None:
                progress(name, done, len(names))
            first = cases[0]
            label = get_rule(first.op).name if first.kernel is None else \
                f"numpy {first.kernel} of interop/judges.py, " + (
                    f"layout-prop's {get_rule(first.op).name} rule as stand-in" if first.op else "no layout-prop rule")
            source = str(checkout.modules[0]) if name in from_modules and len(checkout.modules) == 1 else \
                "--module" if name in from_modules else checkout.entries[name].source
            audit = OpAudit(name, label, source)
            try:
                session.load(name, name in from_modules)
                for case in cases:
                    for shape in meshes:
                        mesh = DeviceMesh(tuple(shape), MESH_NAMES[len(shape)])
                        audit_case(session, name, case, mesh, audit, budget, seed)
            except WorkerFailure as failure:  # this op only: a fresh worker for the next
                session.stop()
                audit = OpAudit(name, label, source, failure=(failure.kind, failure.message))
                if failure.kind == "load-failed":
                    report.failed[name] = failure.message
            audits[name] = audit
        report.ops.extend(audits[name] for name in names if name in audits)  # in the names' order
        report.failed = {name: report.failed[name] for name in names if name in report.failed}
        if progress is not None:
            progress("", len(names), len(names))
    finally:
        session.stop()
        _OURS.clear()
    return report
