"""Real models in through ONNX (issue #29, the import parts): torch's module names kept, constant
chains folded, more op types mapped, computed tables imported as constants, and ``import`` without
a plan.  The models are small hand-written ONNX graphs laid out as torch's exporters write them
(the dynamo exporter's node metadata included), each checked against onnx's ReferenceEvaluator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from layout_prop.api import analyze  # noqa: E402
from layout_prop.cli import main  # noqa: E402
from layout_prop.frontends.onnx import from_onnx, read_onnx  # noqa: E402
from layout_prop.runner import execute_global  # noqa: E402

PLAN1 = {"mesh": {"shape": [2], "names": ["tp"]}}
LLAMA_BLOCK = str(Path(__file__).resolve().parent.parent / "examples" / "llama_block.onnx")


def const(name, array):
    return helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(np.asarray(array)))


def model_of(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def one_device(graph, model, feeds):
    """The imported graph's outputs on one device, fed the model's own initializers and folded
    constants (by ``graph.meta["import_sources"]``) and ``feeds``."""
    consts = {k: v.const for k, v in read_onnx(model).values.items() if v.const is not None}
    sources = graph.meta["import_sources"]
    a = analyze(graph)
    inputs = {n.name: feeds[n.name] if n.name in feeds else consts[sources[n.name]] for n in a.graph.inputs()}
    return execute_global(a.graph, inputs, wanted=a.graph.outputs)


def same_as_onnx(model, feeds, plan=PLAN1, rtol=1e-5, atol=1e-6):
    """Import ``model`` and compare every output with onnx's ReferenceEvaluator; returns the graph."""
    want = ReferenceEvaluator(model).run(None, feeds)
    graph = from_onnx(model, plan)
    got = list(one_device(graph, model, feeds).values())
    assert len(got) == len(want)
    for g_, w in zip(got, want):
        np.testing.assert_allclose(g_, w, rtol=rtol, atol=atol)
    return graph


def one_line_error(capsys, argv, code):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and code in err, err
    return err


def plan_path(tmp_path, plan=PLAN1, name="plan.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


# ------------------------------------------------------------------------------------- folding
def expand_minus_one_model():
    """TorchScript's ``x.expand(2, 3, -1)``: the shape is ``Where(Equal(target, ones * -1), ones, target)``."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [const("target", np.array([2, 3, -1], np.int64)), const("three", np.array([3], np.int64)),
             helper.make_node("ConstantOfShape", ["three"], ["ones"], value=numpy_helper.from_array(
                 np.array([1], np.int64))),
             const("minus_one", np.array(-1, np.int64)),
             helper.make_node("Mul", ["ones", "minus_one"], ["neg"]),
             helper.make_node("Equal", ["target", "neg"], ["eq"]),
             helper.make_node("Where", ["eq", "ones", "target"], ["shape"]),
             helper.make_node("Expand", ["x", "shape"], ["e"], name="expand"),
             helper.make_node("Relu", ["e"], ["y"])]
    return model_of(nodes, [x], [y])


def test_an_all_constant_expand_shape_chain_is_folded():
    model = expand_minus_one_model()
    x = np.random.default_rng(0).standard_normal((2, 1, 4)).astype(np.float32)
    graph = same_as_onnx(model, {"x": x})
    assert analyze(graph).graph.node("y").meta["specs"][0].shape == (2, 3, 4)


def test_a_shape_computed_from_data_is_dynamic_shape_naming_the_node(tmp_path, capsys):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 1, 4])
    s = helper.make_tensor_value_info("s", TensorProto.INT64, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Abs", ["s"], ["t"]), helper.make_node("Expand", ["x", "t"], ["e"], name="expand"),
             helper.make_node("Relu", ["e"], ["y"])]
    path = tmp_path / "m.onnx"
    onnx.save(model_of(nodes, [x, s], [y]), str(path))
    err = one_line_error(capsys, ["import", str(path), "--plan", str(plan_path(tmp_path))], "dynamic-shape")
    assert "node 'expand' (Expand)" in err and "every input's shape is static" in err
    assert "inputs.NAME.shape" not in err  # the hint of a dynamic input does not fit here


# --------------------------------------------------------------------------------------- names
def torch_meta(node, fx: str, scopes: list[str]):
    """Node metadata as torch's dynamo exporter writes it."""
    for key, value in (("pkg.torch.onnx.fx_node", fx), ("pkg.torch.onnx.name_scopes", repr(scopes)),
                       ("namespace", ": Model/" + "/".join(s for s in scopes[1:]))):
        entry = node.metadata_props.add()
        entry.key, entry.value = key, value
    return node


def dynamo_like_model():
    """Two layers as the dynamo exporter writes them with optimize=True: each Linear weight folded
    transposed into an initializer named ``val_N``, one norm weight de-duplicated for both layers,
    and a cos table computed from no parameter."""
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "val_7"),
             numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "val_19"),
             numpy_helper.from_array(np.ones(8, np.float32), "layers.0.norm.weight"),
             numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "unsqueeze_3")]
    nodes = []
    h = "x"
    for layer, weight in ((0, "val_7"), (1, "val_19")):
        scope = ["", "layers", f"layers.{layer}"]
        matmul = helper.make_node("MatMul", [h, weight], [f"linear_{layer}"], name=f"node_linear_{layer}")
        nodes.append(torch_meta(matmul,
                                f"%linear_{layer} : [num_users=1] = call_function[target=torch.ops.aten.linear.default]"
                                f"(args = (%{h}, %p_layers_{layer}_q_proj_weight), kwargs = {{}})",
                                scope + [f"layers.{layer}.q_proj", f"linear_{layer}"]))
        nodes.append(torch_meta(helper.make_node("Mul", ["layers.0.norm.weight", f"linear_{layer}"], [f"mul_{layer}"],
                                                 name=f"node_mul_{layer}"),
                                f"%mul_{layer} : [num_users=1] = call_function[target=torch.ops.aten.mul.Tensor]"
                                f"(args = (%p_layers_{layer}_norm_weight, %linear_{layer}), kwargs = {{}})",
                                scope + [f"layers.{layer}.norm", f"mul_{layer}"]))
        h = f"mul_{layer}"
    nodes.append(torch_meta(helper.make_node("Mul", [h, "unsqueeze_3"], ["y"], name="node_mul_cos"),
                            "%mul_9 : [num_users=1] = call_function[target=torch.ops.aten.mul.Tensor]"
                            "(args = (%mul_1, %unsqueeze_3), kwargs = {})", ["", "mul_9"]))
    return model_of(nodes, [x], [y], inits)


