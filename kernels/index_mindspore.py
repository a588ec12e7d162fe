"""MindSpore kernels of the index op family, merged into the mindspore and cann tables.

:mod:`.mindspore_backend` imports this module; import its helpers (``_ms``, ``to_tensor``...)
inside functions, not at the top.

The values move through MindSpore ops (``gather_elements``, ``gather``, ``tensor_scatter_add``,
``tensor_scatter_update``, ``where``, ``equal``); the range check and, for the scatter ops,
the bookkeeping of the integer index (which flat element each entry writes, which entries
fall in the rank's piece, and for ``scatter`` which of several writes to one element is
the last) are computed in numpy on the index with the numpy kernels' helpers, so that
both backends check and order alike: MindSpore's own scatter of duplicate indices has no
defined order, and its index checks differ by device.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .index_numpy import check_range, last_writes, mask_order, nd_last_writes, nd_targets

__all__ = ["KERNELS"]


def _ms_ops():
    from .mindspore_backend import _ms

    return _ms()


def _local(op: str, index, start: int, size: int, dim_size):
    """MindSpore tensors: the rank-local positions of ``index`` (0 where invalid) and the valid mask."""
    from .mindspore_backend import to_numpy, to_tensor

    check_range(op, to_numpy(index), size if dim_size is None else dim_size)
    ms = _ms_ops()
    ops = ms.ops
    local = to_tensor(index).astype(ms.int64) - start
    valid = ops.logical_and(local >= 0, local < size)
    return ops.where(valid, local, ops.zeros_like(local)), valid


def gather(x, index, dim, start=0, dim_size=None):
    from .mindspore_backend import to_tensor

    ops = _ms_ops().ops
    x = to_tensor(x)
    dim = dim % x.ndim
    local, valid = _local("gather", index, start, x.shape[dim], dim_size)
    if x.shape[dim] == 0 or local.size == 0:
        return ops.zeros(tuple(local.shape), x.dtype)
    corner = x[tuple(slice(None) if k == dim else slice(0, n) for k, n in enumerate(local.shape))]
    picked = ops.gather_elements(corner, dim, local)
    return ops.where(valid, picked, ops.zeros_like(picked))


def scatter_src_grad(dy, index, dim, start=0, dim_size=None):
    """MindSpore ``gather`` kernel, then the entries overwritten by a later one (numpy bookkeeping) zeroed."""
    from .mindspore_backend import to_numpy, to_tensor

    ops = _ms_ops().ops
    picked = gather(dy, index, dim, start, dim_size)
    if picked.size == 0:
        return picked
    dim = dim % picked.ndim
    wins = last_writes(to_numpy(index), dim, to_tensor(dy).shape[dim] if dim_size is None else dim_size)
    return ops.where(to_tensor(wins), picked, ops.zeros_like(picked))


def index_select(x, index, dim, start=0, dim_size=None):
    from .mindspore_backend import to_tensor

    ops = _ms_ops().ops
    x = to_tensor(x)
    dim = dim % x.ndim
    local, valid = _local("index_select", index, start, x.shape[dim], dim_size)
    shape = tuple(x.shape[:dim]) + tuple(local.shape) + tuple(x.shape[dim + 1:])
    if x.shape[dim] == 0 or 0 in shape:
        return ops.zeros(shape, x.dtype)
    picked = ops.gather(x, local, dim)
    mask = ops.reshape(valid, (1,) * dim + (-1,) + (1,) * (x.ndim - dim - 1))
    return ops.where(mask, picked, ops.zeros_like(picked))


def _flat_targets(op: str, shape, index: np.ndarray, dim: int, start: int, dim_size, last_only: bool):
    """numpy bookkeeping: the flat element of x each valid index entry writes, and which entries
    (flattened, row-major) those are; with ``last_only`` only the last write to each element."""
    check_range(op, index, shape[dim] if dim_size is None else dim_size)
    local = index.astype(np.int64) - start
    valid = ((local >= 0) & (local < shape[dim])).reshape(-1)
    coords = list(np.indices(index.shape))
    coords[dim] = local
    flat = np.ravel_multi_index(tuple(c.reshape(-1)[valid] for c in coords), shape) if valid.any() else \
        np.zeros(0, np.int64)
    entries = np.flatnonzero(valid)
    if last_only and len(flat):
        _, last = np.unique(flat[::-1], return_index=True)
        keep = np.sort(len(flat) - 1 - last)
        flat, entries = flat[keep], entries[keep]
    return flat, entries


def _scatter_flat(x, flat: np.ndarray, values, add: bool):
    """x with ``values`` written (or added) at the flat element positions ``flat``."""
    from .mindspore_backend import to_tensor

    ms = _ms_ops()
    ops = ms.ops
    x = to_tensor(x)
    if len(flat) == 0:
        return x.copy()
    rows = ops.reshape(x, (-1,))
    where = to_tensor(flat.astype(np.int64).reshape(-1, 1))
    update = ops.tensor_scatter_add if add else ops.tensor_scatter_update
    return ops.reshape(update(rows, where, values.astype(x.dtype)), tuple(x.shape))


def _scatter_elements(op: str, x, index, src, dim, start, dim_size, add: bool):
    from .mindspore_backend import to_numpy, to_tensor

    ops = _ms_ops().ops
    x = to_tensor(x)
    dim = dim % x.ndim
    flat, entries = _flat_targets(op, tuple(x.shape), to_numpy(index), dim, start, dim_size, last_only=not add)
    if len(flat) == 0:
        return x.copy()
    values = ops.gather(ops.reshape(to_tensor(src), (-1,)), to_tensor(entries.astype(np.int64)), 0)
    return _scatter_flat(x, flat, values, add)


def scatter(x, index, src, dim, start=0, dim_size=None):
    return _scatter_elements("scatter", x, index, src, dim, start, dim_size, add=False)


def scatter_add(x, index, src, dim, start=0, dim_size=None):
    return _scatter_elements("scatter_add", x, index, src, dim, start, dim_size, add=True)


def index_add(x, index, src, dim, start=0, dim_size=None):
    """The 1-D index broadcast to src's shape along ``dim``, then a scatter_add of every element."""
    from .mindspore_backend import to_numpy, to_tensor

    x, src = to_tensor(x), to_tensor(src)
    dim = dim % x.ndim
    index = to_numpy(index).astype(np.int64)
    full = np.broadcast_to(index.reshape((1,) * dim + (-1,) + (1,) * (x.ndim - dim - 1)), tuple(src.shape))
    return _scatter_elements("index_add", x, np.ascontiguousarray(full), src, dim, start, dim_size, add=True)


