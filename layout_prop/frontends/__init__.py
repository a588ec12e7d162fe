"""Bring your own model: importers of ONNX and MindSpore MindIR models with a sharding plan.

:func:`load_model` is the one entry point the command line (and the planner) use:
``load_model("model.onnx", "plan.yaml")`` returns the same :class:`~layout_prop.core.graph.Graph`
a spec gives.  :func:`import_spec` returns the ordinary spec dict instead (what
``layout-prop import -o SPEC`` writes).  The frontends themselves are
:func:`layout_prop.frontends.onnx.from_onnx` and
:func:`layout_prop.frontends.mindspore.from_cell` / ``from_mindir``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from layout_prop.core.errors import SpecError
from layout_prop.core.graph import Graph
from layout_prop.io.plan_file import ShardingPlan, load_plan
from .ir import ModelGraph, apply_plan, compare_declared, to_spec
from layout_prop.core import meta

__all__ = ["load_model", "import_spec", "build_spec", "build_graph", "is_model_path", "read_model_bytes",
           "MODEL_SUFFIXES", "MAX_MODEL_BYTES"]

MODEL_SUFFIXES = (".onnx", ".mindir")

#: the largest model file read: 2 GiB, protobuf's limit for one message (ONNX and MindIR
#: are protobuf files; a larger ONNX model keeps its weights in external data files, which
#: are not read, except tensors of at most 1 KiB that shape inference needs)
MAX_MODEL_BYTES = 2 ** 31


def read_model_bytes(path: str | Path, hint: str) -> bytes:
    """The bytes of a model file, as the spec loader reads a spec (a regular file or a pipe,
    never a device; see :func:`layout_prop.io.loader.read_file_bytes`), at most
    :data:`MAX_MODEL_BYTES` (``model-too-large`` past it, ``model-not-found`` for what
    cannot be read)."""
    from layout_prop.io.loader import read_file_bytes

    return read_file_bytes(path, MAX_MODEL_BYTES, what="model", missing="model-not-found",
                           too_large="model-too-large", hint=hint)


def is_model_path(path: str | Path) -> bool:
    """Whether ``path`` names a model file (by its suffix) rather than a spec."""
    return str(path).lower().endswith(MODEL_SUFFIXES)


def build_spec(model: ModelGraph, plan: ShardingPlan, *, opaque: bool = False, fuse: bool = True) -> tuple[dict, list[str]]:
    """Canonicalise a read model, lower it, and apply the plan: ``(spec dict, notes)``."""
    from .canonicalize import Canonicalize
    from . import pointwise as _pointwise  # noqa: F401  (registers sqrt, sigmoid... and the opaque op)

    if fuse:
        Canonicalize().run(model)
    spec, weights = to_spec(model, opaque=opaque)
    notes: list[str] = []
    spec = apply_plan(spec, weights, plan, model.spec_aliases, notes)
    if plan.constraints and model.spec_modules:  # patterns match module paths too: pins named by their values
        from layout_prop.io.constraints import resolve_module_pins

        spec["constraints"] = resolve_module_pins(plan.constraints, spec, model.spec_values, model.spec_modules)
    return spec, list(model.notes) + notes + compare_declared(model, spec)


def build_graph(model: ModelGraph, plan: ShardingPlan, *, opaque: bool = False, fuse: bool = True) -> Graph:
    """:func:`build_spec`, loaded into a Graph (its notes in ``graph.meta["import_notes"]``, and in
    ``graph.meta["import_sources"]`` the model's own name of each weight and constant input, by
    input name: ``{"model.layers.0.self_attn.q_proj.weight": "val_105"}``)."""
    from layout_prop.io.loader import load_spec

    spec, notes = build_spec(model, plan, opaque=opaque, fuse=fuse)
    graph = load_spec(spec)
    graph.meta[meta.IMPORT_NOTES] = notes
    graph.meta[meta.IMPORT_SOURCES] = dict(model.spec_sources)
    return graph


def import_spec(path: str | Path, plan: Any, *, opaque: bool = False, fuse: bool = True) -> tuple[dict, list[str]]:
    """Read ``path`` (``.onnx`` or ``.mindir``) with ``plan`` into a spec dict and notes."""
    from ..core.graph import paused_gc

    plan = plan if isinstance(plan, ShardingPlan) else load_plan(plan)
    with paused_gc():  # many small objects, no cycles worth collecting mid-import (as analyze does)
        return build_spec(read_model(path, plan), plan, opaque=opaque, fuse=fuse)


def read_model(path: str | Path, plan: ShardingPlan) -> ModelGraph:
    """Read a model file by its suffix."""
    suffix = Path(str(path)).suffix.lower()
    if suffix == ".onnx":
        from .onnx import read_onnx

        return read_onnx(path, plan)
    if suffix == ".mindir":
        from .mindspore import read_mindir

        return read_mindir(path)
    raise SpecError("unknown-model-format", f"cannot tell the format of {str(path)!r} from its suffix",
                    path=str(path), hint="give a .onnx or .mindir file, or a .yaml/.json spec")


def load_model(path: str | Path, plan: Any, *, opaque: bool = False, fuse: bool = True) -> Graph:
    """Import a model file with a sharding plan (a path, YAML/JSON text, dict or ShardingPlan).

    Examples
    --------
    ``load_model("block.onnx", "plan.yaml")`` gives the Graph that ``layout-prop check
    block.onnx --plan plan.yaml`` analyses.
    """
    from layout_prop.io.loader import load_spec

    from ..core.graph import paused_gc

    spec, notes = import_spec(path, plan, opaque=opaque, fuse=fuse)
    with paused_gc():
        graph = load_spec(spec)
    graph.meta[meta.IMPORT_NOTES] = notes
    return graph