def test_a_plan_in_torchs_module_names_matches_the_dynamo_exporters_weights():
    model = dynamo_like_model()
    plan = dict(PLAN1, parameters={"layers.*.q_proj.weight": "colwise", "*": "R"})
    x = np.random.default_rng(1).standard_normal((2, 4, 8)).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"x": x})
    graph = from_onnx(model, plan)
    inputs = {n.name: n for n in graph.inputs()}
    assert graph.meta["import_sources"]["layers.0.q_proj.weight"] == "val_7"
    assert graph.meta["import_sources"]["layers.1.q_proj.weight"] == "val_19"
    assert "val_7" not in inputs and "val_19" not in inputs
    for name in ("layers.0.q_proj.weight", "layers.1.q_proj.weight"):
        assert list(inputs[name].attrs["placements"]) == ["S(1)"]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    a = analyze(graph)
    feeds = {n.name: x if n.name == "x" else inits[graph.meta["import_sources"][n.name]] for n in a.graph.inputs()}
    (got,) = execute_global(a.graph, feeds, wanted=a.graph.outputs).values()
    np.testing.assert_allclose(got, want[0], rtol=1e-5, atol=1e-6)


def test_a_pattern_hitting_a_de_duplicated_tensor_is_noted_and_conflicts_are_refused(tmp_path, capsys):
    model = dynamo_like_model()
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    plan = plan_path(tmp_path, dict(PLAN1, parameters={"layers.1.norm.weight": "R", "*": "R"}))
    assert main(["import", str(path), "--plan", str(plan), "-o", str(tmp_path / "s.yaml")]) == 0
    err = capsys.readouterr().err
    assert "parameter layers.0.norm.weight is one tensor the exporter de-duplicated, shared as " \
           "layers.0.norm.weight, layers.1.norm.weight" in err
    conflict = plan_path(tmp_path, dict(PLAN1, parameters={"layers.1.norm.weight": ["S(0)"], "*": "R"}), "c.yaml")
    err = one_line_error(capsys, ["import", str(path), "--plan", str(conflict)], "bad-plan")
    assert "one shared tensor" in err and "layers.1.norm.weight" in err


def test_a_table_no_parameter_names_is_a_constant_without_gradient(tmp_path, capsys):
    graph = from_onnx(dynamo_like_model(), dict(PLAN1, parameters={"*": "R"}))
    inputs = {n.name: n for n in graph.inputs()}
    assert inputs["unsqueeze_3"].attrs["requires_grad"] is False
    assert inputs["layers.0.q_proj.weight"].attrs["requires_grad"] is True
    assert any("constants without a gradient: unsqueeze_3" in note for note in graph.meta["import_notes"])
    a = analyze(graph, backward=True)
    assert not any(n.name.endswith("unsqueeze_3") for n in a.graph.nodes if n.name.startswith("grad"))


