"""The numpy kernel table: the reference every other backend is checked against.

Kernels take and return numpy arrays (a tuple for multi-output ops) and their attrs as
keyword arguments.  The same table runs the single-device reference (global arrays) and
every rank of the simulator (local arrays with localised attrs).

Examples
--------
>>> import numpy as np
>>> KERNELS["add"](np.ones(3), np.ones(3))
array([2., 2., 2.])
>>> KERNELS["sum_to"](np.ones((2, 3)), shape=[1, 3])
array([[2., 2., 2.]])
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from layout_prop.core.errors import ExecutionError

from . import family_tables
from .rpe_numpy import reduce_to_shape, rpe_backward, rpe_forward

__all__ = ["KERNELS", "get_kernel", "register_kernel"]


def _identity(x: np.ndarray) -> np.ndarray:
    return np.array(x, copy=True)


def _sum_to(x: np.ndarray, shape) -> np.ndarray:
    return reduce_to_shape(x, tuple(shape))


def _rpe(x, cos, sin, mode=0, input_layout=None):
    return rpe_forward(x, cos, sin, mode)


def _rpe_grad(dy, x, cos, sin, mode=0, input_layout=None):
    return rpe_backward(dy, x, cos, sin, mode)


def _redistribute_global(x, placements=None):
    """On one device a redistribution moves nothing."""
    return np.array(x, copy=True)


KERNELS: dict[str, Callable] = {
    "identity": _identity,
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "neg": np.negative,
    "sum_to": _sum_to,
    "rotary_position_embedding": _rpe,
    "rotary_position_embedding_grad": _rpe_grad,
    "redistribute": _redistribute_global,
}
for _table in family_tables("numpy"):  # every *_numpy module's table
    KERNELS.update(_table)


def register_kernel(op: str, fn: Callable, table: dict[str, Callable] = KERNELS) -> Callable:
    """Register the numpy kernel of ``op`` (its canonical name); returns ``fn`` so it works as a decorator."""
    from layout_prop.core.registry import get_rule

    name = get_rule(op).name
    if name in table and table[name] is not fn:
        raise ExecutionError("duplicate-kernel", f"op {name!r} already has a numpy kernel",
                             hint="register each op's kernel once")
    table[name] = fn
    return fn


def get_kernel(op: str, table: dict[str, Callable] = KERNELS, backend: str = "numpy") -> Callable:
    try:
        return table[op]
    except KeyError:
        raise ExecutionError("no-kernel", f"backend {backend!r} has no kernel for op {op!r}",
                             hint=f"register a {backend} kernel for {op!r} in its kernel table") from None
