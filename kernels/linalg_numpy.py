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
    if len(subs) == 2 and _is_plain_contraction(subs[0], subs[1], out):
        return np.asarray(_contract_pair(subs[0], subs[1], out, *expanded), dtype=dtype)
    # optimize=True lets numpy contract through BLAS (tensordot) instead of its slow generic loop
    return np.asarray(np.einsum(equation, *expanded, optimize=True), dtype=dtype)


def _is_plain_contraction(sub_a: str, sub_b: str, out: str) -> bool:
    """No letter repeats within a subscript and every output letter comes from an operand."""
    return all(len(set(s)) == len(s) for s in (sub_a, sub_b, out)) and set(out) <= set(sub_a) | set(sub_b)


def _as_matrices(arr: np.ndarray, sub: str, batch: str, free: str, summed: str) -> tuple[np.ndarray, bool]:
    """``arr`` as a stack of matrices ``(batch, free, summed)``; True when returned transposed.

    Of the two orders ``(batch, free, summed)`` and ``(batch, summed, free)`` the one that
    keeps ``arr``'s own dim order is taken, so that the reshape is a view, not a copy
    (``numpy.matmul`` hands a transposed matrix to BLAS without copying it).
    """
    sizes = dict(zip(sub, arr.shape))

    def block(letters: str) -> int:
        return int(np.prod([sizes[c] for c in letters], dtype=np.int64))

    free_first = batch + free + summed
    if sub == batch + summed + free:
        stacked = arr.reshape(block(batch), block(summed), block(free))
        return stacked, True
    stacked = arr.transpose([sub.index(c) for c in free_first]).reshape(block(batch), block(free), block(summed))
    return stacked, False


def _contract_pair(sub_a: str, sub_b: str, out: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``numpy.einsum(f"{sub_a},{sub_b}->{out}", a, b)`` as one batched matrix product.

    Letters in both operands and the output are batch dims, letters in both operands only
    are contracted, letters of one operand and the output are its free dims, and letters
    of one operand only are summed out first.  Same result as the einsum up to the order
    of floating-point additions, without einsum's per-call path search (which dominates
    on the small per-rank products of a simulated mesh).

    >>> a, b = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
    >>> bool(np.allclose(_contract_pair("mk", "kn", "nm", a, b), np.einsum("mk,kn->nm", a, b)))
    True
    """
    only_a = "".join(c for c in sub_a if c not in sub_b and c not in out)
    only_b = "".join(c for c in sub_b if c not in sub_a and c not in out)
    if only_a:
        a = a.sum(axis=tuple(sub_a.index(c) for c in only_a))
        sub_a = "".join(c for c in sub_a if c not in only_a)
    if only_b:
        b = b.sum(axis=tuple(sub_b.index(c) for c in only_b))
        sub_b = "".join(c for c in sub_b if c not in only_b)
    batch = "".join(c for c in out if c in sub_a and c in sub_b)
    summed = "".join(c for c in sub_a if c in sub_b and c not in out)
    free_a = "".join(c for c in sub_a if c not in sub_b)
    free_b = "".join(c for c in sub_b if c not in sub_a)
    mat_a, a_transposed = _as_matrices(a, sub_a, batch, free_a, summed)
    mat_b, b_transposed = _as_matrices(b, sub_b, batch, free_b, summed)
    # (batch, free_a, summed) @ (batch, summed, free_b)
    left = np.swapaxes(mat_a, -1, -2) if a_transposed else mat_a
    right = mat_b if b_transposed else np.swapaxes(mat_b, -1, -2)
    product = np.matmul(left, right)
    sizes = {**dict(zip(sub_a, a.shape)), **dict(zip(sub_b, b.shape))}
    letters = batch + free_a + free_b
    product = product.reshape(tuple(sizes[c] for c in letters))
    return product.transpose([letters.index(c) for c in out])


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
