"""Output files (``viz -o``, ``gen -o``, the demo's HTML) are written atomically (issue 14).

A write that fails half way (a full disk, a file size limit) leaves the target as it was
(absent, or the old file) and no temporary file behind; the command exits 2 with one line.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from layout_prop import output
from layout_prop.cli import main
from layout_prop.output import atomic_path, write_text_atomic

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def console_command() -> list[str]:
    bindir = os.path.dirname(sys.executable)
    exe = shutil.which("layout-prop", path=bindir) or shutil.which("layout-prop")
    return [exe] if exe else [sys.executable, "-m", "layout_prop.cli"]


def run_with_file_size_limit(argv: list[str], limit: int, cwd: Path) -> subprocess.CompletedProcess:
    """Run the console script with RLIMIT_FSIZE: a write past ``limit`` bytes fails with EFBIG,
    as on a full disk (Python ignores SIGXFSZ, so the write raises instead of killing)."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return subprocess.run([*console_command(), *argv], capture_output=True, text=True, timeout=300, env=env,
                          cwd=cwd, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and lines[0].startswith("layout-prop: error: ")
    return lines[0]


def test_a_write_that_fails_half_way_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "out.html"
    target.write_text("old picture")

    def half_then_full(f, data):
        f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output, "_write_all", half_then_full)
    with pytest.raises(OSError):
        write_text_atomic(target, "new picture " * 1000)
    assert target.read_text() == "old picture"
    assert [p.name for p in tmp_path.iterdir()] == ["out.html"]  # no temporary file left


def test_a_write_that_fails_leaves_no_file_when_there_was_none(tmp_path, monkeypatch):
    def fails(f, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output, "_write_all", fails)
    with pytest.raises(OSError):
        write_text_atomic(tmp_path / "new.yaml", "x" * 100)
    assert list(tmp_path.iterdir()) == []


def test_permissions_of_new_and_replaced_files(tmp_path):
    umask = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "new.txt", "a")
        assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o644  # as open() would give
        old = tmp_path / "old.txt"
        old.write_text("old")
        old.chmod(0o600)
        write_text_atomic(old, "new")
        assert old.read_text() == "new" and stat.S_IMODE(old.stat().st_mode) == 0o600
    finally:
        os.umask(umask)


def test_an_exception_in_the_block_removes_the_temporary_file(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "x.png") as tmp:
            tmp.write_bytes(b"partial")
            raise RuntimeError("drawing failed")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,name,minimum", [
    (["viz", str(EXAMPLES / "llama_block.yaml"), "--reshard", "--backward", "-o", "out.html"], "out.html", 20000),
    (["viz", str(EXAMPLES / "llama_block.yaml"), "-o", "out.svg"], "out.svg", 20000),
    (["gen", "llama", "--layers", "8", "-o", "out.yaml"], "out.yaml", 20000),
    (["gen", "llama", "--layers", "8", "-o", "out.json"], "out.json", 20000),
], ids=["viz-html", "viz-svg", "gen-yaml", "gen-json"])
def test_a_full_disk_leaves_no_truncated_file(tmp_path, argv, name, minimum):
    (tmp_path / name).write_text("old")
    proc = run_with_file_size_limit(argv, 8192, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "write-failed" in one_error_line(proc.stderr)
    assert (tmp_path / name).read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == [name]
    # and without the limit the whole file is written (it is bigger than the limit)
    proc = run_with_file_size_limit(argv, resource.RLIM_INFINITY, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / name).stat().st_size > minimum
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_the_demo_html_on_a_full_disk(tmp_path):
    proc = run_with_file_size_limit(["demo"], 8192, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "write-failed" in one_error_line(proc.stderr)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("command", ["gen", "viz"])
def test_output_to_a_device_is_written_in_place(tmp_path, capsys, command):
    # a link to /dev/full: the device is written through it (never replaced by a renamed
    # file), and it is full: exit 2, one line
    link = tmp_path / ("full.yaml" if command == "gen" else "full.svg")
    link.symlink_to("/dev/full")
    argv = ["gen", "llama"] if command == "gen" else ["viz", str(EXAMPLES / "rpe" / "dp_sp.yaml")]
    rc = main([*argv, "-o", str(link)])
    out, err = capsys.readouterr()
    assert rc == 2
    assert "write-failed" in one_error_line(err)
    assert link.is_symlink() and stat.S_ISCHR(os.stat(link).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == [link.name]


def test_output_to_dev_stdout_is_written_in_place(tmp_path):
    env = dict(os.environ)
    proc = subprocess.run([*console_command(), "gen", "llama", "-o", "/dev/stdout"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("mesh:")
    assert not any(p.name.startswith(".stdout.") for p in Path("/dev").iterdir())
