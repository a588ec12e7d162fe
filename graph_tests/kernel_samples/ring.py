"""Kernel samples of ring attention's ops (ops/ring.py; see the package docstring): a roll of the
sequence blocks, one ring step with and without the causal mask (steps whose rows see no key, a
query offset, the zig-zag order, grouped-query heads with a value head size of its own), the
log-sum-exp merge of two steps and the gradients."""

import numpy as np


def samples(rng, f32_wide) -> dict:
    def f32(*shape):  # unit scale, as the attention family's samples (float32 backward within 1e-5)
        return f32_wide(*shape) / 3

    q, k, v = f32(2, 4, 8, 3), f32(2, 2, 8, 3), f32(2, 2, 8, 2)  # 4 query heads on 2 kv heads, 4 blocks of 2 rows
    blocks = [((q, k, v), {"blocks": 4, "step": step, "causal": True, "q_offset": 1}) for step in range(4)]
    blocks += [((q, k, v), {"blocks": 4, "step": 1, "causal": True, "zigzag": 2}),
               ((q, k, v), {"blocks": 4, "step": 2, "causal": False, "scale": 0.3})]
    from layout_prop.kernels.numpy_backend import KERNELS

    a = KERNELS["attention_block"](q, k, v, blocks=4, step=1, causal=True)
    b = KERNELS["attention_block"](q, k, v, blocks=4, step=2, causal=True)
    assert np.isneginf(a[..., -1]).any()  # the merge sees rows that no key reached
    return {
        "ring_shift": [((q,), {"dim": 2, "blocks": 4, "shift": -1}), ((k,), {"dim": 2, "blocks": 4, "shift": 1})],
        "attention_block": blocks,
        # dy is the packed output's cotangent: the value head size 2 and the log-sum-exp column
        "attention_block_grad": [((f32(2, 4, 8, 3), q, k, v), {"blocks": 4, "step": step, "causal": True})
                                 for step in range(4)],
        "attention_merge": [((a, b), {})],
        "attention_merge_grad": [((f32(*a.shape), a, b), {})],
    }
