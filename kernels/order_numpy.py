"""numpy kernels of the order op family, merged into the numpy table.

One order everywhere (:func:`stable_order`): ties keep the lowest index first, as torch's
stable sort, in both directions, and NaN is greater than every number (torch's order), so
that one device and every rank of a sharded run select exactly the same elements.

Examples
--------
>>> import numpy as np
>>> x = np.array([[3, 1, 3, 2, 3]])
>>> KERNELS["topk"](x, k=2)
(array([[3, 3]]), array([[0, 2]]))
>>> KERNELS["sort"](x, descending=True)[1], KERNELS["argmax"](x, dim=1)
(array([[0, 2, 4, 3, 1]]), array([0]))
>>> KERNELS["cumsum"](np.array([1, 2, 3]), dim=0, exclusive=True, reverse=True)
array([5, 3, 0])
>>> KERNELS["topk_grad"](np.array([[5.0, 7.0]]), np.array([[2, 0]]), dim=1, size=3)
array([[7., 0., 5.]])
"""

from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["KERNELS", "stable_order", "merge_order", "cumsum_dtype", "prod_dtype"]


# ------------------------------------------------------------------------------ the one order
def stable_order(x: np.ndarray, axis: int, descending: bool) -> np.ndarray:
    """The indices that sort ``x`` along ``axis``: ties lowest index first, NaN the greatest.

    >>> stable_order(np.array([1.0, np.nan, 1.0, 2.0]), 0, True)
    array([1, 3, 0, 2])
    >>> stable_order(np.array([1.0, np.nan, 1.0, 2.0]), 0, False)
    array([0, 2, 3, 1])
    """
    if not descending:
        return np.argsort(x, axis=axis, kind="stable")  # numpy sorts NaN last, keeping ties in order
    if x.dtype.kind == "f":
        # primary key: NaN first; then -x ascending (exact: negation does not round)
        return np.lexsort((-x, ~np.isnan(x)), axis=axis)
    return np.argsort(~x, axis=axis, kind="stable")  # ~ reverses the order of every integer type and of bool


