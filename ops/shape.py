"""The shape ops: reshape, transpose, split/chunk/slice (and pad_slice), concat, unsqueeze, squeeze,
and sharding_constraint (a pinned value).

Every op here moves or selects elements without arithmetic, so a Partial value of any
reduce op passes through (the reduction commutes with moving elements); concat passes a
Partial axis only when every operand is the same Partial there (or Replicate).  Strided
shards (``_S(d,k)``) are made and undone by reshape; the other ops keep them, like
shards, on the dims they do not work along.

The ops and their layout rules
------------------------------
``reshape(x, shape)`` (aliases ``Reshape``, ``view``, ``aten.view``, ``aten.reshape``)
    ``shape`` may hold one ``-1``.  The shape change is factorised into groups: each
    group is a run of input dims whose product equals a run of output dims (size-1 dims
    belong to no group: they appear or vanish freely).  Each mesh axis that cuts a dim
    of a group (in mesh order, each cutting the piece the outer ones left) keeps, in
    the group's row-major flat index list, a chunk of each of some equal blocks; the
    output gets the shard ``S(e)``, or the strided shard ``_S(e,k)`` (DTensor's
    ``_StridedShard``), of the output dim that keeps exactly the same elements on every
    rank.  A shard of the outermost dim of a merge stays a shard; a shard of an inner
    dim becomes strided (x ``S(1)`` of shape (2, 16, 16) viewed as (32, 16) is
    ``_S(0,2)``: each rank holds its rows of both blocks), and a strided shard becomes
    a shard again when the dims are split back.  Uneven pieces must line up exactly:
    B = 3 on 2 ranks merged with S = 4 does not (rows 2 + 1 become 8 + 4 elements,
    where ``torch.chunk`` of 12 gives 6 + 6).  Otherwise: ``reshape-sharded-dim`` (one
    per mesh axis), and the rule wants the input with that mesh axis Replicate (an
    all-gather).  A group of one input and one output dim of equal size keeps any
    sharding, uneven included.
    Localized attr: ``shape`` becomes the rank's local target shape.
    vjp: ``reshape`` back to the input's shape.
``transpose(x, dims)`` / ``transpose(x, dim0, dim1)`` (aliases ``Transpose``,
    ``permute``, ``aten.permute``, ``aten.transpose``)
    Either ``dims``, a permutation (output dim j is input dim ``dims[j]``; negative
    entries allowed; MindSpore's ``perm``, torch's ``permute(dims)``), or ``dim0`` and
    ``dim1``, the two dims to swap (torch's ``transpose(dim0, dim1)``); not both.  Shards
    and strided shards move with their dims.  vjp: the inverse permutation.
``split(x, split_size_or_sections, axis=0)`` and ``chunk(x, chunks, axis=0)`` (aliases ``aten.split``,
    ``torch.split``, ``aten.split_with_sizes``; ``aten.chunk``, ``torch.chunk``)
    torch's ``split`` and ``chunk``, with as many outputs as pieces (worked out when the
    graph is built; one piece is one output, named like the node): ``split`` cuts pieces of
    an int size, the last one smaller, or of each size of a list (synonyms ``split_size``,
    ``split_sizes``, ``sections``); ``chunk`` cuts pieces of ``ceil(n / chunks)``, the last
    one smaller, and so may make fewer than ``chunks`` outputs (6 in 4 chunks: 2, 2, 2).
    Their layout rule is the one of the fixed variants below.
``split2`` ... ``split8`` (``x, axis, sizes``) and ``chunk2`` ... ``chunk8`` (``x, axis``)
    Fixed-arity variants, written before ``split`` and ``chunk`` (deprecated):
    ``splitN`` cuts ``axis`` into the N ``sizes`` (torch ``split`` with a list,
    MindSpore ``SplitV``), or with ``sizes`` left out into N equal sections that must
    divide the dim (MindSpore ``Split(axis, output_num=N)``); ``chunkN`` cuts it into N
    ``torch.chunk`` pieces of ``ceil(n / N)``, the trailing ones smaller or empty (always
    N outputs, as the project's uneven shards).  The split axis must be unsharded
    (``sharded-split-dim``, fixed by an all-gather on that axis), except when it is cut
    only by strided shards ``_S(axis,k)`` of one ``k`` and every piece is made of whole
    blocks: then a piece of one block is ``S(axis)`` and one of ``j`` blocks
    ``_S(axis,j)``, with no communication (a fused q/k/v projection laid out ``_S(-1,3)``
    splits into q, k, v each ``S(-1)``; localized attr: ``sizes`` becomes the rank's
    piece sizes).  Other dims keep their shards.  vjp: ``concat`` of the cotangents, or
    the sum of ``pad_slice`` of those present when some outputs are unused.
``slice(x, axis, start=0, stop=None)`` (alias ``aten.slice``, whose ``end`` is ``stop``)
    One axis, Python slice semantics with step 1 (negative and out-of-range bounds as
    in ``x[start:stop]``); torch ``narrow`` and MindSpore ``Slice``/``StridedSlice`` are
    written as one ``slice`` node per sliced axis.  The sliced axis must be unsharded
    (``sharded-split-dim``) unless the slice keeps the whole axis, or keeps whole blocks
    of a strided shard ``_S(axis,k)`` (Phi-3 slices q, k and v out of its fused
    projection): then the piece is ``S(axis)`` (``_S(axis,j)`` for ``j`` blocks) with no
    communication, as for split.  Localized attrs: ``start``/``stop`` normalised (the
    rank's chunks for whole blocks).  vjp: ``pad_slice``.
``pad_slice(x, axis, start, size)``
    Zero-pads ``x`` along ``axis`` to length ``size``, ``x`` landing at ``start``: the
    gradient of ``slice``.  The padded axis must be unsharded (``sharded-split-dim``)
    unless nothing is padded, or ``x`` is cut by ``S(axis)`` / ``_S(axis,j)`` alike and
    lands at a block boundary of a whole number of its blocks: then the output is
    ``_S(axis,K)`` (the gradient of a slice of whole blocks).  vjp: ``slice``.
``concat(x, x1, ..., axis=0)`` (aliases ``Concat``, ``cat``, ``aten.cat``, ``concatenate``)
    Variadic.  The concat axis must be unsharded in every operand
    (``sharded-concat-dim``), except when every operand is cut along it by the same
    mesh axes, each by ``S(axis)`` or ``_S(axis,j)``, in blocks of one size: the output
    is then ``_S(axis,J)`` (``J`` blocks in all) with no communication, the inverse of a
    split of whole blocks (the gradient of a fused projection); all operands must be
    sharded alike on the other dims (the output takes, per mesh axis, the first Shard
    any operand has there, so a Replicate
    operand is sliced for free; any other difference is ``sharding-mismatch``); a mesh
    axis is Partial in the output when the operands are one Partial or Replicate there
    (a Replicate operand becomes terms by a free ``local-partial``), a Partial operand
    beside a sharded or another Partial one is ``partial-input``.  vjp: ``slice``.
``unsqueeze(x, dim)`` (aliases ``ExpandDims``, ``expand_dims``, ``aten.unsqueeze``)
    Inserts a size-1 dim at ``dim`` (``-x.ndim-1 <= dim <= x.ndim``); shards shift.
    vjp: ``squeeze``.
``squeeze(x, dim=None)`` (aliases ``Squeeze``, ``aten.squeeze``)
    Removes the size-1 dims ``dim`` (an int, a list, or None for every size-1 dim);
    shards shift.  A size-1 dim can only be "sharded" on a size-1 mesh axis, which
    becomes Replicate.  Localized attr: ``dim`` becomes the explicit list of dims (a
    rank's local piece may have size-1 dims the global tensor does not).  vjp:
    ``reshape`` back.
``sharding_constraint(x, placements | tensor_map)`` (alias ``with_sharding_constraint``)
    ``x`` itself, its output pinned to the given layout: what a spec's ``constraints:``
    section inserts after a pinned value (:mod:`layout_prop.io.constraints`).  The input
    is wanted in the pinned layout: a move that costs communication is
    ``constraint-unmet`` (fixable when a redistribution reaches it).  vjp: the cotangent
    passes through.

Attribute names: ``axis`` for split/chunk/slice/pad_slice/concat, ``dim`` for
unsqueeze/squeeze, ``dims`` for transpose.  So that an alias takes its framework's
spelling, each op also accepts synonyms (normalised away before the rule and the kernel
see the attrs; giving both spellings is ``bad-attr``): ``dim`` for ``axis`` (torch),
``axis`` for ``dim`` (MindSpore ``ExpandDims``/``Squeeze``), ``perm``/``axes`` for
``dims``, ``size`` for ``shape`` (``aten.view``), ``end`` for ``stop`` (``aten.slice``),
``size_splits`` for ``sizes`` (MindSpore ``SplitV``).

Violation codes
---------------
- ``reshape-sharded-dim``: no shard or strided shard of the output holds what a mesh
  axis's shards of a reshape group hold (fixable: all-gather on that axis).
- ``sharded-split-dim``: split/chunk/slice/pad_slice along a sharded dim (fixable).
- ``sharded-concat-dim``: concat along a sharded dim (fixable).
- ``sharding-mismatch``: concat operands sharded differently off the concat axis (fixable).
- ``partial-input``: a Partial concat operand beside a sharded or a different Partial one
  (fixable: reduce it).
- ``invalid-reshape``: the target shape is malformed or has another element count.
- ``invalid-dim``: an ``axis``/``dim`` attr out of range or not an integer.
- ``invalid-permutation``: ``dims`` is not a permutation, or the transpose attrs are
  missing or given in both forms.
- ``invalid-split``: split sizes, slice or pad bounds that do not fit the dim.
- ``invalid-squeeze``: squeezing a dim whose size is not 1.
- ``concat-shape``: concat operands of different ranks or different sizes off the axis.
- ``constraint-unmet``: a pinned value's layout differs from the pin and reaching it costs
  communication (fixable: the redistribution; unfixable when none reaches it).

Examples
--------
>>> from layout_prop import DeviceMesh, Layout, TensorSpec
>>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
>>> x = TensorSpec((4, 6, 8), "float32", Layout(mesh, ["S(0)", "S(2)"], 3))
>>> res = get_rule("view").infer_layout((x,), {"shape": [4, 6, 2, 4]})
>>> str(res.outputs[0].layout), res.violations
('(S(0), S(2))', ())
>>> merged = get_rule("reshape").infer_layout((x,), {"shape": [24, 8]})
>>> str(merged.outputs[0].layout)
'(S(0), S(1))'
>>> y = TensorSpec((4, 6, 8), "float32", Layout(mesh, ["S(1)", "R"], 3))
>>> strided = get_rule("reshape").infer_layout((y,), {"shape": [24, 8]})
>>> str(strided.outputs[0].layout), strided.violations
('(_S(0,4), R)', ())
>>> z = TensorSpec((3, 4, 6), "float32", Layout(mesh, ["S(0)", "R"], 3))
>>> bad = get_rule("reshape").infer_layout((z,), {"shape": [12, 6]})
>>> [v.code for v in bad.violations], str(bad.wants[0])
(['reshape-sharded-dim'], '(R, R)')
>>> str(get_rule("permute").infer_layout((x,), {"dims": [2, 0, 1]}).outputs[0].layout)
'(S(1), S(0))'
>>> get_rule("ExpandDims").normalize_attrs({"axis": 1})
{'dim': 1}
"""

