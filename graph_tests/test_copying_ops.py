"""The copying family beyond the op database: kernels against references built element by element,
the layouts that stay sharded without communication, and unusable input as exit 2 with one line (the command line run in this process)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from layout_prop.cli import main
from layout_prop.io.loader import load_spec
from layout_prop.kernels.copying_numpy import pad, repeat_interleave, repeat_interleave_grad
from layout_prop.runner import run_graph


def test_pad_kernel_places_x_and_the_value():
    x = np.arange(12.0).reshape(3, 4)
    got = pad(x, pad=[2, -1, -1, 1], value=-5.0)  # last dim: 2 before, crop 1 after; dim 0: crop 1, 1 after
    want = np.full((3, 5), -5.0)
    want[0:2, 2:5] = x[1:3, 0:3]
    np.testing.assert_array_equal(got, want)


def test_repeat_interleave_kernels_by_hand():
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    np.testing.assert_array_equal(repeat_interleave(x, [2, 0, 1], dim=1), [[1, 1, 3], [4, 4, 6]])
    np.testing.assert_array_equal(repeat_interleave(x, 2), [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6])
    dy = np.array([[1.0, 10.0, 100.0], [2.0, 20.0, 200.0]])
    np.testing.assert_array_equal(repeat_interleave_grad(dy, [2, 0, 1], dim=1, shape=[2, 3]),
                                  [[11, 0, 100], [22, 0, 200]])


@pytest.mark.parametrize("op, attrs, placements", [
    ("repeat_interleave", {"repeats": 3, "dim": 0}, ["S(0)", "S(0)"]),  # 4 rows on 4 ranks: 1 each -> 3 each
    ("expand", {"shape": [3, 4, 6]}, ["S(0)", "S(1)"]),
    ("pad", {"pad": [1, 1]}, ["S(0)", "P(max)"]),
])
def test_layouts_that_need_no_communication(op, attrs, placements):
    spec = {"mesh": {"shape": [2, 2]}, "inputs": {"x": {"shape": [4, 6], "placements": placements}},
            "nodes": [{"name": "y", "op": op, "inputs": ["x"], "attrs": attrs}]}
    report = run_graph(load_spec(spec), backward=True, seed=0)
    assert report.ok, report.mismatches
    forward = [c for c in report.collectives if not c["node"].startswith("grad/")]
    assert forward == [], forward


@pytest.mark.parametrize("node, code", [
    ({"op": "expand", "attrs": {"shape": [3, 5]}}, "invalid-shape"),  # x is [4, 6]
    ({"op": "pad", "attrs": {"pad": [-4, -3]}}, "invalid-pad"),  # crops 7 of 6
    ({"op": "pad", "attrs": {"pad": [1, 1], "mode": "reflect"}}, "bad-attr"),
    ({"op": "unbind3", "attrs": {"dim": 0}}, "invalid-shape"),  # dim 0 has size 4
])
def test_unusable_copying_input_is_one_line_and_exit_2(node, code, tmp_path, capsys):
    spec = {"mesh": {"shape": [2]}, "inputs": {"x": {"shape": [4, 6]}},
            "nodes": [{"name": "y", "inputs": ["x"], **node}]}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    assert main(["check", str(path)]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and code in lines[0] and "Traceback" not in err, out + err
