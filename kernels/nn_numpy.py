"""numpy kernels of the nn op family (forward and backward), merged into the numpy table.

Kernels take arrays and the op's (localised) attrs as keywords.  Integer and bool inputs
compute in float32, as the layout rules declare (:func:`layout_prop.ops.nn.float_dtype`);
floating inputs keep their dtype.  The backward kernels are checked against central
finite differences in float64 by ``graph_tests/test_nn_ops.py``.

Examples
--------
>>> import numpy as np
>>> KERNELS["softmax"](np.log(np.array([[1.0, 3.0]])), axis=-1)
array([[0.25, 0.75]])
>>> KERNELS["swiglu"](np.array([0.0, 50.0, 5.0, 2.0]), dim=-1)  # silu(a) * b, silu(50) = 50
array([  0., 100.])
>>> q = np.zeros((1, 1, 2, 4)); v = np.arange(8.0).reshape(1, 1, 2, 4)
>>> KERNELS["scaled_dot_product_attention"](q, q, v, causal=True)[0, 0]
array([[0., 1., 2., 3.],
       [2., 3., 4., 5.]])
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["KERNELS", "GELU_C", "GELU_K", "kv_index", "expand_kv", "reduce_kv", "zigzag_positions", "causal_visible"]

GELU_C = math.sqrt(2.0 / math.pi)
GELU_K = 0.044715
ATTENTION_DIMS = {"BNSD": (0, 1, 2, 3), "BSND": (0, 2, 1, 3)}  # transpose to BNSD (its own inverse)


def _f(x: np.ndarray) -> np.ndarray:
    """Floating inputs as they are, integers and bools as float32."""
    x = np.asarray(x)
    return x if np.issubdtype(x.dtype, np.floating) else x.astype(np.float32)


def _result(value, *inputs) -> np.ndarray:
    """``value`` in the dtype the rule declares: numpy's promotion of the (floated) inputs."""
    return np.asarray(value).astype(np.result_type(*[_f(a).dtype for a in inputs]), copy=False)


# ------------------------------------------------------------------------ pointwise
def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow for large |x|


def exp(x):
    return np.exp(_f(x))


def silu(x):
    x = _f(x)
    return x * _sigmoid(x)


def silu_grad(dy, x):
    dy, x = _f(dy), _f(x)
    s = _sigmoid(x)
    return _result(dy * s * (1.0 + x * (1.0 - s)), dy, x)


def gelu(x):
    x = _f(x)
    return 0.5 * x * (1.0 + np.tanh(GELU_C * (x + GELU_K * x ** 3)))


def gelu_grad(dy, x):
    dy, x = _f(dy), _f(x)
    t = np.tanh(GELU_C * (x + GELU_K * x ** 3))
    dt = (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_K * x * x)
    return _result(dy * (0.5 * (1.0 + t) + 0.5 * x * dt), dy, x)


def cast(x, dtype=None):
    return np.asarray(x).astype(dtype)


def scale(x, factor=1.0):
    x = _f(x)
    return _result(x * factor, x)


def div(x, y):
    x, y = _f(x), _f(y)
    return _result(x / y, x, y)


def silu_mul(a, b):
    a, b = _f(a), _f(b)
    return _result(a * _sigmoid(a) * b, a, b)


def swiglu(x, dim=-1):
    a, b = np.split(_f(x), 2, axis=dim)
    return a * _sigmoid(a) * b


def swiglu_grad(dy, x, dim=-1):
    dy, x = _f(dy), _f(x)
    a, b = np.split(x, 2, axis=dim)
    s = _sigmoid(a)
    da = dy * b * s * (1.0 + a * (1.0 - s))
    db = dy * a * s
    return _result(np.concatenate([da, db], axis=dim), x)


# ------------------------------------------------------------------------ norms
def _norm_axes(x: np.ndarray, normalized_ndim: int) -> tuple[int, ...]:
    return tuple(range(x.ndim - normalized_ndim, x.ndim))


def _lead_axes(x: np.ndarray, normalized_ndim: int) -> tuple[int, ...]:
    return tuple(range(x.ndim - normalized_ndim))


def _keep(xhat: np.ndarray, norm_slices) -> np.ndarray:
    """The chunk ``norm_slices`` (``[start, stop)`` per normalised dim) of whole normalised rows."""
    if norm_slices is None:
        return xhat
    lead = (slice(None),) * (xhat.ndim - len(norm_slices))
    return xhat[lead + tuple(slice(lo, hi) for lo, hi in norm_slices)]


def rms_norm(x, weight, eps=1e-6, normalized_ndim=1, norm_slices=None):
    """``x / sqrt(mean(x**2) + eps) * weight``; ``norm_slices`` keeps a chunk of the normalised
    dims (the weight is that chunk: the rule's sharded-weight case)."""
    x, weight = _f(x), _f(weight)
    axes = _norm_axes(x, normalized_ndim)
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + eps)
    return _result(_keep(x * rstd, norm_slices) * weight, x, weight)


