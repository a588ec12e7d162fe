"""MindSpore kernels of the order op family, merged into the mindspore and cann tables.

:mod:`.mindspore_backend` imports this module; import its helpers (``_ms``, ``to_tensor``...)
inside functions, not at the top.

The order is the numpy kernels' (:func:`layout_prop.kernels.order_numpy.stable_order`): ties
lowest index first.  topk is built on ``ops.sort``, which kept ties in index order in both
directions on MindSpore 2.10 CPU for every dtype and size tried (up to 5,000 elements of
four distinct values); ``ops.topk`` does not (it returned ties in another order).
Bools are compared as int32 (MindSpore's CPU sort, argmin and cumsum take no bool).  MindSpore's
CPU sort leaves a row holding NaN unsorted: NaN is ordered by a second stable sort (:func:`_argsort`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["KERNELS"]


def _backend():
    from . import mindspore_backend

    return mindspore_backend


def _comparable(x):
    """x, with bools as int32 (the order of False < True kept)."""
    ms = _backend()._ms()
    return x.astype(ms.int32) if x.dtype == ms.bool_ else x


def _argsort(x, dim, descending):
    """int64 indices that sort x along ``dim`` stably, NaN the greatest (order_numpy.stable_order).

    MindSpore's CPU sort leaves rows holding NaN unsorted, so NaN is sorted by a second stable
    sort of the NaN flags, after a sort of the values with NaN read as 0."""
    b = _backend()
    ms = b._ms()
    ops = ms.ops
    x = _comparable(b.to_tensor(x))
    dim = dim % x.ndim
    if x.dtype not in (ms.float16, ms.float32, ms.float64):
        return ops.sort(x, axis=dim, descending=bool(descending))[1].astype(ms.int64)
    nan = ops.isnan(x)
    clean = ops.where(nan, ops.zeros_like(x), x)
    order = ops.sort(clean, axis=dim, descending=bool(descending))[1].astype(ms.int64)
    flags = ops.gather_elements(nan.astype(ms.int32), dim, order)
    by_flag = ops.sort(flags, axis=dim, descending=bool(descending))[1].astype(ms.int64)
    return ops.gather_elements(order, dim, by_flag)


def _sorted(x, dim, descending):
    """``(values, int64 indices)`` of x sorted along ``dim``, ties lowest index first."""
    b = _backend()
    x = b.to_tensor(x)
    order = _argsort(x, dim, descending)
    return b._ms().ops.gather_elements(x, dim % x.ndim, order), order


def _topk(x, k, dim=-1, largest=True, sorted=True):
    values, order = _sorted(x, dim, largest)
    return tuple(_backend()._take(t, dim % t.ndim, 0, int(k)) for t in (values, order))


def _sort(x, dim=-1, descending=False, stable=False):
    return _sorted(x, dim, descending)


def _arg(name: str) -> Callable:
    """argmax / argmin: the first extreme element; a NaN wins (numpy's and torch's answer), which
    MindSpore's CPU kernels ignore, so the first NaN is found as the argmax of the NaN flags."""
    def kernel(x, dim=None, keepdim=False):
        b = _backend()
        ms = b._ms()
        ops = ms.ops
        x = _comparable(b.to_tensor(x))
        flat = dim is None
        values, axis, keep = (x.reshape(-1), 0, False) if flat else (x, dim, bool(keepdim))
        out = getattr(ops, name)(values, axis, keep).astype(ms.int64)
        if values.dtype in (ms.float16, ms.float32, ms.float64):
            nan = ops.isnan(values)
            first_nan = ops.argmax(nan.astype(ms.int32), axis, keep).astype(ms.int64)
            out = ops.where(ops.any(nan, axis, keep), first_nan, out)
        return out.reshape((1,) * x.ndim if keepdim else ()) if flat else out

    kernel.__name__ = name
    return kernel


def _accumulating(x):
    """x in the dtype cumsum and prod accumulate in: floats as they are, integers and bools int64."""
    b = _backend()
    ms = b._ms()
    x = b.to_tensor(x)
    return x if x.dtype in (ms.float16, ms.float32, ms.float64) else x.astype(ms.int64)


def _cumsum(x, dim, exclusive=False, reverse=False):
    b = _backend()
    ops = b._ms().ops
    x = _accumulating(x)
    dim = dim % x.ndim
    if reverse:
        x = ops.flip(x, (dim,))
    out = ops.cumsum(x, dim)
    if exclusive and x.shape[dim]:
        zero = ops.zeros_like(b._take(out, dim, 0, 1))
        out = ops.cat((zero, b._take(out, dim, 0, x.shape[dim] - 1)), dim)
    return ops.flip(out, (dim,)) if reverse else out


def _prod(x, dims=None, keepdim=False):
    b = _backend()
    ops = b._ms().ops
    x = _accumulating(x)
    dims = (dims,) if isinstance(dims, int) else dims
    axes = tuple(range(x.ndim)) if dims is None else tuple(d % x.ndim for d in dims)
    if not axes:
        return x.copy()
    return ops.prod(x, axes, bool(keepdim))


