"""``layout-prop export SPEC|MODEL --to hyper-parallel|mindspore|torch``: the checked plan as code and as data
(the work is :mod:`layout_prop.workflows.export`; ``export_text`` is importable here too)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from layout_prop.core import meta
from layout_prop.workflows.export import (  # noqa: F401 (export_text: tests call it from here)
    TARGETS, UnresolvedViolations, check_inputs, export_text, load_export_graph, with_input_hint,
)

from .flags import add_model_args

__all__ = ["add_parser", "run", "export_text"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop export``'s flags, on the command line's ``subparsers``."""
    parser = subparsers.add_parser("export", help="write the checked plan for hyper-parallel, MindSpore or torch (code to paste, "
                            "and the plan as data)")
    parser.add_argument("spec", metavar="SPEC",
                        help="a YAML or JSON spec file (plan's output too), or a model with --plan")
    parser.add_argument("--to", required=True, choices=list(TARGETS), help="the target framework")
    parser.add_argument("-o", "--output", type=Path, help="write the Python module to this file; default stdout")
    parser.add_argument("--data", type=Path, metavar="FILE", help="also write the plan as data (.yaml or .json), a "
                        "sharding plan that import --plan reads")
    parser.add_argument("--input", action="append", metavar="NAME", help="a graph input that is a model input, not a "
                        "parameter (repeatable; default: a model's own inputs, none for a spec)")
    add_model_args(parser)
    return parser


def run(args) -> int:
    from layout_prop.core.errors import LayoutPropError
    from layout_prop.io.output import check_distinct_outputs, check_output, is_stdout, write_output
    from layout_prop.interop.export_plan import format_data, own_parameters, unmarked_inputs_note

    check_inputs(args.input)  # a flag's mistake is said before the model is read
    for path in (args.output, args.data):  # where the files go is checked before the work (as plan -o)
        if path is not None:
            check_output(path)
    check_distinct_outputs({"-o": args.output, "--data": args.data})
    if args.data is not None and (args.output is None or is_stdout(args.output)):
        from .flags import refuse_stdout_output

        refuse_stdout_output("export without -o FILE", "--data", args.data, "the code")  # the code goes there
    graph = load_export_graph(args.spec, args.plan, args.opaque)  # the spec's zero:, recompute:, pipeline: blocks are written or refused by the writer
    # the file's name goes into the module's docstring: a quote, a backslash or a control character would end it
    source = "".join(c if c.isprintable() and c not in '"\\' else "?" for c in Path(str(args.spec)).name)
    guessed = args.input is None and graph.meta.get(meta.IMPORT_SOURCES) is None  # a spec, no input named
    try:
        plan, code = export_text(graph, args.to, data_inputs=args.input, source=source)
    except LayoutPropError as err:
        raise with_input_hint(err, guessed) from None
    except UnresolvedViolations as err:
        for v in err.violations:
            print(f"violation [{v.code}] {v.node}.{v.operand}: {v.message} (fix: {v.hint})", file=sys.stderr)
        print(f"nothing exported: {len(err.violations)} violation(s) that no redistribution fixes "
              "(layout-prop check SPEC --reshard shows them)", file=sys.stderr)
        return 1
    note = unmarked_inputs_note(plan, args.input)
    if note:
        print(note, file=sys.stderr)
    for line in code.splitlines():  # a move the file leaves to the target's own rules is said here too
        if line.startswith("# WARNING: "):
            print("warning: " + line[len("# WARNING: "):], file=sys.stderr)
    if args.to == "torch" and plan.config.zero_stage == 1:
        print("note: ZeRO-1 is written as fully_shard without resharding after forward (ZeRO-2: gradients sharded "
              "too): torch has no ZeRO-1 for DTensor parameters", file=sys.stderr)
    if args.output is None:
        print(code, end="")
    else:
        write_output(args.output, code)
        written = len(own_parameters(plan, args.to))  # the model's parameters, aliases in, constants out
        if not is_stdout(args.output):
            print(f"wrote {args.output} ({args.to}: {written} parameter(s), {len(plan.inputs)} input(s))",
                  file=sys.stderr)
    if args.data is not None:
        fmt = "json" if str(args.data).lower().endswith(".json") else "yaml"
        write_output(args.data, format_data(plan, fmt))
        if not is_stdout(args.data):
            print(f"wrote {args.data} (the plan as data: import --plan reads it)", file=sys.stderr)
    return 0
