"""numpy kernels of the loss op family, merged into the numpy table.

Cross entropy is computed in float64 and rounded once to the logits' dtype.  A ``mean``
kernel reads the whole target (to count the tokens that are not ignored) and its own
tokens' targets at ``token_slices`` (localised; None on one device).

Examples
--------
>>> import numpy as np
>>> logits = np.log(np.array([[1.0, 1.0, 2.0], [1.0, 3.0, 4.0]]))
>>> float(cross_entropy(logits, np.array([2, -100])))
0.6931471805599453
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from layout_prop.core.errors import ExecutionError

__all__ = ["KERNELS", "cross_entropy", "cross_entropy_grad", "cross_entropy_parts", "cross_entropy_parts_grad",
           "cross_entropy_combine", "cross_entropy_combine_grad", "counter_uniform", "splitmix64", "global_indices", "dropout_mask", "dropout", "multinomial",
           "multinomial_draws"]


# --------------------------------------------------------------------------- cross entropy
def _targets(target: np.ndarray, token_slices: Sequence | None) -> np.ndarray:
    """This rank's targets: the whole target cut to ``token_slices`` (a ``mean``), else as given."""
    target = np.asarray(target).astype(np.int64)
    if token_slices is None:
        return target
    return target[tuple(slice(lo, hi) for lo, hi in token_slices)]


def check_targets(target: np.ndarray, classes: int, ignore_index: int) -> np.ndarray:
    """The mask of the tokens that count; ``target-out-of-range`` for a target outside ``[0, classes)``."""
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= classes))
    if bad.any():
        value = int(target[bad].flat[0])
        raise ExecutionError("target-out-of-range", f"cross entropy: target {value} is not a class index in "
                             f"[0, {classes}) nor ignore_index {ignore_index} ({int(bad.sum())} such tokens)",
                             hint="give targets in [0, classes), or ignore_index for tokens that do not count")
    return valid


def _count(target: np.ndarray, ignore_index: int) -> int:
    return int((np.asarray(target) != ignore_index).sum())


def _reduce(loss: np.ndarray, reduction: str, count: int, dtype) -> np.ndarray:
    if reduction == "none":
        return loss.astype(dtype)
    total = loss.sum()
    if reduction == "mean":
        total = total / count if count else np.float64("nan")
    return np.asarray(total, dtype=dtype)


def _loss_weight(dy: np.ndarray, valid: np.ndarray, reduction: str, count: int) -> np.ndarray:
    """Per token, the cotangent the loss gets (0 on ignored tokens)."""
    dy = np.asarray(dy, dtype=np.float64)
    if reduction == "mean":
        dy = dy / count if count else dy * np.nan
    return np.where(valid, np.broadcast_to(dy, valid.shape), 0.0)


def _smoothed_loss(lse, picked, sum_x, classes, eps):
    """torch's smoothed loss: ``(1 - eps) * (lse - x[t]) + eps * (lse - mean(x))``."""
    return lse - (1.0 - eps) * picked - eps * sum_x / classes


def cross_entropy(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, token_slices=None):
    x = np.asarray(logits, dtype=np.float64)
    t = _targets(target, token_slices)
    classes = x.shape[-1]
    valid = check_targets(t, classes, ignore_index)
    m = x.max(axis=-1, keepdims=True) if x.size else np.zeros(x.shape[:-1] + (1,))
    lse = np.log(np.exp(x - m).sum(axis=-1)) + m[..., 0]
    picked = np.take_along_axis(x, np.where(valid, t, 0)[..., None], axis=-1)[..., 0]
    loss = np.where(valid, _smoothed_loss(lse, picked, x.sum(axis=-1), classes, label_smoothing), 0.0)
    return _reduce(loss, reduction, _count(target, ignore_index), logits.dtype)


def cross_entropy_grad(dy, logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                       token_slices=None):
    x = np.asarray(logits, dtype=np.float64)
    t = _targets(target, token_slices)
    classes = x.shape[-1]
    valid = check_targets(t, classes, ignore_index)
    w = _loss_weight(dy, valid, reduction, _count(target, ignore_index))
    if x.size:
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
    else:
        p = np.zeros_like(x)
    onehot = np.zeros_like(x)
    np.put_along_axis(onehot, np.where(valid, t, 0)[..., None], 1.0, axis=-1)
    grad = p - (1.0 - label_smoothing) * onehot - label_smoothing / classes
    return (grad * w[..., None]).astype(logits.dtype)


