"""The attention family: grouped-query heads in ``scaled_dot_product_attention``,
``flash_attention_score`` (MindSpore's fused attention) and context-parallel attention.

Layout rules with hand-written expectations, messages and fixes, finite-difference checks
of the new numpy backward kernels (float64), and end-to-end runs (propagate, reshard,
backward, lower, simulate, compare with one device).  The op database records of
``layout_prop/testing/opdb/attention.py`` try sampled placements on top of these.
"""

from __future__ import annotations

import numpy as np
import pytest

from layout_prop import DeviceMesh, Layout, TensorSpec
from layout_prop.core.registry import get_rule
from layout_prop.io.loader import load_spec
from layout_prop.kernels import nn_numpy
from layout_prop.runner import run_graph

TP = DeviceMesh((4,), ("tp",))
DP_TP = DeviceMesh((2, 2), ("dp", "tp"))


def spec(shape, placements, mesh=TP, dtype="float32") -> TensorSpec:
    return TensorSpec(shape, dtype, Layout(mesh, placements, len(shape)))


def infer(op, *inputs, **attrs):
    rule = get_rule(op)
    return rule.infer_layout(tuple(inputs), rule.normalize_attrs(attrs))


def layouts(result) -> list[str | None]:
    return [None if s is None else str(s.layout) for s in result.outputs]


def wants(result) -> list[str | None]:
    return [None if w is None else str(w) for w in result.wants]


def run(spec_dict, **kwargs):
    rep = run_graph(load_spec(spec_dict), backward=True, seed=kwargs.pop("seed", 0), **kwargs)
    assert rep.ok, rep.mismatches or rep.violations
    return rep


def collectives(rep) -> list[tuple[str, str, str]]:
    return sorted((c["node"], c["kind"], c["mesh_axis"]) for c in rep.collectives)


def attention_spec(mesh, q, kv, q_placements, kv_placements, op="sdpa", attrs=None) -> dict:
    return {"mesh": mesh,
            "inputs": {"q": {"shape": list(q), "placements": q_placements},
                       "k": {"shape": list(kv), "placements": kv_placements},
                       "v": {"shape": list(kv), "placements": kv_placements}},
            "nodes": [{"name": "o", "op": op, "inputs": ["q", "k", "v"], "attrs": attrs or {"causal": True}}]}


# ==================================================================== grouped-query heads in sdpa
def test_gqa_kv_heads_split_like_query_heads_when_they_divide():
    # 8 query heads and 4 kv heads on 4 ranks: rank i holds query heads 2i, 2i+1 and kv head i
    q = spec((2, 8, 6, 4), ["S(1)"])
    kv = spec((2, 4, 6, 4), ["R"])
    res = infer("sdpa", q, kv, kv, causal=True)
    assert res.violations == ()
    assert wants(res) == [None, "(S(1))", "(S(1))"]  # a free local slice
    assert layouts(res) == ["(S(1))"]


def test_gqa_kv_heads_are_replicated_when_they_cannot_split_as_the_query_heads():
    # 8 query heads, 2 kv heads, 4 ranks: rank 1 holds query heads 2, 3 (kv head 0), rank 2 heads 4, 5 (kv head 1);
    # a torch.chunk of 2 kv heads on 4 ranks gives rank 1 kv head 1: not its query heads' kv head
    q = spec((2, 8, 6, 4), ["S(1)"])
    kv = spec((2, 2, 6, 4), ["R"])
    res = infer("sdpa", q, kv, kv)
    assert res.violations == () and wants(res) == [None, None, None]
    rule = get_rule("sdpa")
    attrs = rule.normalize_attrs({})
    maps = [rule.localize(attrs, (q, kv, kv), res.outputs, r)["kv_head_map"] for r in range(4)]
    assert maps == [(0, 0), (0, 0), (1, 1), (1, 1)]


def test_gqa_kv_heads_sharded_where_they_cannot_split_is_a_fixable_mismatch():
    q = spec((2, 8, 6, 4), ["S(1)"])
    kv = spec((2, 2, 6, 4), ["S(1)"])
    res = infer("sdpa", q, kv, kv)
    k_violation, v_violation = res.violations
    assert (k_violation.code, k_violation.operand, k_violation.fixable) == ("sharding-mismatch", "k", True)
    assert v_violation.operand == "v"
    assert k_violation.message == (
        "k's heads (dim 1, N = 2) cannot be split on mesh axis 'tp' as q's 8 heads are (q is (S(1)), k is (S(1))): "
        "a query head's kv head (query head h uses kv head h // 4) would be on another rank")
    assert k_violation.hint == ("all-gather k on 'tp' (every rank keeps every kv head and uses those of its query "
                                "heads), or shard fewer query heads on 'tp'")
    assert wants(res) == [None, "(R)", "(R)"]
    # the fix runs, forward and backward, and equals one device
    rep = run(attention_spec({"shape": [4], "names": ["tp"]}, (2, 8, 6, 4), (2, 2, 6, 4), ["S(1)"], ["S(1)"]))
    assert ("o/k", "all-gather", "tp") in collectives(rep)
    # dk, dv: each rank sums its query heads' parts of every kv head; the backward pass reduces them
    assert ("grad/k", "reduce-scatter", "tp") in collectives(rep)


