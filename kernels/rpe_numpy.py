"""RotaryPositionEmbedding (RPE) in numpy: a readable reference and a fast blocked path.

The op is ``y = arrange(x) * cos + rotate(x) * sin`` over the last dim ``D`` of ``x``:

========  ===============  ===================================  ===========================
mode      name             ``rotate(x)``                        ``arrange(x)``
========  ===============  ===================================  ===========================
0         half             ``cat(-x2, x1)`` (halves)            ``x``
1         interleave       pair ``(a, b)`` becomes ``(-b, a)``  ``x``
2         quarter          ``cat(-q2, q1, -q4, q3)``            ``x``
3         interleave-half  ``cat(-o, e)``                       ``cat(e, o)``
========  ===============  ===================================  ===========================

with ``e = x[..., ::2]`` and ``o = x[..., 1::2]``.  Modes 0 to 2 are the classic form
``x * cos + rotate(x) * sin``; mode 3 first moves the even elements to the front half
and the odd ones to the back half (the CANN ``interleave-half`` mode), so it also needs
the permutation ``arrange``.  Both maps are *signed selections* (each output element is
plus or minus one input element), described by :class:`Piece` lists, so their
transposes are exact and cheap, and the backward is

``dx = arrange_t(dy * cos) + rotate_t(dy * sin)``,
``dcos = reduce(dy * arrange(x))``, ``dsin = reduce(dy * rotate(x))``

where ``reduce`` sums over the dims that ``cos`` / ``sin`` broadcast.

``cos`` and ``sin`` have the same shape; each dim is 1 or equal to ``x``'s, aligned from
the right (numpy broadcasting, lower rank allowed), and the last dim equals ``D``.
float16 inputs are computed in float32 and rounded once at the end; results have
``x``'s dtype.

Examples
--------
>>> import numpy as np
>>> x = np.array([1.0, 2.0, 3.0, 4.0])
>>> cos, sin = np.zeros(4), np.ones(4)
>>> rpe_forward(x, cos, sin, mode=0)
array([-3., -4.,  1.,  2.])
>>> rpe_forward(x, cos, sin, mode=1)
array([-2.,  1., -4.,  3.])
>>> rpe_forward(x, cos, sin, mode=3)
array([-2., -4.,  1.,  3.])
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import Union

import numpy as np

from layout_prop.core.errors import OpError

__all__ = [
    "MODE_NAMES",
    "SUPPORTED_DTYPES",
    "Piece",
    "normalize_mode",
    "check_rpe_shapes",
    "rotate",
    "rotate_t",
    "arrange",
    "arrange_t",
    "reduce_to_shape",
    "rpe_forward_reference",
    "rpe_forward",
    "rpe_backward",
]

MODE_NAMES: dict[int, str] = {0: "half", 1: "interleave", 2: "quarter", 3: "interleave-half"}
"""Rotation mode number to name (the names torch_npu / CANN use)."""

SUPPORTED_DTYPES: tuple[np.dtype, ...] = (np.dtype("float16"), np.dtype("float32"), np.dtype("float64"))

#: Bytes of ``x`` processed per block by :func:`rpe_forward`.  With the blocks in memory
#: order, longer blocks keep the one memory-bound pass per block streaming for longer and
#: cut the per-call overhead; that outweighs the in-cache passes spilling from a 1 MiB L2
#: to L3 (working set about five blocks).  On the 64 MiB float32 benchmark (2-core AMD
#: EPYC, 2026-12-04) mode 0 at 512 KiB was 0.00 to 0.08 (mostly about 0.04) of the copy
#: bandwidth above 128 KiB, at D = 64 and 128 and S = 300, 1024 and 4096; 256 KiB to
#: 1 MiB were close to each other, 64 KiB and 2 MiB slower.  No per-D choice: 512 KiB
#: was as good as any other size, within the noise, at both D.
DEFAULT_BLOCK_BYTES = 512 * 1024

ModeLike = Union[int, str]
_MODE_HELP = ", ".join(f"{number} ({name})" for number, name in MODE_NAMES.items())


# ----------------------------------------------------------------------------- validation


def normalize_mode(mode: ModeLike) -> int:
    """Return the rotation mode as an int in 0..3; names such as ``"half"`` are accepted.

    Raises
    ------
    OpError
        Code ``invalid-mode`` for anything else.

    Examples
    --------
    >>> normalize_mode(1), normalize_mode("interleave-half")
    (1, 3)
    >>> normalize_mode(7)
    Traceback (most recent call last):
        ...
    layout_prop.core.errors.OpError: invalid-mode: rotary mode must be one of 0 (half), 1 (interleave), 2 (quarter), 3 (interleave-half); got 7 (hint: use mode=0 for rotate_half (GPT-NeoX), mode=1 for rotate_interleaved (GPT-J))
    """
    if isinstance(mode, str):
        by_name = {name: number for number, name in MODE_NAMES.items()}
        if mode.lower() in by_name:
            return by_name[mode.lower()]
    elif isinstance(mode, (int, np.integer)) and not isinstance(mode, bool) and int(mode) in MODE_NAMES:
        return int(mode)
    raise OpError(
        "invalid-mode",
        f"rotary mode must be one of {_MODE_HELP}; got {mode!r}",
        hint="use mode=0 for rotate_half (GPT-NeoX), mode=1 for rotate_interleaved (GPT-J)",
    )


def check_rpe_shapes(
    x_shape: tuple[int, ...],
    cos_shape: tuple[int, ...],
    sin_shape: tuple[int, ...],
    mode: ModeLike,
) -> int:
    """Check that ``x``, ``cos`` and ``sin`` shapes fit the op; return the normalized mode.

    Raises
    ------
    OpError
        ``invalid-mode``; ``invalid-head-dim`` when ``D`` is odd (modes 0, 1, 3), not a
        multiple of 4 (mode 2) or ``x`` has no dims; ``broadcast-shape`` when ``cos`` and
        ``sin`` differ, have a higher rank than ``x``, a last dim other than ``D``, or a
        dim that is neither 1 nor ``x``'s.

    Examples
    --------
    >>> check_rpe_shapes((2, 4, 16, 64), (1, 1, 16, 64), (1, 1, 16, 64), "half")
    0
    >>> check_rpe_shapes((2, 4, 16, 64), (16, 32), (16, 32), 0)
    Traceback (most recent call last):
        ...
    layout_prop.core.errors.OpError: broadcast-shape: cos shape (16, 32) has last dim 32 but x shape (2, 4, 16, 64) has D=64 (hint: build cos and sin with the same head dim D as x)
    """
    mode = normalize_mode(mode)
    x_shape, cos_shape, sin_shape = tuple(x_shape), tuple(cos_shape), tuple(sin_shape)
    if len(x_shape) == 0:
        raise OpError(
            "invalid-head-dim",
            "x is a scalar (shape ()); the rotation needs a last dim D",
            hint="pass x with the head dim D last, e.g. shape (B, N, S, D)",
        )
    head_dim = x_shape[-1]
    divisor = 4 if mode == 2 else 2
    if head_dim % divisor != 0:
        kind = "a multiple of 4" if divisor == 4 else "even"
        raise OpError(
            "invalid-head-dim",
            f"mode {mode} ({MODE_NAMES[mode]}) needs the last dim D to be {kind}; "
            f"got D={head_dim} (x shape {x_shape})",
            hint="pad the head dim or pick a mode that fits it (quarter needs D % 4 == 0, the others D % 2 == 0)",
        )
    if cos_shape != sin_shape:
        raise OpError(
            "broadcast-shape",
            f"cos shape {cos_shape} and sin shape {sin_shape} differ",
            hint="build cos and sin from the same position table so that they have one shape",
        )
    if len(cos_shape) > len(x_shape):
        raise OpError(
            "broadcast-shape",
            f"cos shape {cos_shape} has rank {len(cos_shape)}, higher than x shape {x_shape} (rank {len(x_shape)})",
            hint="drop the extra leading size-1 dims of cos and sin",
        )
    if len(cos_shape) == 0 or cos_shape[-1] != head_dim:
        last = cos_shape[-1] if cos_shape else None
        raise OpError(
            "broadcast-shape",
            f"cos shape {cos_shape} has last dim {last} but x shape {x_shape} has D={head_dim}",
            hint="build cos and sin with the same head dim D as x",
        )
    offset = len(x_shape) - len(cos_shape)
    for axis, size in enumerate(cos_shape):
        expected = x_shape[offset + axis]
        if size not in (1, expected):
            raise OpError(
                "broadcast-shape",
                f"cos shape {cos_shape} does not broadcast to x shape {x_shape}: "
                f"dim {axis - len(cos_shape)} is {size}, expected 1 or {expected}",
                hint="give every dim of cos and sin the size of x's dim or 1 (broadcast), aligned from the right",
            )
    return mode


def _check_dtype(name: str, array: np.ndarray) -> None:
    if array.dtype not in SUPPORTED_DTYPES:
        raise OpError(
            "unsupported-dtype",
            f"{name} has dtype {array.dtype}; the numpy RPE kernel supports float16, float32, float64",
            hint="cast the inputs to a floating dtype (bfloat16 is not a numpy dtype: use float32)",
        )


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """float16 is computed in float32 (rounded once at the end), the others in themselves."""
    return np.dtype("float32") if dtype == np.float16 else dtype


# ----------------------------------------------------------------------- the linear maps


@dataclass(frozen=True)
class Piece:
    """One block of a signed selection along the last dim: ``out[..., dst] = sign * x[..., src]``.

    The pieces of one map cover every output position once and read every input position
    once, so the map is a signed permutation and its transpose swaps ``dst`` and ``src``.
    """

    dst: slice
    src: slice
    sign: int


@lru_cache(maxsize=None)
def _rotate_pieces(mode: int, head_dim: int) -> tuple[Piece, ...]:
    half, quarter = head_dim // 2, head_dim // 4
    if mode == 0:  # cat(-x2, x1)
        return (Piece(slice(0, half), slice(half, head_dim), -1), Piece(slice(half, head_dim), slice(0, half), +1))
    if mode == 1:  # (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])
        return (Piece(slice(0, None, 2), slice(1, None, 2), -1), Piece(slice(1, None, 2), slice(0, None, 2), +1))
    if mode == 2:  # cat(-q2, q1, -q4, q3)
        q = [slice(i * quarter, (i + 1) * quarter) for i in range(4)]
        return (Piece(q[0], q[1], -1), Piece(q[1], q[0], +1), Piece(q[2], q[3], -1), Piece(q[3], q[2], +1))
    # mode 3: cat(-o, e)
    return (Piece(slice(0, half), slice(1, None, 2), -1), Piece(slice(half, head_dim), slice(0, None, 2), +1))


@lru_cache(maxsize=None)
def _arrange_pieces(mode: int, head_dim: int) -> tuple[Piece, ...]:
    half = head_dim // 2
    if mode == 3:  # cat(e, o)
        return (Piece(slice(0, half), slice(0, None, 2), +1), Piece(slice(half, head_dim), slice(1, None, 2), +1))
    return (Piece(slice(0, head_dim), slice(0, head_dim), +1),)


def _select(pieces: tuple[Piece, ...], values: np.ndarray, transpose: bool) -> np.ndarray:
    result = np.empty_like(values)
    for piece in pieces:
        dst, src = (piece.src, piece.dst) if transpose else (piece.dst, piece.src)
        # negated by an assignment, not np.negative(..., out=result[..., dst]): numpy 2.4's
        # float32 negative reads a strided input as if contiguous when out is strided too
        # (a (1, 2, 1) column view came out as the wrong elements)
        result[..., dst] = -values[..., src] if piece.sign < 0 else values[..., src]
    return result


def _head_dim_for(values: np.ndarray, mode: ModeLike) -> tuple[int, int]:
    values_shape = np.shape(values)
    mode = check_rpe_shapes(values_shape, values_shape[-1:], values_shape[-1:], mode)
    return mode, values_shape[-1]


def rotate(x: np.ndarray, mode: ModeLike = 0) -> np.ndarray:
    """The rotation ``rotate(x)`` of ``y = arrange(x) * cos + rotate(x) * sin``.

    Examples
    --------
    >>> rotate(np.array([1, 2, 3, 4, 5, 6, 7, 8]), mode=2)
    array([-3, -4,  1,  2, -7, -8,  5,  6])
    """
    x = np.asarray(x)
    mode, head_dim = _head_dim_for(x, mode)
    return _select(_rotate_pieces(mode, head_dim), x, transpose=False)


def rotate_t(g: np.ndarray, mode: ModeLike = 0) -> np.ndarray:
    """The transpose of :func:`rotate` (also its inverse): ``rotate_t(rotate(x)) == x``.

    Examples
    --------
    >>> rotate_t(np.array([-3, -4, 1, 2]), mode=0)
    array([1, 2, 3, 4])
    """
    g = np.asarray(g)
    mode, head_dim = _head_dim_for(g, mode)
    return _select(_rotate_pieces(mode, head_dim), g, transpose=True)


def arrange(x: np.ndarray, mode: ModeLike = 0) -> np.ndarray:
    """The permutation multiplied by ``cos``: ``cat(e, o)`` in mode 3, ``x`` otherwise.

    Examples
    --------
    >>> arrange(np.array([1, 2, 3, 4]), mode=3)
    array([1, 3, 2, 4])
    """
    x = np.asarray(x)
    mode, head_dim = _head_dim_for(x, mode)
    return _select(_arrange_pieces(mode, head_dim), x, transpose=False)


def arrange_t(g: np.ndarray, mode: ModeLike = 0) -> np.ndarray:
    """The transpose of :func:`arrange` (re-interleaves in mode 3).

    Examples
    --------
    >>> arrange_t(np.array([1, 3, 2, 4]), mode=3)
    array([1, 2, 3, 4])
    """
    g = np.asarray(g)
    mode, head_dim = _head_dim_for(g, mode)
    return _select(_arrange_pieces(mode, head_dim), g, transpose=True)


def reduce_to_shape(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum a broadcast result ``g`` back to ``shape`` (the adjoint of numpy broadcasting).

    Examples
    --------
    >>> reduce_to_shape(np.ones((2, 3, 4)), (1, 4))
    array([[6., 6., 6., 6.]])
    """
    shape = tuple(shape)
    extra = g.ndim - len(shape)
    if extra > 0:
        g = g.sum(axis=tuple(range(extra)))
    summed = tuple(axis for axis, size in enumerate(shape) if size == 1 and g.shape[axis] != 1)
    if summed:
        g = g.sum(axis=summed, keepdims=True)
    return g


