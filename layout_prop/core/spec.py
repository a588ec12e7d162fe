"""TensorSpec: shape, dtype and layout; local shapes and slices with uneven shards.

Uneven shards follow ``torch.chunk`` as DTensor does: a dim of size n on k devices gives
chunks of ``ceil(n / k)``; piece i is ``[i*c, min((i+1)*c, n))``, so the last pieces may be
smaller or empty.  A dim sharded on several mesh axes is cut by the outer axis first,
then each piece by the next axis.  A strided shard ``_S(d,k)`` cuts the piece it gets
viewed as ``(k, len / k)`` along its inner part (``len`` must divide by ``k`` on every
rank); a rank then holds ``k`` blocks of the dim, not one range: :meth:`TensorSpec.local_slices`
refuses such a spec (``unsupported-layout``), :meth:`TensorSpec.dim_indices` and
:meth:`TensorSpec.local_index` describe it exactly.

Examples
--------
>>> from layout_prop.core.mesh import DeviceMesh
>>> mesh = DeviceMesh((4,), ("tp",))
>>> spec = TensorSpec((10, 3), "float32", Layout(mesh, ["S(0)"], 2))
>>> [spec.local_shape(r) for r in range(4)]
[(3, 3), (3, 3), (3, 3), (1, 3)]
>>> spec.local_slices(3)
((9, 10), (0, 3))
>>> chunk_bounds(10, 4)
((0, 3), (3, 6), (6, 9), (9, 10))
>>> strided = TensorSpec((8, 3), "float32", Layout(mesh, ["_S(0,2)"], 2))
>>> [strided.dim_indices(0, (r,)).tolist() for r in range(4)]
[[0, 4], [1, 5], [2, 6], [3, 7]]
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from functools import cached_property, lru_cache
from itertools import product
from typing import Sequence

import numpy as np

from .errors import LayoutError
from .layout import Layout
from .mesh import MAX_TENSOR_RANK, DeviceMesh
from .placement import StridedShard

__all__ = ["TensorSpec", "chunk_bounds", "chunk_classes", "rank_classes", "class_ranks", "class_of_rank", "DTYPES",
           "FLOAT_DTYPES", "check_dtype", "numpy_dtype", "is_float_dtype"]

DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "bool")
#: the dtypes that take a gradient (an integer or bool input, such as token ids or a mask, does not)
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def check_dtype(dtype) -> str:
    """Return the canonical dtype name or raise ``bad-dtype``.

    >>> check_dtype("bfloat16"), check_dtype(np.float32)
    ('bfloat16', 'float32')
    """
    name = str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise LayoutError("bad-dtype", f"unsupported dtype {dtype!r}", hint=f"use one of {', '.join(DTYPES)}")
    if name == "bfloat16":
        numpy_dtype(name)  # registers the name with numpy: the rules' np.dtype("bfloat16") then works
    return name


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name; ``bfloat16`` is ``ml_dtypes.bfloat16`` (numpy has none),
    imported only when asked for.

    >>> numpy_dtype("float32"), numpy_dtype("bfloat16").itemsize
    (dtype('float32'), 2)
    """
    if name != "bfloat16":
        return np.dtype(name)
    dtype = _bfloat16()
    if np.sctypeDict.get("bfloat16") is not dtype.type:  # MindSpore registers its own numpy bfloat16 under
        np.sctypeDict["bfloat16"] = dtype.type  # the name when imported: np.dtype("bfloat16") is ml_dtypes' again
    return dtype


@lru_cache(maxsize=1)
def _bfloat16() -> np.dtype:
    try:
        import ml_dtypes
    except ImportError:
        raise LayoutError("bad-dtype", "bfloat16 needs the ml_dtypes package (numpy has no bfloat16), which is not "
                          "installed", hint="pip install ml_dtypes (a dependency of layout-prop and onnx)") from None
    return np.dtype(ml_dtypes.bfloat16)


def is_float_dtype(dtype) -> bool:
    """Whether a numpy dtype is a floating one, bfloat16 included (numpy's ``kind`` of
    ``ml_dtypes.bfloat16`` is ``'V'``, not ``'f'``).

    >>> is_float_dtype(np.dtype("float16")), is_float_dtype(numpy_dtype("bfloat16")), is_float_dtype(np.int64)
    (True, True, False)
    """
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype.name == "bfloat16"


def chunk_bounds(n: int, k: int) -> tuple[tuple[int, int], ...]:
    """``torch.chunk`` bounds of ``range(n)`` cut into ``k`` pieces (trailing ones may be empty).

    The bounds of up to 1,024 pieces are remembered (a rule asks for the same few cuts once
    per rank); larger ones are made each time."""
    if k <= _CACHED_PIECES:
        return _chunk_bounds_cached(n, k)
    return _chunk_bounds(n, k)


