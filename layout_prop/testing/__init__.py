"""A testing kit for transfer functions: :func:`verify_op` and :func:`assert_op_correct`.

For every placement combination of an op's operands on the given meshes (all of them
where that is feasible, a seeded sample where it is not), the kit builds a one-node
graph and requires either a documented violation code, or forward (and backward)
agreement of the lowered per-rank execution with one device.  A combination whose
violations a redistribution can fix is also run through ``--reshard`` and checked.  The
graph verifier (:class:`~layout_prop.passes.verify.Verify`) runs after every pass, so a
rule or pass that leaves a malformed graph or stale specs behind fails here too.

Examples
--------
>>> report = verify_op("add", sample_inputs=[OpSample(shapes=[(4, 3), (3,)])], meshes=[(2,)])
>>> report.combinations, report.mismatches
(12, [])
>>> sorted(report.rejected)
['partial-input', 'sharding-mismatch']
>>> report.accepted + report.resharded + report.refused + report.unusable == report.combinations
True
"""

from __future__ import annotations

import copy
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from layout_prop.core.errors import ExecutionError, LayoutPropError, OpError
from layout_prop.io.loader import load_spec
from layout_prop.core.registry import OpSample, get_rule

__all__ = ["OpSample", "Report", "Mismatch", "verify_op", "assert_op_correct", "GENERIC_CODES",
           "placement_choices", "shrink", "check_spec", "single_op_spec", "combination_specs"]

#: codes any op may report: they come from shared machinery, not from one rule
GENERIC_CODES = frozenset({"partial-input", "sharding-mismatch", "broadcast-shape"})
MESH_NAMES = ("dp", "tp", "sp", "cp")


@dataclass
class Mismatch:
    """A combination whose per-rank execution disagrees with one device.

    ``spec`` is the smallest failing spec shrinking found (ready to run with
    ``layout-prop run``); ``original`` the combination as first tried.
    """

    spec: dict
    output: str
    max_abs_err: float
    message: str
    original: dict | None = None

    def to_dict(self) -> dict:
        """JSON-ready; a non-finite error (a kernel that could not run, a NaN result) is ``null``."""
        err = self.max_abs_err if math.isfinite(self.max_abs_err) else None
        return {"spec": self.spec, "output": self.output, "max_abs_err": err, "message": self.message,
                "original": self.original}


@dataclass
class Report:
    """What :func:`verify_op` found; every combination is counted once.

    ``combinations == accepted + resharded + refused + unusable + len(unfixed)``:
    ``accepted`` ran as declared, ``resharded`` was rejected and then fixed by ``--reshard``
    (``fixed`` counts those by violation code), ``refused`` was rejected with a violation no
    redistribution fixes (``refused_codes`` by code), ``unusable`` could not exist.  ``rejected`` counts violation codes
    over every rejected combination (fixed or not; one combination may have several codes).
    Mismatches are among the accepted and resharded combinations.
    """

    op: str
    combinations: int = 0
    accepted: int = 0
    resharded: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    fixed: dict[str, int] = field(default_factory=dict)
    refused: int = 0
    refused_codes: dict[str, int] = field(default_factory=dict)
    unusable: int = 0
    undocumented: list[tuple[str, dict]] = field(default_factory=list)
    unfixed: list[dict] = field(default_factory=list)  # violations marked fixable that --reshard left
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.undocumented and not self.unfixed

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "combinations": self.combinations, "accepted": self.accepted,
                "resharded": self.resharded, "refused": self.refused, "rejected": dict(sorted(self.rejected.items())),
                "fixed_by_reshard": dict(sorted(self.fixed.items())),
                "refused_by_code": dict(sorted(self.refused_codes.items())), "unusable": self.unusable, "undocumented": sorted({c for c, _ in self.undocumented}),
                "unfixed": self.unfixed[:3],
                "mismatches": [m.to_dict() for m in self.mismatches]}

    def merge(self, other: "Report") -> None:
        self.combinations += other.combinations
        self.accepted += other.accepted
        self.resharded += other.resharded
        self.unusable += other.unusable
        self.refused += other.refused
        for code, n in other.rejected.items():
            self.rejected[code] = self.rejected.get(code, 0) + n
        for code, n in other.fixed.items():
            self.fixed[code] = self.fixed.get(code, 0) + n
        for code, n in other.refused_codes.items():
            self.refused_codes[code] = self.refused_codes.get(code, 0) + n
        self.undocumented += other.undocumented
        self.unfixed += other.unfixed
        self.mismatches += other.mismatches


