"""Planning a redistribution: the steps that move a tensor from one layout to another.

A redistribution changes the placements of one tensor on one mesh, DTensor-style, one
mesh axis at a time.  Each step changes the placement of one mesh axis:

==============  ==============  ===================================================
from            to              step(s)
==============  ==============  ===================================================
``R``           ``S(d)``        ``local-slice`` (no bytes)
``S(d)``        ``R``           ``all-gather``
``S(d)``        ``S(e)``        ``all-to-all``, or ``all-gather`` then ``local-slice``
``P(op)``       ``R``           ``all-reduce``
``P(op)``       ``S(d)``        ``reduce-scatter``, or ``all-reduce`` then ``local-slice``
``R``           ``P(op)``       ``local-partial`` (no bytes)
``S(d)``        ``P(op)``       ``all-gather`` then ``local-partial``
``P(op1)``      ``P(op2)``      impossible
``R``           ``_S(d,k)``     ``local-slice`` (each rank keeps its chunk of each block)
``_S(d,k)``     ``R``           ``all-gather`` (the blocks interleaved back)
other           ``_S(d,k)``     through ``R``; and ``_S(d,k)`` to ``S``/``P`` too
==============  ==============  ===================================================

A ``local-partial`` step turns a replicated value into terms whose reduction is the
value, without communication: for ``P(sum)`` coordinate 0 of the group keeps the value
and the other ranks hold zeros (exact, integers and bools included); for ``P(avg)``,
``P(max)`` and ``P(min)`` every rank keeps the value (the mean, maximum or minimum of
equal terms is the value itself; dividing by the group size, DTensor's ``R -> P(sum)``,
would make an average ``1/n`` of the value).  The terms stay exact under any nesting
with other Partial axes: the reduction of all-zero terms is zero for every op.
Linear rules (add with a Partial operand next to a Replicate one, a bias added to a
Partial product) use it so that the Replicate operand needs no communication.

Validity of an order
--------------------
A dim sharded on several mesh axes is cut by the outer axis first (see
:mod:`layout_prop.core.spec`), so a step that adds or removes mesh axis ``i``'s shard on
tensor dim ``d`` is valid only when no mesh axis ``j > i`` cuts ``d`` at that moment:
the inner axis is cut last and gathered first.  An ``all-to-all`` must satisfy this for
both its source and its destination dim.  The two steps of a two-step transition need
not be adjacent: swapping ``(S(0), S(1)) -> (S(1), S(0))`` has no order of single-step
transitions, and is planned as gather on one axis, all-to-all on the other, slice on
the first.  A mesh axis whose
placement is the same ``S(d)`` in both layouts is gathered and re-sliced when an outer
axis changes its shard on ``d`` (its chunk of ``d`` moves), as DTensor does.

Partial axes: with several Partial axes the global value reduces the innermost axis
first, ``value = op_0 over axis 0 of (op_1 over axis 1 of (... terms))``.  Reducing axis
``i`` while an inner Partial axis ``j > i`` remains is therefore valid only when the two
ops commute (equal ops, or ``sum`` with ``avg``); ``(P(max), P(sum)) -> (R, P(sum))``
has no valid order and raises ``no-redistribution``.

Size-1 mesh axes
----------------
A mesh axis of size 1 cuts nothing and reduces nothing: every placement on it holds
the same data.  A change of placement on a size-1 axis is a *relabel*, not a step: the
plan holds no step for it (not even a 0-byte one), its steps already carry the
destination placements on size-1 axes (so ``plan.steps[0].src`` may differ from
``plan.src`` on size-1 axes only, never in the data any rank holds), and every change
is allowed there, including ``R -> P(op)``.  Size-1 axes never block an order.

Cost model
----------
``bytes_per_rank`` of a step is the number of bytes sent by the busiest rank of the
busiest group along the step's mesh axis, for ring algorithms, exactly, from the shape,
the dtype, the group size ``n`` and the uneven ``torch.chunk`` pieces:

- ``local-slice``, ``local-partial``: 0.
- ``all-gather``: a rank sends every block of the gathered result except one; the
  busiest rank sends ``sum(blocks) - min(blocks)`` (blocks: the group's local pieces);
  ``(n-1)/n`` of the gathered tensor when the split is even.
- ``reduce-scatter``: the same count on the pre-scatter local tensor cut into the
  result blocks: ``local - min(result blocks)``.
- ``all-reduce``: ring reduce-scatter plus all-gather of the flattened local tensor cut
  into ``n`` ``torch.chunk`` pieces: ``2 * (local - min(pieces))``.
- ``all-to-all``: a rank sends its local tensor except the piece it keeps (the part
  of its source piece that is also in its destination piece); the busiest rank counts.

A plan's ``bytes_per_rank`` is the sum over its steps.  :func:`plan_redistribution`
picks the plan with the fewest bytes, then the fewest steps, then the first in a fixed
order (outer mesh axes first).

Examples
--------
A float32 ``(10, 8)`` tensor on 4 ranks: rows cut 3, 3, 3, 1 (blocks of 96, 96, 96
and 32 bytes).  Gathering sends ``320 - 32 = 288`` bytes from the busiest rank:

>>> from layout_prop.core.mesh import DeviceMesh
>>> from layout_prop.core.layout import Layout
>>> from layout_prop.core.spec import TensorSpec
>>> mesh = DeviceMesh((4,), ("tp",))
>>> x = TensorSpec((10, 8), "float32", Layout(mesh, ["S(0)"], 2))
>>> plan = plan_redistribution(x, Layout(mesh, ["R"], 2))
>>> plan.to_dict()
{'from': ['S(0)'], 'to': ['R'], 'steps': [{'kind': 'all-gather', 'mesh_axis': 'tp', 'dim': 0, 'bytes_per_rank': 288}], 'bytes_per_rank': 288}

All-to-all to ``S(1)`` (columns cut 2, 2, 2, 2): rank 0 holds 3x8 elements (96 bytes)
and keeps rows 0:3 of columns 0:2 (24 bytes), so it sends 72 bytes; rank 3 sends
``32 - 8 = 24``:

>>> plan_redistribution(x, Layout(mesh, ["S(1)"], 2)).bytes_per_rank
72

All-reduce of a ``P(sum)`` (10, 8) float32: 80 elements in 4 pieces of 20, so
``2 * (320 - 80) = 480`` bytes; reduce-scatter to ``S(0)``: ``320 - 32 = 288``:

>>> p = TensorSpec((10, 8), "float32", Layout(mesh, ["P(sum)"], 2))
>>> redistribution_cost(p, Layout(mesh, ["R"], 2)), redistribution_cost(p, Layout(mesh, ["S(0)"], 2))
(480, 288)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import product
from typing import Iterator, Sequence, Union

from .errors import LayoutError
from .layout import Layout
from .mesh import DeviceMesh
from .placement import Partial, Placement, Replicate, StridedShard, shard_dim
from .spec import TensorSpec, chunk_classes, rank_classes

__all__ = [
    "Step",
    "Redistribution",
    "STEP_KINDS",
    "LOCAL_STEPS",
    "enumerate_plans",
    "plan_redistribution",
    "redistribution_cost",
    "reduce_ops_commute",
    "clear_caches",
    "step_bytes",
    "permute_step",
    "PERMUTE",
]

STEP_KINDS = ("local-slice", "local-partial", "all-gather", "all-to-all", "reduce-scatter", "all-reduce")
#: The step kinds that run on each rank's own data, without communication.
LOCAL_STEPS = ("local-slice", "local-partial")
_KIND_ORDER = {kind: i for i, kind in enumerate(STEP_KINDS)}
#: The point-to-point step kind (XLA's collective-permute, torch's send/recv pairs): never
#: part of a planned redistribution, made by :func:`permute_step` (pipeline stages, rings).
PERMUTE = "permute"

DstLike = Union[Layout, TensorSpec, Sequence]


# --------------------------------------------------------------------------- types
@dataclass(frozen=True)
class Step:
    """One collective (or local slice) along one mesh axis.

    Parameters
    ----------
    kind : str
        ``'local-slice'``, ``'local-partial'``, ``'all-gather'``, ``'all-reduce'``,
        ``'reduce-scatter'`` or ``'all-to-all'``.
    mesh_axis : int
        Index of the mesh axis whose groups run the step.
    src, dst : TensorSpec
        The spec before and after the step; they differ on ``mesh_axis`` only.
    bytes_per_rank : int
        Bytes sent by the busiest rank (module docstring: cost model).
    reduce_op : str, optional
        The reduction of an all-reduce or reduce-scatter; the Partial op a
        ``local-partial`` makes.
    dim : int, optional
        The tensor dim gathered, scattered or sliced; for an all-to-all the dim that was
        sharded.
    dst_dim : int, optional
        For an all-to-all, the dim that becomes sharded.
    shift : int, optional
        For a ``permute`` (point-to-point, :func:`permute_step`): the rank at coordinate
        ``c`` of the mesh axis receives the piece of coordinate ``c - shift``.
    cyclic : bool
        For a ``permute``: coordinates wrap around (a ring); otherwise a rank with no
        sender receives zeros.
    """

    kind: str
    mesh_axis: int
    src: TensorSpec
    dst: TensorSpec
    bytes_per_rank: int
    reduce_op: str | None = None
    dim: int | None = None
    dst_dim: int | None = None
    shift: int | None = None
    cyclic: bool = False

    @property
    def mesh_axis_name(self) -> str:
        return self.src.mesh.names[self.mesh_axis]

    @property
    def group_size(self) -> int:
        return self.src.mesh.shape[self.mesh_axis]

    def to_dict(self) -> dict:
        """JSON form: kind, mesh axis name, the dims and reduce op when set, bytes."""
        out: dict = {"kind": self.kind, "mesh_axis": self.mesh_axis_name}
        if self.dim is not None:
            out["dim"] = self.dim
        if self.dst_dim is not None:
            out["dst_dim"] = self.dst_dim
        if self.reduce_op is not None:
            out["reduce_op"] = self.reduce_op
        if self.shift is not None:
            out["shift"] = self.shift
            out["cyclic"] = self.cyclic
        out["bytes_per_rank"] = self.bytes_per_rank
        return out

    def __str__(self) -> str:
        args = []
        if self.reduce_op is not None:
            args.append(self.reduce_op)
        if self.dim is not None:
            args.append(f"dim={self.dim}")
        if self.dst_dim is not None:
            args.append(f"dst_dim={self.dst_dim}")
        if self.shift is not None:
            args.append(f"shift={self.shift}{', cyclic' if self.cyclic else ''}")
        return f"{self.kind}({', '.join(args)}) on {self.mesh_axis_name!r}: {self.bytes_per_rank} B"


@dataclass(frozen=True)
class Redistribution:
    """A sequence of steps moving ``src`` to ``dst`` (same tensor, same mesh).

    Parameters
    ----------
    src, dst : TensorSpec
        The tensor before and after.
    steps : tuple of Step
        In execution order; each step's ``src`` is the previous step's ``dst``.
    """

    src: TensorSpec
    dst: TensorSpec
    steps: tuple[Step, ...]

    @property
    def bytes_per_rank(self) -> int:
        """Sum of the steps' bytes sent by the busiest rank."""
        return sum(step.bytes_per_rank for step in self.steps)

    @property
    def is_free(self) -> bool:
        """True when no step communicates (no steps, or local slices and local partials only)."""
        return all(step.kind in LOCAL_STEPS for step in self.steps)

    def to_dict(self) -> dict:
        return {
            "from": self.src.layout.placement_strs(),
            "to": self.dst.layout.placement_strs(),
            "steps": [step.to_dict() for step in self.steps],
            "bytes_per_rank": self.bytes_per_rank,
        }

    def sort_key(self) -> tuple:
        """Fewest bytes, then fewest steps, then outer mesh axes and cheaper kinds first."""
        return (
            self.bytes_per_rank,
            len(self.steps),
            tuple(
                (s.mesh_axis, _KIND_ORDER[s.kind], -1 if s.dim is None else s.dim,
                 -1 if s.dst_dim is None else s.dst_dim)
                for s in self.steps
            ),
        )

    def __str__(self) -> str:
        head = f"{self.src} -> {self.dst.layout}: {self.bytes_per_rank} B"
        return "\n  ".join([head] + [str(s) for s in self.steps])


