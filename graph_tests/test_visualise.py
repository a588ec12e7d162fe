"""``layout-prop viz``: the graph picture in four formats, the tensor grid, the HTML page in a browser, errors.

The grid tests compute the expected block -> rank mapping by hand, from the ``torch.chunk``
rule and row-major rank numbering, never with ``TensorSpec.local_slices``.  The browser
tests open the HTML page in headless Chromium: they skip when it is missing, except under
CI (``CI=true``), where ``.ci/run`` installs it and a missing browser is a failure.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from itertools import product
from pathlib import Path

import pytest

from layout_prop import DeviceMesh, Layout, TensorSpec
from layout_prop.api import analyze
from layout_prop.core.errors import SpecError
from layout_prop.core.graph import Graph
from layout_prop.io.loader import load_spec
from layout_prop.commands.viz import add_parser as add_viz_parser
from layout_prop.commands.viz import run as cmd_viz
from layout_prop.viz import (
    FORMATS,
    Visualise,
    VizError,
    axis_colours,
    draw_grid,
    scene_svg,
    tensor_grid,
)
from layout_prop.viz.scene import VIOLATION_RED

from .cli_support import relu_chain

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples" / "rpe").glob("*.yaml"))
DP_TP_SP = ROOT / "examples" / "rpe" / "dp_tp_sp.yaml"
SVG = "{http://www.w3.org/2000/svg}"

# x shards RPE's rotation dim and sin is Partial: two violations.  The greedy fix (what
# check without --reshard proposes) gathers x on tp and all-reduces sin on dp; --reshard's
# whole-graph plan instead moves x's tp split to the sequence dim (all-to-all) and slices
# cos and sin to match.
BROKEN = """
mesh: {shape: [2, 2], names: [dp, tp]}
inputs:
  x:   {shape: [4, 4, 16, 64], placements: ["S(0)", "S(3)"]}
  cos: {shape: [1, 1, 16, 64], placements: [R, R]}
  sin: {shape: [1, 1, 16, 64], placements: ["P(sum)", R]}
nodes:
  - {name: y, op: rotary_position_embedding, inputs: [x, cos, sin], attrs: {mode: 0}}
  - {name: z, op: add, inputs: [y, x]}
outputs: [z]
"""

FLAG_SETS = [(), ("--reshard",), ("--backward",), ("--reshard", "--backward")]


HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture
def broken_spec(tmp_path: Path) -> Path:
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN, encoding="utf-8")
    return path


def spec_path(name: str, tmp_path: Path) -> Path:
    """An example by stem, or the violating spec above written to ``tmp_path``."""
    if name == "broken":
        path = tmp_path / "broken.yaml"
        path.write_text(BROKEN, encoding="utf-8")
        return path
    return ROOT / "examples" / "rpe" / f"{name}.yaml"


def viz(*argv) -> int:
    """``layout-prop viz ARGV`` through the subcommand's own parser and handler."""
    parser = argparse.ArgumentParser(prog="layout-prop")
    add_viz_parser(parser.add_subparsers(dest="command"))
    return cmd_viz(parser.parse_args(["viz", *map(str, argv)]))


def analysed(path: Path, flags=()) -> Graph:
    return analyze(load_spec(path), reshard="--reshard" in flags, backward="--backward" in flags).graph


def svg_lines(path: Path) -> list[str]:
    """Every <text> line of an SVG file; parsing it proves it is well-formed XML."""
    root = ET.parse(path).getroot()
    assert root.tag == SVG + "svg"
    return ["".join(text.itertext()) for text in root.iter(SVG + "text")]


def svg_groups(path: Path) -> list[ET.Element]:
    return [g for g in ET.parse(path).getroot().iter(SVG + "g")]


def page_data(page: str) -> dict:
    found = re.search(r'<script type="application/json" id="viz-data">(.*?)</script>', page, re.S)
    assert found, "the page has no data script"
    return json.loads(found.group(1))


# --------------------------------------------------------------------------- (1) four formats per example
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_viz_writes_every_format_for_every_example(tmp_path, capsys, example, fmt):
    out = tmp_path / f"graph.{fmt}"
    if fmt == "png" and not HAS_MATPLOTLIB:
        with pytest.raises(VizError) as err:
            viz(example, "--reshard", "--backward", "-o", out)
        assert err.value.code == "png-unavailable"
        assert not out.exists()
        return
    assert viz(example, "--reshard", "--backward", "-o", out) == 0
    data = out.read_bytes()
    signature = {"html": b"<!DOCTYPE html>", "svg": b'<?xml version="1.0" encoding="UTF-8"?>\n<svg',
                 "png": b"\x89PNG\r\n\x1a\n", "dot": b'digraph "layout-prop" {'}[fmt]
    assert data.startswith(signature)
    if fmt == "png":  # IHDR: width and height, big-endian, after the 8-byte signature and 8-byte chunk head
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width > 600 and height > 300
    assert capsys.readouterr().out.startswith(f"wrote {out} (9 nodes, 0 violations)")


