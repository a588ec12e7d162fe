"""Pinned activations (issue 29): a ``constraints:`` section in specs and sharding plans.

The pinned value gets a redistribution with ``--reshard`` and runs forward and backward
matching one device; without it the move is ``constraint-unmet`` (exit 1); malformed,
unmatched and conflicting constraints are exit 2 with one line naming the pattern; and
``plan`` chooses the ``auto`` layouts around a pin.
"""

from __future__ import annotations

import copy
import json
import time

import pytest
import yaml

from graph_tests.cli_support import run_in_process
from layout_prop.api import analyze
from layout_prop.core.errors import SpecError
from layout_prop.io.loader import load_spec
from layout_prop.io.plan_file import load_plan
from layout_prop.planner.solver import solve
from layout_prop.runner import run_graph

# A Megatron MLP on tp: column- then row-parallel, so y is Partial; pinning it S(0) is sequence parallelism
MLP = {
    "mesh": {"shape": [2, 2], "names": ["dp", "tp"]},
    "inputs": {
        "x": {"shape": [4, 6, 8], "placements": ["S(0)", "R"]},
        "w1": {"shape": [8, 16], "placements": ["R", "S(1)"]},
        "w2": {"shape": [16, 8], "placements": ["R", "S(0)"]},
    },
    "nodes": [
        {"name": "h", "op": "matmul", "inputs": ["x", "w1"]},
        {"name": "a", "op": "gelu", "inputs": ["h"]},
        {"name": "y", "op": "matmul", "inputs": ["a", "w2"]},
        {"name": "z", "op": "add", "inputs": ["x", "y"]},
        {"name": "out", "op": "relu", "inputs": ["z"]},
    ],
    "outputs": ["out"],
}


def _spec(constraints, base=MLP) -> dict:
    spec = copy.deepcopy(base)
    spec["constraints"] = constraints
    return spec


def _cli(*args, spec=None, tmp_path=None):
    argv = list(args)
    if spec is not None:
        path = tmp_path / "spec.yaml"
        path.write_text(yaml.safe_dump(spec))
        argv.insert(1, str(path))
    return run_in_process(argv)


def test_a_pin_is_a_node_every_consumer_reads():
    g = load_spec(_spec({"y": ["S(0)", "S(1)"]}))
    pinned = g.node("y/pinned")
    assert pinned.op == "sharding_constraint" and pinned.inputs == ("y",)
    assert g.node("z").inputs == ("x", "y/pinned")
    tensors = analyze(g).tensors()
    assert tensors["y"]["placements"] == ["S(0)", "P(sum)"]  # what the producer computes
    assert tensors["y/pinned"]["placements"] == ["S(0)", "S(1)"]  # what every consumer reads
    assert tensors["z"]["placements"] == ["S(0)", "S(1)"]


def test_a_pinned_output_is_the_graphs_output():
    g = load_spec(_spec({"out": ["S(0)", "S(2)"]}))
    assert g.outputs == ["out/pinned"]


def test_reshard_inserts_the_redistribution_and_runs_forward_and_backward(tmp_path):
    spec = _spec({"y": ["S(0)", "S(1)"]})
    analysis = analyze(load_spec(spec), reshard=True, backward=True)
    assert analysis.ok
    # y reaches its pin through a redistribution (which one is the reshard optimiser's choice: on weights this
    # small it gathers w1 and w2 rather than reduce-scatter y, and the pin is then a local slice)
    assert [r["input"] for r in analysis.report()["redistributions"] if r["node"] == "y/pinned"] == ["y"]
    assert analysis.tensors()["y/pinned"]["placements"] == ["S(0)", "S(1)"]
    report = run_graph(load_spec(spec), backward=True)
    assert report.ok, report.mismatches
    assert set(report.grads) == {"x", "w1", "w2"}
    run = _cli("run", "--backward", "--json", spec=spec, tmp_path=tmp_path)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["ok"] and set(result["grads"]) == {"x", "w1", "w2"}


def test_without_reshard_the_unmet_pin_is_a_violation(tmp_path):
    spec = _spec({"y": ["S(0)", "S(1)"]})
    check = _cli("check", "--json", spec=spec, tmp_path=tmp_path)
    assert check.returncode == 1
    violations = json.loads(check.stdout)["violations"]
    assert [(v["code"], v["node"], v["input"]) for v in violations] == [("constraint-unmet", "y/pinned", "y")]
    assert "reduce-scatter" in violations[0]["message"] and "'y'" in violations[0]["message"]
    run = _cli("run", "--no-reshard", spec=spec, tmp_path=tmp_path)
    assert run.returncode == 1 and "constraint-unmet" in run.stdout + run.stderr


