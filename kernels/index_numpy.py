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

__all__ = ["KERNELS", "check_range", "last_writes", "nd_last_writes", "nd_targets", "mask_order"]


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


def _nd_local(op: str, x: np.ndarray, indices: np.ndarray, starts, dim_sizes):
    """The rank-local index tuples (0 where invalid) of ``indices [..., k]`` and which fall in the rank's piece."""
    indices = np.asarray(indices, dtype=np.int64)
    k = indices.shape[-1]
    starts = [0] * k if starts is None else list(starts)
    sizes = list(x.shape[:k]) if dim_sizes is None else list(dim_sizes)
    valid = np.ones(indices.shape[:-1], bool)
    local = []
    for j in range(k):
        check_range(op, indices[..., j], sizes[j], f"indices[..., {j}] at")
        pos = indices[..., j] - starts[j]
        valid &= (pos >= 0) & (pos < x.shape[j])
        local.append(pos)
    return tuple(np.where(valid, pos, 0) for pos in local), valid


def gather_nd(x, indices, starts=None, dim_sizes=None):
    """``x[indices[b]]`` for the index tuples in the rank's piece, zeros for the others."""
    local, valid = _nd_local("gather_nd", x, indices, starts, dim_sizes)
    k = len(local)
    shape = valid.shape + x.shape[k:]
    if 0 in x.shape[:k]:
        return np.zeros(shape, x.dtype)
    picked = x[local]
    return np.where(valid.reshape(valid.shape + (1,) * (x.ndim - k)), picked, np.zeros((), x.dtype))


def nd_targets(op: str, x: np.ndarray, indices: np.ndarray, starts, dim_sizes, last_only: bool):
    """The flat element positions of x each valid (update element) writes, and which update elements those are."""
    local, valid = _nd_local(op, x, indices, starts, dim_sizes)
    k = len(local)
    trailing = x.shape[k:]
    rows = np.ravel_multi_index(tuple(p[valid] for p in local), x.shape[:k]) if valid.any() else np.zeros(0, np.int64)
    if last_only and len(rows):
        _, last = np.unique(rows[::-1], return_index=True)
        keep = np.zeros(len(rows), bool)
        keep[len(rows) - 1 - last] = True
        chosen = np.flatnonzero(valid)[keep]
        rows = rows[keep]
    else:
        chosen = np.flatnonzero(valid)
    inner = int(np.prod(trailing, dtype=np.int64))
    flat = (rows[:, None] * inner + np.arange(inner)).reshape(-1)
    entries = (chosen[:, None] * inner + np.arange(inner)).reshape(-1)
    return flat, entries


def scatter_nd(x, indices, updates, reduction="none", starts=None, dim_sizes=None, op="scatter_nd"):
    """x with ``updates[b]`` written at (or, reduction add, added to) ``x[indices[b]]`` in the rank's piece."""
    flat, entries = nd_targets(op, x, indices, starts, dim_sizes, last_only=reduction != "add")
    out = np.array(x, order="C", copy=True)
    values = np.asarray(updates, dtype=x.dtype).reshape(-1)[entries]
    if reduction == "add":
        np.add.at(out.reshape(-1), flat, values)
    else:
        out.reshape(-1)[flat] = values
    return out


def index_put(x, indices, values, accumulate=False, starts=None, dim_sizes=None):
    return scatter_nd(x, indices, values, "add" if accumulate else "none", starts, dim_sizes, op="index_put")


def nd_last_writes(indices: np.ndarray, dim_sizes) -> np.ndarray:
    """Whether each index tuple of ``indices [..., k]`` is the last (row-major) to address its element."""
    indices = np.asarray(indices, dtype=np.int64)
    flat = np.ravel_multi_index(tuple(np.moveaxis(indices, -1, 0).reshape(indices.shape[-1], -1)), tuple(dim_sizes))
    out = np.zeros(flat.shape, bool)
    if len(flat):
        _, last = np.unique(flat[::-1], return_index=True)
        out[len(flat) - 1 - last] = True
    return out.reshape(indices.shape[:-1])


def scatter_nd_src_grad(dy, indices, starts=None, dim_sizes=None):
    """``gather_nd(dy, indices)`` where the tuple is the last to address its element, 0 elsewhere."""
    picked = gather_nd(dy, indices, starts, dim_sizes)
    k = np.shape(indices)[-1]
    wins = nd_last_writes(indices, dy.shape[:k] if dim_sizes is None else dim_sizes)
    return np.where(wins.reshape(wins.shape + (1,) * (picked.ndim - wins.ndim)), picked, np.zeros((), picked.dtype))


def mask_order(op: str, mask, full_shape, box, source_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The piece ``box`` of ``mask`` broadcast to ``full_shape``, and for each of its places the number
    of true places before it in the whole mask (row-major): the source element it takes."""
    whole = np.broadcast_to(np.asarray(mask, bool), tuple(full_shape))
    count = int(whole.sum())
    if source_size is not None and count > source_size:
        raise ExecutionError("source-too-small", f"{op}: mask has {count} true places but source only "
                             f"{source_size} elements", hint="give source at least as many elements as the mask "
                                                             "has true places")
    order = (np.cumsum(whole.reshape(-1)) - 1).reshape(whole.shape)
    piece = tuple(slice(a, b) for a, b in (box if box is not None else [(0, n) for n in whole.shape]))
    return whole[piece], order[piece]


def masked_scatter(x, mask, source, box=None, full_shape=None):
    """x with its true places (of the whole mask) filled in row-major order from ``source``."""
    local_mask, order = mask_order("masked_scatter", mask, x.shape if full_shape is None else full_shape, box,
                                   np.size(source))
    out = np.array(x, copy=True)
    out[local_mask] = np.asarray(source, dtype=x.dtype).reshape(-1)[order[local_mask]]
    return out


def masked_scatter_src_grad(dy, mask, shape, box=None, full_shape=None):
    """A ``shape`` gradient of source: dy at the true places of the rank's piece, zeros elsewhere."""
    local_mask, order = mask_order("masked_scatter_src_grad", mask, dy.shape if full_shape is None else full_shape,
                                   box)
    out = np.zeros(int(np.prod(shape, dtype=np.int64)), dy.dtype)
    out[order[local_mask]] = dy[local_mask]
    return out.reshape(tuple(shape))


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
    "scatter_update": index_copy,  # MindSpore's ScatterUpdate: index_copy along dim 0
    "index_copy_src_grad": index_copy_src_grad,
    "gather_nd": gather_nd,
    "scatter_nd": scatter_nd,
    "index_put": index_put,
    "scatter_nd_src_grad": scatter_nd_src_grad,
    "masked_fill": masked_fill,
    "masked_scatter": masked_scatter,
    "masked_scatter_src_grad": masked_scatter_src_grad,
    "where": where,
    "one_hot": one_hot,
    "isin": isin,
}
