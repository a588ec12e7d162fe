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
    OpRecord("scaled_dot_product_attention", _GQA, meshes=MESHES, placements=40, id="attention-gqa"),
    OpRecord("scaled_dot_product_attention_grad", [
        OpSample([(2, 8, 4, 4), (2, 8, 4, 4), (2, 2, 4, 4), (2, 2, 4, 4)], {"causal": True}),
        OpSample([(2, 6, 3, 2), (2, 6, 3, 4), (2, 3, 3, 4), (2, 3, 3, 2)], {"layout": "BSND"}),
    ], meshes=MESHES, placements=40, id="attention_grad-gqa"),
    # torch's 3-D q, k, v (N, L, E): one head (issue 37)
    OpRecord("scaled_dot_product_attention", [
        OpSample([(2, 5, 4), (2, 6, 4), (2, 6, 3)], {"causal": True}),
        OpSample([(3, 4, 2), (3, 4, 2), (3, 4, 2)], {"layout": "BSND"}),
    ], meshes=MESHES, placements=30, id="attention-3d"),
]

_FLASH = [
    # BSH: 4 query heads of 4 and 2 kv heads (H cut into whole heads on 2 or 4 ranks, parts of heads on 8)
    OpSample([(2, 5, 16), (2, 6, 8), (2, 6, 8)], {"head_num": 4, "sparse_mode": 2, "scale": 0.5}),
    OpSample([(5, 2, 8), (4, 2, 8), (4, 2, 8)], {"head_num": 2, "input_layout": "SBH", "sparse_mode": 3}),
    OpSample([(2, 4, 5, 4), (2, 2, 6, 4), (2, 2, 6, 4)],
             {"head_num": 4, "input_layout": "BNSD", "sparse_mode": 4, "pre_tokens": 1, "next_tokens": 0}),
    OpSample([(2, 5, 2, 4), (2, 3, 2, 4), (2, 3, 2, 4)],
             {"head_num": 2, "input_layout": "BSND", "pre_tokens": 1, "next_tokens": 1}, partial_ok=False),
    OpSample([(7, 4, 4), (6, 2, 4), (6, 2, 4)],
             {"head_num": 4, "input_layout": "TND", "sparse_mode": 3, "actual_seq_qlen": [3, 7],
              "actual_seq_kvlen": [2, 6]}, partial_ok=False),
]

RECORDS += [
    OpRecord("flash_attention_score", _FLASH, meshes=MESHES, placements=30, id="flash_attention_score"),
    OpRecord("flash_attention_score_grad", [
        OpSample([(2, 5, 16), (2, 5, 16), (2, 6, 8), (2, 6, 8)], {"head_num": 4, "sparse_mode": 2}),
        OpSample([(7, 4, 4), (7, 4, 4), (6, 2, 4), (6, 2, 4)],
                 {"head_num": 4, "input_layout": "TND", "sparse_mode": 2, "actual_seq_qlen": [4, 7],
                  "actual_seq_kvlen": [3, 6]}),
        OpSample([(2, 3, 4, 4), (2, 3, 4, 4), (2, 3, 2, 4), (2, 3, 2, 4)],
                 {"head_num": 4, "input_layout": "BSND", "sparse_mode": 4, "pre_tokens": 0, "next_tokens": 1}),
    ], meshes=MESHES, placements=30, id="flash_attention_score_grad"),
    # attn_mask, the optional fourth operand: (S1, S2) with the band of mode 0, (B, N1, S1, S2) alone in mode 1
    OpRecord("flash_attention_score", [
        OpSample([(2, 5, 8), (2, 6, 4), (2, 6, 4), (5, 6)], {"head_num": 2, "pre_tokens": 3, "next_tokens": 1},
                 dtypes=["float32", "float32", "float32", "bool"], requires_grad=[True, True, True, False],
                 partial_ok=False),
        OpSample([(2, 4, 4, 2), (2, 2, 6, 2), (2, 2, 6, 2), (2, 4, 4, 6)],
                 {"head_num": 4, "input_layout": "BNSD", "sparse_mode": 1},
                 dtypes=["float32", "float32", "float32", "bool"], requires_grad=[True, True, True, False],
                 partial_ok=False),
    ], meshes=MESHES, placements=30, id="flash_attention_score-attn_mask"),
]

