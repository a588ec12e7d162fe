"""Rules of the order op family: topk, sort, argmax, argmin, cumsum, prod, maximum, minimum.

One order everywhere: ties keep the lowest index first (torch's stable sort) in both
directions, and NaN is greater than every number, so that a sharded run selects exactly
what one device selects (the kernels are in :mod:`layout_prop.kernels.order_numpy`).

The ops
-------
``topk(x, k, dim=-1, largest=True, sorted=True) -> (values, indices)``
    The ``k`` greatest (``largest``) or least elements along ``dim``, in order, and their
    int64 indices.  ``sorted=False`` gives the sorted result too (torch leaves that order
    unspecified).  Aliases ``TopK`` (MindSpore, ONNX), ``aten.topk``.
``sort(x, dim=-1, descending=False, stable=False) -> (values, indices)``
    Always stable (a stable sort is one of the results an unstable sort may give).
    Aliases ``Sort``, ``aten.sort``.
``argmax(x, dim=None, keepdim=False)``, ``argmin(...)``
    int64 indices of the first greatest (least) element along ``dim``; ``dim=None`` over
    the flattened x.  No gradient.  Aliases ``Argmax``/``ArgMax``/``aten.argmax`` and
    ``Argmin``/``ArgMin``/``aten.argmin`` (MindSpore's ``ArgMaxWithValue`` returns the
    values too, two outputs, so it is not an alias).
``cumsum(x, dim, exclusive=False, reverse=False)``
    The running sum along ``dim``; ``exclusive`` and ``reverse`` are MindSpore
    ``CumSum``'s attrs (torch's ``cumsum`` is both False).  Integers and bools accumulate
    in int64 (torch).  Aliases ``CumSum`` (MindSpore, ONNX), ``aten.cumsum``.  The
    gradient is the cumsum of the cotangent run the other way.
``prod(x, dims=None, keepdim=False)``
    The product over ``dims`` (an int, a list, or None for every dim); integers and bools
    in int64.  The gradient is ``dy`` times the product of the other elements of each
    reduced slice, computed from prefix and suffix products (no division, exact with
    zeros).  Aliases ``ReduceProd``, ``aten.prod``, ``reduce_prod``.
``maximum(x, y)``, ``minimum(x, y)``
    Elementwise with numpy broadcasting.  The cotangent goes to the operand that wins,
    half to each on a tie (torch's rule).  Aliases ``Maximum``, ``aten.maximum``;
    ``Minimum``, ``aten.minimum``.

Layout rules
------------
- The dim that topk, sort, argmax, argmin and cumsum run along, and the dims prod
  reduces, must be whole on every rank: a shard there is ``sharded-order-dim``, fixable
  by an all-gather.  Every other dim shards freely (a strided shard too) and the outputs
  keep those shards.
- Partial inputs: cumsum is linear, so ``P(sum)`` (floats and int64) and ``P(avg)``
  (floats) pass through; every other op here needs the value (``partial-input``).
- maximum passes ``P(max)`` through (the maximum of maxima is the maximum), minimum
  ``P(min)``: partial operands of that op with Replicate ones (a free ``local-partial``,
  every rank keeping the value) give the same Partial.  Otherwise maximum and minimum
  shard like the elementwise ops.
- Bad input is unusable (``OpError``, exit 2), not a violation: ``k`` not an integer in
  ``0..size of dim``, a dim out of range, argmax/argmin along an empty dim, shapes of
  maximum/minimum that do not broadcast.

Grad ops (``differentiable = False``)
-------------------------------------
``topk_grad(dv, indices, dim, size, start=0)``
    ``dv`` scatter-added into zeros of ``size`` along ``dim`` at ``indices - start``
    (indices outside the range left out); the gradient of topk and sort values.
``maximum_grad(dy, x, y, minimum=False) -> (dx, dy)`` in the broadcast shape.
``prod_grad(dy, x, dims, keepdim)``.
Each is linear in its cotangent: a ``P(sum|avg)`` cotangent passes through where the
other operands are Replicate.

Violation codes: ``partial-input``, ``sharded-order-dim``, ``sharding-mismatch``,
``broadcast-shape`` (a cotangent of the wrong shape).

What is not here (see the report of issue #28): top-k along a sharded dim as local
top-k candidates gathered and merged, and cumsum along a sharded dim as a local scan plus
an exclusive scan of the shard totals; neither is one op's layout rule.

Examples
--------
>>> from layout_prop import DeviceMesh, Layout, TensorSpec
>>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
>>> x = TensorSpec((4, 6, 8), "float32", Layout(mesh, ["S(0)", "S(2)"], 3))
>>> res = get_rule("TopK").infer_layout((x,), {"k": 2, "dim": -1, "largest": True, "sorted": True})
>>> [str(o) for o in res.outputs], [v.code for v in res.violations], str(res.wants[0])
(['float32[4, 6, 2] (S(0), R)', 'int64[4, 6, 2] (S(0), R)'], ['sharded-order-dim'], '(S(0), R)')
>>> p = TensorSpec((4, 6), "float32", Layout(mesh, ["P(sum)", "S(0)"], 2))
>>> res = get_rule("cumsum").infer_layout((p,), {"dim": 1, "exclusive": False, "reverse": False})
>>> str(res.outputs[0]), res.violations
('float32[4, 6] (P(sum), S(0))', ())
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence

import numpy as np

from layout_prop.core.errors import OpError, Violation
from layout_prop.core.layout import Layout
from layout_prop.core.placement import Partial, Replicate, Shard, StridedShard, shard_dim
from layout_prop.core.registry import OpRule, RuleResult, get_rule, register_op
from layout_prop.core.spec import TensorSpec

from .common import plan_summary
from .elementwise import ElementwiseRule, broadcast_shapes, sum_to_shape

__all__ = ["TopK", "Sort", "ArgMax", "ArgMin", "CumSum", "Prod", "Maximum", "Minimum", "TopKGrad",
           "MaximumGrad", "ProdGrad", "ORDER_CODES", "get_rule"]

ORDER_CODES = ("partial-input", "sharded-order-dim", "sharding-mismatch")
GRAD_CODES = ORDER_CODES + ("broadcast-shape",)
LINEAR_PARTIALS = ("sum", "avg")


# ------------------------------------------------------------------------------ helpers
def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_float(dtype: str) -> bool:
    return np.issubdtype(np.dtype(dtype), np.floating)


def _axis(mesh, axis: int) -> str:
    return repr(mesh.names[axis])


def check_dim(op: str, attr: str, value: Any, ndim: int) -> int:
    """``value`` as a dim of a rank-``ndim`` tensor (0..ndim-1); ``bad-attr`` (exit 2) otherwise.

    >>> check_dim("topk", "dim", -1, 3)
    2
    >>> check_dim("topk", "dim", 3, 3)
    Traceback (most recent call last):
    ...
    layout_prop.core.errors.OpError: bad-attr at attrs.dim: topk: dim=3 is out of range for x of rank 3 \
