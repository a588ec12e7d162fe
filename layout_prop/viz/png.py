"""A scene drawn with matplotlib (Agg, no window) into a PNG file; matplotlib is imported only here."""

from __future__ import annotations

import math
from pathlib import Path

from .scene import HATCH_COLOUR, Scene, Shape, Text, VizError, text_width


def _matplotlib():
    try:
        from matplotlib import patches
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise VizError("png-unavailable", "writing a .png needs matplotlib, which is not installed",
                       hint="pip install matplotlib (or pip install 'layout-prop[viz]'), or write .svg or .html, "
                            "which need nothing else") from None
    return Figure, FigureCanvasAgg, patches


#: the most pixels a PNG may have: Agg draws into an RGBA buffer of 4 bytes a pixel (400 MB
#: here), and the layered layout of a long chain is very wide (1,000 chained ops: 130 million
#: pixels, 3,000: 400 million, 26 s and 2 GB); vector formats have no such cost
MAX_PNG_PIXELS = 100_000_000


def check_png_size(scene: Scene, path: str | Path, *, scale: float = 1.5) -> None:
    """Raise ``picture-too-large`` (naming ``path``) when the PNG of ``scene`` would have more
    than :data:`MAX_PNG_PIXELS` pixels."""
    width, height = math.ceil(scene.width * scale), math.ceil(scene.height * scale)
    if width * height > MAX_PNG_PIXELS:
        raise VizError("picture-too-large", f"the PNG would be {width} x {height} pixels, over the limit of "
                       f"{MAX_PNG_PIXELS // 1_000_000} million", path=str(path),
                       hint="write .svg or .html (vector pictures of any size), or draw one tensor with --tensor")


def scene_png(scene: Scene, path: str | Path, *, scale: float = 1.5) -> None:
    """Draw the scene with matplotlib (Agg, no window) into a PNG file.

    Raises
    ------
    VizError
        ``png-unavailable`` when matplotlib is not installed; ``picture-too-large`` when
        the picture would have more than :data:`MAX_PNG_PIXELS` pixels.
    """
    check_png_size(scene, path, scale=scale)
    Figure, FigureCanvasAgg, patches = _matplotlib()
    from matplotlib import rc_context

    # unhinted glyphs keep the font's fractional advances, so text spans land where the layout put them
    with rc_context({"text.hinting": "no_hinting"}):
        figure = Figure(figsize=(scene.width / 100, scene.height / 100), dpi=100)
        FigureCanvasAgg(figure)
        axes = figure.add_axes((0, 0, 1, 1))
        axes.set_xlim(0, scene.width)
        axes.set_ylim(scene.height, 0)
        axes.set_axis_off()
        for item in scene.items:
            for shape in item.shapes:
                if isinstance(shape, Text):
                    _mpl_text(axes, shape)
                elif not shape.hit:
                    _mpl_shape(axes, patches, shape)
        figure.savefig(path, format="png", dpi=100 * scale, facecolor="white")


_PT = 0.72  # points per pixel at 100 dpi


def _mpl_shape(axes, patches, shape: Shape) -> None:
    width = shape.width * _PT if shape.stroke else 0.0
    style = (0, (4, 3)) if shape.dash else "solid"
    if not shape.closed:
        xs, ys = zip(*shape.points)
        axes.plot(xs, ys, color=shape.stroke, linewidth=width, linestyle=style, solid_capstyle="butt",
                  solid_joinstyle="miter")
        return
    common = dict(facecolor=shape.fill or "none", edgecolor=shape.stroke or "none", linewidth=width, linestyle=style)
    if shape.rect is not None and shape.radius:
        x, y, w, h = shape.rect
        patch = patches.FancyBboxPatch((x, y), w, h, boxstyle=f"round,pad=0,rounding_size={shape.radius}", **common)
    else:
        patch = patches.Polygon(shape.points, closed=True, **common)
    axes.add_patch(patch)
    if shape.hatch:
        axes.add_patch(patches.Polygon(shape.points, closed=True, facecolor="none", edgecolor=HATCH_COLOUR,
                                       linewidth=0, hatch="////"))


def _mpl_text(axes, text: Text) -> None:
    x = text.x - {"start": 0.0, "middle": text.width / 2, "end": text.width}[text.anchor]
    for span in text.spans:
        axes.text(x, text.y, span.text.replace("$", r"\$"), fontsize=text.size * _PT, family="DejaVu Sans Mono",
                  color=span.colour, weight="bold" if span.bold else "normal", ha="left", va="baseline")
        x += text_width(span.text, text.size)
