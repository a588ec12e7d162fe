"""Whole-graph passes: golden snapshots after each pass, ordering of violations, auto
completion, redistribution reporting, and the verifier after every pass.

Golden files live in ``graph_tests/golden``; they were reviewed by hand when written.
Regenerate them after an intended change with ``LAYOUT_PROP_UPDATE_GOLDEN=1 pytest``
and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from layout_prop import Layout, OpRule, RuleResult, register_op
from layout_prop.core import meta
from layout_prop.core.errors import GraphError, OpError, Violation
from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.core.graph import Graph, Node
from layout_prop.io.loader import load_spec
from layout_prop.passes.check import Check
from layout_prop.passes.complete import Complete
from layout_prop.passes.lower import Lower
from layout_prop.passes.propagate import Propagate
from layout_prop.passes.reshard import Reshard
from layout_prop.passes.verify import Verify
from layout_prop.runner import run_graph

GOLDEN = Path(__file__).resolve().parent / "golden"

GRAPHS = {
    "rpe_alone": """
mesh: {shape: [2, 2], names: [dp, sp]}
inputs:
  x:   {shape: [4, 2, 6, 8], placements: ["S(0)", "S(2)"]}
  cos: {shape: [1, 1, 6, 8], placements: [R, R], requires_grad: false}
  sin: {shape: [1, 1, 6, 8], placements: [R, "S(2)"], requires_grad: false}
nodes:
  - {name: y, op: rotary_position_embedding, inputs: [x, cos, sin], attrs: {mode: 1}}
outputs: [y]
""",
    "rpe_partial_producer": """
mesh: {shape: [2], names: [tp]}
inputs:
  a:   {shape: [2, 2, 6, 8], placements: ["P(sum)"]}
  b:   {shape: [2, 2, 6, 8], placements: ["P(sum)"]}
  cos: {shape: [6, 8], requires_grad: false}
  sin: {shape: [6, 8], requires_grad: false}
nodes:
  - {name: x, op: add, inputs: [a, b]}
  - {name: y, op: rotary_position_embedding, inputs: [x, cos, sin]}
outputs: [y]
""",
    "chain_all_gather": """
mesh: {shape: [2], names: [tp]}
inputs:
  x:   {shape: [2, 2, 6, 8], placements: ["S(3)"]}
  cos: {shape: [1, 1, 6, 8], requires_grad: false}
  sin: {shape: [1, 1, 6, 8], requires_grad: false}
nodes:
  - {name: h, op: neg, inputs: [x]}
  - {name: y, op: rotary_position_embedding, inputs: [h, cos, sin], attrs: {mode: 2}}
  - {name: z, op: mul, inputs: [y, h]}
outputs: [z]
""",
}


def _snapshot(name: str) -> str:
    parts = []
    g = load_spec(GRAPHS[name])
    Propagate().run(g)
    Verify().run(g)
    parts.append("## after propagate")
    parts.append(g.format(meta_keys=[meta.SPECS, meta.WANTS]))
    res = Check().run(g)
    parts.append("## after check")
    parts += [str(v) for v in res.violations] or ["no violations"]
    parts += [json.dumps(r.to_dict(), sort_keys=True) for r in res.redistributions]
    new = Reshard().run(g).graph
    Verify(resolved=True).run(new)
    parts.append("## after reshard")
    parts.append(new.format(meta_keys=[meta.SPECS]))
    res = Check().run(new)
    parts += [str(v) for v in res.violations] or ["no violations"]
    parts += [json.dumps(r.to_dict(), sort_keys=True) for r in res.redistributions]
    parts.append("## after lower (rank 1)")
    parts.append(Lower().run(new).program.format(rank=1))
    return "\n".join(parts) + "\n"


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_golden_snapshots_after_each_pass(name):
    text = _snapshot(name)
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("LAYOUT_PROP_UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text()


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_reshard_makes_each_graph_check_clean_and_right(name):
    before = analyze(load_spec(GRAPHS[name]))
    after = analyze(load_spec(GRAPHS[name]), reshard=True)
    assert after.ok
    assert any(r.explicit for r in after.check.redistributions) == (not before.ok)
    rep = run_graph(load_spec(GRAPHS[name]), backward=True)
    assert rep.ok, rep.mismatches


FIVE = """
mesh: {shape: [2, 2], names: [dp, tp]}
inputs:
  x:   {shape: [4, 4, 8, 16], placements: ["S(0)", "S(3)"]}
  p:   {shape: [4, 4, 8, 16], placements: ["P(sum)", R]}
  cos: {shape: [1, 1, 8, 16], placements: ["S(2)", R]}
  sin: {shape: [1, 1, 8, 16]}
  u:   {shape: [5, 3]}
  v:   {shape: [4, 3]}
