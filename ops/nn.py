"""Neural-network ops of a Transformer block: norms, softmax, attention, SwiGLU, activations.

Each op has a pure layout rule, a gradient rule and numpy kernels (forward and backward,
:mod:`layout_prop.kernels.nn_numpy`).  A gradient that is more than a few elementwise
ops is a separate grad op with its own layout rule, as ``rotary_position_embedding_grad``.
Every grad op is linear in its cotangent ``dy``: a ``dy`` that is ``P(sum)`` (or
``P(avg)``) on a mesh axis where the primal inputs are Replicate passes through, and the
gradients are partial on that axis too (the backward pass reduces them).

The ops
-------
``rms_norm(x, weight, eps=1e-6, normalized_ndim=1)``
    ``y = x / sqrt(mean(x**2) + eps) * weight``, the mean over the last
    ``normalized_ndim`` dims of x (``weight.shape == x.shape[-normalized_ndim:]``).
    Aliases ``RmsNorm``, ``npu_rms_norm``, ``RMSNorm``, ``aten.rms_norm``.  Unlike the
    upstream kernels it has one output (y); the gradient recomputes ``rstd``.
``layer_norm(x, weight, bias, eps=1e-5, normalized_ndim=1)``
    ``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the same dims.  Aliases
    ``LayerNorm``, ``aten.layer_norm``.  One output (y).
    Layout rule of both norms: the normalised dims of x are Replicate (else
    ``sharded-normalized-dim``, fixed by an all-gather), x is not Partial
    (``partial-input``); the other dims of x shard freely and y keeps x's layout.  On a
    mesh axis that shards x, weight and bias are Replicate.  On a mesh axis where x is
    Replicate they may be sharded on a normalised dim (then y is sharded there: every
    rank normalises whole rows and keeps its chunk, the localised attr ``norm_slices``;
    the other param is sliced alike) or ``P(sum|avg)`` (then y is that Partial, the
    other param made terms by a free ``local-partial``), without communication, as
    DTensor does.  The grad ops want the params Replicate.  A strided shard
    (``_S(d,k)``, from a reshape that merged tokens) of x's other dims stays.  The
    weight and bias gradients sum over the other dims: ``P(sum)`` on each mesh axis that
    shards one of them, reduced by the backward pass.
``softmax(x, axis=-1)``, ``log_softmax(x, axis=-1)``
    The axis is Replicate (``sharded-softmax-dim``), x is not Partial; other dims free
    (strided shards too).
    Aliases ``Softmax``, ``aten.softmax``, ``aten._softmax``; ``LogSoftmax``,
    ``aten.log_softmax``, ``aten._log_softmax``.
``scaled_dot_product_attention(q, k, v, layout="BNSD", causal=False, scale=None, q_offset=0)``
    ``softmax(q @ k^T * scale + mask) @ v`` per batch and head, with ``layout`` ``"BNSD"``
    or ``"BSND"`` for all three; ``scale`` defaults to ``1/sqrt(D)``.  The causal mask is
    aligned top-left, as torch's ``is_causal``: query row ``i`` sees key ``j`` when
    ``j <= i + q_offset``.  q drives the layout: its B, N and query-sequence dims shard
    freely, k and v must shard B and N exactly like q (a Replicate k or v is sliced for
    free; another sharding is ``sharding-mismatch``), their key/value sequence is whole
    on every rank (``sharded-kv-sequence``, fixed by an all-gather), the head dim D of
    q, k, v is Replicate (``sharded-head-dim``) and none is Partial (``partial-input``).
    ``q_offset`` is LOCALIZED: each rank's kernel gets the global index of its first
    query row (plus the global ``q_offset``, 0 by default).  B of q, k, v must be equal,
    as must the sequence of k and v and the D of q and k; v's head dim may differ (the
    output has it).  Grouped-query attention: k and v may have fewer heads than q, a
    divisor of q's (``invalid-shape`` otherwise); query head ``h`` uses kv head
    ``h // (Nq / Nkv)``.  Sharding q's heads on a mesh axis, k and v shard theirs alike when
    every rank then holds the kv heads of its query heads (kv heads a multiple of the
    axis, say); else k and v are whole on that axis (Megatron's kv head replication, a
    ``sharding-mismatch`` fixed by an all-gather when they are sharded there) and the
    kernel attr ``kv_head_map`` (localised, not an attr of the op) tells each rank which of
    its kv heads each of its query heads uses.  Aliases ``ScaledDotProductAttention``, ``sdpa``,
    ``aten.scaled_dot_product_attention`` (MindSpore's ``FlashAttentionScore`` is the
    op ``flash_attention_score`` of :mod:`.attention`); one output (no softmax statistics).
    Gradients: dq like q; dk and dv like k and v, plus ``P(sum)`` on the mesh axes that
    shard q's sequence (each rank adds the contributions of its own query rows) and on
    those that shard q's heads but not k's and v's (replicated kv heads).
    Context parallelism, ``context_parallel``: how a sharded query sequence meets the
    keys.  ``all_gather`` (the default) gathers k and v on the mesh axes that shard q's
    sequence, as above; ``ulysses`` moves q, k and v there from the sequence to the heads
    (an all-to-all each, and one of the output back where its consumer wants the
    sequence: DeepSpeed-Ulysses), when the heads split so (else it gathers); ``auto``
    takes the one moving fewer bytes (Ulysses from 3 ranks on, for equal q, k, v; never
    the ring, which moves the gather's bytes).  The
    output then has the heads sharded.  The whole-graph solver (``plan``, and ``analyze``
    on small graphs) may also choose the heads strategy under ``all_gather`` when it
    moves fewer bytes.  ``ring``: ring attention (Liu et al. 2023; Megatron's context
    parallelism).  When q, k and v shard their sequence on the same one mesh axis of n
    ranks (n dividing both sequences), the expand pass (``check --reshard``, ``run``,
    ``lower``, ``estimate``) writes the node as n ``attention_block`` steps, each rank
    attending its query block to the key/value block it holds, with k and v passed one
    rank on between steps (``ring_shift``, lowered as a cyclic point-to-point ``permute``
    on that axis) and the partial results combined by their log-sum-exp
    (``attention_merge``); :mod:`.ring` has the ops.  It moves the bytes of the all-gather
    ((n - 1) blocks of k and of v per rank, and as many of their gradients back); in the
    forward a rank holds one pair of k, v blocks and the next (with the backward, every
    step's blocks are kept for the gradient: see :mod:`.ring`); ``zigzag`` passes to the blocks (the
    load-balanced ring: right, though no block skips work, so the balance is not
    modelled).  Elsewhere (the sequence sharded on several axes, k or v not sharded like
    q) the node gathers k and v as under ``all_gather`` and the expand pass says why in a
    note.  Not done: an overlap model of the permutes with the blocks' compute
    (``estimate`` exposes them all) and skipping the causal blocks wholly in the future
    (they run and contribute nothing).  ``flash_attention_score`` takes ``ring`` too, for
    some of its masks (:mod:`.attention`).
    Load balance, ``zigzag=P`` (default 0): q, k and v hold one sequence stored in the
    zig-zag order of ``2P`` chunks (shard i of P holds chunks i and 2P-1-i: Llama 3's and
    ring attention's load-balanced order, which the data and the rotary positions must
    follow); the causal mask compares positions in the sequence, so sharding the stored
    sequence on P ranks gives every rank as many visible query-key pairs.  The length
    must be a multiple of 2P (``invalid-shape``); q_offset stays 0.
``swiglu(x, dim=-1)``
    Cuts x into halves ``a, b`` along ``dim``: ``silu(a) * b``.  The split dim is
    Replicate (``sharded-split-dim``: a ``torch.chunk`` shard of it does not hold
    matching halves of a and b) and of even size (``invalid-shape``); x not Partial.
    Megatron keeps gate and up separate: use ``silu_mul(a, b)`` then, an elementwise
    op (broadcasting) linear in b.  Aliases ``Swiglu``, ``SwiGLU``, ``npu_swiglu``.
``exp``, ``silu``, ``gelu`` (unary, not linear: a Partial input is ``partial-input``)
    ``gelu`` is the tanh approximation ``0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x**3)))``
    (MindSpore ``GeLU``), not torch's default erf form.  Aliases ``Exp``, ``aten.exp``;
    ``SiLU``, ``Silu``, ``aten.silu``; ``GeLU``, ``Gelu``, ``gelu_tanh``.
``cast(x, dtype)``, ``scale(x, factor)``, ``div(x, y)`` (linear in their first operand)
    A ``P(sum|avg)`` x passes through when the op is linear for the dtypes: ``scale``
    and ``div`` always (for a non-bool x, the result is floating), ``cast`` between
    floating dtypes, from an integer to a floating dtype, and between integer dtypes;
    a cast to an integer from a float (truncation) or from/to bool is not linear.  div's
    denominator is never Partial.  Aliases ``Cast``, ``aten._to_copy``; ``Muls``;
    ``Div``, ``RealDiv``, ``aten.div``.
Grad ops (``differentiable = False``)
    ``rms_norm_grad(dy, x, weight) -> (dx, dweight)``,
    ``layer_norm_grad(dy, x, weight, bias) -> (dx, dweight, dbias)``,
    ``softmax_grad(dy, y)``, ``log_softmax_grad(dy, y)`` (y the forward output),
    ``scaled_dot_product_attention_grad(dy, q, k, v) -> (dq, dk, dv)``,
    ``swiglu_grad(dy, x)``, ``silu_grad(dy, x)``, ``gelu_grad(dy, x)``.

Violation codes
---------------
- ``partial-input``: an operand is Partial where the op is not linear in it (fix: all-reduce).
- ``sharding-mismatch``: operands sharded inconsistently (k/v vs q, dy vs the output).
- ``broadcast-shape``: elementwise shapes that do not broadcast; a cotangent of the wrong shape.
- ``sharded-normalized-dim``: a norm's normalised dim (of x, weight or bias) is sharded.
- ``sharded-softmax-dim``: the softmax axis is sharded.
- ``sharded-kv-sequence``: k's or v's sequence dim is sharded.
- ``sharded-head-dim``: the head dim D of q, k or v is sharded.
- ``sharded-split-dim``: swiglu's split dim is sharded.
- ``invalid-shape``: shapes the op cannot take (a weight not of the normalised shape,
  an odd swiglu split dim, q/k/v that do not agree, a rank that is not 4).
- ``invalid-attr``: an attribute value the op cannot take (an axis out of range,
  ``normalized_ndim`` out of range, a negative eps, an unknown dtype, a non-numeric
  scale or factor, a non-bool causal).
- ``invalid-input-layout``: an attention ``layout`` other than ``"BNSD"`` and ``"BSND"``.

Examples
--------
>>> from layout_prop import DeviceMesh, Layout, TensorSpec
>>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
>>> x = TensorSpec((4, 6, 8), "float32", Layout(mesh, ["S(0)", "S(2)"], 3))
>>> w = TensorSpec((8,), "float32", Layout(mesh, ["R", "R"], 1))
>>> res = get_rule("RmsNorm").infer_layout((x, w), {"eps": 1e-6, "normalized_ndim": 1})
>>> str(res.outputs[0].layout), [v.code for v in res.violations], str(res.wants[0])
('(S(0), R)', ['sharded-normalized-dim'], '(S(0), R)')
>>> q = TensorSpec((2, 4, 8, 16), "float32", Layout(mesh, ["S(0)", "S(2)"], 4))
>>> kv = TensorSpec((2, 4, 8, 16), "float32", Layout(mesh, ["R", "R"], 4))
>>> att = get_rule("sdpa")
>>> attrs = att.normalize_attrs({"causal": True})
>>> res = att.infer_layout((q, kv, kv), attrs)
>>> str(res.outputs[0].layout), res.violations, [str(w) for w in res.wants]
('(S(0), S(2))', (), ['None', '(S(0), R)', '(S(0), R)'])
>>> [att.localize(attrs, (q, kv, kv), res.outputs, r)["q_offset"] for r in range(4)]
[0, 4, 0, 4]
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import numbers
from typing import Sequence

import numpy as np

from layout_prop.core.errors import LayoutPropError, Violation
from layout_prop.core.layout import Layout
from layout_prop.core.placement import Partial, Replicate, Shard, StridedShard, parse_placement, shard_dim
from layout_prop.core.registry import OpRule, RuleResult, get_rule, register_op
from layout_prop.core.spec import DTYPES, TensorSpec, is_float_dtype, numpy_dtype

from .common import move_violations as _move_violations
from .elementwise import ElementwiseRule, sum_to_shape

__all__ = [
    "RmsNorm", "RmsNormGrad", "LayerNorm", "LayerNormGrad", "Softmax", "SoftmaxGrad", "LogSoftmax",
    "LogSoftmaxGrad", "ScaledDotProductAttention", "ScaledDotProductAttentionGrad", "Swiglu", "SwigluGrad",
    "SiluMul", "Exp", "Silu", "SiluGrad", "Gelu", "GeluGrad", "Cast", "Scale", "Div", "PointwiseRule",
    "ATTENTION_LAYOUTS", "float_dtype", "cast_is_linear", "get_rule",
]

#: Partial reduce ops a linear function passes through
LINEAR_REDUCE_OPS = ("sum", "avg")
#: attention layouts: the tensor dim of B, N, S and D
ATTENTION_LAYOUTS = {"BNSD": {"B": 0, "N": 1, "S": 2, "D": 3}, "BSND": {"B": 0, "S": 1, "N": 2, "D": 3}}

NORM_CODES = ("partial-input", "sharded-normalized-dim", "sharding-mismatch", "broadcast-shape", "invalid-shape",
              "invalid-attr")
SOFTMAX_CODES = ("partial-input", "sharded-softmax-dim", "sharding-mismatch", "broadcast-shape", "invalid-attr")
ATTENTION_CODES = ("partial-input", "sharded-kv-sequence", "sharded-head-dim", "sharding-mismatch",
                   "broadcast-shape", "invalid-shape", "invalid-attr", "invalid-input-layout")
SWIGLU_CODES = ("partial-input", "sharded-split-dim", "sharding-mismatch", "broadcast-shape", "invalid-shape",
                "invalid-attr")
POINTWISE_CODES = ("broadcast-shape", "partial-input", "sharding-mismatch", "invalid-attr")


# ------------------------------------------------------------------------------------ helpers
def float_dtype(*dtypes: str) -> str:
    """The floating dtype an op computes in: numpy's promotion, integers and bools as float32.

    >>> float_dtype("float16"), float_dtype("int64"), float_dtype("float16", "float32"), float_dtype("bfloat16")
    ('float16', 'float32', 'float32', 'bfloat16')
    """
    floats = [numpy_dtype(d) if is_float_dtype(numpy_dtype(d)) else np.dtype("float32") for d in dtypes]
    return str(np.result_type(*floats))


def _is_float(dtype: str) -> bool:
    return is_float_dtype(numpy_dtype(dtype))  # bfloat16 too (numpy's issubdtype says no to it)


def cast_is_linear(src: str, dst: str) -> bool:
    """Whether casting a partial sum term by term equals casting the sum (up to rounding).

    Float to float is linear up to rounding.  Integer to integer is exact when the target
    is not wider (a wrapped sum casts to the same wrapped value); a wider target, or a
    float target, would turn a sum that overflowed in the source type into the true sum,
    unlike casting the (wrapped) sum.  Float to integer truncates: not linear.

    >>> cast_is_linear("float32", "float16"), cast_is_linear("int64", "int32"), cast_is_linear("int32", "float32")
    (True, True, False)
    >>> cast_is_linear("int32", "int64"), cast_is_linear("float32", "int32")
    (False, False)
    """
    if "bool" in (src, dst):
        return False  # a bool P(sum) is a logical or
    if _is_float(src) and _is_float(dst):
        return True
    if _is_float(src) or _is_float(dst):
        return False
    return np.dtype(dst).itemsize <= np.dtype(src).itemsize


def _name(mesh, axis: int) -> str:
    return repr(mesh.names[axis])


def _names(mesh, axes) -> str:
    return ", ".join(repr(mesh.names[a]) for a in axes)


def _dims_text(dims: Sequence[int]) -> str:
    return str(list(dims))


def _partial_issue(spec: TensorSpec, operand: str, axis: int, op: str, why: str) -> tuple[str, str, str]:
    p = spec.layout.placements[axis]
    name = _name(spec.mesh, axis)
    return ("partial-input",
            f"{operand} is {p} on mesh axis {name} ({operand} is {spec.layout}): {op} {why}",
            f"reduce {operand} on {name} first (all-reduce), or produce {operand} "
            f"Replicate or Shard on {name}")


def _whole_dims(spec: TensorSpec, operand: str, dims: Sequence[int], code: str, op: str,
                why: str, elsewhere: str) -> tuple[Layout, list[tuple[str, str, str]]]:
    """``spec``'s layout with its Partial axes reduced and ``dims`` unsharded, and the issues found.

    ``why`` completes "dim d is sharded on mesh axis a, but ..."; ``elsewhere`` the hint.
    """
    ps, issues = [], []
    for axis, p in enumerate(spec.layout.placements):
        name = _name(spec.mesh, axis)
        if isinstance(p, Partial):
            issues.append(_partial_issue(spec, operand, axis, op, "is not linear in it, so every rank needs the "
                                         "whole value"))
            ps.append(Replicate())
        elif shard_dim(p) is not None and p.dim in dims:  # a shard or a strided shard
            issues.append((code, f"{operand} dim {p.dim} (size {spec.shape[p.dim]}) is sharded on mesh axis {name} "
                           f"({operand} is {spec.layout}), but {why}",
                           f"all-gather {operand} on {name}{elsewhere}"))
            ps.append(Replicate())
        else:
            ps.append(p)
    return Layout(spec.mesh, ps, spec.ndim), issues


def _cotangent(dy: TensorSpec, base: Layout, shape: Sequence[int], op: str):
    """The layout ``dy`` must have for a grad op linear in it, and what passes through.

    Returns ``(want, partials, violations, ok)``: ``partials`` maps mesh axis -> the
    ``P(sum|avg)`` of dy kept on an axis where ``base`` (the primal layout) is Replicate.
    """
    if tuple(dy.shape) != tuple(shape):
        v = Violation("broadcast-shape", f"dy has shape {list(dy.shape)} but the output of {op} has shape "
                      f"{list(shape)}", "the cotangent has the forward output's shape", operand="dy")
        return None, {}, [v], False
    ps, partials, issues = [], {}, []
    for axis, (want, have) in enumerate(zip(base.placements, dy.layout.placements)):
        name = _name(dy.mesh, axis)
        if isinstance(have, Partial) and have.reduce_op in LINEAR_REDUCE_OPS and isinstance(want, Replicate):
            ps.append(have)
            partials[axis] = have
            continue
        ps.append(want)
        if have == want:
            continue
        if isinstance(have, Partial):
            issues.append(("partial-input", f"dy is {have} on mesh axis {name} but the gradient of {op} is computed "
                           f"{want} there (dy is {dy.layout}, the forward output {base})",
                           f"reduce dy on {name} first"))
        else:
            issues.append(("sharding-mismatch", f"dy is {have} on mesh axis {name} but the gradient of {op} is "
                           f"computed {want} there, like the forward output (dy is {dy.layout}, the forward "
                           f"output {base})", f"give dy the forward output's layout {base}"))
    want_layout = Layout(dy.mesh, ps, dy.ndim)
    return want_layout, partials, _move_violations(dy, want_layout, "dy", issues), True


def _with_partials(layout: Layout, partials: dict) -> Layout:
    return layout.with_placements([partials.get(a, p) for a, p in enumerate(layout.placements)])


def _want(layout: Layout, spec: TensorSpec) -> Layout | None:
    return None if layout == spec.layout else layout


def _bad_attr(message: str, hint: str, operand: str = "x") -> Violation:
    return Violation("invalid-attr", message, hint, operand=operand)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _axis_problem(value, ndim: int, attr: str, op: str) -> Violation | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not -ndim <= value < ndim:
        return _bad_attr(f"{op}'s {attr}={value!r} is not a dim of x (x has rank {ndim})",
                         f"give {attr} an integer in {-ndim}..{ndim - 1}")
    return None


# ---------------------------------------------------------------------- pointwise family
class PointwiseRule(ElementwiseRule):
    """:class:`ElementwiseRule` with dtype-aware linearity and messages that name mesh axes.

    Subclasses may set ``linear_note`` (why a Partial is refused), override
    :meth:`partial_passes` (dtypes for which the declared ``partial_mode`` holds) and
    :meth:`attr_problem`.
    """

    violation_codes = POINTWISE_CODES
    linear_note = "is not linear"

    def attr_problem(self, inputs, attrs) -> Violation | None:
        return None

    def partial_passes(self, inputs, attrs) -> bool:
        return all(t.dtype != "bool" for t in inputs)

    def linearity(self, inputs, attrs) -> str:
        return self.linear_note

    def out_dtype(self, inputs, attrs) -> str:
        return float_dtype(*[t.dtype for t in inputs])

    def infer_layout(self, inputs, attrs):
        problem = self.attr_problem(inputs, attrs)
        if problem is not None:
            return RuleResult((None,) * self.num_outputs, (problem,), ())
        rule = self
        if self.partial_mode != "none" and not self.partial_passes(inputs, attrs):
            rule = copy.copy(self)  # the same rule, but no Partial passes for these dtypes
            rule.partial_mode = "none"
        res = ElementwiseRule.infer_layout(rule, inputs, attrs)
        return RuleResult(res.outputs, tuple(self._explain(v, inputs, attrs) for v in res.violations), res.wants)

    def _explain(self, v: Violation, inputs, attrs) -> Violation:
        """Rewrite the shared messages to name the mesh axes and why."""
        if v.operand not in self.operands or "want" not in v.details:
            return v
        spec = inputs[self.operands.index(v.operand)]
        want = Layout(spec.mesh, v.details["want"], spec.ndim)
        differ = [a for a, (h, w) in enumerate(zip(spec.layout.placements, want.placements)) if h != w]
        moves = ", ".join(f"{spec.layout.placements[a]} -> {want.placements[a]} on {_name(spec.mesh, a)}"
                          for a in differ)
        if v.code == "partial-input":
            axes = [a for a in differ if spec.layout.placements[a].is_partial()]
            message = (f"{v.operand} is {spec.layout}, partial on mesh axis {_names(spec.mesh, axes)}: {self.name} "
                       f"{self.linearity(inputs, attrs)}, so it needs {v.operand} as {want} ({moves})")
            hint = (f"reduce {v.operand} on {_names(spec.mesh, axes)} first (all-reduce), "
                    f"or produce it as {want}")
        else:
            message = f"{v.message} ({moves})"
            hint = v.hint
        return dataclasses.replace(v, message=message, hint=hint)


class _UnaryActivation(PointwiseRule):
    """exp, silu, gelu: not linear, so no Partial passes."""

    operands = ("x",)
    partial_mode = "none"
    linear_note = "is not linear"
    grad_op = ""

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None or not needs[0] or not _is_float(g.spec(inputs[0]).dtype):
            return (None,)
        return (g.op(self.grad_op, [dy, inputs[0]]),)


@register_op
class Exp(_UnaryActivation):
    """``exp(x)``; its gradient is ``dy * exp(x)``, reusing the output."""

    name = "exp"
    aliases = ("Exp", "aten.exp")
    linear_note = "is not linear (exp(a + b) != exp(a) + exp(b))"

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None or not needs[0] or not _is_float(g.spec(inputs[0]).dtype):
            return (None,)
        return (g.op("mul", [dy, outputs[0]]),)


@register_op
class Silu(_UnaryActivation):
    """``silu(x) = x * sigmoid(x)``."""

    name = "silu"
    aliases = ("SiLU", "Silu", "aten.silu")
    grad_op = "silu_grad"


@register_op
class Gelu(_UnaryActivation):
    """``gelu(x)``, tanh approximation: ``0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x**3)))``."""

    name = "gelu"
    aliases = ("GeLU", "Gelu", "gelu_tanh")
    grad_op = "gelu_grad"


class _ActivationGrad(PointwiseRule):
    """``dy * f'(x)``: linear in dy (the first operand), x must be whole."""

    operands = ("dy", "x")
    partial_mode = "first"
    differentiable = False
    linear_note = "is linear in dy only"