def index_copy(x, index, src, dim, start=0, dim_size=None):
    """The 1-D index broadcast to src's shape along ``dim``, then a scatter (the last duplicate wins)."""
    from .mindspore_backend import to_numpy, to_tensor

    x, src = to_tensor(x), to_tensor(src)
    dim = dim % x.ndim
    index = to_numpy(index).astype(np.int64)
    full = np.broadcast_to(index.reshape((1,) * dim + (-1,) + (1,) * (x.ndim - dim - 1)), tuple(src.shape))
    return _scatter_elements("index_copy", x, np.ascontiguousarray(full), src, dim, start, dim_size, add=False)


def index_copy_src_grad(dy, index, dim, start=0, dim_size=None):
    """MindSpore ``index_select`` kernel, then the slices overwritten by a later index (numpy bookkeeping) zeroed."""
    from .mindspore_backend import to_numpy, to_tensor

    ops = _ms_ops().ops
    dy = to_tensor(dy)
    dim = dim % dy.ndim
    picked = index_select(dy, index, dim, start, dim_size)
    wins = last_writes(to_numpy(index), 0, dy.shape[dim] if dim_size is None else dim_size)
    mask = to_tensor(wins.reshape((1,) * dim + (-1,) + (1,) * (dy.ndim - dim - 1)))
    return ops.where(mask, picked, ops.zeros_like(picked))


def gather_nd(x, indices, starts=None, dim_sizes=None):
    """MindSpore ``gather_nd`` of the rank-local index tuples, zeros for the tuples outside the piece."""
    from .mindspore_backend import to_numpy, to_tensor

    ms = _ms_ops()
    ops = ms.ops
    x = to_tensor(x)
    indices = to_numpy(indices).astype(np.int64)
    k = indices.shape[-1]
    starts = [0] * k if starts is None else list(starts)
    sizes = list(x.shape[:k]) if dim_sizes is None else list(dim_sizes)
    for j in range(k):
        check_range("gather_nd", indices[..., j], sizes[j], f"indices[..., {j}] at")
    local = to_tensor(indices) - to_tensor(np.array(starts, np.int64))
    valid = ops.logical_and(local >= 0, local < to_tensor(np.array(x.shape[:k], np.int64))).all(-1)
    shape = tuple(indices.shape[:-1]) + tuple(x.shape[k:])
    if 0 in shape or 0 in tuple(x.shape[:k]):
        return ops.zeros(shape, x.dtype)
    safe = ops.where(ops.expand_dims(valid, -1), local, ops.zeros_like(local))
    picked = ops.gather_nd(x, safe)
    mask = ops.reshape(valid, tuple(valid.shape) + (1,) * (x.ndim - k))
    return ops.where(mask, picked, ops.zeros_like(picked))


def scatter_nd(x, indices, updates, reduction="none", starts=None, dim_sizes=None, op="scatter_nd"):
    """numpy bookkeeping of the flat elements each update writes, then MindSpore ``tensor_scatter_update/add``."""
    from .mindspore_backend import to_numpy, to_tensor

    ops = _ms_ops().ops
    x = to_tensor(x)
    flat, entries = nd_targets(op, np.zeros(tuple(x.shape), np.bool_), to_numpy(indices), starts, dim_sizes,
                               last_only=reduction != "add")
    if len(flat) == 0:
        return x.copy()
    values = ops.gather(ops.reshape(to_tensor(updates), (-1,)), to_tensor(entries.astype(np.int64)), 0)
    return _scatter_flat(x, flat, values, reduction == "add")