def _chunk_bounds(n: int, k: int) -> tuple[tuple[int, int], ...]:
    c = -(-n // k) if n else 0
    return tuple((min(i * c, n), min((i + 1) * c, n)) for i in range(k))


#: the most pieces whose bounds :func:`chunk_bounds` remembers (256 entries of at most this many pairs)
_CACHED_PIECES = 1024
_chunk_bounds_cached = lru_cache(maxsize=256)(_chunk_bounds)


def chunk_classes(n: int, k: int) -> tuple[tuple[int, int], ...]:
    """The pieces of :func:`chunk_bounds` grouped by size: ``(first coordinate, size)`` of each
    run of pieces of one size, in order; at most three (full chunks, the remainder, empty ones).

    >>> chunk_classes(10, 4), chunk_classes(8, 4), chunk_classes(2, 4), chunk_classes(0, 3)
    (((0, 3), (3, 1)), ((0, 2),), ((0, 1), (2, 0)), ((0, 0),))
    >>> chunk_classes(7, 5)  # chunks of 2: 2, 2, 2, 1, 0
    ((0, 2), (3, 1), (4, 0))
    """
    if n == 0:
        return ((0, 0),)
    c = -(-n // k)
    q, r = divmod(n, c)  # q full chunks (1 <= q <= k), then one of r, then empty ones
    if q == k:
        return ((0, c),)
    if r == 0 or q + 1 == k:
        return ((0, c), (q, r))
    return ((0, c), (q, r), (q + 1, 0))


def _cut_lengths(n: int, layout: Layout, dim: int):
    """Yield ``(axis, split factor, lengths)`` for each mesh axis of size > 1 that cuts dim
    ``dim`` (size ``n``), outer first: ``lengths`` are the distinct lengths of the piece of the
    dim that axis cuts, over every rank (what the outer axes left), computed per axis from
    :func:`chunk_classes`, never per rank."""
    lengths = {n}
    mesh = layout.mesh
    for axis in layout.cut_axes(dim):
        k = mesh.shape[axis]
        if k == 1:
            continue  # a size-1 axis cuts nothing, strided or not
        p = layout.placements[axis]
        sf = p.split_factor if isinstance(p, StridedShard) else 1
        yield axis, sf, lengths
        lengths = {sf * size for length in lengths for _, size in chunk_classes(length // sf, k)}


def rank_classes(specs, mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
    """Per mesh axis, the first coordinate of each class of alike coordinates for ``specs``.

    A rank's local shape of a spec depends only on its coordinate on each mesh axis, and on
    each axis only on which run of equal chunk sizes (:func:`chunk_classes`) the coordinate
    falls in, for every length the outer axes leave.  Coordinates of one axis in one class
    therefore give every spec the same local shapes (and bytes, and the same overlap of two
    pieces that contain one another) whatever the other coordinates: the ranks of one
    class of the product ``itertools.product(*rank_classes(...))`` are alike, and the
    product's first coordinates, in its order, are the lowest rank of each class in
    increasing rank order.  At most ``mesh.size`` classes; mostly a handful.

    >>> from layout_prop.core.mesh import DeviceMesh
    >>> mesh = DeviceMesh((4, 3), ("dp", "tp"))
    >>> x = TensorSpec((10, 6), "float32", Layout(mesh, ["S(0)", "S(1)"], 2))
    >>> rank_classes([x], mesh)  # rows 3, 3, 3, 1; columns 2, 2, 2
    ((0, 3), (0,))
    """
    starts = [{0} for _ in mesh.shape]
    for spec in specs:
        for axis, found in enumerate(spec._axis_starts):
            starts[axis].update(found)
    return tuple(tuple(sorted(s)) for s in starts)


def class_ranks(starts: Sequence[Sequence[int]], mesh: DeviceMesh) -> list[int]:
    """The lowest rank of each class of :func:`rank_classes` (in the product's order, increasing)."""
    return [mesh.rank(coords) for coords in product(*starts)]


def class_of_rank(starts: Sequence[Sequence[int]], mesh: DeviceMesh) -> np.ndarray:
    """Per rank, the index of its class in the product of ``starts`` (:func:`rank_classes`);
    numpy, one pass over the mesh.

    >>> from layout_prop.core.mesh import DeviceMesh
    >>> class_of_rank(((0, 3), (0, 2)), DeviceMesh((4, 3), ("dp", "tp"))).tolist()
    [0, 0, 1, 0, 0, 1, 0, 0, 1, 2, 2, 3]
    """
    index = np.zeros(1, dtype=np.int64)
    for axis, k in enumerate(mesh.shape):
        on_axis = np.searchsorted(np.asarray(starts[axis], dtype=np.int64), np.arange(k), side="right") - 1
        index = (index[:, None] * len(starts[axis]) + on_axis[None, :]).reshape(-1)
    return index


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8, "bool": 1}


def _cut_indices(n: int, layout: Layout, dim: int, coords: Sequence[int]) -> np.ndarray:
    """The indices of a dim of size ``n`` held at ``coords``: each mesh axis cuts the piece
    the outer ones left (``Shard``: a chunk; ``StridedShard``: the chunk of each of its blocks)."""
    idx = np.arange(n)
    for axis in layout.cut_axes(dim):
        p = layout.placements[axis]
        k = layout.mesh.shape[axis]
        if k == 1:
            continue  # a size-1 axis cuts nothing, strided or not
        if isinstance(p, StridedShard):
            rows = idx.reshape(p.split_factor, len(idx) // p.split_factor)
            lo, hi = chunk_bounds(rows.shape[1], k)[coords[axis]]
            idx = rows[:, lo:hi].reshape(-1)
        else:
            lo, hi = chunk_bounds(len(idx), k)[coords[axis]]
            idx = idx[lo:hi]
    return idx


def _check_strided(shape: tuple[int, ...], layout: Layout) -> None:
    """``invalid-layout`` unless every strided shard's piece divides into its blocks on every rank
    (the lengths the outer axes leave, per axis: :func:`_cut_lengths`)."""
    mesh = layout.mesh
    for axis in layout.strided_axes():
        p = layout.placements[axis]
        if mesh.shape[axis] == 1:
            continue
        sizes: set[int] = set()
        for cut, _, lengths in _cut_lengths(shape[p.dim], layout, p.dim):
            if cut == axis:
                sizes = lengths
                break
        bad = sorted(n for n in sizes if n % p.split_factor)
        if bad:
            raise LayoutError(
                "invalid-layout",
                f"{p} on mesh axis {mesh.names[axis]!r}: the piece of dim {p.dim} (size {shape[p.dim]}) it cuts "
                f"has {bad[0]} elements on some rank, which do not divide into {p.split_factor} blocks",
                hint="a strided shard _S(d,k) needs the piece of dim d it cuts to be a multiple of k")


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
        if len(shape) > MAX_TENSOR_RANK:  # a spec's inputs are checked by the loader; this is an op's output
            raise LayoutError("too-many-dims", f"a tensor of {len(shape)} dims, over the limit {MAX_TENSOR_RANK}",
                              hint=f"keep tensors to at most {MAX_TENSOR_RANK} dims (what numpy can index)")
        if any(s < 0 for s in shape):
            raise LayoutError("invalid-shape", f"shape {list(shape)} has a negative size",
                              hint="sizes are non-negative integers")
        if layout.ndim != len(shape):
            raise LayoutError("invalid-layout", f"layout of rank {layout.ndim} for shape {list(shape)}",
                              hint="the layout must describe every dim of the tensor")
        if layout.has_strided:
            _check_strided(shape, layout)
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
        """The global index range of ``dim`` held at mesh coordinates ``coords`` (not for a strided dim).

        Constant time in the mesh size (one piece's bounds, not all of them), so that a
        mesh of many ranks costs work linear in its size, never quadratic."""
        lo, hi = 0, self.shape[dim]
        sizes = self.layout.mesh.shape
        for axis in self._dim_axes[dim]:
            n, k, i = hi - lo, sizes[axis], coords[axis]
            c = -(-n // k) if n else 0  # chunk_bounds(n, k)[i], without the other k - 1 pieces
            lo, hi = lo + min(i * c, n), lo + min((i + 1) * c, n)
        return lo, hi

    def dim_indices(self, dim: int, coords: tuple[int, ...]) -> np.ndarray:
        """The global indices of ``dim`` held at mesh coordinates ``coords``, in local order.

        Exact for every placement, strided shards included (module docstring).
        """
        return _cut_indices(self.shape[dim], self.layout, dim, coords)

    @cached_property
    def _strided_dims(self) -> tuple[int, ...]:
        return tuple(sorted({self.layout.placements[a].dim for a in self.layout.strided_axes()}))

    def local_slices(self, rank: int) -> tuple[tuple[int, int], ...]:
        """Per dim, the ``[start, stop)`` range of the global tensor that ``rank`` holds.

        Raises ``unsupported-layout`` for a strided shard (a rank holds several ranges
        of that dim): use :meth:`local_index` or :meth:`dim_indices`.
        """
        cache = self._slices_cache
        slices = cache.get(rank)
        if slices is None:
            coords = self.mesh.coords(rank)  # validates the rank
            if self.layout.has_strided:
                raise LayoutError("unsupported-layout",
                                  f"{self} holds dim {self._strided_dims[0]} in strided pieces, not one range per "
                                  f"rank", hint="gather the strided mesh axis first, or use the spec's local_index")
            slices = cache[rank] = tuple(self.dim_bounds(d, coords) for d in range(self.ndim))
        return slices

    @cached_property
    def _slices_cache(self) -> dict[int, tuple[tuple[int, int], ...]]:
        return {}

    @cached_property
    def _dim_axes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.layout.dim_axes(d) for d in range(len(self.shape)))

    def local_runs(self, rank: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per dim, the ``[start, stop)`` ranges ``rank`` holds, in local order: one range
        per dim (``local_slices``), several for a strided shard.

        >>> from layout_prop.core.mesh import DeviceMesh
        >>> mesh = DeviceMesh((2,), ("tp",))
        >>> TensorSpec((6, 2), "float32", Layout(mesh, ["_S(0,2)"], 2)).local_runs(1)
        (((2, 3), (5, 6)), ((0, 2),))
        """
        if not self.layout.has_strided:
            return tuple((b,) for b in self.local_slices(rank))
        coords = self.mesh.coords(rank)
        out = []
        for d in range(self.ndim):
            runs: list[list[int]] = []
            for i in self.dim_indices(d, coords).tolist():
                if runs and runs[-1][1] == i:
                    runs[-1][1] = i + 1
                else:
                    runs.append([i, i + 1])
            out.append(tuple((a, b) for a, b in runs) or ((0, 0),))
        return tuple(out)

    def local_index(self, rank: int) -> tuple:
        """A numpy index of the part of the global tensor that ``rank`` holds (for reading or writing).

        Slices; with a strided shard, an open mesh (``numpy.ix_``) of index arrays.
        """
        if self.layout.has_strided:
            coords = self.mesh.coords(rank)
            return np.ix_(*[self.dim_indices(d, coords) for d in range(self.ndim)])
        return tuple(slice(a, b) for a, b in self.local_slices(rank))

    def local_shape(self, rank: int = 0) -> tuple[int, ...]:
        """The shape of ``rank``'s piece (rank 0 holds a largest piece)."""
        if self.layout.has_strided:
            coords = self.mesh.coords(rank)
            return tuple(len(self.dim_indices(d, coords)) for d in range(self.ndim))
        return tuple(b - a for a, b in self.local_slices(rank))

    def local_nbytes(self, rank: int = 0) -> int:
        """The bytes of ``rank``'s piece (computed once per rank of a uniqued spec)."""
        cache = self._nbytes_cache
        nbytes = cache.get(rank)
        if nbytes is None:
            nbytes = cache[rank] = math.prod(self.local_shape(rank)) * self.itemsize
        return nbytes

    @cached_property
    def _nbytes_cache(self) -> dict[int, int]:
        return {}

    @cached_property
    def _axis_starts(self) -> tuple[tuple[int, ...], ...]:
        """Per mesh axis, the coordinates where this spec's local shape may change along it
        (:func:`rank_classes`), found per axis from the chunk sizes, never per rank."""
        starts: list[set[int]] = [{0} for _ in self.mesh.shape]
        k = self.mesh.shape
        for dim, n in enumerate(self.shape):
            for axis, sf, lengths in _cut_lengths(n, self.layout, dim):
                for length in lengths:
                    starts[axis].update(first for first, _ in chunk_classes(length // sf, k[axis]))
        return tuple(tuple(sorted(s)) for s in starts)

    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """Groups of ranks that hold identical data (they differ only on Replicate axes)."""
        rep_axes = [a for a, p in enumerate(self.layout.placements) if p.is_replicate()]
        groups: dict[tuple, list[int]] = {}
        for rank, coords in enumerate(self.mesh.all_coords()):
            key = tuple(c for a, c in enumerate(coords) if a not in rep_axes)
            groups.setdefault(key, []).append(rank)
        return tuple(tuple(g) for g in groups.values())

    def to_dict(self) -> dict:
        """``shape``, ``dtype``, ``placements``, ``tensor_map`` (None for a strided shard that no
        MindSpore tensor_map expresses: :meth:`Layout.tensor_map`), ``local_shape`` (rank 0's); fresh
        lists."""
        placements, tensor_map, local_shape = self._report_parts
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "placements": list(placements),
            "tensor_map": None if tensor_map is None else [list(e) if isinstance(e, tuple) else e for e in tensor_map],
            "local_shape": list(local_shape),
        }

    @cached_property
    def _report_parts(self) -> tuple[tuple, tuple, tuple]:  # specs are uniqued: a report computes each once
        try:  # a strided shard an inner mesh axis first made is a tensor_map too
            tensor_map = tuple(self.layout.tensor_map())
        except LayoutError:
            tensor_map = None
        return tuple(self.layout.placement_strs()), tensor_map, self.local_shape(0)

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)} {self.layout}"
