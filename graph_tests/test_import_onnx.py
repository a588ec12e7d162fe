"""Importing ONNX models with a sharding plan: the Llama block as torch.onnx.export lays it out
gives gen llama's collectives and matches one device; plans, unknown ops and malformed models
are refused with one line (exit 2)."""

from __future__ import annotations

import copy
import json
from collections import Counter

import numpy as np
import pytest
import yaml

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from layout_prop.api import analyze  # noqa: E402
from layout_prop.cli import main  # noqa: E402
from layout_prop.core.errors import LayoutPropError, OpError, SpecError  # noqa: E402
from layout_prop.frontends import load_model  # noqa: E402
from layout_prop.frontends.ir import sanitize  # noqa: E402
from layout_prop.frontends.onnx import from_onnx  # noqa: E402
from layout_prop.frontends.samples import LLAMA_PLAN, llama_onnx  # noqa: E402
from layout_prop.io.loader import load_spec  # noqa: E402
from layout_prop.frontends.generate import llama_spec  # noqa: E402
from layout_prop.runner import execute_global, run_graph  # noqa: E402


def moves(graph):
    """(kind, mesh axis, bytes) of every step of every redistribution reshard inserts, in order."""
    a = analyze(graph, reshard=True)
    assert a.ok
    return [(s["kind"], s["mesh_axis"], s["bytes_per_rank"]) for r in a.report()["redistributions"]
            for s in r["steps"]]


def one_device(graph, model, feeds):
    """The imported graph's outputs on one device, fed the model's own weights and ``feeds``."""
    inits = {sanitize(t.name): numpy_helper.to_array(t) for t in model.graph.initializer}
    a = analyze(graph)
    inputs = {n.name: feeds[n.name] if n.name in feeds else inits[n.name] for n in a.graph.inputs()}
    return execute_global(a.graph, inputs, wanted=a.graph.outputs)


def write(tmp_path, name, model):
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def plan_file(tmp_path, plan=LLAMA_PLAN, name="plan.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def one_line_error(capsys, argv, code="bad-model"):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and code in err, err
    return err


# ------------------------------------------------------------------------ the Llama block
def test_onnx_llama_block_gives_gen_llamas_collectives_and_violations():
    imported = from_onnx(llama_onnx(), LLAMA_PLAN)
    generated = load_spec(llama_spec(1))
    assert moves(imported) == moves(generated)
    # the expected moves, written out: Megatron's all-gathers and reduce-scatters of 256 bytes
    assert moves(imported) == [("all-gather", "tp", 256), ("all-gather", "sp", 256), ("all-gather", "sp", 256),
                               ("reduce-scatter", "tp", 256), ("all-gather", "tp", 256),
                               ("reduce-scatter", "tp", 256)]
    codes = Counter(v.code for v in analyze(imported).check.violations)
    assert codes == Counter(v.code for v in analyze(generated).check.violations)
    assert codes == {"sharding-mismatch": 5, "sharded-kv-sequence": 2, "partial-input": 2}


def test_onnx_llama_block_fuses_into_the_registry_ops():
    graph = from_onnx(llama_onnx(), LLAMA_PLAN)
    ops = Counter(n.op for n in graph.nodes if not n.is_input)
    assert ops == {"matmul": 7, "rms_norm": 2, "rotary_position_embedding": 2, "scaled_dot_product_attention": 1,
                   "silu_mul": 1, "reshape": 4, "transpose": 4, "unsqueeze": 2, "add": 2}
    assert [n.name for n in graph.inputs()][:4] == ["x", "cos", "sin", "layers.0.attention_norm.weight"]
    attn = next(n for n in graph.nodes if n.op == "scaled_dot_product_attention")
    assert attn.attrs["causal"] is True and attn.attrs["scale"] == pytest.approx(1 / np.sqrt(8))
    norm = next(n for n in graph.nodes if n.op == "rms_norm")
    assert norm.attrs["eps"] == 1e-6


@pytest.mark.parametrize("rsqrt_as_div", [False, True])
def test_imported_graph_computes_what_onnx_computes(rsqrt_as_div):
    model = llama_onnx(layers=2, rsqrt_as_div=rsqrt_as_div)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 8, 32)).astype(np.float32),
             "cos": rng.standard_normal((1, 8, 8)).astype(np.float32),
             "sin": rng.standard_normal((1, 8, 8)).astype(np.float32)}
    (want,) = ReferenceEvaluator(model).run(None, feeds)
    graph = from_onnx(model, LLAMA_PLAN)
    (got,) = one_device(graph, model, feeds).values()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_onnx_llama_block_run_backward_matches_one_device():
    rep = run_graph(from_onnx(llama_onnx(), LLAMA_PLAN), backward=True, seed=3)
    assert rep.ok, rep.mismatches
    assert "layers.0.attention.wq.weight" in rep.grads and "x" in rep.grads


def test_a_wrong_plan_gives_what_a_hand_written_spec_with_the_same_layouts_gives():
    plan = copy.deepcopy(LLAMA_PLAN)
    plan["parameters"] = {"*.attention.wq.weight": "rowwise", **plan["parameters"]}
    imported = from_onnx(llama_onnx(), plan)
    assert imported.node("layers.0.attention.wq.weight").attrs["placements"] == ("R", "R", "S(0)")  # (in, out)
    hand = load_spec(_as_matmuls(llama_spec(1), rowwise_q=True))
    a, b = analyze(imported), analyze(hand)
    assert Counter(v.code for v in a.check.violations) == Counter(v.code for v in b.check.violations)
    assert [v.operand for v in a.check.violations] == [v.operand for v in b.check.violations]
    assert moves(imported) == moves(hand)
    assert moves(imported) != moves(from_onnx(llama_onnx(), LLAMA_PLAN))


