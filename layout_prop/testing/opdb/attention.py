"""Records of the attention family: grouped-query heads in ``scaled_dot_product_attention``,
``flash_attention_score`` and its grad op.

The grouped-query samples hold fewer kv heads than query heads: 8 on 2 (kv heads that split
on 2 ranks but not on 4), 4 on 1 (multi-query) and 6 on 3 (uneven on 4 ranks), with uneven
and size-1 dims beside them.  Meshes (4,) and (2, 2) only, with sampled placements, to keep
the records within the test budget.
"""

from . import OpRecord, OpSample

MESHES = ((4,), (2, 2))

_GQA = [
    OpSample([(2, 8, 4, 4), (2, 2, 4, 4), (2, 2, 4, 4)], {"causal": True}),
    OpSample([(1, 4, 5, 2), (1, 1, 3, 2), (1, 1, 3, 3)]),
    OpSample([(2, 3, 6, 4), (2, 3, 3, 4), (2, 3, 3, 4)], {"layout": "BSND", "causal": True}, partial_ok=False),
]

RECORDS = [
    OpRecord("scaled_dot_product_attention", _GQA, meshes=MESHES, placements=60, id="attention-gqa"),
    OpRecord("scaled_dot_product_attention_grad", [
        OpSample([(2, 8, 4, 4), (2, 8, 4, 4), (2, 2, 4, 4), (2, 2, 4, 4)], {"causal": True}),
        OpSample([(2, 6, 3, 2), (2, 6, 3, 4), (2, 3, 3, 4), (2, 3, 3, 2)], {"layout": "BSND"}),
    ], meshes=MESHES, placements=40, id="attention_grad-gqa"),
]