def test_a_pin_already_met_or_free_changes_nothing():
    met = analyze(load_spec(_spec({"h": ["S(0)", "S(2)"]})))  # h is (S(0), S(2)) already
    assert "constraint-unmet" not in {v.code for v in met.check.violations}
    assert [r for r in met.report()["redistributions"] if r["node"] == "h/pinned"] == []
    with_relu = {**MLP, "nodes": MLP["nodes"] + [{"name": "xr", "op": "relu", "inputs": ["x"]}],
                 "outputs": ["out", "xr"]}
    free = analyze(load_spec(_spec({"xr": ["S(0)", "S(1)"]}, base=with_relu)))
    assert "constraint-unmet" not in {v.code for v in free.check.violations}  # R -> S(1) on tp: a local slice
    moves = [r for r in free.report()["redistributions"] if r["node"] == "xr/pinned"]
    assert [s["kind"] for r in moves for s in r["steps"]] == ["local-slice"]
    assert run_graph(load_spec(_spec({"xr": ["S(0)", "S(1)"]}, base=with_relu)), backward=True).ok


def test_a_glob_pins_every_value_it_matches():
    g = load_spec(_spec({"[hy]": ["S(0)", "R"]}))
    assert {n.name for n in g.nodes if n.op == "sharding_constraint"} == {"h/pinned", "y/pinned"}
    assert run_graph(g, backward=True).ok


def test_a_pin_no_redistribution_reaches_stays_a_violation():
    # y is P(sum) on tp: terms of a sum are not terms of a max, so no move reaches P(max) there
    analysis = analyze(load_spec(_spec({"y": ["S(0)", "P(max)"]})), reshard=True)
    unmet = [v for v in analysis.check.violations if v.code == "constraint-unmet"]
    assert [(v.node, v.fixable) for v in unmet] == [("y/pinned", False)]
    assert "no redistribution exists" in unmet[0].message


# ------------------------------------------------------------------------------ exit 2: the constraint itself
@pytest.mark.parametrize("constraints, code, words", [
    ({"y": ["S(0)", "S(1)"], "[xy]": ["R", "R"]}, "conflicting-constraints",
     "'y' is pinned to ['S(0)', 'S(1)'] by 'y'"),
    ({"q*": ["R", "R"]}, "unmatched-constraint", "'q*' matches no value"),
    ({"w1": ["R", "R"]}, "unmatched-constraint", "'w1' matches no value"),
    ({"y": ["S(0)"]}, "invalid-layout", "1 placements"),
    ({"y": ["S(0)", "Q"]}, "bad-placement", "'Q'"),
    ({"y": "S(0)"}, "bad-type", "takes placements"),
    (["y"], "bad-type", "must be a mapping"),
    ({"y" * 2000: ["R", "R"]}, "bad-value", "over the limit 1024"),
    ({"y\x00": ["R", "R"]}, "bad-value", "not printable"),
])
def test_unusable_constraints_name_the_pattern(constraints, code, words):
    with pytest.raises(SpecError) as info:
        load_spec(_spec(constraints))
    assert info.value.code == code and words in info.value.message
    assert info.value.path.startswith("constraints")


def test_unusable_constraints_on_the_command_line(tmp_path):
    for constraints, code in (({"y": ["R", "R"], "?": ["S(0)", "R"]}, "conflicting-constraints"),
                              ({"nothing": ["R", "R"]}, "unmatched-constraint"),
                              ({"y": ["S(0)", "S(5)"]}, "invalid-layout")):  # out of range for y's rank: at propagation
        out = _cli("check", spec=_spec(constraints), tmp_path=tmp_path)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and code in lines[0], out.stderr
        assert "constraints[" in lines[0] and "Traceback" not in out.stderr


def test_many_pins_on_a_long_chain_load_fast():
    n = 20000
    nodes = [{"name": f"v{i}", "op": "relu", "inputs": [f"v{i - 1}" if i else "x"]} for i in range(n)]
    constraints = {**{f"v{i}": ["R"] for i in range(0, n, 10)}, "v1*5": ["S(0)"]}
    start = time.perf_counter()
    g = load_spec({"mesh": {"shape": [2]}, "inputs": {"x": {"shape": [4, 4]}}, "nodes": nodes,
                   "constraints": constraints})
    ending_in_5 = sum(1 for i in range(n) if str(i).startswith("1") and str(i).endswith("5"))  # v15, v105...
    assert sum(node.op == "sharding_constraint" for node in g.nodes) == n // 10 + ending_in_5
    assert time.perf_counter() - start < 5  # 0.2 s measured: exact names are looked up, each glob compiled once


def test_equal_pins_from_two_patterns_agree():
    g = load_spec(_spec({"y": ["S(0)", "R"], "?": ["S(0)", "R"]}))  # "?" matches h, a, y and z
    assert {n.name for n in g.nodes if n.op == "sharding_constraint"} == {"h/pinned", "a/pinned", "y/pinned",
                                                                         "z/pinned"}


