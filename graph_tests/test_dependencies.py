"""Optional dependencies are said at once, with the extra that installs them.

On an install without extras, ``layout-prop plan`` worked for 30 s, then printed
``internal-error: ModuleNotFoundError: No module named 'scipy'``.  Each command now checks
what it needs before it reads anything (:mod:`layout_prop.core.dependencies`).  Each case
hides one module in a child process (an import hook that refuses it, as an install without
it would) and gives a spec or model path that does not exist: the answer must be
``missing-dependency`` naming the extra, not ``spec-not-found``, which proves that the check
comes before the work.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from layout_prop.core.dependencies import EXTRAS, MissingDependency, available, require, require_model_reader

from .cli_support import cli_env

#: a child that hides the modules named in argv[1] (comma-separated), then runs the CLI on argv[2:]
HIDE = """
import sys
hidden = set(sys.argv[1].split(","))
mode = sys.argv[2]


class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


if mode == "hook":
    sys.meta_path.insert(0, Refuse())
else:  # what a test of a broken install often does
    for name in hidden:
        sys.modules[name] = None
from layout_prop.cli import main
raise SystemExit(main(sys.argv[3:]))
"""

# (module, command line, what needs it, the extra)
CASES = [
    ("scipy", ["plan", "missing.yaml"], "plan", "plan"),
    ("scipy", ["plan", "missing.onnx", "--plan", "missing-plan.yaml"], "plan", "plan"),
    ("onnx", ["import", "missing.onnx", "--plan", "missing-plan.yaml"], "reading an ONNX model", "onnx"),
    ("onnx", ["check", "missing.onnx", "--plan", "missing-plan.yaml"], "reading an ONNX model", "onnx"),
    ("mindspore", ["import", "missing.mindir", "--plan", "missing-plan.yaml"], "reading a MindIR model", "mindspore"),
    ("mindspore", ["run", "missing.mindir", "--plan", "missing-plan.yaml"], "reading a MindIR model", "mindspore"),
    ("mindspore", ["run", "missing.yaml", "--engine", "mindspore"], "run --engine mindspore", "mindspore"),
]


def hidden_run(modules: str, argv: list[str], cwd, mode: str = "hook") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE, modules, mode, *argv], capture_output=True, text=True,
                          cwd=cwd, env=cli_env(), timeout=120)


@pytest.mark.parametrize("module, argv, feature, extra", CASES, ids=[f"{c[0]}-{c[1][0]}-{c[1][1]}" for c in CASES])
def test_a_hidden_module_is_said_first_on_one_line(module, argv, feature, extra, tmp_path):
    proc = hidden_run(module, argv, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"layout-prop: error: missing-dependency: {feature} needs {module}, which is "
                                        f"not installed (hint: pip install 'layout-prop[{extra}]')"]
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_png_without_matplotlib_is_said_before_the_spec_is_read(tmp_path):
    proc = hidden_run("matplotlib", ["viz", "missing.yaml", "-o", "picture.png"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [  # viz's own code for it (graph_tests/test_visualise.py holds its text)
        "layout-prop: error: png-unavailable: writing a .png needs matplotlib, which is not installed (hint: pip "
        "install matplotlib (or pip install 'layout-prop[viz]'), or write .svg or .html, which need nothing else)"]
    assert list(tmp_path.iterdir()) == []


def test_a_module_set_to_none_in_sys_modules_counts_as_missing(tmp_path):
    proc = hidden_run("scipy", ["plan", "missing.yaml"], tmp_path, mode="none")
    assert proc.returncode == 2
    assert "missing-dependency: plan needs scipy" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_commands_that_do_not_need_the_module_still_work(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("mesh: {shape: [2]}\ninputs:\n  x: {shape: [4, 4], placements: [\"S(0)\"]}\n"
                    "nodes:\n  - {name: y, op: relu, inputs: [x]}\n")
    everything = ",".join(EXTRAS)
    for argv in (["check", str(spec), "--reshard"], ["run", str(spec), "--backward"],
                 ["viz", str(spec), "-o", str(tmp_path / "g.svg")]):
        proc = hidden_run(everything, argv, tmp_path)
        assert proc.returncode == 0, (argv, proc.stderr)


def test_every_extra_is_declared_in_setup_cfg():
    import configparser
    from pathlib import Path

    config = configparser.ConfigParser()
    config.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    extras = config["options.extras_require"]
    for module, extra in EXTRAS.items():
        assert module in extras[extra], (module, extra)


def test_require_and_available():
    assert available("json") and not available("no_such_module_for_layout_prop")
    require("json", "anything")
    with pytest.raises(MissingDependency) as info:
        require("no_such_module_for_layout_prop", "a feature", "extra")
    assert (info.value.code, info.value.hint) == ("missing-dependency", "pip install 'layout-prop[extra]'")
    require_model_reader("spec.yaml")  # not a model: nothing to read it with


def test_every_package_folder_is_listed_in_setup_cfg():
    """A folder with an ``__init__.py`` that setup.cfg does not list is missing from a wheel
    (``pip install .``, not ``-e``): its modules raise ModuleNotFoundError only there.
    ``layout_prop.interop`` and ``layout_prop.perf`` were missing this way."""
    import configparser
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    # the top-level folders installed under another name (setup.cfg's package_dir)
    roots = {"layout_prop": "layout_prop", "ops": "layout_prop.ops", "passes": "layout_prop.passes",
             "kernels": "layout_prop.kernels"}
    found = set()
    for folder, name in roots.items():
        for init in (root / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(root / folder).parts
            found.add(".".join((name, *parts)))
    assert found - listed == set(), f"add these packages to setup.cfg [options] packages: {sorted(found - listed)}"
