"""The direction of imports, as ARCHITECTURE.md draws it, held by an ``ast`` walk over the tree.

Every import counts, at module level or inside a function (a lazy import is still a
dependency).  A failure names the file, the line, the import and what its room may import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: the folders installed under ``layout_prop`` with ``package_dir`` (setup.cfg)
MAPPED = {"ops": "layout_prop.ops", "passes": "layout_prop.passes", "kernels": "layout_prop.kernels"}

#: each room and the rooms it may import (besides itself), lowest first
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "io": frozenset({"core"}),
    "ops": frozenset({"core"}),
    "kernels": frozenset({"core"}),
    "passes": frozenset({"core"}),
    "planner": frozenset({"core", "io", "passes", "perf"}),
    "perf": frozenset({"core", "io", "passes"}),
    "engines": frozenset({"core", "io", "kernels"}),
    "frontends": frozenset({"core", "io", "ops", "kernels"}),
    "api": frozenset({"core", "io", "passes", "planner"}),
    "runner": frozenset({"core", "io", "kernels", "passes", "engines", "api"}),
    "viz": frozenset({"core", "io", "passes", "api"}),
    "testing": frozenset({"core", "io", "ops", "kernels", "passes", "api", "runner"}),
    "interop": frozenset({"core", "io", "ops", "kernels", "passes", "engines", "testing"}),
    "commands": frozenset({"core", "io", "ops", "kernels", "passes", "planner", "perf", "engines", "frontends", "api",
                           "runner", "viz", "testing", "interop"}),
    "cli": frozenset({"core", "io", "commands", "package"}),
    # layout_prop/__init__.py: the public names, from the core; analyze and register_kernel lazily
    "package": frozenset({"core", "api", "kernels"}),
    # old module paths kept for code written against them (loader, dtensor, eager)
    "shims": frozenset({"io", "engines"}),
}

#: imports against the rooms' order, each with its reason: (importing module, imported module)
EXCEPTIONS = {
    ("layout_prop.core.registry", "layout_prop.ops"):
        "the registry registers the built-in ops (and the entry points' plugins) on the first lookup",
    ("layout_prop.ops.rpe", "layout_prop.kernels.rpe_cann"):
        "the rule's check_kernel hook asks the CANN kernel module for its limits (its own table, imported lazily)",
}

#: top-level modules of layout_prop and the room each is
TOP = {"api": "api", "runner": "runner", "cli": "cli", "loader": "shims", "dtensor": "shims", "eager": "shims"}


def module_name(path: Path, root: Path) -> tuple[str, bool]:
    """The dotted name ``path`` is imported as, and whether it is a package's ``__init__``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] in MAPPED:
        parts = MAPPED[parts[0]].split(".") + parts[1:]
    package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if package else parts), package


def room(module: str) -> str | None:
    """The room of a ``layout_prop`` module, or None for another package's."""
    parts = module.split(".")
    if parts[0] != "layout_prop":
        return None
    if len(parts) == 1:
        return "package"
    if parts[1] in ALLOWED:
        return parts[1]
    return TOP.get(parts[1], f"unknown top-level module {parts[1]}")


def imports(path: Path, module: str, package: bool):
    """(line, imported module) of every import in ``path``, relative ones resolved; in
    ``from package import name``, ``name`` counts as a module when it is a file or folder
    beside ``path``'s package (``from . import meta``), else as a name of the package."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module:
                yield node.lineno, target
            else:  # from . import a, b: each name may be a module of its own
                folder = path.parent if package or node.level else None
                for _ in range(max(node.level - 1, 0)):
                    folder = folder.parent
                for alias in node.names:
                    is_module = folder is not None and ((folder / f"{alias.name}.py").exists()
                                                        or (folder / alias.name).is_dir())
                    yield node.lineno, f"{target}.{alias.name}" if is_module or not node.level else target


def source_files(root: Path) -> list[Path]:
    files = sorted((root / "layout_prop").rglob("*.py"))
    for folder in MAPPED:
        files += sorted((root / folder).rglob("*.py"))
    return files


def layering_errors(root: Path) -> list[str]:
    """Every import that goes against :data:`ALLOWED`, less :data:`EXCEPTIONS`, one line each."""
    errors = []
    for path in source_files(root):
        module, package = module_name(path, root)
        own = room(module)
        for line, target in imports(path, module, package):
            other = room(target)
            if other is None or other == own:
                continue
            if any(module == a and (target == b or target.startswith(b + ".")) for a, b in EXCEPTIONS):
                continue
            if own not in ALLOWED or other not in ALLOWED or other not in ALLOWED[own]:
                allowed = ", ".join(sorted(ALLOWED.get(own, ()))) or "nothing outside itself"
                errors.append(f"{path.relative_to(root)}:{line}: {module} ({own}) imports {target} ({other}); "
                              f"{own} may import {allowed}")
    return errors


def test_imports_follow_the_architecture():
    assert layering_errors(ROOT) == []


def test_every_room_is_named_in_the_architecture_map():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    for name in ALLOWED:
        if name not in ("package", "shims", "api", "runner", "cli"):
            assert f"`{name}/`" in text or f"`layout_prop/{name}/`" in text, name
    for reason in EXCEPTIONS.values():
        assert reason.split(" (")[0] in " ".join(text.split()), reason


def test_the_walk_reports_an_import_against_the_order(tmp_path):
    """The checker itself: a core module importing a command, a rule importing the testing
    kit and a pass importing an engine are each reported with file, line and rooms."""
    for folder in ("layout_prop/core", "layout_prop/commands", "layout_prop/testing", "layout_prop/engines",
                   "ops", "passes", "kernels"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "layout_prop/__init__.py").write_text("from .core import mesh\n")
    (tmp_path / "layout_prop/core/mesh.py").write_text("import json\n\n\ndef f():\n    from ..commands import check\n")
    (tmp_path / "ops/shape.py").write_text("from layout_prop.core import mesh\nfrom layout_prop.testing import OpSample\n")
    (tmp_path / "passes/lower.py").write_text("from layout_prop.engines.simulator import Simulator\n")
    (tmp_path / "kernels/rpe_cann.py").write_text("")
    (tmp_path / "ops/rpe.py").write_text("from layout_prop.kernels.rpe_cann import check_cann_constraints\n")
    errors = layering_errors(tmp_path)
    assert errors == [
        "layout_prop/core/mesh.py:5: layout_prop.core.mesh (core) imports layout_prop.commands (commands); "
        "core may import nothing outside itself",
        "ops/shape.py:2: layout_prop.ops.shape (ops) imports layout_prop.testing (testing); ops may import core",
        "passes/lower.py:1: layout_prop.passes.lower (passes) imports layout_prop.engines.simulator (engines); "
        "passes may import core",
    ]
