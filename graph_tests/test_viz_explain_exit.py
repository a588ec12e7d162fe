"""Which commands gate on violations, as the exit-code paragraph of docs/commands.md and ``--help`` say.

``check``, ``lower`` and ``run`` (``--no-reshard``) exit 1 on a spec with violations;
``viz`` and ``explain`` are asked to show them, so they exit 0 once their output is
written in full, with the violations in it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from layout_prop.cli import _parser, main

from .cli_support import relu_chain

#: the command reference: its paragraph "Exit codes: ..." says which commands gate
COMMANDS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "commands.md"

#: x shards RPE's rotation dim and sin is Partial: violations
BROKEN = """\
mesh: {shape: [2, 2], names: [dp, tp]}
inputs:
  x:   {shape: [4, 4, 16, 64], placements: ["S(0)", "S(3)"]}
  cos: {shape: [1, 1, 16, 64], placements: [R, R]}
  sin: {shape: [1, 1, 16, 64], placements: ["P(sum)", R]}
nodes:
  - {name: y, op: rotary_position_embedding, inputs: [x, cos, sin], attrs: {mode: 0}}
outputs: [y]
"""


@pytest.fixture
def broken(tmp_path):
    spec = tmp_path / "broken.yaml"
    spec.write_text(BROKEN)
    return spec


@pytest.mark.parametrize("argv", [["check"], ["lower", "--rank", "0", "--no-reshard"], ["run", "--no-reshard"]],
                         ids=["check", "lower", "run"])
def test_the_gates_exit_1_on_violations(broken, capsys, argv):
    assert main([argv[0], str(broken), *argv[1:]]) == 1
    captured = capsys.readouterr()
    assert "sharded-rotation-dim" in captured.out + captured.err


def test_viz_writes_the_violations_and_exits_0(broken, tmp_path, capsys):
    out = tmp_path / "broken.svg"
    assert main(["viz", str(broken), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    count = int(re.search(r"(\d+) violations\)", printed).group(1))
    assert count > 0
    assert "sharded-rotation-dim" in out.read_text()


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_explain_shows_the_violations_and_exits_0(broken, capsys, json_flag):
    assert main(["explain", str(broken), "y", *json_flag]) == 0
    assert "sharded-rotation-dim" in capsys.readouterr().out


def _exit_paragraph() -> str:
    text = COMMANDS_PAGE.read_text()
    start = text.index("Exit codes")
    return " ".join(text[start:text.index("\n\n", start)].split())


def test_the_readme_says_which_commands_gate():
    paragraph = _exit_paragraph()
    assert "everywhere" not in paragraph.split("**2**")[0]  # not "1 on violations everywhere"
    for command in ("check", "run", "lower"):
        assert f"`{command}`" in paragraph
    assert ("`viz` and `explain` are asked to show violations, not to judge them: they exit **0** once their "
            "output is written, violations or not") in paragraph


@pytest.mark.parametrize("command", ["viz", "explain"])
def test_help_says_so(command):
    sub = next(a for a in _parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    text = " ".join(sub.choices[command].format_help().split())
    assert "violations or not (check exits 1 on them)" in text


def test_explain_of_a_mistyped_name_suggests_the_closest(broken, capsys):
    assert main(["explain", str(broken), "yy"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown-value" in err and "did you mean 'y'?" in err
    assert main(["explain", str(broken), "qqqq"]) == 2  # nothing close: how values are named, and one of them
    assert "node output" in capsys.readouterr().err


def test_explain_walks_back_a_bounded_depth_on_a_long_chain(tmp_path, capsys):
    """A chain of 1,000 ops nested deeper than Python's recursion limit (too-deep, exit 2): explain
    walks back --depth producers (default 100) and marks where it stopped."""
    spec = tmp_path / "chain.json"
    spec.write_text(json.dumps(relu_chain(1000, ("S(0)",))))
    assert main(["explain", str(spec), "v999"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 101 and lines[0].startswith("v999 = relu(v998)")
    assert lines[-1].strip().startswith("v899 (as x) = relu(...)") and "explain v899" in lines[-1]
    assert main(["explain", str(spec), "v999", "--depth", "300", "--json"]) == 0
    tree, levels = json.loads(capsys.readouterr().out), 0
    while "inputs" in tree:
        tree, levels = tree["inputs"][0]["from"], levels + 1
    assert levels == 300 and tree == {"value": "v699", "op": "relu", "placements": "(S(0))", "more": True}
    assert main(["explain", str(spec), "v999", "--depth", "301"]) == 2
    assert "from 1 to 300" in capsys.readouterr().err
    assert main(["explain", str(spec), "v5", "--depth", "300"]) == 0  # a short chain reaches the input
    assert capsys.readouterr().out.splitlines()[-1].strip() == "x: graph input, declared (S(0))"