def placement_choices(shape: Sequence[int], partial: bool = True, strided: bool = False) -> list[str]:
    """Every placement an operand of ``shape`` may have on one mesh axis (size-1 dims never shard).

    >>> placement_choices((4, 3), strided=True)
    ['R', 'S(0)', 'S(1)', 'P(sum)', '_S(0,2)']
    """
    out = ["R"] + [f"S({d})" for d, size in enumerate(shape) if size != 1]
    if partial:
        out.append("P(sum)")
    if strided:
        out += [f"_S({d},2)" for d, size in enumerate(shape) if size % 2 == 0 and size >= 4]
    return out


def _combinations(sample: OpSample, mesh_ndim: int, budget: int | str, rng: random.Random):
    per_operand = [placement_choices(s, sample.partial_ok, sample.strided) for s in sample.shapes]
    axes = [per_operand[i] for i in range(len(sample.shapes)) for _ in range(mesh_ndim)]
    total = 1
    for a in axes:
        total *= len(a)
    if budget == "all" or total <= budget:
        yield from itertools.product(*axes)
        return
    seen = set()
    while len(seen) < budget:
        combo = tuple(rng.choice(a) for a in axes)
        if combo not in seen:
            seen.add(combo)
            yield combo


def single_op_spec(op: str, sample: OpSample, mesh_shape: Sequence[int], combo: Sequence[str]) -> dict:
    """The spec of one node of ``op`` on ``sample``; ``combo`` holds each operand's placements in turn."""
    rule = get_rule(op)
    m = len(mesh_shape)
    inputs = {}
    names = [rule.operand_name(i) for i in range(len(sample.shapes))]
    for i, (name, shape) in enumerate(zip(names, sample.shapes)):
        entry: dict[str, Any] = {"shape": list(shape), "placements": list(combo[i * m:(i + 1) * m])}
        if sample.dtypes:
            entry["dtype"] = sample.dtypes[i]
        if sample.requires_grad is not None:
            entry["requires_grad"] = bool(sample.requires_grad[i])
        inputs[name] = entry
    count = rule.output_count(rule.normalize_attrs(dict(sample.attrs)), tuple(map(tuple, sample.shapes))) \
        if rule.variadic_outputs else rule.num_outputs
    outs = [rule.name] if count == 1 else [f"{rule.name}:{k}" for k in range(count)]
    return {"mesh": {"shape": list(mesh_shape), "names": list(MESH_NAMES[:m])}, "inputs": inputs,
            "nodes": [{"name": rule.name, "op": rule.name, "inputs": names, "attrs": dict(sample.attrs)}],
            "outputs": outs}


def check_spec(spec: dict, documented: frozenset, backward: bool, seed: int, report: Report) -> None:
    """Try one spec: count it as unusable, rejected, accepted or resharded; record mismatches."""
    from ..api import analyze
    from ..runner import run_graph

    report.combinations += 1
    try:
        graph = load_spec(spec)
    except LayoutPropError as err:
        if err.code != "invalid-layout":
            raise
        report.unusable += 1
        return
    analysis = analyze(graph, verify=True)
    codes = [v.code for v in analysis.check.violations]
    for code in set(codes):
        report.rejected[code] = report.rejected.get(code, 0) + 1
        if code not in documented:
            report.undocumented.append((code, spec))
    if codes and not all(v.fixable for v in analysis.check.violations):
        report.refused += 1
        for code in set(codes):
            report.refused_codes[code] = report.refused_codes.get(code, 0) + 1
        return
    try:
        rep = run_graph(load_spec(spec), backward=backward, seed=seed, verify=True)
    except ExecutionError as err:  # a kernel that cannot even run on the claimed local shapes
        report.mismatches.append(Mismatch(spec, err.node or "?", float("inf"), str(err)))
        return
    if rep.violations:  # every violation was marked fixable, yet --reshard could not fix them: a rule bug
        report.unfixed.append(spec)
        return
    if codes:
        report.resharded += 1
        for code in set(codes):
            report.fixed[code] = report.fixed.get(code, 0) + 1
    else:
        report.accepted += 1
    if not rep.ok:
        errors = {**rep.outputs, **{f"grad:{k}": v for k, v in rep.grads.items()}}
        worst = max(errors.items(), key=lambda kv: kv[1]["max_abs_err"], default=("?", {"max_abs_err": float("nan")}))
        report.mismatches.append(Mismatch(spec, rep.mismatches[0].split(":")[0] if rep.mismatches else worst[0],
                                          worst[1]["max_abs_err"], "; ".join(rep.mismatches)))


