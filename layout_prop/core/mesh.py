"""The device mesh: an n-dimensional grid of ranks with named axes.

Examples
--------
>>> mesh = DeviceMesh((2, 2, 2), ("dp", "tp", "sp"))
>>> mesh.size
8
>>> mesh.coords(5)
(1, 0, 1)
>>> mesh.rank((1, 0, 1))
5
>>> mesh.groups("tp")
((0, 2), (1, 3), (4, 6), (5, 7))
>>> mesh.group(5, "sp")
(4, 5)
>>> str(mesh)
'DeviceMesh(dp=2, tp=2, sp=2)'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from itertools import product

import numpy as np

from .errors import LayoutError, cut

__all__ = ["DeviceMesh", "MAX_RANKS", "MAX_MESH_AXES", "MAX_TENSOR_RANK"]

#: the most ranks a mesh may have (2^16). Analysis (check, explain, viz, lower) visits classes
#: of alike ranks (``rank_classes`` in spec.py), not every rank: mostly a handful per mesh axis,
#: so its time grows with the graph far more than with the rank count; execution (run) runs
#: every rank, and refuses up front what it estimates past --max-time or the memory.
MAX_RANKS = 2 ** 16
#: the most axes a mesh may have: numpy 1.x's limit on an array's dims (32; MindSpore needs
#: numpy < 2), which the executors reach (the array of a mesh's ranks has one dim per axis)
MAX_MESH_AXES = 32
#: the most dims a tensor may have: numpy 1.x indexes an array with at most 31 index arrays,
#: and a rank's piece of a strided shard is indexed with one per dim
MAX_TENSOR_RANK = 31


@dataclass(frozen=True)
class DeviceMesh:
    """A mesh of ``prod(shape)`` ranks, row-major: rank r sits at ``unravel_index(r, shape)``.

    Parameters
    ----------
    shape : tuple of int
        The size of each mesh axis, all positive.
    names : tuple of str
        One distinct name per axis.
    """

    shape: tuple[int, ...]
    names: tuple[str, ...]

    def __init__(self, shape, names=None) -> None:
        shape = tuple(shape)
        if names is None:
            names = tuple(f"axis{i}" for i in range(len(shape)))
        names = tuple(names)
        if not shape:
            raise LayoutError("invalid-mesh", "a mesh needs at least one axis", hint="give a shape such as [2, 2]")
        if len(shape) > MAX_MESH_AXES:
            raise LayoutError("too-many-dims", f"mesh {cut(list(shape))} has {len(shape)} axes, over the limit "
                              f"{MAX_MESH_AXES}", hint=f"use a mesh of at most {MAX_MESH_AXES} axes (axes of size 1 "
                              "can be dropped)")
        for i, size in enumerate(shape):
            if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
                raise LayoutError(
                    "invalid-mesh",
                    f"mesh axis {i} has size {size!r}; sizes must be positive integers",
                    hint="give every mesh axis a size of at least 1",
                )
        ranks = math.prod(int(s) for s in shape)
        if ranks > MAX_RANKS:
            count = str(ranks) if ranks.bit_length() < 100 else f"about 2^{ranks.bit_length() - 1}"
            raise LayoutError("too-many-ranks", f"mesh {cut(list(shape))} has {count} ranks, over the limit "
                              f"{MAX_RANKS} (2^16)", hint=f"use a mesh of at most {MAX_RANKS} ranks")
        if len(names) != len(shape):
            raise LayoutError(
                "invalid-mesh",
                f"mesh has {len(shape)} axes but {len(names)} names {list(names)}",
                hint="give exactly one name per mesh axis",
            )
        for name in names:
            if not isinstance(name, str) or not name:
                raise LayoutError("invalid-mesh", f"mesh axis name {name!r} is not a non-empty string",
                                  hint="name axes like dp, tp, sp")
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise LayoutError("invalid-mesh", f"mesh axis names {dup} are used more than once",
                              hint="give every mesh axis a distinct name")
        object.__setattr__(self, "shape", tuple(int(s) for s in shape))
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "_hash", hash((self.shape, self.names)))
        object.__setattr__(self, "_size", ranks)


    def __hash__(self) -> int:  # computed once: specs key the rule cache
        return self._hash
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return self._size

    def axis_index(self, axis: int | str) -> int:
        """The index of a mesh axis given by name or index."""
        if isinstance(axis, str):
            if axis not in self.names:
                raise LayoutError("unknown-mesh-axis", f"mesh has no axis {axis!r}; axes are {list(self.names)}",
                                  hint="use one of the mesh's axis names")
            return self.names.index(axis)
        if not -self.ndim <= axis < self.ndim:
            raise LayoutError("unknown-mesh-axis", f"mesh axis index {axis} out of range for {self.ndim} axes",
                              hint="use an index in range or an axis name")
        return axis % self.ndim

    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of ``rank`` (row-major)."""
        self.check_rank(rank)
        coords = []
        for size in reversed(self.shape):
            rank, c = divmod(rank, size)
            coords.append(c)
        return tuple(reversed(coords))

    def check_rank(self, rank: int) -> None:
        """Raise ``invalid-rank`` unless ``0 <= rank < size``."""
        if not 0 <= rank < self._size:
            raise LayoutError("invalid-rank", f"rank {cut(rank)} is outside the mesh of {self._size} ranks",
                              hint=f"use a rank in 0..{self._size - 1}")

    def rank(self, coords) -> int:
        """The rank at ``coords``."""
        coords = tuple(coords)
        if len(coords) != self.ndim or any(not 0 <= c < s for c, s in zip(coords, self.shape)):
            raise LayoutError("invalid-rank", f"coordinates {list(coords)} are outside the mesh {list(self.shape)}",
                              hint=f"give {self.ndim} coordinates, each below its axis size")
        rank = 0
        for c, size in zip(coords, self.shape):  # row-major (numpy's ravel_multi_index stops short of 32 axes)
            rank = rank * size + int(c)
        return rank

    @cached_property
    def _groups(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        ranks = np.arange(self.size).reshape(self.shape)
        out = []
        for axis in range(self.ndim):
            moved = np.moveaxis(ranks, axis, -1).reshape(-1, self.shape[axis])
            out.append(tuple(tuple(int(r) for r in row) for row in moved))
        return tuple(out)

    def groups(self, axis: int | str) -> tuple[tuple[int, ...], ...]:
        """All rank groups along ``axis``: ranks that differ only in that coordinate."""
        return self._groups[self.axis_index(axis)]

    def group(self, rank: int, axis: int | str) -> tuple[int, ...]:
        """The group along ``axis`` that contains ``rank``, in coordinate order."""
        a = self.axis_index(axis)
        coords = list(self.coords(rank))
        out = []
        for i in range(self.shape[a]):
            coords[a] = i
            out.append(self.rank(coords))
        return tuple(out)

    def submesh(self, axes) -> "DeviceMesh":
        """The mesh made of the given axes only (their shape and names)."""
        idx = [self.axis_index(a) for a in axes]
        return DeviceMesh(tuple(self.shape[i] for i in idx), tuple(self.names[i] for i in idx))

    def all_coords(self):
        """Coordinates of every rank, in rank order."""
        return product(*(range(s) for s in self.shape))

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "names": list(self.names)}

    def __str__(self) -> str:
        inner = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape))
        return f"DeviceMesh({inner})"