# -------------------------------------------------------------------------------------- fusions
def gelu_model(kind: str):
    """GELU as torch writes it: ``x * 0.5 * (1 + erf(x / sqrt(2)))`` (BERT), the same with ``0.5 * x``
    first, or the tanh form ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`` (GPT-2's NewGELU)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    c = [const("sqrt2", np.float32(np.sqrt(2.0))), const("one", np.float32(1.0)), const("half", np.float32(0.5)),
         const("three", np.float32(3.0)), const("k", np.float32(0.044715)), const("s", np.float32(np.sqrt(2 / np.pi)))]
    if kind == "erf":
        nodes = [helper.make_node("Div", ["x", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                 helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", ["x", "a"], ["m"]),
                 helper.make_node("Mul", ["m", "half"], ["y"])]
    elif kind == "erf_half_first":
        nodes = [helper.make_node("Mul", ["x", "half"], ["h"]), helper.make_node("Div", ["x", "sqrt2"], ["d"]),
                 helper.make_node("Erf", ["d"], ["e"]), helper.make_node("Add", ["one", "e"], ["a"]),
                 helper.make_node("Mul", ["h", "a"], ["y"])]
    else:
        nodes = [helper.make_node("Mul", ["half", "x"], ["h"]), helper.make_node("Pow", ["x", "three"], ["p"]),
                 helper.make_node("Mul", ["k", "p"], ["kp"]), helper.make_node("Add", ["x", "kp"], ["inner"]),
                 helper.make_node("Mul", ["s", "inner"], ["si"]), helper.make_node("Tanh", ["si"], ["t"]),
                 helper.make_node("Add", ["one", "t"], ["a"]), helper.make_node("Mul", ["h", "a"], ["y"])]
    return model_of(c + nodes, [x], [y])


@pytest.mark.parametrize("kind, op", [("erf", "gelu_erf"), ("erf_half_first", "gelu_erf"), ("tanh", "gelu")])
def test_gelu_written_out_is_one_gelu_op(kind, op):
    model = gelu_model(kind)
    x = (3 * np.random.default_rng(2).standard_normal((2, 3, 8))).astype(np.float32)
    graph = same_as_onnx(model, {"x": x})
    assert [n.op for n in graph.nodes if not n.is_input] == [op]
    plan = dict(PLAN1, inputs={"x": ["S(2)"]})
    from layout_prop.runner import run_graph

    rep = run_graph(from_onnx(model, plan), backward=True, seed=4)
    assert rep.ok and "x" in rep.grads, rep.mismatches


def rope_table_model():
    """Rotate-half RoPE whose cos and sin tables are initializers (an exporter's constant folding),
    in a model without torch's metadata."""
    rng = np.random.default_rng(3)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [numpy_helper.from_array(rng.standard_normal((1, 1, 4, 8)).astype(np.float32), "cos_folded"),
             numpy_helper.from_array(rng.standard_normal((1, 1, 4, 8)).astype(np.float32), "sin_folded")]
    nodes = [const("zero", np.array([0], np.int64)), const("half", np.array([4], np.int64)),
             const("end", np.array([8], np.int64)), const("axis", np.array([3], np.int64)),
             helper.make_node("Slice", ["x", "zero", "half", "axis"], ["x1"]),
             helper.make_node("Slice", ["x", "half", "end", "axis"], ["x2"]),
             helper.make_node("Neg", ["x2"], ["n"]), helper.make_node("Concat", ["n", "x1"], ["rot"], axis=-1),
             helper.make_node("Mul", ["x", "cos_folded"], ["a"]), helper.make_node("Mul", ["rot", "sin_folded"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["y"])]
    return model_of(nodes, [x], [y], inits)


def test_rotary_tables_folded_into_initializers_take_no_gradient():
    model = rope_table_model()
    x = np.random.default_rng(5).standard_normal((1, 2, 4, 8)).astype(np.float32)
    graph = same_as_onnx(model, {"x": x})
    inputs = {n.name: n for n in graph.inputs()}
    assert inputs["cos_folded"].attrs["requires_grad"] is False and inputs["sin_folded"].attrs["requires_grad"] is False
    assert [n.op for n in graph.nodes if not n.is_input] == ["rotary_position_embedding"]
    assert any("cos_folded, sin_folded" in note for note in graph.meta["import_notes"])
    from layout_prop.runner import run_graph

    rep = run_graph(from_onnx(model, dict(PLAN1, inputs={"x": ["S(1)"]})), backward=True, seed=6)
    assert rep.ok and "x" in rep.grads and "cos_folded" not in rep.grads, rep.mismatches


# ------------------------------------------------------------------------- import without a plan
def test_import_without_a_plan_lists_the_parameters_and_writes_a_skeleton(tmp_path, capsys):
    skeleton = tmp_path / "skeleton.yaml"
    assert main(["import", LLAMA_BLOCK, "-o", str(skeleton)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:11]}
    assert rows["layers.0.attention.wq.weight"] == ["[32,", "32]", "matmul", "colwise"]
    assert rows["layers.0.attention.wo.weight"][-1] == "rowwise"  # its input comes from attention
    assert rows["layers.0.feed_forward.w2.weight"][-1] == "rowwise"  # from silu_mul
    assert rows["layers.0.ffn_norm.weight"][-2:] == ["rms_norm", "R"]
    plan = yaml.safe_load(skeleton.read_text())
    assert plan["inputs"] == {"x": "R", "cos": "R", "sin": "R"} and len(plan["parameters"]) == 9
    # the skeleton is a plan the model takes as it is: import, then run the sharded backward
    assert main(["import", LLAMA_BLOCK, "--plan", str(skeleton), "-o", str(tmp_path / "s.yaml")]) == 0
    assert main(["run", LLAMA_BLOCK, "--plan", str(skeleton), "--backward"]) == 0
    assert "matches one device" in capsys.readouterr().out


def test_the_skeleton_names_a_shared_tensor_once_with_its_other_names(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(dynamo_like_model(), str(path))
    assert main(["import", str(path), "-o", str(tmp_path / "p.yaml")]) == 0
    captured = capsys.readouterr()
    assert "layers.0.norm.weight *" in captured.out
    assert "one tensor the exporter de-duplicated, also named layers.1.norm.weight" in captured.out
    assert "constants without a gradient: unsqueeze_3" in captured.err
    plan = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert list(plan["parameters"]) == ["layers.0.q_proj.weight", "layers.0.norm.weight", "layers.1.q_proj.weight"]


# -------------------------------------------------------------------------------------- coverage
def coverage_model():
    """GatherElements, CumSum, Where on a run-time condition, Sin, Cos, CastLike and a Gather of run-time
    indices, beside a mask chain of Range, Equal, LessOrEqual, Not, And, CastLike and GatherND that folds."""
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("x", f, [4, 6]),
              helper.make_tensor_value_info("idx", TensorProto.INT64, [4, 3]),
              helper.make_tensor_value_info("keep", TensorProto.BOOL, [4, 6]),
              helper.make_tensor_value_info("rows", TensorProto.INT64, [2])]
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("g", "s", "sel", "masked")]
    nodes = [const("axis1", np.array(1, np.int64)), const("zero", np.array(0, np.int64)),
             const("six", np.array(6, np.int64)), const("one", np.array(1, np.int64)),
             const("three", np.array(3, np.int64)), const("fill", np.array(0.5, np.float32)),
             helper.make_node("GatherElements", ["x", "idx"], ["g"], axis=1),
             helper.make_node("CumSum", ["x", "axis1"], ["cs"]),
             helper.make_node("Where", ["keep", "cs", "x"], ["w"]),
             helper.make_node("Sin", ["w"], ["sn"]), helper.make_node("Cos", ["x"], ["co"]),
             helper.make_node("Add", ["sn", "co"], ["s"]),
             helper.make_node("Gather", ["x", "rows"], ["sel"], axis=0),
             # a mask from constants only: (pos <= 3) and not (pos == 0), through GatherND, cast like x
             helper.make_node("Range", ["zero", "six", "one"], ["pos"]),
             helper.make_node("LessOrEqual", ["pos", "three"], ["le"]),
             helper.make_node("Equal", ["pos", "zero"], ["eq"]),
             helper.make_node("Not", ["eq"], ["ne"]), helper.make_node("And", ["le", "ne"], ["m"]),
             helper.make_node("Unsqueeze", ["m", "zero"], ["m2"]),
             const("where_nd", np.array([[0]], np.int64)),
             helper.make_node("GatherND", ["m2", "where_nd"], ["m3"]),
             helper.make_node("CastLike", ["m3", "x"], ["mf"]),
             helper.make_node("Mul", ["x", "mf"], ["masked"])]
    return model_of(nodes, inputs, outputs)


def test_more_op_types_map_to_registry_ops_and_compute_what_onnx_computes():
    """Also GatherND and ScatterND (duplicate index tuples added up) on run-time indices."""
    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal((4, 6)).astype(np.float32), "idx": rng.integers(0, 6, (4, 3)),
             "keep": rng.random((4, 6)) < 0.5, "rows": np.array([3, 1])}
    model = coverage_model()
    graph = same_as_onnx(model, feeds)
    ops = {n.op for n in graph.nodes if not n.is_input}
    assert {"gather", "cumsum", "where", "sin", "cos", "index_select"} <= ops
    assert not ops & {"opaque", "take"}  # the mask chain folded: a constant times x
    sharded = from_onnx(model, dict(PLAN1, inputs={"x": ["S(0)"], "idx": ["S(0)"], "keep": ["S(0)"], "rows": ["R"]}))
    assert analyze(sharded, reshard=True).ok
    nd = model_of([helper.make_node("GatherND", ["x", "pairs"], ["picked"]),
                   helper.make_node("ScatterND", ["x", "pairs", "picked"], ["y"], reduction="add")],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6]),
                   helper.make_tensor_value_info("pairs", TensorProto.INT64, [3, 2])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=18)
    graph = same_as_onnx(nd, {"x": feeds["x"], "pairs": np.array([[0, 1], [3, 5], [0, 1]])})
    assert [n.op for n in graph.nodes if not n.is_input] == ["gather_nd", "scatter_nd"]


