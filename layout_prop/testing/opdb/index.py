"""Records of the index family: gather, index_select, scatter, scatter_add, scatter_src_grad, index_add,
index_copy, index_copy_src_grad, gather_nd, scatter_nd, index_put, scatter_nd_src_grad, masked_fill, masked_scatter,
masked_scatter_src_grad, where, one_hot, isin.

The kit's random integers lie in [0, 8), so every indexed (or scattered) dim has at least
8 entries (an index outside the dim is an ``index-out-of-range`` error, not a sample) and
one_hot has at least 8 classes.  Shapes mix uneven dims (9 on 4 ranks is 3, 3, 3, 0; 5 on
2 is 3, 2), size-1 dims, and indices smaller than x in a dim they do not index (gather,
scatter), which must then stay whole.  Index operands are int64 or int32 without gradient.
"""

from . import OpRecord, OpSample

MESHES = ((4,), (2, 2))
IDX = dict(dtypes=["float32", "int64"], requires_grad=[True, False])
SCATTER = dict(dtypes=["float32", "int64", "float32"], requires_grad=[True, False, True])

RECORDS = [
    OpRecord("gather", [
        OpSample([(3, 9), (3, 4)], {"dim": 1}, **IDX),
        OpSample([(9, 5), (2, 5)], {"dim": 0}, **IDX),
        OpSample([(2, 8, 1), (1, 6, 1)], {"dim": -2}, dtypes=["float32", "int32"], requires_grad=[True, False]),
    ], meshes=MESHES, placements=40, id="index-gather"),
    OpRecord("index_select", [
        OpSample([(9, 4), (5,)], {"dim": 0}, **IDX),
        OpSample([(3, 10, 1), (7,)], {"dim": 1}, dtypes=["float32", "int32"], requires_grad=[True, False]),
    ], meshes=MESHES, placements=40, id="index-index_select"),
    OpRecord("scatter", [
        OpSample([(9, 3), (5, 3), (5, 3)], {"dim": 0}, **SCATTER),
        OpSample([(2, 8), (2, 3), (2, 3)], {"dim": -1}, **SCATTER),
        OpSample([(4, 8, 1), (3, 5, 1), (3, 5, 1)], {"dim": 1}, **SCATTER),
    ], meshes=MESHES, placements=30, id="index-scatter"),
    OpRecord("scatter_add", [
        OpSample([(9, 3), (5, 3), (5, 3)], {"dim": 0}, **SCATTER),
        OpSample([(2, 8), (2, 3), (2, 3)], {"dim": -1}, **SCATTER),
        OpSample([(4, 8, 1), (3, 5, 1), (3, 5, 1)], {"dim": 1}, **SCATTER),
    ], meshes=MESHES, placements=30, id="index-scatter_add"),
    OpRecord("scatter_src_grad", [
        OpSample([(9, 3), (5, 3)], {"dim": 0}, dtypes=["float32", "int64"], requires_grad=[False, False]),
        OpSample([(2, 8), (2, 3)], {"dim": -1}, dtypes=["float32", "int64"], requires_grad=[False, False]),
    ], meshes=MESHES, placements=30, backward=False, id="index-scatter_src_grad"),
    OpRecord("index_add", [
        OpSample([(8, 3), (5,), (5, 3)], {"dim": 0}, **SCATTER),
        OpSample([(2, 9), (4,), (2, 4)], {"dim": 1}, **SCATTER),
    ], meshes=MESHES, placements=40, id="index-index_add"),
    OpRecord("index_copy", [
        OpSample([(8, 3), (5,), (5, 3)], {"dim": 0}, **SCATTER),
        OpSample([(2, 9), (4,), (2, 4)], {"dim": 1}, **SCATTER),
    ], meshes=MESHES, placements=30, id="index-index_copy"),
    OpRecord("scatter_update", [  # MindSpore's ScatterUpdate (index_copy along dim 0)
        OpSample([(7, 3), (4,), (4, 3)], {}, **SCATTER),
    ], meshes=MESHES, placements=30, id="index-scatter_update"),
    OpRecord("index_copy_src_grad", [
        OpSample([(9, 3), (5,)], {"dim": 0}, dtypes=["float32", "int64"], requires_grad=[False, False]),
    ], meshes=MESHES, placements=30, backward=False, id="index-index_copy_src_grad"),
    OpRecord("gather_nd", [
        OpSample([(8, 9, 3), (5, 2)], **IDX),
        OpSample([(9, 2), (3, 1, 1)], dtypes=["float32", "int32"], requires_grad=[True, False]),
    ], meshes=MESHES, placements=40, id="index-gather_nd"),
    OpRecord("scatter_nd", [
        OpSample([(8, 9), (4, 2), (4,)], **SCATTER),
        OpSample([(9, 3), (5, 1), (5, 3)], {"reduction": "add"}, **SCATTER),
    ], meshes=MESHES, placements=30, id="index-scatter_nd"),
    OpRecord("index_put", [
        OpSample([(8, 3), (5, 1), (5, 3)], {"accumulate": True}, **SCATTER),
        OpSample([(8, 8), (3, 2), (3,)], **SCATTER),
    ], meshes=MESHES, placements=30, id="index-index_put"),
    OpRecord("scatter_nd_src_grad", [
        OpSample([(8, 3), (5, 1)], dtypes=["float32", "int64"], requires_grad=[False, False]),
    ], meshes=MESHES, placements=30, backward=False, id="index-scatter_nd_src_grad"),
    OpRecord("masked_fill", [
        OpSample([(4, 5), (4, 5)], {"value": -2.5}, dtypes=["float32", "bool"], requires_grad=[True, False]),
        OpSample([(5, 3), (3,)], {"value": 0}, dtypes=["float32", "bool"], requires_grad=[True, False]),
        OpSample([(2, 1, 4), (1, 4)], {"value": 7}, dtypes=["int64", "bool"], requires_grad=[False, False]),
    ], meshes=MESHES, placements=40, id="index-masked_fill"),
    OpRecord("masked_scatter", [
        OpSample([(4, 5), (4, 5), (21,)], dtypes=["float32", "bool", "float32"], requires_grad=[True, False, True]),
        OpSample([(5, 1, 3), (3,), (5, 3)], dtypes=["float32", "bool", "float32"], requires_grad=[True, False, True]),
    ], meshes=MESHES, placements=30, id="index-masked_scatter"),
    OpRecord("masked_scatter_src_grad", [
        OpSample([(5, 3), (5, 3)], {"shape": [16]}, dtypes=["float32", "bool"], requires_grad=[False, False]),
    ], meshes=MESHES, placements=30, backward=False, id="index-masked_scatter_src_grad"),
    OpRecord("where", [
        OpSample([(4, 3), (4, 3), (3,)], dtypes=["bool", "float32", "float32"], requires_grad=[False, True, True]),
        OpSample([(5, 1), (5, 4), (1, 4)], dtypes=["bool", "float32", "float32"], requires_grad=[False, True, True]),
    ], meshes=MESHES, placements=40, id="index-where"),
    OpRecord("one_hot", [
        OpSample([(5, 3)], {"num_classes": 8}, dtypes=["int64"], requires_grad=[False]),
        OpSample([(7, 1)], {"num_classes": 10}, dtypes=["int32"], requires_grad=[False]),
    ], meshes=MESHES, placements="all", backward=False, id="index-one_hot"),
    OpRecord("isin", [
        OpSample([(5, 3), (4,)], dtypes=["int64", "int64"], requires_grad=[False, False]),
        OpSample([(6,), (2, 3)], dtypes=["int32", "int64"], requires_grad=[False, False]),
    ], meshes=MESHES, placements=30, backward=False, id="index-isin"),
]
