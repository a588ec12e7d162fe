"""RotaryPositionEmbedding on Ascend: the CANN kernel through ``mindspore.ops.rotary_position_embedding``.

The CANN kernel accepts only some local shapes.  :func:`check_cann_constraints` checks
them on any machine (it needs no device), so a lowering pass can decide per rank whether
the fused kernel may run or a composed fallback is needed.  The limits come from these
documents (the numbers are repeated next to each check below):

[MS]   MindSpore API ``mindspore.ops.rotary_position_embedding`` (docs r2.4 to master,
       and the docstring of the installed 2.10.0 in
       ``mindspore/ops/auto_generate/gen_ops_def.py``): x 4-D float16/bfloat16/float32;
       half: D < 896 and even, B, N < 1000, cos 11SD/B1SD/BNSD (BNSD x), 1S1D/BS1D/BSND
       (BSND x), S11D/SB1D/SBND (SBND x); interleave: cos only 11SD/1S1D/S11D; modes 0
       and 1 only; a note that BNSD with B*N > 8S "performs poorly ... cannot be called".
[OPS]  CANN ops-transformer ``posembedding/rotary_position_embedding/README.md`` and
       ``posembedding/rotary_position_embedding_grad/README.md`` (Ascend's open kernel
       sources; Atlas A2/A3): D < 896 and even; half: B, N < 1000; interleave: B*N < 1000
       and cos 11SD-style only; grad: B*N <= 1024 when dcos/dsin are computed, and cos
       B1SD (BS1D) needs B < S.  Quarter (2) and interleave-half (3) exist only on
       "Ascend 910_95", with D <= 1024 (D % 4 == 0 for quarter) and cos one of
       (1,1,1,D), (B,S,N,D), (B,1,N,D), (B,S,1,D), (1,1,N,D), (1,S,1,D), (B,1,1,D).
[NPU]  torch_npu 7.0.0 ``torch_npu.npu_rotary_mul`` (hiascend ptaoplist_001217):
       the same A2/A3 half-mode limits, "B*N <= 1024 when the cos/sin gradients are
       needed", and a performance note for BNSD with D not 32-byte aligned.

Where they disagree the stricter limit is used (interleave: [OPS] B*N < 1000 rather than
[MS] B, N < 1000).  The B*N > 8S note and the 32-byte note are performance advice, not
limits in [OPS]: they are returned as advisories, not raised.

Examples
--------
>>> check_cann_constraints((2, 8, 128, 64), (1, 1, 128, 64), mode=0)
[]
>>> check_cann_constraints((2, 8, 128, 63), (1, 1, 128, 63), mode=0)
Traceback (most recent call last):
    ...
layout_prop.core.errors.ExecutionError: kernel-constraint: CANN RotaryPositionEmbedding needs D even and D < 896 on Atlas A2/A3; got D=63 (x shape (2, 8, 128, 63)) (hint: use the composed numpy / mindspore kernel for this shard)
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np

from layout_prop.core.errors import ExecutionError, OpError

from .rpe_numpy import MODE_NAMES, ModeLike, normalize_mode
from .rpe_mindspore import import_mindspore

__all__ = [
    "CANN_LAYOUTS",
    "CANN_PLATFORMS",
    "cann_available",
    "check_cann_constraints",
    "rpe_forward_cann",
    "rpe_backward_cann",
]

CANN_LAYOUTS: tuple[str, ...] = ("BNSD", "BSND", "SBND")
"""The x layouts the kernel accepts ([MS], [OPS])."""

CANN_PLATFORMS: tuple[str, ...] = ("A2", "A3", "910_95")
"""Atlas A2 / A3 training series (modes 0, 1) and Ascend 910_95 (modes 0 to 3), per [OPS]."""

_CANN_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}  # x dtypes [MS], [OPS]
_HEAD_DIM_LIMIT_A2 = 896  # D < 896 [MS], [OPS], [NPU]
_HEAD_DIM_LIMIT_910_95 = 1024  # D <= 1024 [OPS, 910_95]
_BATCH_HEADS_LIMIT = 1000  # half: B < 1000 and N < 1000; interleave: B * N < 1000 [OPS]
_DCOS_BATCH_HEADS_LIMIT = 1024  # grad half: B * N <= 1024 when dcos/dsin are needed [OPS], [NPU]
_FALLBACK_HINT = "use the composed numpy / mindspore kernel for this shard"

# cos/sin layouts per x layout, half mode [MS], [OPS]; interleave allows only the first.
_HALF_COS_LAYOUTS = {
    "BNSD": ("11SD", "B1SD", "BNSD"),
    "BSND": ("1S1D", "BS1D", "BSND"),
    "SBND": ("S11D", "SB1D", "SBND"),
}
# The cos/sin layouts whose gradient kernel needs B < S [OPS grad README].
_GRAD_NEEDS_B_LESS_THAN_S = ("B1SD", "BS1D")
# 910_95: which of cos's first three dims may be 1 (True) instead of x's ([OPS]).
_COS_PATTERNS_910_95 = (
    (True, True, True),
    (False, False, False),
    (False, True, False),
    (False, False, True),
    (True, True, False),
    (True, False, True),
    (False, True, True),
)


# ------------------------------------------------------------------------------ device


def cann_available() -> bool:
    """True when MindSpore runs on an Ascend device (so the CANN kernel can be called).

    Never raises: a missing MindSpore, a CPU / GPU device target or a failing device
    query all give False.  The device target is read first, so that on CPU MindSpore's
    Ascend plugin is never probed.

    Examples
    --------
    >>> isinstance(cann_available(), bool)
    True
    """
    try:
        mindspore = import_mindspore()
        if mindspore.get_context("device_target") != "Ascend":
            return False
        return bool(mindspore.hal.is_available("Ascend"))
    except Exception:
        return False


def _require_ascend() -> None:
    if cann_available():
        return
    try:
        target = import_mindspore().get_context("device_target")
        reason = f"MindSpore's device target is {target!r}"
        if target == "Ascend":
            reason += " but no Ascend device answers"
    except Exception:
        reason = "MindSpore is not usable here"
    raise ExecutionError(
        "backend-unavailable",
        f"no Ascend device for the CANN RotaryPositionEmbedding kernel: {reason}",
        hint="run on an Ascend host with MindSpore's Ascend package, or use --backend numpy or mindspore",
    )


# ------------------------------------------------------------------------ constraints


def _constraint(message: str, hint: str = _FALLBACK_HINT) -> ExecutionError:
    return ExecutionError("kernel-constraint", f"CANN RotaryPositionEmbedding {message}", hint=hint)


def _layout_shape(layout: str, sizes: dict[str, int]) -> tuple[int, ...]:
    """The shape that a ``"B1SD"``-style layout name gives (a ``1`` is a size-1 dim)."""
    return tuple(1 if letter == "1" else sizes[letter] for letter in layout)


def _check_cos_layout_a2(
    x_layout: str, sizes: dict[str, int], cos_shape: tuple[int, ...], mode: int, backward: bool
) -> None:
    allowed = _HALF_COS_LAYOUTS[x_layout] if mode == 0 else _HALF_COS_LAYOUTS[x_layout][:1]
    shapes = {name: _layout_shape(name, sizes) for name in allowed}
    matches = [name for name, shape in shapes.items() if shape == cos_shape]
    if not matches:
        x_shape = _layout_shape(x_layout, sizes)
        options = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        hint = (
            f"broadcast cos/sin over B and N (layout {allowed[0]}), use mode 0, or {_FALLBACK_HINT}"
            if mode == 1
            else f"shard cos/sin like x on B and N or broadcast them ({allowed[0]}), or {_FALLBACK_HINT}"
        )
        raise _constraint(
            f"mode {mode} ({MODE_NAMES[mode]}) with x {x_layout} shape {x_shape} accepts cos/sin layouts "
            f"{options}; got cos shape {cos_shape}",
            hint=hint,
        )
    # A cos that matches only a "needs B < S" layout (not also 11SD / 1S1D, as when B == 1).
    if backward and mode == 0 and all(name in _GRAD_NEEDS_B_LESS_THAN_S for name in matches):
        if not sizes["B"] < sizes["S"]:
            raise _constraint(
                f"gradient with cos/sin layout {matches[0]} {cos_shape} needs B < S; "
                f"got B={sizes['B']}, S={sizes['S']}",
                hint=f"broadcast cos/sin over B, or {_FALLBACK_HINT}",
            )


def _check_a2(
    x_layout: str, x_shape: tuple[int, ...], cos_shape: tuple[int, ...], mode: int, backward: bool, need_dcos: bool
) -> None:
    if mode in (2, 3):
        raise _constraint(
            f"mode {mode} ({MODE_NAMES[mode]}) runs only on Ascend 910_95; Atlas A2/A3 support modes 0 and 1",
            hint="pass platform='910_95' on that chip, or " + _FALLBACK_HINT,
        )
    head_dim = x_shape[-1]
    if not (head_dim < _HEAD_DIM_LIMIT_A2 and head_dim % 2 == 0):
        raise _constraint(
            f"needs D even and D < {_HEAD_DIM_LIMIT_A2} on Atlas A2/A3; got D={head_dim} (x shape {x_shape})"
        )
    sizes = dict(zip(x_layout, x_shape))
    batch, heads = sizes["B"], sizes["N"]
    if mode == 0 and not (batch < _BATCH_HEADS_LIMIT and heads < _BATCH_HEADS_LIMIT):
        raise _constraint(
            f"mode 0 (half) needs B < {_BATCH_HEADS_LIMIT} and N < {_BATCH_HEADS_LIMIT}; "
            f"got B={batch}, N={heads} (x {x_layout} shape {x_shape})",
            hint="shard B or N over more devices, or " + _FALLBACK_HINT,
        )
    if mode == 1 and not batch * heads < _BATCH_HEADS_LIMIT:
        raise _constraint(
            f"mode 1 (interleave) needs B*N < {_BATCH_HEADS_LIMIT}; got B*N={batch}*{heads}={batch * heads} "
            f"(x {x_layout} shape {x_shape})",
            hint="shard B or N over more devices, or " + _FALLBACK_HINT,
        )
    if backward and need_dcos and mode == 0 and batch * heads > _DCOS_BATCH_HEADS_LIMIT:
        raise _constraint(
            f"gradient with dcos/dsin needs B*N <= {_DCOS_BATCH_HEADS_LIMIT}; got B*N={batch}*{heads}={batch * heads} "
            f"(x {x_layout} shape {x_shape})",
            hint="shard B or N over more devices, mark cos/sin requires_grad=false, or " + _FALLBACK_HINT,
        )
    _check_cos_layout_a2(x_layout, sizes, cos_shape, mode, backward)


def _check_910_95(x_shape: tuple[int, ...], cos_shape: tuple[int, ...], mode: int) -> None:
    head_dim = x_shape[-1]
    divisor = 4 if mode == 2 else 2
    if not (head_dim <= _HEAD_DIM_LIMIT_910_95 and head_dim % divisor == 0):
        raise _constraint(
            f"needs D <= {_HEAD_DIM_LIMIT_910_95} and D % {divisor} == 0 for mode {mode} ({MODE_NAMES[mode]}) "
            f"on Ascend 910_95; got D={head_dim} (x shape {x_shape})"
        )
    for pattern in _COS_PATTERNS_910_95:
        expected = tuple(1 if is_one else size for is_one, size in zip(pattern, x_shape[:3])) + (head_dim,)
        if cos_shape == expected:
            return
    raise _constraint(
        f"on Ascend 910_95 needs cos/sin's first three dims to be all 1, all x's, or x's dim 0 with one of "
        f"dims 1, 2 at 1, or exactly one of them x's and the others 1; got cos shape {cos_shape} for x shape {x_shape}",
        hint="broadcast or shard cos/sin differently, or " + _FALLBACK_HINT,
    )


def _dtype_name(dtype: Union[str, np.dtype]) -> str:
    if str(dtype) == "bfloat16":  # not a numpy dtype
        return "bfloat16"
    return np.dtype(dtype).name


def _advisories(x_layout: str, x_shape: tuple[int, ...], mode: int, dtype: Optional[str]) -> list[str]:
    sizes = dict(zip(x_layout, x_shape))
    notes = []
    if x_layout == "BNSD" and sizes["B"] * sizes["N"] > 8 * sizes["S"]:
        notes.append(
            f"BNSD with B*N={sizes['B'] * sizes['N']} > 8*S={8 * sizes['S']}: MindSpore's documentation says "
            "the kernel performs poorly here and should not be called"
        )
    if dtype is not None and x_layout == "BNSD" and mode == 0:
        row_bytes = sizes["D"] * _CANN_ITEMSIZE[dtype]
        if row_bytes % 32 != 0:
            notes.append(
                f"BNSD half mode with D={sizes['D']} ({row_bytes} bytes, not 32-byte aligned): torch_npu "
                "documents a possible slowdown"
            )
    return notes


def check_cann_constraints(
    x_shape: tuple[int, ...],
    cos_shape: tuple[int, ...],
    mode: ModeLike,
    input_layout: str = "BNSD",
    backward: bool = False,
    need_dcos: bool = False,
    *,
    platform: str = "A2",
    dtype: Union[str, np.dtype, None] = None,
) -> list[str]:
    """Check one rank's LOCAL shapes against the CANN RotaryPositionEmbedding kernel's limits.

    Parameters
    ----------
    x_shape, cos_shape : tuple of int
        Local shapes of ``x`` and ``cos`` (``sin`` has ``cos``'s shape).
    mode : int or str
        0 half, 1 interleave, 2 quarter, 3 interleave-half.
    input_layout : {"BNSD", "BSND", "SBND"}
        How ``x``'s four dims are to be read.
    backward : bool
        Whether the gradient kernel will run too.
    need_dcos : bool
        Whether the gradient of ``cos`` / ``sin`` is needed (only with ``backward``).
    platform : {"A2", "A3", "910_95"}
        The chip: Atlas A2/A3 training series or Ascend 910_95 ([OPS]).
    dtype : str, optional
        ``x``'s dtype; checked when given (float16, bfloat16, float32).

    Returns
    -------
    list of str
        Performance advisories from the documentation (empty when none apply).

    Raises
    ------
    ExecutionError
        ``no-backward-kernel`` for a backward of modes 2 and 3; ``kernel-constraint`` naming
        the shape and the limit otherwise.
    OpError
        ``invalid-mode``; ``invalid-platform`` for an unknown ``platform``.

    Examples
    --------
    >>> check_cann_constraints((2, 128, 8, 64), (1, 128, 1, 64), 0, "BSND", backward=True, need_dcos=True)
    []
    >>> check_cann_constraints((32, 33, 128, 64), (1, 1, 128, 64), 0, backward=True, need_dcos=True)
    Traceback (most recent call last):
        ...
    layout_prop.core.errors.ExecutionError: kernel-constraint: CANN RotaryPositionEmbedding gradient with dcos/dsin needs B*N <= 1024; got B*N=32*33=1056 (x BNSD shape (32, 33, 128, 64)) (hint: shard B or N over more devices, mark cos/sin requires_grad=false, or use the composed numpy / mindspore kernel for this shard)
    """
    mode = normalize_mode(mode)
    x_shape, cos_shape = tuple(int(size) for size in x_shape), tuple(int(size) for size in cos_shape)
    if backward and mode in (2, 3):
        raise ExecutionError(
            "no-backward-kernel",
            f"CANN RotaryPositionEmbedding has no gradient kernel for mode {mode} ({MODE_NAMES[mode]}) here; "
            f"x shape {x_shape}",
            hint="run the backward with the numpy / mindspore kernel, or use mode 0 or 1",
        )
    chip = str(platform).upper()
    if chip not in CANN_PLATFORMS:
        raise OpError(
            "invalid-platform",
            f"platform must be one of {', '.join(CANN_PLATFORMS)}; got {platform!r}",
            hint="A2/A3 for Atlas A2/A3 training series, 910_95 for Ascend 910_95",
        )
    if input_layout not in CANN_LAYOUTS:
        raise _constraint(
            f"accepts x layouts {', '.join(CANN_LAYOUTS)}; got input_layout {input_layout!r}",
            hint="transpose x to BNSD, BSND or SBND",
        )
    if len(x_shape) != 4 or len(cos_shape) != 4:
        raise _constraint(
            f"needs 4-D x, cos and sin; got x shape {x_shape}, cos shape {cos_shape}",
            hint="reshape to 4-D (insert a size-1 N or B dim), or " + _FALLBACK_HINT,
        )
    dtype_name = None if dtype is None else _dtype_name(dtype)
    if dtype_name is not None and dtype_name not in _CANN_ITEMSIZE:
        raise _constraint(
            f"supports float16, bfloat16, float32; got dtype {dtype_name} (x shape {x_shape})",
            hint="cast to float32 (or float16 / bfloat16), or " + _FALLBACK_HINT,
        )
    if cos_shape[-1] != x_shape[-1]:
        raise _constraint(f"needs cos's last dim equal to D={x_shape[-1]}; got cos shape {cos_shape}")
    if chip == "910_95":
        _check_910_95(x_shape, cos_shape, mode)
    else:
        _check_a2(input_layout, x_shape, cos_shape, mode, backward, need_dcos)
    return _advisories(input_layout, x_shape, mode, dtype_name)


# ----------------------------------------------------------------------------- kernels


def _tensors(*arrays: np.ndarray):
    mindspore = import_mindspore()
    return tuple(mindspore.Tensor(np.ascontiguousarray(array)) for array in arrays)


def rpe_forward_cann(
    x: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    mode: ModeLike = 0,
    *,
    input_layout: str = "BNSD",
    platform: str = "A2",
) -> np.ndarray:
    """``mindspore.ops.rotary_position_embedding`` (the CANN kernel) on numpy arrays.

    Raises
    ------
    ExecutionError
        ``backend-unavailable`` without an Ascend device; ``kernel-constraint`` for shapes
        the kernel does not accept (see :func:`check_cann_constraints`).
    """
    _require_ascend()
    x = np.asarray(x)
    cos, sin = np.asarray(cos, dtype=x.dtype), np.asarray(sin, dtype=x.dtype)
    mode = normalize_mode(mode)
    if cos.shape != sin.shape:
        raise _constraint(f"needs cos and sin of one shape; got {cos.shape} and {sin.shape}")
    check_cann_constraints(x.shape, cos.shape, mode, input_layout, platform=platform, dtype=x.dtype)
    ops = import_mindspore().ops
    return ops.rotary_position_embedding(*_tensors(x, cos, sin), mode).asnumpy()


def rpe_backward_cann(
    dy: np.ndarray,
    x: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    mode: ModeLike = 0,
    *,
    need_dcos: bool = True,
    input_layout: str = "BNSD",
    platform: str = "A2",
) -> tuple[np.ndarray, Optional[np.ndarray], Optional[np.ndarray]]:
    """``(dx, dcos, dsin)`` through MindSpore autodiff of the CANN kernel (RotaryPositionEmbeddingGrad).

    With ``need_dcos=False`` only ``dx`` is computed and ``dcos``, ``dsin`` are None.

    Raises
    ------
    ExecutionError
        ``backend-unavailable``, ``no-backward-kernel`` or ``kernel-constraint``.
    """
    _require_ascend()
    x = np.asarray(x)
    dy = np.asarray(dy, dtype=x.dtype)
    cos, sin = np.asarray(cos, dtype=x.dtype), np.asarray(sin, dtype=x.dtype)
    mode = normalize_mode(mode)
    if cos.shape != sin.shape or dy.shape != x.shape:
        raise _constraint(
            f"needs cos and sin of one shape and dy of x's shape; got cos {cos.shape}, sin {sin.shape}, "
            f"dy {dy.shape}, x {x.shape}"
        )
    check_cann_constraints(
        x.shape, cos.shape, mode, input_layout, backward=True, need_dcos=need_dcos, platform=platform, dtype=x.dtype
    )
    mindspore = import_mindspore()
    x_t, cos_t, sin_t, dy_t = _tensors(x, cos, sin, dy)
    if need_dcos:
        _, vjp_fn = mindspore.vjp(
            lambda a, c, s: mindspore.ops.rotary_position_embedding(a, c, s, mode), x_t, cos_t, sin_t
        )
        dx, dcos, dsin = vjp_fn(dy_t)
        return dx.asnumpy(), dcos.asnumpy(), dsin.asnumpy()
    _, vjp_fn = mindspore.vjp(lambda a: mindspore.ops.rotary_position_embedding(a, cos_t, sin_t, mode), x_t)
    grads = vjp_fn(dy_t)
    dx = grads[0] if isinstance(grads, (tuple, list)) else grads
    return dx.asnumpy(), None, None
