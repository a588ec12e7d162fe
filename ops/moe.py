"""Rules of the moe op family: Mixture-of-Experts routing: token dispatch to experts and combine.

A Mixtral / Qwen3-MoE / DeepSeek-V3 layer routes each of its T tokens to k of E experts
(the router's top-k ``indices``, ``(T, k)``, with their ``weights``).  ``moe_dispatch`` copies
the tokens into a per-expert buffer ``(E, slots, H)``, the experts run as batched matmuls
on it (``batch_matmul`` with expert weights ``(E, H, F)``), and ``moe_combine`` sums each
token's expert outputs back, weighted.

Slots and capacity
------------------
The tokens are cut into ``groups`` groups (``torch.chunk`` of the token dim); each expert's
slots are ``groups`` blocks of ``block`` slots, block g holding the choices of group g's
tokens in token order.  Without ``capacity_factor`` (the default) no token is dropped:
``block`` is the group's token count (a token names an expert at most once).  With a
capacity factor, an expert takes at most ``capacity = ceil(capacity_factor * T * k / E)``
choices, counted over the GLOBAL token count, and keeps the first ones in GLOBAL token
order; ``block = min(capacity, T / groups)``.  The result is defined by the attrs and the
global indices alone, so one device and every sharded run keep and drop the same tokens.
The price of dropping in global order with static shapes: a group may hold all of an
expert's kept tokens, so each group gets ``min(capacity, T / groups)`` slots per expert and
the buffer (and its all-to-all) is up to ``groups`` times the capacity.  With
``capacity_scope="group"`` the capacity is counted per group instead (Megatron's
drop-and-pad, each rank's own tokens: ``block = ceil(capacity_factor * (T / groups) * k /
E)``), in the group's token order: a buffer of about ``capacity_factor * T * k`` slots, and
the same tokens dropped on one device and sharded, since the groups are an attr.
Choices are ordered by (token, choice); an index outside ``[0, E)`` names no expert and is
dropped (as embedding gives zeros for an id outside its table).

The dense buffer
----------------
``dense=True`` (with ``groups`` 1 and the global scope) is GShard's and Switch's form: one
buffer ``(E, C, H)`` with ``C = min(T, capacity)``, a kept choice at its place among ALL the
choices of its expert (the same tokens kept and dropped as ``groups=1``).  Its layout rule
needs no token groups: tokens sharded on an axis dispatch into a ``P(sum)`` buffer there (each
rank writes the global slots of its own tokens, zeros elsewhere), which a reduce-scatter
moves onto the experts (``S(0)``) or the slots; a combine (or weight gradient) reading a
buffer sharded on E or on the slots gives a ``P(sum)`` output over all tokens (each rank sums
its own experts' choices), reduce-scattered back to the token shards.  A buffer read whole
combines into token-sharded outputs where the weights shard the tokens.  The indices are
whole on every rank (a slot counts the choices of earlier tokens); the weights shard like the
tokens.  The buffer is ``C`` slots whatever the token sharding (the grouped form's is up to
``groups`` times that), and the price is a reduce-scatter of the buffer instead of an
all-to-all of the grouped slots.

Layout rule (expert parallelism)
--------------------------------
``groups`` is the number of token shards the layer is built for (``gen moe`` sets the
product of the mesh axes that shard the tokens).  When the token dim of x is sharded on
mesh axes of n ranks in all, with n dividing ``groups`` and ``groups`` dividing T, every
rank holds whole groups: it dispatches them into its own slot blocks, so the buffer's slot
dim is sharded on the same axes, without communication.  The move to expert parallelism,
buffer ``S(1) -> S(0)`` on the ``ep`` axis, is then an ordinary redistribution: the
``all-to-all`` of the token dispatch, which ``check --reshard`` reports and costs; the
combine wants the slot dim back (the second all-to-all).  With a global capacity the
indices are whole on every rank (``all-gather`` of ``T * k`` integers, the routing counts
every rank needs to drop in global order); otherwise they shard like the tokens.  The hidden dim
of x shards freely (the buffer's last dim), ``P(sum|avg)`` of x passes through (the ops
are linear in x and in the weights; not both partial), and the k dim of indices and
weights is whole.

The ops
-------
``moe_dispatch(x, indices, weights?, num_experts, capacity_factor=None, groups=1, capacity_scope="global")``
    ``x (T, H)`` -> ``buffer (E, groups * block, H)``: ``buffer[e, slot] = weights[t, j] * x[t]``
    (1 without weights) for each kept choice ``(t, j)`` of expert ``e``, zeros elsewhere.
    Aliases ``MoeDispatch``, ``moe_token_permute``, ``npu_moe_init_routing``.
``moe_combine(buffer, indices, weights?, num_experts=None, capacity_factor=None, groups=1, ...)``
    ``buffer (E, slots, H)`` -> ``(T, H)``: ``out[t] = sum_j weights[t, j] * buffer[e, slot]``
    over the kept choices.  Aliases ``MoeCombine``, ``moe_token_unpermute``,
    ``npu_moe_finalize_routing``.
``moe_weight_grad(buffer, y, indices, ...)`` (grad op)
    ``(T, k)``: ``<y[t], buffer[e, slot]>`` per kept choice, 0 for a dropped one: the
    gradient of the routing weights of both ops (``P(sum)`` on the axes sharding H).
``dense=True``
    The same three ops on the dense buffer ``(E, min(T, capacity), H)`` (above).
Gradients: ``d x = moe_combine(d buffer, indices, weights)``, ``d buffer (of a combine) =
moe_dispatch(d out, indices, weights)``, ``d weights = moe_weight_grad``; the indices
(integers) have none.

Violation codes
---------------
- ``partial-input``: indices or weights Partial, both x (or buffer) and weights Partial,
  or a ``P(max|min)`` x (fix: all-reduce).
- ``sharded-choice-dim``: the k dim of indices or weights is sharded (fix: all-gather).
- ``sharded-expert-dim``: the combine's buffer is sharded on E (fix: the all-to-all back to slots).
- ``uneven-token-groups``: the tokens are sharded on n ranks but n does not divide
  ``groups`` or ``groups`` does not divide T (fix: all-gather the tokens, or set groups).
- ``sharding-mismatch``: indices, weights or buffer not sharded like the tokens.

Unusable input is an ``OpError`` (one line, exit 2), not a violation: ``bad-attr``
(num_experts, capacity_factor or groups not positive, capacity_scope not global or group), ``invalid-shape`` (x or y not
``(T, H)``, indices not ``(T, k)``, weights not the indices' shape, a buffer that is not
the dispatch's ``(E, groups * block, H)``) and ``invalid-dtype`` (indices not integers).

Examples
--------
>>> from layout_prop import DeviceMesh, Layout, TensorSpec
>>> mesh = DeviceMesh((2, 2), ("dp", "ep"))
>>> x = TensorSpec((16, 8), "float32", Layout(mesh, ["S(0)", "S(0)"], 2))
>>> idx = TensorSpec((16, 2), "int64", Layout(mesh, ["S(0)", "S(0)"], 2))
>>> rule = get_rule("moe_dispatch")
>>> attrs = rule.normalize_attrs({"num_experts": 4, "groups": 4})
>>> res = rule.infer_layout((x, idx), attrs)
>>> str(res.outputs[0]), res.violations
('float32[4, 16, 8] (S(1), S(1))', ())
>>> [rule.localize(attrs, (x, idx), res.outputs, r)["token_start"] for r in range(4)]
[0, 4, 8, 12]
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from layout_prop.core.errors import OpError, Violation
from layout_prop.core.layout import Layout
from layout_prop.core.placement import Partial, Replicate, Shard
from layout_prop.core.registry import OpRule, RuleResult, get_rule, register_op
from layout_prop.core.spec import TensorSpec, is_float_dtype, numpy_dtype

from .common import plan_summary

__all__ = ["MoeDispatch", "MoeCombine", "MoeWeightGrad", "MOE_CODES", "moe_block", "get_rule"]

MOE_CODES = ("partial-input", "sharded-choice-dim", "sharded-expert-dim", "uneven-token-groups", "sharding-mismatch")
LINEAR_PARTIALS = ("sum", "avg")
_ATTRS = {"num_experts": None, "capacity_factor": None, "groups": 1, "capacity_scope": "global", "dense": False}
#: where a capacity counts: over all tokens (the default), or per token group (Megatron's drop-and-pad)
CAPACITY_SCOPES = ("global", "group")


# ------------------------------------------------------------------------------ sizes
def moe_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor) -> int | None:
    """Slots per expert, ``ceil(capacity_factor * tokens * top_k / num_experts)``; None: no capacity.

    >>> moe_capacity(16, 2, 4, 1.25), moe_capacity(16, 2, 4, None)
    (10, None)
    """
    if capacity_factor is None:
        return None
    return int(math.ceil(float(capacity_factor) * tokens * top_k / max(num_experts, 1)))


def moe_block(tokens: int, top_k: int, num_experts: int, capacity_factor, groups: int,
              capacity_scope: str = "global") -> int:
    """Slots of one token group in one expert: the group's tokens, at most the capacity (of
    all tokens, or with ``capacity_scope="group"`` of the group's).

    >>> moe_block(16, 2, 4, None, 2), moe_block(16, 2, 4, 0.5, 2), moe_block(16, 2, 4, 0.5, 2, "group")
    (8, 4, 2)
    """
    group = max(1, -(-tokens // max(groups, 1)))
    cap = moe_capacity(group if capacity_scope == "group" else tokens, top_k, num_experts, capacity_factor)
    return group if cap is None else min(group, cap)


def _global_capacity(attrs: dict) -> bool:
    """Whether every rank needs the whole indices: a capacity counted over all tokens, or the
    dense buffer (a choice's slot is its place among ALL the choices of its expert)."""
    return attrs["dense"] or (attrs["capacity_factor"] is not None and attrs["capacity_scope"] == "global")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_attrs(op: str, attrs: dict, experts_required: bool) -> None:
    """``bad-attr`` (an OpError: exit 2) for an attr the op cannot take."""
    e = attrs["num_experts"]
    if (e is not None or experts_required) and (not _is_int(e) or e < 1):
        raise OpError("bad-attr", f"{op}: num_experts={e!r} is not a positive integer", path="attrs.num_experts",
                      hint="give num_experts, the number of experts E (the router's output size)")
    cf = attrs["capacity_factor"]
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, numbers.Real) or not math.isfinite(cf)
                           or cf <= 0):
        raise OpError("bad-attr", f"{op}: capacity_factor={cf!r} is not a positive number",
                      path="attrs.capacity_factor",
                      hint="leave capacity_factor out (no token dropped) or give a number > 0, e.g. 1.25")
    g = attrs["groups"]
    if not _is_int(g) or g < 1:
        raise OpError("bad-attr", f"{op}: groups={g!r} is not a positive integer", path="attrs.groups",
                      hint="give groups, the number of token shards (1 on one device)")
    if attrs["capacity_scope"] not in CAPACITY_SCOPES:
        raise OpError("bad-attr", f"{op}: capacity_scope={attrs['capacity_scope']!r} is not one of "
                      f"{list(CAPACITY_SCOPES)}", path="attrs.capacity_scope",
                      hint="leave capacity_scope out (global) or give 'group'")
    if attrs["dense"] and (g != 1 or attrs["capacity_scope"] != "global"):
        raise OpError("bad-attr", f"{op}: dense=True with groups={g}, capacity_scope="
                      f"{attrs['capacity_scope']!r}: the dense buffer is one block of the global capacity",
                      path="attrs.dense", hint="leave groups and capacity_scope out with dense=True")