def _maximum(x, y):
    b = _backend()
    return b._ms().ops.maximum(b.to_tensor(x), b.to_tensor(y))


def _minimum(x, y):
    b = _backend()
    return b._ms().ops.minimum(b.to_tensor(x), b.to_tensor(y))


def _topk_grad(dv, indices, dim, size, start=0):
    """dv scatter-added at ``indices - start``: a one-hot comparison summed over the k picked
    elements (no scatter kernel; out-of-range indices match no position)."""
    b = _backend()
    ms = b._ms()
    ops = ms.ops
    dv, indices = b.to_tensor(dv), b.to_tensor(indices).astype(ms.int64)
    dim = dim % dv.ndim
    dvm = ops.movedim(dv, dim, -1)
    idx = ops.movedim(indices, dim, -1) - int(start)
    positions = ops.arange(int(size), dtype=ms.int64)
    hits = ops.expand_dims(idx, -1) == positions  # (..., k, size)
    picked = ops.expand_dims(dvm, -1) * hits.astype(dv.dtype)
    out = ops.sum(picked, -2) if dvm.shape[-1] else ops.zeros(tuple(dvm.shape[:-1]) + (int(size),), dv.dtype)
    return ops.movedim(out, -1, dim)


def _maximum_grad(dy, x, y, minimum=False):
    b = _backend()
    ms = b._ms()
    ops = ms.ops
    dy, x, y = b.to_tensor(dy), b.to_tensor(x), b.to_tensor(y)
    shape = np.broadcast_shapes(tuple(dy.shape), tuple(x.shape), tuple(y.shape))
    wins = ops.less(x, y) if minimum else ops.greater(x, y)
    tie = ops.equal(x, y)
    dy = ops.broadcast_to(dy, shape)
    half = dy / 2
    zero = ops.zeros_like(dy)
    wins, tie = ops.broadcast_to(wins, dy.shape), ops.broadcast_to(tie, dy.shape)
    dx = ops.where(wins, dy, ops.where(tie, half, zero))
    dother = ops.where(wins, zero, ops.where(tie, half, dy))
    return dx, dother


def _prod_grad(dy, x, dims, keepdim=False):
    """dy times the product of the other elements of each reduced slice (prefix and suffix products)."""
    b = _backend()
    ms = b._ms()
    ops = ms.ops
    dy, x = b.to_tensor(dy), b.to_tensor(x)
    dims = tuple(d % x.ndim for d in dims)
    kept = tuple(d for d in range(x.ndim) if d not in dims)
    perm = kept + dims
    moved = ops.permute(x, perm)
    lead = tuple(moved.shape[:len(kept)])
    m = int(np.prod([x.shape[d] for d in dims], dtype=np.int64))
    flat = moved.reshape(lead + (m,))
    last = flat.ndim - 1
    ones = ops.ones(lead + (1,), flat.dtype)
    before = b._take(ops.cat((ones, ops.cumprod(flat, last)), last), last, 0, m)
    rev = ops.flip(flat, (last,))
    after = ops.flip(b._take(ops.cat((ones, ops.cumprod(rev, last)), last), last, 0, m), (last,))
    grad = dy.reshape(lead + (1,)) * (before * after)
    inverse = tuple(sorted(range(len(perm)), key=lambda i: perm[i]))
    return ops.permute(grad.reshape(tuple(moved.shape)), inverse)


def _topk_candidates(x, k, dim=-1, largest=True, chunks=1, start=0):
    """The top k of each torch.chunk piece of dim, padded to k with zeros at index -1 (order_numpy's)."""
    from layout_prop.core.spec import chunk_bounds

    b = _backend()
    ms = b._ms()
    ops = ms.ops
    x = b.to_tensor(x)
    dim = dim % x.ndim
    values, indices = [], []
    for lo, hi in chunk_bounds(x.shape[dim], int(chunks)):
        v, i = _topk(b._take(x, dim, lo, hi), min(int(k), hi - lo), dim, largest)
        pad = list(x.shape)
        pad[dim] = int(k) - v.shape[dim]
        values += [v, ops.zeros(tuple(pad), x.dtype)]
        indices += [i + (int(start) + lo), ops.full(tuple(pad), -1, dtype=ms.int64)]
    return ops.cat(tuple(values), dim), ops.cat(tuple(indices), dim)


def _merge_order(values, indices, dim, largest):
    """order_numpy.merge_order by stable sorts (index, then value, then padding last), which is a
    lexicographic sort; values compared as :func:`_argsort` compares them."""
    b = _backend()
    ms = b._ms()
    ops = ms.ops
    values, indices = b.to_tensor(values), b.to_tensor(indices)
    _, by_index = ops.sort(indices, axis=dim)
    by_index = by_index.astype(ms.int64)
    by_value = _argsort(ops.gather_elements(values, dim, by_index), dim, largest)
    order = ops.gather_elements(by_index, dim, by_value)
    pad = (ops.gather_elements(indices, dim, order) < 0).astype(ms.int32)
    _, by_pad = ops.sort(pad, axis=dim)
    return ops.gather_elements(order, dim, by_pad.astype(ms.int64))