@register_op
class SiluGrad(_ActivationGrad):
    name = "silu_grad"
    aliases = ("SiLUGrad",)


@register_op
class GeluGrad(_ActivationGrad):
    name = "gelu_grad"
    aliases = ("GeLUGrad",)


@register_op
class Cast(PointwiseRule):
    """``cast(x, dtype)``: linear where :func:`cast_is_linear` says so.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> x = TensorSpec((4,), "float32", Layout(DeviceMesh((2,), ("tp",)), ["P(sum)"], 1))
    >>> str(Cast().infer_layout((x,), {"dtype": "float16"}).outputs[0])
    'float16[4] (P(sum))'
    >>> [v.code for v in Cast().infer_layout((x,), {"dtype": "int32"}).violations]
    ['partial-input']
    """

    name = "cast"
    operands = ("x",)
    aliases = ("Cast", "aten._to_copy")
    attr_defaults = {"dtype": None}
    partial_mode = "first"

    def attr_problem(self, inputs, attrs):
        if attrs["dtype"] not in DTYPES:
            return _bad_attr(f"cast to dtype {attrs['dtype']!r}, which is not a supported dtype",
                             f"set dtype to one of {', '.join(DTYPES)}")
        return None

    def partial_passes(self, inputs, attrs):
        return cast_is_linear(inputs[0].dtype, attrs["dtype"])

    def linearity(self, inputs, attrs):
        return f"from {inputs[0].dtype} to {attrs['dtype']} is not linear in a partial sum (rounding or a bool)"

    def out_dtype(self, inputs, attrs):
        return attrs["dtype"]

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        src = g.spec(inputs[0]).dtype
        if cotangents[0] is None or not needs[0] or not (_is_float(src) and _is_float(attrs["dtype"])):
            return (None,)
        return (g.op("cast", [cotangents[0]], {"dtype": src}),)


