"""Malformed specs: every one is refused with a code, the place in the spec, the value and a hint.

Each case is a spec written inline.  ``load_spec`` must raise a :class:`SpecError` with the
expected ``code`` and ``path``, a message quoting the offending value and a non-empty hint;
``layout-prop check FILE`` must exit 2 with exactly one line on stderr and no traceback.
A valid spec that breaks an op's rule is a violation (exit 1), not unusable input (exit 2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from layout_prop import __version__
from layout_prop.cli import main
from layout_prop.core.errors import LayoutPropError, SpecError
from layout_prop.io.loader import load_spec

from .cli_support import console_command

FILE = object()  # the expected path is the spec file's own path


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    code: str
    path: object  # str, or FILE
    fragments: tuple[str, ...]  # each must appear in the message
    hint: str = ""  # must appear in the hint when given
    filename: str = "spec.yaml"


CASES = [
    # ------------------------------------------------------------------ syntax and top level
    Case("malformed-yaml", "mesh: {shape: [2, 2]\ninputs: [\n", "spec-syntax", FILE, ("line 2, column 1",)),
    Case("malformed-json",
         '{"mesh": {"shape": [2]}, "inputs": {"x": {"shape": [4]}},, "nodes": []}',
         "spec-syntax", FILE, ("line 1, column 58", "','"), filename="spec.json"),
    Case("top-level-list", "- mesh\n- inputs\n", "spec-syntax", FILE, ("list",)),
    Case("top-level-scalar", "just a string\n", "spec-syntax", FILE, ("str",)),
    Case("empty-file", "", "spec-syntax", FILE, ("holds nothing",)),
    # YAML would silently keep the last of two equal keys, dropping an input
    Case("duplicate-input-key",
         "mesh: {shape: [2]}\ninputs:\n  x: {shape: [4]}\n  x: {shape: [8]}\nnodes: []\n",
         "spec-syntax", FILE, ("line 4, column 3", "'x'", "twice"), hint="once"),
    Case("duplicate-json-key",
         '{"mesh": {"shape": [2], "shape": [4]}, "inputs": {"x": {"shape": [4]}}, "nodes": []}',
         "spec-syntax", FILE, ("line 1, column 25", "'shape'", "twice"), filename="spec.json"),
    Case("unknown-top-level-key",
         "mesh: {shape: [2]}\ninputs: {x: {shape: [4]}}\nnodes: []\nextra_stuff: 1\n",
         "unknown-key", "extra_stuff", ("extra_stuff",), hint="outputs"),
    Case("missing-mesh", "inputs: {x: {shape: [4]}}\nnodes: []\n", "missing-key", "<top>", ("'mesh'",),
         hint="mesh"),
    Case("missing-inputs", "mesh: {shape: [2]}\nnodes: []\n", "missing-key", "<top>", ("'inputs'",),
         hint="inputs"),
    Case("empty-inputs", "mesh: {shape: [2]}\ninputs: {}\nnodes: []\n", "bad-type", "inputs", ("{}",)),
    Case("nodes-not-a-list", "mesh: {shape: [2]}\ninputs: {x: {shape: [4]}}\nnodes: {y: neg}\n",
         "bad-type", "nodes", ("dict",)),
    # ------------------------------------------------------------------ mesh
    Case("mesh-not-a-mapping", "mesh: [2, 2]\ninputs: {x: {shape: [4]}}\nnodes: []\n",
         "bad-type", "mesh", ("[2, 2]",)),
    Case("mesh-size-0", "mesh: {shape: [2, 0]}\ninputs: {x: {shape: [4]}}\nnodes: []\n",
         "bad-value", "mesh.shape[1]", ("is 0",)),
    Case("mesh-size-negative", "mesh: {shape: [-2]}\ninputs: {x: {shape: [4]}}\nnodes: []\n",
         "bad-value", "mesh.shape[0]", ("-2",)),
    Case("mesh-shape-not-ints", "mesh: {shape: [2, two]}\ninputs: {x: {shape: [4]}}\nnodes: []\n",
         "bad-type", "mesh.shape", ("'two'",)),
    Case("duplicate-mesh-names", "mesh: {shape: [2, 2], names: [dp, dp]}\ninputs: {x: {shape: [4]}}\nnodes: []\n",
         "invalid-mesh", "mesh.names", ("'dp'",)),
    Case("mesh-names-count", "mesh: {shape: [2, 2], names: [dp]}\ninputs: {x: {shape: [4]}}\nnodes: []\n",
         "invalid-mesh", "mesh.names", ("2 axes", "1 names", "'dp'")),
    Case("unknown-mesh-key", "mesh: {shape: [2], axes: [dp]}\ninputs: {x: {shape: [4]}}\nnodes: []\n",
         "unknown-key", "mesh.axes", ("axes",)),
    # ------------------------------------------------------------------ input layouts
    Case("bad-placement-string",
         "mesh: {shape: [2, 2]}\ninputs:\n  x: {shape: [4, 4], placements: [R, 'Q(1)']}\nnodes: []\n",
         "bad-placement", "inputs.x.placements[1]", ("'Q(1)'",), hint="S(d)"),
    Case("partial-unknown-op",
         "mesh: {shape: [2, 2]}\ninputs:\n  x: {shape: [4, 4], placements: ['P(prod)', R]}\nnodes: []\n",
         "bad-placement", "inputs.x.placements[0]", ("'prod'",), hint="sum"),
    Case("placements-length",
         "mesh: {shape: [2, 2], names: [dp, tp]}\ninputs:\n  x: {shape: [4, 4], placements: ['S(0)']}\nnodes: []\n",
         "invalid-layout", "inputs.x.placements", ("1 placements", "2 axes")),
    Case("placements-and-tensor-map",
         "mesh: {shape: [2]}\ninputs:\n  x: {shape: [4], placements: ['S(0)'], tensor_map: [0]}\nnodes: []\n",
         "conflicting-keys", "inputs.x", ("placements", "tensor_map")),
    Case("tensor-map-length",
         "mesh: {shape: [2, 2]}\ninputs:\n  x: {shape: [4, 4, 4], tensor_map: [1, -1]}\nnodes: []\n",
         "invalid-layout", "inputs.x.tensor_map", ("2 entries", "rank 3")),
    Case("tensor-map-axis-twice",
         "mesh: {shape: [2, 2], names: [dp, tp]}\ninputs:\n  x: {shape: [4, 4], tensor_map: [0, 0]}\nnodes: []\n",
         "invalid-layout", "inputs.x.tensor_map[1]", ("'tp'", "dim 0 and dim 1")),
    Case("tensor-map-out-of-range",
         "mesh: {shape: [2, 2]}\ninputs:\n  x: {shape: [4, 4], tensor_map: [-1, 2]}\nnodes: []\n",
         "invalid-layout", "inputs.x.tensor_map[1]", ("entry 2",)),
    Case("shard-dim-out-of-range",
         "mesh: {shape: [2, 2], names: [dp, tp]}\ninputs:\n  x: {shape: [4, 4], placements: [R, 'S(2)']}\nnodes: []\n",
         "invalid-layout", "inputs.x.placements[1]", ("S(2)", "'tp'", "rank 2")),
    Case("negative-shard-dim-out-of-range",
         "mesh: {shape: [2]}\ninputs:\n  x: {shape: [4, 4], placements: ['S(-3)']}\nnodes: []\n",
         "invalid-layout", "inputs.x.placements[0]", ("S(-3)",)),
    Case("size-1-dim-sharded",
         "mesh: {shape: [1, 2], names: [dp, sp]}\ninputs:\n"
         "  cos: {shape: [1, 1, 16, 64], placements: ['S(2)', 'S(0)']}\nnodes: []\n",
         "invalid-layout", "inputs.cos.placements[1]", ("dim 0", "size 1", "2 devices")),
    Case("size-1-dim-sharded-by-tensor-map",
         "mesh: {shape: [2, 2]}\ninputs:\n  cos: {shape: [16, 1], tensor_map: [-1, [1, 0]]}\nnodes: []\n",
         "invalid-layout", "inputs.cos.tensor_map[1]", ("dim 1", "size 1", "4 devices")),
    Case("bad-dtype", "mesh: {shape: [2]}\ninputs:\n  x: {shape: [4], dtype: float8}\nnodes: []\n",
         "bad-dtype", "inputs.x.dtype", ("'float8'",), hint="float32"),
    Case("negative-shape", "mesh: {shape: [2]}\ninputs:\n  x: {shape: [4, -3]}\nnodes: []\n",
         "bad-value", "inputs.x.shape[1]", ("-3",)),
    Case("shape-not-a-list", "mesh: {shape: [2]}\ninputs:\n  x: {shape: '4x4'}\nnodes: []\n",
         "bad-type", "inputs.x.shape", ("'4x4'",)),
    Case("requires-grad-not-bool", "mesh: {shape: [2]}\ninputs:\n  x: {shape: [4], requires_grad: 'no'}\nnodes: []\n",
         "bad-type", "inputs.x.requires_grad", ("'no'",)),
    # torch refuses a gradient for an integer tensor too; token ids and masks default to none
    Case("integer-requires-grad",
         "mesh: {shape: [2]}\ninputs:\n  ids: {shape: [4], dtype: int64, requires_grad: true}\nnodes: []\n",
         "bad-value", "inputs.ids.requires_grad", ("int64", "requires_grad: true"), hint="default to false"),
    Case("unknown-input-key", "mesh: {shape: [2]}\ninputs:\n  x: {shape: [4], layout: [R]}\nnodes: []\n",
         "unknown-key", "inputs.x.layout", ("layout",), hint="tensor_map"),
    Case("input-without-shape", "mesh: {shape: [2]}\ninputs:\n  x: {dtype: float32}\nnodes: []\n",
         "missing-key", "inputs.x", ("'shape'",)),
    Case("input-name-with-colon", "mesh: {shape: [2]}\ninputs:\n  'x:1': {shape: [4]}\nnodes: []\n",
         "bad-name", "inputs.x:1", ("'x:1'",)),
    # ------------------------------------------------------------------ nodes
    Case("unknown-op",
         "mesh: {shape: [2]}\ninputs: {x: {shape: [2, 2, 4, 8]}}\nnodes:\n"
         "  - {name: y, op: rotary_embeding, inputs: [x, x, x]}\n",
         "unknown-op", "nodes[0].op", ("'rotary_embeding'",), hint="did you mean 'rotary_position_embedding'?"),
    Case("unknown-attr",
         "mesh: {shape: [2]}\ninputs: {x: {shape: [2, 2, 4, 8]}}\nnodes:\n"
         "  - {name: y, op: rotary_position_embedding, inputs: [x, x, x], attrs: {rotary_mode: 1}}\n",
         "bad-attr", "nodes[0].attrs", ("'rotary_mode'",), hint="mode"),
    Case("wrong-number-of-inputs",
         "mesh: {shape: [2]}\ninputs: {x: {shape: [2, 2, 4, 8]}, cos: {shape: [1, 1, 4, 8]}}\nnodes:\n"
         "  - {name: y, op: rotary_position_embedding, inputs: [x, cos]}\n",
         "bad-arity", "nodes[0].inputs", ("got 2", "3 inputs"), hint="sin"),
    Case("undefined-input",
         "mesh: {shape: [2]}\ninputs: {x: {shape: [4]}}\nnodes:\n"
         "  - {name: y, op: neg, inputs: [x]}\n  - {name: z, op: add, inputs: [y, w]}\n",
         "undefined-value", "nodes[1].inputs[1]", ("'w'",)),
    Case("duplicate-node-name",
         "mesh: {shape: [2]}\ninputs: {x: {shape: [4]}}\nnodes:\n"
         "  - {name: y, op: neg, inputs: [x]}\n  - {name: y, op: add, inputs: [x, x]}\n",
         "duplicate-name", "nodes[1].name", ("'y'",)),
    Case("node-name-clashes-with-input",
         "mesh: {shape: [2]}\ninputs: {x: {shape: [4]}, w: {shape: [4]}}\nnodes:\n"
         "  - {name: y, op: neg, inputs: [x]}\n  - {name: w, op: neg, inputs: [y]}\n",
         "duplicate-name", "nodes[1].name", ("'w'",)),
    Case("cycle-of-two-nodes",
         "mesh: {shape: [2]}\ninputs: {x: {shape: [4]}}\nnodes:\n"
         "  - {name: a, op: add, inputs: [x, b]}\n  - {name: b, op: neg, inputs: [a]}\n",
         "cycle", "nodes[0]", ("a -> b -> a",)),
    Case("cycle-listed-late",
         "mesh: {shape: [2]}\ninputs: {x: {shape: [4]}}\nnodes:\n  - {name: c, op: neg, inputs: [x]}\n"
         "  - {name: b, op: neg, inputs: [a]}\n  - {name: a, op: add, inputs: [c, b]}\n",
         "cycle", "nodes[1]", ("b -> a -> b",)),
    Case("self-loop",
         "mesh: {shape: [2]}\ninputs: {x: {shape: [4]}}\nnodes:\n  - {name: a, op: neg, inputs: [a]}\n",
         "cycle", "nodes[0]", ("a -> a",)),
    Case("output-not-defined",
         "mesh: {shape: [2]}\ninputs: {x: {shape: [4]}}\nnodes:\n  - {name: y, op: neg, inputs: [x]}\n"
         "outputs: [y, yy]\n",
         "undefined-value", "outputs[1]", ("'yy'",)),
    Case("node-without-op",
         "mesh: {shape: [2]}\ninputs: {x: {shape: [4]}}\nnodes:\n  - {name: y, op: neg, inputs: [x]}\n"
         "  - {name: z, inputs: [y]}\n",
         "missing-key", "nodes[1]", ("'op'",)),
    Case("node-op-not-a-string",
         "mesh: {shape: [2]}\ninputs: {x: {shape: [4]}}\nnodes:\n  - {name: y, op: [neg], inputs: [x]}\n",
         "bad-type", "nodes[0].op", ("['neg']",)),
    Case("node-unknown-key",
         "mesh: {shape: [2]}\ninputs: {x: {shape: [4]}}\nnodes:\n  - {name: y, op: neg, args: [x]}\n",
         "unknown-key", "nodes[0].args", ("args",), hint="inputs"),
    Case("single-output-named-with-index",
         "mesh: {shape: [2]}\ninputs: {x: {shape: [4]}}\nnodes:\n  - {name: y, op: neg, inputs: ['x:0']}\n",
         "undefined-value", "nodes[0].inputs[0]", ("'x:0'",)),
]

CASE_IDS = [c.id for c in CASES]
assert len(set(CASE_IDS)) == len(CASE_IDS) and len(CASES) >= 24


def write(tmp_path: Path, case: Case) -> Path:
    path = tmp_path / case.filename
    path.write_text(case.text, encoding="utf-8")
    return path


def expected_path(case: Case, spec_file: Path) -> str:
    return str(spec_file) if case.path is FILE else case.path


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("layout-prop: error: ")
    return lines[0]


# --------------------------------------------------------------------------- load_spec
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_load_spec_reports_code_path_value_and_hint(case, tmp_path):
    spec_file = write(tmp_path, case)
    with pytest.raises(LayoutPropError) as excinfo:
        load_spec(spec_file)
    err = excinfo.value
    assert isinstance(err, SpecError)
    assert err.code == case.code
    assert err.path == expected_path(case, spec_file)
    for fragment in case.fragments:
        assert fragment in err.message
    assert err.hint and err.hint.strip()
    assert case.hint in err.hint
    # the one-line form carries all of it
    text = str(err)
    assert "\n" not in text
    assert text.startswith(f"{case.code} at {err.path}")
    assert f"(hint: {err.hint})" in text


@pytest.mark.parametrize("case", [c for c in CASES if c.path is not FILE], ids=lambda c: c.id)
def test_load_spec_from_text_and_from_str_path_agree(case, tmp_path):
    spec_file = write(tmp_path, case)
    for source in (case.text, str(spec_file)):
        with pytest.raises(SpecError) as excinfo:
            load_spec(source)
        assert (excinfo.value.code, excinfo.value.path) == (case.code, case.path)


# --------------------------------------------------------------------------- the CLI, in process
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cli_check_exits_2_with_one_line(case, tmp_path, capsys):
    spec_file = write(tmp_path, case)
    rc = main(["check", str(spec_file)])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    line = one_error_line(err)
    assert f"{case.code} at {expected_path(case, spec_file)}" in line
    assert "hint: " in line


@pytest.mark.parametrize("case", [c for c in CASES if c.id in {"unknown-op", "cycle-of-two-nodes", "bad-dtype"}],
                         ids=lambda c: c.id)
@pytest.mark.parametrize("command", [["check", "--json"], ["check", "--reshard", "--backward"], ["run"],
                                     ["lower", "--rank", "0"]], ids=["check-json", "check-all", "run", "lower"])
def test_every_command_refuses_bad_specs_the_same_way(case, command, tmp_path, capsys):
    spec_file = write(tmp_path, case)
    rc = main([command[0], str(spec_file), *command[1:]])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert f"{case.code} at {case.path}" in one_error_line(err)


def test_missing_spec_file(tmp_path, capsys, monkeypatch):
    # relative: messages shorten a long path in the middle, and pytest-xdist's tmp_path is longer
    monkeypatch.chdir(tmp_path)
    missing = Path("no_such_spec.yaml")
    with pytest.raises(SpecError) as excinfo:
        load_spec(missing)
    assert excinfo.value.code == "spec-not-found"
    assert excinfo.value.path == str(missing)
    assert str(missing) in excinfo.value.message
    assert excinfo.value.hint
    rc = main(["check", str(missing)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert f"spec-not-found at {missing}" in one_error_line(err)


def test_missing_spec_file_without_extension(tmp_path, capsys):
    # the CLI argument is always a path, never spec text
    missing = tmp_path / "no_such_spec"
    rc = main(["check", str(missing)])
    _, err = capsys.readouterr()
    assert rc == 2
    assert f"spec-not-found at {missing}" in one_error_line(err)


def test_spec_that_is_a_directory(tmp_path, capsys):
    rc = main(["check", str(tmp_path)])
    _, err = capsys.readouterr()
    assert rc == 2
    assert f"spec-not-found at {tmp_path}" in one_error_line(err)


def test_spec_that_is_not_utf8(tmp_path, capsys):
    spec_file = tmp_path / "binary.yaml"
    spec_file.write_bytes(b"\xff\xfe\x00mesh")
    with pytest.raises(SpecError) as excinfo:
        load_spec(spec_file)
    assert excinfo.value.code == "spec-syntax"
    assert excinfo.value.path == str(spec_file)
    assert "UTF-8" in excinfo.value.message and excinfo.value.hint
    rc = main(["check", str(spec_file)])
    _, err = capsys.readouterr()
    assert rc == 2
    assert "spec-syntax" in one_error_line(err)


def test_long_one_line_json_text_is_not_taken_for_a_path():
    # a one-line JSON spec longer than a file name may be (255 bytes) must still parse as text
    text = json.dumps({"mesh": {"shape": [2]}, "inputs": {"x": {"shape": [4]}}, "nodes": [],
                       "description": "d" * 400})
    assert "\n" not in text and len(text) > 400
    g = load_spec(text)
    assert [n.name for n in g.nodes] == ["x"]
    with pytest.raises(SpecError) as excinfo:
        load_spec(text.replace('"nodes": []', '"nodes": [], "bogus": 1'))
    assert (excinfo.value.code, excinfo.value.path) == ("unknown-key", "bogus")


# --------------------------------------------------------------------------- valid specs: exit 0 and 1
GOOD_RPE = """\
mesh: {shape: [2, 2], names: [dp, sp]}
inputs:
  x:   {shape: [4, 4, 16, 64], placements: ["S(0)", "S(2)"]}
  cos: {shape: [1, 1, 16, 64], placements: [R, "S(2)"], requires_grad: false}
  sin: {shape: [1, 1, 16, 64], tensor_map: [-1, -1, 0, -1], requires_grad: false}
