"""numpy kernels of the index op family, merged into the numpy table.

A rank whose x is a piece of the indexed (or scattered) dim gets the localised attrs
``start`` (the piece's first global index) and ``dim_size`` (the global size): it looks
up, or writes, only the indices in ``[start, start + local size)``, and checks every
index against the global range, so an index out of range is the same
``index-out-of-range`` error on one device and on every rank.

Examples
--------
>>> import numpy as np
>>> x = np.arange(6.0).reshape(2, 3)
>>> KERNELS["gather"](x, np.array([[2, 0], [1, 1]]), dim=1)
array([[2., 0.],
       [4., 4.]])
>>> KERNELS["gather"](x[:, 2:], np.array([[2, 0], [1, 1]]), dim=1, start=2, dim_size=3)
array([[2., 0.],
       [0., 0.]])
>>> KERNELS["scatter"](np.zeros(4), np.array([1, 1]), np.array([5.0, 7.0]), dim=0)
array([0., 7., 0., 0.])
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from layout_prop.core.errors import ExecutionError

__all__ = ["KERNELS", "check_range", "last_writes"]


def check_range(op: str, index: np.ndarray, size: int, what: str = "index") -> None:
    """``index-out-of-range`` unless every entry of ``index`` lies in ``[0, size)``."""
    index = np.asarray(index)
    bad = (index < 0) | (index >= size)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ExecutionError("index-out-of-range", f"{op}: {what} {list(where)} is {int(index[where])}, outside "
                             f"[0, {size})", hint=f"give {op} indices in [0, {size})")


def _local(op: str, index: np.ndarray, start: int, size: int, dim_size: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The rank-local positions of ``index`` (0 where invalid) and which fall in ``[start, start + size)``."""
    check_range(op, index, size if dim_size is None else dim_size)
    local = np.asarray(index, dtype=np.int64) - start
    valid = (local >= 0) & (local < size)
    return np.where(valid, local, 0), valid


def _corner(x: np.ndarray, shape, dim: int) -> np.ndarray:
    """x cut to ``shape`` in every dim but ``dim``."""
    return x[tuple(slice(None) if k == dim else slice(0, n) for k, n in enumerate(shape))]


def gather(x, index, dim, start=0, dim_size=None):
    """torch.gather of the indices in ``[start, start + x.shape[dim])``, zeros for the others."""
    dim = dim % x.ndim
    local, valid = _local("gather", index, start, x.shape[dim], dim_size)
    if x.shape[dim] == 0:
        return np.zeros(np.shape(index), x.dtype)
    picked = np.take_along_axis(_corner(x, np.shape(index), dim), local, axis=dim)
    return np.where(valid, picked, np.zeros((), x.dtype))


def last_writes(index: np.ndarray, dim: int, dim_size: int) -> np.ndarray:
    """Whether each entry of ``index`` is the last (row-major) to write its element along ``dim``
    (``dim_size``: the global size of that dim)."""
    coords = list(np.indices(index.shape))
    coords[dim] = np.asarray(index, dtype=np.int64)
    shape = index.shape[:dim] + (dim_size,) + index.shape[dim + 1:]
    flat = np.ravel_multi_index(tuple(c.reshape(-1) for c in coords), shape)
    _, last = np.unique(flat[::-1], return_index=True)
    out = np.zeros(flat.shape, bool)
    out[len(flat) - 1 - last] = True
    return out.reshape(index.shape)


def scatter_src_grad(dy, index, dim, start=0, dim_size=None):
    """``gather(dy, index, dim)`` where the entry is the last write to its element, 0 elsewhere."""
    dim = dim % dy.ndim
    picked = gather(dy, index, dim, start, dim_size)
    if picked.size == 0:
        return picked
    wins = last_writes(index, dim, dy.shape[dim] if dim_size is None else dim_size)
    return np.where(wins, picked, np.zeros((), picked.dtype))


def index_select(x, index, dim, start=0, dim_size=None):
    """x's slices at ``index`` along ``dim`` for the indices in the rank's piece, zeros for the others."""
    dim = dim % x.ndim
    local, valid = _local("index_select", index, start, x.shape[dim], dim_size)
    if x.shape[dim] == 0:
        return np.zeros(x.shape[:dim] + np.shape(index) + x.shape[dim + 1:], x.dtype)
    picked = np.take(x, local, axis=dim)
    mask = valid.reshape((1,) * dim + (-1,) + (1,) * (x.ndim - dim - 1))
    return np.where(mask, picked, np.zeros((), x.dtype))


