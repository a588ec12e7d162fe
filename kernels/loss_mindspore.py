"""MindSpore kernels of the loss op family, merged into the mindspore and cann tables.

:mod:`.mindspore_backend` imports this module; import its helpers (``_ms``, ``to_tensor``...)
inside functions, not at the top.

The cross entropy kernels follow :mod:`.loss_numpy` formula by formula in MindSpore ops,
in float64 (as the numpy reference computes), rounded once to the input's dtype.  The
targets are checked (``target-out-of-range``) with the numpy reference's own check on
the target's values, so that both backends refuse alike.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .loss_numpy import check_targets

__all__ = ["KERNELS"]


def _f64(x):
    from .mindspore_backend import _ms, to_tensor

    return to_tensor(x).astype(_ms().float64)


def _int64(x):
    from .mindspore_backend import _ms, to_tensor

    return to_tensor(x).astype(_ms().int64)


def _dtype_of(x):
    from .mindspore_backend import to_tensor

    return to_tensor(x).dtype


def _targets(target, token_slices: Sequence | None):
    t = _int64(target)
    if token_slices is None:
        return t
    return t[tuple(slice(int(lo), int(hi)) for lo, hi in token_slices)]


def _valid(t, classes: int, ignore_index: int):
    """The mask of the tokens that count (MindSpore), after the reference's range check."""
    from .mindspore_backend import to_numpy, to_tensor

    return to_tensor(check_targets(to_numpy(t), classes, ignore_index))


def _count(target, ignore_index: int) -> int:
    from .mindspore_backend import _ms

    t = _int64(target)
    return int(_ms().ops.sum((t != ignore_index).astype(_ms().int64)).asnumpy()) if t.size else 0


def _reduce(loss, reduction: str, count: int, dtype):
    ops = _import_ops()
    if reduction == "none":
        return loss.astype(dtype)
    total = ops.sum(loss) if loss.size else _scalar(0.0)
    if reduction == "mean":
        total = total / count if count else total * float("nan")
    return total.astype(dtype)


def _import_ops():
    from .mindspore_backend import _ms

    return _ms().ops


def _scalar(value: float):
    from .mindspore_backend import to_tensor

    return to_tensor(np.float64(value))


def _pick(x, index):
    """``x[..., index]`` per token (index a tensor of the token shape)."""
    ops = _import_ops()
    if x.shape[-1] == 0 or x.size == 0:
        return ops.zeros(tuple(index.shape), x.dtype)
    return ops.squeeze(ops.gather_elements(x, x.ndim - 1, ops.expand_dims(index, -1)), -1)


def _onehot(x, index, mask):
    ops = _import_ops()
    if x.shape[-1] == 0:
        return ops.zeros_like(x)
    from .mindspore_backend import to_tensor

    hot = ops.one_hot(index, x.shape[-1], to_tensor(np.float32(1.0)), to_tensor(np.float32(0.0)))  # exact 0 and 1
    return hot.astype(x.dtype) * ops.expand_dims(mask.astype(x.dtype), -1)


def _sum_last(x):
    ops = _import_ops()
    if x.shape[-1] == 0 or x.size == 0:
        return ops.zeros(tuple(x.shape[:-1]), x.dtype)
    return ops.sum(x, -1)


def _lse(x):
    ops = _import_ops()
    m = ops.amax(x, -1, True) if x.size else ops.zeros(tuple(x.shape[:-1]) + (1,), x.dtype)
    return ops.log(_sum_last(ops.exp(x - m))) + ops.squeeze(m, -1)


def _smoothed(lse, picked, sum_x, classes, eps):
    return lse - (1.0 - eps) * picked - eps * sum_x / classes


def _weights(dy, valid, reduction: str, count: int):
    ops = _import_ops()
    w = _f64(dy)
    if reduction == "mean":
        w = w / count if count else w * float("nan")
    w = ops.broadcast_to(w, tuple(valid.shape))
    return ops.where(valid, w, ops.zeros_like(w))


# --------------------------------------------------------------------------- cross entropy
def _cross_entropy(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, token_slices=None):
    ops = _import_ops()
    x = _f64(logits)
    t = _targets(target, token_slices)
    classes = x.shape[-1]
    valid = _valid(t, classes, ignore_index)
    index = ops.where(valid, t, ops.zeros_like(t))
    loss = _smoothed(_lse(x), _pick(x, index), _sum_last(x), classes, label_smoothing)
    loss = ops.where(valid, loss, ops.zeros_like(loss))
    return _reduce(loss, reduction, _count(target, ignore_index), _dtype_of(logits))


def _cross_entropy_grad(dy, logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                        token_slices=None):
    ops = _import_ops()
    x = _f64(logits)
    t = _targets(target, token_slices)
    classes = x.shape[-1]
    valid = _valid(t, classes, ignore_index)
    w = _weights(dy, valid, reduction, _count(target, ignore_index))
    index = ops.where(valid, t, ops.zeros_like(t))
    p = ops.softmax(x, -1) if x.size else x
    grad = p - (1.0 - label_smoothing) * _onehot(x, index, ops.ones_like(valid)) - label_smoothing / classes
    return (grad * ops.expand_dims(w, -1)).astype(_dtype_of(logits))