nodes:
  - {name: y, op: rotary_position_embedding, inputs: [x, cos, sin], attrs: {mode: 0}}
outputs: [y]
"""

# x's last dim D (dim 3) is sharded on sp: the layout exists, but RPE rotates within D
RPE_D_SHARDED = """\
mesh: {shape: [2, 2], names: [dp, sp]}
inputs:
  x:   {shape: [4, 4, 16, 64], placements: ["S(0)", "S(-1)"]}
  cos: {shape: [1, 1, 16, 64], requires_grad: false}
  sin: {shape: [1, 1, 16, 64], requires_grad: false}
nodes:
  - {name: y, op: RotaryPositionEmbedding, inputs: [x, cos, sin]}
outputs: [y]
"""


def test_valid_spec_exits_0(tmp_path, capsys):
    spec_file = tmp_path / "good.yaml"
    spec_file.write_text(GOOD_RPE)
    assert main(["check", str(spec_file)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "no violations" in out


def test_rule_violation_exits_1_not_2(tmp_path, capsys):
    spec_file = tmp_path / "d_sharded.yaml"
    spec_file.write_text(RPE_D_SHARDED)
    assert main(["check", str(spec_file)]) == 1
    out, err = capsys.readouterr()
    assert err == ""
    assert "sharded-rotation-dim" in out
    assert main(["check", str(spec_file), "--json"]) == 1
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["ok"] is False
    assert [(v["node"], v["input"], v["operand"], v["code"]) for v in report["violations"]] == [
        ("y", "x", "x", "sharded-rotation-dim")]
    assert report["tensors"]["x"]["tensor_map"] == [1, -1, -1, 0]


def test_version_exits_0(capsys):
    assert main(["--version"]) == 0  # main returns the exit code, also for argparse's own exits
    out, _ = capsys.readouterr()
    assert out.strip() == f"layout-prop {__version__}" == "layout-prop 0.1.0"


def test_check_help_exits_0(capsys):
    assert main(["check", "--help"]) == 0  # main returns the exit code, also for argparse's own exits
    out, _ = capsys.readouterr()
    assert "SPEC" in out and "--reshard" in out and "--json" in out


@pytest.mark.parametrize("argv", [["check", "spec.yaml", "--bogus"], ["frobnicate"], [],
                                  ["check"], ["check", "spec.yaml", "--backend", "tpu"],
                                  ["lower", "spec.yaml", "--rank", "one"]],
                         ids=["unknown-flag", "unknown-command", "no-command", "no-spec", "bad-choice", "bad-int"])
def test_bad_usage_exits_2_with_one_line(argv, capsys):
    assert main(argv) == 2  # main returns the exit code, also for argparse's own exits
    out, err = capsys.readouterr()
    assert out == ""
    assert "bad-usage" in one_error_line(err)


# --------------------------------------------------------------------------- the real console script


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return subprocess.run([*console_command(), *args], capture_output=True, text=True, timeout=120, env=env)


SUBPROCESS_CASES = ["malformed-yaml", "shard-dim-out-of-range", "unknown-op", "cycle-of-two-nodes",
                    "size-1-dim-sharded-by-tensor-map"]


@pytest.mark.parametrize("case", [c for c in CASES if c.id in SUBPROCESS_CASES], ids=lambda c: c.id)
def test_console_script_exits_2_with_one_line(case, tmp_path):
    spec_file = write(tmp_path, case)
    proc = run_cli("check", str(spec_file))
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert f"{case.code} at {expected_path(case, spec_file)}" in one_error_line(proc.stderr)


def test_console_script_missing_file_and_bad_flag(tmp_path):
    proc = run_cli("check", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "spec-not-found" in one_error_line(proc.stderr)
    proc = run_cli("check", str(tmp_path / "nope.yaml"), "--no-such-flag")
    assert proc.returncode == 2 and "bad-usage" in one_error_line(proc.stderr)


def test_console_script_version_and_violation(tmp_path):
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == "layout-prop 0.1.0"
    spec_file = tmp_path / "d_sharded.yaml"
    spec_file.write_text(RPE_D_SHARDED)
    proc = run_cli("check", str(spec_file))
    assert proc.returncode == 1, proc.stderr
    assert "sharded-rotation-dim" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", ["cos@y", "x#0", "grad/x", "cotangent/y"])
def test_names_the_passes_use_are_reserved(name):
    # lowering names local slices value@node and steps value#k; the backward pass uses grad/ and cotangent/
    text = f"mesh: {{shape: [2]}}\ninputs: {{x: {{shape: [4]}}}}\nnodes:\n  - {{name: '{name}', op: neg, inputs: [x]}}\n"
    with pytest.raises(LayoutPropError) as info:
        load_spec(text)
    assert info.value.code == "bad-name" and info.value.path == "nodes[0].name" and name in info.value.message


def test_cli_rejects_bad_numbers_and_ranks_as_unusable_input(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text("mesh: {shape: [2]}\ninputs: {x: {shape: [4], placements: [\"S(0)\"]}}\n"
                    "nodes:\n  - {name: y, op: neg, inputs: [x]}\n")
    for argv in (["run", str(spec), "--seed", "-1"], ["run", str(spec), "--rtol", "-1"],
                 ["run", str(spec), "--rtol", "nan"], ["lower", str(spec), "--rank", "9"],
                 ["gen", "llama", "--heads", "0"], ["gen", "llama", "-o", str(tmp_path / "no" / "x.yaml")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], argv
