"""The command line's use of Python's cyclic garbage collector, restored after every command."""

import gc

import pytest

from layout_prop import cli

SPEC = "mesh: {shape: [2]}\ninputs: {x: {shape: [4]}}\nnodes: [{name: y, op: relu, inputs: [x]}]\n"


@pytest.mark.parametrize("command,flags,collects", [("check", [], False), ("lower", ["--rank", "0"], False),
                                                    ("run", [], True)])
def test_single_graph_commands_run_without_the_collector_and_restore_it(tmp_path, monkeypatch, capsys, command,
                                                                         flags, collects):
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    seen = {}

    def record(args):
        seen["enabled"], seen["threshold"] = gc.isenabled(), gc.get_threshold()
        return 0

    monkeypatch.setattr(f"layout_prop.commands.{cli.COMMANDS[command]}.run", record)
    before = gc.get_threshold()
    assert gc.isenabled()
    assert cli.main([command, str(spec), *flags]) == 0
    assert seen["enabled"] is collects
    assert seen["threshold"] == cli.GC_THRESHOLD
    assert gc.isenabled() and gc.get_threshold() == before


def test_the_collector_is_restored_after_a_failed_command(tmp_path, capsys):
    assert cli.main(["check", str(tmp_path / "missing.yaml")]) == 2
    assert gc.isenabled()