@register_op
class Scale(PointwiseRule):
    """``scale(x, factor) = x * factor`` (a floating result): linear, a Partial passes."""

    name = "scale"
    operands = ("x",)
    aliases = ("Muls",)
    attr_defaults = {"factor": 1.0}
    partial_mode = "first"
    linear_note = "is linear in sum and avg partials of a non-bool x only"

    def attr_problem(self, inputs, attrs):
        if not _is_number(attrs["factor"]):
            return _bad_attr(f"scale factor {attrs['factor']!r} is not a number", "give factor a real number")
        return None

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None or not needs[0] or not _is_float(g.spec(inputs[0]).dtype):
            return (None,)
        return (g.op("scale", [cotangents[0]], {"factor": attrs["factor"]}),)


@register_op
class Div(PointwiseRule):
    """``div(x, y) = x / y`` (true division, broadcasting): linear in the numerator only."""

    name = "div"
    operands = ("x", "y")
    aliases = ("Div", "RealDiv", "aten.div")
    partial_mode = "first"
    linear_note = "is linear in its numerator x only (sum and avg partials), with y Replicate"

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        x, y = inputs
        if dy is None:
            return (None, None)
        t = g.op("div", [dy, y])
        dx = sum_to_shape(g, t, g.spec(x).shape) if needs[0] and _is_float(g.spec(x).dtype) else None
        dyy = None
        if needs[1] and _is_float(g.spec(y).dtype):
            dyy = sum_to_shape(g, g.op("neg", [g.op("mul", [t, outputs[0]])]), g.spec(y).shape)
        return dx, dyy


