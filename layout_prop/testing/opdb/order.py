"""Records of the order ops (topk, sort, argmax, argmin, cumsum, prod, maximum, minimum) and their grad ops.

Meshes (4,) and (2, 2): dims of 5 and 10 are uneven on 4 ranks (2, 2, 1, 0 and 3, 3, 3, 1),
size-1 dims stay.  int32 samples draw from 0..7, so rows of 5 to 10 hold ties: the tie order
(lowest index first) is checked against one device wherever they are sharded.
"""

from . import OpRecord, OpSample

_MESHES = ((4,), (2, 2))

RECORDS = [
    OpRecord("topk", [
        OpSample([(3, 10)], {"k": 4}),
        OpSample([(5, 1, 6)], {"k": 2, "dim": 0, "largest": False}),
        OpSample([(4, 10)], {"k": 3, "dim": 1}, dtypes=["int32"]),  # ties
        OpSample([(10, 3)], {"k": 10, "dim": 0, "sorted": False}),
    ], meshes=_MESHES, placements=40),
    OpRecord("sort", [
        OpSample([(3, 5)]),
        OpSample([(5, 1, 4)], {"dim": 0, "descending": True}),
        OpSample([(4, 10)], {"descending": True}, dtypes=["int32"]),
    ], meshes=_MESHES, placements=40),
    OpRecord("argmax", [
        OpSample([(3, 10)], {"dim": 1}, dtypes=["int32"]),
        OpSample([(5, 1, 4)], {"dim": 0, "keepdim": True}),
        OpSample([(4, 5)], dtypes=["int32"]),  # dim None: the flattened index
    ], meshes=_MESHES, placements=30),
    OpRecord("argmax_with_value", [  # MindSpore's ArgMaxWithValue: the index and the value (differentiable)
        OpSample([(3, 10)], {"axis": 1}),
        OpSample([(5, 1, 4)], {"axis": 0, "keep_dims": True}),
        OpSample([(4, 5)], {"axis": -1}, dtypes=["int32"], requires_grad=[False]),
    ], meshes=_MESHES, placements=30),
    OpRecord("argmin", [
        OpSample([(10, 3)], {"dim": 0}, dtypes=["int32"]),
        OpSample([(2, 5, 1)], {"dim": -2, "keepdim": True}),
    ], meshes=_MESHES, placements=30),
    OpRecord("cumsum", [
        OpSample([(3, 10)], {"dim": 1}),
        OpSample([(5, 1, 4)], {"dim": 0, "exclusive": True}),
        OpSample([(4, 5)], {"dim": -1, "reverse": True, "exclusive": True}),
        OpSample([(5, 4)], {"dim": 1}, dtypes=["int64"]),
        OpSample([(5, 4)], {"dim": 0}, dtypes=["int32"]),
    ], meshes=_MESHES, placements=40),
    OpRecord("prod", [
        OpSample([(3, 10)], {"dims": [1]}),
        OpSample([(5, 1, 4)], {"dims": [0, 2], "keepdim": True}),
        OpSample([(4, 5)], {"dims": None}, dtypes=["int32"]),
    ], meshes=_MESHES, placements=40),
    OpRecord("maximum", [
        OpSample([(5, 4), (5, 4)], dtypes=["int32", "int32"]),  # ties
        OpSample([(10, 3), (3,)]),
        OpSample([(5, 1, 3), (5, 4, 3)]),
    ], meshes=_MESHES, placements=40),
    OpRecord("minimum", [
        OpSample([(4, 5), (1, 5)]),
        OpSample([(10, 3), (10, 3)], dtypes=["int32", "int32"]),
    ], meshes=_MESHES, placements=40),
    OpRecord("topk_grad", [
        OpSample([(4, 3), (4, 3)], {"dim": 1, "size": 10}, dtypes=["float32", "int64"],
                 requires_grad=[True, False]),
        OpSample([(2, 5, 1), (2, 5, 1)], {"dim": 0, "size": 6}, dtypes=["float32", "int64"],
                 requires_grad=[True, False]),
    ], meshes=_MESHES, placements=40, backward=False),
    OpRecord("maximum_grad", [
        OpSample([(5, 4), (5, 4), (5, 1)]),
        OpSample([(10, 3), (10, 3), (3,)], {"minimum": True}),
    ], meshes=_MESHES, placements=40, backward=False),
    OpRecord("prod_grad", [
        OpSample([(3,), (3, 10)], {"dims": [1]}),
        OpSample([(1, 1, 4), (5, 1, 4)], {"dims": [0], "keepdim": True}),
    ], meshes=_MESHES, placements=40, backward=False),
    # top-k along a sharded dim: candidates per chunk, gathered, merged (5 on 4 ranks leaves an empty chunk)
    OpRecord("topk_candidates", [
        OpSample([(3, 10)], {"k": 2, "chunks": 4}),
        OpSample([(8, 3)], {"k": 3, "chunks": 2, "dim": 0}),
        OpSample([(3, 10)], {"k": 3, "chunks": 4, "largest": False}, dtypes=["int32"]),  # ties
        OpSample([(5, 1, 6)], {"k": 2, "chunks": 4, "dim": 0}),
    ], meshes=_MESHES, placements=40),
    OpRecord("topk_merge", [
        OpSample([(3, 8), (3, 8)], {"k": 3}, dtypes=["float32", "int64"], requires_grad=[True, False]),
        OpSample([(6, 1, 2), (6, 1, 2)], {"k": 2, "dim": 0, "largest": False}, dtypes=["int32", "int64"],
                 requires_grad=[False, False]),
    ], meshes=_MESHES, placements=40),
    OpRecord("topk_merge_grad", [
        OpSample([(3, 2), (3, 8), (3, 8)], {"k": 2}, dtypes=["float32", "float32", "int64"],
                 requires_grad=[True, False, False]),
    ], meshes=_MESHES, placements=40, backward=False),
    OpRecord("topk_candidates_grad", [
        OpSample([(3, 8), (3, 8)], {"dim": 1, "size": 10, "chunks": 4}, dtypes=["float32", "int64"],
                 requires_grad=[True, False]),
        OpSample([(6, 3), (6, 3)], {"dim": 0, "size": 8, "chunks": 2}, dtypes=["float32", "int64"],
                 requires_grad=[True, False]),
    ], meshes=_MESHES, placements=40, backward=False),
    # cumsum along a sharded dim: shard totals, their exclusive scan, local scans plus the offsets
    OpRecord("chunk_sum", [
        OpSample([(3, 10)], {"dim": 1, "chunks": 4}),
        OpSample([(5, 1, 2)], {"dim": 0, "chunks": 4}, dtypes=["int32"]),
        OpSample([(8, 3)], {"dim": 0, "chunks": 2}),
    ], meshes=_MESHES, placements=40),
    OpRecord("chunk_sum_grad", [
        OpSample([(3, 4)], {"dim": 1, "size": 10, "chunks": 4}),
        OpSample([(2, 6)], {"dim": 0, "size": 5, "chunks": 2}),
    ], meshes=_MESHES, placements=40, backward=False),
    OpRecord("chunk_cumsum", [
        OpSample([(3, 10), (3, 4)], {"dim": 1, "chunks": 4}),
        OpSample([(5, 1, 2), (4, 1, 2)], {"dim": 0, "chunks": 4, "exclusive": True, "reverse": True}),
        OpSample([(8, 3)], {"dim": 0, "chunks": 2, "reverse": True}),
        OpSample([(3, 10), (3, 2)], {"dim": 1, "chunks": 2}, dtypes=["int64", "int64"]),
    ], meshes=_MESHES, placements=40),
]