(hint: give dim an integer in -3..2)
    """
    low, high = -max(ndim, 1), max(ndim, 1) - 1  # a 0-d tensor takes dim 0 or -1, as torch
    if not _is_int(value) or not low <= value <= high:
        raise OpError("bad-attr", f"{op}: {attr}={value!r} is out of range for x of rank {ndim}",
                      path=f"attrs.{attr}", hint=f"give {attr} an integer in {low}..{high}")
    return int(value) % max(ndim, 1)


def check_dims(op: str, dims: Any, ndim: int) -> tuple[int, ...]:
    """Sorted non-negative dims of ``dims`` (an int, a list of ints, None for all); ``bad-attr`` otherwise.

    >>> check_dims("prod", None, 3), check_dims("prod", [-1, 0], 3)
    ((0, 1, 2), (0, 2))
    """
    if dims is None:
        return tuple(range(ndim))
    items = [dims] if _is_int(dims) else dims
    if not isinstance(items, (list, tuple)):
        raise OpError("bad-attr", f"{op}: dims must be an int, a list of ints or null, got {dims!r}",
                      path="attrs.dims", hint="write dims: [0, 2], dims: 1 or dims: null")
    out = [check_dim(op, "dims", d, ndim) for d in items]
    if len(set(out)) != len(out):
        raise OpError("bad-attr", f"{op}: dims {list(items)} name a dim twice", path="attrs.dims",
                      hint="name each dim once")
    return tuple(sorted(out))


def _violations(spec: TensorSpec, want: Layout, operand: str, issues: list[tuple[str, str, str]]) -> list[Violation]:
    """The issues found on ``operand`` as violations, when moving it to ``want`` costs communication."""
    if want == spec.layout:
        return []
    free, fixable, _ = plan_summary(spec, want)
    if free:
        return []
    if not issues:
        issues = [("sharding-mismatch", f"{operand} is {spec.layout} but the kernel needs {want}",
                   f"give {operand} the layout {want}")]
    details = {"want": want.placement_strs()}
    return [Violation(code, message, hint, operand=operand, fixable=fixable, details=details)
            for code, message, hint in issues]


def whole_dims(op: str, spec: TensorSpec, operand: str, dims: Sequence[int], why: str,
               passes: Sequence[str] = ()) -> tuple[Layout, list[tuple[str, str, str]]]:
    """``spec``'s layout with ``dims`` whole and Partial axes reduced (but those in ``passes``),
    and the issues found, one ``(code, message, hint)`` per offending mesh axis."""
    ps, issues = [], []
    for axis, p in enumerate(spec.layout.placements):
        name = _axis(spec.mesh, axis)
        if isinstance(p, Partial) and p.reduce_op not in passes:
            allowed = f" (it passes {', '.join(f'P({o})' for o in passes)} only)" if passes else ""
            issues.append(("partial-input", f"{operand} is {p} on mesh axis {name} ({operand} is {spec.layout}): "
                           f"{op} needs the value, not partial terms{allowed}",
                           f"reduce {operand} on {name} first (all-reduce {p.reduce_op})"))
            ps.append(Replicate())
        elif shard_dim(p) is not None and p.dim in dims:
            issues.append(("sharded-order-dim", f"{operand} dim {p.dim} (size {spec.shape[p.dim]}) is sharded on "
                           f"mesh axis {name} ({operand} is {spec.layout}), but {why}",
                           f"all-gather {operand} on {name} (--reshard does), or shard another dim instead"))
            ps.append(Replicate())
        else:
            ps.append(p)
    return Layout(spec.mesh, ps, spec.ndim), issues


def _reduced_layout(layout: Layout, dims: Sequence[int], keepdim: bool, ndim_out: int) -> Layout:
    """``layout`` (whole on ``dims``) after reducing ``dims``: the shards of kept dims renumbered."""
    ps = []
    for p in layout.placements:
        d = shard_dim(p)
        if d is None or keepdim:
            ps.append(p)
            continue
        moved = d - sum(1 for r in dims if r < d)
        ps.append(Shard(moved) if isinstance(p, Shard) else StridedShard(moved, p.split_factor))
    return Layout(layout.mesh, ps, ndim_out)


def _reduced_shape(shape: Sequence[int], dims: Sequence[int], keepdim: bool) -> tuple[int, ...]:
    return tuple(1 if d in dims else n for d, n in enumerate(shape) if keepdim or d not in dims)


def _want(layout: Layout, spec: TensorSpec) -> Layout | None:
    return None if layout == spec.layout else layout


def _cotangent(op: str, dy: TensorSpec, base: Layout, shape: Sequence[int]):
    """The layout ``dy`` must have for a grad op linear in it (``base``, the forward output's
    layout, with ``P(sum|avg)`` of dy kept where base is Replicate), the partials kept, and
    the violations; ``None`` for the layout when dy's shape is wrong."""
    if tuple(dy.shape) != tuple(shape):
        v = Violation("broadcast-shape", f"dy has shape {list(dy.shape)} but the output of {op} has shape "
                      f"{list(shape)}", "the cotangent has the forward output's shape", operand="dy")
        return None, {}, [v]
    ps, partials, issues = [], {}, []
    for axis, (want, have) in enumerate(zip(base.placements, dy.layout.placements)):
        if isinstance(have, Partial) and have.reduce_op in LINEAR_PARTIALS and isinstance(want, Replicate):
            ps.append(have)
            partials[axis] = have
            continue
        ps.append(want)
        if have != want and not isinstance(have, Replicate):
            name = _axis(dy.mesh, axis)
            code = "partial-input" if isinstance(have, Partial) else "sharding-mismatch"
            issues.append((code, f"dy is {have} on mesh axis {name} but the gradient of {op} is computed {want} "
                           f"there (dy is {dy.layout}, the forward output {base})",
                           f"give dy the layout {base}" if code == "sharding-mismatch" else
                           f"reduce dy on {name} first"))
    layout = Layout(dy.mesh, ps, dy.ndim)
    return layout, partials, _violations(dy, layout, "dy", issues)