def _fails(spec: dict, documented: frozenset, backward: bool, seed: int) -> Mismatch | None:
    report = Report("shrink")
    try:
        check_spec(spec, documented, backward, seed, report)
    except LayoutPropError:
        return None
    return report.mismatches[0] if report.mismatches else None


def _shrink_candidates(spec: dict):
    """Smaller variants of ``spec``: fewer mesh axes, smaller axes, fewer sharded dims, smaller dims."""
    mesh = spec["mesh"]
    m = len(mesh["shape"])
    if m > 1:
        for axis in range(m):
            cand = copy.deepcopy(spec)
            for key in ("shape", "names"):
                del cand["mesh"][key][axis]
            for entry in cand["inputs"].values():
                del entry["placements"][axis]
            yield cand
    for axis, size in enumerate(mesh["shape"]):
        if size > 2:
            cand = copy.deepcopy(spec)
            cand["mesh"]["shape"][axis] = 2
            yield cand
    for name, entry in spec["inputs"].items():
        for axis, p in enumerate(entry["placements"]):
            if p != "R":
                cand = copy.deepcopy(spec)
                cand["inputs"][name]["placements"][axis] = "R"
                yield cand
    # a dim size, aligned from the right, shrunk in every operand that has it (keeps shapes consistent)
    seen = set()
    for entry in spec["inputs"].values():
        shape = entry["shape"]
        for d, size in enumerate(shape):
            key = (len(shape) - d, size)
            if size <= 1 or key in seen:
                continue
            seen.add(key)
            for new in sorted({1, size // 2, size - 1} - {0, size}):
                cand = copy.deepcopy(spec)
                for other in cand["inputs"].values():
                    k = len(other["shape"]) - key[0]
                    if 0 <= k < len(other["shape"]) and other["shape"][k] == size:
                        other["shape"][k] = new
                yield cand


def shrink(mismatch: Mismatch, documented: frozenset, backward: bool = True, seed: int = 0,
           max_steps: int = 200) -> Mismatch:
    """Greedily shrink a failing spec while it still fails; returns the smallest mismatch found."""
    best = mismatch
    for _ in range(max_steps):
        for cand in _shrink_candidates(best.spec):
            found = _fails(cand, documented, backward, seed)
            if found is not None:
                best = Mismatch(found.spec, found.output, found.max_abs_err, found.message,
                                mismatch.original or mismatch.spec)
                break
        else:
            return best
    return best


def verify_op(op: str, sample_inputs: Iterable[OpSample] | None = None,
              meshes: Iterable[Sequence[int]] = ((2,), (2, 2)), placements: int | str = "all",
              backward: bool = True, seed: int = 0, codes: Iterable[str] | None = None,
              shrink_limit: int = 3, jobs: int = 1,
              progress: Callable[[int, int], None] | None = None) -> Report:
    """Try ``op`` on every (or a seeded sample of ``placements``) placement combination.

    Parameters
    ----------
    op : str
        A registered op name or alias.
    sample_inputs : iterable of OpSample, optional
        Operand shapes to try (include uneven and size-1 dims); default the rule's own
        ``sample_inputs()``.
    meshes : iterable of mesh shapes
    placements : "all" or int
        Every combination, or at most this many per sample and mesh (seeded).
    backward : bool
        Also compare gradients.
    codes : iterable of str, optional
        The op's documented violation codes (default: the rule's ``violation_codes``
        plus :data:`GENERIC_CODES`).
    shrink_limit : int
        How many mismatches to shrink to a minimal failing spec.
    jobs : int
        Processes to check combinations in (forked, so ops registered by the caller are
        known to them); the report is the same as with one job, in the same order.
    progress : callable, optional
        Called as ``progress(done, total)`` as combinations are checked.
    """
    rule = get_rule(op)
    documented = frozenset(codes) if codes is not None else frozenset(
        getattr(rule, "violation_codes", ())) | GENERIC_CODES
    specs = combination_specs(rule.name, sample_inputs, meshes, placements, seed)
    report = Report(rule.name)
    if progress is not None:
        progress(0, len(specs))
    if jobs <= 1 or len(specs) < 2 * _CHUNK:
        for i, spec in enumerate(specs):
            check_spec(spec, documented, backward, seed, report)
            if progress is not None:
                progress(i + 1, len(specs))
    else:
        _check_in_processes(specs, documented, backward, seed, jobs, report, progress)
    for i, m in enumerate(report.mismatches[:shrink_limit]):
        report.mismatches[i] = shrink(m, documented, backward, seed)
    return report


def combination_specs(op: str, sample_inputs: Iterable[OpSample] | None = None,
                      meshes: Iterable[Sequence[int]] = ((2,), (2, 2)), placements: int | str = "all",
                      seed: int = 0) -> list[dict]:
    """The one-node specs :func:`verify_op` tries, in its order (how many: ``len`` of this)."""
    rule = get_rule(op)
    rng = random.Random(seed)
    if sample_inputs is not None:
        samples = list(sample_inputs)
    else:  # the rule's own samples, else the op database's records of a built-in op
        from .opdb import samples_for

        samples = list(rule.sample_inputs()) or samples_for(rule.name)
    if not samples:
        raise OpError("no-samples", f"op {rule.name!r} has no sample inputs to verify with",
                      hint="pass sample_inputs=[OpSample(shapes=...)], or define sample_inputs() on its rule")
    return [single_op_spec(rule.name, sample, mesh, combo)
            for sample in samples for mesh in meshes
            for combo in _combinations(sample, len(mesh), placements, rng)]


_CHUNK = 40  # combinations per task handed to a worker process


def _check_chunk(args) -> tuple[str, Any]:
    """Worker side of :func:`_check_in_processes`: one chunk's report, or the error it raised."""
    specs, documented, backward, seed = args
    report = Report("chunk")
    try:
        for spec in specs:
            check_spec(spec, documented, backward, seed, report)
    except LayoutPropError as err:  # re-raised by the parent (the exception itself may not pickle)
        return "error", (type(err), err.code, err.message,
                         {k: getattr(err, k) for k in ("path", "node", "input", "hint")})
    return "ok", report


def _check_in_processes(specs: list[dict], documented: frozenset, backward: bool, seed: int, jobs: int,
                        report: Report, progress: Callable[[int, int], None] | None) -> None:
    """Check ``specs`` in ``jobs`` forked processes, merging chunk reports in order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    chunks = [specs[i:i + _CHUNK] for i in range(0, len(specs), _CHUNK)]
    done = 0
    context = multiprocessing.get_context("fork")
    # a forked pool starts all its processes at once: never more than there are chunks
    with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(chunks))), mp_context=context) as pool:
        for chunk, (status, value) in zip(chunks, pool.map(_check_chunk, [(c, documented, backward, seed)
                                                                           for c in chunks])):
            if status == "error":
                cls, code, message, where = value
                raise cls(code, message, **where)
            report.merge(value)
            done += len(chunk)
            if progress is not None:
                progress(done, len(specs))


def assert_op_correct(op: str, sample_inputs: Iterable[OpSample] | None = None, **kwargs) -> Report:
    """:func:`verify_op` for pytest: raises AssertionError naming the first mismatch."""
    report = verify_op(op, sample_inputs, **kwargs)
    if report.undocumented:
        code, spec = report.undocumented[0]
        raise AssertionError(f"{op}: undocumented violation code {code!r} for spec {spec}")
    if report.mismatches:
        m = report.mismatches[0]
        raise AssertionError(f"{op}: {len(report.mismatches)} mismatch(es); first: {m.message}; spec {m.spec}")
    return report