def test_one_hot_and_a_wide_expand_map_to_registry_ops():
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])
    col = helper.make_tensor_value_info("col", TensorProto.FLOAT, [4, 1])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("hot", "wide")]
    nodes = [const("depth", np.array(5, np.int64)), const("values", np.array([0.0, 1.0], np.float32)),
             const("shape", np.array([4, 100], np.int64)),
             helper.make_node("OneHot", ["ids", "depth", "values"], ["hot"], axis=-1),
             helper.make_node("Expand", ["col", "shape"], ["wide"])]  # 100 copies: torch's expand, not concats
    feeds = {"ids": np.array([[0, 4, 2], [1, 1, 3]]),
             "col": np.random.default_rng(10).standard_normal((4, 1)).astype(np.float32)}
    graph = same_as_onnx(model_of(nodes, [ids, col], outs), feeds)
    assert sorted(n.op for n in graph.nodes if not n.is_input) == ["cast", "expand", "one_hot"]


# ------------------------------------------------------------------ models exported by torch's exporters
MODELS = Path(__file__).resolve().parent.parent / "examples" / "models"
TP = {"mesh": {"shape": [2], "names": ["tp"]}}
#: a plan per fixture, in torch's module names (Megatron's column/row pairs)
FIXTURE_PLANS = {
    "llama": {"*.self_attn.[qkv]_proj.weight": "colwise", "*.self_attn.o_proj.weight": "rowwise",
              "*.mlp.gate_proj.weight": "colwise", "*.mlp.up_proj.weight": "colwise",
              "*.mlp.down_proj.weight": "rowwise", "*": "R"},
    "gpt2": {"*.mlp.c_fc.weight": "colwise", "*.mlp.c_proj.weight": "rowwise", "*": "R"},
    "bert": {"*.attention.self.query.weight": "colwise", "*.attention.self.key.weight": "colwise",
             "*.attention.self.value.weight": "colwise", "*.attention.output.dense.weight": "rowwise",
             "*.intermediate.dense.weight": "colwise", "encoder.*.output.dense.weight": "rowwise", "*": "R"},
}
FIXTURE_PLANS["qwen2"] = FIXTURE_PLANS["mistral"] = FIXTURE_PLANS["gemma"] = FIXTURE_PLANS["llama"]
# Phi-3's fused qkv_proj and gate_up_proj stay replicated here (a column shard would cut across their blocks)
FIXTURE_PLANS["phi3"] = {"*.self_attn.o_proj.weight": "rowwise", "*.mlp.down_proj.weight": "rowwise", "*": "R"}
FIXTURE_PLANS["bert_torchscript"] = FIXTURE_PLANS["t5_torchscript"] = {"*": "R"}  # the TorchScript exporter
# keeps no module names for MatMul weights (onnx::MatMul_302)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gemma", "phi3", "gpt2", "bert", "bert_torchscript",
                                  "t5_torchscript"])
