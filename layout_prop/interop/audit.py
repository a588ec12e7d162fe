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

import copy
import functools
import itertools
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from layout_prop.core import meta
from layout_prop.core.errors import ExecutionError, LayoutPropError, OpError, describe
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
from .hyper_parallel import Checkout, from_upstream, host_rank, host_tensor, quiet_backend, to_upstream, upstream_text

__all__ = ["AuditReport", "OpAudit", "Finding", "run_audit", "DEFAULT_MESHES", "CLASSES"]

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
        return not any(a.counts["wrong"] for a in self.ops)

    def totals(self) -> dict[str, int]:
        out = {k: sum(a.counts[k] for a in self.ops) for k in CLASSES}
        out["wrong_silently"] = sum(a.silent for a in self.ops)
        out["combinations"] = sum(a.combinations for a in self.ops)
        return out

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checkout": self.root, "platform": self.platform,
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
def _wrap_for(checkout: Checkout, up_op, case: Case, up_out, layouts, extra_args):
    """The upstream expansion around the kernel (Add and Linear scale a term), when the class has one."""
    get_impl = getattr(type(up_op), "get_expand_impl", None)
    if get_impl is None or get_impl is checkout.base_class.get_expand_impl:
        return None
    position = {s: p for p, s in enumerate(case.slots) if s is not None}

    def wrap(rank: int, call: Callable):
        def func(*upos, **_keywords):  # keyword arguments of a torch-style call: the case's attrs hold them
            over = {attr: _plain(upos[p]) for attr, p in case.call_attrs.items()}  # what the expansion adjusted
            return call(*[np.asarray(upos[position[i]]) for i in range(len(case.shapes))], **over)

        with quiet_backend(checkout), host_rank(rank):
            impl = up_op.get_expand_impl(func, up_out[0] if len(up_out) == 1 else up_out, layouts,
                                         copy.deepcopy(extra_args))
        if impl is None:
            return None

        def run(*args):
            upos = [None] * max([len(case.slots)] + [p + 1 for p in case.call_values])
            for p, value in case.call_values.items():
                upos[p] = value
            for i, a in enumerate(args):
                upos[position[i]] = host_tensor(a) if case.call_attrs or case.call_values or case.tied else a
            with quiet_backend(checkout), host_rank(rank):
                return impl(*upos, **case.call_kwargs)

        return run

    return wrap


def audit_case(checkout: Checkout, name: str, up_op, case: Case, mesh: DeviceMesh, audit: OpAudit,
               budget: int, seed: int) -> None:
    """Every input combination of ``case`` on ``mesh``, into ``audit``'s counts."""
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
    for placements in _combos(case, mesh, budget, rng):
        try:
            in_specs = [TensorSpec(s, (case.dtypes[i] if case.dtypes else "float64"), Layout(mesh, ps, len(s)))
                        for i, (s, ps) in enumerate(zip(case.shapes, placements))]
        except LayoutPropError:  # a layout that cannot exist (a size-1 dim on several devices): not tried
            continue
        locals_in = [scatter_global(g, spec, split_rng) for g, spec in zip(globals_, in_specs)]
        layouts = tuple(None if s is None else to_upstream(checkout, in_specs[s].layout) for s in case.slots)
        extra_args = copy.deepcopy(case.extra_args)
        try:
            codes, our_specs, wants, our_attrs = _our_answer(case, mesh, placements)
        except LayoutPropError as err:  # layout-prop cannot even state these inputs: no answer to offer
            codes, our_specs, wants, our_attrs = [err.code], (), (), attrs
        ours = _describe_ours(codes, our_specs)
        finding = Finding("rejected", name, case, mesh, tuple(tuple(p) for p in placements), "", ours)
        judge_ours = functools.partial(_judge_ours, rule, in_specs, locals_in, our_specs, wants, our_attrs,
                                       reference, **how)
        try:
            with quiet_backend(checkout):
                answer = up_op.infer_layout(layouts, extra_args)
        except Exception as exc:  # the rule refuses these inputs (ValueError, mostly)
            finding.upstream_answer = "raises " + _ADDRESS.sub("", describe(exc))  # same text every run
            _judge_refusal(finding, codes, judge_ours)
            audit.add(finding)
            continue
        raw = _outputs(answer)
        if case.outputs is not None:
            raw = tuple(raw[i] if i < len(raw) else None for i in case.outputs)
        up_out = [a for a in raw if a is not None and hasattr(a, "tensor_map")]
        finding.upstream_answer = "; ".join(str(_safe_layout(a, mesh, case.partial_as)) for a in up_out)
        for attr, position in case.answer_attrs.items():
            finding.upstream_answer += f"; {attr} {_outputs(answer)[position]!r}"
        n = min(len(up_out), len(reference))
        if n == 0:
            finding.kind, finding.message = "unjudged", "the rule returned no Layout"
            audit.add(finding)
            continue
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
            run_attrs = {**attrs, **{k: _plain(_outputs(answer)[i]) for k, i in case.answer_attrs.items()}}
            run_how["localize"] = False
        wrap = _wrap_for(checkout, up_op, case, up_out, layouts, case.extra_args) if case.expansion else None
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


def run_audit(checkout: Checkout, ops: Sequence[str] | None = None, meshes: Sequence[Sequence[int]] = DEFAULT_MESHES,
              budget: int = 256, seed: int = 0, progress: Callable[[str], None] | None = None) -> AuditReport:
    """Audit the checkout's ops (all, or the names in ``ops``) on ``meshes``.

    ``budget`` bounds the combinations tried per case and mesh (a seeded sample beyond it).
    Raises ``OpError`` ``unknown-op`` for a name in ``ops`` that the checkout does not register.
    """
    report = AuditReport(checkout.given or str(checkout.root), [tuple(m) for m in meshes], checkout.platform,
                         failed=dict(checkout.failed))
    names = sorted(checkout.ops) if ops is None else list(ops)
    for name in names:
        if name not in checkout.ops:
            known = ", ".join(sorted(checkout.ops)[:8])
            raise OpError("unknown-op", f"the checkout registers no op {name!r}",
                          hint=f"name an op of its ops/yaml files (e.g. {known})")
    for name in names:
        cases = cases_for(name)
        if not cases:
            report.not_mapped[name] = NOT_MAPPED.get(name, "no audit case written")
            continue
        if progress is not None:
            progress(name)
        first = cases[0]
        label = get_rule(first.op).name if first.kernel is None else \
            f"numpy {first.kernel} of interop/judges.py, " + (
                f"layout-prop's {get_rule(first.op).name} rule as stand-in" if first.op else "no layout-prop rule")
        audit = OpAudit(name, label, checkout.sources.get(name, "?"))
        for case in cases:
            for shape in meshes:
                mesh = DeviceMesh(tuple(shape), MESH_NAMES[len(shape)])
                audit_case(checkout, name, checkout.ops[name], case, mesh, audit, budget, seed)
        report.ops.append(audit)
    return report
