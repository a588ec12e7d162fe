"""Kernel samples of the attention op family (see the package docstring): every input layout,
the sparse modes, grouped-query heads (with and without a rank's ``kv_head_map``), a rank's
piece of the query rows (``q_start``, ``q_total``), packed sequences (TND), dropout and attn_mask."""


def samples(rng, f32_wide) -> dict:
    def f32(*shape):  # unit scale: with f32's 3 standard deviations the softmax saturates (scores ~ 18), where
        return f32_wide(*shape) / 3  # float32 rounding in the backward exceeds the 1e-5 the comparison allows

    bsh = (f32(2, 5, 16), f32(2, 6, 8), f32(2, 6, 8))  # 4 query heads of 4, 2 kv heads
    sbh = (f32(5, 2, 8), f32(4, 2, 8), f32(4, 2, 8))
    bnsd = (f32(2, 4, 3, 4), f32(2, 2, 6, 4), f32(2, 2, 6, 4))
    bsnd = (f32(2, 5, 2, 4), f32(2, 3, 2, 4), f32(2, 3, 2, 4))
    tnd = (f32(7, 4, 4), f32(6, 2, 4), f32(6, 2, 4))
    packed = {"input_layout": "TND", "actual_seq_qlen": [3, 7], "actual_seq_kvlen": [2, 6]}
    forward = [
        (bsh, {"head_num": 4, "sparse_mode": 2, "scale": 0.5}),
        (sbh, {"head_num": 2, "input_layout": "SBH", "sparse_mode": 3}),
        (bnsd, {"head_num": 4, "input_layout": "BNSD", "sparse_mode": 4, "pre_tokens": 1, "next_tokens": 0,
                "q_start": 2, "q_total": 5}),
        (bnsd[:1] + bnsd[1:], {"head_num": 4, "input_layout": "BNSD", "kv_head_map": (1, 1, 0, 0)}),
        (bsnd, {"head_num": 2, "input_layout": "BSND", "pre_tokens": 1, "next_tokens": 1}),
        (tnd, {"head_num": 4, "sparse_mode": 3, **packed}),
        (tnd, {"head_num": 4, "sparse_mode": 2, "q_start": 2, "q_total": 9, **packed}),
        (bsh, {"head_num": 4, "keep_prob": 0.7, "seed": 3}),  # dropout, one device
        ((f32(1, 4, 8), f32(1, 8, 4), f32(1, 8, 4)),
         {"head_num": 2, "sparse_mode": 2, "zigzag": 2, "q_start": 4, "q_total": 8}),  # half of a zig-zag sequence
        (bnsd, {"head_num": 4, "input_layout": "BNSD", "keep_prob": 0.8, "seed": 5, "b_start": 2, "b_total": 4,
                "head_start": 4, "head_total": 8, "q_start": 3, "q_total": 6}),  # a rank's piece of the draws
    ]
    masked = bsh + (rng.random((2, 1, 5, 6)) < 0.3,)  # attn_mask (B, 1, S1, S2), True: masked out
    forward += [(masked, {"head_num": 4, "sparse_mode": 1}),
                (bsh + (rng.random((5, 6)) < 0.3,), {"head_num": 4, "pre_tokens": 2, "next_tokens": 0})]
    grad = [((f32(*args[0].shape),) + args, attrs) for args, attrs in forward]
    return {"flash_attention_score": forward, "flash_attention_score_grad": grad}
