"""torch's ``unbind``, ``chunk`` and ``split`` by their names: the output count follows the attrs
and the input shape, worked out when the graph is built (spec loader and ``Graph.op``).

Expected counts and piece sizes are worked out by hand from torch's documented semantics
(``chunk``: pieces of ceil(n / chunks), the last one smaller; ``split``: pieces of an int size
or of each listed size); numerical references are numpy slicing, never the kernels under test.
Every sharded run is compared with one device, forward and backward (``run_graph``).
"""

from __future__ import annotations

import numpy as np
import pytest

from layout_prop import DeviceMesh
from layout_prop.core.errors import LayoutPropError, SpecError
from layout_prop.core.graph import Graph
from layout_prop.core.registry import get_rule
from layout_prop.io.loader import load_spec
from layout_prop.runner import execute_global, random_inputs, run_graph
from layout_prop.api import analyze

# op, attrs, x shape, the pieces' [start, stop) along the cut dim, the cut dim (worked out by hand)
CASES = [
    ("unbind", {"dim": 0}, (3, 4), [(0, 1), (1, 2), (2, 3)], 0),  # the example: dim 0 of size 3
    ("unbind", {"dim": -1}, (4, 2, 5), [(i, i + 1) for i in range(5)], 2),
    ("chunk", {"chunks": 4}, (6, 4), [(0, 2), (2, 4), (4, 6)], 0),  # ceil(6/4) = 2: three chunks, not four
    ("chunk", {"chunks": 2, "dim": 1}, (4, 5), [(0, 3), (3, 5)], 1),
    ("chunk", {"chunks": 7}, (7, 2), [(i, i + 1) for i in range(7)], 0),
    ("split", {"split_size_or_sections": 3, "dim": 1}, (4, 7), [(0, 3), (3, 6), (6, 7)], 1),
    ("split", {"split_size_or_sections": [1, 0, 3, 2]}, (6, 4), [(0, 1), (1, 1), (1, 4), (4, 6)], 0),
    ("split", {"split_size": 2, "axis": 0}, (8, 2), [(0, 2), (2, 4), (4, 6), (6, 8)], 0),
]


def _spec(op, attrs, shape, placements, mesh=(2, 2)):
    """x -> mul by a weight (so the gradient is not trivial) -> op; the sum of squares of every piece."""
    names = ["dp", "tp"][:len(mesh)]
    return {"mesh": {"shape": list(mesh), "names": names},
            "inputs": {"x": {"shape": list(shape), "placements": placements},
                       "w": {"shape": list(shape), "placements": placements}},
            "nodes": [{"name": "h", "op": "mul", "inputs": ["x", "w"]},
                      {"name": "p", "op": op, "inputs": ["h"], "attrs": attrs}]}


