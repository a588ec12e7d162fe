"""Rules of the index op family: gather, index_select, scatter, scatter_add, index_add, index_copy, gather_nd,
scatter_nd, index_put, masked_fill, masked_scatter, where, one_hot, isin (and the grad ops
scatter_src_grad, index_copy_src_grad, scatter_nd_src_grad, masked_scatter_src_grad).

Every rule decides, per mesh axis, what the op computes there (an :class:`AxisChoice`):
which placement each operand needs on that axis and which placement the output gets.
Among the choices an axis allows, the rule keeps the one that moves the fewest bytes
(ties keep the first listed); an operand that must move pays with a fixable violation
(``sharding-mismatch``, or ``partial-input`` for a Partial operand) and ``--reshard``
moves it.  A Replicate operand is sliced, or turned into partial terms, for free.

The ops and their layout rules
------------------------------
``gather(x, index, dim)`` (torch.gather; ONNX ``GatherElements``, MindSpore ``GatherD``, ``aten.gather``)
    ``index`` an integer tensor of x's rank with ``index.shape[k] <= x.shape[k]`` for
    ``k != dim``; ``out[i][j][k] = x[i][index[i][j][k]][k]`` (for dim 1), out of index's shape.
    Per mesh axis: x sharded on ``dim`` (vocabulary-parallel, as ``embedding``): each rank
    looks up the indices that fall in its piece, zeros elsewhere, output ``P(sum)``
    (localised attr ``start``, the piece's first index, and ``dim_size``); x and index
    sharded alike on another dim of equal size in both: output sharded there; index
    sharded on ``dim``: output sharded there, x whole on that axis; a ``P(sum|avg)`` x
    with Replicate index passes through (the op is linear in x).
    vjp: ``scatter_add`` of the cotangent into ``zeros_like(x)``.
``index_select(x, index, dim)`` (ONNX ``Gather``, ``aten.index_select``)
    ``index`` 1-D integer; the output is x with ``dim`` replaced by ``len(index)``.  x
    sharded on ``dim``: ``P(sum)`` as for gather; x sharded on another dim: output sharded
    there; index sharded: output sharded on ``dim``; ``P(sum|avg)`` x passes through.
    vjp: ``index_add`` of the cotangent into ``zeros_like(x)``.
``scatter(x, index, src, dim)`` (ONNX ``ScatterElements``, MindSpore ``TensorScatterElements``, ``aten.scatter``)
    and ``scatter_add(x, index, src, dim)`` (``aten.scatter_add``, MindSpore ``ScatterAddWithAxis``)
    ``out = x`` with ``out[i][index[i][j]][j] = src[i][j]`` (dim 1; ``+=`` for scatter_add).
    ``src`` must have index's shape (torch also takes a larger src and reads only its
    index-shaped corner: slice src first), ``index.shape[k] <= x.shape[k]`` for
    ``k != dim``.  Duplicate indices in scatter: the last one in row-major order wins,
    on one device and on every rank alike (torch leaves it undefined).  Per mesh axis:
    x sharded on ``dim``: each rank writes the indices that fall in its piece (index
    and src whole there; localised ``start``, ``dim_size``), output sharded like x;
    x, index and src sharded alike on another dim of equal size: output sharded there;
    scatter_add only: index and src sharded on ``dim``: each rank adds its share of the
    contributions to its term of x (a Replicate x becomes ``P(sum)`` terms for free),
    output ``P(sum)``; x or src ``P(sum|avg)`` (the other the same Partial, index
    Replicate): both ops are linear in (x, src) together, the Partial passes through.
    vjp: ``dx = dy`` (scatter: ``scatter(dy, index, zeros_like(src))``); ``dsrc = gather(dy,
    index, dim)`` for scatter_add, and for scatter ``scatter_src_grad(dy, index, dim)``:
    the same where the entry is the last write to its element, 0 where a later entry
    overwrote it (torch gives every duplicate the gradient, as if each had been written).
``index_add(x, index, src, dim)`` (torch ``index_add``, ``aten.index_add``, MindSpore ``IndexAdd``)
    ``index`` 1-D, ``src`` x's shape with ``dim`` of ``len(index)``; adds ``src`` slices at
    the indexed positions.  Sharded like scatter_add, the index being the contributions' dim.
    vjp: ``dx = dy``, ``dsrc = index_select(dy, index, dim)``.
``index_copy(x, index, src, dim)`` (``aten.index_copy``; ``scatter_update``, MindSpore ``ScatterUpdate``, is it with
    ``dim`` 0)
    index_add that writes instead of adding (the last of duplicate indices wins); sharded
    like scatter.  vjp: ``dx = index_copy(dy, index, zeros_like(src))``, ``dsrc =
    index_copy_src_grad(dy, index, dim)``: index_select of dy where the index is the last
    occurrence of its value.
``gather_nd(x, indices)`` (ONNX ``GatherND``, MindSpore ``GatherNd``), ``scatter_nd(x, indices, updates,
    reduction)`` (ONNX ``ScatterND``, MindSpore ``TensorScatterUpdate``) and ``index_put(x, indices,
    values, accumulate)`` (``aten.index_put``, with torch's index tensors stacked on a last dim)
    ``indices [..., k]`` holds tuples addressing x's first k dims: see their classes.
``masked_fill(x, mask, value)`` (``aten.masked_fill``, MindSpore ``MaskedFill``)
    ``mask`` bool, broadcasting to x's shape; elementwise rule (a Partial x or mask must
    be reduced first: filling every term would add ``value`` once per rank).
    vjp: ``masked_fill(dy, mask, 0)``.
``masked_scatter(x, mask, source)`` (``aten.masked_scatter``)
    x's true places (in row-major order) filled from the leading elements of source; x
    keeps any shard, mask and source stay whole (the count of true places before a
    rank's piece depends on the whole mask).  See the class.
``where(condition, x, y)`` (ONNX ``Where``, ``aten.where``, MindSpore ``Select``)
    ``condition`` bool; numpy broadcasting; elementwise rule.  where is linear in (x, y)
    together: x and/or y ``P(sum|avg)`` (the other the same Partial or Replicate, made
    terms for free) with a Replicate condition pass the Partial through; any other
    Partial operand is reduced first.  vjp: ``dx = where(condition, dy, zeros_like(dy))``, ``dy_y =
    masked_fill(dy, condition, 0)``, each summed back to its operand's shape.
``one_hot(indices, num_classes)`` (ONNX ``OneHot``, ``aten.one_hot``, MindSpore ``OneHot``, ``OneHotExt``)
    int64 output ``indices.shape + (num_classes,)``; shards of ``indices`` carry over.
``isin(elements, test_elements)`` (``aten.isin``, MindSpore ``IsIn``; ONNX has no such op)
    bool of elements' shape; elements' shards carry over, ``test_elements`` whole.

Unusable input is an :class:`~layout_prop.core.errors.OpError` (exit 2): an index
operand that is not an integer tensor (``invalid-dtype``), a mask or condition that is
not bool, ``dim`` out of range (``invalid-dims``), ranks or shapes that do not match as
torch requires (``invalid-rank``, ``invalid-shape``), ``num_classes`` missing or below 1
(``bad-attr``).  An index outside ``[0, size)`` in the data (one_hot: outside ``[0,
num_classes)``) is an :class:`~layout_prop.core.errors.ExecutionError`
``index-out-of-range`` from the kernel, on one device and on every rank alike (a rank
checks the global range, not only its piece's).  Negative indices are out of range, as in
torch (ONNX's GatherElements, Gather and ScatterND count them from the end: an imported
model that relies on that stops with this error rather than computing something else).

Examples
--------
Vocabulary-parallel lookup: x sharded on the gathered dim gives a partial sum.

>>> from layout_prop import DeviceMesh, Layout, TensorSpec
>>> mesh = DeviceMesh((2,), ("tp",))
>>> x = TensorSpec((4, 10), "float32", Layout(mesh, ["S(1)"], 2))
>>> index = TensorSpec((4, 3), "int64", Layout(mesh, ["R"], 2))
>>> res = get_rule("gather").infer_layout((x, index), {"dim": 1})
>>> str(res.outputs[0]), res.violations
('float32[4, 3] (P(sum))', ())
>>> [get_rule("gather").localize({"dim": 1}, (x, index), res.outputs, r)["start"] for r in range(2)]
[0, 5]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from layout_prop.core.errors import OpError, Violation, cut
from layout_prop.core.layout import Layout
from layout_prop.core.placement import Partial, Placement, Replicate, Shard
from layout_prop.core.registry import InputDomain, OpRule, RuleResult, get_rule, register_op
from layout_prop.core.spec import TensorSpec

from .common import plan_summary
from .elementwise import ElementwiseRule, broadcast_shapes, sum_to_shape

__all__ = ["AxisChoice", "choose_axes", "Gather", "ScatterSrcGrad", "IndexSelect", "Scatter", "ScatterAdd", "IndexAdd",
           "IndexCopy", "IndexCopySrcGrad", "GatherNd", "ScatterNdSrcGrad", "ScatterNd", "IndexPut", "MaskedScatter",
           "MaskedScatterSrcGrad", "MaskedFill",
           "Where", "OneHot", "IsIn", "get_rule"]

LAYOUT_CODES = ("partial-input", "sharding-mismatch")
LINEAR_PARTIALS = ("sum", "avg")  # the Partial ops a linear map passes through
R = Replicate()


# ===================================================================== input checks (exit 2)
def _is_integer(dtype: str) -> bool:
    return np.issubdtype(np.dtype(dtype), np.integer)


def check_integer(op: str, operand: str, spec: TensorSpec) -> None:
    """``invalid-dtype`` unless ``spec`` holds integers (bool is not an index)."""
    if not _is_integer(spec.dtype):
        raise OpError("invalid-dtype", f"{op}: {operand} has dtype {spec.dtype}; {operand} holds indices",
                      hint=f"give {operand} the dtype int64 or int32 (cast it)")


def check_bool(op: str, operand: str, spec: TensorSpec) -> None:
    """``invalid-dtype`` unless ``spec`` is a bool tensor."""
    if spec.dtype != "bool":
        raise OpError("invalid-dtype", f"{op}: {operand} has dtype {spec.dtype}; {operand} must be bool",
                      hint=f"give {operand} the dtype bool (compare, or cast it)")


def normalize_dim(op: str, dim, ndim: int, operand: str = "x") -> int:
    """``dim`` in ``[0, ndim)`` (negative counts from the end); ``invalid-dims`` otherwise."""
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise OpError("bad-attr", f"{op}: dim must be an integer, got {cut(dim)}", hint="give dim as an integer")
    if not -ndim <= dim < ndim:
        raise OpError("invalid-dims", f"{op}: dim {cut(dim)} is out of range for {operand} of rank {ndim}",
                      hint=f"give dim in {-ndim}..{ndim - 1}" if ndim else
                      f"{operand} has no dims to index: give it at least one")
    return int(dim) % ndim


def _shape_error(op: str, message: str, hint: str) -> OpError:
    return OpError("invalid-shape", f"{op}: {message}", hint=hint)


def check_same_rank(op: str, specs: Sequence[tuple[str, TensorSpec]]) -> None:
    """``invalid-rank`` unless every operand has the first one's rank."""
    (first, ref), *rest = specs
    for name, spec in rest:
        if spec.ndim != ref.ndim:
            raise OpError("invalid-rank", f"{op}: {name} has rank {spec.ndim} ({list(spec.shape)}) but {first} has "
                          f"rank {ref.ndim} ({list(ref.shape)})",
                          hint=f"give {name} as many dims as {first}")