def _with_partials(layout: Layout, partials: dict) -> Layout:
    return layout.with_placements([partials.get(a, p) for a, p in enumerate(layout.placements)])


# ------------------------------------------------------------------------------ topk and sort
class _SelectRule(OpRule):
    """Shared rule of topk and sort: two outputs of x's layout, ``dim`` whole, x not Partial."""

    operands = ("x",)
    num_outputs = 2
    violation_codes = ORDER_CODES
    strided = True  # a strided shard off the dim stays; on the dim, gathered
    verb = "selects along"

    def count(self, x: TensorSpec, dim: int, attrs: dict) -> int:
        """How many elements the op keeps along ``dim``."""
        return x.shape[dim]

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        dim = check_dim(self.name, "dim", attrs.get("dim", -1), x.ndim)
        if x.ndim == 0:
            raise OpError("bad-value", f"{self.name} of a 0-d tensor", hint="give x at least one dim")
        k = self.count(x, dim, attrs)
        fixed, issues = whole_dims(self.name, x, "x", [dim], f"{self.name} {self.verb} dim {dim} and needs it "
                                   "whole on every rank")
        shape = x.shape[:dim] + (k,) + x.shape[dim + 1:]
        outs = (TensorSpec(shape, x.dtype, fixed), TensorSpec(shape, "int64", fixed))
        return RuleResult(outs, tuple(_violations(x, fixed, "x", issues)), (_want(fixed, x),))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        x = g.spec(inputs[0])
        if cotangents[0] is None or not needs[0] or not _is_float(x.dtype):
            return (None,)
        dim = attrs.get("dim", -1) % x.ndim
        return (g.op("topk_grad", [cotangents[0], outputs[1]], {"dim": dim, "size": x.shape[dim]}),)


