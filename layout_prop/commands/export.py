"""``layout-prop export SPEC|MODEL --to hyper-parallel|mindspore|torch``: the checked plan as code and as data."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .flags import add_model_args

__all__ = ["add_parser", "run", "export_text", "check_inputs"]


def _writers():
    from layout_prop.interop.export_hyper_parallel import export_hyper_parallel
    from layout_prop.interop.export_mindspore import export_mindspore
    from layout_prop.interop.export_torch import export_torch

    return {"hyper-parallel": export_hyper_parallel, "mindspore": export_mindspore, "torch": export_torch}


class UnresolvedViolations(Exception):
    """The spec has violations that ``check --reshard`` cannot fix: nothing is exported (exit 1, as check)."""

    def __init__(self, violations):
        super().__init__(f"{len(violations)} violation(s)")
        self.violations = list(violations)


def export_text(graph, target: str, *, data_inputs=None, source: str = "", aliases=None):
    """``(plan, code)``: the :class:`~layout_prop.interop.export_plan.ExportPlan` of ``graph`` and ``target``'s module text."""
    from layout_prop.api import analyze
    from layout_prop.interop.export_plan import collect, drop_unit_axes

    analysis = analyze(graph, reshard=True)
    if not analysis.ok:  # a plan that does not check is not written as one that did
        raise UnresolvedViolations(analysis.check.violations)
    done = analysis.graph
    plan = collect(graph, done, data_inputs=data_inputs, source=source, nodes=target == "mindspore",
                   aliases=aliases if aliases is not None else graph.meta.get("import_aliases"))
    return plan, _writers()[target](drop_unit_axes(plan))  # the data keeps the spec's mesh (it round-trips)


def _with_input_hint(err, guessed: bool):
    """``err``, a ``not-expressible`` layout of a *parameter*, with a hint naming ``--input`` when ``guessed``
    (a spec exported without ``--input``: every graph input was taken as a parameter, so the tensor the
    target cannot place as a weight may be the batch); any other error as it is."""
    from layout_prop.core.errors import LayoutPropError

    if not (guessed and isinstance(err, LayoutPropError) and err.code == "not-expressible"
            and " of parameter " in err.message):
        return err
    hint = (f"{err.hint}; " if err.hint else "") + ("or, if it is a model input (activations, token ids), "
                                                    "name it with --input NAME: without --input a spec's input "
                                                    "that takes a gradient is a parameter unless its dim 0 is cut "
                                                    "on a data-parallel axis")
    return type(err)(err.code, err.message, path=err.path, node=err.node, input=err.input, hint=hint)


def check_inputs(names) -> None:
    """Refuse a ``--input`` named twice (``duplicate-input``, one line, exit 2), as a spec refuses a value
    listed twice in ``outputs`` and ``plan --search`` an axis given twice in ``--axes``.

    >>> from layout_prop.core.errors import SpecError
    >>> check_inputs(None), check_inputs(["x", "cos", "sin"])
    (None, None)
    >>> try:
    ...     check_inputs(["x", "cos", "x"])
    ... except SpecError as err:
    ...     print(err.code, err.message)
    duplicate-input 'x' is given twice
    """
    from layout_prop.core.errors import SpecError, cut

    seen = set()
    for name in names or ():
        if name in seen:
            raise SpecError("duplicate-input", f"{cut(name)} is given twice", path="--input",
                            hint="name each model input once")
        seen.add(name)


def _load(args):
    """The graph of ``args.spec``: a spec as every command loads it, a model through the importer's
    ``build_graph`` (which records the model's own weight names, so its inputs are told from its parameters)."""
    from layout_prop.frontends import is_model_path

    from layout_prop.workflows.model_input import load_graph

    if not is_model_path(str(args.spec)) or args.plan is None:
        return load_graph(args.spec, args.plan, args.opaque)  # a spec, or the missing-plan error
    from layout_prop.core.dependencies import require_model_reader
    from layout_prop.frontends import build_graph, read_model
    from layout_prop.io.plan_file import load_plan

    require_model_reader(str(args.spec))
    plan = load_plan(Path(args.plan))
    model = read_model(args.spec, plan)
    graph = build_graph(model, plan, opaque=args.opaque)
    graph.meta["import_aliases"] = dict(model.spec_aliases)  # the other names of de-duplicated parameters
    return graph


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop export``'s flags, on the command line's ``subparsers``."""
    parser = subparsers.add_parser("export", help="write the checked plan for hyper-parallel, MindSpore or torch (code to paste, "
                            "and the plan as data)")
    parser.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file (plan's output too), or a model with --plan")
    parser.add_argument("--to", required=True, choices=["hyper-parallel", "mindspore", "torch"], help="the target framework")
    parser.add_argument("-o", "--output", type=Path, help="write the Python module to this file; default stdout")
    parser.add_argument("--data", type=Path, metavar="FILE", help="also write the plan as data (.yaml or .json), a "
                        "sharding plan that import --plan reads")
    parser.add_argument("--input", action="append", metavar="NAME", help="a graph input that is a model input, not a "
                        "parameter (repeatable; default: a model's own inputs, none for a spec)")
    add_model_args(parser)
    return parser


def run(args) -> int:
    from layout_prop.core.errors import LayoutPropError
    from layout_prop.io.output import check_distinct_outputs, check_output, write_output
    from layout_prop.interop.export_plan import format_data, own_parameters, unmarked_inputs_note

    check_inputs(args.input)  # a flag's mistake is said before the model is read
    for path in (args.output, args.data):  # where the files go is checked before the work (as plan -o)
        if path is not None:
            check_output(path)
    check_distinct_outputs({"-o": args.output, "--data": args.data})
    graph = _load(args)  # the spec's zero:, recompute:, pipeline: blocks are written or refused by the writer
    # the file's name goes into the module's docstring: a quote, a backslash or a control character would end it
    source = "".join(c if c.isprintable() and c not in '"\\' else "?" for c in Path(str(args.spec)).name)
    guessed = args.input is None and graph.meta.get("import_sources") is None  # a spec, no input named
    try:
        plan, code = export_text(graph, args.to, data_inputs=args.input, source=source)
    except LayoutPropError as err:
        raise _with_input_hint(err, guessed) from None
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
        print(f"wrote {args.output} ({args.to}: {written} parameter(s), {len(plan.inputs)} input(s))",
              file=sys.stderr)
    if args.data is not None:
        fmt = "json" if str(args.data).lower().endswith(".json") else "yaml"
        write_output(args.data, format_data(plan, fmt))
        print(f"wrote {args.data} (the plan as data: import --plan reads it)", file=sys.stderr)
    return 0
