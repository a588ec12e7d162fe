"""Records of the linalg family: einsum, matmul, batch_matmul, linear, embedding, sum, mean, max.

Each op gets even dims, uneven dims (5 or 7 on 2 or 4 pieces, so some pieces are
smaller), and size-1 dims (broadcast batch dims, a size-1 hidden or vocabulary).
Embedding ids are int64 or int32 without gradient; the kit's random ids lie in
[0, 8), so a vocabulary smaller than 8 also checks that out-of-range ids give zeros.
"""

from . import OpRecord, OpSample

INT_IDS = dict(dtypes=["int64", "float32"], requires_grad=[False, True])

RECORDS = [
    OpRecord("einsum", [
        OpSample([(4, 3), (3, 5)], {"equation": "mk,kn->mn"}),
        OpSample([(1, 3, 5), (2, 5, 4)], {"equation": "bmk,bkn->bmn"}),
        OpSample([(3, 4), (4, 5), (5, 2)], {"equation": "ab,bc,cd->ad"}),
        OpSample([(5, 3)], {"equation": "ij->ji"}),
    ], placements=100, id="linalg-einsum"),
    OpRecord("matmul", [
        OpSample([(5, 4), (4, 6)]),
        OpSample([(2, 3, 4), (4, 1)]),
        OpSample([(3, 5, 4), (7, 4)], {"transpose_b": True}),
    ], placements=130, id="linalg-matmul"),
    OpRecord("batch_matmul", [
        OpSample([(2, 3, 4), (2, 4, 5)]),
        OpSample([(3, 1, 2, 4), (5, 4, 3)]),
        OpSample([(1, 3, 2), (4, 3, 5)], {"transpose_a": True}),
    ], placements=130, id="linalg-batch_matmul"),
    OpRecord("linear", [
        OpSample([(3, 5), (4, 5), (4,)]),
        OpSample([(2, 3, 4), (6, 4)]),
        OpSample([(2, 5, 3), (7, 3), (1,)]),
    ], placements=130, id="linalg-linear"),
    OpRecord("embedding", [
        OpSample([(3, 4), (7, 6)], **INT_IDS),
        OpSample([(5,), (10, 1)], dtypes=["int32", "float32"], requires_grad=[False, True]),
        OpSample([(2, 3), (1, 4)], **INT_IDS),
    ], placements=140, id="linalg-embedding"),
    OpRecord("sum", [
        OpSample([(5, 3, 4)], {"dims": [0, 2]}),
        OpSample([(4, 6)], {"dims": [1], "keepdim": True}),
        OpSample([(1, 7)]),
    ], placements="all", id="linalg-sum"),
    OpRecord("mean", [
        OpSample([(5, 3, 4)], {"dims": [0, 2]}),
        OpSample([(7, 6)], {"dims": -1, "keepdim": True}),
        OpSample([(1, 7)]),
    ], placements="all", id="linalg-mean"),
    OpRecord("max", [
        OpSample([(5, 3, 4)], {"dims": [0, 2]}),
        OpSample([(4, 6)], {"dims": [1], "keepdim": True}),
        OpSample([(1, 7)]),
    ], placements="all", id="linalg-max"),
]