def test_gqa_grads_are_partial_on_the_axes_of_replicated_kv_heads():
    q = spec((2, 8, 6, 4), ["S(1)"])
    kv = spec((2, 2, 6, 4), ["R"])
    res = infer("scaled_dot_product_attention_grad", q, q, kv, kv)
    assert res.violations == ()
    assert layouts(res) == ["(S(1))", "(P(sum))", "(P(sum))"]
    split = spec((2, 4, 6, 4), ["R"])
    res = infer("scaled_dot_product_attention_grad", q, q, split, split)
    assert layouts(res) == ["(S(1))", "(S(1))", "(S(1))"]


@pytest.mark.parametrize("q_placements, kv_placements, kv_heads", [
    (["S(0)", "S(1)"], ["S(0)", "R"], 2),      # kv heads replicated on tp (4 query heads a rank, 1 kv head)
    (["R", "S(1)"], ["R", "S(1)"], 4),          # kv heads split with the query heads
    (["S(2)", "S(1)"], ["R", "R"], 1),         # multi-query, query sequence on dp
    (["S(1)", "S(1)"], ["R", "R"], 2),         # heads on both axes: 8 on 4, kv 2 replicated
])
def test_gqa_sdpa_runs_forward_and_backward(q_placements, kv_placements, kv_heads):
    run(attention_spec({"shape": [2, 2], "names": ["dp", "tp"]}, (2, 8, 6, 4), (2, kv_heads, 6, 4),
                       q_placements, kv_placements))


def test_gqa_head_counts_that_do_not_divide_are_invalid_shape():
    q = spec((2, 6, 4, 4), ["R"])
    kv = spec((2, 4, 4, 4), ["R"])
    (v,) = infer("sdpa", q, kv, kv).violations
    assert (v.code, v.operand) == ("invalid-shape", "k")
    assert v.message == ("q has 6 heads but k and v have 4 (dim 1; q [2, 6, 4, 4], k [2, 4, 4, 4], v [2, 4, 4, 4]): "
                         "grouped-query attention needs q's head count to be a multiple of k's and v's")
    k = spec((2, 2, 4, 4), ["R"])
    codes = [(v.code, v.operand) for v in infer("sdpa", q, k, kv).violations]
    assert codes == [("invalid-shape", "v")]  # k and v differ


def test_a_rank_sdpa_does_not_take_is_refused_naming_both_forms_it_takes():
    """q, k, v are all 4-D or all 3-D (torch's (N, L, E)); a mix, or rank 2, is refused saying so."""
    q3, kv4 = spec((2, 6, 4), ["R"]), spec((2, 1, 6, 4), ["R"])
    expected = ("q has rank 3 (shape [2, 6, 4]); attention takes q, k, v all 4-D (BNSD or BSND) or all 3-D "
                "(N, L, E)")
    for op, inputs in (("sdpa", (q3, kv4, kv4)), ("scaled_dot_product_attention_grad", (spec((2, 6, 4), ["R"]), q3, kv4, kv4))):
        (v,) = infer(op, *inputs).violations
        assert (v.code, v.operand, v.message) == ("invalid-shape", "q", expected)
        assert v.hint == "reshape q to 4-D, or give q, k and v all 3-D"
    # attention_block (a ring step, written by the expand pass on 4-D q, k, v) still names 4-D only
    (v, *_) = infer("attention_block", q3, kv4, kv4, blocks=1, step=0).violations
    assert v.message == "q has rank 3 (shape [2, 6, 4]); attention takes 4-D q, k, v in the BNSD or BSND layout"


def test_kv_head_map_is_not_a_user_attr():
    from layout_prop.core.errors import OpError

    with pytest.raises(OpError, match="has no attribute"):
        get_rule("sdpa").normalize_attrs({"kv_head_map": (0, 0, 1, 1)})


def _finite_difference(f, x, dy, eps=1e-6):
    grad = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        up, down = x.copy(), x.copy()
        up[i] += eps
        down[i] -= eps
        grad[i] = np.sum((f(up) - f(down)) * dy) / (2 * eps)
    return grad


@pytest.mark.parametrize("kv_head_map", [None, (1, 1, 0)])
def test_gqa_sdpa_backward_kernel_matches_finite_differences(kv_head_map):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4 if kv_head_map is None else 3, 3, 2))
    k, v = rng.standard_normal((1, 2, 5, 2)), rng.standard_normal((1, 2, 5, 3))
    attrs = {"causal": True, "q_offset": 1, "kv_head_map": kv_head_map}
    fwd = nn_numpy.scaled_dot_product_attention
    dy = rng.standard_normal(fwd(q, k, v, **attrs).shape)
    dq, dk, dv = nn_numpy.scaled_dot_product_attention_grad(dy, q, k, v, **attrs)
    np.testing.assert_allclose(dq, _finite_difference(lambda t: fwd(t, k, v, **attrs), q, dy), atol=1e-7)
    np.testing.assert_allclose(dk, _finite_difference(lambda t: fwd(q, t, v, **attrs), k, dy), atol=1e-7)
    np.testing.assert_allclose(dv, _finite_difference(lambda t: fwd(q, k, t, **attrs), v, dy), atol=1e-7)


def test_gqa_equals_attention_over_repeated_kv_heads():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 6, 4, 3)), rng.standard_normal((2, 2, 4, 3)), rng.standard_normal((2, 2, 4, 3))
    repeated = [np.repeat(t, 3, axis=1) for t in (k, v)]
    np.testing.assert_allclose(nn_numpy.scaled_dot_product_attention(q, k, v, causal=True),
                               nn_numpy.scaled_dot_product_attention(q, *repeated, causal=True), rtol=1e-12)


