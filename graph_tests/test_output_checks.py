"""Where a command's output goes is checked before the work.

``plan -o /dev/full`` or ``plan -o SOME_FOLDER`` was refused only after the whole solve
(36-54 s).  Every command that writes a file (``plan -o``, ``import -o``, ``viz -o``, ``gen -o``,
the demo's HTML) now checks its target first (:func:`layout_prop.io.output.check_output`).  Each
CLI case below gives an input that does not exist with a bad output: the answer must be
``write-failed`` (not ``spec-not-found``), which shows that the check comes before anything is
read, and nothing may be left behind.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from layout_prop.cli import main
from layout_prop.core.errors import SpecError
from layout_prop.io.output import check_output

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# (id, command line with OUT for the bad output)
COMMANDS = [
    ("plan", ["plan", "missing.yaml", "-o", "OUT"]),
    ("plan-model", ["plan", "missing.onnx", "--plan", "missing-plan.yaml", "-o", "OUT"]),
    ("import", ["import", "missing.onnx", "--plan", "missing-plan.yaml", "-o", "OUT"]),
    ("viz", ["viz", "missing.yaml", "-o", "OUT"]),
    ("gen", ["gen", "llama", "-o", "OUT"]),  # (no input: the check comes before the model is built)
]
# (id, the output, the reason said)
TARGETS = [
    ("folder", "out.svg", "it is a folder"),
    ("missing-folder", "no/such/folder/out.svg", "its folder 'no/such/folder' does not exist"),
    ("dev-full", "/dev/full", "No space left on device"),
]


def _make(kind: str, tmp_path: Path) -> None:
    if kind == "folder":
        (tmp_path / "out.svg").mkdir()


@pytest.mark.parametrize("target", TARGETS, ids=[t[0] for t in TARGETS])
@pytest.mark.parametrize("command", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_bad_output_is_refused_before_the_input_is_read(command, target, tmp_path, monkeypatch, capsys):
    kind, out, reason = target
    if out == "/dev/full" and not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    monkeypatch.chdir(tmp_path)
    _make(kind, tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    argv = [out if arg == "OUT" else arg for arg in command[1]]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    if command[0] == "viz" and out == "/dev/full":  # viz reads the format from the extension, said first
        assert len(err) == 1 and "bad-format at /dev/full" in err[0]
        return
    assert len(err) == 1, err
    assert err[0].startswith("layout-prop: error: write-failed") and f"cannot write '{out}': {reason}" in err[0], err[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing made, nothing left behind


def test_the_demo_checks_its_html_first(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "layout-prop-demo.html").mkdir()  # where the demo writes: a folder
    assert main(["demo"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before the first line of the demo
    err = captured.err.splitlines()
    assert len(err) == 1 and err[0].startswith("layout-prop: error: write-failed: cannot write '")
    assert "layout-prop-demo.html': it is a folder (hint: " in err[0]  # (a long path is cut in the middle)


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs sysfs")
def test_a_folder_one_cannot_write_to():
    with pytest.raises(SpecError) as info:
        check_output("/sys/kernel/out.yaml")  # not writable, even by root
    assert info.value.code == "write-failed" and "Permission denied" in info.value.message


def test_good_targets_pass_and_leave_nothing(tmp_path):
    check_output(tmp_path / "new.yaml")
    (tmp_path / "old.yaml").write_text("kept")
    check_output(tmp_path / "old.yaml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.yaml"]  # the probe's temporary is gone
    assert (tmp_path / "old.yaml").read_text() == "kept"
    check_output("/dev/null")
    (tmp_path / "link.yaml").symlink_to(tmp_path / "old.yaml")
    check_output(tmp_path / "link.yaml")
    assert (tmp_path / "old.yaml").read_text() == "kept"


def test_a_named_pipe_is_not_opened(tmp_path):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    check_output(fifo)  # opening it would wait for a reader: passed without opening it


def test_a_dangling_link_into_a_missing_folder(tmp_path):
    (tmp_path / "link.yaml").symlink_to(tmp_path / "gone" / "x.yaml")
    with pytest.raises(SpecError) as info:
        check_output(tmp_path / "link.yaml")
    assert "does not exist" in info.value.message


def test_import_still_writes_its_spec(tmp_path, capsys):
    out = tmp_path / "spec.yaml"
    assert main(["import", str(EXAMPLES / "llama_block.onnx"), "--plan", str(EXAMPLES / "llama_plan.yaml"),
                 "-o", str(out)]) == 0
    assert out.read_text().startswith(("mesh", "name", "description", "#"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]
