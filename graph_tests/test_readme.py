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


def _command_rows(text: str) -> dict[str, str]:
    """The command tables' rows, joined per command (a row ``layout-prop a|b ...`` counts for both)."""
    rows: dict[str, str] = {}
    for row in re.findall(r"^\| `layout-prop ([a-z|\\]+)(.*)$", text, re.M):
        for command in row[0].replace("\\", "").split("|"):
            rows[command] = rows.get(command, "") + " " + row[1]
    return rows


def test_readme_command_tables_list_every_flag_of_every_command():
    """Every option of every sub-command's parser appears in that command's row of a README table."""
    import argparse

    from layout_prop.cli import _parser

    rows = _command_rows(README.read_text())
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = []
    for name, parser in commands.items():
        assert name in rows, f"no README table row for 'layout-prop {name}'"
        for action in parser._actions:
            flags = [flag for flag in action.option_strings if flag not in ("-h", "--help")]
            if flags and not any(re.search(re.escape(flag) + r"(?![\w-])", rows[name]) for flag in flags):
                missing.append(f"{name} {'/'.join(flags)}")
    assert missing == []


def test_the_command_row_reader_sees_a_missing_flag():
    rows = _command_rows("| `layout-prop check SPEC [--json]` | x |\n| `layout-prop check\\|run MODEL --plan P` | y |\n")
    assert set(rows) == {"check", "run"}
    assert "--plan" in rows["run"] and "--json" not in rows["run"] and "--json" in rows["check"]
