"""Writing pictures to files (the format from the extension, written atomically) and the ``viz``
command of the command line."""

from __future__ import annotations

from pathlib import Path

from layout_prop.core.errors import cut
from layout_prop.core import meta
from layout_prop.core.graph import Graph
from layout_prop.passes.check import CheckResult
from layout_prop.core.spec import TensorSpec

from .dot import graph_dot, grid_dot
from .graph_layout import draw_graph
from .grid import Grid, draw_grid
from .html_page import scene_html
from .png import check_png_size, scene_png
from .scene import FORMATS, Scene, VizError
from .svg import scene_svg


# --------------------------------------------------------------------------- files and CLI
def output_format(path: str | Path) -> str:
    """The picture format named by ``path``'s extension (``.html``, ``.svg``, ``.png``, ``.dot``).

    Examples
    --------
    >>> output_format("block.SVG"), output_format("out/graph.dot")
    ('svg', 'dot')
    >>> try:
    ...     output_format("graph.pdf")
    ... except VizError as err:
    ...     print(err.code, "|", err.message)
    bad-format | cannot tell a picture format from the extension '.pdf'
    """
    suffix = Path(path).suffix.lower()
    fmt = {".htm": "html"}.get(suffix, suffix.lstrip("."))
    if fmt not in FORMATS:
        shown = repr(suffix) if suffix else "(none)"
        raise VizError("bad-format", f"cannot tell a picture format from the extension {shown}", path=str(path),
                       hint="name the output .html (interactive), .svg, .png (needs matplotlib) or .dot (Graphviz text)")
    return fmt


def parse_dims(text: str) -> tuple[int, ...]:
    """Parse ``--dims``: ``"0,2"`` -> ``(0, 2)``.

    >>> parse_dims("0,2"), parse_dims(" -1 ")
    ((0, 2), (-1,))
    """
    parts = [part.strip() for part in text.split(",")]
    # ASCII digits only (int() reads '٢' as 2 and refuses 4,300 digits with a ValueError of its own)
    if all(p.removeprefix("-").isascii() and p.removeprefix("-").isdigit() and len(p) <= 18 for p in parts):
        return tuple(int(part) for part in parts)
    raise VizError("bad-dims", f"--dims {cut(text, 60)} is not a comma-separated list of integers",
                   hint="name one or two tensor dims, such as --dims 0,2")


def find_value(graph: Graph, name: str) -> TensorSpec:
    """The spec of value ``name`` (an input, a node output, ``node:i``, or ``grad:INPUT``).

    Raises
    ------
    VizError
        ``unknown-value`` when there is no such value, ``no-layout`` when its producer's
        violation left it without a layout.
    """
    specs: dict[str, TensorSpec | None] = {}
    for node in graph.topo_order():
        for value, spec in zip(node.outputs, node.meta.get(meta.SPECS, ())):
            specs[value] = spec
            if node.meta.get(meta.GRAD_OF):
                specs[f"grad:{node.meta[meta.GRAD_OF]}"] = spec
    if name not in specs:
        shown = [v for v in specs if not v.startswith(("grad/", "cotangent/"))]
        known = ", ".join(shown[:12]) + (", ..." if len(shown) > 12 else "")
        hint = f"name one of the graph's values: {known}"
        if name.startswith("grad:"):
            hint = "gradients exist with --backward; " + hint
        raise VizError("unknown-value", f"no value named {name!r} in the graph", input=name, hint=hint)
    spec = specs[name]
    if spec is None:
        raise VizError("no-layout", f"value {name!r} has no layout: its producer has a violation",
                       input=name, hint="fix the violation, or add --reshard")
    return spec


def _write_failed(path: Path, exc: OSError) -> VizError:
    return VizError("write-failed", f"cannot write {str(path)!r}: {exc.strerror or exc}", path=str(path),
                    hint="check that the folder exists and is writable")


def _write_text(path: Path, text: str) -> None:
    """Write atomically (a temporary file beside ``path``, renamed): a full disk leaves no truncated file."""
    from layout_prop.io.output import write_text_atomic

    try:
        write_text_atomic(path, text)
    except OSError as exc:
        raise _write_failed(path, exc) from None


def _write_scene(scene: Scene, path: Path, fmt: str) -> None:
    if fmt == "png":
        from layout_prop.io.output import atomic_path

        check_png_size(scene, path)  # (before the temporary file, so that the error names the file asked for)
        try:
            with atomic_path(path) as tmp:
                scene_png(scene, tmp)
        except OSError as exc:
            raise _write_failed(path, exc) from None
    elif fmt == "svg":
        _write_text(path, scene_svg(scene, standalone=True))
    else:
        _write_text(path, scene_html(scene))


def write_graph(graph: Graph, path: str | Path, *, check: CheckResult | None = None, title: str = "") -> Path:
    """Write the graph's picture; the extension of ``path`` picks the format (:data:`FORMATS`)."""
    path = Path(path)
    fmt = output_format(path)
    if fmt == "dot":
        _write_text(path, graph_dot(graph, check, title=title))
    else:
        _write_scene(draw_graph(graph, check, title=title), path, fmt)
    return path


def write_grid(grid: Grid, path: str | Path, *, name: str = "", title: str = "") -> Path:
    """Write a tensor grid's picture; the extension of ``path`` picks the format."""
    path = Path(path)
    fmt = output_format(path)
    if fmt == "dot":
        _write_text(path, grid_dot(grid, name=name, title=title))
    else:
        _write_scene(draw_grid(grid, name=name, title=title), path, fmt)
    return path


class Visualise:
    """The visualise pass: ``run(graph)`` returns the picture of a propagated graph (reads metadata only)."""

    name = "visualise"

    def run(self, graph: Graph, check: CheckResult | None = None) -> Scene:
        return draw_graph(graph, check)