nodes:
  - {name: r1, op: rope, inputs: [x, cos, sin], attrs: {mode: 9}}
  - {name: q, op: add, inputs: [p, x]}
  - {name: bad, op: add, inputs: [u, v]}
outputs: [r1, q, bad]
"""


def test_five_different_violations_reported_in_order_with_exit_1(tmp_path, capsys):
    a = analyze(load_spec(FIVE))
    got = [(v.node, v.input, v.code) for v in a.check.violations]
    assert got == [
        ("r1", "x", "invalid-mode"),
        ("r1", "x", "sharded-rotation-dim"),
        ("r1", "cos", "sharding-mismatch"),
        ("q", "p", "partial-input"),
        ("bad", "v", "broadcast-shape"),
    ]
    spec = tmp_path / "five.yaml"
    spec.write_text(FIVE)
    assert main(["check", str(spec), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [v["code"] for v in out["violations"]] == [c for _, _, c in got]
    for v in out["violations"]:
        assert v["message"] and v["hint"] and v["op"] in ("rotary_position_embedding", "add")
    assert main(["check", str(spec)]) == 1
    table = capsys.readouterr().out
    assert "5 violation(s)" in table and "[broadcast-shape] bad (add), input v" in table


AUTO = """
mesh: {shape: [2, 2, 2], names: [dp, tp, sp]}
inputs:
  x:   {shape: [4, 4, 16, 64], placements: ["S(0)", "S(1)", "S(2)"]}
  cos: {shape: [1, 1, 16, 64], placements: auto, requires_grad: false}
  sin: {shape: [1, 1, 16, 64], placements: auto, requires_grad: false}
nodes:
  - {name: y, op: rope, inputs: [x, cos, sin]}
"""


def test_auto_completion_matches_x_and_reports_alternatives():
    g = load_spec(AUTO)
    res = Complete().run(g)
    Verify().run(res.graph)  # the graph carries the specs of the chosen layouts, not of the last one tried
    assert res.chosen == {"cos": ("R", "R", "S(2)"), "sin": ("R", "R", "S(2)")}
    assert len(res.notes) == 2
    assert "alternatives: (R, R, R): 0 bytes/rank" in res.notes[0]
    a = analyze(load_spec(AUTO))
    assert a.ok and a.report()["tensors"]["cos"]["placements"] == ["R", "R", "S(2)"]


def test_auto_completion_with_two_consumers_that_want_different_layouts():
    spec = """
mesh: {shape: [2], names: [tp]}
inputs:
  x: {shape: [8, 64], placements: ["S(1)"]}
  z: {shape: [8, 64], placements: ["S(0)"]}
  w: {shape: [8, 64], placements: auto}
nodes:
  - {name: a, op: mul, inputs: [x, w]}
  - {name: b, op: mul, inputs: [z, w]}
  - {name: c, op: mul, inputs: [z, w]}
"""
    g = load_spec(spec)
    res = Complete().run(g)
    Verify().run(res.graph)
    # a wants w as S(1), b and c want S(0).  Replicate serves all three by free local slices (0 bytes).
    # S(0) makes a all-to-all w: its local [4, 64] float32 = 1024 bytes, it keeps half: 512 bytes.
    # S(1) makes b and c each all-to-all w: 2 * 512 = 1024 bytes.
    assert res.chosen == {"w": ("R",)}
    assert res.notes == ["auto layout of 'w': (R) with 0 bytes/rank of redistribution; alternatives: "
                         "(S(0)): 512 bytes/rank, 1 violation(s); (S(1)): 1024 bytes/rank, 2 violation(s)"]


def test_redistributions_in_json_have_steps_and_bytes(capsys, tmp_path):
    spec = tmp_path / "g.yaml"
    spec.write_text(GRAPHS["chain_all_gather"])
    assert main(["check", str(spec), "--reshard", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # planned over the whole graph: h (float32 [2, 2, 6, 8], 384 bytes per rank) goes from S(3) to S(2)
    # by one all-to-all that keeps half of each piece (192 bytes), for both y and z (moved once); the greedy
    # sweep all-gathered h for y (384 bytes) and sliced y for z
    assert out["redistributions"] == [
        {"node": "y", "input": "h", "from": ["S(3)"], "to": ["S(2)"],
         "steps": [{"kind": "all-to-all", "mesh_axis": "tp", "dim": 3, "dst_dim": 2, "bytes_per_rank": 192}],
         "bytes_per_rank": 192},
        {"node": "y", "input": "cos", "from": ["R"], "to": ["S(2)"],
         "steps": [{"kind": "local-slice", "mesh_axis": "tp", "dim": 2, "bytes_per_rank": 0}], "bytes_per_rank": 0},
        {"node": "y", "input": "sin", "from": ["R"], "to": ["S(2)"],
         "steps": [{"kind": "local-slice", "mesh_axis": "tp", "dim": 2, "bytes_per_rank": 0}], "bytes_per_rank": 0},
    ]
    assert out["total_bytes_per_rank"] == 192
    assert out["notes"] == ["reshard: chose where to redistribute over the whole graph: 192 bytes per rank "
                            "(the greedy sweep moves 384)"]


UNEVEN_NON_ASCII = """
mesh: {shape: [3, 2], names: [dp, tp]}
inputs:
  "x\u00e9": {shape: [10, 7, 5], placements: ["S(0)", "S(1)"]}
  w: {shape: [5, 6], placements: [R, "S(1)"]}