def _check_route(op: str, indices: TensorSpec, weights: TensorSpec | None, tokens: int | None) -> None:
    """``invalid-shape`` or ``invalid-dtype`` (OpErrors: exit 2) for routing operands the op cannot take."""
    if indices.ndim != 2:
        raise OpError("invalid-shape", f"{op}: indices has shape {list(indices.shape)}; the routing indices are "
                      "(tokens, k), the router's top-k", hint="give indices the shape (T, k)")
    if tokens is not None and indices.shape[0] != tokens:
        raise OpError("invalid-shape", f"{op}: indices has {indices.shape[0]} rows (shape {list(indices.shape)}) but "
                      f"there are {tokens} tokens", hint="give indices one row per token")
    if not np.issubdtype(np.dtype(indices.dtype), np.integer):
        raise OpError("invalid-dtype", f"{op}: indices has dtype {indices.dtype}; expert indices are integers",
                      hint="give indices the dtype int64 (top-k's indices) or int32")
    if weights is not None and tuple(weights.shape) != tuple(indices.shape):
        raise OpError("invalid-shape", f"{op}: weights has shape {list(weights.shape)} but indices "
                      f"{list(indices.shape)}; a routing weight per choice", hint="give weights the indices' shape")


def _check_tokens(op: str, name: str, x: TensorSpec) -> None:
    if x.ndim != 2:
        raise OpError("invalid-shape", f"{op}: {name} has shape {list(x.shape)}; tokens are (T, H)",
                      hint=f"reshape {name} to (tokens, hidden) first")


