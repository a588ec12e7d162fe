"""The direction of imports, as ARCHITECTURE.md draws it, held by an ``ast`` walk over the tree.

Every import counts, at module level or inside a function (a lazy import is still a
dependency).  A failure names the file, the line, the import and what its room may import.
"""

from __future__ import annotations

import ast
import re
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
    # passes read the spec blocks' value types (ZeroConfig, PipelineConfig) from io/spec_blocks.py
    "passes": frozenset({"core", "io"}),
    "planner": frozenset({"core", "io", "passes", "perf"}),
    "perf": frozenset({"core", "io", "passes"}),
    "engines": frozenset({"core", "io", "kernels"}),
    "frontends": frozenset({"core", "io", "ops", "kernels"}),
    "api": frozenset({"core", "io", "passes", "planner"}),
    "runner": frozenset({"core", "io", "kernels", "passes", "engines", "api"}),
    "viz": frozenset({"core", "io", "passes", "api"}),
    "testing": frozenset({"core", "io", "ops", "kernels", "passes", "api", "runner"}),
    "interop": frozenset({"core", "io", "ops", "kernels", "passes", "engines", "testing"}),
    # the drivers the commands call (and benchmarks, and the Python API): every room below them
    "workflows": frozenset({"core", "io", "ops", "kernels", "passes", "planner", "perf", "engines", "frontends",
                            "api", "runner", "viz", "testing", "interop"}),
    "commands": frozenset({"core", "io", "ops", "kernels", "passes", "planner", "perf", "engines", "frontends", "api",
                           "runner", "viz", "testing", "interop", "workflows"}),
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
        "passes may import core, io",
    ]


