"""``audit`` shows progress on a terminal, and nothing extra when piped or with ``--json``/``--markdown``.

The audited checkout is the small fake one of test_audit_sandbox (two right elementwise rules), so
the runs take a second or two.
"""

from __future__ import annotations

import io
import json
import os
import select
import subprocess
import time

import pytest

from .cli_support import cli_env, console_command
from .test_audit_sandbox import make_checkout

LABEL = "\raudit "


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    return make_checkout(root, {"ReLU": ("parallel_good", "Elementwise"), "Exp": ("parallel_good", "Elementwise")})


def _on_a_terminal(args: list[str], timeout: float = 120.0) -> tuple[int, str]:
    """``layout-prop ARGS`` with its standard streams on a pseudo-terminal: status and all it wrote there."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(console_command() + args, stdin=slave, stdout=slave, stderr=slave, env=cli_env(),
                            close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its side
                break
            if not data:
                break
            chunks.append(data)
        else:
            proc.kill()
            pytest.fail(f"layout-prop {' '.join(args)} did not end within {timeout:.0f} s")
        status = proc.wait(timeout=30)
    finally:
        os.close(master)
    return status, b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")


def test_a_terminal_sees_the_audit_progress_then_the_result(checkout):
    status, text = _on_a_terminal(["audit", str(checkout), "--mesh", "4"])
    assert status == 0, text
    assert LABEL + "Exp: 0/2 (0%)" in text, text  # drawn in place, naming the op being audited
    result = "every accepted answer is right"
    assert text.rstrip().endswith(result) and text.rfind(LABEL) < text.rfind("audit of "), \
        "the progress line came after the result: it was not erased before printing"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("flag", ["--json", "--markdown"])
def test_json_and_markdown_draw_no_progress_even_on_a_terminal(checkout, monkeypatch, capsys, flag):
    from layout_prop.cli import main

    err = _Terminal()
    monkeypatch.setattr("sys.stderr", err)
    assert main(["audit", str(checkout), "--mesh", "4", flag]) == 0
    out = capsys.readouterr().out
    assert err.getvalue() == "" and "\r" not in out
    if flag == "--json":
        assert [o["op"] for o in json.loads(out)["ops"]] == ["Exp", "ReLU"]


def test_a_pipe_gets_no_progress(checkout):
    proc = subprocess.run(console_command() + ["audit", str(checkout), "--mesh", "4"], capture_output=True,
                          text=True, env=cli_env(), timeout=120)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.splitlines()[-1] == "every accepted answer is right"
