"""The strategies found missing against torch DTensor (issue 17), each on its exact example.

Each class: the combination is accepted as declared (no violation, no redistribution
that communicates), the lowered program holds no collective, and every rank's result,
assembled, equals one device, forward and backward.
"""

from __future__ import annotations

import pytest

from layout_prop.api import analyze
from layout_prop.io.loader import load_spec
from layout_prop.passes.lower import Lower
from layout_prop.runner import run_graph

MESHES = {(2,): ["tp"], (4,): ["tp"], (2, 2): ["dp", "tp"]}


def one_node(mesh, inputs: dict, op: str, attrs: dict | None = None) -> dict:
    return {"mesh": {"shape": list(mesh), "names": MESHES[tuple(mesh)]},
            "inputs": {name: {"shape": list(shape), "placements": list(ps)} for name, (shape, ps) in inputs.items()},
            "nodes": [{"name": "out", "op": op, "inputs": list(inputs), "attrs": attrs or {}}],
            "outputs": ["out"]}


def assert_free_and_exact(spec: dict, out_placements: list[str], backward: bool = True) -> None:
    """Accepted as declared, no collective in the forward, one-device agreement forward and backward."""
    analysis = analyze(load_spec(spec))
    assert analysis.ok, [str(v) for v in analysis.check.violations]
    assert analysis.report()["tensors"]["out"]["placements"] == out_placements
    program = Lower().run(analysis.graph).program
    assert program.collectives == [], [op.op for op in program.collectives]
    report = run_graph(load_spec(spec), backward=backward, seed=1)  # the backward may need to communicate
    assert report.ok and report.outputs and (report.grads or not backward), report.mismatches
    forward = [c for c in report.collectives if not c["node"].startswith("grad/")]
    assert forward == []


# ------------------------------------------------------------------ 1. R next to P in a linear op
ADD_CASES = [
    # (mesh, x, y): add with broadcasting and uneven shards (10 rows on 4 ranks: 3, 3, 3, 1)
    ((4,), ((10, 7), ["P(sum)"]), ((7,), ["R"]), ["P(sum)"]),
    ((4,), ((7,), ["R"]), ((10, 7), ["P(sum)"]), ["P(sum)"]),
    ((4,), ((10, 1, 7), ["P(sum)"]), ((5, 7), ["R"]), ["P(sum)"]),
    ((2, 2), ((10, 7), ["S(0)", "P(sum)"]), ((7,), ["R", "R"]), ["S(0)", "P(sum)"]),
    ((2, 2), ((5, 7), ["P(sum)", "S(1)"]), ((5, 1), ["R", "R"]), ["P(sum)", "S(1)"]),
    ((2, 2), ((3, 5), ["P(sum)", "P(sum)"]), ((5,), ["R", "R"]), ["P(sum)", "P(sum)"]),
    ((2, 2), ((9, 5), ["P(avg)", "S(0)"]), ((9, 1), ["R", "S(0)"]), ["P(avg)", "S(0)"]),
]


@pytest.mark.parametrize("op", ["add", "sub"])
@pytest.mark.parametrize("mesh, x, y, out", ADD_CASES)
def test_replicate_beside_partial_in_add_needs_no_communication(op, mesh, x, y, out):
    spec = one_node(mesh, {"x": x, "y": y}, op)
    assert_free_and_exact(spec, out)
    # the Replicate operand is moved by a free local-partial step, shown in the plan
    redistributions = analyze(load_spec(spec)).report()["redistributions"]
    assert {s["kind"] for r in redistributions for s in r["steps"]} == {"local-partial"}
    assert all(r["bytes_per_rank"] == 0 for r in redistributions)


def test_concat_of_partial_and_replicate_needs_no_communication():
    spec = one_node((2, 2), {"x": ((5, 3), ["P(sum)", "S(1)"]), "y": ((2, 3), ["R", "R"])}, "concat", {"axis": 0})
    assert_free_and_exact(spec, ["P(sum)", "S(1)"])


# ------------------------------------------------------------------ 3. a norm's param sharded or Partial
NORM_CASES = [
    # (mesh, x placements, weight placements, output placements); x (3, 10): 10 on 4 ranks is 3, 3, 3, 1
    ((4,), ["R"], ["S(0)"], ["S(1)"]),
    ((4,), ["R"], ["P(sum)"], ["P(sum)"]),
    ((4,), ["R"], ["P(avg)"], ["P(avg)"]),
    ((2, 2), ["S(0)", "R"], ["R", "S(0)"], ["S(0)", "S(1)"]),
    ((2, 2), ["R", "R"], ["S(0)", "S(0)"], ["S(1)", "S(1)"]),
    ((2, 2), ["R", "S(0)"], ["P(sum)", "R"], ["P(sum)", "S(0)"]),
]


@pytest.mark.parametrize("mesh, x, w, out", NORM_CASES)
def test_rms_norm_with_a_sharded_or_partial_weight_needs_no_communication(mesh, x, w, out):
    assert_free_and_exact(one_node(mesh, {"x": ((3, 10), x), "weight": ((10,), w)}, "rms_norm"), out)