# ------------------------------------------------------------------------------ the layout decision
@dataclass(frozen=True)
class Roles:
    """The decision per mesh axis: ``token`` (the token dim and the slot dim are sharded
    there), ``hidden`` (H is sharded), ``partial`` (the driving operand's Partial passes
    through), ``partial_other`` (the other float operand's Partial passes, moe_weight_grad's
    buffer) or ``none``; ``rejected`` holds token axes given up for ``uneven-token-groups``."""

    kinds: tuple[str, ...]
    partials: tuple
    rejected: tuple[int, ...]


def _decide(driver: TensorSpec, token_dim: int, hidden_dim: int, expert_dim: int | None,
            sides: list[TensorSpec | None], tokens: int, groups: int, other: TensorSpec | None = None) -> Roles:
    """Per mesh axis, what the op does there (see :class:`Roles`).

    ``driver`` is the operand whose layout leads (x, the buffer, y); ``sides`` are the
    routing operands whose token dim may carry a token shard where the driver is Replicate
    (or, for a buffer, sharded on E: the all-to-all back); ``other`` a float operand whose
    Partial may pass where the driver is Replicate.
    """
    kinds, partials = [], []
    for axis, p in enumerate(driver.layout.placements):
        side_token = any(s is not None and s.layout.placements[axis] == Shard(0) for s in sides)
        kind, partial = "none", None
        if isinstance(p, Shard) and p.dim == token_dim:
            kind = "token"
        elif isinstance(p, Shard) and p.dim == hidden_dim:
            kind = "hidden"
        elif isinstance(p, Partial) and p.reduce_op in LINEAR_PARTIALS:
            kind, partial = "partial", p
        elif isinstance(p, Replicate) or (expert_dim is not None and p == Shard(expert_dim)):
            o = other.layout.placements[axis] if other is not None else None
            if side_token:
                kind = "token"
            elif isinstance(p, Replicate) and isinstance(o, Partial) and o.reduce_op in LINEAR_PARTIALS:
                kind, partial = "partial_other", o
        kinds.append(kind)
        partials.append(partial)
    token_axes = [a for a, k in enumerate(kinds) if k == "token"]
    n = math.prod(driver.mesh.shape[a] for a in token_axes)
    rejected: tuple[int, ...] = ()
    if n > 1 and (groups % n or tokens % groups):
        rejected = tuple(token_axes)
        kinds = ["none" if k == "token" else k for k in kinds]
    return Roles(tuple(kinds), tuple(partials), rejected)