@register_op
class SiluMul(PointwiseRule):
    """``silu_mul(a, b) = silu(a) * b`` (broadcasting): SwiGLU with gate and up kept apart.

    Linear in b: a ``P(sum|avg)`` b with a Replicate passes.
    """

    name = "silu_mul"
    operands = ("a", "b")
    partial_mode = "one"
    linear_note = "is linear in b only (sum and avg partials), with a Replicate"

    def _partial_out(self, ps):
        a, b = ps
        if self.partial_mode == "none":
            return None
        if isinstance(b, Partial) and b.reduce_op in LINEAR_REDUCE_OPS and isinstance(a, Replicate):
            return b
        return None

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        a, b = inputs
        if dy is None:
            return (None, None)
        da = db = None
        if needs[0] and _is_float(g.spec(a).dtype):
            da = sum_to_shape(g, g.op("silu_grad", [g.op("mul", [dy, b]), a]), g.spec(a).shape)
        if needs[1] and _is_float(g.spec(b).dtype):
            db = sum_to_shape(g, g.op("mul", [dy, g.op("silu", [a])]), g.spec(b).shape)
        return da, db


# -------------------------------------------------------------------------------- norms
def _norm_analysis(op: str, x: TensorSpec, params: Sequence[tuple[str, TensorSpec]], attrs: dict,
                   param_axes: bool = False):
    """Shared by the norms and their grads: ``(x_fixed, wants, violations, ok)``.

    ``wants`` has one entry per x and param; ``ok`` is False when the shapes or attrs are
    unusable (no output can be described).  With ``param_axes`` (the forward norms) the
    params may be sharded or Partial on a mesh axis where x is Replicate
    (:func:`_param_axis_targets`); ``x_fixed`` is then the output's layout.
    """
    violations: list[Violation] = []
    k = attrs["normalized_ndim"]
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= x.ndim:
        violations.append(_bad_attr(f"{op}'s normalized_ndim={k!r} is not in 1..{x.ndim} (x has shape "
                                    f"{list(x.shape)})", f"normalise over 1..{x.ndim} trailing dims of x"))
    eps = attrs["eps"]
    if not _is_number(eps) or not math.isfinite(eps) or eps < 0:
        violations.append(_bad_attr(f"{op}'s eps={eps!r} is not a finite non-negative number", "use eps like 1e-6"))
    if violations:
        return None, [None] * (1 + len(params)), violations, False
    dims = tuple(range(x.ndim - k, x.ndim))
    norm_shape = x.shape[x.ndim - k:]
    for name, p in params:
        if tuple(p.shape) != tuple(norm_shape):
            violations.append(Violation(
                "invalid-shape", f"{name} has shape {list(p.shape)} but {op} normalises x (shape {list(x.shape)}) "
                f"over its last {k} dim(s), of shape {list(norm_shape)}",
                f"give {name} the shape {list(norm_shape)}, or set normalized_ndim to {name}'s rank",
                operand=name))
    if violations:
        return None, [None] * (1 + len(params)), violations, False
    x_fixed, issues = _whole_dims(
        x, "x", dims, "sharded-normalized-dim", op,
        f"{op} normalises over x's last {k} dim(s) {_dims_text(dims)} and needs them whole on every rank",
        f", or shard a dim outside {_dims_text(dims)} of x instead")
    violations += _move_violations(x, x_fixed, "x", issues)
    wants: list[Layout | None] = [_want(x_fixed, x)]
    out_fixed, targets = x_fixed, [Layout.replicated(p.mesh, p.ndim) for _, p in params]
    if param_axes:
        out_fixed, targets = _param_axis_targets(x_fixed, x.ndim - k, [p for _, p in params])
    for (name, p), target in zip(params, targets):
        issues = []
        for axis, (pl, want) in enumerate(zip(p.layout.placements, target.placements)):
            axis_name = _name(p.mesh, axis)
            if pl == want or (isinstance(pl, Replicate) and shard_dim(x_fixed.placements[axis]) is None):
                continue  # as wanted, or a free local slice or local partial of a Replicate param
            x_p, out_p = x_fixed.placements[axis], out_fixed.placements[axis]
            if isinstance(want, Replicate):
                why = (f"x is {x_p} on {axis_name}, so every rank there needs the whole {name} (a param may be "
                       f"sharded or Partial only on a mesh axis where x is Replicate)")
            else:
                why = f"x is {x_p} and the output {out_p} on {axis_name}, so {name} must be {want} there"
            if isinstance(pl, Partial):
                issues.append(_partial_issue(p, name, axis, op, f"is not linear in {name} that way: {why}"))
            elif isinstance(pl, Shard):
                issues.append(("sharded-normalized-dim", f"{name} dim {pl.dim} (size {p.shape[pl.dim]}) is sharded "
                               f"on mesh axis {axis_name} ({name} is {p.layout}); {name} spans x's normalised "
                               f"dims {_dims_text(dims)} and {why}",
                               f"give {name} {want} on {axis_name}" + (" (all-gather it)"
                                                                       if isinstance(want, Replicate) else "")))
        violations += _move_violations(p, target, name, issues)
        wants.append(_want(target, p))
    return out_fixed, wants, violations, True


def _param_axis_targets(x_fixed: Layout, offset: int, params: Sequence[TensorSpec]) -> tuple[Layout, list[Layout]]:
    """The output layout of a norm and each param's wanted layout.

    On a mesh axis where x (as the kernel needs it) is Replicate, every rank holds the
    whole normalised rows, so a param may be sharded or Partial there, as DTensor allows:

    - a param ``S(j)``: every rank normalises the whole rows and keeps its chunk of
      normalised dim ``offset + j``: the output is ``S(offset + j)``, the other params
      ``S(j)`` (a Replicate one is sliced for free);
    - else a param ``P(sum)`` or ``P(avg)``: the output is linear in each param, so it is
      the same Partial (a Replicate param becomes terms by a free ``local-partial``:
      ``x_hat * w + b`` is the sum of ``x_hat * w_k + b_k``);
    - else Replicate.

    On any other mesh axis the params are Replicate.  The first param decides when
    they disagree (the others then need communication: a violation).
    """
    mesh = x_fixed.mesh
    out = list(x_fixed.placements)
    per_param = [[Replicate()] * mesh.ndim for _ in params]
    for axis in range(mesh.ndim):
        if not isinstance(x_fixed.placements[axis], Replicate):
            continue
        here = [p.layout.placements[axis] for p in params]
        shard = next((pl for pl in here if isinstance(pl, Shard)), None)
        partial = next((pl for pl in here if isinstance(pl, Partial) and pl.reduce_op in LINEAR_REDUCE_OPS), None)
        chosen = shard if shard is not None else partial
        if chosen is None:
            continue
        out[axis] = Shard(offset + chosen.dim) if isinstance(chosen, Shard) else chosen
        for targets in per_param:
            targets[axis] = chosen
    return (x_fixed.with_placements(out),
            [Layout(mesh, targets, p.ndim) for targets, p in zip(per_param, params)])


def _param_grad_layout(x_fixed: Layout, ndim: int, partials: dict) -> Layout:
    """A weight/bias gradient: a sum over x's other dims, so ``P(sum)`` where x is sharded."""
    ps = []
    for axis, p in enumerate(x_fixed.placements):
        if axis in partials:
            ps.append(partials[axis])
        elif shard_dim(p) is not None:
            ps.append(Partial("sum"))
        else:
            ps.append(Replicate())
    return Layout(x_fixed.mesh, ps, ndim)


class _NormRule(OpRule):
    params: tuple[str, ...] = ()
    violation_codes = NORM_CODES
    strided = True  # row-wise: a strided shard of x's other dims stays; of a normalised dim, gathered

    def out_dtype(self, inputs) -> str:
        return float_dtype(*[t.dtype for t in inputs])

    def infer_layout(self, inputs, attrs):
        x, params = inputs[0], inputs[1:]
        out_layout, wants, violations, ok = _norm_analysis(self.name, x, list(zip(self.params, params)), attrs,
                                                           param_axes=True)
        out = TensorSpec(x.shape, self.out_dtype(inputs), out_layout) if ok else None
        return RuleResult((out,), tuple(violations), tuple(wants))

    def localize(self, attrs, inputs, outputs, rank):
        """Where the output is sharded on a normalised dim (a sharded param, x Replicate),
        the kernel normalises whole rows and keeps the rank's chunk: ``norm_slices`` holds
        the ``[start, stop)`` of every normalised dim (absent otherwise)."""
        out = outputs[0]
        k = attrs["normalized_ndim"]
        dims = range(out.ndim - k, out.ndim)
        if not any(d in out.layout.sharded_dims() for d in dims):
            return dict(attrs)
        coords = out.mesh.coords(rank)  # the normalised dims are never strided: one range each
        return {**attrs, "norm_slices": [list(out.dim_bounds(d, coords)) for d in dims]}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None,) * len(inputs)
        grads = g.op(f"{self.name}_grad", [dy, *inputs], dict(attrs), num_outputs=len(inputs))
        return tuple(v if need and _is_float(g.spec(i).dtype) else None for v, need, i in zip(grads, needs, inputs))


