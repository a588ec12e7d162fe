"""The expand pass (passes/expand.py): cross_entropy, topk and cumsum on an input sharded along the dim they
work on are written as their sharded forms by ``check --reshard`` and ``run``, which move a few numbers per
row instead of the input; with the dim whole, or without ``--reshard``, nothing is expanded."""

from __future__ import annotations

import json

import numpy as np
import pytest

from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.core.errors import OpError
from layout_prop.core.registry import get_rule
from layout_prop.io.loader import load_spec
from layout_prop.passes import expand as expand_module
from layout_prop.passes.expand import EXPANDED_FROM, Expand
from layout_prop.runner import execute_global, random_inputs, run_graph


def cli(tmp_path, capsys, spec: dict, *args: str) -> tuple[int, str, str]:
    """``layout-prop COMMAND spec.json ARGS`` in this process: (exit code, stdout, stderr)."""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    code = main([args[0], str(path), *args[1:]])
    out, err = capsys.readouterr()
    return code, out, err


def ce_spec(mesh, logits_ps, target_ps, shape=(4, 16), classes=512, **attrs) -> dict:
    return {"mesh": {"shape": list(mesh), "names": ["dp", "tp"][-len(mesh):]},
            "inputs": {"logits": {"shape": [*shape, classes], "placements": list(logits_ps)},
                       "target": {"shape": list(shape), "dtype": "int64", "placements": list(target_ps)}},
            "nodes": [{"name": "loss", "op": "cross_entropy", "inputs": ["logits", "target"], "attrs": attrs}],
            "outputs": ["loss"]}


def topk_spec(mesh, placements, shape, **attrs) -> dict:
    return {"mesh": {"shape": list(mesh), "names": ["dp", "tp"][-len(mesh):]},
            "inputs": {"x": {"shape": list(shape), "placements": list(placements)}},
            "nodes": [{"name": "top", "op": "topk", "inputs": ["x"], "attrs": attrs}],
            "outputs": ["top:0", "top:1"]}


def cumsum_spec(mesh, placements, shape, dtype="float32", **attrs) -> dict:
    return {"mesh": {"shape": list(mesh), "names": ["dp", "sp"][-len(mesh):]},
            "inputs": {"x": {"shape": list(shape), "placements": list(placements), "dtype": dtype}},
            "nodes": [{"name": "y", "op": "cumsum", "inputs": ["x"], "attrs": attrs}],
            "outputs": ["y"]}


def moves(report: dict) -> list[tuple[str, list[str]]]:
    return [(r["input"], [s["kind"] for s in r["steps"]]) for r in report["redistributions"]]


def check_json(tmp_path, capsys, spec: dict) -> dict:
    code, out, err = cli(tmp_path, capsys, spec, "check", "--reshard", "--backward", "--json")
    assert code == 0, err
    return json.loads(out)


def run_ok(spec: dict, seed: int = 0):
    report = run_graph(load_spec(spec), backward=True, seed=seed, verify=True)
    assert report.ok, report.mismatches or report.violations
    return report


# ------------------------------------------------------------------------ cross entropy
def test_cross_entropy_on_vocab_sharded_logits_moves_no_logits(tmp_path, capsys):
    """Logits [4, 16, 512], tokens on dp and classes on tp: the single cross_entropy node is written as
    max, cross_entropy_parts and cross_entropy_combine; the moves are the all-reduces of the max (forward and
    backward) and of the parts, and the mean's gather of the integer target, never the logits."""
    spec = ce_spec((2, 2), ["S(0)", "S(2)"], ["S(0)", "R"], ignore_index=2, label_smoothing=0.1)
    report = check_json(tmp_path, capsys, spec)
    assert report["ok"]
    assert {"loss/max", "loss/parts", "loss", "grad:logits"} <= set(report["tensors"])
    assert report["tensors"]["loss/parts"]["placements"] == ["S(0)", "P(sum)"]
    found = moves(report)
    assert not [m for m in found if m[0] == "logits" or "all-to-all" in m[1]], found
    assert [m for m in found if "all-gather" in m[1]] == [("target", ["all-gather"])]
    assert ("loss/max", ["all-reduce"]) in found and ("loss/parts", ["all-reduce"]) in found
    assert report["total_bytes_per_rank"] == 896  # 128 + 384 + 256 forward, 128 for the max's cotangent
    assert any(n.startswith("expand: loss (cross_entropy) written as loss/max (max), loss/parts "
                            "(cross_entropy_parts), loss (cross_entropy_combine): 768 bytes per rank of "
                            "redistribution instead of ") for n in report["notes"]), report["notes"]


