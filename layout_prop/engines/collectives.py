"""Simulated collectives: exact semantics over per-rank numpy arrays.

Per-rank values are a list ``locals_`` indexed by rank.  The group-level functions
(:func:`all_gather`, :func:`all_reduce`, :func:`reduce_scatter`, :func:`all_to_all`,
:func:`local_slice`, :func:`local_partial`) take the arrays of ONE group, in group order (the order of
``mesh.groups(axis)``), and return that group's results, one fresh array per rank.
:func:`apply_step` runs a planned :class:`~layout_prop.core.redistribute.Step` on every
group of its mesh axis; :func:`apply_plan` runs a whole plan.  Pieces follow
``torch.chunk`` (uneven and empty pieces included).

:func:`scatter_global` cuts a global array into the pieces each rank holds under a
spec, and :func:`assemble` does the reverse, checking that replicas agree.

Reductions
----------
``sum`` adds the terms left to right in group order; ``avg`` is their mean, computed as
``t0 + sum(t_k - t0) / n`` so that equal terms average exactly (integers: the floor of
the mean); ``max`` / ``min`` are elementwise; on bools ``sum`` and ``avg`` are a logical
or.  With several Partial mesh axes the value reduces the innermost axis
first: ``value = op_0 over axis 0 of (op_1 over axis 1 of (... terms))`` (the planner
in :mod:`layout_prop.core.redistribute` keeps to that order).

Buffers
-------
Results that are equal on every rank of a group are one read-only array shared by the
group; groups whose terms are the same objects (the ranks of an earlier collective's
group hold its one result) are run once and share their results too.  A reduction may
accumulate into its group's first term instead of a new array when the caller gives
that buffer up (``into_first`` / ``donatable``, used by the simulator for values that
die at the step): the same additions in the same order, so the same bits.

Examples
--------
>>> import numpy as np
>>> from layout_prop import DeviceMesh, Layout, TensorSpec
>>> from layout_prop.core.redistribute import plan_redistribution
>>> mesh = DeviceMesh((4,), ("tp",))
>>> x = TensorSpec((10,), "float64", Layout(mesh, ["S(0)"], 1))
>>> pieces = scatter_global(np.arange(10.0), x)
>>> [p.tolist() for p in pieces]
[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0], [9.0]]
>>> out = apply_plan(plan_redistribution(x, Layout(mesh, ["R"], 1)), pieces)
>>> out[3].tolist()
[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
>>> all_reduce([np.array([1.0, 5.0]), np.array([3.0, 2.0])], "max")[1].tolist()
[3.0, 5.0]
"""

from __future__ import annotations

from typing import Collection, Sequence

import numpy as np

from layout_prop.core.errors import ExecutionError
from layout_prop.core.placement import REDUCE_OPS, StridedShard, shard_dim
from layout_prop.core.redistribute import Redistribution, Step
from layout_prop.core.spec import TensorSpec, chunk_bounds

__all__ = [
    "reduce_terms",
    "split_terms",
    "scatter_global",
    "assemble",
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "permute",
    "local_slice",
    "local_partial",
    "gathered",
    "sliced",
    "partial_term",
    "local_step",
    "step_split_factor",
    "apply_step",
    "apply_plan",
    "DONATING_STEPS",
    "may_overlap_itself",
]

#: The steps that can accumulate into a donated first term (:func:`apply_step`).
DONATING_STEPS = ("all-reduce", "reduce-scatter")


# --------------------------------------------------------------------------- reductions
def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ExecutionError("bad-reduce-op", f"unknown reduce op {op!r}", hint=f"use one of {', '.join(REDUCE_OPS)}")


def _check_group(arrays: Sequence, what: str) -> list[np.ndarray]:
    arrays = [np.asarray(a) for a in arrays]
    if not arrays:
        raise ExecutionError("empty-group", f"{what} on an empty group", hint="a group holds at least one rank")
    return arrays


def _check_same_shapes(arrays: list[np.ndarray], what: str) -> None:
    shapes = [a.shape for a in arrays]
    if len(set(shapes)) > 1:
        raise ExecutionError("shape-mismatch", f"{what} needs equal shapes in the group, got {shapes}",
                             hint="every rank of the group must hold a piece of the same shape")


