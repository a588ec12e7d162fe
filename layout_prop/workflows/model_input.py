"""``SPEC``, or ``MODEL --plan PLAN``, wherever a command takes a spec: :func:`load_graph`, the one place
commands load their input."""

from __future__ import annotations

from pathlib import Path

from layout_prop.core import meta
from layout_prop.core.errors import SpecError
from layout_prop.core.graph import Graph

__all__ = ["load_graph", "unapplied_blocks_note"]


def load_graph(spec: str | Path, plan: str | Path | None = None, opaque: bool = False) -> Graph:
    """The graph a command analyses: ``spec`` loaded as a spec (``-``: standard input), or imported
    as a model with the sharding plan ``plan`` (``--plan``; ``opaque``: ``--opaque``) when it is an
    ``.onnx`` / ``.mindir`` file."""
    from layout_prop.core.dependencies import require_model_reader
    from layout_prop.io.loader import load_spec
    from layout_prop.frontends import is_model_path, load_model

    source = str(spec)
    if is_model_path(source):
        if plan is None:
            raise SpecError("missing-plan", f"{source!r} is a model: it needs a sharding plan", path=source,
                            hint="add --plan PLAN.yaml (see docs/importing-models.md)")
        require_model_reader(source)  # onnx or MindSpore, said before anything is read
        return load_model(source, Path(plan), opaque=opaque)  # --plan is always a file
    if plan is not None:
        raise SpecError("unexpected-plan", f"--plan goes with a model (.onnx or .mindir), but {source!r} is a spec",
                        path=source, hint="drop --plan, or give the model file")
    from layout_prop.frontends import (  # noqa: F401  (a spec written by 'import' may hold sqrt, opaque...)
        pointwise as _pointwise,
    )

    return load_spec(Path("/dev/stdin") if source == "-" else Path(source))  # "-": stdin, as Unix tools read it


#: the spec blocks that describe a training configuration rather than the graph
CONFIG_BLOCKS = (meta.ZERO, meta.RECOMPUTE, meta.PIPELINE)


def unapplied_blocks_note(graph: Graph, command: str) -> str | None:
    """One note line for a command that shows the graph without the spec's ``zero:``,
    ``recompute:`` or ``pipeline:`` blocks (``lower``, ``viz``, ``explain``, ``export``), or None
    when the spec has none: the answer is the graph's, never silently another configuration's.

    >>> from layout_prop.core.graph import Graph
    >>> from layout_prop.core.mesh import DeviceMesh
    >>> g = Graph(DeviceMesh((2,), ("dp",)))
    >>> unapplied_blocks_note(g, "lower") is None
    True
    >>> g.meta["zero"] = {"stage": 3}
    >>> unapplied_blocks_note(g, "lower")
    "note: lower shows the graph without the spec's zero: block (check, run and estimate apply it)"
    """
    present = [name for name in CONFIG_BLOCKS if graph.meta.get(name) is not None]
    if not present:
        return None
    names = ", ".join(f"{name}:" for name in present)
    where = "check, run and estimate apply " + ("them" if len(present) > 1 else "it")
    if "pipeline" in present:
        where += "; pipeline SPEC --rank R prints a pipelined rank's program"
    return f"note: {command} shows the graph without the spec's {names} block{'s' if len(present) > 1 else ''} ({where})"