def _layout(spec, roles: Roles, token_dim: int | None, hidden_dim: int | None,
            partial: str = "partial", hidden_partial: bool = False) -> Layout:
    """The layout of a tensor (a spec, or ``(mesh, ndim)``) under ``roles``: the token and
    hidden dims sharded where decided, the ``partial`` kind's Partial kept, ``P(sum)`` on
    hidden axes when ``hidden_partial``."""
    ps = []
    for kind, p in zip(roles.kinds, roles.partials):
        if kind == "token" and token_dim is not None:
            ps.append(Shard(token_dim))
        elif kind == "hidden" and hidden_dim is not None:
            ps.append(Shard(hidden_dim))
        elif kind == "hidden" and hidden_partial:
            ps.append(Partial("sum"))
        elif kind == partial or (partial == "both" and kind in ("partial", "partial_other")):
            ps.append(p)
        else:
            ps.append(Replicate())
    mesh, ndim = (spec.mesh, spec.ndim) if isinstance(spec, TensorSpec) else spec
    return Layout(mesh, ps, ndim)


#: why an operand is wanted otherwise on a mesh axis, by the axis's role (see Roles)
_AXIS_REASONS = {
    "token": ": the tokens are sharded there, so it shards its token dim alike",
    "hidden": ": the hidden dim is sharded there, and every rank routes all of its tokens",
    "partial": ": a partial sum passes through there, so the other operands are whole",
    "partial_other": ": a partial sum passes through there, so the other operands are whole",
    "none": ": the tokens are not sharded there",
}


def _issue(name: str, spec: TensorSpec, want: Layout, roles: Roles, expert_dim: int | None,
           choice_dim: int | None, groups: int, tokens: int) -> tuple[str, str, str]:
    """The code, message and hint of the first mesh axis where ``spec`` is not ``want``."""
    for axis, (have, need) in enumerate(zip(spec.layout.placements, want.placements)):
        if have == need or isinstance(have, Replicate):
            continue
        ax = repr(spec.mesh.names[axis])
        where = f"{name} is {spec.layout}"
        if isinstance(have, Partial):
            return ("partial-input", f"{name} is {have} on mesh axis {ax} ({where}); the routing is not linear in it "
                    f"there", f"reduce {name} on {ax} first (all-reduce)")
        if choice_dim is not None and have == Shard(choice_dim):
            return ("sharded-choice-dim", f"{name}'s choice dim {choice_dim} (k, size {spec.shape[choice_dim]}) is "
                    f"sharded on mesh axis {ax} ({where}); each token's choices are read together",
                    f"all-gather {name} on {ax}")
        if expert_dim is not None and have == Shard(expert_dim):
            return ("sharded-expert-dim", f"{name}'s expert dim {expert_dim} (E, size {spec.shape[expert_dim]}) is "
                    f"sharded on mesh axis {ax} ({where}); the combine reads every expert's slots of its tokens",
                    f"move {name} back to its slot dim on {ax} (an all-to-all: --reshard inserts it)")
        if axis in roles.rejected:
            n = math.prod(spec.mesh.shape[a] for a in roles.rejected)
            return ("uneven-token-groups", f"the tokens are sharded on {n} ranks (mesh axis {ax}, {where}) but "
                    f"groups={groups} is not a multiple of {n} or does not divide the {tokens} tokens, so a rank "
                    "would not hold whole token groups", f"set groups to a multiple of {n} dividing {tokens} "
                    f"(gen moe does), or all-gather {name} on {ax}")
        why = _AXIS_REASONS.get(roles.kinds[axis], "")
        return ("sharding-mismatch", f"{name} is {have} on mesh axis {ax} ({where}) but the routing computes "
                f"{need} there{why}", f"give {name} the layout {want}")
    return ("sharding-mismatch", f"{spec.layout} is not {want}", f"give {name} the layout {want}")