def check_fits(op: str, index: TensorSpec, x: TensorSpec, dim: int, x_name: str = "x") -> None:
    """torch's ``index.size(k) <= x.size(k)`` for every ``k != dim``."""
    for k, (n, m) in enumerate(zip(index.shape, x.shape)):
        if k != dim and n > m:
            raise _shape_error(op, f"index has shape {list(index.shape)} and {x_name} {list(x.shape)}: "
                               f"index dim {k} (size {n}) is larger than {x_name}'s ({m})",
                               f"index may be at most {x_name}'s size in every dim but dim {dim}")


# ===================================================================== the per-axis analysis
@dataclass(frozen=True)
class AxisChoice:
    """What an op computes on one mesh axis: each operand's placement there and the output's.

    ``why`` completes "... computes ..." in messages (what each rank does).
    """

    targets: tuple[Placement, ...]
    output: Placement
    why: str


def _move_cost(spec: TensorSpec, have: Placement, want: Placement) -> int:
    if have == want or isinstance(have, Replicate):
        return 0  # nothing, a free local slice or a free local-partial
    return (2 if isinstance(have, Partial) else 1) * spec.nbytes


def choose_axes(op: str, names: Sequence[str], specs: Sequence[TensorSpec],
                options: Callable[[int], list[AxisChoice]]) -> tuple[list[AxisChoice], list[Violation],
                                                                       tuple[Layout | None, ...]]:
    """The cheapest choice per mesh axis, the violations of the operands that must move, and the wants.

    ``options(axis)`` lists the choices the op allows on ``axis`` in preference order (the
    last one is everything Replicate); an operand sliced or made partial for free is no
    violation.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> x = TensorSpec((6,), "float32", Layout(mesh, ["P(max)"], 1))
    >>> choices, found, wants = choose_axes("op", ["x"], [x], lambda a: [AxisChoice((R,), R, "whole values")])
    >>> [v.code for v in found], str(wants[0])
    (['partial-input'], '(R)')
    """
    mesh = specs[0].mesh
    choices = []
    for axis in range(mesh.ndim):
        have = [s.layout.placements[axis] for s in specs]
        choices.append(min(options(axis), key=lambda c: sum(
            _move_cost(s, h, t) for s, h, t in zip(specs, have, c.targets))))
    values = ", ".join(f"{n} is {s.layout}" for n, s in zip(names, specs))
    violations: list[Violation] = []
    wants: list[Layout | None] = []
    for i, (name, spec) in enumerate(zip(names, specs)):
        want = Layout(mesh, [c.targets[i] for c in choices], spec.ndim)
        wants.append(None if want == spec.layout else want)
        if want == spec.layout:
            continue
        move = plan_summary(spec, want)
        if move.free:
            continue
        details = {"want": want.placement_strs()}
        found = []
        for axis, c in enumerate(choices):
            have = spec.layout.placements[axis]
            if have == c.targets[i] or isinstance(have, Replicate):
                continue
            ax = mesh.names[axis]
            if isinstance(have, Partial):
                code, hint = "partial-input", f"reduce {name} on {ax} first (all-reduce {have.reduce_op})"
            else:
                code, hint = "sharding-mismatch", f"give {name} {c.targets[i]} on {ax} (--reshard moves it)"
            found.append(Violation(code, f"{op}: {name} is {have} on mesh axis {ax}, but there {op} computes "
                                   f"{c.why}, which needs {name} {c.targets[i]} ({values})", hint, operand=name,
                                   fixable=move.fixable, details={**details, "mesh_axis": ax}))
        if not found:  # a move the per-axis analysis thought free: report it rather than hide it
            found.append(Violation("sharding-mismatch", f"{op}: {name} is {spec.layout} but must be {want} "
                                   f"({move.text})", f"give {name} the layout {want}", operand=name,
                                   fixable=move.fixable, details=details))
        violations += found
    return choices, violations, tuple(wants)


def _linear_partial(p: Placement) -> bool:
    return isinstance(p, Partial) and p.reduce_op in LINEAR_PARTIALS


