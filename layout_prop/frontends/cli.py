"""The command-line side of the importers: ``layout-prop import``, and ``MODEL --plan PLAN``
wherever a command takes a spec (:func:`load_graph`, the one place commands load their input)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import SpecError
from ..graph import Graph

__all__ = ["add_import_parser", "add_model_args", "cmd_import", "load_graph"]


def add_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--plan`` and ``--opaque``, for a command whose SPEC may also be a model file."""
    parser.add_argument("--plan", metavar="PLAN", help="with a model (.onnx or .mindir) instead of a spec: its "
                        "sharding plan (YAML or JSON)")
    parser.add_argument("--opaque", action="store_true",
                        help="with a model: treat ops the importer cannot map as barriers instead of refusing")
    return parser


def add_import_parser(sub) -> argparse.ArgumentParser:
    im = sub.add_parser("import", help="import an ONNX or MindIR model with a sharding plan; write an ordinary spec")
    im.add_argument("model", metavar="MODEL", help="an .onnx or .mindir file")
    im.add_argument("--plan", metavar="PLAN", required=True, help="the sharding plan (YAML or JSON)")
    im.add_argument("-o", "--output", type=Path, help="write the spec to this file (.yaml or .json); default stdout")
    im.add_argument("--opaque", action="store_true",
                    help="treat ops the importer cannot map as barriers instead of refusing the model")
    im.add_argument("--no-fuse", action="store_true",
                    help="do not fuse decomposed patterns (RMSNorm, RoPE, SiLU, attention) into registry ops")
    return im


def load_graph(args: argparse.Namespace) -> Graph:
    """The graph a command analyses: ``args.spec`` loaded as a spec (``-``: standard input), or
    imported as a model with ``args.plan`` when it is an ``.onnx`` / ``.mindir`` file."""
    from ..loader import load_spec
    from . import is_model_path, load_model

    source = str(args.spec)
    plan = getattr(args, "plan", None)
    if is_model_path(source):
        if plan is None:
            raise SpecError("missing-plan", f"{source!r} is a model: it needs a sharding plan", path=source,
                            hint="add --plan PLAN.yaml (see the README's 'Your own model')")
        return load_model(source, Path(plan), opaque=getattr(args, "opaque", False))  # --plan is always a file
    if plan is not None:
        raise SpecError("unexpected-plan", f"--plan goes with a model (.onnx or .mindir), but {source!r} is a spec",
                        path=source, hint="drop --plan, or give the model file")
    from . import pointwise as _pointwise  # noqa: F401  (a spec written by 'import' may hold sqrt, opaque...)

    return load_spec(Path("/dev/stdin") if source == "-" else Path(source))  # "-": stdin, as Unix tools read it


def cmd_import(args: argparse.Namespace) -> int:
    """``layout-prop import MODEL --plan PLAN [-o SPEC]``: exit 0 with the spec written."""
    from ..loader import format_spec, load_spec
    from . import import_spec

    spec, notes = import_spec(args.model, Path(args.plan), opaque=args.opaque, fuse=not args.no_fuse)
    load_spec(spec)  # never write a spec that check would refuse
    text = format_spec(spec, args.output)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if args.output is None:
        print(text, end="")
        return 0
    from ..output import write_output

    write_output(args.output, text)  # atomic: a full disk leaves the old file, never a truncated spec
    print(f"wrote {args.output} ({len(spec['inputs'])} inputs, {len(spec['nodes'])} nodes)", file=sys.stderr)
    return 0