@register_op
class TopK(_SelectRule):
    """``topk(x, k, dim=-1, largest=True, sorted=True) -> (values, indices)``.

    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> x = TensorSpec((4, 6), "float32", Layout(DeviceMesh((2,), ("tp",)), ["S(0)"], 2))
    >>> [str(o) for o in TopK().infer_layout((x,), TopK().normalize_attrs({"k": 3})).outputs]
    ['float32[4, 3] (S(0))', 'int64[4, 3] (S(0))']
    >>> TopK().infer_layout((x,), TopK().normalize_attrs({"k": 7}))
    Traceback (most recent call last):
    ...
    layout_prop.core.errors.OpError: bad-attr at attrs.k: topk: k=7 is larger than dim 1 of x (size 6) \
(hint: give k an integer in 0..6)
    """

    name = "topk"
    aliases = ("TopK", "aten.topk")
    attr_defaults = {"k": None, "dim": -1, "largest": True, "sorted": True}
    required_attrs = ("k",)

    def normalize_attrs(self, attrs, node=None):
        out = super().normalize_attrs(attrs, node)
        k = out["k"]
        if not _is_int(k) or k < 0:
            raise OpError("bad-value", f"topk: k must be a non-negative integer, got {k!r}", path="attrs.k",
                          node=node, hint="give k, how many elements to keep, as an integer >= 0")
        return out

    def count(self, x, dim, attrs):
        k = attrs["k"]
        if not _is_int(k) or not 0 <= k <= x.shape[dim]:
            raise OpError("bad-attr", f"topk: k={k!r} is larger than dim {dim} of x (size {x.shape[dim]})"
                          if _is_int(k) and k > 0 else f"topk: k={k!r} is not an integer >= 0", path="attrs.k",
                          hint=f"give k an integer in 0..{x.shape[dim]}")
        return int(k)