nodes:
  - {name: "y\u4e2d", op: matmul, inputs: ["x\u00e9", w]}
  - {name: z, op: add, inputs: ["y\u4e2d", "y\u4e2d"]}
outputs: [z]
"""


@pytest.mark.parametrize("reshard, backward", [(False, False), (True, False), (True, True)])
def test_report_json_is_the_report_dumped_byte_for_byte(reshard, backward):
    # check --json writes report_json(), which encodes each distinct spec and plan once: the same text
    from layout_prop.frontends.generate import llama_spec

    sources = [GRAPHS[name] for name in sorted(GRAPHS)] + [UNEVEN_NON_ASCII, llama_spec(2, seq=9)]
    for source in sources:
        analysis = analyze(load_spec(source), reshard=reshard, backward=backward)
        assert analysis.report_json() == json.dumps(analysis.report(), separators=(",", ":"), allow_nan=False)


def test_propagate_cache_makes_repeated_layers_cache_hits():
    layers = "\n".join(
        f"  - {{name: y{i}, op: rope, inputs: [{'x' if i == 0 else f'y{i - 1}'}, cos, sin]}}" for i in range(50))
    spec = f"""
mesh: {{shape: [2, 2], names: [dp, sp]}}
inputs:
  x:   {{shape: [4, 4, 16, 64], placements: ["S(0)", "S(2)"]}}
  cos: {{shape: [1, 1, 16, 64]}}
  sin: {{shape: [1, 1, 16, 64]}}
nodes:
{layers}
"""
    g = load_spec(spec)
    res = Propagate().run(g)
    assert res.nodes == 53
    # the first layer misses, the other 49 see the same (op, attrs, input specs)
    assert res.cache_hits == 49


# --------------------------------------------------------------------------- incremental propagation
def _propagated(graph):
    return {node.name: (node.meta[meta.SPECS], node.meta[meta.VIOLATIONS], node.meta[meta.WANTS])
            for node in graph.topo_order()}


@pytest.mark.parametrize("source", sorted(GRAPHS) + ["llama"])
def test_reshard_incremental_propagation_equals_a_full_one(source):
    """Reshard re-propagates only what its new nodes can change; a fresh full pass must agree."""
    from layout_prop.frontends.generate import llama_spec

    spec = llama_spec(3) if source == "llama" else GRAPHS[source]
    g = load_spec(spec)
    Propagate().run(g)  # a first pass with another cache: its per-node memo must not leak into the next
    before = _propagated(g)
    new = Reshard(Propagate()).run(g).graph
    assert _propagated(g) == before  # the input graph is left as it was
    incremental = _propagated(new)
    fresh = load_spec(spec)
    fresh_new = Graph.from_nodes(new.mesh, [Node(n.name, n.op, n.inputs, dict(n.attrs), n.num_outputs)
                                            for n in new.topo_order()], new.outputs)
    Propagate().run(fresh_new)
    assert incremental == _propagated(fresh_new)
    if source in ("llama", "chain_all_gather"):
        assert len(fresh) < len(new)  # redistributions were inserted
    Verify(resolved=True).run(new)


@register_op
class _EchoWantsReplicate(OpRule):
    """Wants its input Replicate (a fixable violation otherwise) but echoes the layout it is
    given: the one kind of rule whose output changes when reshard fixes its input, so that
    the nodes downstream must be propagated again."""

    name = "test_echo_wants_replicate"
    operands = ("x",)

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        want = Layout(x.mesh, ["R"] * x.mesh.ndim, x.ndim)
        if x.layout == want:
            return RuleResult((x,))
        bad = Violation("sharding-mismatch", "x must be Replicate", "replicate x", operand="x", fixable=True)
        return RuleResult((x,), [bad], [want])


def test_reshard_propagates_again_what_a_changed_output_reaches():
    spec = """