def rms_norm_grad(dy, x, weight, eps=1e-6, normalized_ndim=1):
    """``(dx, dweight)``: ``dx = rstd * (g - xhat * mean(g * xhat))`` with ``g = dy * weight``."""
    dy, x, weight = _f(dy), _f(x), _f(weight)
    axes = _norm_axes(x, normalized_ndim)
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + eps)
    xhat = x * rstd
    g = dy * weight
    dx = rstd * (g - xhat * np.mean(g * xhat, axis=axes, keepdims=True))
    dweight = np.sum(dy * xhat, axis=_lead_axes(x, normalized_ndim))
    return dx.astype(x.dtype, copy=False), dweight.astype(weight.dtype, copy=False)


def layer_norm(x, weight, bias, eps=1e-5, normalized_ndim=1, norm_slices=None):
    """``(x - mean) / sqrt(var + eps) * weight + bias``; ``norm_slices`` as in :func:`rms_norm`."""
    x, weight, bias = _f(x), _f(weight), _f(bias)
    axes = _norm_axes(x, normalized_ndim)
    mean = np.mean(x, axis=axes, keepdims=True)
    centred = x - mean
    rstd = 1.0 / np.sqrt(np.mean(centred * centred, axis=axes, keepdims=True) + eps)
    return _result(_keep(centred * rstd, norm_slices) * weight + bias, x, weight, bias)


def layer_norm_grad(dy, x, weight, bias, eps=1e-5, normalized_ndim=1):
    """``(dx, dweight, dbias)``: ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``."""
    dy, x, weight, bias = _f(dy), _f(x), _f(weight), _f(bias)
    axes = _norm_axes(x, normalized_ndim)
    lead = _lead_axes(x, normalized_ndim)
    centred = x - np.mean(x, axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(np.mean(centred * centred, axis=axes, keepdims=True) + eps)
    xhat = centred * rstd
    g = dy * weight
    dx = rstd * (g - np.mean(g, axis=axes, keepdims=True) - xhat * np.mean(g * xhat, axis=axes, keepdims=True))
    dweight = np.sum(dy * xhat, axis=lead)
    dbias = np.sum(dy, axis=lead)
    return (dx.astype(x.dtype, copy=False), dweight.astype(weight.dtype, copy=False),
            dbias.astype(bias.dtype, copy=False))


# ------------------------------------------------------------------------ softmax
def _max(x, axis):
    """The max along ``axis`` kept as a dim; -inf along a size-0 axis (whose softmax is empty,
    and attention over no keys gives zeros), where numpy's max has no identity."""
    return np.max(x, axis=axis, keepdims=True, initial=-np.inf)


def softmax(x, axis=-1):
    x = _f(x)
    shifted = np.exp(x - _max(x, axis))
    return shifted / np.sum(shifted, axis=axis, keepdims=True)


def softmax_grad(dy, y, axis=-1):
    dy, y = _f(dy), _f(y)
    return _result(y * (dy - np.sum(dy * y, axis=axis, keepdims=True)), dy, y)


def log_softmax(x, axis=-1):
    x = _f(x)
    shifted = x - _max(x, axis)
    with np.errstate(divide="ignore"):  # the log of an empty sum is -inf (a size-0 axis: the result is empty)
        return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def log_softmax_grad(dy, y, axis=-1):
    dy, y = _f(dy), _f(y)
    return _result(dy - np.exp(y) * np.sum(dy, axis=axis, keepdims=True), dy, y)


# ------------------------------------------------------------------------ attention
def _to_bnsd(t: np.ndarray, layout: str) -> np.ndarray:
    return np.transpose(t, ATTENTION_DIMS[layout])


def _attention_probs(q, k, causal, scale, q_offset, zigzag=0):
    """Softmax probabilities (B, N, Sq, Skv) and the scale used; q, k in BNSD."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if causal:
        scores = np.where(causal_visible(q.shape[-2], k.shape[-2], q_offset, zigzag), scores, -np.inf)
    return softmax(scores, axis=-1), scale


def zigzag_positions(n: int, ranks: int) -> np.ndarray:
    """The position in the sequence of each stored index of a sequence of ``n`` kept in zig-zag
    order for ``ranks`` shards (0: the natural order): 2 * ranks chunks, shard i holding chunks i
    and 2 * ranks - 1 - i, so that causal attention gives every shard as many query-key pairs.

    >>> zigzag_positions(8, 2).tolist()  # chunks 0, 3 | 1, 2
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    index = np.arange(n)
    if not ranks or not n:
        return index
    size = n // (2 * ranks)
    chunk, within = index // size, index % size
    shard, second = chunk // 2, chunk % 2
    return np.where(second == 0, shard, 2 * ranks - 1 - shard) * size + within


def causal_visible(sq: int, skv: int, q_offset: int, zigzag: int = 0) -> np.ndarray:
    """The top-left causal mask of ``sq`` query rows from global row ``q_offset`` on: row i sees key
    j when j <= i, both as positions in the sequence (:func:`zigzag_positions` of the stored order)."""
    rows = np.arange(sq) + q_offset
    cols = np.arange(skv)
    if zigzag:
        positions = zigzag_positions(skv, zigzag)
        rows, cols = positions[rows], positions
    return cols[None, :] <= rows[:, None]


def kv_index(q_heads: int, kv_heads: int, kv_head_map=None):
    """The kv head of each query head (grouped-query attention), or None when they are the same heads.

    ``kv_head_map`` is a rank's own map (localised); without one, query head ``h`` uses kv
    head ``h // (q_heads / kv_heads)``.

    >>> kv_index(4, 2).tolist(), kv_index(2, 2), kv_index(2, 4, (3, 3)).tolist()
    ([0, 0, 1, 1], None, [3, 3])
    """
    if kv_head_map is not None:
        return np.asarray(kv_head_map, dtype=np.int64).reshape(-1)
    if q_heads == kv_heads:
        return None
    return np.arange(q_heads) // max(q_heads // max(kv_heads, 1), 1)


def expand_kv(t: np.ndarray, index) -> np.ndarray:
    """k or v in BNSD with one head per query head."""
    return t if index is None else t[:, index]


def reduce_kv(grad: np.ndarray, kv_heads: int, index) -> np.ndarray:
    """The gradient of :func:`expand_kv`: each kv head sums its query heads' gradients."""
    if index is None:
        return grad
    out = np.zeros(grad.shape[:1] + (kv_heads,) + grad.shape[2:], grad.dtype)
    np.add.at(out, (slice(None), index), grad)
    return out


def scaled_dot_product_attention(q, k, v, layout="BNSD", causal=False, scale=None, q_offset=0, kv_head_map=None,
                                 context_parallel="all_gather", zigzag=0):
    """``softmax(q k^T * scale + mask) v``; ``q_offset`` is the global index of q's first row;
    k and v may have fewer heads than q (``kv_head_map``: :func:`kv_index`); 3-D q, k, v are
    torch's (N, L, E), one head."""
    if np.ndim(q) == 3:
        return scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], "BNSD", causal, scale, q_offset,
                                            kv_head_map, context_parallel, zigzag)[:, 0]
    q, k, v = _f(q), _f(k), _f(v)
    qb, kb, vb = (_to_bnsd(t, layout) for t in (q, k, v))
    index = kv_index(qb.shape[1], kb.shape[1], kv_head_map)
    kb, vb = expand_kv(kb, index), expand_kv(vb, index)
    probs, _ = _attention_probs(qb, kb, causal, scale, q_offset, zigzag)
    return _result(_to_bnsd(np.matmul(probs, vb), layout), q, k, v)


