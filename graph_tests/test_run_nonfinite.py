"""``run`` says so when it counted NaN or inf as agreement.

:func:`layout_prop.runner.compare` takes a NaN on one device and on the ranks (or the same
infinity) as the same answer; a run whose outputs or gradients hold them still matches one
device (exit 0), but the report names how many elements were compared that way, in the
text (after the result line) and in ``--json`` as counts (strict JSON, no NaN tokens).
"""

from __future__ import annotations

import json
import warnings

import numpy as np

from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.io.loader import load_spec
from layout_prop.runner import random_inputs

#: sqrt of normal draws is NaN where they are negative; x / (x - x) is inf everywhere
SPEC = """\
mesh: {shape: [2], names: [dp]}
inputs:
  x: {shape: [4, 8], placements: ["S(0)"]}
nodes:
  - {name: y, op: sqrt, inputs: [x]}
  - {name: zero, op: sub, inputs: [x, x]}
  - {name: z, op: div, inputs: [x, zero]}
outputs: [y, z]
"""

#: only sqrt, for the backward (its gradient is NaN where its output is)
SQRT = """\
mesh: {shape: [2], names: [dp]}
inputs:
  x: {shape: [4, 8], placements: ["S(0)"]}
nodes:
  - {name: y, op: sqrt, inputs: [x]}
outputs: [y]
"""


def _negatives(text: str) -> int:
    """How many of run's seeded inputs (seed 0) are negative: the NaNs of sqrt."""
    x = random_inputs(analyze(load_spec(text)).graph, 0)["x"]
    return int(np.count_nonzero(x < 0))


def _strict(text: str):
    def refuse(token):
        raise AssertionError(f"not strict JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def _run(argv, capsys):
    """Exit code and stdout; numpy's floating-point warnings ("invalid value encountered in
    sqrt", printed with a line of the kernels) must not reach the user: the report counts them."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        code = main(argv)
    captured = capsys.readouterr()
    assert "Warning" not in captured.err
    return code, captured.out


def test_the_text_report_names_the_nan_and_inf_compared_as_equal(tmp_path, capsys):
    spec = tmp_path / "nan.yaml"
    spec.write_text(SPEC)
    nan = _negatives(SPEC)
    assert 0 < nan < 32
    code, out = _run(["run", str(spec)], capsys)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[-3] == "matches one device, counting NaN and inf as equal where both have them:"
    assert lines[-2] == (f"  output y: {nan} of 32 elements are NaN or inf ({nan} NaN) on one device and alike "
                         "on the ranks, compared as equal")
    assert lines[-1] == ("  output z: 32 of 32 elements are NaN or inf (32 inf) on one device and alike on the "
                         "ranks, compared as equal")


def test_json_carries_the_counts_for_outputs_and_gradients(tmp_path, capsys):
    spec = tmp_path / "nan.yaml"
    spec.write_text(SQRT)
    nan = _negatives(SQRT)
    code, out = _run(["run", str(spec), "--backward", "--json"], capsys)
    assert code == 0, out
    data = _strict(out)
    assert data["ok"] is True
    assert data["nonfinite"] == [
        {"kind": "output", "name": "y", "elements": 32, "nan": nan, "inf": 0, "alike": nan},
        {"kind": "grad", "name": "x", "elements": 32, "nan": nan, "inf": 0, "alike": nan}]
    code, out = _run(["run", str(spec), "--backward"], capsys)
    assert code == 0 and out.splitlines()[-1].startswith(f"  grad x: {nan} of 32 elements are NaN or inf")


def test_a_finite_run_says_nothing_more(tmp_path, capsys):
    spec = tmp_path / "neg.yaml"
    spec.write_text(SQRT.replace("op: sqrt", "op: neg"))
    code, out = _run(["run", str(spec), "--backward"], capsys)
    assert code == 0 and out.splitlines()[-1] == "matches one device"
    code, out = _run(["run", str(spec), "--json"], capsys)
    assert code == 0 and _strict(out)["nonfinite"] == []


def test_counts_where_the_ranks_differ():
    from layout_prop.runner import count_nonfinite, format_nonfinite

    got = np.array([np.nan, 1.0, -np.inf, np.inf, 2.0])
    ref = np.array([np.nan, np.nan, np.inf, np.inf, 2.0])
    counts = count_nonfinite(got, ref)
    assert counts == {"elements": 5, "nan": 2, "inf": 2, "alike": 2}
    assert format_nonfinite({"kind": "grad", "name": "w", **counts}) == (
        "grad w: 4 of 5 elements are NaN or inf (2 NaN, 2 inf) on one device; the ranks have the same at 2 of them")
    assert count_nonfinite(np.ones(3, np.float32), np.ones(3, np.float32)) is None


def test_numpy_runtime_warnings_do_not_reach_stderr(tmp_path, capsys):
    """A 0-size normalised dim makes numpy warn "Mean of empty slice" (a RuntimeWarning, not a
    floating-point error); it was printed with a line of the kernels."""
    spec = tmp_path / "empty.json"
    spec.write_text(json.dumps({"mesh": {"shape": [2], "names": ["tp"]},
                                "inputs": {"x": {"shape": [2, 0], "placements": ["S(0)"]},
                                           "w": {"shape": [0], "placements": ["R"]}},
                                "nodes": [{"name": "y", "op": "rms_norm", "inputs": ["x", "w"]}], "outputs": ["y"]}))
    code, out = _run(["run", str(spec), "--backward"], capsys)
    assert code == 0 and out.endswith("matches one device\n")
