"""The cost of an op on one rank: FLOPs and bytes on its local shapes, and a roofline time.

Keyed by op like the kernel tables: every built-in op is listed in one class below
(``graph_tests/test_estimate.py`` checks that every registered op is); an op listed
nowhere (a user's own) is costed as a vector op of one FLOP an element, and
:func:`cost_class` returns None for it so that the estimate can say so.

- ``matmul`` (einsum, matmul, batch_matmul, linear): 2 x the product of every index's size
  (for a matmul ``2 M N K``), on the matrix units at the dtype's peak;
- ``attention`` (fused attention and its gradient): the two products of the forward,
  ``4 B N Sq Sk D`` (causal or not: the FLOP convention of Megatron-LM's formula, which
  counts the whole score matrix), the gradient twice that; bytes are the operands and
  outputs only (a fused kernel keeps the ``Sq x Sk`` scores on chip); a ring attention's
  ``attention_block`` on its local q and k (exact where a rank holds one block, as in the
  ring; a rank holding several blocks computes only the diagonal ones, which this overcounts);
- ``vector``: elementwise, norms, softmax, losses, gathers and scatters: bytes read and
  written, and a few FLOPs an element (:data:`VECTOR_FLOPS`), on the vector units;
- ``free``: views and bookkeeping that move no data (reshape, squeeze, the
  ``redistribute`` node itself, whose collectives are priced by :mod:`.collectives`).

The time of an op is the roofline ``max(FLOPs / (peak x efficiency), bytes / (HBM x
efficiency))``.

Examples
--------
>>> from layout_prop.perf.clusters import get_cluster
>>> c = op_cost("matmul", ((4, 8), (8, 16)), ((4, 16),), (4, 4), (4,), {})
>>> c.flops, c.bytes
(1024, 896)
>>> c = op_cost("scaled_dot_product_attention", ((1, 2, 8, 4),) * 3, ((1, 2, 8, 4),), (2,) * 3, (2,), {})
>>> c.flops, c.kind
(2048, 'attention')
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .clusters import Cluster

__all__ = ["OpCost", "VECTOR_FLOPS", "MATMUL", "ATTENTION", "FREE", "op_cost", "op_time", "cost_class"]

MATMUL = ("einsum", "matmul", "batch_matmul", "linear")
ATTENTION = ("scaled_dot_product_attention", "scaled_dot_product_attention_grad", "flash_attention_score",
             "flash_attention_score_grad", "attention_block", "attention_block_grad")
FREE = ("reshape", "squeeze", "unsqueeze", "redistribute", "identity", "opaque", "expand", "sharding_constraint")

#: the vector ops, with the FLOPs an output element costs
VECTOR_FLOPS = {
    "add": 1, "sub": 1, "mul": 1, "div": 1, "neg": 1, "scale": 1, "pow": 2, "reciprocal": 1, "rsqrt": 2, "sqrt": 2,
    "relu": 1, "relu_grad": 1, "cast": 1, "sum_to": 1, "sum": 1, "mean": 1, "max": 1, "sum_grad": 1,
    "max_grad": 2, "embedding": 1, "embedding_grad": 1, "concat": 1, "slice": 1, "pad_slice": 1,
    "transpose": 1, **{f"split{n}": 1 for n in range(2, 9)}, **{f"chunk{n}": 1 for n in range(2, 9)},
    # index family: memory-bound lookups and writes
    "gather": 1, "gather_nd": 1, "index_select": 1, "index_add": 1, "index_copy": 1, "index_copy_src_grad": 1,
    "index_put": 1, "scatter": 1, "scatter_add": 1, "scatter_nd": 1, "scatter_nd_src_grad": 1,
    "scatter_src_grad": 1, "masked_fill": 1, "masked_scatter": 1, "masked_scatter_src_grad": 1, "where": 1,
    "one_hot": 1, "isin": 2,
    # order family: a sort costs about log2 of its dim in comparisons an element (10: dims up to ~1,000)
    "topk": 10, "sort": 10, "topk_candidates": 10, "topk_merge": 10, "topk_grad": 1, "topk_candidates_grad": 1,
    "topk_merge_grad": 1, "argmax": 1, "argmin": 1, "cumsum": 1, "chunk_sum": 1, "chunk_cumsum": 1,
    "chunk_sum_grad": 1, "prod": 1, "prod_grad": 3, "maximum": 1, "minimum": 1, "maximum_grad": 2,
    # copying family (the fills write their output)
    "pad": 1, "stack": 1, **{f"unbind{n}": 1 for n in range(2, 9)}, "repeat_interleave": 1,
    "repeat_interleave_grad": 1, "full_like": 1, "zeros_like": 1, "ones_like": 1, "new_ones": 1,
    # loss family and the random ops (a counter hash an element)
    "cross_entropy_parts": 5, "cross_entropy_parts_grad": 5, "cross_entropy_combine": 5,
    "cross_entropy_combine_grad": 5, "dropout": 8, "multinomial": 10,
    # expert routing: copies of tokens into and out of the expert buffer
    "moe_dispatch": 1, "moe_combine": 2, "moe_weight_grad": 2,
    # the importers' pointwise ops
    "cos": 4, "sin": 4, "gelu_erf": 8, "gelu_erf_grad": 12,
    "softmax": 5, "log_softmax": 5, "softmax_grad": 4, "log_softmax_grad": 4,
    "rms_norm": 4, "rms_norm_grad": 8, "layer_norm": 6, "layer_norm_grad": 10,
    "gelu": 8, "gelu_grad": 12, "silu": 4, "silu_grad": 6, "swiglu": 5, "swiglu_grad": 9, "silu_mul": 5,
    "rotary_position_embedding": 3, "rotary_position_embedding_grad": 3, "cross_entropy": 5,
    "cross_entropy_grad": 5, "exp": 2, "tanh": 4, "erf": 4, "sigmoid": 4,
    # ring attention: the log-sum-exp merge and its gradient; ring_shift as a local roll (sharded, it is a permute,
    # priced by perf/step.py as a collective)
    "attention_merge": 8, "attention_merge_grad": 12, "ring_shift": 1,
}


def cost_class(op: str) -> str | None:
    """``matmul``, ``attention``, ``free``, ``vector``, or None for an op listed nowhere."""
    if op in MATMUL:
        return "matmul"
    if op in ATTENTION:
        return "attention"
    if op in FREE:
        return "free"
    return "vector" if op in VECTOR_FLOPS else None


@dataclass(frozen=True)
class OpCost:
    """One op's work on one rank: FLOPs, bytes read and written, and its cost class."""

    flops: int
    bytes: int
    kind: str
    dtype: str = "float32"


