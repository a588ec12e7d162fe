"""numpy kernels of the copying op family, merged into the numpy table.

Localised attrs: ``expand``'s ``shape`` and ``full_like``'s ``shape`` and ``dtype`` are the
rank's local output; ``repeat_interleave_grad``'s ``shape`` is the rank's piece of x.

Examples
--------
>>> import numpy as np
>>> pad(np.arange(3.0), pad=[1, -1], value=9.0).tolist()
[9.0, 0.0, 1.0]
>>> repeat_interleave_grad(np.arange(6.0), repeats=[1, 0, 2, 3], dim=0, shape=[4]).tolist()
[0.0, 0.0, 3.0, 12.0]
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .shape_numpy import one_or_tuple

__all__ = ["KERNELS", "expanded_shape", "expand", "stack", "unbind", "full_like", "pad", "repeat_interleave", "repeat_interleave_grad"]


def expanded_shape(x_shape: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` with each ``-1`` replaced by x's size there (dims aligned from the right)."""
    lead = len(shape) - len(x_shape)
    return tuple(int(x_shape[i - lead]) if s == -1 and i >= lead else int(s) for i, s in enumerate(shape))


def expand(x, shape):
    return np.array(np.broadcast_to(x, expanded_shape(x.shape, shape)), copy=True)


def stack(*xs, dim=0):
    return np.stack(xs, axis=dim)


def unbind(x, dim=0):
    return tuple(np.array(np.take(x, i, axis=dim), copy=True) for i in range(x.shape[dim]))


def full_like(x, fill_value=0, dtype=None, shape=None):
    return np.full(tuple(x.shape) if shape is None else tuple(shape), fill_value, dtype=dtype or x.dtype)


def pad_pairs(pad: Sequence[int], ndim: int) -> list[tuple[int, int]]:
    """torch's pad list (last dim first) as one (before, after) per dim."""
    out = [(0, 0)] * ndim
    for k in range(len(pad) // 2):
        out[ndim - 1 - k] = (int(pad[2 * k]), int(pad[2 * k + 1]))
    return out


def pad(x, pad, mode="constant", value=0):
    pairs = pad_pairs(pad, x.ndim)
    crop = tuple(slice(max(-a, 0), n - max(-b, 0)) for n, (a, b) in zip(x.shape, pairs))
    grow = [(max(a, 0), max(b, 0)) for a, b in pairs]
    return np.pad(x[crop], grow, mode="constant", constant_values=np.array(value).astype(x.dtype))


def _counts(repeats, n: int) -> np.ndarray:
    return np.full(n, int(repeats), np.int64) if np.ndim(repeats) == 0 else np.asarray(repeats, np.int64)


def repeat_interleave(x, repeats, dim=None):
    if dim is None:
        x, dim = np.reshape(x, -1), 0
    return np.repeat(x, _counts(repeats, x.shape[dim]), axis=dim)


def repeat_interleave_grad(dy, repeats, dim=None, shape=None, placements=None):
    """The sum of each element's copies, of x's ``shape``."""
    shape = tuple(int(s) for s in shape)
    flat = dim is None
    axis = 0 if flat else int(dim) % len(shape)
    n = int(np.prod(shape)) if flat else shape[axis]
    index = np.repeat(np.arange(n), _counts(repeats, n))
    moved = np.moveaxis(np.reshape(dy, -1) if flat else dy, axis, 0)
    out = np.zeros((n,) + moved.shape[1:], dtype=dy.dtype)
    np.add.at(out, index, moved)
    return np.reshape(out, shape) if flat else np.moveaxis(out, 0, axis)


KERNELS: dict[str, Callable] = {
    "expand": expand,
    "stack": stack,
    "full_like": full_like,
    "zeros_like": full_like,  # the rules' normalised attrs always hold fill_value (0 or 1 by default)
    "ones_like": full_like,
    "new_ones": full_like,
    "pad": pad,
    "repeat_interleave": repeat_interleave,
    "repeat_interleave_grad": repeat_interleave_grad,
}
KERNELS.update({f"unbind{n}": unbind for n in range(2, 9)}, unbind=lambda x, dim=0: one_or_tuple(unbind(x, dim)))
