"""How the tests run the installed console script as a user would, and the specs they feed it."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys


def console_command() -> list[str]:
    """The installed ``layout-prop`` next to this interpreter, else ``python -m layout_prop.cli``."""
    bindir = os.path.dirname(sys.executable)
    exe = shutil.which("layout-prop", path=bindir) or shutil.which("layout-prop")
    return [exe] if exe else [sys.executable, "-m", "layout_prop.cli"]


def relu_chain(length: int, placements: tuple[str, ...] = ("R",)) -> dict:
    """A spec of ``length`` chained relus ``v0 .. v{length-1}`` from a 4 x 4 input ``x`` on 2 ranks
    (a graph as deep as it is long: what recursion limits and one-row drawings meet)."""
    nodes = [{"name": f"v{i}", "op": "relu", "inputs": [f"v{i - 1}" if i else "x"]} for i in range(length)]
    return {"mesh": {"shape": [2]}, "inputs": {"x": {"shape": [4, 4], "placements": list(placements)}},
            "nodes": nodes}


def cli_env() -> dict[str, str]:
    """This environment with the interpreter's folder first on PATH (where the script is)."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def run_in_process(argv: list[str], cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """``layout-prop ARGV`` run by :func:`layout_prop.cli.main` in this process, its exit code, stdout and
    stderr returned as :func:`subprocess.run` returns them (text).

    For a test of what a command prints and returns, where the process boundary is not what is tested
    (exit on a closed pipe, a signal, the console script itself): a fresh interpreter costs about half a CPU
    second a call, two with MindSpore imported.  ``cwd`` is this process's folder while the command runs.
    """
    from layout_prop.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in argv])
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["layout-prop", *map(str, argv)], code, out.getvalue(), err.getvalue())
