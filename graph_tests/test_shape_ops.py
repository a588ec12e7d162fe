"""The shape ops: layout rules checked against layouts written by hand, every violation code
with its message, localized attrs, numpy backwards against central finite differences, and
whole graphs (reshape to heads, transpose for attention) run forward and backward on every
simulated rank.

Expected layouts, shapes and blocks below are worked out by hand (comments say how);
numerical references are plain numpy or finite differences, never the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from layout_prop import LayoutError
from layout_prop.core import meta
from layout_prop.api import analyze
from layout_prop.core.graph import Graph
from layout_prop.kernels.numpy_backend import KERNELS
from layout_prop.core.layout import Layout
from layout_prop.io.loader import load_spec
from layout_prop.core.mesh import DeviceMesh
from layout_prop.ops.shape import SPLIT_VARIANTS, reshape_groups, resolve_shape, shard_blocks
from layout_prop.passes.backward import Backward
from layout_prop.passes.lower import Lower
from layout_prop.core.registry import get_rule, registered_ops
from layout_prop.runner import execute_global, run_graph
from layout_prop.core.spec import TensorSpec

DP_TP = DeviceMesh((2, 2), ("dp", "tp"))
TP = DeviceMesh((2,), ("tp",))
SHAPE_OPS = ("reshape", "transpose", "slice", "pad_slice", "concat", "unsqueeze", "squeeze", "sharding_constraint",
             "split", "chunk", *SPLIT_VARIANTS)


def spec(shape, placements, mesh=DP_TP, dtype="float32") -> TensorSpec:
    return TensorSpec(shape, dtype, Layout(mesh, placements, len(shape)))


def infer(op, *specs, **attrs):
    rule = get_rule(op)
    return rule.infer_layout(tuple(specs), rule.normalize_attrs(attrs))


def layouts(result) -> list[str | None]:
    return [None if o is None else str(o.layout) for o in result.outputs]


def codes(result) -> list[str]:
    return [v.code for v in result.violations]


# ============================================================================ reshape
class TestReshapeGroups:
    def test_by_hand(self):
        # (B, S, H) -> (B, S, N, D): B and S map one to one, H splits into N, D
        assert reshape_groups((4, 6, 8), (4, 6, 2, 4)) == [((0,), (0,)), ((1,), (1,)), ((2,), (2, 3))]
        # (B, S, H) -> (B*S, H)
        assert reshape_groups((4, 6, 8), (24, 8)) == [((0, 1), (0,)), ((2,), (1,))]
        # 6*4 = 4*6 with no shorter common prefix: one group of two dims on each side
        assert reshape_groups((6, 4), (4, 6)) == [((0, 1), (0, 1))]
        # size-1 dims belong to no group
        assert reshape_groups((2, 1, 6, 4), (12, 1, 2, 2)) == [((0, 2), (0,)), ((3,), (2, 3))]
        assert reshape_groups((1, 1), ()) == []

    def test_resolve_shape(self):
        assert resolve_shape(48, [12, 1, -1, 2]) == ((12, 1, 2, 2), "")
        assert resolve_shape(6, [2, 3]) == ((2, 3), "")
        assert resolve_shape(6, [-1, -1])[0] is None
        assert resolve_shape(6, [4])[1] == "shape [4] holds 4 elements but x has 6"
        assert resolve_shape(6, [-2, -3])[0] is None
        assert resolve_shape(6, "23")[0] is None

    def test_shard_blocks_nested(self):
        # 10 on 2 -> 5, 5; each 5 on 2 -> 3, 2
        assert shard_blocks(10, [2, 2]) == [(0, 3), (3, 5), (5, 8), (8, 10)]
        assert shard_blocks(3, [4]) == [(0, 1), (1, 2), (2, 3), (3, 3)]


class TestReshapeRule:
    def test_heads_split_keeps_tp_on_n(self):
        # (B, S, H) = (4, 6, 8), H on tp -> (B, S, N, D) = (4, 6, 2, 4): N (2 on 2) on tp
        res = infer("reshape", spec((4, 6, 8), ["S(0)", "S(2)"]), shape=[4, 6, 2, 4])
        assert layouts(res) == ["(S(0), S(2))"] and res.violations == () and res.wants == (None,)
        assert res.outputs[0].shape == (4, 6, 2, 4)
        assert res.outputs[0].local_shape(0) == (2, 6, 1, 4)

    def test_merge_b_s_with_b_sharded_keeps_the_sharding(self):
        res = infer("view", spec((4, 6, 8), ["S(0)", "R"]), shape=[24, 8])
        assert layouts(res) == ["(S(0), R)"] and res.violations == ()
        assert res.outputs[0].local_shape(2) == (12, 8)

    def test_merge_b_s_with_s_sharded_is_a_strided_shard(self):
        # S = 6 on tp: each rank holds S rows [3c, 3c+3) of every b: elements b*6 + j of B*S = 24
        x = spec((4, 6, 8), ["R", "S(1)"])
        res = infer("reshape", x, shape=[24, 8])
        assert layouts(res) == ["(R, _S(0,4))"] and res.violations == () and res.wants == (None,)
        out = res.outputs[0]
        assert [out.dim_indices(0, (0, c)).tolist() for c in range(2)] == [
            [b * 6 + j for b in range(4) for j in range(3)], [b * 6 + j for b in range(4) for j in range(3, 6)]]
        back = infer("reshape", out, shape=[4, 6, 8])  # and back: the strided shard is S(1) again
        assert layouts(back) == ["(R, S(1))"] and back.violations == ()

    def test_uneven_b_merged_with_s_is_a_violation(self):
        # B = 3 on 2 ranks: rows [0:2), [2:3) -> elements [0:8), [8:12) of B*S = 12;
        # the output's torch.chunk blocks are [0:6), [6:12)
        res = infer("reshape", spec((3, 4, 6), ["S(0)", "R"]), shape=[12, 6])
        assert codes(res) == ["reshape-sharded-dim"]
        v = res.violations[0]
        for fragment in ("x dim 0 (size 3)", "2 ways", "mesh axis 'dp'", "[0:8), [8:12)", "[0:6), [6:12)",
                         "output dim 0 (size 12)", "2 divides both 3 and 12"):
            assert fragment in v.message, (fragment, v.message)
        assert "all-gather x dim 0 on mesh axis 'dp'" in v.hint
        assert str(res.wants[0]) == "(R, R)"

    def test_uneven_but_aligned_blocks_are_exact(self):
        # B = 3 on 4 ranks: rows 1, 1, 1, 0 -> 2, 2, 2, 0 elements of B*S = 6, exactly torch.chunk(6, 4)
        mesh = DeviceMesh((4,), ("dp",))
        res = infer("reshape", spec((3, 2, 5), ["S(0)"], mesh), shape=[6, 5])
        assert layouts(res) == ["(S(0))"] and res.violations == ()
        # on a 2 x 2 mesh the same 4 pieces are cut nested (3 -> 2, 1 -> 1, 1, 1, 0 rows; 6 -> 3, 3 -> 2, 1, 2, 1)
        nested = infer("reshape", spec((3, 2, 5), ["S(0)", "S(0)"]), shape=[6, 5])
        assert codes(nested) == ["reshape-sharded-dim", "reshape-sharded-dim"]  # one per mesh axis
        assert str(nested.wants[0]) == "(R, R)"

    def test_one_to_one_dim_keeps_uneven_sharding(self):
        res = infer("reshape", spec((5, 6), ["S(0)"], TP), shape=[5, 2, 3])
        assert layouts(res) == ["(S(0))"] and res.violations == ()
        rule = get_rule("reshape")
        assert [rule.localize({"shape": [5, 2, 3]}, (res.outputs[0],), res.outputs, r) for r in range(2)] == [
            {"shape": [3, 2, 3]}, {"shape": [2, 2, 3]}]

    def test_split_with_two_axes_on_one_dim_shards_both_output_dims(self):
        # H = 8 on dp x tp (4 ways) -> (N, D) = (2, 4): dp cuts N 1, 1; tp cuts each N row, that is D, in half
        res = infer("reshape", spec((4, 6, 8), ["S(2)", "S(2)"]), shape=[4, 6, 2, 4])
        assert layouts(res) == ["(S(2), S(3))"] and res.violations == ()

    def test_regroup_two_by_two(self):
        # (6, 4) -> (4, 6), dim 0 on 2: rows [0:3) = elements [0:12) = output rows [0:2)
        assert layouts(infer("reshape", spec((6, 4), ["S(0)"], TP), shape=[4, 6])) == ["(S(0))"]
        # (6, 4) -> (4, 6), dim 0 on 4 ... on dp x tp: 6 -> 3, 3 -> 2, 1, 2, 1 rows; 4 -> 1 row each: no
        assert codes(infer("reshape", spec((6, 4), ["S(0)", "S(0)"]), shape=[4, 6])) == ["reshape-sharded-dim"]

    @pytest.mark.parametrize("partial", ["P(sum)", "P(max)", "P(avg)"])
    def test_partial_passes(self, partial):
        res = infer("reshape", spec((4, 6, 8), ["S(0)", partial]), shape=[4, 48])
        assert layouts(res) == [f"(S(0), {partial})"] and res.violations == ()

    def test_size_one_dims_and_minus_one(self):
        res = infer("reshape", spec((2, 1, 6, 4), ["S(0)", "S(3)"]), shape=[12, 1, -1, 2])
        assert res.outputs[0].shape == (12, 1, 2, 2)
        assert layouts(res) == ["(S(0), S(2))"] and res.violations == ()

    def test_size_one_mesh_axis_never_complains(self):
        mesh = DeviceMesh((2, 1), ("dp", "tp"))
        res = infer("reshape", spec((4, 6, 8), ["S(0)", "S(1)"], mesh), shape=[24, 8])
        assert layouts(res) == ["(S(0), R)"] and res.violations == ()

    @pytest.mark.parametrize("shape,fragment", [
        ([5, -1], "the other dims give 5, which does not divide 192"),
        ([-1, -1, 8], "more than one -1"),
        ([4, 6, 9], "holds 216 elements but x has 192"),
        ([4, -3, 8], "negative size"),
        (None, "not a list of integers"),
    ])
    def test_invalid_reshape(self, shape, fragment):
        res = infer("reshape", spec((4, 6, 8), ["R", "R"]), shape=shape)
        assert codes(res) == ["invalid-reshape"] and res.outputs == (None,)
        v = res.violations[0]
        assert fragment in v.message and "[4, 6, 8]" in v.message and not v.fixable
        assert "192 elements" in v.hint


# ============================================================================ transpose
class TestTranspose:
    def test_attention_bsnd_to_bnsd(self):
        # (B, S, N, D) with B on dp, N on tp -> dims [0, 2, 1, 3]: N becomes dim 1
        res = infer("permute", spec((2, 8, 4, 16), ["S(0)", "S(2)"]), dims=[0, 2, 1, 3])
        assert layouts(res) == ["(S(0), S(1))"] and res.outputs[0].shape == (2, 4, 8, 16)

    def test_swap_form_and_negative_dims(self):
        res = infer("transpose", spec((3, 5, 7), ["S(2)", "S(0)"]), dim0=-1, dim1=0)
        assert layouts(res) == ["(S(0), S(2))"] and res.outputs[0].shape == (7, 5, 3)

    def test_nested_shards_keep_their_order(self):
        res = infer("Transpose", spec((8, 3), ["S(0)", "S(0)"]), dims=[1, 0])
        assert layouts(res) == ["(S(1), S(1))"]

    def test_partial_passes(self):
        assert layouts(infer("transpose", spec((4, 6), ["P(max)", "S(0)"]), dims=[1, 0])) == ["(P(max), S(1))"]

    @pytest.mark.parametrize("attrs,fragment", [
        ({}, "needs dims (a permutation) or dim0 and dim1"),
        ({"dims": [0, 1], "dim0": 0, "dim1": 1}, "not both"),
        ({"dims": [0, 0, 1]}, "dims=[0, 0, 1] is not a permutation of 0..2"),
        ({"dims": [0, 1]}, "must list 3 dims"),
        ({"dim0": 0, "dim1": 3}, "dim0=0 and dim1=3 must both be dims of x, which has rank 3"),
    ])
    def test_invalid_permutation(self, attrs, fragment):
        res = infer("transpose", spec((4, 6, 8), ["R", "R"]), **attrs)
        assert codes(res) == ["invalid-permutation"] and fragment in res.violations[0].message
        assert "[4, 6, 8]" in res.violations[0].message and "dims: [2, 1, 0]" in res.violations[0].hint


# ============================================================================ split, chunk, slice, pad_slice
class TestSplitChunkSlice:
    def test_split_keeps_other_shards(self):
        # fused qkv (B, S, 3H) split along the last dim, B on dp, S on tp
        res = infer("split3", spec((2, 4, 12), ["S(0)", "S(1)"]), axis=-1)
        assert layouts(res) == ["(S(0), S(1))"] * 3 and res.violations == ()
        assert [o.shape for o in res.outputs] == [(2, 4, 4)] * 3

    def test_split_sizes_and_partial(self):
        res = infer("split2", spec((5, 4), ["P(sum)", "S(1)"]), axis=0, sizes=[2, 3])
        assert [o.shape for o in res.outputs] == [(2, 4), (3, 4)]
        assert layouts(res) == ["(P(sum), S(1))"] * 2

    def test_chunk_uneven_pieces(self):
        # torch.chunk: 5 -> 3, 2; 3 in 4 -> 1, 1, 1, 0
        assert [o.shape for o in infer("chunk2", spec((5, 2), ["R"], TP), axis=0).outputs] == [(3, 2), (2, 2)]
        assert [o.shape[0] for o in infer("chunk4", spec((3, 2), ["R"], TP), axis=0).outputs] == [1, 1, 1, 0]

    def test_split_along_a_sharded_dim_is_a_violation(self):
        res = infer("split2", spec((4, 6), ["S(1)", "S(0)"]), axis=1)
        assert codes(res) == ["sharded-split-dim"]
        v = res.violations[0]
        for fragment in ("x dim 1 (size 6)", "2 ways", "mesh axis 'dp'", "pieces of sizes [3, 3]", "(S(1), S(0))"):
            assert fragment in v.message, (fragment, v.message)
        assert v.hint == "all-gather x dim 1 on 'dp' before the split2, or shard another dim on 'dp'"
        assert v.fixable and str(res.wants[0]) == "(R, S(0))"
        assert layouts(res) == ["(R, S(0))"] * 2

    @pytest.mark.parametrize("attrs,fragment", [
        ({"axis": 0}, "5 is not divisible by 2 for equal sections"),
        ({"axis": 0, "sizes": [2, 2]}, "sizes=[2, 2] must be 2 non-negative sizes summing to 5"),
        ({"axis": 0, "sizes": [6, -1]}, "must be 2 non-negative sizes summing to 5"),
        ({"axis": 0, "sizes": [1, 2, 2]}, "must be 2 non-negative sizes"),
    ])
    def test_invalid_split(self, attrs, fragment):
        res = infer("split2", spec((5, 4), ["R"], TP), **attrs)
        assert codes(res) == ["invalid-split"] and res.outputs == (None, None)
        assert fragment in res.violations[0].message and "x dim 0 (size 5)" in res.violations[0].message
        assert "chunk2" in res.violations[0].hint

    def test_slice(self):
        res = infer("slice", spec((4, 6), ["S(0)", "R"]), axis=1, start=1, stop=-1)
        assert layouts(res) == ["(S(0), R)"] and res.outputs[0].shape == (4, 4) and res.violations == ()
        bad = infer("slice", spec((4, 6), ["S(0)", "S(1)"]), axis=1, start=2)
        assert codes(bad) == ["sharded-split-dim"] and "keeps only [2:6) of it" in bad.violations[0].message
        assert "mesh axis 'tp'" in bad.violations[0].message and str(bad.wants[0]) == "(S(0), R)"

    def test_slice_of_the_whole_axis_keeps_its_shards(self):
        x = spec((5, 6), ["S(0)", "R"])
        res = infer("slice", x, axis=0, start=-10, stop=None)
        assert layouts(res) == ["(S(0), R)"] and res.violations == ()
        rule = get_rule("slice")
        assert rule.localize(rule.normalize_attrs({"axis": 0, "start": -10}), (x,), res.outputs, 1) == {
            "axis": 0, "start": 0, "stop": None}

    def test_slice_localize_normalises_bounds(self):
        x = spec((4, 6), ["S(0)", "R"])
        rule = get_rule("slice")
        attrs = rule.normalize_attrs({"axis": -1, "start": -4, "stop": -1})
        res = rule.infer_layout((x,), attrs)
        assert rule.localize(attrs, (x,), res.outputs, 3) == {"axis": 1, "start": 2, "stop": 5}

    def test_pad_slice(self):
        res = infer("pad_slice", spec((4, 3), ["S(0)", "P(sum)"]), axis=1, start=1, size=6)
        assert layouts(res) == ["(S(0), P(sum))"] and res.outputs[0].shape == (4, 6)
        bad = infer("pad_slice", spec((4, 3), ["S(1)", "R"]), axis=1, start=1, size=6)
        assert codes(bad) == ["sharded-split-dim"] and "pads it to [1:4) of 6" in bad.violations[0].message
        unpadded = infer("pad_slice", spec((4, 3), ["S(1)", "R"]), axis=1, start=0, size=3)
        assert layouts(unpadded) == ["(S(1), R)"] and unpadded.violations == ()
        wrong = infer("pad_slice", spec((4, 3), ["R", "R"]), axis=1, start=4, size=6)
        assert codes(wrong) == ["invalid-split"]
        assert "x dim 1 (size 3) at start=4 in a dim of size=6" in wrong.violations[0].message


# ============================================================================ concat
class TestConcat:
    def test_replicate_operand_is_sliced_for_free(self):
        x = spec((4, 6), ["S(1)", "R"])
        y = spec((2, 6), ["R", "R"])
        res = infer("cat", x, y, axis=0)
        assert layouts(res) == ["(S(1), R)"] and res.violations == ()
        assert res.outputs[0].shape == (6, 6)
        assert [None if w is None else str(w) for w in res.wants] == [None, "(S(1), R)"]

    def test_all_partial_alike_stays_partial(self):
        res = infer("concat", spec((4, 6), ["P(sum)", "S(0)"]), spec((4, 2), ["P(sum)", "S(0)"]), axis=1)
        assert layouts(res) == ["(P(sum), S(0))"] and res.violations == ()

    @pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
    def test_replicate_beside_partial_becomes_terms_for_free(self, op):
        res = infer("concat", spec((4, 6), [f"P({op})", "R"]), spec((4, 2), ["R", "R"]), axis=1)
        assert layouts(res) == [f"(P({op}), R)"] and res.violations == ()
        assert [None if w is None else str(w) for w in res.wants] == [None, f"(P({op}), R)"]

    def test_partial_beside_a_shard_is_partial_input(self):
        res = infer("concat", spec((4, 6), ["P(sum)", "R"]), spec((4, 2), ["S(0)", "R"]), axis=1)
        assert codes(res) == ["partial-input"]
        v = res.violations[0]
        assert v.operand == "x" and "x is P(sum) on mesh axis 'dp' but concat computes S(0) there" in v.message
        assert "reduce x on 'dp' first" in v.hint and v.fixable

    def test_two_different_partials_is_partial_input(self):
        res = infer("concat", spec((4, 6), ["P(sum)", "R"]), spec((4, 2), ["P(max)", "R"]), axis=1)
        assert sorted(codes(res)) == ["partial-input", "partial-input"]

    def test_sharded_concat_dim(self):
        # x (4 rows) is no whole number of x1's blocks (6 rows): x1 is gathered
        res = infer("concat", spec((4, 6), ["R", "R"]), spec((6, 6), ["S(0)", "R"]), axis=0)
        assert codes(res) == ["sharded-concat-dim"]
        v = res.violations[0]
        assert v.operand == "x1"
        for fragment in ("x1 dim 0 (size 6)", "2 ways", "mesh axis 'dp'", "along dim 0 (sizes [4, 6])"):
            assert fragment in v.message, (fragment, v.message)
        assert v.hint == "all-gather x1 dim 0 on 'dp' before the concat, or shard another dim on 'dp'"
        assert layouts(res) == ["(R, R)"]

    def test_concat_of_whole_blocks_stays_sharded(self):
        # equal blocks: x1's rows stay where they are, x is sliced alike for free, the output is _S(0,2)
        res = infer("concat", spec((4, 6), ["R", "R"]), spec((4, 6), ["S(0)", "R"]), axis=0)
        assert codes(res) == [] and layouts(res) == ["(_S(0,2), R)"]
        assert [str(w) if w is not None else None for w in res.wants] == ["(S(0), R)", None]

    def test_operands_sharded_differently_off_the_axis(self):
        x = spec((4, 6, 2), ["S(0)", "R"])
        y = spec((4, 6, 3), ["S(1)", "R"])
        res = infer("concat", x, y, axis=2)
        assert codes(res) == ["sharding-mismatch"]
        v = res.violations[0]
        assert v.operand == "x1" and "x1 is S(1) on mesh axis 'dp' but concat computes S(0) there like x" in v.message
        assert "redistribute x1 to (S(0), R)" in v.hint
        assert layouts(res) == ["(S(0), R)"] and res.outputs[0].shape == (4, 6, 5)

    def test_three_operands_report_each(self):
        res = infer("concat", spec((2, 4), ["S(0)", "R"]), spec((3, 4), ["R", "S(1)"]),
                    spec((1, 4), ["P(sum)", "R"]), axis=0)
        found = sorted((v.operand, v.code) for v in res.violations)
        assert found == [("x", "sharded-concat-dim"), ("x2", "partial-input")]
        assert layouts(res) == ["(R, S(1))"]

    @pytest.mark.parametrize("shapes,axis,code,fragment", [
        ([(4, 6), (4, 5)], 0, "concat-shape", "x1 has shape [4, 5] but x has [4, 6]"),
        ([(4, 6), (4, 6, 1)], 0, "concat-shape", "x1 has rank 3"),
        ([(4, 6), (4, 6)], 2, "invalid-dim", "axis=2 is not a dim of x, which has rank 2"),
    ])
    def test_bad_shapes(self, shapes, axis, code, fragment):
        res = infer("concat", *[spec(s, ["R"], TP) for s in shapes], axis=axis)
        assert codes(res) == [code] and fragment in res.violations[0].message
        assert res.outputs == (None,)


# ============================================================================ unsqueeze, squeeze
class TestUnsqueezeSqueeze:
    def test_unsqueeze_shifts_shards(self):
        assert layouts(infer("unsqueeze", spec((4, 6), ["S(0)", "S(1)"]), dim=1)) == ["(S(0), S(2))"]
        res = infer("ExpandDims", spec((4, 6), ["S(1)", "P(sum)"]), dim=-1)
        assert layouts(res) == ["(S(1), P(sum))"] and res.outputs[0].shape == (4, 6, 1)

    def test_squeeze_shifts_shards(self):
        res = infer("squeeze", spec((4, 1, 6), ["S(2)", "S(0)"]), dim=1)
        assert layouts(res) == ["(S(1), S(0))"] and res.outputs[0].shape == (4, 6)
        all_ones = infer("squeeze", spec((1, 5, 1), ["S(1)", "R"]))
        assert all_ones.outputs[0].shape == (5,) and layouts(all_ones) == ["(S(0), R)"]

    def test_squeezing_a_size_one_dim_is_always_fine(self):
        # a size-1 dim can only be "sharded" on a size-1 mesh axis, which becomes Replicate
        mesh = DeviceMesh((2, 1), ("dp", "tp"))
        res = infer("squeeze", spec((4, 1, 6), ["S(0)", "S(1)"], mesh), dim=1)
        assert layouts(res) == ["(S(0), R)"] and res.violations == ()

    def test_squeeze_localizes_to_explicit_dims(self):
        # x (2, 1) with dim 0 on 2 ranks: each rank holds (1, 1); squeezing "all" must keep dim 0
        x = spec((2, 1), ["S(0)"], TP)
        rule = get_rule("squeeze")
        attrs = rule.normalize_attrs({})
        res = rule.infer_layout((x,), attrs)
        assert rule.localize(attrs, (x,), res.outputs, 1) == {"dim": [1]}

    def test_invalid(self):
        bad = infer("squeeze", spec((4, 1, 6), ["R", "R"]), dim=[1, 2])
        assert codes(bad) == ["invalid-squeeze"]
        assert "x dim 2 has size 6, not 1 (x has shape [4, 1, 6])" in bad.violations[0].message
        assert codes(infer("squeeze", spec((4, 1), ["R", "R"]), dim=2)) == ["invalid-dim"]
        out_of_range = infer("unsqueeze", spec((4, 6), ["R", "R"]), dim=3)
        assert codes(out_of_range) == ["invalid-dim"]
        assert out_of_range.violations[0].message == "dim=3 is not a dim of x, which has rank 3"
        assert out_of_range.violations[0].hint == "give dim as an integer in -3..2"


# ============================================================================ every code, located
VIOLATION_CASES = {
    # code: (op, inputs {name: (shape, placements)}, attrs, input value named, fragments of the message)
    "reshape-sharded-dim": ("reshape", {"h": ((3, 4, 6), ["S(0)", "R"])}, {"shape": [12, 6]}, "h",
                            ["x dim 0 (size 3)", "mesh axis 'dp'", "2 ways"]),
    "sharded-split-dim": ("chunk2", {"h": ((5, 6), ["S(0)", "R"])}, {"axis": 0}, "h",
                          ["x dim 0 (size 5)", "mesh axis 'dp'", "pieces of sizes [3, 2]"]),
    "sharded-concat-dim": ("concat", {"a": ((4, 6), ["R", "S(1)"]), "b": ((4, 2), ["R", "R"])}, {"axis": 1}, "a",
                           ["x dim 1 (size 6)", "mesh axis 'tp'", "sizes [6, 2]"]),
    "sharding-mismatch": ("concat", {"a": ((4, 6, 2), ["S(0)", "R"]), "b": ((4, 6, 3), ["S(1)", "R"])},
                          {"axis": 2}, "b", ["x1 is S(1) on mesh axis 'dp'", "computes S(0) there like x"]),
    "partial-input": ("concat", {"a": ((4, 6), ["R", "S(1)"]), "b": ((2, 6), ["R", "P(sum)"])}, {"axis": 0}, "b",
                      ["x1 is P(sum) on mesh axis 'tp'", "computes S(1) there"]),
    "invalid-reshape": ("reshape", {"h": ((4, 6), ["R", "R"])}, {"shape": [5, -1]}, "h",
                        ["shape [4, 6]", "other dims give 5, which does not divide 24"]),
    "invalid-dim": ("slice", {"h": ((4, 6), ["R", "R"])}, {"axis": 2, "start": 1}, "h",
                    ["axis=2 is not a dim of x, which has rank 2"]),
    "invalid-permutation": ("transpose", {"h": ((4, 6), ["R", "R"])}, {"dims": [1, 1]}, "h",
                            ["dims=[1, 1] is not a permutation of 0..1"]),
    "invalid-split": ("split3", {"h": ((4, 6), ["R", "R"])}, {"axis": 1, "sizes": [1, 2]}, "h",
                      ["x dim 1 (size 6)", "sizes=[1, 2] must be 3 non-negative sizes summing to 6"]),
    "invalid-squeeze": ("squeeze", {"h": ((4, 6), ["R", "R"])}, {"dim": 0}, "h", ["x dim 0 has size 4, not 1"]),
    "concat-shape": ("concat", {"a": ((4, 6), ["R", "R"]), "b": ((3, 5), ["R", "R"])}, {"axis": 0}, "b",
                     ["x1 has shape [3, 5] but x has [4, 6]", "(dim 1: 5 vs 6)"]),
    "constraint-unmet": ("sharding_constraint", {"h": ((4, 6), ["S(0)", "R"])}, {"placements": ["R", "S(1)"]}, "h",
                         ["the value is (S(0), R)", "pins it to (R, S(1))", "all-gather on dp"]),
}


def _one_node_spec(op, inputs, attrs) -> dict:
    return {"mesh": {"shape": [2, 2], "names": ["dp", "tp"]},
            "inputs": {name: {"shape": list(shape), "placements": ps} for name, (shape, ps) in inputs.items()},
            "nodes": [{"name": "y", "op": op, "inputs": list(inputs), "attrs": attrs}]}


def test_every_documented_code_has_a_case():
    documented = set()
    for name in SHAPE_OPS:
        documented |= set(get_rule(name).violation_codes)
    assert documented == set(VIOLATION_CASES)


@pytest.mark.parametrize("code", sorted(VIOLATION_CASES))
def test_violation_is_located_and_named(code):
    op, inputs, attrs, value, fragments = VIOLATION_CASES[code]
    found = analyze(load_spec(_one_node_spec(op, inputs, attrs))).check.violations
    assert [v.code for v in found] == [code], [str(v) for v in found]
    v = found[0]
    assert v.node == "y" and v.op == get_rule(op).name and v.input == value
    for fragment in fragments:
        assert fragment in v.message, (fragment, v.message)
    assert v.hint


@pytest.mark.parametrize("code", ["reshape-sharded-dim", "sharded-split-dim", "sharded-concat-dim",
                                  "sharding-mismatch", "partial-input", "constraint-unmet"])
def test_fixable_codes_are_fixed_by_reshard(code):
    op, inputs, attrs, _, _ = VIOLATION_CASES[code]
    data = _one_node_spec(op, inputs, attrs)
    checked = analyze(load_spec(data))
    assert all(v.fixable for v in checked.check.violations)
    assert "--reshard inserts" in checked.check.violations[0].hint
    rep = run_graph(load_spec(data), backward=True, seed=1)
    assert rep.ok, rep.mismatches
    assert rep.collectives, "a fix that costs communication inserts a collective"


# ============================================================================ kernels and finite differences
def test_every_shape_op_has_a_numpy_kernel():
    assert set(SHAPE_OPS) <= set(KERNELS)
    shape_rules = {name for name, rule in registered_ops().items() if type(rule).__module__.endswith("ops.shape")}
    assert shape_rules == set(SHAPE_OPS)


def test_kernels_against_plain_numpy():
    x = np.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(KERNELS["reshape"](x, shape=[6, -1]), x.reshape(6, 4))
    np.testing.assert_array_equal(KERNELS["transpose"](x, dims=[2, 0, 1]), np.moveaxis(x, 2, 0))
    np.testing.assert_array_equal(KERNELS["transpose"](x, dim0=0, dim1=2), x.swapaxes(0, 2))
    a, b = KERNELS["split2"](x, axis=2, sizes=[1, 3])
    np.testing.assert_array_equal(a, x[:, :, :1])
    np.testing.assert_array_equal(b, x[:, :, 1:])
    pieces = KERNELS["chunk2"](x, axis=1)
    assert [p.shape for p in pieces] == [(2, 2, 4), (2, 1, 4)]
    np.testing.assert_array_equal(KERNELS["slice"](x, axis=1, start=-2, stop=None), x[:, 1:])
    padded = KERNELS["pad_slice"](x, axis=0, start=1, size=4)
    np.testing.assert_array_equal(padded[1:3], x)
    assert not padded[0].any() and not padded[3].any()
    np.testing.assert_array_equal(KERNELS["concat"](x, x[:1], axis=0), np.vstack([x, x[:1]]))
    assert KERNELS["unsqueeze"](x, dim=1).shape == (2, 1, 3, 4)
    assert KERNELS["squeeze"](x[:, :1], dim=[1]).shape == (2, 4)
    assert KERNELS["squeeze"](np.ones((1, 2, 1))).shape == (2,)


FD_CASES = [
    ("reshape", [(3, 4, 2)], {"shape": [6, -1]}),
    ("transpose", [(2, 3, 4)], {"dims": [1, 2, 0]}),
    ("transpose", [(2, 3)], {"dim0": 1, "dim1": 0}),
    ("split3", [(2, 7)], {"axis": 1, "sizes": [3, 0, 4]}),
    ("chunk3", [(5, 2)], {"axis": 0}),
    ("slice", [(4, 5)], {"axis": 1, "start": 1, "stop": -1}),
    ("pad_slice", [(3, 2)], {"axis": 0, "start": 2, "size": 6}),
    ("concat", [(2, 3), (2, 1), (2, 2)], {"axis": 1}),
    ("unsqueeze", [(3, 2)], {"dim": 1}),
    ("squeeze", [(3, 1, 2, 1)], {}),
]


def _loss(op, arrays, attrs, cotangents) -> float:
    rule = get_rule(op)
    outs = KERNELS[rule.name](*arrays, **rule.normalize_attrs(attrs))
    outs = outs if isinstance(outs, tuple) else (outs,)
    return float(sum(np.sum(c * o) for c, o in zip(cotangents, outs) if c is not None))


def _analytic_grads(op, arrays, attrs, cotangents, outputs=None):
    """Gradients through the backward pass (vjp rules + numpy kernels) on one device, float64."""
    rule = get_rule(op)
    g = Graph(DeviceMesh((1,), ("one",)))
    names = [g.input(f"in{i}", shape=a.shape, dtype="float64") for i, a in enumerate(arrays)]
    outs = g.op("y", rule.name, names, attrs, rule.num_outputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    chosen = [o for o, c in zip(outs, cotangents) if c is not None] if outputs is None else outputs
    g.output(*chosen)
    result = Backward().run(g)
    values = {n: a for n, a in zip(names, arrays)}
    for out, cot in zip(outs, cotangents):
        if out in result.cotangents:
            values[result.cotangents[out]] = cot
    env = execute_global(result.graph, values)
    return [env[result.grads[n]] for n in names]


@pytest.mark.parametrize("op,shapes,attrs", FD_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(FD_CASES)])
def test_backward_matches_central_finite_differences(op, shapes, attrs):
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal(s) for s in shapes]
    rule = get_rule(op)
    forward = KERNELS[rule.name](*arrays, **rule.normalize_attrs(attrs))
    forward = forward if isinstance(forward, tuple) else (forward,)
    cotangents = [rng.standard_normal(o.shape) for o in forward]
    analytic = _analytic_grads(op, arrays, attrs, cotangents)
    eps = 1e-6
    for k, array in enumerate(arrays):
        numeric = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            plus = [a.copy() for a in arrays]
            minus = [a.copy() for a in arrays]
            plus[k][index] += eps
            minus[k][index] -= eps
            numeric[index] = (_loss(op, plus, attrs, cotangents) - _loss(op, minus, attrs, cotangents)) / (2 * eps)
        np.testing.assert_allclose(analytic[k], numeric, rtol=1e-7, atol=1e-8)


def test_split_backward_with_unused_outputs_pads_and_adds():
    # torch.chunk(7 rows, 3): pieces of ceil(7 / 3) = 3 rows -> [0:3), [3:6), [6:7); the middle one unused
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 2))
    cotangents = [rng.standard_normal((3, 2)), None, rng.standard_normal((1, 2))]
    (dx,) = _analytic_grads("chunk3", [x], {"axis": 0}, cotangents)
    expected = np.zeros_like(x)
    expected[0:3] = cotangents[0]
    expected[6:7] = cotangents[2]
    np.testing.assert_array_equal(dx, expected)


def test_split_with_an_unused_output_runs_sharded():
    data = {
        "mesh": {"shape": [2, 2], "names": ["dp", "tp"]},
        "inputs": {"x": {"shape": [4, 7], "placements": ["S(0)", "S(1)"]}},
        "nodes": [{"name": "parts", "op": "chunk3", "inputs": ["x"], "attrs": {"axis": 1}}],
        "outputs": ["parts:0", "parts:2"],
    }
    rep = run_graph(load_spec(data), backward=True, seed=6)
    assert rep.ok, rep.mismatches
    assert set(rep.outputs) == {"parts:0", "parts:2"} and set(rep.grads) == {"x"}


# ============================================================================ whole graphs
def _heads_spec(x_placements, h=16, n=4) -> dict:
    """x (B, S, H) -> heads (B, S, N, D) -> (B, N, S, D) -> rope -> back to (B, S, H)."""
    d = h // n
    return {
        "mesh": {"shape": [2, 2], "names": ["dp", "tp"]},
        "inputs": {
            "x": {"shape": [2, 6, h], "placements": x_placements},
            "cos": {"shape": [1, 1, 6, d], "requires_grad": False},
            "sin": {"shape": [1, 1, 6, d], "requires_grad": False},
        },
        "nodes": [
            {"name": "heads", "op": "view", "inputs": ["x"], "attrs": {"shape": [2, 6, n, -1]}},
            {"name": "bnsd", "op": "permute", "inputs": ["heads"], "attrs": {"dims": [0, 2, 1, 3]}},
            {"name": "q", "op": "rope", "inputs": ["bnsd", "cos", "sin"], "attrs": {"mode": 0}},
            {"name": "bsnd", "op": "transpose", "inputs": ["q"], "attrs": {"dim0": 1, "dim1": 2}},
            {"name": "y", "op": "reshape", "inputs": ["bsnd"], "attrs": {"shape": [2, 6, h]}},
        ],
        "outputs": ["y"],
    }


def _layouts_of(graph, names):
    return {n: str(graph.node(n).meta[meta.SPECS][0].layout) for n in names}


def test_reshape_to_heads_and_transpose_for_attention_by_hand():
    a = analyze(load_spec(_heads_spec(["S(0)", "S(2)"])), backward=True)
    assert a.ok, [str(v) for v in a.check.violations]
    # B on dp everywhere; H on tp -> N on tp (dim 2 of BSND, dim 1 of BNSD)
    assert _layouts_of(a.graph, ["heads", "bnsd", "q", "bsnd", "y"]) == {
        "heads": "(S(0), S(2))", "bnsd": "(S(0), S(1))", "q": "(S(0), S(1))", "bsnd": "(S(0), S(2))",
        "y": "(S(0), S(2))"}
    assert str(a.graph.node("grad/x").meta[meta.SPECS][0].layout) == "(S(0), S(2))"
    # each rank reshapes its (1, 6, 8) piece into (1, 6, 2, 4): the localized target shape
    program = Lower().run(a.graph).program
    heads = next(op for op in program.ops if op.name == "heads")
    assert [attrs["shape"] for attrs in heads.attrs] == [[1, 6, 2, 4]] * 4


@pytest.mark.parametrize("x_placements", [["S(0)", "S(2)"], ["R", "S(2)"], ["S(1)", "R"], ["P(sum)", "S(0)"],
                                          ["S(2)", "S(2)"]])
def test_attention_heads_run_forward_and_backward(x_placements):
    rep = run_graph(load_spec(_heads_spec(x_placements)), backward=True, seed=5)
    assert rep.ok, rep.mismatches
    assert set(rep.outputs) == {"y"} and set(rep.grads) == {"x"}


def test_heads_without_communication_when_h_is_on_tp():
    rep = run_graph(load_spec(_heads_spec(["S(0)", "S(2)"])), backward=True, seed=2)
    assert rep.ok and rep.collectives == []


def test_uneven_merge_is_gathered_then_runs():
    data = {
        "mesh": {"shape": [2], "names": ["dp"]},
        "inputs": {"x": {"shape": [3, 4, 6], "placements": ["S(0)"]}},
        "nodes": [{"name": "y", "op": "reshape", "inputs": ["x"], "attrs": {"shape": [12, 6]}}],
    }
    checked = analyze(load_spec(data))
    assert [v.code for v in checked.check.violations] == ["reshape-sharded-dim"]
    rep = run_graph(load_spec(data), backward=True, seed=0)
    assert rep.ok, rep.mismatches
    assert [(c["kind"], c["mesh_axis"]) for c in rep.collectives][0] == ("all-gather", "dp")


def test_fused_qkv_split_and_concat_back():
    data = {
        "mesh": {"shape": [2, 2], "names": ["dp", "tp"]},
        "inputs": {"qkv": {"shape": [2, 4, 12], "placements": ["S(0)", "S(1)"]}},
        "nodes": [
            {"name": "parts", "op": "split3", "inputs": ["qkv"], "attrs": {"axis": 2}},
            {"name": "qk", "op": "mul", "inputs": ["parts:0", "parts:1"]},
            {"name": "y", "op": "concat", "inputs": ["qk", "parts:2"], "attrs": {"axis": -1}},
        ],
        "outputs": ["y"],
    }
    rep = run_graph(load_spec(data), backward=True, seed=4)
    assert rep.ok, rep.mismatches
    assert rep.collectives == []


# ============================================================================ reshape exactness, property
def _exact_local_reshape(x: TensorSpec, out: TensorSpec) -> bool:
    """Independent oracle: every rank's input piece, reshaped, is exactly its output piece."""
    data = np.arange(math.prod(x.shape)).reshape(x.shape)
    reshaped = data.reshape(out.shape)
    for rank in range(x.mesh.size):
        piece = data[x.local_index(rank)]
        want = reshaped[out.local_index(rank)]
        if piece.size != want.size or not np.array_equal(piece.reshape(want.shape), want):
            return False
    return True


