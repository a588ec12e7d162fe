"""The op reference: what every registered op takes, accepts and reports, read off the registry.

``layout-prop ops`` prints it, ``layout-prop ops NAME`` prints one op with its docstring,
and ``docs/ops.md`` is :func:`render_markdown`'s output (a test keeps the file equal to the
registry, so the reference cannot drift from the code).

Examples
--------
>>> entry = op_entry("npu_rotary_mul")
>>> entry["name"], entry["operands"], entry["attrs"]["mode"], entry["gradient"]
('rotary_position_embedding', ['x', 'cos', 'sin'], 0, True)
>>> sorted(entry["kernels"])
['cann', 'mindspore', 'numpy']
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

from layout_prop.core.registry import OpRule, get_rule, registered_ops

__all__ = ["op_entry", "op_reference", "format_reference", "format_entry", "render_markdown"]

BACKENDS = ("numpy", "mindspore", "cann")

_PLACEMENT_SPELLINGS = (
    "Placements in a spec may be written short or long: `R` or `Replicate()`; `S(d)` or "
    "`Shard(d)` (d may be negative); `P`, `P(sum|avg|max|min)` or `Partial(sum)`. A tensor_map "
    "(MindSpore convention) may replace them."
)


def _kernel_tables() -> dict[str, dict]:
    from layout_prop.kernels import mindspore_backend, numpy_backend  # importing these does not import MindSpore

    return {"numpy": numpy_backend.KERNELS, "mindspore": mindspore_backend.KERNELS,
            "cann": mindspore_backend.CANN_KERNELS}


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, (list, dict, str, int, float, bool)) or value is None:
        return value
    return repr(value)


def _doc(rule: OpRule) -> str:
    """The rule class's own docstring (not one inherited from a shared base), else its module's."""
    own = type(rule).__dict__.get("__doc__")
    if own:
        return inspect.cleandoc(own)
    return inspect.getdoc(inspect.getmodule(type(rule))) or ""


def _summary(doc: str) -> str:
    """The first paragraph of a docstring, on one line."""
    first = doc.strip().split("\n\n", 1)[0]
    return " ".join(first.split())


def op_entry(name: str, tables: dict[str, dict] | None = None) -> dict:
    """The reference entry of one op (canonical name or alias), as a JSON-ready dict.

    Keys: ``name``, ``aliases``, ``operands`` (optional ones end in ``?``, a variadic op's
    list ends in ``...``), ``num_outputs`` (``null`` where the count follows the attrs and input shapes:
    ``unbind``, ``chunk``, ``split``), ``attrs`` (defaults; ``null`` where the op has
    none), ``required_attrs``, ``violation_codes``, ``gradient`` (whether the op has a vjp),
    ``kernels`` (the backends with a kernel for it), ``summary`` and ``doc``.
    """
    rule = get_rule(name)
    tables = _kernel_tables() if tables is None else tables
    operands = list(rule.operands) + [f"{o}?" for o in rule.optional_operands]
    if rule.variadic:
        operands.append("...")
    doc = _doc(rule)
    return {
        "name": rule.name,
        "aliases": list(rule.aliases),
        "operands": operands,
        "num_outputs": None if rule.variadic_outputs else rule.num_outputs,
        "attrs": {k: _jsonable(v) for k, v in rule.attr_defaults.items()},
        "required_attrs": list(rule.required_attrs),
        "violation_codes": list(rule.violation_codes),
        "gradient": bool(rule.differentiable and type(rule).vjp is not OpRule.vjp),
        "kernels": [b for b in BACKENDS if rule.name in tables[b]],
        "summary": _summary(doc),
        "doc": doc,
    }


def op_reference(builtin_only: bool = False) -> list[dict]:
    """Every registered op's entry, sorted by name (only layout-prop's own with ``builtin_only``)."""
    tables = _kernel_tables()
    rules = registered_ops()
    return [op_entry(name, tables) for name in sorted(rules)
            if not builtin_only or type(rules[name]).__module__.startswith("layout_prop.ops.")]


def _attrs_text(attrs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in attrs.items()) or "-"


def format_reference(entries: list[dict]) -> str:
    """A table of every op: name, operands, attrs with defaults, gradient, kernels."""
    rows = [("op", "operands", "attrs (defaults)", "grad", "kernels")]
    for e in entries:
        rows.append((e["name"], ", ".join(e["operands"]), _attrs_text(e["attrs"]),
                     "yes" if e["gradient"] else "-", ",".join(e["kernels"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(f"{len(entries)} ops; `layout-prop ops NAME` shows one with its aliases, violation codes "
                 "and documentation.")
    return "\n".join(lines)


_VARIADIC_OUTPUTS = "as many as its attrs and input shape make"


def _outputs_text(count: int | None) -> str:
    return f"{count} output{'s' if count > 1 else ''}" if count is not None else f"outputs {_VARIADIC_OUTPUTS}"


def format_entry(e: dict) -> str:
    """One op in full, for ``layout-prop ops NAME``."""
    lines = [
        f"{e['name']}({', '.join(e['operands'])}) -> {_outputs_text(e['num_outputs'])}",
        f"  aliases:         {', '.join(e['aliases']) or '-'}",
        f"  attrs:           {_attrs_text(e['attrs'])}",
        f"  required attrs:  {', '.join(e['required_attrs']) or '-'}",
        f"  violation codes: {', '.join(e['violation_codes']) or '-'}",
        f"  gradient:        {'yes' if e['gradient'] else 'no'}",
        f"  kernels:         {', '.join(e['kernels']) or '-'}",
    ]
    if e["doc"]:
        lines += ["", *("  " + line if line else "" for line in e["doc"].splitlines())]
    return "\n".join(lines)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown() -> str:
    """The text of ``docs/ops.md``: every built-in op of the registry (plugins and user ops left out)."""
    entries = op_reference(builtin_only=True)
    out = [
        "# Op reference",
        "",
        "Generated from the op registry by `layout-prop ops --markdown > docs/ops.md`;",
        "`graph_tests/test_opref.py` fails when this file and the registry disagree.",
        "",
        _PLACEMENT_SPELLINGS,
        "",
        "| op | operands | attrs (defaults) | gradient | kernels | summary |",
        "|---|---|---|---|---|---|",
    ]
    for e in entries:
        attrs = ", ".join(f"`{k}={v!r}`" for k, v in e["attrs"].items()) or "-"
        out.append(f"| [`{e['name']}`](#{e['name']}) | {', '.join(e['operands'])} | {_md_cell(attrs)} | "
                   f"{'yes' if e['gradient'] else 'no'} | {', '.join(e['kernels']) or '-'} | "
                   f"{_md_cell(e['summary'])} |")
    for e in entries:
        out += ["", f"## {e['name']}", ""]
        out.append(f"- operands: {', '.join(e['operands'])}; outputs: {e['num_outputs'] or _VARIADIC_OUTPUTS}")
        out.append(f"- aliases: {', '.join(f'`{a}`' for a in e['aliases']) or 'none'}")
        out.append(f"- attrs: {', '.join(f'`{k}={v!r}`' for k, v in e['attrs'].items()) or 'none'}"
                   + (f" (required: {', '.join(e['required_attrs'])})" if e["required_attrs"] else ""))
        out.append(f"- violation codes: {', '.join(f'`{c}`' for c in e['violation_codes']) or 'none'}")
        out.append(f"- gradient: {'yes' if e['gradient'] else 'no'}; kernels: {', '.join(e['kernels']) or 'none'}")
        if e["doc"]:
            out += ["", "```text", e["doc"], "```"]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- command line
def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop ops``'s flags, on the command line's ``subparsers``."""
    parser = subparsers.add_parser("ops",
                                   help="the op reference: every op, or one op in full (generated from the registry)")
    parser.add_argument("name", metavar="NAME", nargs="?", help="an op name or alias: print that op in full")
    parser.add_argument("--json", action="store_true", help="print JSON (a list of ops, or one op)")
    parser.add_argument("--markdown", action="store_true", help="print the built-in ops as docs/ops.md is written")
    return parser


def run(args) -> int:
    from layout_prop.core.errors import SpecError

    from .printing import print_json

    if args.markdown and (args.json or args.name is not None):
        raise SpecError("bad-usage", "--markdown writes the whole reference as Markdown: it takes no NAME and "
                        "no --json", hint="drop NAME and --json, or drop --markdown")
    if args.markdown:
        print(render_markdown(), end="")
    elif args.name is not None:
        entry = op_entry(args.name)
        print_json(entry) if args.json else print(format_entry(entry))
    else:
        entries = op_reference()
        print_json(entries) if args.json else print(format_reference(entries))
    return 0
