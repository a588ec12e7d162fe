"""Lowering and `layout-prop run`: determinism, per-rank views, a planted wrong rule."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from layout_prop.core import meta
from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.core.errors import ExecutionError
from layout_prop.kernels import numpy_backend
from layout_prop.core.layout import Layout
from layout_prop.io.loader import load_spec
from layout_prop.passes.lower import Lower
from layout_prop.core.placement import Partial, Replicate, Shard
from layout_prop.core.registry import OpRule, RuleResult, register_op
from layout_prop.runner import execute_global, run_graph
from layout_prop.core.spec import TensorSpec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "rpe"


def test_lowered_json_is_byte_identical_across_runs(capsys):
    spec = str(EXAMPLES / "dp_tp_sp.yaml")
    outs = []
    for _ in range(2):
        assert main(["lower", spec, "--rank", "5", "--json", "--backward"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    data = json.loads(outs[0])
    assert data["rank"] == 5 and data["coords"] == [1, 0, 1]
    x = next(op for op in data["ops"] if op["name"] == "x")
    # rank 5 = (dp 1, tp 0, sp 1) holds x[2:4, 0:2, 8:16, 0:64]
    assert x["global_slices"] == [[2, 4], [0, 2], [8, 16], [0, 64]]
    assert x["local_shapes"] == [[2, 2, 8, 64]]
    reduces = [op for op in data["ops"] if op["kind"] == "collective"]
    assert {(op["op"], op["mesh_axis"]) for op in reduces} == {("all-reduce", "dp"), ("all-reduce", "tp")}
    # rank 5's dp group is {1, 5}, its tp group {5, 7}
    assert {tuple(op["group"]) for op in reduces if op["mesh_axis"] == "dp"} == {(1, 5)}
    assert {tuple(op["group"]) for op in reduces if op["mesh_axis"] == "tp"} == {(5, 7)}


def test_lower_networkx_view_is_a_dag_with_the_program_ops():
    g = analyze(load_spec(EXAMPLES / "dp_sp.yaml"), backward=True, reshard=True).graph
    prog = Lower().run(g).program
    nxg = prog.to_networkx(2)
    assert len(nxg) == len(prog.ops)
    import networkx as nx

    assert nx.is_directed_acyclic_graph(nxg)


def test_lower_refuses_a_graph_with_violations():
    g = analyze(load_spec({
        "mesh": {"shape": [2], "names": ["tp"]},
        "inputs": {"a": {"shape": [4], "placements": ["P(sum)"]}, "b": {"shape": [4], "placements": ["S(0)"]}},
        "nodes": [{"name": "c", "op": "add", "inputs": ["a", "b"]}],
    })).graph
    with pytest.raises(ExecutionError) as info:
        Lower().run(g)
    assert info.value.code == "unresolved-violation" and info.value.node == "c"


def test_run_no_reshard_refuses_with_exit_1(tmp_path, capsys):
    spec = tmp_path / "p.yaml"
    spec.write_text("""
