"""``layout-prop viz``: draw the graph, or one tensor's sharding grid, as HTML, SVG, PNG or DOT."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .flags import add_model_args
from layout_prop.workflows.model_input import load_graph, unapplied_blocks_note

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop viz``'s flags (``layout-prop viz SPEC -o FILE``), on the command line's ``subparsers``."""
    viz = subparsers.add_parser(
        "viz", help="draw the graph (or one tensor's sharding grid) as HTML, SVG, PNG or DOT",
        description="Draw the propagated graph: layers left to right, placements and local shapes on the edges, "
                    "redistributions with their steps and bytes, violations in red. With --tensor, draw which "
                    "ranks hold which block of one value instead. Exits 0 once the file is written, violations or not "
                    "(check exits 1 on them).")
    viz.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file (- reads standard input)")
    viz.add_argument("-o", "--output", required=True, metavar="FILE",
                     help="the picture to write; its extension picks the format: .html (interactive, "
                          "self-contained), .svg, .png (needs matplotlib) or .dot (Graphviz text)")
    viz.add_argument("--reshard", action="store_true", help="draw the graph with the redistributions reshard inserts")
    viz.add_argument("--backward", action="store_true", help="also draw the gradient graph (grad:NAME values)")
    viz.add_argument("--tensor", metavar="NAME",
                     help="draw one value's sharding grid instead: an input, a node output (name:i), or grad:NAME "
                          "with --backward")
    viz.add_argument("--dims", metavar="D0,D1",
                     help="with --tensor: the dims drawn as rows and columns (default: the sharded ones); write a "
                          "list that starts with a negative dim as --dims=-1,0")
    add_model_args(viz)
    return viz


def run(args: argparse.Namespace) -> int:
    """Run ``layout-prop viz``: 0 when the picture is written; typed errors (exit 2) otherwise."""
    from layout_prop.api import analyze
    from layout_prop.core.errors import SpecError
    from layout_prop.io.output import check_output
    from layout_prop.viz.files import find_value, output_format, parse_dims, write_graph, write_grid
    from layout_prop.viz.grid import tensor_grid
    from layout_prop.viz.png import _matplotlib
    from layout_prop.viz.scene import VizError

    out = Path(args.output)
    fmt = output_format(out)
    if fmt == "png":
        _matplotlib()  # png-unavailable, naming the viz extra, before the spec is read
    try:
        check_output(out)  # a folder, a missing folder, /dev/full: before the analysis
    except SpecError as err:  # said as the drawing's own write says it
        raise VizError(err.code, err.message, path=str(out), hint="check that the folder exists and is writable") \
            from None
    graph = load_graph(args.spec, args.plan, args.opaque)  # a spec, or a model with --plan
    note = unapplied_blocks_note(graph, "viz")
    if note:
        print(note, file=sys.stderr)
    tensor = args.tensor
    dims = parse_dims(args.dims) if args.dims is not None else None
    if dims is not None and tensor is None:
        raise VizError("bad-usage", "--dims chooses the drawn dims of a tensor's grid, but no --tensor was given",
                       hint="add --tensor NAME, or drop --dims")
    analysis = analyze(graph, reshard=args.reshard, backward=args.backward)
    flags = [flag for flag, on in (("--reshard", args.reshard), ("--backward", args.backward)) if on]
    title = " ".join([Path(args.spec).name] + flags)
    if tensor is None:
        write_graph(analysis.graph, out, check=analysis.check, title=title)
        what = f"{len(analysis.graph)} nodes, {len(analysis.check.violations)} violations"
    else:
        grid = tensor_grid(find_value(analysis.graph, tensor), dims)
        write_grid(grid, out, name=tensor, title=title)
        what = f"tensor {tensor}, {len(grid.panels) * grid.nrows * grid.ncols} blocks"
    print(f"wrote {out} ({what})")
    return 0