@pytest.mark.parametrize("op, attrs, shape, bounds, dim", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_count_and_pieces_follow_torch(op, attrs, shape, bounds, dim):
    g = load_spec(_spec(op, attrs, shape, ["R", "R"]))
    node = g.node("p")
    assert node.num_outputs == len(bounds)
    analyze(g)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    env = execute_global(g, {"x": x, "w": np.ones(shape, np.float32)})
    for value, (lo, hi) in zip(node.outputs, bounds):
        want = np.take(x, range(lo, hi), axis=dim)
        if op == "unbind":
            want = np.squeeze(want, axis=dim)
        np.testing.assert_array_equal(env[value], want)


# sharded layouts on a 2 x 2 mesh: along the cut dim (an all-gather first), off it, both, and partial
LAYOUTS = [["S(0)", "S(1)"], ["S(1)", "R"], ["R", "S(0)"], ["S(1)", "S(0)"], ["R", "R"]]


@pytest.mark.parametrize("op, attrs, shape, bounds, dim", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_sharded_runs_equal_one_device_forward_and_backward(op, attrs, shape, bounds, dim):
    for placements in LAYOUTS:
        report = run_graph(load_spec(_spec(op, attrs, shape, placements)), backward=True, seed=3, verify=True)
        assert report.ok, (placements, report.mismatches)
        assert len(report.outputs) == len(bounds), placements  # every piece compared
        assert set(report.grads) >= {"x", "w"}, placements


def test_pieces_of_whole_strided_blocks_move_nothing():
    # x (2, 12) laid out _S(1,2): blocks of 6 columns; split into [6, 6] or chunk 2 keeps whole blocks, each S(1)
    for op, attrs in (("split", {"split_size_or_sections": 6, "dim": 1}), ("chunk", {"chunks": 2, "dim": 1})):
        spec = {"mesh": {"shape": [2], "names": ["tp"]}, "inputs": {"x": {"shape": [2, 12], "placements": ["_S(1,2)"]}},
                "nodes": [{"name": "p", "op": op, "inputs": ["x"], "attrs": attrs}]}
        g = load_spec(spec)
        result = analyze(g)
        assert not result.check.violations and not result.check.redistributions
        assert [str(s.layout) for s in g.node("p").meta["specs"]] == ["(S(1))", "(S(1))"]
        assert run_graph(load_spec(spec), backward=True, seed=1, verify=True).ok


def test_one_piece_is_one_output_named_like_the_node():
    spec = _spec("chunk", {"chunks": 1}, (4, 2), ["S(0)", "R"])
    spec["nodes"].append({"name": "y", "op": "add", "inputs": ["p", "p"]})
    g = load_spec(spec)
    assert g.node("p").outputs == ("p",)
    assert run_graph(load_spec(spec), backward=True, seed=2, verify=True).ok


def test_input_computed_by_other_nodes_and_nodes_out_of_order():
    # the count of u needs h's shape, which needs the matmul's: nodes written consumers first
    spec = {"mesh": {"shape": [2], "names": ["tp"]},
            "inputs": {"a": {"shape": [3, 4], "placements": ["R"]}, "b": {"shape": [4, 5], "placements": ["S(1)"]}},
            "nodes": [{"name": "y", "op": "add", "inputs": ["u:0", "u:4"]},
                      {"name": "u", "op": "unbind", "inputs": ["h"], "attrs": {"dim": 1}},
                      {"name": "h", "op": "matmul", "inputs": ["a", "b"]}],
            "outputs": ["y", "u:2"]}
    g = load_spec(spec)
    assert g.node("u").num_outputs == 5
    assert run_graph(load_spec(spec), backward=True, seed=4, verify=True).ok


def test_graph_op_derives_the_count():
    g = Graph(DeviceMesh((2,), ("tp",)))
    x = g.input("x", shape=(5, 3), placements=["S(1)"])
    pieces = g.op("s", "split", [x], {"split_size_or_sections": 2})
    assert pieces == ("s:0", "s:1", "s:2")  # 2, 2, 1
    assert g.op("c", "chunk", [x], {"chunks": 3, "dim": 1}) == ("c:0", "c:1", "c:2")
    assert g.op("y", "add", [pieces[0], pieces[1]]) == "y"  # other ops: one output, as before
    g.output("y", "s:2", "c:1")
    g.lint()
    assert run_graph(g, backward=True, seed=5, verify=True).ok


@pytest.mark.parametrize("op, attrs, code", [
    ("chunk", {"chunks": 0}, "invalid-split"),
    ("split", {"split_size_or_sections": [2, 2]}, "invalid-split"),  # sums to 4, not 6
    ("split", {"split_size_or_sections": 0}, "invalid-split"),
    ("unbind", {"dim": 2}, "invalid-dim"),
    ("chunk", {}, "bad-attr"),  # chunks is required
])
def test_attrs_that_give_no_count_are_refused_at_the_node(op, attrs, code):
    with pytest.raises(SpecError) as err:
        load_spec(_spec(op, attrs, (6, 3), ["R", "R"]))
    assert err.value.code == code
    assert err.value.path.startswith("nodes[1]") and err.value.node == "p"
    assert err.value.hint


def test_count_unknown_behind_a_rejected_node_follows_the_consumers():
    # h's reshape is invalid (12 elements into 10): propagation reports it, the unbind after it is skipped
    spec = {"mesh": {"shape": [2], "names": ["tp"]}, "inputs": {"x": {"shape": [3, 4]}},
            "nodes": [{"name": "h", "op": "reshape", "inputs": ["x"], "attrs": {"shape": [2, 5]}},
                      {"name": "u", "op": "unbind", "inputs": ["h"]},
                      {"name": "y", "op": "add", "inputs": ["u:0", "u:1"]}]}
    g = load_spec(spec)
    assert g.node("u").num_outputs == 2
    codes = [v.code for v in analyze(g).check.violations]
    assert codes == ["invalid-reshape"]


@pytest.mark.parametrize("old, new, attrs, shape", [
    ("unbind3", "unbind", {"dim": 1}, (2, 3, 2)),
    ("chunk3", "chunk", {"chunks": 3, "axis": 0}, (9, 2)),
    ("split2", "split", {"axis": 1}, (3, 4)),  # equal sections: 2 of 2
])
def test_deprecated_fixed_count_names_give_the_same_results(old, new, attrs, shape):
    old_attrs = {k: v for k, v in attrs.items() if k != "chunks"}
    new_attrs = dict(attrs, split_size_or_sections=2) if new == "split" else attrs
    envs = []
    for op, a in ((old, old_attrs), (new, new_attrs)):
        spec = _spec(op, a, shape, ["R", "S(0)"])
        g = load_spec(spec)
        analyze(g)
        inputs = random_inputs(g, seed=7)
        envs.append([execute_global(g, inputs)[v] for v in g.node("p").outputs])
        assert run_graph(load_spec(spec), backward=True, seed=7, verify=True).ok
    assert len(envs[0]) == len(envs[1])
    for a, b in zip(*envs):
        np.testing.assert_array_equal(a, b)


def test_torch_and_upstream_names_resolve():
    assert get_rule("unbind").name == get_rule("Unbind").name == get_rule("aten.unbind").name == "unbind"
    assert get_rule("torch.split").name == "split" and get_rule("aten.chunk").name == "chunk"
    assert get_rule("OneHotExt").name == "one_hot"
    assert get_rule("IsIn").name == "isin"
    assert get_rule("ScatterUpdate").name == "scatter_update" and get_rule("ArgMaxWithValue").name == "argmax_with_value"


def test_upstream_argmax_with_value_and_scatter_update_run():
    # ArgMaxWithValue: (index, value) along axis 1, checked against numpy; ScatterUpdate: x[index] = src on dim 0
    spec = {"mesh": {"shape": [2, 2], "names": ["dp", "tp"]},
            "inputs": {"x": {"shape": [4, 6], "placements": ["S(0)", "S(1)"]},
                       "t": {"shape": [5, 3], "placements": ["S(1)", "R"]},
                       "i": {"shape": [2], "dtype": "int64"}, "s": {"shape": [2, 3]}},
            "nodes": [{"name": "a", "op": "ArgMaxWithValue", "inputs": ["x"], "attrs": {"axis": 1}},
                      {"name": "u", "op": "ScatterUpdate", "inputs": ["t", "i", "s"]}]}
    g = load_spec(spec)
    analyze(g)
    x = np.array([[0, 5, 1, 2, 9, 3], [7, 1, 2, 3, 4, 5], [1, 1, 8, 1, 1, 1], [0, 0, 0, 0, 0, 6]], np.float32)
    t = np.zeros((5, 3), np.float32)
    s = np.arange(6, dtype=np.float32).reshape(2, 3)
    env = execute_global(g, {"x": x, "t": t, "i": np.array([3, 0]), "s": s})
    assert env["a:0"].tolist() == [4, 0, 2, 5] and env["a:1"].tolist() == [9, 7, 8, 6]
    assert env["u"].tolist() == [[3, 4, 5], [0, 0, 0], [0, 0, 0], [0, 1, 2], [0, 0, 0]]
    report = run_graph(load_spec(spec), backward=True, seed=6, verify=True)
    assert report.ok, report.mismatches


def test_upstream_alias_nodes_run():
    spec = {"mesh": {"shape": [2], "names": ["tp"]},
            "inputs": {"i": {"shape": [4], "dtype": "int64", "placements": ["S(0)"]},
                       "t": {"shape": [3], "dtype": "int64", "placements": ["R"]},
                       "x": {"shape": [2, 4], "placements": ["S(1)"]}},
            "nodes": [{"name": "o", "op": "OneHotExt", "inputs": ["i"], "attrs": {"num_classes": 8}},
                      {"name": "m", "op": "IsIn", "inputs": ["i", "t"]},
                      {"name": "u", "op": "Unbind", "inputs": ["x"]}]}
    g = load_spec(spec)
    assert [g.node(n).op for n in "omu"] == ["one_hot", "isin", "unbind"]
    assert run_graph(load_spec(spec), backward=True, seed=8, verify=True).ok


def test_unknown_op_hint_no_longer_offers_a_numbered_variant():
    with pytest.raises(LayoutPropError) as err:
        get_rule("unbnd")
    assert err.value.hint == "did you mean 'unbind'?"


def test_onnx_split_into_more_than_eight_pieces_imports_as_split():
    # before split by torch's name, an ONNX Split of 9 or more outputs had no op (split2..split8 only)
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    from layout_prop.frontends.onnx import from_onnx

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 12])
    outs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [4, None]) for i in range(10)]
    sizes = numpy_helper.from_array(np.array([1] * 9 + [3], np.int64), "sizes")
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Split", ["x", "sizes"], [f"y{i}" for i in range(10)], axis=1)], "g", [x], outs, [sizes]),
        opset_imports=[helper.make_opsetid("", 17)])
    assert onnx.checker.check_model(model) is None
    g = from_onnx(model, {"mesh": {"shape": [2], "names": ["tp"]}})
    (node,) = [n for n in g.nodes if not n.is_input]
    assert (node.op, node.num_outputs) == ("split", 10)
    assert run_graph(g, backward=True, seed=9, verify=True).ok
