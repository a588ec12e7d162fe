"""The scene every picture is made of (boxes, lines and texts in pixels), its colours and text metrics,
and the spans and table rows that describe placements, steps and specs in every output format."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any

from layout_prop.core.errors import LayoutPropError, Violation
from layout_prop.core.layout import Layout
from layout_prop.core.mesh import DeviceMesh
from layout_prop.core.placement import Replicate
from layout_prop.core.redistribute import Redistribution, Step
from layout_prop.core.spec import TensorSpec

FORMATS = ("html", "svg", "png", "dot")


class VizError(LayoutPropError):
    """A picture that cannot be made as asked: unknown format or value, bad dims, no matplotlib."""



# --------------------------------------------------------------------------- colours and text
INK = "#1F2328"
MUTED = "#57606A"
EDGE_COLOUR = "#6E7781"
VIOLATION_RED = "#C81E1E"
HATCH_COLOUR = "#57606A"
NODE_FILLS = {"input": "#EAF0F7", "op": "#FFFFFF", "backward": "#F1EAFB", "redistribute": "#FFF1CC"}
KIND_TEXT = {
    "input": "graph input",
    "op": "op",
    "backward": "backward (gradient) op",
    "redistribute": "redistribution",
}
AXIS_PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#8C6D1F", "#6A3D9A", "#117A65")
KNOWN_AXIS_COLOURS = {"dp": "#0072B2", "tp": "#E69F00", "sp": "#009E73", "cp": "#CC79A7", "pp": "#56B4E9",
                      "ep": "#8C6D1F"}
CELL_FILLS = ("#E3EEF9", "#FDF0D9", "#E2F3EA", "#F6E6F0", "#E6F4FB", "#F1ECDD", "#ECE6F5", "#E1F0EC")
FONT_FAMILY = "DejaVu Sans Mono, Menlo, Consolas, monospace"
CHAR_WIDTH = 0.602  # advance width of DejaVu Sans Mono, in font sizes


def text_width(text: str, size: float) -> float:
    """The width in pixels of ``text`` set in the monospace font at ``size`` pixels.

    >>> text_width("abcd", 10.0)
    24.08
    """
    return round(len(text) * size * CHAR_WIDTH, 6)


def axis_colours(mesh: DeviceMesh) -> dict[str, str]:
    """One fixed colour per mesh axis name.

    Common names always get the same colour (``dp`` blue, ``tp`` orange, ``sp`` green,
    ``cp``, ``pp``, ``ep``); any other name gets a colour picked from its name's CRC, the
    next free one if another axis of the mesh has it already.  Red is kept for violations.

    Examples
    --------
    >>> axis_colours(DeviceMesh((2, 2), ("dp", "tp")))
    {'dp': '#0072B2', 'tp': '#E69F00'}
    >>> axis_colours(DeviceMesh((2, 2), ("tp", "dp")))["dp"]
    '#0072B2'
    """
    chosen: dict[str, str] = {name: KNOWN_AXIS_COLOURS[name] for name in mesh.names if name in KNOWN_AXIS_COLOURS}
    used = set(chosen.values())
    for name in mesh.names:
        if name in chosen:
            continue
        start = zlib.crc32(name.encode("utf-8")) % len(AXIS_PALETTE)
        colour = AXIS_PALETTE[start]
        for step in range(len(AXIS_PALETTE)):
            candidate = AXIS_PALETTE[(start + step) % len(AXIS_PALETTE)]
            if candidate not in used:
                colour = candidate
                break
        chosen[name] = colour
        used.add(colour)
    return {name: chosen[name] for name in mesh.names}


# --------------------------------------------------------------------------- the scene
@dataclass(frozen=True)
class Span:
    """A run of text in one colour."""

    text: str
    colour: str = INK
    bold: bool = False


@dataclass(frozen=True)
class Text:
    """One line of text; ``y`` is the baseline, ``anchor`` is start, middle or end."""

    x: float
    y: float
    spans: tuple[Span, ...]
    size: float = 12.0
    anchor: str = "start"

    @property
    def content(self) -> str:
        return "".join(span.text for span in self.spans)

    @property
    def width(self) -> float:
        return text_width(self.content, self.size)


@dataclass(frozen=True)
class Shape:
    """A polygon (``closed``) or a polyline; ``rect`` set for rectangles (``radius`` rounds them).

    ``hatch`` overlays diagonal hatching (Partial blocks); ``hit`` marks an invisible wide
    line that only makes an edge easier to hover in the HTML page.
    """

    points: tuple[tuple[float, float], ...]
    fill: str | None = None
    stroke: str | None = INK
    width: float = 1.0
    closed: bool = True
    dash: bool = False
    hatch: bool = False
    radius: float = 0.0
    rect: tuple[float, float, float, float] | None = None
    hit: bool = False


def rect(x: float, y: float, w: float, h: float, **style: Any) -> Shape:
    """A rectangle :class:`Shape` with its top-left corner at ``(x, y)``."""
    return Shape(((x, y), (x + w, y), (x + w, y + h), (x, y + h)), rect=(x, y, w, h), **style)


@dataclass
class Item:
    """Shapes and texts drawn together; with an ``id`` the HTML page can show its ``info``."""

    shapes: list
    id: str | None = None
    kind: str = ""
    title: str = ""


@dataclass
class Scene:
    """A picture in pixels: items, plus what the HTML page's side panel shows.

    ``info`` maps an item id to ``{"title", "rows": [[key, value]...], "sections":
    [{"heading", "rows", "alert"}...]}``; ``summary`` is shown before anything is picked.
    """

    width: float
    height: float
    items: list[Item]
    title: str = ""
    summary: list[str] = field(default_factory=list)
    info: dict[str, dict] = field(default_factory=dict)

    def texts(self) -> list[str]:
        """Every line of text in the scene."""
        return [shape.content for item in self.items for shape in item.shapes if isinstance(shape, Text)]


def _placement_spans(layout: Layout, colours: dict[str, str]) -> list[Span]:
    spans = [Span("(")]
    for axis, placement in enumerate(layout.placements):
        if axis:
            spans.append(Span(", "))
        if isinstance(placement, Replicate):
            spans.append(Span(str(placement), MUTED))
        else:
            spans.append(Span(str(placement), colours[layout.mesh.names[axis]], bold=True))
    spans.append(Span(")"))
    return spans


def _mesh_spans(mesh: DeviceMesh, colours: dict[str, str]) -> list[Span]:
    spans: list[Span] = []
    for axis, (name, size) in enumerate(zip(mesh.names, mesh.shape)):
        if axis:
            spans.append(Span(" × "))
        spans += [Span(name, colours[name], bold=True), Span(f"={size}")]
    return spans


def _step_text(step: Step) -> str:
    kind = step.kind + (f"({step.reduce_op})" if step.reduce_op else "")
    dims = ""
    if step.dim is not None:
        dims = f", dim {step.dim}" + (f" -> {step.dst_dim}" if step.dst_dim is not None else "")
    return f"{kind} on {step.mesh_axis_name}{dims}: {step.bytes_per_rank:,} B per rank"


def _step_spans(step: Step, colours: dict[str, str]) -> list[Span]:
    kind = step.kind + (f"({step.reduce_op})" if step.reduce_op else "")
    return [Span(kind + " on "), Span(step.mesh_axis_name, colours[step.mesh_axis_name], bold=True),
            Span(f": {step.bytes_per_rank:,} B")]


def _tensor_map_text(spec: TensorSpec) -> str:
    return json.dumps(spec.to_dict()["tensor_map"])


def _spec_rows(spec: TensorSpec | None) -> list[list[str]]:
    if spec is None:
        return [["layout", "unknown (its producer has a violation)"]]
    return [
        ["shape", str(list(spec.shape))],
        ["dtype", spec.dtype],
        ["placements", str(spec.layout)],
        ["tensor_map", _tensor_map_text(spec)],
        ["local shape (rank 0)", str(list(spec.local_shape(0)))],
        ["bytes (rank 0 / all)", f"{spec.local_nbytes(0):,} / {spec.nbytes:,}"],
    ]


def _plan_rows(plan: Redistribution) -> list[list[str]]:
    rows = [["from", str(plan.src.layout)], ["to", str(plan.dst.layout)]]
    if not plan.steps:
        rows.append(["steps", "none (a relabel on size-1 mesh axes)"])
    for number, step in enumerate(plan.steps, 1):
        rows.append([f"step {number}", _step_text(step)])
    rows.append(["bytes per rank", f"{plan.bytes_per_rank:,}"])
    return rows


def _violation_section(v: Violation) -> dict:
    rows = [["node", str(v.node)], ["op", str(v.op)]]
    if v.input is not None:
        rows.append(["input", f"{v.input} (operand {v.operand})" if v.operand else str(v.input)])
    rows += [["message", v.message], ["fix", v.hint]]
    return {"heading": f"violation {v.code}", "rows": rows, "alert": True}


def _info_text(info: dict) -> str:
    """The plain-text form of an item's info, for the SVG ``<title>`` tooltip."""
    lines = [info["title"]]
    lines += [f"{key}: {value}" for key, value in info.get("rows", ())]
    for section in info.get("sections", ()):
        lines.append(section["heading"])
        lines += [f"  {key}: {value}" for key, value in section["rows"]]
    return "\n".join(lines)