def _shard(p: Placement) -> int | None:
    return p.dim if isinstance(p, Shard) else None


# ===================================================================== gather, index_select
def _lookup_start(x: TensorSpec, dim: int, rank: int) -> dict:
    """The localised attrs of a lookup along ``dim``: the rank's first index and the global size."""
    return {"start": x.local_slices(rank)[dim][0], "dim_size": x.shape[dim]}


class _LookupRule(OpRule):
    """Shared parts of gather and index_select: ``(x, index)``, attr ``dim``, linear in x."""

    operands = ("x", "index")

    def input_domain(self, index, inputs, attrs):
        """The index addresses x's ``dim``: ``[0, size)``."""
        return _index_domain(inputs, attrs) if index == 1 else None
    attr_defaults = {"dim": None}
    required_attrs = ("dim",)
    violation_codes = LAYOUT_CODES
    grad_op = ""

    def check_inputs(self, x: TensorSpec, index: TensorSpec, dim: int) -> None:
        raise NotImplementedError

    def out_shape(self, x: TensorSpec, index: TensorSpec, dim: int) -> tuple[int, ...]:
        raise NotImplementedError

    def axis_options(self, x: TensorSpec, index: TensorSpec, dim: int, axis: int) -> list[AxisChoice]:
        raise NotImplementedError

    def analysis(self, x: TensorSpec, index: TensorSpec, attrs: dict):
        dim = normalize_dim(self.name, attrs.get("dim"), x.ndim)
        check_integer(self.name, "index", index)
        self.check_inputs(x, index, dim)
        return dim, choose_axes(self.name, self.operands, (x, index),
                                lambda axis: self.axis_options(x, index, dim, axis))

    def infer_layout(self, inputs, attrs):
        x, index = inputs
        dim, (choices, violations, wants) = self.analysis(x, index, attrs)
        shape = self.out_shape(x, index, dim)
        out = TensorSpec(shape, x.dtype, Layout(x.mesh, [c.output for c in choices], len(shape)))
        return RuleResult((out,), tuple(violations), wants)

    def localize(self, attrs, inputs, outputs, rank):
        dim = normalize_dim(self.name, attrs.get("dim"), inputs[0].ndim)
        return {**attrs, **_lookup_start(inputs[0], dim, rank)}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None or not needs[0]:
            return (None, None)
        zeros = g.op("zeros_like", [inputs[0]])
        return (g.op(self.grad_op, [zeros, inputs[1], dy], {"dim": attrs["dim"]}), None)  # indices: no gradient


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _index_domain(inputs, attrs) -> InputDomain | None:
    """``[0, x.shape[dim])`` for the index of a lookup or scatter along ``dim`` (None for a dim that is not one)."""
    x, dim = inputs[0], attrs.get("dim")
    if not _is_int(dim) or not -x.ndim <= dim < x.ndim:
        return None
    return InputDomain(0, x.shape[dim % x.ndim])


@register_op
class Gather(_LookupRule):
    """``gather(x, index, dim)``: torch.gather, ``out[...] = x[..., index[...], ...]`` along ``dim``.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("dp",))
    >>> x = TensorSpec((4, 9), "float32", Layout(mesh, ["S(0)"], 2))
    >>> index = TensorSpec((4, 3), "int64", Layout(mesh, ["R"], 2))
    >>> res = Gather().infer_layout((x, index), {"dim": 1})
    >>> str(res.outputs[0]), res.violations, str(res.wants[1])
    ('float32[4, 3] (S(0))', (), '(S(0))')
    """

    name = "gather"
    aliases = ("GatherElements", "GatherD", "aten.gather", "torch.gather")
    grad_op = "scatter_add"
    index_splits = True  # index sharded on dim: each rank looks up its indices in the whole of x

    def check_inputs(self, x, index, dim):
        check_same_rank(self.name, [("x", x), ("index", index)])
        check_fits(self.name, index, x, dim)

    def out_shape(self, x, index, dim):
        return index.shape

    def axis_options(self, x, index, dim, axis):
        px, pi = x.layout.placements[axis], index.layout.placements[axis]
        out = []
        if _shard(px) == dim:
            out.append(AxisChoice((px, R), Partial("sum"), f"a lookup in x's piece of dim {dim} on each rank "
                                  "(zeros for indices outside it, a partial sum), with index whole"))
        for p in (px, pi):
            k = _shard(p)
            if k is not None and k != dim and x.shape[k] == index.shape[k]:
                out.append(AxisChoice((Shard(k), Shard(k)), Shard(k), f"x and index sharded alike on dim {k}"))
        if _linear_partial(px):
            out.append(AxisChoice((px, R), px, f"the lookup of each {px} term of x (index whole)"))
        if _shard(pi) == dim and self.index_splits:
            out.append(AxisChoice((R, pi), pi, f"the lookup of index's piece of dim {dim} in the whole of x"))
        out.append(AxisChoice((R, R), R, "the whole lookup"))
        return out


@register_op
class ScatterSrcGrad(Gather):
    """``scatter_src_grad(dy, index, dim)``: the gradient of scatter's src, ``gather(dy, index, dim)``
    where the entry is the last write to its element, 0 where a later entry overwrote it.

    Which entry wins depends on the whole line of index along ``dim``, so index is never
    split along ``dim`` here (the forward never splits it either).

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> dy = TensorSpec((10, 4), "float32", Layout(mesh, ["R"], 2))
    >>> index = TensorSpec((6, 4), "int64", Layout(mesh, ["S(0)"], 2))
    >>> res = ScatterSrcGrad().infer_layout((dy, index), {"dim": 0})
    >>> str(res.outputs[0].layout), str(res.wants[1])
    ('(R)', '(R)')
    """

    name = "scatter_src_grad"
    operands = ("dy", "index")
    aliases = ()
    differentiable = False
    index_splits = False


@register_op
class IndexSelect(_LookupRule):
    """``index_select(x, index, dim)``: the slices of x at the 1-D ``index`` along ``dim``.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> x = TensorSpec((10, 6), "float32", Layout(mesh, ["R"], 2))
    >>> index = TensorSpec((5,), "int64", Layout(mesh, ["S(0)"], 1))
    >>> str(IndexSelect().infer_layout((x, index), {"dim": 0}).outputs[0])
    'float32[5, 6] (S(0))'
    """

    name = "index_select"
    aliases = ("Gather", "aten.index_select", "torch.index_select")
    grad_op = "index_add"
    index_splits = True  # index sharded: each rank looks up its indices in the whole of x

    def check_inputs(self, x, index, dim):
        if index.ndim != 1:
            raise OpError("invalid-rank", f"{self.name}: index has shape {list(index.shape)}; it must be 1-D",
                          hint="flatten index (reshape it to [-1]) and reshape the output back")

    def out_shape(self, x, index, dim):
        return x.shape[:dim] + (index.shape[0],) + x.shape[dim + 1:]

    def axis_options(self, x, index, dim, axis):
        px, pi = x.layout.placements[axis], index.layout.placements[axis]
        out = []
        k = _shard(px)
        if k == dim:
            out.append(AxisChoice((px, R), Partial("sum"), f"a lookup in x's piece of dim {dim} on each rank "
                                  "(zeros for indices outside it, a partial sum), with index whole"))
        elif k is not None:
            out.append(AxisChoice((px, R), px, f"the lookup in x's piece of dim {k} (index whole)"))
        if _linear_partial(px):
            out.append(AxisChoice((px, R), px, f"the lookup of each {px} term of x (index whole)"))
        if isinstance(pi, Shard) and self.index_splits:
            out.append(AxisChoice((R, pi), Shard(dim), "the lookup of index's piece in the whole of x"))
        out.append(AxisChoice((R, R), R, "the whole lookup"))
        return out


