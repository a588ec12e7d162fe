"""numpy kernels of the moe op family, merged into the numpy table.

The routing arithmetic (which slot of which expert each token's choice takes, and which
choices are dropped) is :func:`route`, shared with the MindSpore kernels: it is integer
bookkeeping, the same on every backend.  The kernels take the op's attrs as keywords; a
rank's kernel also gets the localised ``tokens`` (the global token count), ``token_start``
(the global index of its first token), ``indices_start`` (the global index of the first
row of the indices it holds: 0 when they are whole) and ``local_tokens``.

Examples
--------
Four tokens, two experts, top-1, two groups of two tokens each (slots ``[g * 2, g * 2 + 2)``
of each expert belong to group g):

>>> import numpy as np
>>> x = np.arange(4.0).reshape(4, 1)
>>> idx = np.array([[1], [1], [0], [1]])
>>> buf = KERNELS["moe_dispatch"](x, idx, num_experts=2, groups=2)
>>> buf[:, :, 0]
array([[0., 0., 2., 0.],
       [0., 1., 3., 0.]])
>>> KERNELS["moe_combine"](buf, idx, np.full((4, 1), 0.5), num_experts=2, groups=2)[:, 0]
array([0. , 0.5, 1. , 1.5])

With a capacity factor of 0.5, each expert takes ceil(0.5 * 4 * 1 / 2) = 1 token, the first
in global token order: expert 1 keeps token 0 and drops tokens 1 and 3.

>>> KERNELS["moe_dispatch"](x, idx, num_experts=2, capacity_factor=0.5, groups=2)[:, :, 0]
array([[0., 2.],
       [0., 0.]])
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np

__all__ = ["KERNELS", "Route", "capacity", "route", "window", "moe_dispatch", "moe_combine", "moe_weight_grad"]


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor) -> int | None:
    """Slots per expert: ``ceil(capacity_factor * tokens * top_k / num_experts)`` (GShard's
    formula on the GLOBAL token count); None without a capacity factor (no token dropped).

    >>> capacity(16, 2, 4, 1.25), capacity(16, 2, 4, None)
    (10, None)
    """
    if capacity_factor is None:
        return None
    return int(math.ceil(float(capacity_factor) * tokens * top_k / max(num_experts, 1)))


def group_size(tokens: int, groups: int) -> int:
    """Tokens per group: ``torch.chunk`` of the tokens into ``groups`` pieces (at least 1)."""
    return max(1, -(-tokens // max(groups, 1)))


def block_size(tokens: int, top_k: int, num_experts: int, capacity_factor, groups: int,
               capacity_scope: str = "global") -> int:
    """Slots of one group in one expert: the group's tokens, at most the expert's capacity
    (with ``capacity_scope="group"``, the capacity of the group's own tokens).

    A token names an expert at most once (top-k indices are distinct), so a group of c
    tokens sends an expert at most c of them: dropless routing drops nothing.

    >>> block_size(16, 2, 4, None, 2), block_size(16, 2, 4, 0.5, 2), block_size(16, 2, 4, 0.5, 2, "group")
    (8, 4, 2)
    """
    c = group_size(tokens, groups)
    cap = capacity(c if capacity_scope == "group" else tokens, top_k, num_experts, capacity_factor)
    return c if cap is None else min(c, cap)


class Route(NamedTuple):
    """Where each (local token, choice) goes: ``token`` (local row), ``choice`` (column),
    ``expert`` and ``slot`` (local slot in the buffer), only for the kept choices."""

    token: np.ndarray
    choice: np.ndarray
    expert: np.ndarray
    slot: np.ndarray


def route(indices, num_experts: int, capacity_factor=None, groups: int = 1, tokens: int | None = None,
          token_start: int = 0, indices_start: int = 0, local_tokens: int | None = None,
          capacity_scope: str = "global") -> Route:
    """The kept choices of the local tokens ``[token_start, token_start + local_tokens)`` and their slots.

    ``indices`` holds the rows ``[indices_start, indices_start + len(indices))`` of the global
    ``(tokens, k)`` indices.  Choices are ordered by (token, choice).  A choice of expert e
    is kept when it is among the first ``block`` choices of e in its token group and, with
    a capacity, among the first ``capacity`` choices of e over ALL tokens (the whole
    indices are needed then; with ``capacity_scope="group"`` the group's own capacity is
    its block, and the group's indices suffice); its slot is ``group * block + (its rank
    in the group)``, counted from the first local group.  An expert index outside ``[0, num_experts)`` is
    no expert: that choice is dropped (as embedding gives zeros for an id outside its table).
    """
    indices = np.asarray(indices).astype(np.int64, copy=False)
    rows, k = indices.shape
    tokens = rows if tokens is None else int(tokens)
    local_tokens = tokens if local_tokens is None else int(local_tokens)
    c = group_size(tokens, groups)
    block = block_size(tokens, k, num_experts, capacity_factor, groups, capacity_scope)
    cap = capacity(tokens, k, num_experts, capacity_factor) if capacity_scope == "global" else None
    flat = indices.reshape(-1)
    token = np.repeat(np.arange(rows, dtype=np.int64) + indices_start, k)
    valid = (flat >= 0) & (flat < num_experts)
    expert = np.where(valid, flat, 0)
    group = token // c
    # rank of each choice among the earlier choices of its expert: globally, and in its group
    # (invalid choices sort past every expert and are never kept)
    label = np.where(valid, expert, num_experts)
    order = _rank_in_class(label)
    in_group = _rank_in_class(label * (group.max(initial=0) + 1) + group)
    keep = valid & (in_group < block)
    if cap is not None:
        keep &= order < cap
    local = (token >= token_start) & (token < token_start + local_tokens)
    keep &= local
    first_group = token_start // c
    slot = (group - first_group) * block + in_group
    choice = np.tile(np.arange(k, dtype=np.int64), rows)
    return Route(token[keep] - token_start, choice[keep], expert[keep], slot[keep])


def window(r: Route, expert_start: int, slot_start: int, experts: int, slots: int) -> Route:
    """The choices of ``r`` whose (expert, slot) falls in a rank's block of the dense buffer,
    ``[expert_start, + experts) x [slot_start, + slots)``, with the block's local expert and slot.

    >>> r = Route(np.arange(3), np.zeros(3, np.int64), np.array([0, 1, 1]), np.array([0, 0, 1]))
    >>> w = window(r, 1, 1, 1, 1)
    >>> w.token.tolist(), w.expert.tolist(), w.slot.tolist()
    ([2], [0], [0])
    """
    inside = ((r.expert >= expert_start) & (r.expert < expert_start + experts)
              & (r.slot >= slot_start) & (r.slot < slot_start + slots))
    return Route(r.token[inside], r.choice[inside], r.expert[inside] - expert_start, r.slot[inside] - slot_start)


def _rank_in_class(labels: np.ndarray) -> np.ndarray:
    """For each entry, how many earlier entries have its label (a stable sort; O(n log n)).

    >>> _rank_in_class(np.array([2, 0, 2, 2, 0]))
    array([0, 0, 1, 2, 1])
    """
    perm = np.argsort(labels, kind="stable")
    ordered = labels[perm]
    ranks = np.empty(labels.size, dtype=np.int64)
    ranks[perm] = np.arange(labels.size) - np.searchsorted(ordered, ordered, side="left")
    return ranks


def _float(x) -> np.ndarray:
    x = np.asarray(x)
    return x if np.issubdtype(x.dtype, np.floating) else x.astype(np.float32)


def _dtype(*arrays) -> np.dtype:
    return np.result_type(*[_float(a).dtype for a in arrays if a is not None])


def _local_slots(local_tokens: int, tokens: int, top_k: int, num_experts: int, capacity_factor, groups: int,
                 capacity_scope: str = "global") -> int:
    """The slots of the local groups: ``(local groups) * block``."""
    block = block_size(tokens, top_k, num_experts, capacity_factor, groups, capacity_scope)
    if local_tokens == tokens:
        return groups * block
    return local_tokens // group_size(tokens, groups) * block  # a rank holds whole groups


def moe_dispatch(x, indices, weights=None, num_experts: int = 1, capacity_factor=None, groups: int = 1,
                 tokens: int | None = None, token_start: int = 0, indices_start: int = 0,
                 local_tokens: int | None = None, capacity_scope: str = "global", dense: bool = False) -> np.ndarray:
    """``buffer[e, slot] = weights[t, j] * x[t]`` (weight 1 without weights) for each kept choice.

    ``dense``: the whole buffer of the global capacity, the local tokens at their global slots
    (zeros elsewhere: a rank's buffer is its term of a ``P(sum)``)."""
    x = _float(x)
    local_tokens = x.shape[0] if local_tokens is None else local_tokens
    tokens = x.shape[0] if tokens is None else tokens
    r = route(indices, num_experts, capacity_factor, groups, tokens, token_start, indices_start, local_tokens,
              capacity_scope)
    dtype = _dtype(x, weights)
    slots = _local_slots(tokens if dense else local_tokens, tokens, np.shape(indices)[1], num_experts,
                         capacity_factor, groups, capacity_scope)
    out = np.zeros((num_experts, slots) + x.shape[1:], dtype=dtype)
    rows = x[r.token].astype(dtype)
    if weights is not None:
        rows = rows * _float(weights)[r.token, r.choice].astype(dtype)[:, None]
    out[r.expert, r.slot] = rows
    return out


def moe_combine(buffer, indices, weights=None, num_experts: int | None = None, capacity_factor=None,
                groups: int = 1, tokens: int | None = None, token_start: int = 0, indices_start: int = 0,
                local_tokens: int | None = None, capacity_scope: str = "global", dense: bool = False,
                expert_start: int = 0, slot_start: int = 0) -> np.ndarray:
    """``out[t] = sum_j weights[t, j] * buffer[e, slot]`` over the kept choices of token t.

    ``dense``: ``buffer`` is the block ``[expert_start, ...) x [slot_start, ...)`` of the dense
    buffer; only the choices it holds are summed (the output a rank's term of a ``P(sum)``
    when the buffer is sharded on E or the slots)."""
    buffer = _float(buffer)
    num_experts = buffer.shape[0] if num_experts is None else num_experts
    tokens = np.shape(indices)[0] if tokens is None else tokens
    local_tokens = tokens if local_tokens is None else local_tokens
    r = route(indices, num_experts, capacity_factor, groups, tokens, token_start, indices_start, local_tokens,
              capacity_scope)
    if dense:
        r = window(r, expert_start, slot_start, buffer.shape[0], buffer.shape[1])
    dtype = _dtype(buffer, weights)
    rows = buffer[r.expert, r.slot].astype(dtype)
    if weights is not None:
        rows = rows * _float(weights)[r.token, r.choice].astype(dtype)[:, None]
    out = np.zeros((local_tokens,) + buffer.shape[2:], dtype=dtype)
    np.add.at(out, r.token, rows)
    return out


def moe_weight_grad(buffer, y, indices, num_experts: int | None = None, capacity_factor=None, groups: int = 1,
                    tokens: int | None = None, token_start: int = 0, indices_start: int = 0,
                    local_tokens: int | None = None, capacity_scope: str = "global", dense: bool = False,
                    expert_start: int = 0, slot_start: int = 0) -> np.ndarray:
    """``out[t, j] = <y[t], buffer[e, slot]>`` for each kept choice, 0 for a dropped one
    (``dense``: only the choices the buffer's block holds, as in :func:`moe_combine`)."""
    buffer, y = _float(buffer), _float(y)
    num_experts = buffer.shape[0] if num_experts is None else num_experts
    tokens = y.shape[0] if tokens is None else tokens
    local_tokens = y.shape[0] if local_tokens is None else local_tokens
    r = route(indices, num_experts, capacity_factor, groups, tokens, token_start, indices_start, local_tokens,
              capacity_scope)
    if dense:
        r = window(r, expert_start, slot_start, buffer.shape[0], buffer.shape[1])
    dtype = _dtype(buffer, y)
    out = np.zeros((local_tokens, np.shape(indices)[1]), dtype=dtype)
    out[r.token, r.choice] = np.sum(buffer[r.expert, r.slot].astype(dtype) * y[r.token].astype(dtype), axis=-1)
    return out


KERNELS: dict[str, Callable] = {
    "moe_dispatch": moe_dispatch,
    "moe_combine": moe_combine,
    "moe_weight_grad": moe_weight_grad,
}