def reduce_terms(arrays: Sequence[np.ndarray], op: str, *, into_first: bool = False) -> np.ndarray:
    """Reduce the terms of one group elementwise by ``op``.

    Parameters
    ----------
    arrays : sequence of numpy.ndarray
        The terms, in group order, all of one shape.
    op : {'sum', 'avg', 'max', 'min'}
        ``sum`` adds left to right; ``avg`` is ``t0 + sum(t_k - t0) / n`` (integers: floor);
        on bools ``sum`` and ``avg`` are a logical or.
    into_first : bool, optional
        Accumulate into ``arrays[0]`` instead of a new array and return it (``sum``,
        ``max``, ``min``; ``avg`` always makes a new array and leaves the terms alone).
        The caller gives that buffer up: nothing may read it as a term afterwards.  The
        operations and their order are the same, so the result is bit-identical.

    Returns
    -------
    numpy.ndarray
        A new array of the terms' dtype, or ``arrays[0]`` itself when ``into_first``.

    Raises
    ------
    ExecutionError
        ``read-only-buffer`` when ``into_first`` asks to write a read-only first term;
        ``aliased-buffer`` when another term may share memory with it (writing the first
        term would change that term before it is read).

    Examples
    --------
    >>> reduce_terms([np.array([1.0, 4.0]), np.array([3.0, 0.0])], "avg").tolist()
    [2.0, 2.0]
    >>> first = np.array([1.0, 2.0])
    >>> out = reduce_terms([first, np.array([10.0, 20.0])], "sum", into_first=True)
    >>> out is first, first.tolist()
    (True, [11.0, 22.0])
    """
    _check_op(op)
    arrays = _check_group(arrays, f"reduce({op})")
    _check_same_shapes(arrays, f"reduce({op})")
    dtype = arrays[0].dtype
    if dtype == np.bool_ and op in ("sum", "avg"):
        op = "max"  # on bools a sum, and a mean read as a bool, are a logical or
    if op == "avg":
        return _average(arrays, dtype)
    fold = _FOLDS[op]
    kwargs = {"dtype": dtype} if op == "sum" else {}
    if into_first:
        _check_donated(arrays)
        acc, rest = arrays[0], arrays[1:]
    elif len(arrays) == 1:
        return arrays[0].copy()
    else:
        acc, rest = np.asarray(fold(arrays[0], arrays[1], **kwargs)), arrays[2:]  # a new array: no copy pass
    for term in rest:
        fold(acc, term, out=acc, **kwargs)  # left to right, in place
    return acc


_FOLDS = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def _check_donated(arrays: list[np.ndarray]) -> None:
    """The first term can take the result: writeable, each element at its own address, and
    no later term reads its memory."""
    first = arrays[0]
    if not first.flags.writeable:
        raise ExecutionError("read-only-buffer", "cannot reduce into a read-only first term",
                             hint="donate only a buffer that the caller owns and gives up")
    if may_overlap_itself(first):
        raise ExecutionError("aliased-buffer", "cannot reduce into the first term: some of its elements may share "
                             "an address (a broadcast view?)", hint="donate only a buffer of distinct elements")
    for k, term in enumerate(arrays[1:], start=1):
        if np.may_share_memory(first, term):
            raise ExecutionError("aliased-buffer", f"cannot reduce into the first term: term {k} may share its "
                                 "memory", hint="donate only a buffer that no other term views")


def may_overlap_itself(array: np.ndarray) -> bool:
    """Whether two elements of ``array`` may sit at one address (a broadcast or stride trick).

    ``False`` is certain: sorted by stride, each dim steps over the whole block that the
    smaller dims span.  Writing such an array elementwise in place writes every element once.

    Examples
    --------
    >>> may_overlap_itself(np.zeros((2, 3, 4)).transpose(1, 0, 2)), may_overlap_itself(np.zeros((4, 6))[::2, 1:])
    (False, False)
    >>> may_overlap_itself(np.broadcast_to(np.zeros(3), (2, 3)))
    True
    """
    span = array.itemsize  # bytes from the first element's start to the last one's end, dims so far
    for stride, n in sorted((abs(st), n) for st, n in zip(array.strides, array.shape) if n > 1):
        if stride < span:
            return True
        span += stride * (n - 1)
    return False


