"""An ONNX Mixture-of-Experts layer imports, checks and runs (issue #28, item 4).

The layer is ``examples/models/moe.onnx``, written by hand with ``onnx.helper``
(``examples/models/make_moe_onnx.py``: 16 tokens, hidden 16, 4 SwiGLU experts, top-2): router
MatMul, Softmax, TopK, renormalised weights, dispatch by OneHot, CumSum, GatherElements, Gather
and ScatterND, batched expert MatMuls, combine by GatherND and ScatterElements-add.  Its
imported graph is compared with onnx's ReferenceEvaluator on the model's own weights (one
device, and every rank of a sharded run assembled), and the reference with a per-token numpy
MoE written here."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from layout_prop.api import analyze  # noqa: E402
from layout_prop.cli import main  # noqa: E402
from layout_prop.core import meta  # noqa: E402
from layout_prop.engines.collectives import assemble  # noqa: E402
from layout_prop.engines.simulator import Simulator  # noqa: E402
from layout_prop.frontends.onnx import from_onnx, read_onnx  # noqa: E402
from layout_prop.passes.lower import Lower  # noqa: E402
from layout_prop.runner import execute_global, run_graph  # noqa: E402

MODELS = Path(__file__).resolve().parent.parent / "examples" / "models"
MOE = MODELS / "moe.onnx"
EXPERTS = "moe.experts.*"
#: expert parallelism: the stacked expert weights (E, ., .) cut along E on ep, the router replicated
EP = {"mesh": {"shape": [4], "names": ["ep"]}, "parameters": {EXPERTS: ["S(0)"], "*": "R"}}
#: data x expert parallelism: the tokens on dp, the experts on ep
DP_EP = {"mesh": {"shape": [2, 2], "names": ["dp", "ep"]}, "inputs": {"x": ["S(0)", "R"]},
         "parameters": {EXPERTS: ["R", "S(0)"], "*": "R"}}


@pytest.fixture(scope="module")
def model():
    return onnx.load(str(MOE))


def feeds(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((2, 8, 16)).astype(np.float32)}


def model_inputs(graph, model, given):
    """Every input of the imported graph: ``given`` and the model's own initializers and constants."""
    consts = {k: v.const for k, v in read_onnx(model).values.items() if v.const is not None}
    sources = graph.meta["import_sources"]
    return {n.name: given[n.name] if n.name in given else consts[sources[n.name]] for n in graph.inputs()}


def one_device(graph, model, given):
    a = analyze(graph)
    return execute_global(a.graph, model_inputs(a.graph, model, given), wanted=a.graph.outputs)


def sharded(graph, model, given):
    """The outputs of every rank's lowered program (resharded), assembled, fed the model's own data."""
    a = analyze(graph, reshard=True)
    assert a.ok, [v.message for v in a.check.violations]
    g = a.graph
    program = Lower().run(g).program
    local = Simulator().execute(program, model_inputs(g, model, given), np.random.default_rng(0),
                                wanted=list(g.outputs))
    out = {}
    for value in g.outputs:
        node, index = g.producer(value)
        out[value] = assemble(local[value], node.meta[meta.SPECS][index])
    return out


def numpy_moe(model, x: np.ndarray) -> np.ndarray:
    """The layer by its definition, one token and one choice at a time (not the ONNX graph's dispatch)."""
    w = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    tokens = x.reshape(-1, x.shape[-1]).astype(np.float64)
    logits = tokens @ w["moe.gate.weight"]
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    out = np.zeros_like(tokens)
    for t, row in enumerate(probs):
        chosen = sorted(range(len(row)), key=lambda e: -row[e])[:2]
        total = sum(row[e] for e in chosen)
        for e in chosen:
            gate, up = tokens[t] @ w["moe.experts.w1"][e], tokens[t] @ w["moe.experts.w3"][e]
            out[t] += row[e] / total * ((gate / (1 + np.exp(-gate)) * up) @ w["moe.experts.w2"][e])
    return out.reshape(x.shape)


def cli_error(capsys, argv, code="bad-model"):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and code in err, err
    return err


def plan_path(tmp_path, plan=EP):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


# ------------------------------------------------------------------------------ the fixture
def test_the_committed_file_is_what_the_generator_writes(model):
    sys.path.insert(0, str(MODELS))
    try:
        import make_moe_onnx
    finally:
        sys.path.remove(str(MODELS))
    assert make_moe_onnx.build().SerializeToString() == model.SerializeToString()
    assert MOE.stat().st_size < 64 * 1024
    assert {"TopK", "OneHot", "CumSum", "GatherElements", "Gather", "ScatterND", "GatherND",
            "ScatterElements"} <= {n.op_type for n in model.graph.node}


