"""The linalg family: matmul / batch_matmul / linear / einsum, embedding, sum / mean / max.

- rule unit tests with expected layouts written by hand (Megatron column-parallel,
  row-parallel, sequence-parallel, vocabulary-parallel cases);
- every violation code, its message (operand, dim and letter, mesh axis, values) and hint;
- the numpy backward (kernels and vjp rules) against central finite differences in float64;
- end-to-end runs of the Megatron patterns, forward and backward, through propagate,
  reshard, backward, lower and the simulator, against one device.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from layout_prop import DeviceMesh, Layout, TensorSpec
from layout_prop.core import meta
from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.core.errors import LayoutPropError
from layout_prop.kernels import linalg_numpy as K
from layout_prop.io.loader import load_spec
from layout_prop.passes.backward import Backward
from layout_prop.passes.propagate import value_spec
from layout_prop.core.registry import get_rule
from layout_prop.runner import execute_global, run_graph

TP = DeviceMesh((2,), ("tp",))
DP_TP = DeviceMesh((2, 2), ("dp", "tp"))


def spec(mesh: DeviceMesh, shape, placements, dtype: str = "float32") -> TensorSpec:
    return TensorSpec(shape, dtype, Layout(mesh, placements, len(shape)))


def infer(op: str, *specs: TensorSpec, **attrs):
    return get_rule(op).infer_layout(tuple(specs), attrs)


def graph_spec(mesh_shape, names, inputs: dict, nodes: list, outputs=None) -> dict:
    out = {"mesh": {"shape": list(mesh_shape), "names": list(names)}, "inputs": inputs, "nodes": nodes}
    if outputs is not None:
        out["outputs"] = outputs
    return out


def one_node(mesh_shape, names, inputs: dict, op: str, attrs=None) -> dict:
    return graph_spec(mesh_shape, names, inputs, [{"name": "y", "op": op, "inputs": list(inputs),
                                                  "attrs": attrs or {}}])


def layouts(res) -> list[str]:
    return [str(o.layout) for o in res.outputs]


def want_strs(res) -> list[str]:
    return [str(w) for w in res.wants]


# ============================================================================ names
@pytest.mark.parametrize("alias, name", [
    ("MatMul", "matmul"), ("aten.mm", "matmul"), ("BatchMatMul", "batch_matmul"), ("aten.bmm", "batch_matmul"),
    ("aten.matmul", "batch_matmul"), ("Linear", "linear"), ("Dense", "linear"), ("aten.linear", "linear"),
    ("Einsum", "einsum"), ("aten.einsum", "einsum"), ("Embedding", "embedding"), ("ReduceSum", "sum"),
    ("aten.sum", "sum"), ("ReduceMean", "mean"), ("aten.mean", "mean"), ("ReduceMax", "max"), ("aten.amax", "max"),
])
def test_aliases_resolve_to_the_canonical_op(alias, name):
    assert get_rule(alias).name == name


# ============================================================================ Megatron linear rules
def test_column_parallel_linear_shards_the_output_features():
    x = spec(TP, (4, 8, 16), ["R"])
    w = spec(TP, (32, 16), ["S(0)"])
    b = spec(TP, (32,), ["S(0)"])
    res = infer("linear", x, w, b)
    assert [str(o) for o in res.outputs] == ["float32[4, 8, 32] (S(2))"]
    assert res.violations == () and want_strs(res) == ["None", "None", "None"]


def test_column_parallel_linear_on_a_dp_tp_mesh():
    res = infer("linear", spec(DP_TP, (4, 8, 16), ["S(0)", "R"]), spec(DP_TP, (32, 16), ["R", "S(0)"]))
    assert layouts(res) == ["(S(0), S(2))"] and res.violations == ()


def test_row_parallel_linear_gives_a_partial_sum_and_adds_a_replicated_bias_once():
    x = spec(DP_TP, (4, 8, 32), ["S(0)", "S(2)"])
    w = spec(DP_TP, (16, 32), ["R", "S(1)"])
    b = spec(DP_TP, (16,), ["R", "R"])
    res = infer("linear", x, w, b)
    assert layouts(res) == ["(S(0), P(sum))"] and res.violations == ()
    rule = get_rule("linear")
    # ranks (dp, tp) = (0,0), (0,1), (1,0), (1,1): the bias is added at tp coordinate 0 only
    assert [rule.localize({}, (x, w, b), res.outputs, r)["add_bias"] for r in range(4)] == [True, False, True, False]


def test_row_parallel_linear_with_a_partial_bias_adds_every_term():
    x, w = spec(TP, (4, 32), ["S(1)"]), spec(TP, (16, 32), ["S(1)"])
    b = spec(TP, (16,), ["P(sum)"])
    res = infer("linear", x, w, b)
    assert layouts(res) == ["(P(sum))"] and res.violations == ()
    assert [get_rule("linear").localize({}, (x, w, b), res.outputs, r)["add_bias"] for r in range(2)] == [True, True]


def test_linear_without_bias_has_no_bias_attr():
    x, w = spec(TP, (4, 32), ["S(1)"]), spec(TP, (16, 32), ["S(1)"])
    res = infer("linear", x, w)
    assert get_rule("linear").localize({}, (x, w), res.outputs, 1) == {}


SP_SHAPES = {"x": [2, 4, 8], "w": [32, 8]}  # the weight (256 elements) is larger than x (64)


def test_sequence_parallel_input_with_column_parallel_weight_is_a_documented_violation():
    x = spec(TP, SP_SHAPES["x"], ["S(1)"])
    w = spec(TP, SP_SHAPES["w"], ["S(0)"])
    res = infer("linear", x, w)
    assert layouts(res) == ["(S(2))"]  # the larger weight stays in place
    assert want_strs(res) == ["(R)", "None"]
    (v,) = res.violations
    assert (v.code, v.operand, v.fixable) == ("sharding-mismatch", "x", True)
    assert v.message == ("x dim 1 (letter 'b', size 4) is sharded on mesh axis 'tp' but weight dim 0 (letter 'o', "
                         "size 32) is sharded there; in linear 'abi,oi->abo' a mesh axis must shard the same letter in "
                         "every operand that holds it (x is (S(1)); weight is (S(0)))")
    assert v.hint.startswith("all-gather x on 'tp' (--reshard does: weight is at least as large, so it stays in place)")


def sp_graph() -> dict:
    return one_node((2,), ("tp",), {"x": {"shape": SP_SHAPES["x"], "placements": ["S(1)"]},
                                    "w": {"shape": SP_SHAPES["w"], "placements": ["S(0)"]}}, "linear")


def test_sequence_parallel_reshard_inserts_an_all_gather_of_x():
    a = analyze(load_spec(sp_graph()), reshard=True)
    assert a.ok
    moves = [(r.input, [(s.kind, a.graph.mesh.names[s.mesh_axis]) for s in r.plan.steps]) for r in
             a.check.redistributions if r.explicit]
    assert moves == [("x", [("all-gather", "tp")])]
    assert str(value_spec(a.graph, "y").layout) == "(S(2))"


def test_sequence_parallel_check_cli(tmp_path, capsys):
    path = tmp_path / "sp.json"
    path.write_text(json.dumps(sp_graph()))
    assert main(["check", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [(v["code"], v["input"], v["operand"]) for v in report["violations"]] == [("sharding-mismatch", "x", "x")]
    assert "--reshard inserts all-gather on tp" in report["violations"][0]["hint"]
    assert main(["check", str(path), "--reshard", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tensors"]["y"]["placements"] == ["S(2)"]
    assert [s["kind"] for r in report["redistributions"] for s in r["steps"]] == ["all-gather"]


def test_sequence_parallel_with_a_larger_input_gathers_the_weight_instead():
    x = spec(TP, (8, 64, 8), ["S(1)"])  # 4096 elements against the weight's 256
    w = spec(TP, (32, 8), ["S(0)"])
    res = infer("linear", x, w)
    assert layouts(res) == ["(S(1))"] and want_strs(res) == ["None", "(R)"]
    assert [(v.code, v.operand) for v in res.violations] == [("sharding-mismatch", "weight")]


# ============================================================================ matmul / batch_matmul / einsum rules
def test_sharded_contracting_dim_gives_a_partial_sum_and_slices_the_replicated_operand():
    res = infer("matmul", spec(TP, (6, 4), ["S(1)"]), spec(TP, (4, 5), ["R"]))
    assert layouts(res) == ["(P(sum))"] and want_strs(res) == ["None", "(S(0))"] and res.violations == ()


def test_matmul_transpose_b_shards_the_output_columns():
    res = infer("MatMul", spec(TP, (6, 4), ["R"]), spec(TP, (5, 4), ["S(0)"]), transpose_b=True)
    assert [str(o) for o in res.outputs] == ["float32[6, 5] (S(1))"] and res.violations == ()


def test_matmul_free_output_letters_keep_their_shards_on_two_axes():
    res = infer("matmul", spec(DP_TP, (6, 4), ["S(0)", "R"]), spec(DP_TP, (4, 5), ["R", "S(1)"]))
    assert layouts(res) == ["(S(0), S(1))"] and res.violations == ()


def test_a_letter_sharded_on_two_mesh_axes_must_be_sharded_alike():
    x = spec(DP_TP, (8, 4), ["S(1)", "S(1)"])
    res = infer("matmul", x, spec(DP_TP, (4, 5), ["R", "R"]))
    assert layouts(res) == ["(P(sum), P(sum))"] and want_strs(res) == ["None", "(S(0), S(0))"]


def test_batch_matmul_batch_letters_shard_together():
    res = infer("batch_matmul", spec(TP, (4, 2, 3, 5), ["S(1)"]), spec(TP, (2, 5, 3), ["R"]))
    assert [str(o) for o in res.outputs] == ["float32[4, 2, 3, 3] (S(1))"]
    assert want_strs(res) == ["None", "(S(0))"] and res.violations == ()


def test_batch_matmul_broadcast_batch_dims_stay_replicated():
    # x (3, 1, 2, 4) @ w (5, 4, 3): batch (3, 1) against (5,) gives (3, 5); x's size-1 batch dim broadcasts
    res = infer("batch_matmul", spec(DP_TP, (3, 1, 2, 4), ["S(0)", "R"]), spec(DP_TP, (5, 4, 3), ["R", "S(0)"]))
    assert [str(o) for o in res.outputs] == ["float32[3, 5, 2, 3] (S(0), S(1))"]
    assert res.violations == () and want_strs(res) == ["None", "None"]


def test_batch_matmul_mismatched_batch_shards():
    res = infer("bmm", spec(TP, (4, 3, 5), ["S(0)"]), spec(TP, (4, 5, 2), ["S(2)"]))
    # x and w are 60 and 40 elements: w moves; the output keeps x's batch shard
    assert layouts(res) == ["(S(0))"] and want_strs(res) == ["None", "(S(0))"]
    assert [(v.code, v.operand) for v in res.violations] == [("sharding-mismatch", "w")]


def test_generic_einsum_three_operands():
    a, b, c = spec(TP, (3, 4), ["R"]), spec(TP, (4, 6), ["S(1)"]), spec(TP, (6, 2), ["R"])
    res = infer("einsum", a, b, c, equation="ab,bc,cd->ad")
    assert layouts(res) == ["(P(sum))"] and want_strs(res) == ["None", "None", "(S(0))"]


@pytest.mark.parametrize("x_p, w_p, out", [("P(sum)", "R", "(P(sum))"), ("P(avg)", "R", "(P(avg))"),
                                           ("R", "P(sum)", "(P(sum))")])
def test_one_partial_operand_with_the_other_replicated_passes_through(x_p, w_p, out):
    res = infer("matmul", spec(TP, (4, 8), [x_p]), spec(TP, (8, 6), [w_p]))
    assert layouts(res) == [out] and res.violations == ()


def test_two_partial_operands_reduce_the_cheaper_one():
    res = infer("matmul", spec(TP, (4, 8), ["P(sum)"]), spec(TP, (8, 6), ["P(sum)"]))
    assert layouts(res) == ["(P(sum))"] and want_strs(res) == ["(R)", "None"]
    assert [(v.code, v.operand) for v in res.violations] == [("partial-input", "x")]


def test_partial_beside_a_sharded_operand_takes_the_cheaper_move():
    small_partial = infer("matmul", spec(TP, (2, 8), ["P(sum)"]), spec(TP, (8, 6), ["S(1)"]))
    assert layouts(small_partial) == ["(S(1))"] and want_strs(small_partial) == ["(R)", "None"]
    assert [v.code for v in small_partial.violations] == ["partial-input"]
    big_partial = infer("matmul", spec(TP, (40, 8), ["P(sum)"]), spec(TP, (8, 6), ["S(1)"]))
    assert layouts(big_partial) == ["(P(sum))"] and want_strs(big_partial) == ["None", "(R)"]
    assert [v.code for v in big_partial.violations] == ["sharding-mismatch"]


def test_bias_partial_needs_a_same_partial_product():
    res = infer("linear", spec(TP, (4, 8), ["R"]), spec(TP, (6, 8), ["S(0)"]), spec(TP, (6,), ["P(sum)"]))
    assert layouts(res) == ["(S(1))"] and want_strs(res) == ["None", "None", "(S(0))"]
    assert [(v.code, v.operand) for v in res.violations] == [("partial-input", "bias")]


def test_linear_rejects_a_fourth_input():
    with pytest.raises(LayoutPropError) as err:
        load_spec(graph_spec((2,), ("tp",), {"x": {"shape": [2, 3]}, "w": {"shape": [4, 3]}, "b": {"shape": [4]},
                                             "c": {"shape": [4]}},
                             [{"name": "y", "op": "linear", "inputs": ["x", "w", "b", "c"]}]))
    assert err.value.code == "bad-arity" and "[x, weight, bias?], got 4" in err.value.message
    assert err.value.path == "nodes[0].inputs"


def test_linear_arity_two_and_three_pass_lint():
    for inputs in (["x", "w"], ["x", "w", "b"]):
        g = load_spec(graph_spec((2,), ("tp",), {"x": {"shape": [2, 3]}, "w": {"shape": [4, 3]}, "b": {"shape": [4]}},
                                 [{"name": "y", "op": "linear", "inputs": inputs}]))
        g.lint()


# ============================================================================ embedding rules
def test_vocab_parallel_embedding_is_a_partial_sum_with_rank_offsets():
    ids, table = spec(TP, (4, 6), ["R"], "int64"), spec(TP, (7, 8), ["S(0)"])
    res = infer("embedding", ids, table)
    assert [str(o) for o in res.outputs] == ["float32[4, 6, 8] (P(sum))"] and res.violations == ()
    # 7 rows on 2 ranks: chunks [0, 4) and [4, 7)
    assert [get_rule("embedding").localize({}, (ids, table), res.outputs, r) for r in range(2)] == [
        {"vocab_start": 0}, {"vocab_start": 4}]


def test_hidden_sharded_table_shards_the_last_output_dim():
    res = infer("embedding", spec(TP, (4, 6), ["R"], "int32"), spec(TP, (7, 8), ["S(1)"]))
    assert layouts(res) == ["(S(2))"] and res.violations == ()


def test_sharded_ids_shard_the_output_and_combine_with_a_vocab_parallel_table():
    res = infer("embedding", spec(DP_TP, (4, 6), ["S(0)", "R"], "int64"), spec(DP_TP, (7, 8), ["R", "S(0)"]))
    assert layouts(res) == ["(S(0), P(sum))"] and res.violations == ()


def test_partial_table_with_replicated_ids_passes_through():
    res = infer("embedding", spec(TP, (4, 6), ["R"], "int64"), spec(TP, (7, 8), ["P(avg)"]))
    assert layouts(res) == ["(P(avg))"] and res.violations == ()


def test_ids_and_vocab_sharded_on_one_axis_keep_the_larger_table():
    res = infer("embedding", spec(TP, (4, 6), ["S(1)"], "int64"), spec(TP, (50, 8), ["S(0)"]))
    assert layouts(res) == ["(P(sum))"] and want_strs(res) == ["(R)", "None"]
    assert [(v.code, v.operand) for v in res.violations] == [("sharding-mismatch", "ids")]


def embedding_grad_layout(ids_p, table_p, mesh_shape=(2,), names=("tp",)) -> str:
    g = load_spec(one_node(mesh_shape, names, {
        "ids": {"shape": [4, 6], "dtype": "int64", "placements": ids_p, "requires_grad": False},
        "table": {"shape": [7, 8], "placements": table_p}}, "embedding"))
    a = analyze(g, backward=True)
    assert a.ok
    (node,) = [n for n in a.graph.nodes if n.op == "embedding_grad"]
    return str(node.meta[meta.SPECS][0].layout)


@pytest.mark.parametrize("ids_p, table_p, expected", [
    (["R"], ["S(0)"], "(S(0))"),  # each rank scatters only its vocabulary rows
    (["R"], ["S(1)"], "(S(1))"),  # hidden-sharded like dy
    (["S(0)"], ["R"], "(P(sum))"),  # each rank scatters only its ids
    (["R"], ["R"], "(R)"),
])
def test_embedding_gradient_layouts(ids_p, table_p, expected):
    assert embedding_grad_layout(ids_p, table_p) == expected


def test_embedding_ids_get_no_gradient_even_when_asked():
    g = load_spec(one_node((2,), ("tp",), {"ids": {"shape": [4, 6], "dtype": "int64"},
                                           "table": {"shape": [7, 8], "placements": ["S(0)"]}}, "embedding"))
    rep = run_graph(g, backward=True, seed=3)
    assert rep.ok and set(rep.grads) == {"table"}


# ============================================================================ reduction rules
X3 = spec(DP_TP, (4, 6, 8), ["S(0)", "S(2)"])


@pytest.mark.parametrize("op, keepdim, expected", [
    ("sum", False, "float32[8] (P(sum), S(0))"),
    ("sum", True, "float32[1, 1, 8] (P(sum), S(2))"),
    ("mean", False, "float32[8] (P(sum), S(0))"),
    ("max", False, "float32[8] (P(max), S(0))"),
])
def test_sharded_reduced_dims_become_partial_and_kept_dims_are_renumbered(op, keepdim, expected):
    res = infer(op, X3, dims=[0, 1], keepdim=keepdim)
    assert [str(o) for o in res.outputs] == [expected] and res.violations == ()


def test_mean_gets_the_global_count_on_every_rank():
    x = spec(DeviceMesh((4,), ("sp",)), (2, 7, 3), ["S(1)"])
    res = infer("mean", x, dims=[1])
    # 7 on 4 ranks gives pieces of 2, 2, 2, 1: every rank divides by 7, not by its piece
    assert [x.local_shape(r)[1] for r in range(4)] == [2, 2, 2, 1]
    assert [get_rule("mean").localize({"dims": [1]}, (x,), res.outputs, r)["count"] for r in range(4)] == [7] * 4


@pytest.mark.parametrize("op, partial, expected", [
    ("sum", "P(sum)", "(P(sum))"), ("sum", "P(avg)", "(P(avg))"), ("mean", "P(sum)", "(P(sum))"),
    ("mean", "P(avg)", "(P(avg))"), ("max", "P(max)", "(P(max))"),
])
def test_partial_inputs_that_pass_through_reductions(op, partial, expected):
    res = infer(op, spec(TP, (4, 6), [partial]), dims=[1])
    assert layouts(res) == [expected] and res.violations == ()


@pytest.mark.parametrize("op, partial", [("max", "P(sum)"), ("max", "P(avg)"), ("max", "P(min)"),
                                         ("sum", "P(max)"), ("mean", "P(min)")])
def test_partial_inputs_that_reductions_reject(op, partial):
    res = infer(op, spec(TP, (4, 6), [partial]), dims=[1])
    assert [(v.code, v.operand, v.fixable) for v in res.violations] == [("partial-input", "x", True)]
    assert want_strs(res) == ["(R)"]


def test_reduce_over_all_dims_gives_a_scalar():
    res = infer("sum", spec(DP_TP, (5, 3), ["S(0)", "S(1)"]))
    assert [str(o) for o in res.outputs] == ["float32[] (P(sum), P(sum))"]


def test_mean_of_integers_is_float32_and_sum_of_bools_is_int64():
    assert infer("mean", spec(TP, (4, 6), ["R"], "int32"), dims=[0]).outputs[0].dtype == "float32"
    assert infer("sum", spec(TP, (4, 6), ["R"], "bool"), dims=[0]).outputs[0].dtype == "int64"


# ============================================================================ every violation code
VIOLATIONS = [
    # id, inputs, op, attrs, code, operand, fragments of the message
    ("partial-max-into-matmul", {"x": {"shape": [4, 8], "placements": ["P(max)"]}, "w": {"shape": [8, 6]}},
     "matmul", {}, "partial-input", "x",
     ["x is P(max) on mesh axis 'tp'", "only P(sum) and P(avg) pass through", "(x is (P(max)); w is (R))"]),
    ("two-partials", {"x": {"shape": [4, 8], "placements": ["P(sum)"]}, "w": {"shape": [8, 6], "placements": ["P(sum)"]}},
     "matmul", {}, "partial-input", "x",
     ["x and w are both partial on mesh axis 'tp' (x P(sum), w P(sum))", "at most one operand may be partial"]),
    ("partial-beside-shard", {"x": {"shape": [2, 8], "placements": ["P(sum)"]},
                              "w": {"shape": [8, 6], "placements": ["S(1)"]}},
     "matmul", {}, "partial-input", "x",
     ["x is P(sum) on mesh axis 'tp' while w dim 1 (letter 'n', size 6) is sharded there", "(x is (P(sum)); w is "
      "(S(1)))"]),
    ("letters-disagree", {"x": {"shape": [4, 8], "placements": ["S(1)"]}, "w": {"shape": [8, 6], "placements": ["S(1)"]}},
     "matmul", {}, "sharding-mismatch", "x",
     ["x dim 1 (letter 'k', size 8) is sharded on mesh axis 'tp' but w dim 1 (letter 'n', size 6) is sharded there",
      "matmul 'mk,kn->mn'", "(x is (S(1)); w is (S(1)))"]),
    ("bias-sharded-on-partial-product", {"x": {"shape": [4, 6], "placements": ["S(1)"]},
                                         "w": {"shape": [8, 6], "placements": ["S(1)"]},
                                         "b": {"shape": [8], "placements": ["S(0)"]}},
     "linear", {}, "sharding-mismatch", "bias",
     ["bias dim 0 (letter 'o', size 8) is sharded on mesh axis 'tp'", "is P(sum) there"]),
    ("bias-partial", {"x": {"shape": [4, 6]}, "w": {"shape": [8, 6], "placements": ["S(0)"]},
                      "b": {"shape": [8], "placements": ["P(sum)"]}},
     "linear", {}, "partial-input", "bias",
     ["bias is P(sum) on mesh axis 'tp' but the product in linear 'ai,oi->ao' + bias 'o' is S(1) there"]),
    ("ids-and-vocab", {"ids": {"shape": [4, 6], "dtype": "int64", "placements": ["S(1)"]},
                       "table": {"shape": [50, 8], "placements": ["S(0)"]}},
     "embedding", {}, "sharding-mismatch", "ids",
     ["ids dim 1 (size 6) is sharded on mesh axis 'tp' but table dim 0 (vocab, size 50) is sharded on mesh axis "
      "'tp' (vocab-parallel)", "(ids is (S(1)), table is (S(0)))"]),
    ("partial-ids", {"ids": {"shape": [4, 6], "dtype": "int64", "placements": ["P(sum)"]}, "table": {"shape": [9, 8]}},
     "embedding", {}, "partial-input", "ids", ["ids is P(sum) on mesh axis 'tp'", "indices"]),
    ("max-of-partial-sum", {"x": {"shape": [4, 6], "placements": ["P(sum)"]}}, "max", {"dims": [1]},
     "partial-input", "x", ["x is P(sum) on mesh axis 'tp'", "max over dims [1] passes only P(max)", "(x is (P(sum)))"]),
    ("contracted-size-mismatch", {"x": {"shape": [4, 8]}, "w": {"shape": [7, 6]}}, "matmul", {}, "broadcast-shape", "w",
     ["x dim 1 (letter 'k', size 8) and w dim 0 (letter 'k', size 7) differ", "matmul 'mk,kn->mn'"]),
    ("contracted-broadcast", {"a": {"shape": [3, 4]}, "b": {"shape": [3, 1]}}, "einsum", {"equation": "bk,bk->b"},
     "broadcast-shape", "x1",
     ["letter 'k' is contracted in einsum 'bk,bk->b', so it must have its full size 4 in at least two operands",
      "x1 dim 1 (letter 'k', size 1) broadcasts it"]),
    ("diagonal", {"a": {"shape": [4, 3]}, "b": {"shape": [3, 6]}}, "einsum", {"equation": "ij,jk->ijj"},
     "invalid-equation", "x0", ["subscript 'ijj' repeats letter(s) ['j']"]),
    ("single-operand-sum", {"a": {"shape": [4, 3]}, "b": {"shape": [3, 6]}}, "einsum", {"equation": "ij,kl->ik"},
     "invalid-equation", "x0", ["letter 'j' is summed out of operand 0 alone"]),
    ("subscript-rank", {"a": {"shape": [4, 3]}, "b": {"shape": [3, 6]}}, "einsum", {"equation": "ijk,jk->ik"},
     "invalid-equation", "x0", ["subscript 'ijk' of x0 has 3 letter(s) but x0 has rank 2 (shape [4, 3])"]),
    ("no-arrow", {"a": {"shape": [4, 3]}}, "einsum", {"equation": "ij"},
     "invalid-equation", "x0", ["needs exactly one '->'"]),
    ("batched-weight", {"x": {"shape": [4, 8]}, "w": {"shape": [2, 8, 6]}}, "matmul", {}, "invalid-rank", "w",
     ["w has rank 3 (shape [2, 8, 6]) but matmul takes a 2-D weight (k, n)"]),
    ("float-ids", {"ids": {"shape": [4, 6]}, "table": {"shape": [9, 8]}}, "embedding", {}, "invalid-dtype", "ids",
     ["ids has dtype float32; embedding looks up integer ids"]),
    ("table-rank", {"ids": {"shape": [4], "dtype": "int64"}, "table": {"shape": [9, 8, 2]}}, "embedding", {},
     "invalid-rank", "table", ["table has rank 3 (shape [9, 8, 2])"]),
    ("dims-out-of-range", {"x": {"shape": [4, 6]}}, "sum", {"dims": [2]}, "invalid-dims", "x",
     ["dim 2 is out of range for a tensor of rank 2"]),
    ("dims-twice", {"x": {"shape": [4, 6]}}, "mean", {"dims": [1, -1]}, "invalid-dims", "x",
     ["dims [1, -1] name dim 1 twice"]),
]


@pytest.mark.parametrize("inputs, op, attrs, code, operand, fragments", [v[1:] for v in VIOLATIONS],
                         ids=[v[0] for v in VIOLATIONS])
def test_violation_codes_and_messages(inputs, op, attrs, code, operand, fragments):
    a = analyze(load_spec(one_node((2,), ("tp",), inputs, op, attrs)))
    assert [(v.code, v.operand) for v in a.check.violations] == [(code, operand)]
    v = a.check.violations[0]
    operand_names = [get_rule(op).operand_name(i) for i in range(len(inputs))]
    assert v.node == "y" and v.input == list(inputs)[operand_names.index(operand)]
    for fragment in fragments:
        assert fragment in v.message, (fragment, v.message)
    assert code in get_rule(op).violation_codes
    assert v.hint
    if v.fixable:
        assert "--reshard inserts" in v.hint and "'tp'" in v.hint


def test_every_documented_code_is_exercised():
    codes = {v[4] for v in VIOLATIONS}
    family = set()
    for op in ("einsum", "matmul", "batch_matmul", "linear", "embedding", "sum", "mean", "max"):
        family |= set(get_rule(op).violation_codes)
    assert codes == family


def test_fixable_violations_are_fixed_by_reshard():
    for _, inputs, op, attrs, code, _, _ in VIOLATIONS:
        if code in ("partial-input", "sharding-mismatch"):
            rep = run_graph(load_spec(one_node((2,), ("tp",), inputs, op, attrs)), backward=True, seed=1)
            assert rep.ok, (op, inputs, rep.mismatches)


# ============================================================================ finite differences
def central_vjp(f, args: list[np.ndarray], index: int, dy: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """<dy, d f / d args[index]> by central differences, one element at a time."""
    x = args[index]
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        plus, minus = [a.copy() for a in args], [a.copy() for a in args]
        plus[index][idx] += eps
        minus[index][idx] -= eps
        grad[idx] = np.sum(dy * (f(*plus) - f(*minus))) / (2 * eps)
    return grad


RNG = np.random.default_rng(7)


@pytest.mark.parametrize("dims, keepdim", [([0, 2], False), ([1], True), (None, False)])
def test_sum_and_mean_grad_kernels_match_finite_differences(dims, keepdim):
    x = RNG.standard_normal((3, 4, 5))
    y = K.reduce_sum(x, dims, keepdim)
    dy = RNG.standard_normal(y.shape)
    count = x.size // y.size
    got_sum = K.sum_grad(dy, x.shape, dims, keepdim)
    got_mean = K.sum_grad(dy, x.shape, dims, keepdim, scale=1.0 / count)
    np.testing.assert_allclose(got_sum, central_vjp(lambda a: K.reduce_sum(a, dims, keepdim), [x], 0, dy), atol=1e-7)
    np.testing.assert_allclose(got_mean, central_vjp(lambda a: K.reduce_mean(a, dims, keepdim), [x], 0, dy), atol=1e-7)


@pytest.mark.parametrize("dims, keepdim", [([0, 2], False), ([1], True), (None, False)])
def test_max_grad_kernel_matches_finite_differences(dims, keepdim):
    x = RNG.permutation(60).reshape(3, 4, 5).astype(np.float64) + RNG.uniform(0, 0.1, (3, 4, 5))  # no ties
    y = K.reduce_max(x, dims, keepdim)
    dy = RNG.standard_normal(y.shape)
    got = K.max_grad(dy, x, y, dims, keepdim)
    np.testing.assert_allclose(got, central_vjp(lambda a: K.reduce_max(a, dims, keepdim), [x], 0, dy), atol=1e-7)


def test_max_grad_ties_give_every_maximal_element_the_whole_cotangent():
    x = np.array([[2.0, 5.0, 5.0], [1.0, 0.0, 1.0]])
    got = K.max_grad(np.array([3.0, 4.0]), x, np.array([5.0, 1.0]), [1], False)
    assert got.tolist() == [[0.0, 3.0, 3.0], [4.0, 0.0, 4.0]]


def test_embedding_grad_kernel_matches_finite_differences():
    ids = np.array([[0, 3, 3], [6, 9, -1]])  # repeats, and ids outside [0, 7) that look nothing up
    table = RNG.standard_normal((7, 4))
    dy = RNG.standard_normal((2, 3, 4))
    got = K.embedding_grad(dy, ids, 7)
    np.testing.assert_allclose(got, central_vjp(lambda t: K.embedding(ids, t), [table], 0, dy), atol=1e-7)
    # the rows of a vocabulary shard [4, 7): the same scatter-add restricted to those rows
    np.testing.assert_allclose(K.embedding_grad(dy, ids, 3, vocab_start=4), got[4:7])


def test_embedding_kernel_out_of_range_ids_give_zero_rows():
    table = np.arange(8.0).reshape(4, 2)
    assert K.embedding(np.array([1, 4, -1, 3]), table).tolist() == [[2.0, 3.0], [0.0, 0.0], [0.0, 0.0], [6.0, 7.0]]
    assert K.embedding(np.array([1, 4, 3]), table[2:], vocab_start=2).tolist() == [[0.0, 0.0], [0.0, 0.0], [6.0, 7.0]]


def test_reduction_kernels_on_empty_pieces():
    empty = np.zeros((0, 3))
    assert K.reduce_max(empty, [0]).tolist() == [-np.inf] * 3
    assert K.reduce_sum(empty, [0]).tolist() == [0.0] * 3
    assert K.reduce_mean(empty, [0], count=4).tolist() == [0.0] * 3
    assert K.einsum(np.zeros((2, 0)), np.ones((0, 3)), equation="mk,kn->mn").tolist() == [[0.0] * 3] * 2


VJP_CASES = [
    ("matmul", [(3, 4), (4, 5)], {}, None),
    ("matmul", [(2, 4, 3), (5, 4)], {"transpose_a": True, "transpose_b": True}, None),
    ("batch_matmul", [(3, 1, 2, 4), (5, 4, 3)], {}, None),
    ("batch_matmul", [(2, 3, 4), (4, 5)], {}, None),
    ("linear", [(2, 3, 4), (5, 4), (5,)], {}, None),
    ("linear", [(3, 4), (5, 4), (1,)], {}, None),
    ("linear", [(4,), (5, 4)], {}, None),
    ("einsum", [(3, 4), (4, 5), (5, 2)], {"equation": "ab,bc,cd->ad"}, None),
    ("einsum", [(1, 3, 4), (2, 4, 5)], {"equation": "bmk,bkn->bmn"}, None),
    ("einsum", [(3, 4)], {"equation": "ij->ji"}, None),
    ("embedding", [(2, 5), (7, 3)], {}, ["int64", "float64"]),
    ("sum", [(3, 4, 5)], {"dims": [0, 2]}, None),
    ("mean", [(3, 4, 5)], {"dims": [-1], "keepdim": True}, None),
    ("max", [(3, 4, 5)], {"dims": [1]}, None),
    ("mean", [(3, 4)], {}, None),
]


@pytest.mark.parametrize("op, shapes, attrs, dtypes", VJP_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(VJP_CASES)])
def test_vjp_rules_and_kernels_match_finite_differences(op, shapes, attrs, dtypes):
    rule = get_rule(op)
    dtypes = dtypes or ["float64"] * len(shapes)
    names = [rule.operand_name(i) for i in range(len(shapes))]
    inputs = {n: {"shape": list(s), "dtype": d, "requires_grad": d == "float64"}
              for n, s, d in zip(names, shapes, dtypes)}
    g = Backward().run(load_spec(one_node((1,), ("dp",), inputs, op, attrs))).graph
    rng = np.random.default_rng(11)
    arrays = {}
    for n, s, d in zip(names, shapes, dtypes):
        arrays[n] = rng.integers(-1, 9, s) if d == "int64" else rng.permutation(int(np.prod(s))).reshape(s) \
            + rng.uniform(0, 0.5, s)  # distinct values: max has no ties
    forward = K.KERNELS[op]
    y = forward(*[arrays[n] for n in names], **attrs)
    dy = rng.standard_normal(np.shape(y))
    env = execute_global(g, {**arrays, "cotangent/y": dy})
    for i, n in enumerate(names):
        if dtypes[i] != "float64":
            assert f"grad/{n}" not in g
            continue
        expected = central_vjp(lambda *a: forward(*a, **attrs), [arrays[m].astype(np.float64) for m in names], i, dy)
        np.testing.assert_allclose(env[f"grad/{n}"], expected, atol=1e-6, rtol=1e-6, err_msg=f"grad of {n}")


# ============================================================================ end to end: Megatron patterns
def megatron_mlp(mesh_shape, names, x_placements) -> dict:
    r = ["R"] * (len(mesh_shape) - 1)
    return graph_spec(mesh_shape, names, {
        "x": {"shape": [4, 6, 8], "placements": x_placements},
        "w1": {"shape": [12, 8], "placements": r + ["S(0)"]},
        "b1": {"shape": [12], "placements": r + ["S(0)"]},
        "w2": {"shape": [8, 12], "placements": r + ["S(1)"]},
        "b2": {"shape": [8], "placements": r + ["R"]},
    }, [{"name": "h", "op": "linear", "inputs": ["x", "w1", "b1"]},
        {"name": "y", "op": "linear", "inputs": ["h", "w2", "b2"]}], outputs=["y"])


@pytest.mark.parametrize("mesh_shape, names, x_placements, h, y", [
    ((2,), ("tp",), ["R"], ["S(2)"], ["P(sum)"]),
    ((2, 2), ("dp", "tp"), ["S(0)", "R"], ["S(0)", "S(2)"], ["S(0)", "P(sum)"]),
])
def test_megatron_mlp_column_then_row_parallel(mesh_shape, names, x_placements, h, y):
    g = load_spec(megatron_mlp(mesh_shape, names, x_placements))
    a = analyze(g, backward=True)
    assert a.ok, [str(v) for v in a.check.violations]
    tensors = a.report()["tensors"]
    assert tensors["h"]["placements"] == h and tensors["y"]["placements"] == y
    rep = run_graph(load_spec(megatron_mlp(mesh_shape, names, x_placements)), backward=True, seed=5)
    assert rep.ok, rep.mismatches
    assert set(rep.grads) == {"x", "w1", "b1", "w2", "b2"}
    # the column-parallel layer's input gradient is a partial sum over tp: the backward all-reduce
    assert ("all-reduce", "tp") in {(c["kind"], c["mesh_axis"]) for c in rep.collectives if c["node"] == "grad/x"}
    # the forward moves nothing: the row-parallel output stays a partial sum
    assert not [c for c in rep.collectives if not c["node"].startswith("grad/")]


def test_megatron_sequence_parallel_forward_and_backward_with_reshard():
    rep = run_graph(load_spec(sp_graph()), backward=True, seed=2)
    assert rep.ok, rep.mismatches
    forward = [(c["kind"], c["mesh_axis"]) for c in rep.collectives if not c["node"].startswith("grad")]
    assert forward == [("all-gather", "tp")]


def test_vocab_parallel_embedding_end_to_end():
    spec_ = graph_spec((2, 2), ("dp", "tp"), {
        "ids": {"shape": [4, 5], "dtype": "int64", "placements": ["S(0)", "R"], "requires_grad": False},
        "table": {"shape": [11, 6], "placements": ["R", "S(0)"]},
        "w": {"shape": [3, 6], "placements": ["R", "R"]},
    }, [{"name": "e", "op": "embedding", "inputs": ["ids", "table"]},
        {"name": "y", "op": "linear", "inputs": ["e", "w"]}], outputs=["y"])
    a = analyze(load_spec(spec_), backward=True)
    tensors = a.report()["tensors"]
    assert tensors["e"]["placements"] == ["S(0)", "P(sum)"] and tensors["y"]["placements"] == ["S(0)", "P(sum)"]
    assert tensors["grad:table"]["placements"] == ["R", "S(0)"]
    rep = run_graph(load_spec(spec_), backward=True, seed=4)
    assert rep.ok, rep.mismatches
    # the table gradient is a partial sum over dp (ids sharded) and vocabulary rows on tp: one all-reduce on dp
    assert [(c["kind"], c["mesh_axis"]) for c in rep.collectives if c["node"] == "grad/table"] == [
        ("all-reduce", "dp")]


def test_lm_head_then_max_over_the_vocabulary():
    spec_ = graph_spec((2,), ("tp",), {
        "h": {"shape": [2, 3, 8], "placements": ["R"]},
        "w": {"shape": [13, 8], "placements": ["S(0)"]},
    }, [{"name": "logits", "op": "linear", "inputs": ["h", "w"]},
        {"name": "y", "op": "max", "inputs": ["logits"], "attrs": {"dims": [-1]}}], outputs=["y"])
    a = analyze(load_spec(spec_), backward=True, reshard=True)
    assert a.ok and a.report()["tensors"]["y"]["placements"] == ["P(max)"]
    rep = run_graph(load_spec(spec_), backward=True, seed=6)
    assert rep.ok, rep.mismatches


def test_attention_scores_shard_by_heads():
    spec_ = graph_spec((2,), ("tp",), {
        "q": {"shape": [2, 4, 5, 8], "placements": ["S(1)"]},
        "k": {"shape": [2, 4, 5, 8], "placements": ["S(1)"]},
        "v": {"shape": [2, 4, 5, 8], "placements": ["S(1)"]},
    }, [{"name": "s", "op": "batch_matmul", "inputs": ["q", "k"], "attrs": {"transpose_b": True}},
        {"name": "o", "op": "batch_matmul", "inputs": ["s", "v"]}], outputs=["o"])
    a = analyze(load_spec(spec_))
    assert a.ok and a.report()["tensors"]["s"]["placements"] == ["S(1)"]
    rep = run_graph(load_spec(spec_), backward=True, seed=8)
    assert rep.ok and rep.collectives == []


def test_mean_over_an_unevenly_sharded_sequence():
    x = np.random.default_rng(0).standard_normal((7,))
    pieces = np.array_split(x, [2, 4, 6])  # the torch.chunk pieces of 7 on 4 ranks: 2, 2, 2, 1
    assert not np.isclose(np.mean([p.mean() for p in pieces]), x.mean())  # why local means are not enough
    spec_ = one_node((4,), ("sp",), {"x": {"shape": [2, 7, 3], "placements": ["S(1)"]}}, "mean", {"dims": [1]})
    rep = run_graph(load_spec(spec_), backward=True, seed=9)
    assert rep.ok, rep.mismatches


@pytest.mark.parametrize("op, placement", [("sum", "P(avg)"), ("mean", "P(avg)"), ("max", "P(max)")])
def test_partial_inputs_through_reductions_end_to_end(op, placement):
    spec_ = one_node((2, 2), ("dp", "tp"), {"x": {"shape": [5, 3], "placements": [placement, "S(0)"]}}, op,
                     {"dims": [0]})
    a = analyze(load_spec(spec_))
    assert a.ok
    rep = run_graph(load_spec(spec_), backward=True, seed=10)
    assert rep.ok, rep.mismatches


def test_partial_avg_table_embedding_end_to_end():
    spec_ = one_node((2,), ("tp",), {"ids": {"shape": [3, 4], "dtype": "int32", "requires_grad": False},
                                     "table": {"shape": [9, 5], "placements": ["P(avg)"]}}, "embedding")
    rep = run_graph(load_spec(spec_), backward=True, seed=12)
    assert rep.ok, rep.mismatches


def test_partial_avg_operand_through_matmul_end_to_end():
    spec_ = one_node((2, 2), ("dp", "tp"), {"x": {"shape": [4, 6], "placements": ["P(avg)", "S(1)"]},
                                            "w": {"shape": [6, 5], "placements": ["R", "R"]}}, "matmul")
    a = analyze(load_spec(spec_))
    assert a.ok and a.report()["tensors"]["y"]["placements"] == ["P(avg)", "P(sum)"]
    rep = run_graph(load_spec(spec_), backward=True, seed=13)
    assert rep.ok, rep.mismatches


# --------------------------------------------------------------------------- einsum kernel
@st.composite
def two_operand_equations(draw):
    """A two-operand einsum with distinct letters per subscript, size-1 dims and empty dims included."""
    letters = "abcdef"
    sub_a = "".join(draw(st.permutations(letters)))[: draw(st.integers(0, 4))]
    sub_b = "".join(draw(st.permutations(letters)))[: draw(st.integers(0, 4))]
    present = sorted(set(sub_a) | set(sub_b))
    out = "".join(draw(st.permutations(present)))[: draw(st.integers(0, len(present)))]
    sizes = {c: draw(st.integers(0, 4)) for c in present}
    return f"{sub_a},{sub_b}->{out}", sizes


@settings(max_examples=200, deadline=None)
@given(two_operand_equations(), st.integers(0, 2**31 - 1))
def test_two_operand_einsum_kernel_equals_numpy_einsum(case, seed):
    equation, sizes = case
    sub_a, sub_b = equation.split("->")[0].split(",")
    rng = np.random.default_rng(seed)
    a = rng.standard_normal([sizes[c] for c in sub_a])
    b = rng.standard_normal([sizes[c] for c in sub_b])
    got = K.einsum(a, b, equation=equation)
    want = np.einsum(equation, a, b)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_two_operand_einsum_kernel_broadcasts_size_one_dims_and_keeps_float32():
    a = np.ones((1, 3, 4), np.float32)
    b = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
    got = K.einsum(a, b, equation="bmk,bkn->bmn")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.einsum("bmk,bkn->bmn", np.broadcast_to(a, (2, 3, 4)), b))
