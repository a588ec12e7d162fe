"""layout-prop: layout propagation, checking, resharding, lowering and SPMD execution.

Examples
--------
>>> import layout_prop as lp
>>> mesh = lp.DeviceMesh((2, 2), ("dp", "tp"))
>>> spec = lp.TensorSpec((4, 6), "float32", lp.Layout(mesh, ["S(0)", "S(1)"], 2))
>>> spec.local_shape(3), spec.layout.tensor_map()
((2, 3), (1, 0))
"""

__version__ = "0.1.0"

from .errors import (  # noqa: F401
    ExecutionError,
    GraphError,
    LayoutError,
    LayoutPropError,
    OpError,
    SpecError,
    Violation,
)
from .layout import Layout  # noqa: F401
from .mesh import DeviceMesh  # noqa: F401
from .placement import Partial, Placement, Replicate, Shard, parse_placement  # noqa: F401
from .spec import TensorSpec, chunk_bounds  # noqa: F401