def _check_move(name: str, spec: TensorSpec | None, want: Layout, roles: Roles, violations: list,
                expert_dim: int | None = None, choice_dim: int | None = None, groups: int = 1,
                tokens: int = 0) -> Layout | None:
    """Add a violation when moving ``spec`` to ``want`` costs communication; the want, or None."""
    if spec is None or want == spec.layout:
        return None
    move = plan_summary(spec, want)
    if not move.free:
        code, message, hint = _issue(name, spec, want, roles, expert_dim, choice_dim, groups, tokens)
        violations.append(Violation(code, message, hint, operand=name, fixable=move.fixable,
                                    details={"want": want.placement_strs()}))
    return want


def _route_wants(roles: Roles, indices: TensorSpec, weights: TensorSpec | None, whole: bool,
                 violations: list, groups: int, tokens: int) -> list[Layout | None]:
    """The wants of indices (token-sharded, or whole under a global capacity) and weights."""
    idx_want = _layout(indices, roles, None if whole else 0, None, partial="-")
    wants = [_check_move("indices", indices, idx_want, roles, violations, choice_dim=1, groups=groups, tokens=tokens)]
    if weights is not None:
        w_want = _layout(weights, roles, 0, None, partial="-")
        wants.append(_check_move("weights", weights, w_want, roles, violations, choice_dim=1, groups=groups,
                                 tokens=tokens))
    return wants


def _float_dtype(*specs: TensorSpec | None) -> str:
    dts = [numpy_dtype(s.dtype) for s in specs if s is not None]
    dts = [d if is_float_dtype(d) else np.dtype("float32") for d in dts]
    return str(np.result_type(*dts))


def _localize(attrs: dict, token_spec: TensorSpec, indices: TensorSpec, rank: int, tokens: int) -> dict:
    """A rank's attrs: the global token count, its first token, the first row of its indices."""
    start, stop = token_spec.local_slices(rank)[0]
    return {**attrs, "tokens": tokens, "token_start": start, "local_tokens": stop - start,
            "indices_start": indices.local_slices(rank)[0][0]}


# ------------------------------------------------------------------------------ the dense buffer
def _dense_kinds(driver: TensorSpec, token_dim: int | None, hidden_dim: int, sum_dims: tuple[int, ...],
                 sides: list[TensorSpec | None], other: TensorSpec | None = None) -> Roles:
    """Per mesh axis, what an op on the dense buffer does there (see :class:`Roles`; ``sum``: a
    sharded dim of ``sum_dims`` makes the output a partial sum).

    ``driver`` leads: its token dim sharded is ``token`` (only the dispatch: its buffer is then a
    ``P(sum)``, each rank writing the global slots of its own tokens), its hidden dim ``hidden``,
    a sharded dim of ``sum_dims`` (the combine's buffer on E or on the slots) ``sum``, a linear
    Partial ``partial``.  Where the driver is Replicate, a routing operand (``sides``) sharding
    its tokens makes the axis ``token`` (the output token-sharded, the driver read whole), and a
    linear Partial of ``other`` (the weight gradient's buffer) ``partial_other``; a sharded E or
    slot dim of ``other`` makes it ``sum``.
    """
    kinds, partials = [], []
    for axis, p in enumerate(driver.layout.placements):
        kind, partial = "none", None
        if isinstance(p, Shard) and p.dim == token_dim:
            kind = "token"
        elif isinstance(p, Shard) and p.dim == hidden_dim:
            kind = "hidden"
        elif isinstance(p, Shard) and p.dim in sum_dims:
            kind = "sum"
        elif isinstance(p, Partial) and p.reduce_op in LINEAR_PARTIALS:
            kind, partial = "partial", p
        elif isinstance(p, Replicate):
            o = other.layout.placements[axis] if other is not None else None
            if any(s is not None and s.layout.placements[axis] == Shard(0) for s in sides):
                kind = "token"
            elif isinstance(o, Partial) and o.reduce_op in LINEAR_PARTIALS:
                kind, partial = "partial_other", o
            elif isinstance(o, Shard) and o.dim in (0, 1):
                kind = "sum"
        kinds.append(kind)
        partials.append(partial)
    return Roles(tuple(kinds), tuple(partials), ())


