"""The bounds both model readers (ONNX and MindIR) hold a model's tensors to, and the one
conversion of a tensor's stored data into an array.

A model file is untrusted input: a tensor's dims may be negative, too many for numpy or
astronomically large, and its data may not fit them.  Every check here runs on the dims and
the data's length alone, before anything is allocated, and a failure is a ``bad-model``
:class:`~layout_prop.core.errors.SpecError` naming the tensor (``too-large`` for a constant the
reader would compute or fill past :data:`MAX_CONSTANT_ELEMENTS`):

- :func:`tensor_dims`: at most :data:`~layout_prop.core.mesh.MAX_TENSOR_RANK` dims, none negative;
- :func:`from_bytes` / :func:`from_values`: the data holds exactly what the dims and data type
  take (dims x element size bytes, or dims values), then it is reshaped;
- :func:`unread`: a tensor whose data is not read (kept outside the file, or not saved) is a
  read-only array of zeros that takes no memory, of at most :data:`MAX_TENSOR_BYTES`;
- :func:`zeros` and :func:`check_constant_size`: a constant the reader computes (ONNX's
  folding) or fills (a MindIR constant saved without data) holds at most
  :data:`MAX_CONSTANT_ELEMENTS`, refused before it is allocated.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from layout_prop.core.errors import SpecError, cut
from layout_prop.core.mesh import MAX_TENSOR_RANK

__all__ = ["MAX_CONSTANT_ELEMENTS", "MAX_TENSOR_BYTES", "tensor_dims", "misfit", "check_fits", "from_bytes",
           "from_values", "unread", "zeros", "check_constant_size", "constant_too_large"]

#: the most elements a constant the importer computes or fills may hold (at most 128 MiB of
#: int64): shapes, indices, small tables and masks up to 4096 x 4096
MAX_CONSTANT_ELEMENTS = 2 ** 24

#: the most bytes a tensor's dims may describe: numpy's byte offsets are 64-bit integers (a
#: tensor this large is never allocated: only its shape and data type are used)
MAX_TENSOR_BYTES = 2 ** 62


def _bad(message: str, source: str, hint: str) -> SpecError:
    return SpecError("bad-model", message[:600], path=source, hint=hint)


def tensor_dims(dims: Sequence[int], what: str, source: str, hint: str) -> tuple[int, ...]:
    """``dims`` as a tuple: ``bad-model`` for more than :data:`MAX_TENSOR_RANK` dims or a negative one."""
    if len(dims) > MAX_TENSOR_RANK:
        raise _bad(f"{what} has {len(dims)} dims, over the {MAX_TENSOR_RANK} a tensor may have", source, hint)
    dims = tuple(int(d) for d in dims)
    if any(d < 0 for d in dims):
        raise _bad(f"{what} has negative dims {cut(list(dims))}", source, hint)
    return dims


def misfit(what: str, dims: Sequence[int], dtype, why: str, source: str, hint: str) -> SpecError:
    """The one ``bad-model`` of a tensor whose data does not fit its dims and data type."""
    name = "string" if np.dtype(dtype).kind == "O" else np.dtype(dtype)  # onnx gives strings as objects
    return _bad(f"{what} has data that does not fit its dims {cut(list(dims))} and data type {name} ({why})",
                source, hint)


def check_fits(what: str, dims: tuple[int, ...], dtype, count: int, source: str, hint: str, *,
               unit: str = "bytes", bits: int | None = None) -> None:
    """``count`` bytes (or values, ``unit="values"``) are exactly what ``dims`` of ``dtype`` take;
    ``bits`` per element for packed types (ONNX's 4-bit ones), else the dtype's size."""
    elements = math.prod(dims)
    if unit == "values":
        need = elements
    else:
        need = -(-elements * (bits or np.dtype(dtype).itemsize * 8) // 8)
    if count != need:
        raise misfit(what, dims, dtype, f"{count:,} {unit} given, {need:,} needed", source, hint)


def from_bytes(raw: bytes, dims: Sequence[int], dtype, what: str, source: str, hint: str) -> np.ndarray:
    """A tensor's raw data (little-endian, as both formats store it) as an array of its own."""
    dims = tensor_dims(dims, what, source, hint)
    dtype = np.dtype(dtype).newbyteorder("<")
    check_fits(what, dims, dtype, len(raw), source, hint)
    return np.frombuffer(raw, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


def from_values(values: Sequence, dims: Sequence[int], dtype, what: str, source: str, hint: str) -> np.ndarray:
    """A tensor's typed values (a protobuf repeated field) as an array."""
    dims = tensor_dims(dims, what, source, hint)
    check_fits(what, dims, dtype, len(values), source, hint, unit="values")
    try:
        return np.asarray(values, dtype=dtype).reshape(dims)
    except (ValueError, TypeError, OverflowError) as exc:  # 300 as int8, a float as bool...
        raise misfit(what, dims, dtype, str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                     source, hint) from None


def unread(dims: Sequence[int], dtype, what: str, source: str, hint: str) -> np.ndarray:
    """A tensor whose data is not read: zeros of its shape that take no memory (read-only)."""
    dims = tensor_dims(dims, what, source, hint)
    dtype = np.dtype(dtype)
    size = math.prod(dims) * dtype.itemsize
    if size > MAX_TENSOR_BYTES:
        raise _bad(f"{what} has dims {cut(list(dims))} of {dtype}: {size:,} bytes, over the {MAX_TENSOR_BYTES:,} "
                   "(2^62) a tensor may take", source, hint)
    return np.broadcast_to(np.zeros((), dtype), dims)


def constant_too_large(subject: str, shape: Sequence[int], kind: str, source: str, hint: str) -> SpecError:
    """``too-large``: ``{subject} would give shape ... (N elements), over the ... elements {kind} may hold``."""
    return SpecError("too-large", f"{subject} would give shape {cut(list(shape))} ({math.prod(shape):,} elements), "
                     f"over the {MAX_CONSTANT_ELEMENTS:,} (2^24) elements {kind} may hold", path=source, hint=hint)


def check_constant_size(shape: Sequence[int], subject: str, kind: str, source: str, hint: str) -> None:
    """Refuse (:func:`constant_too_large`) a computed constant of ``shape`` over :data:`MAX_CONSTANT_ELEMENTS`."""
    if math.prod(shape) > MAX_CONSTANT_ELEMENTS:
        raise constant_too_large(subject, shape, kind, source, hint)


def zeros(dims: Sequence[int], dtype, what: str, source: str, hint: str) -> np.ndarray:
    """The zeros a tensor saved without data stands for, made by the reader: at most
    :data:`MAX_CONSTANT_ELEMENTS`, refused (``too-large``) before they are allocated."""
    dims = tensor_dims(dims, what, source, hint)
    check_constant_size(dims, f"{what} is saved without data: filling it with zeros", "a filled constant", source,
                        hint)
    return np.zeros(dims, dtype=dtype)