def test_png_without_matplotlib_is_a_typed_error(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    out = tmp_path / "graph.png"
    with pytest.raises(VizError) as err:
        viz(DP_TP_SP, "-o", out)
    assert err.value.code == "png-unavailable"
    assert str(err.value) == (
        "png-unavailable: writing a .png needs matplotlib, which is not installed (hint: pip install matplotlib "
        "(or pip install 'layout-prop[viz]'), or write .svg or .html, which need nothing else)")
    assert not out.exists()


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed (the test extra installs it)")
def test_png_of_a_tensor_grid(tmp_path):
    out = tmp_path / "x.png"
    assert viz(DP_TP_SP, "--tensor", "x", "-o", out) == 0
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_a_png_too_large_to_draw_is_refused_before_drawing(tmp_path):
    """A chain of 1,000 ops is drawn in one row 295,000 pixels wide: as a PNG (130 million pixels)
    it is refused at once; the same graph as SVG is written."""
    spec = tmp_path / "chain.json"
    spec.write_text(json.dumps(relu_chain(1000)))
    out = tmp_path / "chain.png"
    with pytest.raises(VizError) as err:
        viz(spec, "-o", out)
    assert err.value.code == "picture-too-large" and err.value.path == str(out) and ".svg" in err.value.hint
    assert "over the limit of 100 million" in err.value.message
    assert not out.exists() and list(tmp_path.iterdir()) == [spec]  # no temporary file left either
    assert viz(spec, "-o", tmp_path / "chain.svg") == 0


# --------------------------------------------------------------------------- (2) SVG: well formed, every node
@pytest.mark.parametrize("flags", FLAG_SETS, ids=lambda f: "+".join(f) or "plain")
@pytest.mark.parametrize("name", [p.stem for p in EXAMPLES] + ["broken"])
def test_svg_is_well_formed_and_names_every_node(tmp_path, name, flags):
    spec = spec_path(name, tmp_path)
    out = tmp_path / "graph.svg"
    viz(spec, *flags, "-o", out)
    lines = set(svg_lines(out))
    graph = analysed(spec, flags)
    missing = [node.name for node in graph.nodes if node.name not in lines]
    assert missing == []
    if "--backward" in flags:
        grads = [node.name for node in graph.nodes if node.meta.get("grad_of")]
        assert grads and set(grads) <= lines


def test_svg_draws_inserted_redistributions_with_steps_and_bytes(tmp_path, broken_spec):
    out = tmp_path / "graph.svg"
    viz(broken_spec, "--reshard", "-o", out)
    inserted = {g.find(SVG + "text").findtext(SVG + "tspan"): g for g in svg_groups(out)
                if "redistribute" in g.get("class", "")}
    assert set(inserted) == {"y/x", "y/sin"}  # the two nodes reshard inserted, drawn as redistributions
    # planned over the whole graph: x moves its tp shard from D to S by an all-to-all (S sharded for
    # y and for z alike), sin is sliced on tp then reduced on dp
    x_move = ["".join(t.itertext()) for t in inserted["y/x"].iter(SVG + "text")]
    assert x_move == ["y/x", "redistribute → (S(0), S(2))", "all-to-all on tp: 8,192 B", "8,192 B per rank"]
    sin_move = ["".join(t.itertext()) for t in inserted["y/sin"].iter(SVG + "text")]
    assert sin_move[2:] == ["local-slice on tp: 0 B", "all-reduce(sum) on dp: 2,048 B", "2,048 B per rank"]
    hexagon = inserted["y/x"].find(SVG + "polygon")
    assert len(hexagon.get("points").split()) == 6


def test_svg_marks_violations_red_with_their_code(tmp_path, broken_spec):
    out = tmp_path / "graph.svg"
    viz(broken_spec, "-o", out)
    groups = svg_groups(out)
    violated_edges = [g for g in groups if g.get("class") == "edge violated"]
    codes = sorted("".join(t.itertext()) for g in violated_edges for t in g.iter(SVG + "text")
                   if "✗" in "".join(t.itertext()))
    assert codes == ["✗ partial-input", "✗ sharded-rotation-dim"]
    for group in violated_edges:
        assert group.findall(SVG + "polyline")[1].get("stroke") == VIOLATION_RED
    node_y = next(g for g in groups if "node" in g.get("class", "") and g.find(SVG + "text").findtext(SVG + "tspan") == "y")
    assert node_y.find(SVG + "rect").get("stroke") == VIOLATION_RED
    red_codes = [t.text for t in node_y.iter(SVG + "tspan") if t.get("fill") == VIOLATION_RED]
    assert red_codes == ["✗ sharded-rotation-dim", "✗ partial-input"]


def test_edges_carry_placements_coloured_by_mesh_axis_and_local_shapes(tmp_path):
    out = tmp_path / "graph.svg"
    viz(DP_TP_SP, "-o", out)
    colours = axis_colours(DeviceMesh((2, 2, 2), ("dp", "tp", "sp")))
    edges = [g for g in svg_groups(out) if g.get("class") == "edge"]
    assert len(edges) == 3
    labels = sorted(tuple("".join(t.itertext()) for t in g.iter(SVG + "text")) for g in edges)
    assert labels == [("(R, R, S(2))", "local [1, 1, 8, 64]"), ("(R, R, S(2))", "local [1, 1, 8, 64]"),
                      ("(S(0), S(1), S(2))", "local [2, 2, 8, 64]")]
    fills = {t.text: t.get("fill") for g in edges for t in g.iter(SVG + "tspan") if t.text.startswith("S(")}
    assert fills == {"S(0)": colours["dp"], "S(1)": colours["tp"], "S(2)": colours["sp"]}


def test_layers_run_left_to_right_and_nodes_never_overlap(broken_spec):
    graph = analysed(broken_spec, ("--reshard", "--backward"))
    scene = Visualise().run(graph)
    boxes = {}
    for item in scene.items:
        if item.id and item.id.startswith("n") and "alias" not in item.kind:
            xs = [x for x, _ in item.shapes[0].points]
            ys = [y for _, y in item.shapes[0].points]
            boxes[scene.info[item.id]["title"]] = (min(xs), min(ys), max(xs), max(ys))
    assert set(boxes) == {node.name for node in graph.nodes}
    for src, dst in graph.nx.edges():
        assert boxes[src][2] < boxes[dst][0], f"{src} is not left of {dst}"
    names = sorted(boxes)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            (ax0, ay0, ax1, ay1), (bx0, by0, bx1, by1) = boxes[a], boxes[b]
            assert ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0, f"{a} overlaps {b}"


def deep_chain(blocks: int) -> Graph:
    """``blocks`` RPE blocks in a chain, every one reading the same cos, sin and w inputs."""
    g = Graph(DeviceMesh((2, 2, 2), ("dp", "tp", "sp")))
    x = g.input("x", shape=(8, 16, 128, 64), placements=["S(0)", "S(1)", "S(2)"])
    cos = g.input("cos", shape=(1, 1, 128, 64), placements=["R", "R", "S(2)"], requires_grad=False)
    sin = g.input("sin", shape=(1, 1, 128, 64), placements=["R", "R", "R"], requires_grad=False)
    w = g.input("w", shape=(64,), placements=["R", "R", "R"])
    for i in range(blocks):
        h = g.op(f"rope{i}", "rotary_position_embedding", [x, cos, sin], {"mode": i % 4})
        x = g.op(f"res{i}", "add", [g.op(f"scale{i}", "mul", [h, w]), x])
    g.output(x)
    return analyze(g).graph


def test_deep_graphs_draw_shared_inputs_again_and_stay_level():
    scene = Visualise().run(deep_chain(300))  # 904 nodes
    cos_id = next(i for i, info in scene.info.items() if info["title"] == "cos")
    cos_boxes = [item for item in scene.items if item.id == cos_id]
    # cos feeds every block (one every 3 layers): drawn once for blocks 0 and 1 (3 layers apart, within
    # MAX_SPAN), then again (dashed, same details) just before each of the 298 farther blocks
    assert len(cos_boxes) == 299
    assert sum("alias" in item.kind for item in cos_boxes) == 298
    assert all(item.shapes[0].dash for item in cos_boxes if "alias" in item.kind)
    short = Visualise().run(deep_chain(30))
    assert scene.height < 1.5 * short.height  # a chain stays about level: 10x the blocks, not 10x the height
    assert 'stroke-dasharray="4 3"' in scene_svg(scene)


def test_axis_colours_are_fixed_per_name_and_never_red():
    three = axis_colours(DeviceMesh((2, 2, 2), ("dp", "tp", "sp")))
    two = axis_colours(DeviceMesh((2, 2), ("sp", "dp")))
    assert (three["dp"], three["sp"]) == (two["dp"], two["sp"])
    assert len(set(three.values())) == 3
    odd = axis_colours(DeviceMesh((2, 2, 2, 2), ("rows", "cols", "depth", "dp")))
    assert odd["dp"] == three["dp"] and len(set(odd.values())) == 4
    assert VIOLATION_RED not in set(three.values()) | set(odd.values())


# --------------------------------------------------------------------------- (3) DOT: every node and edge
@pytest.mark.parametrize("flags", FLAG_SETS, ids=lambda f: "+".join(f) or "plain")
@pytest.mark.parametrize("name", ["dp_tp_sp", "dp_b", "broken"])
def test_dot_holds_every_node_and_edge(tmp_path, name, flags):
    spec = spec_path(name, tmp_path)
    out = tmp_path / "graph.dot"
    viz(spec, *flags, "-o", out)
    text = out.read_text(encoding="utf-8")
    quoted = r'"((?:[^"\\]|\\.)*)"'
    declared = re.findall(rf"^  {quoted} \[", text, re.M)
    edges = Counter(re.findall(rf"^  {quoted} -> {quoted} \[", text, re.M))
    graph = analysed(spec, flags)
    assert sorted(declared) == sorted(node.name for node in graph.nodes)
    assert edges == Counter((src, dst) for src, dst, _ in graph.nx.edges(keys=True))
    if shutil.which("dot"):  # Graphviz is optional; when it is here, it must accept the file
        done = subprocess.run(["dot", "-Tsvg", str(out)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr


def test_dot_marks_violations_and_redistributions(tmp_path, broken_spec):
    plain, resharded = tmp_path / "plain.dot", tmp_path / "reshard.dot"
    viz(broken_spec, "-o", plain)
    viz(broken_spec, "--reshard", "-o", resharded)
    plain_text = plain.read_text(encoding="utf-8")
    assert plain_text.count(f'color="{VIOLATION_RED}", penwidth=2.0') == 2  # the two violating inputs
    assert "✗ sharded-rotation-dim" in plain_text and "✗ partial-input" in plain_text
    line = next(line for line in resharded.read_text(encoding="utf-8").splitlines() if line.startswith('  "y/x" ['))
    assert "shape=hexagon" in line and "8,192 B per rank" in line  # the all-to-all the global reshard chose


# --------------------------------------------------------------------------- (4) tensor_grid
def chunk(n: int, k: int) -> list[tuple[int, int]]:
    """torch.chunk: pieces of ceil(n / k); the last pieces may be short or empty."""
    size = -(-n // k)
    return [(min(i * size, n), min((i + 1) * size, n)) for i in range(k)]


def pieces_by_rank(shape, mesh_shape, placements) -> dict[int, list[tuple[int, int]]]:
    """Rank -> per dim [start, stop): ranks row-major on the mesh, the outer mesh axis cutting a dim first."""
    out = {}
    for rank, coords in enumerate(product(*(range(size) for size in mesh_shape))):
        bounds = []
        for dim, n in enumerate(shape):
            lo, hi = 0, n
            for axis, placement in enumerate(placements):
                if placement == f"S({dim})":
                    a, b = chunk(hi - lo, mesh_shape[axis])[coords[axis]]
                    lo, hi = lo + a, lo + b
            bounds.append((lo, hi))
        out[rank] = bounds
    return out


def make_spec(shape, mesh_shape, names, placements) -> TensorSpec:
    return TensorSpec(shape, "float32", Layout(DeviceMesh(mesh_shape, names), placements, len(shape)))


def expected_blocks(grid, shape, mesh_shape, placements) -> dict:
    """(panel, row, col) -> ranks, from pieces_by_rank and the grid's boundaries."""
    pieces = pieces_by_rank(shape, mesh_shape, placements)
    out = {}
    for p, panel in enumerate(grid.panels):
        for i, row in enumerate(zip(grid.row_edges, grid.row_edges[1:])):
            for j, col in enumerate(zip(grid.col_edges, grid.col_edges[1:])):
                out[(p, i, j)] = tuple(
                    rank for rank, bounds in pieces.items()
                    if (grid.row_dim is None or bounds[grid.row_dim] == row) and bounds[grid.col_dim] == col
                    and all(bounds[d] == (a, b) for d, a, b in panel.fixed) and all(b > a for a, b in bounds))
    return out


MESH_222 = ((2, 2, 2), ("dp", "tp", "sp"))


def test_grid_of_a_4d_tensor_with_one_dim_cut_by_two_mesh_axes():
    # dim 0 by dp: 0:2, 2:4; dim 2 by tp (10 -> 5, 5) then sp (5 -> 3, 2): 0:3, 3:5, 5:8, 8:10.
    # Rank = 4 dp + 2 tp + sp, so column c (= 2 tp + sp) of row r is rank 4 r + c.
    grid = tensor_grid(make_spec((4, 6, 10, 8), *MESH_222, ["S(0)", "S(2)", "S(2)"]))
    assert grid.dims == (0, 2)
    assert grid.row_edges == (0, 2, 4)
    assert grid.col_edges == (0, 3, 5, 8, 10)
    assert (grid.whole_dims, grid.split_dims) == ((1, 3), ())
    assert grid.blocks() == {
        (0, 0, 0): (0,), (0, 0, 1): (1,), (0, 0, 2): (2,), (0, 0, 3): (3,),
        (0, 1, 0): (4,), (0, 1, 1): (5,), (0, 1, 2): (6,), (0, 1, 3): (7,),
    }
    assert grid.caption() == ["dims 1, 3 whole on every rank"]


def test_grid_of_a_4d_tensor_sharded_on_three_dims_draws_small_multiples():
    spec = make_spec((4, 6, 10, 8), *MESH_222, ["S(0)", "S(1)", "S(2)"])
    grid = tensor_grid(spec)  # default: the first two sharded dims; dim 2 (cut by sp) becomes two panels
    assert grid.dims == (0, 1)
    assert (grid.row_edges, grid.col_edges) == ((0, 2, 4), (0, 3, 6))
    assert (grid.split_dims, grid.split_pieces, grid.whole_dims) == ((2,), (((0, 5), (5, 10)),), (3,))
    assert [panel.fixed for panel in grid.panels] == [((2, 0, 5),), ((2, 5, 10),)]
    # panel p holds sp = p; row r is dp = r, column c is tp = c: rank 4 r + 2 c + p
    assert grid.blocks() == {
        (0, 0, 0): (0,), (0, 0, 1): (2,), (0, 1, 0): (4,), (0, 1, 1): (6,),
        (1, 0, 0): (1,), (1, 0, 1): (3,), (1, 1, 0): (5,), (1, 1, 1): (7,),
    }
    assert grid.caption() == ["dim 3 whole on every rank",
                              "dim 2 split by sp into 2 pieces (5, 5): one panel per piece"]
    chosen = tensor_grid(spec, dims=(0, 2))  # --dims 0,2: dim 1 (cut by tp) becomes the panels
    assert (chosen.col_edges, chosen.split_dims) == ((0, 5, 10), (1,))
    assert chosen.blocks() == {  # panel p is tp = p, column c is sp = c: rank 4 r + 2 p + c
        (0, 0, 0): (0,), (0, 0, 1): (1,), (0, 1, 0): (4,), (0, 1, 1): (5,),
        (1, 0, 0): (2,), (1, 0, 1): (3,), (1, 1, 0): (6,), (1, 1, 1): (7,),
    }


@pytest.mark.parametrize("shape, mesh, placements, dims", [
    ((4, 6, 10, 8), MESH_222, ["S(0)", "S(2)", "S(2)"], None),
    ((4, 6, 10, 8), MESH_222, ["S(0)", "S(1)", "S(2)"], None),
    ((4, 6, 10, 8), MESH_222, ["S(0)", "S(1)", "S(2)"], (3, 1)),
    ((4, 6, 10, 8), MESH_222, ["S(3)", "R", "S(1)"], (2, 0)),
    ((7, 5, 9), MESH_222, ["S(2)", "S(0)", "S(2)"], None),
    ((5, 3, 11, 2), MESH_222, ["S(1)", "S(2)", "S(0)"], (0, 2)),
    ((9,), ((4,), ("tp",)), ["S(0)"], None),
    ((3, 10), ((4,), ("tp",)), ["S(1)"], None),
])
def test_grid_blocks_match_the_torch_chunk_rule(shape, mesh, placements, dims):
    grid = tensor_grid(make_spec(shape, *mesh, placements), dims)
    if dims is not None:
        assert grid.dims == tuple(dims)
    assert grid.blocks() == expected_blocks(grid, shape, mesh[0], placements)
    held = sorted(r for ranks in grid.blocks().values() for r in ranks)
    empty = [r for r, bounds in pieces_by_rank(shape, mesh[0], placements).items() if any(b <= a for a, b in bounds)]
    assert held == sorted(set(range(len(held) + len(empty))) - set(empty))  # every non-empty rank, exactly once
    assert list(grid.empty_ranks) == empty


def test_uneven_shards_are_drawn_to_scale():
    spec = make_spec((3, 10), (4,), ("tp",), ["S(1)"])  # 10 on 4 -> 3, 3, 3, 1
    grid = tensor_grid(spec)
    assert grid.col_sizes == (3, 3, 3, 1)
    assert [grid.ranks(0, c) for c in range(4)] == [(0,), (1,), (2,), (3,)]
    widths = [item.shapes[0].rect[2] for item in draw_grid(grid).items if item.kind == "cell"]
    unit = sum(widths) / 10
    assert widths == pytest.approx([3 * unit, 3 * unit, 3 * unit, unit])
    short = tensor_grid(make_spec((3,), (4,), ("tp",), ["S(0)"]))  # 3 on 4 -> 1, 1, 1, 0
    assert (short.col_sizes, short.empty_ranks) == ((1, 1, 1), (3,))
    assert short.caption()[-1] == "rank 3 holds an empty piece (uneven shards)"


def test_partial_blocks_list_the_ranks_of_each_term_and_are_hatched():
    mesh = ((2, 2), ("dp", "tp"))
    partial = tensor_grid(make_spec((4, 6), *mesh, ["R", "P(sum)"]))
    # every rank holds the whole block; tp = rank % 2 tells the term, dp copies it
    assert partial.cell(0, 0).ranks == (0, 1, 2, 3)
    assert partial.cell(0, 0).terms == ((0, 2), (1, 3))
    assert partial.partial == {"tp": "sum"}
    sharded = tensor_grid(make_spec((4, 6), *mesh, ["S(0)", "P(max)"]))
    assert [(c.ranks, c.terms) for c in sharded.panels[0].cells] == [((0, 1), ((0,), (1,))), ((2, 3), ((2,), (3,)))]
    scene = draw_grid(sharded, name="p")
    cells = [item for item in scene.items if item.kind == "cell"]
    assert all(item.shapes[0].hatch for item in cells)
    assert [[t.content for t in item.shapes if hasattr(t, "content")] for item in cells] == [
        ["P(max)", "0 + 1"], ["P(max)", "2 + 3"]]
    assert "P(max) on tp: a hatched block's rank groups (joined by +) hold terms; the block is their max" in \
        sharded.caption()
    svg = scene_svg(scene)
    plain_svg = scene_svg(draw_grid(tensor_grid(make_spec((4, 6), *mesh, ["S(0)", "R"]))))
    assert svg.count('fill="url(#lp-hatch)"') == 2 + 1  # both blocks and the legend's sample
    assert plain_svg.count('fill="url(#lp-hatch)"') == 1  # the legend's sample only


def test_grid_of_scalars_and_vectors():
    scalar = tensor_grid(make_spec((), (2,), ("dp",), ["R"]))
    assert (scalar.dims, scalar.blocks()) == ((), {(0, 0, 0): (0, 1)})
    vector = tensor_grid(make_spec((9,), (4,), ("tp",), ["S(0)"]))
    assert (vector.row_dim, vector.col_dim, vector.col_sizes) == (None, 0, (3, 3, 3))
    assert vector.empty_ranks == (3,)


@pytest.mark.parametrize("dims, message", [
    ((0, 9), "dim 9 is out of range for a tensor of shape [4, 6, 10, 8]"),
    ((1, -3), "dims [1, -3] name the same dim twice for a tensor of shape [4, 6, 10, 8]"),
    ((0, 1, 2), "dims [0, 1, 2] for a tensor of shape [4, 6, 10, 8]: give one or two"),
])
def test_bad_dims_are_typed_errors(dims, message):
    with pytest.raises(VizError) as err:
        tensor_grid(make_spec((4, 6, 10, 8), *MESH_222, ["S(0)", "S(1)", "S(2)"]), dims)
    assert err.value.code == "bad-dims"
    assert err.value.message == message
    assert err.value.hint == ("give one or two distinct dims in -4..3, such as --dims 0,1 "
                              "(a negative first dim as --dims=-1,0)")


# --------------------------------------------------------------------------- the tensor view end to end
@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "png"])
def test_viz_tensor_writes_the_grid(tmp_path, fmt):
    out = tmp_path / f"x.{fmt}"
    assert viz(DP_TP_SP, "--tensor", "x", "--dims", "1,2", "-o", out) == 0
    text = out.read_text(encoding="utf-8")
    if fmt == "svg":
        lines = svg_lines(out)
        # x is (S(0), S(1), S(2)): dims 1 (tp) and 2 (sp) drawn, dim 0 (dp) split into two panels
        assert "dim 0 [0:2]" in lines and "dim 0 [2:4]" in lines
        assert sorted(line for line in lines if line.isdigit()) == [str(r) for r in range(8)]
    elif fmt == "html":
        assert len(page_data(text)) == 8  # one side-panel entry per block
    else:
        assert text.count("<TD BGCOLOR") == 8


def test_viz_tensor_gradient_needs_backward(tmp_path):
    out = tmp_path / "g.svg"
    with pytest.raises(VizError) as err:
        viz(DP_TP_SP, "--tensor", "grad:cos", "-o", out)
    assert err.value.code == "unknown-value"
    assert err.value.hint.startswith("gradients exist with --backward; ")
    assert viz(DP_TP_SP, "--backward", "--tensor", "grad:cos", "-o", out) == 0
    lines = svg_lines(out)  # (R, R, S(2)) on dp x tp x sp: two blocks along sp, each copied on dp and tp
    assert "0, 2, 4, 6" in lines and "1, 3, 5, 7" in lines


# --------------------------------------------------------------------------- the HTML page (no browser)
def test_html_is_self_contained_and_describes_every_node_and_edge(tmp_path):
    out = tmp_path / "graph.html"
    viz(DP_TP_SP, "--reshard", "--backward", "-o", out)
    page = out.read_text(encoding="utf-8")
    assert not re.search(r"<link|<img|<iframe|<object|\bsrc=|\bhref=|@import|url\((?!#lp-hatch\))", page, re.I)
    assert "default-src 'none'" in page  # the Content-Security-Policy forbids fetching anything
    data = page_data(page)
    assert set(re.findall(r'data-id="([^"]+)"', page)) == set(data)
    graph = analysed(DP_TP_SP, ("--reshard", "--backward"))
    titles = {info["title"]: info for info in data.values()}
    assert {node.name for node in graph.nodes} <= set(titles)
    x_rows = dict(titles["x"]["sections"][0]["rows"])
    assert x_rows == {"shape": "[4, 4, 16, 64]", "dtype": "float32", "placements": "(S(0), S(1), S(2))",
                      "tensor_map": "[2, 1, 0, -1]", "local shape (rank 0)": "[2, 2, 8, 64]",
                      "bytes (rank 0 / all)": "8,192 / 65,536"}
    edge = titles["grad/y/rotary_position_embedding_grad1:1 -> grad/cos"]
    move = next(s for s in edge["sections"] if s["heading"].startswith("redistribution"))
    assert [row[1] for row in move["rows"]] == [
        "(P(sum), P(sum), S(2))", "(R, R, S(2))", "all-reduce(sum) on dp: 2,048 B per rank",
        "all-reduce(sum) on tp: 2,048 B per rank", "4,096"]


# --------------------------------------------------------------------------- (5) the page in a browser
def _find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture
def chromium() -> str:
    found = _find_chromium()
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not on PATH, but CI=true: .ci/run installs it, so the browser test must run")
        pytest.skip("chromium is not on PATH (CI installs it; apt-get install chromium to run this here)")
    return found


def load_page(chromium: str, page: Path, tmp_path: Path, fragment: str = "") -> tuple[str, list[str]]:
    """Open ``page`` in headless Chromium: the DOM after its scripts ran, and the console's messages."""
    command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={tmp_path / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
               "--dump-dom", page.as_uri() + fragment]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    console = [line for line in done.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    return done.stdout, console


def test_browser_check_catches_a_script_error(chromium, tmp_path):
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><body data-ready="0"><script>notDefined();'
                    'document.body.setAttribute("data-ready", "1");</script></body></html>', encoding="utf-8")
    dom, console = load_page(chromium, page, tmp_path)
    assert any("Uncaught ReferenceError: notDefined is not defined" in line for line in console)
    assert 'data-ready="1"' not in dom


@pytest.mark.parametrize("name, flags", [("dp_tp_sp", ("--reshard", "--backward")), ("broken", ()),
                                         ("broken", ("--reshard", "--backward"))])
def test_html_runs_in_a_browser_without_console_errors(chromium, tmp_path, name, flags):
    spec = spec_path(name, tmp_path)
    out = tmp_path / "graph.html"
    viz(spec, *flags, "-o", out)
    dom, console = load_page(chromium, out, tmp_path)
    assert console == []
    assert '<body data-ready="1">' in dom  # the script ran to its end without throwing
    missing = [node.name for node in analysed(spec, flags).nodes
               if f">{html.escape(node.name, quote=False)}</tspan>" not in dom]
    assert missing == []


def test_picking_an_item_shows_its_spec_and_redistribution_in_the_panel(chromium, tmp_path, broken_spec):
    out = tmp_path / "graph.html"
    viz(broken_spec, "--reshard", "-o", out)
    data = page_data(out.read_text(encoding="utf-8"))
    node_id = next(i for i, info in data.items() if info["title"] == "y/x")
    dom, console = load_page(chromium, out, tmp_path, "#" + node_id)  # '#id' pins that item on load
    assert console == []
    panel = dom[dom.index('<div id="details"'):dom.index("</aside>")]
    assert f'data-showing="{node_id}"' in panel
    # The whole-graph plan moves x's tp split from the rotation dim to the sequence dim: an
    # all-to-all of half of x's 2*4*16*32 float32 piece (8,192 B), where gathering it would move 16,384.
    for text in ("<h3>y/x</h3>", "<th>placements</th><td>(S(0), S(2))</td>",
                 "<th>local shape (rank 0)</th><td>[2, 4, 8, 64]</td>",
                 "<th>step 1</th><td>all-to-all on tp, dim 3 -&gt; 2: 8,192 B per rank</td>",
                 "<th>bytes per rank</th><td>8,192</td>"):
        assert text in panel

    plain = tmp_path / "plain.html"
    viz(broken_spec, "-o", plain)
    data = page_data(plain.read_text(encoding="utf-8"))
    edge_id = next(i for i, info in data.items() if info["title"] == "x -> y")
    dom, console = load_page(chromium, plain, tmp_path, "#" + edge_id)
    assert console == []
    panel = dom[dom.index('<div id="details"'):dom.index("</aside>")]
    for text in ('<h4 class="alert">violation sharded-rotation-dim</h4>',
                 "<h4>redistribution that fixes it (--reshard inserts it)</h4>",
                 "<th>step 1</th><td>all-gather on tp, dim 3: 16,384 B per rank</td>",
                 "<th>tensor_map</th><td>[1, -1, -1, 0]</td>"):
        assert text in panel


# --------------------------------------------------------------------------- (6) errors
def test_unknown_extension_is_a_typed_error(tmp_path):
    out = tmp_path / "graph.pdf"
    with pytest.raises(VizError) as err:
        viz(DP_TP_SP, "-o", out)
    assert err.value.code == "bad-format"
    assert str(err.value) == (
        f"bad-format at {out}: cannot tell a picture format from the extension '.pdf' (hint: name the output "
        ".html (interactive), .svg, .png (needs matplotlib) or .dot (Graphviz text))")
    assert not out.exists()


def test_unknown_tensor_is_a_typed_error(tmp_path):
    out = tmp_path / "q.svg"
    with pytest.raises(VizError) as err:
        viz(DP_TP_SP, "--tensor", "q", "-o", out)
    assert err.value.code == "unknown-value"
    assert str(err.value) == ("unknown-value at input 'q': no value named 'q' in the graph "
                              "(hint: name one of the graph's values: x, cos, sin, y)")
    assert not out.exists()


def test_dims_errors_are_typed(tmp_path):
    out = tmp_path / "x.svg"
    with pytest.raises(VizError) as err:
        viz(DP_TP_SP, "--tensor", "x", "--dims", "0,two", "-o", out)
    assert (err.value.code, err.value.hint) == ("bad-dims", "name one or two tensor dims, such as --dims 0,2")
    with pytest.raises(VizError) as err:
        viz(DP_TP_SP, "--dims", "0,2", "-o", out)
    assert (err.value.code, err.value.hint) == ("bad-usage", "add --tensor NAME, or drop --dims")
    with pytest.raises(VizError) as err:
        viz(DP_TP_SP, "--tensor", "x", "--dims", "0,4", "-o", out)
    assert err.value.code == "bad-dims"
    assert not out.exists()


def test_missing_spec_and_unwritable_output_are_typed_errors(tmp_path):
    with pytest.raises(SpecError) as err:
        viz(tmp_path / "nope.yaml", "-o", tmp_path / "g.svg")
    assert err.value.code == "spec-not-found"
    with pytest.raises(VizError) as err:
        viz(DP_TP_SP, "-o", tmp_path / "no-such-folder" / "g.svg")
    assert err.value.code == "write-failed"
    assert err.value.hint == "check that the folder exists and is writable"


def test_output_is_required():
    parser = argparse.ArgumentParser(prog="layout-prop")
    add_viz_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["viz", str(DP_TP_SP)])
    assert exit_.value.code == 2


def test_drawing_an_unpropagated_graph_is_a_typed_error():
    graph = load_spec(DP_TP_SP)
    with pytest.raises(VizError) as err:
        Visualise().run(graph)
    assert err.value.code == "not-propagated"
