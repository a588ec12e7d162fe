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

Top-k along a sharded dim
-------------------------
topk's rule gathers its dim.  Where the dim is long and sharded (a router over many experts,
a vocabulary), write the top-k in two ops instead, so that only ``k`` candidates per rank move:

``topk_candidates(x, k, chunks, dim=-1, largest=True) -> (values, indices)``
    The top ``k`` of each of the ``chunks`` ``torch.chunk`` pieces of ``dim``, concatenated
    (``chunks * k`` along dim), with global int64 indices; a piece shorter than ``k`` is
    padded (index -1).  Defined on one device for any layout; with ``dim`` cut into exactly
    those pieces (``chunks`` ranks along it) each rank computes its own chunk's candidates
    without communication and the output is sharded like x.
``topk_merge(values, indices, k, dim=-1, largest=True) -> (values, indices)``
    The top ``k`` of the candidates in topk's order (padding last, ties by the lowest global
    index), so ``topk_merge(topk_candidates(x))`` is exactly ``topk(x)``.  Its dim is whole:
    ``--reshard`` gathers the candidates (or, when cheaper, the planner moves their rows).

Gradients: ``topk_merge_grad`` (the cotangent at the chosen candidate positions) and
``topk_candidates_grad`` (block ``c`` of the candidates into piece ``c`` of x: local on
each rank when sharded).  With ``k=1`` the merged indices are ``argmax(x, dim,
keepdim=True)`` (ties and NaN included), so the split form serves argmax too; argmin is
``largest=False`` where x holds no NaN (argmin picks a NaN, the least-first order puts it last).

Cumsum along a sharded dim
--------------------------
A local scan plus an exclusive scan of the shard totals, in three ops, so that only the
``chunks`` totals per row move::

    t = chunk_sum(x, dim, chunks)                 # each rank sums its piece
    o = cumsum(t, dim, exclusive=True)            # the totals gathered (chunks per row)
    y = chunk_cumsum(x, o, dim, chunks)           # each rank scans its piece, plus its offset