@st.composite
def _reshape_cases(draw):
    k = draw(st.integers(2, 4))
    mesh = DeviceMesh((k,), ("tp",))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    sharded = [d for d, s in enumerate(shape) if s > 1]
    if not sharded:
        shape = shape + (2,)
        sharded = [len(shape) - 1]
    dim = draw(st.sampled_from(sharded))
    factors = []
    n = math.prod(shape)
    p = 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    factors = draw(st.permutations(factors))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(factors) - 1)), max_size=3)))
    target, last = [], 0
    for c in [*cuts, len(factors)]:
        if c > last:
            target.append(math.prod(factors[last:c]))
            last = c
    if draw(st.booleans()):
        target.insert(draw(st.integers(0, len(target))), 1)
    splits = [k for k in range(2, shape[dim] + 1) if shape[dim] % k == 0 and k < shape[dim]]
    placement = f"S({dim})"
    if splits and draw(st.booleans()):  # a strided shard, as an earlier merge leaves
        placement = f"_S({dim},{draw(st.sampled_from(splits))})"
    return spec(shape, [placement], mesh), tuple(target or [1])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_reshape_cases())
def test_reshape_accepts_exactly_the_exact_local_reshapes(case):
    x, target = case
    res = infer("reshape", x, shape=list(target))
    if not res.violations:
        event("accepted")
        assert _exact_local_reshape(x, res.outputs[0])
        return
    event("rejected")
    assert codes(res) == ["reshape-sharded-dim"]
    # no output dim could have held the shard: every placement of it, strided or not, is inexact
    for e in range(len(target)):
        if target[e] == 1:
            continue
        for placement in [f"S({e})"] + [f"_S({e},{k})" for k in range(2, target[e] + 1) if target[e] % k == 0]:
            try:
                candidate = TensorSpec(target, x.dtype, Layout(x.mesh, [placement], len(target)))
            except LayoutError:
                continue  # not a layout of this shape at all
            assert not _exact_local_reshape(x, candidate), (x, target, placement)


