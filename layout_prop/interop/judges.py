"""numpy kernels and checks for the upstream ops layout-prop's registry has no op for.

An audit case (:mod:`.cases`) names one of these in ``kernel`` to execute an upstream op
(a comparison, a logical op, ``Log``, ``Square``, ``abs``, a Python-scalar form, ``Tile``,
``all``, ``Slice`` with its begin and end) on one device and on every rank's local piece;
the layout-prop rule beside it (when the case names one) is a stand-in of the same
sharding behaviour, used only to say whether a refusal is over-strict.  Each kernel is the
plain numpy function: it knows no mesh, as layout-prop's own kernels do not.

``CHECKS`` hold the judges of random ops by their invariants rather than by value: the
assembled samples have one device's shape, lie in the support (a class of positive weight)
and, drawn without replacement, are distinct within a row; replicas must agree (the
assembly checks that).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

__all__ = ["KERNELS", "CHECKS", "kernel", "check"]


def _reduce_all(x, dims=None, keepdim=False):
    axis = None if dims is None else tuple(int(d) for d in dims)
    return np.all(np.asarray(x), axis=axis, keepdims=bool(keepdim))


def _slice(x, begin, end):
    return np.asarray(x)[tuple(slice(int(b), int(e)) for b, e in zip(begin, end))]


KERNELS: dict[str, Callable] = {
    "greater_equal": lambda x, y: np.greater_equal(x, y),
    "greater": lambda x, y: np.greater(x, y),
    "less_equal": lambda x, y: np.less_equal(x, y),
    "less": lambda x, y: np.less(x, y),
    "equal": lambda x, y: np.equal(x, y),
    "not_equal": lambda x, y: np.not_equal(x, y),
    "logical_or": lambda x, y: np.logical_or(x, y),
    "logical_and": lambda x, y: np.logical_and(x, y),
    "logical_not": lambda x: np.logical_not(x),
    "floor_div": lambda x, y: np.floor_divide(x, y),
    "mod": lambda x, y: np.fmod(x, y),
    "log": lambda x: np.log(x),
    "square": lambda x: np.square(x),
    "abs": lambda x: np.abs(x),
    "add_scalar": lambda x, value: np.asarray(x) + value,
    "sub_scalar": lambda x, value: np.asarray(x) - value,
    "rsub_scalar": lambda x, value: value - np.asarray(x),
    "tile": lambda x, reps: np.tile(x, tuple(reps)),
    "all": _reduce_all,
    "slice_begin_end": _slice,
    "expand_as": lambda x, other: np.broadcast_to(x, np.shape(other)).copy(),
}


def _multinomial_invariants(got: np.ndarray, inputs, attrs) -> str | None:
    probs = np.asarray(inputs[0], dtype=np.float64)
    want = probs.shape[:-1] + (int(attrs["num_samples"]),)
    if got.shape != want:
        return f"assembled shape {list(got.shape)}, one device {list(want)}"
    if got.dtype.kind not in "iu":
        return f"samples of dtype {got.dtype}, not integer class indices"
    classes = probs.shape[-1]
    rows_w = probs.reshape(-1, classes)
    rows_s = got.reshape(-1, want[-1])
    for r, (w, s) in enumerate(zip(rows_w, rows_s)):
        if ((s < 0) | (s >= classes)).any():
            return f"row {r}: a sample outside the {classes} classes: {s.tolist()}"
        if (w[s] <= 0).any():
            return f"row {r}: a sample of a class whose weight is not positive: {s.tolist()}"
        if not attrs.get("replacement", False) and len(set(s.tolist())) != len(s):
            return f"row {r}: repeated samples drawn without replacement: {s.tolist()}"
    return None


CHECKS: dict[str, Callable] = {"multinomial_invariants": _multinomial_invariants}


def kernel(name: str) -> Callable:
    return KERNELS[name]


def check(name: str) -> Callable:
    return CHECKS[name]