# ===================================================================== scatter, scatter_add, index_add
class _ScatterRule(OpRule):
    """Shared parts of scatter, scatter_add and index_add: ``(x, index, src)``, attr ``dim``."""

    operands = ("x", "index", "src")

    def input_domain(self, index, inputs, attrs):
        """The index addresses x's ``dim``: ``[0, size)``."""
        return _index_domain(inputs, attrs) if index == 1 else None
    attr_defaults = {"dim": None}
    required_attrs = ("dim",)
    violation_codes = LAYOUT_CODES
    adds = True  # contributions add (split contributions give a partial sum)

    def check_inputs(self, x: TensorSpec, index: TensorSpec, src: TensorSpec, dim: int) -> None:
        raise NotImplementedError

    def shared_dims(self, x: TensorSpec, index: TensorSpec, src: TensorSpec, dim: int) -> dict[int, int | None]:
        """x dim -> index dim (None: index lacks it) of the dims all three may shard alike."""
        raise NotImplementedError

    def contribution_dims(self, dim: int) -> tuple[int, int]:
        """(index dim, src dim) along which the contributions are listed."""
        raise NotImplementedError

    def analysis(self, x, index, src, attrs):
        dim = normalize_dim(self.name, attrs.get("dim"), x.ndim)
        check_integer(self.name, "index", index)
        if src.dtype != x.dtype:
            raise OpError("invalid-dtype", f"{self.name}: src has dtype {src.dtype} but x {x.dtype}; the op writes "
                          "src into a copy of x", hint="cast src to x's dtype")
        self.check_inputs(x, index, src, dim)
        shared = self.shared_dims(x, index, src, dim)
        return dim, choose_axes(self.name, self.operands, (x, index, src),
                                lambda axis: self._options(x, index, src, dim, shared, axis))

    def _options(self, x, index, src, dim, shared, axis) -> list[AxisChoice]:
        px, pi, ps = (t.layout.placements[axis] for t in (x, index, src))
        out = []
        if _shard(px) == dim:
            out.append(AxisChoice((px, R, R), px, f"the writes that fall in x's piece of dim {dim} on each rank "
                                  "(index and src whole)"))
        by_index = {v: k for k, v in shared.items() if v is not None}
        for k in (_shard(px), by_index.get(_shard(pi)), _shard(ps)):
            if k is not None and k in shared:
                i_dim = shared[k]
                out.append(AxisChoice((Shard(k), R if i_dim is None else Shard(i_dim), Shard(k)), Shard(k),
                                      f"x, index and src sharded alike on dim {k}"))
        i_dim, s_dim = self.contribution_dims(dim)
        if self.adds and (_shard(pi) == i_dim or _shard(ps) == s_dim) and index.shape[i_dim] == src.shape[s_dim]:
            out.append(AxisChoice((Partial("sum"), Shard(i_dim), Shard(s_dim)), Partial("sum"),
                                  "each rank's share of the contributions added to its term of x (a partial sum)"))
        for p in (px, ps):
            if _linear_partial(p):
                out.append(AxisChoice((p, R, p), p, f"the op on each {p} term of x and src (index whole)"))
        out.append(AxisChoice((R, R, R), R, "the whole op"))
        return out

    def infer_layout(self, inputs, attrs):
        x, index, src = inputs
        dim, (choices, violations, wants) = self.analysis(x, index, src, attrs)
        out = TensorSpec(x.shape, x.dtype, Layout(x.mesh, [c.output for c in choices], x.ndim))
        return RuleResult((out,), tuple(violations), wants)

    def localize(self, attrs, inputs, outputs, rank):
        dim = normalize_dim(self.name, attrs.get("dim"), inputs[0].ndim)
        return {**attrs, **_lookup_start(inputs[0], dim, rank)}


class _ScatterElementsRule(_ScatterRule):
    """scatter and scatter_add: index and src of x's rank, src of index's shape."""

    def check_inputs(self, x, index, src, dim):
        check_same_rank(self.name, [("x", x), ("index", index), ("src", src)])
        if src.shape != index.shape:
            raise _shape_error(self.name, f"src has shape {list(src.shape)} but index {list(index.shape)}",
                               "give src index's shape (torch reads only the index-shaped corner of a larger "
                               "src: slice it to that corner first)")
        check_fits(self.name, index, x, dim)

    def shared_dims(self, x, index, src, dim):
        return {k: k for k in range(x.ndim) if k != dim and x.shape[k] == index.shape[k]}

    def contribution_dims(self, dim):
        return dim, dim


@register_op
class Scatter(_ScatterElementsRule):
    """``scatter(x, index, src, dim)``: x with src written at ``index`` along ``dim`` (last write wins).

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> x = TensorSpec((10, 4), "float32", Layout(mesh, ["S(0)"], 2))
    >>> index = TensorSpec((3, 4), "int64", Layout(mesh, ["S(0)"], 2))
    >>> src = TensorSpec((3, 4), "float32", Layout(mesh, ["R"], 2))
    >>> res = Scatter().infer_layout((x, index, src), {"dim": 0})
    >>> str(res.outputs[0].layout), [v.code for v in res.violations], str(res.wants[1])
    ('(S(0))', ['sharding-mismatch'], '(R)')
    """

    name = "scatter"
    aliases = ("ScatterElements", "TensorScatterElements", "aten.scatter", "torch.scatter")
    adds = False

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None, None, None)
        dsrc = g.op("scatter_src_grad", [dy, inputs[1]], {"dim": attrs["dim"]})
        dx = None
        if needs[0]:
            zeros = g.op("zeros_like", [inputs[2]])
            dx = g.op("scatter", [dy, inputs[1], zeros], {"dim": attrs["dim"]})
        return (dx, None, dsrc if needs[2] else None)


@register_op
class ScatterAdd(_ScatterElementsRule):
    """``scatter_add(x, index, src, dim)``: x with src added at ``index`` along ``dim``.

    Examples
    --------
    Contributions split along the scattered dim: each rank adds its share, a partial sum.

    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> x = TensorSpec((10, 4), "float32", Layout(mesh, ["R"], 2))
    >>> index = TensorSpec((6, 4), "int64", Layout(mesh, ["S(0)"], 2))
    >>> src = TensorSpec((6, 4), "float32", Layout(mesh, ["S(0)"], 2))
    >>> res = ScatterAdd().infer_layout((x, index, src), {"dim": 0})
    >>> str(res.outputs[0].layout), res.violations, str(res.wants[0])
    ('(P(sum))', (), '(P(sum))')
    """

    name = "scatter_add"
    aliases = ("ScatterAddWithAxis", "aten.scatter_add", "torch.scatter_add")

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None, None, None)
        dsrc = g.op("gather", [dy, inputs[1]], {"dim": attrs["dim"]}) if needs[2] else None
        return (dy if needs[0] else None, None, dsrc)


@register_op
class IndexAdd(_ScatterRule):
    """``index_add(x, index, src, dim)``: x with the slices of src added at the 1-D ``index`` along ``dim``.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> x = TensorSpec((10, 4), "float32", Layout(mesh, ["S(1)"], 2))
    >>> index = TensorSpec((3,), "int64", Layout(mesh, ["R"], 1))
    >>> src = TensorSpec((3, 4), "float32", Layout(mesh, ["R"], 2))
    >>> res = IndexAdd().infer_layout((x, index, src), {"dim": 0})
    >>> str(res.outputs[0].layout), res.violations, str(res.wants[2])
    ('(S(1))', (), '(S(1))')
    """

    name = "index_add"
    aliases = ("IndexAdd", "aten.index_add", "torch.index_add")

    def check_inputs(self, x, index, src, dim):
        if index.ndim != 1:
            raise OpError("invalid-rank", f"{self.name}: index has shape {list(index.shape)}; it must be 1-D",
                          hint=f"give {self.name} a 1-D index (scatter_add takes an index of x's rank)")
        want = x.shape[:dim] + index.shape + x.shape[dim + 1:]
        if src.shape != want:
            raise _shape_error(self.name, f"src has shape {list(src.shape)}; for x {list(x.shape)} and "
                               f"{index.shape[0]} indices along dim {dim} it must be {list(want)}",
                               f"give src the shape {list(want)}")

    def shared_dims(self, x, index, src, dim):
        return {k: None for k in range(x.ndim) if k != dim}

    def contribution_dims(self, dim):
        return 0, dim

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None, None, None)
        dsrc = g.op("index_select", [dy, inputs[1]], {"dim": attrs["dim"]}) if needs[2] else None
        return (dy if needs[0] else None, None, dsrc)