@pytest.mark.parametrize("kv_head_map", [None, (1, 1, 0), ()])
def test_gqa_sdpa_mindspore_kernels_match_numpy(kv_head_map):
    pytest.importorskip("mindspore")
    from layout_prop.kernels.mindspore_backend import KERNELS as MS, to_numpy

    rng = np.random.default_rng(2)
    q_heads = {None: 4, (): 0}.get(kv_head_map, 3)
    q = rng.standard_normal((2, q_heads, 3, 4)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 5, 4)).astype(np.float32) for _ in range(2))
    dy = rng.standard_normal((2, q_heads, 3, 4)).astype(np.float32)
    attrs = {"causal": True, "q_offset": 2, "kv_head_map": kv_head_map}
    for op, args in (("scaled_dot_product_attention", (q, k, v)), ("scaled_dot_product_attention_grad", (dy, q, k, v))):
        want = nn_numpy.KERNELS[op](*args, **attrs)
        got = MS[op](*args, **attrs)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            g = to_numpy(g)
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


# ==================================================================== flash_attention_score
from layout_prop.kernels import attention_numpy  # noqa: E402


def test_flash_aliases_resolve_to_the_new_op():
    for alias in ("FlashAttentionScore", "flash_attention_score", "npu_fusion_attention"):
        assert get_rule(alias).name == "flash_attention_score"
    for alias in ("FlashAttentionScoreGrad", "npu_fusion_attention_grad"):
        assert get_rule(alias).name == "flash_attention_score_grad"
    assert get_rule("sdpa").name == "scaled_dot_product_attention"


@pytest.mark.parametrize("mode, pre, nxt, expected", [
    (0, INT := 2 ** 31 - 1, INT, ["1111", "1111", "1111"]),            # no mask
    (0, 1, 0, ["1000", "1100", "0110"]),                               # band from the top-left
    (2, 0, 0, ["1000", "1100", "1110"]),                               # top-left causal (pre/next ignored)
    (3, 0, 0, ["1100", "1110", "1111"]),                               # bottom-right causal: Skv - Sq = 1
    (4, 1, 0, ["1100", "0110", "0011"]),                               # band from the bottom-right
])
def test_sparse_modes_mask(mode, pre, nxt, expected):
    mask = attention_numpy.attention_mask(3, 4, 0, 3, mode, pre, nxt)
    assert ["".join(str(int(b)) for b in row) for row in mask] == expected


def test_packed_sequences_see_their_own_keys_only():
    # two sequences: queries 0-2 with keys 0-1, queries 3-6 with keys 2-5; bottom-right causal in each
    mask = attention_numpy.attention_mask(7, 6, 0, 7, 3, 0, 0, [3, 7], [2, 6])
    assert ["".join(str(int(b)) for b in row) for row in mask] == [
        "000000", "100000", "110000", "001000", "001100", "001110", "001111"]
    # a rank holding query rows 2..4 gets the same rows
    np.testing.assert_array_equal(attention_numpy.attention_mask(3, 6, 2, 7, 3, 0, 0, [3, 7], [2, 6]), mask[2:5])


def test_a_row_that_sees_no_key_is_zeros_forward_and_backward():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((1, 3, 1, 2)), rng.standard_normal((1, 2, 1, 2)), rng.standard_normal((1, 2, 1, 2))
    attrs = {"head_num": 1, "input_layout": "BSND", "sparse_mode": 3}  # Sq 3, Skv 2: row 0 sees nothing
    out = attention_numpy.flash_attention_score(q, k, v, **attrs)
    assert np.all(out[0, 0] == 0) and np.all(np.isfinite(out))
    dq, dk, dv = attention_numpy.flash_attention_score_grad(np.ones_like(out), q, k, v, **attrs)
    assert np.all(dq[0, 0] == 0) and np.all(np.isfinite(dk)) and np.all(np.isfinite(dv))


@pytest.mark.parametrize("layout, shapes, attrs", [
    ("BSH", [(1, 3, 8), (1, 4, 4), (1, 4, 4)], {"head_num": 2, "sparse_mode": 3}),
    ("SBH", [(3, 1, 4), (4, 1, 4), (4, 1, 4)], {"head_num": 2, "sparse_mode": 4, "pre_tokens": 1, "next_tokens": 1}),
    ("TND", [(5, 2, 2), (4, 1, 2), (4, 1, 2)],
     {"head_num": 2, "sparse_mode": 2, "actual_seq_qlen": [2, 5], "actual_seq_kvlen": [2, 4]}),
])
def test_flash_backward_kernel_matches_finite_differences(layout, shapes, attrs):
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s) for s in shapes)
    attrs = {"input_layout": layout, "scale": 0.7, **attrs}
    fwd = attention_numpy.flash_attention_score
    dy = rng.standard_normal(q.shape)
    dq, dk, dv = attention_numpy.flash_attention_score_grad(dy, q, k, v, **attrs)
    np.testing.assert_allclose(dq, _finite_difference(lambda t: fwd(t, k, v, **attrs), q, dy), atol=1e-7)
    np.testing.assert_allclose(dk, _finite_difference(lambda t: fwd(q, t, v, **attrs), k, dy), atol=1e-7)
    np.testing.assert_allclose(dv, _finite_difference(lambda t: fwd(q, k, t, **attrs), v, dy), atol=1e-7)