def _dense_layout(spec, roles: Roles, token_dim: int | None, hidden_dim: int | None, *, token: str = "shard",
                  sums: str = "keep", hidden_partial: bool = False, partial: str = "partial") -> Layout:
    """The layout of a tensor (a spec, or ``(mesh, ndim)``) under dense ``roles``: on ``token``
    axes its token dim sharded (``token="shard"``), ``P(sum)`` (``"sum"``) or Replicate
    (``"whole"``); on ``sum`` axes its own placement (``sums="keep"``), ``P(sum)`` (``"sum"``) or
    Replicate; on ``hidden`` axes the hidden dim sharded, or ``P(sum)`` when ``hidden_partial``;
    the ``partial`` kind's Partial kept."""
    mesh, ndim = (spec.mesh, spec.ndim) if isinstance(spec, TensorSpec) else spec
    ps = []
    for axis, (kind, p) in enumerate(zip(roles.kinds, roles.partials)):
        if kind == "token" and token_dim is not None and token == "shard":
            ps.append(Shard(token_dim))
        elif kind == "token" and token == "sum":
            ps.append(Partial("sum"))
        elif kind == "sum" and sums == "keep" and isinstance(spec, TensorSpec):
            ps.append(spec.layout.placements[axis])
        elif kind == "sum" and sums == "sum":
            ps.append(Partial("sum"))
        elif kind == "hidden" and hidden_dim is not None:
            ps.append(Shard(hidden_dim))
        elif kind == "hidden" and hidden_partial:
            ps.append(Partial("sum"))
        elif kind == partial or (partial == "both" and kind in ("partial", "partial_other")):
            ps.append(p)
        else:
            ps.append(Replicate())
    return Layout(mesh, ps, ndim)


def _dense_dispatch(x: TensorSpec, indices: TensorSpec, weights: TensorSpec | None, slots: int, e: int):
    """The dense dispatch's rule: tokens sharded give the buffer ``P(sum)`` there (module docstring)."""
    violations: list[Violation] = []
    roles = _dense_kinds(x, 0, 1, (), [])
    x_want = _check_move("x", x, _dense_layout(x, roles, 0, 1), roles, violations)
    wants = [x_want] + _route_wants(roles, indices, weights, True, violations, 1, indices.shape[0])
    out = TensorSpec((e, slots, x.shape[1]), _float_dtype(x, weights),
                     _dense_layout((x.mesh, 3), roles, None, 2, token="sum"))
    return RuleResult((out,), tuple(violations), tuple(wants))


def _dense_combine(buffer: TensorSpec, indices: TensorSpec, weights: TensorSpec | None):
    """The dense combine's rule: the buffer sharded on E or on the slots gives a ``P(sum)`` output."""
    violations: list[Violation] = []
    roles = _dense_kinds(buffer, None, 2, (0, 1), [weights])
    b_want = _check_move("buffer", buffer, _dense_layout(buffer, roles, None, 2, token="whole"), roles,
                         violations)
    wants = [b_want] + _route_wants(roles, indices, weights, True, violations, 1, indices.shape[0])
    out = TensorSpec((indices.shape[0], buffer.shape[2]), _float_dtype(buffer, weights),
                     _dense_layout((buffer.mesh, 2), roles, 0, 1, sums="sum"))
    return RuleResult((out,), tuple(violations), tuple(wants))


def _dense_weight_grad(buffer: TensorSpec, y: TensorSpec, indices: TensorSpec):
    """The dense weight gradient's rule: y token-sharded reads the buffer whole; the buffer
    sharded on E or the slots (y whole there) gives a ``P(sum)`` output."""
    violations: list[Violation] = []
    roles = _dense_kinds(y, 0, 1, (), [], other=buffer)
    y_want = _check_move("y", y, _dense_layout(y, roles, 0, 1), roles, violations)
    b_want = _check_move("buffer", buffer, _dense_layout(buffer, roles, None, 2, token="whole",
                                                         partial="partial_other"), roles, violations)
    idx_want = _route_wants(roles, indices, None, True, violations, 1, indices.shape[0])
    out = TensorSpec(tuple(indices.shape), _float_dtype(buffer, y),
                     _dense_layout((y.mesh, 2), roles, 0, None, sums="sum", hidden_partial=True, partial="both"))
    return RuleResult((out,), tuple(violations), (b_want, y_want, *idx_want))


