"""One tensor's sharding grid: which ranks hold which block (:func:`tensor_grid`), drawn to scale
as a scene (:func:`draw_grid`)."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from itertools import product
from typing import Sequence

from layout_prop.core.placement import Replicate
from layout_prop.core.spec import TensorSpec

from .graph_layout import MARGIN
from .scene import (
    CELL_FILLS,
    INK,
    MUTED,
    Item,
    Scene,
    Span,
    Text,
    VizError,
    _info_text,
    _mesh_spans,
    _placement_spans,
    _tensor_map_text,
    axis_colours,
    rect,
    text_width,
)


# --------------------------------------------------------------------------- tensor grid
@dataclass(frozen=True)
class GridCell:
    """One block of a grid: every rank that holds it, and those ranks grouped by Partial term.

    ``terms`` has one group when the tensor is not Partial; otherwise one group per term
    (ranks that differ on a Partial mesh axis hold different terms of the block).
    """

    row: int
    col: int
    ranks: tuple[int, ...]
    terms: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class GridPanel:
    """The cells for one piece of every non-drawn sharded dim: ``fixed`` holds (dim, start, stop)."""

    fixed: tuple[tuple[int, int, int], ...]
    cells: tuple[GridCell, ...]

    def label(self) -> str:
        return ", ".join(f"dim {d} [{a}:{b}]" for d, a, b in self.fixed)


@dataclass(frozen=True)
class Grid:
    """Which ranks hold which block of a tensor, along two drawn dims.

    ``row_edges`` and ``col_edges`` are the block boundaries of the row and column dims
    (``(0, 1)`` for a missing row dim: a 1-D tensor is one row of columns).  ``panels``
    hold one grid of cells per combination of pieces of the non-drawn sharded dims
    (``split_dims``); ``whole_dims`` are held whole by every rank; ``empty_ranks`` hold an
    empty piece (uneven shards).
    """

    spec: TensorSpec
    row_dim: int | None
    col_dim: int | None
    row_edges: tuple[int, ...]
    col_edges: tuple[int, ...]
    panels: tuple[GridPanel, ...]
    whole_dims: tuple[int, ...]
    split_dims: tuple[int, ...]
    split_pieces: tuple[tuple[tuple[int, int], ...], ...]
    empty_ranks: tuple[int, ...]

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(d for d in (self.row_dim, self.col_dim) if d is not None)

    @property
    def row_sizes(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.row_edges, self.row_edges[1:]))

    @property
    def col_sizes(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.col_edges, self.col_edges[1:]))

    @property
    def nrows(self) -> int:
        return max(len(self.row_edges) - 1, 0)

    @property
    def ncols(self) -> int:
        return max(len(self.col_edges) - 1, 0)

    @property
    def partial(self) -> dict[str, str]:
        """Mesh axes (of more than one rank) on which the tensor is Partial -> reduce op."""
        mesh = self.spec.mesh
        return {mesh.names[a]: op for a, op in self.spec.layout.partial_axes().items() if mesh.shape[a] > 1}

    def cell(self, row: int, col: int, panel: int = 0) -> GridCell:
        return self.panels[panel].cells[row * self.ncols + col]

    def ranks(self, row: int, col: int, panel: int = 0) -> tuple[int, ...]:
        """Every rank that holds block ``(row, col)`` of ``panel``."""
        return self.cell(row, col, panel).ranks

    def blocks(self) -> dict[tuple[int, int, int], tuple[int, ...]]:
        """``(panel, row, col) -> ranks`` for every block."""
        return {(p, c.row, c.col): c.ranks for p, panel in enumerate(self.panels) for c in panel.cells}

    def caption(self) -> list[str]:
        """Sentences that summarise what the drawn dims do not show.

        >>> from layout_prop import DeviceMesh, Layout, TensorSpec
        >>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
        >>> tensor_grid(TensorSpec((4, 6, 8), "float32", Layout(mesh, ["S(0)", "S(2)"], 3)), dims=(0, 1)).caption()
        ['dim 2 split by tp into 2 pieces (4, 4): one panel per piece']
        """
        layout, mesh = self.spec.layout, self.spec.mesh
        lines = []
        if self.whole_dims:
            plural = "s" if len(self.whole_dims) > 1 else ""
            lines.append(f"dim{plural} {', '.join(map(str, self.whole_dims))} whole on every rank")
        for dim, pieces in zip(self.split_dims, self.split_pieces):
            axes = " then ".join(mesh.names[a] for a in layout.dim_axes(dim))
            sizes = ", ".join(str(b - a) for a, b in pieces)
            lines.append(f"dim {dim} split by {axes} into {len(pieces)} pieces ({sizes}): one panel per piece")
        replicated = [mesh.names[a] for a, p in enumerate(layout.placements) if isinstance(p, Replicate)
                      and mesh.shape[a] > 1]
        if replicated:
            lines.append(f"replicated on {', '.join(replicated)}: every rank listed in a block holds a copy of it")
        for name, op in self.partial.items():
            lines.append(f"P({op}) on {name}: a hatched block's rank groups (joined by +) hold terms; "
                         f"the block is their {op}")
        if self.empty_ranks:
            ranks = ", ".join(map(str, self.empty_ranks))
            lines.append(f"ranks {ranks} hold an empty piece (uneven shards)" if len(self.empty_ranks) > 1
                         else f"rank {ranks} holds an empty piece (uneven shards)")
        return lines


def _choose_dims(spec: TensorSpec, dims: Sequence[int] | None) -> tuple[int | None, int | None]:
    ndim = spec.ndim
    if dims is None:
        chosen = [d for d in range(ndim) if spec.layout.shard_count(d) > 1][:2]
        for d in range(ndim):
            if len(chosen) >= min(2, ndim):
                break
            if d not in chosen:
                chosen.append(d)
        chosen.sort()
    else:
        chosen = list(dims)
        hint = (f"give one or two distinct dims in {-ndim}..{ndim - 1}, such as --dims 0,{min(1, ndim - 1)} "
                f"(a negative first dim as --dims=-1,0)" if ndim else "a scalar has no dims to choose")
        where = f"for a tensor of shape {list(spec.shape)}"
        if not chosen or len(chosen) > 2 or (ndim and len(chosen) > ndim):
            raise VizError("bad-dims", f"dims {chosen} {where}: give one or two", hint=hint)
        for d in chosen:
            if isinstance(d, bool) or not isinstance(d, int) or not -ndim <= d < ndim:
                raise VizError("bad-dims", f"dim {d!r} is out of range {where}", hint=hint)
        chosen = [d % ndim for d in chosen]
        if len(set(chosen)) != len(chosen):
            raise VizError("bad-dims", f"dims {list(dims)} name the same dim twice {where}", hint=hint)
    if not chosen:
        return None, None
    if len(chosen) == 1:
        return None, chosen[0]
    return chosen[0], chosen[1]


def tensor_grid(spec: TensorSpec, dims: Sequence[int] | None = None) -> Grid:
    """Which ranks hold which block of ``spec``, along two drawn dims.

    Parameters
    ----------
    spec : TensorSpec
        The tensor, of any rank.
    dims : sequence of int, optional
        The dims drawn as rows and columns (one dim: columns only).  Default: the
        sharded dims (the first two), completed with the lowest other dims, ascending.

    Returns
    -------
    Grid
        Block boundaries per drawn dim (the union of every rank's ``torch.chunk`` piece,
        so uneven shards keep their sizes) and, per panel, each block's ranks.

    Raises
    ------
    VizError
        ``bad-dims`` when ``dims`` is out of range, repeats a dim or has more than two.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
    >>> g = tensor_grid(TensorSpec((4, 6, 8), "float32", Layout(mesh, ["S(0)", "R"], 3)))
    >>> g.dims, g.row_edges, g.col_edges, g.whole_dims
    ((0, 1), (0, 2, 4), (0, 6), (2,))
    >>> g.ranks(0, 0), g.ranks(1, 0)
    ((0, 1), (2, 3))
    >>> p = tensor_grid(TensorSpec((4, 6), "float32", Layout(mesh, ["S(1)", "P(sum)"], 2)))
    >>> p.dims, p.cell(0, 1).ranks, p.cell(0, 1).terms
    ((0, 1), (2, 3), ((2,), (3,)))
    """
    row_dim, col_dim = _choose_dims(spec, dims)
    mesh = spec.mesh
    slices = [spec.local_slices(rank) for rank in range(mesh.size)]
    empty = tuple(rank for rank, s in enumerate(slices) if any(b <= a for a, b in s))
    holders = [rank for rank in range(mesh.size) if rank not in empty]
    pieces = {d: tuple(sorted({slices[r][d] for r in holders})) for d in range(spec.ndim)}
    drawn = {d for d in (row_dim, col_dim) if d is not None}
    split = tuple(d for d in range(spec.ndim) if d not in drawn and len(pieces[d]) > 1)
    whole = tuple(d for d in range(spec.ndim) if d not in drawn and d not in split)

    def edges(dim: int | None) -> tuple[int, ...]:
        if dim is None:
            return (0, 1)
        return tuple(sorted({end for piece in pieces[dim] for end in piece}))

    def holds(rank: int, dim: int | None, start: int, stop: int) -> bool:
        if dim is None:
            return True
        lo, hi = slices[rank][dim]
        return lo <= start and stop <= hi

    row_edges, col_edges = edges(row_dim), edges(col_dim)
    partial_axes = sorted(spec.layout.partial_axes())
    panels = []
    for combo in product(*(pieces[d] for d in split)):
        fixed = tuple((d, a, b) for d, (a, b) in zip(split, combo))
        cells = []
        for i, (r0, r1) in enumerate(zip(row_edges, row_edges[1:])):
            for j, (c0, c1) in enumerate(zip(col_edges, col_edges[1:])):
                ranks = tuple(r for r in holders if holds(r, row_dim, r0, r1) and holds(r, col_dim, c0, c1)
                              and all(slices[r][d] == (a, b) for d, a, b in fixed))
                terms: dict[tuple, list[int]] = {}
                for r in ranks:
                    coords = mesh.coords(r)
                    terms.setdefault(tuple(coords[a] for a in partial_axes), []).append(r)
                cells.append(GridCell(i, j, ranks, tuple(tuple(t) for t in terms.values())))
        panels.append(GridPanel(fixed, tuple(cells)))
    return Grid(spec, row_dim, col_dim, row_edges, col_edges, tuple(panels), whole, split,
                tuple(pieces[d] for d in split), empty)


def _extent(sizes: Sequence[int], low: float, per_smallest: float, high: float) -> float:
    """Pixels for a whole dim: at least ``low``, enough for the smallest piece, at most ``high``."""
    positive = [s for s in sizes if s > 0]
    if not positive:
        return low
    return min(high, max(low, per_smallest * sum(positive) / min(positive)))


def _axis_cut_spans(label: str, dim: int | None, grid: Grid, colours: dict[str, str]) -> list[Span]:
    spec = grid.spec
    if dim is None:
        return [Span(f"{label}: none")]
    spans = [Span(f"{label}: dim {dim} (size {spec.shape[dim]})")]
    axes = spec.layout.dim_axes(dim)
    if not axes:
        return spans + [Span(", whole")]
    spans.append(Span(", cut by "))
    for number, axis in enumerate(axes):
        if number:
            spans.append(Span(" then "))
        name = spec.mesh.names[axis]
        spans.append(Span(name, colours[name], bold=True))
    sizes = list(grid.row_sizes if label == "rows" else grid.col_sizes)
    spans.append(Span(f" into {len(sizes)} pieces ({', '.join(map(str, sizes))})"))
    return spans


def _cell_lines(grid: Grid, cell: GridCell, width: float, height: float) -> list[str]:
    chars = max(1, int((width - 8) / text_width("0", 11.0)))
    if grid.partial:
        head = " ".join(f"P({op})" for op in dict.fromkeys(grid.partial.values()))
        body = " + ".join(",".join(map(str, term)) for term in cell.terms)
    else:
        head = "rank" if len(cell.ranks) == 1 else "ranks"
        body = ", ".join(map(str, cell.ranks))
    lines = [head] + (textwrap.wrap(body, chars) or [""])
    room = max(1, int((height - 6) / 13.0))
    if len(lines) > room:
        lines = lines[:room]
        lines[-1] = lines[-1][: max(chars - 1, 0)] + "…"
    return [line[:chars] if len(line) > chars else line for line in lines]


def _cell_info(grid: Grid, panel: GridPanel, cell: GridCell) -> dict:
    spec = grid.spec
    mesh = spec.mesh
    where = []
    if grid.row_dim is not None:
        where.append(f"dim {grid.row_dim} [{grid.row_edges[cell.row]}:{grid.row_edges[cell.row + 1]}]")
    if grid.col_dim is not None:
        where.append(f"dim {grid.col_dim} [{grid.col_edges[cell.col]}:{grid.col_edges[cell.col + 1]}]")
    where += [f"dim {d} [{a}:{b}]" for d, a, b in panel.fixed]
    rows = [["block", ", ".join(where) or "the whole tensor"]]
    if cell.ranks:
        first = cell.ranks[0]
        rows.append(["global slice", "[" + ", ".join(f"{a}:{b}" for a, b in spec.local_slices(first)) + "]"])
        rows.append(["local shape", str(list(spec.local_shape(first)))])
    rows.append(["ranks", ", ".join(map(str, cell.ranks)) or "none"])
    coords = [[f"rank {r}", ", ".join(f"{n}={c}" for n, c in zip(mesh.names, mesh.coords(r)))] for r in cell.ranks]
    sections = [{"heading": "ranks and their mesh coordinates", "rows": coords}]
    if grid.partial:
        ops = ", ".join(f"P({op}) on {name}" for name, op in grid.partial.items())
        terms = [[f"term {k}", "ranks " + ", ".join(map(str, t))] for k, t in enumerate(cell.terms, 1)]
        sections.append({"heading": f"partial terms ({ops})", "rows": terms})
    return {"title": f"block {', '.join(where) or 'whole tensor'}", "rows": rows, "sections": sections}


def draw_grid(grid: Grid, *, name: str = "", title: str = "") -> Scene:
    """Draw a :class:`Grid` as a :class:`Scene`: blocks to scale, ranks listed, Partial hatched.

    Parameters
    ----------
    grid : Grid
        From :func:`tensor_grid`.
    name : str
        The tensor's name, shown in the heading.
    title : str
        Where it comes from (the spec's file name), shown above the heading.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((4,), ("tp",))
    >>> scene = draw_grid(tensor_grid(TensorSpec((3, 10), "float32", Layout(mesh, ["S(1)"], 2))))
    >>> [round(item.shapes[0].rect[2]) for item in scene.items if item.kind == "cell"]
    [168, 168, 168, 56]
    """
    spec = grid.spec
    mesh = spec.mesh
    colours = axis_colours(mesh)
    width = _extent(grid.col_sizes, 360.0, 56.0, 900.0) if grid.col_dim is not None else 120.0
    height = _extent(grid.row_sizes, 140.0, 46.0, 520.0) if grid.row_dim is not None else 64.0
    col_x = [0.0]
    for size in grid.col_sizes:
        col_x.append(col_x[-1] + width * size / max(sum(grid.col_sizes), 1))
    row_y = [0.0]
    for size in grid.row_sizes:
        row_y.append(row_y[-1] + height * size / max(sum(grid.row_sizes), 1))
    row_labels = [f"{a}:{b}" for a, b in zip(grid.row_edges, grid.row_edges[1:])] if grid.row_dim is not None else []
    row_head = max([text_width(label, 10.0) for label in row_labels] + [24.0]) + 12
    panel_head = 22.0 if grid.split_dims else 0.0
    col_head = 18.0
    panel_w = row_head + width + 28
    panel_h = panel_head + col_head + height + 22
    per_line = max(1, min(len(grid.panels), int(1300 // panel_w)))

    heading_spans = [Span(f"{name or 'tensor'}: ", bold=True), Span(f"{spec.dtype}{list(spec.shape)} ", bold=True)]
    heading_spans += _placement_spans(spec.layout, colours)
    lines = [
        Text(MARGIN, MARGIN + 14, (Span(title or "layout-prop tensor grid", MUTED),), 12.0),
        Text(MARGIN, MARGIN + 34, tuple(heading_spans), 15.0),
        Text(MARGIN, MARGIN + 54, tuple([Span(f"tensor_map {_tensor_map_text(spec)} on mesh ")]
                                        + _mesh_spans(mesh, colours) + [Span(f" ({mesh.size} ranks)")]), 12.0),
        Text(MARGIN, MARGIN + 72, tuple(_axis_cut_spans("rows", grid.row_dim, grid, colours)), 12.0),
        Text(MARGIN, MARGIN + 90, tuple(_axis_cut_spans("columns", grid.col_dim, grid, colours)), 12.0),
    ]
    items = [Item(lines, kind="heading")]
    info: dict[str, dict] = {}
    top = MARGIN + 106
    for p, panel in enumerate(grid.panels):
        px = MARGIN + (p % per_line) * panel_w
        py = top + (p // per_line) * panel_h
        shapes: list = []
        if panel_head:
            shapes.append(Text(px + row_head, py + 14, (Span(panel.label(), bold=True),), 12.0))
        gx, gy = px + row_head, py + panel_head + col_head
        if grid.col_dim is not None:
            for j, (a, b) in enumerate(zip(grid.col_edges, grid.col_edges[1:])):
                shapes.append(Text(gx + (col_x[j] + col_x[j + 1]) / 2, gy - 5, (Span(f"{a}:{b}", MUTED),), 10.0,
                                   "middle"))
        for i, label in enumerate(row_labels):
            shapes.append(Text(gx - 6, gy + (row_y[i] + row_y[i + 1]) / 2 + 4, (Span(label, MUTED),), 10.0, "end"))
        items.append(Item(shapes, kind="panel"))
        for cell in panel.cells:
            x0, x1 = gx + col_x[cell.col], gx + col_x[cell.col + 1]
            y0, y1 = gy + row_y[cell.row], gy + row_y[cell.row + 1]
            fill = CELL_FILLS[(cell.row * grid.ncols + cell.col) % len(CELL_FILLS)]
            cell_shapes: list = [rect(x0, y0, x1 - x0, y1 - y0, fill=fill, stroke=INK, width=1.0,
                                      hatch=bool(grid.partial))]
            texts = _cell_lines(grid, cell, x1 - x0, y1 - y0)
            baseline = (y0 + y1) / 2 - (len(texts) - 1) * 13.0 / 2 + 4
            if grid.partial:  # keep the rank list readable over the hatching
                widest = max(text_width(t, 11.0) for t in texts) + 8
                cell_shapes.append(rect((x0 + x1 - widest) / 2, baseline - 13, widest, len(texts) * 13.0 + 5,
                                        fill="#FFFFFF", stroke=None, radius=3.0))
            for number, text in enumerate(texts):
                bold = number > 0
                cell_shapes.append(Text((x0 + x1) / 2, baseline + number * 13.0, (Span(text, INK, bold),), 11.0,
                                        "middle"))
            item_id = f"c{p}-{cell.row}-{cell.col}"
            info[item_id] = _cell_info(grid, panel, cell)
            items.append(Item(cell_shapes, item_id, "cell", _info_text(info[item_id])))
    rows_of_panels = (len(grid.panels) + per_line - 1) // per_line
    y = top + rows_of_panels * panel_h + 6
    caption = grid.caption() + ["each block lists every rank that holds it; widths and heights are to scale"]
    caption_texts = [Text(MARGIN, y + 12 + k * 16, (Span(line),), 12.0) for k, line in enumerate(caption)]
    y += 12 + len(caption) * 16
    legend: list = []
    x = MARGIN
    for axis, (axis_name, size) in enumerate(zip(mesh.names, mesh.shape)):
        legend.append(rect(x, y + 2, 12, 12, fill=colours[axis_name], stroke=None))
        label = f"{axis_name} (mesh axis {axis}, {size} ranks)"
        legend.append(Text(x + 17, y + 12, (Span(label),), 11.0))
        x += 17 + text_width(label, 11.0) + 18
    legend.append(rect(x, y, 34, 16, fill="#FFFFFF", stroke=INK, hatch=True))
    legend.append(Text(x + 40, y + 12, (Span("hatched: Partial (ranks hold terms)"),), 11.0))
    x += 40 + text_width("hatched: Partial (ranks hold terms)", 11.0)
    items.append(Item(caption_texts + legend, kind="legend"))
    right = max([MARGIN + per_line * panel_w, x] + [MARGIN + t.width for t in lines + caption_texts])
    summary = [f"{name or 'tensor'}: {spec.dtype}{list(spec.shape)} {spec.layout} on {mesh}"] + caption
    return Scene(right + MARGIN, y + 16 + MARGIN, items, title=f"{title} {name}".strip() or "tensor grid",
                 summary=summary, info=info)
