"""RotaryPositionEmbedding: the upstream scenarios, every violation code, and a property test.

Numerical claims go through the whole pipeline: propagate, (reshard,) backward, lower,
simulate every rank, assemble, compare with the single-device numpy execution.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from layout_prop.core import meta
from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.core.errors import ExecutionError, LayoutPropError
from layout_prop.engines.collectives import assemble
from layout_prop.engines.simulator import Simulator
from layout_prop.io.loader import load_spec
from layout_prop.passes.lower import Lower
from layout_prop.passes.verify import Verify
from layout_prop.runner import execute_global, random_inputs, run_graph

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "rpe"
SCENARIOS = sorted(p.stem for p in EXAMPLES.glob("*.yaml"))
RPE_CODES = {"partial-input", "sharded-rotation-dim", "broadcast-shape", "sharding-mismatch", "invalid-mode",
             "invalid-head-dim", "invalid-rank", "invalid-input-layout"}


def scenario(name: str, mode: int = 0, **input_overrides) -> dict:
    data = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    data["nodes"][0]["attrs"]["mode"] = mode
    for inp, fields in input_overrides.items():
        entry = data["inputs"][inp]
        for exclusive in ("placements", "tensor_map"):
            if exclusive in fields:
                entry.pop("tensor_map" if exclusive == "placements" else "placements", None)
        entry.update(fields)
    return data


def test_the_eight_upstream_scenarios_are_there():
    assert SCENARIOS == sorted(["replicated", "dp_b", "tp_n", "dp_tp", "dp_sp", "tp_sp", "dp_tp_cos_full",
                                "dp_tp_sp"])


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("name", SCENARIOS)
def test_upstream_scenario_forward_and_backward_match_one_device(name, mode):
    rep = run_graph(load_spec(scenario(name, mode)), backward=True, seed=mode)
    assert rep.ok, rep.mismatches
    assert set(rep.outputs) == {"y"}
    assert set(rep.grads) == {"x", "cos", "sin"}
    for err in [*rep.outputs.values(), *rep.grads.values()]:
        assert err["max_rel_err"] <= 1e-5


# x sharded on a dim that cos broadcasts along: the cos gradient is a partial sum that needs an all-reduce
PARTIAL_GRAD = {"dp_b": ["dp"], "dp_sp": ["dp"], "dp_tp_cos_full": ["dp", "tp"], "dp_tp_sp": ["dp", "tp"]}


@pytest.mark.parametrize("name", sorted(PARTIAL_GRAD))
def test_cos_gradient_needs_the_all_reduce(name):
    g = analyze(load_spec(scenario(name)), backward=True, reshard=True).graph
    Verify(resolved=True).run(g)
    grad_cos = g.node("grad/cos")
    assert grad_cos.op == "redistribute"
    raw = grad_cos.inputs[0]
    raw_spec = g.producer(raw)[0].meta[meta.SPECS][g.producer(raw)[1]]
    partial_axes = [g.mesh.names[a] for a in raw_spec.layout.partial_axes()]
    assert partial_axes == PARTIAL_GRAD[name]
    program = Lower().run(g).program
    reduces = [op for op in program.collectives if op.source == "grad/cos"]
    assert [(op.op, g.mesh.names[op.step.mesh_axis]) for op in reduces] == [
        ("all-reduce", axis) for axis in PARTIAL_GRAD[name]]
    inputs = random_inputs(g, seed=3)
    local = Simulator().execute(program, inputs, np.random.default_rng(4))
    reference = execute_global(g, inputs)["grad/cos"]
    cos_spec = g.node("cos").meta[meta.SPECS][0]
    # with the all-reduce: right
    np.testing.assert_allclose(assemble(local["grad/cos"], cos_spec), reference, rtol=1e-5, atol=1e-5)
    # without it (what upstream does: hand back the local dcos as the gradient): wrong
    with pytest.raises(ExecutionError) as info:
        assemble(local[raw], cos_spec)
    assert info.value.code == "replica-mismatch"
    rank0_block = local[raw][0][cos_spec.local_index(0)] if local[raw][0].shape != cos_spec.local_shape(0) else \
        local[raw][0]
    assert not np.allclose(rank0_block, reference[cos_spec.local_index(0)], rtol=1e-3, atol=1e-3)


def test_replicate_cos_on_a_sharded_full_size_dim_is_sliced_locally_and_gathered_back():
    data = scenario("dp_sp", cos={"placements": ["R", "R"]}, sin={"placements": ["R", "R"]})
    a = analyze(load_spec(data), backward=True, reshard=True)
    assert a.ok
    fwd = [r for r in a.report()["redistributions"] if r["node"] == "y"]
    assert [(r["input"], [(s["kind"], s["mesh_axis"], s["bytes_per_rank"]) for s in r["steps"]]) for r in fwd] == [
        ("cos", [("local-slice", "sp", 0)]), ("sin", [("local-slice", "sp", 0)])]
    grad = {r["node"]: [(s["kind"], s["mesh_axis"]) for s in r["steps"]] for r in a.report()["redistributions"]
            if r["node"] in ("grad/cos", "grad/sin")}
    # dcos is a partial sum over dp (B broadcast) and a slice over sp: all-reduce on dp, all-gather on sp
    assert sorted(grad["grad/cos"]) == [("all-gather", "sp"), ("all-reduce", "dp")]
    rep = run_graph(load_spec(data), backward=True)
    assert rep.ok, rep.mismatches


@pytest.mark.parametrize("name,x_map", [("dp_tp", [1, 0, -1, -1]), ("dp_sp", [1, -1, 0, -1]),
                                        ("dp_tp_sp", [2, 1, 0, -1]), ("tp_n", [-1, 0, -1, -1]),
                                        ("replicated", [-1, -1, -1, -1])])
def test_check_prints_the_layouts(name, x_map, capsys):
    assert main(["check", str(EXAMPLES / f"{name}.yaml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True and out["violations"] == []
    assert out["tensors"]["x"]["tensor_map"] == x_map
    assert out["tensors"]["y"]["tensor_map"] == x_map
    assert out["tensors"]["y"]["placements"] == out["tensors"]["x"]["placements"]
    assert set(out) >= {"ok", "mesh", "tensors", "violations", "redistributions"}


def test_check_dp_tp_layout_of_x_is_s0_s1(capsys):
    main(["check", str(EXAMPLES / "dp_tp.yaml"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["tensors"]["x"]["placements"] == ["S(0)", "S(1)"]
    assert out["tensors"]["x"]["local_shape"] == [2, 2, 16, 64]


# ----------------------------------------------------------------------------- violations

def _violations(data):
    a = analyze(load_spec(data))
    return [(v.code, v.input, v.operand, v.message, v.hint) for v in a.check.violations]


def _one(data, code, operand):
    found = _violations(data)
    assert [f[0] for f in found] == [code], found
    assert found[0][2] == operand
    return found[0]


def test_d_sharded_on_x():
    data = scenario("dp_sp", x={"placements": ["S(0)", "S(3)"]}, cos={"placements": ["R", "R"]},
                    sin={"placements": ["R", "R"]})
    code, inp, operand, message, hint = _one(data, "sharded-rotation-dim", "x")
    assert "'sp'" in message and "dim 3" in message and "64" in message
    assert "all-gather" in hint and "sp" in hint


@pytest.mark.parametrize("table", ["cos", "sin"])
def test_d_sharded_on_cos_or_sin(table):
    data = scenario("dp_sp", **{table: {"placements": ["R", "S(3)"]}})
    found = _violations(data)
    codes = [f[0] for f in found if f[2] == table]
    assert "sharded-rotation-dim" in codes
    message = next(f[3] for f in found if f[0] == "sharded-rotation-dim")
    assert table in message and "'sp'" in message


def test_cos_mismatch_on_b():
    # x is sharded on B by dp; cos (full B) sharded on B by tp instead
    data = scenario("dp_tp", cos={"placements": ["R", "S(0)"]})
    code, inp, operand, message, hint = _one(data, "sharding-mismatch", "cos")
    assert inp == "cos"
    assert "cos dim 0" in message and "tp" in message and "dp" in message
    assert "like x" in hint and "--reshard inserts" in hint


def test_sin_mismatch_on_s():
    # x is sharded on S by sp; sin sharded on S by dp
    data = scenario("dp_sp", sin={"placements": ["S(2)", "R"]})
    code, inp, operand, message, hint = _one(data, "sharding-mismatch", "sin")
    assert "sin dim 2" in message and "dp" in message and "sp" in message


def test_cos_sharded_on_n_where_x_is_replicated():
    data = scenario("tp_n", x={"placements": ["R"]}, sin={"placements": ["R"]})
    code, inp, operand, message, hint = _one(data, "sharding-mismatch", "cos")
    assert "cos dim 1 is sharded on mesh axis tp" in message and "not sharded" in message
    assert "keep cos dim 1 Replicate" in hint and "all-gather on tp" in hint


def test_partial_x():
    data = scenario("dp_b", x={"placements": ["P(sum)"]})
    code, inp, operand, message, hint = _one(data, "partial-input", "x")
    assert "P(sum)" in message and "'dp'" in message and "all-reduce" in hint


def test_partial_cos():
    data = scenario("dp_b", cos={"placements": ["P"]})
    code, inp, operand, message, hint = _one(data, "partial-input", "cos")
    assert "cos is P(sum)" in message


def test_broadcast_shape():
    data = scenario("dp_b", cos={"shape": [1, 1, 8, 64]}, sin={"shape": [1, 1, 8, 64]})
    found = _violations(data)
    assert {f[0] for f in found} == {"broadcast-shape"}
    assert any("cos dim 2 has size 8" in f[3] and "16" in f[3] for f in found)


def test_cos_and_sin_shapes_differ():
    data = scenario("dp_b", sin={"shape": [1, 4, 16, 64]})
    code, inp, operand, message, hint = _one(data, "broadcast-shape", "sin")
    assert "[1, 1, 16, 64]" in message and "[1, 4, 16, 64]" in message


def test_invalid_mode():
    data = scenario("replicated", mode=7)
    code, inp, operand, message, hint = _one(data, "invalid-mode", "x")
    assert "7" in message and "interleave" in hint


@pytest.mark.parametrize("mode,d,divisor", [(2, 6, 4), (0, 5, 2), (1, 7, 2), (3, 3, 2)])
def test_invalid_head_dim(mode, d, divisor):
    data = scenario("replicated", mode=mode, x={"shape": [2, 4, 16, d]}, cos={"shape": [1, 1, 16, d]},
                    sin={"shape": [1, 1, 16, d]})
    code, inp, operand, message, hint = _one(data, "invalid-head-dim", "x")
    assert f"D = {d}" in message and f"divisible by {divisor}" in message


def test_invalid_rank_and_input_layout():
    data = scenario("replicated", x={"shape": [2, 16, 64]}, cos={"shape": [1, 16, 64]}, sin={"shape": [1, 16, 64]})
    data["nodes"][0]["attrs"]["input_layout"] = "BNSD"
    code, inp, operand, message, hint = _one(data, "invalid-input-layout", "x")
    assert "TND" in message
    data = scenario("replicated", x={"shape": [64]}, cos={"shape": [64]}, sin={"shape": [64]})
    _one(data, "invalid-rank", "x")


def test_all_violations_of_a_node_are_collected_in_input_order():
    data = scenario("dp_sp", x={"placements": ["P(sum)", "S(3)"]}, cos={"placements": ["S(3)", "R"]},
                    sin={"placements": ["P(max)", "R"]})
    found = _violations(data)
    assert [(f[0], f[2]) for f in found] == [("partial-input", "x"), ("sharded-rotation-dim", "x"),
                                            ("sharded-rotation-dim", "cos"), ("partial-input", "sin")]


def test_reshard_fixes_every_fixable_rpe_violation_and_the_result_is_right():
    data = scenario("dp_sp", x={"placements": ["P(sum)", "S(3)"]}, cos={"placements": ["S(3)", "R"]},
                    sin={"placements": ["S(2)", "R"]})
    a = analyze(load_spec(data), reshard=True)
    assert a.ok
    Verify(resolved=True).run(a.graph)
    rep = run_graph(load_spec(data))
    assert rep.ok, rep.mismatches
    rep = run_graph(load_spec(data), reshard=False)
    assert not rep.ok and rep.violations


def test_mode_never_changes_the_layout():
    layouts = set()
    for mode in range(4):
        a = analyze(load_spec(scenario("dp_tp_sp", mode)))
        layouts.add(tuple(a.report()["tensors"]["y"]["placements"]))
    assert layouts == {("S(0)", "S(1)", "S(2)")}


# ----------------------------------------------------------------------------- property test

@st.composite
def rpe_cases(draw):
    ndim_mesh = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(1, 4), min_size=ndim_mesh, max_size=ndim_mesh))
    assume(int(np.prod(sizes)) <= 8)
    names = ["dp", "tp", "sp"][:ndim_mesh]
    d = draw(st.sampled_from([4, 6, 8]))
    x_shape = [draw(st.integers(1, 5)) for _ in range(3)] + [d]
    table_rank = draw(st.integers(2, 4))
    table_shape = [draw(st.sampled_from([1, x_shape[4 - table_rank + i]])) for i in range(table_rank - 1)] + [d]
    choices_x = ["R", "R", "S(0)", "S(1)", "S(2)", "S(3)", "P(sum)"]
    choices_t = ["R", "R", "R"] + [f"S({i})" for i in range(table_rank)] + ["P(sum)"]
    x_p = [draw(st.sampled_from(choices_x)) for _ in names]
    cos_p = [draw(st.sampled_from(choices_t)) for _ in names]
    sin_p = draw(st.sampled_from([cos_p, [draw(st.sampled_from(choices_t)) for _ in names]]))
    mode = draw(st.integers(0, 3))
    grads = draw(st.booleans())
    return {
        "mesh": {"shape": sizes, "names": names},
        "inputs": {
            "x": {"shape": x_shape, "placements": x_p},
            "cos": {"shape": table_shape, "placements": cos_p, "requires_grad": grads},
            "sin": {"shape": table_shape, "placements": sin_p, "requires_grad": grads},
        },
        "nodes": [{"name": "y", "op": "rotary_position_embedding", "inputs": ["x", "cos", "sin"],
                   "attrs": {"mode": mode}}],
        "outputs": ["y"],
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(rpe_cases(), st.integers(0, 2**16))
def test_property_every_layout_is_either_a_documented_violation_or_numerically_right(data, seed):
    try:
        graph = load_spec(data)
    except LayoutPropError as err:
        # a layout that cannot exist (size-1 dim sharded over several devices) is unusable input
        assert err.code == "invalid-layout", err
        event("unusable layout")
        return
    plain = analyze(graph)
    assert {v.code for v in plain.check.violations} <= RPE_CODES
    rep = run_graph(load_spec(data), backward=True, seed=seed)
    if rep.violations:
        # only violations that no redistribution can fix remain after reshard
        assert {v["code"] for v in rep.violations} <= {"broadcast-shape", "invalid-mode", "invalid-head-dim"}
        event("unfixable violation")
        return
    assert rep.ok, (data, rep.mismatches)
    event("checked numerically" + (" after reshard" if plain.check.violations else ""))


def test_check_backend_cann_reports_kernel_limits_on_local_shapes(tmp_path, capsys):
    # D = 896 breaks the CANN limit D < 896 on every rank; the numpy backend has no such limit
    data = scenario("dp_b", x={"shape": [4, 4, 16, 896]}, cos={"shape": [1, 1, 16, 896]},
                    sin={"shape": [1, 1, 16, 896]})
    spec = tmp_path / "big_d.yaml"
    spec.write_text(yaml.safe_dump(data))
    assert main(["check", str(spec), "--json"]) == 0
    capsys.readouterr()
    assert main(["check", str(spec), "--backend", "cann", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [(v["node"], v["code"]) for v in out["violations"]] == [("y", "kernel-constraint")]
    assert "896" in out["violations"][0]["message"] and "rank 0" in out["violations"][0]["message"]
    # modes 2 and 3 have no CANN backward kernel
    data = scenario("dp_b", mode=3)
    spec.write_text(yaml.safe_dump(data))
    assert main(["check", str(spec), "--backend", "cann", "--backward", "--json"]) == 1
    codes = {v["code"] for v in json.loads(capsys.readouterr().out)["violations"]}
    assert "no-backward-kernel" in codes


def test_rpe_dtypes_integer_x_and_mixed_tables_are_violations():
    data = scenario("dp_b", x={"dtype": "int32"}, cos={"dtype": "int32"}, sin={"dtype": "int32"})
    code, inp, operand, message, hint = _one(data, "invalid-dtype", "x")
    assert "int32" in message and "float" in hint
    data = scenario("dp_b", cos={"dtype": "float64"})
    code, inp, operand, message, hint = _one(data, "invalid-dtype", "cos")
    assert "float64" in message and "float32" in message