def test_flash_bsh_equals_sdpa_on_the_same_heads():
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((2, 5, 12)), rng.standard_normal((2, 5, 6)), rng.standard_normal((2, 5, 6))
    got = attention_numpy.flash_attention_score(q, k, v, head_num=4, scale=0.4, sparse_mode=2)
    split = [t.reshape(2, 5, -1, 3) for t in (q, k, v)]  # BSND with D 3
    want = nn_numpy.scaled_dot_product_attention(*split, layout="BSND", causal=True, scale=0.4)
    np.testing.assert_allclose(got, want.reshape(2, 5, 12), rtol=1e-12)


def test_fused_heads_shard_only_into_whole_heads():
    # BSH with 4 heads of 4 (H 16): 2 or 4 ranks cut whole heads; 8 ranks would cut heads in halves
    mesh8 = DeviceMesh((8,), ("tp",))
    kv = spec((2, 6, 16), ["R"])
    res = infer("flash_attention_score", spec((2, 6, 16), ["S(2)"]), kv, kv, head_num=4)
    assert res.violations == () and wants(res) == [None, "(S(2))", "(S(2))"]
    q8, kv8 = spec((2, 6, 16), ["S(2)"], mesh8), spec((2, 6, 16), ["R"], mesh8)
    res = infer("flash_attention_score", q8, kv8, kv8, head_num=4)
    (v,) = res.violations
    assert (v.code, v.operand, v.fixable) == ("sharded-head-dim", "query", True)
    assert v.message == ("query dim 2 (size 16) is sharded on mesh axis 'tp' (query is (S(2))), which cuts H = "
                         "head_num * D into parts of heads (D = 4); attention contracts over whole heads")
    assert wants(res) == ["(R)", None, None]


def test_flash_sequence_sharding_of_key_is_fixed_by_an_all_gather():
    q = spec((2, 8, 16), ["S(1)"])
    res = infer("FlashAttentionScore", q, q, q, head_num=4, sparse_mode=2)
    assert [(v.code, v.operand, v.fixable) for v in res.violations] == [
        ("sharded-kv-sequence", "key", True), ("sharded-kv-sequence", "value", True)]
    assert wants(res) == [None, "(R)", "(R)"]


@pytest.mark.parametrize("attrs, code, message", [
    ({"head_num": 3}, "invalid-shape", "query's H (dim 2) is 16, not a multiple of head_num=3"),
    ({"head_num": 4, "keep_prob": 1.5}, "invalid-attr", "keep_prob=1.5 is not a probability in (0, 1]"),
    ({"head_num": 4, "sparse_mode": 5}, "invalid-attr",
     "sparse_mode=5 is not one of [0, 1, 2, 3, 4] (0 band, 1 attn_mask only, 2 top-left causal, 3 bottom-right "
     "causal, 4 band from the bottom-right)"),
    ({"head_num": 4, "input_layout": "BHS"}, "invalid-input-layout",
     "input_layout 'BHS' is not one of ['BSH', 'SBH', 'BNSD', 'BSND', 'TND']"),
    ({"head_num": 4, "actual_seq_qlen": [2, 8]}, "invalid-attr",
     "actual_seq_qlen=[2, 8] is given with input_layout BSH"),
    ({"head_num": 0}, "invalid-attr", "head_num=0 is not a positive integer"),
])
def test_flash_bad_attrs_and_shapes(attrs, code, message):
    q = spec((2, 8, 16), ["R"])
    (v,) = infer("flash_attention_score", q, q, q, **attrs).violations
    assert (v.code, v.message) == (code, message)


def test_flash_tnd_sequence_lengths_are_checked():
    q, kv = spec((7, 4, 4), ["R"]), spec((6, 2, 4), ["R"])
    (v,) = infer("flash_attention_score", q, kv, kv, head_num=4, input_layout="TND", actual_seq_qlen=[3, 6],
                 actual_seq_kvlen=[2, 6]).violations
    assert (v.code, v.message) == ("invalid-attr", "actual_seq_qlen=[3, 6] is not the cumulative ends of the packed "
                                   "sequences (non-decreasing, non-negative, the last one 7, the length of T)")
    (v,) = infer("flash_attention_score", q, kv, kv, head_num=4, input_layout="TND").violations[:1]
    assert v.message == "input_layout TND needs actual_seq_qlen"


# head counts grouped-query attention cannot pair, per layout:
# (layout, query shape, key/value shape, head_num, key/value heads, extra attrs)
BAD_HEAD_COUNTS = [
    ("BSH", (1, 3, 8), (1, 3, 16), 2, 4, {}),         # 2 query heads of 4, 4 kv heads
    ("SBH", (3, 1, 8), (3, 1, 16), 2, 4, {}),
    ("BNSD", (1, 2, 3, 4), (1, 4, 3, 4), 2, 4, {}),
    ("BSND", (1, 3, 2, 4), (1, 3, 4, 4), 2, 4, {}),
    ("TND", (3, 2, 4), (3, 4, 4), 2, 4, {"actual_seq_qlen": [3], "actual_seq_kvlen": [3]}),
    ("BNSD", (1, 3, 3, 4), (1, 2, 3, 4), 3, 2, {}),   # 3 query heads over 2 kv heads: not a multiple either
]


