"""RotaryPositionEmbedding (RPE) built from MindSpore ops, with MindSpore autodiff for the backward.

These kernels run wherever MindSpore runs (CPU included: they use only slicing,
concatenation, stacking and elementwise ops, never the CANN RotaryPositionEmbedding
kernel).  They follow the same formulas as :mod:`layout_prop.kernels.rpe_numpy` but
are written independently, with explicit concatenations, so that the tests can use
:func:`rpe_backward_ms` (MindSpore's autodiff of :func:`rpe_forward_tensor`) as a check
of the hand-written numpy backward.

MindSpore is imported inside the functions: this module imports without it, and a
missing MindSpore is reported as ``ExecutionError`` code ``backend-unavailable``.

Examples
--------
>>> import numpy as np
>>> x = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)
>>> rpe_forward_ms(x, np.zeros(4, np.float32), np.ones(4, np.float32), mode=0)
array([[-3., -4.,  1.,  2.]], dtype=float32)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from layout_prop.core.errors import ExecutionError, OpError

from .rpe_numpy import ModeLike, check_rpe_shapes

if TYPE_CHECKING:  # pragma: no cover - typing only
    import mindspore

__all__ = ["import_mindspore", "rpe_forward_tensor", "rpe_forward_ms", "rpe_backward_ms"]


def import_mindspore() -> Any:
    """Import and return the ``mindspore`` module, or raise a typed error.

    Raises
    ------
    ExecutionError
        Code ``backend-unavailable`` when MindSpore cannot be imported.
    """
    try:
        import mindspore
    except Exception as error:  # ImportError, or a broken install failing at import
        raise ExecutionError(
            "backend-unavailable",
            f"MindSpore cannot be imported ({type(error).__name__}: {error})".splitlines()[0],
            hint="install the extra: pip install 'layout-prop[mindspore]' (it pins numpy<2)",
        ) from None
    return mindspore


def rpe_forward_tensor(
    x: "mindspore.Tensor", cos: "mindspore.Tensor", sin: "mindspore.Tensor", mode: ModeLike = 0
) -> "mindspore.Tensor":
    """``y = arrange(x) * cos + rotate(x) * sin`` on MindSpore tensors (differentiable).

    Parameters
    ----------
    x : mindspore.Tensor
        Rotation dim ``D`` last.
    cos, sin : mindspore.Tensor
        Same shape, broadcastable to ``x`` (numpy rules), last dim ``D``.
    mode : int or str
        0 half, 1 interleave, 2 quarter, 3 interleave-half.

    Returns
    -------
    mindspore.Tensor
        ``y``, with ``x``'s shape and dtype.

    Raises
    ------
    OpError
        ``invalid-mode``, ``invalid-head-dim`` or ``broadcast-shape``.
    """
    mode = check_rpe_shapes(tuple(x.shape), tuple(cos.shape), tuple(sin.shape), mode)
    ops = import_mindspore().ops
    head_dim = x.shape[-1]
    half, quarter = head_dim // 2, head_dim // 4
    if mode == 0:  # cat(-x2, x1)
        x1, x2 = x[..., :half], x[..., half:]
        return x * cos + ops.cat((-x2, x1), -1) * sin
    if mode == 1:  # (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])
        pairs = x.reshape(tuple(x.shape[:-1]) + (half, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        return x * cos + ops.stack((-odd, even), -1).reshape(x.shape) * sin
    if mode == 2:  # cat(-q2, q1, -q4, q3)
        q1, q2, q3, q4 = (x[..., i * quarter : (i + 1) * quarter] for i in range(4))
        return x * cos + ops.cat((-q2, q1, -q4, q3), -1) * sin
    # mode 3: cat(e, o) * cos + cat(-o, e) * sin
    pairs = x.reshape(tuple(x.shape[:-1]) + (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return ops.cat((even, odd), -1) * cos + ops.cat((-odd, even), -1) * sin


def _to_tensor(array: np.ndarray) -> "mindspore.Tensor":
    mindspore = import_mindspore()
    return mindspore.Tensor(np.ascontiguousarray(array))


def rpe_forward_ms(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mode: ModeLike = 0) -> np.ndarray:
    """:func:`rpe_forward_tensor` on numpy arrays: numpy in, MindSpore inside, numpy out.

    ``cos`` and ``sin`` are cast to ``x``'s dtype first (MindSpore computes in that dtype,
    so float16 results may differ from the numpy kernel, which computes float16 in float32,
    by an ulp or so).

    Raises
    ------
    OpError
        As :func:`rpe_forward_tensor`.
    ExecutionError
        ``backend-unavailable`` without MindSpore.
    """
    x = np.asarray(x)
    cos, sin = np.asarray(cos, dtype=x.dtype), np.asarray(sin, dtype=x.dtype)
    mode = check_rpe_shapes(x.shape, cos.shape, sin.shape, mode)
    y = rpe_forward_tensor(_to_tensor(x), _to_tensor(cos), _to_tensor(sin), mode)
    return y.asnumpy()


def rpe_backward_ms(
    dy: np.ndarray, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mode: ModeLike = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dx, dcos, dsin)`` from MindSpore autodiff (``mindspore.vjp``) of :func:`rpe_forward_tensor`.

    MindSpore reduces the gradients of broadcast inputs to their own shapes, so ``dcos``
    and ``dsin`` have ``cos``'s and ``sin``'s shapes.  Everything is computed in ``x``'s
    dtype.

    Raises
    ------
    OpError
        As :func:`rpe_forward_tensor`; ``broadcast-shape`` when ``dy``'s shape is not ``x``'s.
    ExecutionError
        ``backend-unavailable`` without MindSpore.
    """
    x = np.asarray(x)
    dy = np.asarray(dy, dtype=x.dtype)
    cos, sin = np.asarray(cos, dtype=x.dtype), np.asarray(sin, dtype=x.dtype)
    mode = check_rpe_shapes(x.shape, cos.shape, sin.shape, mode)
    if dy.shape != x.shape:
        raise OpError(
            "broadcast-shape",
            f"dy shape {dy.shape} differs from x shape {x.shape}",
            hint="dy is the gradient of y, which has x's shape",
        )
    mindspore = import_mindspore()

    def forward(x_tensor, cos_tensor, sin_tensor):
        return rpe_forward_tensor(x_tensor, cos_tensor, sin_tensor, mode)

    _, vjp_fn = mindspore.vjp(forward, _to_tensor(x), _to_tensor(cos), _to_tensor(sin))
    dx, dcos, dsin = vjp_fn(_to_tensor(dy))
    return dx.asnumpy(), dcos.asnumpy(), dsin.asnumpy()
