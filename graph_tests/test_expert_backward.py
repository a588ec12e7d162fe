"""The backward of expert-parallel experts moves the cotangent, not the expert weights.

In the forward of ``gen moe`` on an ``ep`` axis, the dispatched tokens are moved onto the
experts by an all-to-all, the experts run where their weights are, and the outputs go back to
the token slots by an all-to-all.  The cotangent of an expert's output arrives on the slots;
the einsum rule chose between re-cutting it onto the experts (an all-to-all: each rank sends
its own piece) and gathering the expert weight over ``ep`` (every rank receives all of it),
pricing both as a gather, so on a tie it gathered the weight, then reduce-scattered the
weight's gradient over ``ep`` as well (109,408 bytes a rank on the layer below, before).
"""

from __future__ import annotations

from layout_prop import DeviceMesh, Layout, TensorSpec
from layout_prop.api import analyze
from layout_prop.core.registry import get_rule
from layout_prop.frontends.generate import moe_spec
from layout_prop.io.loader import load_spec
from layout_prop.runner import run_graph

EXPERT_WEIGHTS = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")
MESH = (("dp", 1), ("ep", 4), ("tp", 2))


def _layer():
    return load_spec(moe_spec(1, mesh=MESH, capacity_factor=1.0, capacity_scope="global"))


def test_the_einsum_rule_recuts_the_cotangent_rather_than_gather_the_expert_weight():
    """'ech,efh->ecf' (the input gradient of an expert's down projection): the cotangent cut on
    the slots c, the weight on the experts e, both on ep=4.  Gathering the weight receives its
    3/4 (12,288 bytes); re-cutting the cotangent onto e sends 3/4 of a quarter of it (3,072)."""
    mesh = DeviceMesh((4,), ("ep",))
    cot = TensorSpec((4, 32, 32), "float32", Layout(mesh, ["S(1)"], 3))
    w = TensorSpec((4, 32, 32), "float32", Layout(mesh, ["S(0)"], 3))
    res = get_rule("einsum").infer_layout((cot, w), {"equation": "ech,efh->ecf"})
    assert [None if want is None else str(want) for want in res.wants] == ["(S(0))", None]
    assert str(res.outputs[0].layout) == "(S(0))"


def test_a_contracted_letter_still_gathers_rather_than_leave_a_partial_sum():
    """The all-to-all price applies when the letter stays in the output: cutting the contracted
    k of w (an all-to-all) would leave the product a partial sum, so x is gathered, as before."""
    mesh = DeviceMesh((2,), ("tp",))
    x = TensorSpec((4, 8), "float32", Layout(mesh, ["S(1)"], 2))
    w = TensorSpec((8, 6), "float32", Layout(mesh, ["S(1)"], 2))
    res = get_rule("matmul").infer_layout((x, w), {})
    assert [None if want is None else str(want) for want in res.wants] == ["(R)", None]
    assert str(res.outputs[0].layout) == "(S(1))"


def test_no_expert_weight_moves_on_ep_in_the_training_step():
    a = analyze(_layer(), reshard=True, backward=True)
    assert a.ok
    ep = [(r.input, s.kind) for r in a.check.redistributions for s in r.plan.steps
          if s.mesh_axis_name == "ep" and s.bytes_per_rank]
    assert not [m for m in ep if m[0] in EXPERT_WEIGHTS or m[0] in {f"grad/{w}" for w in EXPERT_WEIGHTS}]
    # each expert weight's gradient is reduced over tp only (its experts stay on their ep rank)
    for name in EXPERT_WEIGHTS:
        grads = [r for r in a.check.redistributions if r.node == f"grad/{name}"]
        assert grads and all(s.mesh_axis_name == "tp" for r in grads for s in r.plan.steps if s.bytes_per_rank)
    # half the bytes before the einsum rule re-cut cotangents, but for the fused gate_up_proj (Hugging Face's
    # layout) whose gradient is all-reduced on tp and sliced to its strided shard (4,096 bytes more than the
    # reduce-scatters of separate gate and up weights: the redistribution planner has no reduce-scatter into a
    # strided shard)
    assert a.check.total_bytes_per_rank < 109_408 // 2 + 4_096


def test_the_expert_parallel_training_step_matches_one_device():
    result = run_graph(_layer(), backward=True)
    assert result.ok, result.mismatches


def test_a_strided_shard_is_priced_as_the_gather_it_takes():
    """The redistribution never re-cuts a strided shard in place (it gathers it, then slices), so
    the all-to-all price is for plain shards only.  'bij,bjk->bik' on 4 ranks, x cut on the batch
    b, w a strided cut of its columns k: re-cutting w onto b gathers all of w (3/4 of 4,608 bytes
    a rank, and again for its gradient: 8,064 in the step), where gathering x and reduce-scattering
    its gradient moves 2 x 3/4 of 2,304 = 3,456 bytes."""
    mesh = DeviceMesh((4,), ("tp",))
    x = TensorSpec((6, 6, 12), "float32", Layout(mesh, ["S(0)"], 3))
    w = TensorSpec((6, 12, 16), "float32", Layout(mesh, ["_S(2,2)"], 3))
    res = get_rule("batch_matmul").infer_layout((x, w), {})
    assert [None if want is None else str(want) for want in res.wants] == ["(R)", None]
    spec = {"mesh": {"shape": [4], "names": ["tp"]},
            "inputs": {"x": {"shape": [6, 6, 12], "placements": ["S(0)"]},
                       "w": {"shape": [6, 12, 16], "placements": ["_S(2,2)"]}},
            "nodes": [{"name": "y", "op": "batch_matmul", "inputs": ["x", "w"]}], "outputs": ["y"]}
    a = analyze(load_spec(spec), reshard=True, backward=True)
    assert a.ok and a.check.total_bytes_per_rank == 3456
    assert run_graph(load_spec(spec), backward=True).ok


def test_the_fix_of_a_recut_operand_says_it_is_recut():
    """The cotangent, twice the weight, is re-cut onto the experts (a quarter of it moves, where
    gathering the weight moves 3/4 of it): the fix says so, not 'all-gather x0 (--reshard does:
    x1 is at least as large)', which was neither what --reshard does nor true."""
    mesh = DeviceMesh((4,), ("ep",))
    cot = TensorSpec((4, 64, 32), "float32", Layout(mesh, ["S(1)"], 3))
    w = TensorSpec((4, 32, 32), "float32", Layout(mesh, ["S(0)"], 3))
    res = get_rule("einsum").infer_layout((cot, w), {"equation": "ech,efh->ecf"})
    assert [None if want is None else str(want) for want in res.wants] == ["(S(0))", None]
    (v,) = res.violations
    assert v.hint.startswith("re-cut x0 to S(0) on 'ep' by an all-to-all (--reshard does: x1 stays in place), "
                             "or all-gather x1 on 'ep' instead"), v.hint