from __future__ import annotations

from abc import abstractmethod

import math
from typing import Sequence

import numpy as np

from layout_prop.core.errors import LayoutError, OpError, Violation
from layout_prop.core.layout import Layout
from layout_prop.core.placement import Partial, Replicate, Shard, StridedShard, shard_dim
from layout_prop.core.registry import OpRule, RuleResult, get_rule, register_op
from layout_prop.core.spec import TensorSpec, chunk_bounds

from .common import free_or_violation, plan_summary

__all__ = [
    "Reshape", "Transpose", "SplitRule", "ChunkRule", "Split", "Chunk", "Slice", "PadSlice", "Concat", "Unsqueeze", "Squeeze",
    "ShardingConstraint",
    "SPLIT_VARIANTS", "reshape_groups", "resolve_shape", "shard_blocks", "get_rule",
]

VARIANT_COUNTS = range(2, 9)  # splitN / chunkN for N in 2..8


# ------------------------------------------------------------------------------ shared helpers
def normalize_dim(value, ndim: int) -> int | None:
    """``value`` as a dim in ``0..ndim-1`` (negative counts from the end), or None when invalid.

    >>> normalize_dim(-1, 3), normalize_dim(3, 3), normalize_dim(True, 3)
    (2, None, None)
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return None
    if not -ndim <= value < ndim:
        return None
    return int(value) % ndim


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _sample(shapes, **attrs):
    """An ``OpSample`` for the testing kit (imported late: the kit imports the registry)."""
    from layout_prop.core.registry import OpSample

    return OpSample(shapes, attrs)


def _strided_sample(shapes, **attrs):
    """An ``OpSample`` that also tries strided shards ``_S(d,2)``."""
    from layout_prop.core.registry import OpSample

    return OpSample(shapes, attrs, strided=True)


def _dim_violation(attr: str, value, ndim: int, operand: str = "x") -> Violation:
    allowed = f"{-ndim}..{ndim - 1}" if ndim else "none (x is a scalar)"
    return Violation("invalid-dim", f"{attr}={value!r} is not a dim of {operand}, which has rank {ndim}",
                     f"give {attr} as an integer in {allowed}", operand=operand)


def _axis_name(layout: Layout, axis: int) -> str:
    return f"{layout.mesh.names[axis]!r}"


def _replicate_axes(layout: Layout, axes) -> Layout:
    axes = set(axes)
    return layout.with_placements([Replicate() if a in axes else p for a, p in enumerate(layout.placements)])


def _cutting_axes(layout: Layout, dim: int) -> tuple[int, ...]:
    """Mesh axes of size > 1 that shard ``dim``, strided or not (size-1 axes cut nothing)."""
    return tuple(a for a in layout.cut_axes(dim) if layout.mesh.shape[a] > 1)


def _fits(shape, layout: Layout) -> bool:
    """Whether ``layout`` is a layout of a tensor of ``shape`` (strided pieces divide into blocks)."""
    try:
        TensorSpec(shape, "float32", layout)
    except LayoutError:
        return False
    return True


def _with_dim(p, dim: int):
    """A shard or strided shard ``p`` moved to tensor dim ``dim``."""
    return StridedShard(dim, p.split_factor) if isinstance(p, StridedShard) else Shard(dim)


def shard_blocks(n: int, counts: Sequence[int]) -> list[tuple[int, int]]:
    """The ``[start, stop)`` blocks of a dim of size ``n`` cut by nested ``torch.chunk`` counts.

    Outer count first, in mesh coordinate order (as :meth:`TensorSpec.dim_bounds`).

    >>> shard_blocks(3, [2])
    [(0, 2), (2, 3)]
    >>> shard_blocks(10, [2, 2])
    [(0, 3), (3, 5), (5, 8), (8, 10)]
    """
    blocks = [(0, n)]
    for k in counts:
        blocks = [(lo + a, lo + b) for lo, hi in blocks for a, b in chunk_bounds(hi - lo, k)]
    return blocks


class _ShapeOpRule(OpRule):
    """Base of the shape rules: accepts each attr's other-framework spelling (``attr_synonyms``)."""

    attr_synonyms: dict[str, str] = {}

    def normalize_attrs(self, attrs: dict, node: str | None = None) -> dict:
        renamed = dict(attrs)
        for synonym, canonical in self.attr_synonyms.items():
            if synonym in renamed:
                if canonical in renamed:
                    raise OpError("bad-attr", f"op {self.name!r} got both {canonical!r} and its synonym {synonym!r}",
                                  node=node, hint=f"give {canonical!r} only")
                renamed[canonical] = renamed.pop(synonym)
        return super().normalize_attrs(renamed, node)


# ------------------------------------------------------------------------------ reshape
def resolve_shape(numel: int, shape) -> tuple[tuple[int, ...] | None, str]:
    """The target shape with its ``-1`` resolved, or ``(None, reason)``.

    >>> resolve_shape(24, [4, -1, 2])
    ((4, 3, 2), '')
    >>> resolve_shape(24, [5, -1])
    (None, 'no size for the -1 dim makes 24 elements: the other dims give 5, which does not divide 24')
    """
    if not isinstance(shape, (list, tuple)) or not all(_is_int(s) for s in shape):
        return None, f"shape {shape!r} is not a list of integers"
    shape = [int(s) for s in shape]
    if shape.count(-1) > 1:
        return None, f"shape {shape} has more than one -1"
    if any(s < -1 for s in shape):
        return None, f"shape {shape} has a negative size other than -1"
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if known == 0 or numel % known:
            return None, (f"no size for the -1 dim makes {numel} elements: the other dims give {known}, "
                          f"which does not divide {numel}" if known else
                          "the -1 dim is ambiguous next to a size-0 dim")
        shape[shape.index(-1)] = numel // known
    elif known != numel:
        return None, f"shape {shape} holds {known} elements but x has {numel}"
    return tuple(shape), ""


Group = tuple[tuple[int, ...], tuple[int, ...]]


def reshape_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[Group]:
    """The factorisation of a shape change: ``(input dims, output dims)`` per group.

    Each group is the shortest run of input dims whose product equals a run of output
    dims.  Size-1 dims belong to no group.  A tensor with no elements is one group.

    >>> reshape_groups((4, 6, 8), (4, 6, 2, 4))
    [((0,), (0,)), ((1,), (1,)), ((2,), (2, 3))]
    >>> reshape_groups((2, 1, 6, 4), (12, 1, 2, 2))
    [((0, 2), (0,)), ((3,), (2, 3))]
    >>> reshape_groups((6, 4), (4, 6))
    [((0, 1), (0, 1))]
    """
    in_dims = [d for d, s in enumerate(in_shape) if s != 1]
    out_dims = [d for d, s in enumerate(out_shape) if s != 1]
    if math.prod(in_shape) == 0:
        return [(tuple(in_dims), tuple(out_dims))] if in_dims or out_dims else []
    groups = []
    i = j = 0
    while i < len(in_dims) and j < len(out_dims):
        gi, go = [in_dims[i]], [out_dims[j]]
        pi, po = in_shape[in_dims[i]], out_shape[out_dims[j]]
        i, j = i + 1, j + 1
        while pi != po:
            if pi < po:
                gi.append(in_dims[i])
                pi *= in_shape[in_dims[i]]
                i += 1
            else:
                go.append(out_dims[j])
                po *= out_shape[out_dims[j]]
                j += 1
        groups.append((tuple(gi), tuple(go)))
    return groups