@pytest.mark.parametrize("mesh, x, w, out", NORM_CASES)
def test_layer_norm_with_a_sharded_or_partial_weight_needs_no_communication(mesh, x, w, out):
    # the bias is Replicate: sliced like the weight, or made terms of its Partial (local-partial)
    bias = [["R"]] if len(mesh) == 1 else [["R", "R"]]
    spec = one_node(mesh, {"x": ((3, 10), x), "weight": ((10,), w), "bias": ((10,), bias[0])}, "layer_norm")
    assert_free_and_exact(spec, out)


def test_layer_norm_partial_bias_beside_a_replicate_weight():
    spec = one_node((4,), {"x": ((3, 10), ["R"]), "weight": ((10,), ["R"]), "bias": ((10,), ["P(sum)"])},
                    "layer_norm")
    assert_free_and_exact(spec, ["P(sum)"])


def test_norm_weight_sharded_where_x_is_sharded_still_gathers():
    # x shards rows on tp: no rank holds whole rows of another rank's weight chunk
    spec = one_node((4,), {"x": ((8, 10), ["S(0)"]), "weight": ((10,), ["S(0)"])}, "rms_norm")
    violations = analyze(load_spec(spec)).check.violations
    assert [(v.code, v.operand, v.fixable) for v in violations] == [("sharded-normalized-dim", "weight", True)]
    assert run_graph(load_spec(spec), backward=True, seed=0).ok


# ------------------------------------------------------------------ 2. strided shards from reshapes
RESHAPE_CASES = [
    # (mesh, x shape, x placements, target shape, output placements)
    ((4,), (2, 16, 16), ["S(1)"], [32, 16], ["_S(0,2)"]),  # the example
    ((2, 2), (2, 16, 16), ["R", "S(1)"], [32, 16], ["R", "_S(0,2)"]),
    ((2, 2), (2, 16, 16), ["S(1)", "S(1)"], [32, 16], ["_S(0,2)", "_S(0,2)"]),  # doubly sharded
    ((2, 2), (2, 16, 16), ["S(1)", "S(0)"], [32, 16], ["_S(0,2)", "S(0)"]),
    ((4,), (2, 10, 16), ["S(1)"], [20, 16], ["_S(0,2)"]),  # uneven: 10 rows on 4 ranks are 3, 3, 3, 1
    ((4,), (3, 6, 4), ["S(1)"], [18, 4], ["_S(0,3)"]),  # uneven: 6 on 4 are 2, 2, 2, 0
    ((2, 2), (2, 5, 16), ["S(2)", "S(1)"], [10, 16], ["S(1)", "_S(0,2)"]),
]


@pytest.mark.parametrize("mesh, shape, placements, target, out", RESHAPE_CASES)
def test_reshape_merging_a_sharded_inner_dim_is_a_strided_shard(mesh, shape, placements, target, out):
    spec = one_node(mesh, {"x": (shape, placements)}, "reshape", {"shape": target})
    assert_free_and_exact(spec, out)


def test_strided_shard_flows_through_elementwise_and_transpose_and_back():
    spec = {"mesh": {"shape": [4], "names": ["tp"]},
            "inputs": {"x": {"shape": [2, 10, 16], "placements": ["S(1)"]}, "b": {"shape": [16], "placements": ["R"]},
                       "g": {"shape": [20, 1], "placements": ["R"]}},
            "nodes": [{"name": "y", "op": "reshape", "inputs": ["x"], "attrs": {"shape": [20, 16]}},
                      {"name": "z", "op": "add", "inputs": ["y", "b"]},  # b broadcasts along the strided dim
                      {"name": "s", "op": "mul", "inputs": ["z", "g"]},  # g is sliced alike for free
                      {"name": "t", "op": "transpose", "inputs": ["s"], "attrs": {"dims": [1, 0]}},
                      {"name": "e", "op": "silu", "inputs": ["t"]},
                      {"name": "u", "op": "transpose", "inputs": ["e"], "attrs": {"dims": [1, 0]}},
                      {"name": "out", "op": "reshape", "inputs": ["u"], "attrs": {"shape": [2, 10, 16]}}],
            "outputs": ["out"]}
    analysis = analyze(load_spec(spec))
    tensors = analysis.report()["tensors"]
    assert [tensors[v]["placements"] for v in ("y", "z", "s", "t", "e", "u", "out")] == [
        ["_S(0,2)"], ["_S(0,2)"], ["_S(0,2)"], ["_S(1,2)"], ["_S(1,2)"], ["_S(0,2)"], ["S(1)"]]
    assert tensors["t"]["tensor_map"] is None  # MindSpore's tensor_map has no strided shard
    from layout_prop.api import format_table

    row = next(line for line in format_table(analysis).splitlines() if line.startswith("t "))
    assert row.split()[4:7] == ["(_S(1,2))", "none", "(strided)"] and "None" not in row
    assert_free_and_exact(spec, ["S(1)"])