def _average(arrays: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """``t0 + sum(t_k - t0) / n``: the mean, exact when the terms are equal (integers: floor)."""
    first = arrays[0]
    offset = np.zeros_like(first)
    with np.errstate(invalid="ignore", over="ignore"):
        for term in arrays[1:]:
            offset = np.add(offset, np.subtract(term, first, dtype=dtype), dtype=dtype)
    if np.issubdtype(dtype, np.floating):
        with np.errstate(invalid="ignore", over="ignore"):
            shifted = np.add(first, offset / len(arrays), dtype=dtype)
            plain = reduce_terms(arrays, "sum") / len(arrays)
        return np.where(np.isfinite(shifted), shifted, plain).astype(dtype)  # inf - inf: plain mean
    return np.add(first, offset // len(arrays), dtype=dtype)  # integers: the floor of the mean


def split_terms(value: np.ndarray, n: int, op: str, rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """``n`` terms whose reduction by ``op`` (as in :func:`reduce_terms`) is ``value``.

    Without ``rng``: ``sum`` puts the value on term 0 and zeros elsewhere; ``avg`` puts
    the value on every term; ``max`` / ``min`` put the value on term 0 and the dtype's
    lowest / highest value (``-inf`` / ``inf`` for floats) elsewhere.  With ``rng``:
    ``sum`` uses random coarse terms (multiples of 1/4) and a residual on the last term,
    exact under left-to-right addition (elements where the residual would round keep
    the value on the last term and zeros elsewhere); ``avg`` uses ``value + d_k`` with
    coarse ``d_k`` adding to zero (exact up to rounding of the mean; integers get the
    value on every term); ``max`` / ``min`` hold the value on one random term per
    element and values ``<=`` / ``>=`` it on the others.

    Examples
    --------
    >>> [t.tolist() for t in split_terms(np.array([1.5, -2.0]), 3, "max")]
    [[1.5, -2.0], [-inf, -inf], [-inf, -inf]]
    >>> rng = np.random.default_rng(0)
    >>> terms = split_terms(np.array([0.1, 7.25]), 3, "sum", rng)
    >>> bool((reduce_terms(terms, "sum") == np.array([0.1, 7.25])).all())
    True
    """
    _check_op(op)
    value = np.asarray(value)
    if value.ndim == 0:  # a scalar: split it as a 1-element vector (element assignment needs an array)
        return [t.reshape(()) for t in split_terms(value.reshape(1), n, op, rng)]
    if n < 1:
        raise ExecutionError("empty-group", f"cannot split a value into {n} terms", hint="n >= 1")
    if n == 1:
        return [value.copy()]
    dtype = value.dtype
    is_bool = dtype == np.bool_
    is_float = np.issubdtype(dtype, np.floating)
    if op == "avg" and (rng is None or not is_float):
        return [value.copy() for _ in range(n)]
    if op in ("max", "min"):
        return _split_extreme(value, n, op, rng)
    if op == "sum" and (rng is None or is_bool):
        if is_bool and rng is not None:
            return _split_extreme(value, n, "max", rng)  # bool sum is logical or
        return [value.copy()] + [np.zeros_like(value) for _ in range(n - 1)]
    if op == "sum":
        coarse = [_coarse(rng, value.shape, dtype, is_float) for _ in range(n - 1)]
        partial = reduce_terms(coarse, "sum")
        residual = np.subtract(value, partial, dtype=dtype)
        terms = coarse + [residual]
        if is_float:
            with np.errstate(invalid="ignore", over="ignore"):
                exact = reduce_terms(terms, "sum") == value
            keep = ~exact
            for t in coarse:
                t[keep] = 0
            residual[keep] = value[keep]
        return terms
    # avg on floats with rng: value + d_k, the d_k adding up to zero exactly
    offsets = [_coarse(rng, value.shape, dtype, True) for _ in range(n - 1)]
    offsets.append(-reduce_terms(offsets, "sum"))
    return [np.add(value, d, dtype=dtype) for d in offsets]


def _coarse(rng: np.random.Generator, shape: tuple, dtype: np.dtype, is_float: bool) -> np.ndarray:
    ints = rng.integers(-8, 9, size=shape)
    return (ints / 4).astype(dtype) if is_float else ints.astype(dtype)


def _split_extreme(value: np.ndarray, n: int, op: str, rng: np.random.Generator | None) -> list[np.ndarray]:
    dtype = value.dtype
    if dtype == np.bool_:
        far = np.zeros_like(value) if op == "max" else np.ones_like(value)
    elif np.issubdtype(dtype, np.floating):
        far = np.full_like(value, -np.inf if op == "max" else np.inf)
    else:
        info = np.iinfo(dtype)
        far = np.full_like(value, info.min if op == "max" else info.max)
    if rng is None:
        return [value.copy()] + [far.copy() for _ in range(n - 1)]
    holder = rng.integers(0, n, size=value.shape)
    terms = []
    for k in range(n):
        terms.append(np.where(holder == k, value, _beyond(value, op, far, rng)).astype(dtype))
    return terms


def _beyond(value: np.ndarray, op: str, far: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random values ``<= value`` (op max) or ``>= value`` (op min), elementwise."""
    if value.dtype == np.bool_:
        noise = rng.integers(0, 2, size=value.shape).astype(bool)
        return value & noise if op == "max" else value | noise
    step = rng.integers(0, 4, size=value.shape).astype(value.dtype)
    if np.issubdtype(value.dtype, np.floating):
        with np.errstate(invalid="ignore", over="ignore"):
            return value - step if op == "max" else value + step  # rounding is monotone
    if op == "max":
        return np.where(value >= far + step, value - step, value)  # no wrap-around below the minimum
    return np.where(value <= far - step, value + step, value)


# --------------------------------------------------------------------------- global <-> local
def _partial_split_plan(spec: TensorSpec) -> list[tuple[int, str]]:
    """Partial mesh axes (index, op), outer first."""
    return sorted(spec.layout.partial_axes().items())


def scatter_global(array, spec: TensorSpec, rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """Each rank's local piece of ``array`` under ``spec``.

    Parameters
    ----------
    array : array_like
        The global value, of shape ``spec.shape`` (cast to ``spec.dtype``).
    spec : TensorSpec
        The layout to cut by.
    rng : numpy.random.Generator, optional
        Randomises the terms on Partial axes (:func:`split_terms`); without it the value
        sits on coordinate 0 of every Partial axis.

    Returns
    -------
    list of numpy.ndarray
        Indexed by rank; ranks of one replica group get equal arrays (separate copies).

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
    >>> spec = TensorSpec((4,), "int64", Layout(mesh, ["P(sum)", "S(0)"], 1))
    >>> [p.tolist() for p in scatter_global(np.arange(4), spec)]
    [[0, 1], [2, 3], [0, 0], [0, 0]]
    """
    array = np.asarray(array)
    if array.shape != spec.shape:
        raise ExecutionError("shape-mismatch", f"global array of shape {list(array.shape)} for {spec}",
                             hint="pass an array of the spec's shape")
    array = array.astype(spec.dtype, copy=False)
    mesh = spec.mesh
    partial = _partial_split_plan(spec)
    splits = [(mesh.shape[a], op) for a, op in partial]
    terms_by_piece: dict[tuple, np.ndarray] = {}
    out: list[np.ndarray] = []
    for rank in range(mesh.size):
        coords = mesh.coords(rank)
        key = _piece_key(spec, coords)
        if key not in terms_by_piece:
            terms_by_piece[key] = _split_nested(array[spec.local_index(rank)], splits, rng)
        terms = terms_by_piece[key]
        out.append(np.array(terms[tuple(coords[a] for a, _ in partial)], dtype=spec.dtype, copy=True))
    return out


def _piece_key(spec: TensorSpec, coords: tuple[int, ...]):
    """Equal for ranks that hold the same piece (before the Partial terms are split)."""
    if spec.layout.has_strided:
        placements = spec.layout.placements
        return tuple(c for a, c in enumerate(coords) if shard_dim(placements[a]) is not None)
    return spec.local_slices(spec.mesh.rank(coords))


def _split_nested(block: np.ndarray, splits: list[tuple[int, str]], rng) -> np.ndarray:
    """Terms indexed by the Partial coordinates (outer first), then the block's dims."""
    if not splits:
        return block
    (n, op), rest = splits[0], splits[1:]
    return np.stack([_split_nested(t, rest, rng) for t in split_terms(block, n, op, rng)])


def _first_mismatch(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> tuple | None:
    if a.dtype == np.bool_ or b.dtype == np.bool_ or (rtol == 0 and atol == 0):
        same = (a == b) | (_isnan(a) & _isnan(b))
    else:
        same = np.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    bad = np.argwhere(~same)
    return None if len(bad) == 0 else tuple(int(i) for i in bad[0])


def _isnan(a: np.ndarray) -> np.ndarray:
    return np.isnan(a) if np.issubdtype(a.dtype, np.floating) else np.zeros(a.shape, dtype=bool)


def _check_locals(locals_: Sequence, spec: TensorSpec, what: str) -> list[np.ndarray]:
    mesh = spec.mesh
    if len(locals_) != mesh.size:
        raise ExecutionError("rank-count-mismatch",
                             f"{what}: {len(locals_)} local arrays for a mesh of {mesh.size} ranks ({mesh})",
                             hint="pass one array per rank, indexed by rank")
    arrays = [np.asarray(x) for x in locals_]
    for rank, arr in enumerate(arrays):
        want = spec.local_shape(rank)
        if arr.shape != want:
            raise ExecutionError("shape-mismatch",
                                 f"{what}: rank {rank} holds shape {list(arr.shape)} but {spec} gives it "
                                 f"{list(want)}", hint="the local arrays do not match the layout")
    return arrays


def assemble(locals_: Sequence, spec: TensorSpec, *, rtol: float = 0, atol: float = 0) -> np.ndarray:
    """The global array held by ``locals_`` under ``spec``.

    Replicas (ranks of one of ``spec.replica_groups()``) must agree within
    ``rtol``/``atol``; the first rank of each group is used, nothing is averaged.
    Partial axes are reduced innermost first, then the shards are placed by
    ``spec.local_slices``.

    Raises
    ------
    ExecutionError
        ``replica-mismatch`` naming the two ranks and the first differing local index;
        ``shape-mismatch`` / ``rank-count-mismatch`` when the arrays do not fit the spec.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> spec = TensorSpec((3,), "float64", Layout(mesh, ["S(0)"], 1))
    >>> assemble([np.array([1.0, 2.0]), np.array([3.0])], spec).tolist()
    [1.0, 2.0, 3.0]
    """
    mesh = spec.mesh
    arrays = _check_locals(locals_, spec, "assemble")
    for group in spec.replica_groups():
        ref = arrays[group[0]]
        for rank in group[1:]:
            where = _first_mismatch(ref, arrays[rank], rtol, atol)
            if where is not None:
                raise ExecutionError(
                    "replica-mismatch",
                    f"ranks {group[0]} and {rank} are replicas under {spec.layout} but differ at local index "
                    f"{list(where)}: {ref[where]!r} vs {arrays[rank][where]!r}",
                    hint="a Replicate axis needs identical data on every rank of its group",
                )
    grid = np.empty(mesh.shape, dtype=object)
    for rank, coords in enumerate(mesh.all_coords()):
        grid[coords] = arrays[rank]
    partial = _partial_split_plan(spec)
    for axis, op in reversed(partial):  # innermost Partial axis first
        moved = np.moveaxis(grid, axis, 0)
        reduced = np.empty(moved.shape[1:], dtype=object)
        for idx in np.ndindex(*moved.shape[1:]):
            reduced[idx] = reduce_terms([moved[(k,) + idx] for k in range(moved.shape[0])], op)
        grid = np.moveaxis(np.broadcast_to(reduced[None], moved.shape), 0, axis)
    out = np.empty(spec.shape, dtype=spec.dtype)
    for group in spec.replica_groups():  # the first replica of each group, nothing averaged
        out[spec.local_index(group[0])] = grid[mesh.coords(group[0])]
    return out


# --------------------------------------------------------------------------- group collectives
def _chunks(array: np.ndarray, dim: int, n: int) -> list[np.ndarray]:
    """``torch.chunk`` of ``array`` along ``dim`` into exactly ``n`` pieces (some may be empty)."""
    pieces = []
    for lo, hi in chunk_bounds(array.shape[dim], n):
        index = [slice(None)] * array.ndim
        index[dim] = slice(lo, hi)
        pieces.append(array[tuple(index)])
    return pieces


def all_gather(arrays: Sequence[np.ndarray], dim: int, split_factor: int = 1) -> list[np.ndarray]:
    """Every rank gets the group's pieces concatenated along ``dim`` in group order.

    With ``split_factor`` k (a strided shard ``_S(dim,k)``) each piece is k blocks; block
    b of every rank, in group order, makes block b of the result.

    >>> [r.tolist() for r in all_gather([np.array([1, 2]), np.array([3])], 0)]
    [[1, 2, 3], [1, 2, 3]]
    >>> all_gather([np.array([0, 4]), np.array([1, 5]), np.array([2, 6]), np.array([3, 7])], 0, 2)[0].tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    arrays = _check_group(arrays, "all-gather")
    return _shared(gathered(arrays, dim, split_factor), len(arrays))


def gathered(pieces: Sequence[np.ndarray], dim: int, split_factor: int = 1) -> np.ndarray:
    """The result of an all-gather of ``pieces`` (one per rank, in group order) along ``dim``.

    Plain pieces are concatenated.  With ``split_factor`` k (the source is a strided
    shard ``_S(dim,k)``) each piece is cut into its k equal blocks, and block b of every
    piece, in group order, makes block b of the result.  The msrun workers call this on
    the pieces their all-gather brought, so both engines order the result alike.

    Returns
    -------
    numpy.ndarray
        A new array.

    Raises
    ------
    ExecutionError
        ``shape-mismatch`` when the pieces disagree on another dim, or a piece does not
        divide into ``split_factor`` blocks.

    Examples
    --------
    >>> gathered([np.array([0, 1, 4, 5]), np.array([2, 6])], 0, 2).tolist()   # _S(0,2) of 7 on 2 ranks
    [0, 1, 2, 4, 5, 6]
    """
    pieces = list(pieces)
    if split_factor > 1:
        pieces = [part for block in zip(*[_blocks(p, dim, split_factor) for p in pieces]) for part in block]
    try:
        return np.concatenate(pieces, axis=dim)
    except ValueError as exc:
        raise ExecutionError("shape-mismatch", f"all-gather along dim {dim} of shapes "
                             f"{[list(p.shape) for p in pieces]}: {exc}",
                             hint="pieces must agree on every dim but the gathered one") from None


def _shared(value: np.ndarray, n: int) -> list[np.ndarray]:
    """The same result for every rank of a group, read-only.

    Values are immutable in the simulator (kernels write only into buffers of their own),
    so the ranks of a group can share one array instead of ``n`` copies; a kernel that
    tried to write into its input would fail loudly instead of corrupting another rank.
    """
    value = np.asarray(value)  # a reduction of 0-d terms may come back as a numpy scalar
    value.flags.writeable = False
    return [value] * n


def _read_only(view: np.ndarray) -> np.ndarray:
    view = view.view()
    view.flags.writeable = False
    return view


def all_reduce(arrays: Sequence[np.ndarray], op: str, *, into_first: bool = False) -> list[np.ndarray]:
    """Every rank gets the reduction of the group's terms (:func:`reduce_terms`).

    With ``into_first`` the reduction accumulates into ``arrays[0]``, which becomes the
    group's (read-only) result.

    >>> [r.tolist() for r in all_reduce([np.array([1, 2]), np.array([3, 4])], "sum")]
    [[4, 6], [4, 6]]
    """
    arrays = _check_group(arrays, f"all-reduce({op})")
    return _shared(reduce_terms(arrays, op, into_first=into_first), len(arrays))


def reduce_scatter(arrays: Sequence[np.ndarray], op: str, dim: int, n: int | None = None, *,
                   into_first: bool = False) -> list[np.ndarray]:
    """Rank ``k`` of the group gets chunk ``k`` (``torch.chunk``, ``n`` pieces) of the reduction.

    ``n`` defaults to, and must equal, the group size.  With ``into_first`` the reduction
    accumulates into ``arrays[0]`` and the pieces are read-only views of it.

    >>> [r.tolist() for r in reduce_scatter([np.arange(5), np.ones(5, int)], "sum", 0)]
    [[1, 2, 3], [4, 5]]
    """
    arrays = _check_group(arrays, f"reduce-scatter({op})")
    if n is None:
        n = len(arrays)
    if n != len(arrays):
        raise ExecutionError("group-size-mismatch", f"reduce-scatter into {n} pieces on a group of {len(arrays)}",
                             hint="scatter into one piece per rank")
    total = np.asarray(reduce_terms(arrays, op, into_first=into_first))
    total.flags.writeable = False
    return _chunks(total, dim, n)  # read-only views of the one reduction


def all_to_all(arrays: Sequence[np.ndarray], split_dim: int, concat_dim: int) -> list[np.ndarray]:
    """Rank ``k`` cuts its array along ``split_dim`` into one chunk per rank; rank ``c``
    gets chunk ``c`` of every rank, concatenated along ``concat_dim`` in group order.

    >>> a = [np.array([[0, 1, 2]]), np.array([[3, 4, 5]])]   # S(0) of a 2x3
    >>> [r.tolist() for r in all_to_all(a, split_dim=1, concat_dim=0)]   # -> S(1)
    [[[0, 1], [3, 4]], [[2], [5]]]
    """
    arrays = _check_group(arrays, "all-to-all")
    n = len(arrays)
    pieces = [_chunks(a, split_dim, n) for a in arrays]
    out = []
    for c in range(n):
        try:
            out.append(np.concatenate([pieces[k][c] for k in range(n)], axis=concat_dim))
        except ValueError as exc:
            raise ExecutionError("shape-mismatch", f"all-to-all of shapes {[list(a.shape) for a in arrays]}: {exc}",
                                 hint="pieces must agree on every dim but the concatenated one") from None
    return out


def local_slice(arrays: Sequence[np.ndarray], dim: int, split_factor: int = 1) -> list[np.ndarray]:
    """Rank ``k`` of the group keeps chunk ``k`` of its own array along ``dim`` (no communication).

    With ``split_factor`` s (a strided shard ``_S(dim,s)``) it keeps chunk ``k`` of each of
    the s blocks of ``dim``, in block order.

    >>> [r.tolist() for r in local_slice([np.arange(3), np.arange(3)], 0)]
    [[0, 1], [2]]
    >>> [r.tolist() for r in local_slice([np.arange(6), np.arange(6)], 0, 2)]
    [[0, 1, 3, 4], [2, 5]]
    """
    arrays = _check_group(arrays, "local-slice")
    n = len(arrays)
    return [_read_only(sliced(a, dim, n, k, split_factor)) for k, a in enumerate(arrays)]


def sliced(array: np.ndarray, dim: int, n: int, index: int, split_factor: int = 1) -> np.ndarray:
    """What rank ``index`` of a group of ``n`` keeps of ``array`` in a local slice along ``dim``.

    Chunk ``index`` of ``n`` (``torch.chunk``), a view; with ``split_factor`` s (the
    target is a strided shard ``_S(dim,s)``) chunk ``index`` of each of the s equal blocks
    of ``dim``, in block order, a new array.  One rank's part of :func:`local_slice`.

    >>> sliced(np.arange(7), 0, 2, 1).tolist(), sliced(np.arange(6), 0, 2, 0, 2).tolist()
    ([4, 5, 6], [0, 1, 3, 4])
    """
    if split_factor > 1:
        return np.concatenate([_chunks(b, dim, n)[index] for b in _blocks(array, dim, split_factor)], axis=dim)
    return _chunks(array, dim, n)[index]


def _blocks(array: np.ndarray, dim: int, k: int) -> list[np.ndarray]:
    """The ``k`` equal blocks of ``array`` along ``dim`` (a strided shard's blocks)."""
    if array.shape[dim] % k:
        raise ExecutionError("shape-mismatch", f"dim {dim} of size {array.shape[dim]} does not divide into {k} "
                             f"blocks of a strided shard", hint="the local arrays do not match the layout")
    return np.split(array, k, axis=dim)


def local_partial(arrays: Sequence[np.ndarray], op: str) -> list[np.ndarray]:
    """Turn a replicated value into terms of a ``P(op)`` without communication.

    ``sum``: rank 0 of the group keeps its array, the others get zeros, so the sum is
    the value exactly (integers and bools too); ``avg``, ``max``, ``min``: every rank
    keeps its array (the reduction of equal terms is the value; :func:`reduce_terms`
    averages equal terms exactly).

    >>> [r.tolist() for r in local_partial([np.array([1.5, 2.0]), np.array([1.5, 2.0])], "sum")]
    [[1.5, 2.0], [0.0, 0.0]]
    >>> [r.tolist() for r in local_partial([np.array([3]), np.array([3])], "avg")]
    [[3], [3]]
    """
    _check_op(op)
    arrays = _check_group(arrays, f"local-partial({op})")
    terms = [partial_term(a, op, k) for k, a in enumerate(arrays)]
    return [_read_only(t) if t is a else t for t, a in zip(terms, arrays)]  # the kept arrays, not to be written


def partial_term(array: np.ndarray, op: str, index: int) -> np.ndarray:
    """Rank ``index``'s term of a ``P(op)`` made from its replica ``array`` (one rank's part of
    :func:`local_partial`): ``array`` itself, or new zeros for ``sum`` on every rank but index 0.

    >>> partial_term(np.array([1.5]), "sum", 1).tolist(), partial_term(np.array([1.5]), "max", 1).tolist()
    ([0.0], [1.5])
    """
    _check_op(op)
    if op == "sum" and index > 0:
        return np.zeros_like(array)
    return array


# --------------------------------------------------------------------------- plans
def _run_group(step: Step, arrays: list[np.ndarray], into_first: bool = False) -> list[np.ndarray]:
    if step.kind == "local-slice":
        return local_slice(arrays, step.dim, step_split_factor(step))
    if step.kind == "local-partial":
        return local_partial(arrays, step.reduce_op)
    if step.kind == "all-gather":
        return all_gather(arrays, step.dim, step_split_factor(step))
    if step.kind == "all-reduce":
        return all_reduce(arrays, step.reduce_op, into_first=into_first)
    if step.kind == "reduce-scatter":
        return reduce_scatter(arrays, step.reduce_op, step.dim, into_first=into_first)
    if step.kind == "all-to-all":
        return all_to_all(arrays, split_dim=step.dst_dim, concat_dim=step.dim)
    if step.kind == "permute":
        return permute(arrays, step.shift, step.cyclic)
    raise ExecutionError("unknown-step", f"unknown step kind {step.kind!r}",
                         hint="steps are local-slice, local-partial, all-gather, all-reduce, reduce-scatter, "
                              "all-to-all, permute")


def permute(arrays: Sequence[np.ndarray], shift: int, cyclic: bool = False) -> list[np.ndarray]:
    """Point-to-point: group member ``k`` gets member ``k - shift``'s array (XLA's collective-permute).

    With ``cyclic`` the index wraps around the group; otherwise a member with no sender gets
    zeros of its own array's shape and dtype.

    >>> a = [np.array([0]), np.array([1]), np.array([2])]
    >>> [r.tolist() for r in permute(a, 1)], [r.tolist() for r in permute(a, -1, cyclic=True)]
    ([[0], [0], [1]], [[1], [2], [0]])
    """
    arrays = _check_group(arrays, "permute")
    n = len(arrays)
    out = []
    for k in range(n):
        source = k - shift
        if cyclic:
            source %= n
        if 0 <= source < n:
            out.append(_read_only(np.asarray(arrays[source])))
        else:
            out.append(np.zeros_like(arrays[k]))
    return out


def step_split_factor(step: Step) -> int:
    """The split factor of the strided shard that ``step`` slices into (a ``local-slice``) or
    gathers from (any other step) on its mesh axis; 1 when that placement is not strided.

    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> from layout_prop.core.redistribute import plan_redistribution
    >>> x = TensorSpec((8,), "float32", Layout(DeviceMesh((2,), ("tp",)), ["R"], 1))
    >>> step = plan_redistribution(x, Layout(x.mesh, ["_S(0,4)"], 1)).steps[0]
    >>> step.kind, step_split_factor(step)
    ('local-slice', 4)
    """
    spec = step.dst if step.kind == "local-slice" else step.src
    p = spec.layout.placements[step.mesh_axis]
    return p.split_factor if isinstance(p, StridedShard) else 1


def local_step(step: Step, array: np.ndarray, index: int) -> np.ndarray:
    """One rank's result of a step that needs no communication, from its own ``array``.

    ``index`` is the rank's position in its group on ``step.mesh_axis``.  A
    ``local-slice`` keeps :func:`sliced` (a strided target included), a
    ``local-partial`` :func:`partial_term`: what :func:`apply_step` gives that rank.  The
    msrun workers, which hold one rank each, run these steps with it.

    Raises
    ------
    ExecutionError
        ``unknown-step`` for a step that communicates.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> from layout_prop.core.redistribute import plan_redistribution
    >>> x = TensorSpec((6,), "float64", Layout(DeviceMesh((2,), ("tp",)), ["R"], 1))
    >>> step = plan_redistribution(x, Layout(x.mesh, ["_S(0,2)"], 1)).steps[0]
    >>> local_step(step, np.arange(6.0), 1).tolist()
    [2.0, 5.0]
    """
    n = step.src.mesh.shape[step.mesh_axis]
    if step.kind == "local-slice":
        return sliced(array, step.dim, n, index, step_split_factor(step))
    if step.kind == "local-partial":
        return partial_term(array, step.reduce_op, index)
    raise ExecutionError("unknown-step", f"{step.kind!r} is not a local step: it communicates",
                         hint="local steps are local-slice and local-partial")


def apply_step(step: Step, locals_: Sequence, donatable: Collection[int] = ()) -> list[np.ndarray]:
    """Run ``step`` on every group along ``step.mesh_axis``.

    Groups whose terms are the same objects in the same order (the ranks of an earlier
    collective's group share its result) run once and share their results.

    Parameters
    ----------
    step : Step
        A planned step; ``locals_`` must match ``step.src``.
    locals_ : sequence of numpy.ndarray
        One array per rank.
    donatable : collection of int, optional
        Ranks whose array the caller gives up: the array is writeable, its only
        references are slots of ``locals_`` (it may sit in several), no view of its
        memory exists anywhere, and the caller never reads it again.  A reduction
        (:data:`DONATING_STEPS`) then accumulates into its group's first term when that
        rank is donatable and every rank holding the same array is the first rank of a
        group with the same terms.

    Returns
    -------
    list of numpy.ndarray
        One array per rank, matching ``step.dst``.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> from layout_prop.core.redistribute import plan_redistribution
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> x = TensorSpec((2,), "float64", Layout(mesh, ["P(sum)"], 1))
    >>> step = plan_redistribution(x, Layout(mesh, ["R"], 1)).steps[0]
    >>> terms = [np.array([1.0, 2.0]), np.array([3.0, 4.0])]
    >>> out = apply_step(step, terms, donatable={0})
    >>> out[0] is terms[0] and out[1] is terms[0], out[0].tolist()
    (True, [4.0, 6.0])
    """
    arrays = _check_locals(locals_, step.src, f"{step.kind} on {step.mesh_axis_name!r}")
    groups = step.src.mesh.groups(step.mesh_axis)
    terms_of = {group: tuple(id(arrays[r]) for r in group) for group in groups}  # ids: arrays keeps them alive
    first_of = {group[0]: terms_of[group] for group in groups}
    done: dict[tuple[int, ...], list[np.ndarray]] = {}
    out: list[np.ndarray | None] = [None] * len(arrays)
    for group in groups:
        terms = terms_of[group]
        if terms not in done:
            into_first = (step.kind in DONATING_STEPS and group[0] in donatable
                          and arrays[group[0]] is locals_[group[0]]  # not a copy made by np.asarray
                          and _only_first_of(arrays, group[0], first_of))
            done[terms] = _run_group(step, [arrays[r] for r in group], into_first)
        for rank, result in zip(group, done[terms]):
            out[rank] = result
    for rank, arr in enumerate(out):
        if arr.shape != step.dst.local_shape(rank):
            raise ExecutionError("internal-error", f"{step} left rank {rank} with shape {list(arr.shape)}, "
                                 f"expected {list(step.dst.local_shape(rank))}",
                                 hint="please report this: the step does not match its specs")
    return out  # type: ignore[return-value]


def _only_first_of(arrays: list[np.ndarray], first: int, first_of: dict[int, tuple[int, ...]]) -> bool:
    """Every rank holding ``arrays[first]`` is the first rank of a group with the same terms.

    Then the one reduction that overwrites it serves every group that reads it: no other
    group reads it as a term before or after.
    """
    array = arrays[first]
    holders = [rank for rank, other in enumerate(arrays) if other is array]
    return all(first_of.get(rank) == first_of[first] for rank in holders)


def apply_plan(plan: Redistribution, locals_: Sequence) -> list[np.ndarray]:
    """Run every step of ``plan``; the result matches ``plan.dst``.

    A plan without steps (same layout, or changes on size-1 mesh axes only) returns
    copies of the inputs.
    """
    arrays = [a.copy() for a in _check_locals(locals_, plan.src, "apply_plan")]
    for step in plan.steps:
        arrays = apply_step(step, arrays)
    return arrays