@register_op
class Sort(_SelectRule):
    """``sort(x, dim=-1, descending=False, stable=False) -> (values, indices)``; always stable."""

    name = "sort"
    aliases = ("Sort", "aten.sort")
    attr_defaults = {"dim": -1, "descending": False, "stable": False}
    verb = "sorts along"


# ------------------------------------------------------------------------------ argmax, argmin
class _ArgRule(OpRule):
    operands = ("x",)
    attr_defaults = {"dim": None, "keepdim": False}
    attr_types = {"dim": "int | None"}
    violation_codes = ORDER_CODES
    differentiable = False  # int64 indices
    strided = True

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        dim = attrs.get("dim")
        dims = tuple(range(x.ndim)) if dim is None else (check_dim(self.name, "dim", dim, x.ndim),)
        empty = [d for d in dims if x.shape[d] == 0]
        if empty:
            raise OpError("bad-value", f"{self.name} along dim {empty[0]} of x {list(x.shape)}, which is empty, "
                          "has no answer", node=None, hint="reduce along a dim of size at least 1")
        keepdim = bool(attrs.get("keepdim"))
        fixed, issues = whole_dims(self.name, x, "x", dims, f"{self.name} compares along dim(s) {list(dims)} and "
                                   "needs them whole on every rank")
        shape = _reduced_shape(x.shape, dims, keepdim)
        out = TensorSpec(shape, "int64", _reduced_layout(fixed, dims, keepdim, len(shape)))
        return RuleResult((out,), tuple(_violations(x, fixed, "x", issues)), (_want(fixed, x),))


@register_op
class ArgMax(_ArgRule):
    """``argmax(x, dim=None, keepdim=False)``: int64 index of the first greatest element."""

    name = "argmax"
    aliases = ("Argmax", "ArgMax", "aten.argmax")


@register_op
class ArgMin(_ArgRule):
    """``argmin(x, dim=None, keepdim=False)``: int64 index of the first least element."""

    name = "argmin"
    aliases = ("Argmin", "ArgMin", "aten.argmin")


# ------------------------------------------------------------------------------ cumsum
def _cumsum_dtype(dtype: str) -> str:
    return dtype if _is_float(dtype) else "int64"