# context parallelism: q's sequence sharded, then Ulysses (q, k, v moved to the heads) or the cheaper strategy
RECORDS += [
    OpRecord("scaled_dot_product_attention", [
        OpSample([(2, 8, 8, 2), (2, 4, 8, 2), (2, 4, 8, 2)], {"causal": True, "context_parallel": "ulysses"}),
        OpSample([(1, 8, 4, 4), (1, 8, 4, 4), (1, 8, 4, 2)], {"layout": "BSND", "context_parallel": "auto"},
                 partial_ok=False),
        OpSample([(2, 4, 8, 2), (2, 2, 8, 2), (2, 2, 8, 2)], {"causal": True, "zigzag": 2}, partial_ok=False),
    ], meshes=MESHES, placements=30, id="attention-context-parallel"),
    OpRecord("flash_attention_score", [
        OpSample([(2, 8, 16), (2, 8, 8), (2, 8, 8)], {"head_num": 4, "sparse_mode": 2, "context_parallel": "auto"},
                 partial_ok=False),
        OpSample([(2, 6, 4, 4), (2, 6, 2, 4), (2, 6, 2, 4)],
                 {"head_num": 4, "input_layout": "BSND", "keep_prob": 0.7, "seed": 2, "context_parallel": "auto"},
                 partial_ok=False),  # dropout: the draws keyed by global indices on every layout
    ], meshes=MESHES, placements=30, id="flash_attention_score-context-parallel"),
]

# ring attention (ops/ring.py): scaled_dot_product_attention with context_parallel='ring' (expanded when q, k and v
# shard their sequence on one mesh axis) and the ops of its expansion, with uneven-free sequences of whole blocks
RECORDS += [
    OpRecord("scaled_dot_product_attention", [
        OpSample([(2, 2, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4)], {"causal": True, "context_parallel": "ring"},
                 partial_ok=False),
        OpSample([(1, 4, 4, 2), (1, 2, 8, 2), (1, 2, 8, 3)], {"layout": "BNSD", "context_parallel": "ring"},
                 partial_ok=False),
        OpSample([(1, 2, 8, 2), (1, 2, 8, 2), (1, 2, 8, 2)], {"causal": True, "zigzag": 2,
                                                             "context_parallel": "ring"}, partial_ok=False),
    ], meshes=MESHES, placements=30, id="attention-ring"),
    OpRecord("ring_shift", [
        OpSample([(2, 8, 3)], {"dim": 1, "blocks": 4}),
        OpSample([(4, 2)], {"dim": 0, "blocks": 2, "shift": -1}),
        OpSample([(3, 6)], {"dim": -1, "blocks": 2, "shift": 3}),
    ], meshes=MESHES, placements="all", id="ring_shift"),
    OpRecord("attention_block", [
        # first (test_gradients' finite differences): every row sees a key; the next one has rows that see none
        OpSample([(2, 4, 2, 4), (2, 8, 2, 4), (2, 8, 2, 4)], {"blocks": 2, "step": 1, "causal": True,
                                                             "layout": "BSND", "q_offset": 4}, partial_ok=False),
        OpSample([(2, 2, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4)], {"blocks": 4, "step": 1, "causal": True}),
        OpSample([(1, 4, 4, 2), (1, 2, 4, 2), (1, 2, 4, 3)], {"blocks": 2, "step": 1}),
        OpSample([(1, 2, 8, 2), (1, 2, 8, 2), (1, 2, 8, 2)], {"blocks": 4, "step": 2, "causal": True, "zigzag": 4},
                 partial_ok=False),
    ], meshes=MESHES, placements=40, id="attention_block"),
    OpRecord("attention_block_grad", [
        OpSample([(2, 2, 8, 5), (2, 2, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4)], {"blocks": 4, "step": 3, "causal": True}),
        OpSample([(1, 4, 4, 4), (1, 4, 4, 2), (1, 2, 4, 2), (1, 2, 4, 3)], {"blocks": 2, "step": 0}),
    ], meshes=MESHES, placements=40, id="attention_block_grad"),
    OpRecord("attention_merge", [OpSample([(2, 3, 4, 5), (2, 3, 4, 5)])], meshes=MESHES, placements=60,
             id="attention_merge"),
    OpRecord("attention_merge_grad", [OpSample([(2, 3, 4, 5), (2, 3, 4, 5), (2, 3, 4, 5)])], meshes=MESHES,
             placements=60, id="attention_merge_grad"),
]

# flash_attention_score's ring (sparse modes 0, 2, 3; BSH and BNSD; expanded where the sequences shard on one axis)
RECORDS += [
    OpRecord("flash_attention_score", [
        OpSample([(2, 8, 16), (2, 8, 8), (2, 8, 8)], {"head_num": 4, "sparse_mode": 2, "context_parallel": "ring"},
                 partial_ok=False),
        OpSample([(1, 2, 4, 4), (1, 2, 8, 4), (1, 2, 8, 4)],
                 {"head_num": 2, "input_layout": "BNSD", "sparse_mode": 3, "context_parallel": "ring"},
                 partial_ok=False),
    ], meshes=MESHES, placements=30, id="flash_attention_score-ring"),
]