@pytest.mark.parametrize("layout, q_shape, kv_shape, heads, kv_heads, extra", BAD_HEAD_COUNTS)
def test_flash_rule_refuses_query_heads_that_are_no_multiple_of_the_kv_heads(layout, q_shape, kv_shape, heads,
                                                                            kv_heads, extra):
    q, kv = spec(q_shape, ["R"]), spec(kv_shape, ["R"])
    (v,) = infer("flash_attention_score", q, kv, kv, head_num=heads, input_layout=layout, **extra).violations
    assert (v.code, v.fixable) == ("invalid-shape", False)
    assert v.message.startswith(f"q has {heads} heads but k and v have {kv_heads} (head_num {heads}; ")
    assert v.message.endswith("grouped-query attention needs q's head count to be a multiple of k's and v's")


@pytest.mark.parametrize("backend", ["numpy", "mindspore"])
@pytest.mark.parametrize("layout, q_shape, kv_shape, heads, kv_heads, extra", BAD_HEAD_COUNTS)
def test_flash_kernels_refuse_query_heads_that_are_no_multiple_of_the_kv_heads(backend, layout, q_shape, kv_shape,
                                                                               heads, kv_heads, extra):
    # MindSpore's FlashAttentionScore refuses them; the kernels used to compute something (query head h
    # read kv head h, or an index past the kv heads)
    from layout_prop.core.errors import OpError

    kernels = attention_numpy.KERNELS
    if backend == "mindspore":
        pytest.importorskip("mindspore")
        from layout_prop.kernels.mindspore_backend import KERNELS as kernels
    q, kv = np.ones(q_shape, np.float32), np.ones(kv_shape, np.float32)
    attrs = {"head_num": heads, "input_layout": layout, **extra}
    for op, args in (("flash_attention_score", (q, kv, kv)), ("flash_attention_score_grad", (q, q, kv, kv))):
        with pytest.raises(OpError) as err:
            kernels[op](*args, **attrs)
        assert err.value.code == "invalid-shape"
        assert err.value.message.startswith(f"query has {heads} heads but key and value have {kv_heads} "
                                            f"(input_layout {layout}; query {q_shape}, key {kv_shape}")
        assert err.value.hint.startswith("give key and value a head count that divides query's")