def _as_matmuls(spec: dict, rowwise_q: bool = False) -> dict:
    """gen llama's spec written by hand as the ONNX model holds it: ``matmul(x, w)`` with
    ``(in, out)`` weights instead of ``linear(x, w)`` with ``(out, in)`` ones."""
    swap = {"S(0)": "S(1)", "S(1)": "S(0)"}
    for nd in spec["nodes"]:
        if nd["op"] == "linear":
            nd["op"] = "matmul"
            w = spec["inputs"][nd["inputs"][1]]
            w["shape"] = w["shape"][::-1]
            w["placements"] = [swap.get(p, p) for p in w["placements"]]
    if rowwise_q:
        spec["inputs"]["model.layers.0.self_attn.q_proj.weight"]["placements"] = ["R", "R", "S(0)"]
    return spec


def test_the_matmul_form_of_gen_llama_has_the_same_collectives():
    assert moves(load_spec(_as_matmuls(llama_spec(1)))) == moves(load_spec(llama_spec(1)))


# ------------------------------------------------------------------------ plans
def test_presets_resolve_through_the_consumer(tmp_path):
    # a Gemm with transB holds its weight as (out, in), as a Dense does: colwise is dim 0 there
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6])
    w = numpy_helper.from_array(np.ones((6, 8), np.float32), "fc.weight")
    b = numpy_helper.from_array(np.ones((6,), np.float32), "fc.bias")
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Gemm", ["x", "fc.weight", "fc.bias"], ["y"], transB=1)], "g", [x], [y], [w, b]),
        opset_imports=[helper.make_opsetid("", 17)])
    graph = from_onnx(model, {"mesh": {"shape": [2], "names": ["tp"]},
                              "parameters": {"fc.weight": "colwise", "fc.bias": "R"}})
    assert graph.node("fc.weight").attrs["placements"] == ("S(0)",)
    assert [(n.op, n.inputs) for n in graph.nodes if not n.is_input] == [("linear", ("x", "fc.weight", "fc.bias"))]
    assert run_graph(graph, backward=True).ok
    with pytest.raises(SpecError) as err:
        from_onnx(model, {"mesh": {"shape": [2], "names": ["tp"]}, "parameters": {"fc.bias": "colwise"}})
    assert err.value.code == "preset-misfit" and "fc.bias" in err.value.path


@pytest.mark.parametrize("parameters, code, named", [
    ({"*.attention.wz.weight": "colwise"}, "unmatched-pattern", "*.attention.wz.weight"),
    ({"*.attention_norm.weight": "colwise"}, "preset-misfit", "*.attention_norm.weight"),
    ({"*.attention.wq.weight": "colwise(mp)"}, "unknown-mesh-axis", "*.attention.wq.weight"),
    ({"*.attention.wq.weight": "sideways"}, "bad-plan", "*.attention.wq.weight"),
    ({"*.attention.wq.weight": ["S(5)", "R", "R"]}, "invalid-layout", "*.attention.wq.weight"),
])
def test_bad_plans_are_one_line_naming_the_pattern(tmp_path, capsys, parameters, code, named):
    model = write(tmp_path, "m.onnx", llama_onnx())
    plan = dict(LLAMA_PLAN, parameters=parameters)
    err = one_line_error(capsys, ["check", str(model), "--plan", str(plan_file(tmp_path, plan))], code)
    assert repr(named) in err


def test_plan_input_errors(tmp_path, capsys):
    model = write(tmp_path, "m.onnx", llama_onnx())
    err = one_line_error(capsys, ["check", str(model), "--plan",
                                  str(plan_file(tmp_path, dict(LLAMA_PLAN, inputs={"y": ["R", "R", "R"]})))],
                         "unknown-input")
    assert "'y'" in err and "'x'" in err
    one_line_error(capsys, ["check", str(model)], "missing-plan")
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(llama_spec(1)))
    one_line_error(capsys, ["check", str(spec), "--plan", str(plan_file(tmp_path))], "unexpected-plan")