# --------------------------------------------------------------------------- vocab-parallel parts
def _pick(x: np.ndarray, target: np.ndarray, vocab_start: int, ignore_index: int):
    """``(local index, held mask)``: where each token's target falls in this piece of the classes."""
    t = np.asarray(target).astype(np.int64)
    local = t - vocab_start
    held = (t != ignore_index) & (local >= 0) & (local < x.shape[-1])
    return np.where(held, local, 0), held


def cross_entropy_parts(logits, target, logits_max, ignore_index=-100, vocab_start=0):
    """Per token ``[sum(exp(x - m)), x[t] (0 where another piece holds t), sum(x)]`` over this piece's classes."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.asarray(logits_max, dtype=np.float64)
    index, held = _pick(x, target, vocab_start, ignore_index)
    sumexp = np.exp(x - m[..., None]).sum(axis=-1)
    picked = np.where(held, np.take_along_axis(x, index[..., None], axis=-1)[..., 0] if x.shape[-1] else 0.0, 0.0)
    return np.stack([sumexp, picked, x.sum(axis=-1)], axis=-1).astype(logits.dtype)


def cross_entropy_parts_grad(dparts, logits, target, logits_max, ignore_index=-100, vocab_start=0):
    """``(dlogits, dlogits_max)`` of :func:`cross_entropy_parts`."""
    d = np.asarray(dparts, dtype=np.float64)
    x = np.asarray(logits, dtype=np.float64)
    m = np.asarray(logits_max, dtype=np.float64)
    index, held = _pick(x, target, vocab_start, ignore_index)
    e = np.exp(x - m[..., None])
    onehot = np.zeros_like(x)
    if x.shape[-1]:
        np.put_along_axis(onehot, index[..., None], 1.0, axis=-1)
    onehot *= held[..., None]
    dx = d[..., 0:1] * e + d[..., 1:2] * onehot + d[..., 2:3]
    dm = -d[..., 0] * e.sum(axis=-1)
    return dx.astype(logits.dtype), dm.astype(np.asarray(logits_max).dtype)


def cross_entropy_combine(parts, logits_max, target, num_classes, ignore_index=-100, reduction="mean",
                          label_smoothing=0.0, token_slices=None):
    p = np.asarray(parts, dtype=np.float64)
    m = np.asarray(logits_max, dtype=np.float64)
    t = _targets(target, token_slices)
    valid = check_targets(t, num_classes, ignore_index)
    lse = np.log(p[..., 0]) + m
    loss = np.where(valid, _smoothed_loss(lse, p[..., 1], p[..., 2], num_classes, label_smoothing), 0.0)
    return _reduce(loss, reduction, _count(target, ignore_index), parts.dtype)


def cross_entropy_combine_grad(dy, parts, target, num_classes, ignore_index=-100, reduction="mean",
                               label_smoothing=0.0, token_slices=None):
    """``(dparts, dlogits_max)`` of :func:`cross_entropy_combine`."""
    p = np.asarray(parts, dtype=np.float64)
    t = _targets(target, token_slices)
    valid = check_targets(t, num_classes, ignore_index)
    w = _loss_weight(dy, valid, reduction, _count(target, ignore_index))
    with np.errstate(divide="ignore", invalid="ignore"):
        dsumexp = np.where(valid, w / np.where(valid, p[..., 0], 1.0), 0.0)
    dparts = np.stack([dsumexp, -(1.0 - label_smoothing) * w, -label_smoothing / num_classes * w], axis=-1)
    return dparts.astype(parts.dtype), w.astype(parts.dtype)


# --------------------------------------------------------------------------- counter-based random numbers
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(counters) -> np.ndarray:
    """splitmix64 of each uint64 counter (Steele, Lea and Flood 2014; the seeding generator of
    xoshiro): the counter stepped once by the golden-ratio increment, then mixed by two
    xor-shift-multiply rounds, in uint64 arithmetic modulo 2**64.

    >>> hex(int(splitmix64(np.zeros(1, np.uint64))[0]))  # the generator's first output from state 0
    '0xe220a8397b1dcdaf'
    """
    z = np.asarray(counters, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def counter_uniform(seed: int, flat_indices) -> np.ndarray:
    """Uniform draws in [0, 1), a pure function of ``(seed, index)`` for each global element index.

    The counter ``seed * 2**32 + index`` (mod 2**64; indices below 2**32) goes through
    :func:`splitmix64`, and its top 53 bits make the float.  A sharded run that passes
    each rank its elements' global indices draws exactly what one device draws.

    >>> counter_uniform(0, [0])[0] == (0xe220a8397b1dcdaf >> 11) / 2.0 ** 53
    True
    """
    idx = np.asarray(flat_indices, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        counters = (np.uint64(int(seed) & 0xFFFFFFFF) << np.uint64(32)) + idx
    return (splitmix64(counters) >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


KERNELS: dict[str, Callable] = {
    "cross_entropy": cross_entropy,
    "cross_entropy_grad": cross_entropy_grad,
    "cross_entropy_parts": cross_entropy_parts,
    "cross_entropy_parts_grad": cross_entropy_parts_grad,
    "cross_entropy_combine": cross_entropy_combine,
    "cross_entropy_combine_grad": cross_entropy_combine_grad,
}


# --------------------------------------------------------------------------- random ops
def global_indices(shape: Sequence[int], offsets: Sequence[int] | None = None,
                   global_shape: Sequence[int] | None = None) -> np.ndarray:
    """The row-major index in the global tensor of every element of a local piece.

    >>> global_indices((2, 2), offsets=[1, 2], global_shape=[3, 4]).tolist()
    [[6, 7], [10, 11]]
    """
    shape = tuple(int(s) for s in shape)
    if offsets is None:
        return np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    grids = np.indices(shape, dtype=np.int64)
    coords = tuple(grids[d] + int(offsets[d]) for d in range(len(shape)))
    if not shape or 0 in shape:
        return np.zeros(shape, dtype=np.int64)
    return np.ravel_multi_index(coords, tuple(int(s) for s in global_shape)).astype(np.int64)


def dropout_mask(shape, p: float, seed: int, offsets=None, global_shape=None) -> np.ndarray:
    """The kept elements: ``counter_uniform(seed, global index) >= p``."""
    return counter_uniform(seed, global_indices(shape, offsets, global_shape)) >= p


def dropout(x, p=0.5, seed=0, training=True, offsets=None, global_shape=None):
    x = np.asarray(x)
    if not training:
        return x.copy()
    keep = dropout_mask(x.shape, p, seed, offsets, global_shape)
    return np.where(keep, x * (1.0 / (1.0 - p)), 0.0).astype(x.dtype)


def _check_probs(w: np.ndarray, num_samples: int, replacement: bool) -> None:
    bad = ~np.isfinite(w).all(axis=-1) | (w < 0).any(axis=-1)
    positive = (w > 0).sum(axis=-1)
    short = positive < (1 if replacement else num_samples)
    if bad.any() or short.any():
        why = ("a weight that is negative or not finite" if bad.any() else
               f"fewer than {1 if replacement else num_samples} positive weights")
        raise ExecutionError("invalid-probs", f"multinomial: {int((bad | short).sum())} row(s) of probs have {why}",
                             hint="give non-negative finite weights, enough of them positive for the draws")


def multinomial_draws(w: np.ndarray, rows: np.ndarray, num_samples: int, replacement: bool, seed: int) -> np.ndarray:
    """The class indices drawn for each row of weights ``w`` (float64 ``[rows, classes]``), row ``i``
    having the global row index ``rows[i]``."""
    classes = w.shape[-1]
    if replacement:
        u = counter_uniform(seed, rows[:, None] * num_samples + np.arange(num_samples))
        cdf = np.cumsum(w, axis=-1)
        total = cdf[:, -1:]
        picks = np.stack([np.searchsorted(cdf[i], u[i] * total[i, 0], side="right") for i in range(len(rows))]) \
            if len(rows) else np.zeros((0, num_samples), np.int64)
        return np.minimum(picks, classes - 1).astype(np.int64)
    u = counter_uniform(seed, rows[:, None] * classes + np.arange(classes))
    with np.errstate(divide="ignore"):
        keys = np.where(w > 0, np.log(np.maximum(u, 1e-300)) / np.where(w > 0, w, 1.0), -np.inf)
    order = np.argsort(-keys, axis=-1, kind="stable")
    return order[:, :num_samples].astype(np.int64)


def multinomial(probs, num_samples, replacement=False, seed=0, offsets=None, global_shape=None):
    w = np.asarray(probs, dtype=np.float64)
    lead = w.shape[:-1]
    _check_probs(w, num_samples, replacement)
    rows = global_indices(lead, offsets, global_shape).reshape(-1)
    draws = multinomial_draws(w.reshape(-1, w.shape[-1]), rows, num_samples, replacement, seed)
    return draws.reshape(lead + (num_samples,))


KERNELS.update({"dropout": dropout, "multinomial": multinomial})