# ------------------------------------------------------------------------------ plan
PLAN_SPEC = {
    "mesh": {"shape": [2], "names": ["tp"]},
    "inputs": {
        "x": {"shape": [8, 8], "requires_grad": False},
        "w1": {"shape": [8, 16], "placements": "auto"},
        "w2": {"shape": [16, 8], "placements": "auto"},
    },
    "nodes": [
        {"name": "h", "op": "matmul", "inputs": ["x", "w1"]},
        {"name": "a", "op": "gelu", "inputs": ["h"]},
        {"name": "y", "op": "matmul", "inputs": ["a", "w2"]},
    ],
    "outputs": ["y"],
}


def test_plan_respects_a_pin():
    free = solve(load_spec(PLAN_SPEC), backward=True)
    assert free.layouts["w1"] == ("S(1)",) and free.cost == 0  # Megatron: column then row parallel
    pinned = solve(load_spec(_spec({"a": ["R"]}, base=PLAN_SPEC)), backward=True)
    assert pinned.layouts["w1"] == ("R",) and pinned.cost == 0  # a replicated a: w1 must not be column-cut
    rows = solve(load_spec(_spec({"a": ["S(0)"]}, base=PLAN_SPEC)), backward=True)
    assert rows.layouts["w1"] == ("R",)  # x is replicated: rows of a are a local slice of h
    assert rows.layouts["w2"] == ("R",)


def test_plan_command_keeps_the_pin(tmp_path):
    out = tmp_path / "planned.yaml"
    plan = _cli("plan", "-o", str(out), spec=_spec({"a": ["R"]}, base=PLAN_SPEC), tmp_path=tmp_path)
    assert plan.returncode == 0, plan.stderr
    planned = yaml.safe_load(out.read_text())
    assert planned["inputs"]["w1"]["placements"] == ["R"]
    pins = [n for n in planned["nodes"] if n["op"] == "sharding_constraint"]
    assert [(n["name"], n["attrs"]["placements"]) for n in pins] == [("a/pinned", ["R"])]
    check = _cli("check", "--backward", "--json", spec=planned, tmp_path=tmp_path)
    assert check.returncode == 0 and json.loads(check.stdout)["redistributions"] == []


# ------------------------------------------------------------------------------ sharding plans of imported models
def test_plan_file_constraints_reach_the_imported_model(tmp_path):
    pytest.importorskip("onnx")
    plan = yaml.safe_load((__import__("pathlib").Path(__file__).parent.parent / "examples" / "llama_plan.yaml")
                          .read_text())
    plan["constraints"] = {"layers.*/attention/wo/MatMul": ["S(0)", "S(1)", "R"]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    assert load_plan(str(path)).constraints_entry() == plan["constraints"]
    model = str(__import__("pathlib").Path(__file__).parent.parent / "examples" / "llama_block.onnx")
    check = run_in_process(["check", model, "--plan", str(path), "--json"])
    assert check.returncode == 1, check.stderr
    report = json.loads(check.stdout)
    assert report["tensors"]["layers.0/attention/wo/MatMul/pinned"]["placements"] == ["S(0)", "S(1)", "R"]
    unmet = [v for v in report["violations"] if v["code"] == "constraint-unmet"]
    assert [v["input"] for v in unmet] == ["layers.0/attention/wo/MatMul"]
    run = run_in_process(["run", model, "--plan", str(path), "--backward"])
    assert run.returncode == 0 and "matches one device" in run.stdout, run.stderr + run.stdout


def test_plan_file_constraint_errors():
    with pytest.raises(SpecError) as info:
        load_plan({"mesh": {"shape": [2], "names": ["tp"]}, "constraints": {"y": ["R", "R"]}})
    assert info.value.code == "invalid-layout" and info.value.path == "constraints['y']"


def test_a_plans_resolved_pin_keeps_the_pattern_it_came_from():
    """A pin an importer resolved (value ``h`` from a module path) goes through the plan's
    ``constraints_entry`` into the spec with its pattern: before, the pattern was dropped and
    messages named ``h`` instead of the module path the user wrote."""
    from layout_prop.io.plan_file import load_plan

    mesh = {"shape": [2], "names": ["dp"]}
    pins = {"h": {"placements": ["S(0)"], "pattern": "model.layers.0.mlp"}, "g": ["R"]}
    plan = load_plan({"mesh": mesh, "parameters": {}, "constraints": pins})
    assert plan.constraints_entry() == pins
    again = load_plan({"mesh": mesh, "parameters": {}, "constraints": plan.constraints_entry()})
    assert [(c.pattern, c.placements, c.label) for c in again.constraints] == [
        ("h", ("S(0)",), "model.layers.0.mlp"), ("g", ("R",), "g")]