# --------------------------------------------------------------------------- public API
def enumerate_plans(src: TensorSpec, dst: DstLike) -> list[Redistribution]:
    """Every valid plan from ``src`` to the layout ``dst``, cheapest first.

    Parameters
    ----------
    src : TensorSpec
        The tensor as it is.
    dst : Layout, TensorSpec or sequence of placements
        The layout wanted (a TensorSpec contributes its layout; a sequence of placements
        is read on ``src``'s mesh).

    Returns
    -------
    list of Redistribution
        Sorted by :meth:`Redistribution.sort_key`; the first is :func:`plan_redistribution`'s.

    Raises
    ------
    LayoutError
        ``no-redistribution`` when no plan exists; ``invalid-layout`` when ``dst`` is not
        a valid layout for the tensor.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> x = TensorSpec((4, 6), "float32", Layout(mesh, ["S(0)"], 2))
    >>> [[s.kind for s in p.steps] for p in enumerate_plans(x, Layout(mesh, ["S(1)"], 2))]
    [['all-to-all'], ['all-gather', 'local-slice']]
    """
    spec, layout = _normalise(src, dst)
    return list(_enumerate(spec, layout))


def plan_redistribution(src: TensorSpec, dst: DstLike) -> Redistribution:
    """The plan with the fewest bytes per rank; ties: fewer steps, then a fixed order.

    Parameters and errors as in :func:`enumerate_plans`.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
    >>> x = TensorSpec((4, 4), "float32", Layout(mesh, ["S(0)", "S(1)"], 2))
    >>> [str(s) for s in plan_redistribution(x, Layout(mesh, ["S(1)", "S(0)"], 2)).steps]
    ["all-gather(dim=0) on 'dp': 16 B", "all-to-all(dim=1, dst_dim=0) on 'tp': 16 B", "local-slice(dim=1) on 'dp': 0 B"]
    """
    if type(src) is TensorSpec and type(dst) is Layout:
        return _best_plan(src, dst)  # the common call, from passes: remembered
    spec, layout = _normalise(src, dst)
    return _enumerate(spec, layout)[0]