@register_op
class IndexCopy(IndexAdd):
    """``index_copy(x, index, src, dim)``: x with the slices of src written at the 1-D ``index`` along ``dim``.

    Of duplicate indices the last one wins (torch leaves it undefined).  Contributions are
    never split along the index (a write is no sum), as for scatter.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> x = TensorSpec((10, 4), "float32", Layout(mesh, ["S(0)"], 2))
    >>> index = TensorSpec((3,), "int64", Layout(mesh, ["R"], 1))
    >>> src = TensorSpec((3, 4), "float32", Layout(mesh, ["R"], 2))
    >>> res = IndexCopy().infer_layout((x, index, src), {"dim": 0})
    >>> str(res.outputs[0].layout), res.violations
    ('(S(0))', ())
    """

    name = "index_copy"
    aliases = ("aten.index_copy", "torch.index_copy")
    adds = False

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None, None, None)
        dsrc = g.op("index_copy_src_grad", [dy, inputs[1]], {"dim": attrs["dim"]})
        dx = None
        if needs[0]:
            zeros = g.op("zeros_like", [inputs[2]])
            dx = g.op("index_copy", [dy, inputs[1], zeros], {"dim": attrs["dim"]})
        return (dx, None, dsrc if needs[2] else None)


@register_op
class ScatterUpdate(IndexCopy):
    """``scatter_update(x, index, src)``: MindSpore's ``ScatterUpdate``, ``x[index] = src`` along dim 0 with a
    1-D ``index``: ``index_copy`` with ``dim`` 0 (its layout rule, gradient and kernels)."""

    name = "scatter_update"
    aliases = ("ScatterUpdate",)
    attr_defaults = {"dim": 0}
    required_attrs = ()
    cost_kind = "vector"


@register_op
class IndexCopySrcGrad(IndexSelect):
    """``index_copy_src_grad(dy, index, dim)``: the gradient of index_copy's src, ``index_select(dy,
    index, dim)`` where the index is the last occurrence of its value, 0 where a later one overwrote it.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> dy = TensorSpec((10, 4), "float32", Layout(mesh, ["S(0)"], 2))
    >>> index = TensorSpec((6,), "int64", Layout(mesh, ["S(0)"], 1))
    >>> res = IndexCopySrcGrad().infer_layout((dy, index), {"dim": 0})
    >>> str(res.outputs[0].layout), str(res.wants[1])
    ('(P(sum))', '(R)')
    """

    name = "index_copy_src_grad"
    operands = ("dy", "index")
    aliases = ()
    differentiable = False
    index_splits = False


# ===================================================================== gather_nd, scatter_nd, index_put
def _nd_depth(op: str, x: TensorSpec, indices: TensorSpec, operand: str = "indices") -> int:
    """k, the number of leading dims of x an index tuple addresses (indices' last dim)."""
    check_integer(op, operand, indices)
    if indices.ndim < 1 or not 1 <= indices.shape[-1] <= x.ndim:
        raise _shape_error(op, f"{operand} has shape {list(indices.shape)}; its last dim (the length of each index "
                           f"tuple) must be in 1..{x.ndim}, the rank of x {list(x.shape)}",
                           f"give {operand} the shape [..., k] with k <= {x.ndim}")
    return indices.shape[-1]


def _nd_starts(x: TensorSpec, k: int, rank: int) -> dict:
    """The localised attrs of an n-d lookup: the rank's first index and the global size of x's first k dims."""
    slices = x.local_slices(rank)
    return {"starts": [slices[j][0] for j in range(k)], "dim_sizes": list(x.shape[:k])}


@register_op
class GatherNd(OpRule):
    """``gather_nd(x, indices)``: ``out[b] = x[indices[b]]``, each ``indices[b]`` a tuple of k indices.

    ``indices`` of shape ``[..., k]`` addresses x's first k dims; the output is
    ``indices.shape[:-1] + x.shape[k:]`` (ONNX ``GatherND`` and MindSpore ``GatherNd`` with no
    batch dims).  Per mesh axis: x sharded on an addressed dim: each rank looks up the index
    tuples in its piece, zeros elsewhere, output ``P(sum)`` (localised ``starts``,
    ``dim_sizes``); x sharded on a trailing dim: the output's matching dim; indices sharded on
    a batch dim: the output's; ``P(sum|avg)`` x passes through.  vjp: ``scatter_nd`` (add) of
    the cotangent into ``zeros_like(x)``.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
    >>> x = TensorSpec((8, 6, 4), "float32", Layout(mesh, ["S(0)", "S(2)"], 3))
    >>> idx = TensorSpec((5, 2), "int64", Layout(mesh, ["R", "R"], 2))
    >>> str(GatherNd().infer_layout((x, idx), {}).outputs[0])
    'float32[5, 4] (P(sum), S(1))'
    """

    name = "gather_nd"
    operands = ("x", "indices")

    def input_domain(self, index, inputs, attrs):
        """An index tuple addresses x's first k dims (k: indices' last dim): ``[0, the least of their sizes)``."""
        if index != 1 or not inputs[1].ndim:
            return None
        k = inputs[1].shape[-1]
        return InputDomain(0, min(inputs[0].shape[:k])) if 0 < k <= inputs[0].ndim else None
    aliases = ("GatherND", "GatherNd", "tf.gather_nd")
    attr_defaults: dict = {}
    violation_codes = LAYOUT_CODES
    index_splits = True

    def options(self, x: TensorSpec, indices: TensorSpec, k: int, axis: int) -> list[AxisChoice]:
        px, pi = x.layout.placements[axis], indices.layout.placements[axis]
        batch = indices.ndim - 1
        out = []
        j = _shard(px)
        if j is not None and j < k:
            out.append(AxisChoice((px, R), Partial("sum"), f"a lookup in x's piece of dim {j} on each rank (zeros "
                                  "for index tuples outside it, a partial sum), with indices whole"))
        elif j is not None:
            out.append(AxisChoice((px, R), Shard(batch + j - k), f"the lookup of x's piece of trailing dim {j}"))
        if _linear_partial(px):
            out.append(AxisChoice((px, R), px, f"the lookup of each {px} term of x (indices whole)"))
        b = _shard(pi)
        if b is not None and b < batch and self.index_splits:
            out.append(AxisChoice((R, pi), pi, f"the lookup of indices' piece of dim {b} in the whole of x"))
        out.append(AxisChoice((R, R), R, "the whole lookup"))
        return out

    def infer_layout(self, inputs, attrs):
        x, indices = inputs
        k = _nd_depth(self.name, x, indices)
        choices, violations, wants = choose_axes(self.name, self.operands, (x, indices),
                                                 lambda axis: self.options(x, indices, k, axis))
        shape = indices.shape[:-1] + x.shape[k:]
        out = TensorSpec(shape, x.dtype, Layout(x.mesh, [c.output for c in choices], len(shape)))
        return RuleResult((out,), tuple(violations), wants)

    def localize(self, attrs, inputs, outputs, rank):
        return {**attrs, **_nd_starts(inputs[0], inputs[1].shape[-1], rank)}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None or not needs[0]:
            return (None, None)
        zeros = g.op("zeros_like", [inputs[0]])
        return (g.op("scatter_nd", [zeros, inputs[1], dy], {"reduction": "add"}), None)


