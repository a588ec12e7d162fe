"""Kernel samples of the moe op family (see the package docstring): dropless and with a
capacity (global, and per group), with and without routing weights, some indices naming no
expert, and the local piece of a rank (a later token range, whole indices) as a sharded run
calls the kernels; the dense buffer whole, a rank's token range of it, and a block of its
experts and slots (experts 2..3, slots 1..2)."""

import numpy as np


def samples(rng, f32) -> dict:
    x, w = f32(8, 3), f32(8, 2)
    idx = rng.integers(0, 4, (8, 2)).astype(np.int64)
    idx[1, 0] = 7  # names no expert of 4: dropped
    buf = f32(4, 8, 3)
    dropless = {"num_experts": 4, "groups": 4}
    capped = {"num_experts": 4, "capacity_factor": 1.0, "groups": 4}
    piece = {**capped, "tokens": 8, "token_start": 4, "local_tokens": 4, "indices_start": 0}  # rank 1 of 2
    grouped = {**capped, "capacity_scope": "group"}  # 1 slot per expert and group of 2 tokens: 4 slots
    dense = {"num_experts": 4, "capacity_factor": 1.0, "dense": True}  # one buffer of 4 slots an expert
    dense_piece = {**dense, "tokens": 8, "token_start": 4, "local_tokens": 4, "indices_start": 0}  # rank 1 of 2
    block = {**dense, "tokens": 8, "token_start": 0, "local_tokens": 8, "expert_start": 2, "slot_start": 1}
    return {
        "moe_dispatch": [((x, idx, w), dropless), ((x, idx), capped), ((x[4:], idx, w[4:]), piece),
                         ((x, idx, w), grouped), ((x, idx, w), dense), ((x[4:], idx, w[4:]), dense_piece)],
        "moe_combine": [((buf, idx, w), dropless), ((buf, idx), capped), ((buf[:, 4:], idx, w[4:]), piece),
                        ((buf[:, :4], idx, w), grouped), ((buf[:, :4], idx, w), dense),
                        ((buf[2:, 1:3], idx, w), block)],
        "moe_weight_grad": [((buf, x, idx), dropless), ((buf, x, idx), capped), ((buf[:, 4:], x[4:], idx), piece),
                            ((buf[:, :4], x, idx), grouped), ((buf[:, :4], x, idx), dense),
                            ((buf[2:, 1:3], x, idx), block)],
    }