def clear_caches() -> None:
    """Forget the remembered plans (benchmarks call it to start cold)."""
    _best_plan.cache_clear()
    _enumerate.cache_clear()


@lru_cache(maxsize=4096)
def _best_plan(src: TensorSpec, dst: Layout) -> Redistribution:
    spec, layout = _normalise(src, dst)
    return _enumerate(spec, layout)[0]


def redistribution_cost(src: TensorSpec, dst: DstLike) -> int:
    """Bytes sent per rank by :func:`plan_redistribution`'s plan."""
    return plan_redistribution(src, dst).bytes_per_rank


def reduce_ops_commute(a: str, b: str) -> bool:
    """Whether reducing by ``a`` then ``b`` equals reducing by ``b`` then ``a``.

    >>> reduce_ops_commute("sum", "avg"), reduce_ops_commute("max", "sum"), reduce_ops_commute("min", "min")
    (True, False, True)
    """
    return a == b or {a, b} == {"sum", "avg"}


# --------------------------------------------------------------------------- planning
def _normalise(src: TensorSpec, dst: DstLike) -> tuple[TensorSpec, Layout]:
    if not isinstance(src, TensorSpec):
        raise TypeError(f"src must be a TensorSpec, got {type(src).__name__}")
    if isinstance(dst, TensorSpec):
        layout = dst.layout
        if dst.shape != src.shape:
            raise LayoutError(
                "no-redistribution",
                f"cannot redistribute shape {list(src.shape)} to a tensor of shape {list(dst.shape)}",
                hint="a redistribution moves one tensor; reshape it instead",
            )
    elif isinstance(dst, Layout):
        layout = dst
    else:
        layout = Layout(src.mesh, dst, src.ndim)
    if layout.mesh != src.mesh:
        raise LayoutError(
            "no-redistribution",
            f"cannot redistribute {src} from {src.mesh} to a layout {layout} on {layout.mesh}",
            hint="a redistribution moves a tensor within one mesh",
        )
    if layout.ndim != src.ndim:
        raise LayoutError(
            "invalid-layout",
            f"target layout {layout} has rank {layout.ndim} but the tensor {src} has rank {src.ndim}",
            hint="the layout must describe every dim of the tensor",
        )
    return src, layout