# ------------------------------------------------------------------------------ forward


def _prepare(x, cos, sin, mode: ModeLike) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Validate; return x, and cos / sin in the compute dtype with x's rank."""
    x, cos, sin = np.asarray(x), np.asarray(cos), np.asarray(sin)
    mode = check_rpe_shapes(x.shape, cos.shape, sin.shape, mode)
    for name, array in (("x", x), ("cos", cos), ("sin", sin)):
        _check_dtype(name, array)
    compute = _compute_dtype(x.dtype)
    lead = (1,) * (x.ndim - cos.ndim)
    cos = np.asarray(cos, dtype=compute).reshape(lead + cos.shape)
    sin = np.asarray(sin, dtype=compute).reshape(lead + sin.shape)
    return x, cos, sin, mode


def rpe_forward_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mode: ModeLike = 0) -> np.ndarray:
    """``arrange(x) * cos + rotate(x) * sin`` written plainly, with full-size temporaries.

    The readable definition that :func:`rpe_forward` is tested against.

    Examples
    --------
    >>> x = np.arange(1.0, 5.0, dtype=np.float32)
    >>> rpe_forward_reference(x, np.full(4, 0.5), np.full(4, 2.0), mode=0)
    array([-5.5, -7. ,  3.5,  6. ], dtype=float32)
    """
    x, cos, sin, mode = _prepare(x, cos, sin, mode)
    xc = x.astype(_compute_dtype(x.dtype), copy=False)
    y = arrange(xc, mode) * cos + rotate(xc, mode) * sin
    return y.astype(x.dtype, copy=False)


