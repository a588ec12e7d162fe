"""The console script's end: one-graph commands end with ``os._exit`` after flushing,
the others (and any process with an exit handler) exit the usual way, and the output and
exit code are those of :func:`layout_prop.cli.main` either way."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from layout_prop.cli import HARD_EXIT_COMMANDS, UNCOLLECTED_COMMANDS, main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

#: a module whose object prints when the interpreter's teardown frees it (not after os._exit),
#: then the console script's entry with the given arguments
_MARKED_ENTRY = """
import sys
class Marker:
    def __del__(self):
        sys.stderr.write("torn down\\n")
sys.modules["teardown_marker"] = Marker()
{setup}
from layout_prop.cli import entry
sys.argv = ["layout-prop", *{argv!r}]
entry()
"""


def run_entry(argv: list[str], setup: str = "", cwd: Path | None = None) -> subprocess.CompletedProcess:
    code = _MARKED_ENTRY.format(setup=setup, argv=argv)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)


def in_process(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def test_hard_exit_commands_are_one_graph_commands():
    assert HARD_EXIT_COMMANDS <= UNCOLLECTED_COMMANDS


# (ops of one op: other test modules register ops in this process, not in the subprocess)
@pytest.mark.parametrize("argv", [["check", str(EXAMPLES / "llama_block.yaml"), "--json"],
                                  ["check", str(EXAMPLES / "rpe" / "dp_sp.yaml")],
                                  ["explain", str(EXAMPLES / "rpe" / "dp_sp.yaml"), "y"],
                                  ["ops", "rotary_position_embedding", "--json"]],
                         ids=["check-violations-json", "check-table", "explain", "ops"])
def test_one_graph_commands_skip_the_teardown_with_the_same_output(argv):
    proc = run_entry(argv)
    code, expected = in_process(argv)
    assert "torn down" not in proc.stderr  # the process ended before the interpreter's teardown
    assert (proc.returncode, proc.stdout) == (code, expected)
    if "--json" in argv:
        json.loads(proc.stdout)


def test_a_file_written_by_gen_is_whole(tmp_path):
    proc = run_entry(["gen", "llama", "--layers", "3", "-o", "spec.json"], cwd=tmp_path)
    assert proc.returncode == 0 and "torn down" not in proc.stderr and "wrote spec.json" in proc.stderr
    code, _ = in_process(["gen", "llama", "--layers", "3", "-o", str(tmp_path / "same.json")])
    assert code == 0
    assert (tmp_path / "spec.json").read_bytes() == (tmp_path / "same.json").read_bytes()
    assert json.loads((tmp_path / "spec.json").read_text())["nodes"]  # complete JSON


@pytest.mark.parametrize("argv", [["--version"], ["check", "no-such-spec.yaml"], ["check", "--reshrad"]],
                         ids=["version", "error", "bad-flag"])
def test_errors_and_flags_exit_as_in_process(argv):
    proc = run_entry(argv)
    code, _ = in_process(argv)
    assert proc.returncode == code
    # --version and a bad flag end before a command ran: the usual exit, teardown included;
    # an error in check itself still ends with os._exit
    assert ("torn down" in proc.stderr) == (argv[0] != "check" or argv[1].startswith("-"))


def test_an_exit_handler_keeps_the_usual_exit():
    setup = "import atexit\natexit.register(lambda: sys.stderr.write('handler ran\\n'))"
    proc = run_entry(["check", str(EXAMPLES / "rpe" / "dp_sp.yaml")], setup=setup)
    assert proc.returncode == 0
    assert "handler ran" in proc.stderr and "torn down" in proc.stderr


def test_other_commands_exit_the_usual_way(tmp_path):
    proc = run_entry(["viz", str(EXAMPLES / "rpe" / "dp_sp.yaml"), "-o", "graph.dot"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "graph.dot").read_text().startswith("digraph")
    assert "torn down" in proc.stderr