def _no_plan(src: TensorSpec, dst: Layout, why: str, hint: str) -> LayoutError:
    return LayoutError(
        "no-redistribution",
        f"cannot redistribute {src.dtype}{list(src.shape)} from {src.layout} to {dst}: {why}",
        hint=hint,
    )


def _shard_dim(p: Placement) -> int | None:
    return shard_dim(p)


def _axis_moves(src: TensorSpec, dst: Layout) -> list[list[tuple[Placement, ...]]]:
    """Per mesh axis, the alternative sequences of placements it goes through.

    Size-1 axes get one empty sequence (they are relabelled, module docstring).
    """
    mesh = src.mesh
    s, t = src.layout.placements, dst.placements
    options: list[list[tuple[Placement, ...]]] = []
    touched: set[int] = set()  # tensor dims whose cut changes on some outer axis
    for axis in range(mesh.ndim):
        a, b = s[axis], t[axis]
        if mesh.shape[axis] == 1:
            options.append([()])
            continue
        if a == b:
            if _shard_dim(a) is not None and a.dim in touched:
                options.append([(Replicate(), a)])  # refresh: gather, then slice again
            else:
                options.append([()])
            continue
        if isinstance(b, Partial):
            if isinstance(a, Partial):
                raise _no_plan(
                    src, dst,
                    f"mesh axis {src.layout.describe_axis(axis)} would go {a} -> {b}",
                    "terms of one reduction are not terms of another; reduce the Partial value "
                    "first (target R or S on that axis), or keep its reduce op",
                )
            if _shard_dim(a) is not None:
                touched.add(a.dim)
                options.append([(Replicate(), b)])  # gather, then make the terms locally
            else:
                options.append([(b,)])
            continue
        for p in (a, b):
            if _shard_dim(p) is not None:
                touched.add(p.dim)
        if isinstance(b, Replicate):
            options.append([(b,)])
        elif isinstance(a, Replicate):
            options.append([(b,)])
        elif isinstance(a, StridedShard) or isinstance(b, StridedShard):
            options.append([(Replicate(), b)])  # a strided shard is only gathered or sliced
        else:  # S -> S(e) or P -> S(e)
            options.append([(b,), (Replicate(), b)])
    return options