def test_strided_placement_in_specs_and_tensor_map():
    from layout_prop import DeviceMesh, Layout, LayoutError, LayoutPropError

    spec = one_node((2,), {"x": ((6, 2), ["_S(0,2)"])}, "identity")
    assert_free_and_exact(spec, ["_S(0,2)"])
    layout = Layout(DeviceMesh((2,), ("tp",)), ["_S(-2, 2)"], 2)
    assert str(layout) == "(_S(0,2))"
    with pytest.raises(LayoutError) as info:
        layout.tensor_map()
    assert info.value.code == "unsupported-layout" and "_S(0,2)" in info.value.message
    bad = one_node((2,), {"x": ((6, 2), ["_S(0,4)"])}, "identity")  # 6 rows do not make 4 blocks
    with pytest.raises(LayoutPropError) as info:
        load_spec(bad)
    assert info.value.code == "invalid-layout" and "do not divide into 4 blocks" in info.value.message


# ------------------------------------------------------------------ 4. where DTensor fails outright
def assert_fixed_by_reshard(spec: dict, codes: list[str]) -> None:
    """A documented, fixable violation, and the resharded run matches one device forward and backward."""
    found = analyze(load_spec(spec)).check.violations
    assert sorted(v.code for v in found) == sorted(codes) and all(v.fixable for v in found), [str(v) for v in found]
    report = run_graph(load_spec(spec), backward=True, seed=2)
    assert report.ok and report.outputs and report.grads, report.mismatches
    assert report.collectives  # the fix communicates


def test_rms_norm_over_a_partial_average_is_reduced_first():
    # DTensor raises on an in-place add for rms_norm over a P(avg) input
    for mesh, x in [((4,), ["P(avg)"]), ((2, 2), ["S(0)", "P(avg)"])]:
        w = ["R"] * len(mesh)
        assert_fixed_by_reshard(one_node(mesh, {"x": ((4, 10), x), "weight": ((10,), w)}, "rms_norm"),
                                ["partial-input"])


def test_matmul_on_a_strided_shard_cuts_the_other_operand_alike():
    # DTensor raises "Cannot unflatten" for a matmul of a _StridedShard operand: here rows stay strided,
    # a strided contracted letter cuts the weight alike and leaves a partial sum, both without communication
    rows = one_node((4,), {"x": ((32, 16), ["_S(0,2)"]), "w": ((16, 8), ["R"])}, "matmul")
    assert_free_and_exact(rows, ["_S(0,2)"])
    inner = one_node((4,), {"x": ((8, 32), ["_S(1,2)"]), "w": ((32, 6), ["R"])}, "matmul")
    assert_free_and_exact(inner, ["P(sum)"])
    # a strided letter that the other operand shards plainly: one of them is moved
    clash = one_node((4,), {"x": ((8, 32), ["_S(1,2)"]), "w": ((32, 6), ["S(0)"])}, "matmul")
    assert_fixed_by_reshard(clash, ["sharding-mismatch"])


def test_reshape_of_doubly_sharded_uneven_dims_is_a_violation_or_exact():
    # DTensor raises "invalid for size" on reshapes of doubly sharded dims; here: exact or gathered
    assert_free_and_exact(one_node((2, 2), {"x": ((4, 6, 8), ["S(1)", "S(1)"])}, "reshape", {"shape": [24, 8]}),
                          ["_S(0,4)", "_S(0,4)"])  # 6 -> 3, 3 -> 2, 1: each rank keeps its rows of 4 blocks
    assert_fixed_by_reshard(one_node((2, 2), {"x": ((3, 4, 6), ["S(0)", "S(0)"])}, "reshape", {"shape": [12, 6]}),
                            ["reshape-sharded-dim", "reshape-sharded-dim"])


def test_norm_and_softmax_keep_a_strided_shard_of_their_rows():
    # tokens flattened with the sequence sharded (sequence parallel): row-wise ops stay local
    spec = {"mesh": {"shape": [4], "names": ["tp"]},
            "inputs": {"x": {"shape": [2, 10, 16], "placements": ["S(1)"]}, "w": {"shape": [16], "placements": ["R"]}},
            "nodes": [{"name": "y", "op": "reshape", "inputs": ["x"], "attrs": {"shape": [20, 16]}},
                      {"name": "n", "op": "rms_norm", "inputs": ["y", "w"]},
                      {"name": "s", "op": "softmax", "inputs": ["n"]},
                      {"name": "out", "op": "reshape", "inputs": ["s"], "attrs": {"shape": [2, 10, 16]}}],
            "outputs": ["out"]}
    tensors = analyze(load_spec(spec)).report()["tensors"]
    assert [tensors[v]["placements"] for v in ("y", "n", "s")] == [["_S(0,2)"]] * 3
    assert_free_and_exact(spec, ["S(1)"])
