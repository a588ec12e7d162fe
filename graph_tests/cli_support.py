"""How the tests run the installed console script as a user would."""

from __future__ import annotations

import os
import shutil
import sys


def console_command() -> list[str]:
    """The installed ``layout-prop`` next to this interpreter, else ``python -m layout_prop.cli``."""
    bindir = os.path.dirname(sys.executable)
    exe = shutil.which("layout-prop", path=bindir) or shutil.which("layout-prop")
    return [exe] if exe else [sys.executable, "-m", "layout_prop.cli"]


def cli_env() -> dict[str, str]:
    """This environment with the interpreter's folder first on PATH (where the script is)."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env