# ============================================================================ aliases and attr synonyms
@pytest.mark.parametrize("alias,attrs,canonical,normalised", [
    ("ExpandDims", {"axis": 1}, "unsqueeze", {"dim": 1}),
    ("Squeeze", {"axis": [0]}, "squeeze", {"dim": [0]}),
    ("Transpose", {"perm": [1, 0]}, "transpose", {"dims": [1, 0], "dim0": None, "dim1": None}),
    ("aten.view", {"size": [4, -1]}, "reshape", {"shape": [4, -1]}),
    ("aten.slice", {"dim": 1, "start": 1, "end": 3}, "slice", {"axis": 1, "start": 1, "stop": 3}),
    ("aten.cat", {"dim": 1}, "concat", {"axis": 1}),
    ("split2", {"dim": 0, "size_splits": [1, 3]}, "split2", {"axis": 0, "sizes": [1, 3]}),
    ("chunk2", {"dim": -1}, "chunk2", {"axis": -1}),
])
def test_aliases_take_their_frameworks_attr_names(alias, attrs, canonical, normalised):
    rule = get_rule(alias)
    assert rule.name == canonical
    assert rule.normalize_attrs(attrs) == normalised


def test_both_spellings_of_an_attr_are_refused():
    from layout_prop.core.errors import OpError

    with pytest.raises(OpError) as info:
        get_rule("concat").normalize_attrs({"axis": 0, "dim": 1})
    assert info.value.code == "bad-attr" and "'axis' and its synonym 'dim'" in info.value.message