def _move_problem(mesh: DeviceMesh, state: tuple[Placement, ...], axis: int, new: Placement) -> str | None:
    """Why changing ``axis`` from its placement in ``state`` to ``new`` is invalid now, or None."""
    old = state[axis]
    for dim in {_shard_dim(old), _shard_dim(new)} - {None}:
        for inner in range(axis + 1, mesh.ndim):
            if mesh.shape[inner] > 1 and _shard_dim(state[inner]) == dim:
                return f"inner mesh axis {mesh.names[inner]!r} still cuts dim {dim}"
    if isinstance(old, Partial):
        for inner in range(axis + 1, mesh.ndim):
            p = state[inner]
            if mesh.shape[inner] > 1 and isinstance(p, Partial) and not reduce_ops_commute(old.reduce_op, p.reduce_op):
                return f"inner mesh axis {mesh.names[inner]!r} is still {p}, which must be reduced first"
    return None


def _step_kind(old: Placement, new: Placement) -> str:
    if isinstance(new, Partial):
        return "local-partial"  # only ever from Replicate (_axis_moves)
    if isinstance(old, Partial):
        return "all-reduce" if isinstance(new, Replicate) else "reduce-scatter"
    if isinstance(old, Replicate):
        return "local-slice"
    return "all-gather" if isinstance(new, Replicate) else "all-to-all"


