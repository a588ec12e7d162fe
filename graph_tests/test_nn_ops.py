"""The nn ops: layout rules with hand-written expectations, every violation code and its
message, finite-difference checks of every numpy backward (float64), the vjp rules through
the backward pass, and end-to-end runs (propagate, reshard, backward, lower, simulate).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from layout_prop import DeviceMesh, Layout, TensorSpec
from layout_prop.api import analyze
from layout_prop.kernels import nn_numpy
from layout_prop.io.loader import load_spec
from layout_prop.ops import nn
from layout_prop.passes.backward import Backward
from layout_prop.passes.propagate import Propagate
from layout_prop.core.registry import get_rule, registered_ops
from layout_prop.runner import execute_global, run_graph

DP_TP = DeviceMesh((2, 2), ("dp", "tp"))
DP_SP = DeviceMesh((2, 2), ("dp", "sp"))


def spec(shape, placements, mesh=DP_TP, dtype="float32") -> TensorSpec:
    return TensorSpec(shape, dtype, Layout(mesh, placements, len(shape)))


def infer(op, *inputs, **attrs):
    rule = get_rule(op)
    return rule.infer_layout(tuple(inputs), rule.normalize_attrs(attrs))


def layouts(result) -> list[str | None]:
    return [None if s is None else str(s.layout) for s in result.outputs]


def wants(result) -> list[str | None]:
    return [None if w is None else str(w) for w in result.wants]


def codes(result) -> list[tuple[str, str]]:
    return [(v.code, v.operand) for v in result.violations]


def only(result, code: str):
    found = [v for v in result.violations if v.code == code]
    assert len(found) == 1, codes(result)
    return found[0]


# ============================================================================ aliases
@pytest.mark.parametrize("alias, name", [
    ("RmsNorm", "rms_norm"), ("npu_rms_norm", "rms_norm"), ("LayerNorm", "layer_norm"), ("Softmax", "softmax"),
    ("LogSoftmax", "log_softmax"), ("FlashAttentionScore", "flash_attention_score"),
    ("npu_fusion_attention", "flash_attention_score"), ("sdpa", "scaled_dot_product_attention"),
    ("npu_swiglu", "swiglu"), ("Swiglu", "swiglu"), ("SiLU", "silu"), ("GeLU", "gelu"), ("Exp", "exp"),
    ("Div", "div"), ("Cast", "cast"), ("Muls", "scale"),
])
def test_aliases_resolve(alias, name):
    assert get_rule(alias).name == name


def test_every_violation_code_is_documented_in_the_module_docstring():
    documented = set(re.findall(r"^- ``([a-z-]+)``", nn.__doc__, flags=re.M))
    nn_rules = [r for r in registered_ops().values() if type(r).__module__ == nn.__name__]
    assert len(nn_rules) == 21
    for rule in nn_rules:
        assert set(rule.violation_codes) <= documented, (rule.name, set(rule.violation_codes) - documented)


# ============================================================================ attention
QKV = (2, 4, 8, 16)


def test_attention_batch_and_heads_sharded_stay():
    q = spec(QKV, ["S(0)", "S(1)"])
    res = infer("sdpa", q, q, q)
    assert layouts(res) == ["(S(0), S(1))"]
    assert res.outputs[0].shape == QKV
    assert res.violations == () and wants(res) == [None, None, None]


def test_attention_bsnd_heads_are_dim_2():
    q = spec((2, 8, 4, 16), ["S(0)", "S(2)"])
    res = infer("sdpa", q, q, q, layout="BSND")
    assert layouts(res) == ["(S(0), S(2))"] and res.violations == ()


def test_attention_replicated_kv_is_sliced_like_q_for_free():
    q = spec(QKV, ["S(0)", "S(1)"])
    kv = spec(QKV, ["R", "R"])
    res = infer("sdpa", q, kv, kv)
    assert res.violations == ()
    assert wants(res) == [None, "(S(0), S(1))", "(S(0), S(1))"]


def test_attention_output_takes_v_head_dim():
    q, k = spec((2, 4, 8, 16), ["S(0)", "R"]), spec((2, 4, 6, 16), ["S(0)", "R"])
    v = spec((2, 4, 6, 5), ["S(0)", "R"])
    res = infer("sdpa", q, k, v)
    assert res.outputs[0].shape == (2, 4, 8, 5) and layouts(res) == ["(S(0), R)"]


def test_causal_attention_with_query_sequence_sharded():
    q = spec(QKV, ["S(0)", "S(2)"], DP_SP)
    kv = spec(QKV, ["S(0)", "R"], DP_SP)
    rule = get_rule("sdpa")
    attrs = rule.normalize_attrs({"causal": True})
    res = rule.infer_layout((q, kv, kv), attrs)
    assert layouts(res) == ["(S(0), S(2))"] and res.violations == ()
    # rank = 2 * dp + sp; a rank holds query rows [4 * sp, 4 * sp + 4)
    assert [rule.localize(attrs, (q, kv, kv), res.outputs, r)["q_offset"] for r in range(4)] == [0, 4, 0, 4]
    shifted = dict(attrs, q_offset=3)
    assert [rule.localize(shifted, (q, kv, kv), res.outputs, r)["q_offset"] for r in range(4)] == [3, 7, 3, 7]


def test_q_offset_follows_uneven_chunks():
    mesh = DeviceMesh((4,), ("sp",))
    q = spec((1, 2, 5, 4), ["S(2)"], mesh)
    kv = spec((1, 2, 5, 4), ["R"], mesh)
    rule = get_rule("sdpa")
    attrs = rule.normalize_attrs({"causal": True})
    res = rule.infer_layout((q, kv, kv), attrs)
    # torch.chunk of 5 rows in 4: [0, 2), [2, 4), [4, 5), [5, 5)
    assert [rule.localize(attrs, (q, kv, kv), res.outputs, r)["q_offset"] for r in range(4)] == [0, 2, 4, 5]


def test_q_offset_bsnd_reads_dim_1():
    mesh = DeviceMesh((2,), ("sp",))
    q = spec((1, 6, 2, 4), ["S(1)"], mesh)
    kv = spec((1, 6, 2, 4), ["R"], mesh)
    rule = get_rule("sdpa")
    attrs = rule.normalize_attrs({"causal": True, "layout": "BSND"})
    res = rule.infer_layout((q, kv, kv), attrs)
    assert [rule.localize(attrs, (q, kv, kv), res.outputs, r)["q_offset"] for r in range(2)] == [0, 3]


def test_attention_grad_with_query_sequence_sharded_gives_partial_dk_dv():
    q = spec(QKV, ["S(0)", "S(2)"], DP_SP)
    kv = spec(QKV, ["S(0)", "R"], DP_SP)
    res = infer("scaled_dot_product_attention_grad", q, q, kv, kv, causal=True)
    assert res.violations == ()
    assert layouts(res) == ["(S(0), S(2))", "(S(0), P(sum))", "(S(0), P(sum))"]


def test_attention_grad_partial_cotangent_passes_where_q_is_replicated():
    q = spec(QKV, ["S(0)", "R"])
    dy = spec(QKV, ["S(0)", "P(sum)"])
    res = infer("scaled_dot_product_attention_grad", dy, q, q, q)
    assert res.violations == () and wants(res)[0] is None
    assert layouts(res) == ["(S(0), P(sum))"] * 3


def test_sharded_kv_sequence_is_a_violation_fixed_by_an_all_gather():
    q = spec(QKV, ["S(0)", "S(2)"], DP_SP)
    res = infer("sdpa", q, q, q, causal=True)
    k_violation, v_violation = res.violations
    assert (k_violation.code, k_violation.operand, k_violation.fixable) == ("sharded-kv-sequence", "k", True)
    assert v_violation.operand == "v"
    assert k_violation.message == ("k's sequence dim 2 (S, size 8) is sharded on mesh axis 'sp' (k is (S(0), S(2))); "
                                   "every query row attends to the whole key/value sequence")
    assert k_violation.hint == "all-gather k on 'sp'; to split the sequence, shard q's sequence dim 2 instead"
    assert wants(res) == [None, "(S(0), R)", "(S(0), R)"]
    graph = load_spec({"mesh": {"shape": [2, 2], "names": ["dp", "sp"]},
                       "inputs": {n: {"shape": list(QKV), "placements": ["S(0)", "S(2)"]} for n in "qkv"},
                       "nodes": [{"name": "o", "op": "sdpa", "inputs": ["q", "k", "v"], "attrs": {"causal": True}}]})
    fixed = analyze(graph, reshard=True)
    assert fixed.ok
    moves = [(r.input, [(s.kind, s.mesh_axis_name) for s in r.plan.steps]) for r in fixed.check.redistributions]
    assert moves == [("k", [("all-gather", "sp")]), ("v", [("all-gather", "sp")])]


def test_sharded_head_dim_on_q_and_v():
    q = spec(QKV, ["R", "S(3)"])
    res = infer("sdpa", q, spec(QKV, ["R", "R"]), spec(QKV, ["S(3)", "R"]))
    assert codes(res) == [("sharded-head-dim", "q"), ("sharded-head-dim", "v")]
    q_v, v_v = res.violations
    assert q_v.message == ("q dim 3 (size 16) is sharded on mesh axis 'tp' (q is (R, S(3))), but attention contracts "
                           "over whole heads")
    assert v_v.message == ("v's head dim 3 (D, size 16) is sharded on mesh axis 'dp' (v is (S(3), R)); attention "
                           "contracts over whole heads")
    assert layouts(res) == ["(R, R)"] and wants(res) == ["(R, R)", None, "(R, R)"]


def test_kv_sharded_where_q_is_not_is_a_mismatch():
    q = spec(QKV, ["R", "R"])
    k = spec(QKV, ["S(0)", "R"])
    res = infer("sdpa", q, k, q)
    v = only(res, "sharding-mismatch")
    assert v.operand == "k" and v.fixable
    assert v.message == ("k's dim 0 (B, size 2) is sharded on mesh axis 'dp' but q does not shard B or N there "
                         "(q is (R, R), k is (S(0), R)); k and v follow q's B and N sharding")


def test_kv_sharding_another_dim_than_q_is_a_mismatch():
    q = spec(QKV, ["S(1)", "R"])
    k = spec(QKV, ["S(0)", "R"])
    v = only(infer("sdpa", q, k, q), "sharding-mismatch")
    assert "k's dim 0 (B, size 2) is sharded on mesh axis 'dp' but q shards its dim 1 there" in v.message


def test_partial_attention_inputs():
    q = spec(QKV, ["P(sum)", "R"])
    res = infer("sdpa", q, spec(QKV, ["R", "R"]), spec(QKV, ["R", "P(sum)"]))
    assert codes(res) == [("partial-input", "q"), ("partial-input", "v")]
    assert res.violations[0].message == ("q is P(sum) on mesh axis 'dp' (q is (P(sum), R)): "
                                         "scaled_dot_product_attention is not linear in it, so every rank needs the "
                                         "whole value")
    assert "v is P(sum) on mesh axis 'tp'" in res.violations[1].message
    assert wants(res) == ["(R, R)", None, "(R, R)"]


@pytest.mark.parametrize("shapes, message", [
    ([(2, 4, 8, 16), (2, 3, 8, 16), (2, 3, 8, 16)],  # (2 kv heads for 4 query heads is grouped-query attention)
     "q has 4 heads but k and v have 3 (dim 1; q [2, 4, 8, 16], k [2, 3, 8, 16], v [2, 3, 8, 16]): grouped-query "
     "attention needs q's head count to be a multiple of k's and v's"),
    ([(2, 4, 8, 16), (2, 4, 8, 8), (2, 4, 8, 16)],
     "k's D (dim 3) is 8 but q's is 16 (q [2, 4, 8, 16], k [2, 4, 8, 8], v [2, 4, 8, 16])"),
    ([(2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 6, 16)],
     "v's S (dim 2) is 6 but k's is 8 (q [2, 4, 8, 16], k [2, 4, 8, 16], v [2, 4, 6, 16])"),
    # 3-D (N, L, E) q, k, v are torch's one-head form, taken since 122d421; rank 2 is still refused
    ([(8, 16), (8, 16), (8, 16)],
     "q has rank 2 (shape [8, 16]); attention takes q, k, v all 4-D (BNSD or BSND) or all 3-D (N, L, E)"),
])
def test_attention_invalid_shapes(shapes, message):
    ins = [spec(s, ["R", "R"]) for s in shapes]
    res = infer("sdpa", *ins)
    assert res.outputs == (None,)
    assert res.violations[0].code == "invalid-shape" and res.violations[0].message == message
    assert not res.violations[0].fixable


@pytest.mark.parametrize("attrs, code, message", [
    ({"layout": "SBH"}, "invalid-input-layout", "attention layout 'SBH' is not one of ['BNSD', 'BSND']"),
    ({"causal": 1}, "invalid-attr", "causal=1 is not a bool"),
    ({"scale": "big"}, "invalid-attr", "scale='big' is not a number"),
    ({"q_offset": -1}, "invalid-attr", "q_offset=-1 is not a non-negative integer"),
])
def test_attention_invalid_attrs(attrs, code, message):
    q = spec(QKV, ["R", "R"])
    res = infer("sdpa", q, q, q, **attrs)
    assert [(v.code, v.message) for v in res.violations] == [(code, message)]
    assert res.outputs == (None,)


# ============================================================================ norms
X3 = (4, 6, 8)


def test_rms_norm_other_dims_shard_freely_and_weight_grad_is_partial():
    x = spec(X3, ["S(0)", "S(1)"], DP_SP)
    w = spec((8,), ["R", "R"], DP_SP)
    res = infer("rms_norm", x, w)
    assert layouts(res) == ["(S(0), S(1))"] and res.violations == () and wants(res) == [None, None]
    grad = infer("rms_norm_grad", x, x, w)
    assert grad.violations == ()
    assert layouts(grad) == ["(S(0), S(1))", "(P(sum), P(sum))"]


def test_rms_norm_sharded_normalized_dim():
    x = spec(X3, ["S(0)", "S(2)"])
    res = infer("rms_norm", x, spec((8,), ["R", "R"]))
    v = only(res, "sharded-normalized-dim")
    assert (v.operand, v.fixable) == ("x", True)
    assert v.message == ("x dim 2 (size 8) is sharded on mesh axis 'tp' (x is (S(0), S(2))), but rms_norm normalises "
                         "over x's last 1 dim(s) [2] and needs them whole on every rank")
    assert v.hint == "all-gather x on 'tp', or shard a dim outside [2] of x instead"
    assert layouts(res) == ["(S(0), R)"] and wants(res) == ["(S(0), R)", None]


def test_rms_norm_over_two_dims():
    w = spec((6, 8), ["R", "R"])
    res = infer("rms_norm", spec(X3, ["S(0)", "S(1)"]), w, normalized_ndim=2)
    assert "x dim 1 (size 6) is sharded on mesh axis 'tp'" in only(res, "sharded-normalized-dim").message
    assert "over x's last 2 dim(s) [1, 2]" in res.violations[0].message
    ok = infer("rms_norm", spec(X3, ["S(0)", "R"]), w, normalized_ndim=2)
    assert ok.violations == () and layouts(ok) == ["(S(0), R)"]


def test_norm_weight_sharded_or_partial():
    x = spec(X3, ["S(0)", "R"])
    # where x is Replicate (tp) the weight may be sharded: the output is sharded on the normalised dim
    ok = infer("rms_norm", x, spec((8,), ["R", "S(0)"]))
    assert ok.violations == () and layouts(ok) == ["(S(0), S(2))"] and wants(ok) == [None, None]
    # where x shards rows (dp) the weight must be whole
    res = infer("rms_norm", x, spec((8,), ["S(0)", "R"]))
    v = only(res, "sharded-normalized-dim")
    assert v.operand == "weight"
    assert v.message == ("weight dim 0 (size 8) is sharded on mesh axis 'dp' (weight is (S(0), R)); weight spans "
                         "x's normalised dims [2] and x is S(0) on 'dp', so every rank there needs the whole weight "
                         "(a param may be sharded or Partial only on a mesh axis where x is Replicate)")
    assert v.hint == "give weight R on 'dp' (all-gather it)" and wants(res) == [None, "(R, R)"]
    res = infer("layer_norm", x, spec((8,), ["R", "R"]), spec((8,), ["P(sum)", "R"]))
    v = only(res, "partial-input")
    assert v.operand == "bias"
    assert v.message.startswith("bias is P(sum) on mesh axis 'dp' (bias is (P(sum), R)): layer_norm is not linear "
                                "in bias that way: x is S(0) on 'dp'")
    # a Partial bias and a sharded weight on one axis: the weight decides, the bias must be sliced like it
    res = infer("layer_norm", spec(X3, ["R", "R"]), spec((8,), ["S(0)", "R"]), spec((8,), ["P(sum)", "R"]))
    v = only(res, "partial-input")
    assert "x is R and the output S(2) on 'dp', so bias must be S(0) there" in v.message
    assert layouts(res) == ["(S(2), R)"] and wants(res) == [None, None, "(S(0), R)"]


def test_norm_partial_x():
    res = infer("layer_norm", spec(X3, ["P(sum)", "S(1)"]), spec((8,), ["R", "R"]), spec((8,), ["R", "R"]))
    v = only(res, "partial-input")
    assert v.operand == "x" and v.fixable
    assert v.message == ("x is P(sum) on mesh axis 'dp' (x is (P(sum), S(1))): layer_norm is not linear in it, so "
                         "every rank needs the whole value")
    assert v.hint == "reduce x on 'dp' first (all-reduce), or produce x Replicate or Shard on 'dp'"
    assert layouts(res) == ["(R, S(1))"]


def test_layer_norm_grad_layouts():
    x = spec(X3, ["S(0)", "R"])
    w = spec((8,), ["R", "R"])
    res = infer("layer_norm_grad", x, x, w, w)
    assert res.violations == ()
    assert layouts(res) == ["(S(0), R)", "(P(sum), R)", "(P(sum), R)"]


def test_norm_grad_partial_cotangent():
    x = spec(X3, ["R", "S(0)"])
    w = spec((8,), ["R", "R"])
    res = infer("rms_norm_grad", spec(X3, ["P(sum)", "S(0)"]), x, w)
    assert res.violations == () and wants(res) == [None, None, None]
    assert layouts(res) == ["(P(sum), S(0))", "(P(sum), P(sum))"]
    res = infer("rms_norm_grad", spec(X3, ["P(avg)", "S(0)"]), x, w)
    assert layouts(res) == ["(P(avg), S(0))", "(P(avg), P(sum))"]
    res = infer("rms_norm_grad", spec(X3, ["P(max)", "S(0)"]), x, w)
    v = only(res, "partial-input")
    assert v.operand == "dy"
    assert v.message.startswith("dy is P(max) on mesh axis 'dp' but the gradient of rms_norm is computed R there")
    res = infer("rms_norm_grad", spec(X3, ["S(1)", "S(0)"]), x, w)
    v = only(res, "sharding-mismatch")
    assert v.operand == "dy" and "dy is S(1) on mesh axis 'dp'" in v.message and wants(res)[0] == "(R, S(0))"


@pytest.mark.parametrize("w_shape, attrs, code, message", [
    ((6,), {}, "invalid-shape",
     "weight has shape [6] but rms_norm normalises x (shape [4, 6, 8]) over its last 1 dim(s), of shape [8]"),
    ((8,), {"normalized_ndim": 0}, "invalid-attr",
     "rms_norm's normalized_ndim=0 is not in 1..3 (x has shape [4, 6, 8])"),
    ((8,), {"normalized_ndim": 4}, "invalid-attr",
     "rms_norm's normalized_ndim=4 is not in 1..3 (x has shape [4, 6, 8])"),
    ((8,), {"eps": -1.0}, "invalid-attr", "rms_norm's eps=-1.0 is not a finite non-negative number"),
    ((8,), {"eps": float("nan")}, "invalid-attr", "rms_norm's eps=nan is not a finite non-negative number"),
    ((8,), {"eps": float("inf")}, "invalid-attr", "rms_norm's eps=inf is not a finite non-negative number"),
])
def test_norm_invalid_shapes_and_attrs(w_shape, attrs, code, message):
    res = infer("rms_norm", spec(X3, ["R", "R"]), spec(w_shape, ["R", "R"]), **attrs)
    assert [(v.code, v.message) for v in res.violations] == [(code, message)]
    assert res.outputs == (None,)


# ============================================================================ softmax
def test_softmax_other_dims_free():
    res = infer("softmax", spec((4, 6), ["S(0)", "R"]))
    assert layouts(res) == ["(S(0), R)"] and res.violations == ()
    res = infer("log_softmax", spec((4, 6), ["R", "S(1)"]), axis=0)
    assert layouts(res) == ["(R, S(1))"] and res.violations == ()


def test_sharded_softmax_dim():
    res = infer("softmax", spec((4, 6), ["S(0)", "S(1)"]))
    v = only(res, "sharded-softmax-dim")
    assert v.message == ("x dim 1 (size 6) is sharded on mesh axis 'tp' (x is (S(0), S(1))), but softmax normalises "
                         "along axis 1 and needs it whole on every rank")
    assert v.hint == "all-gather x on 'tp', or shard another dim of x instead"
    assert layouts(res) == ["(S(0), R)"]


def test_softmax_partial_and_bad_axis():
    res = infer("log_softmax", spec((4, 6), ["P(sum)", "R"]))
    assert codes(res) == [("partial-input", "x")]
    assert "x is P(sum) on mesh axis 'dp'" in res.violations[0].message
    res = infer("softmax", spec((4, 6), ["R", "R"]), axis=2)
    assert [(v.code, v.message) for v in res.violations] == [
        ("invalid-attr", "softmax's axis=2 is not a dim of x (x has rank 2)")]


def test_softmax_grad_partial_cotangent():
    y = spec((4, 6), ["S(0)", "R"])
    res = infer("softmax_grad", spec((4, 6), ["S(0)", "P(sum)"]), y)
    assert res.violations == () and layouts(res) == ["(S(0), P(sum))"]
    res = infer("log_softmax_grad", spec((4, 6), ["S(0)", "S(1)"]), y)
    assert codes(res) == [("sharding-mismatch", "dy")]


# ============================================================================ swiglu
def test_swiglu_halves_the_split_dim():
    res = infer("swiglu", spec((4, 3, 8), ["S(0)", "S(1)"]))
    assert res.outputs[0].shape == (4, 3, 4) and layouts(res) == ["(S(0), S(1))"] and res.violations == ()
    res = infer("npu_swiglu", spec((6, 3), ["R", "S(1)"]), dim=0)
    assert res.outputs[0].shape == (3, 3) and layouts(res) == ["(R, S(1))"]


def test_sharded_split_dim():
    res = infer("swiglu", spec((4, 8), ["S(0)", "S(1)"]))
    v = only(res, "sharded-split-dim")
    assert v.message == ("x dim 1 (size 8) is sharded on mesh axis 'tp' (x is (S(0), S(1))), but swiglu cuts dim 1 "
                         "into halves a and b, and a torch.chunk shard of it does not hold matching halves")
    assert "use silu_mul" in v.hint
    assert wants(res) == ["(S(0), R)"]


def test_swiglu_invalid():
    res = infer("swiglu", spec((4, 7), ["R", "R"]))
    assert [(v.code, v.message) for v in res.violations] == [
        ("invalid-shape", "swiglu cuts x (shape [4, 7]) into two halves along dim 1, but its size 7 is odd")]
    assert codes(infer("swiglu", spec((4, 8), ["R", "R"]), dim=2)) == [("invalid-attr", "x")]
    assert codes(infer("swiglu", spec((4, 8), ["P(sum)", "R"]))) == [("partial-input", "x")]


def test_swiglu_grad_partial_cotangent():
    res = infer("swiglu_grad", spec((4, 4), ["S(0)", "P(sum)"]), spec((4, 8), ["S(0)", "R"]))
    assert res.violations == () and layouts(res) == ["(S(0), P(sum))"]


# ============================================================================ pointwise
def test_exp_of_a_partial_sum():
    res = infer("exp", spec((4, 6), ["P(sum)", "S(1)"]))
    v = only(res, "partial-input")
    assert v.message == ("x is (P(sum), S(1)), partial on mesh axis 'dp': exp is not linear (exp(a + b) != exp(a) + "
                         "exp(b)), so it needs x as (R, S(1)) (P(sum) -> R on 'dp')")
    assert v.hint == "reduce x on 'dp' first (all-reduce), or produce it as (R, S(1))"
    assert layouts(res) == ["(R, S(1))"]


@pytest.mark.parametrize("op", ["silu", "gelu"])
def test_activations_refuse_partial(op):
    assert codes(infer(op, spec((4, 6), ["R", "P(sum)"]))) == [("partial-input", "x")]
    assert layouts(infer(op, spec((4, 6), ["S(1)", "S(0)"]))) == ["(S(1), S(0))"]


def test_scale_is_linear():
    assert layouts(infer("scale", spec((4, 6), ["P(sum)", "S(0)"]), factor=2.0)) == ["(P(sum), S(0))"]
    assert layouts(infer("scale", spec((4, 6), ["P(avg)", "R"]), factor=2.0)) == ["(P(avg), R)"]
    assert codes(infer("scale", spec((4, 6), ["P(max)", "R"]), factor=2.0)) == [("partial-input", "x")]
    assert codes(infer("scale", spec((4, 6), ["R", "R"]), factor="two")) == [("invalid-attr", "x")]
    assert infer("scale", spec((4, 6), ["R", "R"], dtype="int32"), factor=2).outputs[0].dtype == "float32"


@pytest.mark.parametrize("src, dst, passes", [
    ("float32", "float16", True), ("float16", "float64", True), ("int64", "int32", True), ("int32", "int32", True),
    # a sum that overflowed int32 wraps; widening the terms first would give the true sum instead
    ("int32", "float32", False), ("int32", "int64", False),
    ("float32", "int32", False), ("bool", "float32", False), ("float32", "bool", False),
])
def test_cast_of_a_partial_sum(src, dst, passes):
    res = infer("cast", spec((4, 6), ["P(sum)", "R"], dtype=src), dtype=dst)
    assert res.outputs[0].dtype == dst
    if passes:
        assert res.violations == () and layouts(res) == ["(P(sum), R)"]
    else:
        v = only(res, "partial-input")
        assert f"cast from {src} to {dst} is not linear in a partial sum" in v.message


def test_cast_bad_dtype():
    res = infer("cast", spec((4, 6), ["R", "R"]), dtype="complex64")
    assert [(v.code, v.message) for v in res.violations] == [
        ("invalid-attr", "cast to dtype 'complex64', which is not a supported dtype")]


def test_div_is_linear_in_the_numerator_only():
    assert layouts(infer("div", spec((4, 6), ["P(sum)", "R"]), spec((6,), ["R", "R"]))) == ["(P(sum), R)"]
    res = infer("div", spec((4, 6), ["R", "R"]), spec((6,), ["P(sum)", "R"]))
    v = only(res, "partial-input")
    assert v.operand == "y" and "div is linear in its numerator x only" in v.message
    res = infer("div", spec((4, 6), ["S(1)", "R"]), spec((4, 6), ["S(0)", "R"]))
    v = only(res, "sharding-mismatch")
    assert v.operand == "y" and v.message.endswith("(S(0) -> S(1) on 'dp')")


def test_silu_mul_is_linear_in_b_only():
    assert layouts(infer("silu_mul", spec((4, 6), ["R", "S(0)"]), spec((4, 6), ["P(sum)", "S(0)"]))) == \
        ["(P(sum), S(0))"]
    res = infer("silu_mul", spec((4, 6), ["P(sum)", "R"]), spec((4, 6), ["R", "R"]))
    assert codes(res) == [("partial-input", "a")]
    assert "silu_mul is linear in b only" in res.violations[0].message


def test_activation_grads_are_linear_in_dy():
    for op in ("silu_grad", "gelu_grad"):
        res = infer(op, spec((4, 6), ["P(sum)", "S(1)"]), spec((4, 6), ["R", "S(1)"]))
        assert res.violations == () and layouts(res) == ["(P(sum), S(1))"]
        assert codes(infer(op, spec((4, 6), ["R", "R"]), spec((4, 6), ["P(sum)", "R"]))) == [("partial-input", "x")]


def test_integer_inputs_compute_in_float32():
    assert infer("gelu", spec((4, 6), ["R", "R"], dtype="int64")).outputs[0].dtype == "float32"
    assert infer("softmax", spec((4, 6), ["R", "R"], dtype="int32")).outputs[0].dtype == "float32"
    assert infer("exp", spec((4, 6), ["R", "R"], dtype="float16")).outputs[0].dtype == "float16"


# ============================================================================ kernels: forward references
def _rows(x, k):
    """x viewed as (rows, prod of the last k dims)."""
    return x.reshape(-1, int(np.prod(x.shape[x.ndim - k:])))


def test_rms_norm_kernel_matches_a_loop_reference():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 2, 4)), rng.standard_normal((2, 4))
    got = nn_numpy.rms_norm(x, w, eps=1e-3, normalized_ndim=2)
    want = np.empty_like(_rows(x, 2))
    for r, row in enumerate(_rows(x, 2)):
        rms = math.sqrt(sum(v * v for v in row) / len(row) + 1e-3)
        want[r] = row / rms * w.ravel()
    np.testing.assert_allclose(got, want.reshape(x.shape), rtol=1e-12)


def test_layer_norm_kernel_matches_a_loop_reference():
    rng = np.random.default_rng(1)
    x, w, b = rng.standard_normal((5, 3)), rng.standard_normal(3), rng.standard_normal(3)
    got = nn_numpy.layer_norm(x, w, b, eps=1e-5)
    for r, row in enumerate(x):
        mean = sum(row) / 3
        var = sum((v - mean) ** 2 for v in row) / 3
        np.testing.assert_allclose(got[r], (row - mean) / math.sqrt(var + 1e-5) * w + b, rtol=1e-12)


def test_softmax_kernels_by_hand():
    x = np.array([[0.0, math.log(3.0)], [1.0, 1.0]])
    np.testing.assert_allclose(nn_numpy.softmax(x, axis=-1), [[0.25, 0.75], [0.5, 0.5]], rtol=1e-12)
    np.testing.assert_allclose(nn_numpy.log_softmax(x, axis=-1), np.log([[0.25, 0.75], [0.5, 0.5]]), rtol=1e-12)
    e = math.e
    np.testing.assert_allclose(nn_numpy.softmax(x, axis=0)[:, 0], [1 / (1 + e), e / (1 + e)], rtol=1e-12)


def test_activation_kernels_by_hand():
    assert nn_numpy.silu(np.array(1.0)) == pytest.approx(1.0 / (1.0 + math.exp(-1.0)), rel=1e-14)
    # the tanh form, at x = 1: 0.5 * (1 + tanh(sqrt(2/pi) * 1.044715))
    assert nn_numpy.gelu(np.array(1.0)) == pytest.approx(0.8411919906082768, rel=1e-14)
    assert abs(nn_numpy.gelu(np.array(1.0)) - 0.5 * (1 + math.erf(1 / math.sqrt(2)))) < 1e-3  # close to erf gelu
    assert nn_numpy.exp(np.array([0, 1], dtype=np.int32)).dtype == np.float32
    assert nn_numpy.silu_mul(np.array([0.0, 50.0]), np.array([3.0, 2.0])).tolist() == [0.0, 100.0]
    assert nn_numpy.div(np.array([3, 1]), np.array([2, 4])).tolist() == [1.5, 0.25]
    assert nn_numpy.scale(np.array([1.0, -2.0], dtype=np.float16), factor=0.5).dtype == np.float16


def test_swiglu_kernel_by_hand():
    x = np.array([[1.0, -2.0, 3.0, 4.0]])
    sig = [1 / (1 + math.exp(-1.0)), 1 / (1 + math.exp(2.0))]
    want = [[1.0 * sig[0] * 3.0, -2.0 * sig[1] * 4.0]]
    np.testing.assert_allclose(nn_numpy.swiglu(x, dim=-1), want, rtol=1e-12)
    np.testing.assert_allclose(nn_numpy.swiglu(x.T, dim=0), np.array(want).T, rtol=1e-12)


def _attention_loops(q, k, v, causal, scale, q_offset):
    """Plain loops over BNSD q, k, v."""
    b_n, h_n, sq, _ = q.shape
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    for b in range(b_n):
        for h in range(h_n):
            for i in range(sq):
                seen = [j for j in range(k.shape[2]) if not causal or j <= i + q_offset]
                scores = [scale * float(np.dot(q[b, h, i], k[b, h, j])) for j in seen]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                out[b, h, i] = sum(wt * v[b, h, j] for wt, j in zip(weights, seen)) / sum(weights)
    return out


@pytest.mark.parametrize("causal, q_offset, scale", [(False, 0, None), (True, 0, None), (True, 2, 0.7)])
def test_attention_kernel_matches_loops(causal, q_offset, scale):
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((2, 2, 3, 4)), rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((2, 2, 5, 3))
    used = 1 / math.sqrt(4) if scale is None else scale
    want = _attention_loops(q, k, v, causal, used, q_offset)
    got = nn_numpy.scaled_dot_product_attention(q, k, v, causal=causal, scale=scale, q_offset=q_offset)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    swap = (0, 2, 1, 3)
    got_bsnd = nn_numpy.scaled_dot_product_attention(q.transpose(swap), k.transpose(swap), v.transpose(swap),
                                                     layout="BSND", causal=causal, scale=scale, q_offset=q_offset)
    np.testing.assert_allclose(got_bsnd, want.transpose(swap), rtol=1e-10, atol=1e-12)


def test_causal_rows_see_only_earlier_keys():
    q = np.zeros((1, 1, 3, 2))
    v = np.array([1.0, 10.0, 100.0]).reshape(1, 1, 3, 1)
    out = nn_numpy.scaled_dot_product_attention(q, q, v, causal=True)[0, 0, :, 0]
    np.testing.assert_allclose(out, [1.0, 5.5, 37.0], rtol=1e-12)  # uniform weights over the visible keys
    out = nn_numpy.scaled_dot_product_attention(q[:, :, :1], q, v, causal=True, q_offset=1)[0, 0, :, 0]
    np.testing.assert_allclose(out, [5.5], rtol=1e-12)


# ============================================================================ kernels: finite differences
def numeric_grad(fn, args, index, cot, h=1e-6):
    """Central differences of ``sum(fn(*args) * cot)`` with respect to ``args[index]``."""
    x = args[index]
    grad = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        plus = [a.copy() for a in args]
        minus = [a.copy() for a in args]
        plus[index][i] += h
        minus[index][i] -= h
        grad[i] = (np.sum(fn(*plus) * cot) - np.sum(fn(*minus) * cot)) / (2 * h)
    return grad


def check_backward(forward, backward, args, attrs, wrt, rtol=1e-6, atol=1e-8, seed=3):
    """``backward(dy, *args, **attrs)`` against finite differences of ``forward``, for the args in ``wrt``."""
    rng = np.random.default_rng(seed)
    out = forward(*args, **attrs)
    cot = rng.standard_normal(out.shape)
    grads = backward(cot, *args, **attrs)
    grads = grads if isinstance(grads, tuple) else (grads,)
    for grad, index in zip(grads, wrt):
        assert grad.dtype == np.float64
        want = numeric_grad(lambda *a: forward(*a, **attrs), args, index, cot)
        np.testing.assert_allclose(grad, want, rtol=rtol, atol=atol)


def _normal(seed, *shapes):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in shapes]


@pytest.mark.parametrize("k", [1, 2])
def test_rms_norm_backward_finite_differences(k):
    x, w = _normal(4, (3, 2, 4), (2, 4)[2 - k:])
    check_backward(nn_numpy.rms_norm, nn_numpy.rms_norm_grad, [x, w], {"eps": 1e-3, "normalized_ndim": k}, [0, 1])


@pytest.mark.parametrize("k", [1, 2])
def test_layer_norm_backward_finite_differences(k):
    x, w, b = _normal(5, (3, 2, 4), (2, 4)[2 - k:], (2, 4)[2 - k:])
    check_backward(nn_numpy.layer_norm, nn_numpy.layer_norm_grad, [x, w, b], {"eps": 1e-3, "normalized_ndim": k},
                   [0, 1, 2])


@pytest.mark.parametrize("forward, backward", [(nn_numpy.softmax, nn_numpy.softmax_grad),
                                               (nn_numpy.log_softmax, nn_numpy.log_softmax_grad)])
@pytest.mark.parametrize("axis", [0, -1])
def test_softmax_backward_finite_differences(forward, backward, axis):
    (x,) = _normal(6, (3, 4))

    def grad_from_x(dy, x, axis):  # the grad kernels take the forward output
        return backward(dy, forward(x, axis=axis), axis=axis)

    check_backward(forward, grad_from_x, [x], {"axis": axis}, [0])


@pytest.mark.parametrize("attrs", [
    {"layout": "BNSD", "causal": False, "scale": None, "q_offset": 0},
    {"layout": "BNSD", "causal": True, "scale": None, "q_offset": 0},
    {"layout": "BNSD", "causal": True, "scale": 0.6, "q_offset": 2},
    {"layout": "BSND", "causal": True, "scale": None, "q_offset": 1},
])
def test_attention_backward_finite_differences(attrs):
    if attrs["layout"] == "BNSD":
        q, k, v = _normal(7, (1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 3))
    else:
        q, k, v = _normal(7, (1, 3, 2, 4), (1, 5, 2, 4), (1, 5, 2, 3))
    check_backward(nn_numpy.scaled_dot_product_attention, nn_numpy.scaled_dot_product_attention_grad, [q, k, v],
                   attrs, [0, 1, 2])


@pytest.mark.parametrize("dim", [0, -1])
def test_swiglu_backward_finite_differences(dim):
    (x,) = _normal(8, (4, 6))
    check_backward(nn_numpy.swiglu, nn_numpy.swiglu_grad, [x], {"dim": dim}, [0])


@pytest.mark.parametrize("forward, backward", [(nn_numpy.silu, nn_numpy.silu_grad),
                                               (nn_numpy.gelu, nn_numpy.gelu_grad)])
def test_activation_backward_finite_differences(forward, backward):
    x = np.linspace(-4.0, 4.0, 13)
    check_backward(forward, backward, [x], {}, [0])


# ============================================================================ vjp rules through the backward pass
VJP_CASES = {
    "exp": ([(3, 4)], {}),
    "silu": ([(3, 4)], {}),
    "gelu": ([(3, 4)], {}),
    "scale": ([(3, 4)], {"factor": -2.5}),
    "cast": ([(3, 4)], {"dtype": "float64"}),
    "div": ([(3, 4), (4,)], {}),
    "silu_mul": ([(3, 4), (2, 3, 4)], {}),
    "swiglu": ([(3, 6)], {"dim": -1}),
    "rms_norm": ([(3, 4), (4,)], {"eps": 1e-3}),
    "layer_norm": ([(2, 3, 4), (3, 4), (3, 4)], {"eps": 1e-3, "normalized_ndim": 2}),
    "softmax": ([(3, 4)], {"axis": 0}),
    "log_softmax": ([(3, 4)], {}),
    "scaled_dot_product_attention": ([(1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 2)], {"causal": True}),
}


@pytest.mark.parametrize("op", sorted(VJP_CASES))
def test_vjp_rule_matches_finite_differences(op):
    shapes, attrs = VJP_CASES[op]
    rule = get_rule(op)
    names = [rule.operand_name(i) for i in range(len(shapes))]
    graph = load_spec({"mesh": {"shape": [2], "names": ["dp"]},
                       "inputs": {n: {"shape": list(s), "dtype": "float64"} for n, s in zip(names, shapes)},
                       "nodes": [{"name": "out", "op": op, "inputs": names, "attrs": attrs}], "outputs": ["out"]})
    Propagate().run(graph)
    result = Backward().run(graph)
    rng = np.random.default_rng(9)
    if op == "div":
        values = {"x": rng.standard_normal(shapes[0]), "y": rng.uniform(1.0, 2.0, shapes[1])}  # y away from 0
    else:
        values = {n: rng.standard_normal(s) for n, s in zip(names, shapes)}
    out_shape = execute_global(graph, values)["out"].shape
    cot = rng.standard_normal(out_shape)
    env = execute_global(result.graph, {**values, result.cotangents["out"]: cot})

    def forward(*arrays):
        return execute_global(graph, dict(zip(names, arrays)))["out"]

    args = [values[n] for n in names]
    for i, name in enumerate(names):
        np.testing.assert_allclose(env[result.grads[name]], numeric_grad(forward, args, i, cot), rtol=1e-6, atol=1e-8)


# ============================================================================ end to end
def _run(spec_dict, **kwargs):
    rep = run_graph(load_spec(spec_dict), backward=True, seed=kwargs.pop("seed", 0), **kwargs)
    assert rep.ok, rep.mismatches or rep.violations
    return rep


def _collectives(rep) -> list[tuple[str, str, str]]:
    return sorted((c["node"], c["kind"], c["mesh_axis"]) for c in rep.collectives)


def test_rms_norm_sharded_on_batch_and_sequence_end_to_end():
    rep = _run({"mesh": {"shape": [2, 2], "names": ["dp", "sp"]},
                "inputs": {"x": {"shape": [4, 6, 8], "placements": ["S(0)", "S(1)"]}, "w": {"shape": [8]}},
                "nodes": [{"name": "y", "op": "RmsNorm", "inputs": ["x", "w"]}]})
    assert sorted(rep.grads) == ["w", "x"]
    # no communication forward; the weight gradient is summed over B (dp) and S (sp)
    assert _collectives(rep) == [("grad/w", "all-reduce", "dp"), ("grad/w", "all-reduce", "sp")]


def test_layer_norm_uneven_batch_end_to_end():
    rep = _run({"mesh": {"shape": [2], "names": ["dp"]},
                "inputs": {"x": {"shape": [5, 3, 4], "placements": ["S(0)"]}, "w": {"shape": [3, 4]},
                           "b": {"shape": [3, 4]}},
                "nodes": [{"name": "y", "op": "layer_norm", "inputs": ["x", "w", "b"],
                           "attrs": {"normalized_ndim": 2}}]})
    assert _collectives(rep) == [("grad/b", "all-reduce", "dp"), ("grad/w", "all-reduce", "dp")]


@pytest.mark.parametrize("sq", [8, 5])
def test_causal_attention_with_query_sequence_sharded_end_to_end(sq):
    rep = _run({"mesh": {"shape": [2, 2], "names": ["dp", "sp"]},
                "inputs": {"q": {"shape": [2, 2, sq, 4], "placements": ["S(0)", "S(2)"]},
                           "k": {"shape": [2, 2, 8, 4], "placements": ["S(0)", "R"]},
                           "v": {"shape": [2, 2, 8, 4], "placements": ["S(0)", "R"]}},
                "nodes": [{"name": "o", "op": "scaled_dot_product_attention", "inputs": ["q", "k", "v"],
                           "attrs": {"causal": True}}]})
    assert sorted(rep.grads) == ["k", "q", "v"]
    # dk and dv are partial sums over the query-sequence axis, reduced by the backward pass
    assert _collectives(rep) == [("grad/k", "all-reduce", "sp"), ("grad/v", "all-reduce", "sp")]


def test_attention_with_sharded_kv_sequence_runs_after_reshard():
    rep = _run({"mesh": {"shape": [2, 2], "names": ["dp", "sp"]},
                "inputs": {n: {"shape": [2, 2, 8, 4], "placements": ["S(0)", "S(2)"]} for n in "qkv"},
                "nodes": [{"name": "o", "op": "sdpa", "inputs": ["q", "k", "v"], "attrs": {"causal": True}}]})
    assert _collectives(rep) == [("grad/k", "reduce-scatter", "sp"), ("grad/v", "reduce-scatter", "sp"),
                                 ("o/k", "all-gather", "sp"), ("o/v", "all-gather", "sp")]
    refused = run_graph(load_spec({"mesh": {"shape": [2], "names": ["sp"]},
                                   "inputs": {n: {"shape": [1, 2, 8, 4], "placements": ["S(2)"]} for n in "qkv"},
                                   "nodes": [{"name": "o", "op": "sdpa", "inputs": ["q", "k", "v"]}]}),
                        reshard=False)
    assert not refused.ok and [v["code"] for v in refused.violations] == ["sharded-kv-sequence"] * 2


def test_partial_cotangent_flows_through_rms_norm_grad_without_a_reduction():
    # z = rms_norm(x, w) * c with c a partial sum: dz/dy = c arrives P(sum) at rms_norm_grad
    rep = _run({"mesh": {"shape": [2, 2], "names": ["dp", "tp"]},
                "inputs": {"x": {"shape": [4, 8], "placements": ["S(0)", "R"]}, "w": {"shape": [8]},
                           "c": {"shape": [4, 8], "placements": ["S(0)", "P(sum)"], "requires_grad": False}},
                "nodes": [{"name": "y", "op": "rms_norm", "inputs": ["x", "w"]},
                          {"name": "z", "op": "mul", "inputs": ["y", "c"]}]})
    assert _collectives(rep) == [("grad/w", "all-reduce", "dp"), ("grad/w", "all-reduce", "tp"),
                                 ("grad/x", "all-reduce", "tp")]


def test_a_small_block_end_to_end():
    # norm -> q; attention with the query sequence sharded; swiglu; softmax over heads' features
    rep = _run({"mesh": {"shape": [2, 2], "names": ["dp", "sp"]},
                "inputs": {"x": {"shape": [2, 2, 6, 8], "placements": ["S(0)", "S(2)"]}, "w": {"shape": [8]},
                           "k": {"shape": [2, 2, 6, 8]}, "v": {"shape": [2, 2, 6, 8]}},
                "nodes": [{"name": "q", "op": "rms_norm", "inputs": ["x", "w"]},
                          {"name": "o", "op": "sdpa", "inputs": ["q", "k", "v"], "attrs": {"causal": True}},
                          {"name": "h", "op": "swiglu", "inputs": ["o"]},
                          {"name": "g", "op": "gelu", "inputs": ["h"]},
                          {"name": "y", "op": "log_softmax", "inputs": ["g"]}]}, seed=4)
    assert sorted(rep.grads) == ["k", "v", "w", "x"]
    # k and v are sliced on dp for free; their gradients are gathered on dp and summed over sp
    assert _collectives(rep) == [("grad/k", "all-gather", "dp"), ("grad/k", "all-reduce", "sp"),
                                 ("grad/v", "all-gather", "dp"), ("grad/v", "all-reduce", "sp"),
                                 ("grad/w", "all-reduce", "dp"), ("grad/w", "all-reduce", "sp")]
