"""Real models in through ONNX (issue #29, the import parts): torch's module names kept, constant
chains folded, more op types mapped, computed tables imported as constants, and ``import`` without
a plan.  The models are small hand-written ONNX graphs laid out as torch's exporters write them
(the dynamo exporter's node metadata included), each checked against onnx's ReferenceEvaluator."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from layout_prop.api import analyze  # noqa: E402
from layout_prop.cli import main  # noqa: E402
from layout_prop.frontends.ir import sanitize  # noqa: E402
from layout_prop.frontends.onnx import from_onnx  # noqa: E402
from layout_prop.runner import execute_global  # noqa: E402

PLAN1 = {"mesh": {"shape": [2], "names": ["tp"]}}


def const(name, array):
    return helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(np.asarray(array)))


def model_of(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def one_device(graph, model, feeds):
    """The imported graph's outputs on one device, fed the model's own initializers and ``feeds``."""
    inits = {sanitize(t.name): numpy_helper.to_array(t) for t in model.graph.initializer}
    a = analyze(graph)
    inputs = {n.name: feeds[n.name] if n.name in feeds else inits[n.name] for n in a.graph.inputs()}
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
