"""Records of strided shards (``_S(d,k)``, issue 17): reshapes that merge a sharded inner dim
and the ops that take the strided result, on the meshes DTensor was compared on, (4,) and (2, 2).

The samples try ``_S(d,2)`` as an operand placement too (``OpSample(strided=True)``), so
a strided shard meets every other placement: reshape makes and undoes it (uneven inner
dims: 10 on 4 ranks is 3, 3, 3, 1; doubly sharded dims), transpose, split, slice,
concat, unsqueeze and squeeze keep it off their own dim, the
elementwise ops and sum_to take it like a shard (a Replicate operand is sliced alike for
free), the norms and softmax keep it off their normalised dims, matmul (where DTensor
raises "Cannot unflatten") cuts the other operand alike, the reductions reduce it like
a shard, and the ops that do not know it (attention, embedding...) get it gathered
first, a documented ``sharding-mismatch``.
"""

from . import OpRecord, OpSample

MESHES = ((4,), (2, 2))


def _strided(shapes, attrs=None, **kwargs) -> OpSample:
    return OpSample(shapes, attrs or {}, strided=True, **kwargs)


RECORDS = [
    OpRecord("reshape", [
        _strided([(2, 16, 16)], {"shape": [32, 16]}),  # the example
        _strided([(2, 10, 4)], {"shape": [20, 4]}),  # uneven inner dim
        _strided([(3, 6, 4)], {"shape": [18, 4]}),  # uneven outer dim
        _strided([(12, 4)], {"shape": [2, 6, 4]}),  # a strided dim split back
        _strided([(4, 6, 8)], {"shape": [4, 6, 2, 4]}),  # heads split, two axes on one dim
        _strided([(4, 2, 6)], {"shape": [48]}),  # three dims into one
    ], meshes=MESHES, placements="all", backward=True, id="strided-reshape"),
    OpRecord("chunk3", [_strided([(4, 6)], {"axis": 1}), _strided([(6, 4)], {"axis": 0})], meshes=MESHES,
             placements="all", id="strided-chunk3"),  # a qkv split of flattened tokens
    # a fused projection's split (issue 29): pieces of whole blocks of _S(d,2) stay sharded, S(d) each
    # (or _S(d,j) for j blocks), with no communication; pieces across blocks get the axis gathered
    OpRecord("split2", [_strided([(4, 6)], {"axis": 1}), _strided([(8, 4)], {"axis": 0, "sizes": [4, 4]})],
             meshes=MESHES, placements="all", id="strided-split2"),
    OpRecord("split3", [_strided([(4, 8)], {"axis": 1, "sizes": [4, 0, 4]}),
                        _strided([(12, 2)], {"axis": 0, "sizes": [0, 6, 6]}),
                        _strided([(4, 8)], {"axis": 1, "sizes": [2, 2, 4]})],  # pieces across blocks
             meshes=MESHES, placements="all", id="strided-split3"),
    OpRecord("chunk2", [_strided([(6, 4)], {"axis": 0}), _strided([(2, 10)], {"axis": 1})], meshes=MESHES,
             placements="all", id="strided-chunk2"),  # 10 = 2 blocks of 5: uneven chunks 3, 2 of each
    # Phi-3 slices q, k, v out of its fused projection: a slice of whole blocks stays sharded too, and its
    # gradient pads S(d) / _S(d,j) pieces among zero blocks into _S(d,N)
    OpRecord("slice", [_strided([(4, 8)], {"axis": 1, "start": 0, "stop": 4}),
                       _strided([(2, 10)], {"axis": 1, "start": 5}),  # blocks of 5: uneven chunks 3, 2
                       _strided([(12, 2)], {"axis": 0, "start": 6, "stop": 12})],
             meshes=MESHES, placements="all", id="strided-slice-blocks"),
    OpRecord("pad_slice", [_strided([(4, 4)], {"axis": 1, "start": 4, "size": 8}),
                           _strided([(4, 4)], {"axis": 1, "start": 0, "size": 12}),
                           _strided([(8, 3)], {"axis": 0, "start": 8, "size": 24})],
             meshes=MESHES, placements="all", id="strided-pad_slice-blocks"),
    # the gradient of that split: S(d) pieces of one size concat into _S(d,N)
    OpRecord("concat", [_strided([(4, 3), (4, 3)], {"axis": 1}), _strided([(4, 2), (4, 4)], {"axis": 1}),
                        _strided([(6, 2), (6, 2), (6, 2)], {"axis": 0})],
             meshes=MESHES, placements=120, id="strided-concat-blocks"),
    OpRecord("slice", [_strided([(4, 6)], {"axis": 1, "start": 1, "stop": 5}), _strided([(4, 6)], {"axis": 0})],
             meshes=MESHES, placements="all", id="strided-slice"),
    OpRecord("concat", [_strided([(4, 6), (4, 2)], {"axis": 1}), _strided([(4, 6), (2, 6)], {"axis": 0})],
             meshes=MESHES, placements=120, id="strided-concat"),
    OpRecord("unsqueeze", [_strided([(4, 6)], {"dim": 1})], meshes=MESHES, placements="all", id="strided-unsqueeze"),
    OpRecord("squeeze", [_strided([(4, 1, 6)], {"dim": 1})], meshes=MESHES, placements="all", id="strided-squeeze"),
    OpRecord("transpose", [_strided([(4, 6, 2)], {"dims": [1, 2, 0]}), _strided([(8, 3)], {"dim0": 0, "dim1": 1})],
             meshes=MESHES, placements="all", id="strided-transpose"),
    OpRecord("add", [_strided([(8, 6), (6,)]), _strided([(4, 6), (4, 6)]), _strided([(2, 1, 4), (2, 6, 4)])],
             meshes=MESHES, placements=120, id="strided-add"),
    OpRecord("mul", [_strided([(8, 6), (8, 1)]), _strided([(4, 6), (4, 6)])], meshes=MESHES, placements=80,
             id="strided-mul"),
    OpRecord("exp", [_strided([(8, 6)])], meshes=MESHES, placements="all", id="strided-exp"),
    OpRecord("matmul", [_strided([(8, 4), (4, 6)]), _strided([(2, 4, 4), (4, 6)])], meshes=MESHES,
             placements=100, id="strided-matmul"),
    OpRecord("softmax", [_strided([(4, 6)]), _strided([(8, 6)], {"axis": 0})], meshes=MESHES, placements="all",
             id="strided-softmax"),
    OpRecord("softmax_grad", [_strided([(4, 6), (4, 6)])], meshes=MESHES, placements=60, id="strided-softmax_grad"),
    # norms are row-wise: a strided shard of the rows stays, of the normalised dim is gathered
    OpRecord("rms_norm", [_strided([(8, 6), (6,)]), _strided([(4, 2, 4), (2, 4)], {"normalized_ndim": 2})],
             meshes=MESHES, placements=100, id="strided-rms_norm"),
    OpRecord("rms_norm_grad", [_strided([(8, 6), (8, 6), (6,)])], meshes=MESHES, placements=60,
             id="strided-rms_norm_grad"),
    OpRecord("layer_norm", [_strided([(8, 6), (6,), (6,)])], meshes=MESHES, placements=80, id="strided-layer_norm"),
    OpRecord("sum_to", [_strided([(8, 6)], {"shape": [6]}), _strided([(4, 6)], {"shape": [4, 1]})],
             meshes=MESHES, placements="all", backward=False, id="strided-sum_to"),
    OpRecord("sum", [_strided([(8, 6)], {"dims": [0]}), _strided([(4, 6)], {"dims": [1], "keepdim": True})],
             meshes=MESHES, placements="all", id="strided-sum"),
    OpRecord("mean", [_strided([(8, 6)], {"dims": [0]}), _strided([(4, 10)], {"dims": [1]})], meshes=MESHES,
             placements="all", id="strided-mean"),
    OpRecord("max", [_strided([(8, 6)], {"dims": [0]}), _strided([(4, 6)], {"dims": [1]})], meshes=MESHES,
             placements="all", id="strided-max"),
]