@register_op
class CumSum(OpRule):
    """``cumsum(x, dim, exclusive=False, reverse=False)``; linear, so ``P(sum)`` passes through.

    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> x = TensorSpec((4, 6), "int32", Layout(DeviceMesh((2,), ("tp",)), ["S(1)"], 2))
    >>> res = CumSum().infer_layout((x,), CumSum().normalize_attrs({"dim": 1}))
    >>> str(res.outputs[0]), [v.code for v in res.violations]
    ('int64[4, 6] (R)', ['sharded-order-dim'])
    """

    name = "cumsum"
    aliases = ("CumSum", "aten.cumsum")
    operands = ("x",)
    attr_defaults = {"dim": None, "exclusive": False, "reverse": False}
    attr_types = {"dim": "int"}
    required_attrs = ("dim",)
    violation_codes = ORDER_CODES
    strided = True

    @staticmethod
    def passes(dtype: str) -> tuple[str, ...]:
        """The Partial ops a cumsum of ``dtype`` passes through (int32 accumulates in int64: a
        wrapped int32 sum of terms would not be the int64 sum)."""
        if _is_float(dtype):
            return LINEAR_PARTIALS
        return ("sum",) if dtype == "int64" else ()

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        if x.ndim == 0:
            raise OpError("bad-value", "cumsum of a 0-d tensor", hint="give x at least one dim")
        dim = check_dim(self.name, "dim", attrs.get("dim"), x.ndim)
        fixed, issues = whole_dims(self.name, x, "x", [dim], f"cumsum scans along dim {dim} and needs it whole on "
                                   "every rank", self.passes(x.dtype))
        out = TensorSpec(x.shape, _cumsum_dtype(x.dtype), fixed)
        return RuleResult((out,), tuple(_violations(x, fixed, "x", issues)), (_want(fixed, x),))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None or not needs[0] or not _is_float(g.spec(inputs[0]).dtype):
            return (None,)
        return (g.op("cumsum", [cotangents[0]], {"dim": attrs["dim"], "exclusive": bool(attrs.get("exclusive")),
                                                 "reverse": not attrs.get("reverse")}),)


# ------------------------------------------------------------------------------ prod
@register_op
class Prod(OpRule):
    """``prod(x, dims=None, keepdim=False)``: the reduced dims whole, x not Partial.

    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> x = TensorSpec((4, 6, 5), "float32", Layout(DeviceMesh((2, 2), ("dp", "tp")), ["S(2)", "S(1)"], 3))
    >>> res = Prod().infer_layout((x,), Prod().normalize_attrs({"dims": [1]}))
    >>> str(res.outputs[0]), [v.code for v in res.violations]
    ('float32[4, 5] (S(1), R)', ['sharded-order-dim'])
    """

    name = "prod"
    aliases = ("ReduceProd", "aten.prod", "reduce_prod")
    operands = ("x",)
    attr_defaults = {"dims": None, "keepdim": False}
    attr_types = {"dims": "int | list[int] | None"}
    violation_codes = ORDER_CODES
    strided = True

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        dims = check_dims(self.name, attrs.get("dims"), x.ndim)
        keepdim = bool(attrs.get("keepdim"))
        fixed, issues = whole_dims(self.name, x, "x", dims, f"prod multiplies along dim(s) {list(dims)} and needs "
                                   "them whole on every rank (a product of shards is no Partial this tool knows)")
        shape = _reduced_shape(x.shape, dims, keepdim)
        dtype = x.dtype if _is_float(x.dtype) else "int64"
        out = TensorSpec(shape, dtype, _reduced_layout(fixed, dims, keepdim, len(shape)))
        return RuleResult((out,), tuple(_violations(x, fixed, "x", issues)), (_want(fixed, x),))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        x = g.spec(inputs[0])
        if cotangents[0] is None or not needs[0] or not _is_float(x.dtype):
            return (None,)
        dims = list(check_dims(self.name, attrs.get("dims"), x.ndim))
        return (g.op("prod_grad", [cotangents[0], inputs[0]], {"dims": dims, "keepdim": bool(attrs.get("keepdim"))}),)


