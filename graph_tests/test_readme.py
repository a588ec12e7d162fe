"""The README stays true: its Python example runs, its console transcript is what the CLI prints."""

import doctest
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_readme_python_example_runs():
    result = doctest.testfile(str(README), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 5 and result.failed == 0


def test_readme_console_transcripts_match_the_cli():
    text = README.read_text()
    blocks = re.findall(r"```console\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        for chunk in block.split("$ ")[1:]:
            command, _, expected = chunk.partition("\n")
            args = command.split()
            assert args[0] == "layout-prop"
            out = subprocess.run([sys.executable, "-m", "layout_prop.cli", *args[1:]], cwd=ROOT,
                                 capture_output=True, text=True)
            assert out.stdout.strip() == expected.strip(), command


def test_readme_gives_the_ci_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    command = "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/python -m pytest"
    assert command in README.read_text() and command in ci