def _make_step(src: TensorSpec, axis: int, new: Placement) -> Step | None:
    """The step changing ``axis`` of ``src`` to ``new``, or None if the result is not a valid spec."""
    try:
        dst = src.with_layout(src.layout.with_placement(axis, new))
    except LayoutError:
        return None
    old = src.layout.placements[axis]
    kind = _step_kind(old, new)
    reduce_op = old.reduce_op if isinstance(old, Partial) else new.reduce_op if isinstance(new, Partial) else None
    if kind == "all-to-all":
        dim, dst_dim = old.dim, new.dim
    else:
        dim, dst_dim = _shard_dim(new) if _shard_dim(new) is not None else _shard_dim(old), None
    nbytes = step_bytes(kind, src, dst, axis)
    return Step(kind, axis, src, dst, nbytes, reduce_op, dim, dst_dim)


@lru_cache(maxsize=512)
def _enumerate(src: TensorSpec, dst: Layout) -> tuple[Redistribution, ...]:
    dst_spec = src.with_layout(dst)  # raises invalid-layout for an impossible target
    mesh = src.mesh
    start_placements = tuple(
        dst.placements[a] if mesh.shape[a] == 1 else p for a, p in enumerate(src.layout.placements)
    )
    start = src.with_layout(Layout(mesh, start_placements, src.ndim))
    options = _axis_moves(src, dst)
    step_cache: dict[tuple, Step | None] = {}

    def step_for(spec: TensorSpec, axis: int, new: Placement) -> Step | None:
        key = (spec.layout.placements, axis, new)
        if key not in step_cache:
            problem = _move_problem(mesh, spec.layout.placements, axis, new)
            step_cache[key] = None if problem else _make_step(spec, axis, new)
        return step_cache[key]

    def orders(spec: TensorSpec, remaining: tuple[tuple[Placement, ...], ...]) -> Iterator[tuple[Step, ...]]:
        if not any(remaining):
            yield ()
            return
        for axis, moves in enumerate(remaining):
            if not moves:
                continue
            step = step_for(spec, axis, moves[0])
            if step is None:
                continue
            rest = remaining[:axis] + (moves[1:],) + remaining[axis + 1:]
            for tail in orders(step.dst, rest):
                yield (step,) + tail

    plans = [
        Redistribution(src, dst_spec, steps)
        for combo in product(*options)
        for steps in orders(start, tuple(combo))
    ]
    if not plans:
        raise _no_plan(src, dst, _why_no_order(src, dst),
                       "reduce the inner Partial axis first in an earlier redistribution, "
                       "or choose a target that keeps the Partial axes that cannot be reduced")
    plans.sort(key=Redistribution.sort_key)
    return tuple(plans)


def _why_no_order(src: TensorSpec, dst: Layout) -> str:
    mesh, s, t = src.mesh, src.layout.placements, dst.placements
    for i in range(mesh.ndim):
        if mesh.shape[i] == 1 or not isinstance(s[i], Partial) or s[i] == t[i]:
            continue
        for j in range(i + 1, mesh.ndim):
            if (mesh.shape[j] > 1 and isinstance(s[j], Partial) and s[j] == t[j]
                    and not reduce_ops_commute(s[i].reduce_op, s[j].reduce_op)):
                return (f"reducing {s[i]} on mesh axis {mesh.names[i]!r} needs the inner {s[j]} on "
                        f"{mesh.names[j]!r} reduced first (the value is {s[i].reduce_op} of {s[j].reduce_op}), "
                        f"but the target keeps it Partial")
    return "no order of steps keeps every intermediate layout valid"