# ------------------------------------------------------------------------ the command line
def test_import_writes_a_spec_whose_check_equals_the_models(tmp_path, capsys):
    model = write(tmp_path, "m.onnx", llama_onnx())
    plan = plan_file(tmp_path)
    out = tmp_path / "spec.yaml"
    assert main(["import", str(model), "--plan", str(plan), "-o", str(out)]) == 0
    capsys.readouterr()
    reports = []
    for argv in (["check", str(out)], ["check", str(model), "--plan", str(plan)]):
        assert main(argv + ["--reshard", "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0] == reports[1]
    assert reports[0]["total_bytes_per_rank"] == 6 * 256


def test_every_command_takes_a_model_and_a_plan(tmp_path, capsys):
    model, plan = write(tmp_path, "m.onnx", llama_onnx()), plan_file(tmp_path)
    value = "layers.0/attention/wq/MatMul"
    assert main(["explain", str(model), value, "--plan", str(plan)]) == 0
    assert value in capsys.readouterr().out
    assert main(["lower", str(model), "--plan", str(plan), "--rank", "1"]) == 0
    assert "all_gather" in capsys.readouterr().out.replace("-", "_")
    assert main(["run", str(model), "--plan", str(plan), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main(["viz", str(model), "--plan", str(plan), "-o", str(tmp_path / "g.dot")]) == 0
    assert "wq/MatMul" in (tmp_path / "g.dot").read_text()


# ------------------------------------------------------------------------ unknown ops, malformed models
def _unknown_ops_model():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    consts = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
              (("sqrt2", np.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]
    nodes = [helper.make_node("Div", ["x", "sqrt2"], ["d"], name="/mlp/Div"),
             helper.make_node("HardSigmoid", ["d"], ["e"], name="/mlp/Hard"),
             helper.make_node("Add", ["e", "one"], ["a"], name="/mlp/Add"),
             helper.make_node("Mul", ["x", "a"], ["m"], name="/mlp/Mul"),
             helper.make_node("Mul", ["m", "half"], ["r"], name="/mlp/Mul_1"),
             helper.make_node("Abs", ["r"], ["q"], name="/mlp/Abs"),
             helper.make_node("HardSigmoid", ["q"], ["y"], name="/mlp/Hard_1")]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y], consts),
                             opset_imports=[helper.make_opsetid("", 17)])


def test_unknown_ops_are_listed_on_one_line(tmp_path, capsys):
    model = write(tmp_path, "unknown.onnx", _unknown_ops_model())
    plan = plan_file(tmp_path, {"mesh": {"shape": [2], "names": ["tp"]}, "inputs": {"x": ["S(0)"]}})
    err = one_line_error(capsys, ["check", str(model), "--plan", str(plan)], "unknown-op")
    assert "HardSigmoid (x2, first mlp/Hard)" in err and "Abs (x1, first mlp/Abs)" in err and "--opaque" in err


def test_opaque_ops_are_barriers(tmp_path, capsys):
    model = write(tmp_path, "unknown.onnx", _unknown_ops_model())
    plan = plan_file(tmp_path, {"mesh": {"shape": [2], "names": ["tp"]}, "inputs": {"x": ["S(0)"]}})
    assert main(["check", str(model), "--plan", str(plan), "--opaque", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [n for n in report["notes"] if "opaque" in n] == [
        f"node {name} ({op}) is opaque: its inputs are gathered to Replicate, its output is Replicate"
        for name, op in (("mlp/Hard", "HardSigmoid"), ("mlp/Abs", "Abs"), ("mlp/Hard_1", "HardSigmoid"))]
    # HardSigmoid's output is Replicate; x * (h + 1) is sharded like x again, so Abs gathers it too
    assert [(v["node"], v["code"]) for v in report["violations"]] == [("mlp/Hard", "opaque-input"),
                                                                      ("mlp/Abs", "opaque-input")]
    assert report["tensors"]["mlp/Hard_1"]["placements"] == ["R"]
    assert main(["check", str(model), "--plan", str(plan), "--opaque", "--reshard", "--json"]) == 0
    steps = [s["kind"] for r in json.loads(capsys.readouterr().out)["redistributions"] for s in r["steps"]]
    assert steps == ["all-gather"]  # x gathered once, before the first op: everything after it is Replicate
    out = tmp_path / "spec.yaml"
    assert main(["import", str(model), "--plan", str(plan), "--opaque", "-o", str(out)]) == 0
    assert "note: node mlp/Hard (HardSigmoid) is opaque" in capsys.readouterr().err
    assert main(["check", str(out), "--reshard"]) == 0  # the written spec loads: opaque is a known op there


def test_standalone_pointwise_ops_import_and_compute_what_onnx_computes():
    """torch's default (erf) GELU (fused into gelu_erf), a sigmoid gate, tanh, a square root and a power:
    the rest not fused, all mapped."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    consts = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
              (("sqrt2", np.sqrt(2.0)), ("one", 1.0), ("half", 0.5), ("three", 3.0))]
    nodes = [helper.make_node("Div", ["x", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", ["x", "a"], ["m"]),
             helper.make_node("Mul", ["m", "half"], ["gelu"]), helper.make_node("Sigmoid", ["gelu"], ["s"]),
             helper.make_node("Tanh", ["s"], ["t"]), helper.make_node("Mul", ["t", "t"], ["t2"]),
             helper.make_node("Sqrt", ["t2"], ["r"]), helper.make_node("Reciprocal", ["r"], ["i"]),
             helper.make_node("Pow", ["i", "three"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], consts),
                              opset_imports=[helper.make_opsetid("", 17)])
    plan = {"mesh": {"shape": [2], "names": ["tp"]}, "inputs": {"x": ["S(1)"]}}
    graph = from_onnx(model, plan)
    assert Counter(n.op for n in graph.nodes if not n.is_input) == {
        "gelu_erf": 1, "mul": 1, "sigmoid": 1, "tanh": 1, "sqrt": 1, "reciprocal": 1, "pow": 1}
    assert next(n for n in graph.nodes if n.op == "pow").attrs["exponent"] == 3.0
    assert analyze(graph).ok  # elementwise: the sharding passes through
    feeds = {"x": np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)}
    (want,) = ReferenceEvaluator(model).run(None, feeds)
    (got,) = one_device(graph, model, feeds).values()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    rep = run_graph(graph, backward=True)
    assert rep.ok, rep.mismatches


def test_malformed_models_are_one_line(tmp_path, capsys):
    plan = plan_file(tmp_path)
    good = onnx.load_model_from_string(llama_onnx().SerializeToString())
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(good.SerializeToString()[:5000])
    one_line_error(capsys, ["check", str(truncated), "--plan", str(plan)])
    wrong = tmp_path / "wrong.onnx"
    wrong.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    one_line_error(capsys, ["check", str(wrong), "--plan", str(plan)])
    text = tmp_path / "text.onnx"
    text.write_text("mesh: {shape: [2]}\n")
    one_line_error(capsys, ["check", str(text), "--plan", str(plan)])
    one_line_error(capsys, ["check", str(tmp_path / "missing.onnx"), "--plan", str(plan)], "model-not-found")
    no_shape = onnx.load_model_from_string(good.SerializeToString())
    no_shape.graph.input[0].type.tensor_type.ClearField("shape")
    err = one_line_error(capsys, ["check", str(write(tmp_path, "noshape.onnx", no_shape)), "--plan", str(plan)])
    assert "'x' has no shape" in err


def test_dynamic_dims_need_example_shapes_in_the_plan(tmp_path, capsys):
    model = write(tmp_path, "dyn.onnx", llama_onnx(dynamic_batch=True))
    err = one_line_error(capsys, ["check", str(model), "--plan", str(plan_file(tmp_path))], "dynamic-shape")
    assert "'x'" in err and "batch" in err
    plan = copy.deepcopy(LLAMA_PLAN)
    plan["inputs"]["x"] = {"shape": [2, 8, 32], "placements": ["S(0)", "S(1)", "S(1)"]}
    assert main(["check", str(model), "--plan", str(plan_file(tmp_path, plan, "p2.yaml")), "--reshard"]) == 0


def test_python_api_loads_a_model_like_a_spec(tmp_path):
    model = write(tmp_path, "m.onnx", llama_onnx())
    graph = load_model(model, LLAMA_PLAN)
    assert analyze(graph, reshard=True).ok
    with pytest.raises(LayoutPropError):
        load_model(tmp_path / "m.txt", LLAMA_PLAN)
    with pytest.raises(OpError):
        from_onnx(_unknown_ops_model(), {"mesh": {"shape": [2], "names": ["tp"]}})


def test_import_benchmark_prints_its_table():
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    done = subprocess.run([sys.executable, "import_check.py", "--layers", "1", "2", "--repeat", "1"], cwd=bench,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["layers", "onnx", "nodes", "graph", "nodes", "import", "s", "check", "s", "total", "s"]
    assert [row.split()[:3] for row in lines[1:3]] == [["1", "61", "37"], ["2", "119", "69"]]
    assert lines[-1].startswith("total(2)/total(1): ")


def test_vocab_shards_the_embedding_rows_and_colwise_its_columns():
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 16])
    table = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32),
                                    "tok_embeddings.weight")
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Gather", ["tok_embeddings.weight", "input_ids"], ["y"], name="/embed/Gather")],
        "g", [ids], [y], [table]), opset_imports=[helper.make_opsetid("", 17)])
    mesh = {"shape": [2, 2], "names": ["dp", "tp"]}
    graph = from_onnx(model, {"mesh": mesh, "inputs": {"input_ids": ["S(0)", "R"]},
                              "parameters": {"tok_embeddings.weight": "vocab"}})
    assert graph.node("tok_embeddings.weight").attrs["placements"] == ("R", "S(0)")
    assert graph.node("input_ids").attrs["requires_grad"] is False  # integer ids: no gradient
    a = analyze(graph)
    assert a.report()["tensors"]["embed/Gather"]["placements"] == ["S(0)", "P(sum)"]  # each rank its own rows
    rep = run_graph(graph, backward=True)
    assert rep.ok and "tok_embeddings.weight" in rep.grads
    cols = from_onnx(model, {"mesh": mesh, "parameters": {"tok_embeddings.weight": "colwise"}})
    assert cols.node("tok_embeddings.weight").attrs["placements"] == ("R", "S(1)")
    with pytest.raises(SpecError) as err:  # vocab needs an embedding
        from_onnx(llama_onnx(), dict(LLAMA_PLAN, parameters={"*.wq.weight": "vocab"}))
    assert err.value.code == "preset-misfit" and "embedding table" in err.value.message


@pytest.mark.parametrize("example", ["llama_block.onnx", "llama_block.mindir"])
def test_damaged_model_files_are_refused_on_one_line(tmp_path, capsys, example):
    """Seeded random damage (bytes changed, the file cut, a run spliced in): every run ends with
    exit 1 (a damaged weight is still a model) or a typed one-line error, never an internal error."""
    import random

    from pathlib import Path

    if example.endswith(".mindir"):
        pytest.importorskip("mindspore")
    root = Path(__file__).resolve().parent.parent / "examples"
    data = (root / example).read_bytes()
    rng = random.Random(7)
    codes = Counter()
    for k in range(40):
        damaged = bytearray(data)
        kind = k % 3
        if kind == 0:
            for _ in range(rng.randint(1, 20)):
                damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        elif kind == 1:
            damaged = damaged[:rng.randrange(len(damaged))]
        else:
            at = rng.randrange(len(damaged))
            damaged[at:at + rng.randint(1, 200)] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 50)))
        path = tmp_path / f"damaged{Path(example).suffix}"
        path.write_bytes(bytes(damaged))
        rc = main(["check", str(path), "--plan", str(root / "llama_plan.yaml")])
        err = capsys.readouterr().err
        assert rc in (1, 2) and err.count("\n") == (rc == 2), (k, err)
        assert "internal-error" not in err and "Traceback" not in err, (k, err)
        codes[err.split(": ")[2].split(" ")[0] if rc == 2 else "violations"] += 1
    assert codes["bad-model"] >= 20  # most damage breaks the file itself


def test_unreadable_plans_are_one_line(tmp_path, capsys):
    model = write(tmp_path, "m.onnx", llama_onnx())
    one_line_error(capsys, ["check", str(model), "--plan", str(tmp_path / "none.yaml")], "plan-not-found")
    bad = tmp_path / "bad.yaml"
    bad.write_text("mesh: {shape: [2, 2, 2]\n")
    one_line_error(capsys, ["check", str(model), "--plan", str(bad)], "plan-syntax")
    for plan, code in (({"mesh": {"shape": [2]}, "layers": 3}, "unknown-key"), ({"inputs": {}}, "missing-key"),
                       ({"mesh": {"shape": [2]}, "parameters": ["*"]}, "bad-type"),
                       ({"mesh": {"shape": [2]}, "inputs": {"x": {"shape": [2, 8, 32], "layout": "R"}}},
                        "unknown-key")):
        one_line_error(capsys, ["check", str(model), "--plan", str(plan_file(tmp_path, plan))], code)
    # the shorthands: R for an input and for a parameter
    plan = {"mesh": {"shape": [2], "names": ["tp"]}, "inputs": {"x": "R"}, "parameters": {"*": "R"}}
    graph = from_onnx(llama_onnx(), plan)
    assert {n.attrs["placements"] for n in graph.inputs()} == {("R",)}


def test_plan_entries_auto_and_tensor_map():
    plan = copy.deepcopy(LLAMA_PLAN)
    plan["parameters"] = {"*.attention.wq.weight": "auto", "*.attention.wk.weight": {"tensor_map": [-1, 0]},
                          "*.attention.wv.weight": {"placements": ["R", "R", "S(1)"]}, **plan["parameters"]}
    graph = from_onnx(llama_onnx(), plan)
    assert graph.node("layers.0.attention.wq.weight").attrs["placements"] == "auto"
    assert graph.node("layers.0.attention.wk.weight").attrs["placements"] == ("R", "R", "S(1)")  # 0 = tp, innermost
    assert graph.node("layers.0.attention.wv.weight").attrs["placements"] == ("R", "R", "S(1)")
    a = analyze(graph, reshard=True)
    assert a.ok and any("layers.0.attention.wq.weight" in note for note in a.notes)  # complete chose its layout


def test_plan_inputs_may_say_requires_grad():
    plan = copy.deepcopy(LLAMA_PLAN)
    plan["inputs"]["cos"] = {"placements": ["R", "S(1)", "R"], "requires_grad": False}
    graph = from_onnx(llama_onnx(), plan)
    assert graph.node("cos").attrs["requires_grad"] is False and graph.node("sin").attrs["requires_grad"] is True
    rep = run_graph(graph, backward=True)
    assert rep.ok and "cos" not in rep.grads and "sin" in rep.grads


def test_a_general_gemm_computes_what_onnx_computes():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6])
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 6)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "c")]
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "c"], ["y"], transA=1, alpha=2.0, beta=0.5)], "g", [x], [y], inits),
        opset_imports=[helper.make_opsetid("", 17)])
    graph = from_onnx(model, {"mesh": {"shape": [2], "names": ["tp"]}, "inputs": {"x": ["S(1)"]}})
    assert Counter(n.op for n in graph.nodes if not n.is_input) == {"transpose": 1, "matmul": 1, "scale": 2, "add": 1}
    feeds = {"x": rng.standard_normal((8, 4)).astype(np.float32)}
    (want,) = ReferenceEvaluator(model).run(None, feeds)
    (got,) = one_device(graph, model, feeds).values()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("x_shape,w_shape,placements", [
    ((4, 8), (8,), ["S(0)"]), ((8,), (8, 6), ["R"]), ((8,), (8,), ["R"]), ((3, 4, 8), (8,), ["S(1)"]),
    ((8,), (2, 8, 5), ["R"])], ids=["matrix-vector", "vector-matrix", "dot", "batch-vector", "vector-batch"])
def test_a_matmul_with_a_vector_computes_what_onnx_computes(x_shape, w_shape, placements):
    """A 1-D operand of MatMul (numpy's rule: a row on the left, a column on the right, its dim
    dropped) imported as matmul_nd, which takes 2-D and up: check then said invalid-rank."""
    out_shape = np.matmul(np.empty(x_shape), np.empty(w_shape)).shape  # numpy's rule, which ONNX follows
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out_shape))
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal(w_shape).astype(np.float32), "w")
    model = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [w]),
                              opset_imports=[helper.make_opsetid("", 17)])
    graph = from_onnx(model, {"mesh": {"shape": [2], "names": ["tp"]}, "inputs": {"x": placements}})
    assert analyze(graph).ok
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32)}
    (want,) = ReferenceEvaluator(model).run(None, feeds)
    (got,) = one_device(graph, model, feeds).values()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    rep = run_graph(graph, backward=True)
    assert rep.ok, rep.mismatches


def test_import_no_fuse_writes_the_decomposed_graph(tmp_path, capsys):
    model, plan = write(tmp_path, "m.onnx", llama_onnx()), plan_file(tmp_path)
    out = tmp_path / "unfused.yaml"
    assert main(["import", str(model), "--plan", str(plan), "--no-fuse", "-o", str(out)]) == 0
    ops = Counter(nd["op"] for nd in yaml.safe_load(out.read_text())["nodes"])
    assert ops["pow"] == 2 and ops["reciprocal"] == 2 and ops["sigmoid"] == 1 and ops["batch_matmul"] == 2
    assert "rms_norm" not in ops and "scaled_dot_product_attention" not in ops
    capsys.readouterr()
    assert main(["check", str(out), "--reshard"]) == 0  # every op of the decomposed graph is known
    assert main(["run", str(out)]) == 0


def test_a_plan_file_of_any_name(tmp_path, capsys):
    model = write(tmp_path, "m.onnx", llama_onnx())
    plan = tmp_path / "megatron.plan"
    plan.write_text(yaml.safe_dump(LLAMA_PLAN, sort_keys=False))
    assert main(["check", str(model), "--plan", str(plan), "--reshard"]) == 0
    one_line_error(capsys, ["check", str(model), "--plan", str(tmp_path / "missing.plan")], "plan-not-found")


def test_weights_in_an_external_data_file_are_not_read(tmp_path, capsys):
    path = tmp_path / "external.onnx"
    onnx.save(llama_onnx(), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=1024)  # the weights go to the side file, constants stay
    (tmp_path / "weights.bin").unlink()  # shapes and dtypes are in the model file; the values are never needed
    assert moves(load_model(path, LLAMA_PLAN)) == moves(from_onnx(llama_onnx(), LLAMA_PLAN))
    # every tensor outside, even the axes of an Unsqueeze: the small ones are read from the side file
    onnx.save(llama_onnx(), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="all.bin", size_threshold=0)
    assert moves(load_model(path, LLAMA_PLAN)) == moves(from_onnx(llama_onnx(), LLAMA_PLAN))
    (tmp_path / "all.bin").unlink()
    err = one_line_error(capsys, ["check", str(path), "--plan", str(plan_file(tmp_path))])
    assert "external data file" in err


# ------------------------------------------------------------------------ hostile models
TP = {"mesh": {"shape": [2], "names": ["tp"]}}


def _tiny(nodes, inputs, outputs, inits=(), opset=17):
    """A model from (name, shape) inputs and outputs (float32; a shape of None is left to inference)."""
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs]
    model = helper.make_model(helper.make_graph(nodes, "g", info, outs, list(inits)),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _external(name, dims, location, dtype=TensorProto.FLOAT, length=None):
    """A tensor whose data is in the file ``location`` (relative to the model, as onnx.save writes it)."""
    t = TensorProto(name=name, data_type=dtype, dims=dims, data_location=TensorProto.EXTERNAL)
    t.external_data.add(key="location", value=location)
    if length is not None:
        t.external_data.add(key="length", value=str(length))
    return t


def _scaled_by_external(models, location, name="m.onnx"):
    """x * c, c a Constant whose float32 scalar is in the file ``location``."""
    const = helper.make_node("Constant", [], ["c"], value=_external("cval", [], location, length=4))
    return write(models, name, _tiny([const, helper.make_node("Mul", ["x", "c"], ["y"])], [("x", [4])], [("y", [4])]))


@pytest.fixture
def home(tmp_path, monkeypatch):
    """The current folder, holding a secret, and a separate folder of models."""
    (tmp_path / "home").mkdir()
    (tmp_path / "models").mkdir()
    (tmp_path / "home" / "secret.bin").write_bytes(b"SECR" * 4)
    monkeypatch.chdir(tmp_path / "home")
    return tmp_path / "home"


def test_a_constant_in_external_data_is_read_beside_the_model_never_from_the_current_folder(tmp_path, capsys, home):
    """A Constant's value in external data follows the initializers' rule: at most 1 KiB, read
    from beside the model (secret.bin is in the current folder, not beside the model)."""
    plan, models = plan_file(tmp_path, TP), tmp_path / "models"
    out = tmp_path / "leak.yaml"
    err = one_line_error(capsys, ["import", str(_scaled_by_external(models, "secret.bin")), "--plan", str(plan),
                                  "-o", str(out)])
    assert "'c' (Constant)" in err and "external data file that cannot be read" in err and not out.exists()
    (models / "two.bin").write_bytes(np.float32(2.5).tobytes())  # beside the model it is read, as an initializer is
    assert main(["import", str(_scaled_by_external(models, "two.bin")), "--plan", str(plan), "-o", str(out)]) == 0
    assert [(n["op"], n["attrs"]) for n in yaml.safe_load(out.read_text())["nodes"]] == [("scale", {"factor": 2.5})]


def test_a_constant_in_external_data_at_an_absolute_path_is_bad_model(tmp_path, capsys, home):
    model = _scaled_by_external(tmp_path / "models", str(home / "secret.bin"))
    err = one_line_error(capsys, ["import", str(model), "--plan", str(plan_file(tmp_path, TP))])
    assert "'c' (Constant)" in err and "absolute path" in err


def test_constant_of_shapes_value_in_external_data_follows_the_same_rule(tmp_path, capsys, home):
    value = _external("v", [1], "secret.bin", TensorProto.INT64, length=8)
    model = _tiny([helper.make_node("ConstantOfShape", ["s"], ["k"], value=value),
                   helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT),
                   helper.make_node("Add", ["x", "kf"], ["y"])], [("x", [4])], [("y", [4])], [_i64("s", [4])])
    err = one_line_error(capsys, ["import", str(write(tmp_path / "models", "cos.onnx", model)), "--plan",
                                  str(plan_file(tmp_path, TP))])
    assert "attribute 'value' of node 'k' (ConstantOfShape)" in err and "external data file" in err


def test_a_model_in_memory_has_no_folder_to_read_external_data_from(tmp_path, home):
    model = onnx.load(str(_scaled_by_external(tmp_path / "models", "secret.bin")), load_external_data=False)
    with pytest.raises(SpecError) as caught:
        from_onnx(model, TP)  # not read from the current folder
    assert caught.value.code == "bad-model" and "in memory" in caught.value.message


def test_a_constant_over_1_kib_in_external_data_is_never_read_nor_folded(tmp_path):
    """As a weight in external data: only its shape and dtype are used (the file need not exist)."""
    big = helper.make_node("Constant", [], ["c"], value=_external("cval", [512], "absent.bin"))
    graph = from_onnx(_tiny([big, helper.make_node("Add", ["x", "c"], ["y"])], [("x", [512])], [("y", [512])]), TP)
    assert [n.op for n in graph.nodes if not n.is_input] == ["add"]
    assert graph.node("c").attrs["requires_grad"] is False


def _i64(name, value):
    return numpy_helper.from_array(np.array(value, np.int64), name)


def _hostile(case):
    mm = helper.make_node("MatMul", ["x", "w"], ["y"])
    if case == "short":  # 3 floats for dims [4, 4]
        w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4, 4], float_data=[0.0] * 3)
        return _tiny([mm], [("x", [2, 4])], [("y", [2, 4])], [w])
    if case == "odd":  # 7 bytes of float32
        w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4, 4], raw_data=b"\0" * 7)
        return _tiny([mm], [("x", [2, 4])], [("y", [2, 4])], [w])
    add = helper.make_node("Add", ["x", "w"], ["y"])
    if case == "negative":  # numpy's reshape took [-4, 4] for [4, 4]: imported, exit 0
        w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[-4, 4], raw_data=b"\0" * 64)
        return _tiny([add], [("x", [1])], [("y", None)], [w])
    if case == "huge-external":  # not read, but numpy's zero view of it was an internal error
        return _tiny([add], [("x", [1])], [("y", None)], [_external("w", [2 ** 62, 32], "absent.bin")])
    if case == "strings":  # converted to float32: an internal error
        return _tiny([add], [("x", [1])], [("y", None)],
                     [TensorProto(name="w", data_type=TensorProto.STRING, dims=[2], string_data=[b"a", b"b"])])
    if case == "complex":  # cast to float32 with numpy's ComplexWarning on stderr
        return _tiny([add], [("x", [1])], [("y", None)],
                     [TensorProto(name="w", data_type=TensorProto.COMPLEX64, dims=[2], raw_data=b"\0" * 16)])
    if case == "missing":
        return _tiny([helper.make_node("Add", ["x", "nope"], ["y"])], [("x", [4])], [("y", [4])])
    if case == "gather0":  # a constant index on a dim of size 0
        return _tiny([helper.make_node("Gather", ["x", "i"], ["y"], axis=0)], [("x", [0, 4])], [("y", None)],
                     [_i64("i", 0)])
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(np.ones(1, np.float32), "v"), _i64("i", [0]), [2])
    return _tiny([helper.make_node("Constant", [], ["c"], sparse_value=sparse),
                  helper.make_node("Add", ["x", "c"], ["y"])], [("x", [2])], [("y", [2])])


@pytest.mark.parametrize("case, code, named", [
    ("short", "bad-model", "initializer 'w' has data that does not fit its dims [4, 4]"),
    ("odd", "bad-model", "initializer 'w' has data that does not fit its dims [4, 4] and data type float32 "
     "(7 bytes given, 64 needed)"),
    ("negative", "bad-model", "initializer 'w' has negative dims [-4, 4]"),
    ("huge-external", "bad-model", "initializer 'w' has dims [4611686018427387904, 32] of float32: "
     "590,295,810,358,705,651,712 bytes, over the 4,611,686,018,427,387,904 (2^62) a tensor may take"),
    ("strings", "unsupported-dtype", "constant 'w' has dtype string"),
    ("complex", "unsupported-dtype", "constant 'w' has dtype complex"),
    ("missing", "bad-model", "node 'y' (Add) reads 'nope', which no graph input"),
    ("gather0", "bad-model", "node 'y' (Gather) has index 0, out of range for dim 0 of 'x' (size 0)"),
    ("sparse", "unknown-op", "node 'c' (Constant) holds a sparse_value"),
])
def test_hostile_models_are_one_coded_line_naming_the_value(tmp_path, capsys, case, code, named):
    model = write(tmp_path, f"{case}.onnx", _hostile(case))
    err = one_line_error(capsys, ["import", str(model), "--plan", str(plan_file(tmp_path, TP))], code)
    assert named in err


@pytest.mark.parametrize("index, axis", [(7, 0), ([-5], 1), (3, 0), ([0, -4], 0)])
def test_gather_indices_out_of_range_are_bad_model(tmp_path, capsys, index, axis):
    """ONNX's indices lie in [-s, s-1]; numpy's take would wrap 7 on a dim of 3 (or -5 on 4) to a valid one."""
    model = _tiny([helper.make_node("Gather", ["x", "i"], ["y"], axis=axis)], [("x", [3, 4])], [("y", None)],
                  [_i64("i", index)])
    plan = plan_file(tmp_path, TP)
    err = one_line_error(capsys, ["import", str(write(tmp_path, "g.onnx", model)), "--plan", str(plan)])
    bad = np.array(index).reshape(-1)[-1]
    assert f"node 'y' (Gather) has index {bad}, out of range for dim {axis} of 'x' (size {[3, 4][axis]})" in err
    if axis == 1:
        graph = from_onnx(_tiny([helper.make_node("Gather", ["x", "i"], ["y"], axis=1)], [("x", [3, 4])],
                                [("y", None)], [_i64("i", [-4])]), TP)  # the first column: in range
        assert [(n.op, n.attrs) for n in graph.nodes if not n.is_input] == [
            ("slice", {"axis": 1, "start": 0, "stop": 1})]


_ONES = numpy_helper.from_array(np.ones(2, np.float32), "x")


@pytest.mark.parametrize("model, message", [
    (_tiny([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Sigmoid", ["x"], ["y"])], [("x", [2])],
           [("y", [2])]), "node 'y' (Sigmoid) writes 'y', which node 'y' (Relu) already defines"),
    (_tiny([helper.make_node("Add", ["x", "x"], ["y"])], [("x", [2]), ("x", [2])], [("y", [2])]),
     "graph input 'x' is listed twice"),
    (_tiny([helper.make_node("Relu", ["x"], ["x"])], [("x", [2])], [("x", [2])]),
     "writes 'x', which a graph input already defines"),
    (_tiny([helper.make_node("Add", ["x", "x"], ["y"])], [("x", [2])], [("y", [2])], [_ONES, _ONES]),
     "initializer 'x' is defined twice"),
], ids=["two-nodes", "two-inputs", "node-over-input", "two-initializers"])
def test_a_value_defined_twice_is_bad_model(tmp_path, capsys, model, message):
    plan = plan_file(tmp_path, TP)
    err = one_line_error(capsys, ["import", str(write(tmp_path, "m.onnx", model)), "--plan", str(plan)])
    assert message in err


def test_an_input_an_initializer_gives_a_default_is_one_value(tmp_path, capsys):
    defaulted = _tiny([helper.make_node("Add", ["x", "x"], ["y"])], [("x", [2])], [("y", [2])], [_ONES])
    assert main(["import", str(write(tmp_path, "m.onnx", defaulted)), "--plan", str(plan_file(tmp_path, TP))]) == 0


_BIG = 17_000_000  # over the 2^24 elements a folded constant may hold


@pytest.mark.parametrize("nodes, inits, message", [
    ([helper.make_node("ConstantOfShape", ["s"], ["k"], name="fill")], [_i64("s", [5000, 5000])],
     "'fill' (ConstantOfShape) would give shape [5000, 5000] (25,000,000 elements)"),
    ([helper.make_node("Expand", ["one", "s"], ["k"], name="grow")], [_i64("one", [[1]]), _i64("s", [5000, 5000])],
     "'grow' (Expand) would give shape [5000, 5000]"),
    ([helper.make_node("Range", ["a", "b", "d"], ["k"], name="r")], [_i64("a", 0), _i64("b", _BIG), _i64("d", 1)],
     f"'r' (Range) would give shape [{_BIG}]"),  # refused before onnx's data propagation computes it
], ids=["ConstantOfShape", "Expand", "Range"])
def test_constant_folding_is_bounded(tmp_path, capsys, nodes, inits, message):
    """A folded constant holds at most MAX_FOLD_ELEMENTS: a bigger one is refused before it is allocated."""
    model = _tiny(nodes + [helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT),
                           helper.make_node("Add", ["x", "kf"], ["y"])], [("x", [1, 1])], [("y", None)], inits)
    err = one_line_error(capsys, ["import", str(write(tmp_path, "m.onnx", model)), "--plan",
                                  str(plan_file(tmp_path, TP))], "too-large")
    assert message in err and "over the 16,777,216 (2^24) elements a folded constant may hold" in err


@pytest.mark.parametrize("nodes, inits, message", [
    ([helper.make_node("Range", ["a", "b", "d"], ["k"], name="r")], [_i64("a", 0), _i64("b", 10), _i64("d", 0)],
     "'r' (Range): its delta is 0"),
    ([helper.make_node("Div", ["n", "z"], ["k"], name="q")], [_i64("n", [4]), _i64("z", [0])],
     "'q' (Div): an integer division by zero"),
], ids=["Range-step-0", "integer-Div-by-0"])
def test_folding_what_numpy_only_warns_about_is_bad_model(tmp_path, capsys, recwarn, nodes, inits, message):
    model = _tiny(nodes + [helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT),
                           helper.make_node("Add", ["x", "kf"], ["y"])], [("x", [1])], [("y", None)], inits)
    err = one_line_error(capsys, ["import", str(write(tmp_path, "m.onnx", model)), "--plan",
                                  str(plan_file(tmp_path, TP))])
    assert message in err
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]  # no warning line on stderr
