"""MindSpore kernels of the attention op family, merged into the mindspore and cann tables.

:mod:`.mindspore_backend` imports this module; import its helpers (``_ms``, ``to_tensor``...)
inside functions, not at the top.

``flash_attention_score`` is composed from MindSpore ops (transpose, reshape, gather,
matmul, a masked softmax) with the formulas of :mod:`.attention_numpy`: MindSpore's own
``ops.flash_attention_score`` runs on Ascend only (Atlas A2), not on CPU.  The mask, a
function of the attrs and shapes alone, is made by numpy (``attention_numpy.attention_mask``)
and handed over as a tensor, as are the dropout draws (MindSpore's generator cannot be keyed by
global indices: ``counter_uniform`` of the loss family draws them).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from . import attention_ring_mindspore
from .attention_numpy import INT32_MAX, _draws, attention_mask, check_heads

__all__ = ["KERNELS"]


def _to_bnsd(t, layout: str, heads):
    from .mindspore_backend import _ms

    ops = _ms().ops
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return ops.transpose(t, (0, 2, 1, 3))
    if layout == "TND":
        return ops.expand_dims(ops.transpose(t, (1, 0, 2)), 0)
    if layout == "SBH":
        t = ops.transpose(t, (1, 0, 2))
    b, s, h = t.shape
    d = h // heads if heads else 0
    return ops.transpose(t.reshape(b, s, heads, d), (0, 2, 1, 3))


def _from_bnsd(t, layout: str):
    from .mindspore_backend import _ms

    ops = _ms().ops
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return ops.transpose(t, (0, 2, 1, 3))
    if layout == "TND":
        return ops.transpose(t[0], (1, 0, 2))
    b, n, s, d = t.shape
    t = ops.transpose(t, (0, 2, 1, 3)).reshape(b, s, n * d)
    return ops.transpose(t, (1, 0, 2)) if layout == "SBH" else t


def _probs(qb, kb, mask: np.ndarray, scale: float):
    """The masked softmax of ``scale * q k^T``; a row that sees no key is zeros."""
    from .mindspore_backend import _exp_of, _ms, to_tensor

    ops = _ms().ops
    seen = to_tensor(mask)
    scores = ops.matmul(qb, ops.swapaxes(kb, -1, -2)) * scale
    lowest = ops.full_like(scores, -np.inf)
    top = ops.amax(ops.where(seen, scores, lowest), -1, True)
    top = ops.where(ops.isfinite(top), top, ops.zeros_like(top))
    e = ops.where(seen, _exp_of(scores - top), ops.zeros_like(scores))
    total = ops.sum(e, -1, True)
    return e / ops.where(total > 0, total, ops.ones_like(total))


def _dropped(t, keep: np.ndarray | None, keep_prob: float):
    """``t`` where the dropout mask ``keep`` (numpy's draws) keeps, scaled by ``1/keep_prob``; 0 elsewhere."""
    if keep is None:
        return t
    from .mindspore_backend import _ms, to_tensor

    ops = _ms().ops
    return ops.where(to_tensor(keep), t / keep_prob, ops.zeros_like(t))


class _Prepared:
    """q, k, v in BNSD (k and v with one head per query head), and the mask (``attention_numpy._Prepared``)."""

    def __init__(self, q, k, v, head_num, input_layout, sparse_mode, pre_tokens, next_tokens, actual_seq_qlen,
                 actual_seq_kvlen, q_start, q_total, kv_head_map, zigzag=0, attn_mask=None):
        from .mindspore_backend import _expand_kv, _kv_index

        self.qb = _to_bnsd(q, input_layout, head_num)
        kv_heads = None
        if input_layout in ("BSH", "SBH"):
            d = q.shape[-1] // head_num
            kv_heads = k.shape[-1] // d if d else 0
        kb, vb = _to_bnsd(k, input_layout, kv_heads), _to_bnsd(v, input_layout, kv_heads)
        self.kv_heads = kb.shape[1]
        check_heads(self.qb.shape[1], self.kv_heads, kv_head_map, input_layout, (q.shape, k.shape, v.shape))
        self.index = _kv_index(self.qb.shape[1], self.kv_heads, kv_head_map)
        self.kb, self.vb = _expand_kv(kb, self.index), _expand_kv(vb, self.index)
        sq, skv = self.qb.shape[2], self.kb.shape[2]
        self.mask = attention_mask(sq, skv, q_start, sq if q_total is None else q_total, sparse_mode, pre_tokens,
                                   next_tokens, actual_seq_qlen, actual_seq_kvlen, zigzag)
        if attn_mask is not None and sparse_mode in (0, 1):  # 1 or True: the query must not see the key
            from .mindspore_backend import to_numpy

            allowed = ~to_numpy(attn_mask).astype(bool)
            self.mask = self.mask & (allowed if allowed.ndim == 4 else allowed[None, None])


def _flash_attention_score(query, key, value, attn_mask=None, head_num=1,
                           input_layout="BSH", scale=1.0, keep_prob=1.0, sparse_mode=0,
                           pre_tokens=INT32_MAX, next_tokens=INT32_MAX, actual_seq_qlen=None, actual_seq_kvlen=None,
                           q_start=0, q_total=None, kv_head_map=None, context_parallel="all_gather", seed=0,
                           zigzag=0, b_start=0, b_total=None, head_start=0, head_total=None):
    from .mindspore_backend import _as_result, _floated, _ms

    ops = _ms().ops
    q, k, v = _floated(query), _floated(key), _floated(value)
    if head_num == 0:  # no query head on this rank
        return _as_result(ops.zeros(q.shape, q.dtype), q, k, v)
    p = _Prepared(q, k, v, head_num, input_layout, sparse_mode, pre_tokens, next_tokens, actual_seq_qlen,
                  actual_seq_kvlen, q_start, q_total, kv_head_map, zigzag, attn_mask)
    probs = _dropped(_probs(p.qb, p.kb, p.mask, scale), _draws(p, keep_prob, seed, b_start, b_total, head_start,
                                                                head_total, q_start, q_total), keep_prob)
    return _as_result(_from_bnsd(ops.matmul(probs, p.vb), input_layout).reshape(q.shape), q, k, v)


def _flash_attention_score_grad(dy, query, key, value, attn_mask=None, head_num=1,
                                input_layout="BSH", scale=1.0, keep_prob=1.0,
                                sparse_mode=0, pre_tokens=INT32_MAX, next_tokens=INT32_MAX, actual_seq_qlen=None,
                                actual_seq_kvlen=None, q_start=0, q_total=None, kv_head_map=None,
                                context_parallel="all_gather", seed=0, zigzag=0, b_start=0, b_total=None,
                                head_start=0, head_total=None):
    from .mindspore_backend import _floated, _ms, _reduce_kv

    ops = _ms().ops
    dy, q, k, v = _floated(dy), _floated(query), _floated(key), _floated(value)
    if head_num == 0:  # no query head on this rank: it adds nothing to any gradient
        return tuple(ops.zeros(t.shape, t.dtype) for t in (q, k, v))
    p = _Prepared(q, k, v, head_num, input_layout, sparse_mode, pre_tokens, next_tokens, actual_seq_qlen,
                  actual_seq_kvlen, q_start, q_total, kv_head_map, zigzag, attn_mask)
    dyb = _to_bnsd(dy, input_layout, head_num)
    probs = _probs(p.qb, p.kb, p.mask, scale)
    keep = _draws(p, keep_prob, seed, b_start, b_total, head_start, head_total, q_start, q_total)
    dv = ops.matmul(ops.swapaxes(_dropped(probs, keep, keep_prob), -1, -2), dyb)
    dprobs = _dropped(ops.matmul(dyb, ops.swapaxes(p.vb, -1, -2)), keep, keep_prob)
    dscores = probs * (dprobs - ops.sum(dprobs * probs, -1, True)) * scale
    dq = ops.matmul(dscores, p.kb)
    dk = ops.matmul(ops.swapaxes(dscores, -1, -2), p.qb)
    dk, dv = _reduce_kv(dk, p.kv_heads, p.index), _reduce_kv(dv, p.kv_heads, p.index)
    return tuple(_from_bnsd(g, input_layout).reshape(t.shape).astype(t.dtype) for g, t in ((dq, q), (dk, k), (dv, v)))


KERNELS: dict[str, Callable] = {
    "flash_attention_score": _flash_attention_score,
    "flash_attention_score_grad": _flash_attention_score_grad,
}
KERNELS.update(attention_ring_mindspore.KERNELS)  # ring attention's ops (ops/ring.py)