mesh: {shape: [2], names: [tp]}
inputs: {x: {shape: [4, 6], placements: ["S(1)"]}}
nodes:
  - {name: e, op: test_echo_wants_replicate, inputs: [x]}
  - {name: n, op: neg, inputs: [e]}
  - {name: m, op: mul, inputs: [n, n]}
outputs: [m]
"""
    g = load_spec(spec)
    Propagate().run(g)
    assert str(g.node("m").meta[meta.SPECS][0].layout.placements[0]) == "S(1)"
    before = _propagated(g)
    new = Reshard().run(g).graph
    assert _propagated(g) == before  # n and m were propagated again as copies
    Verify(resolved=True).run(new)
    for name in ("e", "n", "m"):
        assert [str(p) for p in new.node(name).meta[meta.SPECS][0].layout.placements] == ["R"], name
    fresh = Graph.from_nodes(new.mesh, [Node(n.name, n.op, n.inputs, dict(n.attrs), n.num_outputs)
                                        for n in new.topo_order()], new.outputs)
    Propagate().run(fresh)
    assert _propagated(fresh) == _propagated(new)


def test_graph_from_nodes_matches_a_graph_built_node_by_node():
    g = load_spec(GRAPHS["chain_all_gather"])
    bulk = Graph.from_nodes(g.mesh, g.topo_order(), g.outputs)
    assert bulk.format() == g.format()
    assert [(n.name, i) for n, i in bulk.consumers("h")] == [(n.name, i) for n, i in g.consumers("h")]
    assert sorted(bulk.nx.edges(keys=True, data=True)) == sorted(g.nx.edges(keys=True, data=True))
    bulk.lint()


def test_rule_cache_tells_attrs_that_python_finds_equal_apart():
    """mode 1 and mode True are equal and hash alike in Python; only one is a rotation mode."""
    spec = """
mesh: {shape: [2], names: [tp]}
inputs:
  x: {shape: [2, 2, 4, 8], placements: ["S(0)"]}
  cos: {shape: [1, 1, 4, 8]}
  sin: {shape: [1, 1, 4, 8]}
nodes:
  - {name: a, op: rotary_position_embedding, inputs: [x, cos, sin], attrs: {mode: 1}}
  - {name: b, op: rotary_position_embedding, inputs: [x, cos, sin], attrs: {mode: true}}
  - {name: c, op: reshape, inputs: [a], attrs: {shape: [2, 2, 32]}}
  - {name: d, op: reshape, inputs: [a], attrs: {shape: [2.0, 2, 32]}}
outputs: [b, c, d]
"""
    result = Check().run(analyze(load_spec(spec)).graph)
    assert [(v.node, v.code) for v in result.violations] == [("b", "invalid-mode"), ("d", "invalid-reshape")]


def test_verifier_catches_missing_and_stale_metadata():
    spec = """
mesh: {shape: [2], names: [tp]}
inputs: {x: {shape: [4, 6], placements: ["S(0)"]}, w: {shape: [4, 6]}}
nodes:
  - {name: y, op: add, inputs: [x, w]}
  - {name: z, op: neg, inputs: [y]}
outputs: [z]
"""
    g = load_spec(spec)
    with pytest.raises(GraphError) as e:
        Verify().run(g)
    assert e.value.code == "missing-spec" and e.value.node == "x"
    Propagate().run(g)
    Verify(resolved=True).run(g)  # w is sliced locally for free: nothing unresolved

    g.node("x").attrs["placements"] = ("S(1)",)  # changed behind propagate's back
    with pytest.raises(GraphError) as e:
        Verify().run(g)
    assert e.value.code == "stale-spec" and e.value.node == "x" and "(S(1))" in e.value.message
    Propagate().run(g)
    Verify().run(g)

    g.node("x").attrs["placements"] = ("P(max)",)  # add is not linear in a maximum
    Propagate().run(g)
    Verify().run(g)  # a violation the graph carries is no error of the metadata
    assert [v.code for v in g.node("y").meta[meta.VIOLATIONS]] == ["partial-input"]
    g.node("y").meta[meta.VIOLATIONS] = ()  # a pass that dropped it
    with pytest.raises(GraphError) as e:
        Verify().run(g)
    assert e.value.code == "stale-spec" and e.value.node == "y" and "violations []" in e.value.message


def test_verifier_catches_a_want_that_needs_communication():
    g = load_spec("""
