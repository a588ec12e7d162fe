"""Fused projections kept tensor-parallel (issue 29): GPT-2's ``c_attn`` and Phi-3's fused q/k/v
and gate/up weights laid out ``_S(out,K)`` on tp, as Megatron shards them.

A split (or chunk) whose pieces are whole blocks of a strided shard leaves each piece
``S(d)`` with no communication, and the gradient's concat of ``S(d)`` pieces of one size
is ``_S(d,K)`` again.  The op database (``layout_prop/testing/opdb/strided.py``) tries
``_S(d,2)`` against every placement; here ``_S(d,3)`` (the testing kit only draws split
factor 2), a GPT-2-like block written as a spec, and an ONNX model imported with the
``colwise_fused(3)`` plan preset.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from graph_tests.cli_support import run_in_process
from layout_prop.api import analyze
from layout_prop.core.registry import get_rule
from layout_prop.io.loader import load_spec
from layout_prop.io.plan_file import load_plan, resolve_parameters, ParamUse
from layout_prop.core.errors import SpecError
from layout_prop.runner import run_graph
from layout_prop.testing import GENERIC_CODES, OpSample, Report, check_spec, single_op_spec

# ------------------------------------------------------------------------------ split3/chunk3/concat with _S(d,3)
# (op, shape, attrs, placement combinations per mesh): the fused dim cut by one or two mesh axes,
# uneven chunks (a block of 5 on 2 ranks: 3 and 2), pieces of several blocks, and the other dim sharded too
STRIDED3 = [
    ("split3", [(4, 12)], {"axis": 1}, {(4,): [("_S(1,3)",)], (2, 2): [("_S(1,3)", "_S(1,3)"), ("S(0)", "_S(1,3)"),
                                                                   ("_S(1,3)", "S(0)"), ("R", "_S(1,3)")]}),
    ("split3", [(15, 2)], {"axis": 0, "sizes": [5, 5, 5]}, {(2, 2): [("R", "_S(0,3)"), ("_S(0,3)", "_S(0,3)")]}),
    ("split2", [(4, 12)], {"axis": 1, "sizes": [4, 8]}, {(2, 2): [("S(0)", "_S(1,3)"), ("_S(1,3)", "R")]}),
    ("chunk3", [(2, 9)], {"axis": 1}, {(4,): [("_S(1,3)",)], (2, 2): [("_S(1,3)", "_S(1,3)"), ("S(0)", "_S(1,3)")]}),
    ("chunk2", [(2, 12)], {"axis": 1}, {(2, 2): [("R", "_S(1,6)")]}),  # 2 pieces of 3 blocks: _S(1,3) each
    ("slice", [(4, 15)], {"axis": 1, "start": 5, "stop": 15}, {(4,): [("_S(1,3)",)],
                                                               (2, 2): [("_S(1,3)", "_S(1,3)"), ("S(0)", "_S(1,3)")]}),
    ("pad_slice", [(4, 5)], {"axis": 1, "start": 10, "size": 15}, {(4,): [("S(1)",)], (2, 2): [("S(1)", "S(1)")]}),
]


@pytest.mark.parametrize("op, shapes, attrs, combos", STRIDED3, ids=[f"{c[0]}-{c[1][0]}" for c in STRIDED3])
def test_split_of_whole_strided_blocks_is_free_and_correct(op, shapes, attrs, combos):
    report = Report(op)
    documented = frozenset(get_rule(op).violation_codes) | GENERIC_CODES
    for mesh, placements in combos.items():
        for combo in placements:
            spec = single_op_spec(op, OpSample(shapes, attrs), mesh, combo)
            violations = analyze(load_spec(spec)).check.violations
            assert not violations, (combo, [v.message for v in violations])
            check_spec(spec, documented, backward=True, seed=0, report=report)
    assert report.accepted == sum(len(p) for p in combos.values()), report.to_dict()
    assert not report.mismatches, report.mismatches[0].message


def test_split_pieces_take_plain_shards():
    spec = single_op_spec("split3", OpSample([(4, 12)], {"axis": 1}), (2, 2), ("S(0)", "_S(1,3)"))
    tensors = analyze(load_spec(spec)).tensors()
    assert [tensors[f"split3:{i}"]["placements"] for i in range(3)] == [["S(0)", "S(1)"]] * 3
    chunk = single_op_spec("chunk2", OpSample([(2, 12)], {"axis": 1}), (2,), ("_S(1,6)",))
    assert analyze(load_spec(chunk)).tensors()["chunk2:0"]["placements"] == ["_S(1,3)"]


@pytest.mark.parametrize("mesh, combo, out", [
    ((2,), ("S(1)", "R", "S(1)"), ["_S(1,3)"]),  # the replicated cotangent is sliced alike for free
    ((2, 2), ("S(1)", "S(1)", "R", "R", "S(1)", "S(1)"), ["_S(1,3)", "_S(1,3)"]),  # nested chunks
    ((2, 2), ("S(0)", "_S(1,2)", "S(0)", "R"), ["S(0)", "_S(1,3)"]),  # k/v fused already, q whole
])
def test_concat_of_whole_blocks_is_free_and_correct(mesh, combo, out):
    shapes = [(4, 5)] * (len(combo) // len(mesh)) if combo[1] != "_S(1,2)" else [(4, 10), (4, 5)]
    spec = single_op_spec("concat", OpSample(shapes, {"axis": 1}), mesh, combo)
    analysis = analyze(load_spec(spec))
    assert analysis.check.violations == [] and analysis.tensors()["concat"]["placements"] == out
    report = Report("concat")
    check_spec(spec, frozenset(get_rule("concat").violation_codes) | GENERIC_CODES, True, 0, report)
    assert report.accepted == 1 and not report.mismatches, report.to_dict()


def test_phi3_style_slices_of_a_fused_projection_stay_sharded():
    # Phi-3's exporter cuts qkv with three Slices (not a Split): whole blocks of _S(1,3) stay sharded, forward and
    # backward (the gradient pads each piece among zero blocks, _S(1,3) again)
    spec = {"mesh": {"shape": [2, 2], "names": ["dp", "tp"]},
            "inputs": {"x": {"shape": [4, 8], "placements": ["S(0)", "R"]},
                       "w": {"shape": [8, 30], "placements": ["R", "_S(1,3)"]}},
            "nodes": [{"name": "h", "op": "matmul", "inputs": ["x", "w"]},
                      {"name": "q", "op": "slice", "inputs": ["h"], "attrs": {"axis": 1, "start": 0, "stop": 10}},
                      {"name": "k", "op": "slice", "inputs": ["h"], "attrs": {"axis": 1, "start": 10, "stop": 20}},
                      {"name": "v", "op": "slice", "inputs": ["h"], "attrs": {"axis": 1, "start": 20}},
                      {"name": "qk", "op": "mul", "inputs": ["q", "k"]},
                      {"name": "o", "op": "add", "inputs": ["qk", "v"]}],
            "outputs": ["o"]}
    analysis = analyze(load_spec(spec), backward=True)
    assert analysis.check.violations == []
    tensors = analysis.tensors()
    assert [tensors[n]["placements"] for n in "qkv"] == [["S(0)", "S(1)"]] * 3  # blocks of 10: chunks 5, 5
    assert tensors["grad:w"]["placements"] == ["R", "_S(1,3)"]
    assert not [s for r in analysis.report()["redistributions"] for s in r["steps"] if s["kind"] == "all-gather"]
    assert run_graph(load_spec(spec), backward=True).ok


def test_pieces_across_blocks_are_still_gathered():
    # q of 2 and k/v of 5 do not line up with 3 blocks of 4: the split axis is gathered, as before
    spec = single_op_spec("split3", OpSample([(4, 12)], {"axis": 1, "sizes": [2, 5, 5]}), (2,), ("_S(1,3)",))
    codes = [v.code for v in analyze(load_spec(spec)).check.violations]
    assert codes == ["sharded-split-dim"]
    assert run_graph(load_spec(spec), backward=True).ok


# ------------------------------------------------------------------------------ a GPT-2-like block
def gpt2_block_spec(dp: int = 2, tp: int = 2) -> dict:
    """GPT-2's attention: layer norm, the fused c_attn (Conv1D: (in, 3 * hidden)) and its bias, a split
    into q, k, v, heads, causal attention, and the row-parallel c_proj; Megatron's layout on tp."""
    b, s, h, heads = 2, 8, 32, 4
    nodes = [
        {"name": "ln", "op": "layer_norm", "inputs": ["x", "ln_g", "ln_b"]},
        {"name": "qkv_mm", "op": "matmul", "inputs": ["ln", "c_attn_w"]},
        {"name": "qkv", "op": "add", "inputs": ["qkv_mm", "c_attn_b"]},
        {"name": "split", "op": "split3", "inputs": ["qkv"], "attrs": {"axis": -1}},
    ]
    for i, name in enumerate("qkv"):
        nodes += [{"name": f"{name}4", "op": "reshape", "inputs": [f"split:{i}"],
                   "attrs": {"shape": [b, s, heads, h // heads]}},
                  {"name": name, "op": "transpose", "inputs": [f"{name}4"], "attrs": {"dims": [0, 2, 1, 3]}}]
    nodes += [
        {"name": "attn", "op": "scaled_dot_product_attention", "inputs": ["q", "k", "v"],
         "attrs": {"layout": "BNSD", "causal": True}},
        {"name": "attn_t", "op": "transpose", "inputs": ["attn"], "attrs": {"dims": [0, 2, 1, 3]}},
        {"name": "attn_m", "op": "reshape", "inputs": ["attn_t"], "attrs": {"shape": [b, s, h]}},
        {"name": "proj_mm", "op": "matmul", "inputs": ["attn_m", "c_proj_w"]},
        {"name": "proj", "op": "add", "inputs": ["proj_mm", "c_proj_b"]},
        {"name": "out", "op": "add", "inputs": ["x", "proj"]},
    ]
    return {
        "mesh": {"shape": [dp, tp], "names": ["dp", "tp"]},
        "inputs": {
            "x": {"shape": [b, s, h], "placements": ["S(0)", "R"]},
            "ln_g": {"shape": [h], "placements": ["R", "R"]},
            "ln_b": {"shape": [h], "placements": ["R", "R"]},
            "c_attn_w": {"shape": [h, 3 * h], "placements": ["R", "_S(1,3)"]},
            "c_attn_b": {"shape": [3 * h], "placements": ["R", "_S(0,3)"]},
            "c_proj_w": {"shape": [h, h], "placements": ["R", "S(0)"]},
            "c_proj_b": {"shape": [h], "placements": ["R", "R"]},
        },
        "nodes": nodes,
        "outputs": ["out"],
    }


def _cli(args, spec_path):
    return run_in_process([args[0], str(spec_path), *args[1:]])


def test_gpt2_fused_c_attn_stays_column_parallel(tmp_path):
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(gpt2_block_spec()))
    check = _cli(["check", "--backward", "--json"], path)
    assert check.returncode == 0, check.stderr
    report = json.loads(check.stdout)
    assert report["violations"] == []
    t = report["tensors"]
    assert t["qkv"]["placements"] == ["S(0)", "_S(2,3)"]
    assert [t[f"split:{i}"]["placements"] for i in range(3)] == [["S(0)", "S(2)"]] * 3
    assert t["grad:c_attn_w"]["placements"] == ["R", "_S(1,3)"]
    assert t["grad:c_attn_b"]["placements"] == ["R", "_S(0,3)"]
    # no gather anywhere (no weight, no activation), and nothing moves on tp but the Partial sums of c_proj
    # and of the replicated values' gradients
    steps = [(r["node"], r["input"], s["kind"], s["mesh_axis"]) for r in report["redistributions"] for s in r["steps"]]
    assert not [s for s in steps if s[2] in ("all-gather", "all-to-all")], steps
    assert not [s for s in steps if "c_attn" in s[0] and s[3] == "tp"], steps
    run = _cli(["run", "--backward", "--json"], path)
    assert run.returncode == 0, run.stderr + run.stdout
    result = json.loads(run.stdout)
    assert result["ok"] and set(result["grads"]) >= {"c_attn_w", "c_attn_b", "x"}
    assert max(v["max_abs_err"] for v in result["grads"].values()) < 1e-4


def test_gpt2_plain_colwise_would_gather():
    # the same block with c_attn S(1) (a plain column shard, what colwise gives) cuts across q, k and v
    spec = gpt2_block_spec()
    spec["inputs"]["c_attn_w"]["placements"] = ["R", "S(1)"]
    spec["inputs"]["c_attn_b"]["placements"] = ["R", "S(0)"]
    codes = {v.code for v in analyze(load_spec(spec)).check.violations}
    assert "sharded-split-dim" in codes


# ------------------------------------------------------------------------------ the plan preset
MESH = {"shape": [2, 2], "names": ["dp", "tp"]}


def test_colwise_fused_preset_resolves_to_a_strided_shard():
    plan = load_plan({"mesh": MESH, "parameters": {"*.c_attn.weight": "colwise_fused(3)",
                                                   "*.gate_up.weight": "colwise_fused(2, dp)"}})
    uses = {"h.0.c_attn.weight": [ParamUse("matmul", out_dim=1, in_dim=0)],
            "h.0.gate_up.weight": [ParamUse("linear", out_dim=0, in_dim=1)]}
    shapes = {"h.0.c_attn.weight": (32, 96), "h.0.gate_up.weight": (128, 32)}
    assert resolve_parameters(plan, shapes, uses) == {"h.0.c_attn.weight": ["R", "_S(1,3)"],
                                                       "h.0.gate_up.weight": ["_S(0,2)", "R"]}


@pytest.mark.parametrize("entry, code, words", [
    ("colwise_fused", "bad-plan", "number of fused projections"),
    ("colwise_fused(1)", "bad-plan", "number of fused projections"),
    ("colwise_fused(3, pp)", "unknown-mesh-axis", "'pp'"),
])
def test_colwise_fused_preset_errors(entry, code, words):
    with pytest.raises(SpecError) as info:
        load_plan({"mesh": MESH, "parameters": {"w": entry}})
    assert info.value.code == code and words in info.value.message


def test_colwise_fused_preset_needs_a_multiple():
    plan = load_plan({"mesh": MESH, "parameters": {"w": "colwise_fused(3)"}})
    with pytest.raises(SpecError) as info:
        resolve_parameters(plan, {"w": (32, 64)}, {"w": [ParamUse("matmul", out_dim=1, in_dim=0)]})
    assert info.value.code == "preset-misfit" and "64 is not a multiple of 3" in info.value.message


def _fused_onnx(path):
    """A GPT-2-like ONNX graph: MatMul by a fused (in, 3 * hidden) weight, Add its bias, Split into q, k, v,
    q * k + v, and the output projection."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    h = 16
    inits = [numpy_helper.from_array((rng.standard_normal((h, 3 * h)) / 4).astype(np.float32), "h.0.c_attn.weight"),
             numpy_helper.from_array(rng.standard_normal(3 * h).astype(np.float32), "h.0.c_attn.bias"),
             numpy_helper.from_array((rng.standard_normal((h, h)) / 4).astype(np.float32), "h.0.c_proj.weight")]
    nodes = [helper.make_node("MatMul", ["x", "h.0.c_attn.weight"], ["mm"], name="/h.0/c_attn/MatMul"),
             helper.make_node("Add", ["mm", "h.0.c_attn.bias"], ["qkv"], name="/h.0/c_attn/Add"),
             helper.make_node("Split", ["qkv"], ["q", "k", "v"], name="/h.0/Split", axis=-1, num_outputs=3),
             helper.make_node("Mul", ["q", "k"], ["qk"], name="/h.0/Mul"),
             helper.make_node("Add", ["qk", "v"], ["mix"], name="/h.0/Add"),
             helper.make_node("MatMul", ["mix", "h.0.c_proj.weight"], ["out"], name="/h.0/c_proj/MatMul")]
    graph = helper.make_graph(nodes, "fused", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, h])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 4, h])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model = onnx.shape_inference.infer_shapes(model)
    onnx.save(model, str(path))


def test_imported_fused_projection_with_the_preset(tmp_path):
    pytest.importorskip("onnx")
    model = tmp_path / "fused.onnx"
    _fused_onnx(model)
    plan = tmp_path / "plan.yaml"
    plan.write_text("mesh: {shape: [2, 2], names: [dp, tp]}\n"
                    "inputs: {x: [\"S(0)\", R]}\n"
                    "parameters:\n"
                    "  \"*.c_attn.weight\": colwise_fused(3)\n"
                    "  \"*.c_attn.bias\": [R, \"_S(0,3)\"]\n"
                    "  \"*.c_proj.weight\": rowwise\n")
    check = run_in_process(["check", str(model), "--plan", str(plan), "--backward", "--json"])
    assert check.returncode == 0, check.stderr
    report = json.loads(check.stdout)
    assert report["violations"] == []
    assert report["tensors"]["h.0.c_attn.weight"]["placements"] == ["R", "_S(1,3)"]
    gathers = [r for r in report["redistributions"] for s in r["steps"] if s["kind"] == "all-gather"]
    assert gathers == []
    run = run_in_process(["run", str(model), "--plan", str(plan), "--backward"])
    assert run.returncode == 0, run.stderr + run.stdout
    assert "matches one device" in run.stdout


# ------------------------------------------------------------------------------ GPT-2 from torch's exporter
GPT2 = Path(__file__).resolve().parent.parent / "examples" / "models" / "gpt2.onnx"
MEGATRON_GPT2 = """mesh: {shape: [2], names: [tp]}
parameters:
  "*.attn.c_attn.weight": colwise_fused(3)
  "*.attn.c_proj.weight": rowwise
  "*.mlp.c_fc.weight": colwise
  "*.mlp.c_proj.weight": rowwise
  "*": R
"""


@pytest.mark.skipif(not GPT2.exists(), reason="the GPT-2 fixture of examples/models is not in this checkout")
def test_gpt2_fixture_megatron_plan_keeps_c_attn_column_parallel(tmp_path):
    pytest.importorskip("onnx")
    plan = tmp_path / "plan.yaml"
    plan.write_text(MEGATRON_GPT2)
    check = run_in_process(["check", str(GPT2), "--plan", str(plan), "--backward", "--reshard", "--json"])
    assert check.returncode == 0, check.stderr
    report = json.loads(check.stdout)
    assert report["ok"] and report["violations"] == []
    weights = [name for name in report["tensors"] if name.endswith("c_attn.weight")]
    assert len(weights) == 4 and all(report["tensors"][w]["placements"] == ["_S(1,3)"] for w in weights)  # and grads
    splits = [t for name, t in report["tensors"].items() if name.startswith("node_Split") and ":" in name]
    assert len(splits) == 6 and all(t["placements"] == ["S(2)"] for t in splits)  # q, k, v of both layers
    gathered = {r["input"] for r in report["redistributions"] for s in r["steps"] if s["kind"] == "all-gather"}
    assert not [g for g in gathered if g.endswith(".weight") or "Split" in g or "Gemm_342" in g], gathered
    run = run_in_process(["run", str(GPT2), "--plan", str(plan), "--backward"])
    assert run.returncode == 0 and "matches one device" in run.stdout, run.stderr + run.stdout
    # a plain column shard cuts across q, k and v
    plan.write_text(MEGATRON_GPT2.replace("colwise_fused(3)", "colwise"))
    plain = run_in_process(["check", str(GPT2), "--plan", str(plan), "--json"])
    assert "sharded-split-dim" in {v["code"] for v in json.loads(plain.stdout)["violations"]}
