"""The strategies found missing against torch DTensor (issue 17), each on its exact example.

Each class: the combination is accepted as declared (no violation, no redistribution
that communicates), the lowered program holds no collective, and every rank's result,
assembled, equals one device, forward and backward.
"""

from __future__ import annotations

import pytest

from layout_prop.api import analyze
from layout_prop.loader import load_spec
from layout_prop.passes.lower import Lower
from layout_prop.runner import run_graph

MESHES = {(4,): ["tp"], (2, 2): ["dp", "tp"]}


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