@lru_cache(maxsize=64)
def _blocks(shape: tuple[int, ...], itemsize: int, block_bytes: int) -> tuple[tuple, ...]:
    """Index tuples that tile ``shape`` into contiguous blocks of about ``block_bytes``.

    The outermost axis whose trailing sub-array fits ``block_bytes`` is cut into chunks
    and the axes before it are walked one index at a time, in memory order, so that the
    blocks follow each other in memory: one unbroken stream for the hardware prefetcher
    (walking chunk by chunk instead, to keep the rows of a (1, 1, S, D) cos / sin in the
    cache, jumps by a whole (S, D) slab between blocks: 0 to 6% slower on the 64 MiB
    benchmark at 128 KiB blocks, and it kept larger blocks from paying off).  The last
    dim (the rotation dim) is never cut.  The tuples depend on the shape only and are
    cached, so a call does not rebuild them.

    Examples
    --------
    >>> _blocks((2, 4, 8), itemsize=4, block_bytes=64)
    ((0, slice(0, 2, None)), (0, slice(2, 4, None)), (1, slice(0, 2, None)), (1, slice(2, 4, None)))
    """
    if len(shape) < 2 or prod(shape) * itemsize <= block_bytes:
        return ((Ellipsis,),)
    split_axis = len(shape) - 2
    for axis in range(len(shape) - 1):
        if prod(shape[axis + 1 :]) * itemsize <= block_bytes:
            split_axis = axis
            break
    row_bytes = prod(shape[split_axis + 1 :]) * itemsize
    chunk = max(1, block_bytes // max(row_bytes, 1))
    return tuple(
        outer + (slice(start, start + chunk),)
        for outer in np.ndindex(*shape[:split_axis])
        for start in range(0, shape[split_axis], chunk)
    )


def _copy_selected(pieces: tuple[Piece, ...], x: np.ndarray, out: np.ndarray) -> None:
    """``out[..., dst] = x[..., src]`` for every piece, signs ignored (they go into sin)."""
    for piece in pieces:
        np.copyto(out[..., piece.dst], x[..., piece.src])


#: :meth:`numpy.ndarray.take` copies items of up to 32 bytes with fixed-size moves and
#: larger ones with ``memmove``; taking the 128-byte halves of mode 0 whole is about 1.5x
#: slower here than taking them as four 32-byte runs.
_TAKE_RUN_BYTES = 32
#: Shorter runs (the single elements of modes 1 and 3) are moved faster by strided copies.
_MIN_TAKE_RUN_BYTES = 16


@lru_cache(maxsize=None)
def _take_plan(mode: int, head_dim: int, itemsize: int) -> tuple[int, np.ndarray] | None:
    """``(run, order)`` when the rotation moves whole runs of ``run`` elements, else None.

    With ``x`` viewed as ``(..., D // run, run)``, the rotation (signs ignored) is
    ``x.take(order, axis=-2)``: one call for a whole block, where strided copies of the
    32-element halves of mode 0 run numpy's inner loop once per half row.  ``run`` is
    the largest power of two of at most 32 bytes that fits; rotations that move single
    elements (modes 1 and 3) get None.

    Examples
    --------
    >>> _take_plan(0, head_dim=64, itemsize=4)
    (8, array([4, 5, 6, 7, 0, 1, 2, 3]))
    >>> _take_plan(2, head_dim=16, itemsize=4)
    (4, array([1, 0, 3, 2]))
    >>> _take_plan(1, head_dim=64, itemsize=4) is None
    True
    """
    source = np.empty(head_dim, np.intp)  # rotate(x)[..., j] = +-x[..., source[j]]
    for piece in _rotate_pieces(mode, head_dim):
        source[piece.dst] = np.arange(head_dim)[piece.src]
    run = _TAKE_RUN_BYTES // itemsize
    while run * itemsize >= _MIN_TAKE_RUN_BYTES:
        if head_dim % run == 0:
            runs = source.reshape(-1, run)
            if np.all(runs[:, :1] % run == 0) and np.all(runs == runs[:, :1] + np.arange(run)):
                order = runs[:, 0] // run
                order.flags.writeable = False  # cached: shared by every call
                return run, order
        run //= 2
    return None


def _sign_row(pieces: tuple[Piece, ...], head_dim: int, dtype: np.dtype) -> np.ndarray:
    """A length-``D`` vector holding each output position's sign."""
    signs = np.empty(head_dim, dtype)
    for piece in pieces:
        signs[piece.dst] = piece.sign
    return signs


def _scratch_view(buffer: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The start of a flat scratch ``buffer`` viewed with ``shape``."""
    return buffer[: prod(shape)].reshape(shape)


def _signed(sin_block: np.ndarray, signs: np.ndarray, buffer: np.ndarray) -> np.ndarray:
    """``sin_block * signs`` written into the start of the scratch ``buffer``."""
    return np.multiply(sin_block, signs, out=_scratch_view(buffer, sin_block.shape))


def _check_out(out: np.ndarray, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    if not isinstance(out, np.ndarray) or out.shape != x.shape or out.dtype != x.dtype:
        shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", type(out).__name__)
        raise OpError(
            "invalid-out",
            f"out must be an ndarray of x's shape {x.shape} and dtype {x.dtype}; got shape {shape}, dtype {dtype}",
            hint="pass out=numpy.empty_like(x) or leave out=None",
        )
    if not out.flags.writeable or any(np.may_share_memory(out, array) for array in (x, cos, sin)):
        raise OpError(
            "invalid-out",
            "out must be writable and must not overlap x, cos or sin (they are read after y is written)",
            hint="pass a separate buffer, e.g. out=numpy.empty_like(x)",
        )


def rpe_forward(
    x: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    mode: ModeLike = 0,
    *,
    out: np.ndarray | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> np.ndarray:
    """Rotary position embedding ``y = arrange(x) * cos + rotate(x) * sin`` (fast path).

    Processes ``x`` in cache-sized blocks along its leading dims and writes straight into
    the output, so no full-size temporary is created (``cos`` and ``sin`` are only copied
    at their own size: when their dtype differs from the compute dtype, and ``sin`` once
    with the rotation's signs folded in when it is broadcast; a ``sin`` as large as ``x``
    is signed block by block instead).  Per block: one multiply that streams ``x`` in and
    ``y`` out, the permutation into a scratch block, and two contiguous in-place passes
    inside the cache.  The permutation is one :meth:`numpy.ndarray.take` of 32-byte runs
    when the rotation moves whole runs (modes 0 and 2), strided copies otherwise.  The
    blocks are visited in memory order.  Tested equal to :func:`rpe_forward_reference`.

    Parameters
    ----------
    x : ndarray of float16, float32 or float64
        Input with the rotation dim ``D`` last (typically BNSD, BSND or 3-D).
    cos, sin : ndarray
        Same shape; each dim 1 or ``x``'s, aligned from the right; last dim ``D``.
    mode : int or str
        0 half, 1 interleave, 2 quarter, 3 interleave-half (see the module docstring).
    out : ndarray, optional
        Preallocated result of ``x``'s shape and dtype, not overlapping ``x``.
    block_bytes : int
        Bytes of ``x`` per block.

    Returns
    -------
    ndarray
        ``y``, with ``x``'s shape and dtype.

    Raises
    ------
    OpError
        ``invalid-mode``, ``invalid-head-dim``, ``broadcast-shape``, ``unsupported-dtype``
        or ``invalid-out``.

    Examples
    --------
    >>> x = np.arange(8.0).reshape(1, 2, 4)
    >>> angle = np.array([0.0, 0.0, np.pi / 2, np.pi / 2])
    >>> np.round(rpe_forward(x, np.cos(angle), np.sin(angle), mode=1), 6) + 0.0
    array([[[ 0.,  1., -3.,  2.],
            [ 4.,  5., -7.,  6.]]])
    """
    x, cos, sin, mode = _prepare(x, cos, sin, mode)
    if out is None:
        out = np.empty(x.shape, x.dtype)
    else:
        _check_out(out, x, cos, sin)
    if x.size == 0:
        return out
    compute = _compute_dtype(x.dtype)
    head_dim = x.shape[-1]
    arrange_pieces, rotate_pieces = _arrange_pieces(mode, head_dim), _rotate_pieces(mode, head_dim)
    arrange_is_identity = len(arrange_pieces) == 1  # modes 0-2: arrange(x) is x
    # The rotation's signs go into sin, so that rotate(x) * sin is a plain product of a
    # permuted x.  A broadcast sin (the usual (1, 1, S, D) table) is signed once, at its
    # own size; a sin as large as x is signed block by block into a scratch block, so
    # that no temporary of x's size is made.
    signs = _sign_row(rotate_pieces, head_dim, compute)
    sign_per_block = sin.size >= x.size
    if not sign_per_block:
        sin = np.multiply(sin, signs)
    cos_full, sin_full = np.broadcast_to(cos, x.shape), np.broadcast_to(sin, x.shape)

    # Modes 0 and 2 permute whole runs: every array is then viewed with the last dim
    # split into (D // run, run) (splitting one dim never copies, so writes through the
    # view of out land in out) and the permutation is one take along axis -2.  take
    # cannot convert, so float16 (computed in float32) uses the general loop.
    plan = _take_plan(mode, head_dim, compute.itemsize) if x.dtype == compute and arrange_is_identity else None
    x_view, out_view = x, out
    if plan is not None:
        run, take_order = plan
        split_shape = x.shape[:-1] + (head_dim // run, run)
        x_view, out_view = x.reshape(split_shape), out.reshape(split_shape)
        cos_full, sin_full = cos_full.reshape(split_shape), sin_full.reshape(split_shape)
        signs = signs.reshape(split_shape[-2:])

    blocks = _blocks(x.shape, compute.itemsize, block_bytes)
    block_elems = max(block_bytes // compute.itemsize, head_dim)  # a block holds at least one row
    scratch_elems = min(block_elems, x.size)
    permuted_buffer = np.empty(scratch_elems, compute)
    signed_sin_buffer = np.empty(scratch_elems, compute) if sign_per_block else None
    # Blocks follow each other in memory order; all but the last of each walked row of
    # blocks have one shape, so the scratch views are only rebuilt when it changes.
    block_shape = None

    if plan is not None:
        # The fast loop: four numpy calls per block, five when sin is signed per block
        # (out is passed positionally: keyword parsing is a measurable part of the
        # per-call cost at this block size).
        for index in blocks:
            x_block, out_block = x_view[index], out_view[index]
            if x_block.shape != block_shape:
                block_shape = x_block.shape
                permuted = _scratch_view(permuted_buffer, block_shape)
            signed_sin = _signed(sin_full[index], signs, signed_sin_buffer) if sign_per_block else sin_full[index]
            np.multiply(x_block, cos_full[index], out_block)  # the one pass that touches memory
            # rotate(x) without its signs; "clip" because the default "raise" buffers out
            x_block.take(take_order, -2, permuted, "clip")
            np.multiply(permuted, signed_sin, permuted)  # in place, in the cache
            np.add(out_block, permuted, out_block)  # in place, in the cache
        return out

    # The general loop: the permutations are strided copies, and float16 is computed in
    # a float32 block that is rounded into out at the end.
    writes_in_place = compute == x.dtype
    acc_buffer = None if writes_in_place else np.empty(scratch_elems, compute)
    for index in blocks:
        x_block, out_block = x_view[index], out_view[index]
        if x_block.shape != block_shape:
            block_shape = x_block.shape
            permuted = _scratch_view(permuted_buffer, block_shape)
            acc_scratch = None if writes_in_place else _scratch_view(acc_buffer, block_shape)
        signed_sin = _signed(sin_full[index], signs, signed_sin_buffer) if sign_per_block else sin_full[index]
        acc = out_block if writes_in_place else acc_scratch
        if arrange_is_identity:
            np.multiply(x_block, cos_full[index], out=acc)
        else:
            _copy_selected(arrange_pieces, x_block, permuted)
            np.multiply(permuted, cos_full[index], out=acc)
        _copy_selected(rotate_pieces, x_block, permuted)
        np.multiply(permuted, signed_sin, out=permuted)
        np.add(acc, permuted, out=acc)
        if not writes_in_place:
            np.copyto(out_block, acc, casting="same_kind")
    return out


# ----------------------------------------------------------------------------- backward


def rpe_backward(
    dy: np.ndarray, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mode: ModeLike = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of :func:`rpe_forward` given the output gradient ``dy``.

    ``dx = arrange_t(dy * cos) + rotate_t(dy * sin)`` (for modes 0 to 2 ``arrange_t`` is
    the identity, so ``dx = dy * cos + rotate_t(dy * sin)``); ``dcos = sum(dy * arrange(x))``
    and ``dsin = sum(dy * rotate(x))`` over the dims ``cos`` / ``sin`` broadcast, returned
    in their own shape.  All results have ``x``'s dtype.

    Raises
    ------
    OpError
        As :func:`rpe_forward`; ``broadcast-shape`` when ``dy``'s shape is not ``x``'s.

    Examples
    --------
    >>> x = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    >>> dx, dcos, dsin = rpe_backward(np.ones_like(x), x, np.zeros(4), np.ones(4), mode=0)
    >>> dx
    array([[ 1.,  1., -1., -1.],
           [ 1.,  1., -1., -1.]])
    >>> dcos, dsin
    (array([ 6.,  8., 10., 12.]), array([-10., -12.,   6.,   8.]))
    """
    cos_shape, sin_shape = np.shape(cos), np.shape(sin)
    x, cos, sin, mode = _prepare(x, cos, sin, mode)
    dy = np.asarray(dy)
    if dy.shape != x.shape:
        raise OpError(
            "broadcast-shape",
            f"dy shape {dy.shape} differs from x shape {x.shape}",
            hint="dy is the gradient of y, which has x's shape",
        )
    _check_dtype("dy", dy)
    compute = _compute_dtype(x.dtype)
    dyc, xc = dy.astype(compute, copy=False), x.astype(compute, copy=False)
    dx = arrange_t(dyc * cos, mode) + rotate_t(dyc * sin, mode)
    dcos = reduce_to_shape(dyc * arrange(xc, mode), cos_shape)
    dsin = reduce_to_shape(dyc * rotate(xc, mode), sin_shape)
    return tuple(g.astype(x.dtype, copy=False) for g in (dx, dcos, dsin))