def scaled_dot_product_attention_grad(dy, q, k, v, layout="BNSD", causal=False, scale=None, q_offset=0,
                                      kv_head_map=None, context_parallel="all_gather", zigzag=0):
    """``(dq, dk, dv)``, recomputing the probabilities (3-D: torch's (N, L, E), one head)."""
    if np.ndim(q) == 3:
        grads = scaled_dot_product_attention_grad(dy[:, None], q[:, None], k[:, None], v[:, None], "BNSD", causal,
                                                  scale, q_offset, kv_head_map, context_parallel, zigzag)
        return tuple(grad[:, 0] for grad in grads)
    dy, q, k, v = _f(dy), _f(q), _f(k), _f(v)
    dyb, qb, kb, vb = (_to_bnsd(t, layout) for t in (dy, q, k, v))
    kv_heads = kb.shape[1]
    index = kv_index(qb.shape[1], kv_heads, kv_head_map)
    kb, vb = expand_kv(kb, index), expand_kv(vb, index)
    probs, used_scale = _attention_probs(qb, kb, causal, scale, q_offset, zigzag)
    dv = np.matmul(np.swapaxes(probs, -1, -2), dyb)
    dprobs = np.matmul(dyb, np.swapaxes(vb, -1, -2))
    dscores = probs * (dprobs - np.sum(dprobs * probs, axis=-1, keepdims=True)) * used_scale
    dq = np.matmul(dscores, kb)
    dk = np.matmul(np.swapaxes(dscores, -1, -2), qb)
    dk, dv = reduce_kv(dk, kv_heads, index), reduce_kv(dv, kv_heads, index)
    return tuple(_to_bnsd(grad, layout).astype(t.dtype, copy=False) for grad, t in ((dq, q), (dk, k), (dv, v)))


KERNELS: dict = {
    "exp": exp,
    "silu": silu,
    "silu_grad": silu_grad,
    "gelu": gelu,
    "gelu_grad": gelu_grad,
    "cast": cast,
    "scale": scale,
    "div": div,
    "silu_mul": silu_mul,
    "swiglu": swiglu,
    "swiglu_grad": swiglu_grad,
    "rms_norm": rms_norm,
    "rms_norm_grad": rms_norm_grad,
    "layer_norm": layer_norm,
    "layer_norm_grad": layer_norm_grad,
    "softmax": softmax,
    "softmax_grad": softmax_grad,
    "log_softmax": log_softmax,
    "log_softmax_grad": log_softmax_grad,
    "scaled_dot_product_attention": scaled_dot_product_attention,
    "scaled_dot_product_attention_grad": scaled_dot_product_attention_grad,
}
