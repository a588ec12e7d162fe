"""Every error and violation code the code raises is named in docs/violation-codes.md or in
the generated op reference (docs/ops.md, which lists each rule's ``violation_codes``).

A user who meets ``bad-axis-order`` or ``worker-failed`` on the command line looks it up on
that page; 86 codes raised by the code were missing from it when this test was written.
The walk is an ``ast`` one over the installed packages: the first argument of a call to an
``...Error`` class, a ``Violation``, a ``super().__init__`` of an error subclass, or the
modules' small error helpers (``_err``, ``_bad_...``), when it is a literal code
(lower-case words joined by hyphens).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("layout_prop", "ops", "passes", "kernels")
CODE = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)+$")


def _called_name(call: ast.Call) -> str:
    fn = call.func
    if isinstance(fn, ast.Name):
        return fn.id
    if isinstance(fn, ast.Attribute):
        return fn.attr
    return ""


def _raises_a_code(name: str) -> bool:
    return (name.endswith(("Error", "Violation", "Dependency")) or name == "__init__" or name == "_err"
            or name.startswith("_bad"))


def raised_codes() -> dict[str, set[str]]:
    """``{code: {module paths}}`` of the literal codes the tree raises."""
    found: dict[str, set[str]] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call) or not _raises_a_code(_called_name(node)):
                    continue
                candidates = list(node.args[:1]) + [k.value for k in node.keywords if k.arg == "code"]
                for arg in candidates:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and CODE.match(arg.value):
                        found.setdefault(arg.value, set()).add(str(path.relative_to(ROOT)))
    return found


def test_the_walk_finds_codes_it_must_find():
    codes = raised_codes()
    # one of each way a code is raised: an error class, a Violation, a subclass's __init__, a helper
    for code in ("bad-placement", "partial-input", "memory-infeasible", "unknown-mesh-axis", "bad-pipeline"):
        assert code in codes, code
    assert len(codes) > 100


def test_every_raised_code_is_documented():
    pages = (ROOT / "docs" / "violation-codes.md").read_text() + (ROOT / "docs" / "ops.md").read_text()
    missing = {code: sorted(where) for code, where in raised_codes().items() if f"`{code}`" not in pages}
    assert not missing, ("name these codes in docs/violation-codes.md (what they mean and the fix): "
                         + "; ".join(f"{code} ({', '.join(where)})" for code, where in sorted(missing.items())))
