"""numpy kernels of the shape op family (forward and backward), merged into the numpy table.

Every kernel takes numpy arrays and the op's attrs as keyword arguments; on a simulated
rank the attrs are the localised ones (reshape gets the local target shape, squeeze
the explicit dims).  ``pad_slice`` is the gradient kernel of ``slice``; the other
gradients are shape ops too (reshape back, the inverse permutation, concat, slice).

Examples
--------
>>> import numpy as np
>>> x = np.arange(6.0).reshape(2, 3)
>>> KERNELS["transpose"](x, dims=[1, 0]).shape
(3, 2)
>>> [p.tolist() for p in KERNELS["chunk3"](np.arange(5), axis=0)]
[[0, 1], [2, 3], [4]]
>>> KERNELS["pad_slice"](np.ones(2), axis=0, start=1, size=4)
array([0., 1., 1., 0.])
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from layout_prop.core.spec import chunk_bounds

__all__ = ["KERNELS", "reshape", "transpose", "split", "chunk", "split_torch", "chunk_torch", "one_or_tuple", "slice_axis", "pad_slice", "concat",
           "unsqueeze", "squeeze", "sharding_constraint"]


def reshape(x: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """``x`` in ``shape`` (one ``-1`` allowed), row-major."""
    return np.reshape(x, tuple(shape)).copy()


def transpose(x: np.ndarray, dims: Sequence[int] | None = None, dim0: int | None = None,
              dim1: int | None = None) -> np.ndarray:
    """Permute ``x``'s dims (``dims``), or swap ``dim0`` and ``dim1``."""
    if dims is not None:
        return np.transpose(x, tuple(dims)).copy()
    return np.swapaxes(x, dim0, dim1).copy()


def _pieces(x: np.ndarray, axis: int, bounds) -> tuple[np.ndarray, ...]:
    index = [slice(None)] * x.ndim
    out = []
    for lo, hi in bounds:
        index[axis] = slice(lo, hi)
        out.append(x[tuple(index)].copy())
    return tuple(out)


def split(x: np.ndarray, count: int, axis: int = 0, sizes: Sequence[int] | None = None) -> tuple[np.ndarray, ...]:
    """``count`` pieces along ``axis``: of ``sizes``, or equal sections."""
    n = x.shape[axis]
    sizes = list(sizes) if sizes is not None else [n // count] * count
    starts = np.cumsum([0, *sizes])
    return _pieces(x, axis, [(int(starts[i]), int(starts[i + 1])) for i in range(count)])


def chunk(x: np.ndarray, count: int, axis: int = 0) -> tuple[np.ndarray, ...]:
    """``count`` ``torch.chunk`` pieces along ``axis`` (trailing ones may be smaller or empty)."""
    return _pieces(x, axis, chunk_bounds(x.shape[axis], count))


def _sized_bounds(n: int, size: int) -> list[tuple[int, int]]:
    """Pieces of ``size`` along a dim of ``n``, the last one smaller (one empty piece when ``n`` is 0)."""
    return [(0, 0)] if n == 0 else [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def split_torch(x: np.ndarray, split_size_or_sections: int | Sequence[int], axis: int = 0) -> tuple[np.ndarray, ...]:
    """``torch.split``: pieces of an int size along ``axis`` (the last one smaller), or of each listed size.

    >>> [p.tolist() for p in split_torch(np.arange(5), 2)], [p.tolist() for p in split_torch(np.arange(3), [2, 1])]
    ([[0, 1], [2, 3], [4]], [[0, 1], [2]])
    >>> split_torch(np.arange(3), 3).tolist()  # one piece: the array itself
    [0, 1, 2]
    """
    if isinstance(split_size_or_sections, (list, tuple)):
        starts = np.cumsum([0, *split_size_or_sections])
        bounds = [(int(starts[i]), int(starts[i + 1])) for i in range(len(split_size_or_sections))]
    else:
        bounds = _sized_bounds(x.shape[axis], int(split_size_or_sections))
    return one_or_tuple(_pieces(x, axis, bounds))


def chunk_torch(x: np.ndarray, chunks: int, axis: int = 0, sizes: Sequence[int] | None = None):
    """``torch.chunk``: pieces of ``ceil(n / chunks)`` along ``axis``, the last one smaller (maybe fewer than
    ``chunks`` of them); a rank's piece of a strided axis is cut into its localised ``sizes``.

    >>> [p.tolist() for p in chunk_torch(np.arange(6), 4)]
    [[0, 1], [2, 3], [4, 5]]
    """
    if sizes is not None:
        return split_torch(x, list(sizes), axis)
    n = x.shape[axis]
    return one_or_tuple(_pieces(x, axis, _sized_bounds(n, -(-n // chunks))))


def one_or_tuple(pieces: tuple):
    """The one piece itself, or the tuple of several: a node of one output holds one value, not a tuple
    (``split``, ``chunk`` and ``unbind``, whose output count follows their attrs and shapes)."""
    return pieces[0] if len(pieces) == 1 else pieces


def slice_axis(x: np.ndarray, axis: int = 0, start: int | None = 0, stop: int | None = None) -> np.ndarray:
    """``x[..., start:stop, ...]`` along ``axis``."""
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return x[tuple(index)].copy()


def pad_slice(x: np.ndarray, axis: int = 0, start: int = 0, size: int | None = None) -> np.ndarray:
    """Zeros of length ``size`` along ``axis`` with ``x`` at ``[start, start + len)``: slice's gradient."""
    shape = list(x.shape)
    shape[axis] = size
    out = np.zeros(shape, dtype=x.dtype)
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, start + x.shape[axis])
    out[tuple(index)] = x
    return out


def concat(*xs: np.ndarray, axis: int = 0) -> np.ndarray:
    """Join the operands along ``axis``."""
    return np.concatenate(xs, axis=axis)


def unsqueeze(x: np.ndarray, dim: int) -> np.ndarray:
    """A new size-1 dim at ``dim``."""
    return np.expand_dims(x, dim).copy()


def squeeze(x: np.ndarray, dim: int | Sequence[int] | None = None) -> np.ndarray:
    """Remove the size-1 dims ``dim`` (every size-1 dim when None)."""
    if dim is None:
        return np.squeeze(x).copy()
    dims = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
    return np.squeeze(x, axis=dims).copy()


def sharding_constraint(x: np.ndarray, placements=None, tensor_map=None, pattern=None) -> np.ndarray:
    """``x`` itself: a pinned value's layout is the graph's business, the local piece is unchanged
    (``placements``, ``tensor_map`` and ``pattern`` are the rule's)."""
    return x.copy()


def _variant(fn: Callable, count: int) -> Callable:
    def kernel(x, **attrs):
        return fn(x, count, **attrs)

    kernel.__name__ = f"{fn.__name__}{count}"
    kernel.__doc__ = f"{fn.__name__} into {count} outputs."
    return kernel


KERNELS: dict[str, Callable] = {
    "reshape": reshape,
    "transpose": transpose,
    "slice": slice_axis,
    "pad_slice": pad_slice,
    "concat": concat,
    "unsqueeze": unsqueeze,
    "squeeze": squeeze,
    "sharding_constraint": sharding_constraint,
    "split": split_torch,
    "chunk": chunk_torch,
}
for _count in range(2, 9):
    KERNELS[f"split{_count}"] = _variant(split, _count)
    KERNELS[f"chunk{_count}"] = _variant(chunk, _count)
del _count