mesh: {shape: [2], names: [tp]}
inputs: {a: {shape: [4], placements: ["P(sum)"]}, b: {shape: [4], placements: ["S(0)"]}}
nodes: [{name: c, op: neg, inputs: [a]}, {name: d, op: add, inputs: [a, b]}]
""")
    Propagate().run(g)
    Verify().run(g)
    with pytest.raises(GraphError) as e:
        Verify(resolved=True).run(g)
    assert e.value.code == "unresolved-violation" and e.value.node == "d"
    new = Reshard().run(g).graph
    Verify(resolved=True).run(new)


def test_equal_specs_from_separate_propagations_are_one_object_and_not_kept_alive():
    import gc
    import weakref

    from layout_prop.frontends.generate import llama_spec

    a, b = load_spec(llama_spec(1)), load_spec(llama_spec(1))
    Propagate().run(a)
    Propagate().run(b)  # another cache: the rule results are computed again
    for node in a.topo_order():
        for x, y in zip(node.meta[meta.SPECS], b.node(node.name).meta[meta.SPECS]):
            assert x is y, node.name  # uniqued: comparisons and cache keys stop at identity
        for x, y in zip(node.meta[meta.WANTS], b.node(node.name).meta[meta.WANTS]):
            assert x is y, node.name
    spec = a.node("x").meta[meta.SPECS][0]
    probe = weakref.ref(spec)
    from layout_prop.core.redistribute import clear_caches as clear_planner

    del a, b, node, x, y, spec
    clear_planner()  # the planner's remembered plans hold specs too; the uniquing table is left as it is
    gc.collect()
    assert probe() is None  # the uniquing table holds values weakly


@register_op
class _WantsAList(OpRule):
    """A rule that breaks the contract: it wants a list of placements instead of a Layout."""

    name = "test_wants_a_list"
    operands = ("x",)

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        if attrs.get("bad_output"):
            return RuleResult(([str(p) for p in x.layout.placements],))
        return RuleResult((x,), (), (["R"],))

    attr_defaults = {"bad_output": False}


@pytest.mark.parametrize("bad_output", [False, True])
def test_a_rule_returning_other_than_specs_and_layouts_is_a_bad_rule(tmp_path, capsys, bad_output):
    spec = tmp_path / "g.yaml"
    spec.write_text(f"""
mesh: {{shape: [2], names: [tp]}}
inputs: {{x: {{shape: [4, 6], placements: ["S(0)"]}}}}
nodes: [{{name: y, op: test_wants_a_list, inputs: [x], attrs: {{bad_output: {str(bad_output).lower()}}}}}]
""")
    with pytest.raises(OpError) as e:
        Propagate().run(load_spec(spec))
    assert e.value.code == "bad-rule" and e.value.node == "y"
    assert ("as an output" if bad_output else "not a Layout") in e.value.message
    assert main(["check", str(spec), "--reshard"]) == 2  # one line, no traceback
    assert "bad-rule" in capsys.readouterr().err


def test_inserted_redistributions_have_attrs_of_their_own():
    spec = """
mesh: {shape: [2], names: [tp]}
inputs: {a: {shape: [4], placements: ["P(sum)"]}, b: {shape: [4], placements: ["P(sum)"]}}
nodes: [{name: c, op: exp, inputs: [a]}, {name: d, op: exp, inputs: [b]}]
"""
    propagate = Propagate()
    first, second = (Reshard(propagate).run(load_spec(spec)).graph for _ in range(2))
    moves = [g.node(n) for g in (first, second) for n in ("c/x", "d/x")]
    assert len({id(m.attrs) for m in moves}) == 4  # the remembered move hands out copies
    moves[0].attrs["placements"] = ("P(sum)",)  # an edit of one node reaches no other
    assert [m.attrs["placements"] for m in moves[1:]] == [("R",)] * 3
    third = Reshard(propagate).run(load_spec(spec)).graph
    assert third.node("c/x").attrs["placements"] == ("R",)