``chunk_sum(x, dim, chunks)`` sums each ``torch.chunk`` piece of dim; ``chunk_cumsum(x,
offsets?, dim, chunks, exclusive=False, reverse=False)`` scans each piece on its own and
adds ``offsets``' c-th element on piece c (with ``reverse``, give it the reverse exclusive
scan).  Both keep a dim cut into exactly those pieces sharded (localised ``chunks=1``), gather
any other cut, and are linear: gradients ``chunk_cumsum`` the other way and ``chunk_sum`` of
the cotangent, and ``chunk_sum_grad`` (each total's cotangent over its piece).  The result
equals cumsum up to float rounding (exactly on integers): the sums are added in another order.

``check --reshard``, ``run`` and ``lower`` write a ``topk`` or ``cumsum`` node whose dim is cut
into one ``torch.chunk`` piece per rank along it as these ops by themselves (the rules'
``expand`` hooks, applied by ``passes/expand.py``), where their moves cost fewer bytes than the
plain rule's gather; the spec may also write them by hand.

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

import itertools
import numbers
from typing import Any, Sequence

import numpy as np

from layout_prop.core.errors import OpError, Violation
from layout_prop.core.layout import Layout
from layout_prop.core.placement import Partial, Replicate, Shard, StridedShard, shard_dim
from layout_prop.core.registry import OpRule, RuleResult, get_rule, register_op
from layout_prop.core.spec import TensorSpec, chunk_bounds, is_float_dtype, numpy_dtype

from .common import move_violations as _violations
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
    return is_float_dtype(numpy_dtype(dtype))


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


def check_k_attr(op: str, k: Any, node=None) -> None:
    """``bad-value`` at load time unless ``k`` is an integer >= 0."""
    if not _is_int(k) or k < 0:
        raise OpError("bad-value", f"{op}: k must be a non-negative integer, got {k!r}", path="attrs.k",
                      node=node, hint="give k, how many elements to keep, as an integer >= 0")


def check_k(op: str, k: Any, x: TensorSpec, dim: int, operand: str = "x") -> int:
    """``k`` as a count of elements of ``dim`` of ``x`` (0..size); ``bad-attr`` (exit 2) otherwise."""
    if not _is_int(k) or not 0 <= k <= x.shape[dim]:
        raise OpError("bad-attr", f"{op}: k={k!r} is larger than dim {dim} of {operand} (size {x.shape[dim]})"
                      if _is_int(k) and k > 0 else f"{op}: k={k!r} is not an integer >= 0", path="attrs.k",
                      hint=f"give k an integer in 0..{x.shape[dim]}")
    return int(k)


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


def pair_layouts(op: str, named: Sequence[tuple[str, TensorSpec]], dim: int, linear: int | None = None,
                 dim_axes: Sequence[int] = ()) -> tuple[list[Layout], list, list[Violation]]:
    """Operands that must shard alike except along ``dim`` (a cotangent and the indices it is scattered by).

    Per mesh axis: a shard of another dim in any operand cuts them all (a Replicate operand is
    sliced for free); ``dim`` is whole, except on ``dim_axes``, where every operand is ``S(dim)``;
    ``P(sum|avg)`` passes through operand ``linear`` where the others are Replicate; any other
    Partial is reduced.  Returns the wanted layout of each operand, the output placements (those
    of operand ``linear``, or of the first) and the violations.
    """
    mesh = named[0][1].mesh
    targets: list[list] = [[] for _ in named]
    out_ps = []
    issues: list[list] = [[] for _ in named]
    first = linear if linear is not None else 0
    values = ", ".join(f"{name} is {spec.layout}" for name, spec in named)
    for axis in range(mesh.ndim):
        ps = [spec.layout.placements[axis] for _, spec in named]
        shard = next((p for p in ps if shard_dim(p) is not None and p.dim != dim), None)
        if axis in dim_axes:
            want = [Shard(dim)] * len(ps)
        elif shard is not None:
            want = [shard] * len(ps)
        elif linear is not None and isinstance(ps[linear], Partial) and ps[linear].reduce_op in LINEAR_PARTIALS \
                and all(isinstance(p, Replicate) for i, p in enumerate(ps) if i != linear):
            want = [p if i == linear else Replicate() for i, p in enumerate(ps)]
        else:
            want = [Replicate()] * len(ps)
        out_ps.append(want[first])
        ax = _axis(mesh, axis)
        for i, ((name, spec), have, target) in enumerate(zip(named, ps, want)):
            targets[i].append(target)
            if have == target or isinstance(have, Replicate):
                continue
            if isinstance(have, Partial):
                issues[i].append(("partial-input", f"{name} is {have} on mesh axis {ax}; {op} needs {target} there "
                                  f"({values})", f"reduce {name} on {ax} first"))
            elif shard_dim(have) == dim:
                issues[i].append(("sharded-order-dim", f"{name} dim {dim} is sharded on mesh axis {ax}; {op} works "
                                  f"along it and needs it whole there ({values})", f"all-gather {name} on {ax}"))
            else:
                issues[i].append(("sharding-mismatch", f"{name} is {have} on mesh axis {ax} but {op} computes "
                                  f"{target} there ({values})", f"give {name} {target} on {ax}"))
    layouts = [Layout(mesh, t, spec.ndim) for t, (_, spec) in zip(targets, named)]
    violations = [v for layout, (name, spec), found in zip(layouts, named, issues)
                  for v in _violations(spec, layout, name, found)]
    return layouts, out_ps, violations


def chunks_match(spec: TensorSpec, dim: int, chunks: int) -> bool:
    """Whether ``spec``'s cut of ``dim`` is ``torch.chunk(n, chunks)``: each rank holds exactly one chunk.

    True for ``chunks`` pieces on one mesh axis; on several axes (outer first) only when the
    nested cut gives the same pieces (10 on 2 x 2 is 3, 2, 3, 2, not 3, 3, 3, 1).

    >>> from layout_prop import DeviceMesh
    >>> mesh = DeviceMesh((2, 2), ("a", "b"))
    >>> x = TensorSpec((3, 10), "float32", Layout(mesh, ["S(1)", "S(1)"], 2))
    >>> chunks_match(x, 1, 4), chunks_match(x.with_placements(["R", "S(1)"]), 1, 2)
    (False, True)
    >>> chunks_match(TensorSpec((3, 8), "float32", x.layout), 1, 4)
    True
    """
    layout = spec.layout
    if layout.cut_axes(dim) != layout.dim_axes(dim):
        return False  # a strided shard of the dim
    axes = layout.dim_axes(dim)
    sizes = [spec.mesh.shape[a] for a in axes]
    if not axes or int(np.prod(sizes)) != chunks:
        return False
    bounds = chunk_bounds(spec.shape[dim], chunks)
    for index, sub in enumerate(itertools.product(*[range(n) for n in sizes])):
        coords = [0] * spec.mesh.ndim
        for a, c in zip(axes, sub):
            coords[a] = c
        if spec.dim_bounds(dim, tuple(coords)) != bounds[index]:
            return False
    return True


def _dim_chunks(spec: TensorSpec, dim: int) -> int | None:
    """How many ranks along ``dim`` hold one ``torch.chunk`` piece of it each (None: ``dim`` is whole, or cut
    another way): the ``chunks`` of the split forms of topk and cumsum."""
    axes = spec.layout.dim_axes(dim)
    if not axes:
        return None
    chunks = int(np.prod([spec.mesh.shape[a] for a in axes]))
    return chunks if chunks > 1 and chunks_match(spec, dim, chunks) else None


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
    """``topk(x, k, dim=-1, largest=True, sorted=True) -> (values, indices)``: the ``k`` greatest (or least)
    elements along ``dim`` and their int64 indices, ties lowest index first, NaN the greatest.

    ``dim`` whole on every rank (``sharded-order-dim``, fixed by an all-gather), x not Partial;
    other dims shard freely and both outputs keep x's layout.  For a long sharded dim, ``--reshard``
    writes the node as ``topk_candidates`` then ``topk_merge`` (only ``k`` candidates per rank move)
    where that moves fewer bytes.

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
        check_k_attr(self.name, out["k"], node)
        return out

    def count(self, x, dim, attrs):
        return check_k(self.name, attrs["k"], x, dim)

    def expand(self, b, inputs, attrs, specs):
        """``topk_candidates`` then ``topk_merge`` (nodes ``NAME/candidates``, then ``NAME``) where ``dim`` is cut
        into one ``torch.chunk`` piece per rank along it, so that ``k`` candidates per rank move instead of the
        dim; None for any other cut (a strided shard, uneven nested pieces) or a whole dim."""
        (x,) = specs
        dim = attrs["dim"] % x.ndim
        chunks = _dim_chunks(x, dim)
        if chunks is None:
            return None
        values, indices = b.op("topk_candidates", [inputs[0]], {"k": attrs["k"], "chunks": chunks, "dim": dim,
                                                                 "largest": bool(attrs["largest"])},
                               num_outputs=2, name="candidates")
        return b.result("topk_merge", [values, indices], {"k": attrs["k"], "dim": dim,
                                                           "largest": bool(attrs["largest"])})


@register_op
class Sort(_SelectRule):
    """``sort(x, dim=-1, descending=False, stable=False) -> (values, indices)``; always stable (ties lowest
    index first, NaN the greatest).  ``dim`` whole on every rank, x not Partial, other dims free."""

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
    """``argmax(x, dim=None, keepdim=False)``: int64 index of the first greatest element (a NaN wins);
    ``dim=None`` over the flattened x.  The dim (every dim for None) whole, x not Partial, other dims free."""

    name = "argmax"
    aliases = ("Argmax", "ArgMax", "aten.argmax")


@register_op
class ArgMin(_ArgRule):
    """``argmin(x, dim=None, keepdim=False)``: int64 index of the first least element (a NaN wins, as numpy
    and torch); ``dim=None`` over the flattened x.  The dim whole, x not Partial, other dims free."""

    name = "argmin"
    aliases = ("Argmin", "ArgMin", "aten.argmin")


@register_op
class ArgMaxWithValue(_ArgRule):
    """``argmax_with_value(x, axis=0, keep_dims=False) -> (index, value)``: MindSpore's ``ArgMaxWithValue``,
    the int64 index of the first greatest element along ``axis`` (a NaN wins) and that element.

    Layout as ``argmax`` along ``axis`` (the axis whole, x not Partial, other dims free); the
    value has the index's shape and layout.  vjp: ``max_grad`` of the value's cotangent (with
    ties, every greatest element gets it, where MindSpore gives it to the index's alone).
    """

    name = "argmax_with_value"
    aliases = ("ArgMaxWithValue",)
    num_outputs = 2
    attr_defaults = {"axis": 0, "keep_dims": False}
    attr_types = {"axis": "int"}
    differentiable = True
    cost_kind = "vector"

    def infer_layout(self, inputs, attrs):
        res = super().infer_layout(inputs, {"dim": attrs["axis"], "keepdim": attrs["keep_dims"]})
        index = res.outputs[0]
        value = TensorSpec(index.shape, inputs[0].dtype, index.layout)
        return RuleResult((index, value), res.violations, res.wants)

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[1]
        if dy is None or not needs[0]:
            return (None,)
        axis = attrs["axis"] % g.spec(inputs[0]).ndim
        return (g.op("max_grad", [dy, inputs[0], outputs[1]], {"dims": [axis], "keepdim": bool(attrs["keep_dims"])}),)


# ------------------------------------------------------------------------------ cumsum
def _cumsum_dtype(dtype: str) -> str:
    return dtype if _is_float(dtype) else "int64"


@register_op
class CumSum(OpRule):
    """``cumsum(x, dim, exclusive=False, reverse=False)``: the running sum along ``dim`` (MindSpore CumSum's
    ``exclusive`` and ``reverse``); integers in int64.  ``dim`` whole on every rank, other dims free;
    linear, so ``P(sum)`` (floats, int64) and ``P(avg)`` (floats) pass through.  For a long sharded
    dim, ``--reshard`` writes the node as ``chunk_sum``, ``cumsum(exclusive)`` and ``chunk_cumsum``
    (only the shard totals move) where that moves fewer bytes.

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

    def expand(self, b, inputs, attrs, specs):
        """``chunk_sum``, an exclusive ``cumsum`` of the chunk totals and ``chunk_cumsum`` (nodes ``NAME/totals``,
        ``NAME/offsets``, then ``NAME``) where ``dim`` is cut into one ``torch.chunk`` piece per rank along it,
        so that ``chunks`` totals per row move instead of the dim; None for any other cut or a whole dim."""
        (x,) = specs
        dim = attrs["dim"] % x.ndim
        chunks = _dim_chunks(x, dim)
        if chunks is None:
            return None
        reverse = bool(attrs["reverse"])
        totals = b.op("chunk_sum", [inputs[0]], {"dim": dim, "chunks": chunks}, name="totals")
        offsets = b.op("cumsum", [totals], {"dim": dim, "exclusive": True, "reverse": reverse}, name="offsets")
        return b.result("chunk_cumsum", [inputs[0], offsets], {"dim": dim, "chunks": chunks,
                                                               "exclusive": bool(attrs["exclusive"]),
                                                               "reverse": reverse})


# ------------------------------------------------------------------------------ prod
@register_op
class Prod(OpRule):
    """``prod(x, dims=None, keepdim=False)``: the product over ``dims`` (integers in int64); the reduced
    dims whole on every rank, x not Partial, kept dims shard freely.

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
    """``maximum(x, y)`` with numpy broadcasting, sharded like the elementwise ops; ``P(max)`` operands beside
    Replicate ones stay ``P(max)``.  Gradient to the greater operand, half to each on a tie."""

    name = "maximum"
    aliases = ("Maximum", "aten.maximum")
    reduce_op = "max"


@register_op
class Minimum(_ExtremumRule):
    """``minimum(x, y)`` with numpy broadcasting, sharded like the elementwise ops; ``P(min)`` operands beside
    Replicate ones stay ``P(min)``.  Gradient to the lesser operand, half to each on a tie."""

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
        (dv_want, idx_want), out_ps, violations = pair_layouts("topk_grad", [("dv", dv), ("indices", idx)], dim,
                                                               linear=0)
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


# ------------------------------------------------------------------------------ top-k along a sharded dim
def _positive_chunks(op: str, attrs: dict, node) -> None:
    chunks = attrs.get("chunks")
    if not _is_int(chunks) or chunks < 1:
        raise OpError("bad-value", f"{op}: chunks must be an integer >= 1, got {chunks!r}", path="attrs.chunks",
                      node=node, hint="give chunks, how many torch.chunk pieces the dim is cut into (the shard count)")


def check_chunks(op: str, chunks: int, size: int, mesh) -> None:
    """``bad-attr`` unless ``chunks`` is at most the dim's size or the mesh's rank count, whichever is
    larger (more pieces would all be empty: a hostile spec's ``chunks: 1e9`` must not make a billion)."""
    limit = max(size, mesh.size)
    if chunks > limit:
        raise OpError("bad-attr", f"{op}: chunks={chunks} is more than the dim's {size} elements and the "
                      f"mesh's {mesh.size} ranks", path="attrs.chunks",
                      hint=f"give chunks the shard count of the dim (at most {limit})")


def _chunk_issue(op: str, spec: TensorSpec, operand: str, dim: int, chunks: int, size: int) -> tuple[str, str, str]:
    axes = spec.layout.cut_axes(dim)
    names = ", ".join(repr(spec.mesh.names[a]) for a in axes)
    return ("sharded-order-dim", f"{operand} dim {dim} is cut on mesh axes {names} ({operand} is {spec.layout}), "
            f"which is not torch.chunk({size}, {chunks}): {op} takes the dim whole or one chunk of "
            f"chunks={chunks} per rank", f"set chunks to the shard count, or all-gather {operand} on {names}")


@register_op
class TopKCandidates(OpRule):
    """``topk_candidates(x, k, chunks, dim=-1, largest=True) -> (values, indices)``: the top ``k`` of
    each ``torch.chunk`` piece of ``dim`` (``chunks`` pieces), concatenated (``chunks * k`` along dim),
    with global int64 indices; a piece shorter than ``k`` is padded with index -1.

    The first half of top-k along a sharded dim: with ``dim`` cut into exactly those chunks
    (``chunks`` ranks along it, one chunk each), every rank computes its own candidates
    (localised attrs ``chunks=1`` and ``start``, its chunk's first index) and the output is
    sharded like x; ``topk_merge`` wants the candidates whole, so ``--reshard`` gathers
    ``chunks * k`` values per row instead of the whole dim.  A Replicate dim computes every
    chunk locally; any other cut is ``sharded-order-dim``.

    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> x = TensorSpec((3, 10), "float32", Layout(DeviceMesh((4,), ("tp",)), ["S(1)"], 2))
    >>> rule = get_rule("topk_candidates")
    >>> attrs = rule.normalize_attrs({"k": 2, "chunks": 4})
    >>> res = rule.infer_layout((x,), attrs)
    >>> [str(o) for o in res.outputs], res.violations
    (['float32[3, 8] (S(1))', 'int64[3, 8] (S(1))'], ())
    >>> [rule.localize(attrs, (x,), res.outputs, r)["start"] for r in range(4)]
    [0, 3, 6, 9]
    """

    name = "topk_candidates"
    operands = ("x",)
    num_outputs = 2
    attr_defaults = {"k": None, "chunks": None, "dim": -1, "largest": True, "start": 0}
    required_attrs = ("k", "chunks")
    violation_codes = ORDER_CODES
    strided = True

    def normalize_attrs(self, attrs, node=None):
        out = super().normalize_attrs(attrs, node)
        check_k_attr(self.name, out["k"], node)
        _positive_chunks(self.name, out, node)
        return out

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        dim = check_dim(self.name, "dim", attrs.get("dim", -1), x.ndim)
        k, chunks = attrs["k"], attrs["chunks"]
        check_chunks(self.name, chunks, x.shape[dim], x.mesh)
        check_k(self.name, k, x, dim)
        fixed, issues = whole_dims(self.name, x, "x", [], "")
        if x.layout.cut_axes(dim) and not chunks_match(x, dim, chunks):
            issues.append(_chunk_issue(self.name, x, "x", dim, chunks, x.shape[dim]))
            fixed = fixed.with_placements([Replicate() if shard_dim(p) == dim else p for p in fixed.placements])
        shape = x.shape[:dim] + (chunks * k,) + x.shape[dim + 1:]
        outs = (TensorSpec(shape, x.dtype, fixed), TensorSpec(shape, "int64", fixed))
        return RuleResult(outs, tuple(_violations(x, fixed, "x", issues)), (_want(fixed, x),))

    def localize(self, attrs, inputs, outputs, rank):
        x = inputs[0]
        dim = attrs.get("dim", -1) % x.ndim
        if not x.layout.dim_axes(dim):
            return dict(attrs)
        lo, _ = x.dim_bounds(dim, x.mesh.coords(rank))
        return {**attrs, "chunks": 1, "start": lo}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        x = g.spec(inputs[0])
        if cotangents[0] is None or not needs[0] or not _is_float(x.dtype):
            return (None,)
        dim = attrs.get("dim", -1) % x.ndim
        return (g.op("topk_candidates_grad", [cotangents[0], outputs[1]],
                     {"dim": dim, "size": x.shape[dim], "chunks": attrs["chunks"]}),)


@register_op
class TopKCandidatesGrad(OpRule):
    """``topk_candidates_grad(dc, indices, dim, size, chunks)``: ``dc`` scatter-added into zeros of
    ``size`` along ``dim`` at the candidates' global indices, block by block: the ``c``-th block of
    ``k`` candidates into the ``c``-th ``torch.chunk`` piece only (indices outside it, and the
    padding -1, left out), so that the answer does not depend on where the indices came from.

    Sharded on ``dim`` (one chunk of candidates per rank, the output cut into the same
    ``torch.chunk`` pieces as the forward's x), each rank scatters its own candidates into
    its own piece (localised ``start`` and ``size``); a Replicate dim scatters all.

    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((4,), ("tp",))
    >>> dc = TensorSpec((3, 8), "float32", Layout(mesh, ["S(1)"], 2))
    >>> idx = TensorSpec((3, 8), "int64", Layout(mesh, ["S(1)"], 2))
    >>> rule = get_rule("topk_candidates_grad")
    >>> attrs = {"dim": 1, "size": 10, "chunks": 4, "start": 0}
    >>> res = rule.infer_layout((dc, idx), attrs)
    >>> str(res.outputs[0]), [rule.localize(attrs, (dc, idx), res.outputs, r)["size"] for r in range(4)]
    ('float32[3, 10] (S(1))', [3, 3, 3, 1])
    """

    name = "topk_candidates_grad"
    operands = ("dc", "indices")
    attr_defaults = {"dim": None, "size": None, "chunks": None, "start": 0}
    attr_types = {"dim": "int", "size": "int", "chunks": "int"}
    required_attrs = ("dim", "size", "chunks")
    violation_codes = GRAD_CODES
    differentiable = False
    strided = True

    def infer_layout(self, inputs, attrs):
        dc, idx = inputs
        dim = check_dim(self.name, "dim", attrs["dim"], dc.ndim)
        size, chunks = attrs["size"], attrs["chunks"]
        check_chunks(self.name, chunks, size, dc.mesh)
        if size < 0 or chunks < 1:
            raise OpError("bad-attr", f"{self.name}: size={size} and chunks={chunks} must be >= 0 and >= 1",
                          hint="give the forward's size along dim and chunks")
        if dc.shape != idx.shape or dc.shape[dim] % chunks:
            v = Violation("broadcast-shape", f"dc has shape {list(dc.shape)} and indices {list(idx.shape)}; both "
                          f"have the shape of topk_candidates' outputs, chunks={chunks} times k along dim {dim}",
                          "give dc and indices the candidates' shape", operand="indices")
            return RuleResult((None,), (v,), ())
        shape = dc.shape[:dim] + (size,) + dc.shape[dim + 1:]
        axes = dc.layout.dim_axes(dim) or idx.layout.dim_axes(dim)
        keep = ()
        if axes:
            out_ps = [Shard(dim) if a in axes else Replicate() for a in range(dc.mesh.ndim)]
            if chunks_match(TensorSpec(shape, dc.dtype, Layout(dc.mesh, out_ps, len(shape))), dim, chunks):
                keep = axes
        (dc_want, idx_want), out_ps, violations = pair_layouts(self.name, [("dc", dc), ("indices", idx)], dim,
                                                               linear=0, dim_axes=keep)
        out = TensorSpec(shape, dc.dtype, Layout(dc.mesh, out_ps, len(shape)))
        return RuleResult((out,), tuple(violations), (_want(dc_want, dc), _want(idx_want, idx)))

    def localize(self, attrs, inputs, outputs, rank):
        out = outputs[0]
        dim = attrs["dim"] % out.ndim
        if not out.layout.dim_axes(dim):
            return dict(attrs)
        lo, hi = out.dim_bounds(dim, out.mesh.coords(rank))
        return {**attrs, "chunks": 1, "start": lo, "size": hi - lo}


@register_op
class TopKMerge(OpRule):
    """``topk_merge(values, indices, k, dim=-1, largest=True) -> (values, indices)``: the top ``k`` of
    topk_candidates' output, in topk's order (ties by the lowest global index, padding never
    chosen), so that ``topk_merge(topk_candidates(x))`` is ``topk(x)`` exactly.

    The candidates' ``dim`` is whole (``sharded-order-dim``: ``--reshard`` all-gathers
    them); their other dims shard alike and the outputs keep those shards.

    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((4,), ("tp",))
    >>> c = TensorSpec((3, 8), "float32", Layout(mesh, ["S(1)"], 2))
    >>> res = get_rule("topk_merge").infer_layout((c, c.with_layout(c.layout)), {"k": 2, "dim": -1, "largest": True})
    >>> str(res.outputs[0]), [v.code for v in res.violations], [str(w) for w in res.wants]
    ('float32[3, 2] (R)', ['sharded-order-dim', 'sharded-order-dim'], ['(R)', '(R)'])
    """

    name = "topk_merge"
    operands = ("values", "indices")
    num_outputs = 2
    attr_defaults = {"k": None, "dim": -1, "largest": True}
    required_attrs = ("k",)
    violation_codes = GRAD_CODES

    def normalize_attrs(self, attrs, node=None):
        out = super().normalize_attrs(attrs, node)
        check_k_attr(self.name, out["k"], node)
        return out

    def infer_layout(self, inputs, attrs):
        values, idx = inputs
        dim = check_dim(self.name, "dim", attrs.get("dim", -1), values.ndim)
        k = check_k(self.name, attrs["k"], values, dim, "values")
        if values.shape != idx.shape:
            v = Violation("broadcast-shape", f"values has shape {list(values.shape)} but indices {list(idx.shape)}; "
                          "both are topk_candidates' outputs", "give values and indices the same shape",
                          operand="indices")
            return RuleResult((None, None), (v,), ())
        (v_want, i_want), out_ps, violations = pair_layouts(self.name, [("values", values), ("indices", idx)], dim)
        shape = values.shape[:dim] + (k,) + values.shape[dim + 1:]
        layout = Layout(values.mesh, out_ps, len(shape))
        outs = (TensorSpec(shape, values.dtype, layout), TensorSpec(shape, "int64", layout))
        return RuleResult(outs, tuple(violations), (_want(v_want, values), _want(i_want, idx)))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None or not needs[0] or not _is_float(g.spec(inputs[0]).dtype):
            return (None, None)
        return (g.op("topk_merge_grad", [cotangents[0], inputs[0], inputs[1]],
                     {"k": attrs["k"], "dim": attrs.get("dim", -1), "largest": bool(attrs.get("largest", True))}),
                None)


@register_op
class TopKMergeGrad(OpRule):
    """``topk_merge_grad(dv, values, indices, k, dim=-1, largest=True)``: ``dv`` at the candidate positions
    the merge chose, zeros elsewhere; the candidates' dim whole, dv like the merge's output."""

    name = "topk_merge_grad"
    operands = ("dv", "values", "indices")
    attr_defaults = {"k": None, "dim": -1, "largest": True}
    required_attrs = ("k",)
    violation_codes = GRAD_CODES
    differentiable = False

    def infer_layout(self, inputs, attrs):
        dv, values, idx = inputs
        dim = check_dim(self.name, "dim", attrs.get("dim", -1), values.ndim)
        k = check_k(self.name, attrs["k"], values, dim, "values")
        want_shape = values.shape[:dim] + (k,) + values.shape[dim + 1:]
        if values.shape != idx.shape or dv.shape != want_shape:
            v = Violation("broadcast-shape", f"dv {list(dv.shape)}, values {list(values.shape)} and indices "
                          f"{list(idx.shape)} are not a merge's cotangent and candidates", "give the forward's shapes",
                          operand="dv")
            return RuleResult((None,), (v,), ())
        wants, out_ps, violations = pair_layouts(self.name, [("dv", dv), ("values", values), ("indices", idx)], dim,
                                                 linear=0)
        out = TensorSpec(values.shape, dv.dtype, Layout(dv.mesh, out_ps, values.ndim))
        return RuleResult((out,), tuple(violations), tuple(_want(w, t) for w, t in zip(wants, inputs)))


# ------------------------------------------------------------------------------ cumsum along a sharded dim
def _chunked_dim(op: str, spec: TensorSpec, operand: str, dim: int, chunks: int,
                 issues: list) -> tuple[int, ...]:
    """The mesh axes that cut ``dim`` into one ``torch.chunk`` piece of ``chunks`` per rank (``()``: the
    dim whole); an issue when the dim is cut otherwise."""
    if not spec.layout.cut_axes(dim):
        return ()
    if chunks_match(spec, dim, chunks):
        return spec.layout.dim_axes(dim)
    issues.append(_chunk_issue(op, spec, operand, dim, chunks, spec.shape[dim]))
    return ()


def _chunk_localize(attrs: dict, spec: TensorSpec, rank: int) -> dict:
    """A rank holding one chunk of ``spec``'s dim computes ``chunks=1`` on it."""
    dim = attrs["dim"] % spec.ndim
    if not spec.layout.dim_axes(dim):
        return dict(attrs)
    return {**attrs, "chunks": 1}


class _ChunkRule(OpRule):
    """Ops defined per ``torch.chunk`` piece of ``dim`` (``chunks`` pieces): a dim cut into exactly
    those pieces stays sharded, a whole dim computes every piece, any other cut is gathered."""

    attr_types = {"dim": "int", "chunks": "int"}
    violation_codes = GRAD_CODES
    strided = True

    def normalize_attrs(self, attrs, node=None):
        out = super().normalize_attrs(attrs, node)
        _positive_chunks(self.name, out, node)
        return out


@register_op
class ChunkSum(_ChunkRule):
    """``chunk_sum(x, dim, chunks)``: the sum of each ``torch.chunk`` piece of ``dim``, ``chunks`` along dim.

    With the dim cut into those pieces each rank sums its own (the output holds one per rank);
    the shard totals of a cumsum along a sharded dim.

    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> x = TensorSpec((3, 10), "float32", Layout(DeviceMesh((4,), ("sp",)), ["S(1)"], 2))
    >>> str(get_rule("chunk_sum").infer_layout((x,), {"dim": 1, "chunks": 4}).outputs[0])
    'float32[3, 4] (S(1))'
    """

    name = "chunk_sum"
    operands = ("x",)
    attr_defaults = {"dim": None, "chunks": None}
    required_attrs = ("dim", "chunks")

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        dim = check_dim(self.name, "dim", attrs["dim"], x.ndim)
        chunks = attrs["chunks"]
        check_chunks(self.name, chunks, x.shape[dim], x.mesh)
        fixed, issues = whole_dims(self.name, x, "x", [], "")
        keep = _chunked_dim(self.name, x, "x", dim, chunks, issues)
        fixed = fixed.with_placements([Replicate() if shard_dim(p) == dim and a not in keep else p
                                       for a, p in enumerate(fixed.placements)])
        shape = x.shape[:dim] + (chunks,) + x.shape[dim + 1:]
        out = TensorSpec(shape, _cumsum_dtype(x.dtype), fixed)
        return RuleResult((out,), tuple(_violations(x, fixed, "x", issues)), (_want(fixed, x),))

    def localize(self, attrs, inputs, outputs, rank):
        return _chunk_localize(attrs, inputs[0], rank)

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        x = g.spec(inputs[0])
        if cotangents[0] is None or not needs[0] or not _is_float(x.dtype):
            return (None,)
        dim = attrs["dim"] % x.ndim
        return (g.op("chunk_sum_grad", [cotangents[0]], {"dim": dim, "size": x.shape[dim],
                                                         "chunks": attrs["chunks"]}),)


@register_op
class ChunkSumGrad(_ChunkRule):
    """``chunk_sum_grad(dt, dim, size, chunks)``: ``dt``'s ``c``-th element along dim repeated over the
    ``c``-th ``torch.chunk`` piece of ``size``; local where dt holds one element per rank."""

    name = "chunk_sum_grad"
    operands = ("dt",)
    attr_defaults = {"dim": None, "size": None, "chunks": None}
    attr_types = {"dim": "int", "size": "int", "chunks": "int"}
    required_attrs = ("dim", "size", "chunks")
    differentiable = False

    def infer_layout(self, inputs, attrs):
        (dt,) = inputs
        dim = check_dim(self.name, "dim", attrs["dim"], dt.ndim)
        size, chunks = attrs["size"], attrs["chunks"]
        check_chunks(self.name, chunks, size, dt.mesh)
        if size < 0:
            raise OpError("bad-attr", f"chunk_sum_grad: size={size} is negative", path="attrs.size",
                          hint="give x's size along dim")
        if dt.shape[dim] != chunks:
            v = Violation("broadcast-shape", f"dt has {dt.shape[dim]} elements along dim {dim}, not chunks={chunks}",
                          "give dt chunk_sum's output shape", operand="dt")
            return RuleResult((None,), (v,), ())
        shape = dt.shape[:dim] + (size,) + dt.shape[dim + 1:]
        axes = dt.layout.dim_axes(dim)
        if axes and not chunks_match(TensorSpec(shape, dt.dtype, dt.layout.with_placements(
                [p if shard_dim(p) != dim or a in axes else Replicate() for a, p in enumerate(dt.layout.placements)]
        )), dim, chunks):
            axes = ()
        (want,), out_ps, violations = pair_layouts(self.name, [("dt", dt)], dim, linear=0, dim_axes=axes)
        out = TensorSpec(shape, dt.dtype, Layout(dt.mesh, out_ps, len(shape)))
        return RuleResult((out,), tuple(violations), (_want(want, dt),))

    def localize(self, attrs, inputs, outputs, rank):
        out = outputs[0]
        dim = attrs["dim"] % out.ndim
        if not out.layout.dim_axes(dim):
            return dict(attrs)
        lo, hi = out.dim_bounds(dim, out.mesh.coords(rank))
        return {**attrs, "chunks": 1, "size": hi - lo}


@register_op
class ChunkCumSum(_ChunkRule):
    """``chunk_cumsum(x, offsets?, dim, chunks, exclusive=False, reverse=False)``: the cumsum of each
    ``torch.chunk`` piece of ``dim`` on its own, plus ``offsets``' ``c``-th element along dim on
    piece ``c``.

    ``chunk_cumsum(x, cumsum(chunk_sum(x), exclusive=True))`` is the cumsum of x (up to float
    rounding: the sums are added in another order).  With x's dim cut into the chunks, every
    rank scans its own piece and adds its own offset (offsets wanted sharded like x on the dim:
    a free slice of the whole exclusive scan), so only the ``chunks`` shard totals move.

    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((4,), ("sp",))
    >>> x = TensorSpec((3, 10), "float32", Layout(mesh, ["S(1)"], 2))
    >>> o = TensorSpec((3, 4), "float32", Layout(mesh, ["R"], 2))
    >>> res = get_rule("chunk_cumsum").infer_layout((x, o), get_rule("chunk_cumsum").normalize_attrs(
    ...     {"dim": 1, "chunks": 4}))
    >>> str(res.outputs[0]), res.violations, [str(w) for w in res.wants]
    ('float32[3, 10] (S(1))', (), ['None', '(S(1))'])
    """

    name = "chunk_cumsum"
    operands = ("x",)
    optional_operands = ("offsets",)
    attr_defaults = {"dim": None, "chunks": None, "exclusive": False, "reverse": False}
    required_attrs = ("dim", "chunks")

    def infer_layout(self, inputs, attrs):
        x = inputs[0]
        dim = check_dim(self.name, "dim", attrs["dim"], x.ndim)
        chunks = attrs["chunks"]
        check_chunks(self.name, chunks, x.shape[dim], x.mesh)
        named = [("x", x)]
        if len(inputs) > 1:
            offsets = inputs[1]
            if offsets.ndim != x.ndim or offsets.shape[dim] != chunks or any(
                    a != b for d, (a, b) in enumerate(zip(offsets.shape, x.shape)) if d != dim):
                v = Violation("broadcast-shape", f"offsets has shape {list(offsets.shape)}; chunk_cumsum of x "
                              f"{list(x.shape)} takes x's shape with chunks={chunks} along dim {dim}",
                              "give offsets chunk_sum's output shape", operand="offsets")
                return RuleResult((None,), (v,), ())
            named.append(("offsets", offsets))
        keep = _chunked_dim(self.name, x, "x", dim, chunks, [])  # another cut: pair_layouts gathers it
        wants, out_ps, violations = pair_layouts(self.name, named, dim, dim_axes=keep)
        out = TensorSpec(x.shape, _cumsum_dtype(x.dtype), Layout(x.mesh, out_ps, x.ndim))
        return RuleResult((out,), tuple(violations), tuple(_want(w, t) for w, t in zip(wants, inputs)))

    def localize(self, attrs, inputs, outputs, rank):
        return _chunk_localize(attrs, outputs[0], rank)

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None or not _is_float(g.spec(inputs[0]).dtype):
            return (None,) * len(inputs)
        chunked = {"dim": attrs["dim"], "chunks": attrs["chunks"]}
        dx = g.op("chunk_cumsum", [dy], {**chunked, "exclusive": bool(attrs.get("exclusive")),
                                         "reverse": not attrs.get("reverse")}) if needs[0] else None
        if len(inputs) == 1:
            return (dx,)
        doffsets = g.op("chunk_sum", [dy], chunked) if needs[1] else None
        return dx, doffsets