@register_op
class ScatterNdSrcGrad(GatherNd):
    """``scatter_nd_src_grad(dy, indices)``: the gradient of scatter_nd's updates (reduction none):
    ``gather_nd(dy, indices)`` where the index tuple is the last to write its element, 0 elsewhere.

    Which tuple wins depends on all of indices, so indices stay whole.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("dp",))
    >>> dy = TensorSpec((8, 4), "float32", Layout(mesh, ["R"], 2))
    >>> idx = TensorSpec((6, 1), "int64", Layout(mesh, ["S(0)"], 2))
    >>> [str(w) for w in ScatterNdSrcGrad().infer_layout((dy, idx), {}).wants]
    ['None', '(R)']
    """

    name = "scatter_nd_src_grad"
    operands = ("dy", "indices")
    aliases = ()
    differentiable = False
    index_splits = False


REDUCTIONS = ("none", "add")


@register_op
class ScatterNd(OpRule):
    """``scatter_nd(x, indices, updates, reduction="none")``: x with ``updates[b]`` written (or added) at
    the index tuple ``indices[b]``.

    ONNX ``ScatterND`` (reduction ``none`` or ``add``), MindSpore ``TensorScatterUpdate`` /
    ``TensorScatterAdd``: ``updates`` of shape ``indices.shape[:-1] + x.shape[k:]``; of
    duplicate tuples the last one wins (``none``) or they add up.  Per mesh axis: x sharded
    on an addressed dim: each rank writes the tuples in its piece (indices and updates
    whole; localised ``starts``, ``dim_sizes``); x sharded on a trailing dim with updates
    sharded on the matching dim; ``add`` only: indices and updates sharded on a batch dim,
    each rank adds its share to its term of x, output ``P(sum)``; ``P(sum|avg)`` x or
    updates pass through (the op is linear in both together).  vjp: ``dx = dy`` (``none``:
    with the written elements zeroed), ``dupdates = gather_nd(dy, indices)`` (``none``:
    ``scatter_nd_src_grad``, only the last write of each element).

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("dp",))
    >>> x = TensorSpec((8, 4), "float32", Layout(mesh, ["R"], 2))
    >>> idx = TensorSpec((6, 1), "int64", Layout(mesh, ["S(0)"], 2))
    >>> upd = TensorSpec((6, 4), "float32", Layout(mesh, ["S(0)"], 2))
    >>> res = ScatterNd().infer_layout((x, idx, upd), {"reduction": "add"})
    >>> str(res.outputs[0].layout), res.violations
    ('(P(sum))', ())
    """

    name = "scatter_nd"
    operands = ("x", "indices", "updates")

    def input_domain(self, index, inputs, attrs):
        """An index tuple addresses x's first k dims (k: indices' last dim): ``[0, the least of their sizes)``."""
        if index != 1 or not inputs[1].ndim:
            return None
        k = inputs[1].shape[-1]
        return InputDomain(0, min(inputs[0].shape[:k])) if 0 < k <= inputs[0].ndim else None
    aliases = ("ScatterND", "TensorScatterUpdate")
    attr_defaults = {"reduction": "none"}
    violation_codes = LAYOUT_CODES
    updates_operand = "updates"

    def adds(self, attrs: dict) -> bool:
        reduction = attrs.get("reduction")
        if reduction not in REDUCTIONS:
            raise OpError("bad-attr", f"{self.name}: reduction must be one of {list(REDUCTIONS)}, got "
                          f"{cut(reduction)}", hint="give reduction none (write) or add")
        return reduction == "add"

    def check_inputs(self, x: TensorSpec, indices: TensorSpec, updates: TensorSpec) -> int:
        k = _nd_depth(self.name, x, indices)
        if updates.dtype != x.dtype:
            raise OpError("invalid-dtype", f"{self.name}: {self.updates_operand} has dtype {updates.dtype} but x "
                          f"{x.dtype}", hint=f"cast {self.updates_operand} to x's dtype")
        want = indices.shape[:-1] + x.shape[k:]
        if updates.shape != want:
            raise _shape_error(self.name, f"{self.updates_operand} has shape {list(updates.shape)}; for x "
                               f"{list(x.shape)} and indices {list(indices.shape)} it must be {list(want)}",
                               f"give {self.updates_operand} the shape {list(want)}")
        return k

    def options(self, x, indices, updates, k, adds, axis) -> list[AxisChoice]:
        px, pi, pu = (t.layout.placements[axis] for t in (x, indices, updates))
        batch = indices.ndim - 1
        out = []
        j = _shard(px)
        if j is not None and j < k:
            out.append(AxisChoice((px, R, R), px, f"the writes that fall in x's piece of dim {j} on each rank "
                                  "(indices and updates whole)"))
        trailing = [j] if j is not None and j >= k else []
        u = _shard(pu)
        if u is not None and u >= batch:
            trailing.append(u - batch + k)
        for j in trailing:
            out.append(AxisChoice((Shard(j), R, Shard(batch + j - k)), Shard(j),
                                  f"x and updates sharded alike on x's trailing dim {j}"))
        b = next((_shard(p) for p in (pi, pu) if _shard(p) is not None and _shard(p) < batch), None)
        if adds and b is not None:
            out.append(AxisChoice((Partial("sum"), Shard(b), Shard(b)), Partial("sum"),
                                  "each rank's share of the updates added to its term of x (a partial sum)"))
        for p in (px, pu):
            if _linear_partial(p):
                out.append(AxisChoice((p, R, p), p, f"the op on each {p} term of x and updates (indices whole)"))
        out.append(AxisChoice((R, R, R), R, "the whole op"))
        return out

    def infer_layout(self, inputs, attrs):
        x, indices, updates = inputs
        adds = self.adds(attrs)
        k = self.check_inputs(x, indices, updates)
        choices, violations, wants = choose_axes(self.name, self.operands, (x, indices, updates),
                                                 lambda axis: self.options(x, indices, updates, k, adds, axis))
        out = TensorSpec(x.shape, x.dtype, Layout(x.mesh, [c.output for c in choices], x.ndim))
        return RuleResult((out,), tuple(violations), wants)

    def localize(self, attrs, inputs, outputs, rank):
        return {**attrs, **_nd_starts(inputs[0], inputs[1].shape[-1], rank)}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None, None, None)
        if self.adds(attrs):
            dupdates = g.op("gather_nd", [dy, inputs[1]]) if needs[2] else None
            return (dy if needs[0] else None, None, dupdates)
        dupdates = g.op("scatter_nd_src_grad", [dy, inputs[1]])
        dx = None
        if needs[0]:
            zeros = g.op("zeros_like", [inputs[2]])
            dx = g.op("scatter_nd", [dy, inputs[1], zeros], {"reduction": "none"})
        return (dx, None, dupdates if needs[2] else None)


@register_op
class IndexPut(ScatterNd):
    """``index_put(x, indices, values, accumulate=False)``: torch's ``index_put`` with the index
    tensors stacked along a last dim (``indices = torch.stack(index_tensors, -1)``, broadcast
    to one shape first); ``values`` of shape ``indices.shape[:-1] + x.shape[k:]`` (torch also
    broadcasts values: expand them first).  ``accumulate`` adds; otherwise the last duplicate
    wins (torch leaves it undefined).  The rule and kernels are scatter_nd's.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> x = TensorSpec((8, 6), "float32", Layout(mesh, ["S(1)"], 2))
    >>> idx = TensorSpec((3, 1), "int64", Layout(mesh, ["R"], 2))
    >>> vals = TensorSpec((3, 6), "float32", Layout(mesh, ["R"], 2))
    >>> res = IndexPut().infer_layout((x, idx, vals), {"accumulate": True})
    >>> str(res.outputs[0].layout), str(res.wants[2])
    ('(S(1))', '(S(1))')
    """

    name = "index_put"
    operands = ("x", "indices", "values")
    aliases = ("aten.index_put", "torch.index_put")  # MindSpore IndexPut takes (x, values, indices): not an alias
    attr_defaults = {"accumulate": False}
    updates_operand = "values"

    def adds(self, attrs: dict) -> bool:
        accumulate = attrs.get("accumulate")
        if not isinstance(accumulate, bool):
            raise OpError("bad-attr", f"{self.name}: accumulate must be true or false, got {cut(accumulate)}",
                          hint="give accumulate as a boolean")
        return accumulate