@pytest.mark.parametrize("mesh, logits_ps, target_ps, reduction", [
    ((2, 2), ["S(0)", "S(2)"], ["S(0)", "R"], "mean"),
    ((4,), ["S(2)"], ["R"], "none"),  # 100 classes on 4 ranks
    ((2, 2), ["S(2)", "S(2)"], ["R", "R"], "sum"),  # the classes cut by both axes
])
def test_expanded_cross_entropy_runs_like_one_device(mesh, logits_ps, target_ps, reduction):
    spec = ce_spec(mesh, logits_ps, target_ps, shape=(3, 5), classes=100, reduction=reduction, ignore_index=4,
                   label_smoothing=0.2)
    report = run_ok(spec, seed=3)
    assert set(report.grads) == {"logits"}
    assert any(n.startswith("expand: loss (cross_entropy)") for n in report.notes), report.notes
    assert not [c for c in report.collectives if c["kind"] in ("all-to-all", "all-gather") and
                c["node"].endswith("logits")], report.collectives


def test_cross_entropy_keeps_its_move_where_the_expansion_costs_more():
    """9 classes on 4 ranks: the all-to-all of the small logits moves fewer bytes than the two all-reduces."""
    spec = ce_spec((4,), ["S(2)"], ["R"], shape=(5, 3), classes=9)
    report = run_ok(spec)
    assert not [n for n in report.notes if n.startswith("expand:")], report.notes
    assert [(c["kind"], c["node"]) for c in report.collectives] == [("all-to-all", "loss/logits"),
                                                                    ("all-to-all", "grad/logits")]


# ------------------------------------------------------------------------ topk
def test_topk_along_a_sharded_dim_moves_candidates_only(tmp_path, capsys):
    """x [6, 40], its 40 columns on 4 ranks: topk_candidates (2 per rank) then topk_merge; x never moves."""
    report = check_json(tmp_path, capsys, topk_spec((4,), ["S(1)"], (6, 40), k=2))
    assert report["ok"]
    assert report["tensors"]["top/candidates:0"]["shape"] == [6, 8]
    assert report["tensors"]["top:1"]["dtype"] == "int64"
    found = moves(report)
    assert found and not [m for m in found if m[0] == "x" or m[0] == "grad/x"], found
    assert all(r["bytes_per_rank"] <= 96 for r in report["redistributions"]), report["redistributions"]
    assert any("instead of 720" in n for n in report["notes"]), report["notes"]