def test_the_onnx_reference_is_a_top2_moe(model):
    x = feeds(1)["x"]
    (want,) = ReferenceEvaluator(model).run(None, {"x": x})
    np.testing.assert_allclose(want, numpy_moe(model, x), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ the import
def test_the_layer_imports_into_registry_ops(model):
    graph = from_onnx(model, EP)
    ops = Counter(n.op for n in graph.nodes if not n.is_input)
    assert ops == {"reshape": 5, "matmul": 1, "softmax": 1, "topk": 1, "sum": 1, "div": 1, "one_hot": 1,
                   "cumsum": 1, "gather": 1, "concat": 1, "index_select": 1, "scatter_nd": 1,
                   "batch_matmul": 3, "silu_mul": 1, "gather_nd": 1, "mul": 1, "scatter_add": 1}
    topk = next(n for n in graph.nodes if n.op == "topk")
    assert topk.attrs == {"k": 2, "dim": 1, "largest": True, "sorted": True}
    assert next(n for n in graph.nodes if n.op == "scatter_add").attrs["dim"] == 0
    assert next(n for n in graph.nodes if n.op == "cumsum").attrs["exclusive"] is True


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_import_computes_what_the_onnx_reference_computes(model, seed):
    given = feeds(seed)
    (want,) = ReferenceEvaluator(model).run(None, given)
    (got,) = one_device(from_onnx(model, EP), model, given).values()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ check and run
def test_check_is_clean_with_the_experts_on_ep(model):
    a = analyze(from_onnx(model, EP), reshard=True)
    assert a.ok and not a.check.violations
    report = a.report()
    steps = [s["kind"] for r in report["redistributions"] for s in r["steps"]]
    assert set(steps) <= {"local-slice", "local-partial"}  # no bytes move in the forward
    tensors = report["tensors"]
    assert tensors["moe.experts.w1"]["placements"] == ["S(0)"]
    for expert_out in ("moe/experts/w1/MatMul", "moe/experts/Mul", "moe/experts/w2/MatMul"):
        assert tensors[expert_out]["placements"] == ["S(0)"] and tensors[expert_out]["local_shape"][0] == 1
    # the router and the dispatch run whole on every rank; the combine adds each rank's experts' share
    assert tensors["moe/TopK:1"]["placements"] == ["R"] and tensors["moe/dispatch"]["placements"] == ["R"]
    assert tensors["moe/GatherND"]["placements"] == ["P(sum)"]
    assert tensors["moe/unflatten"]["placements"] == ["P(sum)"]


def test_tokens_on_dp_need_the_routing_whole_there(model):
    """The dispatch counts positions over all tokens (CumSum) and writes every pair (ScatterND, no add): with
    the tokens on dp, those two need their operands whole on dp, and the expert inputs arrive P(sum) there."""
    graph = from_onnx(model, DP_EP)
    codes = Counter((v.code, v.node) for v in analyze(graph).check.violations)
    assert codes == {("sharded-order-dim", "moe/CumSum"): 1, ("sharding-mismatch", "moe/dispatch"): 1,
                     ("partial-input", "moe/experts/Mul"): 2}
    assert analyze(from_onnx(model, DP_EP), reshard=True).ok


@pytest.mark.parametrize("plan", [EP, DP_EP], ids=["ep4", "dp2xep2"])
def test_run_backward_matches_one_device(model, plan):
    rep = run_graph(from_onnx(model, plan), backward=True, seed=5)
    assert rep.ok, rep.mismatches
    assert {"x", "moe.gate.weight", "moe.experts.w1", "moe.experts.w2", "moe.experts.w3"} <= set(rep.grads)


@pytest.mark.parametrize("plan", [EP, DP_EP], ids=["ep4", "dp2xep2"])
def test_the_sharded_run_on_the_models_own_data_computes_the_onnx_reference(model, plan):
    """``run`` feeds every input random values (the index tables too); here every rank runs on the model's own
    weights and constants, and the assembled output is the reference's."""
    given = feeds(4)
    (want,) = ReferenceEvaluator(model).run(None, given)
    (got,) = sharded(from_onnx(model, plan), model, given).values()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_check_and_run_from_the_command_line(tmp_path, capsys):
    plan = str(plan_path(tmp_path))
    assert main(["check", str(MOE), "--plan", plan]) == 0
    assert "no violations" in capsys.readouterr().out
    assert main(["run", str(MOE), "--plan", plan, "--backward"]) == 0
    assert "matches one device" in capsys.readouterr().out


# ------------------------------------------------------------------------------ the mappings alone
def small_model(nodes, inputs, outputs, opset=18):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def const(name, array):
    return helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(np.asarray(array)))


