"""A scene as SVG, written with Python alone (no Graphviz)."""

from __future__ import annotations

import html

from .scene import FONT_FAMILY, HATCH_COLOUR, Scene, Shape, Text


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def _num(value: float) -> str:
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def _points(points) -> str:
    return " ".join(f"{_num(x)},{_num(y)}" for x, y in points)


def _svg_shape(shape: Shape) -> str:
    if shape.hit:
        return (f'<polyline class="hit" points="{_points(shape.points)}" fill="none" stroke="{shape.stroke}" '
                f'stroke-opacity="0" stroke-width="{_num(shape.width)}" pointer-events="stroke"/>')
    style = f' fill="{shape.fill or "none"}"'
    style += f' stroke="{shape.stroke}" stroke-width="{_num(shape.width)}"' if shape.stroke else ' stroke="none"'
    if shape.dash:
        style += ' stroke-dasharray="4 3"'
    if shape.rect is not None:
        x, y, w, h = shape.rect
        radius = f' rx="{_num(shape.radius)}"' if shape.radius else ""
        geometry = f'x="{_num(x)}" y="{_num(y)}" width="{_num(w)}" height="{_num(h)}"{radius}'
        out = f"<rect {geometry}{style}/>"
        if shape.hatch:
            out += f'<rect {geometry} fill="url(#lp-hatch)" stroke="none"/>'
        return out
    tag = "polygon" if shape.closed else "polyline"
    out = f'<{tag} points="{_points(shape.points)}"{style}/>'
    if shape.hatch and shape.closed:
        out += f'<polygon points="{_points(shape.points)}" fill="url(#lp-hatch)" stroke="none"/>'
    return out


def _svg_text(text: Text) -> str:
    bold = ' font-weight="bold"'
    spans = "".join(f'<tspan fill="{span.colour}"{bold if span.bold else ""}>{_esc(span.text)}</tspan>'
                    for span in text.spans)
    return (f'<text x="{_num(text.x)}" y="{_num(text.y)}" font-size="{_num(text.size)}" '
            f'text-anchor="{text.anchor}" xml:space="preserve">{spans}</text>')


def scene_svg(scene: Scene, *, standalone: bool = False) -> str:
    """The scene as SVG text; ``standalone`` adds the XML declaration of an ``.svg`` file.

    Examples
    --------
    >>> from layout_prop.viz.scene import Item, Span
    >>> svg = scene_svg(Scene(40, 20, [Item([Text(2, 14, (Span("a<b"),))], "n0", "node", "a<b")]))
    >>> '<g data-id="n0" tabindex="0" class="node">' in svg, "<title>a&lt;b</title>" in svg
    (True, True)
    """
    width, height = _num(scene.width), _num(scene.height)
    out = []
    if standalone:
        out.append('<?xml version="1.0" encoding="UTF-8"?>')
    out.append(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
               f'viewBox="0 0 {width} {height}" font-family="{FONT_FAMILY}" role="img" '
               f'aria-label="{_esc(scene.title)}">')
    out.append(f"<title>{_esc(scene.title)}</title>")
    out.append('<defs><pattern id="lp-hatch" patternUnits="userSpaceOnUse" width="7" height="7" '
               f'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="7" stroke="{HATCH_COLOUR}" '
               'stroke-width="1.6"/></pattern></defs>')
    out.append(f'<rect width="{width}" height="{height}" fill="#FFFFFF"/>')
    for item in scene.items:
        attrs = f' data-id="{_esc(item.id)}" tabindex="0"' if item.id else ""
        if item.kind:
            attrs += f' class="{_esc(item.kind)}"'
        out.append(f"<g{attrs}>")
        if item.title:
            out.append(f"<title>{_esc(item.title)}</title>")
        for shape in item.shapes:
            out.append(_svg_text(shape) if isinstance(shape, Text) else _svg_shape(shape))
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"