def _buffer_starts(attrs: dict, buffer: TensorSpec, rank: int) -> dict:
    """The dense buffer's first expert and slot on ``rank`` (a rank may hold a block of either),
    and its global expert count (the kernel sees only its block)."""
    if not attrs["dense"]:
        return {}
    bounds = buffer.local_slices(rank)
    return {"num_experts": buffer.shape[0], "expert_start": bounds[0][0], "slot_start": bounds[1][0]}


class _MoeRule(OpRule):
    attr_defaults = dict(_ATTRS)
    attr_types = {"num_experts": "int | None", "capacity_factor": "float | None", "groups": "int",
                  "capacity_scope": "str", "dense": "bool"}
    violation_codes = MOE_CODES


# ------------------------------------------------------------------------------ the ops
@register_op
class MoeDispatch(_MoeRule):
    """``moe_dispatch(x, indices, weights?, num_experts, capacity_factor=None, groups=1)``:
    tokens ``(T, H)`` into the expert buffer ``(E, groups * block, H)`` (module docstring)."""

    name = "moe_dispatch"
    operands = ("x", "indices")
    optional_operands = ("weights",)
    aliases = ("MoeDispatch", "moe_token_permute", "npu_moe_init_routing")
    required_attrs = ("num_experts",)

    def infer_layout(self, inputs, attrs):
        x, indices = inputs[0], inputs[1]
        weights = inputs[2] if len(inputs) > 2 else None
        _check_attrs(self.name, attrs, True)
        _check_tokens(self.name, "x", x)
        _check_route(self.name, indices, weights, x.shape[0])
        violations: list[Violation] = []
        tokens, k = indices.shape
        e, groups, cf = attrs["num_experts"], attrs["groups"], attrs["capacity_factor"]
        if attrs["dense"]:
            return _dense_dispatch(x, indices, weights, moe_block(tokens, k, e, cf, 1), e)
        whole = _global_capacity(attrs)
        sides = [weights] + ([] if whole else [indices])
        roles = _decide(x, 0, 1, None, sides, tokens, groups)
        x_want = _check_move("x", x, _layout(x, roles, 0, 1), roles, violations, groups=groups, tokens=tokens)
        wants = [x_want] + _route_wants(roles, indices, weights, whole, violations, groups, tokens)
        slots = groups * moe_block(tokens, k, e, cf, groups, attrs["capacity_scope"])
        out = TensorSpec((e, slots, x.shape[1]), _float_dtype(x, weights), _layout((x.mesh, 3), roles, 1, 2))
        return RuleResult((out,), tuple(violations), tuple(wants))

    def localize(self, attrs, inputs, outputs, rank):
        return _localize(attrs, inputs[0], inputs[1], rank, inputs[1].shape[0])

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None,) * len(inputs)
        routing = dict(attrs)
        dx = g.op("moe_combine", [dy, *inputs[1:]], routing) if needs[0] else None
        dw = None
        if len(inputs) > 2 and needs[2]:
            dw = g.op("moe_weight_grad", [dy, inputs[0], inputs[1]], routing)
        return (dx, None, dw)[:len(inputs)]


@register_op
class MoeCombine(_MoeRule):
    """``moe_combine(buffer, indices, weights?, num_experts=None, capacity_factor=None, groups=1)``:
    the expert buffer ``(E, slots, H)`` back to tokens ``(T, H)``, weighted (module docstring)."""

    name = "moe_combine"
    operands = ("buffer", "indices")
    optional_operands = ("weights",)
    aliases = ("MoeCombine", "moe_token_unpermute", "npu_moe_finalize_routing")

    def infer_layout(self, inputs, attrs):
        buffer, indices = inputs[0], inputs[1]
        weights = inputs[2] if len(inputs) > 2 else None
        _check_attrs(self.name, attrs, False)
        _check_route(self.name, indices, weights, None)
        _check_buffer(self.name, buffer, indices, attrs, None)
        if attrs["dense"]:
            return _dense_combine(buffer, indices, weights)
        violations: list[Violation] = []
        tokens = indices.shape[0]
        groups, whole = attrs["groups"], _global_capacity(attrs)
        sides = [weights] + ([] if whole else [indices])
        roles = _decide(buffer, 1, 2, 0, sides, tokens, groups)
        b_want = _check_move("buffer", buffer, _layout(buffer, roles, 1, 2), roles, violations, expert_dim=0,
                             groups=groups, tokens=tokens)
        wants = [b_want] + _route_wants(roles, indices, weights, whole, violations, groups, tokens)
        out = TensorSpec((tokens, buffer.shape[2]), _float_dtype(buffer, weights),
                         _layout((buffer.mesh, 2), roles, 0, 1))
        return RuleResult((out,), tuple(violations), tuple(wants))

    def localize(self, attrs, inputs, outputs, rank):
        return {**_localize(attrs, outputs[0], inputs[1], rank, inputs[1].shape[0]),
                **_buffer_starts(attrs, inputs[0], rank)}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None,) * len(inputs)
        routing = dict(attrs)
        routing["num_experts"] = g.spec(inputs[0]).shape[0]
        dbuf = g.op("moe_dispatch", [dy, *inputs[1:]], routing) if needs[0] else None
        dw = None
        if len(inputs) > 2 and needs[2]:
            dw = g.op("moe_weight_grad", [inputs[0], dy, inputs[1]], routing)
        return (dbuf, None, dw)[:len(inputs)]


