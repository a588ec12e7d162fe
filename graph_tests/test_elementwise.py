"""Elementwise rules: dtypes, sum_to's Partial handling, required attrs, kernels that fail on one device."""

from __future__ import annotations

import json

import pytest

from layout_prop import OpRule, RuleResult, register_kernel, register_op
from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.core.errors import ExecutionError, LayoutPropError
from layout_prop.io.loader import load_spec
from layout_prop.runner import run_graph


def _spec(inputs: dict, nodes: list, mesh=(2,)) -> dict:
    return {"mesh": {"shape": list(mesh), "names": ["tp", "dp"][:len(mesh)]}, "inputs": inputs, "nodes": nodes}


@pytest.mark.parametrize("op,args", [("sub", ["x", "y"]), ("neg", ["x"])])
def test_sub_and_neg_reject_bool_values(op, args, tmp_path, capsys):
    data = _spec({"x": {"shape": [4], "dtype": "bool"}, "y": {"shape": [4], "dtype": "bool"}},
                 [{"name": "z", "op": op, "inputs": args}])
    a = analyze(load_spec(data))
    assert [(v.code, v.input) for v in a.check.violations] == [("invalid-dtype", "x")]
    assert "bool" in a.check.violations[0].message and "cast" in a.check.violations[0].hint
    path = tmp_path / "b.json"
    path.write_text(json.dumps(data))
    assert main(["run", str(path)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "invalid-dtype" in captured.out


def test_add_of_bools_is_still_fine():
    data = _spec({"x": {"shape": [4], "dtype": "bool"}, "y": {"shape": [4], "dtype": "bool"}},
                 [{"name": "z", "op": "add", "inputs": ["x", "y"]}])
    assert run_graph(load_spec(data)).ok


def test_sum_to_passes_a_partial_average_and_reduces_a_partial_max_first():
    avg = _spec({"x": {"shape": [4, 3], "placements": ["P(avg)"]}},
                [{"name": "s", "op": "sum_to", "inputs": ["x"], "attrs": {"shape": [3]}}])
    a = analyze(load_spec(avg))
    assert a.ok and a.report()["tensors"]["s"]["placements"] == ["P(avg)"]
    assert run_graph(load_spec(avg)).ok
    mx = _spec({"x": {"shape": [4, 3], "placements": ["P(max)"]}},
               [{"name": "s", "op": "sum_to", "inputs": ["x"], "attrs": {"shape": [3]}}])
    a = analyze(load_spec(mx))
    assert [(v.code, v.fixable) for v in a.check.violations] == [("partial-input", True)]
    assert "'tp'" in a.check.violations[0].message and "all-reduce" in a.check.violations[0].hint
    rep = run_graph(load_spec(mx))  # --reshard reduces the max first
    assert rep.ok and [c["kind"] for c in rep.collectives] == ["all-reduce"]


@pytest.mark.parametrize("op,attr", [("sum_to", "shape"), ("redistribute", "placements"), ("sum_grad", "shape")])
def test_a_missing_required_attr_is_unusable_input(op, attr, tmp_path, capsys):
    data = _spec({"x": {"shape": [4, 3]}}, [{"name": "y", "op": op, "inputs": ["x"]}])
    with pytest.raises(LayoutPropError) as info:
        load_spec(data)
    assert info.value.code == "bad-attr" and attr in info.value.message and info.value.path == "nodes[0].attrs"
    path = tmp_path / "a.json"
    path.write_text(json.dumps(data))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad-attr" in err[0]


@register_op
class _AcceptsAnything(OpRule):
    """A too-permissive rule whose kernel cannot run what it accepts."""

    name = "test_accepts_anything"
    operands = ("x",)

    def infer_layout(self, inputs, attrs):
        return RuleResult((inputs[0],))


def _failing_kernel(x):
    raise TypeError("this kernel takes no arrays of this kind")


register_kernel("test_accepts_anything", _failing_kernel)


def test_a_kernel_failing_on_one_device_is_a_typed_error(tmp_path, capsys):
    data = _spec({"x": {"shape": [4]}}, [{"name": "y", "op": "test_accepts_anything", "inputs": ["x"]}])
    with pytest.raises(ExecutionError) as info:
        run_graph(load_spec(data))
    assert info.value.code == "kernel-failed" and info.value.node == "y" and "TypeError" in info.value.message
    path = tmp_path / "k.json"
    path.write_text(json.dumps(data))
    assert main(["run", str(path)]) == 2
    assert "Traceback" not in capsys.readouterr().err