def test_topk_and_scatter_elements_forms_compute_what_onnx_computes():
    """TopK smallest along axis 0 with its indices used; ScatterElements reduction none with a constant index
    holding negative entries (taken into [0, s)), and reduction add of run-time indices along axis 1."""
    f = TensorProto.FLOAT
    x = helper.make_tensor_value_info("x", f, [5, 3])
    idx = helper.make_tensor_value_info("idx", TensorProto.INT64, [5, 2])
    outs = [helper.make_tensor_value_info(n, f, None) for n in ("vals", "written", "added")] + \
        [helper.make_tensor_value_info("where", TensorProto.INT64, None)]
    nodes = [const("k", np.array([2], np.int64)),
             const("rows", np.array([[-1, 0, 2], [3, -4, 1]], np.int64)),
             helper.make_node("TopK", ["x", "k"], ["vals", "where"], axis=0, largest=0),
             helper.make_node("ScatterElements", ["x", "rows", "vals"], ["written"], axis=0),
             helper.make_node("Slice", ["x", "zero", "two", "one_axis"], ["src"]),
             helper.make_node("ScatterElements", ["x", "idx", "src"], ["added"], axis=1, reduction="add")]
    nodes[1:1] = [const("zero", np.array([0], np.int64)), const("two", np.array([2], np.int64)),
                  const("one_axis", np.array([1], np.int64))]
    m = small_model(nodes, [x, idx], outs)
    given = {"x": np.random.default_rng(6).standard_normal((5, 3)).astype(np.float32),
             "idx": np.array([[0, 2], [1, 1], [2, 0], [0, 0], [1, 2]])}
    want = ReferenceEvaluator(m).run(None, given)  # vals, written, added, where
    plan = {"mesh": {"shape": [2], "names": ["tp"]}}
    graph = from_onnx(m, plan)
    ops = Counter(n.op for n in graph.nodes if not n.is_input)
    assert ops["topk"] == 1 and ops["scatter"] == 1 and ops["scatter_add"] == 1
    got = list(one_device(graph, m, given).values())
    assert len(got) == len(want) == 4
    for g_, w in zip(got, want):
        np.testing.assert_allclose(g_, w, rtol=1e-6)
    rows = next(n for n in graph.inputs() if n.name.startswith("rows"))
    assert rows.name == "rows_wrapped"
    assert any("(ScatterElements) is torch's: its run-time indices must lie in [0, 3)" in note
               for note in graph.meta["import_notes"])


def test_scatter_elements_mul_stays_unmapped_and_a_run_time_k_is_a_dynamic_shape(capsys, tmp_path):
    f = TensorProto.FLOAT
    x = helper.make_tensor_value_info("x", f, [4, 3])
    idx = helper.make_tensor_value_info("idx", TensorProto.INT64, [4, 3])
    m = small_model([helper.make_node("ScatterElements", ["x", "idx", "x"], ["prod"], reduction="mul")],
                    [x, idx], [helper.make_tensor_value_info("prod", f, None)])
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    plan = str(plan_path(tmp_path, {"mesh": {"shape": [2], "names": ["tp"]}}))
    assert "ScatterElements (x1" in cli_error(capsys, ["check", str(path), "--plan", plan], "unknown-op")
    k = helper.make_tensor_value_info("k", TensorProto.INT64, [1])
    m = small_model([helper.make_node("TopK", ["x", "k"], ["vals", "where"])], [x, k],
                    [helper.make_tensor_value_info("vals", f, None)])
    onnx.save(m, str(path))
    assert "node 'vals' (TopK) computes it from values only known at run time" in \
        cli_error(capsys, ["check", str(path), "--plan", plan], "dynamic-shape")


# ------------------------------------------------------------------------------ bad input
def with_constant(model, name, change):
    """A copy of ``model`` whose Constant ``name`` holds ``change(its value)``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    node = next(n for n in out.graph.node if n.op_type == "Constant" and n.output[0] == name)
    value = change(numpy_helper.to_array(node.attribute[0].t).copy())
    node.attribute[0].t.CopyFrom(numpy_helper.from_array(value, name))
    return out


def _set(index, value):
    def change(array):
        array[index] = value
        return array
    return change


@pytest.mark.parametrize("name, change, named", [
    ("k", lambda a: np.array([5], np.int64), "Axis has less than the requested k elements"),  # onnx's shape inference
    ("k", lambda a: np.array([-1], np.int64), "(TopK) has K=-1, out of range for dim 1 of 'router_probs' (size 4)"),
    ("token_rows", _set((3, 2), 16), "(ScatterElements) has index 16, out of range for dim 0 of 'empty_tokens' "
     "(size 16)"),
    ("token_rows", _set((0, 0), -17), "has index -17, out of range"),
], ids=["k-larger-than-dim", "k-negative", "scatter-index-too-large", "scatter-index-too-small"])
def test_bad_constants_are_one_line_bad_model(model, tmp_path, capsys, name, change, named):
    path = tmp_path / "bad.onnx"
    onnx.save(with_constant(model, name, change), str(path))
    err = cli_error(capsys, ["check", str(path), "--plan", str(plan_path(tmp_path))])
    assert named in err


def test_a_negative_constant_scatter_index_is_the_row_it_names(model):
    bad = with_constant(model, "token_rows", _set((5, 4), 2 - 16))  # pair 5 is token 2's second choice: row -14
    given = feeds(7)
    (want,) = ReferenceEvaluator(bad).run(None, given)
    (got,) = one_device(from_onnx(bad, EP), bad, given).values()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