def _check_buffer(op: str, buffer: TensorSpec, indices: TensorSpec, attrs: dict, hidden: int | None) -> None:
    """``invalid-shape`` (an OpError: exit 2) for an expert buffer that is not the dispatch's."""
    if buffer.ndim != 3:
        raise OpError("invalid-shape", f"{op}: buffer has shape {list(buffer.shape)}; the expert buffer is "
                      "(E, slots, H)", hint="give the buffer moe_dispatch's output shape")
    e = attrs["num_experts"] if attrs["num_experts"] is not None else buffer.shape[0]
    if buffer.shape[0] != e:
        raise OpError("invalid-shape", f"{op}: buffer has {buffer.shape[0]} experts (shape {list(buffer.shape)}) but "
                      f"num_experts is {e}", hint="leave num_experts out or give the buffer's E")
    tokens, k = indices.shape
    slots = attrs["groups"] * moe_block(tokens, k, e, attrs["capacity_factor"], attrs["groups"],
                                        attrs["capacity_scope"])
    if buffer.shape[1] != slots:
        raise OpError("invalid-shape", f"{op}: buffer has {buffer.shape[1]} slots per expert (shape "
                      f"{list(buffer.shape)}) but {tokens} tokens, k={k}, num_experts={e}, capacity_factor="
                      f"{attrs['capacity_factor']}, groups={attrs['groups']} give {slots}",
                      hint="give the op the routing attrs of its moe_dispatch")
    if hidden is not None and buffer.shape[2] != hidden:
        raise OpError("invalid-shape", f"{op}: buffer has hidden size {buffer.shape[2]} but y {hidden}",
                      hint="give y the tokens' shape (T, H)")


@register_op
class MoeWeightGrad(_MoeRule):
    """``moe_weight_grad(buffer, y, indices, ...)``: ``(T, k)``, ``<y[t], buffer[e, slot]>`` per
    kept choice; the routing weights' gradient of moe_dispatch and moe_combine."""

    name = "moe_weight_grad"
    operands = ("buffer", "y", "indices")
    differentiable = False

    def infer_layout(self, inputs, attrs):
        buffer, y, indices = inputs
        _check_attrs(self.name, attrs, False)
        _check_tokens(self.name, "y", y)
        _check_route(self.name, indices, None, y.shape[0])
        _check_buffer(self.name, buffer, indices, attrs, y.shape[1])
        if attrs["dense"]:
            return _dense_weight_grad(buffer, y, indices)
        violations: list[Violation] = []
        tokens, k = indices.shape
        groups, whole = attrs["groups"], _global_capacity(attrs)
        sides = [] if whole else [indices]
        roles = _decide(y, 0, 1, None, sides, tokens, groups, other=buffer)
        y_want = _check_move("y", y, _layout(y, roles, 0, 1), roles, violations, groups=groups, tokens=tokens)
        b_want = _check_move("buffer", buffer, _layout(buffer, roles, 1, 2, partial="partial_other"), roles,
                             violations, expert_dim=0, groups=groups, tokens=tokens)
        idx_want = _route_wants(roles, indices, None, whole, violations, groups, tokens)
        out = TensorSpec((tokens, k), _float_dtype(buffer, y),
                         _layout((y.mesh, 2), roles, 0, None, partial="both", hidden_partial=True))
        return RuleResult((out,), tuple(violations), (b_want, y_want, *idx_want))

    def localize(self, attrs, inputs, outputs, rank):
        return {**_localize(attrs, inputs[1], inputs[2], rank, inputs[2].shape[0]),
                **_buffer_starts(attrs, inputs[0], rank)}