def test_a_model_torch_exported_imports_with_torchs_names_and_computes_what_torch_computed(name):
    """The committed fixture (examples/models/make_fixtures.py) with a plan in torch's module names:
    fully fused, its output on its own weights what torch computed, the sharded backward one device's."""
    from layout_prop.runner import run_graph

    model = onnx.load(str(MODELS / f"{name}.onnx"))
    reference = np.load(MODELS / f"{name}.npz")
    graph = from_onnx(model, dict(TP, parameters=FIXTURE_PLANS[name]))
    ops = {n.op for n in graph.nodes if not n.is_input}
    assert "scaled_dot_product_attention" in ops and "opaque" not in ops
    biased = [n for n in graph.meta["import_notes"] if "left unfused" in n]
    if name == "t5_torchscript":  # its self-attention adds the relative-position bias: op for op, noted
        assert len(biased) == 4 and "softmax" in ops
    else:
        assert not biased and "softmax" not in ops
    (output,) = [k for k in reference.files if not k.endswith("input_ids")]
    feeds = {i.name: reference[i.name] for i in model.graph.input if i.name in reference.files}
    got = one_device(graph, model, feeds)
    np.testing.assert_allclose(next(iter(got.values())), reference[output], rtol=1e-4, atol=1e-5)
    sharded = [n.name for n in graph.inputs() if any(p != "R" for p in n.attrs.get("placements", ()))]
    assert len(sharded) == {"llama": 14, "qwen2": 14, "mistral": 14, "gemma": 14, "phi3": 4, "gpt2": 4, "bert": 12,
                            "bert_torchscript": 0, "t5_torchscript": 0}[name]
    rep = run_graph(graph, backward=True, seed=2)
    assert rep.ok, rep.mismatches