def _blocks_agree(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return all(x == y or (x[0] == x[1] and y[0] == y[1]) for x, y in zip(a, b))


def _group_verb(gi: Sequence[int], go: Sequence[int]) -> str:
    if len(gi) > 1 and len(go) == 1:
        return "merges"
    if len(gi) == 1 and len(go) > 1:
        return "splits"
    return "regroups"


def _describe_group(x: TensorSpec, target: Sequence[int], gi, go) -> str:
    ins = [x.shape[d] for d in gi]
    outs = [target[d] for d in go]
    return f"x dims {list(gi)} (sizes {ins}) into output dims {list(go)} (sizes {outs})"


def _reshape_layout(x: TensorSpec, target: tuple[int, ...]) -> tuple[list, list[Violation], set[int]]:
    """Output placements, violations and the mesh axes that must become Replicate.

    Per group, the mesh axes that cut its input dims are followed in mesh order (the
    order they cut in), on every rank: each cuts one input dim's piece (``S``: a chunk;
    ``_S(d,k)``: a chunk of each of k blocks), which on the group's row-major flat index
    list is "view as (A, L, B), keep chunk c of L".  The output placement of the axis is
    the shard (or strided shard) of an output dim that does exactly that on every rank
    (:func:`_output_cut`); when none does, the axis is gathered.
    """
    lay = x.layout
    mesh = lay.mesh
    groups = reshape_groups(x.shape, target)
    out_ps = [p if shard_dim(p) is None else Replicate() for p in lay.placements]  # size-1 dims: nothing kept
    violations: list[Violation] = []
    gather: set[int] = set()
    for gi, go in groups:
        axes = sorted(a for d in gi for a in lay.cut_axes(d))
        if not axes:
            continue
        coords = list(mesh.all_coords())
        lin = [{d: x.shape[d] for d in gi} for _ in coords]  # per rank, the current length of each input dim
        lout = [{o: target[o] for o in go} for _ in coords]
        for a in axes:
            p = lay.placements[a]
            if mesh.shape[a] == 1:  # cuts nothing: a shard of the group's outer dim stays a shard
                if isinstance(p, Shard) and p.dim == gi[0]:
                    out_ps[a] = Shard(go[0])
                continue
            placement, found = _axis_through_group(p, a, mesh, gi, go, coords, lin, lout)
            if placement is not None:
                out_ps[a] = placement
                o, new_in, new_out = found
                for r in range(len(coords)):
                    lin[r][p.dim], lout[r][o] = new_in[r], new_out[r]
                continue
            gather.add(a)
            violations.append(_reshape_violation(x, target, gi, go, a, found))
    return out_ps, violations, gather


def _axis_through_group(p, axis: int, mesh, gi, go, coords, lin, lout):
    """``(placement, (output dim, new input lengths, new output lengths))``: the output
    placement of mesh ``axis`` (cutting input dim ``p.dim`` of group ``gi``) and each rank's
    lengths after the cut; or, when no output placement does the same cut on every rank,
    ``(None, (input blocks, output blocks))`` of the first rank where it fails, for the message."""
    n = mesh.shape[axis]
    sf_in = p.split_factor if isinstance(p, StridedShard) else 1
    chosen = None
    new_in, new_out = [], []
    for r, c in enumerate(coords):
        if math.prod(lin[r].values()) == 0:  # holds nothing of the group: any cut keeps it empty on both sides
            new_in.append(0)
            new_out.append(0)
            continue
        i = gi.index(p.dim)
        length = lin[r][p.dim]
        outer = math.prod(lin[r][d] for d in gi[:i]) * sf_in
        inner = math.prod(lin[r][d] for d in gi[i + 1:])
        span = length // sf_in
        in_blocks = [(lo * inner, hi * inner) for lo, hi in chunk_bounds(span, n)]
        found = _output_cut(outer, in_blocks, n, go, lout[r])
        if found is None or (chosen is not None and found[:2] != chosen):
            o = go[0]
            rest = math.prod(lout[r][e] for e in go[1:])
            return None, (in_blocks, [(lo * rest, hi * rest) for lo, hi in chunk_bounds(lout[r][o], n)])
        chosen = found[:2]
        lo, hi = chunk_bounds(span, n)[c[axis]]
        new_in.append(sf_in * (hi - lo))
        new_out.append(found[2][c[axis]])
    if chosen is None:  # every rank is empty: the axis cuts nothing that any output shard would not
        return Shard(go[0]), (go[0], new_in, new_out)
    o, sf = chosen
    return (Shard(o) if sf == 1 else StridedShard(o, sf)), (o, new_in, new_out)


def _output_cut(outer: int, in_blocks, n: int, go, lengths: dict) -> tuple | None:
    """``(output dim, split factor, new lengths per coordinate)`` of the output shard that keeps,
    in each of ``outer`` rows of the group's flat list, the blocks ``in_blocks``; or None."""
    row = in_blocks[-1][1] if in_blocks else 0
    for j, o in enumerate(go):
        before = math.prod(lengths[e] for e in go[:j])
        after = math.prod(lengths[e] for e in go[j + 1:])
        if before == 0 or outer % before:
            continue
        sf = outer // before
        if lengths[o] % sf or (lengths[o] // sf) * after != row:
            continue
        span = lengths[o] // sf
        out_blocks = [(lo * after, hi * after) for lo, hi in chunk_bounds(span, n)]
        if _blocks_agree(in_blocks, out_blocks):
            return o, sf, [sf * (hi - lo) for lo, hi in chunk_bounds(span, n)]
    return None


def _reshape_violation(x: TensorSpec, target, gi, go, axis: int, blocks) -> Violation:
    lay = x.layout
    mesh = lay.mesh
    p = lay.placements[axis]
    dim, n = p.dim, mesh.shape[axis]
    in_flat, out_flat = blocks
    return Violation(
        "reshape-sharded-dim",
        f"x dim {dim} (size {x.shape[dim]}) is cut {n} ways by {p} on mesh axis {_axis_name(lay, axis)}, and "
        f"reshape {_group_verb(gi, go)} {_describe_group(x, target, gi, go)}; its shards hold elements "
        f"{_fmt_blocks(in_flat)} of each block of the group but output dim {go[0]} (size {target[go[0]]}) cut "
        f"{n} ways holds {_fmt_blocks(out_flat)}, and no shard or strided shard of the output dims holds what "
        f"each rank holds, so a local reshape is not exact (it is when {n} divides both {x.shape[dim]} and "
        f"{target[go[0]]}); x is {lay}, target shape {list(target)}",
        f"all-gather x dim {dim} on mesh axis {_axis_name(lay, axis)} before the reshape, or choose sizes so "
        f"that the shard count divides both x dim {dim} and the output dim", operand="x")


def _fmt_blocks(blocks: list[tuple[int, int]]) -> str:
    return ", ".join(f"[{a}:{b})" for a, b in blocks)


def _fixable(x: TensorSpec, want: Layout | None, violations: list[Violation],
             fallback: tuple[str, str, str, str] | None = None) -> list[Violation]:
    """The violations, marked fixable when a redistribution reaches ``want``; none when that move is free.

    ``fallback`` (code, operand, message, hint) is reported when the move costs
    communication but no specific violation was found.
    """
    if want is None:
        return []
    code, operand, message, hint = fallback or (violations[0].code if violations else "sharding-mismatch",
                                                violations[0].operand if violations else "x",
                                                f"the kernel needs {want}", f"redistribute to {want}")
    probe = free_or_violation(x, want, operand, code, message, hint)
    if probe is None:
        return []
    if not violations:
        return [probe]
    return [Violation(v.code, v.message, v.hint, v.operand, fixable=probe.fixable, details=probe.details)
            for v in violations]


@register_op
class Reshape(_ShapeOpRule):
    """``reshape(x, shape)``: the same elements in another shape (see the module docstring)."""

    name = "reshape"
    operands = ("x",)
    aliases = ("Reshape", "view", "aten.view", "aten.reshape")
    attr_defaults = {"shape": None}
    attr_synonyms = {"size": "shape"}
    violation_codes = ("reshape-sharded-dim", "invalid-reshape")
    strided = True  # makes and takes strided shards (_S(d,k)): see _reshape_layout

    def sample_inputs(self):
        return [
            _sample([(4, 6, 8)], shape=[4, 6, 2, 4]),  # split the hidden dim into heads
            _sample([(4, 6, 8)], shape=[24, 8]),  # merge B and S (even)
            _sample([(3, 4, 6)], shape=[12, 6]),  # merge B = 3 (uneven on 2 ranks) with S
            _sample([(6, 4)], shape=[4, 6]),  # a group of two dims on each side
            _sample([(2, 1, 6, 4)], shape=[12, 1, -1, 2]),  # size-1 dims and a -1
            _sample([(5, 1, 3)], shape=[5, 3]),  # odd sizes, a size-1 dim vanishes
        ]

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        target, problem = resolve_shape(math.prod(x.shape), attrs["shape"])
        if target is None:
            v = Violation("invalid-reshape", f"cannot reshape x of shape {list(x.shape)}: {problem}",
                          f"give a shape with {math.prod(x.shape)} elements and at most one -1", operand="x")
            return RuleResult((None,), (v,), ())
        out_ps, violations, gather = _reshape_layout(x, target)
        want = _replicate_axes(x.layout, gather) if gather else None
        out = TensorSpec(target, x.dtype, Layout(x.mesh, out_ps, len(target)))
        return RuleResult((out,), tuple(_fixable(x, want, violations)), (want,))

    def localize(self, attrs, inputs, outputs, rank):
        return {"shape": list(outputs[0].local_shape(rank))}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None:
            return (None,)
        return (g.op("reshape", [cotangents[0]], {"shape": list(g.spec(inputs[0]).shape)}),)


# ------------------------------------------------------------------------------ transpose
def _permutation(attrs: dict, ndim: int) -> tuple[tuple[int, ...] | None, str]:
    dims, dim0, dim1 = attrs.get("dims"), attrs.get("dim0"), attrs.get("dim1")
    swap = dim0 is not None or dim1 is not None
    if dims is not None and swap:
        return None, "give either dims (a permutation) or dim0 and dim1 (a swap), not both"
    if dims is None and not swap:
        return None, "transpose needs dims (a permutation) or dim0 and dim1 (the two dims to swap)"
    if swap:
        a, b = normalize_dim(dim0, ndim), normalize_dim(dim1, ndim)
        if a is None or b is None:
            return None, f"dim0={dim0!r} and dim1={dim1!r} must both be dims of x, which has rank {ndim}"
        perm = list(range(ndim))
        perm[a], perm[b] = b, a
        return tuple(perm), ""
    if not isinstance(dims, (list, tuple)) or len(dims) != ndim:
        return None, f"dims={dims!r} must list {ndim} dims, one per dim of x"
    norm = [normalize_dim(d, ndim) for d in dims]
    if None in norm or sorted(norm) != list(range(ndim)):
        return None, f"dims={list(dims)} is not a permutation of 0..{ndim - 1}"
    return tuple(norm), ""


@register_op
class Transpose(_ShapeOpRule):
    """``transpose(x, dims)`` or ``transpose(x, dim0, dim1)``: output dim j is input dim ``dims[j]``."""

    name = "transpose"
    operands = ("x",)
    aliases = ("Transpose", "permute", "aten.permute", "aten.transpose")
    attr_defaults = {"dims": None, "dim0": None, "dim1": None}
    attr_synonyms = {"perm": "dims", "axes": "dims"}
    violation_codes = ("invalid-permutation",)
    strided = True  # a strided shard moves with its dim, like a shard

    def sample_inputs(self):
        return [
            _sample([(4, 3, 6)], dims=[2, 0, 1]),
            _sample([(2, 1, 5, 4)], dims=[0, 2, 1, 3]),  # BSND -> BNSD with a size-1 dim
            _sample([(3, 5)], dim0=0, dim1=1),
            _sample([(4, 1, 6)], dim0=-1, dim1=0),
        ]

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        perm, problem = _permutation(attrs, x.ndim)
        if perm is None:
            v = Violation("invalid-permutation", f"cannot transpose x of shape {list(x.shape)}: {problem}",
                          f"e.g. dims: {list(reversed(range(x.ndim)))}, or dim0: 0, dim1: 1", operand="x")
            return RuleResult((None,), (v,), ())
        where = {d: j for j, d in enumerate(perm)}
        ps = [Shard(where[p.dim]) if isinstance(p, Shard) else
              StridedShard(where[p.dim], p.split_factor) if isinstance(p, StridedShard) else p
              for p in x.layout.placements]
        shape = tuple(x.shape[d] for d in perm)
        return RuleResult((TensorSpec(shape, x.dtype, Layout(x.mesh, ps, x.ndim)),))

    def localize(self, attrs, inputs, outputs, rank):
        perm, _ = _permutation(attrs, inputs[0].ndim)
        return {"dims": list(perm), "dim0": None, "dim1": None}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None:
            return (None,)
        perm, _ = _permutation(attrs, g.spec(inputs[0]).ndim)
        inverse = [perm.index(j) for j in range(len(perm))]
        return (g.op("transpose", [cotangents[0]], {"dims": inverse}),)


# ------------------------------------------------------------------------------ split, chunk, slice
def _unsharded_axis(x: TensorSpec, axis: int, op: str, pieces: str,
                    operand: str = "x") -> tuple[Layout | None, list[Violation]]:
    """The want (``axis`` Replicate) and the violations when ``axis`` of ``x`` is sharded (or strided)."""
    lay = x.layout
    axes = lay.cut_axes(axis)
    if not axes:
        return None, []
    want = _replicate_axes(lay, axes)
    violations = []
    for a in _cutting_axes(lay, axis):
        violations.append(Violation(
            "sharded-split-dim",
            f"{operand} dim {axis} (size {x.shape[axis]}) is sharded {lay.mesh.shape[a]} ways on mesh axis "
            f"{_axis_name(lay, a)}, but {op} {pieces} along dim {axis}; {operand} is {lay}",
            f"all-gather {operand} dim {axis} on {_axis_name(lay, a)} before the {op}, or shard another dim on "
            f"{_axis_name(lay, a)}", operand=operand))
    return want, _fixable(x, want, violations)


def _strided_blocks(x: TensorSpec, axis: int) -> int | None:
    """The block count ``k`` when every mesh axis of size > 1 cutting ``axis`` is ``_S(axis,k)`` (one ``k``).

    Each rank then holds the same chunk of each of ``k`` equal blocks of the dim (nested
    chunks with several such mesh axes), so a piece made of whole blocks is held on every
    rank as that chunk of each of its blocks.  None for any other layout of the dim.
    """
    placements = [x.layout.placements[a] for a in _cutting_axes(x.layout, axis)]
    if not placements or not all(isinstance(p, StridedShard) for p in placements):
        return None
    factors = {p.split_factor for p in placements}
    return factors.pop() if len(factors) == 1 else None


def _block_pieces(x: TensorSpec, axis: int, bounds) -> list[int] | None:
    """How many whole blocks of the strided ``axis`` each piece ``[lo, hi)`` holds, or None.

    None unless the dim is cut by strided shards only (:func:`_strided_blocks`) and every
    piece starts and ends on a block boundary: then piece i is on every rank the rank's
    chunk of each of its blocks, in order.

    >>> from layout_prop import DeviceMesh
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> x = TensorSpec((4, 12), "float32", Layout(mesh, ["_S(1,3)"], 2))
    >>> _block_pieces(x, 1, [(0, 4), (4, 8), (8, 12)]), _block_pieces(x, 1, [(0, 6), (6, 12)])
    ([1, 1, 1], None)
    """
    k = _strided_blocks(x, axis)
    if k is None:
        return None
    m = x.shape[axis] // k
    if m == 0 or any(lo % m or hi % m for lo, hi in bounds):
        return None
    return [(hi - lo) // m for lo, hi in bounds]


def _piece_layout(layout: Layout, axis: int, blocks: int) -> Layout:
    """The layout of a piece of ``blocks`` whole blocks of the strided ``axis``: ``S(axis)`` for one
    block (or none), ``_S(axis,blocks)`` for several, on each mesh axis cutting it."""
    ps = []
    for a, p in enumerate(layout.placements):
        if shard_dim(p) == axis:
            p = StridedShard(axis, blocks) if blocks >= 2 and layout.mesh.shape[a] > 1 else Shard(axis)
        ps.append(p)
    return layout.with_placements(ps)


def _padded_blocks(x: TensorSpec, axis: int, start: int, size: int) -> tuple[int, int] | None:
    """``(m, total)`` when ``x``, cut along ``axis`` by ``S(axis)`` or ``_S(axis,j)`` alike on every
    cutting mesh axis (blocks of ``m``), lands at a block boundary ``start`` of a dim of ``size``, a
    whole number ``total`` of blocks: the padded value is then ``_S(axis,total)`` (``S`` for one)."""
    placements = {x.layout.placements[a] for a in _cutting_axes(x.layout, axis)}
    if len(placements) != 1:
        return None
    p = placements.pop()
    j = p.split_factor if isinstance(p, StridedShard) else 1
    m = x.shape[axis] // j
    if m == 0 or start % m or size % m:
        return None
    return m, size // m


class _PiecesRule(_ShapeOpRule):
    """Shared rule of ``splitN`` and ``chunkN``: N outputs, cut along one unsharded axis, or along a
    strided one (``_S(axis,k)``) when every piece is made of whole blocks (a fused q/k/v projection)."""

    operands = ("x",)
    attr_synonyms = {"dim": "axis"}
    violation_codes = ("sharded-split-dim", "invalid-dim", "invalid-split")
    strided = True  # the other dims keep any shard, strided ones too

    @abstractmethod
    def bounds(self, n: int, attrs: dict) -> tuple[list[tuple[int, int]] | None, str]:
        """The [start, stop) of each piece along the axis of size ``n`` (None and a reason if invalid)."""

    def _analyse(self, x: TensorSpec, attrs: dict):
        axis = normalize_dim(attrs.get("axis"), x.ndim)
        if axis is None:
            return None, None, [_dim_violation("axis", attrs.get("axis"), x.ndim)]
        bounds, problem = self.bounds(x.shape[axis], attrs)
        if bounds is None:
            return axis, None, [Violation("invalid-split", f"cannot cut x dim {axis} (size {x.shape[axis]}) "
                                          f"{self.pieces_text()}: {problem}",
                                          self.split_hint(x.shape[axis]), operand="x")]
        return axis, bounds, []

    def pieces_text(self) -> str:
        return f"into {self.num_outputs} pieces"

    def output_count(self, attrs, shapes):
        """The number of pieces (``num_outputs`` for the fixed variants ``splitN``, ``chunkN``)."""
        if not self.variadic_outputs:
            return self.num_outputs
        x = _ShapeOnly(tuple(shapes[0]))
        _axis, bounds, problems = self._analyse(x, attrs)
        if problems:
            v = problems[0]
            raise OpError(v.code, f"{self.name}: {v.message}", hint=v.hint)
        return len(bounds)

    def split_hint(self, n: int) -> str:
        return f"give {self.num_outputs} non-negative sizes summing to {n}"

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        axis, bounds, problems = self._analyse(x, attrs)
        if problems:
            if self.variadic_outputs:  # no count to give None outputs for: the node's builder refused it already
                raise OpError(problems[0].code, f"{self.name}: {problems[0].message}", hint=problems[0].hint)
            return RuleResult((None,) * self.num_outputs, tuple(problems), ())
        sizes = [b - a for a, b in bounds]
        shapes = [x.shape[:axis] + (s,) + x.shape[axis + 1:] for s in sizes]
        blocks = _block_pieces(x, axis, bounds)
        if blocks is not None:  # whole blocks of a strided shard: each piece stays sharded, no communication
            outs = tuple(TensorSpec(shape, x.dtype, _piece_layout(x.layout, axis, j)) for shape, j in
                         zip(shapes, blocks))
            return RuleResult(outs, (), (None,))
        want, violations = _unsharded_axis(x, axis, self.name, f"cuts it into pieces of sizes {sizes}")
        layout = want or x.layout
        outs = tuple(TensorSpec(shape, x.dtype, layout) for shape in shapes)
        return RuleResult(outs, tuple(violations), (want,))

    def localize(self, attrs, inputs, outputs, rank):
        """A strided axis cut into whole blocks: the rank's local piece sizes (its chunk of each block)."""
        x = inputs[0]
        axis, bounds, _ = self._analyse(x, attrs)
        blocks = _block_pieces(x, axis, bounds) if bounds is not None else None
        if blocks is None:
            return dict(attrs)
        chunk = x.local_shape(rank)[axis] // _strided_blocks(x, axis)  # the rank's chunk of one block
        return self.local_attrs(attrs, axis, [j * chunk for j in blocks])

    def local_attrs(self, attrs: dict, axis: int, sizes: list[int]) -> dict:
        """The attrs cutting a rank's local piece into ``sizes`` along ``axis``."""
        return dict(attrs, axis=axis, sizes=sizes)

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        x = g.spec(inputs[0])
        axis = normalize_dim(attrs.get("axis"), x.ndim)
        present = [c for c in cotangents if c is not None]
        if not present:
            return (None,)
        if len(present) == len(cotangents):
            return (g.op("concat", list(cotangents), {"axis": axis}),)
        bounds, _ = self.bounds(x.shape[axis], attrs)
        total = None
        for dy, (lo, _hi) in zip(cotangents, bounds):
            if dy is None:
                continue
            padded = g.op("pad_slice", [dy], {"axis": axis, "start": lo, "size": x.shape[axis]})
            total = padded if total is None else g.op("add", [total, padded])
        return (total,)


class SplitRule(_PiecesRule):
    """``splitN(x, axis=0, sizes=None)``: N pieces of the given sizes, or N equal sections."""

    attr_defaults = {"axis": 0, "sizes": None}
    attr_synonyms = {"dim": "axis", "size_splits": "sizes"}

    def sample_inputs(self):
        n = self.num_outputs
        return [
            _sample([(2 * n, 3)], axis=0),  # equal sections
            _sample([(3, n + 2)], axis=1, sizes=[1] * (n - 1) + [3]),  # uneven sizes
            _sample([(3, 1, 2 * n)], axis=-1, sizes=[0] + [2] * (n - 2) + [4]),  # an empty piece, a size-1 dim
        ]

    def bounds(self, n, attrs):
        sizes = attrs.get("sizes")
        k = self.num_outputs
        if sizes is None:
            if n % k:
                return None, f"{n} is not divisible by {k} for equal sections"
            sizes = [n // k] * k
        if not isinstance(sizes, (list, tuple)) or not all(_is_int(s) for s in sizes):
            return None, f"sizes={sizes!r} is not a list of integers"
        if len(sizes) != k or any(s < 0 for s in sizes) or sum(sizes) != n:
            return None, f"sizes={list(sizes)} must be {k} non-negative sizes summing to {n}"
        starts = np.cumsum([0, *sizes]).tolist()
        return [(int(starts[i]), int(starts[i + 1])) for i in range(k)], ""

    def split_hint(self, n):
        return (f"give sizes: {self.num_outputs} non-negative sizes summing to {n}, or use "
                f"chunk{self.num_outputs} for torch.chunk pieces")


class ChunkRule(_PiecesRule):
    """``chunkN(x, axis=0)``: N ``torch.chunk`` pieces of ``ceil(n / N)``, trailing ones smaller or empty."""

    attr_defaults = {"axis": 0}
    violation_codes = ("sharded-split-dim", "invalid-dim")

    def sample_inputs(self):
        n = self.num_outputs
        return [
            _sample([(n + 1, 2)], axis=0),  # uneven pieces, maybe empty ones
            _sample([(2, 1, 2 * n - 1)], axis=2),
            _sample([(5, 3)], axis=1),
        ]

    def bounds(self, n, attrs):
        return list(chunk_bounds(n, self.num_outputs)), ""

    def local_attrs(self, attrs: dict, axis: int, sizes: list[int]) -> dict:
        """``torch.chunk`` of the local piece cuts it into ``sizes`` already: if the global chunks are
        ``j`` blocks of ``m``, the local ones are ``ceil(k * c / N) = j * c`` for a chunk ``c <= m``."""
        local_bounds, _ = self.bounds(sum(sizes), attrs)
        local = None if local_bounds is None else [hi - lo for lo, hi in local_bounds]
        if local != sizes:  # not reached (see above): a wrong answer must not pass silently
            raise OpError("internal-error", f"{self.name} of a strided piece: chunks {local}, expected {sizes}",
                          hint="a bug of layout-prop: please report it with the spec")
        return dict(attrs, axis=axis)


SPLIT_VARIANTS: dict[str, type[OpRule]] = {}
for _n in VARIANT_COUNTS:
    for _base, _stem, _doc in ((SplitRule, "split", "sizes"), (ChunkRule, "chunk", "torch.chunk pieces")):
        _cls = type(f"{_stem.capitalize()}{_n}", (_base,), {
            "__doc__": f"``{_stem}{_n}(x, ...)``: {_n} outputs ({_doc}); see :class:`{_base.__name__}`.",
            "name": f"{_stem}{_n}", "num_outputs": _n, "__module__": __name__,
        })
        SPLIT_VARIANTS[_cls.name] = register_op(_cls)
del _n, _base, _stem, _doc, _cls


class _ShapeOnly:
    """What :meth:`_PiecesRule._analyse` reads of x when only its shape is known (the output count)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.ndim = len(shape)


def _sized_pieces(n: int, size: int) -> list[tuple[int, int]]:
    """``torch.split(x, size)`` along a dim of ``n``: pieces of ``size``, the last one smaller; one empty piece
    when ``n`` is 0."""
    if n == 0:
        return [(0, 0)]
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


@register_op
class Split(SplitRule):
    """``split(x, split_size_or_sections, axis=0)``: ``torch.split``, with as many outputs as pieces.

    An int cuts pieces of that size, the last one smaller (``ceil(n / size)`` outputs); a list
    gives each piece's size (as many outputs as sizes, summing to the dim).  The output count
    is worked out when the graph is built.
    """

    name = "split"
    aliases = ("aten.split", "torch.split", "aten.split_with_sizes")
    variadic_outputs = True
    attr_defaults = {"split_size_or_sections": None, "axis": 0}
    attr_synonyms = {"dim": "axis", "split_size": "split_size_or_sections", "split_sizes": "split_size_or_sections",
                     "sections": "split_size_or_sections"}
    attr_types = {"split_size_or_sections": "int | list[int]"}
    required_attrs = ("split_size_or_sections",)

    def sample_inputs(self):
        return [
            _sample([(5, 3)], split_size_or_sections=2, axis=0),  # 2, 2, 1: three outputs
            _sample([(3, 6)], split_size_or_sections=[1, 0, 3, 2], axis=1),  # four, an empty one
            _sample([(2, 1, 4)], split_size_or_sections=4, axis=-1),  # one output
            _sample([(2, 7)], split_size_or_sections=1, axis=1),  # seven outputs
            _strided_sample([(8, 3)], split_size_or_sections=[4, 4], axis=0),  # whole blocks of _S(0,2): no move
        ]

    def pieces_text(self):
        return "into pieces"

    def bounds(self, n, attrs):
        spec = attrs.get("split_size_or_sections")
        if _is_int(spec):
            if spec <= 0 and n > 0:
                return None, f"split_size_or_sections={spec} must be positive"
            return _sized_pieces(n, int(spec)), ""
        if isinstance(spec, (list, tuple)) and spec and all(_is_int(s) and s >= 0 for s in spec) and sum(spec) == n:
            starts = np.cumsum([0, *spec]).tolist()
            return [(int(starts[i]), int(starts[i + 1])) for i in range(len(spec))], ""
        return None, f"split_size_or_sections={spec!r} must be a positive size or non-negative sizes summing to {n}"

    def split_hint(self, n):
        return f"give split_size_or_sections as a positive piece size, or a list of sizes summing to {n}"

    def local_attrs(self, attrs, axis, sizes):
        return dict(attrs, axis=axis, split_size_or_sections=list(sizes))


@register_op
class Chunk(ChunkRule):
    """``chunk(x, chunks, axis=0)``: ``torch.chunk``, pieces of ``ceil(n / chunks)``, the last one smaller.

    As torch, it may make fewer than ``chunks`` outputs (6 in 4 chunks: 2, 2, 2) and never an
    empty one (one empty piece when the dim is empty).  The output count is worked out when
    the graph is built.
    """

    name = "chunk"
    aliases = ("aten.chunk", "torch.chunk")
    variadic_outputs = True
    attr_defaults = {"chunks": None, "axis": 0}
    attr_types = {"chunks": "int"}
    required_attrs = ("chunks",)
    violation_codes = ("sharded-split-dim", "invalid-dim", "invalid-split")

    def sample_inputs(self):
        return [
            _sample([(6, 2)], chunks=4, axis=0),  # 2, 2, 2: three outputs, fewer than asked
            _sample([(2, 1, 5)], chunks=2, axis=2),  # 3, 2
            _sample([(5, 3)], chunks=5, axis=0),  # five outputs of one row
            _sample([(3, 4)], chunks=1, axis=1),  # one output
            _strided_sample([(3, 8)], chunks=2, axis=1),  # whole blocks of _S(1,2): no move
        ]

    def pieces_text(self):
        return "into chunks"

    def bounds(self, n, attrs):
        chunks = attrs.get("chunks")
        if not _is_int(chunks) or chunks <= 0:
            return None, f"chunks={chunks!r} must be a positive integer"
        return _sized_pieces(n, -(-n // chunks)), ""

    def split_hint(self, n):
        return "give chunks as a positive integer"

    def local_attrs(self, attrs, axis, sizes):
        """A strided axis cut into whole blocks: the rank's piece sizes, given to the kernel as ``sizes`` (torch's
        chunk of a rank's empty piece would make one output, not the node's count)."""
        return dict(attrs, axis=axis, sizes=list(sizes))


def _slice_range(n: int, start, stop) -> tuple[int, int] | None:
    if (start is not None and not _is_int(start)) or (stop is not None and not _is_int(stop)):
        return None
    lo, hi, _ = slice(start, stop).indices(n)
    return lo, max(lo, hi)


@register_op
class Slice(_ShapeOpRule):
    """``slice(x, axis, start=0, stop=None)``: ``x[..., start:stop, ...]`` along one axis."""

    name = "slice"
    operands = ("x",)
    aliases = ("aten.slice",)
    attr_defaults = {"axis": 0, "start": 0, "stop": None}
    attr_synonyms = {"dim": "axis", "end": "stop"}
    violation_codes = ("sharded-split-dim", "invalid-dim", "invalid-split")
    strided = True  # strided shards of the untouched dims stay (the op's own dim: gathered)

    def sample_inputs(self):
        return [
            _sample([(4, 6)], axis=1, start=1, stop=5),
            _sample([(5, 3)], axis=0, start=-2),
            _sample([(4, 1, 6)], axis=2),  # the whole axis: shards pass
            _sample([(3, 4, 2)], axis=0, start=2, stop=1),  # empty
        ]

    def _analyse(self, x: TensorSpec, attrs: dict):
        axis = normalize_dim(attrs.get("axis"), x.ndim)
        if axis is None:
            return None, None, _dim_violation("axis", attrs.get("axis"), x.ndim)
        bounds = _slice_range(x.shape[axis], attrs.get("start"), attrs.get("stop"))
        if bounds is None:
            return axis, None, Violation("invalid-split", f"cannot slice x dim {axis} (size {x.shape[axis]}): "
                                         f"start={attrs.get('start')!r} and stop={attrs.get('stop')!r} must be "
                                         "integers (or null)", "give integer bounds, as in x[start:stop]",
                                         operand="x")
        return axis, bounds, None

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        axis, bounds, problem = self._analyse(x, attrs)
        if problem is not None:
            return RuleResult((None,), (problem,), ())
        lo, hi = bounds
        want, violations = None, []
        shape = x.shape[:axis] + (hi - lo,) + x.shape[axis + 1:]
        blocks = _block_pieces(x, axis, [(lo, hi)]) if hi - lo != x.shape[axis] else None
        if blocks is not None:  # whole blocks of a strided shard (Phi-3's q, k, v sliced from qkv): no communication
            return RuleResult((TensorSpec(shape, x.dtype, _piece_layout(x.layout, axis, blocks[0])),), (), (None,))
        if hi - lo != x.shape[axis]:
            want, violations = _unsharded_axis(x, axis, "slice", f"keeps only [{lo}:{hi}) of it")
        return RuleResult((TensorSpec(shape, x.dtype, want or x.layout),), tuple(violations), (want,))

    def localize(self, attrs, inputs, outputs, rank):
        x = inputs[0]
        axis, (lo, hi), _ = self._analyse(x, attrs)
        if hi - lo == x.shape[axis]:  # the whole axis: keep the whole local piece, sharded or not
            return {"axis": axis, "start": 0, "stop": None}
        if _block_pieces(x, axis, [(lo, hi)]) is not None:  # the rank's chunk of each block from lo to hi
            k = _strided_blocks(x, axis)
            m, chunk = x.shape[axis] // k, x.local_shape(rank)[axis] // k
            return {"axis": axis, "start": lo // m * chunk, "stop": hi // m * chunk}
        return {"axis": axis, "start": lo, "stop": hi}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None:
            return (None,)
        x = g.spec(inputs[0])
        axis, (lo, _hi), _ = self._analyse(x, attrs)
        return (g.op("pad_slice", [cotangents[0]], {"axis": axis, "start": lo, "size": x.shape[axis]}),)


@register_op
class PadSlice(_ShapeOpRule):
    """``pad_slice(x, axis, start, size)``: zeros of length ``size`` along ``axis`` with x at ``start``."""

    name = "pad_slice"
    operands = ("x",)
    attr_defaults = {"axis": 0, "start": 0, "size": None}
    attr_synonyms = {"dim": "axis"}
    violation_codes = ("sharded-split-dim", "invalid-dim", "invalid-split")
    strided = True  # strided shards of the untouched dims stay (the op's own dim: gathered)

    def sample_inputs(self):
        return [
            _sample([(4, 3)], axis=1, start=1, size=6),
            _sample([(5, 2)], axis=0, start=0, size=5),  # nothing padded: shards pass
            _sample([(3, 1, 2)], axis=0, start=2, size=7),
        ]

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        axis = normalize_dim(attrs.get("axis"), x.ndim)
        if axis is None:
            return RuleResult((None,), (_dim_violation("axis", attrs.get("axis"), x.ndim),), ())
        start, size, n = attrs.get("start"), attrs.get("size"), x.shape[axis]
        if not (_is_int(start) and _is_int(size)) or start < 0 or start + n > size:
            v = Violation("invalid-split", f"cannot place x dim {axis} (size {n}) at start={start!r} in a dim of "
                          f"size={size!r}", f"give integers with 0 <= start and start + {n} <= size", operand="x")
            return RuleResult((None,), (v,), ())
        want, violations = None, []
        shape = x.shape[:axis] + (size,) + x.shape[axis + 1:]
        placed = _padded_blocks(x, axis, start, size) if size != n else None
        if placed is not None:  # whole blocks placed among zero blocks: the gradient of a slice of whole blocks
            return RuleResult((TensorSpec(shape, x.dtype, _piece_layout(x.layout, axis, placed[1])),), (), (None,))
        if size != n:
            want, violations = _unsharded_axis(x, axis, "pad_slice", f"pads it to [{start}:{start + n}) of {size}")
        return RuleResult((TensorSpec(shape, x.dtype, want or x.layout),), tuple(violations), (want,))

    def localize(self, attrs, inputs, outputs, rank):
        # unsharded axis: the global size; nothing padded: the rank's piece of a sharded axis; whole blocks: the
        # rank's chunk of each, x's at its block's place
        x = inputs[0]
        axis = normalize_dim(attrs["axis"], x.ndim)
        size = outputs[0].local_shape(rank)[axis]
        placed = _padded_blocks(x, axis, attrs["start"], attrs["size"]) if attrs["size"] != x.shape[axis] else None
        if placed is not None:
            m, total = placed
            return {"axis": axis, "start": attrs["start"] // m * (size // total), "size": size}
        return {"axis": axis, "start": attrs["start"], "size": size}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None:
            return (None,)
        x = g.spec(inputs[0])
        axis = normalize_dim(attrs["axis"], x.ndim)
        start = attrs["start"]
        return (g.op("slice", [cotangents[0]], {"axis": axis, "start": start, "stop": start + x.shape[axis]}),)


# ------------------------------------------------------------------------------ concat
def _concat_target(inputs: Sequence[TensorSpec], axis: int) -> Layout:
    """Per mesh axis: the common Partial (the other operands Replicate there), else the first
    operand Shard off ``axis``, else Replicate.

    A Replicate operand next to a Partial one becomes terms of that Partial by a free
    ``local-partial`` step: a concat of terms is the terms of the concat, whatever the op.
    """
    mesh = inputs[0].mesh
    ps = []
    for a in range(mesh.ndim):
        here = [t.layout.placements[a] for t in inputs]
        partials = {p for p in here if isinstance(p, Partial)}
        if len(partials) == 1 and all(isinstance(p, (Partial, Replicate)) for p in here):
            ps.append(partials.pop())
            continue
        shard = next((p for p in here if shard_dim(p) is not None and p.dim != axis), None)
        ps.append(shard if shard is not None else Replicate())
    return Layout(mesh, ps, inputs[0].ndim)


def _strided_concat(inputs: Sequence[TensorSpec], axis: int) -> tuple[dict[int, StridedShard], list] | None:
    """The strided placements of a concat of whole blocks along a sharded ``axis``, or None.

    When the operands cut along ``axis`` are all cut by the same mesh axes (of size > 1),
    each by ``S(axis)`` (one block) or by ``_S(axis,j)`` (``j`` blocks), with blocks of
    one size, and the other operands are Replicate on those mesh axes and a whole number
    of such blocks long (a free local slice cuts them alike), each rank holds its chunk
    of every block: the concat is ``_S(axis,J)`` (``J`` the total block count) on those
    mesh axes with no communication (the gradient of a fused q/k/v split, split's
    inverse).  Returns the output's placements on those mesh axes and, per operand, the
    placement it is taken in there.

    >>> from layout_prop import DeviceMesh
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> q = TensorSpec((4, 4), "float32", Layout(mesh, ["S(1)"], 2))
    >>> kv = TensorSpec((4, 8), "float32", Layout(mesh, ["_S(1,2)"], 2))
    >>> _strided_concat([q, kv], 1)
    ({0: StridedShard(dim=1, split_factor=3)}, [Shard(dim=1), StridedShard(dim=1, split_factor=2)])
    >>> _strided_concat([q, kv.with_placements(["R"])], 1)[1]  # a replicated operand is sliced for free
    [Shard(dim=1), StridedShard(dim=1, split_factor=2)]
    >>> _strided_concat([q.with_placements(["R"]), q.with_placements(["R"])], 1) is None
    True
    """
    cut = [_cutting_axes(t.layout, axis) for t in inputs]
    cutting = {c for c in cut if c}
    if len(cutting) != 1:
        return None
    axes = cutting.pop()
    blocks: list[int | None] = []
    sizes = set()
    for t, c in zip(inputs, cut):
        if not c:
            blocks.append(None)
            continue
        kinds = {t.layout.placements[a] for a in axes}
        if len(kinds) != 1:
            return None
        p = kinds.pop()
        j = p.split_factor if isinstance(p, StridedShard) else 1
        blocks.append(j)
        sizes.add(t.shape[axis] // j)
    if len(sizes) != 1 or 0 in sizes:
        return None
    m = sizes.pop()
    for i, (t, j) in enumerate(zip(inputs, blocks)):
        if j is None:  # a whole operand: sliced into its blocks for free, if it is Replicate there and fits them
            if t.shape[axis] % m or not all(isinstance(t.layout.placements[a], Replicate) for a in axes):
                return None
            blocks[i] = t.shape[axis] // m
    total = sum(blocks)
    if total < 2:
        return None
    taken = [StridedShard(axis, j) if j >= 2 else Shard(axis) for j in blocks]
    return {a: StridedShard(axis, total) for a in axes}, taken


def _concat_axis_violations(rule: OpRule, inputs, axis: int, target: Layout,
                            aligned: Sequence[int] = ()) -> list[list[Violation]]:
    """Per operand, one violation per mesh axis whose placement must change at a cost (the
    ``aligned`` mesh axes, cut into whole blocks, change nothing)."""
    mesh = target.mesh
    out = []
    for i, t in enumerate(inputs):
        name = rule.operand_name(i)
        found = []
        for a, (p, q) in enumerate(zip(t.layout.placements, target.placements)):
            if p == q or mesh.shape[a] == 1 or (isinstance(p, Replicate) and not isinstance(q, Replicate)):
                continue  # the same, a size-1 mesh axis, or a free local slice or local partial
            if a in aligned:
                continue  # whole blocks of a strided output: each operand stays as it is
            axis_text = _axis_name(t.layout, a)
            if shard_dim(p) == axis:
                found.append(Violation(
                    "sharded-concat-dim",
                    f"{name} dim {axis} (size {t.shape[axis]}) is sharded {mesh.shape[a]} ways on mesh axis "
                    f"{axis_text}, but concat joins the operands along dim {axis} (sizes "
                    f"{[s.shape[axis] for s in inputs]}); {name} is {t.layout}",
                    f"all-gather {name} dim {axis} on {axis_text} before the concat, or shard another dim on "
                    f"{axis_text}", operand=name))
            elif isinstance(p, Partial):
                found.append(Violation(
                    "partial-input",
                    f"{name} is {p} on mesh axis {axis_text} but concat computes {q} there (the other operands are "
                    f"not all {p}); {name} is {t.layout}",
                    f"reduce {name} on {axis_text} first (all-reduce), or make every operand {p} there",
                    operand=name))
            else:
                others = [rule.operand_name(k) for k, s in enumerate(inputs) if s.layout.placements[a] == q]
                source = f" like {', '.join(others)}" if others else ""
                found.append(Violation(
                    "sharding-mismatch",
                    f"{name} is {p} on mesh axis {axis_text} but concat computes {q} there{source}: operands must "
                    f"be sharded alike off the concat axis {axis}; {name} is {t.layout}, the output {target}",
                    f"redistribute {name} to {target} (S(d) on {axis_text} like the others), or shard the "
                    f"operands alike", operand=name))
        out.append(found)
    return out


@register_op
class Concat(_ShapeOpRule):
    """``concat(x, x1, ..., axis=0)``: join the operands along ``axis``."""

    name = "concat"
    operands = ("x",)
    variadic = True
    aliases = ("Concat", "cat", "aten.cat", "concatenate")
    attr_defaults = {"axis": 0}
    attr_synonyms = {"dim": "axis"}
    violation_codes = ("sharded-concat-dim", "sharding-mismatch", "partial-input", "invalid-dim", "concat-shape")
    strided = True  # strided shards of the untouched dims stay (the op's own dim: gathered)

    def sample_inputs(self):
        return [
            _sample([(4, 3), (2, 3)], axis=0),
            _sample([(5, 3), (5, 2)], axis=-1),
            _sample([(3, 2, 4), (3, 1, 4), (3, 3, 4)], axis=1),
            _sample([(1, 4), (2, 4)], axis=0),
        ]

    def _shape_problems(self, inputs, axis: int) -> list[Violation]:
        first = inputs[0]
        out = []
        for i, t in enumerate(inputs[1:], start=1):
            name = self.operand_name(i)
            if t.ndim != first.ndim:
                out.append(Violation("concat-shape", f"{name} has rank {t.ndim} (shape {list(t.shape)}) but x has "
                                     f"rank {first.ndim} (shape {list(first.shape)})",
                                     "give every concat operand the same rank", operand=name))
                continue
            bad = [d for d in range(t.ndim) if d != axis and t.shape[d] != first.shape[d]]
            if bad:
                d = bad[0]
                out.append(Violation("concat-shape", f"{name} has shape {list(t.shape)} but x has "
                                     f"{list(first.shape)}: concat along dim {axis} needs every other dim equal "
                                     f"(dim {d}: {t.shape[d]} vs {first.shape[d]})",
                                     f"make {name} dim {d} size {first.shape[d]}, or concat along dim {d}",
                                     operand=name))
        return out

    def infer_layout(self, inputs, attrs):
        first = inputs[0]
        axis = normalize_dim(attrs.get("axis"), first.ndim)
        if axis is None:
            return RuleResult((None,), (_dim_violation("axis", attrs.get("axis"), first.ndim),), ())
        problems = self._shape_problems(inputs, axis)
        if problems:
            return RuleResult((None,), tuple(problems), ())
        target = _concat_target(inputs, axis)
        if target.has_strided and not all(_fits(t.shape, target) for t in inputs):
            # a strided shard from one operand inside another's shard of that dim: no layout holds both
            target = target.with_placements([Replicate() if isinstance(p, StridedShard) else p
                                             for p in target.placements])
        aligned, taken = _strided_concat(inputs, axis) or ({}, None)
        if aligned:
            target = target.with_placements([aligned.get(a, p) for a, p in enumerate(target.placements)])
        wants, violations = [], []
        found_all = _concat_axis_violations(self, inputs, axis, target, tuple(aligned))
        for i, (t, found) in enumerate(zip(inputs, found_all)):
            want = target.with_placements([taken[i] if a in aligned else p
                                           for a, p in enumerate(target.placements)]) if aligned else target
            want = want if want != t.layout else None
            wants.append(want)
            name = self.operand_name(i)
            violations += _fixable(t, want, found, (
                "sharding-mismatch", name, f"{name} is {t.layout} but concat computes {target} along dim {axis}",
                f"redistribute {name} to {target}"))
        shape = list(first.shape)
        shape[axis] = sum(t.shape[axis] for t in inputs)
        dtype = str(np.result_type(*[np.dtype(t.dtype) for t in inputs]))
        return RuleResult((TensorSpec(shape, dtype, target),), tuple(violations), tuple(wants))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None,) * len(inputs)
        ndim = g.spec(inputs[0]).ndim
        axis = normalize_dim(attrs["axis"], ndim)
        grads, start = [], 0
        for value, need in zip(inputs, needs):
            stop = start + g.spec(value).shape[axis]
            grads.append(g.op("slice", [dy], {"axis": axis, "start": start, "stop": stop}) if need else None)
            start = stop
        return tuple(grads)


# ------------------------------------------------------------------------------ unsqueeze, squeeze
@register_op
class Unsqueeze(_ShapeOpRule):
    """``unsqueeze(x, dim)``: a new size-1 dim at ``dim``."""

    name = "unsqueeze"
    operands = ("x",)
    aliases = ("ExpandDims", "expand_dims", "aten.unsqueeze")
    attr_defaults = {"dim": None}
    attr_synonyms = {"axis": "dim"}
    violation_codes = ("invalid-dim",)
    strided = True  # strided shards of the untouched dims stay (the op's own dim: gathered)

    def sample_inputs(self):
        return [_sample([(4, 3)], dim=1), _sample([(5,)], dim=0), _sample([(2, 3, 5)], dim=-1),
                _sample([(3, 1)], dim=2)]

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        dim = normalize_dim(attrs.get("dim"), x.ndim + 1)
        if dim is None:
            return RuleResult((None,), (_dim_violation("dim", attrs.get("dim"), x.ndim + 1),), ())
        ps = [_with_dim(p, p.dim + (p.dim >= dim)) if shard_dim(p) is not None else p for p in x.layout.placements]
        shape = x.shape[:dim] + (1,) + x.shape[dim:]
        return RuleResult((TensorSpec(shape, x.dtype, Layout(x.mesh, ps, x.ndim + 1)),))

    def localize(self, attrs, inputs, outputs, rank):
        return {"dim": normalize_dim(attrs["dim"], inputs[0].ndim + 1)}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None:
            return (None,)
        dim = normalize_dim(attrs["dim"], g.spec(inputs[0]).ndim + 1)
        return (g.op("squeeze", [cotangents[0]], {"dim": dim}),)


def _squeeze_dims(x: TensorSpec, dim) -> tuple[list[int] | None, Violation | None]:
    if dim is None:
        return [d for d, s in enumerate(x.shape) if s == 1], None
    given = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    dims = []
    for value in given:
        d = normalize_dim(value, x.ndim)
        if d is None:
            return None, _dim_violation("dim", value, x.ndim)
        if x.shape[d] != 1:
            return None, Violation("invalid-squeeze", f"x dim {d} has size {x.shape[d]}, not 1 (x has shape "
                                   f"{list(x.shape)}); squeeze only removes size-1 dims",
                                   "squeeze only size-1 dims (leave dim out to squeeze all of them), or use "
                                   "reshape", operand="x")
        dims.append(d)
    return sorted(set(dims)), None


@register_op
class Squeeze(_ShapeOpRule):
    """``squeeze(x, dim=None)``: remove the size-1 dims ``dim`` (all of them when None)."""

    name = "squeeze"
    operands = ("x",)
    aliases = ("Squeeze", "aten.squeeze")
    attr_defaults = {"dim": None}
    attr_synonyms = {"axis": "dim"}
    violation_codes = ("invalid-dim", "invalid-squeeze")
    strided = True  # strided shards of the untouched dims stay (the op's own dim: gathered)

    def sample_inputs(self):
        return [_sample([(4, 1, 3)], dim=1), _sample([(1, 5, 1)]), _sample([(2, 1, 3, 1)], dim=[1, -1]),
                _sample([(3, 1)], dim=-1)]

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        dims, problem = _squeeze_dims(x, attrs.get("dim"))
        if problem is not None:
            return RuleResult((None,), (problem,), ())
        ps = []
        for p in x.layout.placements:
            if shard_dim(p) is not None:  # a squeezed dim is sharded only on a size-1 mesh axis: Replicate
                ps.append(Replicate() if p.dim in dims else _with_dim(p, p.dim - sum(d < p.dim for d in dims)))
            else:
                ps.append(p)
        shape = tuple(s for d, s in enumerate(x.shape) if d not in dims)
        return RuleResult((TensorSpec(shape, x.dtype, Layout(x.mesh, ps, len(shape))),))

    def localize(self, attrs, inputs, outputs, rank):
        dims, _ = _squeeze_dims(inputs[0], attrs.get("dim"))
        return {"dim": dims}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None:
            return (None,)
        return (g.op("reshape", [cotangents[0]], {"shape": list(g.spec(inputs[0]).shape)}),)


# ------------------------------------------------------------------------------ sharding_constraint
@register_op
class ShardingConstraint(_ShapeOpRule):
    """``sharding_constraint(x, placements | tensor_map)``: ``x`` itself, pinned to that layout.

    Exactly one of ``placements`` (one per mesh axis) and ``tensor_map`` (one entry per
    tensor dim, MindSpore's convention) is given; ``pattern`` names the constraint in
    messages.

    What a spec's (or plan's) ``constraints:`` section becomes (JAX's
    ``with_sharding_constraint``, MindSpore's per-op ``shard()``): the loader inserts one
    such node after each pinned value, named ``VALUE/pinned``, and every consumer reads
    it.  Its output always has the pinned layout; its input is wanted in it.  A move that
    costs communication is ``constraint-unmet`` (fixed by ``--reshard``, which inserts
    the redistribution; not fixable when no redistribution reaches the layout).  A
    pinned layout that cannot exist for the value (a dim out of range, a size-1 dim
    sharded) is unusable input, ``invalid-layout`` naming the constraint.  vjp: the
    cotangent passes through unchanged.
    """

    name = "sharding_constraint"
    operands = ("x",)
    aliases = ("with_sharding_constraint",)
    attr_defaults = {"placements": None, "tensor_map": None, "pattern": None}
    violation_codes = ("constraint-unmet",)
    strided = True  # a strided shard may be pinned, or moved to the pinned layout

    def normalize_attrs(self, attrs: dict, node: str | None = None) -> dict:
        out = super().normalize_attrs(attrs, node)
        if (out["placements"] is None) == (out["tensor_map"] is None):
            raise OpError("bad-attr", f"op {self.name!r} takes exactly one of placements and tensor_map", node=node,
                          hint="give the pinned layout as placements: [\"S(0)\", R] (or tensor_map: [0, -1])")
        return out

    def sample_inputs(self):
        # tensor_map fits every mesh (0 is its last axis): the testing kit tries each on (2,) and (2, 2)
        return [_sample([(4, 6)], tensor_map=[0, -1]), _sample([(4, 6)], tensor_map=[-1, -1]),
                _sample([(6, 4)], tensor_map=[-1, 0])]

    def pinned(self, x: TensorSpec, attrs: dict) -> TensorSpec:
        """The spec ``x`` is pinned to; ``invalid-layout`` (naming the constraint) if it cannot exist."""
        from layout_prop.core.errors import SpecError

        try:
            if attrs["tensor_map"] is not None:
                layout = Layout.from_tensor_map(x.mesh, list(attrs["tensor_map"]))
                if layout.ndim != x.ndim:
                    raise LayoutError("invalid-layout", f"tensor_map {list(attrs['tensor_map'])} has {layout.ndim} "
                                      f"entries for a tensor of rank {x.ndim}", hint="give one entry per tensor dim")
                return TensorSpec(x.shape, x.dtype, layout)
            placements = attrs["placements"]
            if not isinstance(placements, (list, tuple)):
                raise LayoutError("bad-type", f"placements must be a list, got {placements!r}",
                                  hint="write one placement per mesh axis, like [\"S(0)\", R]")
            return TensorSpec(x.shape, x.dtype, Layout(x.mesh, placements, x.ndim))
        except LayoutError as err:
            where = f"constraints[{attrs['pattern']!r}]" if attrs.get("pattern") is not None else "constraints"
            given = attrs["placements"] if attrs["tensor_map"] is None else attrs["tensor_map"]
            raise SpecError(err.code, f"the constraint pins a value of shape {list(x.shape)} to "
                            f"{list(given)}: {err.message}", path=where,
                            hint=err.hint or "pin a layout that fits the value") from None

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        out = self.pinned(x, attrs)
        if out.layout == x.layout:
            return RuleResult((out,))
        move = plan_summary(x, out.layout)
        if move.free:
            return RuleResult((out,), (), (out.layout,))
        which = f"constraint {attrs['pattern']!r}" if attrs.get("pattern") is not None else "a constraint"
        how = f"it takes {move.text}" if move.fixable else move.text
        v = Violation("constraint-unmet", f"the value is {x.layout} but {which} pins it to {out.layout}: {how}",
                      "shard the producer's inputs so that it computes the pinned layout, or change the "
                      "constraint", operand="x", fixable=move.fixable,
                      details={"want": out.layout.placement_strs()})
        return RuleResult((out,), (v,), (out.layout,))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        return (cotangents[0],)
