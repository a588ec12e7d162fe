"""MindSpore kernels of ring attention's ops (:mod:`layout_prop.ops.ring`), merged into the mindspore
and cann tables through :mod:`.attention_mindspore`.

Composed from MindSpore ops with the formulas of :mod:`.attention_ring_numpy`: the block's mask,
a function of the attrs and shapes alone, is made by numpy (``block_visible``) and handed over
as a tensor; exp and log go through the backend's float64 evaluation on CPU (``_exp_of``,
``_log_of``).  ``ring_shift`` here is the local roll (a rank holding the whole dim); on a
sharded dim lowering runs a cyclic ``permute`` instead, which the engine performs.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from .attention_ring_numpy import block_visible

__all__ = ["KERNELS"]

_TO_BNSD = {"BNSD": (0, 1, 2, 3), "BSND": (0, 2, 1, 3)}


def _ring_shift(x, dim, blocks, shift=1):
    from .mindspore_backend import _ms, to_tensor

    ops = _ms().ops
    x = to_tensor(x)
    n = x.shape[dim]
    s = (shift * (n // blocks)) % n if n else 0
    if s == 0:
        return x.copy()
    return ops.cat((ops.narrow(x, dim, n - s, s), ops.narrow(x, dim, 0, n - s)), dim)


def _block(q, k, v, blocks, step, layout, causal, scale, q_offset, q_start, kv_start, q_total, kv_total,
           kv_head_map, zigzag=0):
    """q, k, v in BNSD (k, v one head per query head), the probabilities, the log-sum-exp and the scale."""
    from .mindspore_backend import _exp_of, _expand_kv, _kv_index, _log_of, _ms, to_tensor

    ops = _ms().ops
    order = _TO_BNSD[layout]
    qb, kb, vb = (ops.transpose(t, order) for t in (q, k, v))
    kv_heads = kb.shape[1]
    index = _kv_index(qb.shape[1], kv_heads, kv_head_map)
    kb, vb = _expand_kv(kb, index), _expand_kv(vb, index)
    if scale is None:
        scale = 1.0 / math.sqrt(qb.shape[-1])
    seen = to_tensor(np.broadcast_to(block_visible(qb.shape[2], kb.shape[2], blocks, step, causal, q_offset,
                                                   q_start, kv_start, q_total, kv_total, zigzag),
                                     (qb.shape[0], qb.shape[1], qb.shape[2], kb.shape[2])).copy())
    scores = ops.matmul(qb, ops.swapaxes(kb, -1, -2)) * scale
    top = ops.amax(ops.where(seen, scores, ops.full_like(scores, -np.inf)), -1, True)
    top = ops.where(ops.isfinite(top), top, ops.zeros_like(top))
    e = ops.where(seen, _exp_of(scores - top), ops.zeros_like(scores))
    total = ops.sum(e, -1, True)
    some = total > 0
    probs = e / ops.where(some, total, ops.ones_like(total))
    lse = ops.where(some, top + _log_of(ops.where(some, total, ops.ones_like(total))), ops.full_like(total, -np.inf))
    return qb, kb, vb, probs, lse, scale, kv_heads, index


def _attention_block(q, k, v, blocks, step=0, layout="BNSD", causal=False, scale=None, q_offset=0, zigzag=0,
                     q_start=0, kv_start=0, q_total=None, kv_total=None, kv_head_map=None):
    from .mindspore_backend import _as_result, _floated, _ms

    ops = _ms().ops
    qf, kf, vf = _floated(q), _floated(k), _floated(v)
    _, _, vb, probs, lse, _, _, _ = _block(qf, kf, vf, blocks, step, layout, causal, scale, q_offset, q_start,
                                           kv_start, q_total, kv_total, kv_head_map, zigzag)
    packed = ops.cat((ops.matmul(probs, vb), lse.astype(vb.dtype)), -1)
    return _as_result(ops.transpose(packed, _TO_BNSD[layout]), q, k, v)


def _attention_block_grad(dy, q, k, v, blocks, step=0, layout="BNSD", causal=False, scale=None, q_offset=0,
                          zigzag=0, q_start=0, kv_start=0, q_total=None, kv_total=None, kv_head_map=None):
    from .mindspore_backend import _floated, _ms, _reduce_kv

    ops = _ms().ops
    dy, q, k, v = _floated(dy), _floated(q), _floated(k), _floated(v)
    qb, kb, vb, probs, _, used, kv_heads, index = _block(q, k, v, blocks, step, layout, causal, scale, q_offset,
                                                         q_start, kv_start, q_total, kv_total, kv_head_map, zigzag)
    dyb = ops.transpose(dy, _TO_BNSD[layout])
    d_out, d_lse = dyb[..., :-1], dyb[..., -1:]
    out = ops.matmul(probs, vb)
    dv = ops.matmul(ops.swapaxes(probs, -1, -2), d_out)
    dprobs = ops.matmul(d_out, ops.swapaxes(vb, -1, -2))
    dscores = probs * (dprobs - ops.sum(d_out * out, -1, True) + d_lse) * used
    dq = ops.matmul(dscores, kb)
    dk = ops.matmul(ops.swapaxes(dscores, -1, -2), qb)
    dk, dv = _reduce_kv(dk, kv_heads, index), _reduce_kv(dv, kv_heads, index)
    return tuple(ops.transpose(g, _TO_BNSD[layout]).astype(t.dtype) for g, t in ((dq, q), (dk, k), (dv, v)))


def _weights(a, b):
    """``(wa, wb, L)`` as ``attention_ring_numpy._weights``."""
    from .mindspore_backend import _exp_of, _log_of, _ms

    ops = _ms().ops
    la, lb = a[..., -1:], b[..., -1:]
    top = ops.maximum(la, lb)
    finite = ops.isfinite(top)
    base = ops.where(finite, top, ops.zeros_like(top))
    ea = ops.where(ops.isfinite(la), _exp_of(ops.where(finite, la - base, ops.zeros_like(la))), ops.zeros_like(la))
    eb = ops.where(ops.isfinite(lb), _exp_of(ops.where(finite, lb - base, ops.zeros_like(lb))), ops.zeros_like(lb))
    total = ops.where(finite, base + _log_of(ops.where(finite, ea + eb, ops.ones_like(ea))),
                      ops.full_like(top, -np.inf))
    ones = ops.where(finite, ea + eb, ops.ones_like(ea))
    return ea / ones, eb / ones, total


def _attention_merge(a, b):
    from .mindspore_backend import _as_result, _floated, _ms

    ops = _ms().ops
    af, bf = _floated(a), _floated(b)
    wa, wb, total = _weights(af, bf)
    return _as_result(ops.cat((wa * af[..., :-1] + wb * bf[..., :-1], total), -1), a, b)


def _attention_merge_grad(dy, a, b):
    from .mindspore_backend import _floated, _ms

    ops = _ms().ops
    dy, a, b = _floated(dy), _floated(a), _floated(b)
    wa, wb, _ = _weights(a, b)
    oa, ob = a[..., :-1], b[..., :-1]
    out = wa * oa + wb * ob
    d_out, d_lse = dy[..., :-1], dy[..., -1:]
    grads = []
    for w, o, t in ((wa, oa, a), (wb, ob, b)):
        d_l = w * (ops.sum(d_out * (o - out), -1, True) + d_lse)
        grads.append(ops.cat((w * d_out, d_l), -1).astype(t.dtype))
    return tuple(grads)


KERNELS: dict[str, Callable] = {
    "ring_shift": _ring_shift,
    "attention_block": _attention_block,
    "attention_block_grad": _attention_block_grad,
    "attention_merge": _attention_merge,
    "attention_merge_grad": _attention_merge_grad,
}
