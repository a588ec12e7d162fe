"""The index family: gather, index_select, scatter, scatter_add, index_add, index_copy, gather_nd, scatter_nd,
index_put, masked_fill, masked_scatter, where, one_hot, isin.

What the op database (``layout_prop/testing/opdb/index.py``, run by test_opdb and
test_gradients) does not cover:

- the numpy kernels against torch's documented results, written out by hand for small cases
  (torch.gather, scatter_, index_add_ examples), duplicates included;
- a rank's piece (``start``, ``dim_size``): zeros outside the piece, the global range checked;
- an index out of range in the data: ``index-out-of-range`` from the kernel and from ``run``;
- unusable input (integer index, bool mask, dims, ranks, shapes, ``num_classes``): a typed
  error, one line on the command line and exit 2;
- the layouts the rules choose in the cases they exist for (vocabulary-parallel lookup,
  split contributions), written by hand;
- the vjp rules against central finite differences of the forward, in float64, on cases
  the records' first samples leave out (duplicate indices, indices smaller than x, broadcasts).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from layout_prop import DeviceMesh, Layout, TensorSpec
from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.core.errors import ExecutionError, LayoutPropError
from layout_prop.core.registry import get_rule
from layout_prop.io.loader import load_spec
from layout_prop.kernels.index_numpy import KERNELS as K
from layout_prop.runner import execute_global

TP = DeviceMesh((2,), ("tp",))


def spec(shape, placements, dtype="float32", mesh=TP) -> TensorSpec:
    return TensorSpec(shape, dtype, Layout(mesh, placements, len(shape)))


def one_node(op: str, inputs: dict, attrs=None, mesh=(2,)) -> dict:
    return {"mesh": {"shape": list(mesh), "names": ["dp", "tp"][-len(mesh):]}, "inputs": inputs,
            "nodes": [{"name": "y", "op": op, "inputs": list(inputs), "attrs": attrs or {}}]}


def entry(shape, dtype="float32", placements=None, grad=None) -> dict:
    out = {"shape": list(shape), "dtype": dtype}
    if placements is not None:
        out["placements"] = placements
    if grad is not None:
        out["requires_grad"] = grad
    return out


# ============================================================================ kernels by hand
def test_gather_follows_torch():
    x = np.array([[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(K["gather"](x, np.array([[0, 0], [1, 0]]), dim=1), [[1.0, 1.0], [4.0, 3.0]])
    # index smaller than x in the dim it does not index: x's corner is read
    x = np.arange(9.0).reshape(3, 3)
    np.testing.assert_array_equal(K["gather"](x, np.array([[2, 0]]), dim=0), [[6.0, 1.0]])


def test_index_select_follows_torch():
    x = np.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(K["index_select"](x, np.array([2, 0, 2]), dim=0),
                                  [[8, 9, 10, 11], [0, 1, 2, 3], [8, 9, 10, 11]])
    np.testing.assert_array_equal(K["index_select"](x, np.array([3, 1], np.int32), dim=-1),
                                  [[3, 1], [7, 5], [11, 9]])


def test_scatter_follows_torch_and_the_last_duplicate_wins():
    out = K["scatter"](np.zeros((3, 5)), np.array([[0, 1, 2, 0]]), np.array([[1.0, 2.0, 3.0, 4.0]]), dim=0)
    np.testing.assert_array_equal(out, [[1, 0, 0, 4, 0], [0, 2, 0, 0, 0], [0, 0, 3, 0, 0]])
    out = K["scatter"](np.zeros((2, 4)), np.array([[3, 3, 0], [1, 1, 1]]), np.array([[1.0, 2.0, 3.0],
                                                                                       [4.0, 5.0, 6.0]]), dim=1)
    np.testing.assert_array_equal(out, [[3, 0, 0, 2], [0, 6, 0, 0]])


def test_scatter_src_grad_keeps_only_the_last_write_of_each_element():
    dy = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    index = np.array([[3, 3, 0], [1, 1, 1]])
    np.testing.assert_array_equal(K["scatter_src_grad"](dy, index, dim=1), [[0, 4, 1], [0, 0, 6]])
    # a rank's piece [2, 4) of dy's dim 1 of size 4, the whole index
    np.testing.assert_array_equal(K["scatter_src_grad"](dy[:, 2:], index, dim=1, start=2, dim_size=4),
                                  [[0, 4, 0], [0, 0, 0]])


def test_scatter_add_and_index_add_add_duplicates_up():
    np.testing.assert_array_equal(K["scatter_add"](np.ones(4), np.array([1, 1, 3]), np.array([1.0, 2.0, 4.0]), dim=0),
                                  [1, 4, 1, 5])
    t = np.arange(1.0, 10.0).reshape(3, 3)  # torch's index_add_ example
    out = K["index_add"](np.ones((5, 3)), np.array([0, 4, 2]), t, dim=0)
    np.testing.assert_array_equal(out, [[2, 3, 4], [1, 1, 1], [8, 9, 10], [1, 1, 1], [5, 6, 7]])
    out = K["index_add"](np.zeros((2, 3)), np.array([1, 1]), np.array([[1.0, 2.0], [3.0, 4.0]]), dim=1)
    np.testing.assert_array_equal(out, [[0, 3, 0], [0, 7, 0]])


def test_index_copy_follows_torch_and_the_last_duplicate_wins():
    t = np.arange(1.0, 10.0).reshape(3, 3)  # torch's index_copy_ example
    out = K["index_copy"](np.zeros((5, 3)), np.array([0, 4, 2]), t, dim=0)
    np.testing.assert_array_equal(out, [[1, 2, 3], [0, 0, 0], [7, 8, 9], [0, 0, 0], [4, 5, 6]])
    out = K["index_copy"](np.zeros((2, 3)), np.array([2, 0, 2]), np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), dim=1)
    np.testing.assert_array_equal(out, [[2, 0, 3], [5, 0, 6]])
    grad = K["index_copy_src_grad"](np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), np.array([2, 0, 2]), dim=1)
    np.testing.assert_array_equal(grad, [[0, 1, 3], [0, 4, 6]])


def test_gather_nd_scatter_nd_index_put_follow_onnx_and_torch():
    data = np.array([[0.0, 1.0], [2.0, 3.0]])  # ONNX GatherND examples (batch_dims 0)
    np.testing.assert_array_equal(K["gather_nd"](data, np.array([[0, 0], [1, 1]])), [0, 3])
    np.testing.assert_array_equal(K["gather_nd"](data, np.array([[1], [0]])), [[2, 3], [0, 1]])
    out = K["scatter_nd"](np.arange(1.0, 9.0), np.array([[4], [3], [1], [7]]), np.array([9.0, 10.0, 11.0, 12.0]))
    np.testing.assert_array_equal(out, [1, 11, 3, 10, 9, 6, 7, 12])  # ONNX ScatterND example 1
    # torch: x.index_put((rows, cols), values) with rows [0, 2, 0], cols [1, 1, 1]
    indices = np.stack([np.array([0, 2, 0]), np.array([1, 1, 1])], -1)
    out = K["index_put"](np.zeros((3, 2)), indices, np.array([1.0, 2.0, 4.0]), accumulate=True)
    np.testing.assert_array_equal(out, [[0, 5], [0, 0], [0, 2]])
    out = K["index_put"](np.zeros((3, 2)), indices, np.array([1.0, 2.0, 4.0]))  # the last duplicate wins
    np.testing.assert_array_equal(out, [[0, 4], [0, 0], [0, 2]])
    np.testing.assert_array_equal(K["scatter_nd_src_grad"](np.arange(6.0).reshape(3, 2), indices), [0, 5, 1])
    # a rank's piece: rows [2, 3) and columns [1, 2) of a (3, 2) x
    np.testing.assert_array_equal(K["gather_nd"](np.array([[7.0]]), indices, starts=[2, 1], dim_sizes=[3, 2]),
                                  [0, 7, 0])


def test_masked_scatter_follows_torch():
    mask = np.array([[0, 0, 0, 1, 1], [1, 1, 0, 1, 1]], bool)  # torch's masked_scatter example
    source = np.arange(10.0).reshape(2, 5)
    np.testing.assert_array_equal(K["masked_scatter"](np.zeros((2, 5)), mask, source), [[0, 0, 0, 0, 1],
                                                                                       [2, 3, 0, 4, 5]])
    # a rank's piece: columns [3, 5) count the true places before them in the whole mask
    np.testing.assert_array_equal(K["masked_scatter"](np.full((2, 2), -1.0), mask, source, box=[[0, 2], [3, 5]],
                                                      full_shape=[2, 5]), [[0, 1], [4, 5]])
    grad = K["masked_scatter_src_grad"](np.arange(10.0).reshape(2, 5) + 1, mask, shape=[2, 4])
    np.testing.assert_array_equal(grad, [[4, 5, 6, 7], [9, 10, 0, 0]])
    with pytest.raises(ExecutionError) as err:
        K["masked_scatter"](np.zeros((2, 5)), mask, np.ones(5))
    assert err.value.code == "source-too-small" and "mask has 6 true places but source only 5" in err.value.message


def test_masked_fill_where_one_hot_isin():
    out = K["masked_fill"](np.array([[1, 2, 3], [4, 5, 6]]), np.array([True, False, True]), value=-1)
    np.testing.assert_array_equal(out, [[-1, 2, -1], [-1, 5, -1]])
    assert out.dtype == np.int64 or out.dtype == np.dtype(int)
    out = K["where"](np.array([[True], [False]]), np.array([1.0, 2.0]), np.array([[5.0], [6.0]]))
    np.testing.assert_array_equal(out, [[1, 2], [6, 6]])
    out = K["one_hot"](np.array([0, 2]), num_classes=3)
    np.testing.assert_array_equal(out, [[1, 0, 0], [0, 0, 1]])
    assert out.dtype == np.int64
    np.testing.assert_array_equal(K["isin"](np.array([[1, 2], [3, 4]]), np.array([4, 2, 9])),
                                  [[False, True], [False, True]])


def test_a_ranks_piece_looks_up_and_writes_only_its_indices():
    x = np.arange(4.0)  # the piece [6, 10) of a dim of 10
    index = np.array([7, 2, 9, 6])
    np.testing.assert_array_equal(K["gather"](x, index, dim=0, start=6, dim_size=10), [1, 0, 3, 0])
    np.testing.assert_array_equal(K["index_select"](x, index, dim=0, start=6, dim_size=10), [1, 0, 3, 0])
    src = np.array([10.0, 20.0, 30.0, 40.0])
    np.testing.assert_array_equal(K["scatter_add"](x, index, src, dim=0, start=6, dim_size=10), [40, 11, 2, 33])
    np.testing.assert_array_equal(K["scatter"](x, index, src, dim=0, start=6, dim_size=10), [40, 10, 2, 30])


@pytest.mark.parametrize("op,args,attrs", [
    ("gather", (np.zeros((2, 3)), np.array([[0, 3]])), {"dim": 1}),
    ("gather", (np.zeros((2, 3)), np.array([[0, -1]])), {"dim": 1}),
    ("index_select", (np.zeros((2, 3)), np.array([2])), {"dim": 0}),
    ("scatter", (np.zeros(3), np.array([3]), np.ones(1)), {"dim": 0}),
    ("scatter_add", (np.zeros(3), np.array([-2]), np.ones(1)), {"dim": 0}),
    ("index_add", (np.zeros(3), np.array([5]), np.ones(1)), {"dim": 0}),
    ("one_hot", (np.array([1, 4]),), {"num_classes": 4}),
    # a rank's piece [6, 10): 10 is outside the whole dim, not only outside the piece
    ("gather", (np.zeros(4), np.array([10])), {"dim": 0, "start": 6, "dim_size": 10}),
])
def test_an_index_out_of_range_is_an_execution_error(op, args, attrs):
    with pytest.raises(ExecutionError) as err:
        K[op](*args, **attrs)
    assert err.value.code == "index-out-of-range"
    assert "outside [0, " in err.value.message and "\n" not in str(err.value)


def test_run_with_an_index_out_of_range_is_one_line_exit_2(tmp_path, capsys):
    # run draws the index within the gathered dim of 3 (the rule's input_domain): the spec runs; an index
    # given outside it is the one-line error
    path = tmp_path / "g.json"
    path.write_text(json.dumps(one_node("gather", {"x": entry((4, 3), placements=["S(1)"]),
                                                   "index": entry((4, 5), "int64", grad=False)}, {"dim": 1})))
    assert main(["run", str(path)]) == 0
    capsys.readouterr()
    arrays = tmp_path / "index.npz"
    np.savez(arrays, index=np.full((4, 5), 5, dtype=np.int64))
    assert main(["run", str(path), "--inputs", str(arrays)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("layout-prop: error: index-out-of-range: gather: index ") and "outside [0, 3)" in err
    assert "\n" not in err and "Traceback" not in err


# ============================================================================ unusable input: exit 2
BAD = [
    ("gather", {"x": entry((4, 9)), "index": entry((4, 3))}, {"dim": 1}, "invalid-dtype",
     "gather: index has dtype float32; index holds indices"),
    ("gather", {"x": entry((4, 9)), "index": entry((4, 3), "bool")}, {"dim": 1}, "invalid-dtype", "dtype bool"),
    ("gather", {"x": entry((4, 9)), "index": entry((4, 3), "int64")}, {"dim": 2}, "invalid-dims",
     "gather: dim 2 is out of range for x of rank 2"),
    ("gather", {"x": entry((4, 9)), "index": entry((4, 3), "int64")}, {}, "bad-attr", "needs attribute(s) ['dim']"),
    ("gather", {"x": entry((4, 9)), "index": entry((4,), "int64")}, {"dim": 1}, "invalid-rank",
     "index has rank 1 ([4]) but x has rank 2 ([4, 9])"),
    ("gather", {"x": entry((4, 9)), "index": entry((5, 3), "int64")}, {"dim": 1}, "invalid-shape",
     "index dim 0 (size 5) is larger than x's (4)"),
    ("index_select", {"x": entry((4, 9)), "index": entry((2, 3), "int64")}, {"dim": 0}, "invalid-rank",
     "index has shape [2, 3]; it must be 1-D"),
    ("scatter", {"x": entry((4, 9)), "index": entry((2, 3), "int64"), "src": entry((2, 4))}, {"dim": 1},
     "invalid-shape", "src has shape [2, 4] but index [2, 3]"),
    ("scatter_add", {"x": entry((4, 9)), "index": entry((2, 3), "int64"), "src": entry((2, 3), "float64")},
     {"dim": 1}, "invalid-dtype", "src has dtype float64 but x float32"),
    ("index_add", {"x": entry((4, 9)), "index": entry((2,), "int64"), "src": entry((4, 3))}, {"dim": 1},
     "invalid-shape", "it must be [4, 2]"),
    ("index_copy", {"x": entry((4, 9)), "index": entry((2, 1), "int64"), "src": entry((4, 2))}, {"dim": 1},
     "invalid-rank", "index_copy: index has shape [2, 1]; it must be 1-D"),
    ("gather_nd", {"x": entry((4, 9)), "index": entry((2, 3), "int64")}, {}, "invalid-shape",
     "its last dim (the length of each index tuple) must be in 1..2"),
    ("scatter_nd", {"x": entry((4, 9)), "index": entry((2, 1), "int64"), "src": entry((2, 9))},
     {"reduction": "mul"}, "bad-attr", "reduction must be one of ['none', 'add'], got 'mul'"),
    ("index_put", {"x": entry((4, 9)), "index": entry((2, 1), "int64"), "src": entry((9,))}, {}, "invalid-shape",
     "values has shape [9]; for x [4, 9] and indices [2, 1] it must be [2, 9]"),
    ("index_put", {"x": entry((4, 9)), "index": entry((2, 1), "int64"), "src": entry((2, 9))},
     {"accumulate": "yes"}, "bad-attr", "accumulate must be true or false"),
    ("masked_fill", {"x": entry((4, 5)), "mask": entry((4, 5), "int64")}, {"value": 0}, "invalid-dtype",
     "mask has dtype int64; mask must be bool"),
    ("masked_fill", {"x": entry((4, 5)), "mask": entry((4, 1, 5), "bool")}, {"value": 0}, "invalid-shape",
     "mask of shape [4, 1, 5] does not broadcast to x's shape [4, 5]"),
    ("masked_fill", {"x": entry((4, 5)), "mask": entry((4, 5), "bool")}, {}, "bad-attr",
     "needs attribute(s) ['value']"),
    ("masked_scatter", {"x": entry((4, 5)), "mask": entry((2, 4, 5), "bool"), "src": entry((40,))}, {},
     "invalid-shape", "mask of shape [2, 4, 5] does not broadcast to x's shape [4, 5]"),
    ("masked_scatter", {"x": entry((4, 5)), "mask": entry((4, 5), "bool"), "src": entry((40,), "float16")}, {},
     "invalid-dtype", "source has dtype float16 but x float32"),
    ("where", {"c": entry((4, 5), "float32"), "x": entry((4, 5)), "z": entry((5,))}, {}, "invalid-dtype",
     "condition has dtype float32"),
    ("where", {"c": entry((4, 5), "bool"), "x": entry((3, 5)), "z": entry((5,))}, {}, "invalid-shape",
     "do not broadcast"),
    ("one_hot", {"ids": entry((4,), "int64")}, {}, "bad-attr", "needs attribute(s) ['num_classes']"),
    ("one_hot", {"ids": entry((4,), "int64")}, {"num_classes": 0}, "bad-attr",
     "num_classes must be an integer >= 1, got 0"),
    ("one_hot", {"ids": entry((4,), "float32")}, {"num_classes": 3}, "invalid-dtype", "indices has dtype float32"),
]


@pytest.mark.parametrize("op,inputs,attrs,code,text", BAD, ids=[f"{b[0]}-{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_unusable_input_is_a_typed_error(op, inputs, attrs, code, text):
    with pytest.raises(LayoutPropError) as err:
        analyze(load_spec(one_node(op, inputs, attrs)))
    assert err.value.code == code and text in err.value.message, str(err.value)
    assert err.value.node == "y" and err.value.hint


CLI_CASES = [next(b for b in BAD if b[0] == op and b[3] == code) for op, code in (
    ("gather", "invalid-dtype"), ("index_select", "invalid-rank"), ("masked_fill", "invalid-shape"),
    ("one_hot", "bad-attr"), ("scatter_nd", "bad-attr"))]


@pytest.mark.parametrize("case", CLI_CASES, ids=lambda b: f"{b[0]}-{b[3]}")
def test_unusable_input_on_the_command_line_is_one_line_exit_2(case, tmp_path, capsys):
    op, inputs, attrs, code, text = case
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(one_node(op, inputs, attrs)))
    assert main(["check", str(path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith(f"layout-prop: error: {code} at ") and "node 'y'" in err and text in err
    assert "\n" not in err and "Traceback" not in err


# ============================================================================ layouts by hand
def test_vocab_parallel_gather_and_index_select_give_a_partial_sum_and_keep_the_source_in_place():
    x, index = spec((4, 10), ["S(1)"]), spec((4, 3), ["R"], "int64")
    res = get_rule("gather").infer_layout((x, index), {"dim": 1})
    assert str(res.outputs[0]) == "float32[4, 3] (P(sum))" and not res.violations
    assert [get_rule("gather").localize({"dim": 1}, (x, index), res.outputs, r) for r in range(2)] == [
        {"dim": 1, "start": 0, "dim_size": 10}, {"dim": 1, "start": 5, "dim_size": 10}]
    res = get_rule("index_select").infer_layout((spec((10, 8), ["S(0)"]), spec((6,), ["S(0)"], "int64")), {"dim": 0})
    # the table (80 elements) stays, the ids (6) are gathered
    assert str(res.outputs[0].layout) == "(P(sum))" and [str(w) for w in res.wants] == ["None", "(R)"]
    assert [v.code for v in res.violations] == ["sharding-mismatch"] and res.violations[0].operand == "index"


def test_gather_shards_shared_batch_dims_only_where_x_and_index_have_the_same_size():
    res = get_rule("gather").infer_layout((spec((4, 9), ["R"]), spec((4, 3), ["S(0)"], "int64")), {"dim": 1})
    assert str(res.outputs[0].layout) == "(S(0))" and str(res.wants[0]) == "(S(0))" and not res.violations
    res = get_rule("gather").infer_layout((spec((4, 9), ["S(0)"]), spec((2, 3), ["R"], "int64")), {"dim": 1})
    assert str(res.outputs[0].layout) == "(R)" and str(res.wants[0]) == "(R)"
    assert [(v.code, v.operand, v.fixable) for v in res.violations] == [("sharding-mismatch", "x", True)]


def test_scatter_add_splits_contributions_into_a_partial_sum_but_scatter_cannot():
    x, index, src = spec((10, 4), ["R"]), spec((6, 4), ["S(0)"], "int64"), spec((6, 4), ["S(0)"])
    res = get_rule("scatter_add").infer_layout((x, index, src), {"dim": 0})
    assert str(res.outputs[0].layout) == "(P(sum))" and not res.violations and str(res.wants[0]) == "(P(sum))"
    res = get_rule("scatter").infer_layout((x, index, src), {"dim": 0})  # overwrites: split writes are not a sum
    assert str(res.outputs[0].layout) == "(R)" and sorted(v.operand for v in res.violations) == ["index", "src"]


def test_partial_operands():
    x, mask = spec((4, 6), ["P(sum)"]), spec((4, 6), ["R"], "bool")
    res = get_rule("masked_fill").infer_layout((x, mask), {"value": 1.0})  # filling each term adds value twice
    assert [(v.code, v.operand) for v in res.violations] == [("partial-input", "x")]
    res = get_rule("scatter").infer_layout((x, spec((2, 6), ["R"], "int64"), spec((2, 6), ["R"])), {"dim": 0})
    assert str(res.outputs[0].layout) == "(P(sum))" and str(res.wants[2]) == "(P(sum))" and not res.violations
    res = get_rule("gather").infer_layout((spec((4, 6), ["P(max)"]), spec((4, 2), ["R"], "int64")), {"dim": 1})
    assert [(v.code, v.operand) for v in res.violations] == [("partial-input", "x")]
    c, y = spec((4, 1), ["R"], "bool"), spec((6,), ["R"])
    res = get_rule("where").infer_layout((c, x, y), {})  # linear in (x, y): y becomes terms for free
    assert str(res.outputs[0].layout) == "(P(sum))" and not res.violations and str(res.wants[2]) == "(P(sum))"
    res = get_rule("where").infer_layout((spec((4, 1), ["P(sum)"], "bool"), x, y), {})
    assert sorted((v.code, v.operand) for v in res.violations) == [("partial-input", "condition"),
                                                                   ("partial-input", "x")]
    res = get_rule("one_hot").infer_layout((spec((4,), ["P(sum)"], "int64"),), {"num_classes": 8})
    assert [(v.code, v.operand) for v in res.violations] == [("partial-input", "indices")]


# ============================================================================ vjp: finite differences
H = 1e-6


def _fd_check(op, inputs: dict, attrs: dict, data: dict) -> int:
    """Every float input's gradient (the backward graph on one device, float64) against central
    differences of ``sum(cotangent * output)``; returns the number of elements checked."""
    graph_spec = one_node(op, inputs, attrs, mesh=(1,))
    graph_spec["mesh"]["names"] = ["dp"]
    for e in graph_spec["inputs"].values():
        e["placements"] = ["R"]
    joint = analyze(load_spec(graph_spec), backward=True).graph
    forward = analyze(load_spec(graph_spec)).graph
    rng = np.random.default_rng(5)
    cot = rng.standard_normal(execute_global(forward, data)["y"].shape)
    env = execute_global(joint, {**data, "cotangent/y": cot})

    def loss(values):
        return float(np.sum(execute_global(forward, values)["y"] * cot))

    checked = 0
    for name, value in data.items():
        if value.dtype != np.float64:
            continue
        grad = env[f"grad/{name}"]
        for index in np.ndindex(*value.shape):
            up, down = dict(data), dict(data)
            up[name], down[name] = value.copy(), value.copy()
            up[name][index] += H
            down[name][index] -= H
            numeric = (loss(up) - loss(down)) / (2 * H)
            assert abs(grad[index] - numeric) <= 1e-6 * max(1.0, abs(numeric)), (op, name, index, grad[index], numeric)
            checked += 1
    return checked


def _normal(*shape):
    return np.random.default_rng(sum(shape)).standard_normal(shape)


F64 = "float64"
FD_CASES = [
    # index smaller than x in dim 0, duplicate indices along dim 1
    ("gather", {"x": entry((3, 5), F64), "index": entry((2, 4), "int64", grad=False)}, {"dim": 1},
     {"x": _normal(3, 5), "index": np.array([[0, 4, 4, 2], [1, 1, 3, 0]])}),
    ("index_select", {"x": entry((4, 3), F64), "index": entry((5,), "int32", grad=False)}, {"dim": 0},
     {"x": _normal(4, 3), "index": np.array([3, 0, 3, 3, 1], np.int32)}),
    ("scatter_add", {"x": entry((4, 3), F64), "index": entry((2, 3), "int64", grad=False), "src": entry((2, 3), F64)},
     {"dim": 0}, {"x": _normal(4, 3), "index": np.array([[1, 1, 0], [1, 3, 0]]), "src": _normal(2, 3)}),
    # scatter with duplicates: only the last write to an element has a derivative
    ("scatter", {"x": entry((4, 3), F64), "index": entry((3, 3), "int64", grad=False), "src": entry((3, 3), F64)},
     {"dim": 0}, {"x": _normal(4, 3), "index": np.array([[1, 2, 0], [3, 2, 0], [1, 0, 0]]), "src": _normal(3, 3)}),
    ("index_add", {"x": entry((3, 4), F64), "index": entry((3,), "int64", grad=False), "src": entry((3, 3), F64)},
     {"dim": 1}, {"x": _normal(3, 4), "index": np.array([2, 0, 2]), "src": _normal(3, 3)}),
    ("index_copy", {"x": entry((4, 3), F64), "index": entry((3,), "int64", grad=False), "src": entry((3, 3), F64)},
     {"dim": 0}, {"x": _normal(4, 3), "index": np.array([2, 0, 2]), "src": _normal(3, 3)}),
    ("gather_nd", {"x": entry((3, 4, 2), F64), "index": entry((2, 2, 2), "int64", grad=False)}, {},
     {"x": _normal(3, 4, 2), "index": np.array([[[0, 3], [2, 1]], [[0, 3], [1, 0]]])}),
    ("scatter_nd", {"x": entry((3, 2), F64), "index": entry((3, 1), "int64", grad=False), "src": entry((3, 2), F64)},
     {}, {"x": _normal(3, 2), "index": np.array([[2], [0], [2]]), "src": _normal(3, 2)}),
    ("index_put", {"x": entry((3, 2), F64), "index": entry((3, 2), "int64", grad=False), "src": entry((3,), F64)},
     {"accumulate": True}, {"x": _normal(3, 2), "index": np.array([[0, 1], [2, 1], [0, 1]]), "src": _normal(3)}),
    ("masked_fill", {"x": entry((3, 4), F64), "mask": entry((4,), "bool", grad=False)}, {"value": 2.5},
     {"x": _normal(3, 4), "mask": np.array([True, False, False, True])}),
    ("masked_scatter", {"x": entry((3, 4), F64), "mask": entry((4,), "bool", grad=False), "src": entry((8,), F64)},
     {}, {"x": _normal(3, 4), "mask": np.array([True, False, False, True]), "src": _normal(8)}),
    ("where", {"c": entry((3, 1), "bool", grad=False), "x": entry((3, 4), F64), "z": entry((4,), F64)}, {},
     {"c": np.array([[True], [False], [True]]), "x": _normal(3, 4), "z": _normal(4)}),
]


@pytest.mark.parametrize("op,inputs,attrs,data", FD_CASES, ids=[c[0] for c in FD_CASES])
def test_vjp_matches_finite_differences(op, inputs, attrs, data):
    expected = sum(v.size for v in data.values() if v.dtype == np.float64)
    assert _fd_check(op, inputs, attrs, data) == expected > 0


def test_gradients_do_not_read_the_values_they_zero():
    """dx of a lookup is zeros where nothing was looked up, even where x is infinite (zeros_like, not x * 0)."""
    graph_spec = one_node("gather", {"x": entry((1, 3), F64, ["R"]), "index": entry((1, 2), "int64", ["R"], False)},
                          {"dim": 1}, mesh=(1,))
    graph_spec["mesh"]["names"] = ["dp"]
    joint = analyze(load_spec(graph_spec), backward=True).graph
    env = execute_global(joint, {"x": np.array([[np.inf, 2.0, np.nan]]), "index": np.array([[1, 1]]),
                                 "cotangent/y": np.array([[0.5, 0.25]])})
    np.testing.assert_array_equal(env["grad/x"], [[0.0, 0.75, 0.0]])