# ===================================================================== masked_fill, where
@register_op
class MaskedFill(ElementwiseRule):
    """``masked_fill(x, mask, value)``: ``value`` where ``mask`` is true, x elsewhere.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("sp",))
    >>> x = TensorSpec((4, 6), "float32", Layout(mesh, ["S(1)"], 2))
    >>> mask = TensorSpec((6,), "bool", Layout(mesh, ["R"], 1))
    >>> res = MaskedFill().infer_layout((x, mask), {"value": -1e9})
    >>> str(res.outputs[0]), str(res.wants[1])
    ('float32[4, 6] (S(1))', '(S(0))')
    """

    name = "masked_fill"
    operands = ("x", "mask")
    aliases = ("MaskedFill", "aten.masked_fill", "torch.masked_fill")
    attr_defaults = {"value": None}
    required_attrs = ("value",)
    violation_codes = LAYOUT_CODES

    def sample_inputs(self):
        return []  # not the elementwise family's generic samples: verify takes this op's op-database records

    def infer_layout(self, inputs, attrs):
        x, mask = inputs
        check_bool(self.name, "mask", mask)
        value = attrs.get("value")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise OpError("bad-attr", f"{self.name}: value must be a number, got {cut(value)}",
                          hint="give value as a number (float('-inf') is written -.inf in YAML)")
        if broadcast_shapes([x.shape, mask.shape]) != x.shape:
            raise _shape_error(self.name, f"mask of shape {list(mask.shape)} does not broadcast to x's "
                               f"shape {list(x.shape)}", "give mask x's shape, or 1 in dims to broadcast")
        return super().infer_layout(inputs, attrs)

    def out_dtype(self, inputs, attrs):
        return inputs[0].dtype

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None or not needs[0]:
            return (None, None)
        return (g.op("masked_fill", [dy, inputs[1]], {"value": 0.0}), None)


@register_op
class Where(ElementwiseRule):
    """``where(condition, x, y)``: x where ``condition`` is true, y elsewhere (numpy broadcasting).

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("dp",))
    >>> c = TensorSpec((4, 1), "bool", Layout(mesh, ["S(0)"], 2))
    >>> x = TensorSpec((4, 6), "float32", Layout(mesh, ["R"], 2))
    >>> y = TensorSpec((6,), "float32", Layout(mesh, ["R"], 1))
    >>> res = Where().infer_layout((c, x, y), {})
    >>> str(res.outputs[0]), res.violations
    ('float32[4, 6] (S(0))', ())

    A partial x passes through, y becoming terms of the same sum for free:

    >>> c = TensorSpec((4, 1), "bool", Layout(mesh, ["R"], 2))
    >>> x = TensorSpec((4, 6), "float32", Layout(mesh, ["P(sum)"], 2))
    >>> res = Where().infer_layout((c, x, y), {})
    >>> str(res.outputs[0].layout), res.violations, [str(w) for w in res.wants]
    ('(P(sum))', (), ['None', 'None', '(P(sum))'])
    """

    name = "where"
    operands = ("condition", "x", "y")
    aliases = ("Where", "Select", "aten.where", "torch.where")
    violation_codes = LAYOUT_CODES

    def sample_inputs(self):
        return []  # not the elementwise family's generic samples: verify takes this op's op-database records

    def infer_layout(self, inputs, attrs):
        condition, x, y = inputs
        check_bool(self.name, "condition", condition)
        if broadcast_shapes([t.shape for t in inputs]) is None:
            raise _shape_error(self.name, f"shapes {[list(t.shape) for t in inputs]} of condition, x and y "
                               "do not broadcast", "make the shapes equal or 1 in every dim, aligned from the right")
        res = super().infer_layout(inputs, attrs)
        out = res.outputs[0]
        partial = {a: p for a, p in enumerate(out.layout.placements) if isinstance(p, Partial)}
        if not partial:
            return res
        wants = list(res.wants)
        for i in (1, 2):  # a Replicate x or y on a partial axis becomes terms of it, for free (local-partial)
            want = wants[i] or inputs[i].layout
            want = want.with_placements([partial.get(a, p) for a, p in enumerate(want.placements)])
            wants[i] = None if want == inputs[i].layout else want
        return RuleResult(res.outputs, res.violations, tuple(wants))

    def _partial_out(self, ps):
        """``P(sum|avg)`` where x and/or y are that Partial (the other Replicate) and the condition
        is Replicate: where is linear in (x, y) together."""
        condition, *values = ps
        ops = {p.reduce_op for p in values if isinstance(p, Partial)}
        if isinstance(condition, Replicate) and len(ops) == 1 and ops <= set(LINEAR_PARTIALS) \
                and all(isinstance(p, (Replicate, Partial)) for p in values):
            return Partial(ops.pop())
        return None

    def out_dtype(self, inputs, attrs):
        return str(np.result_type(np.dtype(inputs[1].dtype), np.dtype(inputs[2].dtype)))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None, None, None)
        condition, x, y = inputs
        dx = dy_y = None
        if needs[1]:
            dx = sum_to_shape(g, g.op("where", [condition, dy, g.op("zeros_like", [dy])]), g.spec(x).shape)
        if needs[2]:
            dy_y = sum_to_shape(g, g.op("masked_fill", [dy, condition], {"value": 0.0}), g.spec(y).shape)
        return (None, dx, dy_y)


# ===================================================================== masked_scatter
def _box(x: TensorSpec, rank: int) -> dict:
    """The localised attrs of a masked_scatter piece: the rank's [start, stop) per dim and x's global shape."""
    return {"box": [list(b) for b in x.local_slices(rank)], "full_shape": list(x.shape)}


def _check_mask(op: str, mask: TensorSpec, shape: tuple[int, ...], target: str) -> None:
    check_bool(op, "mask", mask)
    if broadcast_shapes([shape, mask.shape]) != shape:
        raise _shape_error(op, f"mask of shape {list(mask.shape)} does not broadcast to {target}'s shape "
                           f"{list(shape)}", f"give mask {target}'s shape, or 1 in dims to broadcast")