def biased_attention_model(bias: np.ndarray):
    """``softmax(q @ k^T / sqrt(d) + bias) @ v`` on BNSD tensors, ``bias`` a constant."""
    shape = [1, 2, 4, 8]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("q", "k", "v")]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [const("bias", bias.astype(np.float32)), const("root", np.float32(np.sqrt(8.0))),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Div", ["s", "root"], ["sd"]),
             helper.make_node("Add", ["sd", "bias"], ["z"]), helper.make_node("Softmax", ["z"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"], name="context")]
    return model_of(nodes, inputs, [y])


def test_attention_with_a_bias_is_left_unfused_and_noted_without_one_fused():
    rng = np.random.default_rng(8)
    feeds = {n: rng.standard_normal((1, 2, 4, 8)).astype(np.float32) for n in ("q", "k", "v")}
    position_bias = rng.standard_normal((1, 2, 4, 4))  # T5's relative-position bias: not a mask
    graph = same_as_onnx(biased_attention_model(position_bias), feeds)
    assert "scaled_dot_product_attention" not in {n.op for n in graph.nodes}
    assert any(note.startswith("attention at node context is left unfused") for note in graph.meta["import_notes"])
    graph = same_as_onnx(biased_attention_model(np.zeros((1, 1, 1, 4))), feeds)  # a padding mask of no padding
    assert "scaled_dot_product_attention" in {n.op for n in graph.nodes}
    assert not any("left unfused" in note for note in graph.meta["import_notes"])


def test_the_torch_exported_llama_keeps_torchs_names_shares_its_norm_weight_and_takes_no_gradient_into_rope():
    graph = from_onnx(str(MODELS / "llama.onnx"), dict(TP, parameters=FIXTURE_PLANS["llama"]))
    inputs = {n.name: n.attrs for n in graph.inputs()}
    assert inputs["model.layers.1.self_attn.q_proj.weight"]["placements"] == ("S(1)",)  # (in, out): out on tp
    assert inputs["model.layers.1.self_attn.o_proj.weight"]["placements"] == ("S(0)",)
    assert not any(name.startswith("val_") for name in inputs)  # every weight named as torch names it
    rope = [n for n in graph.nodes if n.op == "rotary_position_embedding"]
    tables = {t for n in rope for t in n.inputs[1:]}
    assert tables <= set(inputs) and all(inputs[t]["requires_grad"] is False for t in tables)
    notes = graph.meta["import_notes"]
    assert any("model.layers.0.input_layernorm.weight is one tensor the exporter de-duplicated" in n and
               "model.norm.weight" in n for n in notes)


def test_gpt2s_tied_head_keeps_its_name_and_its_transposed_copy_is_named_apart():
    graph = from_onnx(str(MODELS / "gpt2.onnx"), dict(TP, parameters={"lm_head.weight": "vocab", "*": "R"}))
    inputs = {n.name: n.attrs for n in graph.inputs()}
    assert inputs["lm_head.weight"]["placements"] == ("S(0)",)  # the embedding table, rows on tp
    assert inputs["lm_head.weight.T"]["shape"] == (64, 128) and inputs["lm_head.weight.T"]["requires_grad"]
    assert graph.meta["import_sources"]["lm_head.weight.T"] == "val_308"
    assert any(n.startswith("initializer val_308 is a copy of parameter lm_head.weight (transposed)")
               for n in graph.meta["import_notes"])


def test_inference_dropout_is_the_identity_and_training_dropout_the_registry_op():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inference = model_of([const("ratio", np.float32(0.1)), helper.make_node("Dropout", ["x", "ratio"], ["y"])],
                         [x], [y])
    feeds = {"x": np.random.default_rng(9).standard_normal((4, 6)).astype(np.float32)}
    graph = same_as_onnx(inference, feeds)
    assert [n.op for n in graph.nodes if not n.is_input] == ["identity"]
    training = model_of([const("ratio", np.float32(0.25)), const("mode", np.bool_(True)),
                         helper.make_node("Dropout", ["x", "ratio", "mode"], ["y"])], [x], [y])
    graph = from_onnx(training, PLAN1)
    (drop,) = [n for n in graph.nodes if not n.is_input]
    assert drop.op == "dropout" and drop.attrs["p"] == 0.25 and drop.attrs["training"] is True
    assert any("training dropout (p=0.25)" in note for note in graph.meta["import_notes"])


def test_t5s_relative_position_buckets_fold():
    """T5's bucket arithmetic on constant positions (Range, Sub, Abs, Sign, Log, Floor, Ceil, Min, Cast) folds."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [const("zero", np.array(0, np.int64)), const("four", np.array(4, np.int64)),
             const("one", np.array(1, np.int64)), const("axis", np.array([1], np.int64)),
             const("half", np.float32(0.5)), const("cap", np.float32(3.0)),
             helper.make_node("Range", ["zero", "four", "one"], ["pos"]),
             helper.make_node("Unsqueeze", ["pos", "axis"], ["col"]),
             helper.make_node("Sub", ["pos", "col"], ["rel"]),
             helper.make_node("Cast", ["rel"], ["relf"], to=TensorProto.FLOAT),
             helper.make_node("Abs", ["relf"], ["dist"]), helper.make_node("Sign", ["relf"], ["sign"]),
             helper.make_node("Add", ["dist", "half"], ["d1"]), helper.make_node("Log", ["d1"], ["lg"]),
             helper.make_node("Floor", ["lg"], ["fl"]), helper.make_node("Ceil", ["lg"], ["ce"]),
             helper.make_node("Add", ["fl", "ce"], ["b0"]), helper.make_node("Min", ["b0", "cap"], ["b1"]),
             helper.make_node("Mul", ["b1", "sign"], ["bias"]), helper.make_node("Add", ["x", "bias"], ["y"])]
    graph = same_as_onnx(model_of(nodes, [x], [y]), {"x": np.zeros((4, 4), np.float32)})
    assert [n.op for n in graph.nodes if not n.is_input] == ["add"]


def test_the_skeleton_suggests_colwise_fused_for_gpt2s_c_attn_and_runs(tmp_path, capsys):
    skeleton = tmp_path / "gpt2.yaml"
    assert main(["import", str(MODELS / "gpt2.onnx"), "-o", str(skeleton)]) == 0
    plan = yaml.safe_load(skeleton.read_text())["parameters"]
    assert plan["transformer.h.0.attn.c_attn.weight"] == "colwise_fused(3)"  # split into q, k, v after it
    assert plan["transformer.h.0.attn.c_proj.weight"] == "rowwise"
    assert plan["transformer.h.0.mlp.c_fc.weight"] == "colwise"
    assert plan["transformer.h.0.mlp.c_proj.weight"] == "rowwise"
    capsys.readouterr()
    assert main(["run", str(MODELS / "gpt2.onnx"), "--plan", str(skeleton), "--backward"]) == 0
    assert "matches one device" in capsys.readouterr().out



def test_the_skeleton_suggests_colwise_fused_for_phi3s_sliced_projections(tmp_path, capsys):
    """Phi-3 cuts qkv_proj's output into q, k and v (and gate_up_proj's into two) by Slices, not a Split: the
    skeleton suggests colwise_fused(3) and (2) (plain colwise would cut across the blocks and gather them), and the
    skeleton as written (its default mesh: tp=2) moves nothing but the row-parallel sums, forward and backward, and runs equal to one device."""
    skeleton = tmp_path / "phi3.yaml"
    assert main(["import", str(MODELS / "phi3.onnx"), "-o", str(skeleton)]) == 0
    written = yaml.safe_load(skeleton.read_text())
    plan = written["parameters"]
    for i in (0, 1):
        assert plan[f"model.layers.{i}.self_attn.qkv_proj.weight"] == "colwise_fused(3)"
        assert plan[f"model.layers.{i}.mlp.gate_up_proj.weight"] == "colwise_fused(2)"
        assert plan[f"model.layers.{i}.self_attn.o_proj.weight"] == "rowwise"
        assert plan[f"model.layers.{i}.mlp.down_proj.weight"] == "rowwise"
    assert written["mesh"] == {"shape": [2], "names": ["tp"]}  # the skeleton's default mesh, used as written
    capsys.readouterr()
    assert main(["check", str(MODELS / "phi3.onnx"), "--plan", str(skeleton), "--backward", "--reshard",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # plain colwise on the same weights: 10 all-gathers and 22 local slices of the q/k/v and gate/up pieces
    kinds = sorted({step["kind"] for move in report["redistributions"] for step in move["steps"]})
    assert kinds == ["all-reduce"], kinds  # only the row-parallel products' sums (and their gradients)
    assert main(["run", str(MODELS / "phi3.onnx"), "--plan", str(skeleton), "--backward"]) == 0
    assert "matches one device" in capsys.readouterr().out

# ----------------------------------------------------------------------------------- pins by module path
def test_a_pin_by_torchs_module_path_pins_each_layers_o_proj_output(tmp_path, capsys):
    """``model.layers.*.self_attn.o_proj`` in a plan's constraints pins the output of each layer's o_proj (the
    module path the dynamo exporter keeps in the node metadata): with --reshard the row-parallel sum is
    reduce-scattered into it, and the run matches one device forward and backward."""
    pinned = dict(TP, parameters=FIXTURE_PLANS["llama"], constraints={"model.layers.*.self_attn.o_proj": ["S(1)"]})
    graph = from_onnx(str(MODELS / "llama.onnx"), pinned)
    pins = [n for n in graph.nodes if n.op == "sharding_constraint"]
    producers = [graph.node(n.inputs[0]) for n in pins]
    assert [p.inputs[1] for p in producers] == [f"model.layers.{i}.self_attn.o_proj.weight" for i in (0, 1)]
    assert all(n.attrs["pattern"] == "model.layers.*.self_attn.o_proj" for n in pins)
    plan = plan_path(tmp_path, pinned)
    model = str(MODELS / "llama.onnx")
    assert main(["check", model, "--plan", str(plan), "--json"]) == 1
    unmet = [v for v in json.loads(capsys.readouterr().out)["violations"] if v["code"] == "constraint-unmet"]
    assert sorted(v["input"] for v in unmet) == sorted(p.name for p in producers)
    assert main(["check", model, "--plan", str(plan), "--reshard", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    moves = {r["node"]: [s["kind"] for s in r["steps"]] for r in report["redistributions"]}
    assert all(moves[n.name] == ["reduce-scatter"] for n in pins), moves
    assert all(report["tensors"][n.name]["placements"] == ["S(1)"] for n in pins)
    assert main(["run", model, "--plan", str(plan), "--backward"]) == 0
    assert "matches one device" in capsys.readouterr().out


def test_two_patterns_pinning_one_module_output_differently_are_exit_2(tmp_path, capsys):
    # self_attn returns its o_proj's output: both patterns name that value
    plan = plan_path(tmp_path, dict(TP, parameters=FIXTURE_PLANS["llama"], constraints={
        "model.layers.*.self_attn.o_proj": ["S(1)"], "model.layers.0.self_attn": ["R"]}))
    err = one_line_error(capsys, ["check", str(MODELS / "llama.onnx"), "--plan", str(plan)], "conflicting-constraints")
    assert "'model.layers.*.self_attn.o_proj'" in err and "'model.layers.0.self_attn'" in err
    plan = plan_path(tmp_path, dict(TP, constraints={"model.layers.7.self_attn": ["R"]}))
    err = one_line_error(capsys, ["check", str(MODELS / "llama.onnx"), "--plan", str(plan)], "unmatched-constraint")
    assert "no module's output" in err


# ------------------------------------------------------- every fixture on the command line, on its own weights
MEGATRON_PHI3 = {"*.self_attn.qkv_proj.weight": "colwise_fused(3)", "*.self_attn.o_proj.weight": "rowwise",
                 "*.mlp.gate_up_proj.weight": "colwise_fused(2)", "*.mlp.down_proj.weight": "rowwise", "*": "R"}
MEGATRON_GPT2 = {"*.attn.c_attn.weight": "colwise_fused(3)", "*.attn.c_proj.weight": "rowwise",
                 "*.mlp.c_fc.weight": "colwise", "*.mlp.c_proj.weight": "rowwise", "*": "R"}
#: FIXTURE_PLANS with Megatron's fused projections column-parallel, and the TorchScript exports' embedding
#: tables (the only weights that exporter names as torch does) cut by rows
CLI_PLANS = dict(FIXTURE_PLANS, phi3=MEGATRON_PHI3, gpt2=MEGATRON_GPT2,
                 bert_torchscript={"*.word_embeddings.weight": "vocab", "*": "R"},
                 t5_torchscript={"inner.shared.weight": "vocab", "*": "R"})
FIXTURES = ["llama", "qwen2", "mistral", "gemma", "phi3", "gpt2", "bert", "bert_torchscript", "t5_torchscript"]


def test_every_fixture_is_in_the_test():
    assert sorted(FIXTURES) == sorted(p.stem for p in MODELS.glob("*.npz"))


@pytest.mark.parametrize("name", FIXTURES)
def test_a_fixture_imports_checks_and_runs_on_the_command_line_as_torch_computed(name, tmp_path, capsys):
    """With a plan in torch's names: ``import``, ``check --reshard``, ``run --inputs --backward`` on the
    committed token ids and the model's own weights (matching one device forward and backward), and the
    sharded forward, assembled from the ranks, equal to the output torch computed (the committed .npz)."""
    from argparse import Namespace

    from layout_prop.commands.run import load_with_weights
    from layout_prop.engines.collectives import assemble
    from layout_prop.engines.simulator import Simulator
    from layout_prop.passes.lower import Lower
    from layout_prop.runner import check_given_inputs

    model = str(MODELS / f"{name}.onnx")
    reference = np.load(MODELS / f"{name}.npz")
    ids = {k: reference[k] for k in reference.files if k.endswith("input_ids")}
    (output,) = [k for k in reference.files if k not in ids]
    np.savez(tmp_path / "ids.npz", **ids)
    plan = plan_path(tmp_path, dict(TP, parameters=CLI_PLANS[name]))
    assert main(["import", model, "--plan", str(plan), "-o", str(tmp_path / "spec.yaml")]) == 0
    assert main(["check", model, "--plan", str(plan), "--reshard", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["violations"] == []
    sharded = [t for t, r in report["tensors"].items() if ".weight" in t and not t.startswith("grad")
               and r["placements"] != ["R"]]
    assert sharded, "the plan shards no weight"
    assert main(["run", model, "--plan", str(plan), "--inputs", str(tmp_path / "ids.npz"), "--backward",
                 "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert run["ok"] and run["grads"] and sorted(run["inputs"]["file"]) == sorted(ids), run["inputs"]
    assert run["inputs"]["random"] == [] and len(run["inputs"]["model"]) >= len(sharded)

    graph, weights, unread = load_with_weights(Namespace(spec=model, plan=str(plan), opaque=False))
    assert unread == []
    g = analyze(graph, reshard=True).graph
    value = g.outputs[0]  # the model's first output (BERT's last_hidden_state; its pooler output is second)
    inputs = check_given_inputs(g, {**weights, **ids})
    local = Simulator().execute(Lower().run(g).program, inputs, np.random.default_rng(0), wanted=[value])
    node, index = g.producer(value)
    got = assemble(local[value], node.meta["specs"][index])
    np.testing.assert_allclose(got, reference[output], rtol=1e-4, atol=1e-5)


def test_phi3s_fused_projections_stay_column_parallel_under_megatrons_plan(tmp_path, capsys):
    """Phi-3's qkv_proj (cut into q, k and v by Slices) and gate_up_proj: with colwise_fused(3) and (2) every
    block is cut column-wise, so the forward and the backward move no weight and gather nothing: the only
    communication is Megatron's all-reduce of the row-parallel sums (2 a layer forward, 2 backward).  The
    sharded run --backward of this plan is in the test above."""
    plan = plan_path(tmp_path, dict(TP, parameters=MEGATRON_PHI3))
    assert main(["check", str(MODELS / "phi3.onnx"), "--plan", str(plan), "--backward", "--reshard", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    tensors = report["tensors"]
    for layer in (0, 1):
        for weight, placement in (("self_attn.qkv_proj", "_S(1,3)"), ("mlp.gate_up_proj", "_S(1,2)")):
            name = f"model.layers.{layer}.{weight}.weight"
            assert tensors[name]["placements"] == tensors[f"grad:{name}"]["placements"] == [placement]
    steps = [(r["input"], s["kind"]) for r in report["redistributions"] for s in r["steps"]]
    assert [kind for _, kind in steps if kind not in ("local-partial",)] == ["all-reduce"] * 8, steps
    assert not [v for v, _ in steps if ".weight" in v]
    plan = plan_path(tmp_path, dict(TP, parameters=dict(MEGATRON_PHI3, **{
        "*.self_attn.qkv_proj.weight": "colwise", "*.mlp.gate_up_proj.weight": "colwise"})), "plain.yaml")
    assert main(["check", str(MODELS / "phi3.onnx"), "--plan", str(plan), "--reshard", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "all-gather" in {s["kind"] for r in plain["redistributions"] for s in r["steps"]}  # across the blocks
