"""Layout: a mesh, one placement per mesh axis, and the tensor rank.

Also the MindSpore / hyper-parallel ``tensor_map`` view: one entry per tensor dim, ``-1``
for not sharded, ``k`` for mesh axis ``mesh.ndim - 1 - k``, a tuple for several mesh
axes (outer axis first).

Examples
--------
>>> from layout_prop.core.mesh import DeviceMesh
>>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
>>> lay = Layout(mesh, ["S(0)", "S(1)"], 4)
>>> lay.tensor_map()
(1, 0, -1, -1)
>>> Layout.from_tensor_map(mesh, [1, 0, -1, -1]) == lay
True
>>> str(Layout(mesh, ["S(-1)", "P"], 3))
'(S(2), P(sum))'
>>> Layout.from_tensor_map(mesh, [(1, 0), -1]).placements
(Shard(dim=0), Shard(dim=0))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from .errors import LayoutError
from .mesh import DeviceMesh
from .placement import Partial, Placement, Replicate, Shard, StridedShard, parse_placement, shard_dim

__all__ = ["Layout"]


def _ordered_shards(mesh: DeviceMesh, dim: int, axes: Sequence[int]) -> list[Placement]:
    """The placements of mesh ``axes`` cutting ``dim`` in that order, the first one major (a tensor_map entry).

    Mesh order (outer axis first) is plain shards.  An axis cut after an inner axis (``(0, 2)`` on three
    mesh axes: the inner axis 2 picks the major blocks) is a strided shard ``_S(dim,k)``, ``k`` the
    product of the sizes of the inner axes before it: its chunk of each of their ``k`` blocks.

    >>> [str(p) for p in _ordered_shards(DeviceMesh((2, 3, 4), ("a", "b", "c")), 0, [2, 0])]
    ['S(0)', '_S(0,4)']
    """
    out = []
    for i, axis in enumerate(axes):
        k = math.prod(mesh.shape[a] for a in axes[:i] if a > axis)
        out.append(StridedShard(dim, k) if k > 1 else Shard(dim))
    return out


@dataclass(frozen=True)
class Layout:
    """How a tensor of rank ``ndim`` is spread over ``mesh``.

    Parameters
    ----------
    mesh : DeviceMesh
    placements : sequence of Placement or str
        One per mesh axis; negative ``Shard`` dims are normalised.
    ndim : int
        The tensor rank (needed to normalise and check shard dims).
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    ndim: int

    def __init__(self, mesh: DeviceMesh, placements: Iterable, ndim: int) -> None:
        placements = tuple(parse_placement(p) for p in placements)
        if len(placements) != mesh.ndim:
            raise LayoutError(
                "invalid-layout",
                f"{len(placements)} placements {[str(p) for p in placements]} for a mesh of "
                f"{mesh.ndim} axes {list(mesh.names)}",
                hint="give exactly one placement per mesh axis",
            )
        norm = []
        strided = False
        for axis, p in enumerate(placements):
            if isinstance(p, (Shard, StridedShard)):
                d = p.dim
                if not -ndim <= d < ndim:
                    raise LayoutError(
                        "invalid-layout",
                        f"{p} on mesh axis {mesh.names[axis]!r} is out of range for a tensor of rank {ndim}",
                        hint=f"shard a dim in {-ndim}..{ndim - 1}" if ndim else "a scalar cannot be sharded",
                    )
                if isinstance(p, Shard):
                    p = Shard(d % ndim)
                else:
                    p = StridedShard(d % ndim, p.split_factor)
                    strided = True
            norm.append(p)
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "placements", tuple(norm))
        object.__setattr__(self, "ndim", int(ndim))
        object.__setattr__(self, "has_strided", strided)
        object.__setattr__(self, "_hash", hash((mesh, self.placements, self.ndim)))

    # ----------------------------------------------------------------- constructors

    def __hash__(self) -> int:  # computed once: specs key the rule cache
        return self._hash
    @classmethod
    def replicated(cls, mesh: DeviceMesh, ndim: int) -> "Layout":
        return cls(mesh, [Replicate()] * mesh.ndim, ndim)

    @classmethod
    def from_tensor_map(cls, mesh: DeviceMesh, tensor_map: Sequence, partial: dict | None = None) -> "Layout":
        """Build a layout from a MindSpore ``tensor_map``; ``partial`` maps mesh axis -> reduce op.

        An entry of several mesh axes cuts the dim in that order, the first one major: mesh
        order (outer axis first, larger tensor_map value first) is plain shards, an inner axis
        first makes the outer ones strided shards (see :func:`_ordered_shards`).
        """
        placements: list[Placement] = [Replicate()] * mesh.ndim
        used: dict[int, int] = {}
        for dim, entry in enumerate(tensor_map):
            entries = list(entry) if isinstance(entry, (list, tuple)) else [entry]
            axes = []
            for k in entries:
                if isinstance(k, bool) or not isinstance(k, int):
                    raise LayoutError("invalid-layout", f"tensor_map entry {entry!r} for dim {dim} is not an integer",
                                      hint="use -1, k, or a list of k")
                if k == -1:
                    if len(entries) > 1:
                        raise LayoutError("invalid-layout", f"tensor_map entry {entry!r} mixes -1 with mesh axes",
                                          hint="write -1 alone for an unsharded dim")
                    continue
                if not 0 <= k < mesh.ndim:
                    raise LayoutError(
                        "invalid-layout",
                        f"tensor_map entry {k} for dim {dim} names no mesh axis (mesh has {mesh.ndim} axes)",
                        hint=f"use -1 or 0..{mesh.ndim - 1}; k means mesh axis ndim-1-k",
                    )
                axis = mesh.ndim - 1 - k
                if axis in used:
                    raise LayoutError(
                        "invalid-layout",
                        f"mesh axis {mesh.names[axis]!r} (tensor_map {k}) shards both dim {used[axis]} and dim {dim}",
                        hint="use each mesh axis at most once",
                    )
                used[axis] = dim
                axes.append(axis)
            for axis, placement in zip(axes, _ordered_shards(mesh, dim, axes)):
                placements[axis] = placement
        for axis, op in (partial or {}).items():
            a = mesh.axis_index(axis)
            if not isinstance(placements[a], Replicate):
                raise LayoutError("invalid-layout", f"mesh axis {mesh.names[a]!r} is both sharding and Partial",
                                  hint="a mesh axis is either Shard, Replicate or Partial")
            placements[a] = Partial(op)
        return cls(mesh, placements, len(tensor_map))

    # ----------------------------------------------------------------- views
    def tensor_map(self) -> tuple:
        """The MindSpore tensor_map: ints, or tuples of ints when several axes shard a dim.

        The inverse of :meth:`from_tensor_map`: a dim cut by several mesh axes is written in the
        order that cuts it so, outer axis first where that does (plain shards); strided shards
        that an inner axis first made are written that way (``(_S(0,2), S(0))`` on a 2 x 2 mesh
        is ``((0, 1),)``).  Raises ``unsupported-layout`` for a strided shard that no order of
        axes makes (a tensor_map entry cuts its dim by its axes in turn, the first one major).

        >>> from layout_prop.core.mesh import DeviceMesh
        >>> Layout(DeviceMesh((2, 2), ("dp", "tp")), ["_S(0,2)", "S(0)"], 1).tensor_map()
        ((0, 1),)
        """
        out = []
        for d in range(self.ndim):
            axes = self._cut_order(d)
            if axes is None:
                axis = next(a for a in self.cut_axes(d) if isinstance(self.placements[a], StridedShard))
                raise LayoutError(
                    "unsupported-layout",
                    f"{self} has the strided shard {self.placements[axis]} on mesh axis {self.mesh.names[axis]!r}, "
                    f"which no MindSpore tensor_map expresses (an entry cuts a dim by its mesh axes in turn, the "
                    f"first one major)",
                    hint="gather that mesh axis (R) or reshape back to the unmerged dims before exporting a "
                    "tensor_map")
            ks = tuple(self.mesh.ndim - 1 - a for a in axes)
            out.append(-1 if not ks else ks[0] if len(ks) == 1 else ks)
        return tuple(out)

    def _cut_order(self, dim: int) -> tuple[int, ...] | None:
        """The order of the mesh axes cutting ``dim`` that :func:`_ordered_shards` turns into this
        layout's placements (outer axis first where several orders do), or None if no order does."""
        want = {a: self.placements[a] for a in self.cut_axes(dim)}

        def extend(chosen: tuple[int, ...]) -> tuple[int, ...] | None:
            if len(chosen) == len(want):
                return chosen
            for axis in want:  # outer first: a plain layout is mesh order at the first try
                if axis in chosen:
                    continue
                k = math.prod(self.mesh.shape[a] for a in chosen if a > axis)
                if want[axis] == (StridedShard(dim, k) if k > 1 else Shard(dim)):
                    found = extend(chosen + (axis,))
                    if found is not None:
                        return found
            return None

        return extend(())

    def dim_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes that ``Shard`` tensor dim ``dim``, outer first (strided shards: :meth:`cut_axes`)."""
        dim = dim % self.ndim if self.ndim else dim
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim)

    def cut_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes that cut tensor dim ``dim``, by ``Shard`` or ``StridedShard``, outer first."""
        dim = dim % self.ndim if self.ndim else dim
        return tuple(a for a, p in enumerate(self.placements) if shard_dim(p) == dim)

    def strided_axes(self) -> tuple[int, ...]:
        """Mesh axes holding a ``StridedShard``."""
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, StridedShard))

    def sharded_dims(self) -> dict[int, tuple[int, ...]]:
        """Map of ``Shard``-ed tensor dim -> mesh axes, outer first (strided shards not included)."""
        out: dict[int, tuple[int, ...]] = {}
        for a, p in enumerate(self.placements):
            if isinstance(p, Shard):
                out[p.dim] = out.get(p.dim, ()) + (a,)
        return out

    def partial_axes(self) -> dict[int, str]:
        """Map of mesh axis -> reduce op for Partial axes."""
        return {a: p.reduce_op for a, p in enumerate(self.placements) if isinstance(p, Partial)}

    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def shard_count(self, dim: int) -> int:
        """How many pieces dim ``dim`` is cut into."""
        n = 1
        for a in self.dim_axes(dim):
            n *= self.mesh.shape[a]
        return n

    # ----------------------------------------------------------------- edits
    def with_placement(self, axis: int | str, placement) -> "Layout":
        a = self.mesh.axis_index(axis)
        ps = list(self.placements)
        ps[a] = parse_placement(placement)
        return Layout(self.mesh, ps, self.ndim)

    def with_placements(self, placements) -> "Layout":
        return Layout(self.mesh, placements, self.ndim)

    def placement_strs(self) -> list[str]:
        return [str(p) for p in self.placements]

    def describe_axis(self, axis: int) -> str:
        return f"{self.mesh.names[axis]!r} (mesh axis {axis})"

    def __str__(self) -> str:
        return "(" + ", ".join(str(p) for p in self.placements) + ")"