# --------------------------------------------------------------------------- cost model
def step_bytes(kind: str, src: TensorSpec, dst: TensorSpec, axis: int) -> int:
    """Bytes sent by the busiest rank for one step (module docstring: cost model).

    Parameters
    ----------
    kind : str
        The step kind.
    src, dst : TensorSpec
        The specs before and after; they differ on ``axis`` only.
    axis : int
        The mesh axis whose groups run the step.

    Computed per class of alike ranks (:func:`~layout_prop.core.spec.rank_classes`), not per
    rank: a group along ``axis`` is one choice of class on every other axis, and holds each
    class of ``axis`` as many times as that class has coordinates.
    """
    mesh = src.mesh
    n = mesh.shape[axis]
    if kind in LOCAL_STEPS or n == 1:
        return 0
    if kind not in _SENT:
        raise ValueError(f"unknown step kind {kind!r}")
    if kind == "all-to-all" and not _nested(src, dst, axis):
        return _step_bytes_per_rank(kind, src, dst, axis)  # (no valid plan makes one: exact, rank by rank)
    starts = rank_classes((src, dst), mesh)
    along = starts[axis]
    counts = [b - a for a, b in zip(along, along[1:] + (n,))]
    sent = _SENT[kind]
    worst = 0
    for other in product(*((None,) if b == axis else s for b, s in enumerate(starts))):
        coords = list(other)
        members = []  # the lowest rank of each class of axis, in this group
        for c in along:
            coords[axis] = c
            members.append(mesh.rank(coords))
        worst = max(worst, sent(src, dst, n, members, counts))
    return int(worst)


def _all_gather_sent(src: TensorSpec, dst: TensorSpec, n: int, members: list[int], counts: list[int]) -> int:
    blocks = [src.local_nbytes(r) for r in members]
    return sum(b * m for b, m in zip(blocks, counts)) - min(blocks)  # every block but the smallest


def _reduce_scatter_sent(src: TensorSpec, dst: TensorSpec, n: int, members: list[int], counts: list[int]) -> int:
    return src.local_nbytes(members[0]) - min(dst.local_nbytes(r) for r in members)


def _all_reduce_sent(src: TensorSpec, dst: TensorSpec, n: int, members: list[int], counts: list[int]) -> int:
    item = src.itemsize
    numel = src.local_nbytes(members[0]) // item
    smallest = min(size for _, size in chunk_classes(numel, n))  # the smallest of the n torch.chunk pieces
    return 2 * (numel - smallest) * item


def _all_to_all_sent(src: TensorSpec, dst: TensorSpec, n: int, members: list[int], counts: list[int]) -> int:
    item = src.itemsize
    return max(src.local_nbytes(r) - _overlap(src, dst, r) * item for r in members)


_SENT = {"all-gather": _all_gather_sent, "reduce-scatter": _reduce_scatter_sent, "all-reduce": _all_reduce_sent,
         "all-to-all": _all_to_all_sent}


def _nested(src: TensorSpec, dst: TensorSpec, axis: int) -> bool:
    """Whether every rank's source and destination pieces contain one another dim by dim (an
    all-to-all as plans make it: ``S(d) -> S(e)`` on ``axis``, no inner axis cutting ``d`` or
    ``e``, no strided shard), so that their overlap depends on the pieces' lengths only."""
    if src.layout.has_strided or dst.layout.has_strided:
        return False
    mesh = src.mesh
    a, b = src.layout.placements[axis], dst.layout.placements[axis]
    dims = {_shard_dim(a), _shard_dim(b)} - {None}
    for inner in range(axis + 1, mesh.ndim):
        if mesh.shape[inner] > 1 and (_shard_dim(src.layout.placements[inner]) in dims
                                      or _shard_dim(dst.layout.placements[inner]) in dims):
            return False
    return all(p == q for i, (p, q) in enumerate(zip(src.layout.placements, dst.layout.placements)) if i != axis)


def _step_bytes_per_rank(kind: str, src: TensorSpec, dst: TensorSpec, axis: int) -> int:
    """:func:`step_bytes` rank by rank, over every group (for steps no plan makes)."""
    n = src.mesh.shape[axis]
    worst = 0
    for group in src.mesh.groups(axis):
        worst = max(worst, _SENT[kind](src, dst, n, list(group), [1] * n))
    return int(worst)


def _overlap(a: TensorSpec, b: TensorSpec, rank: int) -> int:
    """Elements that ``rank`` holds under both specs."""
    if a.layout.has_strided or b.layout.has_strided:
        import numpy as np

        coords = a.mesh.coords(rank)
        return int(np.prod([len(np.intersect1d(a.dim_indices(d, coords), b.dim_indices(d, coords)))
                            for d in range(a.ndim)], dtype=np.int64))
    count = 1
    for (lo1, hi1), (lo2, hi2) in zip(a.local_slices(rank), b.local_slices(rank)):
        count *= max(0, min(hi1, hi2) - max(lo1, lo2))
    return int(count)