class _NormGradRule(OpRule):
    params: tuple[str, ...] = ()
    forward = ""
    violation_codes = NORM_CODES
    differentiable = False
    strided = True

    def infer_layout(self, inputs, attrs):
        dy, x, params = inputs[0], inputs[1], inputs[2:]
        x_fixed, wants, violations, ok = _norm_analysis(self.forward, x, list(zip(self.params, params)), attrs)
        if not ok:
            return RuleResult((None,) * self.num_outputs, tuple(violations), ())
        dy_want, partials, dy_violations, dy_ok = _cotangent(dy, x_fixed, x.shape, self.forward)
        violations = dy_violations + violations
        if not dy_ok:
            return RuleResult((None,) * self.num_outputs, tuple(violations), ())
        dx = TensorSpec(x.shape, x.dtype, _with_partials(x_fixed, partials))
        dparams = tuple(TensorSpec(p.shape, p.dtype, _param_grad_layout(x_fixed, p.ndim, partials)) for p in params)
        return RuleResult((dx, *dparams), tuple(violations), (_want(dy_want, dy), *wants))


@register_op
class RmsNorm(_NormRule):
    """``rms_norm(x, weight, eps=1e-6, normalized_ndim=1)``: see the module docstring."""

    name = "rms_norm"
    operands = ("x", "weight")
    params = ("weight",)
    aliases = ("RmsNorm", "npu_rms_norm", "RMSNorm", "aten.rms_norm")
    attr_defaults = {"eps": 1e-6, "normalized_ndim": 1}


@register_op
class RmsNormGrad(_NormGradRule):
    """``rms_norm_grad(dy, x, weight) -> (dx, dweight)``; dweight is ``P(sum)`` where x's other dims shard."""

    name = "rms_norm_grad"
    operands = ("dy", "x", "weight")
    params = ("weight",)
    forward = "rms_norm"
    aliases = ("RmsNormGrad",)
    num_outputs = 2
    attr_defaults = {"eps": 1e-6, "normalized_ndim": 1}


@register_op
class LayerNorm(_NormRule):
    """``layer_norm(x, weight, bias, eps=1e-5, normalized_ndim=1)``: see the module docstring."""

    name = "layer_norm"
    operands = ("x", "weight", "bias")
    params = ("weight", "bias")
    aliases = ("LayerNorm", "aten.layer_norm")
    attr_defaults = {"eps": 1e-5, "normalized_ndim": 1}


@register_op
class LayerNormGrad(_NormGradRule):
    """``layer_norm_grad(dy, x, weight, bias) -> (dx, dweight, dbias)``."""

    name = "layer_norm_grad"
    operands = ("dy", "x", "weight", "bias")
    params = ("weight", "bias")
    forward = "layer_norm"
    aliases = ("LayerNormGrad",)
    num_outputs = 3
    attr_defaults = {"eps": 1e-5, "normalized_ndim": 1}


# ------------------------------------------------------------------------------ softmax
def _softmax_analysis(op: str, x: TensorSpec, operand: str, attrs: dict):
    """``(fixed, violations, ok)`` for a softmax-like op over ``attrs["axis"]``."""
    problem = _axis_problem(attrs["axis"], x.ndim, "axis", op)
    if problem is not None:
        return None, [dataclasses.replace(problem, operand=operand)], False
    axis = attrs["axis"] % x.ndim
    fixed, issues = _whole_dims(x, operand, [axis], "sharded-softmax-dim", op,
                                f"{op} normalises along axis {axis} and needs it whole on every rank",
                                f", or shard another dim of {operand} instead")
    return fixed, _move_violations(x, fixed, operand, issues), True


class _SoftmaxRule(OpRule):
    operands = ("x",)
    attr_defaults = {"axis": -1}
    violation_codes = SOFTMAX_CODES
    strided = True  # a strided shard off the axis stays; on the axis, gathered

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        fixed, violations, ok = _softmax_analysis(self.name, x, "x", attrs)
        out = TensorSpec(x.shape, float_dtype(x.dtype), fixed) if ok else None
        return RuleResult((out,), tuple(violations), (_want(fixed, x) if ok else None,))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None or not needs[0] or not _is_float(g.spec(inputs[0]).dtype):
            return (None,)
        return (g.op(f"{self.name}_grad", [cotangents[0], outputs[0]], {"axis": attrs["axis"]}),)


class _SoftmaxGradRule(OpRule):
    """``dx`` from ``dy`` and the forward output ``y``; linear in dy."""

    operands = ("dy", "y")
    attr_defaults = {"axis": -1}
    violation_codes = SOFTMAX_CODES
    differentiable = False
    forward = ""
    strided = True

    def infer_layout(self, inputs, attrs):
        dy, y = inputs
        fixed, violations, ok = _softmax_analysis(self.forward, y, "y", attrs)
        if not ok:
            return RuleResult((None,), tuple(violations), ())
        dy_want, partials, dy_violations, dy_ok = _cotangent(dy, fixed, y.shape, self.forward)
        if not dy_ok:
            return RuleResult((None,), tuple(dy_violations + violations), ())
        dx = TensorSpec(y.shape, float_dtype(dy.dtype, y.dtype), _with_partials(fixed, partials))
        return RuleResult((dx,), tuple(dy_violations + violations), (_want(dy_want, dy), _want(fixed, y)))


@register_op
class Softmax(_SoftmaxRule):
    """``softmax(x, axis=-1)``."""

    name = "softmax"
    aliases = ("Softmax", "aten.softmax", "aten._softmax")


@register_op
class SoftmaxGrad(_SoftmaxGradRule):
    """``softmax_grad(dy, y, axis) = y * (dy - sum(dy * y, axis))``."""

    name = "softmax_grad"
    aliases = ("SoftmaxGrad",)
    forward = "softmax"


@register_op
class LogSoftmax(_SoftmaxRule):
    """``log_softmax(x, axis=-1)``."""

    name = "log_softmax"
    aliases = ("LogSoftmax", "aten.log_softmax", "aten._log_softmax")


@register_op
class LogSoftmaxGrad(_SoftmaxGradRule):
    """``log_softmax_grad(dy, y, axis) = dy - exp(y) * sum(dy, axis)``."""

    name = "log_softmax_grad"
    aliases = ("LogSoftmaxGrad",)
    forward = "log_softmax"


# ---------------------------------------------------------------------------- attention
ATTENTION_OP = "scaled_dot_product_attention"


def _attention_attr_violations(attrs: dict) -> list[Violation]:
    out = []
    if attrs["layout"] not in ATTENTION_LAYOUTS:
        out.append(Violation("invalid-input-layout", f"attention layout {attrs['layout']!r} is not one of "
                             f"{sorted(ATTENTION_LAYOUTS)}", "set layout to 'BNSD' or 'BSND' (q, k and v alike)",
                             operand="q"))
    if not isinstance(attrs["causal"], bool):
        out.append(_bad_attr(f"causal={attrs['causal']!r} is not a bool", "set causal to true or false", "q"))
    scale = attrs["scale"]
    if scale is not None and not _is_number(scale):
        out.append(_bad_attr(f"scale={scale!r} is not a number", "leave scale out (1/sqrt(D)) or give a number",
                             "q"))
    offset = attrs["q_offset"]
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral) or offset < 0:
        out.append(_bad_attr(f"q_offset={offset!r} is not a non-negative integer",
                             "leave q_offset out (each rank's offset is filled in by lowering)", "q"))
    zigzag = attrs.get("zigzag", 0)
    if isinstance(zigzag, bool) or not isinstance(zigzag, numbers.Integral) or zigzag < 0:
        out.append(_bad_attr(f"zigzag={zigzag!r} is not a non-negative integer", "give zigzag, the number of "
                             "sequence shards the zig-zag order balances (0: the natural order)", "q"))
    elif zigzag and attrs["q_offset"] != 0:
        out.append(_bad_attr(f"zigzag={zigzag} with q_offset={attrs['q_offset']!r}: a zig-zag ordered sequence is "
                             "one whole sequence", "leave q_offset out with zigzag", "q"))
    if attrs.get("context_parallel", "all_gather") not in CONTEXT_PARALLEL:
        out.append(_bad_attr(f"context_parallel={attrs['context_parallel']!r} is not one of {list(CONTEXT_PARALLEL)}",
                             "all_gather gathers k and v on the axes that shard q's sequence, ulysses moves q, k, v "
                             "to their heads there, auto takes the one moving fewer bytes", "q"))
    return out


