"""The MindSpore kernel tables: the ops of :mod:`layout_prop.kernels.numpy_backend`, built from MindSpore ops.

Two tables share the op names and signatures of the numpy ``KERNELS`` table:

- :data:`KERNELS` (backend ``mindspore``): MindSpore CPU (or any device) ops.  MindSpore
  has no RotaryPositionEmbedding kernel on CPU (the fused kernel is CANN, Ascend only),
  so the rotation is written with MindSpore slicing, ``cat``, ``mul`` and ``add``, and
  its gradient comes from MindSpore autodiff (:func:`mindspore.vjp`) of that forward.
  The shape, nn and linalg families follow the formulas of their numpy modules
  (``shape_numpy``, ``nn_numpy``, ``linalg_numpy``) op by op in MindSpore ops (einsum,
  which has no CPU kernel, by pairwise batched matmuls).  On CPU, exp / log / tanh of
  float32 are evaluated in float64 (:func:`_precise`: MindSpore's float32 CPU tanh is
  off by up to 1e-4 relative).
- :data:`CANN_KERNELS` (backend ``cann``): the same table with the two rotary ops
  replaced by the CANN kernel of :mod:`layout_prop.kernels.rpe_cann` (Ascend only).

Kernels accept MindSpore tensors (numpy arrays are converted) plus their attrs as
keyword arguments, and return MindSpore tensors (a tuple for multi-output ops), so an
SPMD worker can chain them without leaving MindSpore.  float16 rotary inputs are
computed in float32 and rounded once at the end, like the numpy reference.

The RPE formulation is :func:`layout_prop.kernels.rpe_mindspore.rpe_forward_tensor`
(``y = arrange(x) * cos + rotate(x) * sin``, see :mod:`layout_prop.kernels.rpe_numpy`).

Examples
--------
>>> import numpy as np
>>> to_numpy(KERNELS["add"](np.ones(3, np.float32), np.ones(3, np.float32)))
array([2., 2., 2.], dtype=float32)
>>> to_numpy(KERNELS["sum_to"](np.ones((2, 3), np.float32), shape=[1, 3]))
array([[2., 2., 2.]], dtype=float32)
>>> x = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
>>> to_numpy(KERNELS["rotary_position_embedding"](x, np.zeros(4, np.float32), np.ones(4, np.float32), mode=0))
array([-3., -4.,  1.,  2.], dtype=float32)
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from layout_prop.core.errors import ExecutionError

from . import family_tables
from .rpe_mindspore import import_mindspore, rpe_forward_tensor
from .rpe_numpy import check_rpe_shapes

__all__ = ["KERNELS", "CANN_KERNELS", "TABLES", "get_table", "to_tensor", "to_numpy"]


# --------------------------------------------------------------------------- conversions
def _ms():
    """MindSpore, imported lazily (importing this module does not need it)."""
    return import_mindspore()


def to_tensor(value: Any):
    """A MindSpore tensor holding ``value`` (tensors pass through unchanged).

    Examples
    --------
    >>> to_tensor(np.arange(3)).shape
    (3,)
    """
    ms = _ms()
    if isinstance(value, ms.Tensor):
        return value
    array = np.ascontiguousarray(value)
    if array.dtype.name == "bfloat16":  # computed in float32, as the numpy kernels are (MindSpore's CPU
        array = array.astype(np.float32)  # kernels have no bfloat16 MatMul); the engine rounds each output
    return ms.Tensor(array)


def to_numpy(value: Any) -> np.ndarray:
    """A numpy array holding ``value`` (a MindSpore tensor or anything numpy accepts).

    Examples
    --------
    >>> to_numpy(to_tensor(np.arange(3.0)))
    array([0., 1., 2.])
    """
    ms = _ms()
    if isinstance(value, ms.Tensor):
        array = np.array(value.asnumpy(), copy=True)
        if array.dtype.name == "bfloat16":  # MindSpore's own numpy bfloat16, not ml_dtypes': exactly through float32
            from layout_prop.core.spec import numpy_dtype

            array = array.astype(np.float32).astype(numpy_dtype("bfloat16"))
        return array
    return np.asarray(value)


def _compute_dtype(tensor):
    """float16 is computed in float32 (rounded once at the end), the rest in itself."""
    ms = _ms()
    return ms.float32 if tensor.dtype == ms.float16 else tensor.dtype


# --------------------------------------------------------------------------- elementwise
def _identity(x):
    return to_tensor(x).copy()


def _add(a, b):
    return _ms().ops.add(to_tensor(a), to_tensor(b))


def _sub(a, b):
    return _ms().ops.sub(to_tensor(a), to_tensor(b))


def _mul(a, b):
    return _ms().ops.mul(to_tensor(a), to_tensor(b))


def _neg(x):
    return _ms().ops.neg(to_tensor(x))


def _sum_to(x, shape: Sequence[int]):
    """Sum a broadcast result back to ``shape`` (as :func:`rpe_numpy.reduce_to_shape`)."""
    ops = _ms().ops
    x = to_tensor(x)
    shape = tuple(int(s) for s in shape)
    extra = x.ndim - len(shape)
    if extra > 0:
        x = ops.sum(x, dim=tuple(range(extra)), keepdim=False)
    summed = tuple(axis for axis, size in enumerate(shape) if size == 1 and x.shape[axis] != 1)
    if summed:
        x = ops.sum(x, dim=summed, keepdim=True)
    return x


def _redistribute_global(x, placements=None):
    """On one device (and inside one rank) a redistribution moves nothing."""
    return to_tensor(x).copy()


# --------------------------------------------------------------------------- rotary position embedding
def _prepare_rpe(x, cos, sin, mode):
    """Validate shapes (the numpy reference's rules and errors); cast to the compute dtype."""
    x, cos, sin = to_tensor(x), to_tensor(cos), to_tensor(sin)
    mode = check_rpe_shapes(tuple(x.shape), tuple(cos.shape), tuple(sin.shape), mode)
    compute = _compute_dtype(x)
    return x, cos.astype(compute), sin.astype(compute), mode, compute


def _rpe(x, cos, sin, mode=0, input_layout=None):
    x, cos, sin, mode, compute = _prepare_rpe(x, cos, sin, mode)
    y = rpe_forward_tensor(x.astype(compute), cos, sin, mode)
    return y.astype(x.dtype)


def _rpe_grad(dy, x, cos, sin, mode=0, input_layout=None):
    """``(dx, dcos, dsin)`` by MindSpore autodiff of the forward; ``cos`` / ``sin`` grads in their shape."""
    ms = _ms()
    x, cos, sin, mode, compute = _prepare_rpe(x, cos, sin, mode)
    dy = to_tensor(dy)
    if tuple(dy.shape) != tuple(x.shape):
        raise ExecutionError("shape-mismatch", f"dy shape {list(dy.shape)} differs from x shape {list(x.shape)}",
                             hint="dy is the gradient of y, which has x's shape")
    def fn(x_, cos_, sin_):
        return rpe_forward_tensor(x_, cos_, sin_, mode)

    _, vjp_fn = ms.vjp(fn, x.astype(compute), cos, sin)
    dx, dcos, dsin = vjp_fn(dy.astype(compute))
    return tuple(g.astype(x.dtype) for g in (dx, dcos, dsin))


# --------------------------------------------------------------------------- the CANN kernel
def _cann_module():
    try:
        from . import rpe_cann
    except ImportError as exc:
        raise ExecutionError("backend-unavailable", f"the CANN RPE kernel module is missing: {exc}",
                             hint="use --backend mindspore") from None
    return rpe_cann


def _layout_kwargs(input_layout) -> dict:
    return {} if input_layout is None else {"input_layout": input_layout}


def _rpe_cann(x, cos, sin, mode=0, input_layout=None):
    x = to_numpy(x)
    y = _cann_module().rpe_forward_cann(x, to_numpy(cos), to_numpy(sin), mode, **_layout_kwargs(input_layout))
    return to_tensor(np.asarray(y, dtype=x.dtype))


def _rpe_grad_cann(dy, x, cos, sin, mode=0, input_layout=None):
    x = to_numpy(x)
    grads = _cann_module().rpe_backward_cann(to_numpy(dy), x, to_numpy(cos), to_numpy(sin), mode,
                                             **_layout_kwargs(input_layout))
    return tuple(to_tensor(np.asarray(g, dtype=x.dtype)) for g in grads)


# --------------------------------------------------------------------------- dtypes (as the numpy kernels)
def _ms_dtype(dtype):
    """The MindSpore dtype of a numpy dtype (or its name); bfloat16 (ml_dtypes') is ``mindspore.bfloat16``."""
    from mindspore.common.dtype import pytype_to_dtype

    if str(dtype) == "bfloat16":
        return _ms().bfloat16
    return pytype_to_dtype(np.dtype(dtype))


def _np_dtype(tensor) -> np.dtype:
    from mindspore.common.dtype import dtype_to_nptype

    return np.dtype(dtype_to_nptype(tensor.dtype))


def _floated(x):
    """Floating tensors as they are, integers and bools as float32 (``nn_numpy._f``)."""
    x = to_tensor(x)
    return x if np.issubdtype(_np_dtype(x), np.floating) else x.astype(_ms().float32)


def _as_result(value, *inputs):
    """``value`` in numpy's promotion of the (floated) inputs' dtypes (``nn_numpy._result``)."""
    return value.astype(_ms_dtype(np.result_type(*[_np_dtype(_floated(a)) for a in inputs])))


# --------------------------------------------------------------------------- shape family
def _reshape(x, shape):
    return _ms().ops.reshape(to_tensor(x), tuple(int(s) for s in shape))


def _transpose(x, dims=None, dim0=None, dim1=None):
    ops = _ms().ops
    x = to_tensor(x)
    if dims is not None:
        return ops.permute(x, tuple(int(d) for d in dims))
    return ops.swapaxes(x, dim0, dim1)


def _take(x, axis: int, lo: int, hi: int):
    """``x[..., lo:hi, ...]`` along ``axis``."""
    index = [slice(None)] * x.ndim
    index[axis] = slice(lo, hi)
    return x[tuple(index)]


def _pieces(x, axis: int, bounds):
    return tuple(_take(x, axis, lo, hi) for lo, hi in bounds)


def _split(x, count: int, axis: int = 0, sizes=None):
    x = to_tensor(x)
    sizes = list(sizes) if sizes is not None else [x.shape[axis] // count] * count
    starts = np.cumsum([0, *sizes])
    return _pieces(x, axis, [(int(starts[i]), int(starts[i + 1])) for i in range(count)])


def _chunk(x, count: int, axis: int = 0):
    from layout_prop.core.spec import chunk_bounds

    x = to_tensor(x)
    return _pieces(x, axis, chunk_bounds(x.shape[axis], count))


def _sized_bounds(n: int, size: int) -> list[tuple[int, int]]:
    return [(0, 0)] if n == 0 else [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def _split_torch(x, split_size_or_sections, axis: int = 0):
    """``torch.split`` (the numpy kernel's cut, on a MindSpore tensor)."""
    x = to_tensor(x)
    if isinstance(split_size_or_sections, (list, tuple)):
        pieces = _split(x, len(split_size_or_sections), axis, split_size_or_sections)
    else:
        pieces = _pieces(x, axis, _sized_bounds(x.shape[axis], int(split_size_or_sections)))
    return pieces[0] if len(pieces) == 1 else pieces  # a node of one output holds one value


def _chunk_torch(x, chunks: int, axis: int = 0, sizes=None):
    """``torch.chunk``: pieces of ``ceil(n / chunks)``, maybe fewer than ``chunks`` (a rank's piece of a
    strided axis: its localised ``sizes``)."""
    if sizes is not None:
        return _split_torch(x, list(sizes), axis)
    x = to_tensor(x)
    n = x.shape[axis]
    pieces = _pieces(x, axis, _sized_bounds(n, -(-n // chunks)))
    return pieces[0] if len(pieces) == 1 else pieces  # a node of one output holds one value


def _slice(x, axis=0, start=0, stop=None):
    x = to_tensor(x)
    lo, hi, _ = slice(start, stop).indices(x.shape[axis])
    return _take(x, axis, lo, max(lo, hi))


def _pad_slice(x, axis=0, start=0, size=None):
    ops = _ms().ops
    x = to_tensor(x)
    axis = axis % x.ndim

    def zeros(length):
        shape = list(x.shape)
        shape[axis] = length
        return ops.zeros(tuple(shape), x.dtype)

    return ops.cat((zeros(start), x, zeros(size - start - x.shape[axis])), axis)


def _concat(*xs, axis=0):
    return _ms().ops.cat(tuple(to_tensor(x) for x in xs), axis)


def _unsqueeze(x, dim):
    return _ms().ops.expand_dims(to_tensor(x), dim)


def _squeeze(x, dim=None):
    ops = _ms().ops
    x = to_tensor(x)
    if dim is None:
        return ops.squeeze(x)
    dims = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
    return ops.squeeze(x, dims)


def _counted(fn: Callable, count: int) -> Callable:
    def kernel(x, **attrs):
        return fn(x, count, **attrs)

    kernel.__name__ = f"{fn.__name__.lstrip('_')}{count}"
    return kernel


SHAPE_KERNELS: dict[str, Callable] = {
    "reshape": _reshape,
    "transpose": _transpose,
    "slice": _slice,
    "pad_slice": _pad_slice,
    "concat": _concat,
    "unsqueeze": _unsqueeze,
    "squeeze": _squeeze,
    "sharding_constraint": lambda x, **_pin: _identity(x),  # the local piece unchanged (the attrs are the rule's)
    **{f"split{n}": _counted(_split, n) for n in range(2, 9)},
    **{f"chunk{n}": _counted(_chunk, n) for n in range(2, 9)},
    "split": _split_torch,
    "chunk": _chunk_torch,
}


# --------------------------------------------------------------------------- nn family (the formulas of nn_numpy)
GELU_C = math.sqrt(2.0 / math.pi)
GELU_K = 0.044715
_ATTENTION_DIMS = {"BNSD": (0, 1, 2, 3), "BSND": (0, 2, 1, 3)}


def _precise(fn: Callable, x):
    """``fn(x)`` (an elementary function: exp, log, tanh) rounded once to ``x``'s dtype.

    MindSpore's CPU kernels of float32 ``tanh`` and ``exp`` are approximations (measured
    with MindSpore 2.10: relative errors up to 1e-4 for tanh and 3e-6 for exp, against
    about 6e-8 for numpy), enough to break the runner's float32 tolerance after a
    softmax or a norm's backward.  On CPU, float16 / float32 inputs are therefore
    evaluated in float64 (accurate to 3e-16) and rounded; other devices use the device's
    own kernel.
    """
    ms = _ms()
    if x.dtype in (ms.float16, ms.float32) and ms.get_context("device_target") == "CPU":
        return fn(x.astype(ms.float64)).astype(x.dtype)
    return fn(x)


def _tanh(x):
    return _precise(_ms().ops.tanh, x)


def _exp_of(x):
    return _precise(_ms().ops.exp, x)


def _log_of(x):
    return _precise(_ms().ops.log, x)


def _sigmoid(x):
    return 0.5 * (1.0 + _tanh(0.5 * x))


def _exp(x):
    return _exp_of(_floated(x))


def _silu(x):
    x = _floated(x)
    return x * _sigmoid(x)


def _silu_grad(dy, x):
    dy, x = _floated(dy), _floated(x)
    s = _sigmoid(x)
    return _as_result(dy * s * (1.0 + x * (1.0 - s)), dy, x)


def _gelu_tanh(x):
    return _tanh(GELU_C * (x + GELU_K * x ** 3))


def _gelu(x):
    x = _floated(x)
    return 0.5 * x * (1.0 + _gelu_tanh(x))


def _gelu_grad(dy, x):
    dy, x = _floated(dy), _floated(x)
    t = _gelu_tanh(x)
    dt = (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_K * x * x)
    return _as_result(dy * (0.5 * (1.0 + t) + 0.5 * x * dt), dy, x)


def _cast(x, dtype=None):
    return to_tensor(x).astype(_ms_dtype(dtype))


def _scale(x, factor=1.0):
    x = _floated(x)
    return _as_result(x * factor, x)


def _div(x, y):
    x, y = _floated(x), _floated(y)
    return _as_result(x / y, x, y)


def _silu_mul(a, b):
    a, b = _floated(a), _floated(b)
    return _as_result(a * _sigmoid(a) * b, a, b)


def _halves(x, dim):
    half = x.shape[dim] // 2
    return _take(x, dim, 0, half), _take(x, dim, half, x.shape[dim])


def _swiglu(x, dim=-1):
    a, b = _halves(_floated(x), dim)
    return a * _sigmoid(a) * b


def _swiglu_grad(dy, x, dim=-1):
    dy, x = _floated(dy), _floated(x)
    a, b = _halves(x, dim)
    s = _sigmoid(a)
    da = dy * b * s * (1.0 + a * (1.0 - s))
    db = dy * a * s
    return _as_result(_ms().ops.cat((da, db), dim), x)


def _norm_axes(x, normalized_ndim: int) -> tuple[int, ...]:
    return tuple(range(x.ndim - normalized_ndim, x.ndim))


def _lead_axes(x, normalized_ndim: int) -> tuple[int, ...]:
    return tuple(range(x.ndim - normalized_ndim))


def _mean(x, axes):
    return _ms().ops.mean(x, axes, True)


def _sum(x, axes, keepdims: bool):
    if not axes:
        return x
    return _ms().ops.sum(x, axes, keepdims)


def _rstd(values, axes, eps):
    return 1.0 / _ms().ops.sqrt(_mean(values * values, axes) + eps)


def _keep(xhat, norm_slices):
    """The chunk ``norm_slices`` of whole normalised rows (the numpy kernels' localised attr)."""
    if norm_slices is None:
        return xhat
    lead = (slice(None),) * (xhat.ndim - len(norm_slices))
    return xhat[lead + tuple(slice(lo, hi) for lo, hi in norm_slices)]


def _rms_norm(x, weight, eps=1e-6, normalized_ndim=1, norm_slices=None):
    x, weight = _floated(x), _floated(weight)
    return _as_result(_keep(x * _rstd(x, _norm_axes(x, normalized_ndim), eps), norm_slices) * weight, x, weight)


def _rms_norm_grad(dy, x, weight, eps=1e-6, normalized_ndim=1):
    dy, x, weight = _floated(dy), _floated(x), _floated(weight)
    axes = _norm_axes(x, normalized_ndim)
    rstd = _rstd(x, axes, eps)
    xhat = x * rstd
    g = dy * weight
    dx = rstd * (g - xhat * _mean(g * xhat, axes))
    dweight = _sum(dy * xhat, _lead_axes(x, normalized_ndim), False)
    return dx.astype(x.dtype), dweight.astype(weight.dtype)


def _layer_norm(x, weight, bias, eps=1e-5, normalized_ndim=1, norm_slices=None):
    x, weight, bias = _floated(x), _floated(weight), _floated(bias)
    axes = _norm_axes(x, normalized_ndim)
    centred = x - _mean(x, axes)
    return _as_result(_keep(centred * _rstd(centred, axes, eps), norm_slices) * weight + bias, x, weight, bias)


def _layer_norm_grad(dy, x, weight, bias, eps=1e-5, normalized_ndim=1):
    dy, x, weight, bias = _floated(dy), _floated(x), _floated(weight), _floated(bias)
    axes = _norm_axes(x, normalized_ndim)
    lead = _lead_axes(x, normalized_ndim)
    centred = x - _mean(x, axes)
    rstd = _rstd(centred, axes, eps)
    xhat = centred * rstd
    g = dy * weight
    dx = rstd * (g - _mean(g, axes) - xhat * _mean(g * xhat, axes))
    return (dx.astype(x.dtype), _sum(dy * xhat, lead, False).astype(weight.dtype),
            _sum(dy, lead, False).astype(bias.dtype))


def _softmax(x, axis=-1):
    ops = _ms().ops
    x = _floated(x)
    shifted = _exp_of(x - ops.amax(x, axis, True))
    return shifted / ops.sum(shifted, axis, True)


def _softmax_grad(dy, y, axis=-1):
    dy, y = _floated(dy), _floated(y)
    return _as_result(y * (dy - _ms().ops.sum(dy * y, axis, True)), dy, y)


def _log_softmax(x, axis=-1):
    ops = _ms().ops
    x = _floated(x)
    shifted = x - ops.amax(x, axis, True)
    return shifted - _log_of(ops.sum(_exp_of(shifted), axis, True))


def _log_softmax_grad(dy, y, axis=-1):
    ops = _ms().ops
    dy, y = _floated(dy), _floated(y)
    return _as_result(dy - _exp_of(y) * ops.sum(dy, axis, True), dy, y)


def _to_bnsd(t, layout: str):
    return _ms().ops.permute(t, _ATTENTION_DIMS[layout])


def _attention_probs(q, k, causal, scale, q_offset, zigzag=0):
    from .nn_numpy import causal_visible

    ops = _ms().ops
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = ops.matmul(q, ops.swapaxes(k, -1, -2)) * scale
    if causal:
        visible = to_tensor(causal_visible(q.shape[-2], k.shape[-2], q_offset, zigzag))  # top-left
        scores = ops.where(visible, scores, ops.full_like(scores, -np.inf))
    return _softmax(scores, axis=-1), scale


def _kv_index(q_heads: int, kv_heads: int, kv_head_map):
    """The kv head of each query head, a numpy index (``nn_numpy.kv_index``; None: the same heads)."""
    from .nn_numpy import kv_index

    return kv_index(q_heads, kv_heads, kv_head_map)


def _expand_kv(t, index):
    """k or v in BNSD with one head per query head (a gather along the heads)."""
    if index is None:
        return t
    ops = _ms().ops
    if index.size == 0:
        return ops.zeros((t.shape[0], 0) + tuple(t.shape[2:]), t.dtype)
    return ops.gather(t, to_tensor(index), 1)


def _reduce_kv(grad, kv_heads: int, index):
    """Each kv head sums the gradients of its query heads (a stack of sums, no scatter: exact)."""
    if index is None:
        return grad
    ops = _ms().ops
    heads = []
    for head in range(kv_heads):
        users = np.flatnonzero(index == head)
        if users.size:
            heads.append(ops.sum(ops.gather(grad, to_tensor(users), 1), 1))
        else:
            heads.append(ops.zeros((grad.shape[0],) + tuple(grad.shape[2:]), grad.dtype))
    if not heads:
        return ops.zeros((grad.shape[0], 0) + tuple(grad.shape[2:]), grad.dtype)
    return ops.stack(heads, 1)


def _sdpa(q, k, v, layout="BNSD", causal=False, scale=None, q_offset=0, kv_head_map=None,
          context_parallel="all_gather", zigzag=0):
    ops = _ms().ops
    if len(q.shape) == 3:  # torch's (N, L, E): one head
        one = [ops.expand_dims(to_tensor(t), 1) for t in (q, k, v)]
        return _sdpa(*one, "BNSD", causal, scale, q_offset, kv_head_map, context_parallel, zigzag)[:, 0]
    q, k, v = _floated(q), _floated(k), _floated(v)
    qb, kb, vb = (_to_bnsd(t, layout) for t in (q, k, v))
    index = _kv_index(qb.shape[1], kb.shape[1], kv_head_map)
    kb, vb = _expand_kv(kb, index), _expand_kv(vb, index)
    probs, _ = _attention_probs(qb, kb, causal, scale, q_offset, zigzag)
    return _as_result(_to_bnsd(ops.matmul(probs, vb), layout), q, k, v)


def _sdpa_grad(dy, q, k, v, layout="BNSD", causal=False, scale=None, q_offset=0, kv_head_map=None,
               context_parallel="all_gather", zigzag=0):
    ops = _ms().ops
    if len(q.shape) == 3:  # torch's (N, L, E): one head
        one = [ops.expand_dims(to_tensor(t), 1) for t in (dy, q, k, v)]
        return tuple(g[:, 0] for g in _sdpa_grad(*one, "BNSD", causal, scale, q_offset, kv_head_map,
                                                 context_parallel, zigzag))
    dy, q, k, v = _floated(dy), _floated(q), _floated(k), _floated(v)
    dyb, qb, kb, vb = (_to_bnsd(t, layout) for t in (dy, q, k, v))
    kv_heads = kb.shape[1]
    index = _kv_index(qb.shape[1], kv_heads, kv_head_map)
    kb, vb = _expand_kv(kb, index), _expand_kv(vb, index)
    probs, used_scale = _attention_probs(qb, kb, causal, scale, q_offset, zigzag)
    dv = ops.matmul(ops.swapaxes(probs, -1, -2), dyb)
    dprobs = ops.matmul(dyb, ops.swapaxes(vb, -1, -2))
    dscores = probs * (dprobs - ops.sum(dprobs * probs, -1, True)) * used_scale
    dq = ops.matmul(dscores, kb)
    dk = ops.matmul(ops.swapaxes(dscores, -1, -2), qb)
    dk, dv = _reduce_kv(dk, kv_heads, index), _reduce_kv(dv, kv_heads, index)
    return tuple(_to_bnsd(grad, layout).astype(t.dtype) for grad, t in ((dq, q), (dk, k), (dv, v)))


NN_KERNELS: dict[str, Callable] = {
    "exp": _exp,
    "silu": _silu,
    "silu_grad": _silu_grad,
    "gelu": _gelu,
    "gelu_grad": _gelu_grad,
    "cast": _cast,
    "scale": _scale,
    "div": _div,
    "silu_mul": _silu_mul,
    "swiglu": _swiglu,
    "swiglu_grad": _swiglu_grad,
    "rms_norm": _rms_norm,
    "rms_norm_grad": _rms_norm_grad,
    "layer_norm": _layer_norm,
    "layer_norm_grad": _layer_norm_grad,
    "softmax": _softmax,
    "softmax_grad": _softmax_grad,
    "log_softmax": _log_softmax,
    "log_softmax_grad": _log_softmax_grad,
    "scaled_dot_product_attention": _sdpa,
    "scaled_dot_product_attention_grad": _sdpa_grad,
}


# --------------------------------------------------------------------------- linalg family (as linalg_numpy)
def _sum_letters_out(t, sub: str, keep: set):
    """Sum over the letters of ``sub`` not in ``keep``; ``(tensor, remaining subscript)``."""
    axes = tuple(i for i, c in enumerate(sub) if c not in keep)
    if not axes:
        return t, sub
    return _ms().ops.sum(t, axes, False), "".join(c for c in sub if c in keep)


def _contract_pair(a, sa: str, b, sb: str, keep: set):
    """Contract two operands with one batched matmul; letters in ``keep`` stay."""
    ops = _ms().ops
    a, sa = _sum_letters_out(a, sa, keep | set(sb))
    b, sb = _sum_letters_out(b, sb, keep | set(sa))
    batch = [c for c in sa if c in sb and c in keep]
    contracted = [c for c in sa if c in sb and c not in keep]
    left = [c for c in sa if c not in sb]
    right = [c for c in sb if c not in sa]
    size = {c: n for sub, t in ((sa, a), (sb, b)) for c, n in zip(sub, t.shape)}

    def grouped(t, sub, groups):
        order = [c for group in groups for c in group]
        t = ops.permute(t, tuple(sub.index(c) for c in order))
        return ops.reshape(t, tuple(math.prod(size[c] for c in group) for group in groups))

    product = ops.matmul(grouped(a, sa, (batch, left, contracted)), grouped(b, sb, (batch, contracted, right)))
    letters = batch + left + right
    return ops.reshape(product, tuple(size[c] for c in letters)), "".join(letters)


def _einsum(*operands, equation: str):
    """``numpy.einsum`` (letters only, size-1 dims broadcast) by pairwise batched matmuls."""
    ops = _ms().ops
    lhs, out = equation.replace(" ", "").split("->")
    subs = lhs.split(",")
    tensors = [to_tensor(t) for t in operands]
    dtype = np.result_type(*[_np_dtype(t) for t in tensors])
    compute = _ms_dtype(dtype if np.issubdtype(dtype, np.floating) else np.float64)
    sizes: dict[str, int] = {}
    for sub, t in zip(subs, tensors):
        for c, n in zip(sub, t.shape):
            if c not in sizes or sizes[c] == 1:
                sizes[c] = n
    tensors = [ops.broadcast_to(t.astype(compute), tuple(sizes[c] for c in sub)) for sub, t in zip(subs, tensors)]
    acc, acc_sub = tensors[0], subs[0]
    for k in range(1, len(tensors)):
        keep = set(out).union(*subs[k + 1:])
        acc, acc_sub = _contract_pair(acc, acc_sub, tensors[k], subs[k], keep)
    acc, acc_sub = _sum_letters_out(acc, acc_sub, set(out))
    return ops.permute(acc, tuple(acc_sub.index(c) for c in out)).astype(_ms_dtype(dtype))


def _swap_last_two(t, transpose: bool):
    return _ms().ops.swapaxes(t, -1, -2) if transpose else t


def _matmul(x, w, transpose_a=False, transpose_b=False):
    return _ms().ops.matmul(_swap_last_two(to_tensor(x), transpose_a), _swap_last_two(to_tensor(w), transpose_b))


def _linear(x, weight, bias=None, add_bias=True):
    ops = _ms().ops
    x, weight = to_tensor(x), to_tensor(weight)
    y = ops.matmul(x, ops.swapaxes(weight, 0, 1))
    if bias is not None:
        bias = to_tensor(bias)
        y = y + (bias if add_bias else ops.zeros_like(bias))
    return y


def _local_ids(ids, vocab_start: int, rows: int):
    """``(clipped row index, valid mask)`` of ids in a table piece starting at ``vocab_start``."""
    ops = _ms().ops
    local = to_tensor(ids).astype(_ms().int64) - vocab_start
    valid = ops.logical_and(local >= 0, local < rows)
    return ops.where(valid, local, ops.zeros_like(local)), valid


def _embedding(ids, table, vocab_start=0):
    ops = _ms().ops
    table = to_tensor(table)
    index, valid = _local_ids(ids, vocab_start, table.shape[0])
    rows = ops.gather(table, index, 0)
    mask = ops.reshape(valid, tuple(valid.shape) + (1,) * (table.ndim - 1))
    return ops.where(mask, rows, ops.zeros_like(rows))


def _embedding_grad(dy, ids, num_embeddings, table_placements=None, vocab_start=0):
    ops = _ms().ops
    dy = to_tensor(dy)
    index, valid = _local_ids(ids, vocab_start, num_embeddings)
    hidden = dy.shape[-1]
    flat_dy = ops.reshape(dy, (-1, hidden))
    flat_valid = ops.reshape(valid, (-1, 1))
    flat_dy = ops.where(flat_valid, flat_dy, ops.zeros_like(flat_dy))
    flat_index = ops.reshape(index, (-1,)).astype(_ms().int32)
    return ops.unsorted_segment_sum(flat_dy, flat_index, int(num_embeddings)).astype(dy.dtype)


def _reduce_dims(dims, ndim: int) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(ndim))
    items = [dims] if isinstance(dims, int) else dims
    return tuple(sorted(d % ndim for d in items))


def _reduce_sum(x, dims=None, keepdim=False):
    ms = _ms()
    x = to_tensor(x)
    axes = _reduce_dims(dims, x.ndim)
    dtype = ms.int64 if x.dtype == ms.bool_ else x.dtype
    if not axes:
        return x.astype(dtype)
    return ms.ops.sum(x.astype(dtype), axes, keepdim)


def _reduce_mean(x, dims=None, keepdim=False, count=None):
    ms = _ms()
    x = to_tensor(x)
    axes = _reduce_dims(dims, x.ndim)
    if count is None:
        count = math.prod(x.shape[d] for d in axes)
    dtype = x.dtype if np.issubdtype(_np_dtype(x), np.floating) else ms.float32
    total = ms.ops.sum(x.astype(dtype), axes, keepdim) if axes else x.astype(dtype)
    return total / count if count else total * float("nan")


def _reduce_max(x, dims=None, keepdim=False):
    ops = _ms().ops
    x = to_tensor(x)
    axes = _reduce_dims(dims, x.ndim)
    if not axes:
        return x.copy()
    if math.prod(x.shape[d] for d in axes) == 0:  # an empty piece: the identity of max
        dtype = _np_dtype(x)
        lowest = -np.inf if np.issubdtype(dtype, np.floating) else (False if dtype == np.bool_ else np.iinfo(dtype).min)
        shape = [1 if d in axes else n for d, n in enumerate(x.shape)] if keepdim else \
            [n for d, n in enumerate(x.shape) if d not in axes]
        return to_tensor(np.full(shape, lowest, dtype))
    return ops.amax(x, axes, keepdim)


def _expand_reduced(value, axes, keepdim: bool):
    ops = _ms().ops
    if keepdim:
        return value
    for axis in axes:  # ascending: each inserted dim lands at its final place
        value = ops.expand_dims(value, axis)
    return value


def _sum_grad(dy, shape, dims=None, keepdim=False, scale=1.0, placements=None):
    ops = _ms().ops
    dy = to_tensor(dy)
    axes = _reduce_dims(dims, len(shape))
    out = ops.broadcast_to(_expand_reduced(dy, axes, keepdim), tuple(int(s) for s in shape))
    if scale != 1.0:
        return (out * scale).astype(dy.dtype)
    return out.copy()


def _max_grad(dy, x, y, dims=None, keepdim=False):
    ops = _ms().ops
    dy, x, y = to_tensor(dy), to_tensor(x), to_tensor(y)
    axes = _reduce_dims(dims, x.ndim)
    hit = x == _expand_reduced(y, axes, keepdim)
    grad = ops.broadcast_to(_expand_reduced(dy, axes, keepdim), tuple(x.shape))
    return ops.where(hit, grad, ops.zeros_like(grad)).astype(dy.dtype)


LINALG_KERNELS: dict[str, Callable] = {
    "einsum": _einsum,
    "matmul": _matmul,
    "batch_matmul": _matmul,
    "linear": _linear,
    "embedding": _embedding,
    "embedding_grad": _embedding_grad,
    "sum": _reduce_sum,
    "mean": _reduce_mean,
    "max": _reduce_max,
    "sum_grad": _sum_grad,
    "max_grad": _max_grad,
}


# --------------------------------------------------------------------------- tables
KERNELS: dict[str, Callable] = {
    "identity": _identity,
    "add": _add,
    "sub": _sub,
    "mul": _mul,
    "neg": _neg,
    "sum_to": _sum_to,
    "rotary_position_embedding": _rpe,
    "rotary_position_embedding_grad": _rpe_grad,
    "redistribute": _redistribute_global,
    **SHAPE_KERNELS,
    **NN_KERNELS,
    **LINALG_KERNELS,
}
"""Backend ``mindspore``: MindSpore ops (CPU or any device), keyed like ``numpy_backend.KERNELS``."""
for _table in family_tables("mindspore"):  # every *_mindspore module's table
    KERNELS.update(_table)

CANN_KERNELS: dict[str, Callable] = {
    **KERNELS,
    "rotary_position_embedding": _rpe_cann,
    "rotary_position_embedding_grad": _rpe_grad_cann,
}
"""Backend ``cann``: as :data:`KERNELS` with the fused CANN RotaryPositionEmbedding (Ascend only)."""

TABLES: dict[str, dict[str, Callable]] = {"mindspore": KERNELS, "cann": CANN_KERNELS}


def get_table(backend: str) -> dict[str, Callable]:
    """The kernel table of ``backend`` (``mindspore`` or ``cann``).

    Raises
    ------
    ExecutionError
        ``backend-unavailable`` for any other name.

    Examples
    --------
    >>> get_table("mindspore") is KERNELS
    True
    """
    try:
        return TABLES[backend]
    except KeyError:
        raise ExecutionError("backend-unavailable", f"the MindSpore engine has no kernel backend {backend!r}",
                             hint="use --backend mindspore or --backend cann") from None
