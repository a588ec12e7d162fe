"""``layout-prop import MODEL --plan PLAN [-o SPEC]``: import an ONNX or MindIR model with a sharding plan,
and write an ordinary spec; without ``--plan``, list the parameters a plan may name and write a plan
skeleton (``-o PLAN``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop import``'s flags, on the command line's ``subparsers``."""
    im = subparsers.add_parser("import",
                               help="import an ONNX or MindIR model with a sharding plan; write an ordinary spec")
    im.add_argument("model", metavar="MODEL", help="an .onnx or .mindir file")
    im.add_argument("--plan", metavar="PLAN", help="the sharding plan (YAML or JSON); without it, list the parameters "
                    "a plan may name (name, shape, consumer, suggested preset) and, with -o, write a plan skeleton")
    im.add_argument("-o", "--output", type=Path, help="write the spec to this file (.yaml or .json; without --plan, "
                    "the plan skeleton); default stdout")
    im.add_argument("--opaque", action="store_true",
                    help="treat ops the importer cannot map as barriers instead of refusing the model")
    im.add_argument("--no-fuse", action="store_true",
                    help="do not fuse decomposed patterns (RMSNorm, RoPE, SiLU, attention) into registry ops")
    return im


def run(args: argparse.Namespace) -> int:
    """``layout-prop import MODEL --plan PLAN [-o SPEC]``: exit 0 with the spec written."""
    from layout_prop.core.dependencies import require_model_reader
    from layout_prop.io.loader import format_spec, load_spec
    from layout_prop.frontends import import_spec

    require_model_reader(args.model)  # onnx or MindSpore, said before anything is read
    if args.output is not None:
        from layout_prop.io.output import check_output

        check_output(args.output)  # where the spec goes, checked before the model is read
    if args.plan is None:  # list the names a plan may match, and write a plan skeleton
        if args.output is not None:
            from .flags import refuse_stdout_output

            refuse_stdout_output("import without --plan", "-o", args.output, "the names")  # it prints the names there
        return _skeleton(args)
    from layout_prop.io.progress import Ticker

    with Ticker("import") as ticker:  # on a terminal only (a large model takes a while to read and check)
        ticker.say(f"reading {Path(args.model).name} with the plan")
        spec, notes = import_spec(args.model, Path(args.plan), opaque=args.opaque, fuse=not args.no_fuse)
        ticker.say(f"checking the spec ({len(spec['nodes']):,} nodes)")
        load_spec(spec)  # never write a spec that check would refuse
        text = format_spec(spec, args.output)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if args.output is None:
        print(text, end="")
        return 0
    from layout_prop.io.output import is_stdout, write_output

    write_output(args.output, text)  # atomic: a full disk leaves the old file, never a truncated spec
    if not is_stdout(args.output):
        print(f"wrote {args.output} ({len(spec['inputs'])} inputs, {len(spec['nodes'])} nodes)",
              file=sys.stderr)
    return 0


def _skeleton(args: argparse.Namespace) -> int:
    """``layout-prop import MODEL [-o PLAN]``: the parameters (name, shape, consumer, suggested preset)
    and inputs on stdout; with ``-o``, a plan skeleton written there."""
    from layout_prop.frontends.skeleton import describe_model, format_rows, skeleton_yaml

    from layout_prop.io.progress import Ticker

    with Ticker("import") as ticker:  # on a terminal only
        ticker.say(f"reading {Path(args.model).name}")
        params, inputs, notes = describe_model(args.model, opaque=args.opaque, fuse=not args.no_fuse)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(format_rows(params, inputs), end="")
    if args.output is not None:
        from layout_prop.io.output import write_output

        write_output(args.output, skeleton_yaml(params, inputs, Path(args.model).name))
        print(f"wrote {args.output} (a plan skeleton: {len(params)} parameters, {len(inputs)} inputs); set its "
              f"mesh and presets, then: layout-prop import {args.model} --plan {args.output}", file=sys.stderr)
    return 0
