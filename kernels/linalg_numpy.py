"""numpy kernels of the linalg op family (forward and backward), merged into the numpy table.

The same functions run the single-device reference (global arrays, the op's attrs) and
every simulated rank (local arrays, the attrs the rule's ``localize`` gives: ``add_bias``
for ``linear``, ``vocab_start`` / ``num_embeddings`` for the embedding ops, ``count`` for
``mean``, the local ``shape`` for ``sum_grad``).

Examples
--------
>>> import numpy as np
>>> einsum(np.ones((2, 3)), np.ones((3, 4)), equation="mk,kn->mn").tolist()[0]
[3.0, 3.0, 3.0, 3.0]
>>> embedding(np.array([0, 3, 1]), np.arange(6.0).reshape(3, 2)).tolist()
[[0.0, 1.0], [0.0, 0.0], [2.0, 3.0]]
>>> reduce_mean(np.array([[1.0, 2.0], [3.0, 5.0]]), dims=[0]).tolist()
[2.0, 3.5]
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["KERNELS", "einsum", "matmul", "batch_matmul", "linear", "embedding", "embedding_grad", "reduce_sum",
           "reduce_mean", "reduce_max", "sum_grad", "max_grad"]


# --------------------------------------------------------------------------- products
def einsum(*operands: np.ndarray, equation: str) -> np.ndarray:
    """``numpy.einsum`` after broadcasting size-1 dims of a letter to the letter's size.

    A letter's size is the size some operand holds other than 1 (0 for an empty local
    piece), else 1.

    Examples
    --------
    >>> einsum(np.ones((1, 2, 3)), np.ones((4, 3, 5)), equation="bmk,bkn->bmn").shape
    (4, 2, 5)
    """
    lhs, out = equation.replace(" ", "").split("->")
    subs = lhs.split(",")
    sizes: dict[str, int] = {}
    for sub, arr in zip(subs, operands):
        for c, n in zip(sub, arr.shape):
            if c not in sizes or sizes[c] == 1:
                sizes[c] = n
    expanded = [np.broadcast_to(arr, tuple(sizes[c] for c in sub)) for sub, arr in zip(subs, operands)]
    dtype = np.result_type(*operands)
    # optimize=True lets numpy contract through BLAS (tensordot) instead of its slow generic loop
    return np.asarray(np.einsum(equation, *expanded, optimize=True), dtype=dtype)


def _last_two_swapped(a: np.ndarray, transpose: bool) -> np.ndarray:
    return np.swapaxes(a, -1, -2) if transpose else a


def matmul(x: np.ndarray, w: np.ndarray, transpose_a: bool = False, transpose_b: bool = False) -> np.ndarray:
    """``x (..., m, k) @ w (k, n)`` (the transposes swap the last two dims first)."""
    return np.matmul(_last_two_swapped(x, transpose_a), _last_two_swapped(w, transpose_b))


def batch_matmul(x: np.ndarray, w: np.ndarray, transpose_a: bool = False, transpose_b: bool = False) -> np.ndarray:
    """``torch.matmul`` of two operands of rank >= 2 (batch dims broadcast)."""
    return np.matmul(_last_two_swapped(x, transpose_a), _last_two_swapped(w, transpose_b))


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None, add_bias: bool = True) -> np.ndarray:
    """``x @ weight.T + bias``; ``add_bias=False`` (a rank off coordinate 0 of a partial sum) skips the bias.

    Examples
    --------
    >>> linear(np.ones((2, 3)), np.ones((4, 3)), np.arange(4.0), add_bias=False)[0].tolist()
    [3.0, 3.0, 3.0, 3.0]
    """
    y = np.matmul(x, weight.T)
    if bias is not None:
        y = y + bias if add_bias else y + np.zeros_like(bias)
    return y


# --------------------------------------------------------------------------- embedding
def embedding(ids: np.ndarray, table: np.ndarray, vocab_start: int = 0) -> np.ndarray:
    """Rows ``table[ids - vocab_start]``; ids outside the table's rows give zero rows."""
    local = np.asarray(ids).astype(np.int64) - vocab_start
    valid = (local >= 0) & (local < table.shape[0])
    out = np.zeros(local.shape + table.shape[1:], dtype=table.dtype)
    out[valid] = table[local[valid]]
    return out


