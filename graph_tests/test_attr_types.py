"""Attr values of the wrong type are the spec's mistake, said before any rule runs.

``mode: [1, 1]`` on rotary_position_embedding reached the rule, which raised, and ``check``
said ``rule-failed ... (hint: fix the rule)``.  :meth:`OpRule.normalize_attrs` now checks each
attr against its type (declared in ``attr_types``, else its default's) and ``check`` says
``bad-value at nodes[I].attrs.NAME`` on one line and exits 2.  The forms that worked before
(an int for a float, 0 and 1 for a flag, an int or a list where the default is None) still do,
and a rule that declares no types still judges the single values it knows (``axis: 1.5``,
``factor: two``, ``mode: true`` are its own violations, as its tests say): only a list or a
mapping where one value belongs is refused for it.  A rule that declares ``attr_types`` gets
them checked exactly.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from layout_prop.core.errors import OpError
from layout_prop.core.registry import OpRule, RuleResult, attr_type, check_attr_type, get_rule, register_op
from layout_prop.io.loader import load_spec, parse_spec

from .cli_support import cli_env, console_command

MESH = "mesh: {shape: [2], names: [dp]}\n"
RPE_INPUTS = ("inputs:\n  x: {shape: [2, 4, 2, 8], placements: [\"S(0)\"]}\n"
              "  cos: {shape: [1, 4, 1, 8], placements: [R]}\n  sin: {shape: [1, 4, 1, 8], placements: [R]}\n")
X_W = "inputs:\n  x: {shape: [4, 8], placements: [\"S(0)\"]}\n  w: {shape: [8], placements: [R]}\n"
X_M = "inputs:\n  x: {shape: [4, 8], placements: [\"S(0)\"]}\n  m: {shape: [8, 4], placements: [R]}\n"
QKV = ("inputs:\n  q: {shape: [2, 2, 4, 8], placements: [\"S(0)\"]}\n  k: {shape: [2, 2, 4, 8], placements: [\"S(0)\"]}\n"
       "  v: {shape: [2, 2, 4, 8], placements: [\"S(0)\"]}\n")


def spec(inputs: str, op: str, operands: str, attrs: str) -> str:
    return (MESH + inputs + f"nodes:\n  - {{name: r, op: relu, inputs: [{operands.split(',')[0]}]}}\n"
            f"  - {{name: y, op: {op}, inputs: [{operands}], attrs: {attrs}}}\noutputs: [y]\n")


# (id, spec, the attr's path, a fragment of the message): a list or a mapping where one value belongs
SCALAR = "must be one value (a number, a bool, a string or null), got "
WRONG = [
    ("rope-mode-list", spec(RPE_INPUTS, "rotary_position_embedding", "x, cos, sin", "{mode: [1, 1]}"),
     "nodes[1].attrs.mode", SCALAR + "[1, 1] (a list)"),
    ("rms-eps-list", spec(X_W, "rms_norm", "x, w", "{eps: [1.0e-6]}"), "nodes[1].attrs.eps", SCALAR + "[1e-06]"),
    ("softmax-axis-mapping", spec(X_W, "softmax", "x", "{axis: {dim: 1}}"), "nodes[1].attrs.axis",
     SCALAR + "{'dim': 1} (a dict)"),
    ("matmul-flag-list", spec(X_M, "matmul", "x, m", "{transpose_b: [true]}"), "nodes[1].attrs.transpose_b",
     SCALAR + "[True]"),
    ("attention-layout-list", spec(QKV, "scaled_dot_product_attention", "q, k, v", "{layout: [B, N, S, D]}"),
     "nodes[1].attrs.layout", SCALAR + "['B', 'N', 'S', 'D']"),
    ("attention-offset-list", spec(QKV, "scaled_dot_product_attention", "q, k, v", "{q_offset: [0]}"),
     "nodes[1].attrs.q_offset", SCALAR + "[0]"),
]


@pytest.mark.parametrize("case", WRONG, ids=[c[0] for c in WRONG])
def test_check_says_bad_value_at_the_attr_on_one_line(case, tmp_path):
    _, text, path, fragment = case
    file = tmp_path / "spec.yaml"
    file.write_text(text)
    proc = subprocess.run([*console_command(), "check", str(file)], capture_output=True, text=True, env=cli_env(),
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"bad-value at {path}, node 'y':" in lines[0]
    assert fragment in lines[0]
    assert "(hint: write " in lines[0] and "like its default" in lines[0]
    assert "Traceback" not in proc.stderr and "rule-failed" not in proc.stderr


# forms that worked before the check and must still load: (id, spec); the rule judges the value
ACCEPTED = [
    ("eps-int", spec(X_W, "rms_norm", "x, w", "{eps: 1}")),
    ("mode-float", spec(RPE_INPUTS, "rotary_position_embedding", "x, cos, sin", "{mode: 1.0}")),
    ("mode-bool", spec(RPE_INPUTS, "rotary_position_embedding", "x, cos, sin", "{mode: true}")),  # invalid-mode
    ("axis-fraction", spec(X_W, "softmax", "x", "{axis: 1.5}")),  # invalid-attr, a violation of the rule
    ("scale-string", spec(X_W, "scale", "x", "{factor: two}")),  # invalid-attr, a violation of the rule
    ("flag-zero-one", spec(X_M, "matmul", "x, m", "{transpose_a: 0, transpose_b: 0}")),
    ("rope-layout-null", spec(RPE_INPUTS, "rotary_position_embedding", "x, cos, sin", "{mode: 0, input_layout: null}")),
    ("sum-dims-int", spec(X_W, "sum", "x", "{dims: 1}")),
    ("sum-dims-list", spec(X_W, "sum", "x", "{dims: [0, 1], keepdim: true}")),
    ("attention-scale-float", spec(QKV, "scaled_dot_product_attention", "q, k, v", "{scale: 0.5, causal: true}")),
]


@pytest.mark.parametrize("case", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_forms_that_worked_still_load(case):
    graph = load_spec(parse_spec(case[1]))
    assert graph.node("y").attrs == parse_spec(case[1])["nodes"][1]["attrs"]  # loaded with its attrs as written


def test_python_values_are_accepted_as_their_kind():
    rule = get_rule("rotary_position_embedding")
    assert rule.normalize_attrs({"mode": np.int64(2)})["mode"] == 2  # a numpy int is an int
    assert get_rule("rms_norm").normalize_attrs({"eps": np.float32(1e-5)})["eps"] == np.float32(1e-5)
    assert get_rule("matmul").normalize_attrs({"transpose_a": np.bool_(True)})["transpose_a"] is not None


def test_the_python_api_gets_the_attr_path():
    with pytest.raises(OpError) as info:
        get_rule("rotary_position_embedding").normalize_attrs({"mode": (0, 1)}, "rope1")
    err = info.value
    assert (err.code, err.path, err.node) == ("bad-value", "attrs.mode", "rope1")
    assert "(0, 1)" in err.message and "a tuple" in err.message


class _Declared(OpRule):
    """A rule (never registered) that declares the types of attrs whose default is None."""

    name = "declared_attr_types_probe"
    operands = ("x",)
    attr_defaults = {"dims": None, "scale": None, "name": "a", "label": "a", "anything": None}
    attr_types = {"dims": "int | list[int] | None", "scale": "float | None", "name": "str"}

    def infer_layout(self, inputs, attrs):
        return RuleResult(tuple(inputs))


@pytest.mark.parametrize("name, value", [("dims", 1), ("dims", [0, 2]), ("dims", (0,)), ("dims", None),
                                         ("scale", 2), ("scale", 0.5), ("name", "b"), ("label", 3), ("label", None),
                                         ("anything", {"k": [1]})])
def test_declared_types_accept(name, value):
    check_attr_type(_Declared(), name, value)


@pytest.mark.parametrize("name, value", [("dims", "0"), ("dims", [0, "1"]), ("dims", 1.0), ("dims", True),
                                         ("scale", "big"), ("scale", [1.0]), ("name", None), ("name", 3),
                                         ("label", ["a"]), ("label", {"a": 1})])
def test_declared_types_refuse(name, value):
    with pytest.raises(OpError) as info:
        check_attr_type(_Declared(), name, value, node="n")
    assert (info.value.code, info.value.path) == ("bad-value", f"attrs.{name}")


def test_types_read_off_the_defaults():
    rule = _Declared()
    assert [attr_type(rule, name) for name in ("dims", "scale", "name", "label", "anything")] == [
        "int | list[int] | None", "float | None", "str", "scalar", "any"]
    assert attr_type(get_rule("softmax"), "axis") == "scalar"  # from its default -1
    assert attr_type(get_rule("sum"), "dims") == "any"  # default None: an int or a list, the rule checks


def test_an_unknown_declared_type_is_refused_at_registration():
    class Misdeclared(_Declared):
        name = "misdeclared_attr_types_probe"
        attr_types = {"dims": "integer"}

    with pytest.raises(OpError) as info:
        register_op(Misdeclared)
    assert info.value.code == "bad-rule" and "integer" in info.value.message
