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

__all__ = [
    "DeviceMesh", "Replicate", "Shard", "Partial", "Placement", "parse_placement", "Layout", "TensorSpec",
    "chunk_bounds", "OpRule", "RuleResult", "register_op", "register_kernel", "LayoutPropError", "SpecError",
    "LayoutError", "GraphError", "OpError", "ExecutionError", "Violation", "analyze",
]

from .core.errors import (  # noqa: F401
    ExecutionError,
    GraphError,
    LayoutError,
    LayoutPropError,
    OpError,
    SpecError,
    Violation,
)
from .core.layout import Layout  # noqa: F401
from .core.mesh import DeviceMesh  # noqa: F401
from .core.placement import Partial, Placement, Replicate, Shard, parse_placement  # noqa: F401
from .core.spec import TensorSpec, chunk_bounds  # noqa: F401
from .core.registry import OpRule, RuleResult, register_op  # noqa: F401


def analyze(graph, **options):
    """Analyse a graph (from a spec, a model or a cell): :func:`layout_prop.api.analyze`.

    ``layout_prop.analyze(from_cell(net, x, plan=...), reshard=True)`` works as on a loaded spec.
    """
    from .api import analyze as _analyze

    return _analyze(graph, **options)


def register_kernel(op: str, fn, backend: str = "numpy"):
    """Register a kernel of ``op`` for ``backend`` (numpy: the reference and the simulator)."""
    if backend != "numpy":
        raise OpError("bad-backend", f"kernels for backend {backend!r} are registered in its own table",
                      hint="register the numpy kernel here; see kernels/mindspore_backend.py for MindSpore")
    from .kernels.numpy_backend import register_kernel as _register

    return _register(op, fn)