def test_flash_kernel_takes_fewer_query_heads_than_kv_heads_with_a_rank_kv_head_map():
    # 4 query heads on 4 ranks over 2 replicated kv heads: a rank holds 1 query head and both kv heads,
    # and its localised kv_head_map says which one its head reads
    rng = np.random.default_rng(9)
    q, k, v = rng.standard_normal((1, 4, 3, 2)), rng.standard_normal((1, 2, 3, 2)), rng.standard_normal((1, 2, 3, 2))
    whole = attention_numpy.flash_attention_score(q, k, v, head_num=4, input_layout="BNSD")
    for head in range(4):
        piece = attention_numpy.flash_attention_score(q[:, head:head + 1], k, v, head_num=1, input_layout="BNSD",
                                                      kv_head_map=(head // 2,))
        np.testing.assert_allclose(piece, whole[:, head:head + 1], rtol=1e-12)
    # and the whole graph, query heads sharded 4 ways, key and value replicated, forward and backward
    run(attention_spec({"shape": [4], "names": ["tp"]}, (1, 4, 3, 2), (1, 2, 3, 2), ["S(1)"], ["R"],
                       op="flash_attention_score", attrs={"head_num": 4, "input_layout": "BNSD"}))

def test_flash_runs_sharded_forward_and_backward():
    # BSH, 4 query heads and 2 kv heads; batch on dp, heads on tp, bottom-right causal
    rep = run(attention_spec({"shape": [2, 2], "names": ["dp", "tp"]}, (2, 6, 16), (2, 8, 8), ["S(0)", "S(2)"],
                             ["S(0)", "R"], op="FlashAttentionScore", attrs={"head_num": 4, "sparse_mode": 3}))
    # 2 kv heads split on tp with the 4 query heads (a free slice forward); their gradients, S(2) there, are
    # gathered back to the Replicate inputs
    assert collectives(rep) == [("grad/k", "all-gather", "tp"), ("grad/v", "all-gather", "tp")]
    # TND, packed sequences cut across ranks on T (each rank's rows find their sequence by q_start)
    run(attention_spec({"shape": [4], "names": ["cp"]}, (9, 2, 4), (7, 1, 4), ["S(0)"], ["R"],
                       op="flash_attention_score", attrs={"head_num": 2, "input_layout": "TND", "sparse_mode": 3,
                                                          "actual_seq_qlen": [2, 5, 9],
                                                          "actual_seq_kvlen": [3, 4, 7]}))


def test_flash_dropout_draws_what_one_device_draws_on_every_layout():
    # keep_prob 0.75: the draws are keyed by the global (b, n, i, j) index, so batch on dp, heads on tp, the query
    # sequence on tp (k, v gathered) and Ulysses all equal one device, forward and backward
    mesh = {"shape": [2, 2], "names": ["dp", "tp"]}
    attrs = {"head_num": 4, "sparse_mode": 2, "keep_prob": 0.75, "seed": 7}
    for q_placements, kv_placements, extra in ((["S(0)", "S(2)"], ["S(0)", "R"], {}),
                                               (["R", "S(1)"], ["R", "S(1)"], {}),
                                               (["R", "S(1)"], ["R", "S(1)"], {"context_parallel": "ulysses"})):
        run(attention_spec(mesh, (2, 8, 16), (2, 8, 8), q_placements, kv_placements, op="FlashAttentionScore",
                           attrs={**attrs, **extra}))


def test_flash_dropout_drops_about_one_minus_keep_prob_and_its_backward_is_exact():
    rng = np.random.default_rng(6)
    keep = attention_numpy.dropout_keep((2, 4, 64, 64), 0.75, 3, (0, 0, 0, 0), (2, 4, 64, 64))
    assert abs(keep.mean() - 0.75) < 0.01  # 32,768 draws: the standard deviation of the mean is 0.0024
    q, k, v = rng.standard_normal((1, 3, 4)), rng.standard_normal((1, 5, 4)), rng.standard_normal((1, 5, 4))
    attrs = {"head_num": 2, "keep_prob": 0.6, "seed": 1, "scale": 0.5}
    fwd = attention_numpy.flash_attention_score
    dy = rng.standard_normal(q.shape)
    dq, dk, dv = attention_numpy.flash_attention_score_grad(dy, q, k, v, **attrs)
    np.testing.assert_allclose(dq, _finite_difference(lambda t: fwd(t, k, v, **attrs), q, dy), atol=1e-7)
    np.testing.assert_allclose(dk, _finite_difference(lambda t: fwd(q, t, v, **attrs), k, dy), atol=1e-7)
    np.testing.assert_allclose(dv, _finite_difference(lambda t: fwd(q, k, t, **attrs), v, dy), atol=1e-7)
    assert not np.allclose(fwd(q, k, v, **attrs), fwd(q, k, v, **{**attrs, "keep_prob": 1.0}))


# ==================================================================== context parallelism: Ulysses
CP4 = DeviceMesh((4,), ("cp",))


def test_ulysses_moves_q_k_v_from_the_sequence_to_the_heads():
    q = spec((2, 8, 16, 4), ["S(2)"], CP4)
    res = infer("sdpa", q, q, q, causal=True, context_parallel="ulysses")
    assert wants(res) == ["(S(1))", "(S(1))", "(S(1))"] and layouts(res) == ["(S(1))"]
    q_violation = next(v for v in res.violations if v.operand == "q")
    assert (q_violation.code, q_violation.fixable) == ("sharding-mismatch", True)
    assert q_violation.message == (
        "context_parallel='ulysses': q's sequence is sharded on mesh axis 'cp' (q is (S(2))); attention runs with the "
        "heads sharded there instead ((S(1)): Ulysses, an all-to-all of q, key and value, and of the output back)")
    k_violation = next(v for v in res.violations if v.operand == "k")
    assert (k_violation.code, k_violation.hint) == ("sharded-kv-sequence", "all-to-all k on 'cp' to its heads (dim 1)")
    # the gradient rule agrees: dy arrives with the heads sharded, nothing is partial
    heads = spec((2, 8, 16, 4), ["S(1)"], CP4)
    res = infer("scaled_dot_product_attention_grad", heads, heads, heads, heads, causal=True,
                context_parallel="ulysses")
    assert res.violations == () and layouts(res) == ["(S(1))"] * 3


def test_ulysses_falls_back_to_gathering_when_the_heads_cannot_split():
    # 8 query heads, 1 kv head: the kv head cannot follow the query heads over 4 ranks
    q, kv = spec((2, 8, 16, 4), ["S(2)"], CP4), spec((2, 1, 16, 4), ["S(2)"], CP4)
    res = infer("sdpa", q, kv, kv, context_parallel="ulysses")
    assert wants(res) == [None, "(R)", "(R)"]
    assert {v.code for v in res.violations} == {"sharded-kv-sequence"}


@pytest.mark.parametrize("ranks, strategy", [(2, "all_gather"), (4, "ulysses")])
def test_auto_takes_the_strategy_moving_fewer_bytes(ranks, strategy):
    # equal q, k, v of X bytes on P ranks: gathering k and v moves 2X(P-1)/P, the four all-to-alls 4X(P-1)/P^2:
    # a tie on 2 ranks (the gather is kept), Ulysses from 3 on
    mesh = DeviceMesh((ranks,), ("cp",))
    q = spec((2, 8, 16, 4), ["S(2)"], mesh)
    res = infer("sdpa", q, q, q, context_parallel="auto")
    expected = {"all_gather": [None, "(R)", "(R)"], "ulysses": ["(S(1))", "(S(1))", "(S(1))"]}[strategy]
    assert wants(res) == expected


def _greedy_moves(spec_dict):
    """The collectives the greedy reshard sweep inserts (no whole-graph solver)."""
    from layout_prop.passes.reshard import Reshard
    from layout_prop.api import analyze

    graph = Reshard().run(load_spec(spec_dict)).graph
    moves = []
    for node in graph.nodes:
        if node.op == "redistribute" and node.name.startswith("o/"):  # inserted before the attention node o
            moves.append((node.name, tuple(node.attrs["placements"])))
    return sorted(moves), analyze(graph).ok


def test_ulysses_runs_forward_and_backward_with_gqa_and_the_greedy_sweep_chooses_it():
    mesh = {"shape": [4], "names": ["cp"]}
    spec_dict = attention_spec(mesh, (2, 8, 16, 4), (2, 4, 16, 4), ["S(2)"], ["S(2)"],
                               attrs={"causal": True, "context_parallel": "ulysses"})
    spec_dict["nodes"].append({"name": "y", "op": "redistribute", "inputs": ["o"], "attrs": {"placements": ["S(2)"]}})
    spec_dict["outputs"] = ["y"]
    moves, ok = _greedy_moves(spec_dict)
    assert ok and moves == [("o/k", ("S(1)",)), ("o/q", ("S(1)",)), ("o/v", ("S(1)",))]
    rep = run(spec_dict)
    kinds = {c[1] for c in collectives(rep)}
    assert kinds == {"all-to-all"}


def test_the_whole_graph_solver_chooses_ulysses_where_it_moves_fewer_bytes():
    # context_parallel all_gather: the greedy sweep gathers k and v (2 x 3/4 of 4 KiB); the solver analyze asks on
    # small graphs finds the four all-to-alls (4 x 3/16 of 4 KiB) cheaper and keeps them
    mesh = {"shape": [4], "names": ["cp"]}
    spec_dict = attention_spec(mesh, (2, 8, 16, 4), (2, 8, 16, 4), ["S(2)"], ["S(2)"])
    spec_dict["nodes"].append({"name": "y", "op": "redistribute", "inputs": ["o"], "attrs": {"placements": ["S(2)"]}})
    spec_dict["outputs"] = ["y"]
    moves, _ = _greedy_moves(spec_dict)
    assert moves == [("o/k", ("R",)), ("o/v", ("R",))]
    rep = run(spec_dict)
    forward = sorted(c for c in collectives(rep) if not c[0].startswith("grad/"))
    assert forward == [("o/k", "all-to-all", "cp"), ("o/q", "all-to-all", "cp"), ("o/v", "all-to-all", "cp"),
                       ("y", "all-to-all", "cp")]


def test_flash_ulysses_cuts_fused_heads_whole_and_runs():
    mesh = {"shape": [4], "names": ["cp"]}
    spec_dict = attention_spec(mesh, (2, 16, 32), (2, 16, 16), ["S(1)"], ["S(1)"], op="FlashAttentionScore",
                               attrs={"head_num": 8, "sparse_mode": 2, "context_parallel": "auto"})
    rep = run(spec_dict)
    assert ("o/query", "all-to-all", "cp") in collectives(rep)
    # 4 heads of 8 on 8 ranks cannot be whole: the gather stays
    q = spec((2, 16, 32), ["S(1)"], DeviceMesh((8,), ("cp",)))
    res = infer("flash_attention_score", q, q, q, head_num=4, context_parallel="ulysses")
    assert wants(res) == [None, "(R)", "(R)"]


def test_context_parallel_must_be_known():
    q = spec((2, 8, 16, 4), ["R"], CP4)
    (v,) = infer("sdpa", q, q, q, context_parallel="rings").violations
    assert (v.code, v.message) == ("invalid-attr", "context_parallel='rings' is not one of ['all_gather', 'ulysses', "
                                   "'auto', 'ring']")


# ==================================================================== zig-zag order (load balance)
def test_zigzag_order_balances_causal_work_over_the_shards():
    # 16 tokens on 4 shards, causal: the natural order gives shard r rows 4r..4r+3, seeing 10, 26, 42, 58 keys;
    # the zig-zag order (chunks r and 7 - r of 2 tokens) gives every shard 34
    for zigzag, expected in ((0, [10, 26, 42, 58]), (4, [34, 34, 34, 34])):
        mask = nn_numpy.causal_visible(16, 16, 0, zigzag)
        assert [int(mask[4 * r:4 * r + 4].sum()) for r in range(4)] == expected


def test_zigzag_attention_is_natural_attention_in_the_stored_order():
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 2, 12, 3)) for _ in range(3))
    positions = nn_numpy.zigzag_positions(12, 3)
    stored = [t[:, :, positions] for t in (q, k, v)]
    got = nn_numpy.scaled_dot_product_attention(*stored, causal=True, zigzag=3)
    want = nn_numpy.scaled_dot_product_attention(q, k, v, causal=True)[:, :, positions]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    got = attention_numpy.flash_attention_score(*[np.transpose(t, (0, 2, 1, 3)) for t in stored], head_num=2,
                                                input_layout="BSND", sparse_mode=2, zigzag=3, scale=3 ** -0.5)
    np.testing.assert_allclose(np.transpose(got, (0, 2, 1, 3)), want, rtol=1e-12)


