"""No pass mutates its input graph (ARCHITECTURE.md's invariant, held by execution).

Every pass runs over the op database's graphs (one node per record's sample, placements drawn
as the testing kit draws them, and the same with the first operand ``auto``) and over the
examples' specs; the input's whole content (nodes, their attrs and metadata, edges, outputs,
the graph-level metadata) is taken before and compared after, deeply.

The one pass whose contract is writing its input's metadata is propagate (an analysis pass):
on a fresh graph it may add only the keys it owns (specs, violations, wants, attrs and its
private memo of each node's rule), and on a propagated graph it changes nothing.  Every other
pass is given the graph as the analysis hands it over: propagated, or still holding its
``auto`` inputs (complete, and the sweep-or-solver pass that runs it).
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest

from layout_prop.core import meta
from layout_prop.core.errors import LayoutPropError
from layout_prop.io.loader import load_spec
from layout_prop.passes.backward import Backward
from layout_prop.passes.base import AnalysisOptions
from layout_prop.passes.check import Check
from layout_prop.passes.complete import Complete
from layout_prop.passes.expand import Expand
from layout_prop.passes.kernel_check import KernelCheck
from layout_prop.passes.lower import Lower
from layout_prop.passes.memory import Memory
from layout_prop.passes.pass_manager import PassContext
from layout_prop.passes.propagate import Propagate
from layout_prop.passes.recompute import Recompute
from layout_prop.passes.reshard import Reshard
from layout_prop.passes.verify import Verify
from layout_prop.passes.zero import Zero, ZeroConfig
from layout_prop.planner.choice import SweepOrSolver
from layout_prop.testing import _combinations, single_op_spec
from layout_prop.testing.opdb import all_records

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted([ROOT / "examples" / "llama_block.yaml", *(ROOT / "examples" / "rpe").glob("*.yaml")])

#: propagate's private memo of a node's rule (passes/propagate.py's _PREPARED)
PREPARED = "propagate.prepared"
#: the node metadata propagate writes (its private memo among them)
PROPAGATE_KEYS = {meta.SPECS, meta.VIOLATIONS, meta.WANTS, meta.ATTRS, PREPARED}


# ------------------------------------------------------------------------------------ the snapshot
class _Held:
    """A value compared by identity: one that a deep copy does not reproduce equal (a rule
    object, the propagation cache's tables), so that only the very object counts as unchanged."""

    def __init__(self, value) -> None:
        self.value = value

    def __eq__(self, other) -> bool:
        return isinstance(other, _Held) and other.value is self.value

    def __repr__(self) -> str:
        return f"<the object {type(self.value).__name__} at {id(self.value):#x}>"


def _frozen(value):
    """A deep copy of ``value`` that compares equal to a later deep copy of it exactly when the
    content is unchanged: containers copied element by element, value types deep-copied,
    anything a copy does not reproduce equal held by identity."""
    if isinstance(value, dict):
        return {"<dict>": [(_frozen(k), _frozen(v)) for k, v in value.items()]}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return (type(value).__name__, [_frozen(v) for v in items])
    try:
        copied = copy.deepcopy(value)
        if copied == value:
            return copied
    except Exception:  # noqa: BLE001 (not copyable: held by identity)
        pass
    return _Held(value)


def _node_meta(node) -> dict:
    """A node's metadata; of propagate's private memo (the propagation cache's table the rule was
    looked up in, the rule, its attrs, the rule's index in that table) the rule and attrs: which
    cache's table a run used is the cache's state, not the graph's."""
    found = dict(node.meta)
    if PREPARED in found:
        found[PREPARED] = found[PREPARED][1:3]
    return found


def content(graph) -> dict:
    """Everything a graph holds: mesh, nodes in order (name, op, inputs (the edges), outputs,
    attrs, metadata), graph outputs and graph-level metadata."""
    return {
        "mesh": _frozen(graph.mesh),
        "nodes": [(n.name, n.op, tuple(n.inputs), n.num_outputs, _Held(n), _frozen(n.attrs), _frozen(_node_meta(n)))
                  for n in graph.nodes],
        "outputs": list(graph.outputs),
        "meta": _frozen(graph.meta),
    }


def _differences(before: dict, after: dict) -> list[str]:
    said = [f"{key} changed" for key in ("mesh", "outputs", "meta") if before[key] != after[key]]
    if [n[0] for n in before["nodes"]] != [n[0] for n in after["nodes"]]:
        said.append(f"nodes changed: {[n[0] for n in before['nodes']]} -> {[n[0] for n in after['nodes']]}")
        return said
    parts = ("name", "op", "inputs", "num_outputs", "node object", "attrs", "meta")
    for b, a in zip(before["nodes"], after["nodes"]):
        said += [f"node {b[0]!r}: {part} changed" for part, x, y in zip(parts[:-1], b, a) if x != y]
        old, new = dict(b[-1]["<dict>"]), dict(a[-1]["<dict>"])
        said += [f"node {b[0]!r}: meta {key!r} changed" for key in sorted(old.keys() | new.keys(), key=repr)
                 if old.get(key, "<absent>") != new.get(key, "<absent>")]
    return said


def assert_untouched(graph, run, what: str) -> None:
    """Run ``run(graph)`` (a refusal is fine) and assert ``graph``'s content is as it was."""
    before = content(graph)
    try:
        run(graph)
    except LayoutPropError:
        pass
    assert _differences(before, content(graph)) == [], what


# ------------------------------------------------------------------------------------ the passes
def _sweep_or_solver(reshard: bool, backward: bool):
    return lambda g: SweepOrSolver().apply(g, PassContext(AnalysisOptions(reshard=reshard, backward=backward)))


#: passes given a graph still holding its ``auto`` inputs, or a propagated one
FIRST = {
    "complete": lambda g: Complete().run(g),
    "sweep-or-solver": _sweep_or_solver(False, False),
    "sweep-or-solver --reshard": _sweep_or_solver(True, False),
    "sweep-or-solver --reshard --backward": _sweep_or_solver(True, True),
}
#: passes given a propagated graph
PROPAGATED = {
    **FIRST,
    "propagate": lambda g: Propagate().run(g),
    "expand": lambda g: Expand().run(g),
    "backward": lambda g: Backward().run(g),
    "reshard": lambda g: Reshard().run(g),
    "check": lambda g: Check().run(g),
    "memory": lambda g: Memory("adam").run(g),
    "kernel_check": lambda g: KernelCheck("cann").run(g),
    "verify": lambda g: Verify(resolved=True).run(g),
    "recompute": lambda g: Recompute("full").run(g),
}
#: passes given a resolved graph (its backward, resharded)
RESOLVED = {
    "lower": lambda g: Lower().run(g),
    "zero": lambda g: Zero(ZeroConfig(3, tuple(g.mesh.names[:1]))).run(g),
    "recompute": lambda g: Recompute("full").run(g),
    "memory": lambda g: Memory("adam").run(g),
    "verify": lambda g: Verify(resolved=True).run(g),
}


def check_every_pass(source, analyses=tuple(FIRST)) -> None:
    """Every pass on ``source`` (a spec), each given a freshly loaded graph in the state it expects;
    of complete and the sweep-or-solver pass, the runs named in ``analyses``."""
    has_auto = any(n.attrs.get("placements") == "auto" for n in load_spec(source).inputs())
    if has_auto:
        for name in analyses:
            assert_untouched(load_spec(source), FIRST[name], name)
        return
    fresh = load_spec(source)
    before = content(fresh)
    try:
        Propagate().run(fresh)
    except LayoutPropError:
        return  # nothing to hand the other passes
    after = content(fresh)
    assert [n[:5] for n in after["nodes"]] == [n[:5] for n in before["nodes"]]
    for b, a in zip(before["nodes"], after["nodes"]):
        assert b[5] == a[5], f"propagate changed the attrs of {b[0]!r}"
        old, new = dict(b[6]["<dict>"]), dict(a[6]["<dict>"])
        assert {k: v for k, v in new.items() if k not in PROPAGATE_KEYS} == old, b[0]
    assert (before["outputs"], before["meta"]) == (after["outputs"], after["meta"])

    for name, run in PROPAGATED.items():
        if name in FIRST and name not in analyses:
            continue
        graph = load_spec(source)
        Propagate().run(graph)
        assert_untouched(graph, run, name)
    ctx = PassContext(AnalysisOptions(reshard=True, backward=True))
    try:
        resolved = SweepOrSolver().apply(load_spec(source), ctx).graph
    except LayoutPropError:
        return
    for name, run in RESOLVED.items():
        assert_untouched(resolved, run, f"{name} (on the resolved graph)")


# ------------------------------------------------------------------------------------ the graphs
def _record_specs(record) -> list[dict]:
    """One node per sample of ``record`` on a 2 x 2 mesh (or its first), placements drawn as
    verify_op draws them, and the first with its first operand ``auto``."""
    mesh = (2, 2) if (2, 2) in [tuple(m) for m in record.meshes] else tuple(record.meshes[0])
    rng = random.Random(0)
    specs = []
    for sample in record.samples:
        for combo in _combinations(sample, len(mesh), 1, rng):
            specs.append(single_op_spec(record.op, sample, mesh, combo))
    if specs:
        auto = copy.deepcopy(specs[0])
        first = next(iter(auto["inputs"].values()))
        first["placements"] = "auto"
        specs.append(auto)
    return specs


RECORDS = all_records()


@pytest.mark.parametrize("record", RECORDS, ids=[r.name for r in RECORDS])
def test_no_pass_mutates_an_op_database_graph(record):
    """(complete, and the whole analysis with its backward; the examples run every option)"""
    for spec in _record_specs(record):
        check_every_pass(spec, ("complete", "sweep-or-solver --reshard --backward"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_no_pass_mutates_an_example(path):
    text = path.read_text()
    check_every_pass(text)
    # and with its first input auto: complete and the sweep-or-solver pass write the layouts on a copy
    import yaml

    spec = yaml.safe_load(text)
    next(iter(spec["inputs"].values()))["placements"] = "auto"
    check_every_pass(spec)


def test_analyze_leaves_an_auto_input_auto():
    """``analyze(g, reshard=True)`` used to write complete's choice, ``('S(2)',)``, into ``g`` itself."""
    from layout_prop.api import analyze

    g = load_spec("""
mesh: {shape: [2], names: [sp]}
inputs:
  x:   {shape: [2, 2, 8, 16], placements: ["S(2)"]}
  cos: {shape: [1, 1, 8, 16], placements: auto}
  sin: {shape: [1, 1, 8, 16], placements: auto}
nodes:
  - {name: y, op: rope, inputs: [x, cos, sin]}
""")
    before = content(g)
    analysis = analyze(g, reshard=True)
    assert analysis.graph.node("cos").attrs["placements"] == ("S(2)",)
    assert g.node("cos").attrs["placements"] == "auto"
    assert _differences(before, content(g)) == []


def test_the_snapshot_sees_a_mutation():
    """The comparison itself: an attr rewritten, a metadata key added, a node added and a
    graph-level key added are each reported."""
    source = "mesh: {shape: [2]}\ninputs: {x: {shape: [4], placements: [R]}}\nnodes: [{name: y, op: exp, inputs: [x]}]"

    def rewrite(g):
        g.node("x").attrs["placements"] = ("S(0)",)

    def grow(g):
        g.node("y").meta["seen"] = True

    def add(g):
        g.op("z", "exp", ["y"])

    def mark(g):
        g.meta["zero"] = 1

    for change in (rewrite, grow, add, mark):
        graph = load_spec(source)
        Propagate().run(graph)
        with pytest.raises(AssertionError):
            assert_untouched(graph, change, change.__name__)