def _take(x: np.ndarray, order: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    return np.take_along_axis(x, order, axis=axis), order.astype(np.int64)


def _topk(x, k, dim=-1, largest=True, sorted=True):
    """The k greatest (``largest``) or least elements along ``dim`` and their indices, in order.

    ``sorted=False`` gives the same (sorted) result: torch leaves the order unspecified then.
    """
    order = stable_order(x, dim, largest)
    picked = np.take(order, np.arange(k), axis=dim)
    return _take(x, picked, dim)


def _sort(x, dim=-1, descending=False, stable=False):
    """Values and indices sorted along ``dim``; always stable (a stable sort is a valid unstable one)."""
    return _take(x, stable_order(x, dim, descending), dim)


def _arg(fn: Callable) -> Callable:
    def kernel(x, dim=None, keepdim=False):
        return np.asarray(fn(x, axis=dim, keepdims=bool(keepdim))).astype(np.int64)

    kernel.__name__ = fn.__name__
    return kernel


def cumsum_dtype(dtype) -> np.dtype:
    """Integers and bools accumulate in int64 (torch's cumsum and prod); floats in themselves."""
    dtype = np.dtype(dtype)
    return dtype if dtype.kind in "fc" else np.dtype(np.int64)


prod_dtype = cumsum_dtype


def _cumsum(x, dim, exclusive=False, reverse=False):
    """The running sum along ``dim``; ``exclusive`` leaves each element out of its own sum,
    ``reverse`` runs from the end (MindSpore ``CumSum``'s attrs)."""
    x = np.asarray(x).astype(cumsum_dtype(x.dtype), copy=False)
    if reverse:
        x = np.flip(x, axis=dim)
    out = np.cumsum(x, axis=dim)
    if exclusive:
        out = np.concatenate([np.zeros_like(np.take(out, [0], axis=dim)), np.take(out, np.arange(
            out.shape[dim] - 1), axis=dim)], axis=dim) if out.shape[dim] else out
    return np.ascontiguousarray(np.flip(out, axis=dim)) if reverse else out


def _prod(x, dims=None, keepdim=False):
    axes = None if dims is None else (dims,) if isinstance(dims, (int, np.integer)) else tuple(dims)
    return np.asarray(np.prod(x, axis=axes, keepdims=bool(keepdim), dtype=prod_dtype(x.dtype)))


# ------------------------------------------------------------------------------ top-k along a sharded dim
def merge_order(values: np.ndarray, indices: np.ndarray, axis: int, descending: bool) -> np.ndarray:
    """The order of top-k candidates along ``axis``: padding (index < 0) last, then the one order
    of the values (NaN the greatest), ties by the lowest index; the order topk gives the elements.

    >>> merge_order(np.array([2.0, 3.0, 0.0, 3.0]), np.array([4, 7, -1, 1]), 0, True)
    array([3, 1, 0, 2])
    """
    pad = indices < 0
    if values.dtype.kind == "f":
        nan = np.isnan(values)
        clean = np.where(nan, 0, values)
        keys = (indices, -clean, ~nan) if descending else (indices, clean, nan)
    else:
        keys = (indices, ~values if descending else values)
    return np.lexsort(keys + (pad,), axis=axis)


def _topk_candidates(x, k, dim=-1, largest=True, chunks=1, start=0):
    """The top ``k`` of each of the ``chunks`` ``torch.chunk`` pieces of ``dim``, concatenated: values and
    global int64 indices (``start`` + the position in x); a piece shorter than k is padded with zeros at
    index -1.  A rank holding one piece gets ``chunks=1`` and its piece's first global index as ``start``."""
    from layout_prop.core.spec import chunk_bounds

    x = np.asarray(x)
    dim = dim % x.ndim
    values, indices = [], []
    for lo, hi in chunk_bounds(x.shape[dim], int(chunks)):
        piece = np.take(x, np.arange(lo, hi), axis=dim)
        take = min(int(k), hi - lo)
        v, i = _topk(piece, take, dim, largest)
        pad_shape = list(x.shape)
        pad_shape[dim] = int(k) - take
        values += [v, np.zeros(pad_shape, x.dtype)]
        indices += [i + (int(start) + lo), np.full(pad_shape, -1, np.int64)]
    return np.concatenate(values, axis=dim), np.concatenate(indices, axis=dim)


def _topk_merge(values, indices, k, dim=-1, largest=True):
    """The top ``k`` of the candidates (padding never chosen while k <= the real candidates)."""
    order = np.take(merge_order(values, indices, dim, largest), np.arange(int(k)), axis=dim)
    return np.take_along_axis(values, order, axis=dim), np.take_along_axis(indices, order, axis=dim)


def _topk_merge_grad(dv, values, indices, k, dim=-1, largest=True):
    """The cotangent of the candidate values: ``dv`` at the positions the merge chose."""
    order = np.take(merge_order(values, indices, dim, largest), np.arange(int(k)), axis=dim)
    return _topk_grad(dv, order, dim, values.shape[dim])


# ------------------------------------------------------------------------------ cumsum along a sharded dim
def _pieces(x: np.ndarray, dim: int, chunks: int, size: int | None = None):
    """The ``torch.chunk`` bounds of ``dim`` (or of ``size``) in ``chunks`` pieces."""
    from layout_prop.core.spec import chunk_bounds

    return chunk_bounds(x.shape[dim] if size is None else int(size), int(chunks))


def _chunk_sum(x, dim, chunks):
    """The sum of each ``torch.chunk`` piece of ``dim``: ``chunks`` along dim (int64 for integers)."""
    x = np.asarray(x)
    dim = dim % x.ndim
    dtype = cumsum_dtype(x.dtype)
    return np.concatenate([np.sum(np.take(x, np.arange(lo, hi), axis=dim), axis=dim, keepdims=True, dtype=dtype)
                           for lo, hi in _pieces(x, dim, chunks)], axis=dim)


def _chunk_sum_grad(dt, dim, size, chunks):
    """``dt``'s c-th element along dim repeated over the c-th piece of ``size``."""
    dt = np.asarray(dt)
    dim = dim % dt.ndim
    lengths = [hi - lo for lo, hi in _pieces(dt, dim, chunks, size)]
    return np.repeat(dt, lengths, axis=dim)


def _chunk_cumsum(x, offsets=None, dim=0, chunks=1, exclusive=False, reverse=False):
    """The cumsum of each piece of ``dim`` on its own, plus ``offsets``' c-th element on piece c."""
    x = np.asarray(x)
    dim = dim % x.ndim
    out = []
    for c, (lo, hi) in enumerate(_pieces(x, dim, chunks)):
        scan = _cumsum(np.take(x, np.arange(lo, hi), axis=dim), dim, exclusive, reverse)
        if offsets is not None:
            scan = scan + np.take(offsets, [c], axis=dim).astype(scan.dtype, copy=False)
        out.append(scan)
    return np.concatenate(out, axis=dim).astype(cumsum_dtype(x.dtype), copy=False)


# ------------------------------------------------------------------------------ gradients
def _topk_grad(dv, indices, dim, size, start=0):
    """``dx`` of shape ``dv``'s with ``size`` along ``dim``: ``dv`` scatter-added at ``indices - start``.

    Indices outside ``[start, start + size)`` are left out (a rank keeps its own range);
    repeated indices add up.
    """
    dv = np.asarray(dv)
    dim = dim % dv.ndim
    dvm = np.moveaxis(dv, dim, -1)
    size = int(size)
    rows = int(np.prod(dvm.shape[:-1], dtype=np.int64))
    idx = np.moveaxis(np.asarray(indices), dim, -1).astype(np.int64).reshape(rows, dvm.shape[-1]) - int(start)
    row = np.broadcast_to(np.arange(rows).reshape(-1, 1), idx.shape)
    keep = (idx >= 0) & (idx < size)
    out = np.zeros((rows, size), dtype=dv.dtype)
    np.add.at(out, (row[keep], idx[keep]), dvm.reshape(idx.shape)[keep])
    return np.moveaxis(out.reshape(dvm.shape[:-1] + (size,)), -1, dim)


def _maximum_grad(dy, x, y, minimum=False):
    """``(dx, dy_)`` in the broadcast shape: the cotangent goes to the operand that won, half to each on a tie
    (torch's rule)."""
    wins = np.less(x, y) if minimum else np.greater(x, y)
    tie = np.equal(x, y)
    shape = np.broadcast_shapes(np.shape(dy), np.shape(x), np.shape(y))
    dy = np.broadcast_to(dy, shape)
    half = dy / np.asarray(2, dtype=dy.dtype)
    zero = np.zeros((), dtype=dy.dtype)
    dx = np.where(wins, dy, np.where(tie, half, zero))
    dother = np.where(wins, zero, np.where(tie, half, dy))
    return np.ascontiguousarray(dx.astype(dy.dtype, copy=False)), np.ascontiguousarray(
        dother.astype(dy.dtype, copy=False))


def _prod_grad(dy, x, dims, keepdim=False):
    """``dx = dy * (product of the other elements of x's reduced slice)``, zeros included (no division)."""
    x = np.asarray(x)
    dims = tuple(d % x.ndim for d in dims)
    kept = tuple(d for d in range(x.ndim) if d not in dims)
    moved = np.transpose(x, kept + dims)
    lead = moved.shape[:len(kept)]
    m = int(np.prod([x.shape[d] for d in dims], dtype=np.int64))
    flat = moved.reshape(lead + (m,))
    ones = np.ones(lead + (1,), dtype=x.dtype)
    before = np.concatenate([ones, np.cumprod(flat, axis=-1)], axis=-1)[..., :m]
    after = np.flip(np.concatenate([ones, np.cumprod(np.flip(flat, -1), axis=-1)], axis=-1)[..., :m], -1)
    dyk = np.asarray(dy).reshape(lead + (1,))
    grad = (dyk * (before * after)).astype(np.result_type(dy, x), copy=False)
    grad = grad.reshape(moved.shape)
    return np.ascontiguousarray(np.transpose(grad, np.argsort(kept + dims)))


def _topk_candidates_grad(dc, indices, dim, size, chunks=1, start=0):
    """The candidates' cotangent scatter-added at their global indices, block by block: the ``c``-th
    block of candidates (``k`` along dim) only into the ``c``-th ``torch.chunk`` piece of ``size``
    (offset by ``start``), other indices (padding, -1) left out.  So a rank holding one block and
    its piece (``chunks=1``, its piece's ``start`` and ``size``) computes its part of the whole.
    """
    from layout_prop.core.spec import chunk_bounds

    dc = np.asarray(dc)
    dim = dim % dc.ndim
    k = dc.shape[dim] // int(chunks)
    pieces = []
    for c, (lo, hi) in enumerate(chunk_bounds(int(size), int(chunks))):
        block = np.arange(c * k, (c + 1) * k)
        pieces.append(_topk_grad(np.take(dc, block, axis=dim), np.take(indices, block, axis=dim), dim, hi - lo,
                                 int(start) + lo))
    return np.concatenate(pieces, axis=dim)


def _argmax_with_value(x, axis=0, keep_dims=False):
    """MindSpore's ArgMaxWithValue: the argmax along ``axis`` and the element it points at."""
    x = np.asarray(x)
    index = np.argmax(x, axis=axis, keepdims=True).astype(np.int64)
    value = np.take_along_axis(x, index, axis=axis)
    if not keep_dims:
        index, value = np.squeeze(index, axis=axis), np.squeeze(value, axis=axis)
    return index, value


KERNELS: dict[str, Callable] = {
    "topk": _topk,
    "sort": _sort,
    "argmax": _arg(np.argmax),
    "argmin": _arg(np.argmin),
    "argmax_with_value": _argmax_with_value,
    "cumsum": _cumsum,
    "prod": _prod,
    "maximum": np.maximum,
    "minimum": np.minimum,
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
