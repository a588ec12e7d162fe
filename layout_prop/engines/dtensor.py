"""A simulated DTensor: every rank's local array plus the global spec.

It lets ops run eagerly on distributed values in one process, the way hyper-parallel
dispatches DTensor ops: see :mod:`layout_prop.engines.eager`.

Examples
--------
>>> import numpy as np
>>> from layout_prop import DeviceMesh
>>> mesh = DeviceMesh((2,), ("dp",))
>>> t = distribute(np.arange(6.0).reshape(3, 2), mesh, ["S(0)"])
>>> t.to_local(0), t.to_local(1)
(array([[0., 1.],
       [2., 3.]]), array([[4., 5.]]))
>>> t.redistribute(["R"]).to_local(1).shape
(3, 2)
>>> bool((t.full_tensor() == np.arange(6.0).reshape(3, 2)).all())
True
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from layout_prop.core.errors import LayoutError
from layout_prop.core.layout import Layout
from layout_prop.core.mesh import DeviceMesh
from layout_prop.core.spec import TensorSpec

__all__ = ["DTensor", "distribute"]


class DTensor:
    """A global tensor held as per-rank local arrays, laid out by ``spec``."""

    def __init__(self, locals_: Sequence[np.ndarray], spec: TensorSpec) -> None:
        if len(locals_) != spec.mesh.size:
            raise LayoutError("rank-count-mismatch", f"{len(locals_)} local arrays for a mesh of {spec.mesh.size} "
                              "ranks", hint="give one local array per rank")
        for rank, local in enumerate(locals_):
            want = spec.local_shape(rank)
            if tuple(local.shape) != want:
                raise LayoutError("local-shape-mismatch", f"rank {rank} holds shape {list(local.shape)} but "
                                  f"{spec} gives it {list(want)}", hint="build DTensors with distribute()")
        self._locals = list(locals_)
        self.spec = spec

    @property
    def mesh(self) -> DeviceMesh:
        return self.spec.mesh

    @property
    def layout(self) -> Layout:
        return self.spec.layout

    @property
    def placements(self):
        return self.spec.layout.placements

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    def to_local(self, rank: int) -> np.ndarray:
        """The local array of ``rank``."""
        self.mesh.coords(rank)
        return self._locals[rank]

    def locals(self) -> list[np.ndarray]:
        return list(self._locals)

    def full_tensor(self) -> np.ndarray:
        """The global array (Partial axes reduced; replicas must agree)."""
        from layout_prop.engines.collectives import assemble

        return assemble(self._locals, self.spec)

    def redistribute(self, placements) -> "DTensor":
        """The same tensor in another layout, moved by the cheapest plan's collectives."""
        from layout_prop.engines.collectives import apply_plan
        from layout_prop.core.redistribute import plan_redistribution

        layout = Layout(self.mesh, placements, len(self.shape))
        plan = plan_redistribution(self.spec, layout)
        return DTensor(apply_plan(plan, self._locals), TensorSpec(self.shape, self.dtype, layout))

    def __repr__(self) -> str:
        return f"DTensor({self.spec})"


def distribute(array, mesh: DeviceMesh, placements, rng: np.random.Generator | None = None) -> DTensor:
    """Cut a global array into the per-rank pieces of ``placements`` (Partial: terms)."""
    from layout_prop.engines.collectives import scatter_global

    array = np.asarray(array)
    spec = TensorSpec(array.shape, str(array.dtype), Layout(mesh, placements, array.ndim))
    return DTensor(scatter_global(array, spec, rng), spec)
