"""A cotangent the backward moved back for an explicit ``redistribute`` is summed before it is moved.

The gradient of ``redistribute`` (ops/redistribute.py) moves the cotangent back to the layout its
primal had.  When that primal has another use, the backward pass adds the two cotangents; the add
then sliced the moved one back to the other's layout, and ``grad/NAME`` moved the sum again: on
``plan``'s layouts of the a100 Llama case (x replicated on tp, the first norm's input an explicit
``redistribute`` of x to S(1) on tp) x's cotangent from the norm was all-gathered on tp, sliced
for the add with the residual's, and the sum all-gathered again (22.1 us of 0.732 ms modelled).
The reshard pass now has the add read the norm's cotangent itself and drops the move
(passes/reshard.py, ``_Sweep._skip_vjp_move``).  Counts below are by hand: an all-gather over n
ranks sends (n - 1) local blocks, an all-reduce 2 (n - 1) / n of the buffer.
"""

from __future__ import annotations

import copy

from layout_prop.api import analyze
from layout_prop.frontends.generate import llama_spec
from layout_prop.io.loader import load_spec
from layout_prop.runner import run_graph

MINIMAL = """
mesh: {shape: [2, 4], names: [dp, tp]}
inputs:
  x: {shape: [2, 8, 16], placements: ["S(0)", R]}
  w: {shape: [16], placements: [R, R]}
nodes:
  - {name: xs, op: redistribute, inputs: [x], attrs: {placements: ["S(0)", "S(1)"]}}
  - {name: h, op: rms_norm, inputs: [xs, w], attrs: {eps: 1.0e-6}}
  - {name: y, op: add, inputs: [x, h]}
outputs: [y]
"""
# x: [2, 8, 16] float32 = 1024 bytes, 512 a dp rank, 128 a tp rank: x's gradient gathered on tp once
MINIMAL_X_GATHER = 3 * (2 * 8 * 16 * 4 // 2 // 4)
# w's gradient (P(sum) on dp and tp: each rank saw other tokens), 16 float32 = 64 bytes
MINIMAL_W_REDUCE = 2 * 1 * 64 // 2 + 2 * 3 * 64 // 4
MINIMAL_HAND_COUNT = MINIMAL_X_GATHER + MINIMAL_W_REDUCE


def _steps(check, prefix=""):
    return [(r.node, s.kind, s.mesh_axis_name, s.bytes_per_rank) for r in check.redistributions
            if r.node.startswith(prefix) for s in r.plan.steps if s.bytes_per_rank]


def test_the_minimal_hand_count():
    assert (MINIMAL_X_GATHER, MINIMAL_W_REDUCE, MINIMAL_HAND_COUNT) == (384, 160, 544)


def test_minimal_sum_moved_once():
    a = analyze(load_spec(MINIMAL), reshard=True, backward=True, verify=True)
    assert a.ok
    assert a.check.total_bytes_per_rank == MINIMAL_HAND_COUNT
    gathers = [s for s in _steps(a.check) if s[1] == "all-gather"]
    assert gathers == [("grad/x", "all-gather", "tp", MINIMAL_X_GATHER)]
    # the user's forward redistribute stays; the backward's move of the norm's cotangent is gone
    assert "xs" in a.graph and a.graph.node("xs").op == "redistribute"
    add = a.graph.node("grad/x/accadd1")
    assert all(a.graph.producer(v)[0].op != "redistribute" for v in add.inputs)


def test_minimal_runs_equal_to_one_device():
    rep = run_graph(load_spec(MINIMAL), backward=True, seed=3)
    assert rep.ok, rep.mismatches
    assert set(rep.grads) == {"x", "w"}


# ------------------------------------------------------------------ the a100 plan's layouts, small
MESH = (("dp", 2), ("sp", 1), ("tp", 4))


def _planned_llama() -> dict:
    """``gen llama`` (1 layer, seq 8, hidden 32, ffn 64, float64) in the layouts ``plan --objective
    time --cluster a100-80g`` chose for the a100 case (x S(0) on dp, replicated on tp; q, k, v
    column-parallel on tp; the MLP's weights sharded on dp; wo and the norms replicated), with
    the plan's explicit redistribute nodes."""
    spec = copy.deepcopy(llama_spec(1, mesh=MESH, dtype="float64"))
    placements = {"x": ["S(0)", "R", "R"], "input_layernorm": ["R", "R", "R"], "self_attn.q_proj": ["R", "R", "S(0)"],
                  "self_attn.k_proj": ["R", "R", "S(0)"], "self_attn.v_proj": ["R", "R", "S(0)"],
                  "self_attn.o_proj": ["R", "R", "R"], "post_attention_layernorm": ["R", "R", "R"],
                  "mlp.gate_proj": ["S(0)", "R", "R"], "mlp.up_proj": ["S(0)", "R", "R"],
                  "mlp.down_proj": ["S(1)", "R", "R"]}
    for name, pl in placements.items():
        spec["inputs"][name if name == "x" else f"model.layers.0.{name}.weight"]["placements"] = pl
    moves = [  # (move name, value moved, placements, the consumers that read it)
        ("l0_h/x", "x", ["S(0)", "R", "S(1)"], ["l0_h"]),
        ("l0_q/x", "l0_h", ["S(0)", "R", "R"], ["l0_q", "l0_k", "l0_v"]),
        ("l0_attn_bsnd/x", "l0_attn", ["S(0)", "R", "S(2)"], ["l0_attn_bsnd"]),
        ("l0_gate/x", "l0_h2", ["R", "R", "S(1)"], ["l0_gate", "l0_up"]),
        ("l0_out/y", "l0_down", ["S(0)", "R", "S(1)"], ["l0_out"]),
    ]
    nodes = spec["nodes"]
    for name, value, pl, readers in moves:
        first = min(i for i, n in enumerate(nodes) if n["name"] in readers)
        nodes.insert(first, {"name": name, "op": "redistribute", "inputs": [value], "attrs": {"placements": pl}})
        for n in nodes:
            if n["name"] in readers:
                n["inputs"] = [name if v == value else v for v in n["inputs"]]
    return spec


# x: [2, 8, 32] float64 = 4096 bytes, 2048 a dp rank, 512 a tp rank
ACT_GATHER_TP = 3 * (2 * 8 * 32 * 8 // 2 // 4)


def test_planned_llama_gathers_x_cotangent_once():
    a = analyze(load_spec(_planned_llama()), reshard=True, backward=True, verify=True)
    assert a.ok
    # the backward's only all-gather on tp: x's gradient, from the sum of the norm's and the residual's
    # cotangents (both S(1) on tp) to x's layout (R on tp); the forward gathers the norm's output once
    assert [s for s in _steps(a.check, "grad/") if s[1:3] == ("all-gather", "tp")] == [
        ("grad/x", "all-gather", "tp", ACT_GATHER_TP)]
    assert [s for s in _steps(a.check) if s[1:3] == ("all-gather", "tp")] == [
        ("l0_q/x", "all-gather", "tp", ACT_GATHER_TP), ("grad/x", "all-gather", "tp", ACT_GATHER_TP)]
    for name in ("l0_h/x", "l0_q/x", "l0_attn_bsnd/x", "l0_gate/x", "l0_out/y"):  # the plan's own moves stay
        assert a.graph.node(name).op == "redistribute"


def test_planned_llama_runs_equal_to_one_device():
    rep = run_graph(load_spec(_planned_llama()), backward=True, seed=2)
    assert rep.ok, rep.mismatches
    assert len(rep.grads) == 10  # x, the two norm weights, the seven matrices