def embedding_grad(dy: np.ndarray, ids: np.ndarray, num_embeddings: int, table_placements: Any = None,
                   vocab_start: int = 0) -> np.ndarray:
    """Scatter-add ``dy`` into a ``(num_embeddings, hidden)`` table at rows ``ids - vocab_start``.

    Examples
    --------
    >>> embedding_grad(np.ones((3, 2)), np.array([1, 1, 4]), 3).tolist()
    [[0.0, 0.0], [2.0, 2.0], [0.0, 0.0]]
    """
    local = np.asarray(ids).astype(np.int64) - vocab_start
    valid = (local >= 0) & (local < num_embeddings)
    out = np.zeros((num_embeddings, dy.shape[-1]), dtype=dy.dtype)
    np.add.at(out, local[valid], dy[valid])
    return out


# --------------------------------------------------------------------------- reductions
def _dims(dims: Any, ndim: int) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(ndim))
    items = [dims] if isinstance(dims, int) else dims
    return tuple(sorted(d % ndim for d in items))


def reduce_sum(x: np.ndarray, dims: Any = None, keepdim: bool = False) -> np.ndarray:
    """``x.sum(dims)``; bools count as int64."""
    dtype = np.int64 if x.dtype == np.bool_ else x.dtype
    return np.asarray(np.sum(x, axis=_dims(dims, x.ndim), keepdims=keepdim, dtype=dtype))


def reduce_mean(x: np.ndarray, dims: Any = None, keepdim: bool = False, count: int | None = None) -> np.ndarray:
    """``x.sum(dims) / count``; ``count`` defaults to the number of reduced elements of ``x``.

    A rank holding a piece of a sharded reduced dim gets the *global* count, so the
    partial sums of the ranks add up to the mean.
    """
    axes = _dims(dims, x.ndim)
    if count is None:
        count = int(np.prod([x.shape[d] for d in axes], dtype=np.int64))
    dtype = x.dtype if np.issubdtype(x.dtype, np.floating) else np.dtype("float32")
    total = np.sum(x, axis=axes, keepdims=keepdim, dtype=dtype)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.asarray(total / dtype.type(count) if count else total * np.nan, dtype=dtype)


def _lowest(dtype: np.dtype):
    if np.issubdtype(dtype, np.floating):
        return -np.inf
    if dtype == np.bool_:
        return False
    return np.iinfo(dtype).min


def reduce_max(x: np.ndarray, dims: Any = None, keepdim: bool = False) -> np.ndarray:
    """``x.max(dims)``; an empty piece gives the dtype's lowest value (the identity of max)."""
    return np.asarray(np.max(x, axis=_dims(dims, x.ndim), keepdims=keepdim, initial=_lowest(x.dtype)))


def _expand(value: np.ndarray, dims: Sequence[int], keepdim: bool) -> np.ndarray:
    return value if keepdim else np.expand_dims(value, tuple(dims))


def sum_grad(dy: np.ndarray, shape: Sequence[int], dims: Any = None, keepdim: bool = False, scale: float = 1.0,
             placements: Any = None) -> np.ndarray:
    """``dy`` broadcast back to ``shape`` over the reduced ``dims``, times ``scale``.

    Examples
    --------
    >>> sum_grad(np.array([1.0, 2.0]), [3, 2], dims=[0], scale=0.5).tolist()
    [[0.5, 1.0], [0.5, 1.0], [0.5, 1.0]]
    """
    axes = _dims(dims, len(shape))
    out = np.broadcast_to(_expand(dy, axes, keepdim), tuple(shape))
    if scale != 1.0:
        return (out * dy.dtype.type(scale)).astype(dy.dtype)
    return np.array(out, copy=True)


def max_grad(dy: np.ndarray, x: np.ndarray, y: np.ndarray, dims: Any = None, keepdim: bool = False) -> np.ndarray:
    """The cotangent of ``max`` at every element equal to the maximum (ties: each gets all of it).

    Examples
    --------
    >>> max_grad(np.array([1.0]), np.array([[3.0, 1.0, 3.0]]), np.array([3.0]), dims=[1]).tolist()
    [[1.0, 0.0, 1.0]]
    """
    axes = _dims(dims, x.ndim)
    hit = x == _expand(y, axes, keepdim)
    return np.where(hit, _expand(dy, axes, keepdim), np.zeros((), dtype=dy.dtype)).astype(dy.dtype)


KERNELS: dict[str, Callable] = {
    "einsum": einsum,
    "matmul": matmul,
    "batch_matmul": batch_matmul,
    "linear": linear,
    "embedding": embedding,
    "embedding_grad": embedding_grad,
    "sum": reduce_sum,
    "mean": reduce_mean,
    "max": reduce_max,
    "sum_grad": sum_grad,
    "max_grad": max_grad,
}