def _targets(op: str, x: np.ndarray, index: np.ndarray, dim: int, start: int, dim_size):
    """The element coordinates in x that ``index`` writes to along ``dim`` (row-major order), and
    which entries of index (flattened) fall in the rank's piece."""
    local, valid = _local(op, index, start, x.shape[dim], dim_size)
    coords = list(np.indices(np.shape(index), sparse=False))
    coords[dim] = local
    valid = valid.reshape(-1)
    return tuple(c.reshape(-1)[valid] for c in coords), valid


def scatter(x, index, src, dim, start=0, dim_size=None, op="scatter"):
    """x with ``src`` written at ``index`` along ``dim``; of duplicate targets the last (row-major) wins."""
    dim = dim % x.ndim
    coords, valid = _targets(op, x, index, dim, start, dim_size)
    out = np.array(x, order="C", copy=True)
    if not valid.any():
        return out
    flat = np.ravel_multi_index(coords, x.shape)
    values = np.asarray(src).reshape(-1)[valid]
    _, last = np.unique(flat[::-1], return_index=True)  # the last write to each target
    keep = len(flat) - 1 - last
    out.reshape(-1)[flat[keep]] = values[keep]
    return out


def scatter_add(x, index, src, dim, start=0, dim_size=None):
    """x with ``src`` added at ``index`` along ``dim`` (duplicates add up)."""
    dim = dim % x.ndim
    coords, valid = _targets("scatter_add", x, index, dim, start, dim_size)
    out = np.array(x, order="C", copy=True)
    np.add.at(out, coords, np.asarray(src, dtype=x.dtype).reshape(-1)[valid])
    return out


def index_add(x, index, src, dim, start=0, dim_size=None):
    """x with the slices of ``src`` added at the 1-D ``index`` along ``dim``."""
    dim = dim % x.ndim
    local, valid = _local("index_add", index, start, x.shape[dim], dim_size)
    out = np.array(x, order="C", copy=True)
    picked = np.compress(valid, np.asarray(src, dtype=x.dtype), axis=dim)
    np.add.at(out, (slice(None),) * dim + (local[valid],), picked)
    return out


def _along(index, dim: int, shape) -> np.ndarray:
    """The 1-D ``index`` broadcast to ``shape`` along ``dim``."""
    index = np.asarray(index)
    return np.broadcast_to(index.reshape((1,) * dim + (-1,) + (1,) * (len(shape) - dim - 1)), shape)


def index_copy(x, index, src, dim, start=0, dim_size=None):
    """x with the slices of ``src`` written at the 1-D ``index`` along ``dim`` (the last duplicate wins)."""
    dim = dim % x.ndim
    return scatter(x, _along(index, dim, np.shape(src)), src, dim, start, dim_size, op="index_copy")


def index_copy_src_grad(dy, index, dim, start=0, dim_size=None):
    """``index_select(dy, index, dim)`` where the index is the last occurrence of its value, 0 elsewhere."""
    dim = dim % dy.ndim
    picked = index_select(dy, index, dim, start, dim_size)
    wins = last_writes(np.asarray(index), 0, dy.shape[dim] if dim_size is None else dim_size)
    return np.where(_along(wins, dim, picked.shape), picked, np.zeros((), picked.dtype))


def masked_fill(x, mask, value):
    return np.where(mask, np.asarray(value).astype(x.dtype), x)


def where(condition, x, y):
    return np.where(condition, x, y)


def one_hot(indices, num_classes):
    check_range("one_hot", indices, num_classes, "indices")
    return (np.asarray(indices)[..., None] == np.arange(num_classes)).astype(np.int64)


def isin(elements, test_elements):
    return np.isin(elements, test_elements)


KERNELS: dict[str, Callable] = {
    "gather": gather,
    "scatter_src_grad": scatter_src_grad,
    "index_select": index_select,
    "scatter": scatter,
    "scatter_add": scatter_add,
    "index_add": index_add,
    "index_copy": index_copy,
    "index_copy_src_grad": index_copy_src_grad,
    "masked_fill": masked_fill,
    "where": where,
    "one_hot": one_hot,
    "isin": isin,
}