def _attention_shape_violations(q: TensorSpec, k: TensorSpec, v: TensorSpec, dims: dict,
                                three_d: bool = False) -> list[Violation]:
    """Rank and size mismatches of 4-D q, k, v; ``three_d`` when the op also takes them all 3-D
    (torch's (N, L, E): scaled_dot_product_attention and its gradient), so the message says so."""
    out = []
    takes = ("attention takes q, k, v all 4-D (BNSD or BSND) or all 3-D (N, L, E)" if three_d
             else "attention takes 4-D q, k, v in the BNSD or BSND layout")
    fix = "reshape {} to 4-D, or give q, k and v all 3-D" if three_d else "reshape {} to 4-D"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            out.append(Violation("invalid-shape", f"{name} has rank {t.ndim} (shape {list(t.shape)}); {takes}",
                                 fix.format(name), operand=name))
    if out:
        return out

    def size(t: TensorSpec, dim: str) -> int:
        return t.shape[dims[dim]]

    checks = [("k", k, "B", q), ("v", v, "B", q), ("v", v, "N", k), ("k", k, "D", q), ("v", v, "S", k)]
    for name, t, dim, ref in checks:
        ref_name = "k" if ref is k else "q"
        if size(t, dim) != size(ref, dim):
            out.append(Violation("invalid-shape", f"{name}'s {dim} (dim {dims[dim]}) is {size(t, dim)} but "
                                 f"{ref_name}'s is {size(ref, dim)} (q {list(q.shape)}, k {list(k.shape)}, "
                                 f"v {list(v.shape)})", f"give {name} the same {dim} as {ref_name}", operand=name))
    problem = gqa_heads_problem(size(q, "N"), size(k, "N"), f"dim {dims['N']}", (q, k, v))
    if problem is not None:
        out.append(problem)
    return out


def gqa_heads_problem(q_heads: int, kv_heads: int, where: str, specs) -> Violation | None:
    """``invalid-shape`` unless q's head count is a multiple of k's and v's (grouped-query attention).

    ``where`` names the head dim; ``specs`` are q, k, v (their shapes go into the message).
    """
    if kv_heads == q_heads or (kv_heads > 0 and q_heads % kv_heads == 0):
        return None
    shapes = ", ".join(f"{n} {list(t.shape)}" for n, t in zip("qkv", specs))
    return Violation("invalid-shape", f"q has {q_heads} heads but k and v have {kv_heads} ({where}; {shapes}): "
                     "grouped-query attention needs q's head count to be a multiple of k's and v's",
                     "give k and v a head count that divides q's (1 for multi-query attention, q's for "
                     "multi-head attention)", operand="k")