# ------------------------------------------------------------------------------ maximum, minimum
class _ExtremumRule(ElementwiseRule):
    """maximum / minimum: elementwise, passing their own Partial (``P(max)`` / ``P(min)``) through."""

    operands = ("x", "y")
    partial_mode = "all"  # a Replicate operand becomes a term by a free local-partial (every rank keeps it)
    reduce_op = "max"

    def _partial_out(self, ps):
        partials = [p for p in ps if isinstance(p, Partial)]
        if not partials or any(p.reduce_op != self.reduce_op for p in partials):
            return None
        if all(isinstance(p, (Partial, Replicate)) for p in ps):
            return Partial(self.reduce_op)
        return None

    def infer_layout(self, inputs, attrs):
        if broadcast_shapes([t.shape for t in inputs]) is None:
            raise OpError("broadcast-shape", f"{self.name}: shapes {[list(t.shape) for t in inputs]} do not "
                          "broadcast", hint="make the shapes equal or 1 in every dim, aligned from the right")
        return super().infer_layout(inputs, attrs)

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None or not _is_float(g.spec(outputs[0]).dtype):
            return (None, None)
        dx, dother = g.op("maximum_grad", [dy, inputs[0], inputs[1]], {"minimum": self.reduce_op == "min"},
                          num_outputs=2)
        return tuple(sum_to_shape(g, grad, g.spec(v).shape) if need and _is_float(g.spec(v).dtype) else None
                     for grad, v, need in zip((dx, dother), inputs, needs))


@register_op
class Maximum(_ExtremumRule):
    """``maximum(x, y)`` with broadcasting; ``P(max)`` passes through."""

    name = "maximum"
    aliases = ("Maximum", "aten.maximum")
    reduce_op = "max"


@register_op
class Minimum(_ExtremumRule):
    """``minimum(x, y)`` with broadcasting; ``P(min)`` passes through."""

    name = "minimum"
    aliases = ("Minimum", "aten.minimum")
    reduce_op = "min"


# ------------------------------------------------------------------------------ grad ops
@register_op
class TopKGrad(OpRule):
    """``topk_grad(dv, indices, dim, size, start=0)``: dv scatter-added at ``indices - start``
    into zeros of ``size`` along ``dim``.

    ``dim`` is whole in dv and indices; their other dims shard alike (the output keeps
    those shards); a ``P(sum|avg)`` dv passes through where indices is Replicate.

    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> dv = TensorSpec((4, 2), "float32", Layout(mesh, ["P(sum)"], 2))
    >>> idx = TensorSpec((4, 2), "int64", Layout(mesh, ["R"], 2))
    >>> str(TopKGrad().infer_layout((dv, idx), {"dim": 1, "size": 6, "start": 0}).outputs[0])
    'float32[4, 6] (P(sum))'
    """

    name = "topk_grad"
    operands = ("dv", "indices")
    attr_defaults = {"dim": None, "size": None, "start": 0}
    attr_types = {"dim": "int", "size": "int"}
    required_attrs = ("dim", "size")
    violation_codes = GRAD_CODES
    differentiable = False

    def infer_layout(self, inputs, attrs):
        dv, idx = inputs
        dim = check_dim(self.name, "dim", attrs["dim"], dv.ndim)
        size = attrs["size"]
        if size < 0:
            raise OpError("bad-attr", f"topk_grad: size={size} is negative", path="attrs.size",
                          hint="give size, x's size along dim, as an integer >= 0")
        if dv.shape != idx.shape:
            v = Violation("broadcast-shape", f"dv has shape {list(dv.shape)} but indices {list(idx.shape)}; both "
                          "have the shape of topk's outputs", "give dv and indices the same shape", operand="indices")
            return RuleResult((None,), (v,), ())
        dv_ps, idx_ps, out_ps = [], [], []
        issues: dict[str, list] = {"dv": [], "indices": []}
        for axis in range(dv.mesh.ndim):
            pv, pi = dv.layout.placements[axis], idx.layout.placements[axis]
            shard = next((p for p in (pv, pi) if shard_dim(p) is not None and p.dim != dim), None)
            if shard is not None:
                targets = (shard, shard)
            elif isinstance(pv, Partial) and pv.reduce_op in LINEAR_PARTIALS and isinstance(pi, Replicate):
                targets = (pv, Replicate())
            else:
                targets = (Replicate(), Replicate())
            dv_ps.append(targets[0])
            idx_ps.append(targets[1])
            out_ps.append(targets[0])
            for name, have, want in (("dv", pv, targets[0]), ("indices", pi, targets[1])):
                if have == want or isinstance(have, Replicate):
                    continue
                ax = _axis(dv.mesh, axis)
                if isinstance(have, Partial):
                    issues[name].append(("partial-input", f"{name} is {have} on mesh axis {ax}; topk_grad needs "
                                         f"{want} there (dv is {dv.layout}, indices {idx.layout})",
                                         f"reduce {name} on {ax} first"))
                elif shard_dim(have) == dim:
                    issues[name].append(("sharded-order-dim", f"{name} dim {dim} is sharded on mesh axis {ax}; "
                                         "topk_grad scatters along it and needs it whole",
                                         f"all-gather {name} on {ax}"))
                else:
                    issues[name].append(("sharding-mismatch", f"{name} is {have} on mesh axis {ax} but topk_grad "
                                         f"computes {want} there (dv is {dv.layout}, indices {idx.layout})",
                                         f"give {name} {want} on {ax}"))
        dv_want, idx_want = Layout(dv.mesh, dv_ps, dv.ndim), Layout(dv.mesh, idx_ps, idx.ndim)
        violations = _violations(dv, dv_want, "dv", issues["dv"]) + _violations(idx, idx_want, "indices",
                                                                                 issues["indices"])
        shape = dv.shape[:dim] + (size,) + dv.shape[dim + 1:]
        out = TensorSpec(shape, dv.dtype, Layout(dv.mesh, out_ps, len(shape)))
        return RuleResult((out,), tuple(violations), (_want(dv_want, dv), _want(idx_want, idx)))


