"""numpy kernels of the attention op family, merged into the numpy table.

``flash_attention_score`` and its backward, computed on q, k, v brought to ``(B, N, S, D)``
(``TND`` as one batch of T tokens).  A rank's kernel gets localised attrs: ``q_start``
(the global index of its first query row), ``q_total`` (the global query length),
``head_num`` (its own head count) and ``kv_head_map`` (for grouped-query heads); on one
device they default to the whole tensor.

Examples
--------
>>> import numpy as np
>>> q = np.zeros((1, 2, 4)); v = np.arange(8.0).reshape(1, 2, 4)  # BSH, one head
>>> flash_attention_score(q, q, v, head_num=1, sparse_mode=2)[0]
array([[0., 1., 2., 3.],
       [2., 3., 4., 5.]])
>>> visible(np.arange(3), np.arange(4), 3, 4, sparse_mode=3, pre_tokens=0, next_tokens=0).astype(int)
array([[1, 1, 0, 0],
       [1, 1, 1, 0],
       [1, 1, 1, 1]])
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from layout_prop.core.errors import OpError

from . import attention_ring_numpy
from .nn_numpy import _f, _result, expand_kv, kv_index, reduce_kv, zigzag_positions

__all__ = ["KERNELS", "flash_attention_score", "flash_attention_score_grad", "visible", "attention_mask", "to_bnsd",
           "from_bnsd", "dropout_keep", "check_heads"]

INT32_MAX = 2 ** 31 - 1


# ------------------------------------------------------------------------------- layouts
def to_bnsd(t: np.ndarray, layout: str, heads: int | None) -> np.ndarray:
    """``t`` in ``layout`` as ``(B, N, S, D)``; ``heads`` is N for a fused H (BSH, SBH)."""
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return np.transpose(t, (0, 2, 1, 3))
    if layout == "TND":
        return np.transpose(t, (1, 0, 2))[None]
    if layout == "SBH":
        t = np.transpose(t, (1, 0, 2))
    b, s, h = t.shape
    d = h // heads if heads else 0
    return np.transpose(t.reshape(b, s, heads, d), (0, 2, 1, 3))


def from_bnsd(t: np.ndarray, layout: str) -> np.ndarray:
    """The inverse of :func:`to_bnsd`."""
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return np.transpose(t, (0, 2, 1, 3))
    if layout == "TND":
        return np.transpose(t[0], (1, 0, 2))
    b, n, s, d = t.shape
    t = np.transpose(t, (0, 2, 1, 3)).reshape(b, s, n * d)
    return np.transpose(t, (1, 0, 2)) if layout == "SBH" else t


def _kv_heads(q_heads: int, q_h: int, kv_h: int) -> int:
    """k's and v's head count in a fused layout: their H / D (D = q's H / q's heads)."""
    d = q_h // q_heads if q_heads else 0
    return kv_h // d if d else 0


def check_heads(q_heads: int, kv_heads: int, kv_head_map, input_layout: str, shapes) -> None:
    """Refuse query and key/value head counts that grouped-query attention cannot pair.

    Without a ``kv_head_map`` (a rank's own map, localised), query head ``h`` uses kv head
    ``h // (q_heads / kv_heads)``, so ``q_heads`` must be a multiple of ``kv_heads``, as
    MindSpore's FlashAttentionScore requires.  ``shapes`` are query's, key's and value's.

    Raises
    ------
    OpError
        ``invalid-shape``: query has fewer heads than key and value, or a count that is not
        a multiple of theirs.

    Examples
    --------
    >>> check_heads(4, 2, None, "BNSD", [(1, 4, 2, 3), (1, 2, 2, 3), (1, 2, 2, 3)])
    >>> check_heads(2, 4, None, "BNSD", [(1, 2, 2, 3), (1, 4, 2, 3), (1, 4, 2, 3)])
    Traceback (most recent call last):
        ...
    layout_prop.core.errors.OpError: invalid-shape: query has 2 heads but key and value have 4 (input_layout BNSD; \
query (1, 2, 2, 3), key (1, 4, 2, 3), value (1, 4, 2, 3)): flash_attention_score needs query's head count to be a \
multiple of key's and value's (hint: give key and value a head count that divides query's (1 for multi-query \
attention, query's for multi-head attention); head_num is query's head count)
    """
    if kv_head_map is not None or (kv_heads > 0 and q_heads % kv_heads == 0):
        return
    where = ", ".join(f"{name} {tuple(shape)}" for name, shape in zip(("query", "key", "value"), shapes))
    raise OpError(
        "invalid-shape",
        f"query has {q_heads} heads but key and value have {kv_heads} (input_layout {input_layout}; {where}): "
        "flash_attention_score needs query's head count to be a multiple of key's and value's",
        hint="give key and value a head count that divides query's (1 for multi-query attention, query's for "
             "multi-head attention); head_num is query's head count",
    )


# ------------------------------------------------------------------------------- the mask
def visible(rows: np.ndarray, cols: np.ndarray, sq: int, skv: int, sparse_mode: int, pre_tokens: int,
            next_tokens: int) -> np.ndarray:
    """Which keys each query row sees, rows and columns given as positions in one sequence of
    ``sq`` queries and ``skv`` keys (the op's module docstring gives the modes)."""
    i, j = rows[:, None], cols[None, :]
    if sparse_mode == 1:  # attn_mask alone decides
        return np.ones((len(rows), len(cols)), bool)
    if sparse_mode == 2:
        return np.broadcast_to(j <= i, (len(rows), len(cols)))
    if sparse_mode == 3:
        return np.broadcast_to(j <= i + (skv - sq), (len(rows), len(cols)))
    origin = i + (skv - sq if sparse_mode == 4 else 0)
    return (j >= origin - pre_tokens) & (j <= origin + next_tokens)


def attention_mask(q_rows: int, skv: int, q_start: int, q_total: int, sparse_mode: int, pre_tokens: int,
                   next_tokens: int, actual_seq_qlen=None, actual_seq_kvlen=None, zigzag: int = 0) -> np.ndarray:
    """The ``(q_rows, skv)`` mask of query rows ``q_start ...`` of ``q_total``: one sequence (stored
    in zig-zag order for ``zigzag`` shards: ``nn_numpy.zigzag_positions``), or the packed sequences
    whose cumulative ends are ``actual_seq_qlen`` / ``actual_seq_kvlen``."""
    rows = q_start + np.arange(q_rows)
    cols = np.arange(skv)
    if zigzag:
        positions = zigzag_positions(skv, zigzag)
        rows, cols = positions[rows], positions
    if actual_seq_qlen is None:
        return visible(rows, cols, q_total, skv, sparse_mode, pre_tokens, next_tokens)
    q_ends, kv_ends = np.asarray(actual_seq_qlen, np.int64), np.asarray(actual_seq_kvlen, np.int64)
    q_begins, kv_begins = np.concatenate([[0], q_ends[:-1]]), np.concatenate([[0], kv_ends[:-1]])
    mask = np.zeros((q_rows, skv), bool)
    row_seq = np.searchsorted(q_ends, rows, side="right")
    for seq in np.unique(row_seq):
        if seq >= len(q_ends):
            continue
        these = row_seq == seq
        k0, k1 = kv_begins[seq], kv_ends[seq]
        sq, sk = int(q_ends[seq] - q_begins[seq]), int(k1 - k0)
        part = visible(rows[these] - q_begins[seq], np.arange(sk), sq, sk, sparse_mode, pre_tokens, next_tokens)
        mask[np.ix_(these, np.arange(k0, k1))] = part
    return mask


def dropout_keep(shape, keep_prob: float, seed: int, offsets, global_shape):
    """The kept probabilities of a ``(B, N, Sq, Skv)`` piece at ``offsets`` of ``global_shape``
    (None: nothing dropped); the loss family's ``dropout_mask``, keyed by global indices."""
    if keep_prob == 1:
        return None
    from .loss_numpy import dropout_mask

    return dropout_mask(shape, 1.0 - keep_prob, seed, offsets, global_shape)


def _draws(p, keep_prob, seed, b_start, b_total, head_start, head_total, q_start, q_total):
    """The dropout mask of a prepared piece (``_Prepared``), or None."""
    if keep_prob == 1:
        return None
    b, n, sq, skv = p.qb.shape[0], p.qb.shape[1], p.qb.shape[2], p.kb.shape[2]
    offsets = (b_start, head_start, q_start, 0)
    global_shape = (b if b_total is None else b_total, n if head_total is None else head_total,
                    sq if q_total is None else q_total, skv)
    return dropout_keep((b, n, sq, skv), keep_prob, seed, offsets, global_shape)


def _probs(qb, kb, mask, scale):
    """Softmax probabilities of ``scale * q k^T`` under ``mask``; a row that sees no key is zeros."""
    scores = np.where(mask, np.matmul(qb, np.swapaxes(kb, -1, -2)) * scale, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.where(mask, np.exp(scores - top), 0.0)
    total = np.sum(e, axis=-1, keepdims=True)
    return e / np.where(total > 0, total, 1.0)


class _Prepared:
    """q, k, v in BNSD (k and v with one head per query head), the mask and what undoes it."""

    def __init__(self, q, k, v, head_num, input_layout, sparse_mode, pre_tokens, next_tokens, actual_seq_qlen,
                 actual_seq_kvlen, q_start, q_total, kv_head_map, zigzag=0, attn_mask=None):
        self.qb = to_bnsd(q, input_layout, head_num)
        kv_heads = _kv_heads(head_num, q.shape[-1], k.shape[-1]) if input_layout in ("BSH", "SBH") else None
        kb, vb = to_bnsd(k, input_layout, kv_heads), to_bnsd(v, input_layout, kv_heads)
        self.kv_heads = kb.shape[1]
        check_heads(self.qb.shape[1], self.kv_heads, kv_head_map, input_layout, (q.shape, k.shape, v.shape))
        self.index = kv_index(self.qb.shape[1], self.kv_heads, kv_head_map)
        self.kb, self.vb = expand_kv(kb, self.index), expand_kv(vb, self.index)
        sq, skv = self.qb.shape[2], self.kb.shape[2]
        self.mask = attention_mask(sq, skv, q_start, sq if q_total is None else q_total, sparse_mode, pre_tokens,
                                   next_tokens, actual_seq_qlen, actual_seq_kvlen, zigzag)
        if attn_mask is not None and sparse_mode in (0, 1):  # 1 or True: the query must not see the key
            allowed = ~np.asarray(attn_mask).astype(bool)
            self.mask = self.mask & (allowed if allowed.ndim == 4 else allowed[None, None])


def flash_attention_score(query, key, value, attn_mask=None, head_num=1,
                          input_layout="BSH", scale=1.0, keep_prob=1.0, sparse_mode=0,
                          pre_tokens=INT32_MAX, next_tokens=INT32_MAX, actual_seq_qlen=None, actual_seq_kvlen=None,
                          q_start=0, q_total=None, kv_head_map=None, context_parallel="all_gather", seed=0,
                          zigzag=0, b_start=0, b_total=None, head_start=0, head_total=None):
    """``dropout(softmax(mask(scale * q k^T))) v`` in ``input_layout``; ``b_start``... locate a rank's
    piece of the probabilities for the dropout draws (localised)."""
    q, k, v = _f(query), _f(key), _f(value)
    if head_num == 0:  # no query head on this rank
        return _result(np.zeros(q.shape), q, k, v)
    p = _Prepared(q, k, v, head_num, input_layout, sparse_mode, pre_tokens, next_tokens, actual_seq_qlen,
                  actual_seq_kvlen, q_start, q_total, kv_head_map, zigzag, attn_mask)
    probs = _probs(p.qb, p.kb, p.mask, scale)
    keep = _draws(p, keep_prob, seed, b_start, b_total, head_start, head_total, q_start, q_total)
    if keep is not None:
        probs = np.where(keep, probs / keep_prob, 0.0)
    return _result(from_bnsd(np.matmul(probs, p.vb), input_layout).reshape(q.shape), q, k, v)


def flash_attention_score_grad(dy, query, key, value, attn_mask=None, head_num=1,
                               input_layout="BSH", scale=1.0, keep_prob=1.0,
                               sparse_mode=0, pre_tokens=INT32_MAX, next_tokens=INT32_MAX, actual_seq_qlen=None,
                               actual_seq_kvlen=None, q_start=0, q_total=None, kv_head_map=None,
                               context_parallel="all_gather", seed=0, zigzag=0, b_start=0, b_total=None,
                               head_start=0, head_total=None):
    """``(dq, dk, dv)``, recomputing the probabilities."""
    dy, q, k, v = _f(dy), _f(query), _f(key), _f(value)
    if head_num == 0:  # no query head on this rank: it adds nothing to any gradient
        return tuple(np.zeros(t.shape, t.dtype) for t in (q, k, v))
    p = _Prepared(q, k, v, head_num, input_layout, sparse_mode, pre_tokens, next_tokens, actual_seq_qlen,
                  actual_seq_kvlen, q_start, q_total, kv_head_map, zigzag, attn_mask)
    dyb = to_bnsd(dy, input_layout, head_num)
    probs = _probs(p.qb, p.kb, p.mask, scale)
    keep = _draws(p, keep_prob, seed, b_start, b_total, head_start, head_total, q_start, q_total)
    dropped = probs if keep is None else np.where(keep, probs / keep_prob, 0.0)
    dv = np.matmul(np.swapaxes(dropped, -1, -2), dyb)
    dprobs = np.matmul(dyb, np.swapaxes(p.vb, -1, -2))
    if keep is not None:
        dprobs = np.where(keep, dprobs / keep_prob, 0.0)
    dscores = probs * (dprobs - np.sum(dprobs * probs, axis=-1, keepdims=True)) * scale
    dq = np.matmul(dscores, p.kb)
    dk = np.matmul(np.swapaxes(dscores, -1, -2), p.qb)
    dk, dv = reduce_kv(dk, p.kv_heads, p.index), reduce_kv(dv, p.kv_heads, p.index)
    return tuple(from_bnsd(g, input_layout).reshape(t.shape).astype(t.dtype, copy=False)
                 for g, t in ((dq, q), (dk, k), (dv, v)))


KERNELS: dict[str, Callable] = {
    "flash_attention_score": flash_attention_score,
    "flash_attention_score_grad": flash_attention_score_grad,
}
KERNELS.update(attention_ring_numpy.KERNELS)  # ring attention's ops (ops/ring.py)