def _size(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _einsum_flops(equation: str, shapes) -> int:
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for letters, shape in zip(lhs, shapes):
        letters = letters.replace("...", "")
        for letter, size in zip(letters[::-1], tuple(shape)[::-1]):
            sizes[letter] = max(sizes.get(letter, 1), int(size))
    return 2 * math.prod(sizes.values())


def _matmul_flops(op: str, shapes, out_shapes, attrs) -> int:
    if op == "einsum":
        return _einsum_flops(str(attrs.get("equation", "")), shapes)
    out = _size(out_shapes[0])
    a = shapes[0]
    if not a:
        return 0
    if op == "linear":
        return 2 * out * a[-1]
    k = a[-2] if attrs.get("transpose_a") and len(a) > 1 else a[-1]
    return 2 * out * k


def _attention_flops(op: str, shapes, attrs) -> int:
    q, k = shapes[1:3] if op.endswith("_grad") else shapes[:2]
    layout = str(attrs.get("layout", attrs.get("input_layout", "BNSD")))
    if len(q) == 4:
        if layout in ("BSND",):
            b, sq, n, d = q
            sk = k[1]
        elif layout in ("SBH",):
            sq, b, n, d = q[0], q[1], 1, q[2]
            sk = k[0]
        else:
            b, n, sq, d = q
            sk = k[2]
    elif len(q) == 3 and layout == "TND":  # packed sequences: counted as one of T tokens (an upper bound)
        sq, n, d = q
        b, sk = 1, k[0]
    elif len(q) == 3:  # BSH / SBH: heads inside the hidden dim
        b, sq, d = q if layout != "SBH" else (q[1], q[0], q[2])
        n = 1
        sk = k[1] if layout != "SBH" else k[0]
    else:
        return 4 * _size(q) * (k[0] if k else 1)
    forward = 4 * b * n * sq * sk * d
    return 2 * forward if op.endswith("_grad") else forward


def op_cost(op: str, in_shapes, out_shapes, in_itemsizes, out_itemsizes, attrs: dict,
            dtype: str = "float32") -> OpCost:
    """The work of op ``op`` on local shapes (module docstring)."""
    kind = cost_class(op) or "vector"
    moved = sum(_size(s) * i for s, i in zip(in_shapes, in_itemsizes)) + \
        sum(_size(s) * i for s, i in zip(out_shapes, out_itemsizes))
    if kind == "free":
        return OpCost(0, 0, kind, dtype)
    if kind == "matmul":
        return OpCost(_matmul_flops(op, in_shapes, out_shapes, attrs), moved, kind, dtype)
    if kind == "attention":
        return OpCost(_attention_flops(op, in_shapes, attrs), moved, kind, dtype)
    elements = sum(_size(s) for s in out_shapes)
    return OpCost(VECTOR_FLOPS.get(op, 1) * elements, moved, kind, dtype)


def op_time(cost: OpCost, cluster: Cluster) -> float:
    """Seconds: the roofline of the op's FLOPs and bytes on ``cluster``'s device."""
    if cost.kind == "free":
        return 0.0
    memory = cost.bytes / (cluster.hbm_bytes_per_s * cluster.memory_efficiency)
    if cost.kind in ("matmul", "attention"):
        peak = cluster.peak_flops(cost.dtype) * cluster.matmul_efficiency
    else:
        peak = cluster.vector_tflops * 1e12 * cluster.memory_efficiency
    return max(cost.flops / peak, memory)