@register_op
class MaximumGrad(_ExtremumRule):
    """``maximum_grad(dy, x, y, minimum=False) -> (dx, dy)`` in the broadcast shape; linear in ``dy``."""

    name = "maximum_grad"
    operands = ("dy", "x", "y")
    num_outputs = 2
    attr_defaults = {"minimum": False}
    partial_mode = "first"
    differentiable = False
    violation_codes = GRAD_CODES

    def _partial_out(self, ps):
        return ElementwiseRule._partial_out(self, ps)

    def sample_inputs(self):
        return []  # the op database's records (three operands, unlike the elementwise samples)

    def out_dtype(self, inputs, attrs):
        return inputs[0].dtype

    def infer_layout(self, inputs, attrs):
        res = super().infer_layout(inputs, attrs)
        return RuleResult((res.outputs[0], res.outputs[0]), res.violations, res.wants)


@register_op
class ProdGrad(OpRule):
    """``prod_grad(dy, x, dims, keepdim)``: x's reduced dims whole; dy like prod's output."""

    name = "prod_grad"
    operands = ("dy", "x")
    attr_defaults = {"dims": None, "keepdim": False}
    attr_types = {"dims": "int | list[int] | None"}
    violation_codes = GRAD_CODES
    differentiable = False
    strided = True

    def infer_layout(self, inputs, attrs):
        dy, x = inputs
        dims = check_dims(self.name, attrs.get("dims"), x.ndim)
        keepdim = bool(attrs.get("keepdim"))
        fixed, issues = whole_dims("prod_grad", x, "x", dims, "the gradient of prod needs the reduced dims whole")
        shape = _reduced_shape(x.shape, dims, keepdim)
        base = _reduced_layout(fixed, dims, keepdim, len(shape))
        dy_want, partials, dy_violations = _cotangent("prod", dy, base, shape)
        if dy_want is None:
            return RuleResult((None,), tuple(dy_violations), ())
        violations = dy_violations + _violations(x, fixed, "x", issues)
        dx = TensorSpec(x.shape, dy.dtype, _with_partials(fixed, partials))
        return RuleResult((dx,), tuple(violations), (_want(dy_want, dy), _want(fixed, x)))