def _topk_merge(values, indices, k, dim=-1, largest=True):
    b = _backend()
    ops = b._ms().ops
    values, indices = b.to_tensor(values), b.to_tensor(indices)
    dim = dim % values.ndim
    order = b._take(_merge_order(values, indices, dim, largest), dim, 0, int(k))
    return ops.gather_elements(values, dim, order), ops.gather_elements(indices, dim, order)


def _topk_merge_grad(dv, values, indices, k, dim=-1, largest=True):
    b = _backend()
    values = b.to_tensor(values)
    dim = dim % values.ndim
    order = b._take(_merge_order(values, indices, dim, largest), dim, 0, int(k))
    return _topk_grad(dv, order, dim, values.shape[dim])


def _topk_candidates_grad(dc, indices, dim, size, chunks=1, start=0):
    """Block c of the candidates into piece c of ``size`` (order_numpy's ``_topk_candidates_grad``)."""
    from layout_prop.core.spec import chunk_bounds

    b = _backend()
    dc, indices = b.to_tensor(dc), b.to_tensor(indices)
    dim = dim % dc.ndim
    k = dc.shape[dim] // int(chunks)
    pieces = [_topk_grad(b._take(dc, dim, c * k, (c + 1) * k), b._take(indices, dim, c * k, (c + 1) * k), dim,
                         hi - lo, int(start) + lo)
              for c, (lo, hi) in enumerate(chunk_bounds(int(size), int(chunks)))]
    return b._ms().ops.cat(tuple(pieces), dim)


def _cat_pieces(pieces, shape, dim, dtype):
    """Concatenate the non-empty pieces along dim (zeros of ``shape`` when every piece is empty)."""
    ops = _backend()._ms().ops
    pieces = [p for p in pieces if p.shape[dim]]
    return ops.cat(tuple(pieces), dim) if pieces else ops.zeros(tuple(shape), dtype)


def _chunk_sum(x, dim, chunks):
    from layout_prop.core.spec import chunk_bounds

    b = _backend()
    ops = b._ms().ops
    x = _accumulating(x)
    dim = dim % x.ndim
    one = tuple(1 if d == dim else n for d, n in enumerate(x.shape))
    sums = [ops.sum(b._take(x, dim, lo, hi), dim, keepdim=True) if hi > lo else ops.zeros(one, x.dtype)
            for lo, hi in chunk_bounds(x.shape[dim], int(chunks))]
    return ops.cat(tuple(sums), dim)


def _chunk_sum_grad(dt, dim, size, chunks):
    from layout_prop.core.spec import chunk_bounds

    b = _backend()
    ops = b._ms().ops
    dt = b.to_tensor(dt)
    dim = dim % dt.ndim
    shape = list(dt.shape)
    pieces = []
    for c, (lo, hi) in enumerate(chunk_bounds(int(size), int(chunks))):
        shape[dim] = hi - lo
        if hi > lo:
            pieces.append(ops.broadcast_to(b._take(dt, dim, c, c + 1), tuple(shape)))
    shape[dim] = int(size)
    return _cat_pieces(pieces, shape, dim, dt.dtype)


def _chunk_cumsum(x, offsets=None, dim=0, chunks=1, exclusive=False, reverse=False):
    from layout_prop.core.spec import chunk_bounds

    b = _backend()
    x = _accumulating(x)
    dim = dim % x.ndim
    pieces = []
    for c, (lo, hi) in enumerate(chunk_bounds(x.shape[dim], int(chunks))):
        if hi == lo:
            continue
        scan = _cumsum(b._take(x, dim, lo, hi), dim, exclusive, reverse)
        if offsets is not None:
            scan = scan + b._take(b.to_tensor(offsets), dim, c, c + 1).astype(scan.dtype)
        pieces.append(scan)
    return _cat_pieces(pieces, x.shape, dim, x.dtype)


def _argmax_with_value(x, axis=0, keep_dims=False):
    """MindSpore's ArgMaxWithValue, with argmax's NaN rule: the index and the element it points at."""
    b = _backend()
    ops = b._ms().ops
    x = b.to_tensor(x)
    index = _arg("argmax")(x, axis, True)
    value = ops.gather_elements(x, axis % x.ndim, index)
    if not keep_dims:
        index, value = ops.squeeze(index, axis % x.ndim), ops.squeeze(value, axis % x.ndim)
    return index, value


KERNELS: dict[str, Callable] = {
    "topk": _topk,
    "sort": _sort,
    "argmax": _arg("argmax"),
    "argmin": _arg("argmin"),
    "argmax_with_value": _argmax_with_value,
    "cumsum": _cumsum,
    "prod": _prod,
    "maximum": _maximum,
    "minimum": _minimum,
    "topk_grad": _topk_grad,
    "maximum_grad": _maximum_grad,
    "prod_grad": _prod_grad,
    "topk_candidates": _topk_candidates,
    "topk_merge": _topk_merge,
    "topk_merge_grad": _topk_merge_grad,
    "topk_candidates_grad": _topk_candidates_grad,
    "chunk_sum": _chunk_sum,
    "chunk_sum_grad": _chunk_sum_grad,
    "chunk_cumsum": _chunk_cumsum,
}