@pytest.mark.parametrize("op, attrs", [
    ("sdpa", {"causal": True, "zigzag": 4}),
    ("sdpa", {"causal": True, "zigzag": 4, "context_parallel": "ulysses"}),
])
def test_zigzag_sequence_sharded_runs_forward_and_backward(op, attrs):
    run(attention_spec({"shape": [4], "names": ["cp"]}, (1, 4, 16, 2), (1, 4, 16, 2), ["S(2)"], ["S(2)"], op=op,
                       attrs=attrs))


def test_flash_zigzag_runs_and_bad_lengths_are_invalid_shape():
    run(attention_spec({"shape": [2, 2], "names": ["dp", "cp"]}, (2, 8, 8), (2, 8, 8), ["S(0)", "S(1)"],
                       ["S(0)", "S(1)"], op="FlashAttentionScore", attrs={"head_num": 2, "sparse_mode": 2,
                                                                          "zigzag": 2}))
    q = spec((1, 4, 10, 2), ["R"], CP4)
    (v,) = infer("sdpa", q, q, q, causal=True, zigzag=4).violations
    assert (v.code, v.message) == ("invalid-shape", "zigzag=4 keeps the sequence in 8 chunks, but the query sequence "
                                   "is 10 and the key sequence 10")


def test_zigzag_mindspore_kernels_match_numpy():
    pytest.importorskip("mindspore")
    from layout_prop.kernels.mindspore_backend import KERNELS as MS, to_numpy

    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 2, 4, 3)).astype(np.float32)  # rows 4..7 of a sequence of 8 in zig-zag order
    k, v, dy = (rng.standard_normal(s).astype(np.float32) for s in ((1, 2, 8, 3), (1, 2, 8, 3), (1, 2, 4, 3)))
    attrs = {"causal": True, "q_offset": 4, "zigzag": 2}
    for op, args in (("scaled_dot_product_attention", (q, k, v)), ("scaled_dot_product_attention_grad", (dy, q, k, v))):
        want = nn_numpy.KERNELS[op](*args, **attrs)
        got = MS[op](*args, **attrs)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            np.testing.assert_allclose(to_numpy(g), w, rtol=1e-5, atol=1e-5)