def command_imports_outside_cli(root: Path) -> list[str]:
    """Every import of ``layout_prop.commands`` (or of a command module) in benchmarks/, one line each: a
    benchmark calls the library (``workflows``, ``api``, ``runner``...), never a command."""
    errors = []
    for path in sorted((root / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            for name in names:
                if name == "layout_prop.commands" or name.startswith("layout_prop.commands."):
                    errors.append(f"{path.relative_to(root).as_posix()}:{node.lineno}: imports {name}")
                    break
    return errors


def test_benchmarks_import_the_library_not_commands():
    assert command_imports_outside_cli(ROOT) == []


def test_the_benchmark_check_reports_a_command_import(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "a.py").write_text("from layout_prop.commands.search import run_search\n")
    (tmp_path / "benchmarks" / "b.py").write_text("import json\n\n\ndef f():\n    from layout_prop import commands\n")
    (tmp_path / "benchmarks" / "c.py").write_text("from layout_prop.workflows.search import run_search\n")
    assert command_imports_outside_cli(tmp_path) == [
        "benchmarks/a.py:1: imports layout_prop.commands.search",
        "benchmarks/b.py:5: imports layout_prop.commands",
    ]


# ----------------------------------------------------------------------------- the map names the tree
#: rooms whose modules the map names by their family rather than by file: ``ops/`` lists its
#: families as words (``elementwise, linalg, ...``); ``kernels/`` names its tables by pattern
#: (``*_numpy.py``, one module per family and backend), so only its folder is checked
BY_FAMILY = {"ops"}
NOT_LISTED = {"kernels"}


def _sections(text: str) -> dict[str, str]:
    """Each ``### `room/``` section of the map, its words on one line, keyed by the folder(s) its heading names."""
    out = {}
    for block in re.split(r"^### ", text, flags=re.M)[1:]:
        heading, _, body = block.partition("\n")
        for folder in re.findall(r"`(?:layout_prop/)?([\w/]+)/`", heading):
            out[folder] = " ".join(block.split())
    return out


def map_gaps(root: Path) -> list[str]:
    """Every package folder ARCHITECTURE.md does not name (as ```name/```), every module of a room
    its section does not name (as ``name.py``; ``room/name.py`` anywhere counts too), and every
    ``name.py`` a room's section names that is not there (a module moved or removed), one line each."""
    text = (root / "ARCHITECTURE.md").read_text()
    flat = " ".join(text.split())
    rooms = _sections(text)
    folders = [p.parent for p in sorted((root / "layout_prop").rglob("__init__.py"))]
    for top in MAPPED:
        folders += [p.parent for p in sorted((root / top).rglob("__init__.py"))]
    gaps = []
    for folder in folders:
        rel = folder.relative_to(root)
        if rel.parts == ("layout_prop",):
            continue
        if not re.search(r"`(?:[\w/]*/)?" + re.escape(rel.parts[-1]) + r"/`", flat):
            gaps.append(f"{rel.as_posix()}/: the package folder is not named in ARCHITECTURE.md")
            continue
        top_room = len(rel.parts) == 1 or (len(rel.parts) == 2 and rel.parts[0] == "layout_prop")
        name = rel.parts[-1]
        if not top_room or name in NOT_LISTED:
            continue  # a room's own subfolder (testing/opdb/) is named above, its files are its room's business
        section = rooms.get(name, "")
        for module in sorted(folder.glob("*.py")):
            if module.stem == "__init__":
                continue
            word = re.escape(module.stem) + (r"(?!\w)" if name in BY_FAMILY else r"\.py")
            if not re.search(r"(?<![\w.])" + word, section) and f"{name}/{module.name}" not in flat:
                gaps.append(f"{rel.as_posix()}/{module.name}: not named in ARCHITECTURE.md's section of {name}/")
        for prefix, module in re.findall(r"(?<![\w.*])([\w/]*?)(\w+\.py)\b", section):
            places = [root / "layout_prop" / prefix / module, root / prefix / module] if prefix else \
                [folder / module, root / "layout_prop" / module]
            if not any(place.exists() for place in places):
                gaps.append(f"ARCHITECTURE.md's section of {name}/ names {prefix}{module}, which is not there")
    return gaps


def test_the_map_names_every_package_and_module():
    assert map_gaps(ROOT) == []


def test_the_map_check_reports_a_module_and_a_folder_it_does_not_name(tmp_path):
    """The checker itself: a new command module, a new engine, an op family, an unnamed package
    folder and two module names that are not in the tree are each reported; named ones are not."""
    for folder in ("layout_prop/commands", "layout_prop/engines", "layout_prop/newroom", "ops", "passes", "kernels"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    for module in ("layout_prop/commands/check.py", "layout_prop/commands/estimate.py",
                   "layout_prop/engines/simulator.py", "layout_prop/engines/pipeline.py",
                   "ops/nn.py", "ops/moe.py", "passes/pipeline.py", "kernels/nn_numpy.py"):
        (tmp_path / module).write_text("")
    (tmp_path / "ARCHITECTURE.md").write_text(
        "### `layout_prop/commands/`\n\nOne module per command (check.py).\n\n"
        "### `layout_prop/engines/`\n\n`Simulator` (simulator.py), the launcher (msrun.py, `engines/gone.py`).\n\n"
        "### `ops/` (`layout_prop.ops`)\n\nOne module per family (nn, shape).\n\n"
        "### `passes/`\n\nStages: pipeline.py.\n\n### `kernels/`\n\nTables.\n")
    assert map_gaps(tmp_path) == [
        "layout_prop/commands/estimate.py: not named in ARCHITECTURE.md's section of commands/",
        "layout_prop/engines/pipeline.py: not named in ARCHITECTURE.md's section of engines/",
        "ARCHITECTURE.md's section of engines/ names msrun.py, which is not there",
        "ARCHITECTURE.md's section of engines/ names engines/gone.py, which is not there",
        "layout_prop/newroom/: the package folder is not named in ARCHITECTURE.md",
        "ops/moe.py: not named in ARCHITECTURE.md's section of ops/",
    ]


# ----------------------------------------------------------------------------- the manual's index
def manual_pages_not_linked(root: Path) -> list[str]:
    """The pages of docs/ that neither README.md nor docs/README.md links to."""
    linked = set()
    for index, base in ((root / "README.md", root), (root / "docs" / "README.md", root / "docs")):
        for target in re.findall(r"\]\(([^)#\s]+)", index.read_text()):
            linked.add((base / target).resolve())
    return [page.relative_to(root).as_posix() for page in sorted((root / "docs").glob("*.md"))
            if page.name != "README.md" and page.resolve() not in linked]


def test_every_manual_page_is_linked_from_an_index():
    assert manual_pages_not_linked(ROOT) == []


def test_the_index_check_reports_an_unlinked_page(tmp_path):
    (tmp_path / "docs").mkdir()
    for page in ("a.md", "b.md", "c.md", "README.md"):
        (tmp_path / "docs" / page).write_text("")
    (tmp_path / "README.md").write_text("See [a](docs/a.md#top) and [the manual](docs/README.md).\n")
    (tmp_path / "docs" / "README.md").write_text("- [b](b.md)\n")
    assert manual_pages_not_linked(tmp_path) == ["docs/c.md"]
