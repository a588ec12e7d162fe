"""``run --inputs FILE.npz``: some or all graph inputs given by name, the rest drawn; a model's own weights.

The values given must reach both the ranks and the one-device reference (a NaN given is
counted on both sides); a name that is no input, a wrong shape or dtype, a pickle, a single
``.npy`` array or a missing file is one line on stderr and exit 2.  With ``MODEL --plan
PLAN`` the model's initialisers are the default weights: fed its own token ids, the
imported Llama fixture computes the logits torch computed (``examples/models/llama.npz``).
"""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.io.loader import load_spec
from layout_prop.runner import check_given_inputs, execute_global, run_graph

MODELS = Path(__file__).resolve().parent.parent / "examples" / "models"

SPEC = """\
mesh: {shape: [2, 2], names: [dp, tp]}
inputs:
  x: {shape: [4, 8], placements: ["S(0)", R]}
  ids: {shape: [4], dtype: int64, placements: ["S(0)", R]}
  w: {shape: [8, 6], placements: [R, "S(1)"]}
nodes:
  - {name: h, op: matmul, inputs: [x, w]}
  - {name: y, op: relu, inputs: [h]}
outputs: [y]
"""


@pytest.fixture
def spec_path(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    return path


def one_line_error(capsys, argv, code):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and code in err, err
    return err


def test_given_values_reach_the_ranks_and_the_reference(tmp_path, spec_path, capsys):
    """x with 3 NaN rows' worth of NaN: relu(x @ w) is NaN in exactly those rows, on both sides."""
    x = np.ones((4, 8), np.float32)
    x[1, 2] = np.nan  # row 1 of h, and of y, is NaN in all 6 columns
    path = tmp_path / "in.npz"
    np.savez(path, x=x)
    assert main(["run", str(spec_path), "--inputs", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"]
    assert report["nonfinite"] == [{"kind": "output", "name": "y", "elements": 24, "nan": 6, "inf": 0, "alike": 6}]
    assert report["inputs"] == {"file": ["x"], "model": [], "random": ["ids", "w"], "unread": []}


def test_all_inputs_given_run_on_exactly_those_values(spec_path):
    """Every input given: run_graph's one-device result is the numpy product of the given arrays."""
    rng = np.random.default_rng(3)
    given = {"x": rng.standard_normal((4, 8)).astype(np.float32), "ids": np.arange(4),
             "w": rng.standard_normal((8, 6)).astype(np.float32)}
    graph = load_spec(SPEC)
    report = run_graph(graph, backward=True, inputs=given)
    assert report.ok and sorted(report.grads) == ["w", "x"]
    a = analyze(load_spec(SPEC))
    checked = check_given_inputs(a.graph, given)
    got = execute_global(a.graph, checked, wanted=["y"])["y"]
    np.testing.assert_allclose(got, np.maximum(given["x"] @ given["w"], 0), rtol=1e-6)


def test_the_text_report_says_where_inputs_came_from(tmp_path, spec_path, capsys, monkeypatch):
    # a path relative to the working folder: messages shorten a long path in the middle, and pytest-xdist's
    # workers give tmp_path a longer name (popen-gw0/...)
    monkeypatch.chdir(tmp_path)
    path = Path("in.npz")
    np.savez(path, ids=np.array([3, 1, 4, 1]))
    assert main(["run", str(spec_path), "--inputs", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"  inputs: 1 from '{path}', 2 drawn at random ('x, w')" in out.splitlines()


@pytest.mark.parametrize("arrays, code, words", [
    ({"z": np.zeros(3)}, "unknown-input", ["holds 'z', which is not an input", "['x', 'ids', 'w']"]),
    ({"x": np.zeros((8, 4), np.float32)}, "shape-mismatch", ["gives x shape [8, 4]", "shape [4, 8]"]),
    ({"x": np.zeros((4, 8), np.float64)}, "bad-dtype", ["gives x dtype float64", "input is float32"]),
    ({"ids": np.zeros(4, np.int32)}, "bad-dtype", ["gives ids dtype int32", "input is int64"]),
    ({"x": np.array([{"a": 1}] * 32, dtype=object).reshape(4, 8)}, "bad-inputs", ["stored as a pickle"]),
])
def test_bad_arrays_are_one_line_exit_2(tmp_path, spec_path, capsys, arrays, code, words):
    path = tmp_path / "in.npz"
    np.savez(path, **arrays)
    err = one_line_error(capsys, ["run", str(spec_path), "--inputs", str(path)], code)
    assert f"{code} at {path}" in err
    for word in words:
        assert word in err


def test_files_that_are_no_npz_archive_are_one_line_exit_2(tmp_path, spec_path, capsys):
    npy = tmp_path / "x.npy"
    np.save(npy, np.zeros((4, 8), np.float32))
    assert "is a single .npy array" in one_line_error(capsys, ["run", str(spec_path), "--inputs", str(npy)],
                                                      "bad-inputs")
    text = tmp_path / "x.npz"
    text.write_text("x = 1\n")
    assert "not an .npz archive" in one_line_error(capsys, ["run", str(spec_path), "--inputs", str(text)],
                                                   "bad-inputs")
    broken = tmp_path / "broken.npz"
    np.savez(broken, x=np.zeros((4, 8), np.float32))
    broken.write_bytes(broken.read_bytes()[:60])  # a zip cut short
    one_line_error(capsys, ["run", str(spec_path), "--inputs", str(broken)], "bad-inputs")
    one_line_error(capsys, ["run", str(spec_path), "--inputs", str(tmp_path / "missing.npz")], "inputs-not-found")


def test_a_model_runs_on_its_own_weights_and_the_token_ids_given(tmp_path, capsys):
    """The Llama fixture: token ids from an npz, every weight the model's own (none drawn), and
    those weights and ids on one device give torch's logits."""
    pytest.importorskip("onnx")
    from layout_prop.commands.run import load_with_weights

    reference = np.load(MODELS / "llama.npz")
    ids = tmp_path / "ids.npz"
    np.savez(ids, input_ids=reference["input_ids"])
    plan = tmp_path / "plan.yaml"
    plan.write_text("mesh: {shape: [2], names: [tp]}\nparameters:\n  '*.q_proj.weight': colwise\n"
                    "  '*.o_proj.weight': rowwise\n")
    model = str(MODELS / "llama.onnx")
    assert main(["run", model, "--plan", str(plan), "--inputs", str(ids), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["inputs"]["file"] == ["input_ids"] and report["inputs"]["random"] == []
    assert len(report["inputs"]["model"]) > 10

    graph, weights, unread = load_with_weights(Namespace(spec=model, plan=str(plan), opaque=False))
    assert unread == [] and "model.layers.0.self_attn.q_proj.weight" in weights
    a = analyze(graph)
    inputs = check_given_inputs(a.graph, {**weights, "input_ids": reference["input_ids"]})
    (logits,) = execute_global(a.graph, inputs, wanted=a.graph.outputs).values()
    np.testing.assert_allclose(logits, reference["logits"], rtol=1e-4, atol=1e-5)


def test_weights_left_in_external_data_are_drawn_and_said_so(tmp_path, capsys):
    """A weight over 1 KiB in an external data file is not read by the importer: run draws it at
    random and says so, unless the npz gives it; a small one (the bias, read) is the model's."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32)  # 4 KiB
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
             helper.make_node("Add", ["h", "b"], ["y"], name="bias")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 32])],
                              initializer=[numpy_helper.from_array(w, "w"),
                                           numpy_helper.from_array(np.ones(32, np.float32), "b")])
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(model),
              save_as_external_data=True, all_tensors_to_one_file=True, location="m.data", size_threshold=0)
    plan = tmp_path / "plan.yaml"
    plan.write_text("mesh: {shape: [2], names: [tp]}\nparameters: {w: colwise}\n")
    assert main(["run", str(model), "--plan", str(plan)]) == 0
    assert ("  inputs: 1 the model's own, 2 drawn at random ('x, w'); 1 weights in external data files are not "
            "read (drawn at random)") in capsys.readouterr().out.splitlines()
    given = tmp_path / "w.npz"
    np.savez(given, w=w)
    assert main(["run", str(model), "--plan", str(plan), "--inputs", str(given), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["inputs"] == {"file": ["w"], "model": ["b"], "random": ["x"], "unread": []}
