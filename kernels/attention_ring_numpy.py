"""numpy kernels of ring attention's ops (:mod:`layout_prop.ops.ring`), merged into the numpy table
through :mod:`.attention_numpy`.

``attention_block`` returns the block's attention output packed with its log-sum-exp (the
last column); ``attention_merge`` combines two such results by their log-sum-exp.  A rank's
``attention_block`` gets localised attrs: ``q_start`` and ``kv_start`` (the global index of its
first query and key row), ``q_total`` and ``kv_total`` (the global lengths) and
``kv_head_map``; on one device they default to the whole tensor.  ``ring_shift`` on one
device (or on a rank holding the whole dim) is ``np.roll`` by whole blocks; on a sharded dim
lowering runs a cyclic ``permute`` instead.

Examples
--------
>>> import numpy as np
>>> ring_shift(np.arange(6), dim=0, blocks=3).tolist()
[4, 5, 0, 1, 2, 3]
>>> q = np.zeros((1, 1, 2, 2)); v = np.arange(4.0).reshape(1, 1, 2, 2)
>>> packed = attention_block(q, q, v, blocks=1, causal=True)
>>> packed[0, 0].round(4).tolist()  # row 0 sees key 0, row 1 keys 0 and 1 (lse log 1, log 2)
[[0.0, 1.0, 0.0], [1.0, 2.0, 0.6931]]
>>> a = attention_block(q, q, v, blocks=2, step=0)  # each row its own key, then the other one
>>> b = attention_block(q, ring_shift(q, dim=2, blocks=2), ring_shift(v, dim=2, blocks=2), blocks=2, step=1)
>>> np.allclose(attention_merge(a, b), attention_block(q, q, v, blocks=1))
True
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from .nn_numpy import _f, expand_kv, kv_index, reduce_kv, zigzag_positions

__all__ = ["KERNELS", "ring_shift", "attention_block", "attention_block_grad", "attention_merge",
           "attention_merge_grad", "block_visible"]

_TO_BNSD = {"BNSD": (0, 1, 2, 3), "BSND": (0, 2, 1, 3)}  # its own inverse


def ring_shift(x, dim, blocks, shift=1):
    """``x`` rolled by ``shift`` of its ``blocks`` blocks along ``dim`` (block i <- block i - shift)."""
    x = np.asarray(x)
    if shift % blocks == 0:
        return np.array(x, copy=True)
    return np.roll(x, shift * (x.shape[dim] // blocks), axis=dim)


def block_visible(sq: int, skv: int, blocks: int, step: int, causal: bool, q_offset: int = 0, q_start: int = 0,
                  kv_start: int = 0, q_total: int | None = None, kv_total: int | None = None,
                  zigzag: int = 0) -> np.ndarray:
    """``(sq, skv)``: which local key each local query row sees at ring step ``step``.

    Query row r (global) of block i sees the keys of block i of the shifted k, whose original
    block is ``(i - step) mod blocks``; causal: original key index <= r + q_offset, both as
    positions in the sequence when it is stored in zig-zag order (``zigzag``, q_offset 0).
    """
    q_total = sq if q_total is None else q_total
    kv_total = skv if kv_total is None else kv_total
    bq, bk = max(q_total // blocks, 1), max(kv_total // blocks, 1)
    rows = q_start + np.arange(sq)
    cols = kv_start + np.arange(skv)
    q_block, k_block = rows // bq, cols // bk
    seen = q_block[:, None] == k_block[None, :]
    if causal:
        original = ((k_block - step) % blocks) * bk + cols % bk
        queries = rows + q_offset
        if zigzag:  # stored indices -> positions in the sequence
            original = zigzag_positions(kv_total, zigzag)[original]
            queries = zigzag_positions(q_total, zigzag)[rows]
        seen &= original[None, :] <= queries[:, None]
    return seen


def _block_probs(q, k, blocks, step, causal, scale, q_offset, q_start, kv_start, q_total, kv_total, zigzag=0):
    """Probabilities over the visible keys (0 elsewhere; rows seeing none all 0), the log-sum-exp
    (-inf for those rows) and the scale; q, k in BNSD."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    seen = block_visible(q.shape[-2], k.shape[-2], blocks, step, causal, q_offset, q_start, kv_start, q_total,
                         kv_total, zigzag)
    scores = np.where(seen, np.matmul(q, np.swapaxes(k, -1, -2)) * scale, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(scores - top)
    total = np.sum(e, axis=-1, keepdims=True)
    some = total > 0
    probs = e / np.where(some, total, 1.0)
    lse = np.where(some, top + np.log(np.where(some, total, 1.0)), -np.inf)
    return probs, lse[..., 0], scale


def attention_block(q, k, v, blocks, step=0, layout="BNSD", causal=False, scale=None, q_offset=0, zigzag=0,
                    q_start=0, kv_start=0, q_total=None, kv_total=None, kv_head_map=None):
    """The block's attention output packed with its log-sum-exp: q's shape, last dim Dv + 1."""
    q, k, v = _f(q), _f(k), _f(v)
    dtype = np.result_type(q, k, v)
    order = _TO_BNSD[layout]
    qb, kb, vb = (np.transpose(t, order) for t in (q, k, v))
    index = kv_index(qb.shape[1], kb.shape[1], kv_head_map)
    kb, vb = expand_kv(kb, index), expand_kv(vb, index)
    probs, lse, _ = _block_probs(qb, kb, blocks, step, causal, scale, q_offset, q_start, kv_start, q_total, kv_total,
                                 zigzag)
    packed = np.concatenate([np.matmul(probs, vb), lse[..., None]], axis=-1)
    return np.transpose(packed, order).astype(dtype, copy=False)


def attention_block_grad(dy, q, k, v, blocks, step=0, layout="BNSD", causal=False, scale=None, q_offset=0,
                         zigzag=0, q_start=0, kv_start=0, q_total=None, kv_total=None, kv_head_map=None):
    """``(dq, dk, dv)``; dy's last column is the cotangent of the log-sum-exp."""
    dy, q, k, v = _f(dy), _f(q), _f(k), _f(v)
    order = _TO_BNSD[layout]
    dyb, qb, kb, vb = (np.transpose(t, order) for t in (dy, q, k, v))
    kv_heads = kb.shape[1]
    index = kv_index(qb.shape[1], kv_heads, kv_head_map)
    kb, vb = expand_kv(kb, index), expand_kv(vb, index)
    probs, _, used = _block_probs(qb, kb, blocks, step, causal, scale, q_offset, q_start, kv_start, q_total,
                                  kv_total, zigzag)
    d_out, d_lse = dyb[..., :-1], dyb[..., -1:]
    out = np.matmul(probs, vb)
    dv = np.matmul(np.swapaxes(probs, -1, -2), d_out)
    dprobs = np.matmul(d_out, np.swapaxes(vb, -1, -2))
    dscores = probs * (dprobs - np.sum(d_out * out, axis=-1, keepdims=True) + d_lse) * used
    dq = np.matmul(dscores, kb)
    dk = np.matmul(np.swapaxes(dscores, -1, -2), qb)
    dk, dv = reduce_kv(dk, kv_heads, index), reduce_kv(dv, kv_heads, index)
    return tuple(np.transpose(g, order).astype(t.dtype, copy=False) for g, t in ((dq, q), (dk, k), (dv, v)))


def _weights(a, b):
    """``(wa, wb, L)`` of two packed results: ``L = logaddexp(la, lb)``, ``w = exp(l - L)`` (0 where
    both are -inf: rows that see no key yet)."""
    la, lb = a[..., -1:], b[..., -1:]
    total = np.logaddexp(la, lb)
    finite = np.isfinite(total)
    base = np.where(finite, total, 0.0)
    wa = np.where(finite, np.exp(np.where(finite, la - base, 0.0)) * np.isfinite(la), 0.0)
    wb = np.where(finite, np.exp(np.where(finite, lb - base, 0.0)) * np.isfinite(lb), 0.0)
    return wa, wb, total


def attention_merge(a, b):
    """The log-sum-exp combine of two packed partial attention results."""
    a, b = _f(a), _f(b)
    dtype = np.result_type(a, b)
    wa, wb, total = _weights(a, b)
    out = wa * a[..., :-1] + wb * b[..., :-1]
    return np.concatenate([out, total], axis=-1).astype(dtype, copy=False)


def attention_merge_grad(dy, a, b):
    """``(da, db)`` of :func:`attention_merge`."""
    dy, a, b = _f(dy), _f(a), _f(b)
    wa, wb, _ = _weights(a, b)
    oa, ob = a[..., :-1], b[..., :-1]
    out = wa * oa + wb * ob
    d_out, d_lse = dy[..., :-1], dy[..., -1:]
    grads = []
    for w, o, t in ((wa, oa, a), (wb, ob, b)):
        d_l = w * (np.sum(d_out * (o - out), axis=-1, keepdims=True) + d_lse)
        grads.append(np.concatenate([w * d_out, d_l], axis=-1).astype(t.dtype, copy=False))
    return tuple(grads)


KERNELS: dict[str, Callable] = {
    "ring_shift": ring_shift,
    "attention_block": attention_block,
    "attention_block_grad": attention_block_grad,
    "attention_merge": attention_merge,
    "attention_merge_grad": attention_merge_grad,
}
