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
  written, and a few FLOPs an element (:data:`VECTOR_FLOPS`), on the vector units; a dropout
  also moves its mask, one byte an element (:data:`MASK_BYTES`): the forward writes it and the
  gradient reads it (PyTorch's fused dropout keeps a one-byte mask; Korthikanti et al. 2022,
  arXiv:2205.05198, section 4.1, count it so among a layer's stored activations);
- ``free``: views and bookkeeping that move no data (reshape, squeeze, the
  ``redistribute`` node itself, whose collectives are priced by :mod:`.collectives`).

The time of an op (:func:`op_time`) on a profile with a device model (``cores``):

- a matrix product: its output in tiles (the profile's ``gemm_tiles``, the best of them), one
  tile a core at a time: ``waves = ceil(batch ceil(M / tm) ceil(N / tn) / cores)``, each wave
  a tile's ``2 tm tn K`` FLOPs at the core's share of the measured large-GEMM throughput
  (``peak x gemm_efficiency / cores``); tile and wave quantization make a thin or small GEMM
  slower than its FLOPs say (:func:`gemm_time`); at least its bytes through HBM (the
  roofline's memory-bound regime);
- fused attention: its FLOPs (half of them when causal, as FlashAttention skips the masked
  blocks) at the profile's ``attention_efficiency`` (forward, backward) of the peak;
- vector work: its bytes through HBM at ``memory_efficiency`` of the bandwidth (or its FLOPs
  on the vector units, whichever is longer);
- every kernel adds the profile's ``launch_us`` (0 on the built-in profiles: not priced).

A profile without ``cores`` (a user's file) keeps the roofline with one flat
``matmul_efficiency``: ``max(FLOPs / (peak x efficiency), bytes / (HBM x efficiency))``.

Examples
--------
>>> from layout_prop.perf.clusters import get_cluster
>>> c = op_cost("matmul", ((4, 8), (8, 16)), ((4, 16),), (4, 4), (4,), {})
>>> c.flops, c.bytes
(1024, 896)
>>> c = op_cost("scaled_dot_product_attention", ((1, 2, 8, 4),) * 3, ((1, 2, 8, 4),), (2,) * 3, (2,), {})
>>> c.flops, c.kind
(2048, 'attention')
>>> op_cost("linear", ((2, 2048, 4096), (1024, 4096)), ((2, 2048, 1024),), (2, 2), (2,), {}).gemm
(1, 4096, 1024, 4096)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .clusters import Cluster

__all__ = ["OpCost", "VECTOR_FLOPS", "MASK_BYTES", "MATMUL", "ATTENTION", "FREE", "op_cost", "op_time", "cost_class",
           "gemm_time"]

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
    "split": 1, "chunk": 1, "unbind": 1,
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

#: bytes an output element of the op moves besides its operands and outputs: a dropout's mask, one byte an element,
#: written by the forward and read by the gradient (Korthikanti et al. 2022, arXiv:2205.05198, section 4.1, count a
#: dropout's mask at one byte an element; the graph's gradient of a dropout is a dropout of the same seed)
MASK_BYTES = {"dropout": 1}


def cost_class(op: str) -> str | None:
    """``matmul``, ``attention``, ``free``, ``vector``, or None for an op listed nowhere."""
    if op in MATMUL:
        return "matmul"
    if op in ATTENTION:
        return "attention"
    if op in FREE:
        return "free"
    if op in VECTOR_FLOPS:
        return "vector"
    rule = _rule(op)
    return rule.cost_kind if rule is not None else None  # a family's own ops declare it beside their rule


def _rule(op: str):
    """The rule of ``op`` when it is registered (its ``cost_kind`` and ``vector_flops``), else None."""
    from layout_prop.core.registry import get_rule, is_registered

    return get_rule(op) if is_registered(op) else None


@dataclass(frozen=True)
class OpCost:
    """One op's work on one rank: FLOPs, bytes read and written, and its cost class."""

    flops: int
    bytes: int
    kind: str
    dtype: str = "float32"
    gemm: tuple[int, int, int, int] | None = None  # a matrix product's (batch, M, N, K)
    causal: bool = False  # fused attention that masks the future (half its FLOPs run)
    backward: bool = False  # the gradient of fused attention


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
        flops = _matmul_flops(op, in_shapes, out_shapes, attrs)
        return OpCost(flops, moved, kind, dtype, gemm=_gemm_dims(op, out_shapes, flops))
    if kind == "attention":
        causal = attrs.get("sparse_mode") in (2, 3) if "sparse_mode" in attrs else bool(attrs.get("causal"))
        return OpCost(_attention_flops(op, in_shapes, attrs), moved, kind, dtype, causal=causal,
                      backward=op.endswith("_grad"))
    elements = sum(_size(s) for s in out_shapes)
    flops = VECTOR_FLOPS[op] if op in VECTOR_FLOPS else getattr(_rule(op), "vector_flops", 1)
    return OpCost(flops * elements, moved + MASK_BYTES.get(op, 0) * elements, kind, dtype)


def _gemm_dims(op: str, out_shapes, flops: int) -> tuple[int, int, int, int] | None:
    """``(batch, M, N, K)`` of a matrix product from its output and FLOPs: the output's last two dims are the
    tile grid's, the leading ones its batch (a ``linear``'s leading dims are rows of one product)."""
    if not out_shapes or not out_shapes[0] or flops <= 0:
        return None
    out = tuple(int(d) for d in out_shapes[0])
    if op == "linear" or len(out) < 2:
        batch, m, n = 1, math.prod(out[:-1]) if len(out) > 1 else 1, out[-1]
    else:
        batch, m, n = math.prod(out[:-2]), out[-2], out[-1]
    if batch * m * n == 0:
        return None
    return batch, m, n, max(1, round(flops / (2 * batch * m * n)))


def gemm_time(batch: int, m: int, n: int, k: int, dtype: str, cluster: Cluster) -> float:
    """Seconds of the compute of a ``batch`` of ``M x K`` by ``K x N`` products on ``cluster``'s cores (module
    docstring): the best of the profile's tiles, whole waves of tiles over the cores, each tile at the core's share
    of the measured large-GEMM throughput, or slower when the on-chip bandwidth (``l2_GBps``, shared by the cores)
    cannot feed a small tile its operands (a 64 x 64 tile does 32 FLOPs a byte read, a 256 x 128 one 85).

    >>> from layout_prop.perf.clusters import get_cluster
    >>> a100 = get_cluster("a100-80g")
    >>> full = gemm_time(1, 108 * 256, 128, 4096, "float16", a100)  # 108 tiles of 256 x 128: one whole wave
    >>> round(2 * 108 * 256 * 128 * 4096 / full / 1e12, 1)  # the measured 267.9 TFLOP/s
    267.9
    >>> round(gemm_time(1, 109 * 256, 128, 4096, "float16", a100) / full, 2)  # one tile more: a second wave
    1.5
    """
    peak_core = cluster.peak_flops(dtype) * cluster.gemm_efficiency / cluster.cores
    itemsize = 4 if dtype in ("float32", "float64") else 2
    best = math.inf
    for tm, tn in cluster.gemm_tiles:
        rate = peak_core
        if cluster.l2_GBps is not None:  # a tile reads (tm + tn) K operands for its 2 tm tn K FLOPs
            rate = min(rate, 2 * tm * tn / ((tm + tn) * itemsize) * cluster.l2_GBps * 1e9 / cluster.cores)
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / cluster.cores)
        best = min(best, waves * 2 * tm * tn * k / rate)
    return best


def op_time(cost: OpCost, cluster: Cluster) -> float:
    """Seconds of the op on ``cluster``'s device (module docstring)."""
    if cost.kind == "free":
        return 0.0
    memory = cost.bytes / (cluster.hbm_bytes_per_s * cluster.memory_efficiency)
    if cluster.cores is None:  # no device model: the flat roofline
        if cost.kind in ("matmul", "attention"):
            peak = cluster.peak_flops(cost.dtype) * cluster.matmul_efficiency
        else:
            peak = cluster.vector_tflops * 1e12 * cluster.memory_efficiency
        return max(cost.flops / peak, memory)
    if cost.kind == "matmul" and cost.gemm is not None:
        compute = gemm_time(*cost.gemm, cost.dtype, cluster)
    elif cost.kind in ("matmul", "attention"):
        forward, backward = cluster.attention_efficiency
        efficiency = backward if cost.backward else forward
        if cost.kind == "matmul":
            efficiency = cluster.gemm_efficiency
        compute = cost.flops * (0.5 if cost.causal else 1.0) / (cluster.peak_flops(cost.dtype) * efficiency)
    else:
        compute = cost.flops / (cluster.vector_tflops * 1e12 * cluster.memory_efficiency)
    return max(compute, memory) + cluster.launch_us * 1e-6