@register_op
class MaskedScatter(OpRule):
    """``masked_scatter(x, mask, source)``: x with the true places of ``mask`` (broadcast to x's shape)
    filled, in row-major order, by the leading elements of ``source`` (flattened).

    Which source element lands where depends on how many true places come before, anywhere
    in the mask, so mask and source stay whole on every rank (a rank counts over the whole
    mask and keeps its piece: localised ``box``, ``full_shape``); x keeps any shard, and a
    ``P(sum|avg)`` x or source passes through with the other the same Partial (the op is
    linear in both together).  A source with fewer elements than the mask has true places
    is ``source-too-small`` at run time.  vjp: ``dx = masked_fill(dy, mask, 0)``, ``dsource =
    masked_scatter_src_grad(dy, mask)`` (dy at the true places, in order; 0 for unused source).

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> x = TensorSpec((4, 6), "float32", Layout(mesh, ["S(1)"], 2))
    >>> mask = TensorSpec((4, 6), "bool", Layout(mesh, ["S(1)"], 2))
    >>> source = TensorSpec((30,), "float32", Layout(mesh, ["R"], 1))
    >>> res = MaskedScatter().infer_layout((x, mask, source), {})
    >>> str(res.outputs[0].layout), [(v.code, v.operand) for v in res.violations]
    ('(S(1))', [('sharding-mismatch', 'mask')])
    """

    name = "masked_scatter"
    operands = ("x", "mask", "source")
    aliases = ("aten.masked_scatter", "torch.masked_scatter", "MaskedScatter")
    attr_defaults: dict = {}
    violation_codes = LAYOUT_CODES

    def infer_layout(self, inputs, attrs):
        x, mask, source = inputs
        _check_mask(self.name, mask, x.shape, "x")
        if source.dtype != x.dtype:
            raise OpError("invalid-dtype", f"{self.name}: source has dtype {source.dtype} but x {x.dtype}",
                          hint="cast source to x's dtype")

        def options(axis):
            px, ps = x.layout.placements[axis], source.layout.placements[axis]
            out = []
            if isinstance(px, Shard):
                out.append(AxisChoice((px, R, R), px, f"the fill of x's piece of dim {px.dim}, counting over the "
                                      "whole mask (mask and source whole)"))
            for p in (px, ps):
                if _linear_partial(p):
                    out.append(AxisChoice((p, R, p), p, f"the fill of each {p} term of x and source (mask whole)"))
            return out + [AxisChoice((R, R, R), R, "the whole fill")]

        choices, violations, wants = choose_axes(self.name, self.operands, inputs, options)
        out = TensorSpec(x.shape, x.dtype, Layout(x.mesh, [c.output for c in choices], x.ndim))
        return RuleResult((out,), tuple(violations), wants)

    def localize(self, attrs, inputs, outputs, rank):
        return {**attrs, **_box(inputs[0], rank)}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None, None, None)
        x, mask, source = inputs
        dx = g.op("masked_fill", [dy, mask], {"value": 0.0}) if needs[0] else None
        dsource = g.op("masked_scatter_src_grad", [dy, mask], {"shape": list(g.spec(source).shape)}) \
            if needs[2] else None
        return (dx, None, dsource)


@register_op
class MaskedScatterSrcGrad(OpRule):
    """``masked_scatter_src_grad(dy, mask, shape)``: the gradient of masked_scatter's source, of
    ``shape``: dy at the mask's true places in row-major order, then zeros.

    A rank with a piece of dy fills the source elements of its true places (counting over
    the whole mask) and leaves zeros elsewhere: ``P(sum)``.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> dy = TensorSpec((4, 6), "float32", Layout(mesh, ["S(0)"], 2))
    >>> mask = TensorSpec((6,), "bool", Layout(mesh, ["R"], 1))
    >>> str(MaskedScatterSrcGrad().infer_layout((dy, mask), {"shape": [30]}).outputs[0])
    'float32[30] (P(sum))'
    """

    name = "masked_scatter_src_grad"
    operands = ("dy", "mask")
    attr_defaults = {"shape": None}
    required_attrs = ("shape",)
    violation_codes = LAYOUT_CODES
    differentiable = False

    def infer_layout(self, inputs, attrs):
        dy, mask = inputs
        _check_mask(self.name, mask, dy.shape, "dy")
        shape = attrs.get("shape")
        if not isinstance(shape, (list, tuple)) or any(isinstance(n, bool) or not isinstance(n, int) or n < 0
                                                       for n in shape):
            raise OpError("bad-attr", f"{self.name}: shape must be a list of non-negative integers, got {cut(shape)}",
                          hint="give the source's shape")

        def options(axis):
            p = dy.layout.placements[axis]
            out = []
            if isinstance(p, Shard):
                out.append(AxisChoice((p, R), Partial("sum"), f"the source elements of dy's piece of dim {p.dim} "
                                      "(zeros for the others, a partial sum), with mask whole"))
            if _linear_partial(p):
                out.append(AxisChoice((p, R), p, f"the source elements of each {p} term of dy (mask whole)"))
            return out + [AxisChoice((R, R), R, "the whole gradient")]

        choices, violations, wants = choose_axes(self.name, self.operands, inputs, options)
        out = TensorSpec(tuple(shape), dy.dtype, Layout(dy.mesh, [c.output for c in choices], len(shape)))
        return RuleResult((out,), tuple(violations), wants)

    def localize(self, attrs, inputs, outputs, rank):
        return {**attrs, **_box(inputs[0], rank)}


# ===================================================================== one_hot, isin
@register_op
class OneHot(OpRule):
    """``one_hot(indices, num_classes)``: int64 ``indices.shape + (num_classes,)``, 1 at each index.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("dp",))
    >>> ids = TensorSpec((4, 6), "int64", Layout(mesh, ["S(1)"], 2))
    >>> str(OneHot().infer_layout((ids,), {"num_classes": 8}).outputs[0])
    'int64[4, 6, 8] (S(1))'
    """

    name = "one_hot"
    operands = ("indices",)

    def input_domain(self, index, inputs, attrs):
        """The indices are classes: ``[0, num_classes)``."""
        n = attrs.get("num_classes")
        return InputDomain(0, n) if _is_int(n) and n > 0 else None
    aliases = ("OneHot", "OneHotExt", "aten.one_hot", "torch.one_hot")
    attr_defaults = {"num_classes": None}
    required_attrs = ("num_classes",)
    violation_codes = LAYOUT_CODES
    differentiable = False

    def infer_layout(self, inputs, attrs):
        (indices,) = inputs
        check_integer(self.name, "indices", indices)
        classes = attrs.get("num_classes")
        if isinstance(classes, bool) or not isinstance(classes, int) or classes < 1:
            raise OpError("bad-attr", f"{self.name}: num_classes must be an integer >= 1, got {cut(classes)}",
                          hint="give num_classes, the number of classes (torch's -1, inferred from the data, "
                               "is not supported: a layout cannot depend on the data)")

        def options(axis):
            p = indices.layout.placements[axis]
            out = [AxisChoice((p,), p, f"the one-hot rows of indices' piece of dim {p.dim}")] \
                if isinstance(p, Shard) else []
            return out + [AxisChoice((R,), R, "the whole one-hot")]

        choices, violations, wants = choose_axes(self.name, self.operands, (indices,), options)
        out = TensorSpec(indices.shape + (classes,), "int64",
                         Layout(indices.mesh, [c.output for c in choices], indices.ndim + 1))
        return RuleResult((out,), tuple(violations), wants)


@register_op
class IsIn(OpRule):
    """``isin(elements, test_elements)``: bool, whether each element is among ``test_elements``.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("dp",))
    >>> e = TensorSpec((4, 6), "int64", Layout(mesh, ["S(0)"], 2))
    >>> t = TensorSpec((5,), "int64", Layout(mesh, ["S(0)"], 1))
    >>> res = IsIn().infer_layout((e, t), {})
    >>> str(res.outputs[0]), [v.code for v in res.violations]
    ('bool[4, 6] (S(0))', ['sharding-mismatch'])
    """

    name = "isin"
    operands = ("elements", "test_elements")
    aliases = ("aten.isin", "torch.isin", "IsIn")
    attr_defaults: dict = {}
    violation_codes = LAYOUT_CODES
    differentiable = False

    def infer_layout(self, inputs, attrs):
        elements, test = inputs

        def options(axis):
            p = elements.layout.placements[axis]
            out = [AxisChoice((p, R), p, f"the test of elements' piece of dim {p.dim} against every test "
                              "element")] if isinstance(p, Shard) else []
            return out + [AxisChoice((R, R), R, "the whole test")]

        choices, violations, wants = choose_axes(self.name, self.operands, (elements, test), options)
        out = TensorSpec(elements.shape, "bool", Layout(elements.mesh, [c.output for c in choices], elements.ndim))
        return RuleResult((out,), tuple(violations), wants)