# --------------------------------------------------------------------------- vocab-parallel parts
def _held(x, target, vocab_start: int, ignore_index: int):
    ops = _import_ops()
    t = _int64(target)
    local = t - vocab_start
    held = ops.logical_and(ops.logical_and(t != ignore_index, local >= 0), local < x.shape[-1])
    return ops.where(held, local, ops.zeros_like(local)), held


def _shifted_exp(x, m):
    """``exp(x - m)`` per token (an empty piece as it is: MindSpore's CPU kernels warn on empty outputs)."""
    ops = _import_ops()
    return ops.exp(x - ops.expand_dims(m, -1)) if x.size else x


def _cross_entropy_parts(logits, target, logits_max, ignore_index=-100, vocab_start=0):
    ops = _import_ops()
    x, m = _f64(logits), _f64(logits_max)
    index, held = _held(x, target, vocab_start, ignore_index)
    sumexp = _sum_last(_shifted_exp(x, m))
    picked = _pick(x, index)
    picked = ops.where(held, picked, ops.zeros_like(picked))
    return ops.stack([sumexp, picked, _sum_last(x)], -1).astype(_dtype_of(logits))


def _cross_entropy_parts_grad(dparts, logits, target, logits_max, ignore_index=-100, vocab_start=0):
    d, x, m = _f64(dparts), _f64(logits), _f64(logits_max)
    index, held = _held(x, target, vocab_start, ignore_index)
    e = _shifted_exp(x, m)
    dx = d[..., 0:1] * e + d[..., 1:2] * _onehot(x, index, held) + d[..., 2:3]
    dm = -d[..., 0] * _sum_last(e)
    return dx.astype(_dtype_of(logits)), dm.astype(_dtype_of(logits_max))


def _cross_entropy_combine(parts, logits_max, target, num_classes, ignore_index=-100, reduction="mean",
                           label_smoothing=0.0, token_slices=None):
    ops = _import_ops()
    p, m = _f64(parts), _f64(logits_max)
    t = _targets(target, token_slices)
    valid = _valid(t, num_classes, ignore_index)
    loss = _smoothed(ops.log(p[..., 0]) + m, p[..., 1], p[..., 2], num_classes, label_smoothing)
    loss = ops.where(valid, loss, ops.zeros_like(loss))
    return _reduce(loss, reduction, _count(target, ignore_index), _dtype_of(parts))


def _cross_entropy_combine_grad(dy, parts, target, num_classes, ignore_index=-100, reduction="mean",
                                label_smoothing=0.0, token_slices=None):
    ops = _import_ops()
    p = _f64(parts)
    t = _targets(target, token_slices)
    valid = _valid(t, num_classes, ignore_index)
    w = _weights(dy, valid, reduction, _count(target, ignore_index))
    sumexp = ops.where(valid, p[..., 0], ops.ones_like(p[..., 0]))
    dparts = ops.stack([w / sumexp, -(1.0 - label_smoothing) * w, -label_smoothing / num_classes * w], -1)
    return dparts.astype(_dtype_of(parts)), w.astype(_dtype_of(parts))


KERNELS: dict[str, Callable] = {
    "cross_entropy": _cross_entropy,
    "cross_entropy_grad": _cross_entropy_grad,
    "cross_entropy_parts": _cross_entropy_parts,
    "cross_entropy_parts_grad": _cross_entropy_parts_grad,
    "cross_entropy_combine": _cross_entropy_combine,
    "cross_entropy_combine_grad": _cross_entropy_combine_grad,
}


# --------------------------------------------------------------------------- random ops
def _dropout(x, p=0.5, seed=0, training=True, offsets=None, global_shape=None):
    """The mask is the numpy reference's (:func:`.loss_numpy.dropout_mask`, the counter-based
    draws keyed by global indices, which no MindSpore generator offers); the scaling is MindSpore's."""
    from .loss_numpy import dropout_mask
    from .mindspore_backend import to_tensor

    x = to_tensor(x)
    if not training:
        return x.copy()
    keep = to_tensor(dropout_mask(tuple(x.shape), p, seed, offsets, global_shape))
    ops = _import_ops()
    return ops.where(keep, x * (1.0 / (1.0 - p)), ops.zeros_like(x)).astype(x.dtype)


def _multinomial(probs, num_samples, replacement=False, seed=0, offsets=None, global_shape=None):
    """The numpy reference's draws, as a MindSpore tensor: MindSpore's ``multinomial`` draws from
    its own generator, which cannot be keyed by global element indices (a sharded run would not
    draw what one device draws)."""
    from .loss_numpy import multinomial
    from .mindspore_backend import to_numpy, to_tensor

    return to_tensor(multinomial(to_numpy(probs), num_samples, replacement, seed, offsets, global_shape))


KERNELS.update({"dropout": _dropout, "multinomial": _multinomial})
