"""Hypothesis strategies for property tests of transfer functions.

Compose them in your own tests: meshes of up to ``max_ranks`` ranks, shapes with uneven and
size-1 dims, layouts that can exist for a shape, and whole tensor specs.

Examples
--------
>>> from hypothesis import given
>>> @given(tensor_specs(max_rank=3))
... def test_local_pieces_fit(spec):
...     assert all(0 <= a <= b <= n for r in range(spec.mesh.size)
...                for (a, b), n in zip(spec.local_slices(r), spec.shape))
>>> test_local_pieces_fit()
"""

from __future__ import annotations

from hypothesis import strategies as st

from layout_prop.core.layout import Layout
from layout_prop.core.mesh import DeviceMesh
from layout_prop.core.placement import Partial, Replicate, Shard
from layout_prop.core.spec import TensorSpec

__all__ = ["meshes", "shapes", "placements_for", "layouts", "tensor_specs"]

AXIS_NAMES = ("dp", "tp", "sp", "cp", "ep")


@st.composite
def meshes(draw, max_axes: int = 3, max_ranks: int = 8, max_axis_size: int = 4) -> DeviceMesh:
    """Device meshes of 1..max_axes axes (size-1 axes included) with at most ``max_ranks`` ranks."""
    ndim = draw(st.integers(1, max_axes))
    sizes: list[int] = []
    for _ in range(ndim):
        room = max_ranks
        for s in sizes:
            room //= s
        sizes.append(draw(st.integers(1, max(1, min(max_axis_size, room)))))
    return DeviceMesh(tuple(sizes), AXIS_NAMES[:ndim])


def shapes(min_rank: int = 1, max_rank: int = 4, max_size: int = 9):
    """Tensor shapes whose dims are often uneven and sometimes 1."""
    dim = st.one_of(st.just(1), st.integers(2, max_size))
    return st.lists(dim, min_size=min_rank, max_size=max_rank).map(tuple)


@st.composite
def placements_for(draw, mesh: DeviceMesh, shape, partial: bool = True) -> tuple:
    """One placement per mesh axis that can exist for ``shape`` (no size-1 dim sharded over >1 device)."""
    out = []
    for size in mesh.shape:
        choices = [Replicate()]
        choices += [Shard(d) for d, n in enumerate(shape) if n > 1 or size == 1]
        if partial:
            choices.append(Partial(draw(st.sampled_from(["sum", "sum", "avg", "max"]))))
        out.append(draw(st.sampled_from(choices)))
    return tuple(out)


@st.composite
def layouts(draw, mesh: DeviceMesh, shape, partial: bool = True) -> Layout:
    return Layout(mesh, draw(placements_for(mesh, shape, partial)), len(shape))


@st.composite
def tensor_specs(draw, mesh: DeviceMesh | None = None, min_rank: int = 1, max_rank: int = 4,
                 partial: bool = False, dtype: str = "float32") -> TensorSpec:
    """Whole specs: a mesh (drawn unless given), a shape and a layout that can exist."""
    mesh = mesh if mesh is not None else draw(meshes())
    shape = draw(shapes(min_rank, max_rank))
    return TensorSpec(shape, dtype, draw(layouts(mesh, shape, partial)))
