"""MindSpore kernels of the copying op family, merged into the mindspore and cann tables.

:mod:`.mindspore_backend` imports this module; import its helpers (``_ms``, ``to_tensor``...)
inside functions, not at the top.

Each kernel follows its numpy reference (:mod:`.copying_numpy`) in MindSpore ops:
``broadcast_to``, ``stack``, ``unbind``, ``full``, ``pad`` after a slice for the crops,
``repeat_interleave``, and ``index_add`` for the sum of the copies.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .copying_numpy import expanded_shape, pad_pairs

__all__ = ["KERNELS"]


def _ms():
    from .mindspore_backend import _ms as import_ms

    return import_ms()


def _t(x):
    from .mindspore_backend import to_tensor

    return to_tensor(x)


def _expand(x, shape):
    x = _t(x)
    return _ms().ops.broadcast_to(x, expanded_shape(tuple(x.shape), shape)).copy()


def _stack(*xs, dim=0):
    return _ms().ops.stack([_t(x) for x in xs], dim)


def _one_or_tuple(pieces: tuple):
    """The one piece itself, or the tuple of several (a node of one output holds one value)."""
    return pieces[0] if len(pieces) == 1 else pieces


def _unbind(x, dim=0):
    return tuple(t.copy() for t in _ms().ops.unbind(_t(x), dim))


def _full_like(x, fill_value=0, dtype=None, shape=None):
    from .mindspore_backend import _ms_dtype

    x = _t(x)
    size = tuple(x.shape) if shape is None else tuple(int(s) for s in shape)
    ms_dtype = x.dtype if dtype is None else _ms_dtype(np.dtype(dtype))
    return _ms().ops.full(size, fill_value, dtype=ms_dtype)


def _pad(x, pad, mode="constant", value=0):
    x = _t(x)
    pairs = pad_pairs(pad, x.ndim)
    out_shape = tuple(n + a + b for n, (a, b) in zip(x.shape, pairs))
    crop = tuple(slice(max(-a, 0), n - max(-b, 0)) for n, (a, b) in zip(x.shape, pairs))
    if 0 in out_shape or any(hi <= lo for lo, hi in ((c.start, c.stop) for c in crop)):
        return _ms().ops.full(out_shape, value, dtype=x.dtype)  # nothing of x is left (MindSpore pads no empty)
    x = x[crop] if any(a < 0 or b < 0 for a, b in pairs) else x
    grow = []  # MindSpore's pad takes torch's order: the last dim first
    for a, b in reversed(pairs):
        grow += [max(a, 0), max(b, 0)]
    if not any(grow):
        return x.copy()
    return _ms().ops.pad(x, tuple(grow), mode="constant", value=float(value)).astype(x.dtype)


def _counts(repeats, n: int):
    return np.full(n, int(repeats), np.int64) if np.ndim(repeats) == 0 else np.asarray(repeats, np.int64)


def _repeat_interleave(x, repeats, dim=None):
    x = _t(x)
    if dim is None:
        x, dim = _ms().ops.reshape(x, (-1,)), 0
    counts = _counts(repeats, x.shape[dim])
    index = _t(np.repeat(np.arange(x.shape[dim]), counts).astype(np.int64))
    return _ms().ops.gather(x, index, dim)


def _repeat_interleave_grad(dy, repeats, dim=None, shape=None, placements=None):
    ops = _ms().ops
    dy = _t(dy)
    shape = tuple(int(s) for s in shape)
    flat = dim is None
    axis = 0 if flat else int(dim) % len(shape)
    n = int(np.prod(shape)) if flat else shape[axis]
    index = _t(np.repeat(np.arange(n), _counts(repeats, n)).astype(np.int32))
    moved = ops.moveaxis(ops.reshape(dy, (-1,)) if flat else dy, axis, 0)
    rest = tuple(moved.shape[1:])
    if moved.shape[0] == 0 or 0 in rest:
        out = ops.zeros((n,) + rest, dy.dtype)
    else:
        flat_rows = ops.reshape(moved, (moved.shape[0], -1))
        out = ops.reshape(ops.unsorted_segment_sum(flat_rows, index, n), (n,) + rest).astype(dy.dtype)
    return ops.reshape(out, shape) if flat else ops.moveaxis(out, 0, axis)


KERNELS: dict[str, Callable] = {
    "expand": _expand,
    "stack": _stack,
    "full_like": _full_like,
    "zeros_like": _full_like,
    "ones_like": _full_like,
    "new_ones": _full_like,
    "pad": _pad,
    "repeat_interleave": _repeat_interleave,
    "repeat_interleave_grad": _repeat_interleave_grad,
}
KERNELS.update({f"unbind{n}": _unbind for n in range(2, 9)}, unbind=lambda x, dim=0: _one_or_tuple(_unbind(x, dim)))