def index_put(x, indices, values, accumulate=False, starts=None, dim_sizes=None):
    return scatter_nd(x, indices, values, "add" if accumulate else "none", starts, dim_sizes, op="index_put")


def scatter_nd_src_grad(dy, indices, starts=None, dim_sizes=None):
    """MindSpore ``gather_nd`` kernel, then the tuples overwritten by a later one (numpy bookkeeping) zeroed."""
    from .mindspore_backend import to_numpy, to_tensor

    ops = _ms_ops().ops
    dy = to_tensor(dy)
    picked = gather_nd(dy, indices, starts, dim_sizes)
    indices = to_numpy(indices)
    k = indices.shape[-1]
    wins = nd_last_writes(indices, tuple(dy.shape[:k]) if dim_sizes is None else dim_sizes)
    mask = to_tensor(wins.reshape(wins.shape + (1,) * (picked.ndim - wins.ndim)))
    return ops.where(mask, picked, ops.zeros_like(picked))


def masked_scatter(x, mask, source, box=None, full_shape=None):
    """numpy bookkeeping of which source element each true place takes, then MindSpore ``gather`` and
    ``tensor_scatter_update``."""
    from .mindspore_backend import to_numpy, to_tensor

    ops = _ms_ops().ops
    x, source = to_tensor(x), to_tensor(source)
    local_mask, order = mask_order("masked_scatter", to_numpy(mask), tuple(x.shape) if full_shape is None else
                                   full_shape, box, int(source.size))
    flat = np.flatnonzero(local_mask)
    if len(flat) == 0:
        return x.copy()
    values = ops.gather(ops.reshape(source, (-1,)), to_tensor(order[local_mask].astype(np.int64)), 0)
    return _scatter_flat(x, flat, values, add=False)


def masked_scatter_src_grad(dy, mask, shape, box=None, full_shape=None):
    """MindSpore ``gather`` of dy at the true places, ``tensor_scatter_update`` into zeros of ``shape``."""
    from .mindspore_backend import to_numpy, to_tensor

    ops = _ms_ops().ops
    dy = to_tensor(dy)
    local_mask, order = mask_order("masked_scatter_src_grad", to_numpy(mask), tuple(dy.shape) if full_shape is None
                                   else full_shape, box)
    zeros = ops.zeros((int(np.prod(shape, dtype=np.int64)),), dy.dtype)
    flat = np.flatnonzero(local_mask)
    if len(flat) == 0:
        return ops.reshape(zeros, tuple(shape))
    values = ops.gather(ops.reshape(dy, (-1,)), to_tensor(flat.astype(np.int64)), 0)
    return ops.reshape(_scatter_flat(zeros, order[local_mask], values, add=False), tuple(shape))


def masked_fill(x, mask, value):
    from .mindspore_backend import to_tensor

    ms = _ms_ops()
    x = to_tensor(x)
    fill = ms.Tensor(np.asarray(value).astype(np.dtype(ms.dtype_to_nptype(x.dtype))))
    return ms.ops.where(to_tensor(mask), fill, x)


def where(condition, x, y):
    from .mindspore_backend import to_tensor

    ms = _ms_ops()
    x, y = to_tensor(x), to_tensor(y)
    dtype = np.result_type(ms.dtype_to_nptype(x.dtype), ms.dtype_to_nptype(y.dtype))
    ms_dtype = ms.Tensor(np.zeros(0, dtype)).dtype
    return ms.ops.where(to_tensor(condition), x.astype(ms_dtype), y.astype(ms_dtype))


def one_hot(indices, num_classes):
    from .mindspore_backend import to_numpy, to_tensor

    ms = _ms_ops()
    check_range("one_hot", to_numpy(indices), num_classes, "indices")
    indices = to_tensor(indices).astype(ms.int64)
    classes = ms.ops.arange(0, num_classes, dtype=ms.int64)
    return ms.ops.equal(ms.ops.expand_dims(indices, -1), classes).astype(ms.int64)


def isin(elements, test_elements):
    from .mindspore_backend import to_tensor

    ms = _ms_ops()
    ops = ms.ops
    elements, test = to_tensor(elements), to_tensor(test_elements)
    if test.size == 0 or elements.size == 0:
        return ops.zeros(tuple(elements.shape), ms.bool_)
    common = np.result_type(ms.dtype_to_nptype(elements.dtype), ms.dtype_to_nptype(test.dtype))
    common = ms.Tensor(np.zeros(0, common)).dtype
    flat = ops.reshape(test, (-1,)).astype(common)
    return ops.equal(ops.expand_dims(elements.astype(common), -1), flat).any(-1)


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