# ==================================================================== flash_attention_score's attn_mask
def test_attn_mask_follows_query_rows_batch_and_heads():
    mesh = DeviceMesh((2, 2), ("dp", "cp"))
    q = spec((2, 8, 16), ["S(0)", "S(1)"], mesh)
    kv = spec((2, 8, 16), ["S(0)", "R"], mesh)
    for mask_shape, want in (((8, 8), "(R, S(0))"), ((2, 1, 8, 8), "(S(0), S(2))"), ((1, 4, 8, 8), "(R, S(2))")):
        mask = spec(mask_shape, ["R", "R"], mesh, dtype="bool")
        res = infer("flash_attention_score", q, kv, kv, mask, head_num=4)
        assert res.violations == () and wants(res)[3] == want, mask_shape
    sharded = spec((8, 8), ["R", "S(1)"], mesh, dtype="bool")  # keys cut: every row needs all its keys
    res = infer("flash_attention_score", q, kv, kv, sharded, head_num=4)
    assert [(v.code, v.operand, v.fixable) for v in res.violations] == [("sharding-mismatch", "attn_mask", True)]


def test_attn_mask_shapes_and_modes():
    q = spec((2, 8, 16), ["R"])
    (v,) = infer("flash_attention_score", q, q, q, spec((8, 4), ["R"], dtype="bool"), head_num=4).violations
    assert (v.code, v.operand) == ("invalid-shape", "attn_mask")
    assert v.message == ("attn_mask has shape [8, 4], but query [2, 8, 16] and key [2, 8, 16] (BSH) take (8, 8) or "
                         "(2 or 1, 4 or 1, 8, 8)")
    (v,) = infer("flash_attention_score", q, q, q, head_num=4, sparse_mode=1).violations
    assert v.message == "sparse_mode=1 (allMask) computes what attn_mask allows, but no attn_mask is given"
    # modes 2-4 ignore the mask (MindSpore's compressed 2048 x 2048 causal mask): no shape asked, no move
    res = infer("flash_attention_score", q, q, q, spec((2048, 2048), ["S(0)"], dtype="bool"), head_num=4,
                sparse_mode=2)
    assert res.violations == () and wants(res)[3] is None


def test_attn_mask_of_a_lower_triangle_is_top_left_causal_and_mode_1_reads_the_mask_alone():
    rng = np.random.default_rng(9)
    q, k, v = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 4))
    upper = np.triu(np.ones((5, 5), bool), 1)  # True: masked out
    fa = attention_numpy.flash_attention_score
    np.testing.assert_allclose(fa(q, k, v, upper, head_num=2), fa(q, k, v, head_num=2, sparse_mode=2), rtol=1e-12)
    np.testing.assert_allclose(fa(q, k, v, upper, head_num=2, sparse_mode=1, pre_tokens=0, next_tokens=0),
                               fa(q, k, v, head_num=2, sparse_mode=2), rtol=1e-12)
    # mode 0 keeps its band too: band 0..0 and the lower triangle leave the diagonal
    diagonal = fa(q, k, v, upper, head_num=2, pre_tokens=0, next_tokens=0)
    np.testing.assert_allclose(diagonal[..., :2], v[..., :2], rtol=1e-12)


def test_attn_mask_runs_sharded_forward_and_backward():
    # a padding mask per batch row (B, 1, S1, S2), batch on dp and the query rows on cp (k, v gathered)
    mesh = {"shape": [2, 2], "names": ["dp", "cp"]}
    spec_dict = attention_spec(mesh, (2, 8, 16), (2, 8, 8), ["S(0)", "S(1)"], ["S(0)", "R"],
                               op="FlashAttentionScore", attrs={"head_num": 4, "sparse_mode": 1})
    spec_dict["inputs"]["m"] = {"shape": [2, 1, 8, 8], "dtype": "bool", "requires_grad": False}
    spec_dict["nodes"][0]["inputs"].append("m")
    rep = run(spec_dict)
    assert sorted(rep.grads) == ["k", "q", "v"]