def test_mindspore_spelling_runs_end_to_end():
    data = {
        "mesh": {"shape": [2], "names": ["dp"]},
        "inputs": {"x": {"shape": [4, 3], "placements": ["S(0)"]}},
        "nodes": [{"name": "e", "op": "ExpandDims", "inputs": ["x"], "attrs": {"axis": 1}},
                  {"name": "t", "op": "Transpose", "inputs": ["e"], "attrs": {"perm": [2, 1, 0]}},
                  {"name": "y", "op": "Squeeze", "inputs": ["t"], "attrs": {"axis": 1}}],
    }
    a = analyze(load_spec(data))
    assert _layouts_of(a.graph, ["e", "t", "y"]) == {"e": "(S(0))", "t": "(S(2))", "y": "(S(1))"}
    rep = run_graph(load_spec(data), backward=True)
    assert rep.ok, rep.mismatches


def test_slice_with_non_integer_bounds():
    res = infer("slice", spec((4, 6), ["R", "R"]), axis=1, start=1.5)
    assert codes(res) == ["invalid-split"]
    assert res.violations[0].message == "cannot slice x dim 1 (size 6): start=1.5 and stop=None must be integers " \
                                        "(or null)"


@st.composite
def _mesh_reshape_cases(draw):
    """Any mesh of up to 3 axes, any placements (shards, strided shards, Partial), any regrouping."""
    mesh_shape = draw(st.sampled_from([(2, 2), (2, 3), (4, 2), (3,), (4,), (1, 2), (2, 2, 2)]))
    mesh = DeviceMesh(mesh_shape, ("a", "b", "c")[:len(mesh_shape)])
    shape = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 8, 12]), min_size=1, max_size=3)))
    factors, n, p = [], math.prod(shape), 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    factors = draw(st.permutations(factors))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(factors) - 1)), max_size=3)))
    target, last = [], 0
    for c in [*cuts, len(factors)]:
        if c > last:
            target.append(math.prod(factors[last:c]))
            last = c
    if math.prod(shape) == 0:
        target = [0, *draw(st.lists(st.sampled_from([1, 2, 3]), max_size=2))]
    choices = (["R", "P(sum)"] + [f"S({d})" for d in range(len(shape))]
               + [f"_S({d},{k})" for d in range(len(shape)) for k in (2, 3)])
    placements = [draw(st.sampled_from(choices)) for _ in mesh_shape]
    try:
        x = spec(shape, placements, mesh)
    except LayoutError:
        assume(False)
    return x, tuple(target or [1])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(_mesh_reshape_cases())
def test_reshape_on_any_mesh_is_exact_or_its_fix_is(case):
    # accepted: every rank's piece, reshaped locally, is its piece of the output (strided shards included);
    # rejected: the wanted layout is accepted and exact
    x, target = case
    res = infer("reshape", x, shape=list(target))
    if res.violations:
        event("rejected")
        assert set(codes(res)) == {"reshape-sharded-dim"} and all(v.fixable for v in res.violations)
        x = x.with_layout(res.wants[0])
        res = infer("reshape", x, shape=list(target))
        assert res.violations == ()
    else:
        event("accepted")
    assert _exact_local_reshape(x, res.outputs[0]), (x, target, res.outputs[0])
