"""Output files (``viz -o``, ``gen -o``, the demo's HTML) are written atomically (issue 14).

A write that fails half way (a full disk, a file size limit) leaves the target as it was
(absent, or the old file) and no temporary file behind; the command exits 2 with one line.
"""

from __future__ import annotations

import errno
import os
import resource
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from layout_prop.io import output
from layout_prop.cli import main
from layout_prop.io.output import atomic_path, write_text_atomic

from .cli_support import console_command

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


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


# --------------------------------------------------------------------------- review of issue 14
SMALL_PLAN = """mesh: {shape: [2], names: [tp]}
inputs:
  x:  {shape: [8, 16], requires_grad: false}
  w1: {shape: [16, 32], placements: auto}
  w2: {shape: [32, 16], placements: auto}
nodes:
  - {name: h, op: matmul, inputs: [x, w1]}
  - {name: a, op: gelu, inputs: [h]}
  - {name: y, op: matmul, inputs: [a, w2]}
outputs: [y]
"""


@pytest.mark.parametrize("command", ["import", "plan"])
def test_import_and_plan_outputs_are_atomic(tmp_path, command):
    # `import -o` and `plan -o` wrote with Path.write_text: a full disk left a truncated spec
    if command == "import":
        pytest.importorskip("onnx")
        argv = ["import", str(EXAMPLES / "llama_block.onnx"), "--plan", str(EXAMPLES / "llama_plan.yaml"),
                "-o", "out.yaml"]
    else:
        (tmp_path / "in.yaml").write_text(SMALL_PLAN)
        argv = ["plan", "in.yaml", "-o", "out.yaml"]
    (tmp_path / "out.yaml").write_text("old")
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = run_with_file_size_limit(argv, 256, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "write-failed" in one_error_line(proc.stderr)
    assert (tmp_path / "out.yaml").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary file left
    proc = run_with_file_size_limit(argv, resource.RLIM_INFINITY, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out.yaml").read_text().startswith("mesh:")


def test_a_symbolic_link_is_written_through(tmp_path):
    # the link stays a link to the real file, which is replaced beside itself (as editors do)
    real_folder, link_folder = tmp_path / "real", tmp_path / "links"
    real_folder.mkdir()
    link_folder.mkdir()
    real = real_folder / "spec.yaml"
    real.write_text("old")
    real.chmod(0o640)
    link = link_folder / "spec.yaml"
    link.symlink_to(Path("..") / "real" / "spec.yaml")  # a relative link
    chain = link_folder / "chain.yaml"
    chain.symlink_to(link)  # a chain of two links
    write_text_atomic(chain, "new")
    assert link.is_symlink() and chain.is_symlink() and os.readlink(chain) == str(link)
    assert real.read_text() == "new" and stat.S_IMODE(real.stat().st_mode) == 0o640
    assert sorted(p.name for p in real_folder.iterdir()) == ["spec.yaml"]
    assert sorted(p.name for p in link_folder.iterdir()) == ["chain.yaml", "spec.yaml"]
    dangling = link_folder / "new.yaml"  # a link to a file not written yet: the file is made
    dangling.symlink_to(real_folder / "made.yaml")
    write_text_atomic(dangling, "made")
    assert dangling.is_symlink() and (real_folder / "made.yaml").read_text() == "made"


def test_gen_writes_through_a_link(tmp_path, capsys):
    real = tmp_path / "real.yaml"
    real.write_text("old")
    (tmp_path / "link.yaml").symlink_to(real)
    assert main(["gen", "llama", "-o", str(tmp_path / "link.yaml")]) == 0
    assert (tmp_path / "link.yaml").is_symlink() and real.read_text().startswith("mesh:")


@pytest.mark.skipif(os.geteuid() != 0, reason="a link owned by another user needs root")
def test_another_users_link_in_a_shared_folder_is_not_followed(tmp_path, capsys):
    # /tmp/out.yaml planted by another user as a link to one of your files: refused, as the
    # kernel's protected_symlinks refuses it; your file is untouched
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    trap = shared / "out.yaml"
    trap.symlink_to(victim)
    os.lchown(trap, 12345, 12345)
    with pytest.raises(PermissionError):
        write_text_atomic(trap, "overwritten")
    assert main(["gen", "llama", "-o", str(trap)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "write-failed" in line and "refusing to follow the symbolic link" in line and "uid 12345" in line
    assert victim.read_text() == "precious" and trap.is_symlink()
    os.lchown(trap, os.geteuid(), os.getegid())  # your own link there is followed
    write_text_atomic(trap, "yours")
    assert victim.read_text() == "yours"


def test_the_process_umask_is_never_changed(tmp_path, monkeypatch):
    # the mode of a new file was computed by setting the umask to 0 for a moment, which
    # another thread creating a file in that moment would have suffered
    def no_umask(mask):
        raise AssertionError("os.umask called")

    saved = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", no_umask)
        write_text_atomic(tmp_path / "new.txt", "a")
        assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o640  # what open() gives under 027
    finally:
        monkeypatch.undo()
        os.umask(saved)


def test_dev_stdout_to_a_file_is_written_in_place(tmp_path):
    # /dev/stdout is a link to /proc/self/fd/1, which leads to the file stdout goes to: the
    # file is written through it, and /dev/stdout is never replaced (as root, it could be)
    with open(tmp_path / "out.yaml", "w") as out:
        proc = subprocess.run([*console_command(), "gen", "llama", "-o", "/dev/stdout"], stdout=out,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out.yaml").read_text().startswith("mesh:")
    assert os.path.islink("/dev/stdout")
    assert not any(p.name.startswith(".stdout.") for p in Path("/dev").iterdir())