# --------------------------------------------------------------------------- point-to-point
def permute_step(spec: TensorSpec, mesh_axis: int | str, shift: int = 1, cyclic: bool = False,
                 dst: TensorSpec | None = None) -> Step:
    """A point-to-point ``permute`` step: along mesh axis ``mesh_axis``, the ranks at coordinate
    ``c`` receive the pieces of the ranks at coordinate ``c - shift``, every other coordinate equal.

    XLA calls it collective-permute; torch writes it as send/recv pairs.  With ``cyclic`` the
    coordinates wrap (a ring, as ring attention passes K/V); otherwise a rank whose sender
    would lie outside the axis receives zeros of its local shape (a pipeline's first stage
    receives nothing from before it).

    Parameters
    ----------
    spec : TensorSpec
        The value moved; every rank's piece has this spec's local shape.
    mesh_axis : int or str
        The axis index or name.
    shift : int
        Coordinates moved, positive or negative (``1``: stage ``s`` to ``s + 1``); not 0
        modulo the axis size.
    cyclic : bool
        Wrap around the axis.
    dst : TensorSpec, optional
        The spec after the move (default ``spec``): a ring shifting shards may relabel them;
        every rank's local shape must be its sender's.

    Returns
    -------
    Step
        ``kind='permute'``, ``shift``, ``cyclic``; ``bytes_per_rank`` the largest piece a
        sending rank sends (one link transfer per rank).

    Raises
    ------
    LayoutError
        ``bad-permute`` for a shift of 0 (mod the axis size for a ring), an axis not in the
        mesh, or a ``dst`` whose local shapes are not the senders'.

    Examples
    --------
    >>> from layout_prop.core.mesh import DeviceMesh
    >>> from layout_prop.core.layout import Layout
    >>> mesh = DeviceMesh((2, 2), ("pp", "tp"))
    >>> x = TensorSpec((4, 8), "float32", Layout(mesh, ["R", "S(1)"], 2))
    >>> step = permute_step(x, "pp")
    >>> step.to_dict()
    {'kind': 'permute', 'mesh_axis': 'pp', 'shift': 1, 'cyclic': False, 'bytes_per_rank': 64}
    """
    mesh = spec.mesh
    if isinstance(mesh_axis, str):
        if mesh_axis not in mesh.names:
            raise LayoutError("bad-permute", f"no mesh axis {mesh_axis!r} to permute along (mesh {mesh})",
                              hint=f"use one of {', '.join(mesh.names)}")
        mesh_axis = mesh.names.index(mesh_axis)
    if not 0 <= mesh_axis < mesh.ndim:
        raise LayoutError("bad-permute", f"mesh axis {mesh_axis} out of range for {mesh}",
                          hint=f"use 0..{mesh.ndim - 1}")
    n = mesh.shape[mesh_axis]
    if shift == 0 or (cyclic and shift % n == 0):
        raise LayoutError("bad-permute", f"a permute by {shift} on axis {mesh.names[mesh_axis]!r} of size {n} "
                          f"moves nothing", hint="shift by a non-zero amount, not a multiple of the axis size")
    dst = spec if dst is None else dst
    sent = 0
    for rank in range(mesh.size):
        coords = list(mesh.coords(rank))
        target = coords[mesh_axis] + shift
        if cyclic:
            target %= n
        elif not 0 <= target < n:
            continue  # this rank sends nothing
        coords[mesh_axis] = target
        receiver = mesh.rank(coords)
        if tuple(dst.local_shape(receiver)) != tuple(spec.local_shape(rank)):
            raise LayoutError("bad-permute", f"rank {receiver} would receive a piece of shape "
                              f"{list(spec.local_shape(rank))} from rank {rank} but holds "
                              f"{list(dst.local_shape(receiver))}", hint="a permute moves pieces of equal shapes")
        sent = max(sent, spec.local_nbytes(rank))
    return Step(PERMUTE, mesh_axis, spec, dst, sent, shift=int(shift), cyclic=bool(cyclic))