@pytest.mark.parametrize("mesh, placements, shape, attrs", [
    ((4,), ["S(1)"], (6, 40), {"k": 2}),
    ((2, 2), ["S(0)", "S(1)"], (5, 61), {"k": 5, "largest": False}),  # uneven: 31 + 30 columns
    ((2, 2), ["S(1)", "S(0)"], (40, 3), {"k": 3, "dim": 0, "sorted": False}),
])
def test_expanded_topk_runs_like_one_device(mesh, placements, shape, attrs):
    report = run_ok(topk_spec(mesh, placements, shape, **attrs), seed=2)
    assert any(n.startswith("expand: top (topk)") for n in report.notes), report.notes
    assert report.outputs["top:1"]["max_abs_err"] == 0 and report.outputs["top:0"]["max_abs_err"] == 0
    assert report.grads["x"]["max_abs_err"] == 0
    assert not [c for c in report.collectives if c["kind"] == "all-gather" and c["bytes_per_rank"] >= 4 * shape[0]
                * shape[1] // 4], report.collectives


# ------------------------------------------------------------------------ cumsum
def test_cumsum_along_a_sharded_dim_moves_the_totals_only(tmp_path, capsys):
    report = check_json(tmp_path, capsys, cumsum_spec((4,), ["S(1)"], (3, 40), dim=1))
    assert report["ok"]
    assert report["tensors"]["y/totals"]["shape"] == [3, 4]
    assert report["tensors"]["y"]["placements"] == ["S(1)"]  # the result keeps x's layout
    found = moves(report)
    assert [m for m in found if "all-gather" in m[1]] == [("y/totals", ["all-gather"]),
                                                          ("grad/y/chunk_sum2", ["all-gather"])], found
    assert not [m for m in found if m[0] == "x"], found
    assert report["total_bytes_per_rank"] == 72
    assert any("instead of 360" in n for n in report["notes"]), report["notes"]


@pytest.mark.parametrize("attrs", [{}, {"exclusive": True}, {"reverse": True}, {"exclusive": True, "reverse": True}])
def test_expanded_cumsum_runs_like_one_device(attrs):
    report = run_ok(cumsum_spec((2, 2), ["S(0)", "S(1)"], (5, 30), dim=1, **attrs), seed=1)
    assert any(n.startswith("expand: y (cumsum)") for n in report.notes), report.notes
    assert report.grads["x"]["max_abs_err"] < 1e-5


def test_expanded_cumsum_of_integers_is_exact():
    """int32 accumulates in int64, as cumsum: the same dtype and the same numbers (10 on 4: 3, 3, 3, 1)."""
    spec = cumsum_spec((4,), ["S(1)"], (3, 10), dtype="int32", dim=1, reverse=True)
    graph = load_spec(spec)
    analysis = analyze(graph, reshard=True, verify=True)
    assert [n.op for n in analysis.graph.nodes if n.op != "redistribute"] == ["input", "chunk_sum", "cumsum",
                                                                               "chunk_cumsum"]
    assert analysis.tensors()["y"]["dtype"] == "int64"
    report = run_graph(load_spec(spec), seed=0)
    assert report.ok and report.outputs["y"]["max_abs_err"] == 0
    x = random_inputs(graph, 0)["x"]
    np.testing.assert_array_equal(execute_global(graph, {"x": x})["y"], np.cumsum(x[:, ::-1], axis=1)[:, ::-1])


# ------------------------------------------------------------------------ nothing to expand
@pytest.mark.parametrize("spec", [  # each rule asks a move, but not of a dim it works along: its hook declines
    ce_spec((2, 2), ["S(0)", "S(1)"], ["S(1)", "S(1)"]),  # tokens sharded, classes whole; the target moves
    topk_spec((2, 2), ["S(0)", "P(sum)"], (6, 40), k=2),  # the partial sum is reduced
    cumsum_spec((2, 2), ["P(max)", "S(1)"], (4, 40), dim=0),  # sharded along dim 1, scanned along dim 0
], ids=["cross_entropy", "topk", "cumsum"])
def test_a_dim_that_is_not_sharded_expands_nothing(spec):
    violations = analyze(load_spec(spec)).check.violations
    assert violations and all(v.fixable for v in violations)  # the hook is asked
    graph = load_spec(spec)
    ops = [n.op for n in graph.nodes]
    analysis = analyze(graph, reshard=True, backward=True, verify=True)
    assert not [n for n in analysis.notes if n.startswith("expand:")], analysis.notes
    forward = [n.op for n in analysis.graph.nodes if not n.name.startswith(("grad/", "cotangent/"))
               and n.op != "redistribute"]
    assert forward == ops
    assert not any(EXPANDED_FROM in n.meta for n in analysis.graph.nodes)


def test_without_reshard_the_plain_violation_is_reported(tmp_path, capsys):
    code, out, _ = cli(tmp_path, capsys, topk_spec((4,), ["S(1)"], (6, 40), k=2), "check", "--json")
    report = json.loads(out)
    assert code == 1 and [v["code"] for v in report["violations"]] == ["sharded-order-dim"]
    assert "top/candidates:0" not in report["tensors"]


# ------------------------------------------------------------------------ the hook's contract
def test_a_hook_that_does_not_end_with_result_is_a_bad_rule(monkeypatch):
    real = get_rule("topk")

    class Unfinished(type(real)):
        def expand(self, b, inputs, attrs, specs):
            b.op("topk_candidates", [inputs[0]], {"k": attrs["k"], "chunks": 4}, num_outputs=2)
            return ()

    bad = Unfinished()
    monkeypatch.setattr(expand_module, "get_rule", lambda op, node=None: bad if op == "topk" else get_rule(op))
    with pytest.raises(OpError) as err:
        Expand().run(load_spec(topk_spec((4,), ["S(1)"], (6, 40), k=2)))
    assert err.value.code == "bad-rule" and "did not end its subgraph with b.result" in str(err.value)


def test_the_consumers_of_an_expanded_node_see_its_layout():
    """A per-token loss on 4 ranks: the plain rule moves the classes' axis to a token dim (loss S(1)); the
    expansion leaves the loss whole on every rank (R), and the node reading it is propagated again."""
    spec = ce_spec((4,), ["S(2)"], ["R"], shape=(3, 5), classes=100, reduction="none")
    spec["nodes"].append({"name": "scaled", "op": "mul", "inputs": ["loss", "loss"]})
    spec["outputs"] = ["scaled"]
    plain = analyze(load_spec(spec))
    assert plain.tensors()["scaled"]["placements"] == ["S(1)"]
    graph = load_spec(spec)
    expanded = analyze(graph, reshard=True, backward=True, verify=True)
    assert expanded.tensors()["scaled"]["placements"] == ["R"]
    assert graph.node("scaled").meta["specs"][0].layout.placement_strs() == ["S(1)"]  # the given graph unchanged
    assert set(run_ok(spec).grads) == {"logits"}  # run --backward equals one device


def _with_hook(monkeypatch, hook):
    """``topk``'s rule with ``hook`` as its expand, as the pass finds it."""
    real = get_rule("topk")
    rule = type("Hooked", (type(real),), {"expand": hook})()
    monkeypatch.setattr(expand_module, "get_rule", lambda op, node=None: rule if op == "topk" else get_rule(op))


def test_a_hook_whose_result_has_another_shape_is_a_bad_rule(monkeypatch):
    def hook(self, b, inputs, attrs, specs):
        values, indices = b.op("topk_candidates", [inputs[0]], {"k": attrs["k"], "chunks": 4}, num_outputs=2)
        return b.result("topk_merge", [values, indices], {"k": 1})  # one element where the node keeps two

    _with_hook(monkeypatch, hook)
    with pytest.raises(OpError) as err:
        Expand().run(load_spec(topk_spec((4,), ["S(1)"], (6, 40), k=2)))
    assert err.value.code == "bad-rule" and "gives top:0 as float32[6, 1], not the node's float32[6, 2]" in \
        str(err.value)


def test_a_hook_whose_ops_refuse_the_inputs_leaves_the_node_with_a_note(monkeypatch):
    def hook(self, b, inputs, attrs, specs):
        return b.result("topk_merge", [inputs[0], inputs[0]], {"k": 99})  # k larger than the dim: bad-attr

    _with_hook(monkeypatch, hook)
    graph = load_spec(topk_spec((4,), ["S(1)"], (6, 40), k=2))
    result = Expand().run(graph)
    assert result.graph is graph and not result.expanded
    assert result.notes == ["expand: top (topk) kept as it is: its expansion failed: bad-attr at attrs.k, node 'top': "
                            "topk_merge: k=99 is larger than dim 1 of values (size 40) (hint: give k an integer in "
                            "0..40)"]


# ------------------------------------------------------------------ a forced expansion whose moves cannot be planned
def _ring_on_a_strided_sequence() -> dict:
    """Ring attention on q, k, v whose sequence is cut by a strided shard on a and a shard on cp: the ring's
    first block reads q with the strided axis gathered, (R, S(2)) (its own move), and the plain rule gathers
    k and v whole, (R, R)."""
    inputs = {name: {"shape": [1, 1, 8, 2], "placements": ["_S(2,2)", "S(2)"]} for name in "qkv"}
    return {"mesh": {"shape": [2, 2], "names": ["a", "cp"]}, "inputs": inputs,
            "nodes": [{"name": "attn", "op": "scaled_dot_product_attention", "inputs": ["q", "k", "v"],
                       "attrs": {"causal": True, "context_parallel": "ring"}}],
            "outputs": ["attn"]}


def _unplannable(monkeypatch, target: list[str]) -> None:
    """The expand pass cannot plan a move to the layout ``target`` (no input of the built-in ring reaches this:
    the ring's hooks check what it takes, so its moves are always plannable; tried: q, k, v with every
    placement of R, P(sum), P(max), shards and strided shards on a second and a third mesh axis, uneven
    sizes, and flash_attention_score in its four layouts)."""
    from layout_prop.core.errors import LayoutError
    from layout_prop.core.redistribute import plan_redistribution

    def plan(src, dst):
        if dst.placement_strs() == target:
            raise LayoutError("no-redistribution", f"cannot redistribute to {dst} here", hint="the test says so")
        return plan_redistribution(src, dst)

    monkeypatch.setattr(expand_module, "plan_redistribution", plan)


def test_a_forced_expansion_whose_own_moves_cannot_be_planned_is_not_kept_and_says_why(monkeypatch):
    """It said '... None bytes per rank of redistribution instead of 144' and kept a ring the reshard pass
    could not resolve."""
    _unplannable(monkeypatch, ["R", "S(2)"])
    result = Expand().run(load_spec(_ring_on_a_strided_sequence()))
    assert not result.expanded and not result.forced
    assert result.notes == ["expand: attn (scaled_dot_product_attention) kept as it is, though "
                            "context_parallel='ring' on mesh axis 'cp' asks its expansion: the moves of attn/block0 "
                            "(attention_block) cannot be planned: no-redistribution: cannot redistribute to "
                            "(R, S(2)) here (hint: the test says so)"]


def test_a_forced_expansion_whose_plain_moves_cannot_be_planned_says_so(monkeypatch):
    """It said '208 bytes per rank of redistribution instead of None'."""
    _unplannable(monkeypatch, ["R", "R"])
    result = Expand().run(load_spec(_ring_on_a_strided_sequence()))
    assert list(result.expanded) == ["attn"]
    assert result.notes[0].endswith(": 208 bytes per rank of redistribution; the plain rule's moves cannot be "
                                    "planned (context_parallel='ring' on mesh axis 'cp' asks it)"), result.notes
    assert "None" not in result.notes[0]