def head_ranges(spec: TensorSpec, dim: int, axes: Sequence[int], unit: int = 1) -> dict | None:
    """The heads ``[first, stop)`` of ``spec``'s dim ``dim`` at each coordinate of mesh ``axes``.

    ``unit`` is the number of elements of one head along the dim (D for a fused ``H = N*D``
    dim, else 1).  Keys are the coordinate tuples on ``axes`` (the other axes at 0: only
    ``axes`` may cut the dim); None when a piece does not start and end on head boundaries.
    """
    mesh = spec.mesh
    out = {}
    for point in itertools.product(*(range(mesh.shape[a]) for a in axes)):
        coords = [0] * mesh.ndim
        for a, c in zip(axes, point):
            coords[a] = c
        lo, hi = spec.dim_bounds(dim, tuple(coords))
        if unit and (lo % unit or hi % unit):
            return None
        out[point] = (lo // unit, hi // unit) if unit else (0, 0)
    return out


def kv_heads_follow(q: TensorSpec, kv: TensorSpec, q_dim: int, kv_dim: int, axes: Sequence[int],
                    q_unit: int = 1, kv_unit: int = 1) -> bool:
    """Whether k or v (``kv``) sharded on q's head-sharding mesh ``axes`` gives every rank the kv
    heads its query heads use (query head h uses kv head ``h // (q heads / kv heads)``).

    True for multi-head attention (equal head counts); for grouped-query attention when the
    kv heads split as the query heads do (kv heads a multiple of the ranks, say), False when
    a query head's kv head would be on another rank (8 query and 2 kv heads on 4 ranks).
    """
    q_heads, kv_heads = q.shape[q_dim] // max(q_unit, 1), kv.shape[kv_dim] // max(kv_unit, 1)
    if not axes or q_heads == kv_heads:
        return True
    group = q_heads // kv_heads if kv_heads else 1
    q_ranges = head_ranges(q, q_dim, axes, q_unit)
    kv_ranges = head_ranges(kv, kv_dim, axes, kv_unit)
    if q_ranges is None or kv_ranges is None:
        return False
    for point, (a, b) in q_ranges.items():
        c, d = kv_ranges[point]
        if b > a and not (c <= a // group and (b - 1) // group < d):
            return False
    return True


def kv_head_map(q_heads: tuple[int, int], kv_heads: tuple[int, int], group: int) -> tuple[int, ...]:
    """For each local query head, the index of its kv head among the local kv heads.

    ``q_heads`` and ``kv_heads`` are the global ``[first, stop)`` heads a rank holds.

    >>> kv_head_map((2, 4), (0, 2), 2), kv_head_map((4, 8), (1, 2), 4)
    ((1, 1), (0, 0, 0, 0))
    """
    return tuple((h // group) - kv_heads[0] for h in range(*q_heads))


def _kv_want(q: TensorSpec, q_fixed: Layout, t: TensorSpec, dims: dict) -> Layout:
    """k's and v's layout: q's B and N shards, everything else Replicate.

    With grouped-query heads that do not split as q's do (8 query and 2 kv heads on 4
    ranks), q's N axes are Replicate too: every rank holds every kv head (Megatron's kv
    head replication) and its kernel picks those of its query heads (``kv_head_map``).
    """
    keep = (dims["B"], dims["N"])
    ps = [p if isinstance(p, Shard) and p.dim in keep else Replicate() for p in q_fixed.placements]
    want = Layout(t.mesh, ps, t.ndim)
    n_axes = want.dim_axes(dims["N"])
    if n_axes and q.shape[dims["N"]] != t.shape[dims["N"]]:
        try:
            follows = kv_heads_follow(q.with_layout(q_fixed), t.with_layout(want), dims["N"], dims["N"], n_axes)
        except LayoutPropError:  # fewer kv heads than the ranks that would split them (a size-1 dim, say)
            follows = False
        if not follows:
            want = want.with_placements([Replicate() if a in n_axes else p for a, p in enumerate(ps)])
    return want


def _kv_issues(name: str, t: TensorSpec, want: Layout, q: TensorSpec, dims: dict) -> list[tuple[str, str, str]]:
    issues = []
    s, d = dims["S"], dims["D"]
    for axis, p in enumerate(t.layout.placements):
        axis_name = _name(t.mesh, axis)
        if isinstance(p, Partial):
            issues.append(_partial_issue(t, name, axis, ATTENTION_OP, "is not linear in it (only sum or avg "
                                         "partials of v alone would be), so every rank needs whole values"))
        elif isinstance(p, Shard) and p.dim == s and want.placements[axis] == Shard(dims["N"]):
            issues.append(("sharded-kv-sequence", f"{name}'s sequence dim {s} (S, size {t.shape[s]}) is sharded on "
                           f"mesh axis {axis_name} ({name} is {t.layout}); with Ulysses attention shards the heads "
                           f"there", f"all-to-all {name} on {axis_name} to its heads (dim {dims['N']})"))
        elif isinstance(p, Shard) and p.dim == s:
            issues.append(("sharded-kv-sequence", f"{name}'s sequence dim {s} (S, size {t.shape[s]}) is sharded on "
                           f"mesh axis {axis_name} ({name} is {t.layout}); every query row attends to the whole "
                           "key/value sequence",
                           f"all-gather {name} on {axis_name}; to split the sequence, shard "
                           f"q's sequence dim {s} instead"))
        elif isinstance(p, Shard) and p.dim == d:
            issues.append(("sharded-head-dim", f"{name}'s head dim {d} (D, size {t.shape[d]}) is sharded on mesh "
                           f"axis {axis_name} ({name} is {t.layout}); attention contracts over whole heads",
                           f"all-gather {name} on {axis_name}, or shard B or N on "
                           f"{axis_name} instead"))
        elif isinstance(p, Shard) and p.dim == dims["N"] and q.layout.placements[axis] == p \
                and want.placements[axis] != p:
            issues.append(("sharding-mismatch", f"{name}'s heads (dim {p.dim}, N = {t.shape[p.dim]}) cannot be split "
                           f"on mesh axis {axis_name} as q's {q.shape[p.dim]} heads are (q is {q.layout}, {name} is "
                           f"{t.layout}): a query head's kv head (query head h uses kv head "
                           f"h // {q.shape[p.dim] // max(t.shape[p.dim], 1)}) would be on another rank",
                           f"all-gather {name} on {axis_name} (every rank keeps every kv head and uses those of "
                           f"its query heads), or shard fewer query heads on {axis_name}"))
        elif isinstance(p, Shard) and p != want.placements[axis]:
            label = "B" if p.dim == dims["B"] else "N"
            q_p = want.placements[axis]
            q_desc = f"q shards its dim {q_p.dim} there" if isinstance(q_p, Shard) else "q does not shard B or N there"
            issues.append(("sharding-mismatch", f"{name}'s dim {p.dim} ({label}, size {t.shape[p.dim]}) is sharded "
                           f"on mesh axis {axis_name} but {q_desc} (q is {q.layout}, {name} is {t.layout}); k and v "
                           "follow q's B and N sharding", f"shard {name} like q on {axis_name} ({want}), or shard "
                           f"q's dim {p.dim} on {axis_name} too"))
    return issues


def _attention_analysis(q: TensorSpec, k: TensorSpec, v: TensorSpec, attrs: dict):
    """Shared by the forward and gradient rules: ``(q_fixed, kv_wants, wants, violations, dims)``.

    ``q_fixed`` is None when the shapes or attrs are unusable.
    """
    violations = _attention_attr_violations(attrs)
    dims = ATTENTION_LAYOUTS.get(attrs["layout"])
    if dims is not None:
        violations += _attention_shape_violations(q, k, v, dims, three_d=True)
        if not violations and q.shape[dims["D"]] == 0 and attrs["scale"] is None:
            violations.append(Violation("invalid-shape", f"q's head dim D is 0 (q {list(q.shape)}): the default "
                                        "scale 1/sqrt(D) is undefined", "give q and k a head dim of at least 1, "
                                        "or an explicit scale", operand="q"))
    if not violations and attrs["zigzag"]:
        violations += zigzag_problems(q.shape[dims["S"]], k.shape[dims["S"]], attrs["zigzag"], "q")
    if violations:
        return None, (None, None), [None, None, None], violations, dims
    q_fixed, issues = _whole_dims(q, "q", [dims["D"]], "sharded-head-dim", ATTENTION_OP,
                                  "attention contracts over whole heads", ", or shard B, N or S of q instead")
    heads_layout = _ulysses(q, k, v, q_fixed, attrs["context_parallel"], dims)
    if heads_layout is not None:
        issues = issues + [ulysses_issue(q, q_fixed, heads_layout, "q", attrs["context_parallel"])]
        q_fixed = heads_layout
    violations += _move_violations(q, q_fixed, "q", issues)
    wants: list[Layout | None] = [_want(q_fixed, q)]
    kv_wants = []
    for name, t in (("k", k), ("v", v)):
        want = _kv_want(q, q_fixed, t, dims)
        violations += _move_violations(t, want, name, _kv_issues(name, t, want, q, dims))
        wants.append(_want(want, t))
        kv_wants.append(want)
    return q_fixed, tuple(kv_wants), wants, violations, dims


def zigzag_problems(sq: int, skv: int, zigzag: int, operand: str) -> list[Violation]:
    """``invalid-shape`` unless the query and key sequences are one sequence of ``2 * zigzag`` equal chunks."""
    if sq == skv and sq % (2 * zigzag) == 0:
        return []
    return [Violation("invalid-shape", f"zigzag={zigzag} keeps the sequence in {2 * zigzag} chunks, but the query "
                      f"sequence is {sq} and the key sequence {skv}", f"give query and key one sequence of a "
                      f"multiple of {2 * zigzag} tokens, or zigzag=0", operand=operand)]


def moved_bytes(spec: TensorSpec, want: Layout) -> float:
    """Bytes per rank of moving ``spec`` to ``want`` (infinite when no redistribution can)."""
    from layout_prop.core.redistribute import plan_redistribution

    try:
        return plan_redistribution(spec, want).bytes_per_rank
    except LayoutPropError:
        return math.inf


def heads_for_sequence(q: TensorSpec, q_fixed: Layout, s_dim: int, head_dim: int) -> Layout | None:
    """Ulysses: q's layout with every mesh axis that shards its sequence sharding its heads instead
    (None when no axis shards the sequence, or the heads cannot be cut so)."""
    axes = q_fixed.dim_axes(s_dim)
    if not axes:
        return None
    try:
        layout = Layout(q.mesh, [Shard(head_dim) if a in axes else p for a, p in enumerate(q_fixed.placements)],
                        q.ndim)
        q.with_layout(layout)  # a layout that can exist (no size-1 dim over several ranks)
    except LayoutPropError:
        return None
    return layout


def ulysses_issue(q: TensorSpec, q_fixed: Layout, heads_layout: Layout, operand: str, mode: str):
    """The ``(code, message, hint)`` of moving q from its sequence shards to its heads (Ulysses)."""
    axes = [a for a, (p, h) in enumerate(zip(q_fixed.placements, heads_layout.placements)) if p != h]
    names = _names(q.mesh, axes)
    return ("sharding-mismatch", f"context_parallel={mode!r}: {operand}'s sequence is sharded on mesh axis {names} "
            f"({operand} is {q.layout}); attention runs with the heads sharded there instead ({heads_layout}: "
            f"Ulysses, an all-to-all of {operand}, key and value, and of the output back)",
            f"let --reshard insert the all-to-alls, or set context_parallel='all_gather' to gather key and value "
            f"on {names} instead")


def _ulysses(q: TensorSpec, k: TensorSpec, v: TensorSpec, q_fixed: Layout, mode: str, dims: dict) -> Layout | None:
    """The heads-sharded layout q moves to for Ulysses context parallelism, or None to gather k and v.

    ``mode`` ``ulysses`` moves whenever every kv head then follows its query heads; ``auto`` only
    when the all-to-alls of q, k, v and the output move fewer bytes than gathering k and v.
    """
    if mode not in ("ulysses", "auto"):
        return None
    heads_layout = heads_for_sequence(q, q_fixed, dims["S"], dims["N"])
    if heads_layout is None:
        return None
    kv_wants = [_kv_want(q, heads_layout, t, dims) for t in (k, v)]
    if any(w.dim_axes(dims["N"]) != heads_layout.dim_axes(dims["N"]) for w in kv_wants):
        return None  # kv heads that cannot split as the query heads: gathering them is no saving
    if mode == "ulysses":
        return heads_layout
    out = TensorSpec(q.shape[:-1] + (v.shape[-1],), q.dtype, heads_layout)
    gather = sum(moved_bytes(t, _kv_want(q, q_fixed, t, dims)) for t in (k, v))
    alltoall = moved_bytes(q, heads_layout) + sum(moved_bytes(t, w) for t, w in zip((k, v), kv_wants)) + \
        moved_bytes(out, q_fixed)
    return heads_layout if alltoall < gather else None


def _q_offset(attrs: dict, q: TensorSpec, rank: int) -> int:
    s = ATTENTION_LAYOUTS[attrs["layout"]]["S"]
    return int(attrs["q_offset"]) + q.local_slices(rank)[s][0]


def _localized(attrs: dict, q: TensorSpec, k: TensorSpec, rank: int) -> dict:
    """A rank's attrs: its query rows' offset and, for grouped-query heads, its ``kv_head_map``."""
    n = ATTENTION_LAYOUTS[attrs["layout"]]["N"]
    out = {**attrs, "q_offset": _q_offset(attrs, q, rank)}
    if q.shape[n] != k.shape[n]:
        out["kv_head_map"] = kv_head_map(q.local_slices(rank)[n], k.local_slices(rank)[n], q.shape[n] // k.shape[n])
    return out


def _kv_head_axes(q_fixed: Layout, kv_want: Layout, dims: dict) -> set[int]:
    """Mesh axes that shard q's heads but not k's or v's (kv heads replicated for grouped-query heads)."""
    return set(q_fixed.dim_axes(dims["N"])) - set(kv_want.dim_axes(dims["N"]))


_ATTENTION_ATTRS = {"layout": "BNSD", "causal": False, "scale": None, "q_offset": 0, "context_parallel": "all_gather",
                    "zigzag": 0}
#: how attention runs with q's sequence sharded: gather k and v, all-to-all to the heads (Ulysses), or the cheaper;
#: ring (sdpa only): k and v passed around the ring, written by the expand pass (ops/ring.py)
CONTEXT_PARALLEL = ("all_gather", "ulysses", "auto", "ring")


def _heads_dim(attrs: dict) -> int:
    """Where a 3-D (N, L, E) q, k, v gets its one head: the layout's head dim (1 for BNSD, 2 for BSND)."""
    return ATTENTION_LAYOUTS.get(attrs.get("layout"), ATTENTION_LAYOUTS["BNSD"])["N"]


def _moved_dims(layout: Layout, ndim: int, fn) -> Layout:
    """``layout`` on a tensor of ``ndim`` dims, each shard's dim ``d`` at ``fn(d)`` (None: Replicate)."""
    ps = []
    for p in layout.placements:
        if isinstance(p, (Shard, StridedShard)):
            d = fn(p.dim)
            p = Replicate() if d is None else StridedShard(d, p.split_factor) if isinstance(p, StridedShard) \
                else Shard(d)
        ps.append(p)
    return Layout(layout.mesh, ps, ndim)


def _one_head(specs: Sequence[TensorSpec], attrs: dict) -> tuple[TensorSpec, ...]:
    """3-D (N, L, E) specs, torch's attention without a head dim, as 4-D ones with one head."""
    h = _heads_dim(attrs)
    return tuple(TensorSpec(t.shape[:h] + (1,) + t.shape[h:], t.dtype,
                            _moved_dims(t.layout, t.ndim + 1, lambda d: d + 1 if d >= h else d)) for t in specs)


def _headless(spec: TensorSpec | None, attrs: dict) -> TensorSpec | None:
    """A 4-D spec of one head back to 3-D (the inverse of :func:`_one_head`)."""
    if spec is None:
        return None
    h = _heads_dim(attrs)
    return TensorSpec(spec.shape[:h] + spec.shape[h + 1:], spec.dtype, _headless_layout(spec.layout, attrs))


def _headless_layout(layout: Layout | None, attrs: dict) -> Layout | None:
    if layout is None:
        return None
    h = _heads_dim(attrs)
    return _moved_dims(layout, layout.ndim - 1, lambda d: None if d == h else d - 1 if d > h else d)


def _three_d(specs: Sequence[TensorSpec]) -> bool:
    """Whether q, k, v (the last three specs) are all 3-D: torch's (N, L, E), one head."""
    return all(t.ndim == 3 for t in specs[-3:])


def _headless_result(res: RuleResult, attrs: dict) -> RuleResult:
    """The result of the rule on one-head 4-D specs, for the 3-D specs it was asked about: outputs and
    wants back to 3-D, each violation's message saying how its dims count (and its wanted placements
    back on the 3-D dims)."""
    h = _heads_dim(attrs)
    note = (f" (3-D q, k, v (N, L, E) are read as {attrs.get('layout')} with one head at dim {h}: "
            "the dims and layouts above count that dim)")

    def placement(text: str) -> str:
        p = parse_placement(text)
        if not isinstance(p, (Shard, StridedShard)):
            return text
        d = None if p.dim == h else p.dim - 1 if p.dim > h else p.dim
        return "R" if d is None else str(StridedShard(d, p.split_factor) if isinstance(p, StridedShard) else Shard(d))

    violations = tuple(dataclasses.replace(v, message=v.message + note, details={
        **v.details, **({"want": [placement(t) for t in v.details["want"]]} if "want" in v.details else {})})
        for v in res.violations)
    return RuleResult(tuple(_headless(o, attrs) for o in res.outputs), violations,
                      tuple(_headless_layout(w, attrs) for w in res.wants))


@register_op
class ScaledDotProductAttention(OpRule):
    """``scaled_dot_product_attention(q, k, v, layout="BNSD", causal=False, scale=None, q_offset=0)``.

    See the module docstring for the layout rule; ``q_offset`` is localised per rank.
    """

    name = ATTENTION_OP
    operands = ("q", "k", "v")
    aliases = ("ScaledDotProductAttention", "sdpa", "aten.scaled_dot_product_attention")
    attr_defaults = dict(_ATTENTION_ATTRS)
    violation_codes = ATTENTION_CODES

    def infer_layout(self, inputs, attrs):
        if _three_d(inputs):  # torch's (N, L, E): one head
            return _headless_result(self.infer_layout(_one_head(inputs, attrs), attrs), attrs)
        q, k, v = inputs
        q_fixed, _, wants, violations, _ = _attention_analysis(q, k, v, attrs)
        out = None
        if q_fixed is not None:
            out = TensorSpec(q.shape[:-1] + (v.shape[-1],), float_dtype(q.dtype, k.dtype, v.dtype), q_fixed)
        if attrs["context_parallel"] == "ring":  # the expand pass writes the ring where it applies
            violations = [dataclasses.replace(v, hint=f"{v.hint}; with context_parallel='ring', --reshard passes "
                                              "k and v around the ring instead (a permute a step) where q, k and v "
                                              "shard their sequence on one mesh axis")
                          if v.code == "sharded-kv-sequence" else v for v in violations]
        return RuleResult((out,), tuple(violations), tuple(wants))

    def localize(self, attrs, inputs, outputs, rank):
        if _three_d(inputs):
            inputs = _one_head(inputs, attrs)
        return _localized(attrs, inputs[0], inputs[1], rank)

    def expand(self, b, inputs, attrs, specs):
        from .ring import ring_attention  # context_parallel='ring'

        if _three_d(specs):
            if attrs.get("context_parallel") == "ring":
                b.note("ring attention takes 4-D q, k, v (BNSD or BSND); 3-D ones (N, L, E) gather k and v")
            return None
        return ring_attention(b, inputs, attrs, specs)

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None, None, None)
        grads = g.op(f"{ATTENTION_OP}_grad", [dy, *inputs], dict(attrs), num_outputs=3)
        return tuple(gv if need and _is_float(g.spec(i).dtype) else None for gv, need, i in zip(grads, needs, inputs))


@register_op
class ScaledDotProductAttentionGrad(OpRule):
    """``scaled_dot_product_attention_grad(dy, q, k, v) -> (dq, dk, dv)``.

    dq takes q's layout; dk and dv take k's and v's, plus ``P(sum)`` on every mesh axis
    that shards q's sequence: each rank sums the contributions of its own query rows.
    ``q_offset`` is localised as in the forward.
    """

    name = f"{ATTENTION_OP}_grad"
    operands = ("dy", "q", "k", "v")
    aliases = ("ScaledDotProductAttentionGrad",)
    num_outputs = 3
    attr_defaults = dict(_ATTENTION_ATTRS)
    violation_codes = ATTENTION_CODES
    differentiable = False

    def infer_layout(self, inputs, attrs):
        if _three_d(inputs) and inputs[0].ndim == 3:  # torch's (N, L, E): one head
            return _headless_result(self.infer_layout(_one_head(inputs, attrs), attrs), attrs)
        dy, q, k, v = inputs
        q_fixed, kv_wants, wants, violations, dims = _attention_analysis(q, k, v, attrs)
        if q_fixed is None:
            return RuleResult((None,) * 3, tuple(violations), ())
        out_shape = q.shape[:-1] + (v.shape[-1],)
        dy_want, partials, dy_violations, dy_ok = _cotangent(dy, q_fixed, out_shape, ATTENTION_OP)
        violations = dy_violations + violations
        if not dy_ok:
            return RuleResult((None,) * 3, tuple(violations), ())
        seq_axes = set(q_fixed.dim_axes(dims["S"]))
        grads = [TensorSpec(q.shape, q.dtype, _with_partials(q_fixed, partials))]
        for t, want in zip((k, v), kv_wants):
            summed = seq_axes | _kv_head_axes(q_fixed, want, dims)
            ps = [partials.get(a, Partial("sum") if a in summed else p) for a, p in enumerate(want.placements)]
            grads.append(TensorSpec(t.shape, t.dtype, Layout(t.mesh, ps, t.ndim)))
        return RuleResult(tuple(grads), tuple(violations), (_want(dy_want, dy), *wants))

    def localize(self, attrs, inputs, outputs, rank):
        if _three_d(inputs):
            inputs = _one_head(inputs, attrs)
        return _localized(attrs, inputs[1], inputs[2], rank)


# ------------------------------------------------------------------------------- swiglu
def _swiglu_analysis(op: str, x: TensorSpec, attrs: dict):
    """``(x_fixed, out_shape, violations)``; ``x_fixed`` is None when x or dim is unusable."""
    problem = _axis_problem(attrs["dim"], x.ndim, "dim", op)
    if problem is not None:
        return None, None, [problem]
    dim = attrs["dim"] % x.ndim
    if x.shape[dim] % 2:
        return None, None, [Violation("invalid-shape", f"{op} cuts x (shape {list(x.shape)}) into two halves along "
                                      f"dim {dim}, but its size {x.shape[dim]} is odd",
                                      f"give x an even size on dim {dim} (gate and up halves)", operand="x")]
    x_fixed, issues = _whole_dims(
        x, "x", [dim], "sharded-split-dim", op,
        f"{op} cuts dim {dim} into halves a and b, and a torch.chunk shard of it does not hold matching halves",
        ", or shard another dim of x instead (or keep gate and up apart and use silu_mul)")
    out_shape = tuple(s // 2 if i == dim else s for i, s in enumerate(x.shape))
    return x_fixed, out_shape, _move_violations(x, x_fixed, "x", issues)


@register_op
class Swiglu(OpRule):
    """``swiglu(x, dim=-1) = silu(a) * b`` with ``a, b`` the halves of x along ``dim``."""

    name = "swiglu"
    operands = ("x",)
    aliases = ("Swiglu", "SwiGLU", "npu_swiglu")
    attr_defaults = {"dim": -1}
    violation_codes = SWIGLU_CODES

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        x_fixed, out_shape, violations = _swiglu_analysis(self.name, x, attrs)
        if x_fixed is None:
            return RuleResult((None,), tuple(violations), ())
        out = TensorSpec(out_shape, float_dtype(x.dtype), x_fixed)
        return RuleResult((out,), tuple(violations), (_want(x_fixed, x),))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None or not needs[0] or not _is_float(g.spec(inputs[0]).dtype):
            return (None,)
        return (g.op("swiglu_grad", [cotangents[0], inputs[0]], {"dim": attrs["dim"]}),)


@register_op
class SwigluGrad(OpRule):
    """``swiglu_grad(dy, x, dim) -> dx``: linear in dy."""

    name = "swiglu_grad"
    operands = ("dy", "x")
    attr_defaults = {"dim": -1}
    violation_codes = SWIGLU_CODES
    differentiable = False

    def infer_layout(self, inputs, attrs):
        dy, x = inputs
        x_fixed, out_shape, violations = _swiglu_analysis("swiglu", x, attrs)
        if x_fixed is None:
            return RuleResult((None,), tuple(violations), ())
        dy_want, partials, dy_violations, dy_ok = _cotangent(dy, x_fixed, out_shape, "swiglu")
        if not dy_ok:
            return RuleResult((None,), tuple(dy_violations + violations), ())
        dx = TensorSpec(x.shape, x.dtype, _with_partials(x_fixed, partials))
        return RuleResult((dx,), tuple(dy_violations + violations), (_want(dy_want, dy), _want(x_fixed, x)))
