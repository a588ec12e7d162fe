"""TensorSpec: shape, dtype and layout; local shapes and slices with uneven shards.

Uneven shards follow ``torch.chunk`` as DTensor does: a dim of size n on k devices gives
chunks of ``ceil(n / k)``; piece i is ``[i*c, min((i+1)*c, n))``, so the last pieces may be
smaller or empty.  A dim sharded on several mesh axes is cut by the outer axis first,
then each piece by the next axis.

Examples
--------
>>> from layout_prop.mesh import DeviceMesh
>>> mesh = DeviceMesh((4,), ("tp",))
>>> spec = TensorSpec((10, 3), "float32", Layout(mesh, ["S(0)"], 2))
>>> [spec.local_shape(r) for r in range(4)]
[(3, 3), (3, 3), (3, 3), (1, 3)]
>>> spec.local_slices(3)
((9, 10), (0, 3))
>>> chunk_bounds(10, 4)
((0, 3), (3, 6), (6, 9), (9, 10))
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .errors import LayoutError
from .layout import Layout
from .mesh import DeviceMesh

__all__ = ["TensorSpec", "chunk_bounds", "DTYPES", "check_dtype"]

DTYPES = ("float16", "float32", "float64", "int32", "int64", "bool")


def check_dtype(dtype) -> str:
    """Return the canonical dtype name or raise ``bad-dtype``."""
    name = str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise LayoutError("bad-dtype", f"unsupported dtype {dtype!r}", hint=f"use one of {', '.join(DTYPES)}")
    return name


def chunk_bounds(n: int, k: int) -> tuple[tuple[int, int], ...]:
    """``torch.chunk`` bounds of ``range(n)`` cut into ``k`` pieces (trailing ones may be empty)."""
    c = -(-n // k) if n else 0
    return tuple((min(i * c, n), min((i + 1) * c, n)) for i in range(k))


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8, "bool": 1}


@dataclass(frozen=True)
class TensorSpec:
    """A global tensor: shape, dtype and layout.

    Raises ``invalid-layout`` when the layout's rank differs from the shape's, or when a
    size-1 dim is sharded over more than one device.
    """

    shape: tuple[int, ...]
    dtype: str
    layout: Layout

    def __init__(self, shape, dtype, layout: Layout) -> None:
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise LayoutError("invalid-shape", f"shape {list(shape)} has a negative size",
                              hint="sizes are non-negative integers")
        if layout.ndim != len(shape):
            raise LayoutError("invalid-layout", f"layout of rank {layout.ndim} for shape {list(shape)}",
                              hint="the layout must describe every dim of the tensor")
        for dim, axes in layout.sharded_dims().items():
            count = layout.shard_count(dim)
            if shape[dim] == 1 and count > 1:
                names = [layout.mesh.names[a] for a in axes]
                raise LayoutError(
                    "invalid-layout",
                    f"dim {dim} has size 1 but is sharded over {count} devices (mesh axes {names})",
                    hint=f"keep dim {dim} Replicate; a size-1 dim broadcasts instead of sharding",
                )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", check_dtype(dtype))
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "_hash", hash((self.shape, self.dtype, layout)))


    def __hash__(self) -> int:  # computed once: specs key the rule cache
        return self._hash
    @property
    def mesh(self) -> DeviceMesh:
        return self.layout.mesh

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE.get(self.dtype) or np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def with_layout(self, layout: Layout) -> "TensorSpec":
        return TensorSpec(self.shape, self.dtype, layout)

    def with_placements(self, placements) -> "TensorSpec":
        return TensorSpec(self.shape, self.dtype, self.layout.with_placements(placements))

    # ------------------------------------------------------------ local views
    def dim_bounds(self, dim: int, coords: tuple[int, ...]) -> tuple[int, int]:
        """The global index range of ``dim`` held at mesh coordinates ``coords``.

        Constant time in the mesh size (one piece's bounds, not all of them), so that a
        mesh of many ranks costs work linear in its size, never quadratic."""
        lo, hi = 0, self.shape[dim]
        sizes = self.layout.mesh.shape
        for axis in self._dim_axes[dim]:
            n, k, i = hi - lo, sizes[axis], coords[axis]
            c = -(-n // k) if n else 0  # chunk_bounds(n, k)[i], without the other k - 1 pieces
            lo, hi = lo + min(i * c, n), lo + min((i + 1) * c, n)
        return lo, hi

    def local_slices(self, rank: int) -> tuple[tuple[int, int], ...]:
        """Per dim, the ``[start, stop)`` range of the global tensor that ``rank`` holds."""
        cache = self._slices_cache
        slices = cache.get(rank)
        if slices is None:
            coords = self.mesh.coords(rank)  # validates the rank
            slices = cache[rank] = tuple(self.dim_bounds(d, coords) for d in range(self.ndim))
        return slices

    @cached_property
    def _slices_cache(self) -> dict[int, tuple[tuple[int, int], ...]]:
        return {}

    @cached_property
    def _dim_axes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.layout.dim_axes(d) for d in range(len(self.shape)))

    def local_index(self, rank: int) -> tuple[slice, ...]:
        """``local_slices`` as a numpy index."""
        return tuple(slice(a, b) for a, b in self.local_slices(rank))

    def local_shape(self, rank: int = 0) -> tuple[int, ...]:
        """The shape of ``rank``'s piece (rank 0 holds a largest piece)."""
        return tuple(b - a for a, b in self.local_slices(rank))

    def local_nbytes(self, rank: int = 0) -> int:
        """The bytes of ``rank``'s piece (computed once per rank of a uniqued spec)."""
        cache = self._nbytes_cache
        nbytes = cache.get(rank)
        if nbytes is None:
            nbytes = cache[rank] = math.prod(b - a for a, b in self.local_slices(rank)) * self.itemsize
        return nbytes

    @cached_property
    def _nbytes_cache(self) -> dict[int, int]:
        return {}

    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """Groups of ranks that hold identical data (they differ only on Replicate axes)."""
        rep_axes = [a for a, p in enumerate(self.layout.placements) if p.is_replicate()]
        groups: dict[tuple, list[int]] = {}
        for rank, coords in enumerate(self.mesh.all_coords()):
            key = tuple(c for a, c in enumerate(coords) if a not in rep_axes)
            groups.setdefault(key, []).append(rank)
        return tuple(tuple(g) for g in groups.values())

    def to_dict(self) -> dict:
        """``shape``, ``dtype``, ``placements``, ``tensor_map``, ``local_shape`` (rank 0's); fresh lists."""
        placements, tensor_map, local_shape = self._report_parts
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "placements": list(placements),
            "tensor_map": [list(e) if isinstance(e, tuple) else e for e in tensor_map],
            "local_shape": list(local_shape),
        }

    @cached_property
    def _report_parts(self) -> tuple[tuple, tuple, tuple]:  # specs are uniqued: a report computes each once
        return tuple(self.layout.placement_strs()), tuple(self.layout.tensor_map()), self.local_shape(0)

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)} {self.layout}"
