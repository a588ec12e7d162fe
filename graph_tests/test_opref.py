"""The op reference (``layout-prop ops``, ``docs/ops.md``) is read off the registry and cannot drift."""

import json
from pathlib import Path

import pytest

from layout_prop.cli import main
from layout_prop.commands.ops import op_entry, op_reference, render_markdown
from layout_prop.core.registry import get_rule, registered_ops

DOCS = Path(__file__).resolve().parent.parent / "docs" / "ops.md"


def test_docs_ops_md_equals_the_registry():
    assert DOCS.read_text() == render_markdown(), "regenerate with: layout-prop ops --markdown > docs/ops.md"


def test_every_builtin_op_is_in_the_reference_with_its_aliases_and_codes():
    names = [e["name"] for e in op_reference(builtin_only=True)]
    builtin = sorted(n for n, r in registered_ops().items() if type(r).__module__.startswith("layout_prop.ops."))
    assert names == builtin and len(names) > 40
    for name in names:
        entry, rule = op_entry(name), get_rule(name)
        assert entry["aliases"] == list(rule.aliases)
        assert set(entry["violation_codes"]) == set(rule.violation_codes)
        for alias in rule.aliases:  # every alias leads back to the op
            assert op_entry(alias)["name"] == name
        assert f"## {name}\n" in render_markdown()


def test_gradient_and_kernel_columns_follow_the_code():
    from layout_prop.kernels.numpy_backend import KERNELS

    assert op_entry("rope")["gradient"] is True
    assert op_entry("rotary_position_embedding_grad")["gradient"] is False  # grads of grads are not built
    assert op_entry("sum_to")["gradient"] is False
    assert all("numpy" in e["kernels"] for e in op_reference(builtin_only=True) if e["name"] in KERNELS)
    assert "cann" in op_entry("rope")["kernels"]


def test_ops_command_lists_every_op_and_one_op_in_json(capsys):
    assert main(["ops", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {e["name"] for e in listed} == set(registered_ops())
    assert main(["ops", "npu_rotary_mul", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["name"] == "rotary_position_embedding" and one["attrs"] == {"mode": 0, "input_layout": None}
    assert "partial-input" in one["violation_codes"] and one["doc"]


def test_ops_command_text_forms(capsys):
    assert main(["ops"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["op", "operands", "attrs"] and "\nredistribute " in out
    assert main(["ops", "redistribute"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("redistribute(x) -> 1 output") and "required attrs:  placements" in out


@pytest.mark.parametrize("name", ["ropee", "no_such_op"])
def test_ops_command_unknown_op_is_one_line_exit_2(name, capsys):
    assert main(["ops", name]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown-op" in err


@pytest.mark.parametrize("argv", [["ops", "rope", "--markdown"], ["ops", "--json", "--markdown"]],
                         ids=["name", "json"])
def test_markdown_with_a_name_or_json_is_a_usage_error(capsys, argv):
    # found by a new-user audit: NAME or --json was dropped without a word
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "bad-usage" in err and "--markdown" in err