mesh: {shape: [2], names: [tp]}
inputs: {a: {shape: [4, 8], placements: ["P(sum)"]}}
nodes: [{name: c, op: exp, inputs: [a]}]
""")
    assert main(["run", str(spec), "--no-reshard", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["violations"][0]["code"] == "partial-input"
    assert main(["run", str(spec), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and [c["kind"] for c in out["collectives"]] == ["all-reduce"]


# ----------------------------------------------------------------------------- a planted wrong rule

@register_op
class _WrongRowSum(OpRule):
    """Sums over dim 1 and claims the result keeps x's Shard: wrong when x is sharded on dim 1
    (the truth there is P(sum))."""

    name = "test_wrong_row_sum"
    operands = ("x",)

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        ps = [Shard(0) if isinstance(p, Shard) else p for p in x.layout.placements]
        return RuleResult((TensorSpec(x.shape[:1], x.dtype, Layout(x.mesh, ps, 1)),))


@register_op
class _RightRowSum(OpRule):
    name = "test_right_row_sum"
    operands = ("x",)

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        ps = [(Shard(0) if p.dim == 0 else Partial("sum")) if isinstance(p, Shard) else p
              for p in x.layout.placements]
        return RuleResult((TensorSpec(x.shape[:1], x.dtype, Layout(x.mesh, ps, 1)),))


@pytest.fixture
def row_sum_kernels(monkeypatch):
    def row_sum(x):
        return x.sum(axis=1)

    monkeypatch.setitem(numpy_backend.KERNELS, "test_wrong_row_sum", row_sum)
    monkeypatch.setitem(numpy_backend.KERNELS, "test_right_row_sum", row_sum)


ROW_SUM = """
mesh: {shape: [2], names: [tp]}
inputs: {x: {shape: [4, 6], placements: ["S(1)"]}}
nodes: [{name: y, op: OP, inputs: [x]}]
outputs: [y]
"""


def test_run_catches_a_rule_that_claims_shard_where_the_truth_is_partial(row_sum_kernels, tmp_path, capsys):
    spec = tmp_path / "wrong.yaml"
    spec.write_text(ROW_SUM.replace("OP", "test_wrong_row_sum"))
    assert main(["run", str(spec), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False
    assert out["mismatches"] and out["mismatches"][0].startswith("y:")
    spec.write_text(ROW_SUM.replace("OP", "test_right_row_sum"))
    assert main(["run", str(spec), "--json"]) == 0


def test_mismatch_names_the_output_rank_and_index():
    from layout_prop.runner import compare

    mesh_spec = TensorSpec((4,), "float32", Layout(load_spec(ROW_SUM.replace("OP", "add").replace(
        "inputs: [x]", "inputs: [x, x]")).mesh, ["S(0)"], 1))
    got = np.array([0.0, 1.0, 2.0, 30.0], dtype=np.float32)
    ref = np.array([0.0, 1.0, 2.0, 3.0], dtype=np.float32)
    errors, problem = compare("y", got, ref, mesh_spec)
    assert errors["max_abs_err"] == pytest.approx(27.0)
    assert "y:" in problem and "[3]" in problem and "rank 1" in problem


def test_replicated_outputs_that_disagree_are_reported_not_averaged():
    from layout_prop.engines.collectives import assemble

    spec = TensorSpec((3,), "float64", Layout(load_spec(EXAMPLES / "dp_b.yaml").mesh, [Replicate()], 1))
    with pytest.raises(ExecutionError) as info:
        assemble([np.zeros(3), np.ones(3)], spec)
    assert info.value.code == "replica-mismatch"


def test_partial_inputs_and_uneven_shards_run_right():
    spec = {
        "mesh": {"shape": [3, 2], "names": ["dp", "tp"]},
        "inputs": {"a": {"shape": [7, 5], "placements": ["S(0)", "P(sum)"]},
                   "b": {"shape": [7, 5], "placements": ["S(0)", "P(sum)"]},
                   "c": {"shape": [5], "placements": ["R", "R"]}},
        "nodes": [{"name": "s", "op": "add", "inputs": ["a", "b"]},
                  {"name": "t", "op": "mul", "inputs": ["s", "c"]},
                  {"name": "u", "op": "neg", "inputs": ["t"]}],
        "outputs": ["u"],
    }
    a = analyze(load_spec(spec))
    assert a.ok  # add of partials stays partial, times a replicated value stays partial, neg too
    assert a.report()["tensors"]["u"]["placements"] == ["S(0)", "P(sum)"]
    rep = run_graph(load_spec(spec), backward=True, seed=5)
    assert rep.ok, rep.mismatches
    assert set(rep.grads) == {"a", "b", "c"}


def test_input_meta_specs_are_kept_in_lowering():
    g = analyze(load_spec(EXAMPLES / "tp_n.yaml")).graph
    prog = Lower().run(g).program
    assert prog.specs["x"] == g.node("x").meta[meta.SPECS][0]


def test_equal_infinities_and_nans_agree_and_a_nan_against_a_number_does_not():
    from layout_prop.runner import compare

    spec = TensorSpec((3,), "float32", Layout(load_spec(EXAMPLES / "dp_b.yaml").mesh, ["R"], 1))
    ref = np.array([-np.inf, np.nan, 1.0], dtype=np.float32)
    errors, problem = compare("y", ref.copy(), ref, spec)
    assert problem is None and errors["max_abs_err"] == 0.0
    errors, problem = compare("y", np.array([-np.inf, 0.0, 1.0], np.float32), ref, spec)
    assert problem is not None and "[1]" in problem and "expected nan" in problem


def test_execute_global_with_wanted_drops_the_rest_and_keeps_the_values():
    from layout_prop.frontends.generate import llama_spec
    from layout_prop.runner import random_inputs

    g = analyze(load_spec(llama_spec(1)), backward=True).graph
    inputs = random_inputs(g, 3)
    every = execute_global(g, inputs)
    wanted = list(g.outputs)
    some = execute_global(g, inputs, wanted=wanted)
    assert list(some) == wanted
    for value in wanted:
        np.testing.assert_array_equal(some[value], every[value])


def test_execute_global_with_wanted_frees_a_value_after_its_last_use():
    import weakref

    from layout_prop.kernels.numpy_backend import KERNELS

    made = []

    def neg(x):
        out = -x
        made.append(weakref.ref(out))
        return out

    g = load_spec({"mesh": {"shape": [1], "names": ["dp"]}, "inputs": {"a": {"shape": [3]}},
                   "nodes": [{"name": "b", "op": "neg", "inputs": ["a"]},
                             {"name": "c", "op": "neg", "inputs": ["b"]}], "outputs": ["c"]})
    analyze(g)
    out = execute_global(g, {"a": np.arange(3.0)}, kernels={**KERNELS, "neg": neg}, wanted=["c"])
    assert made[0]() is None and made[1]() is out["c"]  # b is gone, c is returned
    made.clear()
    every = execute_global(g, {"a": np.arange(3.0)}, kernels={**KERNELS, "neg": neg})
    assert made[0]() is every["b"]


def test_random_inputs_draw_the_weights_of_products_with_fan_in_scale():
    from layout_prop.runner import random_inputs

    spec = {
        "mesh": {"shape": [2], "names": ["tp"]},
        "inputs": {"x": {"shape": [64, 256], "placements": ["S(0)"]},
                   "w": {"shape": [128, 256], "placements": ["S(0)"]},  # linear weight (out, in): fan-in 256
                   "m": {"shape": [128, 16]},  # matmul rhs (k, n): fan-in 128
                   "e": {"shape": [16, 4]},  # einsum "mk,kj->mj": fan-in 16
                   "g": {"shape": [64, 16], "placements": ["S(1)"]}},  # an addend: unscaled
        "nodes": [{"name": "wr", "op": "redistribute", "inputs": ["w"], "attrs": {"placements": ["R"]}},
                  {"name": "y", "op": "linear", "inputs": ["x", "wr"]},
                  {"name": "z", "op": "matmul", "inputs": ["y", "m"]},
                  {"name": "u", "op": "einsum", "inputs": ["z", "e"], "attrs": {"equation": "mk,kj->mj"}},
                  {"name": "v", "op": "add", "inputs": ["z", "g"]}],
        "outputs": ["u", "v"],
    }
    g = analyze(load_spec(spec), reshard=True).graph
    assert [n.name for n, _ in g.consumers("w")] == ["wr"]  # the scale is looked up through the move
    values = random_inputs(g, 0)
    for name, std in (("x", 1.0), ("w", 256 ** -0.5), ("m", 128 ** -0.5), ("e", 16 ** -0.5), ("g", 1.0)):
        assert abs(values[name].std() / std - 1) < 0.15, name


def test_execute_global_refuses_a_wanted_value_the_graph_does_not_have():
    g = load_spec({"mesh": {"shape": [1], "names": ["dp"]}, "inputs": {"a": {"shape": [3]}},
                   "nodes": [{"name": "b", "op": "neg", "inputs": ["a"]}], "outputs": ["b"]})
    analyze(g)
    with pytest.raises(ExecutionError) as info:
        execute_global(g, {"a": np.arange(3.0)}, wanted=["c"])
    assert info.value.code == "missing-output" and "'c'" in info.value.message and "b" in info.value.hint
