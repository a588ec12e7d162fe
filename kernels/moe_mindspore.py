"""MindSpore kernels of the moe op family, merged into the mindspore and cann tables.

:mod:`.mindspore_backend` imports this module; import its helpers (``_ms``, ``to_tensor``...)
inside functions, not at the top.

The routing bookkeeping (which slot each kept choice takes) is integer arithmetic on the
indices, computed by :func:`layout_prop.kernels.moe_numpy.route` on the host, as a MoE
layer computes its permutation map before the token copy; the token copies and the
weighted sums are MindSpore ops (``gather``, ``tensor_scatter_elements``-free
``tensor_scatter_add`` and ``unsorted_segment_sum``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .moe_numpy import _local_slots, route, window

__all__ = ["KERNELS"]


def _route(indices, attrs: dict, tokens_default: int, local_default: int):
    from .mindspore_backend import to_numpy

    tokens = attrs.get("tokens") or tokens_default
    local = attrs.get("local_tokens")
    local = local_default if local is None else local
    return route(to_numpy(indices), attrs["num_experts"], attrs.get("capacity_factor"), attrs.get("groups", 1),
                 tokens, attrs.get("token_start", 0), attrs.get("indices_start", 0), local,
                 attrs.get("capacity_scope", "global")), tokens, local


def _window(r, attrs: dict, buffer):
    """The dense buffer's block on this rank: only the choices it holds (numpy's :func:`window`)."""
    if not attrs.get("dense"):
        return r
    return window(r, attrs.get("expert_start", 0), attrs.get("slot_start", 0), buffer.shape[0], buffer.shape[1])


def _index(values: np.ndarray):
    from .mindspore_backend import to_tensor

    return to_tensor(np.ascontiguousarray(values, dtype=np.int64))


def _dtype(*inputs):
    from .mindspore_backend import _floated, _ms_dtype, _np_dtype

    return _ms_dtype(np.result_type(*[_np_dtype(_floated(a)) for a in inputs if a is not None]))


def _rows(x, weights, token, choice, dtype):
    """``x[token] * weights[token, choice]`` (the rows of the kept choices), in ``dtype``."""
    from .mindspore_backend import _floated, _ms

    ops = _ms().ops
    rows = ops.gather(_floated(x).astype(dtype), _index(token), 0)
    if weights is not None:
        w = ops.gather_nd(_floated(weights).astype(dtype), _index(np.stack([token, choice], axis=1)))
        rows = rows * w.reshape((-1,) + (1,) * (rows.ndim - 1))
    return rows


def moe_dispatch(x, indices, weights=None, num_experts: int = 1, **attrs):
    from .mindspore_backend import _ms, to_tensor

    ms = _ms()
    x = to_tensor(x)
    attrs["num_experts"] = num_experts
    r, tokens, local = _route(indices, attrs, x.shape[0], x.shape[0])
    dtype = _dtype(x, weights)
    slots = _local_slots(tokens if attrs.get("dense") else local, tokens, to_tensor(indices).shape[1], num_experts,
                         attrs.get("capacity_factor"), attrs.get("groups", 1), attrs.get("capacity_scope", "global"))
    out = ms.ops.zeros((num_experts, slots) + tuple(x.shape[1:]), dtype)
    if r.token.size == 0:
        return out
    rows = _rows(x, weights, r.token, r.choice, dtype)
    return ms.ops.tensor_scatter_add(out, _index(np.stack([r.expert, r.slot], axis=1)), rows)


def moe_combine(buffer, indices, weights=None, num_experts=None, **attrs):
    from .mindspore_backend import _floated, _ms, to_tensor

    ms = _ms()
    buffer = to_tensor(buffer)
    attrs["num_experts"] = buffer.shape[0] if num_experts is None else num_experts
    r, tokens, local = _route(indices, attrs, to_tensor(indices).shape[0], None)
    r = _window(r, attrs, buffer)
    local = tokens if local is None else local
    dtype = _dtype(buffer, weights)
    shape = (local,) + tuple(buffer.shape[2:])
    if r.token.size == 0:
        return ms.ops.zeros(shape, dtype)
    rows = ms.ops.gather_nd(_floated(buffer).astype(dtype), _index(np.stack([r.expert, r.slot], axis=1)))
    if weights is not None:
        w = ms.ops.gather_nd(_floated(weights).astype(dtype), _index(np.stack([r.token, r.choice], axis=1)))
        rows = rows * w.reshape((-1,) + (1,) * (rows.ndim - 1))
    return ms.ops.unsorted_segment_sum(rows, _index(r.token).astype(ms.int32), local).astype(dtype)


def moe_weight_grad(buffer, y, indices, num_experts=None, **attrs):
    from .mindspore_backend import _floated, _ms, to_tensor

    ms = _ms()
    buffer, y = to_tensor(buffer), to_tensor(y)
    attrs["num_experts"] = buffer.shape[0] if num_experts is None else num_experts
    r, tokens, local = _route(indices, attrs, y.shape[0], y.shape[0])
    r = _window(r, attrs, buffer)
    dtype = _dtype(buffer, y)
    k = to_tensor(indices).shape[1]
    out = ms.ops.zeros((local, k), dtype)
    if r.token.size == 0:
        return out
    rows = ms.ops.gather_nd(_floated(buffer).astype(dtype), _index(np.stack([r.expert, r.slot], axis=1)))
    dots = (rows * ms.ops.gather(_floated(y).astype(dtype), _index(r.token), 0)).sum(axis=-1)
    return ms.ops.tensor_scatter_add(out, _index(np.stack([r.token, r.choice], axis=1)), dots)


KERNELS: dict[str, Callable] = {
    "moe_dispatch": moe_dispatch,
    "moe_combine": moe_combine,
    "moe_weight_grad": moe_weight_grad,
}
